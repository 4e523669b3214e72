"""Split-time forward for inference: the chunk kernel with more parallelism at small batch x heads.

The chunk forward (chunk.py) gives one program to each (sequence, head, block of Dv) and walks the
chunks in order. With few sequences and heads (prefill of one long prompt: B=1, H=9) that is a
handful of programs on a GPU with 132 multiprocessors, and the time grows with T on one core
each. Without gradients the sequence can be cut into ``num_splits`` segments instead:

1. each segment's own contribution to the state, from an empty state
   (``S_j = sum_s G(s, end_j) k_s^T v_s``, ``z_j`` likewise), all segments in parallel: the chunk
   forward kernel in its state-only mode (no q read, no output);
2. a scan over segments (a prefix sum, or one small einsum with a gate): the state entering
   segment j is ``init_j = G(start_0, start_j) S_0 + sum_{i<j} G(end_i, start_j) S_i``;
3. the ordinary chunk forward on the segments as packed sequences (``cu_seqlens``), each starting
   from ``init_j``; ``init`` one past the last segment is the final state.

The result equals the sequential forward up to float rounding (the state is summed in another
order). Pass 1 reads k and v once more: worth it only when the sequential walk leaves the GPU idle,
which ``auto_splits`` decides.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as Fn
import triton

from . import chunk as _chunk


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
    sms = _multiprocessors(q.device)
    if programs > sms // 4:  # pass 1 and the scan cost ~0.5 ms of launches: not worth it once a quarter of the GPU is busy
        return 1
    want = -(-2 * sms // programs)
    return max(1, min(want, T // min_len))


def _multiprocessors(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:  # a property read per call costs more host time than the scan below
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


_SMS: dict[int, int] = {}


@functools.lru_cache(maxsize=64)
def _segments(B: int, T: int, L: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The segments' packed offsets (int32 [B*n + 1]) and ``lower`` [n+1, n] fp32, 1 where segment i
    ends before j starts, cached per shape and device: every layer and chunk of a prefill asks for the
    same ones, and building them is several small launches per call."""
    starts = (torch.arange(B, device=device)[:, None] * T + torch.arange(0, T, L, device=device)[None]).flatten()
    bounds = torch.cat([starts, starts.new_full((1,), B * T)]).to(torch.int32)
    return bounds, torch.ones(n + 1, n, device=device).tril(-1)


def split_time_fwd(q, k, v, log_g, S0, z0, normalize, eps, output_final_state, num_splits, store_den=False):
    """Chunk forward (no gradients) over ``num_splits`` segments per sequence.

    q, k [B, T, H, F]; v [B, T, H, Dv]; log_g None or [H, B*T] fp32 (the chunk kernels' layout);
    S0, z0 None or fp32 [B, H, F, Dv], [B, H, F]. Returns o, den, Sn, zn like ``chunk.chunk_fwd``
    (``store_den`` without ``normalize``: the denominators [H, B*T], the segments being in token order)."""
    B, T, H, F = q.shape
    DV = v.shape[-1]
    cfg = _chunk._cfg(F, DV)
    BT = cfg["BT"]
    L = triton.cdiv(triton.cdiv(T, num_splits), BT) * BT  # segment length, whole chunks
    n = triton.cdiv(T, L)
    dev = q.device
    bounds, lower = _segments(B, T, L, n, dev)
    N = B * n
    qf, kf, vf = (x.reshape(1, B * T, H, x.shape[-1]) for x in (q, k, v))

    # 1. each segment's own state
    _, _, Sl, zl = _chunk.chunk_fwd(kf, kf, vf, log_g, None, None, False, eps, True, bounds, False, state_only=True)

    # 2. scan over segments: init_j = sum_{i<j} G(end_i -> start_j) S_i + G(0 -> start_j) S_0
    Sl, zl = Sl.view(B, n, H, F, DV), zl.view(B, n, H, F)
    if log_g is None:  # no decay: init_j = S_0 + sum_{i<j} S_i, a prefix sum (two launches)
        first_S = Sl.new_zeros(B, 1, H, F, DV) if S0 is None else S0[:, None]
        first_z = zl.new_zeros(B, 1, H, F) if z0 is None else z0[:, None]
        init_S = torch.cat([first_S, Sl], 1).cumsum(1)
        init_z = torch.cat([first_z, zl], 1).cumsum(1)
    else:
        # lower [j, i]: segment i ends before j starts
        G = Fn.pad(log_g.view(H, B, T), (0, n * L - T)).view(H, B, n, L).sum(-1)  # log gate of each segment
        C = torch.cat([torch.zeros(H, B, 1, device=dev), G.cumsum(-1)], -1).permute(1, 0, 2)  # (B, H, n+1): at starts
        w = torch.exp((C[..., :, None] - C[..., None, 1:]).masked_fill(lower == 0, float("-inf")))
        w0 = torch.exp(C)
        init_S = torch.einsum("bhji,bihfd->bjhfd", w, Sl)
        init_z = torch.einsum("bhji,bihf->bjhf", w, zl)
        if S0 is not None:
            init_S = init_S + w0.transpose(1, 2)[..., None, None] * S0[:, None]
            init_z = init_z + w0.transpose(1, 2)[..., None] * z0[:, None]

    # 3. the chunk forward on the segments, each from its entering state
    o, den, _, _ = _chunk.chunk_fwd(qf, kf, vf, log_g, init_S[:, :n].reshape(N, H, F, DV).contiguous(),
                                    init_z[:, :n].reshape(N, H, F).contiguous(), normalize, eps, False, bounds,
                                    store_den)
    if not output_final_state:
        return o.view(B, T, H, DV), den, None, None
    return o.view(B, T, H, DV), den, init_S[:, n].contiguous(), init_z[:, n].contiguous()
