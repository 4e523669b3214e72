"""Chunkwise normalized feature-map linear attention: Triton kernels, autograd, public function.

One program owns one (sequence, head) and a block of the feature or value dimension and walks
the chunks of its sequence in order, carrying the state ``(S, z)`` in registers: the chunk
states never touch device memory, so the forward reads q, k, v once and writes o once (plus
one fp32 denominator per token, kept for the backward).  The normalizer is the linear
attention of a value column of ones, so it comes out of the same score tile.

Backward: with ``d_t = q_t . z_t + eps`` the normalized output is the unnormalized one with
value ``[v, 1]`` and output gradient ``[do_t / d_t, -(do_t . o_t) / d_t]``; one elementwise pass
writes both (``do / d`` and ``dd``), then three sweeps:

* ``dq`` (forward in time, blocks of F): intra-chunk ``(do v^T)`` plus ``do S^T``;
* ``dk`` (backward in time, blocks of F): intra-chunk plus ``v dS^T``; also writes dS_0, dz_0;
* ``dv`` (backward in time, blocks of Dv): intra-chunk plus ``k dS``.

The gate gradient follows from the rest: with ``B_t`` the cumulative log gate,
``dL/dB_t = q_t . dq_t - k_t . dk_t`` (each term is linear in q_t or k_t and carries
``exp(B_t - ...)`` or ``exp(... - B_t)``), plus ``<dS_T, S_T> + <dz_T, z_T>`` at the last
step; ``dlog_g`` is its reverse cumulative sum.  Normalized, o_t is invariant to scaling all of
q_t's terms except through eps, so ``q_t . dq_t = -eps dd_t`` exactly (no cancellation noise).

Sliding-window hybrid (``_window_attn``): the linear part runs through these kernels as an
ordinary causal linear attention with queries shifted by W (two unnormalized varlen passes, for
the numerator and the denominator); the softmax over the W newest keys and the combination of
both run in the Triton kernels of window.py (flash-attention style, forward and backward), which
read the linear outputs in place.  Packed sequences (cu_seqlens) go through both in one call each.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as Fn
import triton
import triton.language as tl

from ..launch import call_directly, launch
from .reference import _check_window
from .tiles import _next_pow2, _prec, _seq_bounds, _tile

# Chunk length, state-tile sizes (elements of the fp32 state block one program carries) and
# launch settings; module-level so a tuning script can override them.  CONFIG_BY_DIM overrides
# CONFIG for a head dim max(F, Dv) (picked on an H100 by scripts/bench_kernels.py --tune).
CONFIG = {
    "BT": 64, "bwd_BT": 64,  # chunk lengths of the forward and the backward (independent)
    "fwd_block_elems": 4096, "fwd_warps": 4, "fwd_stages": 3,
    "bwd_block_elems": 4096, "bwd_warps": 4, "bwd_stages": 3,
}
# From `bench_kernels.py --tune` on an H200 (triton 3.6), B=2, H=32, T=8K, bf16.
CONFIG_BY_DIM: dict[int, dict] = {
    64: {"fwd_block_elems": 4096, "bwd_block_elems": 1024},
    128: {"fwd_block_elems": 8192, "bwd_block_elems": 8192},
}


# The log decay that resets the linear state at a packed document's start (``_window_attn``'s q_lo):
# exp(-128) is 0 in float32; a power of two, so the kernels' in-chunk cumulative sums of a layer
# without a decay stay exact (the same value as linearize/layers.py RESET_LOG_DECAY, see there).
RESET_LOG_DECAY = 128.0


def _cfg(F: int, DV: int) -> dict:
    return {**CONFIG, **CONFIG_BY_DIM.get(max(F, DV), {})}


# ----------------------------------------------------------------------------- kernels

@triton.jit
def _load_gate(lg, bos, i_t, Tn, i_h, TT, BT: tl.constexpr):
    """Chunk-local cumulative log gate b [BT] and the chunk total (pads count as log g = 0).

    Per-token vectors (log g, d, dd) are stored [H, TT] so that a chunk's values are contiguous.
    """
    o_t = i_t * BT + tl.arange(0, BT)
    g = tl.load(lg + i_h * TT + bos + o_t, mask=o_t < Tn, other=0.).to(tl.float32)
    return tl.cumsum(g, axis=0), tl.sum(g, axis=0)


# T and TT stay runtime values in every chunk kernel (see _bwd_dv_kernel). The forward also
# raised illegal addresses on an H200 at B = T = 1 in fp16 (fuzz seeds 1785, 1925, F = 200 padded
# to 256, D = 32, gate, initial state): not replayed since this change.
@triton.jit(do_not_specialize=["T", "TT"])
def _fwd_kernel(
    q, k, v, lg, h0s, h0z, o, den, hts, htz, cu, T, TT, eps,
    H: tl.constexpr, F: tl.constexpr, DV: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, NORMALIZE: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr,
    STORE_DEN: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr, STATE_ONLY: tl.constexpr = False,
):
    """STATE_ONLY: only the final state (no q read, no output): split_time_fwd's pass over segments.
    STORE_DEN without NORMALIZE: o is the unnormalized numerator and ``den`` the denominator q.z (no
    eps), both from one pass (the window hybrid's linear terms, see ``_shifted_linear``)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, Tn = _seq_bounds(cu, i_n, T, IS_VARLEN)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    causal = o_t[:, None] >= o_t[None, :]
    TRACK_Z: tl.constexpr = NORMALIZE or STORE_HT or STORE_DEN
    DEN: tl.constexpr = NORMALIZE or STORE_DEN

    h = tl.zeros([BK, BV], dtype=tl.float32)
    z = tl.zeros([BK], dtype=tl.float32)
    if USE_H0:
        p_h0, m_h0 = _tile(h0s + i_nh * F * DV, 0, F, DV, i_v * BV, DV, BK, BV)
        h = tl.load(p_h0, mask=m_h0, other=0.).to(tl.float32)
        z = tl.load(h0z + i_nh * F + o_k, mask=o_k < F, other=0.).to(tl.float32)

    NT = tl.cdiv(Tn, BT)
    for i_t in range(0, NT):
        if not STATE_ONLY:
            p_q, m_q = _tile(q + (bos * H + i_h) * F, i_t * BT, Tn, H * F, 0, F, BT, BK)
        p_k, m_k = _tile(k + (bos * H + i_h) * F, i_t * BT, Tn, H * F, 0, F, BT, BK)
        p_v, m_v = _tile(v + (bos * H + i_h) * DV, i_t * BT, Tn, H * DV, i_v * BV, DV, BT, BV)
        if not STATE_ONLY:
            b_q = tl.load(p_q, mask=m_q, other=0.)
        b_k = tl.load(p_k, mask=m_k, other=0.)
        b_v = tl.load(p_v, mask=m_v, other=0.)

        if STATE_ONLY:
            if GATE:
                b_g, g_last = _load_gate(lg, bos, i_t, Tn, i_h, TT, BT)
        else:
            s = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)  # [BT, BT] q_i . k_j
            inter = tl.dot(b_q, h.to(b_q.dtype), input_precision=PREC)  # [BT, BV] q_i S_prev
            if DEN:
                qz = tl.sum(b_q.to(tl.float32) * z[None, :], axis=1)  # q_i . z_prev
            if GATE:
                b_g, g_last = _load_gate(lg, bos, i_t, Tn, i_h, TT, BT)
                s = s * tl.exp(tl.where(causal, b_g[:, None] - b_g[None, :], float("-inf")))
                e_q = tl.exp(b_g)
                inter = inter * e_q[:, None]
                if DEN:
                    qz = qz * e_q
            else:
                s = tl.where(causal, s, 0.)
            b_o = tl.dot(s.to(b_v.dtype), b_v, input_precision=PREC) + inter
            if DEN:
                d = tl.sum(s, axis=1) + qz
                if NORMALIZE:
                    d = d + eps
                    b_o = b_o / d[:, None]
                if STORE_DEN:
                    if i_v == 0:
                        o_tt = i_t * BT + o_t
                        tl.store(den + i_h * TT + bos + o_tt, d, mask=o_tt < Tn)
            p_o, m_o = _tile(o + (bos * H + i_h) * DV, i_t * BT, Tn, H * DV, i_v * BV, DV, BT, BV)
            tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=m_o)

        # State update to the end of the chunk.
        if GATE:
            k_dec32 = b_k.to(tl.float32) * tl.exp(g_last - b_g)[:, None]
            k_dec = k_dec32.to(b_k.dtype)
            h = h * tl.exp(g_last)
            if TRACK_Z:
                z = z * tl.exp(g_last)
        else:
            k_dec32 = b_k.to(tl.float32)
            k_dec = b_k
        h += tl.dot(tl.trans(k_dec), b_v, input_precision=PREC)
        if TRACK_Z:
            z += tl.sum(k_dec32, axis=0)

    if STORE_HT:
        p_ht, m_ht = _tile(hts + i_nh * F * DV, 0, F, DV, i_v * BV, DV, BK, BV)
        tl.store(p_ht, h, mask=m_ht)
        if i_v == 0:
            tl.store(htz + i_nh * F + o_k, z, mask=o_k < F)


@triton.jit(do_not_specialize=["TT"])
def _bwd_prep_kernel(o, do, den, dd, do_s, TT, H: tl.constexpr, DV: tl.constexpr, BR: tl.constexpr,
                     BV: tl.constexpr):
    """Per (token, head) row: do_s = do / d (the numerator's gradient) and dd = -(do . o) / d
    (the denominator's), so that the sweeps need no per-row rescaling."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)  # row = token * H + head
    cols = tl.arange(0, BV)
    R = TT * H
    m = (rows[:, None] < R) & (cols[None, :] < DV)
    off = rows[:, None].to(tl.int64) * DV + cols[None, :]
    b_o = tl.load(o + off, mask=m, other=0.).to(tl.float32)
    b_do = tl.load(do + off, mask=m, other=0.).to(tl.float32)
    vec = (rows % H).to(tl.int64) * TT + rows // H
    rd = 1. / tl.load(den + vec, mask=rows < R, other=1.)
    tl.store(dd + vec, -tl.sum(b_o * b_do, axis=1) * rd, mask=rows < R)
    tl.store(do_s + off, (b_do * rd[:, None]).to(do_s.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["T", "TT"])
def _bwd_dq_kernel(
    q, k, v, lg, do, dd, h0s, h0z, dq, dgq, cu, T, TT,
    H: tl.constexpr, F: tl.constexpr, DV: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, NORMALIZE: tl.constexpr, USE_H0: tl.constexpr, IS_VARLEN: tl.constexpr,
    PREC: tl.constexpr,
):
    i_k, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, Tn = _seq_bounds(cu, i_n, T, IS_VARLEN)
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    causal = o_t[:, None] >= o_t[None, :]

    h = tl.zeros([BK, BV], dtype=tl.float32)  # rows i_k*BK.. of S
    z = tl.zeros([BK], dtype=tl.float32)
    if USE_H0:
        p_h0, m_h0 = _tile(h0s + i_nh * F * DV, i_k * BK, F, DV, 0, DV, BK, BV)
        h = tl.load(p_h0, mask=m_h0, other=0.).to(tl.float32)
        z = tl.load(h0z + i_nh * F + o_k, mask=o_k < F, other=0.).to(tl.float32)

    NT = tl.cdiv(Tn, BT)
    for i_t in range(0, NT):
        p_k, m_k = _tile(k + (bos * H + i_h) * F, i_t * BT, Tn, H * F, i_k * BK, F, BT, BK)
        p_v, m_v = _tile(v + (bos * H + i_h) * DV, i_t * BT, Tn, H * DV, 0, DV, BT, BV)
        p_do, m_do = _tile(do + (bos * H + i_h) * DV, i_t * BT, Tn, H * DV, 0, DV, BT, BV)
        b_k = tl.load(p_k, mask=m_k, other=0.)
        b_v = tl.load(p_v, mask=m_v, other=0.)
        b_do = tl.load(p_do, mask=m_do, other=0.)

        ds = tl.dot(b_do, tl.trans(b_v), input_precision=PREC)  # [BT(i), BT(j)]
        inter = tl.dot(b_do, tl.trans(h.to(b_do.dtype)), input_precision=PREC)  # [BT, BK]
        if NORMALIZE:
            o_tt = i_t * BT + o_t
            b_dd = tl.load(dd + i_h * TT + bos + o_tt, mask=o_tt < Tn, other=0.)
            ds = ds + b_dd[:, None]
            inter = inter + b_dd[:, None] * z[None, :]
        if GATE:
            b_g, g_last = _load_gate(lg, bos, i_t, Tn, i_h, TT, BT)
            ds = ds * tl.exp(tl.where(causal, b_g[:, None] - b_g[None, :], float("-inf")))
            inter = inter * tl.exp(b_g)[:, None]
        else:
            ds = tl.where(causal, ds, 0.)
        b_dq = tl.dot(ds.to(b_k.dtype), b_k, input_precision=PREC) + inter
        p_dq, m_dq = _tile(dq + (bos * H + i_h) * F, i_t * BT, Tn, H * F, i_k * BK, F, BT, BK)
        tl.store(p_dq, b_dq.to(p_dq.dtype.element_ty), mask=m_dq)
        if GATE and not NORMALIZE:
            # Partial q . dq over this block of F (normalized: q . dq = -eps dd exactly).
            p_q, m_q = _tile(q + (bos * H + i_h) * F, i_t * BT, Tn, H * F, i_k * BK, F, BT, BK)
            b_q = tl.load(p_q, mask=m_q, other=0.)
            o_tt = i_t * BT + o_t
            tl.store(dgq + (i_k * H + i_h) * TT + bos + o_tt,
                     tl.sum(b_q.to(tl.float32) * b_dq, axis=1), mask=o_tt < Tn)

        if GATE:
            k_dec32 = b_k.to(tl.float32) * tl.exp(g_last - b_g)[:, None]
            k_dec = k_dec32.to(b_k.dtype)
            h = h * tl.exp(g_last)
            if NORMALIZE:
                z = z * tl.exp(g_last)
        else:
            k_dec32 = b_k.to(tl.float32)
            k_dec = b_k
        h += tl.dot(tl.trans(k_dec), b_v, input_precision=PREC)
        if NORMALIZE:
            z += tl.sum(k_dec32, axis=0)


@triton.jit(do_not_specialize=["T", "TT"])
def _bwd_dk_kernel(
    q, k, v, lg, do, dd, dhts, dhtz, dh0s, dh0z, dk, dgk, cu, T, TT,
    H: tl.constexpr, F: tl.constexpr, DV: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, NORMALIZE: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
    IS_VARLEN: tl.constexpr, PREC: tl.constexpr,
):
    i_k, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, Tn = _seq_bounds(cu, i_n, T, IS_VARLEN)
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    anti = o_t[:, None] <= o_t[None, :]  # [j, i]: key j reaches query i >= j
    TRACK_DZ: tl.constexpr = NORMALIZE or USE_DHT

    dh = tl.zeros([BK, BV], dtype=tl.float32)  # rows of dL/dS at the end of the current chunk
    dz = tl.zeros([BK], dtype=tl.float32)  # dL/dz at the end of the current chunk
    if USE_DHT:
        p_dht, m_dht = _tile(dhts + i_nh * F * DV, i_k * BK, F, DV, 0, DV, BK, BV)
        dh = tl.load(p_dht, mask=m_dht, other=0.).to(tl.float32)
        dz = tl.load(dhtz + i_nh * F + o_k, mask=o_k < F, other=0.).to(tl.float32)

    NT = tl.cdiv(Tn, BT)
    for i_r in range(0, NT):
        i_t = NT - 1 - i_r
        p_q, m_q = _tile(q + (bos * H + i_h) * F, i_t * BT, Tn, H * F, i_k * BK, F, BT, BK)
        p_k, m_k = _tile(k + (bos * H + i_h) * F, i_t * BT, Tn, H * F, i_k * BK, F, BT, BK)
        p_v, m_v = _tile(v + (bos * H + i_h) * DV, i_t * BT, Tn, H * DV, 0, DV, BT, BV)
        p_do, m_do = _tile(do + (bos * H + i_h) * DV, i_t * BT, Tn, H * DV, 0, DV, BT, BV)
        b_q = tl.load(p_q, mask=m_q, other=0.)
        b_k = tl.load(p_k, mask=m_k, other=0.)
        b_v = tl.load(p_v, mask=m_v, other=0.)
        b_do = tl.load(p_do, mask=m_do, other=0.)

        ds_t = tl.dot(b_v, tl.trans(b_do), input_precision=PREC)  # [BT(j), BT(i)] v_j . do_i
        inter = tl.dot(b_v, tl.trans(dh.to(b_v.dtype)), input_precision=PREC)  # [BT, BK]
        if TRACK_DZ:
            inter += dz[None, :]
        if NORMALIZE:
            o_tt = i_t * BT + o_t
            b_dd = tl.load(dd + i_h * TT + bos + o_tt, mask=o_tt < Tn, other=0.)
            ds_t = ds_t + b_dd[None, :]
        if GATE:
            b_g, g_last = _load_gate(lg, bos, i_t, Tn, i_h, TT, BT)
            ds_t = ds_t * tl.exp(tl.where(anti, b_g[None, :] - b_g[:, None], float("-inf")))
            inter = inter * tl.exp(g_last - b_g)[:, None]
        else:
            ds_t = tl.where(anti, ds_t, 0.)
        b_dk = tl.dot(ds_t.to(b_q.dtype), b_q, input_precision=PREC) + inter
        p_dk, m_dk = _tile(dk + (bos * H + i_h) * F, i_t * BT, Tn, H * F, i_k * BK, F, BT, BK)
        tl.store(p_dk, b_dk.to(p_dk.dtype.element_ty), mask=m_dk)
        if GATE:
            o_tt = i_t * BT + o_t
            tl.store(dgk + (i_k * H + i_h) * TT + bos + o_tt,
                     tl.sum(b_k.to(tl.float32) * b_dk, axis=1), mask=o_tt < Tn)

        # State gradient to the start of the chunk.
        if GATE:
            q_dec32 = b_q.to(tl.float32) * tl.exp(b_g)[:, None]
            q_dec = q_dec32.to(b_q.dtype)
            dh = dh * tl.exp(g_last)
            if TRACK_DZ:
                dz = dz * tl.exp(g_last)
        else:
            q_dec32 = b_q.to(tl.float32)
            q_dec = b_q
        dh += tl.dot(tl.trans(q_dec), b_do, input_precision=PREC)
        if NORMALIZE:
            dz += tl.sum(q_dec32 * b_dd[:, None], axis=0)  # sum_i e^{b_i} q_i dd_i

    if STORE_DH0:
        p_dh0, m_dh0 = _tile(dh0s + i_nh * F * DV, i_k * BK, F, DV, 0, DV, BK, BV)
        tl.store(p_dh0, dh, mask=m_dh0)
        tl.store(dh0z + i_nh * F + o_k, dz, mask=o_k < F)


# T and TT stay runtime values: an H200 (triton 3.6) computed dv wrongly in bf16 for T = 1, which
# Triton specializes as a constant (the GPU fuzz, seeds 0 and 532; docs/reports/kernels.md)
@triton.jit(do_not_specialize=["T", "TT"])
def _bwd_dv_kernel(
    q, k, lg, do, dhts, dv, cu, T, TT,
    H: tl.constexpr, F: tl.constexpr, DV: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, NORMALIZE: tl.constexpr, USE_DHT: tl.constexpr, IS_VARLEN: tl.constexpr,
    PREC: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, Tn = _seq_bounds(cu, i_n, T, IS_VARLEN)
    o_t = tl.arange(0, BT)
    anti = o_t[:, None] <= o_t[None, :]

    dh = tl.zeros([BK, BV], dtype=tl.float32)  # columns of dL/dS
    if USE_DHT:
        p_dht, m_dht = _tile(dhts + i_nh * F * DV, 0, F, DV, i_v * BV, DV, BK, BV)
        dh = tl.load(p_dht, mask=m_dht, other=0.).to(tl.float32)

    NT = tl.cdiv(Tn, BT)
    for i_r in range(0, NT):
        i_t = NT - 1 - i_r
        p_q, m_q = _tile(q + (bos * H + i_h) * F, i_t * BT, Tn, H * F, 0, F, BT, BK)
        p_k, m_k = _tile(k + (bos * H + i_h) * F, i_t * BT, Tn, H * F, 0, F, BT, BK)
        p_do, m_do = _tile(do + (bos * H + i_h) * DV, i_t * BT, Tn, H * DV, i_v * BV, DV, BT, BV)
        b_q = tl.load(p_q, mask=m_q, other=0.)
        b_k = tl.load(p_k, mask=m_k, other=0.)
        b_do = tl.load(p_do, mask=m_do, other=0.)

        a_t = tl.dot(b_k, tl.trans(b_q), input_precision=PREC)  # [BT(j), BT(i)] k_j . q_i
        inter = tl.dot(b_k, dh.to(b_k.dtype), input_precision=PREC)  # [BT, BV]
        if GATE:
            b_g, g_last = _load_gate(lg, bos, i_t, Tn, i_h, TT, BT)
            a_t = a_t * tl.exp(tl.where(anti, b_g[None, :] - b_g[:, None], float("-inf")))
            inter = inter * tl.exp(g_last - b_g)[:, None]
        else:
            a_t = tl.where(anti, a_t, 0.)
        b_dv = tl.dot(a_t.to(b_do.dtype), b_do, input_precision=PREC) + inter
        p_dv, m_dv = _tile(dv + (bos * H + i_h) * DV, i_t * BT, Tn, H * DV, i_v * BV, DV, BT, BV)
        tl.store(p_dv, b_dv.to(p_dv.dtype.element_ty), mask=m_dv)

        if GATE:
            q_dec = (b_q.to(tl.float32) * tl.exp(b_g)[:, None]).to(b_q.dtype)
            dh = dh * tl.exp(g_last)
        else:
            q_dec = b_q
        dh += tl.dot(tl.trans(q_dec), b_do, input_precision=PREC)


# ----------------------------------------------------------------------------- launchers

def _geometry(q, v, cu_seqlens):
    B, T, H, F = q.shape
    DV = v.shape[-1]
    if not (16 <= F <= 256 and 16 <= DV <= 256):
        raise ValueError(f"feature and value dims must be in [16, 256], got F={F}, Dv={DV}")
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    return B, T, H, F, DV, N


def _split(full: int, other: int, elems: int) -> int:
    """Block of a dim of size ``full`` (a power of 2) such that block * other <= elems."""
    return max(16, min(full, triton.next_power_of_2(max(elems // other, 1)) if elems >= other else 16))


def chunk_fwd(q, k, v, log_g, S0, z0, normalize, eps, output_final_state, cu_seqlens, store_den, state_only=False):
    """state_only: the final state alone (q is not read, o is None)."""
    B, T, H, F, DV, N = _geometry(q, v, cu_seqlens)
    cfg = _cfg(F, DV)
    BT = cfg["BT"]
    BK = _next_pow2(F)
    BV = _split(_next_pow2(DV), BK, cfg["fwd_block_elems"])
    NV = triton.cdiv(DV, BV)
    o = None if state_only else torch.empty_like(v)
    den = torch.empty(H, B * T, device=q.device, dtype=torch.float32) if store_den else None
    Sn = torch.empty(N, H, F, DV, device=q.device, dtype=torch.float32) if output_final_state else None
    zn = torch.empty(N, H, F, device=q.device, dtype=torch.float32) if output_final_state else None
    launch(
        _fwd_kernel, (NV, N * H), q, k, v, log_g, S0, z0, o, den, Sn, zn, cu_seqlens, T, B * T, eps,
        H=H, F=F, DV=DV, BT=BT, BK=BK, BV=BV,
        GATE=log_g is not None, NORMALIZE=normalize, USE_H0=S0 is not None, STORE_HT=output_final_state,
        STORE_DEN=den is not None, IS_VARLEN=cu_seqlens is not None, PREC=_prec(q), STATE_ONLY=state_only,
        num_warps=cfg["fwd_warps"], num_stages=cfg["fwd_stages"])
    return o, den, Sn, zn


def chunk_bwd(q, k, v, log_g, S0, z0, o, den, do, dSn, dzn, Sn, zn, normalize, eps, cu_seqlens):
    B, T, H, F, DV, N = _geometry(q, v, cu_seqlens)
    cfg = _cfg(F, DV)
    BT = cfg["bwd_BT"]
    gate = log_g is not None
    varlen = cu_seqlens is not None
    prec = _prec(q)
    opts = dict(num_warps=cfg["bwd_warps"], num_stages=cfg["bwd_stages"])
    use_dht = dSn is not None or dzn is not None
    if use_dht:
        f32 = dict(device=q.device, dtype=torch.float32)
        dSn = torch.zeros(N, H, F, DV, **f32) if dSn is None else dSn.float().contiguous()
        dzn = torch.zeros(N, H, F, **f32) if dzn is None else dzn.float().contiguous()

    BVf = _next_pow2(DV)
    BKs = _split(_next_pow2(F), BVf, cfg["bwd_block_elems"])
    NK = triton.cdiv(F, BKs)
    TT = B * T
    dgq = torch.empty(NK, H, TT, device=q.device, dtype=torch.float32) if gate and not normalize else None
    dgk = torch.empty(NK, H, TT, device=q.device, dtype=torch.float32) if gate else None
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dS0 = torch.empty(N, H, F, DV, device=q.device, dtype=torch.float32) if S0 is not None else None
    dz0 = torch.empty(N, H, F, device=q.device, dtype=torch.float32) if S0 is not None else None

    dd = None
    do_s = do
    if normalize:
        dd = torch.empty(H, TT, device=q.device, dtype=torch.float32)
        do_s = torch.empty_like(do)
        BR = max(1, 4096 // BVf)
        _bwd_prep_kernel[(triton.cdiv(TT * H, BR),)](o, do, den, dd, do_s, TT, H=H, DV=DV, BR=BR, BV=BVf,
                                                      num_warps=4)

    common = dict(H=H, F=F, DV=DV, BT=BT, GATE=gate, NORMALIZE=normalize, IS_VARLEN=varlen, PREC=prec, **opts)
    launch(_bwd_dq_kernel, (NK, N * H), q, k, v, log_g, do_s, dd, S0, z0, dq, dgq, cu_seqlens, T, TT,
           BK=BKs, BV=BVf, USE_H0=S0 is not None, **common)
    launch(_bwd_dk_kernel, (NK, N * H), q, k, v, log_g, do_s, dd, dSn, dzn, dS0, dz0, dk, dgk, cu_seqlens, T,
           TT, BK=BKs, BV=BVf, USE_DHT=use_dht, STORE_DH0=S0 is not None, **common)
    BKf = _next_pow2(F)
    BVs = _split(_next_pow2(DV), BKf, cfg["bwd_block_elems"])
    launch(_bwd_dv_kernel, (triton.cdiv(DV, BVs), N * H), q, k, log_g, do_s, dSn, dv, cu_seqlens, T, TT,
           BK=BKf, BV=BVs, USE_DHT=use_dht, **common)

    dlog_g = None
    if gate:
        # dL/dB_t without the final-state term.  Normalized, o_t does not change when all of
        # q_t's terms are scaled together except through eps: q_t . dq_t = -eps * dd_t exactly.
        dq_side = -eps * dd if normalize else dgq.sum(0)
        dB = (dq_side - dgk.sum(0)).t().reshape(B, T, H)
        dlog_g = _reverse_cumsum(dB, cu_seqlens)
        if use_dht and Sn is not None:
            # B_{T-1} scales the whole final state: <dS_T, S_T> + <dz_T, z_T>, for every t.
            last = (dSn * Sn).sum((-2, -1)) + (dzn * zn).sum(-1)  # (N, H)
            if varlen:
                lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
                dlog_g = dlog_g + last.repeat_interleave(lens, dim=0)[None]
            else:
                dlog_g = dlog_g + last[:, None, :]
        if S0 is None:
            # A sequence's first gate multiplies its zero initial state: its gradient is exactly 0.
            # The reverse sum above gives it as the sum of every dL/dB_s of the sequence, which
            # cancels to 0 only up to the rounding of all of them (bf16, T=1: 1.3 against 0).
            if varlen:
                starts = cu_seqlens[:-1].long()
                dlog_g[:, starts[starts < cu_seqlens[1:].long()]] = 0
            else:
                dlog_g[:, 0] = 0
    return dq, dk, dv, dlog_g, dS0, dz0


def _reverse_cumsum(x: torch.Tensor, cu_seqlens) -> torch.Tensor:
    """sum_{s >= t} x_s along dim 1, restarted at every sequence boundary of cu_seqlens."""
    suffix = x.transpose(1, 2).flip(-1).cumsum(-1).flip(-1).transpose(1, 2)
    if cu_seqlens is None:
        return suffix
    # Subtract what lies beyond each token's own sequence end.
    pad = torch.cat([suffix, suffix.new_zeros(1, 1, suffix.shape[2])], dim=1)
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    eos = cu_seqlens[1:].long().repeat_interleave(lens)
    return suffix - pad[:, eos]


# ----------------------------------------------------------------------------- autograd

def _gate_layout(log_g):
    """Gates travel to the kernels as [H, B*T] fp32, so that a chunk's values are contiguous."""
    return None if log_g is None else log_g.float().reshape(-1, log_g.shape[-1]).t().contiguous()


def _empty(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(0, dtype=torch.float32)


def _opt(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None or x.numel() == 0 else x


def _chunk_linear_attn_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_g: torch.Tensor | None, S0: torch.Tensor | None,
    z0: torch.Tensor | None, cu_seqlens: torch.Tensor | None, normalize: bool, eps: float, store_den: bool,
    num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunk forward as a torch op: q, k [B, T, H, F], v [B, T, H, Dv] (contiguous), log_g
    [B, T, H] or None, S0/z0 fp32 or None, cu_seqlens int32 or None. Returns o, the fp32
    denominators [H, B*T] (empty unless ``store_den``: the backward needs them; without ``normalize``
    o is the numerator and den the denominator, no eps, inference only), and the final
    state (S [N, H, F, Dv], z [N, H, F]) fp32. ``num_splits > 1`` runs the split-time forward
    (inference only, no cu_seqlens)."""
    lg = _gate_layout(log_g)
    if num_splits > 1 and cu_seqlens is None and not (store_den and normalize):
        o, den, Sn, zn = split_time_fwd(q, k, v, lg, S0, z0, normalize, eps, True, num_splits, store_den=store_den)
        return o, (_empty(q) if den is None else den), Sn, zn
    o, den, Sn, zn = chunk_fwd(q, k, v, lg, S0, z0, normalize, eps, True, cu_seqlens, store_den=store_den)
    return o, (_empty(q) if den is None else den), Sn, zn


chunk_linear_attn_fwd_op = torch.library.custom_op("linearize::chunk_linear_attn_fwd", mutates_args=())(
    _chunk_linear_attn_fwd)


@chunk_linear_attn_fwd_op.register_fake
def _(q, k, v, log_g, S0, z0, cu_seqlens, normalize, eps, store_den, num_splits):
    B, T, H, F = q.shape
    DV = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    f32 = dict(device=q.device, dtype=torch.float32)
    den = q.new_empty(H, B * T, dtype=torch.float32) if store_den else _empty(q)
    return torch.empty_like(v), den, q.new_empty(N, H, F, DV, **f32), q.new_empty(N, H, F, **f32)


@torch.library.custom_op("linearize::chunk_linear_attn_bwd", mutates_args=())
def chunk_linear_attn_bwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_g: torch.Tensor | None, S0: torch.Tensor | None,
    z0: torch.Tensor | None, cu_seqlens: torch.Tensor | None, o: torch.Tensor, den: torch.Tensor,
    Sn: torch.Tensor, zn: torch.Tensor, do: torch.Tensor, dSn: torch.Tensor | None, dzn: torch.Tensor | None,
    normalize: bool, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`chunk_linear_attn_fwd_op`: dq, dk, dv, dlog_g (in log_g's dtype), dS0,
    dz0 (empty where the input was None)."""
    dq, dk, dv, dlog_g, dS0, dz0 = chunk_bwd(q, k, v, _gate_layout(log_g), S0, z0, o, _opt(den), do.contiguous(),
                                             dSn, dzn, Sn, zn, normalize, eps, cu_seqlens)
    dlog_g = _empty(q) if log_g is None else dlog_g.to(log_g.dtype).contiguous()
    return dq, dk, dv, dlog_g, (_empty(q) if dS0 is None else dS0), (_empty(q) if dz0 is None else dz0)


@chunk_linear_attn_bwd_op.register_fake
def _(q, k, v, log_g, S0, z0, cu_seqlens, o, den, Sn, zn, do, dSn, dzn, normalize, eps):
    like = lambda x: _empty(q) if x is None else torch.empty_like(x)  # noqa: E731
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), like(log_g), like(S0), like(z0)


def _chunk_setup(ctx, inputs, output):
    q, k, v, log_g, S0, z0, cu_seqlens, normalize, eps, store_den, num_splits = inputs
    o, den, Sn, zn = output
    ctx.save_for_backward(q, k, v, log_g, S0, z0, cu_seqlens, o, den, Sn, zn)
    ctx.normalize, ctx.eps = normalize, eps


def _chunk_backward(ctx, do, dden, dSn, dzn):
    q, k, v, log_g, S0, z0, cu_seqlens, o, den, Sn, zn = ctx.saved_tensors
    if ctx.normalize and den.numel() == 0:
        raise RuntimeError("chunk_linear_attn_fwd ran with store_den=False: call chunk_linear_attn with inputs "
                           "that require grad to train through it")
    dq, dk, dv, dlog_g, dS0, dz0 = torch.ops.linearize.chunk_linear_attn_bwd(
        q, k, v, log_g, S0, z0, cu_seqlens, o, den, Sn, zn, do, dSn, dzn, ctx.normalize, ctx.eps)
    return (dq, dk, dv, None if log_g is None else dlog_g, None if S0 is None else dS0,
            None if z0 is None else dz0, None, None, None, None, None)


chunk_linear_attn_fwd_op.register_autograd(_chunk_backward, setup_context=_chunk_setup)


def chunk_linear_attn(q, k, v, *, log_g=None, normalize=True, eps=1e-6, initial_state=None,
                      output_final_state=False, window=0, q_sm=None, k_sm=None, sm_scale=None,
                      window_weight=1.0, cu_seqlens=None, num_splits=None, q_lo=None, sinks=0):
    """Chunkwise (normalized) feature-map linear attention.

    Args:
        q, k: [B, T, H, F] feature-mapped queries and keys (non-negative when normalize=True).
        v: [B, T, H, Dv] values. F and Dv in [16, 256]; fp32, bf16 or fp16.
        log_g: optional [B, T, H] log of the per-step decay (<= 0).
        initial_state: optional (S [N, H, F, Dv], z [N, H, F]), fp32.
        window, q_sm, k_sm, sm_scale, window_weight: sliding-window softmax hybrid (see reference.py).
        cu_seqlens: optional int32 [N+1] offsets of packed sequences (then B must be 1).
        num_splits: without gradients, cut each sequence into this many segments run in parallel
            (the split-time section below); None picks it from the GPU's size (1 on CPU), 1 never splits.
        q_lo: optional int [B, T], the window hybrid over rows that pack several documents (no
            cu_seqlens): q_lo[b, t] <= t is the position in row b where token t's document starts.
            Every document then gives what it gives alone (see ``_window_attn``), with shapes that
            depend on (B, T) only; the final state is that of the document holding position T-W.
        sinks: the window hybrid's attention sinks, the first ``sinks`` keys of each document in its
            softmax part beside the window (see reference.py).

    Returns:
        o [B, T, H, Dv] in v's dtype, and (S, z) fp32 when output_final_state else None.
    """
    _check_window(window, initial_state, normalize, q_sm, k_sm, sm_scale, sinks)
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs a packed batch of 1, got B={q.shape[0]}")
    if q_lo is not None and (window == 0 or cu_seqlens is not None):
        raise ValueError("q_lo (packed documents) is for the window hybrid over rows, without cu_seqlens")
    if window > 0:
        return _window_attn(q, k, v, log_g=log_g, output_final_state=output_final_state, window=window,
                            q_sm=q_sm, k_sm=k_sm, sm_scale=sm_scale, window_weight=window_weight,
                            cu_seqlens=cu_seqlens, q_lo=q_lo, sinks=sinks)
    F = q.shape[-1]
    if 16 <= F <= 256 and F != _next_pow2(F):
        # Zero features fill the feature tile. On an H200 (triton 3.6) the forward kernel read shared
        # memory out of bounds when its feature tile was partly masked (compute-sanitizer: "Invalid
        # __shared__ read" in _fwd_kernel; the GPU fuzz's illegal addresses at F = 65 and F = 20). Shared
        # memory is the compiler's, not indexed by this code. Zero features change nothing: q.k, the
        # normalizer q.z and the state's other rows are the same; gradients are sliced back by Fn.pad.
        Fp = _next_pow2(F)
        pad = (lambda x: Fn.pad(x, (0, Fp - F)))  # noqa: E731
        init = None
        if initial_state is not None:
            S0, z0 = initial_state
            init = (Fn.pad(S0, (0, 0, 0, Fp - F)), pad(z0))
        o, state = chunk_linear_attn(pad(q), pad(k), v, log_g=log_g, normalize=normalize, eps=eps,
                                     initial_state=init, output_final_state=output_final_state,
                                     cu_seqlens=cu_seqlens, num_splits=num_splits)
        return o, (None if state is None else (state[0][..., :F, :], state[1][..., :F]))
    S0 = z0 = None
    if initial_state is not None:
        S0, z0 = (x.float().contiguous() for x in initial_state)
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(torch.int32)
    q, k, v = (x.contiguous() for x in (q, k, v))
    if log_g is not None:
        log_g = log_g.contiguous()
    grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, log_g, S0, z0))
    n = 1
    if cu_seqlens is None and not grad:  # inference with few sequences x heads: cut the time axis
        n = auto_splits(q, v) if num_splits is None else num_splits
    fwd = _chunk_linear_attn_fwd if call_directly(grad) else torch.ops.linearize.chunk_linear_attn_fwd
    o, _, Sn, zn = fwd(q, k, v, log_g, S0, z0, cu_seqlens, normalize, float(eps), grad and normalize, int(n))
    return o, ((Sn, zn) if output_final_state else None)


def chunk_num_den(q, k, v, *, log_g=None, initial_state=None, num_splits=None):
    """Unnormalized linear attention and its denominator from one pass, without gradients: n = sum_s
    G(s, t) (q_t . k_s) v_s [B, T, H, Dv] in v's dtype, d = sum_s G(s, t) q_t . k_s fp32 [H, B*T], and
    the final state (S, z) fp32, from ``initial_state`` (S0, z0) or zeros. What two passes of
    ``chunk_linear_attn(normalize=False)`` (values v, then ones) give, reading q and k once. Feature
    dims in [16, 256] (zero features pad one to a power of two, as ``chunk_linear_attn`` does)."""
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, log_g)):
        raise RuntimeError("chunk_num_den has no backward: use two chunk_linear_attn passes to train")
    F = q.shape[-1]
    if not 16 <= F <= 256:
        raise ValueError(f"chunk_num_den takes a feature dim in [16, 256], got {F}")
    if F != _next_pow2(F):
        pad = (lambda x: Fn.pad(x, (0, _next_pow2(F) - F)))  # noqa: E731
        init = None if initial_state is None else (Fn.pad(initial_state[0], (0, 0, 0, _next_pow2(F) - F)),
                                                   pad(initial_state[1]))
        n, d, (S, z) = chunk_num_den(pad(q), pad(k), v, log_g=log_g, initial_state=init, num_splits=num_splits)
        return n, d, (S[..., :F, :], z[..., :F])
    q, k, v = (x.contiguous() for x in (q, k, v))
    log_g = None if log_g is None else log_g.contiguous()
    if num_splits is None:
        num_splits = auto_splits(q, v)
    fwd = _chunk_linear_attn_fwd if call_directly(False) else torch.ops.linearize.chunk_linear_attn_fwd
    S0, z0 = (None, None) if initial_state is None else (x.float().contiguous() for x in initial_state)
    n, d, Sn, zn = fwd(q, k, v, log_g, S0, z0, None, False, 0.0, True, int(num_splits))
    return n, d, (Sn, zn)


def _window_attn(q, k, v, *, log_g, output_final_state, window, q_sm, k_sm, sm_scale, window_weight, cu_seqlens,
                 q_lo=None, sinks=0):
    """Sliding-window hybrid: the linear part through the chunk kernels, the window in window.py.

    Rows are packed into one batch of sequences (B sequences of length T without cu_seqlens), the
    linear part runs as one varlen call (:func:`_shifted_linear`) and the window kernel reads its
    outputs in place and combines both under one normalizer, the linear terms weighted by
    ``window_weight`` (the LoLCATs layer, as in reference.py).  Gradients flow through both.

    ``q_lo`` [B, T] (rows packing documents, no cu_seqlens): the linear part's decay is reset at
    each document start (a log decay of -RESET_LOG_DECAY there: the state it reads at u holds u's
    document only), a query whose linear position t-W lies before its document start reads no
    linear row (lin_idx -1), and the window kernel masks keys before q_lo[t].  No host sync, no
    shape that depends on the number of documents.
    """
    from .window import window_softmax_attn

    B, T, H, F = q.shape

    def packed(x):  # (B, T, H, ...) -> (B*T, H, ...)
        return None if x is None else x.reshape(B * T, *x.shape[2:])

    if cu_seqlens is None:  # rows of one length: batched, so the time axis can be split (the split-time section below)
        lens = [T] * B
        cu_seqlens = torch.arange(0, (B + 1) * T, T, device=q.device, dtype=torch.int32)
        if q_lo is not None:
            t = torch.arange(T, device=q.device)
            q_lo = q_lo.to(device=q.device, dtype=torch.int32).expand(B, T)
            restart = ((q_lo == t) & (t > 0))[..., None]  # a document's first token, past the row's first
            base = q.new_zeros(B, T, H, dtype=torch.float32) if log_g is None else log_g
            log_g = torch.where(restart, -RESET_LOG_DECAY, base)
        n, d, lin_idx, state = _shifted_linear_rows(q, k, v, log_g, window, output_final_state)
        if q_lo is not None:  # the state at t-W belongs to an earlier document: no linear terms
            lin_idx = torch.where((t - window < q_lo).reshape(-1), -1, lin_idx)
            q_lo = q_lo.reshape(-1)
    else:
        b = cu_seqlens.tolist()
        lens = [e - s for s, e in zip(b[:-1], b[1:])]
        cu_seqlens = cu_seqlens.to(torch.int32)
        n, d, lin_idx, state = _shifted_linear(packed(q), packed(k), packed(v), packed(log_g), window, lens,
                                               output_final_state)
    gamma = torch.as_tensor(window_weight, device=q.device).float().reshape(-1).expand(H)
    o = window_softmax_attn(packed(q_sm), packed(k_sm), packed(v), n, d, gamma, lin_idx, cu_seqlens,
                            window=window, sm_scale=sm_scale, max_len=max(lens, default=1), q_lo=q_lo, sinks=sinks)
    return o.view(B, T, H, -1), state


def _shifted_linear_rows(q, k, v, log_g, W, output_final_state):
    """:func:`_shifted_linear` for B rows of one length T (no packing): q, k [B, T, H, F], v [B, T, H, Dv],
    log_g [B, T, H] or None. Row b's positions u = 0 .. T-W are rows b * (T-W+1) + u of n and d, as
    the packed layout has them. Slices, not gathers; without gradients the time axis is split over
    the GPU (``auto_splits``) and n and d come from one pass (``chunk_num_den``)."""
    B, T, H, F = q.shape
    DV = v.shape[-1]
    L = T - W + 1  # positions u = 0 .. T-W: the last only feeds the final state
    dev = q.device
    t = torch.arange(T, device=dev)
    lin_idx = (torch.arange(B, device=dev)[:, None] * max(L, 0) + (t - W)[None]).masked_fill(t[None] < W, -1)
    lin_idx = lin_idx.reshape(-1).to(torch.int32)
    if L <= 0:
        state = None
        if output_final_state:
            state = (q.new_zeros(B, H, F, DV, dtype=torch.float32), q.new_zeros(B, H, F, dtype=torch.float32))
        return None, None, lin_idx, state
    q_next = q[:, W:]  # the query W tokens after key u
    lg = None
    if log_g is not None:  # the decay product in float32, rounded once (float64 running sum)
        cum = log_g.double().cumsum(1)
        q_next = q_next.float() * (cum[:, W:] - cum[:, : T - W]).exp().float()[..., None]
        lg = log_g[:, :L]
    q_shift = torch.cat([q_next.to(q.dtype), q.new_zeros(B, 1, H, F)], 1)
    k_lin, v_lin = k[:, :L], v[:, :L]
    grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, log_g))
    if not grad:
        n, d, state = chunk_num_den(q_shift, k_lin, v_lin, log_g=lg)
        d = d.t()  # [H, B*L] -> [B*L, H]
    else:
        n, state = chunk_linear_attn(q_shift, k_lin, v_lin, log_g=lg, normalize=False,
                                     output_final_state=output_final_state)
        d, _ = chunk_linear_attn(q_shift, k_lin, v.new_ones(B, L, H, 16), log_g=lg, normalize=False)
        d = d[..., 0].reshape(B * L, H)
    return n.reshape(B * L, H, DV), d, lin_idx, (state if output_final_state else None)


def _shifted_linear(q, k, v, log_g, W, lens, output_final_state):
    """Linear part of the window hybrid over packed sequences of lengths ``lens``.

    The linear part of query t is q_t times the state at t-W decayed to t, i.e. the ordinary
    causal linear attention at step u = t-W with the query q'_u = q_{u+W} prod_{r=u+1..u+W} g_r.
    Each sequence of length Tn gives the positions u = 0 .. Tn-W (the last one only feeds the
    final state, with a zero query); two unnormalized kernel passes over them, one varlen call
    each, give the numerators (values v) and denominators (values 1).

    Args: q, k [TT, H, F]; v [TT, H, Dv]; log_g [TT, H] or None; lens: Python ints, sum TT.
    Returns: n [R, H, Dv] and d [R, H] (None when no sequence is longer than W), lin_idx int32
    [TT] (token t's row of n and d, -1 for the first W tokens of a sequence), and the final state
    (S [N, H, F, Dv], z [N, H, F]) covering s <= Tn-W, decayed to s = Tn-W, or None.
    """
    TT, H, F = q.shape
    DV = v.shape[-1]
    N = len(lens)
    dev = q.device
    lin_lens = [max(n - W + 1, 0) for n in lens]
    R = sum(lin_lens)
    lens_t = torch.tensor(lens, device=dev)
    cu = Fn.pad(lens_t.cumsum(0), (1, 0))
    lin_cu = Fn.pad(torch.tensor(lin_lens, device=dev).cumsum(0), (1, 0))

    seq = torch.repeat_interleave(torch.arange(N, device=dev), lens_t, output_size=TT)
    t = torch.arange(TT, device=dev) - cu[seq]  # position in its sequence
    lin_idx = torch.where(t >= W, lin_cu[seq] + t - W, -1).to(torch.int32)
    if R == 0:
        state = None
        if output_final_state:
            state = (q.new_zeros(N, H, F, DV, dtype=torch.float32), q.new_zeros(N, H, F, dtype=torch.float32))
        return None, None, lin_idx, state

    lin_seq = torch.repeat_interleave(torch.arange(N, device=dev), lin_cu.diff(), output_size=R)
    u = torch.arange(R, device=dev) - lin_cu[lin_seq]
    key = cu[lin_seq] + u  # packed row of the key at position u
    last = u == lin_cu.diff()[lin_seq] - 1  # its query q_{u+W} lies past the sequence end
    qry = torch.where(last, key, key + W)
    q_next = q[qry]
    lg = None
    if log_g is not None:  # the decay product in float32, rounded once (without a gate: no float32 copy)
        cum = log_g.double().cumsum(0)  # float64: differences of a long running sum
        q_next = q_next.float() * (cum[qry] - cum[key]).exp().float()[..., None]
        lg = log_g[key][None]
    q_shift = q_next.masked_fill(last[:, None, None], 0.).to(q.dtype)[None]
    k_lin, v_lin = k[key][None], v[key][None]
    lin_cu = lin_cu.to(torch.int32)
    n, state = chunk_linear_attn(q_shift, k_lin, v_lin, log_g=lg, normalize=False,
                                 output_final_state=output_final_state, cu_seqlens=lin_cu)
    d, _ = chunk_linear_attn(q_shift, k_lin, v.new_ones(1, R, H, 16), log_g=lg, normalize=False,
                             cu_seqlens=lin_cu)
    # the state stays decayed to its last key, Tn-W: the W-1 newer keys (and their gates) are
    # the caller's window buffer and get folded in, with their decay, when they leave it
    return n[0], d[0, :, :, 0], lin_idx, state


# ----------------------------------------------------------------------------------------------------
# Split-time inference forward (formerly split.py)
#
# Split-time forward for inference: the chunk kernel with more parallelism at small batch x heads.
#
# The chunk forward (chunk.py) gives one program to each (sequence, head, block of Dv) and walks the
# chunks in order. With few sequences and heads (prefill of one long prompt: B=1, H=9) that is a
# handful of programs on a GPU with 132 multiprocessors, and the time grows with T on one core
# each. Without gradients the sequence can be cut into ``num_splits`` segments instead:
#
# 1. each segment's own contribution to the state, from an empty state
#    (``S_j = sum_s G(s, end_j) k_s^T v_s``, ``z_j`` likewise), all segments in parallel: the chunk
#    forward kernel in its state-only mode (no q read, no output);
# 2. a scan over segments (a prefix sum, or one small einsum with a gate): the state entering
#    segment j is ``init_j = G(start_0, start_j) S_0 + sum_{i<j} G(end_i, start_j) S_i``;
# 3. the ordinary chunk forward on the segments as packed sequences (``cu_seqlens``), each starting
#    from ``init_j``; ``init`` one past the last segment is the final state.
#
# The result equals the sequential forward up to float rounding (the state is summed in another
# order). Pass 1 reads k and v once more: worth it only when the sequential walk leaves the GPU idle,
# which ``auto_splits`` decides.

def auto_splits(q: torch.Tensor, v: torch.Tensor, min_len: int = 1024) -> int:
    """How many segments fill the GPU: enough programs for two waves over the multiprocessors,
    each segment at least ``min_len`` tokens. 1 (no split) on CPU, or when the unsplit call already
    has programs for a quarter of the multiprocessors (B=2, H=32 on an H200: measured slower split)."""
    if not q.is_cuda:
        return 1
    B, T, H, F = q.shape
    cfg = _cfg(F, v.shape[-1])
    BK = _next_pow2(F)
    nv = triton.cdiv(v.shape[-1], _split(_next_pow2(v.shape[-1]), BK, cfg["fwd_block_elems"]))
    programs = B * H * nv
    sms = _multiprocessors(q.device)
    if programs > sms // 4:  # pass 1 and the scan cost ~0.5 ms of launches: not worth it once a quarter of the GPU is busy
        return 1
    want = -(-2 * sms // programs)
    return max(1, min(want, T // min_len))


def _multiprocessors(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:  # a property read per call costs more host time than the scan below
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


_SMS: dict[int, int] = {}


@functools.lru_cache(maxsize=64)
def _segments(B: int, T: int, L: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The segments' packed offsets (int32 [B*n + 1]) and ``lower`` [n+1, n] fp32, 1 where segment i
    ends before j starts, cached per shape and device: every layer and chunk of a prefill asks for the
    same ones, and building them is several small launches per call."""
    starts = (torch.arange(B, device=device)[:, None] * T + torch.arange(0, T, L, device=device)[None]).flatten()
    bounds = torch.cat([starts, starts.new_full((1,), B * T)]).to(torch.int32)
    return bounds, torch.ones(n + 1, n, device=device).tril(-1)


def split_time_fwd(q, k, v, log_g, S0, z0, normalize, eps, output_final_state, num_splits, store_den=False):
    """Chunk forward (no gradients) over ``num_splits`` segments per sequence.

    q, k [B, T, H, F]; v [B, T, H, Dv]; log_g None or [H, B*T] fp32 (the chunk kernels' layout);
    S0, z0 None or fp32 [B, H, F, Dv], [B, H, F]. Returns o, den, Sn, zn like ``chunk.chunk_fwd``
    (``store_den`` without ``normalize``: the denominators [H, B*T], the segments being in token order)."""
    B, T, H, F = q.shape
    DV = v.shape[-1]
    cfg = _cfg(F, DV)
    BT = cfg["BT"]
    L = triton.cdiv(triton.cdiv(T, num_splits), BT) * BT  # segment length, whole chunks
    n = triton.cdiv(T, L)
    dev = q.device
    bounds, lower = _segments(B, T, L, n, dev)
    N = B * n
    qf, kf, vf = (x.reshape(1, B * T, H, x.shape[-1]) for x in (q, k, v))

    # 1. each segment's own state
    _, _, Sl, zl = chunk_fwd(kf, kf, vf, log_g, None, None, False, eps, True, bounds, False, state_only=True)

    # 2. scan over segments: init_j = sum_{i<j} G(end_i -> start_j) S_i + G(0 -> start_j) S_0
    Sl, zl = Sl.view(B, n, H, F, DV), zl.view(B, n, H, F)
    if log_g is None:  # no decay: init_j = S_0 + sum_{i<j} S_i, a prefix sum (two launches)
        first_S = Sl.new_zeros(B, 1, H, F, DV) if S0 is None else S0[:, None]
        first_z = zl.new_zeros(B, 1, H, F) if z0 is None else z0[:, None]
        init_S = torch.cat([first_S, Sl], 1).cumsum(1)
        init_z = torch.cat([first_z, zl], 1).cumsum(1)
    else:
        # lower [j, i]: segment i ends before j starts
        G = Fn.pad(log_g.view(H, B, T), (0, n * L - T)).view(H, B, n, L).sum(-1)  # log gate of each segment
        C = torch.cat([torch.zeros(H, B, 1, device=dev), G.cumsum(-1)], -1).permute(1, 0, 2)  # (B, H, n+1): at starts
        w = torch.exp((C[..., :, None] - C[..., None, 1:]).masked_fill(lower == 0, float("-inf")))
        w0 = torch.exp(C)
        with torch.autocast(dev.type, enabled=False):  # fp32 states also under a bf16 autocast
            init_S = torch.einsum("bhji,bihfd->bjhfd", w, Sl)
            init_z = torch.einsum("bhji,bihf->bjhf", w, zl)
        if S0 is not None:
            init_S = init_S + w0.transpose(1, 2)[..., None, None] * S0[:, None]
            init_z = init_z + w0.transpose(1, 2)[..., None] * z0[:, None]

    # 3. the chunk forward on the segments, each from its entering state
    o, den, _, _ = chunk_fwd(qf, kf, vf, log_g, init_S[:, :n].reshape(N, H, F, DV).contiguous(),
                                    init_z[:, :n].reshape(N, H, F).contiguous(), normalize, eps, False, bounds,
                                    store_den)
    if not output_final_state:
        return o.view(B, T, H, DV), den, None, None
    return o.view(B, T, H, DV), den, init_S[:, n].contiguous(), init_z[:, n].contiguous()
