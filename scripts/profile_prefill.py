"""Profile a prefill of a converted SmolLM2-shaped model (random weights, bf16) on CUDA, in one call
or in chunks through the state cache as `linearize bench` does: time per call and tokens/s, then the
top GPU ops (torch.profiler) of one timed prefill. Where docs/reports/quality.md's "96% of the GPU time in the
chunk kernel" comes from, and where a slow chunked prefill shows which kernel takes the time.

    python scripts/profile_prefill.py                                   # hedgehog, B=1, 4K, one call
    python scripts/profile_prefill.py --preset lolcats -T 65536 --chunk 8192

``--count-ops`` counts instead of timing, on any device (on CPU under ``TRITON_INTERPRET=1``, so the
layers take the kernel path they take on a GPU): the aten ops that launch work (views and empty
allocations left out), the Triton launches and the host reads that one converted layer runs in a
continuation chunk of a chunked prefill (a call that reads a state), per preset, on the tiny shape by
default:

    TRITON_INTERPRET=1 python scripts/profile_prefill.py --count-ops --preset lolcats -T 128
    python scripts/profile_prefill.py --count-ops --preset gdn -T 8192 --shape smollm2-135m   # on a GPU

What it cannot see: the aten ops inside a ``linearize::`` op (one node each; their Triton launches
are counted), and on CPU an op that CUDA runs as one fused kernel but the CPU decomposes
(``F.rms_norm``) counts as its parts.
"""
import argparse
import collections
import contextlib
import os
import time

import torch
import torch.utils._python_dispatch
from transformers import LlamaConfig, LlamaForCausalLM

import linearize
from linearize.benchmarks.measure import prefill
from linearize.benchmarks.plan import PRESETS, preset_config


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="hedgehog", choices=list(PRESETS))
    p.add_argument("-T", type=int, default=4096, help="prompt tokens")
    p.add_argument("-B", type=int, default=1, help="batch")
    p.add_argument("--chunk", type=int, default=0, help="tokens per call through the cache (0: one call)")
    p.add_argument("--rows", type=int, default=15, help="rows of the profiler table")
    p.add_argument("--graph", action="store_true",
                   help="with --chunk: replay one captured chunk (linearize.PrefillGraph over a StaticLinearizeCache), "
                        "as the bench's 'chunked, graph' column")
    p.add_argument("--python-profile", type=int, default=0, metavar="N",
                   help="also run one prefill under cProfile and print its N costliest Python functions")
    p.add_argument("--count-ops", action="store_true",
                   help="count the ops per converted layer in a continuation chunk of -T tokens (no timing)")
    p.add_argument("--shape", default=None, help="--count-ops: model shape (default tiny; smollm2-135m as timed)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="--count-ops: model dtype")
    a = p.parse_args()
    if a.count_ops:
        counts = count_prefill_ops(a.preset, T=a.T, B=a.B, shape=a.shape or "tiny", dtype=getattr(torch, a.dtype))
        print(format_counts(a.preset, a.T, a.B, counts))
        return

    cfg = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      head_dim=64, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                      max_position_embeddings=max(131072, a.T))
    m = LlamaForCausalLM(cfg).cuda().bfloat16().eval()
    linearize.linearize(m, preset_config(a.preset, "smollm2-135m"))
    ids = torch.randint(0, cfg.vocab_size, (a.B, a.T), device="cuda")

    if a.graph and a.chunk:
        cache = linearize.StaticLinearizeCache(m.config, max_batch_size=a.B, max_cache_len=a.T, device="cuda",
                                               dtype=torch.bfloat16)
        graph = linearize.PrefillGraph(m, cache, a.B, a.chunk)

        def run():
            cache.reset()
            graph(ids)
    else:
        def run():
            with torch.no_grad():
                prefill(m, ids, linearize.LinearizeCache(m.config), chunk=a.chunk or None)

    run()  # warm-up (compiles the kernels)
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        s = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - s)
    best = min(times)
    print(f"{a.preset} B={a.B} T={a.T} chunk={a.chunk or 'one call'}{' (graph)' if a.graph and a.chunk else ''}: {best * 1e3:.1f} ms, "
          f"{a.B * a.T / best:,.0f} tok/s", flush=True)

    if a.python_profile:  # where the host time goes (a CPU-bound chunked prefill): Python functions by own time
        import cProfile
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        run()
        torch.cuda.synchronize()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(a.python_profile)
        pstats.Stats(pr).sort_stats("cumulative").print_stats(a.python_profile)

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=a.rows, max_name_column_width=70))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=8, max_name_column_width=70))


# ops that launch no device work: metadata, views and allocations (aten ops seen by a dispatch mode,
# i.e. after autograd and the composite decompositions, as the device backend gets them)
_FREE = {"empty", "empty_strided", "empty_like", "new_empty", "_unsafe_view", "new_empty_strided", "detach", "alias",
         "lift_fresh", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "result_type"}
_HOST_READS = {"_local_scalar_dense", "item", "equal", "is_nonzero", "nonzero"}


class OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts, per label, the aten ops that launch device work, the custom ops (``linearize::*``, each
    one node whatever it runs inside) and the ops that read a value on the host (a CPU-GPU sync on
    CUDA). ``label`` is set by the caller (the converted layer running now); None counts nothing."""

    def __init__(self):
        super().__init__()
        self.label = None
        self.ops = collections.defaultdict(collections.Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.label is not None:
            ns, name = func.namespace, func._schema.name.split("::")[-1]
            if ns != "aten":
                self.ops[self.label][f"{ns}::{name}"] += 1
            elif name in _HOST_READS:
                self.ops[self.label][f"host::{name}"] += 1
            elif not func.is_view and name not in _FREE:
                self.ops[self.label][f"aten::{name}"] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_triton_launches(counter: OpCounter):
    """Adds ``triton::<kernel>`` to ``counter`` for every launch (compiled or interpreted)."""
    import triton.runtime.jit as jit

    classes = [jit.JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction
        classes.append(InterpretedFunction)
    except ImportError:  # pragma: no cover
        pass
    saved = {c: c.run for c in classes}

    def wrap(run):
        def counted(self, *args, **kwargs):
            label = counter.label
            if label is not None and not kwargs.get("warmup", False):
                counter.ops[label][f"triton::{self.__name__}"] += 1
            counter.label = None  # the interpreter's own copies of the arguments are no device work
            try:
                return run(self, *args, **kwargs)
            finally:
                counter.label = label
        return counted

    for c in classes:
        c.run = wrap(saved[c])
    try:
        yield
    finally:
        for c, run in saved.items():
            c.run = run


def tiny_converted(preset: str, shape: str = "tiny", dtype=torch.bfloat16, seed: int = 0):
    """A converted model of ``shape`` (benchmarks/plan.py's SHAPES) from random weights, in eval mode, on
    the GPU if there is one."""
    from linearize.benchmarks.plan import SHAPES

    torch.manual_seed(seed)
    cfg = LlamaConfig(**SHAPES[shape], initializer_range=0.2, max_position_embeddings=1 << 17)
    m = LlamaForCausalLM(cfg).to(device="cuda" if torch.cuda.is_available() else "cpu", dtype=dtype).eval()
    # the tiny shape takes --smoke's window (8): the preset's 256 keys would cover a test's whole context
    linearize.linearize(m, preset_config(preset, shape, smoke=shape == "tiny"))
    return m


def count_prefill_ops(preset: str, T: int = 128, B: int = 1, shape: str = "tiny", dtype=torch.bfloat16,
                      model=None) -> dict[str, collections.Counter]:
    """The ops each converted layer runs in a continuation chunk: a first call of T tokens fills a
    ``LinearizeCache``, a second one warms what the layers cache (as the 2nd..8th chunks of a long
    prefill find it), then the third call of T tokens is counted, layer by layer (forward hooks).
    Returns {layer name: Counter(op -> calls)}."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--count-ops on CPU needs TRITON_INTERPRET=1 (the layers then take the kernel path "
                         "they take on a GPU)")
    from linearize.layers import ConvertedAttention

    m = tiny_converted(preset, shape, dtype) if model is None else model
    dev = next(m.parameters()).device
    ids = torch.randint(0, m.config.vocab_size, (B, 3 * T), device=dev)
    counter = OpCounter()
    hooks = []
    for name, mod in m.named_modules():
        if isinstance(mod, ConvertedAttention):
            hooks.append(mod.register_forward_pre_hook(lambda mod, args, name=name: setattr(counter, "label", name)))
            hooks.append(mod.register_forward_hook(lambda mod, args, out: setattr(counter, "label", None)))
    cache = linearize.LinearizeCache(m.config)
    try:
        with torch.no_grad():
            prefill(m, ids[:, :2 * T], cache, chunk=T)
            with counter, count_triton_launches(counter):
                prefill(m, ids[:, 2 * T:], cache)
    finally:
        for h in hooks:
            h.remove()
    return dict(counter.ops)


def format_counts(preset: str, T: int, B: int, counts: dict[str, collections.Counter]) -> str:
    """A per-layer summary (mean over the converted layers) and the ops of the first one."""
    n = max(len(counts), 1)
    total = collections.Counter()
    for c in counts.values():
        total.update(c)
    kinds = collections.Counter()
    for op, k in total.items():
        kinds[op.split("::")[0]] += k
    lines = [f"{preset} B={B} continuation chunk T={T}: per converted layer ({n} layers): "
             f"{sum(total.values()) / n:.0f} ops = {kinds['aten'] / n:.0f} aten + {kinds['triton'] / n:.0f} "
             f"triton launches + {kinds['linearize'] / n:.0f} linearize ops + {kinds['host'] / n:.0f} host reads"]
    for op, k in sorted(total.items(), key=lambda kv: (-kv[1], kv[0])):
        lines.append(f"  {k / n:5.1f}  {op}")
    return "\n".join(lines)


def per_layer(counts: dict[str, collections.Counter], kind: str | None = None) -> float:
    """Mean ops per converted layer (of one kind: aten, triton, linearize, host; None: all)."""
    n = max(len(counts), 1)
    return sum(k for c in counts.values() for op, k in c.items() if kind is None or op.startswith(kind + "::")) / n


if __name__ == "__main__":
    main()
