"""Normalized feature-map linear attention: chunkwise Triton kernels, a fused recurrent decode
step, and PyTorch references.  Layout [B, T, H, D]; states are (S [B, H, F, Dv], z [B, H, F]) fp32."""

from .chunk import chunk_linear_attn
from .recurrent import fused_recurrent_hedgehog, fused_recurrent_linear_attn, hedgehog_recurrent_ref
from .reference import linear_attn_chunked_ref, linear_attn_recurrent_ref, linear_attn_ref

__all__ = [
    "chunk_linear_attn", "fused_recurrent_linear_attn", "fused_recurrent_hedgehog", "hedgehog_recurrent_ref",
    "linear_attn_ref", "linear_attn_recurrent_ref", "linear_attn_chunked_ref",
]
