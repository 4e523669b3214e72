"""The softmax layers of a hybrid model (kept beside converted ones): chunked prefill without a mask,
and decode steps on a kernel that reads grouped key/value heads once.

A chunk of q queries continuing a cache of T - q tokens attends lower-right causally: query i sees
keys 0 .. T - q + i. SDPA's ``is_causal`` aligns top-left, so transformers' ``sdpa_mask`` builds that
pattern as a (B, 1, q, T) bool tensor, and the attention kernel turns it into an additive mask of
the activations' dtype: at q = 8,192 and T = 128K, 1 GB plus 2 GB per chunk, more than the softmax
layers' own keys and values. ``prefill_without_mask`` swaps the model's attention implementation
for one call to ``NAME``: its mask function returns no mask for exactly that case (no padding, no
packed documents, no local window, a dynamic cache whose keys end at the chunk's last query) and
its attention runs SDPA with PyTorch's ``causal_lower_right`` bias, which the flash and
memory-efficient kernels apply without materialising anything. Every other call goes to
transformers' own ``sdpa_mask`` and ``sdpa_attention_forward``.

A decode step (one query per sequence) of a hybrid's softmax layer goes to
``linearize.kernels.softmax_decode`` where the kernels run: transformers' sdpa path repeats a
grouped-query cache's keys and values per query head before attending (``repeat_kv``), so every
step writes and reads the whole cache several times, which dominates a hybrid's step at long
context. The kernel takes the same boolean mask, so padding and the static cache's empty slots
are treated as sdpa treats them. :func:`use_for` makes ``DECODE_NAME`` (transformers' sdpa mask
and attention, decode steps on the kernel) a hybrid's attention implementation, set where layers
are converted or restored, so compiled steps trace it too.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

NAME = "linearize_sdpa_lower_right"  # the chunk of prefill_without_mask, set for that call only
DECODE_NAME = "linearize_hybrid_sdpa"  # a hybrid's own (use_for): decode steps on the kernel, else sdpa
_REGISTERED = False


def lower_right_ok(kwargs: dict) -> bool:
    """Whether a mask-function call (transformers' keyword arguments) is a plain causal chunk that
    continues a dynamic cache: the lower-right pattern is then all the mask would say."""
    from transformers.masking_utils import causal_mask_function

    q, q_offset, kv = kwargs.get("q_length"), kwargs.get("q_offset", 0), kwargs.get("kv_length")
    return (isinstance(q, int) and isinstance(q_offset, int) and isinstance(kv, int)  # older signatures: no
            and q > 1 and q_offset > 0 and kv == q_offset + q and kwargs.get("kv_offset", 0) == 0
            and kwargs.get("attention_mask") is None and kwargs.get("local_size") is None
            and kwargs.get("allow_is_causal_skip", True) and kwargs.get("mask_function") is causal_mask_function)


def _mask(*args, **kwargs):
    from transformers.masking_utils import sdpa_mask

    if not args and lower_right_ok(kwargs):
        return None
    return sdpa_mask(*args, **kwargs)


def decode_kernel_ok(module, query, key, attention_mask, dropout: float, kwargs: dict) -> bool:
    """Whether a softmax layer's call is a decode step the kernel computes exactly as sdpa would: one
    query, grouped heads, a boolean mask or none, and nothing sdpa's call would add (dropout in
    training, soft-capping, attention sinks)."""
    from .attention import use_kernels

    return (query.shape[2] == 1 and query.shape[1] % key.shape[1] == 0 and query.shape[-1] <= 256
            and (attention_mask is None or (attention_mask.dtype == torch.bool and attention_mask.shape[2] == 1))
            and not (module.training and dropout) and kwargs.get("softcap") is None and kwargs.get("s_aux") is None
            and query.dtype == key.dtype and use_kernels(query))


def _decode(query, key, value, attention_mask, scaling):
    from linearize.kernels.softmax_decode import softmax_decode

    L = key.shape[2]
    mask = None if attention_mask is None else attention_mask[:, 0, 0, :L]
    if mask is not None and mask.shape[0] != query.shape[0]:
        mask = mask.expand(query.shape[0], L)
    out = softmax_decode(query[:, :, 0], key, value, mask, scale=scaling)  # (B, H, D)
    return out[:, None], None  # (B, 1, H, D), as sdpa_attention_forward returns it


def _decode_or_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if decode_kernel_ok(module, query, key, attention_mask, dropout, kwargs):
        return _decode(query, key, value, attention_mask, scaling)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q_len, kv_len = query.shape[2], key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if (attention_mask is None and 1 < q_len < kv_len and causal and kwargs.get("sliding_window") is None
            and kwargs.get("s_aux") is None and kwargs.get("softcap") is None):
        from torch.nn.attention.bias import causal_lower_right

        groups = query.shape[1] // key.shape[1]
        if groups > 1:  # the causal bias takes no enable_gqa on every kernel: the chunk's K/V per head
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=causal_lower_right(q_len, kv_len),
                                             dropout_p=dropout if module.training else 0.0, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def register() -> None:
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(NAME, _attention)
        AttentionMaskInterface.register(NAME, _mask)
        AttentionInterface.register(DECODE_NAME, _decode_or_sdpa)
        AttentionMaskInterface.register(DECODE_NAME, sdpa_mask)
        _REGISTERED = True


def use_for(model) -> bool:
    """Make ``DECODE_NAME`` the attention implementation of a causal model with softmax layers left
    beside converted ones (a hybrid) that runs sdpa; returns whether it is now. Undone by
    :func:`restore_sdpa`."""
    from .arch import EncoderSpec, get_arch, get_submodule
    from .layers import ConvertedAttention  # every converted layer's base (not modeling_linearize: no circle)

    config = model.config
    spec = get_arch(config.model_type)
    if config._attn_implementation not in ("sdpa", DECODE_NAME) or isinstance(spec, EncoderSpec):
        return False
    blocks = get_submodule(model, spec.layers)
    converted = sum(isinstance(a := b.get_submodule(spec.attention), ConvertedAttention)
                    and not getattr(a, "keeps_softmax", False) for b in blocks)
    if not converted or converted >= len(blocks):
        restore_sdpa(model)
        return False
    register()
    config._attn_implementation = DECODE_NAME
    return True


def restore_sdpa(model) -> None:
    if model.config._attn_implementation == DECODE_NAME:
        model.config._attn_implementation = "sdpa"


@contextlib.contextmanager
def prefill_without_mask(config):
    """Within this context the model's softmax layers use ``NAME`` (set on ``config`` and restored)."""
    register()
    before = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = before


def applies(model, kwargs: dict, cache) -> bool:
    """A forward call of a converted model that gains from ``prefill_without_mask``: softmax layers
    left (a hybrid) on sdpa, a dynamic cache with tokens in it, a chunk of several tokens, no mask."""
    conv = getattr(model.config, "linearize", None) or {}
    if (cache is None or kwargs.get("attention_mask") is not None or torch.compiler.is_compiling()
            or model.config._attn_implementation not in ("sdpa", DECODE_NAME)
            or len(conv.get("layers", ())) >= model.config.num_hidden_layers):
        return False
    from .cache import StaticLinearizeCache

    if isinstance(cache, StaticLinearizeCache):
        return False
    x = kwargs.get("input_ids")
    x = kwargs.get("inputs_embeds") if x is None else x
    return x is not None and x.shape[1] > 1 and cache.get_seq_length() > 0
