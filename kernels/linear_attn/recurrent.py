"""Fused recurrent step of normalized feature-map linear attention (decode, T = 1 .. ~16).

One program owns one (batch, head) and a block of value columns; it loads its slice of the
fp32 state once, runs the T steps in registers and writes the state back in place.  The
normalizer state z is needed whole by every program, so when the value dim is split over
several programs the new z goes to a scratch buffer first (a program could otherwise read a z
that another one already advanced); with one program per head it is written in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Largest state tile (F * BV fp32 elements) one program carries.
MAX_TILE = 16384


@triton.jit
def _recurrent_kernel(
    q, k, v, lg, S, z, z_out, o, T, eps,
    H: tl.constexpr, F: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, NORMALIZE: tl.constexpr,
):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < F, o_v < DV
    m_s = m_k[:, None] & m_v[None, :]
    p_s = S + i_bh.to(tl.int64) * F * DV + o_k[:, None] * DV + o_v[None, :]
    b_s = tl.load(p_s, mask=m_s, other=0.).to(tl.float32)
    b_z = tl.load(z + i_bh * F + o_k, mask=m_k, other=0.).to(tl.float32)
    for t in range(0, T):
        row = (i_b.to(tl.int64) * T + t) * H + i_h
        b_q = tl.load(q + row * F + o_k, mask=m_k, other=0.).to(tl.float32)
        b_k = tl.load(k + row * F + o_k, mask=m_k, other=0.).to(tl.float32)
        b_v = tl.load(v + row * DV + o_v, mask=m_v, other=0.).to(tl.float32)
        if GATE:
            g = tl.exp(tl.load(lg + row).to(tl.float32))
            b_s = b_s * g
            b_z = b_z * g
        b_s += b_k[:, None] * b_v[None, :]
        b_z += b_k
        b_o = tl.sum(b_q[:, None] * b_s, axis=0)
        if NORMALIZE:
            b_o = b_o / (tl.sum(b_q * b_z, axis=0) + eps)
        tl.store(o + row * DV + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    tl.store(p_s, b_s, mask=m_s)
    if i_v == 0:
        tl.store(z_out + i_bh * F + o_k, b_z, mask=m_k)


@torch.no_grad()
def fused_recurrent_linear_attn(q, k, v, *, log_g=None, normalize=True, eps=1e-6, state):
    """Run T (small) recurrent steps and update ``state`` in place.

    Args:
        q, k: [B, T, H, F] feature-mapped; v: [B, T, H, Dv]; log_g: optional [B, T, H] (<= 0).
        state: (S [B, H, F, Dv], z [B, H, F]), contiguous fp32, updated in place.

    Returns:
        o [B, T, H, Dv] in v's dtype.  No autograd (decode path).
    """
    S, z = state
    B, T, H, F = q.shape
    DV = v.shape[-1]
    if S.dtype != torch.float32 or z.dtype != torch.float32 or not (S.is_contiguous() and z.is_contiguous()):
        raise ValueError("state must be contiguous fp32 tensors (S [B, H, F, Dv], z [B, H, F])")
    if S.shape != (B, H, F, DV) or z.shape != (B, H, F):
        raise ValueError(f"state shapes {tuple(S.shape)}, {tuple(z.shape)} do not match q {tuple(q.shape)}, "
                         f"v {tuple(v.shape)}")
    q, k, v = (x.contiguous() for x in (q, k, v))
    if log_g is not None:
        log_g = log_g.float().contiguous()
    BK = triton.next_power_of_2(F)
    BV = min(triton.next_power_of_2(DV), max(16, MAX_TILE // BK))
    if B * H >= 1024:
        # Enough heads to fill the GPU twice over with smaller tiles: split the value dim.
        BV = min(BV, 64)
    NV = triton.cdiv(DV, BV)
    z_out = z if NV == 1 else torch.empty_like(z)
    o = torch.empty_like(v)
    num_warps = 4 if BK * BV <= 4096 else 8
    _recurrent_kernel[(NV, B * H)](q, k, v, log_g, S, z, z_out, o, T, float(eps), H=H, F=F, DV=DV,
                                   BK=BK, BV=BV, GATE=log_g is not None, NORMALIZE=normalize,
                                   num_warps=num_warps)
    if NV > 1:
        z.copy_(z_out)
    return o
