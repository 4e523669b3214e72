"""The Triton kernels as PyTorch operators (``torch.ops.linearize.*``).

Importing this module registers every op. Each is a ``torch.library.custom_op`` defined beside
its kernels (fwd/bwd launchers -> op -> public function, the layout fla uses), with a fake
implementation (shapes only, for ``torch.compile`` tracing and meta tensors) and, for the
training ops, ``register_autograd`` over a backward op. So ``torch.compile(model,
fullgraph=True)`` traces a converted model with the kernels inside, forward and backward,
instead of falling back to the PyTorch math, and CUDA graphs capture them.

=================================  ==============================================================
op                                 what it computes
=================================  ==============================================================
``chunk_linear_attn_fwd`` / _bwd   chunkwise (normalized) feature-map linear attention, gate,
                                   initial state, packed sequences; split-time inference forward
``chunk_linear_attn_channel_*``    the same with a decay gate per feature channel (GLA's form),
  (fwd / bwd)                      initial state; packed documents by resets of the gate
``hedgehog_features``              Hedgehog feature map of a prefill (inference): GEMM + softmax
``window_attn_fwd`` / _bwd         sliding-window softmax combined with the linear terms
``window_decode``                  window hybrid decode step(s): ring buffer and state, in place
``window_decode_hedgehog``         the same with Hedgehog's feature maps computed in the kernel
``window_prefill``                 a chunk of the window hybrid continuing from a cached state (a
                                   chunked prefill): the buffer's keys, the chunk, the state
``window_softmax_prefill``         the softmax window alone over the buffer's keys and a chunk
                                   (Gated DeltaNet's window, whose state has its own kernels)
``window_softmax_decode``          its decode step: RoPE, the softmax over the buffer, the token
                                   and the sinks, the state's output added, the buffer moved on
``recurrent_linear_attn``          linear-attention decode step(s), state updated in place
``recurrent_hedgehog``             the same with Hedgehog's feature maps computed in the kernel
``chunk_gated_delta_fwd`` / _bwd   gated delta rule, chunkwise WY form, packed sequences;
                                   split-time state pass for inference
``recurrent_gated_delta``          gated delta rule decode step(s), state updated in place
``gated_delta_decode``             a Gated DeltaNet layer's decode step(s) between its GEMMs: conv
                                   cache, RoPE, norms, gates and state, in place
``gdn_prefill_prologue`` / _epi.   a Gated DeltaNet prefill's glue before and after the chunk
                                   kernel: conv (from the cache), RoPE, L2 norms, repeats; the
                                   output norm mix and gate (inference)
``decode_linear`` / ``decode_gated``  a decode step's projections (a few rows) as GEMVs spread over
                                   the SMs; the gated MLP's silu(x Wg) * (x Wu) in one kernel
``softmax_decode``                 a kept softmax layer's decode step over its key/value cache
                                   (split over the positions, grouped query heads read once)
=================================  ==============================================================

The public functions (``chunk_linear_attn``, ``window_softmax_attn``,
``fused_recurrent_linear_attn``, ``chunk_gated_delta_rule``, ``fused_recurrent_gated_delta_rule``)
check their arguments and call these ops; the layers call the public functions.
"""

from __future__ import annotations

from .decode_linear import decode_gated_op, decode_linear_op
from .gated_delta.chunk import chunk_gated_delta_bwd_op, chunk_gated_delta_fwd_op
from .gated_delta.decode import gated_delta_decode_op
from .gated_delta.prefill import epilogue_op as gdn_prefill_epilogue_op
from .gated_delta.prefill import prologue_op as gdn_prefill_prologue_op
from .gated_delta.recurrent import recurrent_gated_delta_op
from .linear_attn.chunk import chunk_linear_attn_bwd_op, chunk_linear_attn_fwd_op
from .linear_attn.chunk_channel import chunk_linear_attn_channel_bwd_op, chunk_linear_attn_channel_fwd_op
from .linear_attn.features import hedgehog_features_op
from .linear_attn.recurrent import recurrent_hedgehog_op, recurrent_linear_attn_op
from .linear_attn.window import window_attn_bwd_op, window_attn_fwd_op
from .linear_attn.window_decode import (window_decode_hedgehog_op, window_decode_op, window_prefill_op,
                                        window_softmax_decode_op, window_softmax_prefill_op)
from .softmax_decode import softmax_decode_op

OPS = {
    "chunk_linear_attn_fwd": chunk_linear_attn_fwd_op,
    "chunk_linear_attn_bwd": chunk_linear_attn_bwd_op,
    "chunk_linear_attn_channel_fwd": chunk_linear_attn_channel_fwd_op,
    "chunk_linear_attn_channel_bwd": chunk_linear_attn_channel_bwd_op,
    "hedgehog_features": hedgehog_features_op,
    "window_attn_fwd": window_attn_fwd_op,
    "window_attn_bwd": window_attn_bwd_op,
    "window_decode": window_decode_op,
    "window_prefill": window_prefill_op,
    "window_softmax_prefill": window_softmax_prefill_op,
    "window_softmax_decode": window_softmax_decode_op,
    "window_decode_hedgehog": window_decode_hedgehog_op,
    "recurrent_linear_attn": recurrent_linear_attn_op,
    "recurrent_hedgehog": recurrent_hedgehog_op,
    "chunk_gated_delta_fwd": chunk_gated_delta_fwd_op,
    "chunk_gated_delta_bwd": chunk_gated_delta_bwd_op,
    "recurrent_gated_delta": recurrent_gated_delta_op,
    "gated_delta_decode": gated_delta_decode_op,
    "gdn_prefill_prologue": gdn_prefill_prologue_op,
    "gdn_prefill_epilogue": gdn_prefill_epilogue_op,
    "decode_linear": decode_linear_op,
    "decode_gated": decode_gated_op,
    "softmax_decode": softmax_decode_op,
}

__all__ = ["OPS"]
