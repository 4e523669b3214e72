"""A decode step's projections: cuBLAS (``F.linear``, what the compiled step runs) beside the decode
GEMVs of kernels/decode_linear.py, on the two benchmark shapes, 1 and 8 rows, bf16, in one process on
one GPU. Each figure is the time per call of 50 calls captured in one CUDA graph (as a decode step
replays them: no launch cost from the host), the median of ``triton.testing.do_bench_cudagraph``;
the floor is the weight's bytes over the measured copy bandwidth.

    python scripts/bench_decode_linear.py --out docs/decode_linear.md
"""
import argparse
import datetime

import torch
import torch.nn.functional as F

from linearize.benchmark.plan import SHAPES
from linearize.kernels.decode_linear import decode_gated, decode_linear

CALLS = 50


def per_call_us(fn, calls: int = CALLS) -> float:
    """Microseconds per call of ``fn``, ``calls`` calls replayed in one CUDA graph (median)."""
    import triton.testing

    def many():
        for _ in range(calls):
            fn()

    return triton.testing.do_bench_cudagraph(many, rep=200) * 1e3 / calls


def projections(shape: str) -> list[tuple[str, int, int, bool]]:
    """A decode step's projections of a benchmark shape: (name, N, K, gated)."""
    s = SHAPES[shape]
    hid, I = s["hidden_size"], s["intermediate_size"]
    qkv = (s["num_attention_heads"] + 2 * s["num_key_value_heads"]) * s["head_dim"]
    return [("q|k|v (fused)", qkv, hid, False), ("o", hid, s["num_attention_heads"] * s["head_dim"], False),
            ("gate, up -> silu(gate) * up", I, hid, True), ("down", hid, I, False)]


def bandwidth() -> float:
    x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    import triton.testing

    ms = triton.testing.do_bench(lambda: y.copy_(x), rep=100)
    return 2 * x.numel() / ms / 1e-3  # bytes/s


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="write the table here (markdown)")
    p.add_argument("--sweep", action="store_true", help="time tile configurations per projection (prints only)")
    p.add_argument("--sweep-early", action="store_true",
                   help="with PDL: time the one-block early-weight path (EARLY_MAX_K, EARLY_WARPS) against the "
                        "looped one, per projection (prints only)")
    a = p.parse_args()
    if a.sweep:
        return sweep()
    if a.sweep_early:
        return sweep_early()
    dt, dev = torch.bfloat16, "cuda"
    bw = bandwidth()
    rows = []
    for shape in ("smollm2-135m", "llama-3.2-1b"):
        for name, N, K, gated in projections(shape):
            w = torch.randn(N, K, device=dev, dtype=dt) / K ** 0.5
            w2 = torch.randn(N, K, device=dev, dtype=dt) / K ** 0.5
            for M in (1, 8):
                x = torch.randn(M, K, device=dev, dtype=dt)
                if gated:
                    ref = F.silu(F.linear(x, w)) * F.linear(x, w2)
                    got = decode_gated(x, w, w2)
                    base = per_call_us(lambda: (F.linear(x, w), F.linear(x, w2)))
                    ours = per_call_us(lambda: decode_gated(x, w, w2))
                    nbytes = 2 * w.numel() * w.element_size()
                else:
                    ref, got = F.linear(x, w), decode_linear(x, w)
                    base = per_call_us(lambda: F.linear(x, w))
                    ours = per_call_us(lambda: decode_linear(x, w))
                    nbytes = w.numel() * w.element_size()
                err = float((got.float() - ref.float()).norm() / ref.float().norm())
                rows.append((shape, name, N, K, M, base, ours, nbytes / bw * 1e6, err))
                print(rows[-1], flush=True)
    lines = [
        "## Decode projections: cuBLAS beside the decode GEMVs",
        "",
        f"Written by `scripts/bench_decode_linear.py` on {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; "
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}; bf16; copy bandwidth {bw / 1e9:,.0f} GB/s. "
        f"Microseconds per call, {CALLS} calls replayed in one CUDA graph. cuBLAS for the gated row: its two "
        "GEMMs (the compiled step adds a fused SiLU-and-product kernel, ~1.1 us, not counted here).",
        "",
        "| shape | projection | N | K | rows | cuBLAS us | decode GEMV us | speed-up | floor us | rel. diff |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for shape, name, N, K, M, base, ours, floor, err in rows:
        lines.append(f"| {shape} | {name} | {N} | {K} | {M} | {base:.2f} | {ours:.2f} | {base / ours:.2f}x | "
                     f"{floor:.2f} | {err:.1e} |")
    md = "\n".join(lines) + "\n"
    print(md)
    if a.out:
        open(a.out, "w").write(md)


def sweep():
    """Each projection of both shapes at 1 row under (BN, BK, warps, stages) configurations."""
    import linearize.kernels.decode_linear as dl

    default = dl._config
    dt = torch.bfloat16
    for shape in ("smollm2-135m", "llama-3.2-1b"):
        for _, N, K, gated in projections(shape):
            w = torch.randn(N, K, device="cuda", dtype=dt)
            w2 = torch.randn(N, K, device="cuda", dtype=dt)
            x = torch.randn(1, K, device="cuda", dtype=dt)
            res = []
            for BN in (16, 32, 64):
                for BK in (128, 256, 512):
                    for warps, stages in ((4, 3), (8, 3)):
                        dl._config = lambda *_, c=(BN, BK, warps, stages): c
                        try:
                            us = per_call_us((lambda: decode_gated(x, w, w2)) if gated else (lambda: decode_linear(x, w)))
                        except Exception as e:  # noqa: BLE001 - a config that does not compile
                            print("skip", BN, BK, warps, stages, type(e).__name__)
                            continue
                        res.append((us, BN, BK, warps, stages))
            dl._config = default
            us_def = per_call_us((lambda: decode_gated(x, w, w2)) if gated else (lambda: decode_linear(x, w)))
            res.sort()
            print(f"{shape} N={N} K={K} gated={gated}: default {us_def:.2f} us; best", res[:4], flush=True)


def sweep_early():
    """Each projection of both shapes at 1 row, per call: PDL off, PDL on, and PDL on with the weight
    marked ready (a parameter: its first K block read before the wait). LINEARIZE_PDL is read at
    each launch and every figure captures its own graph, so one process compares the three."""
    import os

    dt = torch.bfloat16
    for shape in ("smollm2-135m", "llama-3.2-1b"):
        for _, N, K, gated in projections(shape):
            w, w2 = (torch.randn(N, K, device="cuda", dtype=dt) / K ** 0.5 for _ in range(2))
            x = torch.randn(1, K, device="cuda", dtype=dt)
            res = {}
            for name, env, ready in (("off", "0", False), ("on", "1", False), ("on, ready", "1", True)):
                os.environ["LINEARIZE_PDL"] = env
                res[name] = round(per_call_us((lambda: decode_gated(x, w, w2, weight_ready=ready)) if gated else
                                              (lambda: decode_linear(x, w, weight_ready=ready))), 2)
            os.environ.pop("LINEARIZE_PDL")
            print(f"{shape} N={N} K={K} gated={gated}: us per call, PDL {res}", flush=True)


if __name__ == "__main__":
    main()
