"""The decode kernels of the three converted layer types at the benchmark shapes: one token per call, as
a converted layer's decode step runs them, over how many value columns each program owns (``BLOCK_V``:
a batch-1 step has one program per head, far fewer than the GPU's SMs; splitting the state's columns
over several programs per head shortens each program's critical path) and how many warps run each
program. The window op keeps one program per head (every program of a head reads the ring entries it
overwrites): only its warps vary. bf16, in one process on one GPU.

Each figure is the time per call of 30 calls (a model's layers) captured in one CUDA graph, as a
decode step replays them, the median of ``triton.testing.do_bench_cudagraph``. The floor is the bytes
a call must move (the float32 state read and written, the window's ring read, the feature maps'
weights) over the measured copy bandwidth; "kernels" counts the launches per call (the recurrent op
split adds a copy of z; Gated DeltaNet always runs a second kernel for its conv cache, which also
applies the output norm when the columns are split).

    python scripts/bench_decode_kernels.py --out docs/decode_kernels.md
"""
import argparse
import datetime
import importlib

import torch

from bench_decode_linear import bandwidth, per_call_us  # (scripts/ is on sys.path)
from linearize.benchmark.plan import SHAPES

CALLS = 30
WINDOW = 64  # the lolcats preset's
CONV = 4  # Gated DeltaNet's short conv width


def cases(shape: str, B: int, dev: str = "cuda"):
    """(op name, one call of the op, bytes a call must move, the op's kernel module) for one shape and
    batch; the calls advance their states in place."""
    from linearize.kernels.gated_delta import fused_gated_delta_decode, gated_delta_decode_columns
    from linearize.kernels.linear_attn import fused_recurrent_hedgehog, fused_window_decode_hedgehog

    s = SHAPES[shape]
    H, Hkv, D = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
    P, F, dt = D, 2 * D, torch.bfloat16  # Hedgehog: feature_dim = head_dim, F = 2P features
    r = lambda *shape_, dtype=dt: torch.randn(*shape_, device=dev, dtype=dtype)  # noqa: E731
    q, k, v = r(B, 1, H, D), r(B, 1, Hkv, D), r(B, 1, Hkv, D)
    wq, wk = r(H, D, P) * 0.1, r(H, D, P) * 0.1
    cos, sin = torch.ones(1, 1, D, device=dev, dtype=dt), torch.zeros(1, 1, D, device=dev, dtype=dt)
    S, z = torch.rand(B, H, F, D, device=dev), torch.rand(B, H, F, device=dev)
    out = []

    state_bytes = 2 * 4 * B * H * (F * D + F)
    weights = 2 * H * D * P * 2
    out.append(("hedgehog (recurrent_hedgehog)",
                lambda: fused_recurrent_hedgehog(q, k, v, wq, wk, state=(S, z), cos=cos, sin=sin),
                state_bytes + weights, "linearize.kernels.linear_attn.recurrent"))
    W1 = WINDOW - 1
    ring = {"k": r(B, W1, H, D), "phi_k": torch.rand(B, W1, H, F, device=dev), "v": r(B, W1, H, D),
            "log_g": torch.zeros(B, W1, H, device=dev), "valid": torch.ones(B, W1, device=dev)}
    log_gamma, pos = torch.zeros(H, device=dev), torch.tensor(1000, device=dev)
    ring_bytes = B * W1 * H * (2 * D * 2 + 4 * F + 4) + 4 * B * W1
    out.append(("lolcats (window_decode_hedgehog, W=64)",
                lambda: fused_window_decode_hedgehog(q, k, v, wq, wk, ring=ring, state=(S, z), pos=pos,
                                                     log_gamma=log_gamma, sm_scale=D ** -0.5, cos=cos, sin=sin),
                state_bytes + weights + ring_bytes, "linearize.kernels.linear_attn.window_decode"))
    widths = {"q_proj": H * D, "k_proj": Hkv * D, "v_proj": Hkv * D, "a_proj": H, "b_proj": H, "o_gate": H * D}
    cols = gated_delta_decode_columns(widths, qkv=("q_proj", "k_proj", "v_proj"), per_head=False, num_heads=H,
                                      num_kv_heads=Hkv, head_dim=D)
    y = r(B, 1, sum(widths.values()))
    C = (H + 2 * Hkv) * D
    gdn = dict(cols=cols, num_heads=H, num_kv_heads=Hkv, head_dim=D, state=torch.randn(B, H, D, D, device=dev) * 0.1,
               A_log=torch.zeros(H, device=dev), dt_bias=torch.zeros(H, device=dev),
               norm_weight=torch.ones(D, device=dev), norm_mix=torch.full((H,), 0.5, device=dev),
               conv_state=r(B, C, CONV), conv_weight=torch.randn(C, CONV, device=dev) * 0.3, cos=cos, sin=sin)
    out.append(("gdn (gated_delta_decode, conv 4)", lambda: fused_gated_delta_decode(y, **gdn),
                2 * 4 * B * H * D * D + 2 * 2 * B * C * CONV, "linearize.kernels.gated_delta.decode"))
    return out


def window_before_case(path: str, shape: str, B: int, dev: str = "cuda"):
    """``--window-before FILE``: an older ``window_decode.py``'s kernel, launched through its own
    ``_launch`` on the lolcats case's inputs (its op registrations are left out: they would replace the
    current module's ``linearize::window_decode*`` ops for the whole process)."""
    import pathlib

    from older_kernels import load_prefix

    mod = load_prefix(path, "linearize.kernels.linear_attn._window_decode_before", "linearize.kernels.linear_attn",
                      "_MUTATES = ")
    s = SHAPES[shape]
    H, Hkv, D = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
    F, dt, W1 = 2 * D, torch.bfloat16, WINDOW - 1
    r = lambda *shape_, dtype=dt: torch.randn(*shape_, device=dev, dtype=dtype)  # noqa: E731
    q, k, v = r(B, 1, H, D), r(B, 1, Hkv, D), r(B, 1, Hkv, D)
    wq, wk = r(H, D, D) * 0.1, r(H, D, D) * 0.1
    cos, sin = torch.ones(1, 1, D, device=dev, dtype=dt), torch.zeros(1, 1, D, device=dev, dtype=dt)
    S, z = torch.rand(B, H, F, D, device=dev), torch.rand(B, H, F, device=dev)
    ring = {"k": r(B, W1, H, D), "phi_k": torch.rand(B, W1, H, F, device=dev), "v": r(B, W1, H, D),
            "log_g": torch.zeros(B, W1, H, device=dev), "valid": torch.ones(B, W1, device=dev)}
    log_gamma, pos = torch.zeros(H, device=dev), torch.tensor(1000, device=dev, dtype=torch.int64)

    def call():
        return mod._launch(q, None, k, None, v, wq, wk, None, None, ring["k"], ring["phi_k"], ring["v"],
                           ring["log_g"], ring["valid"], S, z, pos, log_gamma, D ** -0.5, 0.0, log_gamma=True,
                           cos=cos, sin=sin)

    return (f"lolcats (window_decode_hedgehog, W=64), before: {pathlib.Path(path).name}", call, None,
            "linearize.kernels.linear_attn.window_decode")


def block_knob(module) -> str | None:
    """The module attribute that sets its op's value-column block: ``BLOCK_V``, or for the recurrent op
    its tile ``MAX_TILE`` (its block is min(DV, MAX_TILE // F)); None for an op without one (window)."""
    return next((n for n in ("BLOCK_V", "MAX_TILE") if hasattr(module, n)), None)


def set_block_v(module, knob: str, bv: int | None, default):
    """Set the op's block to ``bv`` columns (None: ``default``, the module's own setting)."""
    if bv is None:
        setattr(module, knob, default)
    else:
        setattr(module, knob, bv if knob == "BLOCK_V" else bv * 128)  # F = 128 at head dim 64


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="write the table here (markdown)")
    p.add_argument("--shapes", default="smollm2-135m,llama-3.2-1b")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--blocks", default="auto,64,32,16", help="value columns per program ('auto': the op's rule)")
    p.add_argument("--warps", default="auto", help="warps per program to sweep ('auto': the op's rule)")
    p.add_argument("--window-before", default=None, metavar="FILE",
                   help="also time an older window_decode.py's kernel on the lolcats case, in this process")
    a = p.parse_args()
    bw = bandwidth()
    rows = []
    with torch.no_grad():
        for shape in a.shapes.split(","):
            for B in (int(b) for b in a.batches.split(",")):
                todo = cases(shape, B)
                if a.window_before:  # the older kernel moves the lolcats case's bytes
                    name, fn, _, modname = window_before_case(a.window_before, shape, B)
                    todo.append((name, fn, next(n for nm, _, n, _ in todo if nm.startswith("lolcats")), modname))
                for name, fn, nbytes, modname in todo:
                    mod = importlib.import_module(modname)
                    knob = block_knob(mod)
                    saved = getattr(mod, knob) if knob else None
                    blocks = a.blocks.split(",") if knob else ["auto"]
                    for blk in blocks:  # the window op has no column split (its ring entries are shared)
                        if knob:
                            set_block_v(mod, knob, None if blk == "auto" else int(blk), saved)
                        for warps in a.warps.split(","):
                            mod.NUM_WARPS = None if warps == "auto" else int(warps)
                            kernels = count_kernels(fn)
                            us = per_call_us(fn, CALLS)
                            rows.append((shape, B, name, blk, warps, kernels, us, nbytes / bw * 1e6))
                            print(rows[-1], flush=True)
                        mod.NUM_WARPS = None
                    if knob:
                        setattr(mod, knob, saved)
    lines = [
        "## Decode kernels: value columns per program",
        "",
        f"Written by `scripts/bench_decode_kernels.py` on {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; "
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}; bf16, one token per call; copy bandwidth "
        f"{bw / 1e9:,.0f} GB/s. Microseconds per call, {CALLS} calls replayed in one CUDA graph. Block "
        "'auto' is what the op picks; the recurrent op's block is set through its tile size.",
        "",
        "| shape | B | op | value columns per program | warps | kernels per call | us per call | floor us |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for shape, B, name, blk, warps, kernels, us, floor in rows:
        lines.append(f"| {shape} | {B} | {name} | {blk} | {warps} | {kernels} | {us:.2f} | {floor:.2f} |")
    md = "\n".join(lines) + "\n"
    print(md)
    if a.out:
        open(a.out, "w").write(md)


def count_kernels(fn) -> int:
    """CUDA kernels one call launches (the profiler's count)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


if __name__ == "__main__":
    main()
