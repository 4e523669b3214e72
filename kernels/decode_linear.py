"""The projections of a decode step (a few rows: one token per sequence) as Triton GEMVs.

    y = x W^T (+ b)                                  x [M, K], W [N, K], M <= MAX_ROWS
    y = silu(x Wg^T) * (x Wu^T)                      the gated MLP's first half, one kernel

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
def _decode_linear_kernel(x, w, w2, b, y, M, N, K, sxm, sym,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GATED: tl.constexpr,
                          BIAS: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr,
                          EARLY: tl.constexpr):
    i_n = tl.program_id(0)
    o_m = tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    m_m, m_n = o_m < M, o_n < N
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
    b_x = tl.load(x + o_m[:, None] * sxm + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.)
    acc = _dot(b_x, b_w, PREC, UPCAST)
    acc2 = tl.zeros([BM, BN], dtype=tl.float32)
    if GATED:
        acc2 = _dot(b_x, b_w2, PREC, UPCAST)
    for k0 in range(BK, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        b_x = tl.load(x + o_m[:, None] * sxm + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.)
        p_w = o_n.to(tl.int64)[:, None] * K + o_k[None, :]
        m_w = m_n[:, None] & m_k[None, :]
        acc += _dot(b_x, tl.load(w + p_w, mask=m_w, other=0.), PREC, UPCAST)
        if GATED:
            acc2 += _dot(b_x, tl.load(w2 + p_w, mask=m_w, other=0.), PREC, UPCAST)
    if BIAS:
        acc += tl.load(b + o_n, mask=m_n, other=0.).to(tl.float32)[None, :]
    if GATED:
        acc = acc / (1. + tl.exp(-acc)) * acc2  # silu(gate) * up
    tl.store(y + o_m[:, None] * sym + o_n[None, :], acc.to(y.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


def _launch(x2: torch.Tensor, w: torch.Tensor, w2: torch.Tensor | None, bias: torch.Tensor | None,
            weight_ready: bool = False) -> torch.Tensor:
    M, K = x2.shape
    N = w.shape[0]
    y = torch.empty(M, N, device=x2.device, dtype=x2.dtype)
    if M == 0 or N == 0:
        return y
    on = pdl.enabled(x2)
    BN, BK, warps, stages = _config(N, K, w2 is not None)
    upcast = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") and x2.dtype != torch.float32
    prec = "ieee" if x2.dtype == torch.float32 or upcast else "tf32"
    launch(_decode_linear_kernel, (triton.cdiv(N, BN),), x2, w, w2, bias, y, M, N, K, x2.stride(0), y.stride(0),
           BM=16, BN=BN, BK=BK, GATED=w2 is not None, BIAS=bias is not None, PREC=prec, UPCAST=upcast, PDL=on,
           EARLY=on and weight_ready, num_warps=warps, num_stages=stages, **pdl.launch_options(on))
    return y


@torch.library.custom_op("linearize::decode_linear", mutates_args=())
def decode_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     weight_ready: bool = False) -> torch.Tensor:
    """:func:`decode_linear` as a torch op (x [M, K] contiguous rows)."""
    return _launch(x, weight, None, bias, weight_ready)


@decode_linear_op.register_fake
def _(x, weight, bias, weight_ready=False):
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("linearize::decode_gated", mutates_args=())
def decode_gated_op(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                    weight_ready: bool = False) -> torch.Tensor:
    """:func:`decode_gated` as a torch op (x [M, K] contiguous rows)."""
    return _launch(x, w_gate, w_up, None, weight_ready)


@decode_gated_op.register_fake
def _(x, w_gate, w_up, weight_ready=False):
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


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  weight_ready: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for at most MAX_ROWS rows of x (all dims but the last), as one
    Triton kernel spread over the output columns. weight [N, K] contiguous, in x's dtype.

    ``weight_ready``: the weight is not written by the kernel launched just before this call (a
    module's parameter, never written by a forward). With programmatic dependent launch (Hopper and
    newer, ``kernels/pdl.py``) the kernel then reads it while the kernel before is finishing; leave
    it False for a weight computed just before the call."""
    x2 = _rows(x, weight)
    ready = weight_ready and weight.is_contiguous()  # .contiguous() would make a copy just before
    y = torch.ops.linearize.decode_linear(x2, weight.contiguous(), None if bias is None else bias.contiguous(), ready)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def decode_gated(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, *,
                 weight_ready: bool = False) -> torch.Tensor:
    """``silu(F.linear(x, w_gate)) * F.linear(x, w_up)`` in one kernel (the gated MLP's first half),
    for at most MAX_ROWS rows of x; the two weights [N, K] contiguous, in x's dtype. ``weight_ready``
    as in :func:`decode_linear`."""
    if w_gate.shape != w_up.shape:
        raise ValueError(f"gate {tuple(w_gate.shape)} and up {tuple(w_up.shape)} weights differ in shape")
    x2 = _rows(x, w_gate)
    ready = weight_ready and w_gate.is_contiguous() and w_up.is_contiguous()
    y = torch.ops.linearize.decode_gated(x2, w_gate.contiguous(), w_up.contiguous(), ready)
    return y.reshape(*x.shape[:-1], w_gate.shape[0])


def decode_linear_ref(x, weight, bias=None):
    """Readable twin of :func:`decode_linear`: the product in float64, rounded once to x's dtype."""
    y = x.double() @ weight.double().T
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)


def decode_gated_ref(x, w_gate, w_up):
    """Readable twin of :func:`decode_gated`: SiLU and the product in float64, rounded once."""
    g, u = x.double() @ w_gate.double().T, x.double() @ w_up.double().T
    return (F.silu(g) * u).to(x.dtype)
