"""Sliding-window softmax of the LoLCATs hybrid, combined with its linear terms: Triton kernels.

Per packed token t of a sequence and head h (see reference.py for the whole layer)::

    a_ts = sm_scale * q_sm_t . k_sm_s          for t-W < s <= t, s in t's sequence
    m_t  = max_s a_ts,   p_ts = exp(a_ts - m_t)
    o_t  = (sum_s p_ts v_s + gamma_h n_t) / (sum_s p_ts + gamma_h d_t)

where ``n_t, d_t`` are the linear-attention numerator and denominator over the keys older than
the window (computed by the chunk kernels, see ``chunk._window_attn``).  They are read through
``lin_idx``: row ``lin_idx[t]`` of ``n_lin, d_lin`` holds token t's terms, -1 means none (the
first W tokens of a sequence), so the caller's linear outputs are used in place, unshifted.

Packed documents (optional ``q_lo``, int32 [TT]): several documents share a sequence with static
shapes; ``q_lo[t]`` is the position, within t's sequence (0 at its ``cu_seqlens`` start), of the
first key of t's document (q_lo[t] <= t), and every key s < q_lo[t] is masked out of t's window,
in the forward and in both backward kernels (constexpr ``HAS_LO``: without it the code is the
one-document one).  The linear terms are the caller's: it points lin_idx at -1 for a query whose
t-W lies before q_lo[t] and resets its state at document starts (``chunk._window_attn``).

Attention sinks (``sinks`` S, constexpr ``SINKS``): the first S keys of t's document (positions
q_lo[t] + j, or j without q_lo) join t's softmax where they lie outside its window (position <=
t-W): in the max, both sums and ``arg``.  The forward and the query kernel take them before the
window's blocks: with W >= BT as one more key block (``SINK_TILE``: the queries of a block that count
sinks share one document, so its S sinks are one [BSK, D] tile, scored with a dot), else gathered
per row; the key kernel leaves them alone (it sees keys in windows only), so
their dk and dv, sums over every query of the document, are reduced per document by ``_sink_grads``
from per-(sink, head, token) terms the query kernel writes.

Forward: one program per (block of BT queries, sequence, head) walks the key blocks that meet
``[t0-W+1, t0+BT)`` (two when W <= BS) with a flash-attention online softmax, adds the linear
terms and writes o; it keeps per token the fp32 denominator ``den``, the max ``m`` and the key
that attains it (``arg``) for the backward.

Backward: ``m_t`` is not a constant here (the linear terms are not rescaled by exp(-m_t)), so
the gradient flows through the max.  With ``g_t = do_t / den_t`` and ``c_t = -(do_t . o_t) / den_t``::

    dn_t = gamma g_t,   dd_t = gamma c_t,   dgamma_h = sum_t X_t,   X_t = g_t . n_t + c_t d_t
    da_ts = p_ts (g_t . v_s + c_t) + [s == arg_t] gamma X_t

(the max term is -[s == arg_t] sum_s p_ts (g_t . v_s + c_t), which equals the above since
``sum_s p_ts v_s = o_t den_t - gamma n_t``; taken from the linear terms it is free of that sum's
cancellation, and exactly zero without linear terms, as it should be).  X_t is formed as
``(l_t do_t.n_t - d_t do_t.S_t) / den_t^2`` with ``l_t = sum_s p_ts`` and ``do_t.S_t = sum_s p_ts
do_t.v_s`` summed in fp32 over the window, not from o: o is stored rounded, and ``do.n - (do.o) d``
cancels (bf16, W = 1, gamma d >> l: 20x per token), so dgamma came out 30% off.  Two kernels:
one per query block (dq_sm, and the per-token c, X, dn, dd; c, X and dd after its loop, the max
term then added with key arg_t's row), one per key block (dk_sm, dv), each recomputing p from the
stored m.  On a tie in the max the whole max gradient goes to the
stored key (the earliest one attaining it); torch's ``amax`` would split it between them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launch import launch

from .tiles import _next_pow2, _prec, _seq_bounds, _tile

# Query and key block lengths and launch settings (not tuned on a GPU yet); module-level so a
# tuning script can override them.
CONFIG = {"BT": 64, "BS": 64, "fwd_warps": 4, "bwd_warps": 4, "stages": 2}


@triton.jit
def _in_window(t, s, W):
    """Key s is in query t's window, t-W < s <= t (block starts are >= 0).  Keys past the
    sequence end only meet query rows past it, which are never stored (and carry do = 0)."""
    return (s <= t) & (s > t - W)


@triton.jit
def _load_lin(n_lin, d_lin, lin_idx, bos, o_t, Tn, i_h, H: tl.constexpr, DV: tl.constexpr,
              BDV: tl.constexpr):
    """The linear terms n [BT, BDV] and d [BT] of queries o_t (zero where they have none)."""
    r = tl.load(lin_idx + bos + o_t, mask=o_t < Tn, other=-1).to(tl.int64)
    o_v = tl.arange(0, BDV)
    has = r >= 0
    b_n = tl.load(n_lin + (r * H + i_h)[:, None] * DV + o_v[None, :],
                  mask=has[:, None] & (o_v[None, :] < DV), other=0.).to(tl.float32)
    b_d = tl.load(d_lin + r * H + i_h, mask=has, other=0.).to(tl.float32)
    return r, has, b_n, b_d


@triton.jit
def _load_sink(k, v, kvalid, bos, o_t, b_lo, j, Tn, W, i_h, H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
               BD: tl.constexpr, BDV: tl.constexpr, HAS_KV: tl.constexpr):
    """Sink j of queries o_t: its key position sp = b_lo + j in the sequence, whether it counts
    (outside the window, sp <= t - W, and a valid key), and its key [BT, BD] and value [BT, BDV] (fp32)."""
    sp = b_lo + j
    ok = (sp <= o_t - W) & (o_t < Tn)
    if HAS_KV:
        ok = ok & (tl.load(kvalid + bos + sp, mask=ok, other=0.) > 0)
    row = (bos + sp).to(tl.int64) * H + i_h
    o_d, o_v = tl.arange(0, BD), tl.arange(0, BDV)
    b_ks = tl.load(k + row[:, None] * D + o_d[None, :], mask=ok[:, None] & (o_d[None, :] < D), other=0.)
    b_vs = tl.load(v + row[:, None] * DV + o_v[None, :], mask=ok[:, None] & (o_v[None, :] < DV), other=0.)
    return sp, ok, b_ks.to(tl.float32), b_vs.to(tl.float32)


@triton.jit
def _buffered_sink(snk, snv, snat, s_pos, i_n, o_t, j, Tn, W, i_h, H: tl.constexpr, D: tl.constexpr,
                   DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, SINKS: tl.constexpr):
    """Sink j of a cache's buffer for queries o_t of sequence i_n (forward only): its position
    ``sp`` (-1: an empty slot), whether it counts (filled, and at most the query's absolute position
    s_pos + t minus W), its key [BT, BD] and value [BT, BDV] broadcast over the queries (fp32)."""
    at = tl.load(snat + i_n * SINKS + j) + 0. * o_t  # [BT]
    ok = (at >= 0) & (at <= (tl.load(s_pos) + o_t - W).to(tl.float32)) & (o_t < Tn)
    row = (i_n.to(tl.int64) * SINKS + j) * H + i_h
    o_d, o_v = tl.arange(0, BD), tl.arange(0, BDV)
    b_k = tl.load(snk + row * D + o_d, mask=o_d < D, other=0.).to(tl.float32)
    b_v = tl.load(snv + row * DV + o_v, mask=o_v < DV, other=0.).to(tl.float32)
    ones = tl.where(ok, 1., 1.)[:, None]  # [BT, 1]
    return at.to(tl.int32), ok, ones * b_k[None, :], ones * b_v[None, :]


@triton.jit
def _sink_tile(k, v, bos, o_t, b_lo, Tn, W, i_h, H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
               BD: tl.constexpr, BDV: tl.constexpr, BSK: tl.constexpr, SINKS: tl.constexpr):
    """With W >= BT: the sinks of a block of queries o_t as one key tile.  A query counts sinks only
    once it is W past its document's start, and a document starting inside the block is less than
    BT <= W old at the block's end, so the queries that count any share one document, starting at d0.
    Returns d0, the positions o_s [BSK], which (query, sink) pairs count [BT, BSK] (sink j < S, outside
    the query's window, the query in that document), and the keys [BSK, BD] and values [BSK, BDV]."""
    d0 = tl.max(tl.where((o_t - b_lo >= W) & (o_t < Tn), b_lo, 0), axis=0)
    o_s = d0 + tl.arange(0, BSK)
    ok = ((o_s[None, :] - d0 < SINKS) & (o_s[None, :] <= o_t[:, None] - W) & (b_lo[:, None] == d0)
          & (o_t[:, None] < Tn))
    p_k, m_k = _tile(k + (bos * H + i_h) * D, d0, Tn, H * D, 0, D, BSK, BD)
    p_v, m_v = _tile(v + (bos * H + i_h) * DV, d0, Tn, H * DV, 0, DV, BSK, BDV)
    return d0, o_s, ok, tl.load(p_k, mask=m_k, other=0.), tl.load(p_v, mask=m_v, other=0.)


@triton.jit
def _fwd_kernel(
    q, k, v, n_lin, d_lin, lin_idx, gamma, o, den, mx, arg, cu, TT, W, sm_scale, kvalid,
    q_lo, snk, snv, snat, s_pos, H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr,
    BS: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, HAS_LIN: tl.constexpr, PREC: tl.constexpr,
    HAS_KV: tl.constexpr, HAS_LO: tl.constexpr, SINKS: tl.constexpr, SINK_BUF: tl.constexpr,
    SINK_TILE: tl.constexpr, BSK: tl.constexpr,
):
    # HAS_KV (inference only, no backward): kvalid [TT] masks keys out (a cached window's empty or
    # padding slots); a query with no valid key and no linear terms gets 0
    i_t, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, Tn = _seq_bounds(cu, i_n, 0, True)
    t0 = i_t * BT
    if t0 >= Tn:
        return
    o_t = t0 + tl.arange(0, BT)
    p_q, m_q = _tile(q + (bos * H + i_h) * D, t0, Tn, H * D, 0, D, BT, BD)
    b_q = tl.load(p_q, mask=m_q, other=0.)

    m_i = tl.full([BT], float("-inf"), tl.float32)
    l_i = tl.zeros([BT], dtype=tl.float32)
    arg_i = tl.zeros([BT], dtype=tl.int32)
    acc = tl.zeros([BT, BDV], dtype=tl.float32)
    lo = tl.maximum(t0 - W + 1, 0)
    hi = tl.minimum(t0 + BT, Tn)
    if HAS_LO:  # packed documents: no key before the query's document start
        b_lo = tl.load(q_lo + bos + o_t, mask=o_t < Tn, other=0)
        lo = tl.maximum(lo, tl.min(b_lo, axis=0))  # skip key blocks no query of the block sees
    else:
        b_lo = tl.zeros([BT], dtype=tl.int32)
    # the sinks first: they are the oldest keys, so a tie in the max keeps them (the earliest key)
    if SINK_TILE:
        # (names of their own: a name the window's loop below assigns must keep its shape there)
        d0, _, s_ok, s_k, s_v = _sink_tile(k, v, bos, o_t, b_lo, Tn, W, i_h, H, D, DV, BD, BDV, BSK, SINKS)
        s_a = tl.where(s_ok, tl.dot(b_q, tl.trans(s_k), input_precision=PREC) * sm_scale, float("-inf"))
        m_i = tl.max(s_a, axis=1)  # the first keys: m_i was -inf
        arg_i = tl.where(m_i > float("-inf"), d0 + tl.argmax(s_a, axis=1).to(tl.int32), arg_i)
        s_p = tl.exp(s_a - tl.where(m_i == float("-inf"), 0., m_i)[:, None])
        l_i = tl.sum(s_p, axis=1)
        acc = tl.dot(s_p.to(s_v.dtype), s_v, input_precision=PREC)
    else:
        for j in tl.static_range(SINKS):
            if SINK_BUF:  # a cache's sinks (inference): key j of sequence i_n counts where sink_at <= p - W
                sp, ok, b_ks, b_vs = _buffered_sink(snk, snv, snat, s_pos, i_n, o_t, j, Tn, W, i_h, H, D, DV, BD, BDV,
                                                    SINKS)
            else:
                sp, ok, b_ks, b_vs = _load_sink(k, v, kvalid, bos, o_t, b_lo, j, Tn, W, i_h, H, D, DV, BD, BDV, HAS_KV)
            a_s = tl.where(ok, tl.sum(b_q.to(tl.float32) * b_ks, axis=1) * sm_scale, float("-inf"))
            arg_i = tl.where(a_s > m_i, sp, arg_i)
            m_new = tl.maximum(m_i, a_s)
            m_ref = tl.where(m_new == float("-inf"), 0., m_new)
            alpha = tl.exp(m_i - m_ref)
            p_s = tl.exp(a_s - m_ref)
            l_i = l_i * alpha + p_s
            acc = acc * alpha[:, None] + p_s[:, None] * b_vs
            m_i = m_new
    for j in range(0, tl.cdiv(hi - lo, BS)):
        s0 = lo + j * BS
        o_s = s0 + tl.arange(0, BS)
        p_k, m_k = _tile(k + (bos * H + i_h) * D, s0, Tn, H * D, 0, D, BS, BD)
        p_v, m_v = _tile(v + (bos * H + i_h) * DV, s0, Tn, H * DV, 0, DV, BS, BDV)
        b_k = tl.load(p_k, mask=m_k, other=0.)
        b_v = tl.load(p_v, mask=m_v, other=0.)
        a = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * sm_scale  # [BT, BS]
        a = tl.where(_in_window(o_t[:, None], o_s[None, :], W), a, float("-inf"))
        if HAS_LO:
            a = tl.where(o_s[None, :] >= b_lo[:, None], a, float("-inf"))
        if HAS_KV:
            b_kv = tl.load(kvalid + bos + o_s, mask=o_s < Tn, other=0.)
            a = tl.where(b_kv[None, :] > 0, a, float("-inf"))
        b_max = tl.max(a, axis=1)
        # strictly greater: on a tie the earlier key keeps the max (argmax is also leftmost)
        arg_i = tl.where(b_max > m_i, (s0 + tl.argmax(a, axis=1)).to(tl.int32), arg_i)
        m_new = tl.maximum(m_i, b_max)
        m_ref = tl.where(m_new == float("-inf"), 0., m_new)  # rows without a key so far
        alpha = tl.exp(m_i - m_ref)
        p = tl.exp(a - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(b_v.dtype), b_v, input_precision=PREC)
        m_i = m_new

    if HAS_LIN:
        g_h = tl.load(gamma + i_h)
        _, _, b_n, b_d = _load_lin(n_lin, d_lin, lin_idx, bos, o_t, Tn, i_h, H, DV, BDV)
        acc += g_h * b_n
        l_i += g_h * b_d
    if HAS_KV:
        l_i = tl.where(l_i > 0, l_i, 1.)
    p_o, m_o = _tile(o + (bos * H + i_h) * DV, t0, Tn, H * DV, 0, DV, BT, BDV)
    tl.store(p_o, (acc / l_i[:, None]).to(p_o.dtype.element_ty), mask=m_o)
    vec = i_h * TT + bos + o_t  # per-token vectors are [H, TT]
    tl.store(den + vec, l_i, mask=o_t < Tn)
    tl.store(mx + vec, m_i, mask=o_t < Tn)
    tl.store(arg + vec, arg_i, mask=o_t < Tn)


@triton.jit
def _bwd_dq_kernel(
    q, k, v, n_lin, d_lin, lin_idx, gamma, o, do, den, mx, arg, dq, dn_lin, dd_lin, cc, xx,
    cu, TT, W, sm_scale, q_lo, sk_da, sk_w, sk_arg,
    H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
    BD: tl.constexpr, BDV: tl.constexpr, HAS_LIN: tl.constexpr, PREC: tl.constexpr, HAS_LO: tl.constexpr,
    SINKS: tl.constexpr, SINK_TILE: tl.constexpr, BSK: tl.constexpr,
):
    """dq_sm for a block of queries, and their per-token terms c, X (for the key kernel), dn, dd.
    Sinks: dq's sink terms here; per (sink j, head, token) da (without the max term), p / den,
    and whether the sink holds the max, for the caller's per-document sums of the sinks' dk and dv
    (``_sink_grads``)."""
    i_t, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, Tn = _seq_bounds(cu, i_n, 0, True)
    t0 = i_t * BT
    if t0 >= Tn:
        return
    o_t = t0 + tl.arange(0, BT)
    o_v = tl.arange(0, BDV)
    p_q, m_q = _tile(q + (bos * H + i_h) * D, t0, Tn, H * D, 0, D, BT, BD)
    p_o, m_o = _tile(o + (bos * H + i_h) * DV, t0, Tn, H * DV, 0, DV, BT, BDV)
    p_do, _ = _tile(do + (bos * H + i_h) * DV, t0, Tn, H * DV, 0, DV, BT, BDV)
    b_q = tl.load(p_q, mask=m_q, other=0.)
    b_o = tl.load(p_o, mask=m_o, other=0.).to(tl.float32)
    b_do_in = tl.load(p_do, mask=m_o, other=0.)  # the dots take do as given, scaled by 1/den after
    b_do = b_do_in.to(tl.float32)
    vec = i_h * TT + bos + o_t
    rd = 1. / tl.load(den + vec, mask=o_t < Tn, other=1.)
    b_m = tl.load(mx + vec, mask=o_t < Tn, other=0.)
    b_c = -tl.sum(b_do * b_o, axis=1) * rd  # from the stored o: only the window's p terms use it
    if HAS_LIN:
        g_h = tl.load(gamma + i_h)
        r, has, b_n, b_d = _load_lin(n_lin, d_lin, lin_idx, bos, o_t, Tn, i_h, H, DV, BDV)
        tl.store(dn_lin + (r * H + i_h)[:, None] * DV + o_v[None, :],
                 (g_h * b_do * rd[:, None]).to(dn_lin.dtype.element_ty), mask=has[:, None] & (o_v[None, :] < DV))

    b_dq = tl.zeros([BT, BD], dtype=tl.float32)
    b_l = tl.zeros([BT], dtype=tl.float32)  # sum_s p_ts
    b_ds = tl.zeros([BT], dtype=tl.float32)  # do_t . sum_s p_ts v_s
    lo = tl.maximum(t0 - W + 1, 0)
    hi = tl.minimum(t0 + BT, Tn)
    if HAS_LO:  # packed documents: no key before the query's document start
        b_lo = tl.load(q_lo + bos + o_t, mask=o_t < Tn, other=0)
        lo = tl.maximum(lo, tl.min(b_lo, axis=0))  # skip key blocks no query of the block sees
    else:
        b_lo = tl.zeros([BT], dtype=tl.int32)
    if SINKS > 0:
        b_arg0 = tl.load(arg + vec, mask=o_t < Tn, other=-1)
    if SINK_TILE:  # the sinks as one key block (the window's loop below, plus their per-token terms)
        # (names of their own: a name the window's loop below assigns must keep its shape there)
        _, s_at, s_ok, s_k, s_v = _sink_tile(k, v, bos, o_t, b_lo, Tn, W, i_h, H, D, DV, BD, BDV, BSK, SINKS)
        s_a = tl.dot(b_q, tl.trans(s_k), input_precision=PREC) * sm_scale
        s_p = tl.exp(tl.where(s_ok, s_a - b_m[:, None], float("-inf")))
        s_dov = tl.dot(b_do_in, tl.trans(s_v), input_precision=PREC)
        b_l += tl.sum(s_p, axis=1)
        b_ds += tl.sum(s_p * s_dov, axis=1)
        s_da = s_p * (s_dov * rd[:, None] + b_c[:, None])
        b_dq += tl.dot(s_da.to(s_k.dtype), s_k, input_precision=PREC)
        js = tl.arange(0, BSK)
        sv = (js[None, :] * H + i_h) * TT + bos + o_t[:, None]
        sm = (js[None, :] < SINKS) & (o_t[:, None] < Tn)
        tl.store(sk_da + sv, s_da, mask=sm)
        tl.store(sk_w + sv, s_p * rd[:, None], mask=sm)
        tl.store(sk_arg + sv, tl.where(s_ok & (b_arg0[:, None] == s_at[None, :]), 1., 0.), mask=sm)
    else:
        for j in tl.static_range(SINKS):
            sp, ok, b_ks, b_vs = _load_sink(k, v, k, bos, o_t, b_lo, j, Tn, W, i_h, H, D, DV, BD, BDV, False)
            a_s = tl.sum(b_q.to(tl.float32) * b_ks, axis=1) * sm_scale
            p_s = tl.exp(tl.where(ok, a_s - b_m, float("-inf")))
            dov_s = tl.sum(b_do * b_vs, axis=1)
            b_l += p_s
            b_ds += p_s * dov_s
            da_s = p_s * (dov_s * rd + b_c)
            b_dq += da_s[:, None] * b_ks
            sv = (j * H + i_h) * TT + bos + o_t
            tl.store(sk_da + sv, da_s, mask=o_t < Tn)
            tl.store(sk_w + sv, p_s * rd, mask=o_t < Tn)
            tl.store(sk_arg + sv, tl.where(ok & (b_arg0 == sp), 1., 0.), mask=o_t < Tn)
    for j in range(0, tl.cdiv(hi - lo, BS)):
        s0 = lo + j * BS
        o_s = s0 + tl.arange(0, BS)
        p_k, m_k = _tile(k + (bos * H + i_h) * D, s0, Tn, H * D, 0, D, BS, BD)
        p_v, m_v = _tile(v + (bos * H + i_h) * DV, s0, Tn, H * DV, 0, DV, BS, BDV)
        b_k = tl.load(p_k, mask=m_k, other=0.)
        b_v = tl.load(p_v, mask=m_v, other=0.)
        a = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * sm_scale
        keep = _in_window(o_t[:, None], o_s[None, :], W)
        if HAS_LO:
            keep = keep & (o_s[None, :] >= b_lo[:, None])
        p = tl.exp(tl.where(keep, a - b_m[:, None], float("-inf")))
        dov = tl.dot(b_do_in, tl.trans(b_v), input_precision=PREC)  # do_t . v_s
        b_l += tl.sum(p, axis=1)
        b_ds += tl.sum(p * dov, axis=1)
        da = p * (dov * rd[:, None] + b_c[:, None])
        b_dq += tl.dot(da.to(b_k.dtype), b_k, input_precision=PREC)
    if HAS_LIN:
        # X_t = do.(n l - S d) / den^2 from fp32 sums: (do.n - (do.o) d) / den with the stored o
        # cancels to o's rounding (bf16: dgamma 30% off, W = 1 and gamma d >> l)
        b_dn = tl.sum(b_do * b_n, axis=1)
        b_x = (b_l * b_dn - b_d * b_ds) * rd * rd
        b_c = -(b_ds + g_h * b_dn) * rd * rd  # c again, now without the stored o
        tl.store(xx + vec, b_x, mask=o_t < Tn)
        tl.store(dd_lin + r * H + i_h, (g_h * b_c).to(dd_lin.dtype.element_ty), mask=has)
        # the max's gradient, all on key arg_t, added in fp32
        b_arg = tl.load(arg + vec, mask=o_t < Tn, other=0)
        o_d = tl.arange(0, BD)
        b_ka = tl.load(k + ((bos + b_arg) * H + i_h)[:, None] * D + o_d[None, :],
                       mask=(o_t < Tn)[:, None] & (o_d[None, :] < D), other=0.).to(tl.float32)
        b_dq += (g_h * b_x)[:, None] * b_ka
    tl.store(cc + vec, b_c, mask=o_t < Tn)
    p_dq, _ = _tile(dq + (bos * H + i_h) * D, t0, Tn, H * D, 0, D, BT, BD)
    tl.store(p_dq, (b_dq * sm_scale).to(p_dq.dtype.element_ty), mask=m_q)


@triton.jit
def _bwd_dkv_kernel(
    q, k, v, gamma, do, den, mx, arg, cc, xx, dk, dv, cu, TT, W, sm_scale, q_lo,
    H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
    BD: tl.constexpr, BDV: tl.constexpr, HAS_LIN: tl.constexpr, PREC: tl.constexpr, HAS_LO: tl.constexpr,
):
    """dk_sm and the window's part of dv for a block of keys, over the queries that see them."""
    i_s, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, Tn = _seq_bounds(cu, i_n, 0, True)
    s0 = i_s * BS
    if s0 >= Tn:
        return
    o_s = s0 + tl.arange(0, BS)
    p_k, m_k = _tile(k + (bos * H + i_h) * D, s0, Tn, H * D, 0, D, BS, BD)
    p_v, m_v = _tile(v + (bos * H + i_h) * DV, s0, Tn, H * DV, 0, DV, BS, BDV)
    b_k = tl.load(p_k, mask=m_k, other=0.)
    b_v = tl.load(p_v, mask=m_v, other=0.)
    if HAS_LIN:
        g_h = tl.load(gamma + i_h)

    b_dk = tl.zeros([BS, BD], dtype=tl.float32)
    b_dv = tl.zeros([BS, BDV], dtype=tl.float32)
    hi = tl.minimum(s0 + BS + W - 1, Tn)  # the last of these keys is seen up to query s0+BS-1+W-1
    for j in range(0, tl.cdiv(hi - s0, BT)):
        t0 = s0 + j * BT
        o_t = t0 + tl.arange(0, BT)
        p_q, m_q = _tile(q + (bos * H + i_h) * D, t0, Tn, H * D, 0, D, BT, BD)
        p_do, m_do = _tile(do + (bos * H + i_h) * DV, t0, Tn, H * DV, 0, DV, BT, BDV)
        b_q = tl.load(p_q, mask=m_q, other=0.)
        vec = i_h * TT + bos + o_t
        rd = 1. / tl.load(den + vec, mask=o_t < Tn, other=1.)
        b_g = (tl.load(p_do, mask=m_do, other=0.).to(tl.float32) * rd[:, None]).to(b_v.dtype)
        b_m = tl.load(mx + vec, mask=o_t < Tn, other=0.)
        b_c = tl.load(cc + vec, mask=o_t < Tn, other=0.)

        a_t = tl.dot(b_k, tl.trans(b_q), input_precision=PREC) * sm_scale  # [BS(s), BT(t)]
        keep = _in_window(o_t[None, :], o_s[:, None], W)
        if HAS_LO:  # the queries whose document starts at or before these keys
            b_lo = tl.load(q_lo + bos + o_t, mask=o_t < Tn, other=0)
            keep = keep & (o_s[:, None] >= b_lo[None, :])
        p_t = tl.exp(tl.where(keep, a_t - b_m[None, :], float("-inf")))
        b_dv += tl.dot(p_t.to(b_v.dtype), b_g, input_precision=PREC)
        dp_t = tl.dot(b_v, tl.trans(b_g), input_precision=PREC) + b_c[None, :]
        da_t = p_t * dp_t
        if HAS_LIN:
            b_arg = tl.load(arg + vec, mask=o_t < Tn, other=-1)
            b_x = tl.load(xx + vec, mask=o_t < Tn, other=0.)
            # only a key of the window: a sink holding the max gets its term in ``_sink_grads``
            da_t += tl.where(keep & (o_s[:, None] == b_arg[None, :]), g_h * b_x[None, :], 0.)
        b_dk += tl.dot(da_t.to(b_q.dtype), b_q, input_precision=PREC)
    p_dk, _ = _tile(dk + (bos * H + i_h) * D, s0, Tn, H * D, 0, D, BS, BD)
    p_dv, _ = _tile(dv + (bos * H + i_h) * DV, s0, Tn, H * DV, 0, DV, BS, BDV)
    tl.store(p_dk, (b_dk * sm_scale).to(p_dk.dtype.element_ty), mask=m_k)
    tl.store(p_dv, b_dv.to(p_dv.dtype.element_ty), mask=m_v)


# ----------------------------------------------------------------------------- launchers

def _geometry(q_sm, k_sm, v, cu_seqlens):
    TT, H, D = q_sm.shape
    DV = v.shape[-1]
    if not (D <= 256 and 16 <= DV <= 256):
        raise ValueError(f"window head dims must be D <= 256 and 16 <= Dv <= 256, got D={D}, Dv={DV}")
    if not (q_sm.dtype == k_sm.dtype == v.dtype):
        raise ValueError(f"q_sm, k_sm and v must share a dtype, got {q_sm.dtype}, {k_sm.dtype}, {v.dtype}")
    return TT, H, D, DV, cu_seqlens.numel() - 1


def _sink_tile_on(sinks, window, BT) -> bool:
    """The sinks as one key tile (``_sink_tile``): only where the window is at least a query block."""
    return int(sinks) > 0 and int(window) >= BT


def _bsk(sinks) -> int:
    return max(16, _next_pow2(int(sinks)))  # a dot's smallest side


def window_fwd(q_sm, k_sm, v, n_lin, d_lin, gamma, lin_idx, cu_seqlens, max_len, window, sm_scale, key_valid=None,
               q_lo=None, sinks=0, sink_buf=None):
    """The forward (see the module docstring). ``sink_buf`` (inference only, no backward): the sinks
    from a cache instead of the sequences, (keys [N, S, H, D], values [N, S, H, Dv], positions [N, S]
    fp32 (-1: empty), s_pos: a 0-dim int64 tensor, the absolute position of sequence row 0); a query at
    row t counts sink j where its position is at most s_pos + t - W."""
    snk = snv = snat = s_pos = None
    if sink_buf is not None:
        snk, snv, snat, s_pos = sink_buf
        sinks = snk.shape[1]
    TT, H, D, DV, N = _geometry(q_sm, k_sm, v, cu_seqlens)
    BT, BS = CONFIG["BT"], CONFIG["BS"]
    f32 = dict(device=v.device, dtype=torch.float32)
    o = torch.empty_like(v)
    den, mx = torch.empty(H, TT, **f32), torch.empty(H, TT, **f32)
    arg = torch.empty(H, TT, device=v.device, dtype=torch.int32)
    launch(
        _fwd_kernel, (triton.cdiv(max_len, BT), N * H),
        q_sm, k_sm, v, n_lin, d_lin, lin_idx, gamma, o, den, mx, arg, cu_seqlens, TT, window, sm_scale, key_valid,
        q_lo, snk, snv, snat, s_pos, H=H, D=D, DV=DV, BT=BT, BS=BS, BD=_next_pow2(D), BDV=_next_pow2(DV),
        HAS_LIN=n_lin is not None, PREC=_prec(v), HAS_KV=key_valid is not None, HAS_LO=q_lo is not None,
        SINKS=int(sinks), SINK_BUF=sink_buf is not None,
        SINK_TILE=_sink_tile_on(sinks, window, BT) and key_valid is None and sink_buf is None, BSK=_bsk(sinks),
        num_warps=CONFIG["fwd_warps"], num_stages=CONFIG["stages"])
    return o, den, mx, arg


def window_bwd(q_sm, k_sm, v, n_lin, d_lin, gamma, lin_idx, cu_seqlens, max_len, window, sm_scale,
               o, den, mx, arg, do, q_lo=None, sinks=0):
    TT, H, D, DV, N = _geometry(q_sm, k_sm, v, cu_seqlens)
    BT, BS = CONFIG["BT"], CONFIG["BS"]
    has_lin = n_lin is not None
    f32 = dict(device=v.device, dtype=torch.float32)
    cc = torch.empty(H, TT, **f32)
    xx = torch.zeros(H, TT, **f32) if has_lin else None  # summed over all rows into dgamma
    # linear rows that no query reads (each sequence's newest, kept for the final state) get 0
    dn = torch.zeros_like(n_lin) if has_lin else None
    dd = torch.zeros_like(d_lin) if has_lin else None
    dq, dk, dv = torch.empty_like(q_sm), torch.empty_like(k_sm), torch.empty_like(v)
    common = dict(H=H, D=D, DV=DV, BT=BT, BS=BS, BD=_next_pow2(D), BDV=_next_pow2(DV), HAS_LIN=has_lin,
                  PREC=_prec(v), HAS_LO=q_lo is not None, num_warps=CONFIG["bwd_warps"], num_stages=CONFIG["stages"])
    S = int(sinks)
    sk_da, sk_w, sk_arg = (torch.zeros(S, H, TT, **f32) for _ in range(3))
    launch(_bwd_dq_kernel, (triton.cdiv(max_len, BT), N * H),
           q_sm, k_sm, v, n_lin, d_lin, lin_idx, gamma, o, do, den, mx, arg, dq, dn, dd, cc, xx,
           cu_seqlens, TT, window, sm_scale, q_lo, sk_da, sk_w, sk_arg, SINKS=S,
           SINK_TILE=_sink_tile_on(S, window, BT), BSK=_bsk(S), **common)
    launch(_bwd_dkv_kernel, (triton.cdiv(max_len, BS), N * H),
           q_sm, k_sm, v, gamma, do, den, mx, arg, cc, xx, dk, dv, cu_seqlens, TT, window, sm_scale, q_lo,
           **common)
    if S:
        dk, dv = _sink_grads(q_sm, do, gamma if has_lin else None, xx, sm_scale, dk, dv, sk_da, sk_w, sk_arg,
                             cu_seqlens, q_lo, window)
    dgamma = xx.sum(1) if has_lin else torch.zeros(H, **f32)
    return dq, dk, dv, dn, dd, dgamma


def _sink_grads(q_sm, do, gamma, xx, sm_scale, dk, dv, sk_da, sk_w, sk_arg, cu_seqlens, q_lo, window):
    """Add the sinks' dk and dv: every query of a document reads its sinks, so their gradients are
    sums over the document's queries (in fp32):
    dk_s += sm_scale sum_t (da_ts + [s == arg_t] gamma X_t) q_t,   dv_s += sum_t (p_ts / den_t) do_t.
    A sink that does not count for a query has da = p = 0 there.  Only a query at least W past its
    document's start counts a sink, so only documents longer than W have any, at most TT // (W + 1)
    of them.  And among any L <= W consecutive tokens the ones that count a sink are all of one
    document (one that starts among them is younger than L at their end).  So the sums go by blocks
    of L = min(W, 64) tokens: a [S, L] x [L, D] matmul per block and head, a (block -> document)
    one-hot matmul over the blocks, then a scatter to each document's S distinct rows.  No per-token
    product is stored (as [TT, S*H*D] that was 151 MB a layer at 16K tokens, written and read
    several times), and no scatter of every token's term onto its document's rows (that serializes
    on atomics).  Static shapes, no host sync: it runs inside CUDA graphs."""
    TT, H, D = q_sm.shape
    S = sk_da.shape[0]
    n_docs = TT // (window + 1)  # documents long enough to count a sink, at most
    if n_docs == 0:
        return dk, dv
    dev = q_sm.device
    t = torch.arange(TT, device=dev)
    # the sequence of each token (any token past the last sequence has zero terms: clamped into range)
    seq = torch.searchsorted(cu_seqlens[1:].long(), t, right=True).clamp_max(cu_seqlens.numel() - 2)
    start = cu_seqlens[:-1].long()[seq]
    if q_lo is not None:
        start = start + q_lo.long()  # the first token of each token's document
    off = t - start
    mark = off == window  # one token of each document that counts a sink
    doc = torch.cumsum(mark, 0) - 1  # that document's rank, on its tokens at offset >= W
    first = torch.zeros(n_docs + 1, device=dev, dtype=torch.long)
    first = first.scatter_(0, torch.where(mark, doc, n_docs), start)[:n_docs]  # each document's start
    # distinct rows; a sink past its document's end (S > W + 1) has zero terms, clamped into range
    rows = (first[:, None] + torch.arange(S, device=dev)).reshape(-1).clamp_max(TT - 1)
    L = min(int(window), 64)
    nb, pad = -(-TT // L), -TT % L
    # each block's document; n_docs where none of its tokens counts a sink (a column that is dropped)
    bdoc = torch.nn.functional.pad(torch.where(off >= window, doc, -1), (0, pad), value=-1).view(nb, L).amax(1)
    hot = torch.zeros(nb, n_docs + 1, device=dev, dtype=torch.float32)
    # a scatter of a scalar, not an index_put of one: that copies a CPU tensor, refused in graph capture
    hot.scatter_(1, torch.where(bdoc < 0, n_docs, bdoc)[:, None], 1.0)
    hot = hot[:, :n_docs]

    def per_doc(w, x):  # w [S, H, TT] per-token weights, x [TT, H, E] -> [n_docs * S, H, E]: sum_t w x per doc
        E = x.shape[-1]
        wb = torch.nn.functional.pad(w, (0, pad)).view(S, H, nb, L).permute(2, 1, 0, 3)  # [nb, H, S, L]
        xb = torch.nn.functional.pad(x.float(), (0, 0, 0, 0, 0, pad)).view(nb, L, H, E).transpose(1, 2)
        part = (wb @ xb).reshape(nb, H * S * E)  # per block and head: [S, L] x [L, E]
        return (hot.t() @ part).view(n_docs, H, S, E).transpose(1, 2).reshape(n_docs * S, H, E)

    da = sk_da if gamma is None else sk_da + sk_arg * (gamma[None, :, None] * xx[None])  # [S, H, TT]
    with _tf32(q_sm.dtype != torch.float32):  # fp32 inputs keep fp32 sums; bf16 / fp16 ones round more
        sk = per_doc(da, q_sm) * sm_scale
        sv = per_doc(sk_w, do)
    # in place, on the rows only (dk and dv are the key kernel's own outputs): the sums in fp32, rounded once
    # to dk's dtype before the add; a clamped duplicate row adds zeros
    return dk.index_add_(0, rows, sk.to(dk.dtype)), dv.index_add_(0, rows, sv.to(dv.dtype))


class _tf32:
    """fp32 matmuls inside with TF32 on or off, whatever the trainer set (restored after)."""

    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        self.saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = self.on

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.saved


# ----------------------------------------------------------------------------- autograd

def _none_or(x: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0, dtype=torch.float32) if x is None else x


@torch.library.custom_op("linearize::window_attn_fwd", mutates_args=())
def window_attn_fwd_op(
    q_sm: torch.Tensor, k_sm: torch.Tensor, v: torch.Tensor, n_lin: torch.Tensor | None, d_lin: torch.Tensor | None,
    gamma: torch.Tensor, lin_idx: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int, window: int, sm_scale: float,
    q_lo: torch.Tensor | None = None, sinks: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The window forward as a torch op: o, and the softmax statistics the backward reads."""
    return window_fwd(q_sm, k_sm, v, n_lin, d_lin, gamma, lin_idx, cu_seqlens, max_len, window, sm_scale, q_lo=q_lo,
                      sinks=sinks)


@window_attn_fwd_op.register_fake
def _(q_sm, k_sm, v, n_lin, d_lin, gamma, lin_idx, cu_seqlens, max_len, window, sm_scale, q_lo=None, sinks=0):
    TT, H = q_sm.shape[:2]
    stat = q_sm.new_empty(H, TT, dtype=torch.float32)
    return torch.empty_like(v), stat, torch.empty_like(stat), q_sm.new_empty(H, TT, dtype=torch.int32)


@torch.library.custom_op("linearize::window_attn_bwd", mutates_args=())
def window_attn_bwd_op(
    q_sm: torch.Tensor, k_sm: torch.Tensor, v: torch.Tensor, n_lin: torch.Tensor | None, d_lin: torch.Tensor | None,
    gamma: torch.Tensor, lin_idx: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int, window: int, sm_scale: float,
    o: torch.Tensor, den: torch.Tensor, mx: torch.Tensor, arg: torch.Tensor, do: torch.Tensor,
    q_lo: torch.Tensor | None = None, sinks: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq_sm, dk_sm, dv, dn_lin, dd_lin (empty without linear terms), dgamma."""
    dq, dk, dv, dn, dd, dgamma = window_bwd(q_sm, k_sm, v, n_lin, d_lin, gamma, lin_idx, cu_seqlens, max_len,
                                            window, sm_scale, o, den, mx, arg, do.contiguous(), q_lo=q_lo,
                                            sinks=sinks)
    return dq, dk, dv, _none_or(dn, q_sm), _none_or(dd, q_sm), dgamma


@window_attn_bwd_op.register_fake
def _(q_sm, k_sm, v, n_lin, d_lin, gamma, lin_idx, cu_seqlens, max_len, window, sm_scale, o, den, mx, arg, do,
      q_lo=None, sinks=0):
    like = lambda x: q_sm.new_empty(0, dtype=torch.float32) if x is None else torch.empty_like(x)  # noqa: E731
    return (torch.empty_like(q_sm), torch.empty_like(k_sm), torch.empty_like(v), like(n_lin), like(d_lin),
            q_sm.new_empty(q_sm.shape[1], dtype=torch.float32))


def _window_setup(ctx, inputs, output):
    q_sm, k_sm, v, n_lin, d_lin, gamma, lin_idx, cu_seqlens, max_len, window, sm_scale, *rest = inputs
    q_lo, sinks = (list(rest) + [None, 0])[:2]
    o, den, mx, arg = output
    ctx.save_for_backward(q_sm, k_sm, v, n_lin, d_lin, gamma, lin_idx, cu_seqlens, o, den, mx, arg, q_lo)
    ctx.args = (max_len, window, sm_scale)
    ctx.sinks = sinks


def _window_backward(ctx, do, dden, dmx, darg):
    q_sm, k_sm, v, n_lin, d_lin, gamma, lin_idx, cu_seqlens, o, den, mx, arg, q_lo = ctx.saved_tensors
    dq, dk, dv, dn, dd, dgamma = torch.ops.linearize.window_attn_bwd(
        q_sm, k_sm, v, n_lin, d_lin, gamma, lin_idx, cu_seqlens, *ctx.args, o, den, mx, arg, do, q_lo, ctx.sinks)
    has_lin = n_lin is not None
    return (dq, dk, dv, dn if has_lin else None, dd if has_lin else None, dgamma, None, None, None, None, None, None,
            None)


window_attn_fwd_op.register_autograd(_window_backward, setup_context=_window_setup)


def window_softmax_attn(q_sm, k_sm, v, n_lin, d_lin, gamma, lin_idx, cu_seqlens, *, window, sm_scale,
                        max_len=None, q_lo=None, sinks=0):
    """Sliding-window softmax plus weighted linear terms under one normalizer (module docstring).

    Args:
        q_sm, k_sm: [TT, H, D] packed softmax queries and keys, D <= 256 (padded to >= 16).
        v: [TT, H, Dv] values, 16 <= Dv <= 256; same dtype as q_sm, k_sm (fp32, bf16 or fp16).
        n_lin, d_lin: [R, H, Dv] and [R, H] linear numerators and denominators, or both None.
        gamma: [H] fp32 weight of the linear terms (may require grad).
        lin_idx: int32 [TT], the row of n_lin, d_lin holding token t's terms, or -1 for none
            (no row read by two tokens; rows no token reads get a zero gradient).
        cu_seqlens: int32 [N+1] sequence offsets into the TT packed tokens.
        window: W >= 1; sm_scale: the score scale.  max_len: the longest sequence (else read
            from cu_seqlens, which syncs).
        q_lo: optional int [TT], packed documents inside the sequences: token t's document
            starts at position q_lo[t] <= t of t's sequence (counted from its cu_seqlens start);
            keys before it are masked.  lin_idx must already be -1 where t-W < q_lo[t].
        sinks: S >= 0 attention sinks: the first S keys of token t's document (its sequence, or
            from q_lo[t]) join its softmax where they are outside the window (position <= t-W).

    Returns:
        o [TT, H, Dv] in v's dtype.
    """
    if max_len is None:
        max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    if sinks < 0:
        raise ValueError(f"sinks must be >= 0, got {sinks}")
    if window == 1 and not sinks:
        # A softmax over one key is 1 whatever the scores: o does not depend on q_sm, k_sm, and
        # their exact gradient is zero (the kernels' p dp and max terms would cancel only to
        # rounding).
        q_sm, k_sm = q_sm.detach(), k_sm.detach()
    q_sm, k_sm, v = (x.contiguous() for x in (q_sm, k_sm, v))
    if n_lin is not None:
        n_lin, d_lin = n_lin.contiguous(), d_lin.contiguous()
    o, _, _, _ = torch.ops.linearize.window_attn_fwd(q_sm, k_sm, v, n_lin, d_lin, gamma.float().contiguous(),
                                                     lin_idx.to(torch.int32).contiguous(), cu_seqlens.to(torch.int32),
                                                     max(int(max_len), 1), int(window), float(sm_scale),
                                                     None if q_lo is None else q_lo.to(torch.int32).contiguous(),
                                                     int(sinks))
    return o


def window_softmax_attn_ref(q_sm, k_sm, v, n_lin, d_lin, gamma, lin_idx, cu_seqlens, *, window, sm_scale,
                            max_len=None, q_lo=None, sinks=0):
    """Readable PyTorch twin of :func:`window_softmax_attn` (same arguments; computes in q_sm's
    dtype, differentiable in every tensor; O(T^2) memory per sequence)."""
    TT, H, _ = q_sm.shape
    dt = q_sm.dtype
    has = (lin_idx >= 0)[:, None]  # (TT, 1)
    n_t = d_t = 0.
    if n_lin is not None:  # token t's linear terms, zero where it has none
        rows = lin_idx.long().clamp_min(0)
        n_t = torch.where(has[..., None], n_lin.to(dt)[rows], 0.)  # (TT, H, Dv)
        d_t = torch.where(has, d_lin.to(dt)[rows], 0.)  # (TT, H)
    nums, dens = [], []
    b = cu_seqlens.tolist()
    for bos, eos in zip(b[:-1], b[1:]):
        if eos == bos:
            continue
        t = torch.arange(eos - bos, device=q_sm.device)
        diff = t[:, None] - t[None, :]  # t - s
        a = sm_scale * torch.einsum("thd,shd->hts", q_sm[bos:eos], k_sm[bos:eos].to(dt))
        first = torch.zeros_like(t) if q_lo is None else q_lo[bos:eos].to(t.device).long()  # the document's first key
        # the window, and the document's first ``sinks`` keys (the sinks; those in the window count once)
        keep = (diff >= 0) & ((diff < window) | (t[None, :] < first[:, None] + sinks))
        keep = keep & (t[None, :] >= first[:, None])  # packed documents: keys of the query's own document
        a = a.masked_fill(~keep, float("-inf"))
        p = (a - a.amax(-1, keepdim=True)).exp()
        nums.append(torch.einsum("hts,shd->thd", p, v[bos:eos].to(dt)))
        dens.append(p.sum(-1).t())
    e = gamma.to(dt)
    num = torch.cat(nums) + e[:, None] * n_t
    den = torch.cat(dens) + e * d_t
    return (num / den[..., None]).to(v.dtype)
