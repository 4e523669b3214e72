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

from .. import pdl
from ..pdl import wait_then_release

# Largest state tile (F * BV fp32 elements) one program carries.
MAX_TILE = 16384
# Warps per program of the fused Hedgehog decode kernel: None picks 4 up to a [128, 64] state tile (4
# beat 8 at every benchmark shape, H200 2026-11-25: docs/decode_kernels.md); the benchmark
# scripts/bench_decode_kernels.py sets it to sweep.
NUM_WARPS: int | None = None


@triton.jit
def _recurrent_kernel(
    q, k, v, lg, S, z, z_out, o, T, eps,
    H: tl.constexpr, F: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, NORMALIZE: tl.constexpr, PDL: tl.constexpr,
):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    wait_then_release(PDL)  # kernels/pdl.py: nothing read or written before
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
        if GATE == 1:  # one gate per head and step
            g = tl.exp(tl.load(lg + row).to(tl.float32))
            b_s = b_s * g
            b_z = b_z * g
        if GATE == 2:  # one gate per key channel (GLA's form): row f of the state decays by g_f
            g_f = tl.exp(tl.load(lg + row * F + o_k, mask=m_k, other=0.).to(tl.float32))
            b_s = b_s * g_f[:, None]
            b_z = b_z * g_f
        b_s += b_k[:, None] * b_v[None, :]
        b_z += b_k
        b_o = tl.sum(b_q[:, None] * b_s, axis=0)
        if NORMALIZE:
            b_o = b_o / (tl.sum(b_q * b_z, axis=0) + eps)
        tl.store(o + row * DV + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    tl.store(p_s, b_s, mask=m_s)
    if i_v == 0:
        tl.store(z_out + i_bh * F + o_k, b_z, mask=m_k)


def fused_recurrent_linear_attn(q, k, v, *, log_g=None, normalize=True, eps=1e-6, state):
    """Run T (small) recurrent steps and update ``state`` in place.

    Args:
        q, k: [B, T, H, F] feature-mapped; v: [B, T, H, Dv]; log_g: optional, <= 0: [B, T, H] (a gate
            per head and step) or [B, T, H, F] (per key channel, ``decay='channel'``).
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
        if log_g.shape not in ((B, T, H), (B, T, H, F)):
            raise ValueError(f"log_g shape {tuple(log_g.shape)} is neither {(B, T, H)} (per head) nor "
                             f"{(B, T, H, F)} (per key channel)")
        log_g = log_g.float().contiguous()
    return torch.ops.linearize.recurrent_linear_attn(q, k, v, log_g, S, z, normalize, float(eps))


@torch.library.custom_op("linearize::recurrent_linear_attn", mutates_args=("S", "z"))
def recurrent_linear_attn_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_g: torch.Tensor | None,
                             S: torch.Tensor, z: torch.Tensor, normalize: bool, eps: float) -> torch.Tensor:
    """The decode step as a torch op: advances (S, z) in place and returns o (see
    :func:`fused_recurrent_linear_attn`, which checks the arguments)."""
    B, T, H, F = q.shape
    DV = v.shape[-1]
    BK = triton.next_power_of_2(F)
    BV = min(triton.next_power_of_2(DV), max(16, MAX_TILE // BK))
    if B * H >= 1024:
        # Enough heads to fill the GPU twice over with smaller tiles: split the value dim.
        BV = min(BV, 64)
    NV = triton.cdiv(DV, BV)
    z_out = z if NV == 1 else torch.empty_like(z)
    o = torch.empty_like(v)
    num_warps = 4 if BK * BV <= 4096 else 8
    on = pdl.enabled(q)
    _recurrent_kernel[(NV, B * H)](q, k, v, log_g, S, z, z_out, o, T, eps, H=H, F=F, DV=DV,
                                   BK=BK, BV=BV, GATE=0 if log_g is None else log_g.dim() - 2, NORMALIZE=normalize,
                                   PDL=on, num_warps=num_warps, **pdl.launch_options(on))
    if NV > 1:
        z.copy_(z_out)
    return o


@recurrent_linear_attn_op.register_fake
def _(q, k, v, log_g, S, z, normalize, eps):
    return torch.empty_like(v)


# ----------------------------------------------------------------------------- Hedgehog, fused


@triton.jit
def _hedgehog_features(x, w_ptr, o_d, m_d, o_k, m_k, D: tl.constexpr, P: tl.constexpr):
    """phi(x) = softmax([x W, -x W]) over F = 2P features, for one head: x [BD] fp32, W [D, P].
    Lane f of the [BK] result holds feature f (column f mod P, sign + for f < P, - after)."""
    col = tl.where(o_k < P, o_k, o_k - P)
    w = tl.load(w_ptr + o_d[:, None] * P + col[None, :], mask=m_d[:, None] & m_k[None, :], other=0.).to(tl.float32)
    y = tl.sum(x[:, None] * w, axis=0)
    y = tl.where(o_k < P, y, -y)
    y = tl.where(m_k, y, float("-inf"))
    e = tl.exp(y - tl.max(y, axis=0))
    return e / tl.sum(e, axis=0)


@triton.jit
def _rotary(p, x, o_d, m_d, c, s, ROT: tl.constexpr):
    """Rotate-half RoPE (as transformers' ``apply_rotary_pos_emb``) on the first ROT dims of one
    head's vector x [BD] (fp32), read at ``p``; c, s: that token's cos and sin rows."""
    HALF: tl.constexpr = ROT // 2
    m_r = o_d < ROT
    xp = tl.load(p + tl.where(o_d < HALF, o_d + HALF, o_d - HALF), mask=m_r & m_d, other=0.).to(tl.float32)
    cos = tl.load(c + o_d, mask=m_r, other=1.).to(tl.float32)
    sin = tl.load(s + o_d, mask=m_r, other=0.).to(tl.float32)
    return x * cos + tl.where(o_d < HALF, -xp, xp) * sin


@triton.jit
def _hedgehog_recurrent_kernel(
    q, k, v, wq, wk, lg, valid, S, z, z_out, o, T, eps, cos, sin,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sc_b, sc_t,
    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, P: tl.constexpr, DV: tl.constexpr,
    BD: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr, VALID: tl.constexpr,
    ROT: tl.constexpr, PDL: tl.constexpr,
):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    wait_then_release(PDL)  # kernels/pdl.py: nothing read or written before
    i_b, i_h = i_bh // H, i_bh % H
    i_hk = i_h // (H // HKV)  # GQA: the key/value head this query head reads
    F: tl.constexpr = 2 * P
    o_d, o_k = tl.arange(0, BD), tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_d, m_k, m_v = o_d < D, o_k < F, o_v < DV
    m_s = m_k[:, None] & m_v[None, :]
    p_s = S + i_bh.to(tl.int64) * F * DV + o_k[:, None] * DV + o_v[None, :]
    b_s = tl.load(p_s, mask=m_s, other=0.).to(tl.float32)
    b_z = tl.load(z + i_bh * F + o_k, mask=m_k, other=0.).to(tl.float32)
    for t in range(0, T):
        bt = i_b.to(tl.int64) * T + t
        # q, k, v may be strided views (heads of one fused projection output): strides per row,
        # token and head, the last dim contiguous
        p_q = q + i_b.to(tl.int64) * sq_b + t * sq_t + i_h * sq_h
        p_k = k + i_b.to(tl.int64) * sk_b + t * sk_t + i_hk * sk_h
        b_q = tl.load(p_q + o_d, mask=m_d, other=0.).to(tl.float32)
        b_kx = tl.load(p_k + o_d, mask=m_d, other=0.).to(tl.float32)
        b_v = tl.load(v + i_b.to(tl.int64) * sv_b + t * sv_t + i_hk * sv_h + o_v, mask=m_v, other=0.).to(tl.float32)
        if ROT > 0:  # RoPE in registers: q and k arrive straight from the projection GEMM
            c_t = cos + i_b * sc_b + t * sc_t
            s_t = sin + i_b * sc_b + t * sc_t
            b_q = _rotary(p_q, b_q, o_d, m_d, c_t, s_t, ROT)
            b_kx = _rotary(p_k, b_kx, o_d, m_d, c_t, s_t, ROT)
        f_q = _hedgehog_features(b_q, wq + i_h * D * P, o_d, m_d, o_k, m_k, D, P)
        f_k = _hedgehog_features(b_kx, wk + i_h * D * P, o_d, m_d, o_k, m_k, D, P)
        keep = 1.
        if VALID:  # a pad token writes nothing and does not decay the state
            keep = tl.load(valid + bt).to(tl.float32)
        if GATE == 1:  # one gate per head and step
            g = tl.exp(tl.load(lg + bt * H + i_h).to(tl.float32) * keep)
            b_s = b_s * g
            b_z = b_z * g
        if GATE == 2:  # one gate per key channel (GLA's form): row f of the state decays by g_f
            g_f = tl.exp(tl.load(lg + (bt * H + i_h) * F + o_k, mask=m_k, other=0.).to(tl.float32) * keep)
            b_s = b_s * g_f[:, None]
            b_z = b_z * g_f
        f_k = f_k * keep
        b_s += f_k[:, None] * b_v[None, :]
        b_z += f_k
        b_o = tl.sum(f_q[:, None] * b_s, axis=0) / (tl.sum(f_q * b_z, axis=0) + eps)
        tl.store(o + (bt * H + i_h) * DV + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    tl.store(p_s, b_s, mask=m_s)
    if i_v == 0:
        tl.store(z_out + i_bh * F + o_k, b_z, mask=m_k)


def _check_rope(cos, sin, B: int, T: int, D: int):
    """The decode kernels' optional RoPE inputs, checked and made contiguous."""
    if (cos is None) != (sin is None):
        raise ValueError("pass cos and sin together (or neither: q and k already rotated)")
    if cos is None:
        return None, None
    if (cos.shape != sin.shape or cos.dim() != 3 or cos.shape[0] not in (1, B) or cos.shape[1] != T
            or cos.shape[-1] % 2 or cos.shape[-1] > D):
        raise ValueError(f"cos and sin must be [B or 1, T, R] with an even R <= head dim {D}; got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    return cos.contiguous(), sin.contiguous()


def fused_recurrent_hedgehog(q, k, v, wq, wk, *, log_g=None, valid=None, eps=1e-6, state, cos=None, sin=None):
    """Hedgehog features and the normalized recurrent step in one kernel (decode, T = 1 .. ~16).

    Args:
        q: [B, T, H, D] raw queries (after RoPE, or before it with ``cos``/``sin``); k: [B, T, Hkv, D]
            raw keys; v: [B, T, Hkv, Dv] (H a multiple of Hkv: query head h reads key/value head
            h // (H / Hkv)). Strided views are read in place as long as the last dim is contiguous
            (e.g. q, k and v as views of one fused projection output).
        wq, wk: [H, D, P] the Hedgehog maps' weights (features F = 2P: softmax([x W, -x W])).
        log_g: optional log decay (<= 0): [B, T, H] (a gate per head and step) or [B, T, H, F] (per
            key channel, ``decay='channel'``: row f of S and entry f of z decay by exp(log_g[..., f]));
            valid: optional [B, T] (0 = padding: no write, no decay).
        state: (S [B, H, F, Dv], z [B, H, F]), contiguous fp32, updated in place.
        cos, sin: optional [B or 1, T, R] RoPE of the tokens, applied to q and k in the kernel
            (rotate-half on the first R <= D dims, R even, as transformers does).

    Returns:
        o [B, T, H, Dv] in v's dtype. No autograd (decode path); :func:`hedgehog_recurrent_ref`
        is its PyTorch twin.
    """
    S, z = state
    B, T, H, D = q.shape
    HKV, DV, P = k.shape[2], v.shape[-1], wq.shape[-1]
    if S.dtype != torch.float32 or z.dtype != torch.float32 or not (S.is_contiguous() and z.is_contiguous()):
        raise ValueError("state must be contiguous fp32 tensors (S [B, H, F, Dv], z [B, H, F])")
    if S.shape != (B, H, 2 * P, DV) or z.shape != (B, H, 2 * P) or H % HKV or wq.shape != (H, D, P) or wk.shape != (H, D, P):
        raise ValueError(f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"wq {tuple(wq.shape)}, wk {tuple(wk.shape)}, S {tuple(S.shape)}, z {tuple(z.shape)}")
    cos, sin = _check_rope(cos, sin, B, T, D)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    wq, wk = wq.contiguous(), wk.contiguous()
    if log_g is not None:
        if log_g.shape not in ((B, T, H), (B, T, H, 2 * P)):
            raise ValueError(f"log_g shape {tuple(log_g.shape)} is neither {(B, T, H)} (per head) nor "
                             f"{(B, T, H, 2 * P)} (per key channel)")
        log_g = log_g.float().contiguous()
    if valid is not None:
        valid = valid.to(torch.float32).contiguous()
    return torch.ops.linearize.recurrent_hedgehog(q, k, v, wq, wk, log_g, valid, S, z, float(eps), cos, sin)


@torch.library.custom_op("linearize::recurrent_hedgehog", mutates_args=("S", "z"))
def recurrent_hedgehog_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor,
                          log_g: torch.Tensor | None, valid: torch.Tensor | None, S: torch.Tensor, z: torch.Tensor,
                          eps: float, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`fused_recurrent_hedgehog` as a torch op: advances (S, z) in place, returns o."""
    B, T, H, D = q.shape
    HKV, DV, P = k.shape[2], v.shape[-1], wq.shape[-1]
    BK = triton.next_power_of_2(2 * P)
    BV = min(triton.next_power_of_2(DV), max(16, MAX_TILE // BK))
    if B * H >= 1024:
        BV = min(BV, 64)
    NV = triton.cdiv(DV, BV)
    z_out = z if NV == 1 else torch.empty_like(z)
    o = torch.empty(B, T, H, DV, device=v.device, dtype=v.dtype)
    rot = 0 if cos is None else cos.shape[-1]
    on = pdl.enabled(q)
    _hedgehog_recurrent_kernel[(NV, B * H)](
        q, k, v, wq, wk, log_g, valid, S, z, z_out, o, T, eps, cos, sin,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        0 if cos is None or cos.shape[0] == 1 else cos.stride(0), 0 if cos is None else cos.stride(1),
        H=H, HKV=HKV, D=D, P=P, DV=DV,
        BD=triton.next_power_of_2(D), BK=BK, BV=BV, GATE=0 if log_g is None else log_g.dim() - 2, VALID=valid is not None, ROT=rot,
        PDL=on, num_warps=NUM_WARPS or (4 if BK * BV <= 8192 else 8), **pdl.launch_options(on))
    if NV > 1:
        z.copy_(z_out)
    return o


@recurrent_hedgehog_op.register_fake
def _(q, k, v, wq, wk, log_g, valid, S, z, eps, cos=None, sin=None):
    return v.new_empty(*q.shape[:3], v.shape[-1])


def hedgehog_recurrent_ref(q, k, v, wq, wk, *, log_g=None, valid=None, eps=1e-6, state):
    """Readable twin of :func:`fused_recurrent_hedgehog` (returns o and the new (S, z); float64 in,
    float64 out). ``log_g`` [B, T, H] decays each head's state as a whole, [B, T, H, F] row f of S
    and entry f of z by exp(log_g[..., f]); a pad token (valid 0) neither decays nor writes."""
    H, Hkv = q.shape[2], k.shape[2]
    k, v = k.repeat_interleave(H // Hkv, dim=2), v.repeat_interleave(H // Hkv, dim=2)

    def phi(x, w):
        y = torch.einsum("bthd,hdp->bthp", x, w.to(x.dtype))
        return torch.softmax(torch.cat([y, -y], dim=-1), dim=-1)

    fq, fk = phi(q, wq), phi(k, wk)
    S, z = state[0].clone(), state[1].clone()
    outs = []
    for t in range(q.shape[1]):
        keep = 1.0 if valid is None else valid[:, t].to(S.dtype)[:, None]  # (B, 1)
        if log_g is not None and log_g.dim() == 3:  # per head
            g = torch.exp(log_g[:, t].to(S.dtype) * keep)  # (B, H)
            S, z = S * g[..., None, None], z * g[..., None]
        elif log_g is not None:  # per key channel
            g = torch.exp(log_g[:, t].to(S.dtype) * (keep[..., None] if valid is not None else 1.0))  # (B, H, F)
            S, z = S * g[..., None], z * g
        kt = fk[:, t] * (keep[..., None] if valid is not None else 1.0)
        S = S + kt[..., :, None] * v[:, t, :, None, :].to(S.dtype)
        z = z + kt
        num = torch.einsum("bhf,bhfd->bhd", fq[:, t], S)
        den = torch.einsum("bhf,bhf->bh", fq[:, t], z)[..., None] + eps
        outs.append(num / den)
    return torch.stack(outs, dim=1), (S, z)
