"""Decode step(s) of the LoLCATs window hybrid from a cached state, with the window in a ring buffer.

The cached state of a window-W layer (see linearize/cache.py) is the linear state (S, z) over every
key except the newest W-1, decayed to the last key folded in, and a ring buffer of those W-1 keys:
raw key k (softmax part), phi(k), v, log gate, valid.  The token at absolute position p (``pos``,
the layer's token counter, plus its index in the call) lives in ring slot ``p mod (W-1)``, so the
slot it takes is the one of the key that leaves the window (position p-W+1).  Per token::

    a_s   = sm_scale q . k_s  (softcapped)     s over the ring and the token itself (valid keys only)
    m     = max_s a_s,  p_s = exp(a_s - m)
    lin   = phi(q) exp(sum of the W window gates) [S, z]          (S(p-W) decayed to p)
    o     = (sum_s p_s v_s + gamma lin_num) / (sum_s p_s + gamma lin_den)   (den 0 -> 1)
    then  S, z <- g_e S + phi(k_e)^T [v_e, 1] for the evicted key e (nothing if e is padding),
          and the token is written into e's slot.

Attention sinks (optional ``sinks``: the keys and values of a row's first S real tokens and their
positions, -1 for an empty slot) join the softmax of a token at position p when they lie outside its
window (position <= p - W). The kernel only reads them: the layer fills them (linearize/layers.py).

A padding token (valid 0) is not attended, adds nothing and does not decay (S, z) when it leaves;
it still takes its ring slot (marked invalid), as it takes a place in the PyTorch timeline.

One program per (batch, head) owns S[b, h], z[b, h] and the ring's head-h slices, so it updates
them in place; the ring's ``valid`` (one per batch row, shared by the heads) is read once at the
start and kept in registers, and the last program of the row to have read it writes the new row
(a ticket count in the flags, see the kernel's end): no other launch follows the kernel.

Two ops share the kernel: ``window_decode`` takes the features phi(q), phi(k) computed outside;
``window_decode_hedgehog`` computes Hedgehog's features in registers from the raw q, k (after
RoPE) and the maps' weights, reads k and v with the kv-head count (GQA is an index) and gamma as
its log: with it a decode step of a LoLCATs layer is one launch between the input projection
(+ RoPE) and the output projection.  :func:`window_decode_ref` and
:func:`window_decode_hedgehog_ref` are the readable PyTorch twins.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import pdl
from ..pdl import wait_then_release
from .recurrent import _check_rope, _hedgehog_features, _rotary


@triton.jit
def _softcap(a, softcap):
    """softcap * tanh(a / softcap), from exp (the decode kernels' logit soft-capping)."""
    return softcap * (1. - 2. / (tl.exp(2. * a / softcap) + 1.))


@triton.jit
def _load_sinks(snk, snv, snat, i_b, i_h, o_d, m_d, o_v, m_v, H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                SINKS: tl.constexpr, BSN: tl.constexpr):
    """Row i_b's attention sinks for head i_h: keys [BSN, BD] and values [BSN, BDV] in fp32, and their
    positions [BSN] (-1: empty), from sink_k / sink_v [B, S, H, *] and sink_at [B, S]."""
    o_n = tl.arange(0, BSN)
    m_n = o_n < SINKS
    n_off = (i_b.to(tl.int64) * SINKS + o_n) * H + i_h
    b_nk = tl.load(snk + n_off[:, None] * D + o_d[None, :], mask=m_n[:, None] & m_d[None, :], other=0.)
    b_nv = tl.load(snv + n_off[:, None] * DV + o_v[None, :], mask=m_n[:, None] & m_v[None, :], other=0.)
    b_nat = tl.load(snat + i_b.to(tl.int64) * SINKS + o_n, mask=m_n, other=-1.)
    return b_nk.to(tl.float32), b_nv.to(tl.float32), b_nat


@triton.jit
def _window_decode_kernel(
    q, qf, k, kf, v, wq, wk, lg, valid, rk, rf, rv, rlg, rvalid, S, z, pos_ptr, gamma, o, T, sm_scale, softcap,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, cos, sin, sc_b, sc_t, snk, snv, snat,
    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, F: tl.constexpr, DV: tl.constexpr, W1: tl.constexpr,
    BD: tl.constexpr, BK: tl.constexpr, BDV: tl.constexpr, BW: tl.constexpr,
    GATE: tl.constexpr, VALID: tl.constexpr, SOFTCAP: tl.constexpr, HEDGEHOG: tl.constexpr, LOG_GAMMA: tl.constexpr,
    ROT: tl.constexpr, PDL: tl.constexpr, SINKS: tl.constexpr, BSN: tl.constexpr,
):
    # GATE: 0 none, 1 one gate per head, 2 one per feature (channel). HEDGEHOG: phi(q), phi(k) computed
    # here from the raw q, k and the maps' weights wq, wk [H, D, F/2] (qf, kf unused), else read from qf, kf.
    # q, k, v are read through their (batch, time, head) strides (unit stride along D); k and v have HKV heads
    # (GQA: query head h reads head h // (H / HKV)). LOG_GAMMA: ``gamma`` holds log gamma. ROT > 0: q and k
    # arrive before RoPE and are rotated here (the ring stores the rotated keys, as the layer would).
    i_bh = tl.program_id(0)
    wait_then_release(PDL)  # kernels/pdl.py: nothing read or written before
    i_b, i_h = i_bh // H, i_bh % H
    i_hk = i_h // (H // HKV)
    o_d, o_k, o_v, o_w = tl.arange(0, BD), tl.arange(0, BK), tl.arange(0, BDV), tl.arange(0, BW)
    m_d, m_k, m_v, m_w = o_d < D, o_k < F, o_v < DV, o_w < W1
    p_s = S + i_bh.to(tl.int64) * F * DV + o_k[:, None] * DV + o_v[None, :]
    b_s = tl.load(p_s, mask=m_k[:, None] & m_v[None, :], other=0.)
    b_z = tl.load(z + i_bh.to(tl.int64) * F + o_k, mask=m_k, other=0.)
    g_h = tl.load(gamma + i_h).to(tl.float32)
    if LOG_GAMMA:
        g_h = tl.exp(g_h)
    pos = tl.load(pos_ptr)
    rb = i_b.to(tl.int64) * W1  # ring row base: slot w of batch b at (rb + w) * H + h
    if W1 > 0:
        b_rv = tl.load(rvalid + rb + o_w, mask=m_w, other=0.).to(tl.float32)
        b_rv = b_rv - 2. * tl.floor(0.5 * b_rv)  # drop the tickets other heads of the row took (see the end)
    if SINKS > 0:  # the row's attention sinks (read only: the caller fills them), kept in registers
        b_nk, b_nv, b_nat = _load_sinks(snk, snv, snat, i_b, i_h, o_d, m_d, o_v, m_v, H, D, DV, SINKS, BSN)
    for t in range(0, T):
        row = (i_b.to(tl.int64) * T + t) * H + i_h
        p_q = q + i_b.to(tl.int64) * sq_b + t * sq_t + i_h * sq_h
        p_k = k + i_b.to(tl.int64) * sk_b + t * sk_t + i_hk * sk_h
        b_q = tl.load(p_q + o_d, mask=m_d, other=0.).to(tl.float32)
        b_kc = tl.load(p_k + o_d, mask=m_d, other=0.).to(tl.float32)
        b_vc = tl.load(v + i_b.to(tl.int64) * sv_b + t * sv_t + i_hk * sv_h + o_v, mask=m_v, other=0.).to(tl.float32)
        if ROT > 0:
            c_t = cos + i_b * sc_b + t * sc_t
            s_t = sin + i_b * sc_b + t * sc_t
            b_q = _rotary(p_q, b_q, o_d, m_d, c_t, s_t, ROT)
            b_kc = _rotary(p_k, b_kc, o_d, m_d, c_t, s_t, ROT)
        if HEDGEHOG:
            b_qf = _hedgehog_features(b_q, wq + i_h * D * (F // 2), o_d, m_d, o_k, m_k, D, F // 2)
            b_kfc = _hedgehog_features(b_kc, wk + i_h * D * (F // 2), o_d, m_d, o_k, m_k, D, F // 2)
        else:
            b_qf = tl.load(qf + row * F + o_k, mask=m_k, other=0.).to(tl.float32)
            b_kfc = tl.load(kf + row * F + o_k, mask=m_k, other=0.).to(tl.float32)
        keep = 1.
        if VALID:
            keep = tl.load(valid + i_b.to(tl.int64) * T + t).to(tl.float32)
        a_c = tl.sum(b_q * b_kc, axis=0) * sm_scale
        if SOFTCAP:
            a_c = _softcap(a_c, softcap)
        a_c = tl.where(keep > 0, a_c, float("-inf"))
        # log decay over the window (the ring's valid gates and the token's): S(p-W) -> p
        if GATE == 1:
            dsum = tl.load(lg + row).to(tl.float32) * keep
        elif GATE == 2:
            dsum = tl.load(lg + row * F + o_k, mask=m_k, other=0.).to(tl.float32) * keep
        m = a_c
        if W1 > 0:
            slot = (pos + t) % W1
            r_off = (rb + o_w) * H + i_h
            b_rk = tl.load(rk + r_off[:, None] * D + o_d[None, :], mask=m_w[:, None] & m_d[None, :], other=0.)
            b_rvv = tl.load(rv + r_off[:, None] * DV + o_v[None, :], mask=m_w[:, None] & m_v[None, :], other=0.)
            b_rvv = b_rvv.to(tl.float32)
            a = tl.sum(b_rk.to(tl.float32) * b_q[None, :], axis=1) * sm_scale
            if SOFTCAP:
                a = _softcap(a, softcap)
            a = tl.where(m_w & (b_rv > 0), a, float("-inf"))
            m = tl.maximum(tl.max(a, axis=0), a_c)
            if GATE == 1:
                b_rlg = tl.load(rlg + r_off, mask=m_w, other=0.).to(tl.float32)
                dsum += tl.sum(tl.where(b_rv > 0, b_rlg, 0.), axis=0)
            elif GATE == 2:
                b_rlg = tl.load(rlg + r_off[:, None] * F + o_k[None, :], mask=m_w[:, None] & m_k[None, :], other=0.)
                dsum += tl.sum(tl.where(b_rv[:, None] > 0, b_rlg.to(tl.float32), 0.), axis=0)
        if SINKS > 0:  # a filled sink outside the window (position <= p - W) joins the softmax
            a_n = tl.sum(b_nk * b_q[None, :], axis=1) * sm_scale
            if SOFTCAP:
                a_n = _softcap(a_n, softcap)
            ok_n = (b_nat >= 0) & (b_nat <= (pos + t - W1 - 1).to(tl.float32))
            a_n = tl.where(ok_n, a_n, float("-inf"))
            m = tl.maximum(m, tl.max(a_n, axis=0))
        m = tl.where(m == float("-inf"), 0., m)  # no valid key at all (padding)
        p_c = tl.exp(a_c - m)
        num = p_c * b_vc
        den = p_c
        if W1 > 0:
            p = tl.exp(a - m)
            num += tl.sum(p[:, None] * b_rvv, axis=0)
            den += tl.sum(p, axis=0)
        if SINKS > 0:
            p_n = tl.exp(a_n - m)
            num += tl.sum(p_n[:, None] * b_nv, axis=0)
            den += tl.sum(p_n, axis=0)
        b_qd = b_qf
        if GATE > 0:
            b_qd = b_qf * tl.exp(dsum)
        num += g_h * tl.sum(b_qd[:, None] * b_s, axis=0)
        den += g_h * tl.sum(b_qd * b_z, axis=0)
        den = tl.where(den > 0, den, 1.)
        tl.store(o + row * DV + o_v, (num / den).to(o.dtype.element_ty), mask=m_v)

        # fold the key that leaves the window (the ring's oldest; the token itself when W = 1)
        if W1 > 0:
            sel = o_w == slot
            e_keep = tl.sum(tl.where(sel, b_rv, 0.), axis=0)
            e_off = (rb + slot) * H + i_h
            e_f = tl.load(rf + e_off * F + o_k, mask=m_k, other=0.).to(tl.float32)
            e_v = tl.sum(tl.where(sel[:, None], b_rvv, 0.), axis=0)
            if GATE == 1:
                e_g = tl.exp(tl.sum(tl.where(sel, b_rlg, 0.), axis=0) * e_keep)
            elif GATE == 2:
                e_g = tl.exp(tl.sum(tl.where(sel[:, None], b_rlg.to(tl.float32), 0.), axis=0) * e_keep)
        else:
            e_keep = keep
            e_f = b_kfc
            e_v = b_vc
            if GATE == 1:
                e_g = tl.exp(tl.load(lg + row).to(tl.float32) * keep)
            elif GATE == 2:
                e_g = tl.exp(tl.load(lg + row * F + o_k, mask=m_k, other=0.).to(tl.float32) * keep)
        if GATE == 1:
            b_s = b_s * e_g
            b_z = b_z * e_g
        elif GATE == 2:
            b_s = b_s * e_g[:, None]
            b_z = b_z * e_g
        e_f = e_f * e_keep
        b_s += e_f[:, None] * e_v[None, :]
        b_z += e_f

        # the token takes the evicted key's slot
        if W1 > 0:
            tl.store(rk + e_off * D + o_d, b_kc.to(rk.dtype.element_ty), mask=m_d)
            tl.store(rf + e_off * F + o_k, b_kfc.to(rf.dtype.element_ty), mask=m_k)
            tl.store(rv + e_off * DV + o_v, b_vc.to(rv.dtype.element_ty), mask=m_v)
            if GATE == 1:
                tl.store(rlg + e_off, tl.load(lg + row).to(rlg.dtype.element_ty))
            elif GATE == 2:
                b_lgc = tl.load(lg + row * F + o_k, mask=m_k, other=0.)
                tl.store(rlg + e_off * F + o_k, b_lgc.to(rlg.dtype.element_ty), mask=m_k)
            b_rv = tl.where(sel, keep, b_rv)
            tl.debug_barrier()  # the next step reads the slot back
    tl.store(p_s, b_s, mask=m_k[:, None] & m_v[None, :])
    tl.store(z + i_bh.to(tl.int64) * F + o_k, b_z, mask=m_k)
    if W1 > 0:
        # The H programs of a batch row share its valid flags: each read them all at the start and
        # holds the same new row in b_rv now. Each takes a ticket by adding 2 to the flag of the first
        # slot written (readers strip the tickets: flags are 0 / 1); the last one, when every head has
        # read the row, writes it (restoring 0 / 1). The ticket depends on b_rv, so it is issued only
        # after this program's loads of the flags have returned.
        tick = tl.atomic_add(rvalid + rb + pos % W1, 2. + 0. * tl.sum(b_rv, axis=0))
        if tick > 2. * H - 2.5:  # the flag's 0 / 1 plus 2 for each of the other H - 1 heads
            tl.store(rvalid + rb + o_w, b_rv, mask=m_w)


def _strides(x):
    """(batch, time, head) strides of a [B, T, H, D] tensor with unit stride along D (copied if not)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x, x.stride()[:3]


def _launch(q, qf, k, kf, v, wq, wk, log_g, valid, ring_k, ring_phi, ring_v, ring_log_g, ring_valid, S, z, pos,
            gamma, sm_scale, softcap, log_gamma, cos=None, sin=None, sink_k=None, sink_v=None, sink_at=None):
    B, T, H, D = q.shape
    HKV, DV, F, W1 = k.shape[2], v.shape[-1], S.shape[2], ring_k.shape[1]
    gate = 0 if log_g is None else (1 if log_g.dim() == 3 else 2)
    (q, sq), (k, sk), (v, sv) = _strides(q), _strides(k), _strides(v)
    o = torch.empty(B, T, H, DV, device=v.device, dtype=v.dtype)
    BK, BDV = triton.next_power_of_2(F), triton.next_power_of_2(DV)
    on = pdl.enabled(q)
    _window_decode_kernel[(B * H,)](
        q, qf, k, kf, v, wq, wk, log_g, valid, ring_k, ring_phi, ring_v, ring_log_g, ring_valid, S, z, pos, gamma,
        o, T, sm_scale, softcap, *sq, *sk, *sv, cos, sin,
        0 if cos is None or cos.shape[0] == 1 else cos.stride(0), 0 if cos is None else cos.stride(1),
        sink_k, sink_v, sink_at,
        H=H, HKV=HKV, D=D, F=F, DV=DV, W1=W1, ROT=0 if cos is None else cos.shape[-1],
        SINKS=0 if sink_k is None else sink_k.shape[1],
        BSN=1 if sink_k is None else triton.next_power_of_2(sink_k.shape[1]),
        BD=triton.next_power_of_2(D), BK=BK, BDV=BDV, BW=triton.next_power_of_2(max(W1, 1)), GATE=gate,
        VALID=valid is not None, SOFTCAP=softcap > 0, HEDGEHOG=wq is not None, LOG_GAMMA=log_gamma, PDL=on,
        num_warps=NUM_WARPS or (4 if BK * BDV <= 8192 else 8), **pdl.launch_options(on))
    return o


# Warps per program: None picks 4 up to a [128, 64] state tile (a decode step is latency-bound on each
# program's instruction stream, and 4 warps beat 8 at every benchmark shape, H200 2026-11-25:
# docs/decode_kernels.md); scripts/bench_decode_kernels.py sets it to sweep.
NUM_WARPS: int | None = None


_MUTATES = ("ring_k", "ring_phi", "ring_v", "ring_log_g", "ring_valid", "S", "z")


@torch.library.custom_op("linearize::window_decode", mutates_args=_MUTATES)
def window_decode_op(
    q_sm: torch.Tensor, qf: torch.Tensor, k_sm: torch.Tensor, kf: torch.Tensor, v: torch.Tensor,
    log_g: torch.Tensor | None, valid: torch.Tensor | None, ring_k: torch.Tensor, ring_phi: torch.Tensor,
    ring_v: torch.Tensor, ring_log_g: torch.Tensor, ring_valid: torch.Tensor, S: torch.Tensor, z: torch.Tensor,
    pos: torch.Tensor, gamma: torch.Tensor, sm_scale: float, softcap: float,
    sink_k: torch.Tensor | None = None, sink_v: torch.Tensor | None = None, sink_at: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`window_decode` as a torch op: advances the ring and (S, z) in place, returns o."""
    return _launch(q_sm, qf, k_sm, kf, v, None, None, log_g, valid, ring_k, ring_phi, ring_v, ring_log_g, ring_valid,
                   S, z, pos, gamma, sm_scale, softcap, log_gamma=False, sink_k=sink_k, sink_v=sink_v, sink_at=sink_at)


@window_decode_op.register_fake
def _(q_sm, qf, k_sm, kf, v, log_g, valid, ring_k, ring_phi, ring_v, ring_log_g, ring_valid, S, z, pos, gamma,
      sm_scale, softcap, sink_k=None, sink_v=None, sink_at=None):
    return torch.empty_like(v)


@torch.library.custom_op("linearize::window_decode_hedgehog", mutates_args=_MUTATES)
def window_decode_hedgehog_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor,
    log_g: torch.Tensor | None, valid: torch.Tensor | None, ring_k: torch.Tensor, ring_phi: torch.Tensor,
    ring_v: torch.Tensor, ring_log_g: torch.Tensor, ring_valid: torch.Tensor, S: torch.Tensor, z: torch.Tensor,
    pos: torch.Tensor, log_gamma: torch.Tensor, sm_scale: float, softcap: float,
    cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
    sink_k: torch.Tensor | None = None, sink_v: torch.Tensor | None = None, sink_at: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`fused_window_decode_hedgehog` as a torch op: advances the ring and (S, z) in place, returns o."""
    return _launch(q, None, k, None, v, wq, wk, log_g, valid, ring_k, ring_phi, ring_v, ring_log_g, ring_valid,
                   S, z, pos, log_gamma, sm_scale, softcap, log_gamma=True, cos=cos, sin=sin,
                   sink_k=sink_k, sink_v=sink_v, sink_at=sink_at)


@window_decode_hedgehog_op.register_fake
def _(q, k, v, wq, wk, log_g, valid, ring_k, ring_phi, ring_v, ring_log_g, ring_valid, S, z, pos, log_gamma,
      sm_scale, softcap, cos=None, sin=None, sink_k=None, sink_v=None, sink_at=None):
    return v.new_empty(*q.shape[:3], v.shape[-1])


def window_decode(q_sm, qf, k_sm, kf, v, *, log_g=None, valid=None, ring, state, pos, gamma, sm_scale,
                  softcap=None, sinks=None):
    """T (small) decode steps of the window hybrid, updating the ring and the state in place.

    Args:
        q_sm, k_sm: [B, T, H, D] raw queries and keys (softmax part); qf, kf: [B, T, H, F] their
            features; v: [B, T, H, Dv]. One dtype for q_sm, k_sm, v (fp32/bf16/fp16); qf, kf any.
        log_g: optional [B, T, H] or [B, T, H, F] log decay (<= 0); valid: optional [B, T] (0 = pad).
        ring: dict k [B, W-1, H, D], phi_k [B, W-1, H, F], v [B, W-1, H, Dv], log_g [B, W-1, H(, F)]
            fp32, valid [B, W-1] fp32; contiguous, updated in place (slot = position mod (W-1)).
        state: (S [B, H, F, Dv], z [B, H, F]) contiguous fp32, updated in place.
        pos: 0-dim int64 tensor, the absolute position of the first token (the layer's token count).
        gamma: [H] fp32 weight of the linear part; sm_scale, softcap: the softmax's (softcap None = off).
        sinks: optional attention sinks, a dict sink_k [B, S, H, D] (k_sm's dtype), sink_v [B, S, H, Dv]
            (v's), sink_at [B, S] fp32 (each sink's position, -1 for an empty slot): a query at
            position p also attends to the sinks at positions <= p - W (read only; the caller fills them).

    Returns:
        o [B, T, H, Dv] in v's dtype. No autograd (decode path).
    """
    S, z = state
    B, T, H, D = q_sm.shape
    _check_ring_and_state(ring, state, B, H, D, qf.shape[-1], v.shape[-1], log_g)
    sk, sv, sat = _check_sinks(sinks, B, H, D, v.shape[-1])
    q_sm, qf, k_sm, kf, v = (x.contiguous() for x in (q_sm, qf, k_sm, kf, v))
    if log_g is not None:
        log_g = log_g.float().contiguous()
    if valid is not None:
        valid = valid.to(torch.float32).contiguous()
    gamma = torch.as_tensor(gamma, device=v.device).float().reshape(-1).expand(H).contiguous()
    pos = torch.as_tensor(pos, device=v.device).to(torch.int64).reshape(())
    return torch.ops.linearize.window_decode(
        q_sm, qf, k_sm, kf, v, log_g, valid, ring["k"], ring["phi_k"], ring["v"], ring["log_g"], ring["valid"],
        S, z, pos, gamma, float(sm_scale), float(softcap or 0.0), sk, sv, sat)


def _check_sinks(sinks, B, H, D, DV):
    """The sinks' tensors (contiguous), or three None."""
    if sinks is None:
        return None, None, None
    sk, sv, sat = sinks["sink_k"], sinks["sink_v"], sinks["sink_at"]
    S = sk.shape[1]
    if tuple(sk.shape) != (B, S, H, D) or tuple(sv.shape) != (B, S, H, DV) or tuple(sat.shape) != (B, S) or S < 1:
        raise ValueError(f"sinks must be sink_k [B, S, H, D] = {(B, S, H, D)}, sink_v [B, S, H, Dv] and sink_at [B, S], "
                         f"got {tuple(sk.shape)}, {tuple(sv.shape)}, {tuple(sat.shape)}")
    return sk.contiguous(), sv.contiguous(), sat.float().contiguous()


def _check_ring_and_state(ring, state, B, H, D, F, DV, log_g):
    S, z = state
    W1 = ring["k"].shape[1]
    want = {"k": (B, W1, H, D), "phi_k": (B, W1, H, F), "v": (B, W1, H, DV), "valid": (B, W1)}
    want["log_g"] = (B, W1, H) if log_g is None or log_g.dim() == 3 else (B, W1, H, F)
    for name, shape in want.items():
        t = ring[name]
        if tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"ring[{name!r}] must be a contiguous {shape} tensor, got {tuple(t.shape)}")
    for name in ("phi_k", "log_g", "valid"):
        if ring[name].dtype != torch.float32:
            raise ValueError(f"ring[{name!r}] must be float32, got {ring[name].dtype}")
    if S.dtype != torch.float32 or z.dtype != torch.float32 or not (S.is_contiguous() and z.is_contiguous()):
        raise ValueError("state must be contiguous fp32 tensors (S [B, H, F, Dv], z [B, H, F])")
    if S.shape != (B, H, F, DV) or z.shape != (B, H, F):
        raise ValueError(f"state shapes {tuple(S.shape)}, {tuple(z.shape)} do not match B={B}, H={H}, F={F}, Dv={DV}")


def fused_window_decode_hedgehog(q, k, v, wq, wk, *, log_g=None, valid=None, ring, state, pos, log_gamma, sm_scale,
                                 softcap=None, cos=None, sin=None, sinks=None):
    """T (small) decode steps of the window hybrid with Hedgehog's feature maps computed in the kernel,
    updating the ring and the state in place: one launch.

    Args:
        q: [B, T, H, D] raw queries (after RoPE, or before it with ``cos``/``sin``); k: [B, T, Hkv, D]
            raw keys (likewise); v: [B, T, Hkv, Dv]; one
            dtype (fp32/bf16/fp16), any strides with a unit stride along the last dim (H a multiple of
            Hkv: query head h reads key/value head h // (H / Hkv)).
        wq, wk: [H, D, F/2] the Hedgehog maps' weights (phi(x) = softmax([x W, -x W]), F features).
        log_g: optional [B, T, H] or [B, T, H, F] log decay (<= 0, per head or per key channel, as
            :func:`window_decode`; the ring's log_g has the same per-token shape); valid: optional [B, T] (0 = pad).
        ring, state, pos, sm_scale, softcap: as :func:`window_decode` (the ring per query head).
        log_gamma: [H] log of the linear part's weight (the layer's ``window_log_gamma``), any float dtype.
        cos, sin: optional [B or 1, T, R] RoPE of the tokens, applied to q and k in the kernel (as
            :func:`fused_recurrent_hedgehog`); the ring then holds the rotated keys.
        sinks: optional attention sinks per query head, as :func:`window_decode`.

    Returns:
        o [B, T, H, Dv] in v's dtype. No autograd (decode path).
    """
    B, T, H, D = q.shape
    HKV, DV, P = k.shape[2], v.shape[-1], wq.shape[-1]
    if (k.shape[:2] != (B, T) or k.shape[-1] != D or v.shape[:3] != (B, T, HKV) or H % HKV
            or wq.shape != (H, D, P) or wk.shape != (H, D, P) or q.dtype != k.dtype or k.dtype != v.dtype):
        raise ValueError(f"q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}, v {tuple(v.shape)} {v.dtype}, "
                         f"wq {tuple(wq.shape)}, wk {tuple(wk.shape)} do not fit: q [B, T, H, D], k [B, T, Hkv, D], "
                         "v [B, T, Hkv, Dv] of one dtype, H a multiple of Hkv, wq and wk [H, D, P]")
    if log_g is not None and log_g.shape not in ((B, T, H), (B, T, H, 2 * P)):
        raise ValueError(f"log_g must be [B, T, H] = {(B, T, H)} (one gate per head) or [B, T, H, F] = "
                         f"{(B, T, H, 2 * P)} (one per key channel), got {tuple(log_g.shape)}")
    _check_ring_and_state(ring, state, B, H, D, 2 * P, DV, log_g)
    S, z = state
    wq, wk, log_gamma = wq.contiguous(), wk.contiguous(), log_gamma.reshape(-1).expand(H).contiguous()
    if log_g is not None:
        log_g = log_g.float().contiguous()
    if valid is not None:
        valid = valid.to(torch.float32).contiguous()
    pos = torch.as_tensor(pos, device=v.device).to(torch.int64).reshape(())
    cos, sin = _check_rope(cos, sin, B, T, D)
    sk, sv, sat = _check_sinks(sinks, B, H, D, DV)
    return torch.ops.linearize.window_decode_hedgehog(
        q, k, v, wq, wk, log_g, valid, ring["k"], ring["phi_k"], ring["v"], ring["log_g"], ring["valid"],
        S, z, pos, log_gamma, float(sm_scale), float(softcap or 0.0), cos, sin, sk, sv, sat)


def window_decode_hedgehog_ref(q, k, v, wq, wk, *, log_gamma, **kwargs):
    """Readable twin of :func:`fused_window_decode_hedgehog`: Hedgehog's features of q and of k (k and
    v repeated to the query heads), then :func:`window_decode_ref` (same returns; changes nothing;
    ``log_g`` per head [B, T, H] or per key channel [B, T, H, F], the ring's alike)."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32

    def phi(x, w):  # softmax([x W, -x W]) per head, as linearize.feature_maps.Hedgehog
        y = torch.einsum("bthd,hdp->bthp", x.to(dt), w.to(dt))
        return torch.softmax(torch.cat([y, -y], dim=-1), dim=-1)

    return window_decode_ref(q, phi(q, wq), k, phi(k, wk), v, gamma=torch.exp(log_gamma.to(dt)), **kwargs)


def window_decode_ref(q_sm, qf, k_sm, kf, v, *, log_g=None, valid=None, ring, state, pos, gamma, sm_scale,
                      softcap=None, sinks=None):
    """Readable PyTorch twin of :func:`window_decode` (one token at a time). Returns o (float64 for
    float64 inputs, else fp32), the new ring (a dict of copies) and the new (S, z); changes nothing."""
    dt = torch.float64 if qf.dtype == torch.float64 else torch.float32
    B, T, H, _ = q_sm.shape
    W1 = ring["k"].shape[1]
    ring = {n: t.clone() for n, t in ring.items()}
    S, z = state[0].to(dt).clone(), state[1].to(dt).clone()
    gamma = torch.as_tensor(gamma, dtype=dt, device=v.device).reshape(-1).expand(H)
    p0 = int(pos)
    rows = torch.arange(B, device=v.device)
    outs = []
    for t in range(T):
        keep = torch.ones(B, dtype=dt, device=v.device) if valid is None else valid[:, t].to(dt)
        lg = None if log_g is None else log_g[:, t].to(dt)  # (B, H[, F])
        # the window: the ring's slots and the token itself
        ks = torch.cat([ring["k"].to(dt), k_sm[:, t, None].to(dt)], dim=1)  # (B, W, H, D)
        vs = torch.cat([ring["v"].to(dt), v[:, t, None].to(dt)], dim=1)
        ok = torch.cat([ring["valid"].to(dt), keep[:, None]], dim=1) > 0  # (B, W)
        if sinks is not None:  # and the filled sinks outside the window: position <= p - W
            at = sinks["sink_at"].to(dt)
            ks = torch.cat([sinks["sink_k"].to(dt), ks], dim=1)
            vs = torch.cat([sinks["sink_v"].to(dt), vs], dim=1)
            ok = torch.cat([(at >= 0) & (at <= p0 + t - W1 - 1), ok], dim=1)
        a = torch.einsum("bhd,bwhd->bhw", q_sm[:, t].to(dt), ks) * sm_scale
        if softcap:
            a = softcap * torch.tanh(a / softcap)
        a = a.masked_fill(~ok[:, None, :], float("-inf"))
        m = a.amax(-1, keepdim=True)
        p = torch.exp(a - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
        num = torch.einsum("bhw,bwhd->bhd", p, vs)
        den = p.sum(-1)
        qd = qf[:, t].to(dt)
        if lg is not None:  # S(p-W) decayed to p: the valid gates in the window
            g_ring = ring["log_g"].to(dt) * ring["valid"].to(dt).view(B, W1, *[1] * (lg.dim() - 1))
            dsum = g_ring.sum(1) + lg * keep.view(B, *[1] * (lg.dim() - 1))
            qd = qd * torch.exp(dsum if dsum.dim() == 3 else dsum[..., None])
        num = num + gamma[None, :, None] * torch.einsum("bhf,bhfd->bhd", qd, S)
        den = den + gamma[None, :] * torch.einsum("bhf,bhf->bh", qd, z)
        outs.append(num / torch.where(den > 0, den, torch.ones_like(den))[..., None])
        # fold the evicted key (the ring's oldest, or the token itself when W = 1)
        if W1 > 0:
            slot = (p0 + t) % W1
            e_keep = ring["valid"][:, slot].to(dt)
            e_f, e_v = ring["phi_k"][:, slot].to(dt), ring["v"][:, slot].to(dt)
            e_lg = ring["log_g"][:, slot].to(dt) if lg is not None else None
        else:
            e_keep, e_f, e_v, e_lg = keep, kf[:, t].to(dt), v[:, t].to(dt), lg
        if e_lg is not None:
            g = torch.exp(e_lg * e_keep.view(B, *[1] * (e_lg.dim() - 1)))
            g = g if g.dim() == 3 else g[..., None]  # (B, H, F or 1)
            S, z = S * g[..., None], z * g
        e_f = e_f * e_keep[:, None, None]
        S = S + e_f[..., None] * e_v[:, :, None, :]
        z = z + e_f
        if W1 > 0:
            for name, x in (("k", k_sm), ("phi_k", kf), ("v", v)):
                ring[name][rows, slot] = x[:, t].to(ring[name].dtype)
            if log_g is not None:
                ring["log_g"][rows, slot] = log_g[:, t].to(ring["log_g"].dtype)
            ring["valid"][rows, slot] = keep.to(ring["valid"].dtype)
    return torch.stack(outs, dim=1), ring, (S, z)


# ----------------------------------------------------------------------------- chunked prefill


def window_prefill(q_sm, qf, k_sm, kf, v, *, log_g=None, valid=None, buf, state, gamma, sm_scale, sinks=None,
                   pos=None):
    """A long call of the window hybrid that continues from a cached state (a chunk of a chunked
    prefill): three kernel launches over the whole chunk, no loop over tokens.

    The timeline is the W-1 buffered keys followed by the T new tokens.  Token j reads the state
    at its key j-1 of the timeline (S(t-W), t = W-1+j) decayed to t: that is ordinary causal linear
    attention from the initial state over the keys [dummy, timeline 0..T-1] with the query
    phi(q_j) exp(cum_t - cum_{j-1}) at position j (the dummy, a zero key with no decay, lets token
    0 read the initial state alone); two unnormalized chunk-kernel passes give numerators and
    denominators, and their final states are the new (S, z).  The window kernel then runs over the
    timeline with its empty / padding keys masked out, adding the linear terms.

    Args: as :func:`window_decode`, with ``buf`` the W-1 buffered tensors in time order (oldest
    first; see ``window_decode``'s ``ring`` for names and shapes) and ``state`` (S, z) fp32 (not
    modified); ``sinks`` as :func:`window_decode`'s, with ``pos`` the absolute position of the first
    new token (the layer's token count).  No autograd.  Returns o [B, T, H, Dv] in v's dtype and the
    new (S, z) fp32.
    """
    B, T, H, D = q_sm.shape
    gamma = torch.as_tensor(gamma, device=v.device).float().reshape(-1).expand(H).contiguous()
    lg_buf = buf["log_g"] if log_g is not None else None
    sk, sv, sat = _check_sinks(sinks, B, H, D, v.shape[-1])
    if sinks is not None:
        pos = torch.as_tensor(pos, device=v.device).to(torch.int64).reshape(())
    o, S, z = torch.ops.linearize.window_prefill(q_sm, qf, k_sm, kf, v, log_g, valid, buf["k"], buf["phi_k"], buf["v"],
                                                 buf["valid"], lg_buf, state[0], state[1], gamma, float(sm_scale),
                                                 sk, sv, sat, pos if sinks is not None else None)
    return o, (S, z)


_PREFILL_BUF = ("k", "phi_k", "v", "valid", "log_g")


@torch.library.custom_op("linearize::window_prefill", mutates_args=())
def window_prefill_op(q_sm: torch.Tensor, qf: torch.Tensor, k_sm: torch.Tensor, kf: torch.Tensor, v: torch.Tensor,
                      log_g: torch.Tensor | None, valid: torch.Tensor | None, buf_k: torch.Tensor,
                      buf_phi_k: torch.Tensor, buf_v: torch.Tensor, buf_valid: torch.Tensor,
                      buf_log_g: torch.Tensor | None, S: torch.Tensor, z: torch.Tensor, gamma: torch.Tensor,
                      sm_scale: float, sink_k: torch.Tensor | None = None, sink_v: torch.Tensor | None = None,
                      sink_at: torch.Tensor | None = None,
                      pos: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`window_prefill` as a torch op (the buffer's tensors one by one, gamma one per head):
    returns o and the new (S, z), the cached state left as it was."""
    buf = dict(zip(_PREFILL_BUF, (buf_k, buf_phi_k, buf_v, buf_valid, buf_log_g)))
    sinks = None if sink_k is None else (sink_k, sink_v, sink_at, pos)
    o, (S1, z1) = _window_prefill(q_sm, qf, k_sm, kf, v, log_g, valid, buf, (S, z), gamma, sm_scale, sinks)
    return o, S1, z1


@window_prefill_op.register_fake
def _(q_sm, qf, k_sm, kf, v, log_g, valid, buf_k, buf_phi_k, buf_v, buf_valid, buf_log_g, S, z, gamma, sm_scale,
      sink_k=None, sink_v=None, sink_at=None, pos=None):
    B, T, H = q_sm.shape[:3]
    return (v.new_empty(B, T, H, v.shape[-1]), S.new_empty(S.shape, dtype=torch.float32),
            z.new_empty(z.shape, dtype=torch.float32))


def _window_prefill(q_sm, qf, k_sm, kf, v, log_g, valid, buf, state, gamma, sm_scale, sinks=None):
    from .chunk import chunk_num_den

    B, T, H, D = q_sm.shape
    F, DV = qf.shape[-1], v.shape[-1]
    W1 = buf["k"].shape[1]
    dev, dt = v.device, v.dtype
    # the timeline with one leading dummy row (a zero key with no decay, so token 0 reads the initial
    # state alone): built once, k_lin / v_lin are its first T+1 rows and the window reads the rest
    kv = torch.cat([buf["valid"].float(), torch.ones(B, T, device=dev) if valid is None else valid.float()], 1)  # (B, N)
    kv1 = torch.cat([kv.new_zeros(B, 1), kv], 1)[..., None, None]  # (B, N+1, 1, 1)
    K1 = torch.cat([qf.new_zeros(B, 1, H, F), buf["phi_k"].to(qf.dtype), kf.to(qf.dtype)], 1) * kv1.to(qf.dtype)
    V1 = torch.cat([v.new_zeros(B, 1, H, DV), buf["v"].to(dt), v], 1) * kv1.to(dt)
    q_shift = torch.cat([qf, qf.new_zeros(B, 1, H, F)], 1)  # position T only feeds the final state
    lg_lin = None
    if log_g is not None:
        LG = torch.cat([buf["log_g"].float(), log_g.float()], 1)
        LG = LG * (kv[..., None] if LG.dim() == 3 else kv[..., None, None])
        if LG.dim() == 4:
            raise ValueError("chunked prefill from a state on the kernels takes one gate per head "
                             "(decay='scalar'); per-channel gates run with LINEARIZE_KERNELS=torch")
        cum = torch.cat([torch.zeros_like(LG[:, :1]), LG.double().cumsum(1)], 1)  # cum[u + 1] = cum_u
        j = torch.arange(T, device=dev)
        decay = (cum[:, W1 + j + 1] - cum[:, j]).exp().float()  # exp(cum_{W1+j} - cum_{j-1})
        q_shift = torch.cat([qf * decay[..., None].to(qf.dtype), qf.new_zeros(B, 1, H, F)], 1)
        lg_lin = torch.cat([torch.zeros_like(LG[:, :1]), LG[:, :T]], 1).contiguous()
    k_lin, v_lin = K1[:, : T + 1], V1[:, : T + 1]
    S0, z0 = (x.float().contiguous() for x in state)
    q_shift, k_lin = q_shift.to(dt), k_lin.to(dt)  # the chunk kernels take one dtype (fp32 state either way)
    n, d, (S, z) = chunk_num_den(q_shift, k_lin, v_lin, log_g=lg_lin, initial_state=(S0, z0))  # one pass
    d = d.view(H, B, T + 1).permute(1, 2, 0)[..., None]  # (B, T+1, H, 1)
    o = _window_over_timeline(q_sm, k_sm, V1[:, 1:], buf["k"], kv, n[:, :T].reshape(B * T, H, DV).contiguous(),
                              d[:, :T, :, 0].reshape(B * T, H).contiguous(), gamma, sm_scale, sinks)
    return o.to(dt).contiguous(), (S, z)  # an op's output owns its storage


def _window_over_timeline(q_sm, k_sm, v_line, buf_k, valid_line, n_lin, d_lin, gamma, sm_scale, sinks):
    """The window kernel over each row's timeline, the W-1 buffered keys then the call's T (one launch):
    ``v_line`` (B, W-1+T, H, Dv) and ``valid_line`` (B, W-1+T) the timeline's values and key validity;
    the buffer's rows have no query (their outputs are dropped); ``n_lin``, ``d_lin`` the call's linear
    terms (B*T rows) or None; ``sinks`` (keys, values, positions, pos) with ``pos`` the absolute position
    of the call's first token, or None. Returns o [B, T, H, Dv] in q_sm's dtype."""
    from .window import window_fwd

    B, T, H, D = q_sm.shape
    W1, dt = buf_k.shape[1], q_sm.dtype
    N = W1 + T
    pack = lambda x: x.reshape(B * N, *x.shape[2:]).contiguous()  # noqa: E731
    qs = pack(torch.cat([q_sm.new_zeros(B, W1, H, D), q_sm], 1))
    ks = pack(torch.cat([buf_k.to(dt), k_sm.to(dt)], 1))
    lin_idx, cu = _timeline_rows(B, T, W1, q_sm.device)  # lin_idx is not read without linear terms
    o, _, _, _ = window_fwd(qs, ks, pack(v_line.to(dt)), n_lin, d_lin, gamma, lin_idx, cu, N, W1 + 1, float(sm_scale),
                            key_valid=pack(valid_line),
                            # the cache's sinks: timeline row t of the call is absolute position pos - W1 + t
                            sink_buf=None if sinks is None else (*sinks[:3], sinks[3] - W1))
    return o.view(B, N, H, -1)[:, W1:]


def window_softmax_prefill(q_sm, k_sm, v, *, buf, sm_scale, sinks=None, pos=None):
    """The softmax window alone (no linear terms) of a call that continues from cached keys: a chunk of
    a chunked prefill, or a later turn's prompt, for Gated DeltaNet's window (``linearize/gdn.py``),
    whose state runs on its own kernels. One window-kernel launch over the timeline [the W-1 buffered
    keys; the call's T], the buffer's empty slots masked out, the buffer's rows without queries.

    Args: q_sm, k_sm [B, T, H, D] and v [B, T, H, Dv] (keys and values per query head, RoPE applied; the
    kernel runs in q_sm's dtype, the rest is cast to it); ``buf``: "k", "v", "valid" of the W-1 newest earlier tokens in time order (oldest first;
    empty slots invalid); ``sinks``/``pos`` as :func:`window_prefill`'s. Every token of the call is
    real (no padding). No autograd. Returns o [B, T, H, Dv] in v's dtype. Its PyTorch twin is the
    window part of ``linearize.attention.linear_attention`` with ``prefix`` (``GatedDeltaNet._window_math``).
    """
    B, T, H, D = q_sm.shape
    sk, sv, sat = _check_sinks(sinks, B, H, D, v.shape[-1])
    if sinks is not None:
        pos = torch.as_tensor(pos, device=v.device).to(torch.int64).reshape(())
    return torch.ops.linearize.window_softmax_prefill(q_sm, k_sm, v, buf["k"], buf["v"], buf["valid"], float(sm_scale),
                                                      sk, sv, sat, pos if sinks is not None else None)


@torch.library.custom_op("linearize::window_softmax_prefill", mutates_args=())
def window_softmax_prefill_op(q_sm: torch.Tensor, k_sm: torch.Tensor, v: torch.Tensor, buf_k: torch.Tensor,
                              buf_v: torch.Tensor, buf_valid: torch.Tensor, sm_scale: float,
                              sink_k: torch.Tensor | None = None, sink_v: torch.Tensor | None = None,
                              sink_at: torch.Tensor | None = None, pos: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`window_softmax_prefill` as a torch op (the buffer's tensors one by one)."""
    B, T, H = q_sm.shape[:3]
    dt = q_sm.dtype
    valid = torch.cat([buf_valid.float(), buf_valid.new_ones(B, T, dtype=torch.float32)], 1)
    o = _window_over_timeline(q_sm, k_sm, torch.cat([buf_v.to(dt), v.to(dt)], 1), buf_k, valid, None, None,
                              q_sm.new_zeros(H, dtype=torch.float32), sm_scale,
                              None if sink_k is None else (sink_k, sink_v, sink_at, pos))
    return o.to(v.dtype).contiguous()


@window_softmax_prefill_op.register_fake
def _(q_sm, k_sm, v, buf_k, buf_v, buf_valid, sm_scale, sink_k=None, sink_v=None, sink_at=None, pos=None):
    return v.new_empty(v.shape)


@functools.lru_cache(maxsize=64)
def _timeline_rows(B: int, T: int, W1: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For window_prefill's packed timelines of N = W1 + T rows: each row's row of the linear
    outputs (token j at W1 + j reads row b * T + j, the buffer's rows -1) and the sequences'
    offsets, int32. Cached per shape and device: a chunked prefill asks for the same ones in every
    layer and chunk, and building them is nine small launches."""
    N = W1 + T
    r = torch.arange(N, device=device)
    row = (torch.arange(B, device=device) * T)[:, None] + r[None] - W1
    lin_idx = torch.where(r[None] >= W1, row, -1).reshape(-1).to(torch.int32)
    return lin_idx, torch.arange(0, (B + 1) * N, N, device=device, dtype=torch.int32)


# ----------------------------------------------------------------------------- the softmax window's decode step


@triton.jit
def _window_softmax_decode_kernel(
    q, k, v, cos, sin, valid, bk, bv, bvalid, snk, snv, snat, pos_ptr, extra, gamma, o, done,
    sm_scale, softcap, sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, sc_b, se_b, se_h,
    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, W1: tl.constexpr,
    BD: tl.constexpr, BDV: tl.constexpr, BW: tl.constexpr, ROT: tl.constexpr, VALID: tl.constexpr,
    SOFTCAP: tl.constexpr, SINKS: tl.constexpr, BSN: tl.constexpr, EXTRA: tl.constexpr, PDL: tl.constexpr,
):
    # One program per (batch row, query head); it owns head h's slices of the buffer and the sinks, so it
    # shifts them in place. The row's flags (buffer validity, sink positions) are shared by the heads:
    # every program reads them, and the last of the row's programs to finish reading writes their new row
    # in place (a hand-off through the counter done[b], which that program sets back to 0).
    i_bh = tl.program_id(0)
    wait_then_release(PDL)  # kernels/pdl.py: nothing read or written before
    i_b, i_h = i_bh // H, i_bh % H
    i_hk = i_h // (H // HKV)  # GQA: the key/value head this query head reads
    o_d, o_v, o_w = tl.arange(0, BD), tl.arange(0, BDV), tl.arange(0, BW)
    m_d, m_v, m_w = o_d < D, o_v < DV, o_w < W1
    pos = tl.load(pos_ptr)
    p_q = q + i_b.to(tl.int64) * sq_b + i_h * sq_h
    p_k = k + i_b.to(tl.int64) * sk_b + i_hk * sk_h
    b_q = tl.load(p_q + o_d, mask=m_d, other=0.).to(tl.float32)
    b_kc = tl.load(p_k + o_d, mask=m_d, other=0.).to(tl.float32)
    b_vc = tl.load(v + i_b.to(tl.int64) * sv_b + i_hk * sv_h + o_v, mask=m_v, other=0.).to(tl.float32)
    if ROT > 0:  # q and k arrive before RoPE; the buffer and the sinks keep the rotated key
        b_q = _rotary(p_q, b_q, o_d, m_d, cos + i_b * sc_b, sin + i_b * sc_b, ROT)
        b_kc = _rotary(p_k, b_kc, o_d, m_d, cos + i_b * sc_b, sin + i_b * sc_b, ROT)
    keep = pos.to(tl.float32) * 0. + 1.
    if VALID:
        keep = tl.load(valid + i_b).to(tl.float32)
    # the token's own key, always (a pad token's query reads itself alone: finite, and zeroed below)
    a_c = tl.sum(b_q * b_kc, axis=0) * sm_scale
    if SOFTCAP:
        a_c = _softcap(a_c, softcap)
    rb = i_b.to(tl.int64) * W1
    r_off = (rb + o_w) * H + i_h  # slot w of head h
    raw_k = tl.load(bk + r_off[:, None] * D + o_d[None, :], mask=m_w[:, None] & m_d[None, :], other=0.)
    raw_v = tl.load(bv + r_off[:, None] * DV + o_v[None, :], mask=m_w[:, None] & m_v[None, :], other=0.)
    b_ok = tl.load(bvalid + rb + o_w, mask=m_w, other=0.).to(tl.float32)
    a = tl.sum(raw_k.to(tl.float32) * b_q[None, :], axis=1) * sm_scale
    if SOFTCAP:
        a = _softcap(a, softcap)
    a = tl.where(m_w & (b_ok > 0), a, float("-inf"))
    m = tl.maximum(tl.max(a, axis=0), a_c)
    if SINKS > 0:  # a filled sink outside the window (position <= p - W) joins the softmax
        o_n = tl.arange(0, BSN)
        m_n = o_n < SINKS
        b_nk, b_nv, b_nat = _load_sinks(snk, snv, snat, i_b, i_h, o_d, m_d, o_v, m_v, H, D, DV, SINKS, BSN)
        a_n = tl.sum(b_nk * b_q[None, :], axis=1) * sm_scale
        if SOFTCAP:
            a_n = _softcap(a_n, softcap)
        a_n = tl.where(m_n & (b_nat >= 0) & (b_nat <= (pos - W1 - 1).to(tl.float32)), a_n, float("-inf"))
        m = tl.maximum(m, tl.max(a_n, axis=0))
    p_c = tl.exp(a_c - m)
    p = tl.exp(a - m)
    num = p_c * b_vc + tl.sum(p[:, None] * raw_v.to(tl.float32), axis=0)
    den = p_c + tl.sum(p, axis=0)
    if SINKS > 0:
        p_n = tl.exp(a_n - m)
        num += tl.sum(p_n[:, None] * b_nv, axis=0)
        den += tl.sum(p_n, axis=0)
    out = num / den * keep
    if EXTRA:  # o + gamma_h * extra: Gated DeltaNet's output beside its window
        g_h = tl.load(gamma + i_h).to(tl.float32)
        b_e = tl.load(extra + i_b.to(tl.int64) * se_b + i_h * se_h + o_v, mask=m_v, other=0.).to(tl.float32)
        out += g_h * b_e
    tl.store(o + i_bh.to(tl.int64) * DV + o_v, out.to(o.dtype.element_ty), mask=m_v)

    # the buffer moves one slot toward the front (the oldest key leaves) and the token takes the last slot
    tl.debug_barrier()  # every warp of the program has read the slots before any is overwritten
    shift = m_w & (o_w >= 1)
    tl.store(bk + (r_off - H)[:, None] * D + o_d[None, :], raw_k, mask=shift[:, None] & m_d[None, :])
    tl.store(bv + (r_off - H)[:, None] * DV + o_v[None, :], raw_v, mask=shift[:, None] & m_v[None, :])
    last = (rb + W1 - 1) * H + i_h
    tl.store(bk + last * D + o_d, b_kc.to(bk.dtype.element_ty), mask=m_d)
    tl.store(bv + last * DV + o_v, b_vc.to(bv.dtype.element_ty), mask=m_v)
    if SINKS > 0:  # a real token takes the first empty sink slot, if any
        filled = tl.sum((b_nat >= 0).to(tl.int32), axis=0)
        take = tl.where(keep > 0, filled, SINKS) < SINKS  # (int compare: a vector mask in every backend)
        s_off = (i_b.to(tl.int64) * SINKS + filled) * H + i_h
        tl.store(snk + s_off * D + o_d, b_kc.to(snk.dtype.element_ty), mask=m_d & ((o_d * 0 + take) > 0))
        tl.store(snv + s_off * DV + o_v, b_vc.to(snv.dtype.element_ty), mask=m_v & ((o_v * 0 + take) > 0))
    # every warp read the row's flags before the barrier above; the counter's release orders those reads
    # before it, so the program that counts H has the row to itself
    n = tl.atomic_add(done + i_b, 1, sem="acq_rel")
    last_w = (o_w * 0 + n) == H - 1  # (int compare: a vector mask in every backend)
    tl.store(bvalid + rb + o_w - 1, b_ok, mask=shift & last_w)
    tl.store(bvalid + rb + W1 - 1 + 0 * o_w, keep + 0. * b_ok, mask=(o_w == 0) & last_w)
    if SINKS > 0:
        new_at = tl.where(((o_n * 0 + take) > 0) & (o_n == filled), pos.to(tl.float32), b_nat)
        tl.store(snat + i_b.to(tl.int64) * SINKS + o_n, new_at, mask=m_n & ((o_n * 0 + n) == H - 1))
    tl.store(done + i_b + 0 * o_w, 0 * o_w, mask=(o_w == 0) & last_w)  # ready for the next launch


_SOFTMAX_DECODE_MUTATES = ("buf_k", "buf_v", "buf_valid", "sink_k", "sink_v", "sink_at")
_HANDOFF: dict = {}  # (device, B): the zeroed int32 counters of window_softmax_decode's hand-off, kept for graphs


def _handoff_counters(B: int, device: torch.device) -> torch.Tensor:
    """One int32 counter per batch row, zero between launches (the kernel's last program of a row sets it
    back); allocated once per device and batch size, so a captured CUDA graph keeps its address. Launches
    on one stream follow each other; two streams decoding the same batch size at once would share it."""
    key = (str(device), B)
    if key not in _HANDOFF:
        _HANDOFF[key] = torch.zeros(B, dtype=torch.int32, device=device)
    return _HANDOFF[key]


@torch.library.custom_op("linearize::window_softmax_decode", mutates_args=_SOFTMAX_DECODE_MUTATES)
def window_softmax_decode_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
    valid: torch.Tensor | None, buf_k: torch.Tensor, buf_v: torch.Tensor, buf_valid: torch.Tensor,
    sink_k: torch.Tensor | None, sink_v: torch.Tensor | None, sink_at: torch.Tensor | None, pos: torch.Tensor,
    extra: torch.Tensor | None, gamma: torch.Tensor | None, sm_scale: float, softcap: float,
) -> torch.Tensor:
    """:func:`window_softmax_decode` as a torch op: moves the buffer (keys, values, validity) and fills the
    sinks (keys, values, positions) in place; returns o."""
    B, _, H, D = q.shape
    HKV, DV, W1 = k.shape[2], v.shape[-1], buf_k.shape[1]
    o = torch.empty(B, 1, H, DV, device=v.device, dtype=v.dtype)
    n = 0 if sink_k is None else sink_k.shape[1]
    on = pdl.enabled(q)
    _window_softmax_decode_kernel[(B * H,)](
        q, k, v, cos, sin, valid, buf_k, buf_v, buf_valid, sink_k, sink_v, sink_at, pos, extra, gamma, o,
        _handoff_counters(B, v.device), sm_scale, softcap, q.stride(0), q.stride(2), k.stride(0), k.stride(2), v.stride(0), v.stride(2),
        0 if cos is None or cos.shape[0] == 1 else cos.stride(0),
        0 if extra is None else extra.stride(0), 0 if extra is None else extra.stride(2),
        H=H, HKV=HKV, D=D, DV=DV, W1=W1, BD=triton.next_power_of_2(D), BDV=triton.next_power_of_2(DV),
        BW=triton.next_power_of_2(W1), ROT=0 if cos is None else cos.shape[-1], VALID=valid is not None,
        SOFTCAP=softcap > 0, SINKS=n, BSN=triton.next_power_of_2(max(n, 1)), EXTRA=extra is not None, PDL=on,
        num_warps=4, **pdl.launch_options(on))
    return o


@window_softmax_decode_op.register_fake
def _(q, k, v, cos, sin, valid, buf_k, buf_v, buf_valid, sink_k, sink_v, sink_at, pos, extra, gamma, sm_scale,
      softcap):
    B, _, H, _ = q.shape
    return v.new_empty(B, 1, H, v.shape[-1])


def window_softmax_decode(q, k, v, *, buf, pos, sm_scale, softcap=None, cos=None, sin=None, valid=None, sinks=None,
                          extra=None, gamma=None):
    """A decode step of a softmax window over the newest W-1 keys kept in time order (Gated DeltaNet's
    window, ``linearize/gdn.py``), in one launch: RoPE, the softmax over the buffer, the token itself and
    the sinks outside the window, the output beside a second one, and the cache's update.

    Args:
        q [B, 1, H, D], k [B, 1, Hkv, D], v [B, 1, Hkv, Dv]: the token's query, key and value before RoPE
            (unit stride along D; any other strides: views of a fused projection are read in place). GQA:
            query head h reads key head h // (H / Hkv), and the buffer keeps the key per query head.
        buf: "k" [B, W-1, H, D], "v" [B, W-1, H, Dv] and "valid" [B, W-1] fp32, oldest first, contiguous and
            updated in place: every slot moves one toward the front and the token takes the last.
        pos: the token's absolute position (the layer's token count; an int or a 0-dim tensor).
        cos, sin: [B or 1, 1, R] RoPE of the token (rotate-half on the first R <= D dims), or None.
        valid: [B, 1] (0 = padding: the token's output is 0, it still takes its slot, marked invalid), or None.
        sinks: optional dict sink_k [B, S, H, D], sink_v [B, S, H, Dv] and sink_at [B, S] fp32 (positions, -1
            empty), contiguous; a real token fills the first empty slot in place; the token reads the filled
            sinks at positions <= pos - W.
        extra [B, 1, H, Dv] and gamma [H]: optional; the output is then o + gamma_h * extra.

    Returns:
        o [B, 1, H, Dv] in v's dtype. No autograd (decode path). :func:`window_softmax_decode_ref` is its
        PyTorch twin.
    """
    B, T, H, D = q.shape
    W1 = buf["k"].shape[1]
    HKV, DV = k.shape[2], v.shape[-1]
    if T != 1 or k.shape[:2] != (B, 1) or v.shape[:3] != (B, 1, HKV) or H % HKV:
        raise ValueError(f"window_softmax_decode takes one token: q [B, 1, H, D], k [B, 1, Hkv, D], v [B, 1, Hkv, Dv] "
                         f"with Hkv dividing H; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if (W1 < 1 or tuple(buf["k"].shape) != (B, W1, H, D) or tuple(buf["v"].shape) != (B, W1, H, DV)
            or tuple(buf["valid"].shape) != (B, W1) or buf["valid"].dtype != torch.float32
            or not all(buf[n].is_contiguous() for n in ("k", "v", "valid"))):
        raise ValueError(f"buf must hold contiguous k [B, W-1, H, D] = {(B, W1, H, D)}, v [B, W-1, H, Dv] and fp32 "
                         f"valid [B, W-1], W >= 2 (all updated in place); got {tuple(buf['k'].shape)}, "
                         f"{tuple(buf['v'].shape)}, {tuple(buf['valid'].shape)} {buf['valid'].dtype}")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    cos, sin = _check_rope(cos, sin, B, 1, D)
    sk, sv, sat = _check_sinks(sinks, B, H, D, DV)
    if sinks is not None and not (all(sinks[n].is_contiguous() for n in ("sink_k", "sink_v", "sink_at"))
                                  and sinks["sink_at"].dtype == torch.float32):
        raise ValueError("sinks' sink_k, sink_v and sink_at are filled in place: pass contiguous tensors, sink_at fp32")
    if (extra is None) != (gamma is None):
        raise ValueError("pass extra and gamma together (or neither)")
    if extra is not None and (tuple(extra.shape) != (B, 1, H, DV) or extra.stride(-1) != 1):
        raise ValueError(f"extra must be [B, 1, H, Dv] = {(B, 1, H, DV)} with unit stride along Dv; got "
                         f"{tuple(extra.shape)}")
    if valid is not None:
        valid = valid.reshape(B).to(torch.float32).contiguous()
    pos = torch.as_tensor(pos, device=v.device).to(torch.int64).reshape(())
    return torch.ops.linearize.window_softmax_decode(
        q, k, v, cos, sin, valid, buf["k"], buf["v"], buf["valid"], sk, sv, sat, pos, extra,
        None if gamma is None else gamma.reshape(H).contiguous(), float(sm_scale), float(softcap or 0.0))


def window_softmax_decode_ref(q, k, v, *, buf, pos, sm_scale, softcap=None, cos=None, sin=None, valid=None,
                              sinks=None, extra=None, gamma=None):
    """Readable PyTorch twin of :func:`window_softmax_decode`: returns o (fp32, or float64 for float64
    inputs), the new buffer (a dict of copies: k, v, valid) and the new sinks (copies, or None); changes
    nothing."""
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, _, H, D = q.shape
    rep = H // k.shape[2]
    p = int(pos)
    W1 = buf["k"].shape[1]
    qt, kt, vt = q[:, 0].to(dt), k[:, 0].to(dt), v[:, 0].to(dt)
    if cos is not None:  # rotate-half RoPE on the first R dims
        R = cos.shape[-1]

        def rope(x):
            c, s = cos[:, 0, None].to(dt), sin[:, 0, None].to(dt)  # (B or 1, 1, R)
            x1, x2 = x[..., : R // 2], x[..., R // 2: R]
            return torch.cat([x[..., :R] * c + torch.cat([-x2, x1], -1) * s, x[..., R:]], -1)

        qt, kt = rope(qt), rope(kt)
    kt, vt = kt.repeat_interleave(rep, dim=1), vt.repeat_interleave(rep, dim=1)  # (B, H, D): per query head
    keep = torch.ones(B, dtype=dt, device=q.device) if valid is None else valid.reshape(B).to(dt)
    keys = torch.cat([buf["k"].to(dt), kt[:, None]], 1)  # (B, W, H, D): the buffer, then the token
    values = torch.cat([buf["v"].to(dt), vt[:, None]], 1)
    ok = torch.cat([buf["valid"] > 0, torch.ones(B, 1, dtype=torch.bool, device=q.device)], 1)
    if sinks is not None:  # the filled sinks outside the window: position <= p - W
        at = sinks["sink_at"]
        keys = torch.cat([sinks["sink_k"].to(dt), keys], 1)
        values = torch.cat([sinks["sink_v"].to(dt), values], 1)
        ok = torch.cat([(at >= 0) & (at <= p - W1 - 1), ok], 1)
    a = torch.einsum("bhd,bnhd->bhn", qt, keys) * sm_scale
    if softcap:
        a = softcap * torch.tanh(a / softcap)
    o = a.masked_fill(~ok[:, None], float("-inf")).softmax(-1)
    o = torch.einsum("bhn,bnhd->bhd", o, values) * keep[:, None, None]
    if extra is not None:
        o = o + gamma.to(dt)[None, :, None] * extra[:, 0].to(dt)
    new_buf = {"k": torch.cat([buf["k"], kt[:, None].to(buf["k"].dtype)], 1)[:, 1:],
               "v": torch.cat([buf["v"], vt[:, None].to(buf["v"].dtype)], 1)[:, 1:],
               "valid": torch.cat([buf["valid"].float(), keep[:, None].float()], 1)[:, 1:]}
    new_sinks = None
    if sinks is not None:
        new_sinks = {n: t.clone() for n, t in sinks.items()}
        for b in range(B):
            filled = int((sinks["sink_at"][b] >= 0).sum())
            if keep[b] > 0 and filled < sinks["sink_at"].shape[1]:
                new_sinks["sink_k"][b, filled] = kt[b].to(sinks["sink_k"].dtype)
                new_sinks["sink_v"][b, filled] = vt[b].to(sinks["sink_v"].dtype)
                new_sinks["sink_at"][b, filled] = float(p)
    return o[:, None], new_buf, new_sinks
