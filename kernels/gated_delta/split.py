"""Split-time inference forward of the gated delta rule: the state pass with more parallelism.

Of the chunk forward's three kernels (chunk.py), two are parallel over chunks; the state pass
(``_fwd_h_kernel``) gives one program to each (sequence, head, block of V) and walks the chunks in
order. Prefilling one long prompt (B=1, H=9, V=64) that is 18 programs on 132 multiprocessors,
each walking the 1,024 chunks of a 64K-token prompt.

The pass is affine in the state it starts from: over a segment of chunks,

    S_end = M S_start + R,

M [K, K] the product of the chunks' ``exp(g_C) I - (k exp(g_C - g))^T w`` and R [K, V] the state
the segment builds from zero. Each column of the state evolves on its own, so one run of the same
kernel from the state ``[I | 0]`` with values ``[0 | u]`` (K + V columns) ends in ``[M | R]``.
Without gradients, for ``num_splits`` segments of whole chunks per row:

1. ``[M_j | R_j]`` of every segment, all segments in parallel (``_fwd_h_kernel`` with ``ID=K``:
   the identity columns built in the kernel, no per-chunk states written);
2. a scan over the segments, one program per (row, head, block of V), ``S_{j+1} = M_j S_j + R_j``
   from the initial state (``_scan_kernel``); the last one is the final state;
3. ``_fwd_h_kernel`` on the segments as packed sequences, each from its entering state: the
   per-chunk states and v' that the output kernel reads, in the unsplit pass's layout.

Pass 1 costs (K + V) / V of a state pass and pass 3 one more, each spread over ``num_splits`` times
as many programs: worth it only where the unsplit pass leaves most of the GPU idle and is a large
share of the forward. The result equals the unsplit pass up to rounding: M_j enters pass 1's
products in the input dtype, as the state itself does there.

It runs on request only (``chunk_gated_delta_rule(num_splits=N)``). Measured on an H100
(``scripts/bench_gdn.py`` part 4, 2026-11-26; ``docs/reports/kernels.md``), one prompt of the
SmolLM2 shape (B=1, H=9, D=64) gained nothing at 64K tokens with the 15 segments ``splits_for``
proposes (1.98 ms against 1.97) and was 2.7x slower at 8K with 8 (0.72 ms against 0.27), which
made gdn's chunked prefill slower end to end: the state pass is a small share of the forward there.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import chunk as _chunk

MAX_K = 128  # the scan holds M [K, K] in fp32 registers; larger key dims keep the unsplit pass


def splits_for(B: int, T: int, H: int, V: int, sms: int, min_len: int = 1024) -> int:
    """A candidate number of segments for a GPU of ``sms`` multiprocessors: programs for two waves,
    each segment at least ``min_len`` tokens, none where the unsplit pass has programs for more than
    a quarter of the multiprocessors (``linear_attn.split.auto_splits``' rule). What the bench
    measures; not a default (see the module's docstring)."""
    programs = B * H * triton.cdiv(V, 32)  # BV = 32: the tuner's usual pick at V = 64
    if programs > sms // 4:
        return 1
    return max(1, min(-(-2 * sms // programs), T // min_len))


@triton.jit
def _scan_kernel(mr, h0, init, ht, NS, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 BK: tl.constexpr, BV: tl.constexpr, USE_H0: tl.constexpr):
    """mr [B*NS, H, K, K+V] fp32: each segment's [M | R]. Writes the state entering each segment
    (init [B*NS, H, K, V]) and the one after the last (ht [B, H, K, V])."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mk, mv = o_k < K, o_v < V
    s_off = o_k[:, None] * V + o_v[None, :]
    b_s = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_s += tl.load(h0 + i_bh.to(tl.int64) * K * V + s_off, mask=mk[:, None] & mv[None, :], other=0.0)
    for j in range(0, NS):
        seg = (i_b * NS + j).to(tl.int64) * H + i_h
        tl.store(init + seg * K * V + s_off, b_s, mask=mk[:, None] & mv[None, :])
        p = mr + seg * K * (K + V)
        b_m = tl.load(p + o_k[:, None] * (K + V) + o_k[None, :], mask=mk[:, None] & mk[None, :], other=0.0)
        b_r = tl.load(p + o_k[:, None] * (K + V) + K + o_v[None, :], mask=mk[:, None] & mv[None, :], other=0.0)
        b_s = tl.dot(b_m, b_s, input_precision="ieee") + b_r
    tl.store(ht + i_bh.to(tl.int64) * K * V + s_off, b_s, mask=mk[:, None] & mv[None, :])


@functools.lru_cache(maxsize=64)
def _segments(B: int, T: int, L: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The segments as packed sequences: their token offsets and chunk offsets (int32 [B*n + 1]), cached
    per shape and device (every layer of a prefill asks for the same; building them is launches)."""
    nts = triton.cdiv(T, _chunk.BT)
    starts = torch.arange(B)[:, None] * T + torch.arange(0, T, L)[None]
    cstarts = torch.arange(B)[:, None] * nts + torch.arange(0, T, L)[None] // _chunk.BT
    return tuple(torch.cat([x.flatten(), torch.tensor([last])]).to(torch.int32).to(device)
                 for x, last in ((starts, B * T), (cstarts, B * nts)))


def split_fwd_h(k, w, u, gc, h0, output_final_state, B, T, num_splits):
    """The state pass of ``chunk.chunk_fwd`` over ``num_splits`` segments per row (dense rows).

    k, w [B*T, H, K]; u [B*T, H, V]; gc [B*T, H] fp32; h0 None or [B, H, K, V] fp32. Returns what
    ``chunk._fwd_h`` does: the states at chunk starts [NT, H, K, V], v' [B*T, H, V] and the final
    state [B, H, K, V] fp32 (or None)."""
    _, H, K = k.shape
    V = u.shape[-1]
    BT = _chunk.BT
    L = triton.cdiv(triton.cdiv(T, num_splits), BT) * BT  # segment length: whole chunks
    n = triton.cdiv(T, L)
    cu, co = _segments(B, T, L, n, k.device)
    N = B * n
    NT = B * triton.cdiv(T, BT)
    prec = _chunk._prec(k.dtype, K, V)

    # 1. each segment's [M | R], all in parallel
    mr = k.new_empty(N, H, K, K + V, dtype=torch.float32)
    grid = lambda meta: (triton.cdiv(K + V, meta["BV"]), N * H)  # noqa: E731
    _chunk._fwd_h_kernel[grid](k, w, u, gc, None, None, None, mr, cu, co, H, K, K + V,
                               BT=BT, BK=_chunk._pow2(K), PREC=prec, USE_H0=False, STORE_HT=True, ID=K)

    # 2. the scan: the state entering every segment, and the final one
    init = k.new_empty(N, H, K, V, dtype=torch.float32)
    ht = k.new_empty(B, H, K, V, dtype=torch.float32)
    BV = min(_chunk._pow2(V), 32)
    _scan_kernel[(triton.cdiv(V, BV), B * H)](mr, h0, init, ht, n, H, K, V, BK=_chunk._pow2(K), BV=BV,
                                              USE_H0=h0 is not None, num_warps=4)

    # 3. the ordinary state pass on the segments, each from its entering state
    h, vn, _ = _chunk._fwd_h(k, w, u, gc, init, False, cu, co, NT, N)
    return h, vn, (ht if output_final_state else None)
