"""The projections of a decode step (a few rows: one token per sequence) as Triton GEMVs.

    y = x W^T (+ b)                                  x [M, K], W [N, K], M <= MAX_ROWS
    y = silu(x Wg^T) * (x Wu^T)                      the gated MLP's first half, one kernel

and, for the decoder layer of a decode step (``linearize.attention.DecodeBlock``), either may read
its x through the layer's RMSNorm and the plain one may add the residual to its output:

    x <- w_n * (x * rsqrt(mean(x^2) + eps))          the norm inside the GEMV (``norm_weight``, ``eps``)
    y <- r + y                                       the residual in the epilogue (``residual``)

each rounded where transformers' Llama-style ``RMSNorm`` and ``residual + hidden_states`` round
(the normalised x to x's dtype, then the product with the weight; y, then the sum), so the layer
computes what the unfused layer computes without the norm and add kernels between the GEMVs.

At batch 1 a decode step's projections are matrix-vector products of a few hundred KB to a few MB
each, and cuBLAS runs them with tiles of 64 output columns: a 576 x 576 projection gets 9 thread
blocks on a GPU of 132 SMs, and each of the step's ~150 GEMMs takes ~3.5-4 us where reading its
weight at the memory's speed takes well under 1 us (``scripts/profile_decode.py``; H200, SmolLM2
shape). Here one program computes BN output columns for every row, so a projection spreads over
N / BN programs (36 to 96 at that shape), each streaming its [BN, K] slice of W through a
pipelined loop of ``tl.dot`` over K (the rows padded to 16, the tensor cores' smallest tile).

The gated form reads the gate's and the up projection's rows of the same output columns in one
program and writes ``silu(gate) * up`` (SiLU and the product in fp32, one rounding): the two
GEMMs of a gated MLP and the elementwise kernel between them become one launch, with no
concatenated copy of the weights.

Products in fp32 accumulation: bf16/fp16 inputs on the tensor cores, fp32 inputs as true fp32
(``ieee``). :func:`decode_linear_ref` and :func:`decode_gated_ref` are the readable twins. No
autograd: these run where gradients are off (a decode step); callers fall back to ``F.linear``
otherwise and for more than MAX_ROWS rows.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import pdl
from .launch import launch
from .pdl import wait_then_release

MAX_ROWS = 16  # rows of x (tokens of a decode step, batch x tokens) the kernel takes: one dot tile
# the RMSNorm inside the GEMV: False, two passes over x, each rounding as transformers rounds (the rows'
# mean squares first, then x normalised block by block); True, one pass: the products read x times the
# norm's weight and each row is scaled by its reciprocal RMS at the end (the same math, one rounding of
# the operand instead of two, and no pass over x before the first product)
ONE_PASS_NORM = True


def _config(N: int, K: int, gated: bool) -> tuple[int, int, int, int]:
    """(BN, BK, warps, stages), from a sweep on an H200 (``scripts/bench_decode_linear.py --sweep``,
    bf16, one row, the two benchmark shapes): narrow tiles (many programs) for small projections,
    long K steps once K passes 1K (fewer loop trips), wider N tiles for the gated kernel (two
    weights per tile) and past 2K columns. (With PDL, reading the whole of a small K in one block
    before the wait was slower at every shape on an H100, 2026-11-25: 2.7-26 us against 2.1-3.1 us
    for these tiles with their first block read early; ``--sweep-early`` of that script.)"""
    BN = 32 if gated or N > 2048 else 16
    BK = 128 if gated or K <= 1024 else 512
    return BN, min(BK, max(32, triton.next_power_of_2(K))), 4, 3


@triton.jit
def _dot(b_x, b_w, PREC: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:  # the interpreter multiplies bf16 dot operands as raw bits (triton 3.9)
        b_x, b_w = b_x.to(tl.float32), b_w.to(tl.float32)
    return tl.dot(b_x, tl.trans(b_w), input_precision=PREC)


@triton.jit
def _round(v, dtype: tl.constexpr, RTNE: tl.constexpr):
    """fp32 ``v`` to ``dtype``, rounding to nearest even. RTNE: by hand, for bf16 under the interpreter,
    whose fp32 -> bf16 conversion truncates (the GPU's rounds to nearest)."""
    if RTNE:
        b = v.to(tl.int32, bitcast=True)
        v = ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return v.to(dtype)


@triton.jit
def _x_block(x, nw, r_x, o_m, o_k, m_m, m_k, sxm, NORM: tl.constexpr, RTNE: tl.constexpr):
    """A [BM, BK] block of x as the dot reads it, and its rows' sums of squares (NORM 2, else zeros).
    NORM 1: through the RMSNorm (r_x: each row's reciprocal RMS), rounded as transformers rounds (x's
    dtype after the scaling and after the weight); NORM 2: times the norm's weight only (rounded
    once), the rows' scaling left to the end (``ONE_PASS_NORM``)."""
    b_x = tl.load(x + o_m[:, None] * sxm + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.)
    ss = r_x * 0.
    if NORM == 1:
        b_n = _round(b_x.to(tl.float32) * r_x[:, None], b_x.dtype, RTNE)
        b_w = tl.load(nw + o_k, mask=m_k, other=0.)
        b_x = _round(b_w.to(tl.float32)[None, :] * b_n.to(tl.float32), b_x.dtype, RTNE)
    elif NORM == 2:
        b_f = b_x.to(tl.float32)
        ss = tl.sum(b_f * b_f, axis=1)
        b_w = tl.load(nw + o_k, mask=m_k, other=0.)
        b_x = _round(b_w.to(tl.float32)[None, :] * b_f, b_x.dtype, RTNE)
    return b_x, ss


@triton.jit
def _decode_linear_kernel(x, w, w2, b, nw, eps, r, y, M, N, K, sxm, srm, sym,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GATED: tl.constexpr,
                          BIAS: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr, PREC: tl.constexpr,
                          UPCAST: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr, RTNE: tl.constexpr):
    i_n = tl.program_id(0)
    o_m = tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    m_m, m_n = o_m < M, o_n < N
    m_y = m_m[:, None] & m_n[None, :]
    # the first K block, peeled: with EARLY its weights are read before the PDL wait (the caller
    # vouches that the launch just before did not write them: kernels/pdl.py, rule 3)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    p_w = o_n.to(tl.int64)[:, None] * K + o_k[None, :]
    m_w = m_n[:, None] & m_k[None, :]
    if EARLY:
        b_w = tl.load(w + p_w, mask=m_w, other=0.)
        if GATED:
            b_w2 = tl.load(w2 + p_w, mask=m_w, other=0.)
    wait_then_release(PDL)
    if not EARLY:
        b_w = tl.load(w + p_w, mask=m_w, other=0.)
        if GATED:
            b_w2 = tl.load(w2 + p_w, mask=m_w, other=0.)
    if RESIDUAL:  # read at the start: its latency hides behind the products
        b_r = tl.load(r + o_m[:, None] * srm + o_n[None, :], mask=m_y, other=0.)
    r_x = tl.zeros([BM], dtype=tl.float32)
    if NORM == 1:  # each row's mean square over all of K first (x is a few KB: a pass from L1/L2)
        ss = tl.zeros([BM], dtype=tl.float32)
        for k0 in range(0, K, BK):
            o_kk = k0 + tl.arange(0, BK)
            b_xx = tl.load(x + o_m[:, None] * sxm + o_kk[None, :], mask=m_m[:, None] & (o_kk < K)[None, :],
                           other=0.).to(tl.float32)
            ss += tl.sum(b_xx * b_xx, axis=1)
        r_x = 1. / tl.sqrt(ss / K + eps)
    b_x, ss = _x_block(x, nw, r_x, o_m, o_k, m_m, m_k, sxm, NORM, RTNE)
    acc = _dot(b_x, b_w, PREC, UPCAST)
    acc2 = tl.zeros([BM, BN], dtype=tl.float32)
    if GATED:
        acc2 = _dot(b_x, b_w2, PREC, UPCAST)
    for k0 in range(BK, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        b_x, ss_k = _x_block(x, nw, r_x, o_m, o_k, m_m, m_k, sxm, NORM, RTNE)
        ss += ss_k
        p_w = o_n.to(tl.int64)[:, None] * K + o_k[None, :]
        m_w = m_n[:, None] & m_k[None, :]
        acc += _dot(b_x, tl.load(w + p_w, mask=m_w, other=0.), PREC, UPCAST)
        if GATED:
            acc2 += _dot(b_x, tl.load(w2 + p_w, mask=m_w, other=0.), PREC, UPCAST)
    if NORM == 2:  # W (w_n * x * r) = r (W (w_n * x)): each row's scale after the products
        r_x = 1. / tl.sqrt(ss / K + eps)
        acc = acc * r_x[:, None]
        if GATED:
            acc2 = acc2 * r_x[:, None]
    if BIAS:
        acc += tl.load(b + o_n, mask=m_n, other=0.).to(tl.float32)[None, :]
    if GATED:
        acc = acc / (1. + tl.exp(-acc)) * acc2  # silu(gate) * up
    out = _round(acc, y.dtype.element_ty, RTNE)
    if RESIDUAL:  # residual + the projection, each rounded to y's dtype as the unfused layer rounds
        out = _round(b_r.to(tl.float32) + out.to(tl.float32), y.dtype.element_ty, RTNE)
    tl.store(y + o_m[:, None] * sym + o_n[None, :], out, mask=m_y)


def _launch(x2: torch.Tensor, w: torch.Tensor, w2: torch.Tensor | None, bias: torch.Tensor | None,
            weight_ready: bool = False, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
            residual: torch.Tensor | None = None) -> torch.Tensor:
    M, K = x2.shape
    N = w.shape[0]
    y = torch.empty(M, N, device=x2.device, dtype=x2.dtype)
    if M == 0 or N == 0:
        return y
    on = pdl.enabled(x2)
    BN, BK, warps, stages = _config(N, K, w2 is not None)
    upcast = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") and x2.dtype != torch.float32
    prec = "ieee" if x2.dtype == torch.float32 or upcast else "tf32"
    launch(_decode_linear_kernel, (triton.cdiv(N, BN),), x2, w, w2, bias, norm_weight, float(eps), residual, y,
           M, N, K, x2.stride(0), 0 if residual is None else residual.stride(0), y.stride(0),
           BM=16, BN=BN, BK=BK, GATED=w2 is not None, BIAS=bias is not None,
           NORM=0 if norm_weight is None else 2 if ONE_PASS_NORM else 1,
           RESIDUAL=residual is not None, PREC=prec, UPCAST=upcast, PDL=on, EARLY=on and weight_ready,
           RTNE=upcast and x2.dtype == torch.bfloat16,
           num_warps=warps, num_stages=stages, **pdl.launch_options(on))
    return y


@torch.library.custom_op("linearize::decode_linear", mutates_args=())
def decode_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     weight_ready: bool = False, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                     residual: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`decode_linear` as a torch op (x [M, K] contiguous rows; residual [M, N] rows)."""
    return _launch(x, weight, None, bias, weight_ready, norm_weight, eps, residual)


@decode_linear_op.register_fake
def _(x, weight, bias, weight_ready=False, norm_weight=None, eps=0.0, residual=None):
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("linearize::decode_gated", mutates_args=())
def decode_gated_op(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                    weight_ready: bool = False, norm_weight: torch.Tensor | None = None,
                    eps: float = 0.0) -> torch.Tensor:
    """:func:`decode_gated` as a torch op (x [M, K] contiguous rows)."""
    return _launch(x, w_gate, w_up, None, weight_ready, norm_weight, eps)


@decode_gated_op.register_fake
def _(x, w_gate, w_up, weight_ready=False, norm_weight=None, eps=0.0):
    return x.new_empty(x.shape[0], w_gate.shape[0])


def _rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    K = weight.shape[1]
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} features, the weight takes {K}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x is {x.dtype} and the weight {weight.dtype}: cast one (as F.linear would refuse)")
    x2 = x.reshape(-1, K)
    if x2.shape[0] > MAX_ROWS:
        raise ValueError(f"{x2.shape[0]} rows: the decode GEMV takes at most {MAX_ROWS} (use F.linear)")
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _norm_weight(x: torch.Tensor, norm_weight: torch.Tensor | None) -> torch.Tensor | None:
    if norm_weight is None:
        return None
    if norm_weight.shape != (x.shape[-1],) or norm_weight.dtype != x.dtype:
        raise ValueError(f"the norm weight must be ({x.shape[-1]},) in {x.dtype} (x's features and dtype), got "
                         f"{tuple(norm_weight.shape)} in {norm_weight.dtype}")
    return norm_weight.contiguous()


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  weight_ready: bool = False, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for at most MAX_ROWS rows of x (all dims but the last), as one
    Triton kernel spread over the output columns. weight [N, K] contiguous, in x's dtype.

    ``norm_weight`` (K,): x is first put through the RMSNorm ``norm_weight * (x * rsqrt(mean(x^2) +
    eps))``; ``residual`` (x's leading dims, N): added to the output. Both round as transformers'
    Llama-style decoder layer does (see the module's docstring).

    ``weight_ready``: the weight is not written by the kernel launched just before this call (a
    module's parameter, never written by a forward). With programmatic dependent launch (Hopper and
    newer, ``kernels/pdl.py``) the kernel then reads it while the kernel before is finishing; leave
    it False for a weight computed just before the call."""
    x2 = _rows(x, weight)
    N = weight.shape[0]
    r2 = None
    if residual is not None:
        if residual.shape != (*x.shape[:-1], N) or residual.dtype != x.dtype:
            raise ValueError(f"the residual must be {(*x.shape[:-1], N)} in {x.dtype}, got {tuple(residual.shape)} "
                             f"in {residual.dtype}")
        r2 = residual.reshape(-1, N)
        r2 = r2 if r2.stride(-1) == 1 else r2.contiguous()
    ready = weight_ready and weight.is_contiguous()  # .contiguous() would make a copy just before
    y = torch.ops.linearize.decode_linear(x2, weight.contiguous(), None if bias is None else bias.contiguous(), ready,
                                          _norm_weight(x, norm_weight), float(eps), r2)
    return y.reshape(*x.shape[:-1], N)


def decode_gated(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, *,
                 weight_ready: bool = False, norm_weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """``silu(F.linear(x, w_gate)) * F.linear(x, w_up)`` in one kernel (the gated MLP's first half),
    for at most MAX_ROWS rows of x; the two weights [N, K] contiguous, in x's dtype. ``weight_ready``
    and ``norm_weight`` as in :func:`decode_linear`."""
    if w_gate.shape != w_up.shape:
        raise ValueError(f"gate {tuple(w_gate.shape)} and up {tuple(w_up.shape)} weights differ in shape")
    x2 = _rows(x, w_gate)
    ready = weight_ready and w_gate.is_contiguous() and w_up.is_contiguous()
    y = torch.ops.linearize.decode_gated(x2, w_gate.contiguous(), w_up.contiguous(), ready,
                                         _norm_weight(x, norm_weight), float(eps))
    return y.reshape(*x.shape[:-1], w_gate.shape[0])


def rms_norm_ref(x, weight, eps):
    """transformers' Llama-style RMSNorm, as the fused GEMVs apply it: fp32 statistics, the normalised x
    rounded to x's dtype, then the weight's product rounded again."""
    n = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * n


def decode_linear_ref(x, weight, bias=None, norm_weight=None, eps=1e-6, residual=None):
    """Readable twin of :func:`decode_linear`: the (normed) x's product in float64, rounded once to x's
    dtype, then the residual added and rounded again."""
    if norm_weight is not None:
        x = rms_norm_ref(x, norm_weight, eps)
    y = x.double() @ weight.double().T
    if bias is not None:
        y = y + bias.double()
    y = y.to(x.dtype)
    return y if residual is None else residual + y


def decode_gated_ref(x, w_gate, w_up, norm_weight=None, eps=1e-6):
    """Readable twin of :func:`decode_gated`: SiLU and the product in float64, rounded once."""
    if norm_weight is not None:
        x = rms_norm_ref(x, norm_weight, eps)
    g, u = x.double() @ w_gate.double().T, x.double() @ w_up.double().T
    return (F.silu(g) * u).to(x.dtype)
