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
from conftest import rel_err

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}



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
        assert rel_err(got, want) < TOL[dtype], (M, N, K, bias is None)
    # as F.linear: the bias changes the result, every output column is written
    assert rel_err(decode_linear(x, w, b), decode_linear(x, w)) > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("M,N,K", [(1, 48, 40), (5, 70, 130), (16, 17, 257)])
def test_decode_gated_matches_float64(M, N, K, dtype):
    x, w, w2, _ = _data(M, N, K, dtype, seed=7 + M)
    got = decode_gated(x, w, w2)
    assert got.shape == (M, N)
    assert rel_err(got, decode_gated_ref(x, w, w2)) < TOL[dtype]
    # the gate and the up weight are not interchangeable: silu is applied to the gate only
    assert rel_err(decode_gated(x, w2, w), decode_gated_ref(x, w, w2)) > 1e-2


def test_leading_dims_and_strided_rows():
    x, w, _, b = _data(2, 40, 24, torch.float32, lead=(3,))  # (3, 2, 24): 6 rows
    got = decode_linear(x, w, b)
    assert got.shape == (3, 2, 40)
    assert rel_err(got, decode_linear_ref(x, w, b)) < 1e-5
    wide = torch.randn(4, 48, device=DEVICE)
    view = wide[:, 8:32]  # rows with a stride wider than their length
    assert rel_err(decode_linear(view, w), decode_linear_ref(view, w)) < 1e-5


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
