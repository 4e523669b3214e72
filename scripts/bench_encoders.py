"""Encoder speed and memory: the original (SDPA) beside each conversion, in one process.

Random weights in bf16, forward only (no grad), batch 8, for the BERT-base shape (absolute
positions extended to the longest n) and the ModernBERT-base shape (RoPE, every third layer global,
the others a 128-token window), at n = 512, 2K, 4K, 8K. Conversions: Linformer (k=256, E and F
of n columns; shorter inputs use the first columns) and non-causal hedgehog linear attention.
Time is the median of CUDA-event timings after warm-up; memory is the peak allocated during the
forward above what the weights hold. Targets at 4K and above: at least 2x faster and at most half
the peak memory of SDPA. Writes docs/reports/encoders.md (+ .json) and prints the table; the
hand-written docs/reports/encoders.md quotes the runs it keeps (this script never rewrites it).

    python scripts/bench_encoders.py                   # GPU, about 3 minutes on one H100
    python scripts/bench_encoders.py --shapes bert-base --lengths 4096,8192
    python scripts/bench_encoders.py --shapes bert-base --lengths 4096,8192 --compile   # all compiled
    python scripts/bench_encoders.py --smoke --out /tmp/b.md   # tiny shapes on CPU (CI)
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import transformers

import linearize
from benchlib import REPORTS, write_section
from linearize.config import EncoderLinearAttentionConfig, LinformerConfig

ROOT = Path(__file__).resolve().parents[1]

SHAPES = {
    "bert-base": lambda n: transformers.BertConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                                   intermediate_size=3072, max_position_embeddings=n),
    "modernbert-base": lambda n: transformers.ModernBertConfig(
        hidden_size=768, num_hidden_layers=22, num_attention_heads=12, intermediate_size=1152, max_position_embeddings=n,
        local_attention=128, global_attn_every_n_layers=3, vocab_size=50368, pad_token_id=50283),
    # --smoke
    "tiny-bert": lambda n: transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                   intermediate_size=64, vocab_size=100, max_position_embeddings=n),
    "tiny-modernbert": lambda n: transformers.ModernBertConfig(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64, max_position_embeddings=n,
        local_attention=16, global_attn_every_n_layers=3, vocab_size=100, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, cls_token_id=1, sep_token_id=2),
}


def build(shape: str, n_max: int, dtype, device):
    config = SHAPES[shape](n_max)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config).to(device=device, dtype=dtype).eval()
    return model


class _WithConfig(torch.nn.Module):
    """Runs ``model`` with the bidirectional kernels' CONFIG changed for the call (the op reads it at
    each call, compiled or not): a launch setting beside the committed one, in one process."""

    def __init__(self, model, **config):
        super().__init__()
        self.model, self.config = model, config

    def forward(self, *args, **kwargs):
        from linearize.kernels.linear_attn import bidirectional

        before = dict(bidirectional.CONFIG)
        bidirectional.CONFIG.update(self.config)
        try:
            return self.model(*args, **kwargs)
        finally:
            bidirectional.CONFIG.clear()
            bidirectional.CONFIG.update(before)


def variants(original, n_max: int, k: int, feature_map: str, compile_: bool = False, kv_warps=()):
    models = [("sdpa", original),
              (f"linformer k={k}", linearize.linearize(copy.deepcopy(original), LinformerConfig(k=k, max_length=n_max))),
              (f"linear {feature_map}",
               linearize.linearize(copy.deepcopy(original), EncoderLinearAttentionConfig(feature_map=feature_map))),
              (NO_ATTENTION, without_attention(original))]
    models.insert(3, (PROJECTIONS_ONLY, projections_only(models[1][1])))
    if feature_map == "hedgehog":  # the same layers on the PyTorch math, as before the fused kernels
        models.insert(3, (f"linear {feature_map} (PyTorch math)", pytorch_math(models[2][1])))
    if compile_:  # the strongest SDPA a user can pick is the faster of the two (compiled BERT fell to
        yield "sdpa", original  # a materialised attention matrix on an H100, 2026-11-25: 8x slower)
    for name, model in models:
        yield (f"{name}, compiled", torch.compile(model, dynamic=False)) if compile_ else (name, model)
        if name == f"linear {feature_map}" and feature_map == "hedgehog":
            for w in kv_warps:  # the same layers, the keys' pass launched at w warps
                tag = f"{name}, keys' pass at {w} warps"
                yield ((f"{tag}, compiled", _WithConfig(torch.compile(model, dynamic=False), kv_warps=w)) if compile_
                       else (tag, _WithConfig(model, kv_warps=w)))


def against_best_sdpa(rows: list[dict]) -> None:
    """Speedup and memory ratio of each row of one (shape, n) against SDPA's best row: the fastest
    time and the smallest peak of the SDPA variants (eager and, with --compile, compiled)."""
    sdpa = [r for r in rows if r["variant"].startswith("sdpa") and r["ms"] == r["ms"]]  # not NaN (OOM)
    ms = min((r["ms"] for r in sdpa), default=float("nan"))
    mib = min((r["peak_mib"] for r in sdpa), default=float("nan"))
    for r in rows:
        r["speedup"] = ms / r["ms"]
        r["memory_ratio"] = r["peak_mib"] / mib if mib else float("nan")


NO_ATTENTION = "no attention (floor)"
PROJECTIONS_ONLY = "projections only (floor)"


def _projections_only_forward(self, hidden_states, position_embeddings=None, attention_mask=None, *_, **__):
    q, k, v = self.project(hidden_states, position_embeddings)
    return self.finish(q + k + v, hidden_states.dtype), None  # the sum keeps q and k from being optimised away


def projections_only(converted):
    """A copy of a converted model whose layers compute what every conversion computes around its
    attention: q, k, v (RoPE included), then o = q + k + v (one elementwise pass, less than any
    attention) through the output projection when the layer owns it. ``sdpa ms / this ms`` is the
    most any conversion can gain; the no-attention floor leaves the q/k/v projections out too."""
    import types

    from linearize.encoders import EncoderAttention

    model = copy.deepcopy(converted)
    for m in model.modules():
        if isinstance(m, EncoderAttention):
            m._linear_forward = types.MethodType(_projections_only_forward, m)
    return model


def pytorch_math(converted):
    """A copy of a Hedgehog-converted model whose layers run the PyTorch math in inference too
    (``_fast_features`` off), the path before ``kernels/linear_attn/bidirectional.py``."""
    from linearize.encoders import EncoderLinearAttention

    model = copy.deepcopy(converted)
    for m in model.modules():
        if isinstance(m, EncoderLinearAttention):
            m._fast_features = lambda q: False
    return model


class _Skip(torch.nn.Module):
    """Stands in for a self-attention module: its input passes through, so the layer's other parts
    (output dense and norm, feed-forward, embeddings) run as in every variant."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states, None


def without_attention(original):
    """A copy of ``original`` whose self-attention modules (projections included) do nothing: the
    time every variant shares. ``sdpa ms / this ms`` is the most any conversion can gain."""
    from linearize.arch import get_arch

    model = copy.deepcopy(original)
    spec = get_arch(model.config.model_type)
    for layer in model.get_submodule(spec.layers):
        parent, _, name = spec.attention.rpartition(".")
        setattr(layer.get_submodule(parent) if parent else layer, name, _Skip())
    return model


def measure(model, ids, iters: int, warmup: int) -> tuple[float, float]:
    """(median ms, peak MiB above the memory held before the forward)."""
    cuda = ids.is_cuda
    with torch.no_grad():
        for _ in range(warmup):
            model(input_ids=ids)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        times = []
        for _ in range(iters):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                model(input_ids=ids)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                model(input_ids=ids)
                times.append(1e3 * (time.perf_counter() - t0))
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else float("nan")
    return statistics.median(times), peak


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="bert-base,modernbert-base")
    p.add_argument("--lengths", default="512,2048,4096,8192")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--k", type=int, default=256, help="Linformer projection length")
    p.add_argument("--feature-map", default="hedgehog")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=str(REPORTS / "encoders.md"))
    p.add_argument("--compile", action="store_true",
                   help="every variant (SDPA included) under torch.compile(dynamic=False), compiled once per length")
    p.add_argument("--kv-warps", default="", metavar="W[,W]",
                   help="also run the Hedgehog conversion with its keys' pass launched at these warps "
                        "(bidirectional.CONFIG['kv_warps'], 4 committed)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, one iteration (CI)")
    args = p.parse_args(argv)
    if args.smoke:
        args.shapes, args.lengths, args.batch, args.k, args.iters, args.warmup = "tiny-bert,tiny-modernbert", "32,64", 2, 8, 1, 0
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = []

    def write():  # after every (shape, n): a call stopped by its time limit keeps the rows so far
        dev = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
        lines = ["# Encoders: forward speed and memory (original SDPA vs conversions)", "",
                 f"{dev}, torch {torch.__version__}, transformers {transformers.__version__}, {str(dtype).removeprefix('torch.')}, "
                 f"random weights, batch {args.batch}, forward without grad, median of {args.iters} after {args.warmup} warm-up. "
                 "Peak = memory allocated during the forward above what was held before it. Targets at n >= 4096: "
                 "speedup >= 2x and peak <= 0.5x of SDPA. *" + NO_ATTENTION + "*: the same model with its self-attention "
                 "modules (projections included) passing their input through. *" + PROJECTIONS_ONLY + "*: the "
                 "converted layers computing only their q, k, v projections (RoPE included) and the output "
                 "projection of q + k + v: what every conversion computes besides its attention, so its speedup is "
                 "the most any conversion can reach at that length."
                 + (" Every variant runs under `torch.compile(dynamic=False)`, compiled before the timed runs, and SDPA "
                    "eagerly too: *vs SDPA* is against SDPA's best (the faster time and the smaller peak of the two)."
                    if args.compile else ""), "",
                 "Command: `python scripts/bench_encoders.py " + " ".join(argv if argv is not None else __import__("sys").argv[1:]) + "`", "",
                 "| shape | n | variant | ms | speedup vs SDPA | peak MiB | peak vs SDPA | target |",
                 "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            target = "" if r["variant"].startswith(("sdpa", NO_ATTENTION, PROJECTIONS_ONLY)) or r["n"] < 4096 else (
                "met" if r["speedup"] >= 2 and r["memory_ratio"] <= 0.5 else "missed")
            lines.append(f"| {r['shape']} | {r['n']} | {r['variant']} | {r['ms']:.2f} | {r['speedup']:.2f}x | "
                         f"{r['peak_mib']:.0f} | {r['memory_ratio']:.2f}x | {target} |")
        text = "\n".join(lines) + "\n"
        out = write_section(args.out, "bench_encoders", text)
        (out.parent / "data").mkdir(exist_ok=True)
        (out.parent / "data" / "bench_encoders.json").write_text(json.dumps(rows, indent=2))
        return text

    for shape in args.shapes.split(","):
        original = build(shape, max(lengths), dtype, device)
        models = list(variants(original, max(lengths), args.k, args.feature_map, args.compile,
                               [int(w) for w in args.kv_warps.split(",") if w]))
        for n in lengths:
            ids = torch.randint(5, original.config.vocab_size, (args.batch, n), device=device,
                                generator=torch.Generator(device).manual_seed(n))
            at_n = []
            for name, model in models:
                try:
                    ms, mib = measure(model, ids, args.iters, args.warmup)
                except torch.cuda.OutOfMemoryError:
                    torch.cuda.empty_cache()
                    ms, mib = float("nan"), float("nan")
                at_n.append({"shape": shape, "n": n, "variant": name, "ms": ms, "peak_mib": mib})
                print(json.dumps(at_n[-1]), flush=True)
            against_best_sdpa(at_n)
            rows += at_n
            write()
        del original, models
        if device == "cuda":
            torch.cuda.empty_cache()

    text = write()
    print(text)
    return rows


if __name__ == "__main__":
    main()
