"""Fused recurrent gated delta rule for decoding (T = 1 or a few tokens), state updated in place.

One program owns a [K, BV] slice of one head's float32 state, keeps it in registers over
the T steps and writes it back once: the state is read and written exactly once per call,
which is the whole cost of a decode step at realistic sizes (memory-bound).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_AUTOTUNE = not _INTERPRET and os.environ.get("LINEARIZE_TRITON_AUTOTUNE", "1") != "0"
# (BV, num_warps) candidates, tuned per shape on the first call (see _pick)
_CONFIGS = ((8, 1), (16, 1), (32, 2), (32, 4), (64, 4))
_BEST: dict[tuple, tuple[int, int]] = {}


@triton.jit(do_not_specialize=["T"])
def _recurrent_kernel(
    q, k, v, g, beta, s, o, scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr,
):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mk, mv = o_k < K, o_v < V
    p_s = s + i_bh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    b_s = tl.load(p_s, mask=mk[:, None] & mv[None, :], other=0.0)
    base = i_b.to(tl.int64) * T * H + i_h                           # token 0 of this row and head
    for t in range(0, T):
        r = base + t * H
        b_q = tl.load(q + r * K + o_k, mask=mk, other=0.0).to(tl.float32)
        b_k = tl.load(k + r * K + o_k, mask=mk, other=0.0).to(tl.float32)
        b_v = tl.load(v + r * V + o_v, mask=mv, other=0.0).to(tl.float32)
        b_g = tl.load(g + r).to(tl.float32)
        b_b = tl.load(beta + r).to(tl.float32)
        if L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
        b_s = b_s * tl.exp(b_g)
        b_d = b_b * (b_v - tl.sum(b_s * b_k[:, None], 0))
        b_s = b_s + b_k[:, None] * b_d[None, :]
        b_o = tl.sum(b_s * b_q[:, None], 0) * scale
        tl.store(o + r * V + o_v, b_o.to(o.dtype.element_ty), mask=mv)
    tl.store(p_s, b_s, mask=mk[:, None] & mv[None, :])


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    state: torch.Tensor,
    use_qk_l2norm: bool = False,
) -> torch.Tensor:
    """Decode T (small) tokens from `state`, which is updated in place.

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] log decay; beta: [B, T, H].
        state: [B, H, K, V] float32, contiguous; holds the final state on return.
        use_qk_l2norm: L2-normalise q and k inside the kernel.
    Returns:
        o [B, T, H, V] in v's dtype. Inference only: no gradients (use
        `chunk_gated_delta_rule` to train).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if state.shape != (B, H, K, V) or state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"state must be a contiguous float32 [B, H, K, V] = {(B, H, K, V)} tensor; got "
                         f"{state.dtype} {tuple(state.shape)}")
    if g.shape != (B, T, H) or beta.shape != (B, T, H):
        raise ValueError(f"g and beta must be [B, T, H] = {(B, T, H)}; got {tuple(g.shape)}, {tuple(beta.shape)}")
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, g, beta)):
        raise RuntimeError("fused_recurrent_gated_delta_rule is inference-only (it overwrites the state); "
                           "use chunk_gated_delta_rule for training or call it under torch.no_grad()")
    scale = K ** -0.5 if scale is None else float(scale)
    q, k, v, g, beta = (x if x.is_contiguous() else x.contiguous() for x in (q, k, v, g, beta))
    return torch.ops.linearize.recurrent_gated_delta(q, k, v, g, beta, state, scale, use_qk_l2norm)


@torch.library.custom_op("linearize::recurrent_gated_delta", mutates_args=("state",))
def recurrent_gated_delta_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                             state: torch.Tensor, scale: float, use_qk_l2norm: bool) -> torch.Tensor:
    """The decode step as a torch op: advances ``state`` in place and returns o (see
    :func:`fused_recurrent_gated_delta_rule`, which checks the arguments)."""
    o = torch.empty_like(v)
    cfg = _pick(q, k, v, g, beta, state, o, scale, use_qk_l2norm)
    _launch(cfg, q, k, v, g, beta, state, o, scale, use_qk_l2norm)
    return o


@recurrent_gated_delta_op.register_fake
def _(q, k, v, g, beta, state, scale, use_qk_l2norm):
    return torch.empty_like(v)


def _launch(cfg, q, k, v, g, beta, state, o, scale, l2norm):
    B, T, H, K = q.shape
    V = v.shape[-1]
    BV, nw = cfg
    _recurrent_kernel[(triton.cdiv(V, BV), B * H)](
        q, k, v, g, beta, state, o, scale, T, H=H, K=K, V=V, BK=max(16, triton.next_power_of_2(K)),
        BV=BV, L2NORM=l2norm, num_warps=nw,
    )


def _pick(q, k, v, g, beta, state, o, scale, l2norm):
    """Fastest (BV, num_warps) for this shape, timed once on scratch copies: triton's autotuner
    would need restore_value on the in-place state, and the copies it times along with each
    config drown the differences between configs."""
    B, T, H, K = q.shape
    key = (B * H, K, v.shape[-1], min(T, 8), q.dtype, q.device)
    if key not in _BEST:
        if not _AUTOTUNE:
            _BEST[key] = _CONFIGS[0]
        else:
            from triton.testing import do_bench

            s2, o2 = state.clone(), torch.empty_like(o)
            times = {c: do_bench(lambda c=c: _launch(c, q, k, v, g, beta, s2, o2, scale, l2norm),
                                 warmup=5, rep=25, return_mode="median") for c in _CONFIGS}
            _BEST[key] = min(times, key=times.get)
    return _BEST[key]
