"""A softmax attention layer's decode step over a key/value cache, grouped-query heads read once.

    o[b, h] = softmax(scale * q[b, h] . K[b, h // G]^T, over the positions mask[b] allows) V[b, h // G]

The softmax layers a hybrid keeps decode through transformers' sdpa path. With a static cache that
path attends over every slot of the cache (a boolean mask (B, 1, 1, L) says which hold tokens), and
for grouped-query attention (G query heads per key/value head) it first writes the keys and values
out G times (``repeat_kv``): a step moves the whole cache 2G + 1 times where once would do
(SmolLM2: G = 3, B = 8 at 64K, 0.4 GB of keys and values per layer).

Here (flash decoding) the positions are cut into splits; one program takes one key/value head and
one split, reads each block of BL positions once for all G query heads of its group (a [G, D] x
[D, BL] dot, G padded to 16, the tensor cores' smallest tile), keeps the running max, sum and
weighted values of an online softmax in fp32, and writes them; a second kernel merges the splits.
Positions with nothing to attend (the static cache's unfilled tail, left padding) are not fetched.
The probabilities meet the values in the input dtype (as flash attention does), the output is
rounded once. No autograd: a decode step. :func:`softmax_decode_ref` is the readable twin.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .launch import launch

# Tile rules, from a sweep on an H200 (docs/softmax_decode.md): positions per block (None: 64 up to
# LARGE_AT key/value positions over the batch's heads, 128 above), programs per SM over the batch's
# key/value heads (the splits), warps and pipeline stages per program.
BL = None
LARGE_AT = 1 << 18
PROGRAMS_PER_SM = 8
WARPS, STAGES = 4, 3
MAX_HEAD_DIM = 256


@triton.jit
def _split_kernel(q, k, v, mask, part_o, part_ml, L, SPLIT, scale, NS,
                  sqb, sqh, skb, skh, skl, svb, svh, svl, smb,
                  HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr,
                  BL: tl.constexpr, MASK: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr):
    i_bh, i_s = tl.program_id(0), tl.program_id(1)
    i_b, i_hk = i_bh // HKV, i_bh % HKV
    o_g, o_d = tl.arange(0, BG), tl.arange(0, BD)
    m_g, m_d = o_g < G, o_d < D
    heads = i_hk * G + o_g  # the query heads of this key/value head
    b_q = tl.load(q + i_b * sqb + heads[:, None] * sqh + o_d[None, :], mask=m_g[:, None] & m_d[None, :], other=0.)
    if UPCAST:
        b_q = b_q.to(tl.float32)
    m_i = tl.full([BG], float("-inf"), tl.float32)
    l_i = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, BD], tl.float32)
    k_base = k + i_b * skb + i_hk * skh
    v_base = v + i_b * svb + i_hk * svh
    start = i_s * SPLIT
    end = tl.minimum(start + SPLIT, L)
    for off in range(start, end, BL):
        o_l = off + tl.arange(0, BL)
        valid = o_l < end
        if MASK:
            valid = valid & (tl.load(mask + i_b * smb + o_l, mask=valid, other=0) != 0)
        # masked-off positions are not fetched (the static cache's empty tail costs no bandwidth); no
        # branch around the loads, so the loop stays software-pipelined
        b_k = tl.load(k_base + o_l[:, None] * skl + o_d[None, :], mask=valid[:, None] & m_d[None, :], other=0.)
        b_v = tl.load(v_base + o_l[:, None] * svl + o_d[None, :], mask=valid[:, None] & m_d[None, :], other=0.)
        if UPCAST:
            b_k, b_v = b_k.to(tl.float32), b_v.to(tl.float32)
        s = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * scale  # [BG, BL]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0., m_new)  # nothing attended yet: exp(-inf) = 0, no NaN
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(b_v.dtype), b_v, input_precision=PREC)
        m_i = m_new
    rows = i_b * (HKV * G) + heads  # (b, h) row of the partial results
    tl.store(part_ml + (rows * NS + i_s) * 2, m_i, mask=m_g)
    tl.store(part_ml + (rows * NS + i_s) * 2 + 1, l_i, mask=m_g)
    tl.store(part_o + (rows[:, None] * NS + i_s) * D + o_d[None, :], acc, mask=m_g[:, None] & m_d[None, :])


@triton.jit
def _merge_kernel(part_o, part_ml, o, NS, sob, soh, H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                  BD: tl.constexpr):
    row = tl.program_id(0)  # b * H + h
    i_b, i_h = row // H, row % H
    o_s, o_d = tl.arange(0, BS), tl.arange(0, BD)
    m_s, m_d = o_s < NS, o_d < D
    m = tl.load(part_ml + (row * NS + o_s) * 2, mask=m_s, other=float("-inf"))
    l = tl.load(part_ml + (row * NS + o_s) * 2 + 1, mask=m_s, other=0.)
    mx = tl.max(m, 0)
    mx = tl.where(mx == float("-inf"), 0., mx)  # no position at all: every weight 0, the output 0
    w = tl.where(m == float("-inf"), 0., tl.exp(m - mx))
    den = tl.sum(w * l, 0)
    b_o = tl.load(part_o + (row * NS + o_s[:, None]) * D + o_d[None, :], mask=m_s[:, None] & m_d[None, :], other=0.)
    out = tl.sum(b_o * w[:, None], 0) / tl.where(den > 0, den, 1.)
    tl.store(o + i_b * sob + i_h * soh + o_d, out.to(o.dtype.element_ty), mask=m_d)


def _block(B: int, Hkv: int, L: int) -> int:
    return BL if BL is not None else 64 if B * Hkv * L <= LARGE_AT else 128


def _splits(B: int, Hkv: int, L: int, device: torch.device) -> tuple[int, int]:
    """(positions per split, number of splits): about PROGRAMS_PER_SM programs per SM over B x Hkv
    heads, each split a whole number of blocks."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    bl = _block(B, Hkv, L)
    blocks = triton.cdiv(max(L, 1), bl)
    want = max(1, min(blocks, triton.cdiv(PROGRAMS_PER_SM * sms, B * Hkv)))
    split = triton.cdiv(blocks, want) * bl
    return split, triton.cdiv(max(L, 1), split)


def _launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    B, H, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = H // Hkv
    o = torch.empty(B, H, D, device=q.device, dtype=q.dtype)
    if B == 0 or H == 0:
        return o
    split, ns = _splits(B, Hkv, L, q.device)
    part_o = torch.empty(B * H * ns * D, device=q.device, dtype=torch.float32)
    part_ml = torch.empty(B * H * ns * 2, device=q.device, dtype=torch.float32)
    upcast = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") and q.dtype != torch.float32
    prec = "ieee" if q.dtype == torch.float32 or upcast else "tf32"
    BD = max(16, triton.next_power_of_2(D))
    m = mask if mask is not None else q  # a placeholder pointer (MASK=False never reads it)
    launch(_split_kernel, (B * Hkv, ns), q, k, v, m, part_o, part_ml, L, split, scale, ns,
           q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
           mask.stride(0) if mask is not None else 0,
           HKV=Hkv, G=G, D=D, BG=max(16, triton.next_power_of_2(G)), BD=BD, BL=_block(B, Hkv, L), MASK=mask is not None,
           UPCAST=upcast, PREC=prec, num_warps=WARPS, num_stages=STAGES)
    launch(_merge_kernel, (B * H,), part_o, part_ml, o, ns, o.stride(0), o.stride(1), H=H, D=D,
           BS=max(2, triton.next_power_of_2(ns)), BD=BD, num_warps=4, num_stages=1)
    return o


@torch.library.custom_op("linearize::softmax_decode", mutates_args=())
def softmax_decode_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scale: float) -> torch.Tensor:
    """:func:`softmax_decode` as a torch op (q [B, H, D] with unit last stride, mask [B, L] bool)."""
    return _launch(q, k, v, mask, scale)


@softmax_decode_op.register_fake
def _(q, k, v, mask, scale):
    return q.new_empty(q.shape)


def softmax_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, *,
                   scale: float | None = None) -> torch.Tensor:
    """One query per sequence against a key/value cache: q [B, H, D], k and v [B, Hkv, L, D] (the
    layout of transformers' caches, any strides with a unit last one), H a multiple of Hkv; ``mask``
    [B, L] bool (True: attend) or None (every position). ``scale`` defaults to D ** -0.5. Returns
    [B, H, D] in q's dtype; a row with no position to attend gives zeros."""
    if q.dim() != 3 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"q [B, H, D] and k, v [B, Hkv, L, D] of one shape: got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    B, H, D = q.shape
    if k.shape[0] != B or k.shape[3] != D or H % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} does not fit k {tuple(k.shape)}: same B and D, H a multiple of Hkv")
    if D > MAX_HEAD_DIM:
        raise ValueError(f"head dim {D}: the decode kernel takes at most {MAX_HEAD_DIM}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v in one dtype: got {q.dtype}, {k.dtype}, {v.dtype}")
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (B, k.shape[2])):
        raise ValueError(f"mask: a bool [B, L] = {(B, k.shape[2])} tensor, got {mask.dtype} {tuple(mask.shape)}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    mask = None if mask is None else (mask if mask.stride(-1) == 1 else mask.contiguous())
    return torch.ops.linearize.softmax_decode(q, k, v, mask, float(D ** -0.5 if scale is None else scale))


def softmax_decode_ref(q, k, v, mask=None, *, scale=None):
    """Readable twin of :func:`softmax_decode`: the keys and values repeated per query head, the
    softmax in float64, rounded once to q's dtype (zeros where nothing is attended)."""
    B, H, D = q.shape
    G = H // k.shape[1]
    kk, vv = k.double().repeat_interleave(G, dim=1), v.double().repeat_interleave(G, dim=1)
    s = torch.einsum("bhd,bhld->bhl", q.double(), kk) * (D ** -0.5 if scale is None else scale)
    if mask is not None:
        s = s.masked_fill(~mask[:, None, :], float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("bhl,bhld->bhd", p, vv).to(q.dtype)
