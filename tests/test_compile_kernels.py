"""The window op's and the per-channel gate op's Triton kernels compile for an H100/H200 (sm_90) on this
CPU machine.

The interpreter (TRITON_INTERPRET=1, tests/test_kernels_*.py) runs a kernel's body as Python, so what
only Triton's compiler checks first fails on a GPU: a loop-carried variable that changes shape, a dot
with a side below 16, a branch on a value that is not constexpr. Each case records the launches of the
op's own host code (``window_fwd`` and ``window_bwd`` on CPU tensors, ``launch`` replaced), so the
signatures and compile-time constants are the ones a GPU run launches, and compiles them to a cubin with
the ptxas bundled in Triton's wheel. Not under the interpreter: there ``@triton.jit`` builds no AST to
compile (this file is not a ``test_kernels_*`` one for that reason).
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("the interpreter builds no compilable kernels", allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from linearize.kernels.linear_attn import window  # noqa: E402

TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32", torch.int64: "i64"}


def recorded_launches(monkeypatch, **op) -> list[tuple]:
    """(kernel, positional args, keyword args) of each launch of the window op's forward and backward."""
    calls = []
    monkeypatch.setattr(window, "launch", lambda kernel, grid, *args, **kw: calls.append((kernel, args, kw)))
    dt, W, sinks, packed = op["dtype"], op["window"], op["sinks"], op["packed"]
    g = torch.Generator().manual_seed(0)
    lens = [300, 212]
    TT, H, D = sum(lens), 9, 64
    q, k, v, do = (torch.randn(TT, H, D, generator=g).to(dt) for _ in range(4))
    n, d = torch.randn(TT, H, D, generator=g), torch.rand(TT, H, generator=g)
    gamma = torch.ones(H)
    lin_idx = torch.arange(TT, dtype=torch.int32)
    cu = torch.tensor([0, lens[0], TT], dtype=torch.int32)
    q_lo = torch.cat([torch.zeros(100, dtype=torch.int32), torch.full((200,), 100, dtype=torch.int32),
                      torch.zeros(lens[1], dtype=torch.int32)]) if packed else None
    o, den, mx, arg = window.window_fwd(q, k, v, n, d, gamma, lin_idx, cu, max(lens), W, 0.125, q_lo=q_lo, sinks=sinks)
    window.window_bwd(q, k, v, n, d, gamma, lin_idx, cu, max(lens), W, 0.125, o, den, mx, arg.zero_(), do,
                      q_lo=q_lo, sinks=sinks)
    return calls


def compile_for_sm90(kernel, args, kwargs):
    """Compile one recorded launch: tensors become pointers of their dtype, the kernel's constexpr
    parameters, the keyword constants and None arguments become constants, ints and floats scalars."""
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    constexprs, signature = dict(kwargs), {}
    for p, a in zip(kernel.params, args):
        if p.is_constexpr or a is None:
            constexprs[p.name] = a
        elif isinstance(a, torch.Tensor):
            signature[p.name] = "*" + TYPES[a.dtype]
        else:
            signature[p.name] = "fp32" if isinstance(a, float) else "i32"
    signature.update({name: "constexpr" for name in constexprs})
    return triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32), options=options)


@pytest.mark.parametrize("op", [
    # lolcats as trained: bf16, packed documents, 4 sinks beside a 192-key window (the sinks' key tile)
    dict(dtype=torch.bfloat16, window=192, sinks=4, packed=True),
    # a window under the 64-query block: the sinks gathered per row
    dict(dtype=torch.bfloat16, window=32, sinks=4, packed=True),
    # fp32, no sinks, one document a sequence
    dict(dtype=torch.float32, window=64, sinks=0, packed=False),
], ids=["bf16-W192-sinks4-tile", "bf16-W32-sinks4-rows", "fp32-W64-no-sinks"])
def test_window_kernels_compile_for_sm90(op, monkeypatch):
    calls = recorded_launches(monkeypatch, **op)
    assert [c[0].fn.__name__ for c in calls] == ["_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkv_kernel"]
    assert [c[2].get("SINK_TILE") for c in calls[:2]] == [op["sinks"] > 0 and op["window"] >= 64] * 2
    for kernel, args, kwargs in calls:
        compiled = compile_for_sm90(kernel, args, dict(kwargs))
        assert compiled.asm.get("cubin"), kernel.fn.__name__


def recorded_channel_launches(monkeypatch, dtype, F, DV, normalize, h0) -> list[tuple]:
    """(kernel, positional args, keyword args) of each launch of the per-channel gate op's forward and
    backward (kernels/linear_attn/chunk_channel.py)."""
    from linearize.kernels.linear_attn import chunk_channel

    calls = []
    monkeypatch.setattr(chunk_channel, "launch", lambda kernel, grid, *args, **kw: calls.append((kernel, args, kw)))
    g = torch.Generator().manual_seed(0)
    B, T, H = 2, 200, 9
    q, k = (torch.rand(B, T, H, F, generator=g).to(dtype) for _ in range(2))
    v, do = (torch.randn(B, T, H, DV, generator=g).to(dtype) for _ in range(2))
    log_g = -torch.rand(B, T, H, F, generator=g)
    S0, z0 = (torch.randn(B, H, F, DV), torch.rand(B, H, F)) if h0 else (None, None)
    o, den, Sn, zn = chunk_channel.channel_fwd(q, k, v, log_g, S0, z0, normalize, 1e-6, normalize)
    chunk_channel.channel_bwd(q, k, v, log_g, S0, z0, o, den, do, torch.zeros_like(Sn), torch.zeros_like(zn), Sn, zn,
                              normalize, 1e-6)
    return calls


@pytest.mark.parametrize("op", [
    # the training shape: bf16, F = 128 key features, Dv = 64, normalized, no initial state
    dict(dtype=torch.bfloat16, F=128, DV=64, normalize=True, h0=False),
    # the largest head: fp32 (ieee dots, the largest tiles), F = Dv = 256, unnormalized, initial state
    dict(dtype=torch.float32, F=256, DV=256, normalize=False, h0=True),
], ids=["bf16-F128-D64", "fp32-F256-D256-h0"])
def test_channel_gate_kernels_compile_for_sm90(op, monkeypatch):
    calls = recorded_channel_launches(monkeypatch, **op)
    names = [c[0].fn.__name__ for c in calls]
    assert names == (["_state_fwd_kernel", "_fwd_out_kernel"] + ["_bwd_prep_kernel"] * op["normalize"]
                     + ["_state_fwd_kernel", "_state_bwd_kernel", "_bwd_dq_kernel", "_bwd_dk_kernel",
                        "_bwd_dv_kernel",
                        "_dlg_tile_kernel", "_dlg_carry_kernel", "_dlg_scan_kernel"])
    for kernel, args, kwargs in calls:
        compiled = compile_for_sm90(kernel, args, dict(kwargs))
        assert compiled.asm.get("cubin"), kernel.fn.__name__
        assert compiled.metadata.shared <= 227 * 1024, (kernel.fn.__name__, compiled.metadata.shared)
