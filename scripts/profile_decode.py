"""Profile a decode step of the original and of each preset on CUDA, as `linearize bench` times it:
the forward under ``torch.compile(mode="reduce-overhead", fullgraph=True)`` over the static caches
(what ``generate(cache_implementation="static")`` runs), random weights, bf16. Prints, per model, the
ms per step, the CUDA kernels per step, the GPU-busy time (the sum of the kernels' durations) beside
the step's wall time, the kernels by kind (GEMMs, our Triton ops, Inductor's fused kernels) and the
costliest kernels.

    python scripts/profile_decode.py                                    # smollm2-135m, 4K, B=1, all models
    python scripts/profile_decode.py --models lolcats,gdn -T 65536 -B 8
    python scripts/profile_decode.py --variant graph                    # linearize.DecodeGraph instead
    python scripts/profile_decode.py --models original,original+mlp     # the original, its MLPs on the GEMVs

``original+mlp``: a copy of the original whose gated MLPs run a decode step on linearize's decode
GEMVs (``install_decode_mlps``, as every converted model does) with its softmax attention as it is:
the part of a preset's gain over the original that comes from the MLP and not from the attention.
``--variant compiled-graph``: ``linearize.DecodeGraph(..., compile=True)``, the bench's "compiled, graph".

Where the time of a step goes when it is far above its memory floor: a busy time close to the wall
time means slow kernels (the table says which); a busy time well below it means gaps between
kernels (launch-bound: fewer kernels is the lead).
"""
import argparse
import collections
import time

import torch

from linearize.benchmark.measure import Measure, build_original, convert
from linearize.benchmark.plan import PRESETS, Point

KINDS = (  # (kind, test on the kernel's name), first match wins
    ("gemm (cuBLAS)", lambda n: any(s in n.lower() for s in ("gemm", "gemv", "cutlass", "sm90_", "sm80_", "splitk"))),
    ("inductor (fused elementwise / reductions)", lambda n: n.startswith(("triton_poi", "triton_red", "triton_per"))),
    ("linearize ops (Triton)", lambda n: n.startswith("_")),
    ("other", lambda n: True),
)


def kind_of(name: str) -> str:
    return next(k for k, test in KINDS if test(name))


def profile_steps(step, ids, pos, n: int):
    """(kernels by name -> [count, total us], wall ms per step) over n steps under the profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        for _ in range(n):
            step(ids, pos)
        torch.cuda.synchronize()
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False):
            continue
        if e.name.startswith(("Memcpy", "Memset")):
            continue
        rec = by_name[e.name]
        rec[0] += 1
        rec[1] += e.device_time  # us
    return by_name


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2-135m")
    p.add_argument("--models", default="original,original+mlp," + ",".join(PRESETS))
    p.add_argument("-T", type=int, default=4096, help="context length of the step")
    p.add_argument("-B", type=int, default=1)
    p.add_argument("--variant", default="compiled", choices=["compiled", "graph", "compiled-graph"])
    p.add_argument("--steps", type=int, default=100, help="steps timed")
    p.add_argument("--profiled", type=int, default=20, help="steps under the profiler")
    p.add_argument("--rows", type=int, default=12)
    a = p.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    variant = {"compiled": "compiled-static", "graph": "graph-static", "compiled-graph": "compiled-graph"}[a.variant]
    m = Measure(dev, dtype, seed=0, steps=a.steps, prefill_chunk=8192, decode_prefill=1024, check_prompt=96)
    original = build_original(a.shape, 0, a.T + 512, dev, dtype)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {a.shape}, T={a.T}, B={a.B}, bf16, {variant}")
    for name in a.models.split(","):
        if name == "original+mlp":
            import copy

            from linearize.modeling_linearize import install_decode_mlps

            model = copy.deepcopy(original, {id(t): t for t in [*original.parameters(), *original.buffers()]})
            install_decode_mlps(model)
        else:
            model = original if name == "original" else convert(original, name, a.shape, False, dev, dtype)
        pt = Point("decode", a.shape, "original" if name == "original+mlp" else name, variant, a.T, a.B)
        t0 = time.perf_counter()
        step, cache, _ = m.decode_setup(pt, model, a.T + 256)
        ids = torch.randint(0, model.config.vocab_size, (a.B, 1), device=dev)
        pos = torch.full((a.B, 1), a.T, dtype=torch.long, device=dev)
        with torch.no_grad():
            for _ in range(3):  # compile, record, replay
                step(ids, pos)
            torch.cuda.synchronize()
            setup = time.perf_counter() - t0
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(a.steps):
                step(ids, pos)
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / a.steps
            kernels = profile_steps(step, ids, pos, a.profiled)
        n = a.profiled
        count = sum(c for c, _ in kernels.values()) / n
        busy = sum(t for _, t in kernels.values()) / n / 1e3
        print(f"\n== {name}: {ms:.3f} ms/step ({setup:.0f} s to set up); {count:.0f} kernels/step; GPU busy "
              f"{busy:.3f} ms/step ({busy / ms:.0%} of the step), mean kernel {busy / max(count, 1) * 1e3:.2f} us, "
              f"wall per kernel {ms / max(count, 1) * 1e3:.2f} us")
        kinds = collections.defaultdict(lambda: [0, 0.0])
        for kname, (c, t) in kernels.items():
            kinds[kind_of(kname)][0] += c
            kinds[kind_of(kname)][1] += t
        for k, (c, t) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
            print(f"   {k:44s} {c / n:6.1f} kernels  {t / n / 1e3:.3f} ms  ({t / c:.2f} us each)")
        print(f"   {'kernel':80s} {'/step':>6s} {'us each':>8s} {'ms/step':>8s}")
        for kname, (c, t) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:a.rows]:
            print(f"   {kname[:80]:80s} {c / n:6.1f} {t / c:8.2f} {t / n / 1e3:8.3f}")
        del step, cache
        m.forget_compiled()
        if model is not original:
            del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
