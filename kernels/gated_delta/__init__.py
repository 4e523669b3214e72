"""Gated delta rule (Gated DeltaNet): Triton kernels and PyTorch references.

    S_t = exp(g_t) S_{t-1};  S_t += beta_t k_t^T (v_t - k_t S_t);  o_t = scale q_t S_t

Layout [B, T, H, D]; states [N, H, K, V] in float32. Tensors are positional, everything
else keyword-only (gates are never positional).

- `chunk_gated_delta_rule`: chunkwise (WY / UT-transform) forward and backward, varlen.
- `fused_recurrent_gated_delta_rule`: decode step(s), updates the state in place.
- `fused_gated_delta_decode`: a Gated DeltaNet layer's decode step between its input GEMM and its
  output projection (conv cache, RoPE, L2 norms, gates, state, output norm and gate) in one op;
  `gated_delta_decode_ref` is its readable twin.
- `gated_delta_rule_ref`, `gated_delta_rule_chunk_ref`: readable PyTorch references.

The Triton modules import lazily, so the references work without Triton.
"""
from .reference import gated_delta_rule_chunk_ref, gated_delta_rule_ref

__all__ = [
    "chunk_gated_delta_rule",
    "fused_gated_delta_decode",
    "fused_recurrent_gated_delta_rule",
    "gated_delta_decode_columns",
    "gated_delta_decode_ref",
    "gated_delta_rule_chunk_ref",
    "gated_delta_rule_ref",
]


def __getattr__(name):
    if name == "chunk_gated_delta_rule":
        from .chunk import chunk_gated_delta_rule
        return chunk_gated_delta_rule
    if name == "fused_recurrent_gated_delta_rule":
        from .recurrent import fused_recurrent_gated_delta_rule
        return fused_recurrent_gated_delta_rule
    if name in ("fused_gated_delta_decode", "gated_delta_decode_ref", "gated_delta_decode_columns"):
        from . import decode
        return getattr(decode, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
