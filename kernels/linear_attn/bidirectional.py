"""Non-causal (encoder) linear attention with Hedgehog's feature maps computed in the kernels.

    phi(x)_h = softmax([x W_h, -x W_h])                           x (B, T, H, D), W (H, D, P), F = 2P
    o_t      = phi(q_t) KV / (phi(q_t) . ks + eps),   KV = sum_j phi(k_j)^T v_j,   ks = sum_j phi(k_j)

over the real keys j (``valid``). Two kernels, no feature tensor in memory:

1. ``_kv_kernel``, one program per (batch row and head, segment of the sequence): the keys' features
   of each block of BT tokens in registers (one ``tl.dot`` against W_h and the softmax), then
   phi(k)^T v and the feature sums accumulated in fp32; each segment writes its partial KV and ks, and
   the few segments (enough programs to fill the GPU) are summed in PyTorch.
2. ``_out_kernel``, one program per (block of queries, batch row and head): the queries' features the
   same way, then the numerator and the normaliser against KV and ks, written as o (B, T, H, Dv).

In PyTorch (``EncoderLinearAttention`` on its own) the same is the maps' GEMMs and softmaxes, the
features of q and k written out (twice the size of q and k), copies of them and of v into the batched
GEMMs' layouts, a second pass over phi(q) for the normaliser and the division in fp32: ~1.4 ms a layer
of BERT-base at 8 x 8K tokens on an H100 (docs/reports/encoders.md), where the bytes a layer must
move (q, k, v read and o written) take ~0.1 ms.

Products: the maps' GEMMs as ``features.py`` does (``tf32x3`` for 16-bit inputs, ``ieee`` for fp32);
phi^T v and phi KV in tf32 for 16-bit inputs (phi in [0, 1], fp32 accumulation; the PyTorch path
rounds both to bf16), ``ieee`` for fp32 inputs (whose users ask for fp32 results). No autograd: inference only (training
runs the PyTorch path). :func:`bidirectional_hedgehog_ref` is the readable twin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launch import call_directly, launch
from .features import hedgehog_tile

# kv_warps: the keys' pass; warps: the queries' pass. Read at each call (the op is opaque to
# torch.compile). The keys' pass spills ~360 bytes a thread at 4 warps (ptxas -v, sm_90a), yet 8 warps
# ran 8-11% slower on an H100 (scripts/bench_encoders.py --kv-warps 8, docs/reports/encoders.md).
CONFIG = {"BT": 64, "warps": 4, "kv_warps": 4, "stages": 2, "tokens_per_segment": 512}


@triton.jit
def _phi(p_x, m_x, b_w, m_p, PREC: tl.constexpr):
    """Hedgehog's features of a [BT, BD] tile of x read at ``p_x``: the two halves softmax([y, -y])."""
    return hedgehog_tile(tl.load(p_x, mask=m_x, other=0.).to(tl.float32), b_w, m_p, PREC)


@triton.jit
def _kv_kernel(k, v, wk, valid, kv, ks, T, SEG, skb, skt, skh, svb, svt, svh,
               H: tl.constexpr, D: tl.constexpr, P: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr,
               BD: tl.constexpr, BP: tl.constexpr, BDV: tl.constexpr, VALID: tl.constexpr, PREC: tl.constexpr,
               PREC_KV: tl.constexpr):
    i_bh, i_s = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_t, o_d, o_p, o_v = tl.arange(0, BT), tl.arange(0, BD), tl.arange(0, BP), tl.arange(0, BDV)
    m_d, m_p, m_v = o_d < D, o_p < P, o_v < DV
    b_w = tl.load(wk + i_h * D * P + o_d[:, None] * P + o_p[None, :], mask=m_d[:, None] & m_p[None, :],
                  other=0.).to(tl.float32)
    a1 = tl.zeros([BP, BDV], dtype=tl.float32)
    a2 = tl.zeros([BP, BDV], dtype=tl.float32)
    s1 = tl.zeros([BP], dtype=tl.float32)
    s2 = tl.zeros([BP], dtype=tl.float32)
    t_end = tl.minimum(T, (i_s + 1) * SEG)
    for t0 in range(i_s * SEG, t_end, BT):
        t = t0 + o_t
        m_t = t < t_end
        p_k = k + i_b.to(tl.int64) * skb + t[:, None].to(tl.int64) * skt + i_h * skh + o_d[None, :]
        f1, f2 = _phi(p_k, m_t[:, None] & m_d[None, :], b_w, m_p, PREC)
        keep = m_t
        if VALID:
            keep = keep & (tl.load(valid + i_b.to(tl.int64) * T + t, mask=m_t, other=0.) > 0)
        f1 = tl.where(keep[:, None], f1, 0.)
        f2 = tl.where(keep[:, None], f2, 0.)
        p_v = v + i_b.to(tl.int64) * svb + t[:, None].to(tl.int64) * svt + i_h * svh + o_v[None, :]
        b_v = tl.load(p_v, mask=m_t[:, None] & m_v[None, :], other=0.).to(tl.float32)
        a1 += tl.dot(tl.trans(f1), b_v, input_precision=PREC_KV)
        a2 += tl.dot(tl.trans(f2), b_v, input_precision=PREC_KV)
        s1 += tl.sum(f1, axis=0)
        s2 += tl.sum(f2, axis=0)
    base = (i_s * tl.num_programs(0) + i_bh).to(tl.int64)
    p_kv = kv + base * (2 * P * DV) + o_p[:, None] * DV + o_v[None, :]
    m_kv = m_p[:, None] & m_v[None, :]
    tl.store(p_kv, a1, mask=m_kv)
    tl.store(p_kv + P * DV, a2, mask=m_kv)
    tl.store(ks + base * (2 * P) + o_p, s1, mask=m_p)
    tl.store(ks + base * (2 * P) + P + o_p, s2, mask=m_p)


@triton.jit
def _out_kernel(q, wq, kv, ks, o, T, eps, sqb, sqt, sqh,
                H: tl.constexpr, D: tl.constexpr, P: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr,
                BD: tl.constexpr, BP: tl.constexpr, BDV: tl.constexpr, PREC: tl.constexpr, PREC_KV: tl.constexpr):
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_d, o_p, o_v = tl.arange(0, BD), tl.arange(0, BP), tl.arange(0, BDV)
    m_d, m_p, m_v = o_d < D, o_p < P, o_v < DV
    t = i_t * BT + tl.arange(0, BT)
    m_t = t < T
    b_w = tl.load(wq + i_h * D * P + o_d[:, None] * P + o_p[None, :], mask=m_d[:, None] & m_p[None, :],
                  other=0.).to(tl.float32)
    p_kv = kv + i_bh.to(tl.int64) * (2 * P * DV) + o_p[:, None] * DV + o_v[None, :]
    m_kv = m_p[:, None] & m_v[None, :]
    kv1 = tl.load(p_kv, mask=m_kv, other=0.)
    kv2 = tl.load(p_kv + P * DV, mask=m_kv, other=0.)
    ks1 = tl.load(ks + i_bh.to(tl.int64) * (2 * P) + o_p, mask=m_p, other=0.)
    ks2 = tl.load(ks + i_bh.to(tl.int64) * (2 * P) + P + o_p, mask=m_p, other=0.)
    p_q = q + i_b.to(tl.int64) * sqb + t[:, None].to(tl.int64) * sqt + i_h * sqh + o_d[None, :]
    f1, f2 = _phi(p_q, m_t[:, None] & m_d[None, :], b_w, m_p, PREC)
    num = tl.dot(f1, kv1, input_precision=PREC_KV) + tl.dot(f2, kv2, input_precision=PREC_KV)
    den = tl.sum(f1 * ks1[None, :], axis=1) + tl.sum(f2 * ks2[None, :], axis=1) + eps
    p_o = o + ((i_b.to(tl.int64) * T + t[:, None]) * H + i_h) * DV + o_v[None, :]
    tl.store(p_o, (num / den[:, None]).to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])


def _segments(T: int, BH: int, device: torch.device) -> int:
    """How many segments the keys' pass cuts each sequence into: enough programs for two per SM, each
    segment at least ``tokens_per_segment`` long."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min(triton.cdiv(T, CONFIG["tokens_per_segment"]), triton.cdiv(2 * sms, BH)))


def _bidirectional_hedgehog(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, wq: torch.Tensor,
                            wk: torch.Tensor, valid: torch.Tensor | None, eps: float) -> torch.Tensor:
    B, T, H, D = q.shape
    P, DV = wq.shape[-1], v.shape[-1]
    o = torch.empty(B, T, H, DV, device=v.device, dtype=v.dtype)
    if B * T == 0:
        return o
    BT = CONFIG["BT"]
    NS = _segments(T, B * H, q.device)
    SEG = triton.cdiv(triton.cdiv(T, NS), BT) * BT
    NS = triton.cdiv(T, SEG)
    kv = torch.empty(NS, B * H, 2 * P, DV, device=v.device, dtype=torch.float32)
    ks = torch.empty(NS, B * H, 2 * P, device=v.device, dtype=torch.float32)
    BD, BP, BDV = (max(16, triton.next_power_of_2(n)) for n in (D, P, DV))
    prec = "ieee" if q.dtype == torch.float32 else "tf32x3"
    opts = dict(num_stages=CONFIG["stages"], PREC=prec, PREC_KV="ieee" if q.dtype == torch.float32 else "tf32")
    launch(_kv_kernel, (B * H, NS), k, v, wk, valid, kv, ks, T, SEG, *k.stride()[:3], *v.stride()[:3],
           H=H, D=D, P=P, DV=DV, BT=BT, BD=BD, BP=BP, BDV=BDV, VALID=valid is not None,
           num_warps=CONFIG["kv_warps"], **opts)
    if NS > 1:
        kv, ks = kv.sum(0), ks.sum(0)
    launch(_out_kernel, (triton.cdiv(T, BT), B * H), q, wq, kv, ks, o, T, eps, *q.stride()[:3],
           H=H, D=D, P=P, DV=DV, BT=BT, BD=BD, BP=BP, BDV=BDV, num_warps=CONFIG["warps"], **opts)
    return o


bidirectional_hedgehog_op = torch.library.custom_op("linearize::bidirectional_hedgehog", mutates_args=())(
    _bidirectional_hedgehog)


@bidirectional_hedgehog_op.register_fake
def _(q, k, v, wq, wk, valid, eps):
    return v.new_empty(*q.shape[:3], v.shape[-1])


def bidirectional_hedgehog(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor,
                           valid: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """Non-causal linear attention with Hedgehog's maps, without gradients (inference).

    Args:
        q, k: (B, T, H, D) raw queries and keys (after RoPE if the model has it); v: (B, T, H, Dv); one
            dtype among fp32 / bf16 / fp16, any strides with a unit stride along the last dim (views of
            a fused projection are fine).
        wq, wk: (H, D, P) the maps' weights (``Hedgehog.weight``), any float dtype (read as fp32).
        valid: optional (B, T), nonzero for real tokens: pad keys add nothing (pad queries get an output
            like any other, which the caller ignores).
        eps: added to the normaliser.

    Returns:
        o (B, T, H, Dv) in v's dtype.
    """
    B, T, H, D = q.shape
    P = wq.shape[-1]
    if (k.shape != q.shape or v.shape[:3] != q.shape[:3] or wq.shape != (H, D, P) or wk.shape != (H, D, P)
            or not q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}, v {tuple(v.shape)} {v.dtype}, "
                         f"wq {tuple(wq.shape)}, wk {tuple(wk.shape)} do not fit: q, k (B, T, H, D), v (B, T, H, Dv) "
                         "of one dtype, wq and wk (H, D, P)")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"q, k, v must be fp32, bf16 or fp16, got {q.dtype}")
    if not (1 <= D <= 256 and 1 <= P <= 128 and 1 <= v.shape[-1] <= 256):
        raise ValueError(f"head dims must be in [1, 256] and feature columns in [1, 128], got D={D}, P={P}, "
                         f"Dv={v.shape[-1]}")
    if valid is not None:
        if valid.shape != (B, T):
            raise ValueError(f"valid must be (B, T) = {(B, T)}, got {tuple(valid.shape)}")
        valid = valid.to(torch.float32).contiguous()
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    wq, wk = wq.detach().contiguous(), wk.detach().contiguous()
    if call_directly(False):
        return _bidirectional_hedgehog(q, k, v, wq, wk, valid, float(eps))
    return torch.ops.linearize.bidirectional_hedgehog(q, k, v, wq, wk, valid, float(eps))


def bidirectional_hedgehog_ref(q, k, v, wq, wk, valid=None, eps=1e-6):
    """The readable PyTorch twin, in fp32 (float64 stays float64); returns o in that dtype."""
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32

    def phi(x, w):
        y = torch.einsum("bthd,hdp->bthp", x.to(dt), w.to(dt))
        return torch.softmax(torch.cat([y, -y], dim=-1), dim=-1)

    qf, kf = phi(q, wq), phi(k, wk)
    if valid is not None:
        kf = kf * (valid != 0).to(dt)[:, :, None, None]
    kv = torch.einsum("bthf,bthd->bhfd", kf, v.to(dt))
    num = torch.einsum("bthf,bhfd->bthd", qf, kv)
    den = torch.einsum("bthf,bhf->bth", qf, kf.sum(1)) + eps
    return num / den[..., None]
