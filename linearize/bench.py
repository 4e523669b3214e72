"""End-to-end benchmark: an original Hugging Face Llama beside its converted twin, in one process.

For each model shape (random weights, bf16, sdpa) the original ``LlamaForCausalLM`` and the same
model converted by ``linearize.linearize`` (sharing every original weight) are measured side by
side on the same GPU:

  prefill  tokens/s and peak memory for T x B; the original with a DynamicCache, the converted model
           with its own cache in one call and in chunks of ``--prefill-chunk`` tokens (its state
           carries over, so peak memory follows a chunk's activations, not T);
  decode   ms/step, tokens/s and peak memory at context T for batch B: original eager
           (DynamicCache) and StaticCache + CUDA graph (``linearize.graphs.DecodeGraph``);
           converted eager (LinearizeCache) and StaticLinearizeCache + CUDA graph;
  check    16 greedy tokens from each graph equal eager decoding with the same prefill (a failed
           check stops that model's graph rows), chunked == one-shot prefill of the converted
           model, and generate(cache_implementation="static") == generate() on the converted model.

Results go to a JSON file written after every point; points already there are skipped, so a run
can be split over several calls. ``--write-docs`` renders the "End-to-end" section of
docs/benchmarks.md (between ``<!-- e2e:start -->`` and ``<!-- e2e:end -->``) and a PNG.

    python scripts/bench_e2e.py                                  # everything, on a GPU
    python scripts/bench_e2e.py --shapes llama-3.2-1b --parts decode --contexts 4K,64K
    python scripts/bench_e2e.py --smoke --json /tmp/e2e.json     # tiny model, CPU, every path but graphs
    python scripts/bench_e2e.py --write-docs                     # render from the JSON only (no CUDA)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib
import importlib.util
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

from .loading import UserError

REPO = Path(__file__).resolve().parents[1]
DEFAULT_JSON = REPO / "docs" / "bench_e2e.json"
DEFAULT_DOCS = REPO / "docs" / "benchmarks.md"
MARK_START, MARK_END = "<!-- e2e:start -->", "<!-- e2e:end -->"
PARTS = ("check", "prefill", "decode", "generate")
GiB = 2**30

# Llama shapes (random weights: decode and prefill speed do not depend on the values)
SHAPES: dict[str, dict] = {
    "smollm2-135m": {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152,
                     "tie_word_embeddings": True, "rope_theta": 100000.0},
    "llama-3.2-1b": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 8192, "vocab_size": 128256,
                     "tie_word_embeddings": True, "rope_theta": 500000.0},
    # --smoke: small enough for two CPU cores, large enough to exercise GQA and tied embeddings
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "intermediate_size": 128, "vocab_size": 512, "tie_word_embeddings": True,
             "rope_theta": 10000.0},
}
FULL = {"shapes": "smollm2-135m,llama-3.2-1b", "contexts": "4K,16K,32K,64K,128K", "prefill_batches": "1,8",
        "decode_batches": "1,8,64", "steps": 32, "prefill_chunk": 8192, "check_prompt": 96}
SMOKE = {"shapes": "tiny", "contexts": "64,128", "prefill_batches": "1,2", "decode_batches": "1,2", "steps": 4,
         "prefill_chunk": 32, "check_prompt": 24}
CHECK_TOKENS = 16
DECODE_WARMUP = 4
CACHE_MARGIN = 16  # static KV slots beyond T + warm-up + timed steps

# targets of the issue, at these points
TARGET_DECODE_T, TARGET_DECODE_B = 65536, 8
TARGET_PREFILL_SMALL, TARGET_PREFILL_T = 4096, 65536
TARGET_MEMORY_T, TARGET_MEMORY_B = 131072, 8


# ----------------------------------------------------------------------------- flags


def _positive_int(text: str) -> int:
    t = text.strip()
    mult = 1
    if t[-1:] in ("k", "K"):
        t, mult = t[:-1], 1024
    try:
        value = int(t) * mult
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer (write e.g. 4096 or 4K)")
    return value


def int_list(text: str) -> list[int]:
    """'4K,16K,65536' -> [4096, 16384, 65536] (sorted, unique)."""
    items = [x for x in text.split(",") if x.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list of positive integers, got nothing")
    return sorted({_positive_int(x) for x in items})


def shape_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in SHAPES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown shape {', '.join(map(repr, bad)) or '(none)'}; known: {', '.join(SHAPES)}")
    return list(dict.fromkeys(names))


def part_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if names == ["none"]:
        return []
    bad = [n for n in names if n not in PARTS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown part {', '.join(map(repr, bad)) or '(none)'}; "
                                         f"choose from {','.join(PARTS)} (comma-separated) or 'none'")
    return [p for p in PARTS if p in names]


def decode_prefill_arg(text: str) -> int | None:
    return None if text == "full" else _positive_int(text)


def compile_at_arg(text: str) -> tuple[int, int]:
    try:
        t, b = text.split(":")
        return _positive_int(t), _positive_int(b)
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"{text!r} is not CONTEXT:BATCH (e.g. 64K:8)") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The bench flags (shared by ``scripts/bench_e2e.py`` and ``linearize bench``)."""
    what = p.add_argument_group("what to run (defaults: the full GPU run; --smoke changes them)")
    what.add_argument("--shapes", type=shape_list, default=None, help=f"model shapes, of: {', '.join(SHAPES)} "
                      f"(default {FULL['shapes']})")
    what.add_argument("--contexts", type=int_list, default=None, metavar="T,..",
                      help=f"context lengths, e.g. 4K,16K (default {FULL['contexts']})")
    what.add_argument("--prefill-batches", type=int_list, default=None, metavar="B,..",
                      help=f"prefill batch sizes (default {FULL['prefill_batches']})")
    what.add_argument("--decode-batches", type=int_list, default=None, metavar="B,..",
                      help=f"decode batch sizes (default {FULL['decode_batches']})")
    what.add_argument("--parts", type=part_list, default=list(PARTS), metavar="P,..",
                      help="any of check (graph == eager, chunked == one-shot prefill), prefill, decode, generate "
                           "(generate(cache_implementation='static') == generate(): compiles on CUDA, about a minute "
                           "per shape), or none (default: all)")
    what.add_argument("--steps", type=_positive_int, default=None, help=f"decode steps timed per point (default {FULL['steps']})")
    what.add_argument("--prefill-chunk", type=_positive_int, default=None, metavar="N",
                      help=f"chunk length of the converted model's chunked prefill (default {FULL['prefill_chunk']})")
    what.add_argument("--decode-prefill", type=decode_prefill_arg, default=1024, metavar="P|full",
                      help="the converted model's state before decode at context T comes from a real prefill of "
                           "min(T, P) tokens, then positions continue from T ('full': all T tokens) (default 1024)")
    what.add_argument("--compile", action="store_true",
                      help="also time the original with torch.compile(mode='reduce-overhead') + StaticCache at --compile-at")
    what.add_argument("--compile-at", type=compile_at_arg, default=(TARGET_DECODE_T, TARGET_DECODE_B), metavar="T:B",
                      help="context:batch of the --compile point (default 64K:8)")
    conv = p.add_argument_group("the conversion")
    conv.add_argument("--method", choices=["linear_attention", "gdn"], default="linear_attention")
    conv.add_argument("--feature-map", default="hedgehog", help="for --method linear_attention (default hedgehog)")
    conv.add_argument("--window", type=int, default=0, help="softmax window of the LoLCATs hybrid (default 0: none)")
    run = p.add_argument_group("where")
    run.add_argument("--device", default=None, help="cuda (default) or cpu (only with --smoke)")
    run.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                     help="default bfloat16 on CUDA, float32 on CPU")
    run.add_argument("--smoke", action="store_true",
                     help="tiny shape, contexts 64,128, batches 1,2, 4 steps: every code path in seconds "
                          "(CPU: no CUDA graphs, the static caches step eagerly); default files in a temp folder")
    run.add_argument("--json", default=None, help=f"results file, read and extended (default {_rel(DEFAULT_JSON)})")
    run.add_argument("--docs", default=None, help=f"markdown file whose End-to-end section --write-docs renders "
                     f"(default {_rel(DEFAULT_DOCS)}); the PNG goes beside it")
    run.add_argument("--write-docs", action="store_true",
                     help="render the docs section (and the PNG, if matplotlib is installed) from the JSON; "
                          "without CUDA (and without --smoke) it only renders")
    run.add_argument("--retry-errors", action="store_true", help="run again the points recorded as errors")
    run.add_argument("--seed", type=int, default=0)


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


def resolve(args) -> argparse.Namespace:
    """Fill the defaults that depend on --smoke and the device; check what argparse cannot."""
    base = SMOKE if args.smoke else FULL
    for name in ("shapes", "contexts", "prefill_batches", "decode_batches"):
        if getattr(args, name) is None:
            parse = shape_list if name == "shapes" else int_list
            setattr(args, name, parse(base[name]))
    args.steps = args.steps or base["steps"]
    args.prefill_chunk = args.prefill_chunk or base["prefill_chunk"]
    args.check_prompt = base["check_prompt"]
    if args.method == "gdn" and (args.window or args.feature_map != "hedgehog"):
        raise UserError("--window and --feature-map belong to --method linear_attention, not gdn")
    try:
        method_config(args)
    except ValueError as err:
        raise UserError(str(err)) from None
    if args.smoke:
        tmp = Path(tempfile.gettempdir()) / "linearize_bench_smoke"
        args.json = args.json or str(tmp / "bench_e2e.json")
        args.docs = args.docs or str(tmp / "benchmarks.md")
    args.json = Path(args.json or DEFAULT_JSON)
    args.docs = Path(args.docs or DEFAULT_DOCS)

    import torch

    cuda = torch.cuda.is_available()
    args.device = args.device or ("cuda" if cuda else "cpu")
    if not args.device.startswith(("cuda", "cpu")):
        raise UserError(f"--device must be cuda[:N] or cpu, got {args.device!r}")
    args.render_only = not args.parts
    if not args.render_only and args.device.startswith("cuda") and not cuda:
        if args.smoke:
            raise UserError("no CUDA device: run the smoke test on CPU (--device cpu, the default here)")
        if not args.write_docs:
            raise UserError("no CUDA device: run with --smoke (tiny model on CPU), or --write-docs to render the "
                            "docs from the JSON")
        args.render_only = True  # a CPU machine rendering a GPU run's JSON
    if not args.render_only and args.device == "cpu" and not args.smoke:
        if not args.write_docs:
            raise UserError("the full benchmark needs a GPU; on CPU use --smoke (or --write-docs to render only)")
        args.render_only = True
    if args.compile and not args.device.startswith("cuda") and not args.render_only:
        raise UserError("--compile times torch.compile(mode='reduce-overhead'), which captures CUDA graphs: it needs CUDA")
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    return args


# ----------------------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class Point:
    part: str  # prefill | decode | check
    shape: str
    model: str  # "original", or the conversion's label (e.g. "hedgehog")
    variant: str
    T: int = 0
    B: int = 0

    @property
    def key(self) -> str:
        tail = f"/T={self.T}/B={self.B}" if self.part != "check" else ""
        return f"{self.part}/{self.shape}/{self.model}/{self.variant}{tail}"

    @property
    def converted(self) -> bool:
        return self.model != "original"


def method_config(args):
    """The conversion as a linearize method config (validated)."""
    import linearize

    if args.method == "gdn":
        return linearize.GatedDeltaNetConfig()
    return linearize.LinearAttentionConfig(feature_map=args.feature_map, window=args.window)


def method_label(args) -> str:
    if args.method == "gdn":
        return "gdn"
    return args.feature_map + (f"-w{args.window}" if args.window else "")


def plan(args) -> list[Point]:
    label = method_label(args)
    pts: list[Point] = []
    for shape in args.shapes:
        if "check" in args.parts:
            pts += [Point("check", shape, "original", "graph-vs-eager"), Point("check", shape, label, "graph-vs-eager"),
                    Point("check", shape, label, "chunked-prefill")]
        if "prefill" in args.parts:
            for T in args.contexts:
                for B in args.prefill_batches:
                    pts += [Point("prefill", shape, "original", "dynamic", T, B), Point("prefill", shape, label, "cache", T, B)]
                    if T > args.prefill_chunk:
                        pts.append(Point("prefill", shape, label, f"chunk{args.prefill_chunk}", T, B))
        if "decode" in args.parts:
            for T in args.contexts:
                for B in args.decode_batches:
                    pts += [Point("decode", shape, "original", "eager-dynamic", T, B),
                            Point("decode", shape, "original", "graph-static", T, B),
                            Point("decode", shape, label, "eager-default", T, B),
                            Point("decode", shape, label, "graph-static", T, B)]
                    if args.compile and (T, B) == tuple(args.compile_at):
                        pts.append(Point("decode", shape, "original", "compiled-static", T, B))
            if args.compile and tuple(args.compile_at) not in {(T, B) for T in args.contexts for B in args.decode_batches}:
                T, B = args.compile_at
                pts.append(Point("decode", shape, "original", "compiled-static", T, B))
        if "generate" in args.parts:
            pts.append(Point("check", shape, label, "generate-static"))
    return pts


def rough_seconds(p: Point, shape: dict, args) -> float:
    """A guess of a point's wall time on an H100/H200, to split runs (a fixed cost model)."""
    H, L, V = shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"]
    params = L * (4 * H * H + 3 * H * shape["intermediate_size"])  # about: q/o full, k/v smaller, MLP
    kv_bytes = 2 * L * shape["num_key_value_heads"] * shape["head_dim"] * 2 * p.T * p.B
    flops_s, bw = 3e14, 3e12
    if p.part == "check":
        return 90.0 if p.variant == "generate-static" else 5.0
    if p.part == "prefill":
        tokens = p.T * p.B
        flops = 2 * params * tokens
        if not p.converted:
            flops += 2 * L * H * p.T * tokens  # causal attention: QK^T and PV, halved, x2 flops
        reps = 3 if flops / flops_s < 0.3 else 1
        return 1.0 + (reps + 0.3) * flops / flops_s
    steps = args.steps + DECODE_WARMUP
    weights = 2 * (params + V * H)
    if p.variant.startswith("eager"):
        ms = max(L * 0.7e-3, (weights + (0 if p.converted else 2 * kv_bytes)) / bw)
    else:
        ms = (weights + (0 if p.converted else kv_bytes)) / bw
    setup = 2.0 + (0 if p.converted else kv_bytes / 5e11)
    if p.converted:
        setup += 2 * params * min(p.T, args.decode_prefill or p.T) * p.B / flops_s
    return setup + steps * ms + (60 if p.variant == "compiled-static" else 0)


# ----------------------------------------------------------------------------- results file


def load_results(path: Path, smoke: bool | None) -> dict:
    """The results so far (``smoke``: the kind of run this must be; None: any)."""
    if path.exists():
        data = json.loads(path.read_text())
        if smoke is not None and data.get("smoke", False) != smoke:
            raise UserError(f"{path} holds {'a smoke' if data.get('smoke') else 'a full'} run; use another --json "
                            f"for {'--smoke' if smoke else 'the full run'}")
        return data
    return {"format": 1, "smoke": smoke, "runs": [], "shapes": {}, "points": {}}


def save_results(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, path)  # never a half-written file, even when the call is killed


# ----------------------------------------------------------------------------- runtime helpers


def ensure_kernels() -> str:
    """Make ``linearize.kernels`` importable from the repo's kernels/ when linearize is not installed
    (the GPU machine runs from a checkout), so the layers use the Triton kernels there."""
    try:
        importlib.import_module("linearize.kernels.linear_attn")
        return "linearize.kernels"
    except ImportError:
        pass
    path = REPO / "kernels"
    if not (path / "__init__.py").exists():
        return "unavailable"
    import linearize

    spec = importlib.util.spec_from_file_location("linearize.kernels", path / "__init__.py",
                                                  submodule_search_locations=[str(path)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["linearize.kernels"] = mod
    spec.loader.exec_module(mod)
    linearize.kernels = mod
    try:
        importlib.import_module("linearize.kernels.linear_attn")
    except ImportError as err:
        return f"unavailable ({err})"
    return f"{_rel(path)} (loaded by path)"


class Timer:
    """Wall time of GPU work (CUDA events) or of CPU work (perf_counter), in ms."""

    def __init__(self, device):
        import torch

        self.cuda = device.type == "cuda"
        if self.cuda:
            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def start(self):
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            self.a.record()
        else:
            self.t = time.perf_counter()

    def stop(self) -> float:
        import torch

        if self.cuda:
            self.b.record()
            torch.cuda.synchronize()
            return self.a.elapsed_time(self.b)
        return (time.perf_counter() - self.t) * 1e3


def free_memory(device) -> None:
    """Return the last point's GPU memory before the next one (a no-op on CPU: nothing to measure)."""
    import torch

    if device.type == "cuda":
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def versions() -> dict:
    import torch
    import transformers

    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = None
    return {"torch": torch.__version__, "triton": tv, "transformers": transformers.__version__, "cuda": torch.version.cuda}


# ----------------------------------------------------------------------------- models


def build_models(shape_name: str, args, device, dtype):
    """(original, converted): random-weight LlamaForCausalLM and its conversion, sharing every weight."""
    import copy

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import linearize

    shape = dict(SHAPES[shape_name])
    rope = {"rope_type": "default", "rope_theta": shape.pop("rope_theta")}  # the transformers 5 spelling
    cfg = LlamaConfig(**shape, rope_parameters=rope, max_position_embeddings=max(131072, max(args.contexts)) + 4096,
                      bos_token_id=1, eos_token_id=None, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as from_pretrained(dtype=...): parameters in dtype, RoPE inv_freq in fp32
    try:
        with torch.device(device):
            original = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    original.generation_config.eos_token_id = None  # random weights: no end of text, always 16 new tokens
    original.generation_config.pad_token_id = 0
    # a copy that shares every parameter and buffer: the converted layers then reuse the very same
    # q/k/v/o tensors (as linearize does in place) and only their new parameters add memory
    shared = {id(t): t for t in [*original.parameters(), *original.buffers()]}
    converted = copy.deepcopy(original, shared)
    linearize.linearize(converted, method_config(args))
    converted.to(device).eval()
    for p in converted.parameters():  # only the new ones could differ; buffers (inv_freq) stay as they are
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return original, converted


def shape_record(shape_name: str, original, converted) -> dict:
    def count(m):
        return sum(p.numel() for p in {id(p): p for p in m.parameters()}.values())

    return dict(SHAPES[shape_name], params=count(original), converted_params=count(converted),
                conversion={k: v for k, v in converted.config.linearize.items() if k not in ("layers", "base_model")})


# ----------------------------------------------------------------------------- measurements


def positions(start: int, length: int, B: int, device):
    import torch

    return torch.arange(start, start + length, device=device).expand(B, -1)


def prefill(model, ids, cache, chunk: int | None = None):
    """Feed ``ids`` (B, T) through ``cache`` in chunks (one call if None); returns last logits (B, V)."""
    B, T = ids.shape
    step = chunk or T
    for s in range(0, T, step):
        e = min(T, s + step)
        out = model(input_ids=ids[:, s:e], position_ids=positions(s, e - s, B, ids.device), past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1]
        del out
    return logits


def eager_stepper(model, cache):
    def step(ids, pos):
        return model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]

    return step


def dynamic_cache_random(model, B: int, T: int, gen):
    """A DynamicCache holding T random keys/values per layer (decode speed does not depend on them)."""
    import torch
    from transformers import DynamicCache

    c = model.config
    cache = DynamicCache(config=c)
    p = next(model.parameters())
    for i in range(c.num_hidden_layers):
        k = torch.empty(B, c.num_key_value_heads, T, c.head_dim, device=p.device, dtype=p.dtype).normal_(generator=gen)
        v = torch.empty_like(k).normal_(generator=gen)
        cache.update(k, v, i)
        del k, v
    return cache


def static_cache_random(model, B: int, T: int, max_len: int, gen):
    """transformers' StaticCache of max_len slots whose first T hold random keys/values."""
    import torch
    from transformers import StaticCache

    c = model.config
    cache = StaticCache(config=c, max_cache_len=max_len)
    p = next(model.parameters())
    probe = torch.zeros(B, c.num_key_value_heads, 1, c.head_dim, device=p.device, dtype=p.dtype)
    for layer in cache.layers:
        layer.lazy_initialization(probe, probe)
        layer.keys[:, :, :T].normal_(generator=gen)
        layer.values[:, :, :T].normal_(generator=gen)
        layer.cumulative_length.fill_(T)
    return cache


class Runner:
    def __init__(self, args):
        import torch

        self.args = args
        self.device = torch.device(args.device)
        self.dtype = getattr(torch, args.dtype)
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is not None:
            torch.cuda.set_device(self.device)  # memory statistics and events follow the current device
        self.models = None  # (shape name, original, converted)
        self.data = load_results(args.json, args.smoke)
        self.counts = {"run": 0, "skip": 0, "ok": 0, "oom": 0, "error": 0, "fail": 0}

    # -- bookkeeping

    def converted_cache(self, model, B, max_len, static: bool):
        from linearize import LinearizeCache, StaticLinearizeCache

        if static:
            return StaticLinearizeCache(model.config, max_batch_size=B, max_cache_len=max_len, device=self.device,
                                        dtype=self.dtype)
        return LinearizeCache(model.config)

    def get_models(self, shape: str):
        if self.models is None or self.models[0] != shape:
            self.models = None
            free_memory(self.device)
            t = time.perf_counter()
            original, converted = build_models(shape, self.args, self.device, self.dtype)
            self.models = (shape, original, converted)
            self.data["shapes"][shape] = shape_record(shape, original, converted)
            print(f"built {shape} (original + converted, shared weights) in {time.perf_counter() - t:.1f} s", flush=True)
        return self.models[1], self.models[2]

    def generator(self, salt: int):
        import torch

        return torch.Generator(device=self.device).manual_seed(self.args.seed * 1000 + salt)

    def random_ids(self, B, T, vocab, salt):
        import torch

        return torch.randint(0, vocab, (B, T), device=self.device, generator=self.generator(salt))

    # -- main loop

    def run(self, points: list[Point]) -> None:
        import torch

        pts = self.data["points"]
        pending = [p for p in points if p.key not in pts or (self.args.retry_errors and pts[p.key]["status"] == "error")]
        guess = sum(rough_seconds(p, SHAPES[p.shape], self.args) for p in pending)
        guess += 15 * len({p.shape for p in pending})
        print(f"plan: {len(points)} points, {len(points) - len(pending)} already in {self.args.json}, {len(pending)} to run; "
              f"rough guess {guess / 60:.1f} min on an H100/H200 (a cost model, not a measurement)", flush=True)
        if self.cuda and os.environ.get("LINEARIZE_KERNELS") is None:
            os.environ["LINEARIZE_KERNELS"] = "triton"  # fail loudly rather than time the PyTorch fallback
        run = dict(started=_now(), device=self._device_name(), argv=sys.argv[1:], dtype=self.args.dtype,
                   kernels=ensure_kernels(), linearize_kernels=os.environ.get("LINEARIZE_KERNELS", "auto"),
                   static_cache="StaticLinearizeCache", **versions())
        print("run:", json.dumps(run), flush=True)
        if pending:
            self.data["runs"].append(run)
        self.run_id = len(self.data["runs"]) - 1
        t0 = time.perf_counter()
        done = 0
        for p in points:
            if p not in pending:
                self.counts["skip"] += 1
                print(f"skip {p.key} (in JSON: {pts[p.key]['status']})", flush=True)
                continue
            t = time.perf_counter()
            rec = self.measure(p)
            rec.update(part=p.part, shape=p.shape, model=p.model, variant=p.variant, T=p.T, B=p.B, run=self.run_id,
                       elapsed_s=round(time.perf_counter() - t, 2))
            pts[p.key] = rec
            save_results(self.args.json, self.data)
            done += 1
            self.counts["run"] += 1
            self.counts[rec["status"]] = self.counts.get(rec["status"], 0) + 1
            print(f"[{done}/{len(pending)}] {p.key}: {summary(rec)}  ({rec['elapsed_s']:.1f} s; "
                  f"total {_mmss(time.perf_counter() - t0)})", flush=True)
        self.models = None
        free_memory(self.device)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def _device_name(self) -> str:
        import platform

        import torch

        if self.cuda:
            return torch.cuda.get_device_name(self.device)
        return f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"

    def measure(self, p: Point) -> dict:
        """One point's record; out of memory and other errors are recorded, not raised. GPU memory
        is returned before the next point (gc costs ~0.2 s, so once per point)."""
        import torch

        try:
            original, converted = self.get_models(p.shape)
            model = converted if p.converted else original
            if self.cuda:
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if self.cuda else None
            rec = getattr(self, f"run_{p.part}")(p, model)
            if self.cuda:
                rec["peak_gib"] = round(torch.cuda.max_memory_allocated() / GiB, 3)
                rec["resident_gib"] = round(base / GiB, 3)
            rec.setdefault("status", "ok")
        except torch.OutOfMemoryError as err:
            rec = {"status": "oom", "message": str(err).splitlines()[0][:300]}
        except Exception as err:  # noqa: BLE001 - one failing point must not end a 10-minute GPU call
            tb = traceback.format_exception(type(err), err, err.__traceback__)
            rec = {"status": "error", "message": f"{type(err).__name__}: {err}"[:500], "traceback": "".join(tb[-6:])[-3000:]}
        free_memory(self.device)
        return rec

    # -- prefill

    def run_prefill(self, p: Point, model) -> dict:
        from transformers import DynamicCache

        chunk = int(p.variant.removeprefix("chunk")) if p.variant.startswith("chunk") else None
        vocab = model.config.vocab_size

        def once(T):
            cache = self.converted_cache(model, p.B, T, static=False) if p.converted else DynamicCache(config=model.config)
            ids = self.random_ids(p.B, T, vocab, salt=T)
            with torch_no_grad():
                prefill(model, ids, cache, chunk)
            del cache, ids

        timer = Timer(self.device)
        once(min(p.T, 2 * chunk if chunk else 4096))  # warm-up: kernels compiled, allocator primed
        self._reset_peak()
        times = []
        while len(times) < 3 and (not times or sum(times) < 1000):  # the median of up to 3 runs within ~1 s
            timer.start()
            once(p.T)  # its cache and activations are freed on return (no reference cycles)
            times.append(timer.stop())
        ms = sorted(times)[len(times) // 2]
        return {"ms": round(ms, 3), "tokens_per_s": round(p.B * p.T / ms * 1e3, 1), "repeats": len(times),
                    "cache": "LinearizeCache" if p.converted else "DynamicCache", "chunk": chunk}

    def _reset_peak(self):
        import torch

        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    # -- decode

    def decode_setup(self, p: Point, model, max_len: int):
        """(step function, note on the state, cache class name) for a decode point at context p.T."""
        gen = self.generator(p.T + p.B)
        if not p.converted:
            if p.variant == "eager-dynamic":
                cache = dynamic_cache_random(model, p.B, p.T, gen)
                return eager_stepper(model, cache), "random K/V of T tokens", "DynamicCache"
            cache = static_cache_random(model, p.B, p.T, max_len, gen)
            if p.variant == "compiled-static":
                return self.compiled_stepper(model, cache), "random K/V of T tokens", "StaticCache"
            return self.graph_or_eager(model, cache, p.B), "random K/V of T tokens", "StaticCache"
        static = p.variant == "graph-static"
        cache = self.converted_cache(model, p.B, max_len, static=static)
        P = min(p.T, self.args.decode_prefill or p.T)
        with torch_no_grad():
            prefill(model, self.random_ids(p.B, P, model.config.vocab_size, salt=7), cache, self.args.prefill_chunk)
        note = "real prefill of all T tokens" if P == p.T else f"real prefill of {P} tokens, positions from T"
        step = self.graph_or_eager(model, cache, p.B) if static else eager_stepper(model, cache)
        return step, note, type(cache).__name__

    def graph_or_eager(self, model, cache, B):
        if not self.cuda:
            return eager_stepper(model, cache)  # --smoke on CPU: the static cache, stepped eagerly
        from .graphs import DecodeGraph

        with torch_no_grad():
            graph = DecodeGraph(model, cache, B)
        return graph.step

    def compiled_stepper(self, model, cache):
        import torch

        fwd = torch.compile(model.forward, mode="reduce-overhead")

        def step(ids, pos):
            torch.compiler.cudagraph_mark_step_begin()
            return fwd(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]

        return step

    def run_decode(self, p: Point, model) -> dict:
        import torch

        if p.variant == "graph-static":
            check = self.ensure_graph_check(p.shape, p.model)
            if check["status"] != "ok":
                return {"status": "error", "message": f"not timed: graph check failed ({check.get('message', '')})"}
        max_len = p.T + DECODE_WARMUP + self.args.steps + CACHE_MARGIN
        t = time.perf_counter()
        step, note, cache_name = self.decode_setup(p, model, max_len)
        setup_s = time.perf_counter() - t
        self._reset_peak()  # peak memory of decoding: the cache as set up, plus the steps
        ids = self.random_ids(p.B, 1, model.config.vocab_size, salt=11)
        pos = torch.full((p.B, 1), p.T, dtype=torch.long, device=self.device)
        timer = Timer(self.device)
        with torch_no_grad():
            for i in range(DECODE_WARMUP + self.args.steps):
                if i == DECODE_WARMUP:
                    timer.start()
                logits = step(ids, pos)
                ids = logits.argmax(-1, keepdim=True)
                pos = pos + 1
            total = timer.stop()
        ms = total / self.args.steps
        return {"ms": round(ms, 4), "tokens_per_s": round(p.B * 1e3 / ms, 1), "steps": self.args.steps, "state": note,
                    "cache": cache_name, "graph": self.cuda and p.variant.startswith("graph"), "setup_s": round(setup_s, 2)}

    # -- checks

    def ensure_graph_check(self, shape: str, model_label: str) -> dict:
        """The graph-vs-eager check of this model, run now if the JSON lacks it: graph rows are only
        timed after their graph decoded the same tokens as eager decoding."""
        point = Point("check", shape, model_label, "graph-vs-eager")
        pts = self.data["points"]
        if point.key not in pts:
            rec = self.measure(point)
            rec.update(part="check", shape=shape, model=model_label, variant="graph-vs-eager", T=0, B=0, run=self.run_id)
            pts[point.key] = rec
            save_results(self.args.json, self.data)
            print(f"(prerequisite) {point.key}: {summary(rec)}", flush=True)
        return pts[point.key]

    def run_check(self, p: Point, model) -> dict:
        if p.variant == "graph-vs-eager":
            return self.check_graph(model, p.converted)
        if p.variant == "chunked-prefill":
            return self.check_chunked(model)
        return self.check_generate(model)

    def _greedy(self, step, first_logits, start, n):
        import torch

        ids = first_logits.argmax(-1, keepdim=True)
        toks, logits = [ids], []
        pos = torch.full_like(ids, start)
        for _ in range(n - 1):
            out = step(ids, pos)
            logits.append(out.float().clone())
            ids = out.argmax(-1, keepdim=True)
            toks.append(ids)
            pos = pos + 1
        return torch.cat(toks, 1), logits

    def check_graph(self, model, converted: bool) -> dict:
        """Greedy tokens of the graph (CUDA) equal eager decoding over the same static cache class.

        On CPU the static cache steps eagerly and is compared with the default cache instead."""
        from transformers import DynamicCache

        B, P, n = 2, self.args.check_prompt, CHECK_TOKENS
        prompt = self.random_ids(B, P, model.config.vocab_size, salt=3)
        max_len = P + n + CACHE_MARGIN

        def static():
            if converted:
                return self.converted_cache(model, B, max_len, static=True)
            from transformers import StaticCache

            return StaticCache(config=model.config, max_cache_len=max_len)

        def default():
            return self.converted_cache(model, B, max_len, static=False) if converted else DynamicCache(config=model.config)

        from .graphs import HostReads

        runs = {}
        with torch_no_grad():
            for name, make, graph in (("eager-static", static, False), ("eager-default", default, False),
                                      ("graph-static", static, True)):
                if graph and not self.cuda:
                    continue
                cache = make()
                first = prefill(model, prompt, cache)
                step = self.graph_or_eager(model, cache, B) if graph else eager_stepper(model, cache)
                if name == "eager-static":
                    # what capture needs, checked on any device: no host read of a tensor in the step
                    with HostReads() as reads:
                        runs[name] = self._greedy(step, first, P, 2)
                    cache = make()
                    first = prefill(model, prompt, cache)
                    step = eager_stepper(model, cache)
                runs[name] = self._greedy(step, first, P, n)
                del cache, step
        ref_t, ref_l = runs["eager-static"]
        cand = "graph-static" if self.cuda else "eager-default"
        t, lg = runs[cand]
        same = bool((t == ref_t).all())
        # random weights with tied embeddings mostly predict the input token again, so equal tokens
        # alone prove little: every step's logits must agree too
        scale = max(float(x.abs().max()) for x in ref_l)
        diff = max(float((a - b).abs().max()) for a, b in zip(lg, ref_l)) / scale
        tol = 1e-4 if self.dtype.itemsize == 4 else 2e-2
        host = sorted(set(reads.found))
        rec = {"status": "ok" if same and diff <= tol and not host else "fail", "compared": f"{cand} vs eager-static",
               "tokens": n, "batch": B, "prompt": P, "rel_logit_diff": diff, "tolerance": tol,
               "host_reads_per_step": host, "ref_tokens": ref_t.tolist(), "cand_tokens": t.tolist()}
        if self.cuda:  # info: the default cache (another code path) against the static one
            rec["default_cache_agreement"] = float((runs["eager-default"][0] == ref_t).float().mean())
        if not same:
            first = int((t != ref_t).any(0).nonzero()[0])
            rec["message"] = f"tokens differ from step {first}; max relative logit difference {diff:.3g}"
        elif diff > tol:
            rec["message"] = f"same tokens, but logits differ: max relative difference {diff:.3g} > {tol}"
        elif host:
            rec["message"] = f"a decode step reads tensors on the host (no CUDA graph possible): {'; '.join(host[:3])}"
        return rec

    def check_chunked(self, model) -> dict:
        """Chunked prefill through the cache continues from the state: same last logits as one call."""
        chunk = min(self.args.prefill_chunk, 256)
        T = 2 * chunk + 17  # not a multiple of the chunk
        ids = self.random_ids(2, T, model.config.vocab_size, salt=5)
        with torch_no_grad():
            whole = prefill(model, ids, self.converted_cache(model, 2, T, False)).float()
            parts = prefill(model, ids, self.converted_cache(model, 2, T, False), chunk).float()
        rel = float((whole - parts).norm() / whole.norm())
        tol = 1e-4 if self.dtype.itemsize == 4 else 3e-2
        same_argmax = bool((whole.argmax(-1) == parts.argmax(-1)).all())
        rec = {"status": "ok" if rel <= tol else "fail", "length": T, "chunk": chunk, "rel_diff": rel,
               "tolerance": tol, "same_argmax": same_argmax}
        if rel > tol:
            rec["message"] = f"relative difference {rel:.3g} > {tol}"
        return rec

    def check_generate(self, model) -> dict:
        """generate(cache_implementation="static") against generate(), greedy (on CUDA transformers
        compiles the static decode step). Random weights mostly repeat the input token, so the
        per-step scores are compared too (recorded, not judged: the compiled step runs other kernels)."""
        ids = self.random_ids(1, 32, model.config.vocab_size, salt=9)
        kw = {"max_new_tokens": CHECK_TOKENS, "do_sample": False, "output_scores": True, "return_dict_in_generate": True}
        with torch_no_grad():
            ref = model.generate(ids, **kw)
            t = time.perf_counter()
            try:
                out = model.generate(ids, cache_implementation="static", **kw)
            except Exception as err:  # noqa: BLE001 - the outcome is recorded, whatever it is
                return {"status": "fail", "message": f"generate(cache_implementation='static') raised "
                                                   f"{type(err).__name__}: {str(err)[:300]}"}
        secs = time.perf_counter() - t
        a, b = ref.sequences[0, 32:].tolist(), out.sequences[0, 32:].tolist()
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))
        scale = max(float(x.float().abs().max()) for x in ref.scores)
        # scores are comparable only while both runs continue the same prefix: up to the first difference
        upto = len(ref.scores) if first is None else first + 1
        diff = max(float((x.float() - y.float()).abs().max()) for x, y in zip(ref.scores[:upto], out.scores[:upto])) / scale
        rec = {"status": "ok" if first is None else "fail", "seconds": round(secs, 1), "rel_score_diff": diff,
               "default_tokens": a, "static_tokens": b}
        msg = "same tokens" if first is None else f"tokens differ from generate() with the default cache from step {first + 1}"
        if first is not None and first < min(len(a), len(b)):
            s = ref.scores[first][0].float()
            top2 = s.topk(2).values
            rec["first_difference"] = {"step": first + 1, "default_top2_gap": float(top2[0] - top2[1]) / scale,
                                       "static_choice_below_default_best": float(s.max() - s[b[first]]) / scale}
            msg += (f" (there the default's scores put the static run's token "
                    f"{rec['first_difference']['static_choice_below_default_best']:.2g} of the largest score below its best)")
        rec["message"] = msg + f"; max score difference up to there {diff:.2g} of the largest"
        return rec


def torch_no_grad():
    import torch

    return torch.no_grad()


def summary(rec: dict) -> str:
    """One line for the console."""
    s = rec["status"]
    if s == "ok" and "tokens_per_s" in rec:
        unit = "ms/step" if "steps" in rec else "ms"
        mem = f", peak {rec['peak_gib']:.2f} GiB" if rec.get("peak_gib") is not None else ""
        return f"{rec['tokens_per_s']:,.0f} tok/s, {rec['ms']:.3f} {unit}{mem}"
    if s in ("ok", "fail"):  # a check
        return f"{s.upper()} {rec.get('message') or rec.get('compared') or ''}".strip()
    return f"{s.upper()}: {rec.get('message', '')}"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _mmss(s: float) -> str:
    return f"{int(s // 60)}m{int(s % 60):02d}s"


# ----------------------------------------------------------------------------- report


def _ok(points: dict, key: str):
    r = points.get(key)
    return r if r and r["status"] == "ok" else None


def _cell(points: dict, key: str, fmt) -> str:
    r = points.get(key)
    if r is None:
        return "-"
    if r["status"] == "oom":
        return "OOM"
    if r["status"] != "ok":
        return r["status"]
    return fmt(r)


def _tok(r) -> str:
    return f"{r['tokens_per_s']:,.0f}"


def _mem(r) -> str:
    return f"{r['peak_gib']:.2f}" if r.get("peak_gib") is not None else "n/a"


def _ctx(T: int) -> str:
    return f"{T // 1024}K" if T % 1024 == 0 else str(T)


def _best(points: dict, keys: list[str], field="tokens_per_s", pick=max):
    vals = [(points[k][field], k) for k in keys if _ok(points, k) and points[k].get(field) is not None]
    return pick(vals) if vals else None


def _labels(points: dict, shape: str) -> list[str]:
    return sorted({r["model"] for r in points.values() if r["shape"] == shape and r["model"] != "original"})


def _key(part, shape, model, variant, T=0, B=0):
    return Point(part, shape, model, variant, T, B).key


def _variants(points, part, shape, model):
    return list(dict.fromkeys(r["variant"] for r in points.values()
                              if r["part"] == part and r["shape"] == shape and r["model"] == model))


def targets(points: dict, shape: str, label: str) -> list[str]:
    """The issue's three targets for one shape and conversion, with measured values and PASS/MISS."""
    out = []
    # 1. decode
    T, B = TARGET_DECODE_T, TARGET_DECODE_B
    o = _best(points, [_key("decode", shape, "original", v, T, B) for v in _variants(points, "decode", shape, "original")])
    c = _best(points, [_key("decode", shape, label, v, T, B) for v in _variants(points, "decode", shape, label)])
    if o and c:
        ratio = c[0] / o[0]
        out.append(f"- decode at {_ctx(T)}, batch {B}: converted {c[0]:,.0f} tok/s ({c[1].split('/')[3]}) vs the "
                   f"original's best {o[0]:,.0f} tok/s ({o[1].split('/')[3]}): {ratio:.2f}x (target >= 5x) -> "
                   f"{'PASS' if ratio >= 5 else 'MISS'}")
    else:
        out.append(f"- decode at {_ctx(T)}, batch {B} >= 5x the original's best: n/a (not measured)")
    variant = "graph-static" if any(_ok(points, _key("decode", shape, label, "graph-static", t, B))
                                    for t in _contexts(points, shape)) else "eager-default"
    flat = [(t, points[k]["tokens_per_s"]) for t in _contexts(points, shape)
            if 4096 <= t <= 131072 and _ok(points, k := _key("decode", shape, label, variant, t, B))]
    if len(flat) >= 2 and flat[0][0] == 4096 and flat[-1][0] == 131072:
        lo, hi = min(v for _, v in flat), max(v for _, v in flat)
        spread = 1 - lo / hi
        out.append(f"- converted decode ({variant}, batch {B}) flat from 4K to 128K: "
                   + ", ".join(f"{_ctx(t)} {v:,.0f}" for t, v in flat)
                   + f" tok/s; min/max {lo / hi:.3f} (target: within 10%) -> {'PASS' if spread <= 0.10 else 'MISS'}")
    else:
        out.append(f"- converted decode flat within 10% from 4K to 128K (batch {B}): n/a (not measured at both ends)")
    # 2. prefill
    for Bp in sorted({r["B"] for r in points.values() if r["part"] == "prefill" and r["shape"] == shape}):
        def conv(t, Bp=Bp):
            return _best(points, [_key("prefill", shape, label, v, t, Bp) for v in _variants(points, "prefill", shape, label)])

        small, big = conv(TARGET_PREFILL_SMALL), conv(TARGET_PREFILL_T)
        orig = _best(points, [_key("prefill", shape, "original", "dynamic", TARGET_PREFILL_T, Bp)])
        okey = _key("prefill", shape, "original", "dynamic", TARGET_PREFILL_T, Bp)
        if small and big:
            keep = big[0] / small[0]
            line = (f"- prefill, batch {Bp}: converted {big[0]:,.0f} tok/s at 64K vs {small[0]:,.0f} at 4K = "
                    f"{keep:.2f} (target >= 0.90)")
            if orig:
                sp = big[0] / orig[0]
                line += f"; original {orig[0]:,.0f} tok/s at 64K -> {sp:.2f}x (target >= 2.5x)"
                ok = keep >= 0.9 and sp >= 2.5
            elif points.get(okey, {}).get("status") == "oom":
                line += "; original OOM at 64K (counts as met)"
                ok = keep >= 0.9
            else:
                line += "; original at 64K not measured"
                ok = None
            out.append(line + (f" -> {'PASS' if ok else 'MISS'}" if ok is not None else " -> n/a"))
        else:
            out.append(f"- prefill, batch {Bp}: converted at 64K >= 0.9x its 4K rate and >= 2.5x the original: "
                       "n/a (not measured)")
    # 3. memory
    T, B = TARGET_MEMORY_T, TARGET_MEMORY_B
    for part in ("decode", "prefill"):
        ok_keys = {m: [_key(part, shape, m, v, T, B) for v in _variants(points, part, shape, m)] for m in ("original", label)}
        o = _best(points, ok_keys["original"], "peak_gib", min)
        c = _best(points, ok_keys[label], "peak_gib", min)
        o_oom = any(points.get(k, {}).get("status") == "oom" for k in ok_keys["original"])
        name = f"peak memory, {part} at {_ctx(T)} batch {B}"
        if c and o:
            r = c[0] / o[0]
            out.append(f"- {name}: converted {c[0]:.2f} GiB ({c[1].split('/')[3]}) vs original {o[0]:.2f} GiB "
                       f"({o[1].split('/')[3]}) = {r:.3f} (target <= 0.25) -> {'PASS' if r <= 0.25 else 'MISS'}")
        elif c and o_oom:
            out.append(f"- {name}: converted {c[0]:.2f} GiB ({c[1].split('/')[3]}), original OOM -> PASS")
        else:
            out.append(f"- {name}: converted <= 1/4 of the original: n/a (not measured)")
    # chunked prefill: peak memory follows a chunk's activations, not T
    for v in [v for v in _variants(points, "prefill", shape, label) if v.startswith("chunk")]:
        for Bp in sorted({r["B"] for r in points.values() if r["part"] == "prefill" and r["shape"] == shape}):
            vals = [(t, points[k]["peak_gib"]) for t in _contexts(points, shape)
                    if _ok(points, k := _key("prefill", shape, label, v, t, Bp)) and points[k].get("peak_gib") is not None]
            if len(vals) < 2:
                continue
            (t0, m0), (t1, m1) = vals[0], vals[-1]
            one = _ok(points, _key("prefill", shape, label, "cache", t1, Bp))
            whole = points.get(_key("prefill", shape, label, "cache", t1, Bp), {})
            ref = (f"; in one call at {_ctx(t1)}: {one['peak_gib']:.2f} GiB" if one and one.get("peak_gib") is not None
                   else "; in one call at " + _ctx(t1) + ": OOM" if whole.get("status") == "oom" else "")
            growth = m1 / m0
            out.append(f"- chunked prefill peak memory ({v[5:]}-token chunks, batch {Bp}): {m0:.2f} GiB at {_ctx(t0)}, "
                       f"{m1:.2f} GiB at {_ctx(t1)} ({t1 // t0}x the tokens){ref} (target: flat within 10%) -> "
                       f"{'PASS' if growth <= 1.10 else 'MISS'}")
    return out


def _contexts(points, shape):
    return sorted({r["T"] for r in points.values() if r["shape"] == shape and r["part"] in ("prefill", "decode")})


def render(data: dict, png_name: str | None) -> str:
    points, runs = data["points"], data["runs"]
    used = sorted({r["run"] for r in points.values() if "run" in r})
    L = [MARK_START, "## End-to-end: original vs converted model (prefill and decode)", ""]
    if not points:
        return "\n".join(L + [("Not measured yet. On a GPU: `python scripts/bench_e2e.py` (resumable; `--help` for how "
                              "to split it), then `python scripts/bench_e2e.py --write-docs` renders this section "
                              "from `docs/bench_e2e.json`."), "", MARK_END])
    devs = sorted({runs[i]["device"] for i in used})
    last = runs[used[-1]]
    L.append(f"Written by `scripts/bench_e2e.py` (`linearize bench`) from `bench_e2e.json` on {_now()}; measured "
             f"{runs[used[0]]['started']} .. {last['started']} on {' and '.join(devs)}"
             + (" (**mixed devices: compare rows with care**)" if len(devs) > 1 else "")
             + f"; torch {last['torch']}, triton {last['triton']}, transformers {last['transformers']}, "
               f"CUDA {last['cuda']}; {last['dtype']}, sdpa; kernels: {last['kernels']}; "
               f"static converted cache: {last['static_cache']}." + (" **Smoke run (tiny model, CPU)**." if data.get("smoke") else ""))
    L.append("")
    steps = "/".join(str(x) for x in sorted({r["steps"] for r in points.values() if "steps" in r})) or "the"
    L += [("Both models of a shape live in one process on the same device and share every weight (the converted "
          "layers reuse the original q/k/v/o by reference); weights are random (decode and prefill speed do not "
          "depend on their values). Prefill: one forward of B x T random tokens with `use_cache=True` and "
          "`logits_to_keep=1`, timed with CUDA events after a warm-up at a shorter length, median of up to 3 runs; "
          "the original fills a DynamicCache, the converted model its state cache, in one call or in chunks. "
          f"Decode: {steps} greedy steps after {DECODE_WARMUP} warm-up steps, ms per step and B x 1000 / ms tokens/s. The original "
          "decodes from a cache filled directly with T random keys/values per layer (no O(T^2) prefill: a decode "
          "step's cost does not depend on the values); the converted model's state comes from a real prefill "
          "(the `state` field of each point in the JSON says how many tokens) and positions continue from T. "
          "Graph rows replay one decode step captured in a CUDA graph (`linearize.graphs.DecodeGraph`) over a "
          "static cache. Peak memory: `torch.cuda.max_memory_allocated` over the point, weights included (both "
          "models' shared weights are resident in every point). OOM: the point ran out of GPU memory.")]
    if any(r.get("graph") is False and r["variant"] == "graph-static" for r in points.values()):
        L[-1] += (" Here the graph rows ran without CUDA: the static caches were stepped eagerly, so they test the "
                  "code path, not the speed.")
    L.append("")
    if data.get("notes"):  # hand-written remarks kept in the JSON (e.g. what changed since the run)
        L += [f"- {n}" for n in data["notes"]] + [""]
    for shape in sorted({r["shape"] for r in points.values()}, key=list(SHAPES).index):
        sh = data["shapes"].get(shape, SHAPES.get(shape, {}))
        for label in _labels(points, shape) or ["(no conversion measured)"]:
            L.append(f"### {shape}, converted: {label}")
            L.append("")
            if "params" in sh:
                L.append(f"Shape: {sh['num_hidden_layers']} layers, hidden {sh['hidden_size']}, "
                         f"{sh['num_attention_heads']} heads / {sh['num_key_value_heads']} kv heads, head_dim "
                         f"{sh['head_dim']}, intermediate {sh['intermediate_size']}, vocab {sh['vocab_size']}, tied "
                         f"embeddings; {sh['params'] / 1e6:.1f}M parameters, converted {sh['converted_params'] / 1e6:.1f}M "
                         f"({json.dumps(sh.get('conversion', {}))}).")
                L.append("")
            L.append("#### Targets")
            L.append("")
            L += targets(points, shape, label)
            L.append("")
            L += _checks_table(points, shape, label)
            L += _prefill_table(points, shape, label)
            L += _decode_table(points, shape, label)
            L += _memory_table(points, shape, label)
    if png_name:
        L += [f"![tokens/s and peak memory vs context length]({png_name})", ""]
    L.append(MARK_END)
    return "\n".join(L)


def _checks_table(points, shape, label) -> list[str]:
    rows = [(m, v, points[_key("check", shape, m, v)]) for m in ("original", label)
            for v in ("graph-vs-eager", "chunked-prefill", "generate-static") if _key("check", shape, m, v) in points]
    if not rows:
        return []
    out = ["#### Checks", "", "| model | check | result | detail |", "|---|---|---|---|"]
    for m, v, r in rows:
        if v == "graph-vs-eager":
            d = (f"{r.get('tokens')} greedy tokens x batch {r.get('batch')} after a {r.get('prompt')}-token prompt, "
                 f"{r.get('compared')}: max logit difference {r.get('rel_logit_diff', float('nan')):.2g} of the "
                 f"largest logit (tol {r.get('tolerance')}); host reads in a decode step: "
                 f"{len(r.get('host_reads_per_step', [])) or 'none'}")
            if "default_cache_agreement" in r:
                d += f"; agreement with the default cache {r['default_cache_agreement']:.2f}"
        elif v == "chunked-prefill":
            d = (f"{r.get('length')} tokens in chunks of {r.get('chunk')} vs one call: relative logit diff "
                 f"{r.get('rel_diff', float('nan')):.2g} (tol {r.get('tolerance')}), same argmax {r.get('same_argmax')}")
        else:
            d = r.get("message", "")
            if r.get("seconds") is not None:
                d += f" (the static generate took {r['seconds']} s, torch.compile included on CUDA)"
        if r["status"] == "error":
            d = r.get("message", "")
        out.append(f"| {m} | {v} | {r['status'].upper()} | {d.replace('|', '/')} |")
    return out + [""]


def _prefill_table(points, shape, label) -> list[str]:
    Ts = sorted({r["T"] for r in points.values() if r["part"] == "prefill" and r["shape"] == shape})
    if not Ts:
        return []
    cv = _variants(points, "prefill", shape, label)
    Bs = sorted({r["B"] for r in points.values() if r["part"] == "prefill" and r["shape"] == shape})
    names = {"cache": "converted, one call"}
    head = ["T", "B", "original tok/s"] + [names.get(v, f"converted, chunks of {v[5:]}") + " tok/s" for v in cv]
    out = ["#### Prefill (tokens/s)", "", "| " + " | ".join(head + ["converted best / original"]) + " |",
           "|" + "---|" * (len(head) + 1)]
    for T in Ts:
        for B in Bs:
            ok = _key("prefill", shape, "original", "dynamic", T, B)
            cells = [_ctx(T), str(B), _cell(points, ok, _tok)] + [_cell(points, _key("prefill", shape, label, v, T, B), _tok) for v in cv]
            c = _best(points, [_key("prefill", shape, label, v, T, B) for v in cv])
            o = _ok(points, ok)
            cells.append(f"{c[0] / o['tokens_per_s']:.2f}x" if c and o else "-")
            out.append("| " + " | ".join(cells) + " |")
    return out + [""]


DECODE_NAMES = {"eager-dynamic": "eager, DynamicCache", "graph-static": "CUDA graph, StaticCache",
                "compiled-static": "torch.compile reduce-overhead, StaticCache",
                "eager-default": "eager, LinearizeCache"}


def _decode_name(model, variant):
    if model != "original" and variant == "graph-static":
        return "CUDA graph, static state cache"
    return DECODE_NAMES.get(variant, variant)


def _decode_table(points, shape, label) -> list[str]:
    Ts = sorted({r["T"] for r in points.values() if r["part"] == "decode" and r["shape"] == shape})
    if not Ts:
        return []
    Bs = sorted({r["B"] for r in points.values() if r["part"] == "decode" and r["shape"] == shape})
    cols = [("original", v) for v in _variants(points, "decode", shape, "original")]
    cols += [(label, v) for v in _variants(points, "decode", shape, label)]
    head = ["T", "B"] + [f"{'original' if m == 'original' else 'converted'}: {_decode_name(m, v)}" for m, v in cols]
    out = ["#### Decode (tokens/s, ms per step in parentheses)", "",
           "| " + " | ".join(head + ["converted best / original best"]) + " |", "|" + "---|" * (len(head) + 1)]
    for T in Ts:
        for B in Bs:
            cells = [_ctx(T), str(B)] + [_cell(points, _key("decode", shape, m, v, T, B),
                                               lambda r: f"{r['tokens_per_s']:,.0f} ({r['ms']:.2f})") for m, v in cols]
            o = _best(points, [_key("decode", shape, m, v, T, B) for m, v in cols if m == "original"])
            c = _best(points, [_key("decode", shape, m, v, T, B) for m, v in cols if m != "original"])
            cells.append(f"{c[0] / o[0]:.1f}x" if c and o else ("original OOM" if c else "-"))
            out.append("| " + " | ".join(cells) + " |")
    return out + [""]


def _memory_table(points, shape, label) -> list[str]:
    Ts = sorted({r["T"] for r in points.values() if r["part"] in ("prefill", "decode") and r["shape"] == shape})
    cols = [("prefill", m, v) for m in ("original", label) for v in _variants(points, "prefill", shape, m)]
    cols += [("decode", m, v) for m in ("original", label) for v in _variants(points, "decode", shape, m)]
    if not Ts or not cols:
        return []
    Bs = sorted({r["B"] for r in points.values() if r["part"] in ("prefill", "decode") and r["shape"] == shape})

    def name(part, m, v):
        who = "original" if m == "original" else "converted"
        if part == "prefill":
            return f"prefill {who}" + ("" if v in ("dynamic", "cache") else f" ({v})")
        return f"decode {who}: {_decode_name(m, v)}"

    out = ["#### Peak memory (GiB, weights included)", "", "| T | B | " + " | ".join(name(*c) for c in cols) + " |",
           "|---|---|" + "---|" * len(cols)]
    for T in Ts:
        for B in Bs:
            cells = [_cell(points, _key(part, shape, m, v, T, B), _mem) for part, m, v in cols]
            if all(c == "-" for c in cells):
                continue
            out.append(f"| {_ctx(T)} | {B} | " + " | ".join(cells) + " |")
    return out + [""]


def plot(data: dict, path: Path) -> bool | None:
    """tokens/s and peak memory vs context length, original vs converted (best variant of each; log
    axes; an x on the top edge where every variant ran out of memory). False without matplotlib,
    None when there is nothing to plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        return False
    points = data["points"]
    shapes = [s for s in SHAPES if any(r["shape"] == s and r["part"] in ("prefill", "decode") for r in points.values())]
    if not shapes:
        return None
    panels = [("prefill", "tokens_per_s", max, "prefill tokens/s"), ("decode", "tokens_per_s", max, "decode tokens/s"),
              ("prefill", "peak_gib", min, "prefill peak memory (GiB)"), ("decode", "peak_gib", min, "decode peak memory (GiB)")]
    fig, axes = plt.subplots(len(shapes), len(panels), figsize=(5 * len(panels), 4 * len(shapes)), squeeze=False)
    for row, shape in zip(axes, shapes):
        labels = _labels(points, shape)
        for ax, (part, field, pick, title) in zip(row, panels):
            Bs = sorted({r["B"] for r in points.values() if r["part"] == part and r["shape"] == shape})
            B = TARGET_DECODE_B if TARGET_DECODE_B in Bs else (Bs[-1] if Bs else None)
            for m, color in [("original", "tab:red")] + [(lab, c) for lab, c in zip(labels, ("tab:blue", "tab:green", "tab:purple"))]:
                xs, ys, oom = [], [], []
                for T in _contexts(points, shape):
                    keys = [_key(part, shape, m, v, T, B) for v in _variants(points, part, shape, m)]
                    best = _best(points, keys, field, pick)
                    if best:
                        xs.append(T)
                        ys.append(best[0])
                    elif keys and all(points.get(k, {}).get("status") == "oom" for k in keys):
                        oom.append(T)
                name = "original" if m == "original" else f"converted ({m})"
                if xs:
                    ax.plot(xs, ys, "o-", color=color, label=name)
                for T in oom:
                    ax.plot([T], [1.0], "x", color=color, markersize=10, clip_on=False,
                            transform=ax.get_xaxis_transform(), label=f"{name}: OOM" if T == oom[0] else None)
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: _ctx(int(x)) if x >= 1 else str(x)))
            if ax.lines and field == "tokens_per_s":
                ax.set_yscale("log")
            ax.set_xlabel("context length T")
            ax.set_title(f"{shape}: {title}, batch {B}")
            ax.grid(True, alpha=0.3, which="both")
            if ax.lines:
                ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_docs(data: dict, docs: Path) -> None:
    png = docs.with_name("bench_e2e.png")
    has_png = plot(data, png)
    if has_png is False:
        print("WARNING: matplotlib is not installed: no PNG written (run --write-docs again where it is)", flush=True)
    section = render(data, png.name if has_png else None)
    text = docs.read_text() if docs.exists() else ""
    if MARK_START in text and MARK_END in text:
        head, rest = text.split(MARK_START, 1)
        tail = rest.split(MARK_END, 1)[1]
        text = head + section + tail
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + section + "\n"
    docs.parent.mkdir(parents=True, exist_ok=True)
    docs.write_text(text)
    print(f"wrote the End-to-end section of {docs}" + (f" and {png}" if has_png else ""), flush=True)


# ----------------------------------------------------------------------------- entry points


def run(args) -> dict:
    """Measure the planned points that are not in the JSON yet, then optionally render the docs.
    Returns the counts of points by outcome. Raises UserError for bad settings."""
    args = resolve(args)
    if args.render_only:
        if not args.write_docs:
            raise UserError("--parts none measures nothing: add --write-docs to render the docs from the JSON")
        if not args.json.exists():
            raise UserError(f"{args.json} does not exist: nothing to render")
        data = load_results(args.json, None)
        print(f"rendering only (no measurement) from {args.json}", flush=True)
        write_docs(data, args.docs)
        return {"run": 0, "skip": 0}
    import torch

    runner = Runner(args)
    threads = torch.get_num_threads()
    if not runner.cuda:
        torch.set_num_threads(1)  # a tiny model gains nothing from threads on a shared CPU
    try:
        runner.run(plan(args))
    finally:
        torch.set_num_threads(threads)
    if args.write_docs:
        write_docs(runner.data, args.docs)
    c = runner.counts
    print(f"done: {c['run']} run ({c.get('ok', 0)} ok, {c.get('oom', 0)} OOM, {c.get('fail', 0)} failed checks, "
          f"{c.get('error', 0)} errors), {c['skip']} skipped; results in {args.json}", flush=True)
    return c


def build_parser(prog: str = "bench_e2e.py") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        counts = run(args)
    except UserError as err:
        print(f"bench_e2e: error: {err}", file=sys.stderr)
        return 2
    return 1 if counts.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
