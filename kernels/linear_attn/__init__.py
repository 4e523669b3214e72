"""Normalized feature-map linear attention: chunkwise Triton kernels, a fused recurrent decode
step, and PyTorch references.  Layout [B, T, H, D]; states are (S [B, H, F, Dv], z [B, H, F]) fp32."""

from .bidirectional import bidirectional_hedgehog, bidirectional_hedgehog_ref
from .chunk import chunk_linear_attn
from .chunk_channel import chunk_linear_attn_channel
from .features import hedgehog_features, hedgehog_features_ref
from .recurrent import fused_recurrent_hedgehog, fused_recurrent_linear_attn, hedgehog_recurrent_ref
from .window_decode import (fused_window_decode_hedgehog, window_decode, window_decode_hedgehog_ref, window_decode_ref,
                            window_prefill, window_softmax_decode, window_softmax_decode_ref, window_softmax_prefill)
from .reference import linear_attn_channel_ref, linear_attn_chunked_ref, linear_attn_recurrent_ref, linear_attn_ref

__all__ = [
    "bidirectional_hedgehog", "bidirectional_hedgehog_ref", "chunk_linear_attn", "chunk_linear_attn_channel",
    "hedgehog_features", "hedgehog_features_ref",
    "fused_recurrent_linear_attn", "fused_recurrent_hedgehog", "hedgehog_recurrent_ref",
    "linear_attn_ref", "linear_attn_recurrent_ref", "linear_attn_chunked_ref", "linear_attn_channel_ref",
    "window_decode", "window_decode_ref", "window_prefill", "window_softmax_prefill", "window_softmax_decode",
    "window_softmax_decode_ref",
    "fused_window_decode_hedgehog", "window_decode_hedgehog_ref",
]
