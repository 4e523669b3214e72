"""Chunkwise normalized feature-map linear attention with a per-channel decay (the GLA form).

Per (sequence, head), with ``g_t = exp(log_g_t)`` a vector over the F key channels::

    S_t = diag(g_t) S_{t-1} + k_t^T v_t      S: [F, Dv]
    z_t = g_t * z_{t-1} + k_t                z: [F]
    o_t = (q_t S_t) / (q_t . z_t + eps)      normalize=True  (o_t = q_t S_t otherwise)

Chunks of BT = 64 tokens (CONFIG), each cut into sub-chunks of BC = 16.  With ``b`` the cumulative
log gate inside a chunk (per channel, so ``b`` is [BT, F], every step <= 0) the output of token i
of a chunk that starts from the state (S_c, z_c) is::

    num_i = sum_{j <= i} A_ij v_j + (q_i * exp(b_i)) S_c,     A_ij = sum_f q_if k_jf exp(b_if - b_jf)
    den_i = sum_{j <= i} A_ij     + (q_i * exp(b_i)) . z_c

and the state moves to the chunk end as ``S_{c+1} = exp(b_last) * S_c + (k_j * exp(b_last - b_j))^T v_j``.

The score A of a channel's decay cannot be pulled apart as ``exp(b_i) * exp(-b_j)`` (it overflows or
underflows at strong decays and resets), so A is computed per sub-chunk row block I:

* columns j in the earlier sub-chunks of the chunk: with r = b at the row just before I (the
  last row of sub-chunk I-1), ``exp(b_i - b_j) = exp(b_i - r) * exp(r - b_j)`` and both exponents
  are <= 0 (b never increases), so the block is one tensor-core ``tl.dot`` of
  ``q_I * exp(b_I - r)`` [BC, F] with ``k_j * exp(r - b_j)`` [BT, F] (the exponent of the other
  columns masked to -inf before the exp);
* the diagonal BC x BC block: the per-channel elementwise product ``q_if k_jf exp(b_if - b_jf)``
  summed over a block of BK channels at a time, one column j at a time (a [BC, BK] tile against
  row j), with the exponent masked to -inf above the diagonal BEFORE the exp.

Every exponent is a difference ``b_later - b_earlier <= 0`` (or b, or b_last - b), so strong decays
and resets (log g = -128: exp is 0 in fp32) give exact zeros, never inf or NaN; the products of two
factors <= 1 underflow only where their product does.  All kernels read the chunk-local cumulative
gate from one fp32 array (written by the state pass), so every kernel sees the same b.

Forward, two launches:

1. ``_state_fwd_kernel`` (grid F-blocks x Dv-blocks x B*H): walks the chunks in order and writes
   the state at each chunk start (S_c, z_c) to memory, the chunk-local cumulative gate, and the
   final state.
2. ``_fwd_out_kernel`` (grid sub-chunks x Dv-blocks x B*H, all sub-chunks of all chunks in
   parallel): one sub-chunk's intra-chunk scores as above, ``A v`` plus the inter-chunk
   ``(q exp(b)) S_c``, normalized.

Backward: as in chunk.py the normalized output is the unnormalized one with value ``[v, 1]`` and
output gradient ``[do / d, dd]`` (``dd = -(do . o) / d``, chunk.py's elementwise prep kernel).
With ``dA_ij = do_i . v_j + dd_i`` and (dS_c, dz_c) the gradient of the state at the END of chunk c:

* ``dq_if = sum_{j<=i} dA_ij k_jf exp(b_if - b_jf) + exp(b_if) (do_i S_c^T + dd_i z_c)_f``
* ``dk_jf = sum_{i>=j} dA_ij q_if exp(b_if - b_jf) + exp(b_last,f - b_jf) (v_j dS_c^T + dz_c)_f``
* ``dv_j = sum_{i>=j} A_ij do_i + (k_j * exp(b_last - b_j)) dS_c``

in launches: the state pass again (S_c, z_c, b); ``_state_bwd_kernel``, a reverse walk over the
chunks writing (dS_c, dz_c) (``dS_{c-1} = exp(b_last) dS_c + (q exp(b))^T do``) and dS_0, dz_0;
``_bwd_dq_kernel`` then ``_bwd_dk_kernel`` (each sub-chunks x F-blocks x B*H; two launches, so
that neither holds both sides' tiles) with the intra-chunk terms split as in the forward
(reference r = the row before sub-chunk I for dq's earlier columns, r = the last row of sub-chunk
J for dk's later rows, the diagonal block one row of the sub-chunk at a time for both dq and dk);
``_bwd_dv_kernel`` (sub-chunks x Dv-blocks x B*H, the transposed scores); and three short launches for
the gate (below).

Rounding: b is an fp32 running sum inside a chunk, so past a reset (-128) in the same chunk the
differences ``b_i - b_j`` are rounded at that magnitude (~4e-6 absolute, ~1e-5 relative in the
scores), as in chunk.py; across a reset every factor is an exact 0.

Gate gradient: with ``B_t`` the cumulative log gate over the whole sequence every term carries
``exp(B_i - B_j)`` (query i, key j) or ``exp(B_t)`` (initial state), so, per channel,
``dL/dB_tf = q_tf dq_tf - k_tf dk_tf`` (the dq and dk kernels write it), plus at the last step the final
state's ``sum_v dS_T[f, v] S_T[f, v] + dz_T[f] z_T[f]``; ``dlog_g_t`` is the sum of ``dL/dB_s`` over
``s >= t``, a reverse scan over the sequence, in place, on tiles of 64 steps (CONFIG) in parallel:
``_dlg_tile_kernel`` sums each tile's terms up to its first reset, ``_dlg_carry_kernel`` walks those
per-tile sums backward into the carry each tile gets from the later ones, and ``_dlg_scan_kernel``
runs each tile's segmented reverse scan (``tl.associative_scan``) and adds the carry.
The sum stops at a reset (a gate that is 0 in fp32, e.g. log g = -128): the terms at and past it
sum to the reset gate's own gradient, exactly 0 but for rounding, so the reset gate gets exactly 0
and earlier steps get exactly what they would get without the later document.  Without an initial
state the first gate multiplies zeros: its gradient is set to exactly 0 (chunk.py explains why).

Speed: the chunk states go through memory (fp32, [B, H, T/BT, F, Dv]) so that the outputs and the
q/k/v gradients of all sub-chunks are computed in parallel (fla's GLA design); only the two state
passes and the gate scan's carry pass (over the sums of 64-step tiles) walk the sequence.  What a
training step costs against chunk.py's scalar gate is measured by
``scripts/bench_train.py --presets linear,linear:decay=channel``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as Fn
import triton
import triton.language as tl

from ..launch import call_directly, launch
from .chunk import _bwd_prep_kernel, _empty
from .tiles import _next_pow2, _prec, _tile

# Chunk length and sub-chunk (BT a multiple of BC >= 16), channel block of the dq and dk kernels
# (BK) and of the scores in the output and dv kernels (score_BK), value blocks, blocks of the state
# passes and of the gate scan, launch settings; module-level so a tuning script (or a test) can
# override them.
# Picked from ptxas's resource usage of the sm_90 compilation (tests/test_compile_kernels.py) at
# bf16, F = 64 and 128, Dv = 64, not timed yet: no spills; registers (8 warps) dq/dk ~110 at BK =
# 32 (~210 at 16), output/dv ~80 at score_BK = 16 (~160 at 32); scan kernels ~70-110 (4 warps);
# state passes 80-150 at state_BK = 16 (twice the programs of 32 for these sequential walks).
CONFIG = {
    "BT": 64, "BC": 16, "BK": 32, "score_BK": 16, "fwd_BV": 128, "bwd_BV": 32, "dv_BV": 64,
    "state_BK": 16, "state_BV": 64, "scan_BS": 64, "scan_BK": 32, "scan_warps": 4,
    "warps": 8, "stages": 2, "state_warps": 8,
    # segments per sequence of a forward without gradients when the caller names none (the split-time
    # forward below); 1: no split. An H200 (2026-11-30b) ran a 64K-token prompt of one SmolLM2 layer in
    # 4.98 ms unsplit against 5.09 ms in 8 segments: the output kernel dominates, not the state walk
    "splits": 1,
}


# A log gate below this is a reset: its exp is below float32's smallest normal (0 on a GPU, which
# flushes it), so the gradient of every earlier gate through the terms past it is 0.  The reverse
# scan of the gate gradient stops there instead of leaving the rounding of those terms' sum (which
# cancels to 0 only up to rounding) as a gradient on an earlier document's gates.
_RESET = tl.constexpr(-87.5)


# ----------------------------------------------------------------------------- kernels

@triton.jit
def _scores(xb, yb, gcb, t0, i_s, T, Tp, rs, F, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
            REV: tl.constexpr, PREC: tl.constexpr):
    """Intra-chunk scores of the rows of sub-chunk ``i_s`` of the chunk starting at row t0, summed
    over all F channels: (off [BC, BT] against the other sub-chunks' rows, 0 in the columns of this
    sub-chunk; diag [BC, BC] against this sub-chunk's rows).

    REV=False (x = q, y = k): ``A[i, j] = sum_f q_if k_jf exp(b_if - b_jf)`` for j <= i, else 0.
    REV=True (x = k, y = q): ``At[j, i] = sum_f k_jf q_if exp(b_if - b_jf)`` for i >= j, else 0.
    Off the diagonal block a tl.dot around a reference row r (both exponents <= 0); on it the
    per-channel product column by column (a [BC, BK] tile against one row of y at a time, the
    exponent masked to -inf before the exp): no [BC, BC, BK] tile in registers."""
    o_c = tl.arange(0, BT)
    o_s = tl.arange(0, BC)
    r0 = t0 + i_s * BC
    off = tl.zeros([BC, BT], dtype=tl.float32)
    diag = tl.zeros([BC, BC], dtype=tl.float32)
    if REV:
        far = (o_c >= (i_s + 1) * BC)[:, None]  # later sub-chunks; r = the last row of this one
        ref = r0 + BC - 1
    else:
        far = (o_c < i_s * BC)[:, None]  # earlier sub-chunks; r = the row before this one
        ref = tl.maximum(r0 - 1, t0)  # (the chunk's first row at i_s = 0: no earlier columns, b - r <= 0)
    for f0 in range(0, F, BK):
        o_k = f0 + tl.arange(0, BK)
        p_x, m_x = _tile(xb, r0, T, rs, f0, F, BC, BK)
        b_x = tl.load(p_x, mask=m_x, other=0.)
        p_bx, m_bx = _tile(gcb, r0, Tp, F, f0, F, BC, BK)
        b_bx = tl.load(p_bx, mask=m_bx, other=0.)
        p_y, m_y = _tile(yb, t0, T, rs, f0, F, BT, BK)
        b_y = tl.load(p_y, mask=m_y, other=0.).to(tl.float32)
        p_by, m_by = _tile(gcb, t0, Tp, F, f0, F, BT, BK)
        b_by = tl.load(p_by, mask=m_by, other=0.)
        r = tl.load(gcb + ref * F + o_k, mask=o_k < F, other=0.)
        if REV:
            xs = b_x.to(tl.float32) * tl.exp(r[None, :] - b_bx)
            ys = b_y * tl.exp(tl.where(far, b_by - r[None, :], float("-inf")))
        else:
            xs = b_x.to(tl.float32) * tl.exp(b_bx - r[None, :])
            ys = b_y * tl.exp(tl.where(far, r[None, :] - b_by, float("-inf")))
        off += tl.dot(xs.to(b_x.dtype), tl.trans(ys.to(b_x.dtype)), input_precision=PREC)
        for c in range(0, BC):  # column c of the diagonal block: row r0 + c of y
            y_c = tl.load(yb + (r0 + c).to(tl.int64) * rs + o_k, mask=(o_k < F) & (r0 + c + 0 * o_k < T), other=0.)
            b_c = tl.load(gcb + (r0 + c) * F + o_k, mask=o_k < F, other=0.)
            if REV:  # At[j, c] for c >= j
                e = tl.exp(tl.where((o_s <= c)[:, None], b_c[None, :] - b_bx, float("-inf")))
            else:  # A[i, c] for c <= i
                e = tl.exp(tl.where((o_s >= c)[:, None], b_bx - b_c[None, :], float("-inf")))
            col = tl.sum(b_x.to(tl.float32) * y_c.to(tl.float32)[None, :] * e, axis=1)
            diag += tl.where((o_s == c)[None, :], col[:, None], 0.)
    return off, diag


@triton.jit(do_not_specialize=["T", "Tp", "NT"])
def _state_fwd_kernel(
    k, v, lg, h0s, h0z, gc, hs, zs, hts, htz, T, Tp, NT,
    H: tl.constexpr, F: tl.constexpr, DV: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, PREC: tl.constexpr, STORE_CHUNKS: tl.constexpr,
):
    """One program per (block of F, block of Dv, sequence * head), forward in time: the state at
    each chunk start to hs/zs, the chunk-local cumulative gate to gc (programs of Dv block 0; not
    without STORE_CHUNKS: the split forward's first pass wants the final state alone), the final
    state to hts/htz."""
    i_k, i_v, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    nh = i_nh.to(tl.int64)
    bos = i_n.to(tl.int64) * T
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < F
    kb = k + (bos * H + i_h) * F
    gb = lg + (bos * H + i_h) * F
    vb = v + (bos * H + i_h) * DV
    gcb = gc + nh * Tp * F

    h = tl.zeros([BK, BV], dtype=tl.float32)
    z = tl.zeros([BK], dtype=tl.float32)
    if USE_H0:
        p_h0, m_h0 = _tile(h0s + nh * F * DV, i_k * BK, F, DV, i_v * BV, DV, BK, BV)
        h = tl.load(p_h0, mask=m_h0, other=0.)
        z = tl.load(h0z + nh * F + o_k, mask=m_k, other=0.)

    for i_t in range(0, NT):
        if STORE_CHUNKS:
            p_h, m_h = _tile(hs + (nh * NT + i_t) * F * DV, i_k * BK, F, DV, i_v * BV, DV, BK, BV)
            tl.store(p_h, h, mask=m_h)
        p_g, m_g = _tile(gb, i_t * BT, T, H * F, i_k * BK, F, BT, BK)
        b = tl.cumsum(tl.load(p_g, mask=m_g, other=0.), axis=0)  # padded tokens: log g = 0
        if STORE_CHUNKS and i_v == 0:
            tl.store(zs + (nh * NT + i_t) * F + o_k, z, mask=m_k)
            p_c, m_c = _tile(gcb, i_t * BT, Tp, F, i_k * BK, F, BT, BK)
            tl.store(p_c, b, mask=m_c)
        b_last = tl.sum(tl.where((o_t == BT - 1)[:, None], b, 0.), axis=0)
        p_k, m_kk = _tile(kb, i_t * BT, T, H * F, i_k * BK, F, BT, BK)
        p_v, m_v = _tile(vb, i_t * BT, T, H * DV, i_v * BV, DV, BT, BV)
        b_k = tl.load(p_k, mask=m_kk, other=0.)
        b_v = tl.load(p_v, mask=m_v, other=0.)
        k_dec = b_k.to(tl.float32) * tl.exp(b_last[None, :] - b)
        h = h * tl.exp(b_last)[:, None] + tl.dot(tl.trans(k_dec.to(b_k.dtype)), b_v, input_precision=PREC)
        z = z * tl.exp(b_last) + tl.sum(k_dec, axis=0)

    if STORE_HT:
        p_ht, m_ht = _tile(hts + nh * F * DV, i_k * BK, F, DV, i_v * BV, DV, BK, BV)
        tl.store(p_ht, h, mask=m_ht)
        if i_v == 0:
            tl.store(htz + nh * F + o_k, z, mask=m_k)


@triton.jit(do_not_specialize=["T", "TT", "Tp", "NT"])
def _fwd_out_kernel(
    q, k, v, gc, hs, zs, o, den, T, TT, Tp, NT, eps,
    H: tl.constexpr, F: tl.constexpr, DV: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NORMALIZE: tl.constexpr, STORE_DEN: tl.constexpr, PREC: tl.constexpr,
):
    """One program per (sub-chunk, block of Dv, sequence * head): the sub-chunk's outputs, from
    its intra-chunk scores and the state at the chunk start."""
    i_ts, i_v, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_t, i_s = i_ts // (BT // BC), i_ts % (BT // BC)  # chunk, sub-chunk
    i_n, i_h = i_nh // H, i_nh % H
    nh = i_nh.to(tl.int64)
    bos = i_n.to(tl.int64) * T
    o_s = tl.arange(0, BC)
    t0 = i_t * BT
    qb = q + (bos * H + i_h) * F
    kb = k + (bos * H + i_h) * F
    vb = v + (bos * H + i_h) * DV
    ob = o + (bos * H + i_h) * DV
    gcb = gc + nh * Tp * F
    hb = hs + (nh * NT + i_t) * F * DV
    zb = zs + (nh * NT + i_t) * F

    r0 = t0 + i_s * BC
    A, A_d = _scores(qb, kb, gcb, t0, i_s, T, Tp, H * F, F, BT, BC, BK, False, PREC)  # [BC, BT], [BC, BC]
    p_v, m_v = _tile(vb, t0, T, H * DV, i_v * BV, DV, BT, BV)
    b_v = tl.load(p_v, mask=m_v, other=0.)
    p_vi, m_vi = _tile(vb, r0, T, H * DV, i_v * BV, DV, BC, BV)
    b_o = tl.dot(A.to(b_v.dtype), b_v, input_precision=PREC)
    b_o += tl.dot(A_d.to(b_v.dtype), tl.load(p_vi, mask=m_vi, other=0.), input_precision=PREC)
    d = tl.sum(A, axis=1) + tl.sum(A_d, axis=1)
    for f0 in range(0, F, BK):  # inter-chunk: (q_i * exp(b_i)) S_c
        p_q, m_q = _tile(qb, r0, T, H * F, f0, F, BC, BK)
        p_b, m_b = _tile(gcb, r0, Tp, F, f0, F, BC, BK)
        b_q = tl.load(p_q, mask=m_q, other=0.)
        q_dec = b_q.to(tl.float32) * tl.exp(tl.load(p_b, mask=m_b, other=0.))
        p_h, m_h = _tile(hb, f0, F, DV, i_v * BV, DV, BK, BV)
        b_h = tl.load(p_h, mask=m_h, other=0.)
        b_o += tl.dot(q_dec.to(b_q.dtype), b_h.to(b_q.dtype), input_precision=PREC)
        if NORMALIZE:
            o_k = f0 + tl.arange(0, BK)
            b_z = tl.load(zb + o_k, mask=o_k < F, other=0.)
            d += tl.sum(q_dec * b_z[None, :], axis=1)
    if NORMALIZE:
        d += eps
        b_o = b_o / d[:, None]
        if STORE_DEN:
            if i_v == 0:
                o_tt = r0 + o_s
                tl.store(den + i_h * TT + bos + o_tt, d, mask=o_tt < T)
    p_o, m_o = _tile(ob, r0, T, H * DV, i_v * BV, DV, BC, BV)
    tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=m_o)


@triton.jit(do_not_specialize=["T", "TT", "Tp", "NT"])
def _state_bwd_kernel(
    q, do, dd, gc, dhts, dhtz, dhs, dzs, dh0s, dh0z, T, TT, Tp, NT,
    H: tl.constexpr, F: tl.constexpr, DV: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NORMALIZE: tl.constexpr, USE_DHT: tl.constexpr, USE_H0: tl.constexpr, PREC: tl.constexpr,
):
    """One program per (block of F, block of Dv, sequence * head), backward in time: the gradient
    of the state at each chunk END to dhs/dzs, and dS_0, dz_0."""
    i_k, i_v, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    nh = i_nh.to(tl.int64)
    bos = i_n.to(tl.int64) * T
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < F
    qb = q + (bos * H + i_h) * F
    dob = do + (bos * H + i_h) * DV
    gcb = gc + nh * Tp * F

    dh = tl.zeros([BK, BV], dtype=tl.float32)
    dz = tl.zeros([BK], dtype=tl.float32)
    if USE_DHT:
        p_dht, m_dht = _tile(dhts + nh * F * DV, i_k * BK, F, DV, i_v * BV, DV, BK, BV)
        dh = tl.load(p_dht, mask=m_dht, other=0.)
        dz = tl.load(dhtz + nh * F + o_k, mask=m_k, other=0.)

    for i_r in range(0, NT):
        i_t = NT - 1 - i_r
        p_dh, m_dh = _tile(dhs + (nh * NT + i_t) * F * DV, i_k * BK, F, DV, i_v * BV, DV, BK, BV)
        tl.store(p_dh, dh, mask=m_dh)
        if i_v == 0:
            tl.store(dzs + (nh * NT + i_t) * F + o_k, dz, mask=m_k)
        p_b, m_b = _tile(gcb, i_t * BT, Tp, F, i_k * BK, F, BT, BK)
        b = tl.load(p_b, mask=m_b, other=0.)
        b_last = tl.load(gcb + (i_t * BT + BT - 1) * F + o_k, mask=m_k, other=0.)
        p_q, m_q = _tile(qb, i_t * BT, T, H * F, i_k * BK, F, BT, BK)
        p_do, m_do = _tile(dob, i_t * BT, T, H * DV, i_v * BV, DV, BT, BV)
        b_q = tl.load(p_q, mask=m_q, other=0.)
        b_do = tl.load(p_do, mask=m_do, other=0.)
        q_dec = b_q.to(tl.float32) * tl.exp(b)
        dh = dh * tl.exp(b_last)[:, None] + tl.dot(tl.trans(q_dec.to(b_q.dtype)), b_do, input_precision=PREC)
        dz = dz * tl.exp(b_last)
        if NORMALIZE:
            o_tt = i_t * BT + o_t
            b_dd = tl.load(dd + i_h * TT + bos + o_tt, mask=o_tt < T, other=0.)
            dz += tl.sum(q_dec * b_dd[:, None], axis=0)

    if USE_H0:
        p_dh0, m_dh0 = _tile(dh0s + nh * F * DV, i_k * BK, F, DV, i_v * BV, DV, BK, BV)
        tl.store(p_dh0, dh, mask=m_dh0)
        if i_v == 0:
            tl.store(dh0z + nh * F + o_k, dz, mask=m_k)


@triton.jit(do_not_specialize=["T", "TT", "Tp", "NT"])
def _bwd_dq_kernel(
    q, k, v, gc, do, dd, hs, zs, dq, dB, T, TT, Tp, NT,
    H: tl.constexpr, F: tl.constexpr, DV: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NORMALIZE: tl.constexpr, PREC: tl.constexpr,
):
    """One program per (sub-chunk, block of F, sequence * head): dq of the sub-chunk's rows in those
    channels, and q dq (fp32, the first term of dL/dB) to dB."""
    i_ts, i_k, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_t, i_s = i_ts // (BT // BC), i_ts % (BT // BC)  # chunk, sub-chunk
    i_n, i_h = i_nh // H, i_nh % H
    nh = i_nh.to(tl.int64)
    bos = i_n.to(tl.int64) * T
    t0 = i_t * BT
    r0 = t0 + i_s * BC
    o_c = tl.arange(0, BT)
    o_s = tl.arange(0, BC)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < F
    qb = q + (bos * H + i_h) * F
    kb = k + (bos * H + i_h) * F
    vb = v + (bos * H + i_h) * DV
    dob = do + (bos * H + i_h) * DV
    gcb = gc + nh * Tp * F
    hb = hs + (nh * NT + i_t) * F * DV

    dA = tl.zeros([BC, BT], dtype=tl.float32)  # dA[i, j] = do_i . v_j (+ dd_i), rows i of this sub-chunk
    dAd = tl.zeros([BC, BC], dtype=tl.float32)  # dA[i, j], i and j in this sub-chunk
    iq = tl.zeros([BC, BK], dtype=tl.float32)  # do_i S_c^T
    for v0 in range(0, DV, BV):
        p_doi, m_doi = _tile(dob, r0, T, H * DV, v0, DV, BC, BV)
        p_vi, m_vi = _tile(vb, r0, T, H * DV, v0, DV, BC, BV)
        p_vc, m_vc = _tile(vb, t0, T, H * DV, v0, DV, BT, BV)
        b_doi = tl.load(p_doi, mask=m_doi, other=0.)
        b_vi = tl.load(p_vi, mask=m_vi, other=0.)
        b_vc = tl.load(p_vc, mask=m_vc, other=0.)
        p_h, m_h = _tile(hb, i_k * BK, F, DV, v0, DV, BK, BV)
        b_h = tl.load(p_h, mask=m_h, other=0.)
        dA += tl.dot(b_doi, tl.trans(b_vc), input_precision=PREC)
        dAd += tl.dot(b_doi, tl.trans(b_vi), input_precision=PREC)
        iq += tl.dot(b_doi, tl.trans(b_h.to(b_doi.dtype)), input_precision=PREC)
    if NORMALIZE:
        b_ddi = tl.load(dd + i_h * TT + bos + r0 + o_s, mask=r0 + o_s < T, other=0.)
        b_z = tl.load(zs + (nh * NT + i_t) * F + o_k, mask=m_k, other=0.)  # z at the chunk start
        dA += b_ddi[:, None]
        dAd += b_ddi[:, None]
        iq += b_ddi[:, None] * b_z[None, :]
    # (the q, k, b tiles are loaded only now: fewer registers live through the loop above)
    p_b, m_b = _tile(gcb, r0, Tp, F, i_k * BK, F, BC, BK)
    b_b = tl.load(p_b, mask=m_b, other=0.)
    b_dq = iq * tl.exp(b_b)

    # The keys of the earlier sub-chunks: r = b at the row before this sub-chunk.
    p_G, m_G = _tile(gcb, t0, Tp, F, i_k * BK, F, BT, BK)
    b_G = tl.load(p_G, mask=m_G, other=0.)
    p_K, m_K = _tile(kb, t0, T, H * F, i_k * BK, F, BT, BK)
    b_K = tl.load(p_K, mask=m_K, other=0.)
    r = tl.load(gcb + tl.maximum(r0 - 1, t0) * F + o_k, mask=m_k, other=0.)
    k_r = b_K.to(tl.float32) * tl.exp(tl.where((o_c < i_s * BC)[:, None], r[None, :] - b_G, float("-inf")))
    b_dq += tl.exp(b_b - r[None, :]) * tl.dot(dA, k_r, input_precision=PREC)

    # The diagonal block, per channel, one key m of the sub-chunk at a time (no [BC, BC, BK] tile):
    # dq_i += dA[i, m] k_m exp(b_i - b_m) for i >= m, the exponent masked to -inf before the exp.
    for m in range(0, BC):
        t_m = r0 + m
        m_m = m_k & (t_m + 0 * o_k < T)  # (a vector: the interpreter takes no scalar & vector mask)
        k_m = tl.load(kb + t_m.to(tl.int64) * (H * F) + o_k, mask=m_m, other=0.).to(tl.float32)
        b_m = tl.load(gcb + t_m * F + o_k, mask=m_k, other=0.)
        dA_col = tl.sum(tl.where((o_s == m)[None, :], dAd, 0.), axis=1)  # dA[i, m]
        b_dq += (dA_col[:, None] * k_m[None, :]) * tl.exp(tl.where((o_s >= m)[:, None], b_b - b_m[None, :],
                                                                   float("-inf")))

    p_q, m_q = _tile(qb, r0, T, H * F, i_k * BK, F, BC, BK)
    b_q = tl.load(p_q, mask=m_q, other=0.)
    p_dq, _ = _tile(dq + (bos * H + i_h) * F, r0, T, H * F, i_k * BK, F, BC, BK)
    p_dB, _ = _tile(dB + (bos * H + i_h) * F, r0, T, H * F, i_k * BK, F, BC, BK)
    tl.store(p_dq, b_dq.to(p_dq.dtype.element_ty), mask=m_q)
    tl.store(p_dB, b_q.to(tl.float32) * b_dq, mask=m_q)


@triton.jit(do_not_specialize=["T", "TT", "Tp", "NT"])
def _bwd_dk_kernel(
    q, k, v, gc, do, dd, dhs, dzs, dk, dB, T, TT, Tp, NT,
    H: tl.constexpr, F: tl.constexpr, DV: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NORMALIZE: tl.constexpr, PREC: tl.constexpr,
):
    """One program per (sub-chunk, block of F, sequence * head): dk of the sub-chunk's rows in those
    channels, and dL/dB = q dq - k dk (dB holds q dq from _bwd_dq_kernel)."""
    i_ts, i_k, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_t, i_s = i_ts // (BT // BC), i_ts % (BT // BC)  # chunk, sub-chunk
    i_n, i_h = i_nh // H, i_nh % H
    nh = i_nh.to(tl.int64)
    bos = i_n.to(tl.int64) * T
    t0 = i_t * BT
    r0 = t0 + i_s * BC
    o_c = tl.arange(0, BT)
    o_s = tl.arange(0, BC)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < F
    qb = q + (bos * H + i_h) * F
    kb = k + (bos * H + i_h) * F
    vb = v + (bos * H + i_h) * DV
    dob = do + (bos * H + i_h) * DV
    gcb = gc + nh * Tp * F
    dhb = dhs + (nh * NT + i_t) * F * DV

    dAt = tl.zeros([BC, BT], dtype=tl.float32)  # dAt[j, i] = dA[i, j], rows j of this sub-chunk
    dAd = tl.zeros([BC, BC], dtype=tl.float32)  # dA[i, j], i and j in this sub-chunk
    ik = tl.zeros([BC, BK], dtype=tl.float32)  # v_j dS_c^T
    for v0 in range(0, DV, BV):
        p_doi, m_doi = _tile(dob, r0, T, H * DV, v0, DV, BC, BV)
        p_vi, m_vi = _tile(vb, r0, T, H * DV, v0, DV, BC, BV)
        p_doc, m_doc = _tile(dob, t0, T, H * DV, v0, DV, BT, BV)
        b_doi = tl.load(p_doi, mask=m_doi, other=0.)
        b_vi = tl.load(p_vi, mask=m_vi, other=0.)
        b_doc = tl.load(p_doc, mask=m_doc, other=0.)
        p_dh, m_dh = _tile(dhb, i_k * BK, F, DV, v0, DV, BK, BV)
        b_dh = tl.load(p_dh, mask=m_dh, other=0.)
        dAt += tl.dot(b_vi, tl.trans(b_doc), input_precision=PREC)
        dAd += tl.dot(b_doi, tl.trans(b_vi), input_precision=PREC)
        ik += tl.dot(b_vi, tl.trans(b_dh.to(b_vi.dtype)), input_precision=PREC)
    if NORMALIZE:
        b_ddi = tl.load(dd + i_h * TT + bos + r0 + o_s, mask=r0 + o_s < T, other=0.)
        b_ddc = tl.load(dd + i_h * TT + bos + t0 + o_c, mask=t0 + o_c < T, other=0.)
        dAt += b_ddc[None, :]
        dAd += b_ddi[:, None]
    ik += tl.load(dzs + (nh * NT + i_t) * F + o_k, mask=m_k, other=0.)[None, :]  # dz at the chunk end
    # (the q, k, b tiles are loaded only now: fewer registers live through the loop above)
    b_last = tl.load(gcb + (t0 + BT - 1) * F + o_k, mask=m_k, other=0.)
    p_b, m_b = _tile(gcb, r0, Tp, F, i_k * BK, F, BC, BK)
    b_b = tl.load(p_b, mask=m_b, other=0.)
    b_dk = ik * tl.exp(b_last[None, :] - b_b)

    # The queries of the later sub-chunks: r = b at the last row of this sub-chunk.
    p_G, m_G = _tile(gcb, t0, Tp, F, i_k * BK, F, BT, BK)
    b_G = tl.load(p_G, mask=m_G, other=0.)
    p_Q, m_Q = _tile(qb, t0, T, H * F, i_k * BK, F, BT, BK)
    b_Q = tl.load(p_Q, mask=m_Q, other=0.)
    r = tl.load(gcb + (r0 + BC - 1) * F + o_k, mask=m_k, other=0.)
    q_r = b_Q.to(tl.float32) * tl.exp(tl.where((o_c >= (i_s + 1) * BC)[:, None], b_G - r[None, :],
                                               float("-inf")))
    b_dk += tl.exp(r[None, :] - b_b) * tl.dot(dAt, q_r, input_precision=PREC)

    # The diagonal block, per channel, one query m of the sub-chunk at a time (no [BC, BC, BK] tile):
    # dk_j += dA[m, j] q_m exp(b_m - b_j) for j <= m, the exponent masked to -inf before the exp.
    for m in range(0, BC):
        t_m = r0 + m
        m_m = m_k & (t_m + 0 * o_k < T)  # (a vector: the interpreter takes no scalar & vector mask)
        q_m = tl.load(qb + t_m.to(tl.int64) * (H * F) + o_k, mask=m_m, other=0.).to(tl.float32)
        b_m = tl.load(gcb + t_m * F + o_k, mask=m_k, other=0.)
        dA_row = tl.sum(tl.where((o_s == m)[:, None], dAd, 0.), axis=0)  # dA[m, j]
        b_dk += (dA_row[:, None] * q_m[None, :]) * tl.exp(tl.where((o_s <= m)[:, None], b_m[None, :] - b_b,
                                                                   float("-inf")))

    p_k, m_kk = _tile(kb, r0, T, H * F, i_k * BK, F, BC, BK)
    b_k = tl.load(p_k, mask=m_kk, other=0.)
    p_dk, _ = _tile(dk + (bos * H + i_h) * F, r0, T, H * F, i_k * BK, F, BC, BK)
    p_dB, _ = _tile(dB + (bos * H + i_h) * F, r0, T, H * F, i_k * BK, F, BC, BK)
    tl.store(p_dk, b_dk.to(p_dk.dtype.element_ty), mask=m_kk)
    tl.store(p_dB, tl.load(p_dB, mask=m_kk, other=0.) - b_k.to(tl.float32) * b_dk, mask=m_kk)


@triton.jit(do_not_specialize=["T", "Tp", "NT"])
def _bwd_dv_kernel(
    q, k, gc, do, dhs, dv, T, Tp, NT,
    H: tl.constexpr, F: tl.constexpr, DV: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    """One program per (sub-chunk, block of Dv, sequence * head): dv of the sub-chunk's rows."""
    i_ts, i_v, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_t, i_s = i_ts // (BT // BC), i_ts % (BT // BC)  # chunk, sub-chunk
    i_n, i_h = i_nh // H, i_nh % H
    nh = i_nh.to(tl.int64)
    bos = i_n.to(tl.int64) * T
    t0 = i_t * BT
    qb = q + (bos * H + i_h) * F
    kb = k + (bos * H + i_h) * F
    dob = do + (bos * H + i_h) * DV
    dvb = dv + (bos * H + i_h) * DV
    gcb = gc + nh * Tp * F
    dhb = dhs + (nh * NT + i_t) * F * DV

    r0 = t0 + i_s * BC
    At, At_d = _scores(kb, qb, gcb, t0, i_s, T, Tp, H * F, F, BT, BC, BK, True, PREC)  # [BC(j), BT(i)]
    p_do, m_do = _tile(dob, t0, T, H * DV, i_v * BV, DV, BT, BV)
    b_do = tl.load(p_do, mask=m_do, other=0.)
    p_doi, m_doi = _tile(dob, r0, T, H * DV, i_v * BV, DV, BC, BV)
    b_dv = tl.dot(At.to(b_do.dtype), b_do, input_precision=PREC)
    b_dv += tl.dot(At_d.to(b_do.dtype), tl.load(p_doi, mask=m_doi, other=0.), input_precision=PREC)
    for f0 in range(0, F, BK):  # the key's part of the chunk-end state: (k_j exp(b_last - b_j)) dS_c
        o_k = f0 + tl.arange(0, BK)
        b_last = tl.load(gcb + (t0 + BT - 1) * F + o_k, mask=o_k < F, other=0.)
        p_k, m_k = _tile(kb, r0, T, H * F, f0, F, BC, BK)
        p_b, m_b = _tile(gcb, r0, Tp, F, f0, F, BC, BK)
        b_k = tl.load(p_k, mask=m_k, other=0.)
        k_dec = b_k.to(tl.float32) * tl.exp(b_last[None, :] - tl.load(p_b, mask=m_b, other=0.))
        p_dh, m_dh = _tile(dhb, f0, F, DV, i_v * BV, DV, BK, BV)
        b_dh = tl.load(p_dh, mask=m_dh, other=0.)
        b_dv += tl.dot(k_dec.to(b_k.dtype), b_dh.to(b_k.dtype), input_precision=PREC)
    p_dv, m_dv = _tile(dvb, r0, T, H * DV, i_v * BV, DV, BC, BV)
    tl.store(p_dv, b_dv.to(p_dv.dtype.element_ty), mask=m_dv)


@triton.jit
def _seg_sum(va, fa, vb, fb):
    """Combine of the gate scan (run from the last step back): (va, fa) the sum over the later steps
    and whether they hold a reset, (vb, fb) the earlier ones; a reset in the earlier part hides the
    later sum."""
    return tl.where(fb != 0, vb, va + vb), fa | fb


@triton.jit(do_not_specialize=["T", "NS"])
def _dlg_tile_kernel(
    lg, dlg, tot, T, NS,
    H: tl.constexpr, F: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr,
):
    """One program per (tile of BS steps, block of F, sequence * head): the tile's part of the
    reverse sum at its first step (dL/dB summed over the steps before its first reset, fp32) and
    whether it holds a reset, to tot[nh, tile] and tot[nh, NS + tile]."""
    i_t, i_k, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    nh = i_nh.to(tl.int64)
    bos = i_n.to(tl.int64) * T
    o_t = tl.arange(0, BS)
    o_k = i_k * BK + tl.arange(0, BK)
    p_d, m_d = _tile(dlg + (bos * H + i_h) * F, i_t * BS, T, H * F, i_k * BK, F, BS, BK)
    p_g, _ = _tile(lg + (bos * H + i_h) * F, i_t * BS, T, H * F, i_k * BK, F, BS, BK)
    cut = tl.load(p_g, mask=m_d, other=0.) < _RESET
    first = tl.min(tl.where(cut, o_t[:, None], BS), axis=0)  # the tile's first reset (BS: none)
    part = tl.sum(tl.where(o_t[:, None] < first[None, :], tl.load(p_d, mask=m_d, other=0.), 0.), axis=0)
    tb = tot + nh * 2 * NS * F
    tl.store(tb + i_t * F + o_k, part, mask=o_k < F)
    tl.store(tb + (NS + i_t) * F + o_k, (first < BS).to(tl.float32), mask=o_k < F)


@triton.jit(do_not_specialize=["NS"])
def _dlg_carry_kernel(
    tot, hts, htz, dhts, dhtz, NS,
    F: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_DHT: tl.constexpr,
):
    """One program per (block of F, sequence * head), backward over the tiles: replaces each tile's
    part (tot[nh, tile]) by the reverse sum carried into the tile from the later ones (started from
    the final state's term, cut at the tiles that hold a reset)."""
    i_k, i_nh = tl.program_id(0), tl.program_id(1)
    nh = i_nh.to(tl.int64)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < F
    carry = tl.zeros([BK], dtype=tl.float32)
    if USE_DHT:  # dL/dB at the last step gets sum_v dS_T S_T + dz_T z_T
        for v0 in range(0, DV, BV):
            p_ht, m_ht = _tile(hts + nh * F * DV, i_k * BK, F, DV, v0, DV, BK, BV)
            p_dht, _ = _tile(dhts + nh * F * DV, i_k * BK, F, DV, v0, DV, BK, BV)
            carry += tl.sum(tl.load(p_ht, mask=m_ht, other=0.) * tl.load(p_dht, mask=m_ht, other=0.), axis=1)
        carry += tl.load(htz + nh * F + o_k, mask=m_k, other=0.) * tl.load(dhtz + nh * F + o_k, mask=m_k, other=0.)
    tb = tot + nh * 2 * NS * F
    for i_r in range(0, NS):
        i_t = NS - 1 - i_r
        part = tl.load(tb + i_t * F + o_k, mask=m_k, other=0.)
        has = tl.load(tb + (NS + i_t) * F + o_k, mask=m_k, other=0.)
        tl.store(tb + i_t * F + o_k, carry, mask=m_k)
        carry = part + tl.where(has != 0, 0., carry)


@triton.jit(do_not_specialize=["T", "NS"])
def _dlg_scan_kernel(
    lg, dlg, tot, T, NS,
    H: tl.constexpr, F: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr, USE_H0: tl.constexpr,
):
    """One program per (tile of BS steps, block of F, sequence * head): dlg holds dL/dB on entry and
    dlog_g on exit, the tile's reverse sum cut at its resets (a segmented scan) plus the carry from
    the later tiles (tot, from _dlg_carry_kernel) at the steps before the tile's first reset."""
    i_t, i_k, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    nh = i_nh.to(tl.int64)
    bos = i_n.to(tl.int64) * T
    o_t = tl.arange(0, BS)
    o_k = i_k * BK + tl.arange(0, BK)
    p_d, m_d = _tile(dlg + (bos * H + i_h) * F, i_t * BS, T, H * F, i_k * BK, F, BS, BK)
    p_g, _ = _tile(lg + (bos * H + i_h) * F, i_t * BS, T, H * F, i_k * BK, F, BS, BK)
    cut = (tl.load(p_g, mask=m_d, other=0.) < _RESET).to(tl.int32)
    dB = tl.where(cut != 0, 0., tl.load(p_d, mask=m_d, other=0.))  # the reset step's own term: out
    # s >= t and no reset in [t, s]: a reset hides what follows it, and gets 0 itself.
    b_dlg, blocked = tl.associative_scan((dB, cut), 0, _seg_sum, reverse=True)
    carry = tl.load(tot + nh * 2 * NS * F + i_t * F + o_k, mask=o_k < F, other=0.)
    b_dlg += tl.where(blocked == 0, carry[None, :], 0.)  # no reset in [t, tile end]
    if not USE_H0:  # the first gate multiplies a zero state
        b_dlg = tl.where((i_t * BS + o_t == 0)[:, None], 0., b_dlg)
    tl.store(p_d, b_dlg, mask=m_d)


# ----------------------------------------------------------------------------- launchers

def _geometry(q, v):
    B, T, H, F = q.shape
    DV = v.shape[-1]
    if not (16 <= F <= 256 and 16 <= DV <= 256):
        raise ValueError(f"feature and value dims must be in [16, 256], got F={F}, Dv={DV}")
    return B, T, H, F, DV


def _chunking(T: int):
    BT, BC = CONFIG["BT"], CONFIG["BC"]
    if BC < 16 or BT % BC:
        raise ValueError(f"CONFIG: BT={BT} must be a multiple of BC={BC} >= 16")
    NT = triton.cdiv(T, BT)
    return BT, BC, NT, NT * BT


def _states(k, v, log_g, S0, z0, store_ht, store_chunks=True):
    """The state pass: (gc, hs, zs, S_T, z_T), the cumulative gate [B*H, Tp, F] and the chunk-start
    states [B*H, NT, F, Dv], [B*H, NT, F] (fp32); without ``store_chunks`` only the final state
    (the first three are then placeholders, never written)."""
    B, T, H, F, DV = _geometry(k, v)
    cfg = CONFIG
    BT, _, NT, Tp = _chunking(T)
    f32 = dict(device=k.device, dtype=torch.float32)
    if store_chunks:
        gc = torch.empty(B * H, Tp, F, **f32)
        hs = torch.empty(B * H, NT, F, DV, **f32)
        zs = torch.empty(B * H, NT, F, **f32)
    else:
        gc = hs = zs = torch.empty(1, **f32)
    Sn = torch.empty(B, H, F, DV, **f32) if store_ht else None
    zn = torch.empty(B, H, F, **f32) if store_ht else None
    SK, SV = min(cfg["state_BK"], _next_pow2(F)), min(cfg["state_BV"], _next_pow2(DV))
    launch(_state_fwd_kernel, (triton.cdiv(F, SK), triton.cdiv(DV, SV), B * H),
           k, v, log_g, S0, z0, gc, hs, zs, Sn, zn, T, Tp, NT,
           H=H, F=F, DV=DV, BT=BT, BK=SK, BV=SV, USE_H0=S0 is not None, STORE_HT=store_ht, PREC=_prec(k),
           STORE_CHUNKS=store_chunks, num_warps=cfg["state_warps"], num_stages=cfg["stages"])
    return gc, hs, zs, Sn, zn


def channel_fwd(q, k, v, log_g, S0, z0, normalize, eps, store_den):
    """q, k, log_g (fp32) [B, T, H, F], v [B, T, H, Dv], contiguous; S0/z0 fp32 or None.
    Returns o, den ([H, B*T] fp32, or None), S_T, z_T."""
    B, T, H, F, DV = _geometry(q, v)
    cfg = CONFIG
    BT, BC, NT, Tp = _chunking(T)
    gc, hs, zs, Sn, zn = _states(k, v, log_g, S0, z0, True)
    o = torch.empty_like(v)
    den = torch.empty(H, B * T, device=q.device, dtype=torch.float32) if store_den else None
    BK, BV = min(cfg["score_BK"], _next_pow2(F)), min(cfg["fwd_BV"], _next_pow2(DV))
    if NT:
        launch(_fwd_out_kernel, (NT * (BT // BC), triton.cdiv(DV, BV), B * H),
               q, k, v, gc, hs, zs, o, den, T, B * T, Tp, NT, eps,
               H=H, F=F, DV=DV, BT=BT, BC=BC, BK=BK, BV=BV, NORMALIZE=normalize, STORE_DEN=den is not None,
               PREC=_prec(q), num_warps=cfg["warps"], num_stages=cfg["stages"])
    return o, den, Sn, zn


# ----------------------------------------------------------------------------- split-time forward
#
# Without gradients, a prompt of few sequences x heads (a 64K-token prefill at batch 1: 72 state
# programs on SmolLM2's 9 heads) leaves most of the GPU idle while the state pass walks its chunks
# one after another. The forward then cuts each sequence into n segments of whole chunks, as
# chunk.py's split_time_fwd does for the scalar gate:
# 1. each segment's final state from zero (the state pass alone, nothing per chunk stored);
# 2. the state entering segment j, per channel f: sum_{i<j} exp(C_j - C_{i+1}) S_i + exp(C_j) S_0,
#    C_j the log gates summed over segments 0..j-1 (every exponent <= 0: resets give exact zeros);
# 3. the whole forward on every segment from its entering state, all segments in parallel.
# Segments are rows of the same [B, T, H, F] memory (a view when n divides T into whole chunks;
# else zero tokens with log g = 0 pad the end, which change no state).
# Measured on an H200 (2026-11-30b) it did not pay at SmolLM2's shape: the output kernel, not the
# state walk, bounds a 64K prompt. So it runs only when asked (num_splits, or CONFIG["splits"]).


def split_fwd(q, k, v, log_g, S0, z0, normalize, eps, num_splits):
    """``channel_fwd`` without gradients over ``num_splits`` segments per sequence (above); returns
    o, S_T, z_T."""
    B, T, H, F, DV = _geometry(q, v)
    BT = CONFIG["BT"]
    L = triton.cdiv(triton.cdiv(T, num_splits), BT) * BT  # segment length, whole chunks
    n = triton.cdiv(T, L)
    if n * L != T:
        pad = lambda x: Fn.pad(x, (0, 0, 0, 0, 0, n * L - T))  # noqa: E731
        q, k, v, log_g = pad(q), pad(k), pad(v), pad(log_g)
    seg = lambda x: x.view(B * n, L, H, x.shape[-1])  # noqa: E731
    # 1. each segment's own final state
    _, _, _, Sl, zl = _states(seg(k), seg(v), seg(log_g), None, None, True, store_chunks=False)
    # 2. the state entering each segment (and after the last)
    # in float64: after a reset (-128) C is large, and the difference of two fp32 sums would lose the
    # small log decays between them
    # (autocast off: under a bf16 autocast, as in training or `accelerate`'s evaluation, the einsums would
    # give bf16 states, which the kernels refuse as an initial state)
    with torch.autocast(q.device.type, enabled=False):
        G = log_g.view(B, n, L, H, F).sum(2, dtype=torch.float64)  # [B, n, H, F]
        C = torch.cat([G.new_zeros(B, 1, H, F), G.cumsum(1)], 1)  # [B, n+1, H, F]: at the segments' starts
        before = torch.ones(n + 1, n, device=q.device, dtype=torch.bool).tril(-1)  # [j, i]: i ends before j starts
        w = torch.exp((C[:, :, None] - C[:, None, 1:]).masked_fill(~before[None, :, :, None, None],
                                                                   float("-inf"))).float()
        init_S = torch.einsum("bjihf,bihfd->bjhfd", w, Sl.view(B, n, H, F, DV))
        init_z = torch.einsum("bjihf,bihf->bjhf", w, zl.view(B, n, H, F))
        if S0 is not None:
            w0 = torch.exp(C).float()  # [B, n+1, H, F]: the initial state's decay to each segment's start
            init_S = init_S + w0[..., None] * S0[:, None]
            init_z = init_z + w0 * z0[:, None]
    # 3. every segment from its entering state
    o, _, _, _ = channel_fwd(seg(q), seg(k), seg(v), seg(log_g), init_S[:, :n].reshape(B * n, H, F, DV).contiguous(),
                             init_z[:, :n].reshape(B * n, H, F).contiguous(), normalize, eps, False)
    return o.view(B, n * L, H, DV)[:, :T], init_S[:, n].contiguous(), init_z[:, n].contiguous()


def channel_bwd(q, k, v, log_g, S0, z0, o, den, do, dSn, dzn, Sn, zn, normalize, eps):
    """Gradients dq, dk, dv, dlog_g (fp32), dS0, dz0 (None without S0)."""
    B, T, H, F, DV = _geometry(q, v)
    cfg = CONFIG
    BT, BC, NT, Tp = _chunking(T)
    TT = B * T
    prec = _prec(q)
    opts = dict(num_warps=cfg["warps"], num_stages=cfg["stages"])
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
        launch(_bwd_prep_kernel, (triton.cdiv(TT * H, BR),), o, do, den, dd, do_s, TT, H=H, DV=DV, BR=BR, BV=BVf,
               num_warps=4, num_stages=1)

    gc, hs, zs, _, _ = _states(k, v, log_g, S0, z0, False)
    dhs = torch.empty(B * H, NT, F, DV, **f32)
    dzs = torch.empty(B * H, NT, F, **f32)
    dS0 = torch.empty(B, H, F, DV, **f32) if S0 is not None else None
    dz0 = torch.empty(B, H, F, **f32) if S0 is not None else None
    SK, SV = min(cfg["state_BK"], _next_pow2(F)), min(cfg["state_BV"], _next_pow2(DV))
    launch(_state_bwd_kernel, (triton.cdiv(F, SK), triton.cdiv(DV, SV), B * H),
           q, do_s, dd, gc, dSn, dzn, dhs, dzs, dS0, dz0, T, TT, Tp, NT,
           H=H, F=F, DV=DV, BT=BT, BK=SK, BV=SV, NORMALIZE=normalize, USE_DHT=use_dht, USE_H0=S0 is not None,
           PREC=prec, num_warps=cfg["state_warps"], num_stages=cfg["stages"])

    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dlog_g = torch.empty(B, T, H, F, **f32)  # dL/dB from the dq and dk kernels, then dlog_g in place
    BK, BV = min(cfg["BK"], _next_pow2(F)), min(cfg["bwd_BV"], _next_pow2(DV))
    if NT:
        # dq, then dk (dlog_g holds q dq in between; dL/dB = q dq - k dk after)
        launch(_bwd_dq_kernel, (NT * (BT // BC), triton.cdiv(F, BK), B * H),
               q, k, v, gc, do_s, dd, hs, zs, dq, dlog_g, T, TT, Tp, NT,
               H=H, F=F, DV=DV, BT=BT, BC=BC, BK=BK, BV=BV, NORMALIZE=normalize, PREC=prec, **opts)
        launch(_bwd_dk_kernel, (NT * (BT // BC), triton.cdiv(F, BK), B * H),
               q, k, v, gc, do_s, dd, dhs, dzs, dk, dlog_g, T, TT, Tp, NT,
               H=H, F=F, DV=DV, BT=BT, BC=BC, BK=BK, BV=BV, NORMALIZE=normalize, PREC=prec, **opts)
        BVd = min(cfg["dv_BV"], _next_pow2(DV))
        launch(_bwd_dv_kernel, (NT * (BT // BC), triton.cdiv(DV, BVd), B * H),
               q, k, gc, do_s, dhs, dv, T, Tp, NT,
               H=H, F=F, DV=DV, BT=BT, BC=BC, BK=min(cfg["score_BK"], _next_pow2(F)), BV=BVd, PREC=prec, **opts)
    # dlog_g: a reverse sum over the sequence, per tile of BS steps (in parallel), then the carries
    # between the tiles (a walk over the tiles' sums), then each tile's segmented scan plus its carry.
    BS, SBK = cfg["scan_BS"], min(cfg["scan_BK"], _next_pow2(F))
    NS = triton.cdiv(T, BS)
    if NS:
        tot = torch.empty(B * H, 2, NS, F, **f32)  # per tile: its sum (then its carry), has-a-reset
        sopts = dict(num_warps=cfg["scan_warps"], num_stages=1)
        launch(_dlg_tile_kernel, (NS, triton.cdiv(F, SBK), B * H), log_g, dlog_g, tot, T, NS,
               H=H, F=F, BS=BS, BK=SBK, **sopts)
        launch(_dlg_carry_kernel, (triton.cdiv(F, SBK), B * H), tot, Sn, zn, dSn, dzn, NS,
               F=F, DV=DV, BK=SBK, BV=min(64, _next_pow2(DV)), USE_DHT=use_dht, **sopts)
        launch(_dlg_scan_kernel, (NS, triton.cdiv(F, SBK), B * H), log_g, dlog_g, tot, T, NS,
               H=H, F=F, BS=BS, BK=SBK, USE_H0=S0 is not None, **sopts)
    return dq, dk, dv, dlog_g, dS0, dz0


# ----------------------------------------------------------------------------- ops and autograd

def _chunk_linear_attn_channel_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_g: torch.Tensor, S0: torch.Tensor | None,
    z0: torch.Tensor | None, normalize: bool, eps: float, store_den: bool, num_splits: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward as a torch op: q, k [B, T, H, F], v [B, T, H, Dv] (contiguous), log_g fp32
    [B, T, H, F], S0/z0 fp32 or None. Returns o, the fp32 denominators [H, B*T] (empty unless
    ``store_den`` and ``normalize``: the normalized backward needs them) and the final state (S, z)
    fp32. ``num_splits`` > 1 (without ``store_den``: no backward) runs the split-time forward."""
    if num_splits > 1 and not store_den:
        o, Sn, zn = split_fwd(q, k, v, log_g.float().contiguous(), S0, z0, normalize, eps, num_splits)
        return o, _empty(q), Sn, zn
    o, den, Sn, zn = channel_fwd(q, k, v, log_g.float().contiguous(), S0, z0, normalize, eps,
                                 store_den and normalize)
    return o, (_empty(q) if den is None else den), Sn, zn


chunk_linear_attn_channel_fwd_op = torch.library.custom_op(
    "linearize::chunk_linear_attn_channel_fwd", mutates_args=())(_chunk_linear_attn_channel_fwd)


@chunk_linear_attn_channel_fwd_op.register_fake
def _(q, k, v, log_g, S0, z0, normalize, eps, store_den, num_splits=1):
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
    q, k, v, log_g, S0, z0, normalize, eps, store_den, num_splits = inputs
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
    return (dq, dk, dv, dlog_g, None if S0 is None else dS0, None if z0 is None else dz0, None, None, None, None)


chunk_linear_attn_channel_fwd_op.register_autograd(_backward, setup_context=_setup)


def chunk_linear_attn_channel(q, k, v, log_g, *, normalize=True, eps=1e-6, initial_state=None,
                              output_final_state=False, num_splits=None):
    """Chunkwise (normalized) feature-map linear attention with a per-channel decay.

    Args:
        q, k: [B, T, H, F] feature-mapped queries and keys (non-negative when normalize=True).
        v: [B, T, H, Dv] values. F and Dv in [16, 256]; fp32, bf16 or fp16.
        log_g: [B, T, H, F] log decay of each key channel (<= 0; -128 resets the state), fp32.
        initial_state: optional (S [B, H, F, Dv], z [B, H, F]), fp32.
        num_splits: without gradients, cut each sequence into this many segments run in parallel
            (the split-time forward above); None takes ``CONFIG["splits"]`` (1: no split).

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
                                             initial_state=init, output_final_state=output_final_state,
                                             num_splits=num_splits)
        return o, (None if state is None else (state[0][..., :F, :], state[1][..., :F]))
    S0 = z0 = None
    if initial_state is not None:
        S0, z0 = (x.float().contiguous() for x in initial_state)
    q, k, v = (x.contiguous() for x in (q, k, v))
    log_g = log_g.float().contiguous()
    grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, log_g, S0, z0))
    n = 1
    if not grad:  # inference: the time axis may be cut into segments
        n = CONFIG["splits"] if num_splits is None else num_splits
    fwd = (_chunk_linear_attn_channel_fwd if call_directly(grad)
           else torch.ops.linearize.chunk_linear_attn_channel_fwd)
    o, _, Sn, zn = fwd(q, k, v, log_g, S0, z0, normalize, float(eps), grad and normalize, int(n))
    return o, ((Sn, zn) if output_final_state else None)
