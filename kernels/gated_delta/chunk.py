"""Chunkwise-parallel gated delta rule: Triton kernels, forward and backward.

Notation (one head, one chunk of BT tokens starting from state S0 [K, V]; see
reference.gated_delta_rule_chunk_ref for the same maths in PyTorch):

    gc    in-chunk cumulative sum of the log decay g; gamma = exp(gc)
    A     = strict_lower(beta_i (k_i . k_j) gamma_i / gamma_j)      [BT, BT]
    Tm    = (I + A)^-1                                              (UT transform)
    w     = Tm (beta gamma k) [BT, K],   u = Tm (beta v) [BT, V]    (WY form)
    v'    = u - w S0                                                (the deltas)
    o     = scale (gamma q S0 + (lower(gamma_i / gamma_j) * q k^T) v')
    S1    = gamma_C S0 + (k gamma_C / gamma)^T v'

Forward: `_wy_fwd` (gc, Tm, w, u; parallel over chunks; Tm from 16 x 16 blocks) -> `_fwd_h` (states at chunk starts
and v'; sequential over the chunks of a sequence) -> `_fwd_o` (parallel over chunks).
Backward: `_fwd_h` again (recompute states), `_bwd_dv_local`, `_bwd_dhu` (sequential,
reverse), `_bwd_dqkwg`, `_bwd_wy` (gradients through the UT transform, then the reverse
in-chunk cumsum that turns d(gc) into d(g)).

All sequences are handled as packed varlen internally: a [B, T] batch is the packed batch
with cu_seqlens = [0, T, 2T, ...], so one code path serves both and no chunk ever spans two
sequences. Accumulation and states are float32; matmul operands are in the input dtype.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import torch
import triton
import triton.language as tl

from ..launch import call_directly, launch

BT = 64  # chunk size: two 32-row halves in the UT transform

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# LINEARIZE_TRITON_AUTOTUNE=0 keeps the first (default) config: quick GPU test runs
_AUTOTUNE = not _INTERPRET and os.environ.get("LINEARIZE_TRITON_AUTOTUNE", "1") != "0"


def _configs(configs: list[triton.Config]) -> list[triton.Config]:
    # the interpreter would "benchmark" every config on the CPU: keep the first one
    return configs if _AUTOTUNE else configs[:1]


def _one_stage_only_when_needed(configs, named_args, **kwargs):
    """The state kernels (whole K in one tile) list a 1-stage config for fp32 at head dims above 128,
    where 2 stages need more shared memory than an H100/H200 SM has (GPU fuzz seed 33: 279 KB against
    227 KB) and the tuner, which skips configs that do not fit, would find none. Anywhere else it is
    pruned: while every shape was offered it (and ``_fwd_o_kernel`` had one too), an H200 run saw
    illegal addresses inside the tuner's benchmark of the GDN forward and wrong bf16 outputs at
    K = 17..48; with the prune, none in the next run's 59 GDN chunk cases (docs/reports/kernels.md)."""
    big = named_args["k"].element_size() >= 4 and named_args["K"] > 128
    keep = [c for c in configs if big or c.num_stages > 1]
    return keep or configs


_PRUNE = {"early_config_prune": _one_stage_only_when_needed}


# The interpreter of triton 3.9 returns garbage for tl.dot on bfloat16 operands (checked:
# errors ~1e10 on a 32x16 product): there, every product runs on float32 copies.
_UPCAST_DOTS = tl.constexpr(_INTERPRET)
# The H200 fuzz (triton 3.6) found the backward's gradients (dq, dk, dg) wrong on the GPU only, with
# native 16-bit tensor-core products at small head dims: fp16 at K = 16..31 (seeds 47, 187, 271, 376),
# bf16 at K = 17, V = 24 (seeds 1188, 1748); larger bf16 head dims (K = 31..256 with V >= 100) were
# right. Those products therefore run as tf32 products of float32 copies ("upcast"), exact for 16-bit
# values (tf32 keeps 10 mantissa bits): every fp16 product, and bf16 ones where a head dim is below 64,
# which the converted models' heads (64 and up) never hit. LINEARIZE_GDN_NATIVE_DOTS=1 restores the
# native products (to reproduce it).
_NATIVE_DOTS = os.environ.get("LINEARIZE_GDN_NATIVE_DOTS", "0") == "1"


@triton.jit
def _dot(a, b, input_precision: tl.constexpr):
    if _UPCAST_DOTS:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif input_precision == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32")
    else:
        return tl.dot(a, b, input_precision=input_precision)


# --------------------------------------------------------------------------------------
# forward kernels
# --------------------------------------------------------------------------------------


@triton.jit
def _chunk_bounds(cu, ci, i_c, BT: tl.constexpr):
    """First token, number of valid rows of global chunk i_c."""
    i_n = tl.load(ci + 2 * i_c)
    i_t = tl.load(ci + 2 * i_c + 1)
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    t0 = bos + i_t * BT
    L = tl.minimum(eos - t0, BT)
    return t0, L


@triton.jit
def _rows(p, t, m, i_h, H: tl.constexpr, D: tl.constexpr, o_d):
    """The [rows, BD] tile of a [tokens, H, D] tensor at tokens t (rows masked by m)."""
    return tl.load(p + (t[:, None] * H + i_h) * D + o_d[None, :], mask=m[:, None] & (o_d < D)[None, :], other=0.0)


@triton.jit
def _put(p, x, t, m, i_h, H: tl.constexpr, D: tl.constexpr, o_d):
    tl.store(p + (t[:, None] * H + i_h) * D + o_d[None, :], x.to(p.dtype.element_ty),
             mask=m[:, None] & (o_d < D)[None, :])


@triton.jit
def _load_gc(gc, t0, L, tok, mt, i_h, H: tl.constexpr):
    """In-chunk cumulative log decay of a chunk's rows and of its last valid row. Rows past the
    chunk's end get the last valid value: every pairwise difference gc_i - gc_j with i >= j then
    stays <= 0 also for them, so no exp() overflows into 0 * inf = nan once decays are strong."""
    g_last = tl.load(gc + (t0 + L - 1) * H + i_h)
    return tl.where(mt, tl.load(gc + tok * H + i_h, mask=mt, other=0.0), g_last), g_last


# Pairwise decays exp(gc_i - gc_j) are exp2 of log2(e)-scaled cumulative decays: one multiply per row
# and column instead of one per pair (ptxas on sm_90a: the output kernel's instructions 984 -> 712 at
# D=64). No guard inside the exp2: pairs the causal mask drops may overflow to inf (inf * 0 = nan),
# and the tl.where around each product drops them.
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _gate_blk(A, si, sj, bi, DIAG: tl.constexpr):
    """beta_i * A_ij * exp(gc_i - gc_j) on a [16, 16] block, from s = gc * log2(e); diagonal blocks
    keep i > j only."""
    if DIAG:
        r = tl.arange(0, 16)
        strict = r[:, None] > r[None, :]
        return tl.where(strict, A * tl.math.exp2(si[:, None] - sj[None, :]), 0.0) * bi[:, None]
    else:
        return A * tl.math.exp2(si[:, None] - sj[None, :]) * bi[:, None]


@triton.jit
def _subst_row(A, Ti, i):
    """One forward-substitution step: row i of (I + A)^-1 from the rows above it."""
    r = tl.arange(0, 16)
    sel = r[:, None] == i
    a = tl.sum(tl.where(sel, A, 0.0), 0)
    new = tl.where(r == i, 1.0, 0.0) - tl.sum(a[:, None] * Ti, 0)
    return tl.where(sel, new[None, :], Ti)


@triton.jit
def _inv_pow(A, eye, P: tl.constexpr):
    """(I + A)^-1 of a strictly lower-triangular [16, 16] block as (I - A)(I + A^2)(I + A^4)(I + A^8)
    (A^16 = 0): six tensor-core products in place of 15 serial substitution steps. Its factors cancel
    (A^8 reaches thousands on alike keys): sound on tf32x3 products only, and a default nowhere since
    _inv_merge (scripts/bench_gdn.py --solve-compare keeps it to compare)."""
    A2 = _dot(A, A, P)
    A4 = _dot(A2, A2, P)
    A8 = _dot(A4, A4, P)
    return _dot(_dot(eye - A, eye + A2, P), _dot(eye + A4, eye + A8, P), P)


@triton.jit
def _merge_level(T, A, r, S: tl.constexpr, P: tl.constexpr):
    """(I + A)^-1 on blocks of 2S from T = (I + A)^-1 on blocks of S: with I + A = D + E (D the blocks of S,
    E the [S, S] corner below them inside each block of 2S), (D + E)^-1 = D^-1 - D^-1 E D^-1."""
    E = tl.where((r[:, None] // (2 * S) == r[None, :] // (2 * S)) & (r[:, None] // S != r[None, :] // S), A, 0.0)
    return T - _dot(T, _dot(E, T, P), P)


@triton.jit
def _inv_merge(A, eye, P: tl.constexpr):
    """(I + A)^-1 of a strictly lower-triangular [16, 16] block by merging diagonal blocks 2 -> 4 -> 8 -> 16
    (the 2 x 2 inverses are exact: I - A there): six tensor-core products, as _inv_pow, but every
    intermediate is a block of the inverse itself, so nothing cancels. The product form's powers A^8
    reach thousands on alike keys and one tf32 product each turned them into nan (H100, 2026-11-27)."""
    r = tl.arange(0, 16)
    T = eye - tl.where(r[:, None] // 2 == r[None, :] // 2, A, 0.0)
    T = _merge_level(T, A, r, 2, P)
    T = _merge_level(T, A, r, 4, P)
    return _merge_level(T, A, r, 8, P)


@triton.jit
def _store_tm(Tm, T00, T10, T11, T20, T21, T22, T30, T31, T32, T33, t_0, t_1, t_2, t_3,
              m_0, m_1, m_2, m_3, i_h, H: tl.constexpr, BT: tl.constexpr):
    r = tl.arange(0, 16)
    zero = tl.zeros([16, 16], dtype=tl.float32)
    _put(Tm, T00, t_0, m_0, i_h, H, BT, r)
    _put(Tm, zero, t_0, m_0, i_h, H, BT, r + 16)
    _put(Tm, zero, t_0, m_0, i_h, H, BT, r + 32)
    _put(Tm, zero, t_0, m_0, i_h, H, BT, r + 48)
    _put(Tm, T10, t_1, m_1, i_h, H, BT, r)
    _put(Tm, T11, t_1, m_1, i_h, H, BT, r + 16)
    _put(Tm, zero, t_1, m_1, i_h, H, BT, r + 32)
    _put(Tm, zero, t_1, m_1, i_h, H, BT, r + 48)
    _put(Tm, T20, t_2, m_2, i_h, H, BT, r)
    _put(Tm, T21, t_2, m_2, i_h, H, BT, r + 16)
    _put(Tm, T22, t_2, m_2, i_h, H, BT, r + 32)
    _put(Tm, zero, t_2, m_2, i_h, H, BT, r + 48)
    _put(Tm, T30, t_3, m_3, i_h, H, BT, r)
    _put(Tm, T31, t_3, m_3, i_h, H, BT, r + 16)
    _put(Tm, T32, t_3, m_3, i_h, H, BT, r + 32)
    _put(Tm, T33, t_3, m_3, i_h, H, BT, r + 48)


@triton.autotune(
    configs=_configs([triton.Config({}, num_warps=nw) for nw in (2, 4, 1)]),
    key=["H", "K", "V", "BK", "TPREC", "DIAG"],
)
@triton.jit
def _wy_fwd_kernel(
    k, v, g, beta, gc, Tm, w, u, cu, ci,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, STORE_T: tl.constexpr,
    TPREC: tl.constexpr = "ieee", DIAG: tl.constexpr = "subst",
):
    """gc, Tm = (I + A)^-1 (kept for the backward only), w, u for one chunk of 64 tokens, as 4 x 4 blocks of 16: the diagonal
    blocks are inverted by forward substitution (the four chains interleaved) or, at inference, by DIAG "merge"
    (_inv_merge) or "pow" (_inv_pow, compared only); the blocks below by T_ik = -T_ii sum_{k <= j < i} A_ij T_jk,
    whose products run in TPREC ("ieee": fp32 FMA; "tf32" / "tf32x3" at inference, see UTSolve)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, L = _chunk_bounds(cu, ci, i_c, BT)
    r = tl.arange(0, 16)
    t_0, t_1, t_2, t_3 = t0 + r, t0 + 16 + r, t0 + 32 + r, t0 + 48 + r
    m_0, m_1, m_2, m_3 = r < L, r + 16 < L, r + 32 < L, r + 48 < L

    g_0 = tl.load(g + t_0 * H + i_h, mask=m_0, other=0.0).to(tl.float32)
    g_1 = tl.load(g + t_1 * H + i_h, mask=m_1, other=0.0).to(tl.float32)
    g_2 = tl.load(g + t_2 * H + i_h, mask=m_2, other=0.0).to(tl.float32)
    g_3 = tl.load(g + t_3 * H + i_h, mask=m_3, other=0.0).to(tl.float32)
    c_0 = tl.cumsum(g_0, 0)
    c_1 = tl.cumsum(g_1, 0) + tl.sum(g_0, 0)
    c_2 = tl.cumsum(g_2, 0) + tl.sum(g_0, 0) + tl.sum(g_1, 0)
    c_3 = tl.cumsum(g_3, 0) + tl.sum(g_0, 0) + tl.sum(g_1, 0) + tl.sum(g_2, 0)
    tl.store(gc + t_0 * H + i_h, c_0, mask=m_0)
    tl.store(gc + t_1 * H + i_h, c_1, mask=m_1)
    tl.store(gc + t_2 * H + i_h, c_2, mask=m_2)
    tl.store(gc + t_3 * H + i_h, c_3, mask=m_3)
    b_0 = tl.load(beta + t_0 * H + i_h, mask=m_0, other=0.0).to(tl.float32)
    b_1 = tl.load(beta + t_1 * H + i_h, mask=m_1, other=0.0).to(tl.float32)
    b_2 = tl.load(beta + t_2 * H + i_h, mask=m_2, other=0.0).to(tl.float32)
    b_3 = tl.load(beta + t_3 * H + i_h, mask=m_3, other=0.0).to(tl.float32)

    A00 = tl.zeros([16, 16], dtype=tl.float32)
    A11 = tl.zeros([16, 16], dtype=tl.float32)
    A22 = tl.zeros([16, 16], dtype=tl.float32)
    A33 = tl.zeros([16, 16], dtype=tl.float32)
    A10 = tl.zeros([16, 16], dtype=tl.float32)
    A20 = tl.zeros([16, 16], dtype=tl.float32)
    A21 = tl.zeros([16, 16], dtype=tl.float32)
    A30 = tl.zeros([16, 16], dtype=tl.float32)
    A31 = tl.zeros([16, 16], dtype=tl.float32)
    A32 = tl.zeros([16, 16], dtype=tl.float32)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        k_0 = _rows(k, t_0, m_0, i_h, H, K, o_k)
        k_1 = _rows(k, t_1, m_1, i_h, H, K, o_k)
        k_2 = _rows(k, t_2, m_2, i_h, H, K, o_k)
        k_3 = _rows(k, t_3, m_3, i_h, H, K, o_k)
        A00 += _dot(k_0, tl.trans(k_0), PREC)
        A11 += _dot(k_1, tl.trans(k_1), PREC)
        A22 += _dot(k_2, tl.trans(k_2), PREC)
        A33 += _dot(k_3, tl.trans(k_3), PREC)
        A10 += _dot(k_1, tl.trans(k_0), PREC)
        A20 += _dot(k_2, tl.trans(k_0), PREC)
        A21 += _dot(k_2, tl.trans(k_1), PREC)
        A30 += _dot(k_3, tl.trans(k_0), PREC)
        A31 += _dot(k_3, tl.trans(k_1), PREC)
        A32 += _dot(k_3, tl.trans(k_2), PREC)
    s_0, s_1, s_2, s_3 = c_0 * _LOG2E, c_1 * _LOG2E, c_2 * _LOG2E, c_3 * _LOG2E
    A00 = _gate_blk(A00, s_0, s_0, b_0, True)
    A11 = _gate_blk(A11, s_1, s_1, b_1, True)
    A22 = _gate_blk(A22, s_2, s_2, b_2, True)
    A33 = _gate_blk(A33, s_3, s_3, b_3, True)
    A10 = _gate_blk(A10, s_1, s_0, b_1, False)
    A20 = _gate_blk(A20, s_2, s_0, b_2, False)
    A21 = _gate_blk(A21, s_2, s_1, b_2, False)
    A30 = _gate_blk(A30, s_3, s_0, b_3, False)
    A31 = _gate_blk(A31, s_3, s_1, b_3, False)
    A32 = _gate_blk(A32, s_3, s_2, b_3, False)

    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    if DIAG == "pow":
        T00 = _inv_pow(A00, eye, TPREC)
        T11 = _inv_pow(A11, eye, TPREC)
        T22 = _inv_pow(A22, eye, TPREC)
        T33 = _inv_pow(A33, eye, TPREC)
    elif DIAG == "merge":
        T00 = _inv_merge(A00, eye, TPREC)
        T11 = _inv_merge(A11, eye, TPREC)
        T22 = _inv_merge(A22, eye, TPREC)
        T33 = _inv_merge(A33, eye, TPREC)
    else:
        T00, T11, T22, T33 = eye, eye, eye, eye
        for i in range(1, 16):
            T00 = _subst_row(A00, T00, i)
            T11 = _subst_row(A11, T11, i)
            T22 = _subst_row(A22, T22, i)
            T33 = _subst_row(A33, T33, i)
    T10 = -_dot(T11, _dot(A10, T00, TPREC), TPREC)
    T21 = -_dot(T22, _dot(A21, T11, TPREC), TPREC)
    T32 = -_dot(T33, _dot(A32, T22, TPREC), TPREC)
    T20 = -_dot(T22, _dot(A20, T00, TPREC) + _dot(A21, T10, TPREC), TPREC)
    T31 = -_dot(T33, _dot(A31, T11, TPREC) + _dot(A32, T21, TPREC), TPREC)
    T30 = -_dot(T33, _dot(A30, T00, TPREC) + _dot(A31, T10, TPREC) + _dot(A32, T20, TPREC), TPREC)

    # Tm rows as [tokens, H, 64]; the zero blocks above the diagonal are written too
    if STORE_T:
        _store_tm(Tm, T00, T10, T11, T20, T21, T22, T30, T31, T32, T33, t_0, t_1, t_2, t_3,
                  m_0, m_1, m_2, m_3, i_h, H, BT)

    dt = k.dtype.element_ty
    T00, T11, T22, T33 = T00.to(dt), T11.to(dt), T22.to(dt), T33.to(dt)
    T10, T20, T21, T30, T31, T32 = T10.to(dt), T20.to(dt), T21.to(dt), T30.to(dt), T31.to(dt), T32.to(dt)
    f_0, f_1, f_2, f_3 = b_0 * tl.exp(c_0), b_1 * tl.exp(c_1), b_2 * tl.exp(c_2), b_3 * tl.exp(c_3)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        x_0 = (_rows(k, t_0, m_0, i_h, H, K, o_k) * f_0[:, None]).to(dt)
        x_1 = (_rows(k, t_1, m_1, i_h, H, K, o_k) * f_1[:, None]).to(dt)
        x_2 = (_rows(k, t_2, m_2, i_h, H, K, o_k) * f_2[:, None]).to(dt)
        x_3 = (_rows(k, t_3, m_3, i_h, H, K, o_k) * f_3[:, None]).to(dt)
        _put(w, _dot(T00, x_0, PREC), t_0, m_0, i_h, H, K, o_k)
        _put(w, _dot(T10, x_0, PREC) + _dot(T11, x_1, PREC), t_1, m_1, i_h, H, K, o_k)
        _put(w, _dot(T20, x_0, PREC) + _dot(T21, x_1, PREC) + _dot(T22, x_2, PREC), t_2, m_2, i_h, H, K, o_k)
        _put(w, _dot(T30, x_0, PREC) + _dot(T31, x_1, PREC) + _dot(T32, x_2, PREC) + _dot(T33, x_3, PREC),
             t_3, m_3, i_h, H, K, o_k)
    for v0 in range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        x_0 = (_rows(v, t_0, m_0, i_h, H, V, o_v) * b_0[:, None]).to(dt)
        x_1 = (_rows(v, t_1, m_1, i_h, H, V, o_v) * b_1[:, None]).to(dt)
        x_2 = (_rows(v, t_2, m_2, i_h, H, V, o_v) * b_2[:, None]).to(dt)
        x_3 = (_rows(v, t_3, m_3, i_h, H, V, o_v) * b_3[:, None]).to(dt)
        _put(u, _dot(T00, x_0, PREC), t_0, m_0, i_h, H, V, o_v)
        _put(u, _dot(T10, x_0, PREC) + _dot(T11, x_1, PREC), t_1, m_1, i_h, H, V, o_v)
        _put(u, _dot(T20, x_0, PREC) + _dot(T21, x_1, PREC) + _dot(T22, x_2, PREC), t_2, m_2, i_h, H, V, o_v)
        _put(u, _dot(T30, x_0, PREC) + _dot(T31, x_1, PREC) + _dot(T32, x_2, PREC) + _dot(T33, x_3, PREC),
             t_3, m_3, i_h, H, V, o_v)


@triton.autotune(
    configs=_configs([
        triton.Config({"BV": bv}, num_warps=nw, num_stages=ns)
        # 3-4 stages: the next chunk's w, u, k load while the state updates (6-12% faster forward at
        # 8K-32K on an H100, 2026-11-27; each passed scripts/probe_gdn_configs.py alone)
        for (bv, nw, ns) in ((32, 4, 2), (64, 4, 2), (16, 2, 2), (16, 4, 1), (64, 4, 3), (64, 4, 4), (32, 4, 4))
    ]),
    prune_configs_by=_PRUNE,
    key=["H", "K", "V", "ID"],  # the autotuner adds the tensors' dtypes to the key
)
@triton.jit
def _fwd_h_kernel(
    k, w, u, gc, h0, h, vn, ht, cu, co,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, ID: tl.constexpr = 0,
):
    """The state pass. ``ID > 0`` (the split-time section below's pass 1): the state has ID + V_u columns, the first ID
    start as the identity and see zero values, the rest see u (width V_u = V - ID) from zero; only
    the final state is written (no per-chunk states, no v')."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    boh = tl.load(co + i_n).to(tl.int64)
    NTn = tl.cdiv(eos - bos, BT)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mk, mv = o_k < K, o_v < V
    mkv = mk[:, None] & mv[None, :]
    s_off = o_k[:, None] * V + o_v[None, :]
    dt = k.dtype.element_ty

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if ID > 0:
        b_h += tl.where((o_k[:, None] == o_v[None, :]) & mkv, 1.0, 0.0)
    if USE_H0:
        b_h += tl.load(h0 + i_nh.to(tl.int64) * K * V + s_off, mask=mkv, other=0.0).to(tl.float32)
    for c in range(0, NTn):
        t0 = bos + c * BT
        L = tl.minimum(eos - t0, BT)
        mt = o_t < L
        tok = t0 + o_t
        if ID == 0:
            tl.store(h + ((boh + c) * H + i_h) * K * V + s_off, b_h.to(h.dtype.element_ty), mask=mkv)
        b_w = tl.load(w + (tok[:, None] * H + i_h) * K + o_k[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
        mu = mv & (o_v >= ID)
        b_u = tl.load(u + (tok[:, None] * H + i_h) * (V - ID) + (o_v - ID)[None, :], mask=mt[:, None] & mu[None, :],
                      other=0.0)
        b_v = b_u.to(tl.float32) - _dot(b_w, b_h.to(dt), input_precision=PREC)
        if ID == 0:
            tl.store(vn + (tok[:, None] * H + i_h) * V + o_v[None, :], b_v.to(dt), mask=mt[:, None] & mv[None, :])
        b_g, g_last = _load_gc(gc, t0, L, tok, mt, i_h, H)
        b_k = tl.load(k + (tok[:, None] * H + i_h) * K + o_k[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
        b_k = (b_k * tl.exp(g_last - b_g)[:, None]).to(dt)
        b_h = b_h * tl.exp(g_last) + _dot(tl.trans(b_k), b_v.to(dt), input_precision=PREC)
    if STORE_HT:
        tl.store(ht + i_nh.to(tl.int64) * K * V + s_off, b_h, mask=mkv)


@triton.autotune(
    configs=_configs([
        triton.Config({"BK": bk, "BV": bv}, num_warps=nw, num_stages=ns)
        # (128, 64, 4, 3): picked at D=128 (H100); (64, 128, 4, 2): picked at D=128 over it and 9 other
        # candidates (1.6% faster forward at 32K, 2026-11-27, third session). Not BV=32 with 3-4 stages:
        # wrong outputs at D=64 (BK64 BV32 w4 s3) and an illegal address (BK128 BV32 w4 s4) on an H100
        # (docs/reports/kernels.md)
        for (bk, bv, nw, ns) in ((64, 64, 4, 2), (128, 64, 4, 2), (128, 128, 8, 2), (128, 64, 4, 3), (64, 128, 4, 2))
    ]),
    key=["H", "K", "V"],  # the autotuner adds the tensors' dtypes to the key
)
@triton.jit
def _fwd_o_kernel(
    q, k, vn, h, gc, o, scale, cu, ci,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    i_v, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0, L = _chunk_bounds(cu, ci, i_c, BT)
    o_t = tl.arange(0, BT)
    mt = o_t < L
    tok = t0 + o_t
    o_v = i_v * BV + tl.arange(0, BV)
    mv = o_v < V
    p_h = h + (i_c.to(tl.int64) * H + i_h) * K * V
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    b_s = tl.zeros([BT, BT], dtype=tl.float32)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        mk = o_k < K
        b_q = tl.load(q + (tok[:, None] * H + i_h) * K + o_k[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
        b_k = tl.load(k + (tok[:, None] * H + i_h) * K + o_k[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
        b_hk = tl.load(p_h + o_k[:, None] * V + o_v[None, :], mask=mk[:, None] & mv[None, :], other=0.0)
        b_o += _dot(b_q, b_hk, input_precision=PREC)
        b_s += _dot(b_q, tl.trans(b_k), input_precision=PREC)
    b_g, _ = _load_gc(gc, t0, L, tok, mt, i_h, H)
    b_g = b_g * _LOG2E  # exp2 of scaled decays (see _LOG2E)
    causal = o_t[:, None] >= o_t[None, :]
    b_s = tl.where(causal, b_s * tl.math.exp2(b_g[:, None] - b_g[None, :]), 0.0)
    b_v = tl.load(vn + (tok[:, None] * H + i_h) * V + o_v[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
    b_o = b_o * tl.math.exp2(b_g)[:, None] + _dot(b_s.to(b_v.dtype), b_v, input_precision=PREC)
    tl.store(o + (tok[:, None] * H + i_h) * V + o_v[None, :], (b_o * scale).to(o.dtype.element_ty),
             mask=mt[:, None] & mv[None, :])


# --------------------------------------------------------------------------------------
# backward kernels
# --------------------------------------------------------------------------------------


@triton.jit
def _bwd_dv_local_kernel(
    q, k, do, gc, dv, scale, cu, ci,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    """dv_j = scale * sum_{i >= j} gamma_i / gamma_j (q_i . k_j) do_i (the intra-chunk part)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, L = _chunk_bounds(cu, ci, i_c, BT)
    o_t = tl.arange(0, BT)
    mt = o_t < L
    tok = t0 + o_t
    b_a = tl.zeros([BT, BT], dtype=tl.float32)                      # [j, i] = k_j . q_i
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        mk = o_k < K
        b_q = tl.load(q + (tok[:, None] * H + i_h) * K + o_k[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
        b_k = tl.load(k + (tok[:, None] * H + i_h) * K + o_k[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
        b_a += _dot(b_k, tl.trans(b_q), input_precision=PREC)
    b_g, _ = _load_gc(gc, t0, L, tok, mt, i_h, H)
    b_s = b_g * _LOG2E
    causal = o_t[:, None] <= o_t[None, :]
    b_a = tl.where(causal, b_a * tl.math.exp2(b_s[None, :] - b_s[:, None]), 0.0) * scale
    b_a = b_a.to(do.dtype.element_ty)
    for v0 in range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        mv = o_v < V
        b_do = tl.load(do + (tok[:, None] * H + i_h) * V + o_v[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
        b_dv = _dot(b_a, b_do, input_precision=PREC)
        tl.store(dv + (tok[:, None] * H + i_h) * V + o_v[None, :], b_dv.to(dv.dtype.element_ty),
                 mask=mt[:, None] & mv[None, :])


@triton.autotune(
    configs=_configs([
        triton.Config({"BV": bv}, num_warps=nw, num_stages=ns)
        for (bv, nw, ns) in ((32, 4, 2), (64, 4, 2), (16, 2, 2), (16, 4, 1))
    ]),
    prune_configs_by=_PRUNE,
    key=["H", "K", "V"],  # the autotuner adds the tensors' dtypes to the key
)
@triton.jit
def _bwd_dhu_kernel(
    q, k, w, do, dv_local, dv, gc, dht, dh0, dh, scale, cu, co,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
):
    """Reverse recurrence over chunks. dh[c] = gradient w.r.t. the state after chunk c;
    dv = d(v') = dv_local + (k gamma_C / gamma) dh[c]."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    boh = tl.load(co + i_n).to(tl.int64)
    NTn = tl.cdiv(eos - bos, BT)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mk, mv = o_k < K, o_v < V
    mkv = mk[:, None] & mv[None, :]
    s_off = o_k[:, None] * V + o_v[None, :]
    dt = k.dtype.element_ty

    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        b_dh += tl.load(dht + i_nh.to(tl.int64) * K * V + s_off, mask=mkv, other=0.0).to(tl.float32)
    for i in range(0, NTn):
        c = NTn - 1 - i
        t0 = bos + c * BT
        L = tl.minimum(eos - t0, BT)
        mt = o_t < L
        tok = t0 + o_t
        tl.store(dh + ((boh + c) * H + i_h) * K * V + s_off, b_dh.to(dh.dtype.element_ty), mask=mkv)
        b_g, g_last = _load_gc(gc, t0, L, tok, mt, i_h, H)
        b_k = tl.load(k + (tok[:, None] * H + i_h) * K + o_k[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
        b_k = (b_k * tl.exp(g_last - b_g)[:, None]).to(dt)
        b_dvl = tl.load(dv_local + (tok[:, None] * H + i_h) * V + o_v[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
        b_dv = b_dvl.to(tl.float32) + _dot(b_k, b_dh.to(dt), input_precision=PREC)
        tl.store(dv + (tok[:, None] * H + i_h) * V + o_v[None, :], b_dv.to(dv.dtype.element_ty),
                 mask=mt[:, None] & mv[None, :])
        b_q = tl.load(q + (tok[:, None] * H + i_h) * K + o_k[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
        b_q = (b_q * (scale * tl.exp(b_g))[:, None]).to(dt)
        b_w = tl.load(w + (tok[:, None] * H + i_h) * K + o_k[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
        b_do = tl.load(do + (tok[:, None] * H + i_h) * V + o_v[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
        b_dh = b_dh * tl.exp(g_last) + _dot(tl.trans(b_q), b_do, input_precision=PREC) \
            - _dot(tl.trans(b_w), b_dv.to(dt), input_precision=PREC)
    if STORE_DH0:
        tl.store(dh0 + i_nh.to(tl.int64) * K * V + s_off, b_dh, mask=mkv)


@triton.autotune(
    configs=_configs([
        triton.Config({"BV": bv}, num_warps=nw, num_stages=ns)
        for (bv, nw, ns) in ((64, 4, 2), (32, 4, 2), (16, 4, 1))
    ]),
    prune_configs_by=_PRUNE,
    key=["H", "K", "V"],  # the autotuner adds the tensors' dtypes to the key
)
@triton.jit
def _bwd_dqkwg_kernel(
    q, k, vn, h, dh, do, dv, gc, dq, dk, dw, dgc, scale, cu, ci, TT,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    """Per chunk and K block: dq, dk (paths through o and the next state), dw = -dv' S0^T and
    the partial d(gc) of this K block (summed over blocks by the caller)."""
    i_k, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0, L = _chunk_bounds(cu, ci, i_c, BT)
    o_t = tl.arange(0, BT)
    mt = o_t < L
    tok = t0 + o_t
    o_k = i_k * BK + tl.arange(0, BK)
    mk = o_k < K
    s_base = (i_c.to(tl.int64) * H + i_h) * K * V
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dkh = tl.zeros([BT, BK], dtype=tl.float32)
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    b_ds = tl.zeros([BT, BT], dtype=tl.float32)
    b_hdh = tl.zeros([BV, BK], dtype=tl.float32)
    for v0 in range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        mv = o_v < V
        m_tv = mt[:, None] & mv[None, :]
        m_vk = mv[:, None] & mk[None, :]
        b_v = tl.load(vn + (tok[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.0)
        b_do = tl.load(do + (tok[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.0)
        b_dv = tl.load(dv + (tok[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.0)
        b_h = tl.load(h + s_base + o_k[None, :] * V + o_v[:, None], mask=m_vk, other=0.0)     # S0^T [BV, BK]
        b_dh = tl.load(dh + s_base + o_k[None, :] * V + o_v[:, None], mask=m_vk, other=0.0)   # dS1^T
        b_dq += _dot(b_do, b_h, input_precision=PREC)
        b_ds += _dot(b_do, tl.trans(b_v), input_precision=PREC)
        b_dkh += _dot(b_v, b_dh, input_precision=PREC)
        b_dw += _dot(b_dv, b_h, input_precision=PREC)
        b_hdh += b_h.to(tl.float32) * b_dh.to(tl.float32)
    m_tk = mt[:, None] & mk[None, :]
    p_tk = (tok[:, None] * H + i_h) * K + o_k[None, :]
    tl.store(dw + p_tk, (-b_dw).to(dw.dtype.element_ty), mask=m_tk)
    b_g, g_last = _load_gc(gc, t0, L, tok, mt, i_h, H)
    b_q = tl.load(q + p_tk, mask=m_tk, other=0.0)
    b_k = tl.load(k + p_tk, mask=m_tk, other=0.0)
    causal = o_t[:, None] >= o_t[None, :]
    b_s = b_g * _LOG2E
    b_ds = tl.where(causal, b_ds * tl.math.exp2(b_s[:, None] - b_s[None, :]), 0.0) * scale
    b_dsc = b_ds.to(b_k.dtype)
    b_dq = b_dq * (scale * tl.exp(b_g))[:, None] + _dot(b_dsc, b_k, input_precision=PREC)
    b_dkh = tl.where(mt[:, None], b_dkh * tl.exp(g_last - b_g)[:, None], 0.0)
    b_dk = b_dkh + _dot(tl.trans(b_dsc), b_q, input_precision=PREC)
    tl.store(dq + p_tk, b_dq.to(dq.dtype.element_ty), mask=m_tk)
    tl.store(dk + p_tk, b_dk.to(dk.dtype.element_ty), mask=m_tk)
    b_qf = b_q.to(tl.float32)
    b_kf = b_k.to(tl.float32)
    # d(gc)_t = q_t.dq_t - k_t.dk_t; the last token also owns gamma_C in S1
    b_dg = tl.sum(b_qf * b_dq, 1) - tl.sum(b_kf * b_dk, 1)
    last = tl.exp(g_last) * tl.sum(tl.sum(b_hdh, 1), 0) + tl.sum(tl.sum(b_kf * b_dkh, 1), 0)
    b_dg = tl.where(o_t == L - 1, b_dg + last, b_dg)
    tl.store(dgc + i_k * TT * H + tok * H + i_h, b_dg, mask=mt)


@triton.jit
def _bwd_wy_kernel(
    k, v, beta, gc, Tm, dw, du, dk, dgc, dv, dbeta, dg, cu, ci,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, DA_PREC: tl.constexpr,
):
    """Gradients through w = Tm (beta gamma k), u = Tm (beta v), Tm = (I + A)^-1; reads the partial
    dk (from _bwd_dqkwg) and writes the whole dk, dv, dbeta and dg (reverse in-chunk cumsum of the
    total d(gc)).

    Four passes, so that few [BT, BT] tiles are live at once (with Tm, dTm, A's k k^T and the
    loops' tiles all kept, ptxas spilled 5 KB a thread at 4 warps and the kernel took 1.2 ms a
    layer of a 16 x 1024-token training step, 35% of the GDN stage's GPU time, H100 2026-11-26;
    0.135 ms now, see WY_NUM_WARPS):
      1. dTm = dw (beta gamma k)^T + du (beta v)^T, and dv, dbeta's v term on the way;
      2. dA = -Tm^T dTm Tm^T (fp32 products, ``DA_PREC``: it cancels heavily), G = dA gamma_i / gamma_j;
      3. k k^T, for the dA * A terms of dbeta and d(gc);
      4. dk = dk_in + (Tm^T dw) beta gamma + (beta G) k + (beta G)^T k, and the k terms of dbeta,
         d(gc), with Tm^T dw recomputed there rather than kept from pass 1.
    Tm^T is read transposed from memory (no register transpose) and Tm again in fp32 for pass 2."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, L = _chunk_bounds(cu, ci, i_c, BT)
    o_t = tl.arange(0, BT)
    mt = o_t < L
    tok = t0 + o_t
    dt = k.dtype.element_ty
    b_g, _ = _load_gc(gc, t0, L, tok, mt, i_h, H)
    b_b = tl.load(beta + tok * H + i_h, mask=mt, other=0.0).to(tl.float32)
    f = b_b * tl.exp(b_g)
    b_db = tl.zeros([BT], dtype=tl.float32)
    # 1. dTm
    b_dT = tl.zeros([BT, BT], dtype=tl.float32)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_tk = mt[:, None] & (o_k < K)[None, :]
        p_tk = (tok[:, None] * H + i_h) * K + o_k[None, :]
        b_k = tl.load(k + p_tk, mask=m_tk, other=0.0)
        b_dw = tl.load(dw + p_tk, mask=m_tk, other=0.0)
        b_dT += _dot(b_dw, tl.trans((b_k * f[:, None]).to(dt)), input_precision=PREC)
    # Tm^T [i, j] = Tm[j, i]: rows j of Tm are tokens
    p_Tt = Tm + tok[None, :] * (H * BT) + i_h * BT + o_t[:, None]
    b_Tt = tl.load(p_Tt, mask=mt[None, :], other=0.0).to(dt)
    for v0 in range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        m_tv = mt[:, None] & (o_v < V)[None, :]
        p_tv = (tok[:, None] * H + i_h) * V + o_v[None, :]
        b_v = tl.load(v + p_tv, mask=m_tv, other=0.0)
        b_du = tl.load(du + p_tv, mask=m_tv, other=0.0)
        b_dvb = _dot(b_Tt, b_du, input_precision=PREC)                  # d(beta v)
        b_db += tl.sum(b_v.to(tl.float32) * b_dvb, 1)
        tl.store(dv + p_tv, (b_dvb * b_b[:, None]).to(dv.dtype.element_ty), mask=m_tv)
        b_dT += _dot(b_du, tl.trans((b_v * b_b[:, None]).to(dt)), input_precision=PREC)
    # 2. dA = -Tm^T dTm Tm^T on the strict lower triangle
    b_Tt32 = tl.load(p_Tt, mask=mt[None, :], other=0.0)
    b_dA = _dot(b_Tt32, b_dT, input_precision=DA_PREC)
    b_dA = -_dot(b_dA, b_Tt32, input_precision=DA_PREC)
    strict = (o_t[:, None] > o_t[None, :]) & mt[:, None]
    b_s = b_g * _LOG2E
    b_G = tl.where(strict, b_dA * tl.math.exp2(b_s[:, None] - b_s[None, :]), 0.0)
    # 3. dA * A terms: A = beta_i (k_i . k_j) gamma_i / gamma_j
    b_KK = tl.zeros([BT, BT], dtype=tl.float32)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_tk = mt[:, None] & (o_k < K)[None, :]
        b_k = tl.load(k + (tok[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
        b_KK += _dot(b_k, tl.trans(b_k), input_precision=PREC)
    b_GK = b_G * b_KK
    b_db += tl.sum(b_GK, 1)
    b_R = b_GK * b_b[:, None]                                            # dA * A
    b_dg = tl.load(dgc + tok * H + i_h, mask=mt, other=0.0) + tl.sum(b_R, 1) - tl.sum(b_R, 0)
    # (beta G) k + (beta G)^T k in one product: the two are strictly lower / upper, so their sum
    # rounds to bf16 exactly as each alone
    b_bG = b_G * b_b[:, None]
    b_bG = (b_bG + tl.trans(b_bG)).to(dt)
    b_Tt = tl.load(p_Tt, mask=mt[None, :], other=0.0).to(dt)
    # 4. dk
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_tk = mt[:, None] & (o_k < K)[None, :]
        p_tk = (tok[:, None] * H + i_h) * K + o_k[None, :]
        b_k = tl.load(k + p_tk, mask=m_tk, other=0.0)
        b_dw = tl.load(dw + p_tk, mask=m_tk, other=0.0)
        b_dkb = _dot(b_Tt, b_dw, input_precision=PREC)                  # d(beta gamma k)
        s = tl.sum(b_k.to(tl.float32) * b_dkb, 1)
        b_db += tl.math.exp2(b_s) * s
        b_dg += f * s
        b_dk = tl.load(dk + p_tk, mask=m_tk, other=0.0).to(tl.float32) + b_dkb * f[:, None]
        b_dk += _dot(b_bG, b_k, input_precision=PREC)
        tl.store(dk + p_tk, b_dk.to(dk.dtype.element_ty), mask=m_tk)
    tl.store(dbeta + tok * H + i_h, b_db.to(dbeta.dtype.element_ty), mask=mt)
    b_dg = tl.where(mt, b_dg, 0.0)
    # g -> gc is an in-chunk cumsum, so dg is the reverse in-chunk cumsum of d(gc)
    b_rc = tl.sum(b_dg, 0) - tl.cumsum(b_dg, 0) + b_dg
    tl.store(dg + tok * H + i_h, b_rc.to(dg.dtype.element_ty), mask=mt)


# --------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


def _prec(dtype: torch.dtype, K: int, V: int) -> str:
    """The kernels' ``PREC``: "ieee" for float32 inputs (true fp32 products; tf32 would cost ~1e-3
    relative error), "upcast" for the 16-bit cases the GPU got wrong natively (see ``_dot``), else
    native 16-bit products ("tf32" is then ignored by tl.dot)."""
    if dtype == torch.float32:
        return "ieee"
    if not _NATIVE_DOTS and (dtype == torch.float16 or min(K, V) < 64):
        return "upcast"
    return "tf32"


def _dense_meta(B: int, T: int, device: torch.device):
    # built on the device at every call, not cached: a cached tensor first made inside a CUDA-graph
    # tree's warm-up (torch.compile mode="reduce-overhead", `linearize distill --cuda-graphs`) lives
    # in the tree's memory pool untracked, and the tree stops ("tensors in the cudagraph pool not
    # tracked as outputs"); host-made tensors copied in would be stale under capture
    NTs = triton.cdiv(T, BT)
    i32 = dict(dtype=torch.int32, device=device)
    cu = torch.arange(0, B + 1, **i32) * T
    co = torch.arange(0, B + 1, **i32) * NTs
    n = torch.arange(B * NTs, **i32)
    ci = torch.stack([n // NTs, n % NTs], 1)
    return cu, co, ci, B * NTs


def _meta(B: int, T: int, cu_seqlens: torch.Tensor | None, device: torch.device):
    """(cu_seqlens int32 [N+1], chunk offsets int32 [N+1], chunk indices int32 [NT, 2], NT)."""
    if cu_seqlens is None:
        return _dense_meta(B, T, device)
    lens = cu_seqlens.diff().tolist()  # one host sync: the grid size depends on it
    nts = [triton.cdiv(n, BT) for n in lens]
    co = torch.tensor([0] + nts, dtype=torch.int64).cumsum(0).to(torch.int32)
    ci = torch.tensor([(n, c) for n, m in enumerate(nts) for c in range(m)], dtype=torch.int32).reshape(-1, 2)
    return cu_seqlens.to(torch.int32), co.to(device), ci.to(device), int(co[-1])


def _fwd_h(k, w, u, gc, h0, output_final_state, cu, co, NT, N):
    TT, H, K = k.shape
    V = u.shape[-1]
    BK = _pow2(K)
    h = k.new_empty(NT, H, K, V)
    vn = torch.empty_like(u)
    ht = k.new_empty(N, H, K, V, dtype=torch.float32) if output_final_state else None
    grid = lambda meta: (triton.cdiv(V, meta["BV"]), N * H)
    _fwd_h_kernel[grid](
        k, w, u, gc, h0, h, vn, ht, cu, co, H, K, V,
        BT=BT, BK=BK, PREC=_prec(k.dtype, K, V), USE_H0=h0 is not None, STORE_HT=output_final_state,
    )
    return h, vn, ht


@dataclasses.dataclass(frozen=True)
class UTSolve:
    """How the UT transform (the chunk's [64, 64] triangular inverse) runs at inference; training (the
    backward reads the stored inverse, ``store_tm``) and float32 inputs always take fp32 FMA products
    ("ieee") and forward substitution. Passed to :func:`chunk_fwd` (``UT_SOLVE`` by default); the
    measurements behind the defaults are in docs/reports/kernels.md (H100, 2026-11-27).

    Args:
        fast: tensor-core products for 16-bit inputs at inference (False: "ieee" everywhere). The
            inverse is rounded to the inputs' dtype before its use, so products finer than it lose nothing.
        tprec: the products' precision by input dtype. bfloat16 takes one tf32 product (its 10-bit
            mantissa is finer than bfloat16's, as fla's solve does); float16 keeps "tf32x3" (three tf32
            products, ~fp32), tf32's mantissa being float16's own. bf16 forward at 32K: 2.45 -> 1.71 ms
            (D=64), 4.02 -> 3.56 ms (D=128), output errors unchanged to three digits.
        diag: how the four diagonal [16, 16] blocks are inverted with tensor-core products: "merge"
            (blocks merged 2 -> 16, every intermediate a block of the inverse), "pow" (the product form
            (I - A)(I + A^2)(I + A^4)(I + A^8): nan with one tf32 product on alike keys, tf32x3 only) or
            "subst" (15 serial substitution steps; always with "ieee").
        diag_max_k: the largest head dim ``diag`` applies to with "tf32" (tf32x3 spills above 64).
        bk: the K tile at inference (None: the head dim up to 64; 32 was 8% faster at D=64, 32K).
    """

    fast: bool = True
    tprec: tuple = (("bfloat16", "tf32"), ("float16", "tf32x3"))
    diag: str = "merge"
    diag_max_k: int = 128
    bk: int | None = 32

    def __post_init__(self):
        if self.diag not in ("merge", "pow", "subst"):
            raise ValueError(f"UTSolve.diag must be 'merge', 'pow' or 'subst', got {self.diag!r}")
        if any(p not in ("tf32", "tf32x3", "ieee") for _, p in self.tprec):
            raise ValueError(f"UTSolve.tprec precisions must be 'tf32', 'tf32x3' or 'ieee', got {self.tprec!r}")

    def t_prec(self, dtype, store_tm: bool) -> str:
        """The block products' precision for inputs of ``dtype``."""
        if not self.fast or store_tm:
            return "ieee"
        return dict(self.tprec).get(str(dtype).removeprefix("torch."), "ieee")

    def block_k(self, K: int, tprec: str) -> int:
        """The UT-transform kernel's K tile: the head dim up to 64, at inference at most ``bk``."""
        bk = min(_pow2(K), 64)
        return min(bk, self.bk or bk) if tprec != "ieee" else bk

    def diag_for(self, tprec: str, K: int) -> str:
        if tprec == "ieee":
            return "subst"
        return self.diag if K <= (self.diag_max_k if tprec == "tf32" else 64) else "subst"


UT_SOLVE = UTSolve()


def chunk_fwd(q, k, v, g, beta, scale, h0, output_final_state, cu, co, ci, NT, N, store_tm=True, split=None,
              solve: UTSolve = UT_SOLVE):
    """q, k: [TT, H, K]; v: [TT, H, V]; g, beta: [TT, H] (packed tokens). Returns
    o [TT, H, V], final state or None, and the tensors the backward needs. ``split`` = (B, T,
    num_splits): the state pass cut along time (the split-time section below; dense rows, inference only)."""
    TT, H, K = k.shape
    V = v.shape[-1]
    BV = min(_pow2(V), 64)
    prec = _prec(k.dtype, K, V)
    gc = torch.empty(TT, H, device=k.device, dtype=torch.float32)
    Tm = torch.empty(TT if store_tm else 1, H, BT, device=k.device, dtype=torch.float32)
    w = torch.empty_like(k)
    u = torch.empty_like(v)
    tprec = solve.t_prec(k.dtype, store_tm)
    _wy_fwd_kernel[(NT, H)](k, v, g, beta, gc, Tm, w, u, cu, ci, H, K, V, BT=BT, BK=solve.block_k(K, tprec), BV=BV,
                            PREC=prec, STORE_T=store_tm, TPREC=tprec, DIAG=solve.diag_for(tprec, K))  # autotuned: the tuner skips configs that do not fit
    if split is not None and split[2] > 1:
        h, vn, ht = split_fwd_h(k, w, u, gc, h0, output_final_state, *split)
    else:
        h, vn, ht = _fwd_h(k, w, u, gc, h0, output_final_state, cu, co, NT, N)
    o = torch.empty_like(v)
    grid = lambda meta: (triton.cdiv(V, meta["BV"]), NT, H)
    _fwd_o_kernel[grid](q, k, vn, h, gc, o, scale, cu, ci, H, K, V, BT=BT, PREC=prec)
    return o, ht, (gc, Tm, w, u)


# _bwd_wy_kernel's warps and the precision of its dA = -Tm^T dTm Tm^T products ("ieee": fp32 FMA
# products; "tf32x3": three tf32 tensor-core products, as exact here: the same gradient errors to three
# digits). measured in docs/reports/kernels.md (H100 2026-11-26):
# at the GDN training shape (16 x 1024 tokens, 9 heads of 64) the kernel took 1.18 ms before the
# four passes, 0.57 with them (4 warps, ieee), 0.43 (8, ieee), 0.25 (8, tf32x3), 0.135 (4, tf32x3).
# 8 warps also broke the fp16 "upcast" products at K = 16 (fuzz seed 271: an out-of-bounds shared
# memory read with ieee, wrong dk with tf32x3); 4 warps passed it.
WY_NUM_WARPS = 4
WY_DA_PREC = "tf32x3"


def chunk_bwd(q, k, v, beta, gc, Tm, w, u, scale, h0, do, dht, cu, co, ci, NT, N):
    TT, H, K = k.shape
    V = v.shape[-1]
    BK, BV = min(_pow2(K), 64), min(_pow2(V), 64)
    prec = _prec(k.dtype, K, V)
    do = do.contiguous()
    h, vn, _ = _fwd_h(k, w, u, gc, h0, False, cu, co, NT, N)
    dv_local = torch.empty_like(v)
    launch(_bwd_dv_local_kernel, (NT, H), q, k, do, gc, dv_local, scale, cu, ci, H, K, V,
           BT=BT, BK=BK, BV=BV, PREC=prec, num_warps=4, num_stages=3)
    dh = k.new_empty(NT, H, K, V)
    dvn = torch.empty_like(v)
    dh0 = torch.empty(N, H, K, V, device=k.device, dtype=torch.float32) if h0 is not None else None
    grid = lambda meta: (triton.cdiv(V, meta["BV"]), N * H)
    _bwd_dhu_kernel[grid](
        q, k, w, do, dv_local, dvn, gc, dht, dh0, dh, scale, cu, co, H, K, V,
        BT=BT, BK=_pow2(K), PREC=prec, USE_DHT=dht is not None, STORE_DH0=h0 is not None,
    )
    del dv_local
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dw = torch.empty_like(w)
    # one partial d(gc) row per K block, summed below
    NK = triton.cdiv(K, BK)
    dgc = torch.empty(NK, TT, H, device=k.device, dtype=torch.float32)
    _bwd_dqkwg_kernel[(NK, NT, H)](
        q, k, vn, h, dh, do, dvn, gc, dq, dk, dw, dgc, scale, cu, ci, TT, H, K, V,
        BT=BT, BK=BK, PREC=prec,
    )
    dgc = dgc[0] if NK == 1 else dgc.sum(0)
    del h, dh
    dv = torch.empty_like(v)
    dbeta = torch.empty_like(beta)
    dg = torch.empty(TT, H, device=k.device, dtype=torch.float32)
    launch(_bwd_wy_kernel, (NT, H), k, v, beta, gc, Tm, dw, dvn, dk, dgc, dv, dbeta, dg, cu, ci, H, K, V,
           BT=BT, BK=BK, BV=BV, PREC=prec, DA_PREC=WY_DA_PREC, num_warps=WY_NUM_WARPS, num_stages=3)
    return dq, dk, dv, dg, dbeta, dh0


def _chunk_gated_delta_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, h0: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None, B: int, T: int, scale: float, store_tm: bool, num_splits: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunk forward as a torch op over packed tokens: q, k [TT, H, K], v [TT, H, V], g (fp32),
    beta [TT, H]. Returns o, the final state [N, H, K, V] fp32, and what the backward reads (gc,
    Tm, w, u; Tm has one row unless ``store_tm``). ``num_splits > 1`` cuts the state pass along time
    (the split-time section below): inference (``store_tm`` False) of dense rows only."""
    cu, co, ci, NT = _meta(B, T, cu_seqlens, q.device)
    split = (B, T, num_splits) if num_splits > 1 and cu_seqlens is None and not store_tm else None
    o, ht, (gc, Tm, w, u) = chunk_fwd(q, k, v, g, beta, scale, h0, True, cu, co, ci, NT, cu.numel() - 1,
                                      store_tm=store_tm, split=split)
    return o, ht, gc, Tm, w, u


chunk_gated_delta_fwd_op = torch.library.custom_op("linearize::chunk_gated_delta_fwd", mutates_args=())(
    _chunk_gated_delta_fwd)


@chunk_gated_delta_fwd_op.register_fake
def _(q, k, v, g, beta, h0, cu_seqlens, B, T, scale, store_tm, num_splits=1):
    TT, H, K = k.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    f32 = dict(dtype=torch.float32)
    return (torch.empty_like(v), q.new_empty(N, H, K, v.shape[-1], **f32), q.new_empty(TT, H, **f32),
            q.new_empty(TT if store_tm else 1, H, BT, **f32), torch.empty_like(k), torch.empty_like(v))


@torch.library.custom_op("linearize::chunk_gated_delta_bwd", mutates_args=())
def chunk_gated_delta_bwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, gc: torch.Tensor, Tm: torch.Tensor,
    w: torch.Tensor, u: torch.Tensor, h0: torch.Tensor | None, cu_seqlens: torch.Tensor | None, B: int, T: int,
    scale: float, do: torch.Tensor, dht: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv, dg (fp32), dbeta, dh0 (empty without an initial state)."""
    cu, co, ci, NT = _meta(B, T, cu_seqlens, q.device)
    dht = None if dht is None else dht.contiguous().float()
    dq, dk, dv, dg, dbeta, dh0 = chunk_bwd(q, k, v, beta, gc, Tm, w, u, scale, h0, do, dht, cu, co, ci, NT,
                                           cu.numel() - 1)
    return dq, dk, dv, dg, dbeta, (q.new_empty(0, dtype=torch.float32) if dh0 is None else dh0)


@chunk_gated_delta_bwd_op.register_fake
def _(q, k, v, beta, gc, Tm, w, u, h0, cu_seqlens, B, T, scale, do, dht):
    dh0 = q.new_empty(0, dtype=torch.float32) if h0 is None else torch.empty_like(h0)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(gc),
            torch.empty_like(beta), dh0)


def _gdn_setup(ctx, inputs, output):
    q, k, v, g, beta, h0, cu_seqlens, B, T, scale, store_tm, num_splits = inputs
    o, ht, gc, Tm, w, u = output
    ctx.save_for_backward(q, k, v, beta, gc, Tm, w, u, h0, cu_seqlens)
    ctx.args = (B, T, scale)


def _gdn_backward(ctx, do, dht, dgc, dTm, dw, du):
    q, k, v, beta, gc, Tm, w, u, h0, cu_seqlens = ctx.saved_tensors
    if Tm.shape[0] != q.shape[0]:
        raise RuntimeError("chunk_gated_delta_fwd ran with store_tm=False: call chunk_gated_delta_rule with "
                           "inputs that require grad to train through it")
    B, T, scale = ctx.args
    dq, dk, dv, dg, dbeta, dh0 = torch.ops.linearize.chunk_gated_delta_bwd(
        q, k, v, beta, gc, Tm, w, u, h0, cu_seqlens, B, T, scale, do, dht)
    return dq, dk, dv, dg, dbeta, (None if h0 is None else dh0), None, None, None, None, None, None


chunk_gated_delta_fwd_op.register_autograd(_gdn_backward, setup_context=_gdn_setup)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(x.dtype)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule, chunkwise-parallel Triton kernels (training and prefill).

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]; one dtype among float32 / bfloat16 / float16.
        g: [B, T, H] log decay (alpha_t = exp(g_t), g <= 0); computed in float32.
        beta: [B, T, H] write strength in (0, 1).
        scale: query scale, default K ** -0.5.
        initial_state: [N, H, K, V] (N = B, or the number of sequences with cu_seqlens).
        output_final_state: also return the final state [N, H, K, V] (float32).
        use_qk_l2norm: L2-normalise q and k first (in PyTorch, differentiable).
        cu_seqlens: int [N+1] offsets of N sequences packed in a batch of size 1; no state
            crosses a boundary.
        num_splits: without gradients and cu_seqlens, cut each row's state pass into this many
            segments run in parallel (the split-time section below); None or 1: no split (it did not pay on the
            shapes measured).
    Returns:
        o [B, T, H, V] in v's dtype, and the final state or None. Differentiable in q, k, v,
        g, beta and initial_state.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"q, k must be [B, T, H, K] and v [B, T, H, V]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if g.shape != q.shape[:3] or beta.shape != q.shape[:3]:
        raise ValueError(f"g and beta must be [B, T, H] = {tuple(q.shape[:3])}; got {tuple(g.shape)}, "
                         f"{tuple(beta.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or v.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"q, k, v must share one dtype among float32/bfloat16/float16; got "
                        f"{q.dtype}, {k.dtype}, {v.dtype}")
    if not (16 <= K <= 256 and 16 <= V <= 256):
        raise ValueError(f"head dims must lie in [16, 256]; got K={K}, V={V}")
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"with cu_seqlens the batch must be packed to size 1; got B={B}")
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if initial_state is not None and initial_state.shape != (N, H, K, V):
        raise ValueError(f"initial_state must be [N, H, K, V] = {(N, H, K, V)}; got {tuple(initial_state.shape)}")
    scale = K ** -0.5 if scale is None else float(scale)
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    h0 = None if initial_state is None else initial_state.float().contiguous()
    args = (q.reshape(B * T, H, K).contiguous(), k.reshape(B * T, H, K).contiguous(),
            v.reshape(B * T, H, V).contiguous(), g.reshape(B * T, H).float().contiguous(),
            beta.reshape(B * T, H).contiguous(), h0)
    grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in args)
    n = 1
    if cu_seqlens is None and not grad and num_splits is not None:  # inference: the state pass cut along time
        n = int(num_splits)
        if n > 1 and K > MAX_K:
            raise ValueError(f"num_splits={n} takes key dims up to {MAX_K} (the scan holds a K x K matrix); "
                             f"got K={K}: pass num_splits=1")
    # inference (grad False) skips the tensors only the backward needs
    fwd = _chunk_gated_delta_fwd if call_directly(grad) else torch.ops.linearize.chunk_gated_delta_fwd
    o, ht, *_ = fwd(*args, cu_seqlens, B, T, scale, grad, n)
    return o.reshape(B, T, H, V), (ht if output_final_state else None)


# ----------------------------------------------------------------------------------------------------
# Split-time inference forward (formerly split.py)
#
# Split-time inference forward of the gated delta rule: the state pass with more parallelism.
#
# Of the chunk forward's three kernels (chunk.py), two are parallel over chunks; the state pass
# (``_fwd_h_kernel``) gives one program to each (sequence, head, block of V) and walks the chunks in
# order. Prefilling one long prompt (B=1, H=9, V=64) that is 18 programs on 132 multiprocessors,
# each walking the 1,024 chunks of a 64K-token prompt.
#
# The pass is affine in the state it starts from: over a segment of chunks,
#
#     S_end = M S_start + R,
#
# M [K, K] the product of the chunks' ``exp(g_C) I - (k exp(g_C - g))^T w`` and R [K, V] the state
# the segment builds from zero. Each column of the state evolves on its own, so one run of the same
# kernel from the state ``[I | 0]`` with values ``[0 | u]`` (K + V columns) ends in ``[M | R]``.
# Without gradients, for ``num_splits`` segments of whole chunks per row:
#
# 1. ``[M_j | R_j]`` of every segment, all segments in parallel (``_fwd_h_kernel`` with ``ID=K``:
#    the identity columns built in the kernel, no per-chunk states written);
# 2. a scan over the segments, one program per (row, head, block of V), ``S_{j+1} = M_j S_j + R_j``
#    from the initial state (``_scan_kernel``); the last one is the final state;
# 3. ``_fwd_h_kernel`` on the segments as packed sequences, each from its entering state: the
#    per-chunk states and v' that the output kernel reads, in the unsplit pass's layout.
#
# Pass 1 costs (K + V) / V of a state pass and pass 3 one more, each spread over ``num_splits`` times
# as many programs: worth it only where the unsplit pass leaves most of the GPU idle and is a large
# share of the forward. The result equals the unsplit pass up to rounding: M_j enters pass 1's
# products in the input dtype, as the state itself does there.
#
# It runs on request only (``chunk_gated_delta_rule(num_splits=N)``). Measured on an H100
# (``scripts/bench_gdn.py`` part 4, 2026-11-26; ``docs/reports/kernels.md``), one prompt of the
# SmolLM2 shape (B=1, H=9, D=64) gained nothing at 64K tokens with the 15 segments ``splits_for``
# proposes (1.98 ms against 1.97) and was 2.7x slower at 8K with 8 (0.72 ms against 0.27), which
# made gdn's chunked prefill slower end to end: the state pass is a small share of the forward there.

MAX_K = 128  # the scan holds M [K, K] in fp32 registers; larger key dims keep the unsplit pass


def splits_for(B: int, T: int, H: int, V: int, sms: int, min_len: int = 1024) -> int:
    """A candidate number of segments for a GPU of ``sms`` multiprocessors: programs for two waves,
    each segment at least ``min_len`` tokens, none where the unsplit pass has programs for more than
    a quarter of the multiprocessors (``linear_attn.chunk.auto_splits``' rule). What the bench
    measures; not a default (see the module's docstring)."""
    programs = B * H * triton.cdiv(V, 32)  # BV = 32: the tuner's usual pick at V = 64
    if programs > sms // 4:
        return 1
    return max(1, min(-(-2 * sms // programs), T // min_len))


@triton.jit
def _scan_kernel(mr, h0, init, ht, NS, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 BK: tl.constexpr, BV: tl.constexpr, USE_H0: tl.constexpr):
    """mr [B*NS, H, K, K+V] fp32: each segment's [M | R]. Writes the state entering each segment
    (init [B*NS, H, K, V]) and the one after the last (ht [B, H, K, V])."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mk, mv = o_k < K, o_v < V
    s_off = o_k[:, None] * V + o_v[None, :]
    b_s = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_s += tl.load(h0 + i_bh.to(tl.int64) * K * V + s_off, mask=mk[:, None] & mv[None, :], other=0.0)
    for j in range(0, NS):
        seg = (i_b * NS + j).to(tl.int64) * H + i_h
        tl.store(init + seg * K * V + s_off, b_s, mask=mk[:, None] & mv[None, :])
        p = mr + seg * K * (K + V)
        b_m = tl.load(p + o_k[:, None] * (K + V) + o_k[None, :], mask=mk[:, None] & mk[None, :], other=0.0)
        b_r = tl.load(p + o_k[:, None] * (K + V) + K + o_v[None, :], mask=mk[:, None] & mv[None, :], other=0.0)
        b_s = tl.dot(b_m, b_s, input_precision="ieee") + b_r
    tl.store(ht + i_bh.to(tl.int64) * K * V + s_off, b_s, mask=mk[:, None] & mv[None, :])


@functools.lru_cache(maxsize=64)
def _segments(B: int, T: int, L: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The segments as packed sequences: their token offsets and chunk offsets (int32 [B*n + 1]), cached
    per shape and device (every layer of a prefill asks for the same; building them is launches)."""
    nts = triton.cdiv(T, BT)
    starts = torch.arange(B)[:, None] * T + torch.arange(0, T, L)[None]
    cstarts = torch.arange(B)[:, None] * nts + torch.arange(0, T, L)[None] // BT
    return tuple(torch.cat([x.flatten(), torch.tensor([last])]).to(torch.int32).to(device)
                 for x, last in ((starts, B * T), (cstarts, B * nts)))


def split_fwd_h(k, w, u, gc, h0, output_final_state, B, T, num_splits):
    """The state pass of ``chunk_fwd`` over ``num_splits`` segments per row (dense rows).

    k, w [B*T, H, K]; u [B*T, H, V]; gc [B*T, H] fp32; h0 None or [B, H, K, V] fp32. Returns what
    ``_fwd_h`` does: the states at chunk starts [NT, H, K, V], v' [B*T, H, V] and the final
    state [B, H, K, V] fp32 (or None)."""
    _, H, K = k.shape
    V = u.shape[-1]
    L = triton.cdiv(triton.cdiv(T, num_splits), BT) * BT  # segment length: whole chunks
    n = triton.cdiv(T, L)
    cu, co = _segments(B, T, L, n, k.device)
    N = B * n
    NT = B * triton.cdiv(T, BT)
    prec = _prec(k.dtype, K, V)

    # 1. each segment's [M | R], all in parallel
    mr = k.new_empty(N, H, K, K + V, dtype=torch.float32)
    grid = lambda meta: (triton.cdiv(K + V, meta["BV"]), N * H)  # noqa: E731
    _fwd_h_kernel[grid](k, w, u, gc, None, None, None, mr, cu, co, H, K, K + V,
                               BT=BT, BK=_pow2(K), PREC=prec, USE_H0=False, STORE_HT=True, ID=K)

    # 2. the scan: the state entering every segment, and the final one
    init = k.new_empty(N, H, K, V, dtype=torch.float32)
    ht = k.new_empty(B, H, K, V, dtype=torch.float32)
    BV = min(_pow2(V), 32)
    _scan_kernel[(triton.cdiv(V, BV), B * H)](mr, h0, init, ht, n, H, K, V, BK=_pow2(K), BV=BV,
                                              USE_H0=h0 is not None, num_warps=4)

    # 3. the ordinary state pass on the segments, each from its entering state
    h, vn, _ = _fwd_h(k, w, u, gc, init, False, cu, co, NT, N)
    return h, vn, (ht if output_final_state else None)
