"""Helpers the linear-attention kernels share (chunk.py and window.py): tile pointers, sequence bounds,
block sizes and the dot products' precision. A module of its own so that chunk.py can call window.py's
kernels while window.py uses the same helpers (no import circle)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _next_pow2(x: int) -> int:
    return triton.next_power_of_2(max(int(x), 16))


def _prec(x: torch.Tensor) -> str:
    # fp32 inputs get true fp32 products (not tf32); bf16/fp16 ignore the setting.
    return "ieee" if x.dtype == torch.float32 else "tf32"


@triton.jit
def _tile(base, r0, R, rs, c0, C, BR: tl.constexpr, BC: tl.constexpr):
    """Pointers and bounds mask of the [BR, BC] tile at (r0, c0) of a row-major [R, C] view."""
    o_r = r0 + tl.arange(0, BR)
    o_c = c0 + tl.arange(0, BC)
    return base + o_r[:, None].to(tl.int64) * rs + o_c[None, :], (o_r[:, None] < R) & (o_c[None, :] < C)


@triton.jit
def _seq_bounds(cu, i_n, T, IS_VARLEN: tl.constexpr):
    if IS_VARLEN:
        bos = tl.load(cu + i_n).to(tl.int64)
        eos = tl.load(cu + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    return bos, eos - bos
