"""A Gated DeltaNet layer's whole decode step between its input GEMM and its output projection,
in one op (a kernel, then a small one for the conv cache): short causal conv (its cache updated in
place), RoPE, L2 norm of q and k, the decay and write-strength gates, padding, the delta-rule step
on the float32 state (in place), and the output's RMS-norm mix and ``2 sigmoid(o_gate)`` gate.

In eager PyTorch these are ~60 small kernels per layer and step (``linearize.gdn`` unfused); here
the step is memory-bound on reading and writing the state once, like the plain recurrent kernel.

Per token t (positions counted from the start of the call) and state head, with x the pre-conv
q|k|v channels read from the fused projection output ``y``, c the conv cache (the last W inputs)
and w the depthwise taps:

    x_t   = y_t[q|k|v columns] * valid_t                    (a pad token's conv input is zero)
    u_t   = sum_j w[:, j] * [c | x_1 .. x_T][:, t + 1 + j]   (the causal conv, cache first)
    q, k  = l2norm(rope(u_q)), l2norm(rope(u_k));  v = u_v
    g     = -exp(A_log) * softplus(y_t[a] + dt_bias) * valid_t;  beta = sigmoid(y_t[b]) * valid_t
    S     = exp(g) S;  S += beta k^T (v - k S);  o = q S
    o     = (o + mix (w_o rmsnorm(o) - o)) * 2 sigmoid(y_t[o_gate])

and the conv cache becomes the last W columns of ``[c | x_1 .. x_T]``. ``gated_delta_decode_ref``
is the readable twin.

Two kernels, launched one after the other on the same stream by one op call, so that the state
heads run side by side (at batch 1 the step is latency-bound: a program walking several state heads
in turn is the critical path) and no program waits on another. ``_gdn_decode_kernel`` runs one
program per (block of value columns, batch row, state head): ``expand`` gives one state head per
query head, ``group`` one per key/value head shared by its queries. A program owns its columns of
the state (the delta rule updates each column on its own: ``k S`` and ``q S`` are per column) and
recomputes q, k and the gates. It only reads the conv cache (its old columns) and the new tokens,
so the programs of one key/value group may all recompute that group's k and v conv channels; it
writes only its own columns of the state and of its query heads' outputs. The output's RMS norm
needs a whole row: with the columns split, the raw o goes to a float32 buffer and
``_gdn_finish_kernel`` applies the norm and the gate, one program per (token, head). The same
kernel shifts the new inputs into the conv cache in place, one program per (batch row, block of
channels): each owns disjoint channels, and the stream order puts it after every read of the old
columns. With neither a conv nor split columns it is not launched.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import pdl
from ..pdl import wait_then_release

# The largest head dim the kernel takes: one program keeps a whole [D, D] float32 state in registers
# (at 256 it spills to local memory even with 16 warps; such layers keep the unfused path).
MAX_HEAD_DIM = 128
# Conv channels per program of the conv cache update (a few programs per batch row at 1K channels).
CONV_CHANNEL_BLOCK = 256


@triton.jit
def _rope_lanes(o_d, ROT: tl.constexpr):
    """For rotate-half RoPE on the first ROT lanes: each lane's partner (d +- ROT/2; itself past ROT)
    and the sign its partner enters with."""
    half = ROT // 2
    pd = tl.where(o_d < half, o_d + half, tl.where(o_d < ROT, o_d - half, o_d))
    return pd, tl.where(o_d < half, -1., 1.)


@triton.jit
def _conv_input(y_b, c_b, cw, valid_b, ch, col, m, t, stride_yt, stride_vt,
                W: tl.constexpr, HAS_VALID: tl.constexpr):
    """Channels ``ch`` (y columns ``col``) of token t after the causal conv, fp32 [BD]: tap j reads
    position t + 1 + j of [cache (W columns) | new tokens]."""
    if W == 0:
        acc = tl.load(y_b + t * stride_yt + col, mask=m, other=0.).to(tl.float32)
    else:
        acc = tl.zeros(ch.shape, dtype=tl.float32)
        for j in tl.static_range(W):
            s = t + 1 + j
            old = (ch * 0 + s) < W  # (a vector: the interpreter wants tensor masks)
            x_old = tl.load(c_b + ch * W + s, mask=m & old, other=0.).to(tl.float32)
            x_new = tl.load(y_b + (s - W) * stride_yt + col, mask=m & ~old, other=0.).to(tl.float32)
            if HAS_VALID:  # (x_new is zero where the position is in the cache: any valid row will do there)
                tn = s - W
                x_new = x_new * tl.load(valid_b + tn * (tn > 0) * stride_vt).to(tl.float32)
            acc += tl.load(cw + ch * W + j, mask=m, other=0.).to(tl.float32) * (x_old + x_new)
    return acc


@triton.jit
def _qk(y_b, c_b, cw, valid_b, cos_t, sin_t, ch0, col0, o_d, pd, sign, m, t, stride_yt, stride_vt,
        W: tl.constexpr, HAS_VALID: tl.constexpr, ROT: tl.constexpr):
    """A query or key head of token t: conv, rotate-half RoPE on the first ROT dims, L2 norm."""
    x = _conv_input(y_b, c_b, cw, valid_b, ch0 + o_d, col0 + o_d, m, t, stride_yt, stride_vt, W, HAS_VALID)
    if ROT > 0:  # the partner lane (d +- ROT/2) recomputed from memory: no register shuffle needed
        xp = _conv_input(y_b, c_b, cw, valid_b, ch0 + pd, col0 + pd, m, t, stride_yt, stride_vt, W, HAS_VALID)
        cos = tl.load(cos_t + o_d, mask=o_d < ROT, other=1.).to(tl.float32)
        sin = tl.load(sin_t + o_d, mask=o_d < ROT, other=0.).to(tl.float32)
        x = x * cos + sign * xp * sin
    return x / tl.maximum(tl.sqrt(tl.sum(x * x, 0)), 1e-6)  # F.normalize(eps=1e-6)


@triton.jit
def _conv_cache_update(y_b, c_b, valid_b, ch, col, m, T, stride_yt, stride_vt,
                       W: tl.constexpr, BW: tl.constexpr, HAS_VALID: tl.constexpr):
    """Cache column j <- position T + j of [cache | new tokens] (the last W conv inputs)."""
    o_w = tl.arange(0, BW)
    s = T + o_w
    m2 = m[:, None] & (o_w < W)[None, :]
    x_old = tl.load(c_b + ch[:, None] * W + s[None, :], mask=m2 & (s < W)[None, :], other=0.)
    x_new = tl.load(y_b + (s - W)[None, :] * stride_yt + col[:, None], mask=m2 & (s >= W)[None, :], other=0.)
    x_new = x_new.to(tl.float32)
    if HAS_VALID:
        keep = tl.load(valid_b + (s - W) * stride_vt, mask=(s >= W) & (o_w < W), other=0).to(tl.float32)
        x_new = x_new * keep[None, :]
    new = x_old.to(tl.float32) + x_new
    tl.debug_barrier()  # every lane has read the old columns before any is overwritten
    tl.store(c_b + ch[:, None] * W + o_w[None, :], new.to(c_b.dtype.element_ty), mask=m2)


@triton.jit
def _out_norm_gate(b_o, o_d, m, nw, mix_h, gate_p, D: tl.constexpr):
    """The output's RMS-norm mix and ``2 sigmoid(o_gate)`` gate of one head's o [BD] fp32."""
    w_o = tl.load(nw + o_d, mask=m, other=0.).to(tl.float32)
    normed = b_o * tl.rsqrt(tl.sum(b_o * b_o, 0) / D + 1e-6) * w_o
    b_o = b_o + mix_h * (normed - b_o)
    gate = tl.load(gate_p + o_d, mask=m, other=0.).to(tl.float32)
    return b_o * 2. * tl.sigmoid(gate)


@triton.jit(do_not_specialize=["T"])
def _gdn_decode_kernel(
    y, conv, cw, cos, sin, valid, A_log, dt_bias, nw, mix, S, out, T,
    stride_yb, stride_yt, stride_cosb, stride_cost, stride_vb, stride_vt,
    Q_OFF: tl.constexpr, K_OFF: tl.constexpr, V_OFF: tl.constexpr, HEAD_STRIDE: tl.constexpr,
    A_OFF: tl.constexpr, B_OFF: tl.constexpr, G_OFF: tl.constexpr,
    H: tl.constexpr, HKV: tl.constexpr, NS: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
    W: tl.constexpr, ROT: tl.constexpr, HAS_VALID: tl.constexpr, PDL: tl.constexpr,
):
    """One (value column block, batch row and state head): reads the conv cache, never writes it
    (``_gdn_finish_kernel`` does). With the columns split (BV < BD) the output's norm needs the whole
    row: the program writes its columns of the raw o (float32) to ``out`` and the finish kernel
    applies the norm and gate."""
    HS: tl.constexpr = HKV * NS  # state heads
    SPLIT: tl.constexpr = BV < BD
    i_v = tl.program_id(0)
    wait_then_release(PDL)  # kernels/pdl.py: nothing read or written before
    i_b, hs = tl.program_id(1) // HS, tl.program_id(1) % HS
    i_hk, i_s = hs // NS, hs % NS  # its key/value head, and which of that head's states
    REP: tl.constexpr = H // HKV  # query heads per key/value head
    NQ: tl.constexpr = REP // NS  # query heads per state
    C: tl.constexpr = (H + 2 * HKV) * D  # conv channels: [q heads | k heads | v heads]
    o_d = tl.arange(0, BD)
    o_v = i_v * BV + tl.arange(0, BV)
    m, m_v = o_d < D, o_v < D
    pd, sign = _rope_lanes(o_d, ROT)
    y_b = y + i_b.to(tl.int64) * stride_yb
    c_b = conv + i_b.to(tl.int64) * C * W
    valid_b = valid + i_b * stride_vb
    k_ch, v_ch = (H + i_hk) * D, (H + HKV + i_hk) * D
    k_col, v_col = K_OFF + i_hk * HEAD_STRIDE, V_OFF + i_hk * HEAD_STRIDE
    p_s = S + (i_b * HS + hs).to(tl.int64) * D * D + o_d[:, None] * D + o_v[None, :]
    m_s = m[:, None] & m_v[None, :]
    b_s = tl.load(p_s, mask=m_s, other=0.)
    neg_a = -tl.exp(tl.load(A_log + hs).to(tl.float32))
    dt_b = tl.load(dt_bias + hs).to(tl.float32)
    for t in range(T):
        cos_t = cos + i_b * stride_cosb + t * stride_cost
        sin_t = sin + i_b * stride_cosb + t * stride_cost
        b_k = _qk(y_b, c_b, cw, valid_b, cos_t, sin_t, k_ch, k_col, o_d, pd, sign, m, t, stride_yt, stride_vt,
                  W, HAS_VALID, ROT)
        b_v = _conv_input(y_b, c_b, cw, valid_b, v_ch + o_v, v_col + o_v, m_v, t, stride_yt, stride_vt, W, HAS_VALID)
        x_a = tl.load(y_b + t * stride_yt + A_OFF + hs).to(tl.float32) + dt_b
        g = neg_a * tl.where(x_a > 20., x_a, tl.log(1. + tl.exp(x_a)))  # softplus (torch's threshold 20)
        beta = tl.sigmoid(tl.load(y_b + t * stride_yt + B_OFF + hs).to(tl.float32))
        if HAS_VALID:  # a pad token writes nothing and does not decay the state
            keep = tl.load(valid_b + t * stride_vt).to(tl.float32)
            g, beta = g * keep, beta * keep
        b_s = b_s * tl.exp(g)
        b_d = beta * (b_v - tl.sum(b_s * b_k[:, None], 0))
        b_s = b_s + b_k[:, None] * b_d[None, :]
        for r in range(NQ):
            h = i_hk * REP + i_s * NQ + r
            b_q = _qk(y_b, c_b, cw, valid_b, cos_t, sin_t, h * D, Q_OFF + h * HEAD_STRIDE, o_d, pd, sign, m, t,
                      stride_yt, stride_vt, W, HAS_VALID, ROT)
            b_o = tl.sum(b_s * b_q[:, None], 0)
            p_o = out + ((i_b * T + t) * H + h).to(tl.int64) * D + o_v
            if SPLIT:
                tl.store(p_o, b_o.to(out.dtype.element_ty), mask=m_v)
            else:
                b_o = _out_norm_gate(b_o, o_d, m, nw, tl.load(mix + h).to(tl.float32),
                                     y_b + t * stride_yt + G_OFF + h * D, D)
                tl.store(p_o, b_o.to(out.dtype.element_ty), mask=m)
    tl.store(p_s, b_s, mask=m_s)


@triton.jit(do_not_specialize=["T"])
def _gdn_finish_kernel(
    y, conv, valid, raw, nw, mix, out, T, stride_yb, stride_yt, stride_vb, stride_vt,
    Q_OFF: tl.constexpr, K_OFF: tl.constexpr, V_OFF: tl.constexpr, HEAD_STRIDE: tl.constexpr, G_OFF: tl.constexpr,
    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, W: tl.constexpr, BW: tl.constexpr,
    BC: tl.constexpr, NC: tl.constexpr, HAS_VALID: tl.constexpr, PDL: tl.constexpr,
):
    """Batch row axis 1. Axis 0 < NC: the conv cache's channels [BC i, BC (i + 1)) advanced by T tokens.
    Axis 0 >= NC (only when the decode kernel split the value columns): one (token, head) of the output,
    its raw o (written to ``raw`` by the decode kernel) RMS-norm mixed and gated into ``out``."""
    i_c, i_b = tl.program_id(0), tl.program_id(1)
    wait_then_release(PDL)  # kernels/pdl.py: nothing read or written before
    if i_c < NC:
        C: tl.constexpr = (H + 2 * HKV) * D
        ch = i_c * BC + tl.arange(0, BC)
        head, d = ch // D, ch % D  # head in [q heads | k heads | v heads]
        col = tl.where(head < H, Q_OFF + head * HEAD_STRIDE,
                       tl.where(head < H + HKV, K_OFF + (head - H) * HEAD_STRIDE,
                                V_OFF + (head - H - HKV) * HEAD_STRIDE))
        _conv_cache_update(y + i_b.to(tl.int64) * stride_yb, conv + i_b.to(tl.int64) * C * W,
                           valid + i_b * stride_vb, ch, col + d, ch < C, T, stride_yt, stride_vt, W, BW, HAS_VALID)
    else:
        r = i_c - NC
        t, h = r // H, r % H
        o_d = tl.arange(0, BD)
        m = o_d < D
        row = ((i_b * T + t) * H + h).to(tl.int64) * D
        b_o = tl.load(raw + row + o_d, mask=m, other=0.).to(tl.float32)
        b_o = _out_norm_gate(b_o, o_d, m, nw, tl.load(mix + h).to(tl.float32),
                             y + i_b.to(tl.int64) * stride_yb + t * stride_yt + G_OFF + h * D, D)
        tl.store(out + row + o_d, b_o.to(out.dtype.element_ty), mask=m)


# ------------------------------------------------------------------------------------------- API


def gated_delta_decode_columns(widths: dict[str, int], *, qkv: tuple[str, ...], per_head: bool, num_heads: int,
                               num_kv_heads: int, head_dim: int) -> list[int]:
    """Where each input of the step sits in the fused projection output: ``widths`` maps the projection
    names, in the GEMM's order, to their output widths; ``qkv`` names the q, k, v projections (one name:
    a fused q|k|v projection, ``per_head`` = [q_h | k_h | v_h] per head, else [q heads | k heads | v
    heads]); a, b, o_gate are ``a_proj``, ``b_proj``, ``o_gate``. Returns ``cols`` for
    :func:`fused_gated_delta_decode`: [q, k, v offsets, head stride, a, b, o_gate offsets]."""
    off = dict(zip(widths, itertools.accumulate([0, *widths.values()])))
    H, Hkv, D = num_heads, num_kv_heads, head_dim
    if len(qkv) == 3:
        q, k, v, stride = off[qkv[0]], off[qkv[1]], off[qkv[2]], D
    elif per_head:
        q, k, v, stride = off[qkv[0]], off[qkv[0]] + D, off[qkv[0]] + 2 * D, 3 * D
    else:
        q, k, v, stride = off[qkv[0]], off[qkv[0]] + H * D, off[qkv[0]] + (H + Hkv) * D, D
    return [q, k, v, stride, off["a_proj"], off["b_proj"], off["o_gate"]]


def fused_gated_delta_decode(
    y: torch.Tensor,
    *,
    cols: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    state: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_mix: torch.Tensor,
    conv_state: torch.Tensor | None = None,
    conv_weight: torch.Tensor | None = None,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """A Gated DeltaNet decode step of T (small) tokens; ``state`` and ``conv_state`` advance in place.

    Args:
        y: [B, T, N] the fused input projection's output (q, k, v, a, b, o_gate columns at ``cols``,
            see :func:`gated_delta_decode_columns`), in the activation dtype.
        state: [B, Hs, D, D] float32, contiguous; Hs = H (a state per query head) or Hkv (one per key
            head, shared by its H / Hkv queries).
        A_log, dt_bias: [Hs] decay parameters; norm_weight: [D]; norm_mix: [H].
        conv_state: [B, (H + 2 Hkv) D, W] the last W conv inputs (q heads | k heads | v heads),
            contiguous; conv_weight: [(H + 2 Hkv) D, W] or [C, 1, W] depthwise taps. Both None: no conv.
        cos, sin: [B or 1, T, R] RoPE of the tokens (rotate-half on the first R <= D dims), or None.
        valid: [B, T] bool (False = padding: writes nothing, does not decay, zero conv input), or None.
    Returns:
        [B, T, H * D] in y's dtype, ready for the output projection. Inference only (no autograd).
    """
    B, T, _ = y.shape
    H, Hkv, D = num_heads, num_kv_heads, head_dim
    if D > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {D} is above the fused decode's {MAX_HEAD_DIM} (its state lives in registers)")
    if H % Hkv or state.dtype != torch.float32 or not state.is_contiguous() or state.shape not in (
            (B, H, D, D), (B, Hkv, D, D)):
        raise ValueError(f"state must be a contiguous float32 [B, H or Hkv, D, D] = [{B}, {H} or {Hkv}, {D}, {D}] "
                         f"tensor; got {state.dtype} {tuple(state.shape)}")
    if len(cols) != 7:
        raise ValueError(f"cols must hold 7 column offsets (see gated_delta_decode_columns), got {cols!r}")
    if (conv_state is None) != (conv_weight is None):
        raise ValueError("pass conv_state and conv_weight together (or neither: no convolution)")
    if conv_state is not None:
        C = (H + 2 * Hkv) * D
        conv_weight = conv_weight.reshape(C, -1)
        if conv_state.shape != (B, C, conv_weight.shape[-1]) or not conv_state.is_contiguous():
            raise ValueError(f"conv_state must be a contiguous [B, (H + 2 Hkv) D, W] = [{B}, {C}, "
                             f"{conv_weight.shape[-1]}] tensor; got {tuple(conv_state.shape)}")
    if (cos is None) != (sin is None):
        raise ValueError("pass cos and sin together (or neither: no RoPE)")
    if cos is not None and (cos.shape[-1] % 2 or cos.shape[-1] > D or cos.shape[1] != T):
        raise ValueError(f"cos/sin must be [B or 1, T, R] with an even R <= head_dim {D}; got {tuple(cos.shape)}")
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (y, A_log, dt_bias, norm_weight,
                                                                                  norm_mix, conv_weight)):
        raise RuntimeError("fused_gated_delta_decode is inference-only (it overwrites the state): call it under "
                           "torch.no_grad()")
    if cos is not None and (cos.shape != sin.shape or cos.shape[0] not in (1, B)):
        raise ValueError(f"cos and sin must both be [B or 1, T, R]; got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos is not None and (cos.stride(-1) != 1 or cos.stride() != sin.stride()):
        cos, sin = cos.contiguous(), sin.contiguous()
    if y.stride(-1) != 1:
        y = y.contiguous()
    params = [x.contiguous() for x in (A_log, dt_bias, norm_weight, norm_mix)]
    return torch.ops.linearize.gated_delta_decode(
        y, state, conv_state, None if conv_weight is None else conv_weight.contiguous(), cos, sin, valid, *params,
        list(cols), H, Hkv)


@torch.library.custom_op("linearize::gated_delta_decode", mutates_args=("state", "conv_state"))
def gated_delta_decode_op(y: torch.Tensor, state: torch.Tensor, conv_state: torch.Tensor | None,
                          conv_weight: torch.Tensor | None, cos: torch.Tensor | None, sin: torch.Tensor | None,
                          valid: torch.Tensor | None, A_log: torch.Tensor, dt_bias: torch.Tensor,
                          norm_weight: torch.Tensor, norm_mix: torch.Tensor, cols: list[int], num_heads: int,
                          num_kv_heads: int) -> torch.Tensor:
    """:func:`fused_gated_delta_decode` as a torch op (which checks the arguments): advances ``state``
    and ``conv_state`` in place, returns the output [B, T, H * D]."""
    B, T, _ = y.shape
    H, Hkv, Hs, D = num_heads, num_kv_heads, state.shape[1], state.shape[-1]
    out = y.new_empty(B, T, H * D)
    W = 0 if conv_state is None else conv_state.shape[-1]
    ROT = 0 if cos is None else cos.shape[-1]
    dummy = y  # unused pointer arguments (their constexpr switch is off)
    BD = triton.next_power_of_2(D)
    BV = _block_v(B * Hs, BD)
    raw = out if BV == BD else torch.empty(B, T, H * D, device=y.device, dtype=torch.float32)
    conv_arg, valid_arg = dummy if conv_state is None else conv_state, dummy if valid is None else valid
    stride_vb, stride_vt = (0, 0) if valid is None else valid.stride()
    on = pdl.enabled(y)
    _gdn_decode_kernel[(triton.cdiv(D, BV), B * Hs)](
        y, conv_arg, dummy if conv_weight is None else conv_weight,
        dummy if cos is None else cos, dummy if sin is None else sin, valid_arg,
        A_log, dt_bias, norm_weight, norm_mix, state, raw, T,
        y.stride(0), y.stride(1), 0 if cos is None or cos.shape[0] == 1 else cos.stride(0),
        0 if cos is None else cos.stride(1), stride_vb, stride_vt,
        Q_OFF=cols[0], K_OFF=cols[1], V_OFF=cols[2], HEAD_STRIDE=cols[3], A_OFF=cols[4], B_OFF=cols[5],
        G_OFF=cols[6], H=H, HKV=Hkv, NS=Hs // Hkv, D=D, BD=BD, BV=BV, W=W, ROT=ROT, HAS_VALID=valid is not None,
        PDL=on, num_warps=NUM_WARPS or (4 if BD * BV <= 4096 else 8), **pdl.launch_options(on),
    )
    # After every read of the old conv columns and of the raw outputs (same stream): the conv channel
    # blocks and the output rows are disjoint, no barrier.
    C = (H + 2 * Hkv) * D
    BC = min(triton.next_power_of_2(C), CONV_CHANNEL_BLOCK)
    NC = triton.cdiv(C, BC) if W else 0
    rows = 0 if BV == BD else T * H
    if NC + rows:
        _gdn_finish_kernel[(NC + rows, B)](
            y, conv_arg, valid_arg, raw, norm_weight, norm_mix, out, T, y.stride(0), y.stride(1), stride_vb, stride_vt,
            Q_OFF=cols[0], K_OFF=cols[1], V_OFF=cols[2], HEAD_STRIDE=cols[3], G_OFF=cols[6], H=H, HKV=Hkv, D=D, BD=BD,
            W=W, BW=triton.next_power_of_2(max(W, 1)), BC=BC, NC=NC, HAS_VALID=valid is not None, PDL=on,
            **pdl.launch_options(on),
        )
    return out


# Value columns and warps per program of the decode kernel: None picks (see ``_block_v``); the decode
# kernel benchmark (scripts/bench_decode_kernels.py) sets them to sweep.
BLOCK_V: int | None = None
NUM_WARPS: int | None = None


def _block_v(programs: int, BD: int) -> int:
    """Value columns per program. A step is latency-bound on each program's walk through its state:
    halving the columns a program owns shortened it at every benchmark shape (H200, 2026-11-25,
    docs/decode_kernels.md: 9 to 256 programs of 64 columns), and quartering them at batch 1 of 9
    heads (36 programs on 132 SMs)."""
    if BLOCK_V is not None:
        return min(BLOCK_V, BD)
    if programs > 1024:
        return BD
    return max(16, BD // 4 if programs <= 16 else BD // 2)


@gated_delta_decode_op.register_fake
def _(y, state, conv_state, conv_weight, cos, sin, valid, A_log, dt_bias, norm_weight, norm_mix, cols, num_heads,
      num_kv_heads):
    return y.new_empty(*y.shape[:2], num_heads * state.shape[-1])


# ------------------------------------------------------------------------------------- reference


def gated_delta_decode_ref(y, *, cols, num_heads, num_kv_heads, head_dim, state, A_log, dt_bias, norm_weight,
                           norm_mix, conv_state=None, conv_weight=None, cos=None, sin=None, valid=None):
    """Readable twin of :func:`fused_gated_delta_decode` (same arguments). Returns (out, state,
    conv_state) without touching its inputs; computes in float64 for float64 inputs, else float32."""
    dt = torch.float64 if y.dtype == torch.float64 else torch.float32
    B, T, _ = y.shape
    H, Hkv, D = num_heads, num_kv_heads, head_dim
    q_off, k_off, v_off, stride, a_off, b_off, g_off = cols

    def heads(off, n):  # (B, T, n, D) columns of n heads
        idx = torch.tensor([off + h * stride + d for h in range(n) for d in range(D)], device=y.device)
        return y.index_select(-1, idx).view(B, T, n, D).to(dt)

    x = torch.cat([heads(q_off, H), heads(k_off, Hkv), heads(v_off, Hkv)], dim=2).flatten(2)  # (B, T, C)
    new_conv = None
    if conv_state is not None:
        if valid is not None:
            x = x * valid[..., None].to(dt)
        w = conv_weight.reshape(x.shape[-1], -1).to(dt)  # (C, W)
        W = w.shape[-1]
        full = torch.cat([conv_state.to(dt), x.transpose(1, 2)], dim=-1)  # (B, C, W + T)
        x = torch.stack([(full[..., t + 1:t + 1 + W] * w).sum(-1) for t in range(T)], dim=1)
        new_conv = full[..., -W:].to(conv_state.dtype)
    q, k, v = x.split([H * D, Hkv * D, Hkv * D], dim=-1)
    q, k, v = q.reshape(B, T, H, D), k.reshape(B, T, Hkv, D), v.reshape(B, T, Hkv, D)
    if cos is not None:
        R = cos.shape[-1]
        c, s = cos.to(dt)[:, :, None], sin.to(dt)[:, :, None]

        def rope(u):
            rot, rest = u[..., :R], u[..., R:]
            half = torch.cat([-rot[..., R // 2:], rot[..., :R // 2]], dim=-1)
            return torch.cat([rot * c + half * s, rest], dim=-1)

        q, k = rope(q), rope(k)
    q, k = F.normalize(q, dim=-1, eps=1e-6), F.normalize(k, dim=-1, eps=1e-6)
    Hs = state.shape[1]
    if Hs == H and H != Hkv:  # a state per query head: its key/value head's k and v
        k, v = k.repeat_interleave(H // Hkv, dim=2), v.repeat_interleave(H // Hkv, dim=2)
    a, b = y[..., a_off:a_off + Hs].to(dt), y[..., b_off:b_off + Hs].to(dt)
    g = -torch.exp(A_log.to(dt)) * F.softplus(a + dt_bias.to(dt))
    beta = torch.sigmoid(b)
    if valid is not None:
        g, beta = g * valid[..., None].to(dt), beta * valid[..., None].to(dt)
    S = state.to(dt).clone()
    q = q.view(B, T, Hs, H // Hs, D)
    outs = []
    for t in range(T):
        S = S * torch.exp(g[:, t])[..., None, None]
        pred = torch.einsum("bhk,bhkv->bhv", k[:, t], S)
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], beta[:, t, :, None] * (v[:, t] - pred))
        outs.append(torch.einsum("bhrk,bhkv->bhrv", q[:, t], S).reshape(B, H, D))
    o = torch.stack(outs, dim=1)  # (B, T, H, D)
    normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_weight.to(dt)
    o = o + norm_mix.to(dt)[:, None] * (normed - o)
    o = o * 2 * torch.sigmoid(y[..., g_off:g_off + H * D].to(dt).view(B, T, H, D))
    return o.reshape(B, T, H * D).to(y.dtype), S.to(state.dtype), new_conv
