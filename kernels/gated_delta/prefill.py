"""A Gated DeltaNet layer's prefill glue around the chunk kernel, in two Triton kernels (inference).

Before the chunk kernel (``gdn_prefill_prologue``), per token t of the call, from the fused input
projection's output ``y`` (the same columns and conv as the decode step, see decode.py)::

    u_t  = causal depthwise conv over [cache | x_1 .. x_T], x_t = y_t[q|k|v] * valid_t (no conv: y_t[q|k|v])
    q, k = l2norm(rope(u_q)), l2norm(rope(u_k));  v = u_v       (k, v repeated to the query heads)

After it (``gdn_prefill_epilogue``), per token and head::

    o = (o + mix_h (w_o rmsnorm(o) - o)) * 2 sigmoid(y_t[o_gate])

In eager PyTorch these are a conv (on a transposed copy), casts to fp32 and back, RoPE, the norms,
repeats and gates: a dozen passes over the (B, T, H, D) activations per layer. Here each side reads
its inputs once and writes its outputs once, in the dtype the next GEMM or kernel reads.

Prologue: one program per (block of BT tokens, batch row, query head): the query head, and the key
and value of its key/value head (recomputed by each of its ``rep`` query heads: the conv reads a few
columns more, no repeated copy is ever written to memory and read again). The conv cache is only
read here (the layer advances it after, see ``linearize.gdn``). Epilogue: one program per (block of
tokens, head). ``*_ref`` are the readable twins.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launch import call_directly, launch
from .decode import _rope_lanes

# halves: RoPE over a whole power-of-two head rotates its two halves into each other (one conv per
# lane, _qk_halves) instead of convolving every lane's partner again (_qk_tile)
CONFIG = {"BT": 32, "warps": 4, "epi_BN": 64, "halves": True}


@triton.jit
def _conv_tile(y_b, c_b, cw, valid_b, ch, col, m_d, o_t, m_t, stride_yt, stride_vt,
               W: tl.constexpr, HAS_VALID: tl.constexpr, HAS_CACHE: tl.constexpr):
    """Channels ``ch`` (y columns ``col``) of tokens ``o_t`` after the causal conv, fp32 [BT, BD]: tap j
    of token t reads position t + 1 + j of [cache (W columns) | new tokens] (zeros without a cache)."""
    if W == 0:  # no conv: the projection as it is (a pad token writes nothing: its gates are zero)
        acc = tl.load(y_b + o_t[:, None] * stride_yt + col[None, :], mask=m_t[:, None] & m_d[None, :],
                      other=0.).to(tl.float32)
    else:
        acc = tl.zeros([o_t.shape[0], ch.shape[0]], dtype=tl.float32)
        for j in tl.static_range(W):
            s = o_t + 1 + j
            new = (s >= W) & m_t
            tn = tl.where(new, s - W, 0)
            x = tl.load(y_b + tn[:, None] * stride_yt + col[None, :], mask=new[:, None] & m_d[None, :],
                        other=0.).to(tl.float32)
            if HAS_VALID:
                x = x * tl.load(valid_b + tn * stride_vt, mask=new, other=0).to(tl.float32)[:, None]
            if HAS_CACHE:
                old = (s < W) & m_t
                x += tl.load(c_b + ch[None, :] * W + tl.where(old, s, 0)[:, None], mask=old[:, None] & m_d[None, :],
                             other=0.).to(tl.float32)
            x = x * tl.load(cw + ch * W + j, mask=m_d, other=0.).to(tl.float32)[None, :]
            acc += x
    return acc


@triton.jit
def _qk_tile(y_b, c_b, cw, valid_b, cos_b, sin_b, ch0, col0, o_d, pd, sign, m_d, o_t, m_t, stride_yt, stride_vt,
             stride_cost, W: tl.constexpr, HAS_VALID: tl.constexpr, HAS_CACHE: tl.constexpr, ROT: tl.constexpr):
    """A query or key head of tokens ``o_t``: conv, rotate-half RoPE on the first ROT dims, L2 norm."""
    x = _conv_tile(y_b, c_b, cw, valid_b, ch0 + o_d, col0 + o_d, m_d, o_t, m_t, stride_yt, stride_vt, W, HAS_VALID,
                   HAS_CACHE)
    if ROT > 0:  # the partner lane (d +- ROT/2) recomputed from memory
        xp = _conv_tile(y_b, c_b, cw, valid_b, ch0 + pd, col0 + pd, m_d, o_t, m_t, stride_yt, stride_vt, W,
                        HAS_VALID, HAS_CACHE)
        m_r = m_t[:, None] & (o_d < ROT)[None, :]
        p = o_t[:, None] * stride_cost + o_d[None, :]
        cos = tl.load(cos_b + p, mask=m_r, other=1.).to(tl.float32)
        sin = tl.load(sin_b + p, mask=m_r, other=0.).to(tl.float32)
        x = x * cos + sign[None, :] * xp * sin
    return x / tl.maximum(tl.sqrt(tl.sum(x * x, 1)), 1e-6)[:, None]  # F.normalize(eps=1e-6)


@triton.jit
def _qk_halves(y_b, c_b, cw, valid_b, cos_b, sin_b, ch0, col0, o_h, m_t, o_t, stride_yt, stride_vt, stride_cost,
               HD: tl.constexpr, W: tl.constexpr, HAS_VALID: tl.constexpr, HAS_CACHE: tl.constexpr):
    """``_qk_tile`` for RoPE over the whole head (ROT = D, a power of two): the two halves of the head
    are convolved once each and rotate into each other (x1 cos - x2 sin, x2 cos + x1 sin), where
    ``_qk_tile`` convolves every lane's partner a second time. Returns the normalised halves."""
    m_h = o_h < HD
    x1 = _conv_tile(y_b, c_b, cw, valid_b, ch0 + o_h, col0 + o_h, m_h, o_t, m_t, stride_yt, stride_vt, W, HAS_VALID,
                    HAS_CACHE)
    x2 = _conv_tile(y_b, c_b, cw, valid_b, ch0 + HD + o_h, col0 + HD + o_h, m_h, o_t, m_t, stride_yt, stride_vt, W,
                    HAS_VALID, HAS_CACHE)
    m_r = m_t[:, None] & m_h[None, :]
    p = o_t[:, None] * stride_cost + o_h[None, :]
    r1 = x1 * tl.load(cos_b + p, mask=m_r, other=1.).to(tl.float32) - x2 * tl.load(sin_b + p, mask=m_r, other=0.).to(
        tl.float32)
    r2 = x2 * tl.load(cos_b + p + HD, mask=m_r, other=1.).to(tl.float32) + x1 * tl.load(
        sin_b + p + HD, mask=m_r, other=0.).to(tl.float32)
    inv = 1. / tl.maximum(tl.sqrt(tl.sum(r1 * r1, 1) + tl.sum(r2 * r2, 1)), 1e-6)  # F.normalize(eps=1e-6)
    return r1 * inv[:, None], r2 * inv[:, None]


@triton.jit(do_not_specialize=["T"])
def _prologue_kernel(
    y, conv, cw, cos, sin, valid, q_out, k_out, v_out, T,
    stride_yb, stride_yt, stride_cosb, stride_cost, stride_vb, stride_vt,
    Q_OFF: tl.constexpr, K_OFF: tl.constexpr, V_OFF: tl.constexpr, HEAD_STRIDE: tl.constexpr,
    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
    W: tl.constexpr, ROT: tl.constexpr, HAS_VALID: tl.constexpr, HAS_CACHE: tl.constexpr, HALVES: tl.constexpr,
):
    i_t, i_b, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    j = h // (H // HKV)  # its key/value head
    C: tl.constexpr = (H + 2 * HKV) * D
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    pd, sign = _rope_lanes(o_d, ROT)
    y_b = y + i_b.to(tl.int64) * stride_yb
    c_b = conv + i_b.to(tl.int64) * C * W
    valid_b = valid + i_b * stride_vb
    cos_b, sin_b = cos + i_b * stride_cosb, sin + i_b * stride_cosb
    rows = ((i_b * T + o_t).to(tl.int64) * H + h) * D
    p_o = rows[:, None] + o_d[None, :]
    m_o = m_t[:, None] & m_d[None, :]
    if HALVES:  # whole-head RoPE: each half convolved once (see _qk_halves)
        HD: tl.constexpr = D // 2
        o_h = tl.arange(0, HD)
        p_h = rows[:, None] + o_h[None, :]
        m_hh = m_t[:, None] & (o_h < HD)[None, :]
        q1, q2 = _qk_halves(y_b, c_b, cw, valid_b, cos_b, sin_b, h * D, Q_OFF + h * HEAD_STRIDE, o_h, m_t, o_t,
                            stride_yt, stride_vt, stride_cost, HD, W, HAS_VALID, HAS_CACHE)
        tl.store(q_out + p_h, q1.to(q_out.dtype.element_ty), mask=m_hh)
        tl.store(q_out + p_h + HD, q2.to(q_out.dtype.element_ty), mask=m_hh)
        k1, k2 = _qk_halves(y_b, c_b, cw, valid_b, cos_b, sin_b, (H + j) * D, K_OFF + j * HEAD_STRIDE, o_h, m_t, o_t,
                            stride_yt, stride_vt, stride_cost, HD, W, HAS_VALID, HAS_CACHE)
        tl.store(k_out + p_h, k1.to(k_out.dtype.element_ty), mask=m_hh)
        tl.store(k_out + p_h + HD, k2.to(k_out.dtype.element_ty), mask=m_hh)
    else:
        b_q = _qk_tile(y_b, c_b, cw, valid_b, cos_b, sin_b, h * D, Q_OFF + h * HEAD_STRIDE, o_d, pd, sign, m_d, o_t, m_t,
                       stride_yt, stride_vt, stride_cost, W, HAS_VALID, HAS_CACHE, ROT)
        tl.store(q_out + p_o, b_q.to(q_out.dtype.element_ty), mask=m_o)
        b_k = _qk_tile(y_b, c_b, cw, valid_b, cos_b, sin_b, (H + j) * D, K_OFF + j * HEAD_STRIDE, o_d, pd, sign, m_d,
                       o_t, m_t, stride_yt, stride_vt, stride_cost, W, HAS_VALID, HAS_CACHE, ROT)
        tl.store(k_out + p_o, b_k.to(k_out.dtype.element_ty), mask=m_o)
    b_v = _conv_tile(y_b, c_b, cw, valid_b, (H + HKV + j) * D + o_d, V_OFF + j * HEAD_STRIDE + o_d, m_d, o_t, m_t,
                     stride_yt, stride_vt, W, HAS_VALID, HAS_CACHE)
    tl.store(v_out + p_o, b_v.to(v_out.dtype.element_ty), mask=m_o)


@triton.jit(do_not_specialize=["T"])
def _epilogue_kernel(o, y, nw, mix, out, T, N, stride_yb, stride_yt,
                     G_OFF: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr):
    i_n, h = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BN + tl.arange(0, BN)
    o_d = tl.arange(0, BD)
    m_n, m_d = o_n < N, o_d < D
    m = m_n[:, None] & m_d[None, :]
    p = (o_n.to(tl.int64) * H + h)[:, None] * D + o_d[None, :]
    b_o = tl.load(o + p, mask=m, other=0.).to(tl.float32)
    w_o = tl.load(nw + o_d, mask=m_d, other=0.).to(tl.float32)
    normed = b_o * tl.rsqrt(tl.sum(b_o * b_o, 1) / D + 1e-6)[:, None] * w_o[None, :]
    b_o = b_o + tl.load(mix + h).to(tl.float32) * (normed - b_o)
    b, t = (o_n // T).to(tl.int64), (o_n % T).to(tl.int64)
    gate = tl.load(y + b[:, None] * stride_yb + t[:, None] * stride_yt + G_OFF + h * D + o_d[None, :], mask=m,
                   other=0.).to(tl.float32)
    tl.store(out + p, (b_o * 2. * tl.sigmoid(gate)).to(out.dtype.element_ty), mask=m)


# ------------------------------------------------------------------------------------------- ops


def _dummy(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(1)


def _prologue(y: torch.Tensor, conv_state: torch.Tensor | None, conv_weight: torch.Tensor | None,
              cos: torch.Tensor | None, sin: torch.Tensor | None, valid: torch.Tensor | None, cols: list[int],
              num_heads: int, num_kv_heads: int, head_dim: int, out_dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, T = y.shape[:2]
    H, Hkv, D = num_heads, num_kv_heads, head_dim
    q, k, v = (torch.empty(B, T, H, D, device=y.device, dtype=out_dtype) for _ in range(3))
    if B * T == 0:
        return q, k, v
    W = 0 if conv_weight is None else conv_weight.shape[-1]
    cw = _dummy(y) if conv_weight is None else conv_weight.reshape(-1, W).contiguous()
    ROT = 0 if cos is None else cos.shape[-1]
    vd = valid if valid is not None else _dummy(y)
    c = conv_state if conv_state is not None else _dummy(y)
    cs, sn = (cos, sin) if cos is not None else (_dummy(y), _dummy(y))
    BD = max(16, triton.next_power_of_2(D))
    launch(_prologue_kernel, (triton.cdiv(T, CONFIG["BT"]), B, H), y, c, cw, cs, sn, vd, q, k, v, T,
           y.stride(0), y.stride(1), cs.stride(0) if cos is not None else 0, cs.stride(1) if cos is not None else 0,
           vd.stride(0) if valid is not None else 0, vd.stride(1) if valid is not None else 0,
           Q_OFF=cols[0], K_OFF=cols[1], V_OFF=cols[2], HEAD_STRIDE=cols[3], H=H, HKV=Hkv, D=D, BD=BD,
           BT=CONFIG["BT"], W=W, ROT=ROT, HAS_VALID=valid is not None, HAS_CACHE=conv_state is not None,
           HALVES=CONFIG["halves"] and ROT == D == BD, num_warps=CONFIG["warps"], num_stages=1)
    return q, k, v


prologue_op = torch.library.custom_op("linearize::gdn_prefill_prologue", mutates_args=())(_prologue)


@prologue_op.register_fake
def _(y, conv_state, conv_weight, cos, sin, valid, cols, num_heads, num_kv_heads, head_dim, out_dtype):
    B, T = y.shape[:2]
    return tuple(y.new_empty(B, T, num_heads, head_dim, dtype=out_dtype) for _ in range(3))


def _epilogue(o: torch.Tensor, y: torch.Tensor, norm_weight: torch.Tensor, norm_mix: torch.Tensor, g_off: int,
              out_dtype: torch.dtype) -> torch.Tensor:
    B, T, H, D = o.shape
    out = torch.empty(B, T, H * D, device=o.device, dtype=out_dtype)
    N = B * T
    if N == 0:
        return out
    BN = CONFIG["epi_BN"]
    launch(_epilogue_kernel, (triton.cdiv(N, BN), H), o, y, norm_weight, norm_mix, out, T, N, y.stride(0), y.stride(1),
           G_OFF=g_off, H=H, D=D, BD=max(16, triton.next_power_of_2(D)), BN=BN, num_warps=CONFIG["warps"],
           num_stages=1)
    return out


epilogue_op = torch.library.custom_op("linearize::gdn_prefill_epilogue", mutates_args=())(_epilogue)


@epilogue_op.register_fake
def _(o, y, norm_weight, norm_mix, g_off, out_dtype):
    B, T, H, D = o.shape
    return o.new_empty(B, T, H * D, dtype=out_dtype)


def gdn_prefill_prologue(y, *, cols, num_heads, num_kv_heads, head_dim, conv_state=None, conv_weight=None,
                         cos=None, sin=None, valid=None, out_dtype=None):
    """q, k, v (B, T, H, D) in ``out_dtype`` (default y's) for the chunk kernel, k and v repeated to the
    query heads. ``y`` (B, T, *) the fused projection output (last dim contiguous), ``cols`` its
    columns as :func:`~.decode.gated_delta_decode_columns` gives them (the first four are read);
    ``conv_state`` (B, C, W) the conv cache before this call (None: zeros), ``conv_weight`` (C, 1, W)
    or None (no conv); ``cos, sin`` (B, T, R) rotate-half RoPE on the first R dims, or None;
    ``valid`` (B, T) or None. No autograd."""
    D = head_dim
    if y.stride(-1) != 1:
        raise ValueError("y's last dim must be contiguous")
    if cos is not None:
        if cos.dim() != 3 or cos.shape[-1] % 2 or cos.shape[-1] > D or cos.stride(-1) != 1 or sin.stride() != cos.stride():
            raise ValueError(f"cos/sin must be (B, T, R) with R even <= {D}, last dim contiguous, same strides")
        cos, sin = cos.expand(y.shape[0], -1, -1), sin.expand(y.shape[0], -1, -1)
    if conv_state is not None and conv_weight is not None:
        if not conv_state.is_contiguous() or conv_state.shape[-1] != conv_weight.shape[-1]:
            raise ValueError("conv_state must be a contiguous (B, C, W) with W the conv's taps")
    if valid is not None:
        valid = valid.to(torch.uint8) if valid.dtype == torch.bool else valid
    args = (y, conv_state if conv_weight is not None else None, conv_weight, cos, sin, valid, [int(c) for c in cols[:4]],
            num_heads, num_kv_heads, D, out_dtype or y.dtype)
    return _prologue(*args) if call_directly(False) else torch.ops.linearize.gdn_prefill_prologue(*args)


def gdn_prefill_epilogue(o, y, *, norm_weight, norm_mix, g_off, out_dtype):
    """(B, T, H * D) in ``out_dtype``: ``(o + mix_h (w rmsnorm(o) - o)) * 2 sigmoid(y[..., g_off + h D + d])``
    from the chunk kernel's o (B, T, H, D); ``norm_mix`` (H,). No autograd."""
    o = o.contiguous()
    if y.stride(-1) != 1:
        raise ValueError("y's last dim must be contiguous")
    args = (o, y, norm_weight.detach().contiguous(), norm_mix.detach().reshape(-1).contiguous(), int(g_off), out_dtype)
    return _epilogue(*args) if call_directly(False) else torch.ops.linearize.gdn_prefill_epilogue(*args)


def gdn_prefill_prologue_ref(y, *, cols, num_heads, num_kv_heads, head_dim, conv_state=None, conv_weight=None,
                             cos=None, sin=None, valid=None, out_dtype=None):
    """The PyTorch twin of :func:`gdn_prefill_prologue`, in fp32 (float64 stays)."""
    dt = torch.float64 if y.dtype == torch.float64 else torch.float32
    B, T = y.shape[:2]
    H, Hkv, D = num_heads, num_kv_heads, head_dim
    q_off, k_off, v_off, stride = cols[:4]
    heads = lambda off, n: torch.stack([y[..., off + i * stride: off + i * stride + D] for i in range(n)], 2)  # noqa: E731
    x = torch.cat([heads(q_off, H), heads(k_off, Hkv), heads(v_off, Hkv)], 2).to(dt).flatten(2)  # (B, T, C)
    if conv_weight is not None:
        if valid is not None:  # a pad token's conv input is zero (without a conv its gates mask it)
            x = x * valid[..., None].to(dt)
        W = conv_weight.shape[-1]
        hist = conv_state.to(dt).transpose(1, 2) if conv_state is not None else x.new_zeros(B, W, x.shape[-1])
        full = torch.cat([hist, x], 1)  # (B, W + T, C)
        w = conv_weight.reshape(-1, W).to(dt)
        x = sum(full[:, 1 + j: 1 + j + T] * w[:, j] for j in range(W))
    x = x.unflatten(-1, (H + 2 * Hkv, D))
    q, k, v = x[:, :, :H], x[:, :, H:H + Hkv], x[:, :, H + Hkv:]
    if cos is not None:
        R = cos.shape[-1]
        c, s = cos.to(dt)[:, :, None], sin.to(dt)[:, :, None]

        def rope(t):
            r = torch.cat([-t[..., R // 2:R], t[..., :R // 2]], -1)
            return torch.cat([t[..., :R] * c + r * s, t[..., R:]], -1)
        q, k = rope(q), rope(k)
    q, k = (torch.nn.functional.normalize(t, dim=-1, eps=1e-6) for t in (q, k))
    rep = H // Hkv
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    od = out_dtype or y.dtype
    return q.to(od), k.to(od), v.to(od)


def gdn_prefill_epilogue_ref(o, y, *, norm_weight, norm_mix, g_off, out_dtype):
    """The PyTorch twin of :func:`gdn_prefill_epilogue`."""
    B, T, H, D = o.shape
    dt = torch.float64 if o.dtype == torch.float64 else torch.float32
    o = o.to(dt)
    normed = torch.nn.functional.rms_norm(o, (D,), norm_weight.to(dt), eps=1e-6)
    o = torch.lerp(o, normed, norm_mix.to(dt).reshape(H, 1))
    gate = y[..., g_off: g_off + H * D].to(dt).view(B, T, H, D)
    return (o * 2 * torch.sigmoid(gate)).reshape(B, T, H * D).to(out_dtype)
