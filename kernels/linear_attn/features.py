"""Hedgehog feature map for a prefill: one Triton kernel from the raw queries or keys to the features
the chunk kernels read.

    phi(x)_h = softmax([x W_h, -x W_h])      x (B, T, Hx, D), W (H, D, P), phi (B, T, H, 2P)

With GQA (keys: Hx = H / rep) head h reads x head h // rep, so the repeated copy of x is never made.
One program per (block of BN tokens, head): the tile of x in fp32, one ``tl.dot`` against W_h,
the softmax over the 2P features in registers (the max of ``[y, -y]`` is ``max |y|``), and one store
in the dtype the chunk kernels read. In PyTorch the same is a GEMM in fp32, a softmax and a cast
(a copy of x in fp32 and two fp32 round trips of the features through memory: 3-4 passes over a
tensor twice the features' size, the largest glue of a Hedgehog prefill on the GPU).

Products: x (bf16 or fp16 from the model) is exact in tf32, so ``tf32x3`` (three tensor-core
products, W split in two tf32 parts) gives fp32 accuracy; fp32 x takes true fp32 products
(``ieee``). No autograd: inference only (training computes ``Hedgehog.forward`` in PyTorch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launch import call_directly, launch

CONFIG = {"BN": 64, "warps": 4, "stages": 2}


@triton.jit
def hedgehog_tile(b_x, b_w, m_p, PREC: tl.constexpr):
    """Hedgehog's features of a tile of rows: x [BN, BD] fp32, W_h [BD, BP] fp32 (columns past P masked by
    ``m_p``) -> the two halves of softmax([x W, -x W]), each [BN, BP] fp32 (zero past P)."""
    y = tl.dot(b_x, b_w, input_precision=PREC)  # [BN, BP]
    m = tl.max(tl.where(m_p[None, :], tl.abs(y), 0.), axis=1)  # max of [y, -y] over the real columns
    e1 = tl.where(m_p[None, :], tl.exp(y - m[:, None]), 0.)
    e2 = tl.where(m_p[None, :], tl.exp(-y - m[:, None]), 0.)
    inv = 1.0 / (tl.sum(e1, axis=1) + tl.sum(e2, axis=1))
    return e1 * inv[:, None], e2 * inv[:, None]


@triton.jit
def _features_kernel(x, w, out, N, T, sxb, sxt, sxh, H: tl.constexpr, REP: tl.constexpr, D: tl.constexpr,
                     P: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BP: tl.constexpr, PREC: tl.constexpr):
    i_n, i_h = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BN + tl.arange(0, BN)
    o_d = tl.arange(0, BD)
    o_p = tl.arange(0, BP)
    m_n, m_d, m_p = o_n < N, o_d < D, o_p < P
    b = (o_n // T).to(tl.int64)
    t = (o_n % T).to(tl.int64)
    p_x = x + b[:, None] * sxb + t[:, None] * sxt + (i_h // REP) * sxh + o_d[None, :]
    b_x = tl.load(p_x, mask=m_n[:, None] & m_d[None, :], other=0.).to(tl.float32)
    p_w = w + i_h * D * P + o_d[:, None] * P + o_p[None, :]
    b_w = tl.load(p_w, mask=m_d[:, None] & m_p[None, :], other=0.).to(tl.float32)
    f1, f2 = hedgehog_tile(b_x, b_w, m_p, PREC)
    p_o = out + o_n.to(tl.int64)[:, None] * (H * 2 * P) + i_h * 2 * P + o_p[None, :]
    m_o = m_n[:, None] & m_p[None, :]
    tl.store(p_o, f1.to(out.dtype.element_ty), mask=m_o)
    tl.store(p_o + P, f2.to(out.dtype.element_ty), mask=m_o)


def _hedgehog_features(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    B, T, Hx, D = x.shape
    H, _, P = w.shape
    out = torch.empty(B, T, H, 2 * P, device=x.device, dtype=out_dtype)
    N = B * T
    if N == 0:
        return out
    BD, BP = max(16, triton.next_power_of_2(D)), max(16, triton.next_power_of_2(P))
    prec = "ieee" if x.dtype == torch.float32 else "tf32x3"
    launch(_features_kernel, (triton.cdiv(N, CONFIG["BN"]), H), x, w, out, N, T, x.stride(0), x.stride(1),
           x.stride(2), H=H, REP=H // Hx, D=D, P=P, BN=CONFIG["BN"], BD=BD, BP=BP, PREC=prec,
           num_warps=CONFIG["warps"], num_stages=CONFIG["stages"])
    return out


hedgehog_features_op = torch.library.custom_op("linearize::hedgehog_features", mutates_args=())(_hedgehog_features)


@hedgehog_features_op.register_fake
def _(x, w, out_dtype):
    B, T = x.shape[:2]
    return x.new_empty(B, T, w.shape[0], 2 * w.shape[2], dtype=out_dtype)


def hedgehog_features(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Hedgehog features of raw queries or keys, without gradients.

    Args:
        x: (B, T, Hx, D) fp32/bf16/fp16, last dim contiguous (a strided view of a projection is fine);
            Hx divides H (GQA keys: head h reads x head h // (H / Hx)).
        w: (H, D, P) the map's weights (``Hedgehog.weight``), any float dtype (read as fp32).
        out_dtype: the features' dtype.

    Returns:
        (B, T, H, 2P) contiguous in ``out_dtype``: ``softmax([x W_h, -x W_h])`` per head.
    """
    H, D, P = w.shape
    if x.dim() != 4 or x.shape[-1] != D:
        raise ValueError(f"x must be (B, T, Hx, {D}), got {tuple(x.shape)}")
    if H % x.shape[2]:
        raise ValueError(f"x has {x.shape[2]} heads, which do not divide the map's {H}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x must be fp32, bf16 or fp16, got {x.dtype} (float64 runs Hedgehog.forward)")
    if not 1 <= D <= 256 or not 1 <= P <= 256:
        raise ValueError(f"head dim and feature columns must be in [1, 256], got D={D}, P={P}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    w = w.detach().contiguous()
    if call_directly(False):
        return _hedgehog_features(x, w, out_dtype)
    return torch.ops.linearize.hedgehog_features(x, w, out_dtype)


def hedgehog_features_ref(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The PyTorch twin: ``Hedgehog.forward`` on the repeated heads, in fp32 (float64 stays)."""
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    rep = w.shape[0] // x.shape[2]
    xr = x.to(dt).repeat_interleave(rep, dim=2)
    y = torch.einsum("bthd,hdp->bthp", xr, w.to(dt))
    return torch.softmax(torch.cat([y, -y], dim=-1), dim=-1).to(out_dtype)
