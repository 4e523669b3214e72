"""The decode GEMVs (kernels/decode_linear.py) against their float64 twins: plain with and without a
bias, gated (SiLU and product in one kernel), 1 to 16 rows, sizes that are not multiples of the
tiles, fp32 / bf16 / fp16; the op's checks (opcheck) and the refusals."""

import os

import pytest
import torch

pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET, reason="needs a GPU or TRITON_INTERPRET=1")

from linearize.kernels.decode_linear import (  # noqa: E402
    MAX_ROWS, decode_gated, decode_gated_ref, decode_linear, decode_linear_ref)
from linearize.kernels.ops import OPS  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _data(M, N, K, dtype, seed=0, lead=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, M, K, generator=g)
    w = torch.randn(N, K, generator=g) / K ** 0.5
    w2 = torch.randn(N, K, generator=g) / K ** 0.5
    b = torch.randn(N, generator=g)
    return [t.to(DEVICE, dtype) for t in (x, w, w2, b)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("M,N,K", [(1, 48, 40), (3, 100, 300), (16, 33, 17), (8, 2050, 64)])
def test_decode_linear_matches_float64(M, N, K, dtype):
    x, w, _, b = _data(M, N, K, dtype, seed=M * N + K)
    for bias in (None, b):
        got = decode_linear(x, w, bias)
        want = decode_linear_ref(x, w, bias)
        assert got.shape == (M, N) and got.dtype == dtype
        assert rel(got, want) < TOL[dtype], (M, N, K, bias is None)
    # as F.linear: the bias changes the result, every output column is written
    assert rel(decode_linear(x, w, b), decode_linear(x, w)) > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("M,N,K", [(1, 48, 40), (5, 70, 130), (16, 17, 257)])
def test_decode_gated_matches_float64(M, N, K, dtype):
    x, w, w2, _ = _data(M, N, K, dtype, seed=7 + M)
    got = decode_gated(x, w, w2)
    assert got.shape == (M, N)
    assert rel(got, decode_gated_ref(x, w, w2)) < TOL[dtype]
    # the gate and the up weight are not interchangeable: silu is applied to the gate only
    assert rel(decode_gated(x, w2, w), decode_gated_ref(x, w, w2)) > 1e-2


def test_leading_dims_and_strided_rows():
    x, w, _, b = _data(2, 40, 24, torch.float32, lead=(3,))  # (3, 2, 24): 6 rows
    got = decode_linear(x, w, b)
    assert got.shape == (3, 2, 40)
    assert rel(got, decode_linear_ref(x, w, b)) < 1e-5
    wide = torch.randn(4, 48, device=DEVICE)
    view = wide[:, 8:32]  # rows with a stride wider than their length
    assert rel(decode_linear(view, w), decode_linear_ref(view, w)) < 1e-5


def test_refusals():
    x, w, _, _ = _data(MAX_ROWS + 1, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="at most 16"):
        decode_linear(x, w)
    with pytest.raises(ValueError, match="features"):
        decode_linear(x[:2, :8], w)
    with pytest.raises(ValueError, match="cast"):
        decode_linear(x[:2].bfloat16(), w)
    with pytest.raises(ValueError, match="differ in shape"):
        decode_gated(x[:2], w, w[:8])


def test_opcheck():
    x, w, w2, b = _data(2, 24, 20, torch.float32)
    torch.library.opcheck(OPS["decode_linear"], (x, w, b))
    torch.library.opcheck(OPS["decode_linear"], (x, w, None))
    torch.library.opcheck(OPS["decode_gated"], (x, w, w2))


@pytest.mark.parametrize("one_pass", [True, False], ids=["one-pass", "two-pass"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("M,N,K", [(1, 48, 40), (3, 100, 300), (16, 33, 257)])
@torch.no_grad()
def test_norm_and_residual_inside_the_gemvs(M, N, K, dtype, one_pass, monkeypatch):
    """The decoder layer's RMSNorm read into the GEMV (two passes over x rounding as transformers
    does, or one pass scaling each row at the end) and the residual added in its epilogue give what
    transformers' Llama RMSNorm, F.linear and ``residual + out`` give (the twin is checked against
    the real module here too); each part changes the result."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from linearize.kernels import decode_linear as dl
    from linearize.kernels.decode_linear import rms_norm_ref

    monkeypatch.setattr(dl, "ONE_PASS_NORM", one_pass)
    x, w, w2, b = _data(M, N, K, dtype, seed=11 + K)
    x = x * 3 + 0.5  # a mean square far from 1: a missing or wrong normalisation shows
    g = torch.Generator().manual_seed(K)
    nw = (1 + torch.randn(K, generator=g)).to(DEVICE, dtype)
    res = torch.randn(M, N, generator=g).to(DEVICE, dtype)
    eps = 1e-5
    hf = LlamaRMSNorm(K, eps=eps).to(DEVICE, dtype)
    hf.weight.copy_(nw)
    assert torch.equal(rms_norm_ref(x, nw, eps), hf(x)) or dtype == torch.float32
    torch.testing.assert_close(rms_norm_ref(x, nw, eps), hf(x))
    for bias in (None, b):
        got = decode_linear(x, w, bias, norm_weight=nw, eps=eps, residual=res)
        want = decode_linear_ref(x, w, bias, norm_weight=nw, eps=eps, residual=res)
        assert rel(got, want) < TOL[dtype]
        assert rel(got, res + decode_linear_ref(hf(x), w, bias)) < TOL[dtype]
    assert rel(decode_linear(x, w, norm_weight=nw, eps=eps), decode_linear_ref(x, w, norm_weight=nw, eps=eps)) < TOL[dtype]
    assert rel(decode_linear(x, w, norm_weight=nw, eps=eps), decode_linear_ref(x, w)) > 0.1
    assert rel(decode_linear(x, w, residual=res), decode_linear_ref(x, w)) > 0.1
    got = decode_gated(x, w, w2, norm_weight=nw, eps=eps)
    assert rel(got, decode_gated_ref(x, w, w2, norm_weight=nw, eps=eps)) < TOL[dtype]
    assert rel(got, decode_gated_ref(hf(x), w, w2)) < TOL[dtype]
    assert rel(got, decode_gated_ref(x, w, w2)) > 0.1
    # the eps is used: a large one shrinks the normalised x
    assert rel(decode_linear(x, w, norm_weight=nw, eps=100.0), decode_linear_ref(x, w, norm_weight=nw, eps=100.0)) < TOL[dtype]


def test_norm_and_residual_refusals_and_opcheck():
    x, w, w2, b = _data(2, 24, 20, torch.float32)
    nw = torch.rand(20, device=DEVICE) + 0.5
    res = torch.randn(2, 24, device=DEVICE)
    with pytest.raises(ValueError, match="norm weight"):
        decode_linear(x, w, norm_weight=nw[:10])
    with pytest.raises(ValueError, match="residual"):
        decode_linear(x, w, residual=res[:, :10])
    torch.library.opcheck(OPS["decode_linear"], (x, w, b, False, nw, 1e-6, res))
    torch.library.opcheck(OPS["decode_gated"], (x, w, w2, False, nw, 1e-6))
