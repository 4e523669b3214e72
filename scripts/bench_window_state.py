"""The window hybrid from a cached state on the kernels: correctness and timing on a GPU.

Decode (T=1): ``window_decode`` (one kernel, ring and state in place) against the PyTorch path the
layer ran before (the buffer rebuilt with torch.cat, ``linear_attention(..., prefix=W-1)``); and the
LoLCATs layer's fused step ``fused_window_decode_hedgehog`` (Hedgehog features, GQA and the window
weight inside the kernel) against the same glue in PyTorch followed by ``window_decode``.
Chunked prefill: ``window_prefill`` on one chunk against the one-call window kernels on the same
number of tokens. SmolLM2-135M attention shape (H=9, D=64, Hedgehog F=64), W=64, bf16 inputs.
Writes docs/window_state.md and prints it.  ``--smoke``: tiny shapes on the CPU (TRITON_INTERPRET=1).

    python scripts/bench_window_state.py            # on the GPU, about a minute
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch


def timed(fn, iters, cuda):
    fn()
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


def case(B, T, H, D, F, W, dev, dt, g):
    r = lambda *s: torch.randn(*s, generator=g).to(dev)  # noqa: E731
    W1 = W - 1
    c = dict(q_sm=r(B, T, H, D).to(dt), qf=torch.softmax(r(B, T, H, F), -1), k_sm=r(B, T, H, D).to(dt),
             kf=torch.softmax(r(B, T, H, F), -1), v=r(B, T, H, D).to(dt),
             log_g=-torch.rand(B, T, H, generator=g).to(dev) * 0.1, valid=None,
             gamma=torch.rand(H, generator=g).to(dev) + 0.5, sm_scale=D ** -0.5)
    ring = {"k": r(B, W1, H, D).to(dt), "phi_k": torch.softmax(r(B, W1, H, F), -1), "v": r(B, W1, H, D).to(dt),
            "log_g": -torch.rand(B, W1, H, generator=g).to(dev) * 0.1, "valid": torch.ones(B, W1, device=dev)}
    state = (torch.rand(B, H, F, D, generator=g).to(dev), torch.rand(B, H, F, generator=g).to(dev))
    return c, ring, state


def hedgehog_case(B, H, Hkv, D, W, dev, dt, g):
    """Raw q, k, v (k and v with Hkv heads), Hedgehog weights (F = 2D), ring and state: the fused step's inputs."""
    r = lambda *s: torch.randn(*s, generator=g).to(dev)  # noqa: E731
    W1, F = W - 1, 2 * D
    ring = {"k": r(B, W1, H, D).to(dt), "phi_k": torch.softmax(r(B, W1, H, F), -1), "v": r(B, W1, H, D).to(dt),
            "log_g": torch.zeros(B, W1, H, device=dev), "valid": torch.ones(B, W1, device=dev)}
    return dict(q=r(B, 1, H, D).to(dt), k=r(B, 1, Hkv, D).to(dt), v=r(B, 1, Hkv, D).to(dt),
                wq=(r(H, D, D) * 0.2).to(dt), wk=(r(H, D, D) * 0.2).to(dt), log_gamma=r(H) * 0.1, ring=ring,
                state=(torch.rand(B, H, F, D, generator=g).to(dev), torch.rand(B, H, F, generator=g).to(dev)),
                pos=torch.tensor(1000 if dev == "cuda" else 7, device=dev))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    ap.add_argument("--out", default="docs/window_state.md")
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from linearize.attention import linear_attention
    from linearize.kernels.linear_attn import (chunk_linear_attn, fused_window_decode_hedgehog, window_decode,
                                               window_decode_hedgehog_ref, window_decode_ref, window_prefill)

    cuda = not args.smoke
    dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    H, D, F, W = (9, 64, 64, 64) if cuda else (2, 16, 16, 5)
    iters = 200 if cuda else 2
    g = torch.Generator().manual_seed(0)
    rows = ["| what | B | T | kernel ms | PyTorch / reference ms | speed-up | max abs err |", "|---|---|---|---|---|---|---|"]
    for B in (1, 8) if cuda else (1,):
        c, ring, state = case(B, 1, H, D, F, W, dev, dt, g)
        pos = torch.tensor(1000 if cuda else 7, device=dev)
        o_ref, _, _ = window_decode_ref(**c, ring=ring, state=state, pos=pos)
        ring_k, st_k = {n: t.clone() for n, t in ring.items()}, tuple(x.clone() for x in state)
        o = window_decode(**c, ring=ring_k, state=st_k, pos=pos)
        err = (o.float() - o_ref.float()).abs().max().item()
        order = (pos + torch.arange(W - 1, device=dev)) % (W - 1)

        def torch_step():  # what the layer ran before: the buffer rebuilt, the PyTorch math
            buf = {n: t.index_select(1, order) for n, t in ring.items()}
            cat = lambda a, b: torch.cat([a.to(b.dtype), b], 1)  # noqa: E731
            return linear_attention(c["qf"], cat(buf["phi_k"], c["kf"]), cat(buf["v"], c["v"]),
                                    log_g=cat(buf["log_g"], c["log_g"]), initial_state=state,
                                    key_valid=torch.cat([buf["valid"] > 0, torch.ones(B, 1, dtype=torch.bool, device=dev)], 1),
                                    window=W, q_sm=c["q_sm"], k_sm=cat(buf["k"], c["k_sm"]), sm_scale=c["sm_scale"],
                                    window_weight=c["gamma"], prefix=W - 1)

        os.environ["LINEARIZE_KERNELS"] = "torch"
        t_torch = timed(torch_step, iters, cuda)
        os.environ.pop("LINEARIZE_KERNELS")
        t_kernel = timed(lambda: window_decode(**c, ring=ring_k, state=st_k, pos=pos), iters, cuda)
        rows.append(f"| decode | {B} | 1 | {t_kernel:.4f} | {t_torch:.4f} | {t_torch / t_kernel:.1f}x | {err:.2e} |")

        # the layer's whole decode step between RoPE and out_proj: Hedgehog features (F = 2D, the preset's),
        # GQA (3 kv heads) and exp(log gamma) inside one kernel, against that glue in PyTorch + window_decode
        fused_args = hedgehog_case(B, H, 3 if H % 3 == 0 else 1, D, W, dev, dt, g)
        f_ring = {n: t.clone() for n, t in fused_args["ring"].items()}
        f_state = tuple(x.clone() for x in fused_args["state"])
        o_ref, _, _ = window_decode_hedgehog_ref(**fused_args, sm_scale=c["sm_scale"])
        o = fused_window_decode_hedgehog(**{**fused_args, "ring": f_ring, "state": f_state}, sm_scale=c["sm_scale"])
        err = (o.float() - o_ref.float()).abs().max().item()

        def unfused_step():
            a = fused_args
            rep = H // a["k"].shape[2]
            k, v = a["k"].repeat_interleave(rep, dim=2), a["v"].repeat_interleave(rep, dim=2)
            def phi(x, w):  # linearize.feature_maps.Hedgehog in fp32, as the layer runs it
                y = torch.einsum("bthd,hdp->bthp", x.float(), w.float())
                return torch.softmax(torch.cat([y, -y], -1), -1)

            return window_decode(a["q"], phi(a["q"], a["wq"]), k, phi(k, a["wk"]), v, log_g=None, ring=f_ring,
                                 state=f_state, pos=pos, gamma=torch.exp(a["log_gamma"].float()), sm_scale=c["sm_scale"])

        t_glue = timed(unfused_step, iters, cuda)
        t_fused = timed(lambda: fused_window_decode_hedgehog(**{**fused_args, "ring": f_ring, "state": f_state},
                                                             sm_scale=c["sm_scale"]), iters, cuda)
        rows.append(f"| decode, Hedgehog F={2 * D} + GQA fused (vs features in PyTorch + window_decode) | {B} | 1 "
                    f"| {t_fused:.4f} | {t_glue:.4f} | {t_glue / t_fused:.1f}x | {err:.2e} |")

        T = 8192 if cuda else 24
        c, ring, state = case(B, T, H, D, F, W, dev, dt, g)
        kw = {n: c[n] for n in ("log_g", "valid", "gamma", "sm_scale")}
        t_chunk = timed(lambda: window_prefill(c["q_sm"], c["qf"], c["k_sm"], c["kf"], c["v"], buf=ring, state=state, **kw),
                        max(iters // 20, 1), cuda)
        one = lambda: chunk_linear_attn(c["qf"].to(dt), c["kf"].to(dt), c["v"], log_g=c["log_g"], window=W,  # noqa: E731
                                        q_sm=c["q_sm"], k_sm=c["k_sm"], sm_scale=c["sm_scale"],
                                        window_weight=c["gamma"], output_final_state=True)
        t_one = timed(one, max(iters // 20, 1), cuda)
        rows.append(f"| prefill chunk from state vs one call (no state) | {B} | {T} | {t_chunk:.3f} | {t_one:.3f} "
                    f"| {t_one / t_chunk:.2f}x | |")
    device = torch.cuda.get_device_name() if cuda else "CPU (interpreter, smoke)"
    text = (f"# Window hybrid from a cached state\n\n{device}, H={H}, D={D}, F={F}, W={W}, {dt}. "
            "Generated by scripts/bench_window_state.py.\n\n" + "\n".join(rows) + "\n")
    if not args.smoke:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
