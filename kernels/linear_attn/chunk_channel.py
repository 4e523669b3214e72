"""Chunkwise normalized feature-map linear attention with a per-channel decay (the GLA form).

Per (sequence, head), with ``g_t = exp(log_g_t)`` a vector over the F key channels::

    S_t = diag(g_t) S_{t-1} + k_t^T v_t      S: [F, Dv]
    z_t = g_t * z_{t-1} + k_t                z: [F]
    o_t = (q_t S_t) / (q_t . z_t + eps)      normalize=True  (o_t = q_t S_t otherwise)

Chunks of BT = 16 tokens.  With ``b`` the cumulative log gate inside a chunk (per channel, so
``b`` is [BT, F], every step <= 0) the output of token i of a chunk that starts from (S, z) is::

    num_i = sum_{j <= i} s_ij v_j + (q_i * exp(b_i)) S,     s_ij = sum_f q_if k_jf exp(b_if - b_jf)
    den_i = sum_{j <= i} s_ij     + (q_i * exp(b_i)) . z

and the state moves to the chunk end as ``S <- exp(b_last) * S + (k_j * exp(b_last - b_j))^T v_j``.
A channel's decay cannot be pulled out of the score as in chunk.py (one scalar per token):
``s_ij`` is computed per channel, an elementwise [BT, BT, BKS] product summed over a sub-block of
BKS channels at a time, with the exponent masked to -inf above the diagonal BEFORE the exp.  Every
exponent is a difference ``b_later - b_earlier <= 0`` (never ``exp(b_i) * exp(-b_j)``), so strong
decays and resets (log g = -128, exp = 0 in fp32) give exact zeros, never inf or NaN.

Backward: as in chunk.py, the normalized output is the unnormalized one with value ``[v, 1]``
and output gradient ``[do / d, dd]`` (``dd = -(do . o) / d``, chunk.py's elementwise prep kernel),
then three sweeps:

* ``dq`` (forward in time, blocks of F): ``dq_if = sum_{j<=i} ds_ij k_jf exp(b_if - b_jf) +
  exp(b_if) (do_i S^T + dd_i z)_f``, ``ds_ij = do_i . v_j + dd_i``; also writes ``q * dq``;
* ``dk`` (backward in time, blocks of F): ``dk_jf = sum_{i>=j} ds_ij q_if exp(b_if - b_jf) +
  exp(b_last,f - b_jf) (v_j dS^T + dz)_f`` with (dS, dz) the state gradient at the chunk end;
  writes dS_0, dz_0 and the gate gradient (below);
* ``dv`` (backward in time, blocks of Dv): ``dv_j = sum_{i>=j} s_ij do_i + (k_j * exp(b_last - b_j)) dS``.

Gate gradient: with ``B_t`` the cumulative log gate over the whole sequence every term carries
``exp(B_i - B_j)`` (query i, key j) or ``exp(B_t)`` (initial state), so, per channel,
``dL/dB_tf = q_tf dq_tf - k_tf dk_tf``, plus at the last step the final state's
``sum_v dS_T[f, v] S_T[f, v] + dz_T[f] z_T[f]``; ``dlog_g_t`` is the sum of ``dL/dB_s`` over
``s >= t``, which the dk sweep accumulates as it walks back in time.  The sum stops at a reset
(a gate that is 0 in fp32, e.g. log g = -128): the terms at and past it sum to the reset gate's
own gradient, exactly 0 but for rounding, so earlier steps get exactly what they would get
without the later document.  Without an initial state the first gate multiplies zeros: its
gradient is set to exactly 0 (chunk.py explains why).

Speed: every program walks its sequence in chunks of 16 and the per-channel score is CUDA-core
work, so it is slower than chunk.py's scalar gate; what that costs a training step is measured by
``scripts/bench_train.py --presets linear,linear:decay=channel``.  A faster design would keep chunk
states in memory and compute the outputs of all chunks in parallel (fla's GLA kernels).
"""

from __future__ import annotations

import torch
import torch.nn.functional as Fn
import triton
import triton.language as tl

from ..launch import call_directly, launch
from .chunk import _bwd_prep_kernel, _empty
from .tiles import _next_pow2, _prec, _tile

# Chunk length, channel sub-block of the per-channel score, blocks of the state; module-level so
# a tuning script can override them.  BT stays small: the score tile is [BT, BT, sub_BK].
CONFIG = {
    "BT": 16, "sub_BK": 16, "bwd_BK": 16,
    "fwd_block_elems": 4096, "fwd_warps": 4, "fwd_stages": 2,
    "bwd_block_elems": 4096, "bwd_warps": 4, "bwd_stages": 2,
}


# A log gate below this is a reset: its exp is below float32's smallest normal (0 on a GPU, which
# flushes it), so the gradient of every earlier gate through the terms past it is 0.  The reverse sum of
# the dk sweep stops there instead of leaving the rounding of those terms' sum (which cancels to 0
# only up to rounding) as a gradient on an earlier document's gates.
_RESET = tl.constexpr(-87.5)


# ----------------------------------------------------------------------------- kernels

@triton.jit
def _gate_tile(lg, i_t, Tn, rs, c0, F, BT: tl.constexpr, BK: tl.constexpr):
    """Chunk-local cumulative log gate b [BT, BK] of channels c0.. and its last row (the chunk's
    total; padded tokens and channels count as log g = 0)."""
    p, m = _tile(lg, i_t * BT, Tn, rs, c0, F, BT, BK)
    b = tl.cumsum(tl.load(p, mask=m, other=0.), axis=0)
    last = tl.sum(tl.where((tl.arange(0, BT) == BT - 1)[:, None], b, 0.), axis=0)
    return b, last


@triton.jit
def _intra_scores(q, k, lg, i_t, Tn, rs, F, BT: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr):
    """s [BT(i), BT(j)] = sum_f q_if k_jf exp(b_if - b_jf) for j <= i, 0 above the diagonal.

    Sums BKS channels at a time (tiles reloaded per sub-block: registers stay [BT, BT, BKS])."""
    o_t = tl.arange(0, BT)
    causal = (o_t[:, None] >= o_t[None, :])[:, :, None]
    s = tl.zeros([BT, BT], dtype=tl.float32)
    for c0 in range(0, BK, BKS):
        p_q, m_q = _tile(q, i_t * BT, Tn, rs, c0, F, BT, BKS)
        p_k, m_k = _tile(k, i_t * BT, Tn, rs, c0, F, BT, BKS)
        b_q = tl.load(p_q, mask=m_q, other=0.).to(tl.float32)
        b_k = tl.load(p_k, mask=m_k, other=0.).to(tl.float32)
        b, _ = _gate_tile(lg, i_t, Tn, rs, c0, F, BT, BKS)
        e = tl.exp(tl.where(causal, b[:, None, :] - b[None, :, :], float("-inf")))
        s += tl.sum(b_q[:, None, :] * b_k[None, :, :] * e, axis=2)
    return s


@triton.jit(do_not_specialize=["T", "TT"])
def _fwd_kernel(
    q, k, v, lg, h0s, h0z, o, den, hts, htz, T, TT, eps,
    H: tl.constexpr, F: tl.constexpr, DV: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr,
    NORMALIZE: tl.constexpr, USE_H0: tl.constexpr, STORE_DEN: tl.constexpr, PREC: tl.constexpr,
):
    """One program per (sequence * head, block of Dv): walks the chunks carrying (S, z)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = i_n.to(tl.int64) * T
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    qb = q + (bos * H + i_h) * F
    kb = k + (bos * H + i_h) * F
    gb = lg + (bos * H + i_h) * F
    vb = v + (bos * H + i_h) * DV
    ob = o + (bos * H + i_h) * DV

    h = tl.zeros([BK, BV], dtype=tl.float32)
    z = tl.zeros([BK], dtype=tl.float32)
    if USE_H0:
        p_h0, m_h0 = _tile(h0s + i_nh * F * DV, 0, F, DV, i_v * BV, DV, BK, BV)
        h = tl.load(p_h0, mask=m_h0, other=0.)
        z = tl.load(h0z + i_nh * F + o_k, mask=o_k < F, other=0.)

    for i_t in range(0, tl.cdiv(T, BT)):
        p_q, m_q = _tile(qb, i_t * BT, T, H * F, 0, F, BT, BK)
        p_k, m_k = _tile(kb, i_t * BT, T, H * F, 0, F, BT, BK)
        p_v, m_v = _tile(vb, i_t * BT, T, H * DV, i_v * BV, DV, BT, BV)
        b_q = tl.load(p_q, mask=m_q, other=0.)
        b_k = tl.load(p_k, mask=m_k, other=0.)
        b_v = tl.load(p_v, mask=m_v, other=0.)
        b, b_last = _gate_tile(gb, i_t, T, H * F, 0, F, BT, BK)

        s = _intra_scores(qb, kb, gb, i_t, T, H * F, F, BT, BK, BKS)  # [BT, BT]
        q_dec = b_q.to(tl.float32) * tl.exp(b)  # q_i * exp(b_i): reads the state at the chunk start
        b_o = tl.dot(s.to(b_v.dtype), b_v, input_precision=PREC)
        b_o += tl.dot(q_dec.to(b_q.dtype), h.to(b_q.dtype), input_precision=PREC)
        if NORMALIZE:
            d = tl.sum(s, axis=1) + tl.sum(q_dec * z[None, :], axis=1) + eps
            b_o = b_o / d[:, None]
            if STORE_DEN:
                if i_v == 0:
                    o_tt = i_t * BT + o_t
                    tl.store(den + i_h * TT + bos + o_tt, d, mask=o_tt < T)
        p_o, m_o = _tile(ob, i_t * BT, T, H * DV, i_v * BV, DV, BT, BV)
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=m_o)

        # State update to the end of the chunk (exponents b_last - b_j <= 0).
        k_dec = b_k.to(tl.float32) * tl.exp(b_last[None, :] - b)
        h = h * tl.exp(b_last)[:, None] + tl.dot(tl.trans(k_dec.to(b_k.dtype)), b_v, input_precision=PREC)
        z = z * tl.exp(b_last) + tl.sum(k_dec, axis=0)

    p_ht, m_ht = _tile(hts + i_nh * F * DV, 0, F, DV, i_v * BV, DV, BK, BV)
    tl.store(p_ht, h, mask=m_ht)
    if i_v == 0:
        tl.store(htz + i_nh * F + o_k, z, mask=o_k < F)


@triton.jit(do_not_specialize=["T", "TT"])
def _bwd_dq_kernel(
    q, k, v, lg, do, dd, h0s, h0z, dq, dgq, T, TT,
    H: tl.constexpr, F: tl.constexpr, DV: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NORMALIZE: tl.constexpr, USE_H0: tl.constexpr, PREC: tl.constexpr,
):
    """One program per (block of F, sequence * head), forward in time; dgq = q * dq (fp32)."""
    i_k, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = i_n.to(tl.int64) * T
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    causal = (o_t[:, None] >= o_t[None, :])[:, :, None]  # [i, j, 1]
    qb = q + (bos * H + i_h) * F
    kb = k + (bos * H + i_h) * F
    gb = lg + (bos * H + i_h) * F
    dqb = dq + (bos * H + i_h) * F
    dgb = dgq + (bos * H + i_h) * F
    vb = v + (bos * H + i_h) * DV
    dob = do + (bos * H + i_h) * DV

    h = tl.zeros([BK, BV], dtype=tl.float32)  # rows i_k*BK.. of S
    z = tl.zeros([BK], dtype=tl.float32)
    if USE_H0:
        p_h0, m_h0 = _tile(h0s + i_nh * F * DV, i_k * BK, F, DV, 0, DV, BK, BV)
        h = tl.load(p_h0, mask=m_h0, other=0.)
        z = tl.load(h0z + i_nh * F + o_k, mask=o_k < F, other=0.)

    for i_t in range(0, tl.cdiv(T, BT)):
        p_k, m_k = _tile(kb, i_t * BT, T, H * F, i_k * BK, F, BT, BK)
        p_v, m_v = _tile(vb, i_t * BT, T, H * DV, 0, DV, BT, BV)
        p_do, m_do = _tile(dob, i_t * BT, T, H * DV, 0, DV, BT, BV)
        b_k = tl.load(p_k, mask=m_k, other=0.)
        b_v = tl.load(p_v, mask=m_v, other=0.)
        b_do = tl.load(p_do, mask=m_do, other=0.)
        b, b_last = _gate_tile(gb, i_t, T, H * F, i_k * BK, F, BT, BK)

        ds = tl.dot(b_do, tl.trans(b_v), input_precision=PREC)  # [BT(i), BT(j)] do_i . v_j
        inter = tl.dot(b_do, tl.trans(h.to(b_do.dtype)), input_precision=PREC)  # [BT, BK] do_i S^T
        if NORMALIZE:
            o_tt = i_t * BT + o_t
            b_dd = tl.load(dd + i_h * TT + bos + o_tt, mask=o_tt < T, other=0.)
            ds += b_dd[:, None]
            inter += b_dd[:, None] * z[None, :]
        e = tl.exp(tl.where(causal, b[:, None, :] - b[None, :, :], float("-inf")))  # [i, j, f]
        b_dq = tl.sum(ds[:, :, None] * b_k.to(tl.float32)[None, :, :] * e, axis=1) + inter * tl.exp(b)
        p_dq, m_dq = _tile(dqb, i_t * BT, T, H * F, i_k * BK, F, BT, BK)
        tl.store(p_dq, b_dq.to(p_dq.dtype.element_ty), mask=m_dq)
        p_q, m_q = _tile(qb, i_t * BT, T, H * F, i_k * BK, F, BT, BK)
        b_q = tl.load(p_q, mask=m_q, other=0.).to(tl.float32)
        p_dg, m_dg = _tile(dgb, i_t * BT, T, H * F, i_k * BK, F, BT, BK)
        tl.store(p_dg, b_q * b_dq, mask=m_dg)

        k_dec = b_k.to(tl.float32) * tl.exp(b_last[None, :] - b)
        h = h * tl.exp(b_last)[:, None] + tl.dot(tl.trans(k_dec.to(b_k.dtype)), b_v, input_precision=PREC)
        if NORMALIZE:
            z = z * tl.exp(b_last) + tl.sum(k_dec, axis=0)


@triton.jit(do_not_specialize=["T", "TT"])
def _bwd_dk_kernel(
    q, k, v, lg, do, dd, dgq, dhts, dhtz, hts, htz, dh0s, dh0z, dk, dlg, T, TT,
    H: tl.constexpr, F: tl.constexpr, DV: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NORMALIZE: tl.constexpr, USE_DHT: tl.constexpr, USE_H0: tl.constexpr, PREC: tl.constexpr,
):
    """One program per (block of F, sequence * head), backward in time: dk, dS_0/dz_0 and dlog_g
    (the reverse running sum of q * dq - k * dk, started from the final state's term)."""
    i_k, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = i_n.to(tl.int64) * T
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    anti = (o_t[:, None] <= o_t[None, :])[:, :, None]  # [j, i, 1]: key j reaches query i >= j
    TRACK_DZ: tl.constexpr = NORMALIZE or USE_DHT
    qb = q + (bos * H + i_h) * F
    kb = k + (bos * H + i_h) * F
    gb = lg + (bos * H + i_h) * F
    dgb = dgq + (bos * H + i_h) * F
    dkb = dk + (bos * H + i_h) * F
    dlb = dlg + (bos * H + i_h) * F
    vb = v + (bos * H + i_h) * DV
    dob = do + (bos * H + i_h) * DV

    dh = tl.zeros([BK, BV], dtype=tl.float32)  # rows of dL/dS at the end of the current chunk
    dz = tl.zeros([BK], dtype=tl.float32)
    carry = tl.zeros([BK], dtype=tl.float32)  # sum of dL/dB_s over the later chunks
    if USE_DHT:
        p_dht, m_dht = _tile(dhts + i_nh * F * DV, i_k * BK, F, DV, 0, DV, BK, BV)
        dh = tl.load(p_dht, mask=m_dht, other=0.)
        dz = tl.load(dhtz + i_nh * F + o_k, mask=o_k < F, other=0.)
        p_ht, m_ht = _tile(hts + i_nh * F * DV, i_k * BK, F, DV, 0, DV, BK, BV)
        b_ht = tl.load(p_ht, mask=m_ht, other=0.)
        carry = tl.sum(dh * b_ht, axis=1) + dz * tl.load(htz + i_nh * F + o_k, mask=o_k < F, other=0.)

    NT = tl.cdiv(T, BT)
    for i_r in range(0, NT):
        i_t = NT - 1 - i_r
        p_q, m_q = _tile(qb, i_t * BT, T, H * F, i_k * BK, F, BT, BK)
        p_k, m_k = _tile(kb, i_t * BT, T, H * F, i_k * BK, F, BT, BK)
        p_v, m_v = _tile(vb, i_t * BT, T, H * DV, 0, DV, BT, BV)
        p_do, m_do = _tile(dob, i_t * BT, T, H * DV, 0, DV, BT, BV)
        b_q = tl.load(p_q, mask=m_q, other=0.)
        b_k = tl.load(p_k, mask=m_k, other=0.)
        b_v = tl.load(p_v, mask=m_v, other=0.)
        b_do = tl.load(p_do, mask=m_do, other=0.)
        b, b_last = _gate_tile(gb, i_t, T, H * F, i_k * BK, F, BT, BK)
        o_tt = i_t * BT + o_t

        ds_t = tl.dot(b_v, tl.trans(b_do), input_precision=PREC)  # [BT(j), BT(i)] v_j . do_i
        inter = tl.dot(b_v, tl.trans(dh.to(b_v.dtype)), input_precision=PREC)  # [BT, BK] v_j dS^T
        if NORMALIZE:
            b_dd = tl.load(dd + i_h * TT + bos + o_tt, mask=o_tt < T, other=0.)
            ds_t += b_dd[None, :]
        if TRACK_DZ:
            inter += dz[None, :]
        e = tl.exp(tl.where(anti, b[None, :, :] - b[:, None, :], float("-inf")))  # [j, i, f]
        b_dk = tl.sum(ds_t[:, :, None] * b_q.to(tl.float32)[None, :, :] * e, axis=1)
        b_dk += inter * tl.exp(b_last[None, :] - b)
        p_dk, m_dk = _tile(dkb, i_t * BT, T, H * F, i_k * BK, F, BT, BK)
        tl.store(p_dk, b_dk.to(p_dk.dtype.element_ty), mask=m_dk)

        # dL/dB_t = q_t dq_t - k_t dk_t; dlog_g_t = sum over s >= t, cut at a reset (see _RESET).
        p_dg, m_dg = _tile(dgb, i_t * BT, T, H * F, i_k * BK, F, BT, BK)
        dB = tl.load(p_dg, mask=m_dg, other=0.) - b_k.to(tl.float32) * b_dk
        p_g, m_g = _tile(gb, i_t * BT, T, H * F, i_k * BK, F, BT, BK)
        cut = (tl.load(p_g, mask=m_g, other=0.) < _RESET).to(tl.int32)
        n_cut = tl.cumsum(cut, axis=0)  # resets in [chunk start, s]
        before = n_cut - cut  # resets in [chunk start, t)
        # s >= t and no reset in [t, s]
        keep = (o_t[:, None] <= o_t[None, :])[:, :, None] & (n_cut[None, :, :] == before[:, None, :])  # [t, s, f]
        b_dlg = tl.sum(tl.where(keep, dB[None, :, :], 0.), axis=1)
        n_all = tl.sum(cut, axis=0)
        b_dlg += tl.where(before == n_all[None, :], carry[None, :], 0.)  # no reset in [t, chunk end]
        carry = tl.sum(tl.where((o_t == 0)[:, None], b_dlg, 0.), axis=0)
        if not USE_H0:  # the first gate multiplies a zero state
            b_dlg = tl.where((o_tt == 0)[:, None], 0., b_dlg)
        p_dl, m_dl = _tile(dlb, i_t * BT, T, H * F, i_k * BK, F, BT, BK)
        tl.store(p_dl, b_dlg, mask=m_dl)

        # State gradient to the start of the chunk.
        q_dec = b_q.to(tl.float32) * tl.exp(b)
        dh = dh * tl.exp(b_last)[:, None] + tl.dot(tl.trans(q_dec.to(b_q.dtype)), b_do, input_precision=PREC)
        if TRACK_DZ:
            dz = dz * tl.exp(b_last)
        if NORMALIZE:
            dz += tl.sum(q_dec * b_dd[:, None], axis=0)

    if USE_H0:
        p_dh0, m_dh0 = _tile(dh0s + i_nh * F * DV, i_k * BK, F, DV, 0, DV, BK, BV)
        tl.store(p_dh0, dh, mask=m_dh0)
        tl.store(dh0z + i_nh * F + o_k, dz, mask=o_k < F)


@triton.jit(do_not_specialize=["T"])
def _bwd_dv_kernel(
    q, k, lg, do, dhts, dv, T,
    H: tl.constexpr, F: tl.constexpr, DV: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr,
    USE_DHT: tl.constexpr, PREC: tl.constexpr,
):
    """One program per (block of Dv, sequence * head), backward in time."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = i_n.to(tl.int64) * T
    qb = q + (bos * H + i_h) * F
    kb = k + (bos * H + i_h) * F
    gb = lg + (bos * H + i_h) * F
    dob = do + (bos * H + i_h) * DV
    dvb = dv + (bos * H + i_h) * DV

    dh = tl.zeros([BK, BV], dtype=tl.float32)  # columns of dL/dS
    if USE_DHT:
        p_dht, m_dht = _tile(dhts + i_nh * F * DV, 0, F, DV, i_v * BV, DV, BK, BV)
        dh = tl.load(p_dht, mask=m_dht, other=0.)

    NT = tl.cdiv(T, BT)
    for i_r in range(0, NT):
        i_t = NT - 1 - i_r
        p_q, m_q = _tile(qb, i_t * BT, T, H * F, 0, F, BT, BK)
        p_k, m_k = _tile(kb, i_t * BT, T, H * F, 0, F, BT, BK)
        p_do, m_do = _tile(dob, i_t * BT, T, H * DV, i_v * BV, DV, BT, BV)
        b_q = tl.load(p_q, mask=m_q, other=0.)
        b_k = tl.load(p_k, mask=m_k, other=0.)
        b_do = tl.load(p_do, mask=m_do, other=0.)
        b, b_last = _gate_tile(gb, i_t, T, H * F, 0, F, BT, BK)

        s = _intra_scores(qb, kb, gb, i_t, T, H * F, F, BT, BK, BKS)  # [BT(i), BT(j)]
        k_dec = b_k.to(tl.float32) * tl.exp(b_last[None, :] - b)
        b_dv = tl.dot(tl.trans(s).to(b_do.dtype), b_do, input_precision=PREC)
        b_dv += tl.dot(k_dec.to(b_k.dtype), dh.to(b_k.dtype), input_precision=PREC)
        p_dv, m_dv = _tile(dvb, i_t * BT, T, H * DV, i_v * BV, DV, BT, BV)
        tl.store(p_dv, b_dv.to(p_dv.dtype.element_ty), mask=m_dv)

        q_dec = b_q.to(tl.float32) * tl.exp(b)
        dh = dh * tl.exp(b_last)[:, None] + tl.dot(tl.trans(q_dec.to(b_q.dtype)), b_do, input_precision=PREC)


# ----------------------------------------------------------------------------- launchers

def _geometry(q, v):
    B, T, H, F = q.shape
    DV = v.shape[-1]
    if not (16 <= F <= 256 and 16 <= DV <= 256):
        raise ValueError(f"feature and value dims must be in [16, 256], got F={F}, Dv={DV}")
    return B, T, H, F, DV


def _split(full: int, other: int, elems: int) -> int:
    """Block of a dim of size ``full`` (a power of 2) such that block * other <= elems (>= 16)."""
    return max(16, min(full, triton.next_power_of_2(max(elems // other, 1))))


def channel_fwd(q, k, v, log_g, S0, z0, normalize, eps, store_den):
    """q, k, log_g (fp32) [B, T, H, F], v [B, T, H, Dv], contiguous; S0/z0 fp32 or None.
    Returns o, den ([H, B*T] fp32, or None), S_T, z_T."""
    B, T, H, F, DV = _geometry(q, v)
    cfg = CONFIG
    BK = _next_pow2(F)
    BV = _split(_next_pow2(DV), BK, cfg["fwd_block_elems"])
    o = torch.empty_like(v)
    den = torch.empty(H, B * T, device=q.device, dtype=torch.float32) if store_den else None
    Sn = torch.empty(B, H, F, DV, device=q.device, dtype=torch.float32)
    zn = torch.empty(B, H, F, device=q.device, dtype=torch.float32)
    launch(_fwd_kernel, (triton.cdiv(DV, BV), B * H), q, k, v, log_g, S0, z0, o, den, Sn, zn, T, B * T, eps,
           H=H, F=F, DV=DV, BT=cfg["BT"], BK=BK, BKS=min(cfg["sub_BK"], BK), BV=BV,
           NORMALIZE=normalize, USE_H0=S0 is not None, STORE_DEN=den is not None, PREC=_prec(q),
           num_warps=cfg["fwd_warps"], num_stages=cfg["fwd_stages"])
    return o, den, Sn, zn


def channel_bwd(q, k, v, log_g, S0, z0, o, den, do, dSn, dzn, Sn, zn, normalize, eps):
    """Gradients dq, dk, dv, dlog_g (fp32), dS0, dz0 (None without S0)."""
    B, T, H, F, DV = _geometry(q, v)
    cfg = CONFIG
    BT = cfg["BT"]
    TT = B * T
    prec = _prec(q)
    opts = dict(num_warps=cfg["bwd_warps"], num_stages=cfg["bwd_stages"])
    f32 = dict(device=q.device, dtype=torch.float32)
    use_dht = dSn is not None or dzn is not None
    if use_dht:
        dSn = torch.zeros(B, H, F, DV, **f32) if dSn is None else dSn.float().contiguous()
        dzn = torch.zeros(B, H, F, **f32) if dzn is None else dzn.float().contiguous()

    dd, do_s = None, do
    if normalize:  # chunk.py's prep: do_s = do / d, dd = -(do . o) / d
        dd = torch.empty(H, TT, **f32)
        do_s = torch.empty_like(do)
        BVf = _next_pow2(DV)
        BR = max(1, 4096 // BVf)
        _bwd_prep_kernel[(triton.cdiv(TT * H, BR),)](o, do, den, dd, do_s, TT, H=H, DV=DV, BR=BR, BV=BVf,
                                                      num_warps=4)

    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dgq = torch.empty(B, T, H, F, **f32)
    dlog_g = torch.empty(B, T, H, F, **f32)
    dS0 = torch.empty(B, H, F, DV, **f32) if S0 is not None else None
    dz0 = torch.empty(B, H, F, **f32) if S0 is not None else None

    BVf = _next_pow2(DV)
    BKs = min(cfg["bwd_BK"], _next_pow2(F))
    common = dict(H=H, F=F, DV=DV, BT=BT, PREC=prec, **opts)
    grid = (triton.cdiv(F, BKs), B * H)
    launch(_bwd_dq_kernel, grid, q, k, v, log_g, do_s, dd, S0, z0, dq, dgq, T, TT,
           BK=BKs, BV=BVf, NORMALIZE=normalize, USE_H0=S0 is not None, **common)
    launch(_bwd_dk_kernel, grid, q, k, v, log_g, do_s, dd, dgq, dSn, dzn, Sn, zn, dS0, dz0, dk, dlog_g, T, TT,
           BK=BKs, BV=BVf, NORMALIZE=normalize, USE_DHT=use_dht, USE_H0=S0 is not None, **common)
    BKf = _next_pow2(F)
    BVs = _split(_next_pow2(DV), BKf, cfg["bwd_block_elems"])
    launch(_bwd_dv_kernel, (triton.cdiv(DV, BVs), B * H), q, k, log_g, do_s, dSn, dv, T,
           BK=BKf, BKS=min(cfg["sub_BK"], BKf), BV=BVs, USE_DHT=use_dht, **common)
    return dq, dk, dv, dlog_g, dS0, dz0


# ----------------------------------------------------------------------------- ops and autograd

def _chunk_linear_attn_channel_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_g: torch.Tensor, S0: torch.Tensor | None,
    z0: torch.Tensor | None, normalize: bool, eps: float, store_den: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward as a torch op: q, k [B, T, H, F], v [B, T, H, Dv] (contiguous), log_g fp32
    [B, T, H, F], S0/z0 fp32 or None. Returns o, the fp32 denominators [H, B*T] (empty unless
    ``store_den`` and ``normalize``: the normalized backward needs them) and the final state (S, z)
    fp32."""
    o, den, Sn, zn = channel_fwd(q, k, v, log_g.float().contiguous(), S0, z0, normalize, eps,
                                 store_den and normalize)
    return o, (_empty(q) if den is None else den), Sn, zn


chunk_linear_attn_channel_fwd_op = torch.library.custom_op(
    "linearize::chunk_linear_attn_channel_fwd", mutates_args=())(_chunk_linear_attn_channel_fwd)


@chunk_linear_attn_channel_fwd_op.register_fake
def _(q, k, v, log_g, S0, z0, normalize, eps, store_den):
    B, T, H, F = q.shape
    DV = v.shape[-1]
    den = q.new_empty(H, B * T, dtype=torch.float32) if store_den and normalize else _empty(q)
    return (torch.empty_like(v), den, q.new_empty(B, H, F, DV, dtype=torch.float32),
            q.new_empty(B, H, F, dtype=torch.float32))


@torch.library.custom_op("linearize::chunk_linear_attn_channel_bwd", mutates_args=())
def chunk_linear_attn_channel_bwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_g: torch.Tensor, S0: torch.Tensor | None,
    z0: torch.Tensor | None, o: torch.Tensor, den: torch.Tensor, Sn: torch.Tensor, zn: torch.Tensor,
    do: torch.Tensor, dSn: torch.Tensor | None, dzn: torch.Tensor | None, normalize: bool, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`chunk_linear_attn_channel_fwd_op`: dq, dk, dv, dlog_g (in log_g's dtype),
    dS0, dz0 (empty where the input was None)."""
    dq, dk, dv, dlog_g, dS0, dz0 = channel_bwd(q, k, v, log_g.float().contiguous(), S0, z0, o, den,
                                               do.contiguous(), dSn, dzn, Sn, zn, normalize, eps)
    return (dq, dk, dv, dlog_g.to(log_g.dtype), (_empty(q) if dS0 is None else dS0),
            (_empty(q) if dz0 is None else dz0))


@chunk_linear_attn_channel_bwd_op.register_fake
def _(q, k, v, log_g, S0, z0, o, den, Sn, zn, do, dSn, dzn, normalize, eps):
    like = lambda x: _empty(q) if x is None else torch.empty_like(x)  # noqa: E731
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(log_g), like(S0), like(z0)


def _setup(ctx, inputs, output):
    q, k, v, log_g, S0, z0, normalize, eps, store_den = inputs
    o, den, Sn, zn = output
    ctx.save_for_backward(q, k, v, log_g, S0, z0, o, den, Sn, zn)
    ctx.normalize, ctx.eps = normalize, eps


def _backward(ctx, do, dden, dSn, dzn):
    q, k, v, log_g, S0, z0, o, den, Sn, zn = ctx.saved_tensors
    if ctx.normalize and den.numel() == 0:
        raise RuntimeError("chunk_linear_attn_channel_fwd ran with store_den=False: call "
                           "chunk_linear_attn_channel with inputs that require grad to train through it")
    dq, dk, dv, dlog_g, dS0, dz0 = torch.ops.linearize.chunk_linear_attn_channel_bwd(
        q, k, v, log_g, S0, z0, o, den, Sn, zn, do, dSn, dzn, ctx.normalize, ctx.eps)
    return (dq, dk, dv, dlog_g, None if S0 is None else dS0, None if z0 is None else dz0, None, None, None)


chunk_linear_attn_channel_fwd_op.register_autograd(_backward, setup_context=_setup)


def chunk_linear_attn_channel(q, k, v, log_g, *, normalize=True, eps=1e-6, initial_state=None,
                              output_final_state=False):
    """Chunkwise (normalized) feature-map linear attention with a per-channel decay.

    Args:
        q, k: [B, T, H, F] feature-mapped queries and keys (non-negative when normalize=True).
        v: [B, T, H, Dv] values. F and Dv in [16, 256]; fp32, bf16 or fp16.
        log_g: [B, T, H, F] log decay of each key channel (<= 0; -128 resets the state), fp32.
        initial_state: optional (S [B, H, F, Dv], z [B, H, F]), fp32.

    Returns:
        o [B, T, H, Dv] in v's dtype, and (S, z) fp32 when output_final_state else None.
    """
    B, T, H, F = q.shape
    if k.shape != q.shape or log_g.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"log_g {tuple(log_g.shape)} (q, k, log_g [B, T, H, F], v [B, T, H, Dv])")
    if 16 <= F <= 256 and F != _next_pow2(F):
        # Zero features (and log g = 0) fill the feature tile, as chunk_linear_attn does: they add
        # nothing to any score or normalizer, their state rows stay 0 and are sliced off.
        Fp = _next_pow2(F)
        pad = (lambda x: Fn.pad(x, (0, Fp - F)))  # noqa: E731
        init = None
        if initial_state is not None:
            init = (Fn.pad(initial_state[0], (0, 0, 0, Fp - F)), pad(initial_state[1]))
        o, state = chunk_linear_attn_channel(pad(q), pad(k), v, pad(log_g), normalize=normalize, eps=eps,
                                             initial_state=init, output_final_state=output_final_state)
        return o, (None if state is None else (state[0][..., :F, :], state[1][..., :F]))
    S0 = z0 = None
    if initial_state is not None:
        S0, z0 = (x.float().contiguous() for x in initial_state)
    q, k, v = (x.contiguous() for x in (q, k, v))
    log_g = log_g.float().contiguous()
    grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, log_g, S0, z0))
    fwd = (_chunk_linear_attn_channel_fwd if call_directly(grad)
           else torch.ops.linearize.chunk_linear_attn_channel_fwd)
    o, _, Sn, zn = fwd(q, k, v, log_g, S0, z0, normalize, float(eps), grad and normalize)
    return o, ((Sn, zn) if output_final_state else None)
