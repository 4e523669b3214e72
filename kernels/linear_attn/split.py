"""Split-time forward for inference: the chunk kernel with more parallelism at small batch x heads.

The chunk forward (chunk.py) gives one program to each (sequence, head, block of Dv) and walks the
chunks in order. With few sequences and heads (prefill of one long prompt: B=1, H=9) that is a
handful of programs on a GPU with 132 multiprocessors, and the time grows with T on one core
each. Without gradients the sequence can be cut into ``num_splits`` segments instead:

1. ``_state_kernel``: each segment's own contribution to the state, from an empty state
   (``S_j = sum_s G(s, end_j) k_s^T v_s``, ``z_j`` likewise), all segments in parallel;
2. a scan over segments (one small einsum): the state entering segment j is
   ``init_j = G(start_0, start_j) S_0 + sum_{i<j} G(end_i, start_j) S_i``;
3. the ordinary chunk forward on the segments as packed sequences (``cu_seqlens``), each starting
   from ``init_j``; ``init`` one past the last segment is the final state.

The result equals the sequential forward up to float rounding (the state is summed in another
order). Pass 1 reads k and v once more: worth it only when the sequential walk leaves the GPU idle,
which ``auto_splits`` decides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import chunk as _chunk


@triton.jit
def _state_kernel(k, v, lg, hts, htz, cu, TT,
                  H: tl.constexpr, F: tl.constexpr, DV: tl.constexpr,
                  BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr, PREC: tl.constexpr):
    """One program per (segment, head, block of Dv): the segment's state from zero, decayed to its end."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, Tn = _chunk._seq_bounds(cu, i_n, 0, True)
    o_k = tl.arange(0, BK)
    h = tl.zeros([BK, BV], dtype=tl.float32)
    z = tl.zeros([BK], dtype=tl.float32)
    for i_t in range(0, tl.cdiv(Tn, BT)):
        p_k, m_k = _chunk._tile(k + (bos * H + i_h) * F, i_t * BT, Tn, H * F, 0, F, BT, BK)
        p_v, m_v = _chunk._tile(v + (bos * H + i_h) * DV, i_t * BT, Tn, H * DV, i_v * BV, DV, BT, BV)
        b_k = tl.load(p_k, mask=m_k, other=0.)
        b_v = tl.load(p_v, mask=m_v, other=0.)
        if GATE:
            b_g, g_last = _chunk._load_gate(lg, bos, i_t, Tn, i_h, TT, BT)
            k32 = b_k.to(tl.float32) * tl.exp(g_last - b_g)[:, None]
            h = h * tl.exp(g_last)
            z = z * tl.exp(g_last)
        else:
            k32 = b_k.to(tl.float32)
        h += tl.dot(tl.trans(k32.to(b_k.dtype)), b_v, input_precision=PREC)
        z += tl.sum(k32, axis=0)
    p_ht, m_ht = _chunk._tile(hts + i_nh * F * DV, 0, F, DV, i_v * BV, DV, BK, BV)
    tl.store(p_ht, h, mask=m_ht)
    if i_v == 0:
        tl.store(htz + i_nh * F + o_k, z, mask=o_k < F)


def auto_splits(q: torch.Tensor, v: torch.Tensor, min_len: int = 1024) -> int:
    """How many segments fill the GPU: enough programs for two waves over the multiprocessors,
    each segment at least ``min_len`` tokens. 1 (no split) on CPU, or when the unsplit call already
    has programs for a quarter of the multiprocessors (B=2, H=32 on an H200: measured slower split)."""
    if not q.is_cuda:
        return 1
    B, T, H, F = q.shape
    cfg = _chunk._cfg(F, v.shape[-1])
    BK = _chunk._next_pow2(F)
    nv = triton.cdiv(v.shape[-1], _chunk._split(_chunk._next_pow2(v.shape[-1]), BK, cfg["fwd_block_elems"]))
    programs = B * H * nv
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    if programs > sms // 4:  # pass 1 and the scan cost ~0.5 ms of launches: not worth it once a quarter of the GPU is busy
        return 1
    want = -(-2 * sms // programs)
    return max(1, min(want, T // min_len))


def split_time_fwd(q, k, v, log_g, S0, z0, normalize, eps, output_final_state, num_splits):
    """Chunk forward (no gradients) over ``num_splits`` segments per sequence.

    q, k [B, T, H, F]; v [B, T, H, Dv]; log_g None or [H, B*T] fp32 (the chunk kernels' layout);
    S0, z0 None or fp32 [B, H, F, Dv], [B, H, F]. Returns o, Sn, zn like ``chunk.chunk_fwd``."""
    B, T, H, F = q.shape
    DV = v.shape[-1]
    cfg = _chunk._cfg(F, DV)
    BT = cfg["BT"]
    L = triton.cdiv(triton.cdiv(T, num_splits), BT) * BT  # segment length, whole chunks
    starts = list(range(0, T, L))
    n = len(starts)
    dev = q.device
    bounds = torch.tensor([b * T + s for b in range(B) for s in starts] + [B * T], device=dev, dtype=torch.int32)
    N = B * n
    qf, kf, vf = (x.reshape(1, B * T, H, x.shape[-1]) for x in (q, k, v))

    # 1. each segment's own state
    BK = _chunk._next_pow2(F)
    BV = _chunk._split(_chunk._next_pow2(DV), BK, cfg["fwd_block_elems"])
    Sl = torch.empty(N, H, F, DV, device=dev, dtype=torch.float32)
    zl = torch.empty(N, H, F, device=dev, dtype=torch.float32)
    _state_kernel[(triton.cdiv(DV, BV), N * H)](
        kf, vf, log_g, Sl, zl, bounds, B * T, H=H, F=F, DV=DV, BT=BT, BK=BK, BV=BV,
        GATE=log_g is not None, PREC=_chunk._prec(q), num_warps=cfg["fwd_warps"], num_stages=cfg["fwd_stages"])

    # 2. scan over segments: init_j = sum_{i<j} G(end_i -> start_j) S_i + G(0 -> start_j) S_0
    Sl, zl = Sl.view(B, n, H, F, DV), zl.view(B, n, H, F)
    lower = torch.ones(n + 1, n, device=dev).tril(-1).bool()  # [j, i]: segment i ends before j starts
    if log_g is None:
        w = lower.float().expand(B, H, n + 1, n)
        w0 = torch.ones(B, H, n + 1, device=dev)
    else:
        seg = torch.arange(n, device=dev).repeat_interleave(torch.tensor([min(L, T - s) for s in starts], device=dev))
        G = torch.zeros(H, B, n, device=dev).index_add_(2, seg, log_g.view(H, B, T))  # log gate of each segment
        C = torch.cat([torch.zeros(H, B, 1, device=dev), G.cumsum(-1)], -1).permute(1, 0, 2)  # (B, H, n+1): at starts
        w = torch.exp((C[..., :, None] - C[..., None, 1:]).masked_fill(~lower, float("-inf")))
        w0 = torch.exp(C)
    init_S = torch.einsum("bhji,bihfd->bjhfd", w, Sl)
    init_z = torch.einsum("bhji,bihf->bjhf", w, zl)
    if S0 is not None:
        init_S = init_S + w0.transpose(1, 2)[..., None, None] * S0[:, None]
        init_z = init_z + w0.transpose(1, 2)[..., None] * z0[:, None]

    # 3. the chunk forward on the segments, each from its entering state
    o, _, _, _ = _chunk.chunk_fwd(qf, kf, vf, log_g, init_S[:, :n].reshape(N, H, F, DV).contiguous(),
                                  init_z[:, :n].reshape(N, H, F).contiguous(), normalize, eps, False, bounds, False)
    if not output_final_state:
        return o.view(B, T, H, DV), None, None, None
    return o.view(B, T, H, DV), None, init_S[:, n].contiguous(), init_z[:, n].contiguous()
