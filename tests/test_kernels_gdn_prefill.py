"""The Gated DeltaNet prefill glue kernels (kernels/gated_delta/prefill.py) against their float64
twins: conv with and without a cache, partial RoPE, padding, GQA, odd head dims; and as torch ops.

Runs under TRITON_INTERPRET=1 on CPU (CI's kernel pass) or on a GPU."""

import os

import pytest
import torch

pf = pytest.importorskip("linearize.kernels.gated_delta.prefill")
from linearize.kernels.ops import OPS  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                                reason="no GPU and TRITON_INTERPRET=1 not exported: Triton kernels cannot run")


def _case(B, T, H, Hkv, D, W, R, cache, pad, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    C = (H + 2 * Hkv) * D
    width = C + 2 * H + H * D  # q | k | v | a | b | o_gate, as the fused projection lays them out
    y = torch.randn(B, T, width + 3, generator=g)[..., :width]  # a strided view, as pre["*"] can be
    cols = [0, H * D, (H + Hkv) * D, D, C, C + H, C + 2 * H]
    kw = {}
    if W:
        kw["conv_weight"] = 0.5 * torch.randn(C, 1, W, generator=g)
        if cache:
            kw["conv_state"] = torch.randn(B, C, W, generator=g)
    if R:
        ang = torch.randn(1, T, R // 2, generator=g)
        kw["cos"], kw["sin"] = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    if pad:
        valid = torch.ones(B, T, dtype=torch.bool)
        valid[-1, : T // 3] = False
        kw["valid"] = valid
    dev = lambda x: x.to(DEVICE, dtype if x.is_floating_point() else x.dtype)  # noqa: E731
    return dev(y), cols, {k: dev(v) for k, v in kw.items()}


@pytest.mark.parametrize("B,T,H,Hkv,D,W,R,cache,pad", [
    (2, 45, 4, 2, 16, 4, 16, False, True),  # GQA, full RoPE, padding
    (1, 3, 2, 2, 20, 4, 10, True, False),  # a chunk shorter than the conv reading the cache; partial RoPE
    (2, 70, 3, 1, 24, 3, 0, True, True),  # no RoPE (a NoPE layer), 3 taps
    (1, 33, 2, 2, 16, 0, 8, False, True),  # no conv
    (2, 40, 3, 1, 64, 4, 64, True, False),  # the models' shape: head 64, whole-head RoPE (its halves), a cache
    (1, 37, 2, 2, 32, 4, 32, False, True),  # whole-head RoPE with padding
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("halves", [True, False], ids=["halves", "partners"])
def test_prologue_matches_float64(B, T, H, Hkv, D, W, R, cache, pad, dtype, halves, monkeypatch):
    monkeypatch.setitem(pf.CONFIG, "halves", halves)
    y, cols, kw = _case(B, T, H, Hkv, D, W, R, cache, pad, dtype)
    got = pf.gdn_prefill_prologue(y, cols=cols, num_heads=H, num_kv_heads=Hkv, head_dim=D, **kw)
    d64 = {k: v.double() if v.is_floating_point() else v for k, v in kw.items()}
    want = pf.gdn_prefill_prologue_ref(y.double(), cols=cols, num_heads=H, num_kv_heads=Hkv, head_dim=D, **d64)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, a, b in zip("qkv", got, want):
        assert a.shape == (B, T, H, D) and a.dtype == dtype, name
        assert (a.double() - b).abs().max().item() <= tol * max(1.0, b.abs().max().item()), name
    if cache and W and T < W:  # the cache is read: a different cache changes the first tokens' output
        other = dict(kw, conv_state=kw["conv_state"] + 1)
        q2 = pf.gdn_prefill_prologue(y, cols=cols, num_heads=H, num_kv_heads=Hkv, head_dim=D, **other)[2]
        assert not torch.allclose(q2, got[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_epilogue_matches_float64(dtype):
    B, T, H, D = 2, 37, 3, 20
    y, cols, _ = _case(B, T, H, H, D, 0, 0, False, False, dtype, seed=1)
    g = torch.Generator().manual_seed(2)
    o = torch.randn(B, T, H, D, generator=g).to(DEVICE, dtype)
    nw, mix = (torch.rand(D, generator=g) + 0.5).to(DEVICE), torch.rand(H, generator=g).to(DEVICE)
    got = pf.gdn_prefill_epilogue(o, y, norm_weight=nw, norm_mix=mix, g_off=cols[6], out_dtype=dtype)
    want = pf.gdn_prefill_epilogue_ref(o.double(), y.double(), norm_weight=nw.double(), norm_mix=mix.double(),
                                       g_off=cols[6], out_dtype=torch.float64)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.shape == (B, T, H * D) and (got.double() - want).abs().max().item() <= tol * want.abs().max().item()


def test_the_ops_pass_opcheck():
    B, T, H, Hkv, D = 1, 9, 2, 1, 16
    y, cols, kw = _case(B, T, H, Hkv, D, 4, 16, True, True, torch.float32)
    torch.library.opcheck(OPS["gdn_prefill_prologue"], (
        y.contiguous(), kw["conv_state"], kw["conv_weight"], kw["cos"], kw["sin"], kw["valid"].to(torch.uint8),
        cols[:4], H, Hkv, D, torch.float32))
    o = torch.randn(B, T, H, D, device=DEVICE)
    torch.library.opcheck(OPS["gdn_prefill_epilogue"], (o, y.contiguous(), torch.ones(D, device=DEVICE),
                                                        torch.full((H,), 0.5, device=DEVICE), cols[6], torch.float32))
