"""The SWA-only baseline of the quality issue's ablations: every layer keeps softmax attention, but
each query sees only the newest ``window`` keys of its document plus the document's first ``sinks``
tokens (attention sinks, as in StreamingLLM). No linear part, no new parameter: what a window hybrid
(``--preset lolcats``) must beat to show that its linear branch earns its keep.

    linearize distill --preset swa --window 64 --sinks 4 ...    # stage 2 (KD) only: nothing new to transfer

The model stays the original transformers model; only its attention function changes, registered
with transformers as ``linearize_swa`` (``transformers.AttentionInterface``) on top of SDPA. The
setting is saved in ``config.linearize_swa``: linearize's loader (``linearize eval``, ``generate``)
applies it again, plain transformers loads the model with full attention. The
allowed keys come from the mask transformers builds for SDPA (causal, padding, packed documents), so
training on packed rows, ``generate()`` with a ``DynamicCache`` and left padding all keep their meaning.
It is a baseline for quality, not for speed: the KV cache still grows with the context.
"""

from __future__ import annotations

import torch

NAME = "linearize_swa"
CONFIG_KEY = "linearize_swa"  # model.config.linearize_swa = {"window": W, "sinks": S}


def swa_mask(mask: torch.Tensor | None, q_len: int, k_len: int, window: int, sinks: int, device) -> torch.Tensor:
    """(B or 1, 1, q_len, k_len) bool: ``mask`` (True = attend; None = causal over the newest keys)
    narrowed to the newest ``window`` keys up to each query plus the first ``sinks`` keys its row may
    attend (its document's first tokens). Each query's own key is the last one its row allows."""
    k = torch.arange(k_len, device=device)
    if mask is None:
        q_pos = (k_len - q_len + torch.arange(q_len, device=device)).view(1, 1, q_len, 1)
        first = torch.zeros(1, 1, q_len, 1, dtype=torch.long, device=device)
        allowed = k.view(1, 1, 1, k_len) <= q_pos
    else:
        allowed = mask.bool()
        first = allowed.int().argmax(-1, keepdim=True)  # the document's (or the unpadded row's) start
        q_pos = k_len - 1 - allowed.flip(-1).int().argmax(-1, keepdim=True)  # the query's own key
    k = k.view(1, 1, 1, k_len)
    return allowed & ((q_pos - k < window) | (k < first + sinks))


def _attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cfg = getattr(module.config, CONFIG_KEY)
    mask = swa_mask(attention_mask, query.shape[2], key.shape[2], cfg["window"], cfg["sinks"], query.device)
    kwargs.pop("is_causal", None)
    return sdpa_attention_forward(module, query, key, value, mask, is_causal=False, **kwargs)


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def apply_swa(model, window: int, sinks: int) -> None:
    """Switch every attention layer of ``model`` (a transformers causal LM) to the SWA-with-sinks
    baseline, in place."""
    if window < 1 or sinks < 0:
        raise ValueError(f"the SWA baseline needs window >= 1 and sinks >= 0, got window {window}, sinks {sinks}")
    register()
    setattr(model.config, CONFIG_KEY, {"window": window, "sinks": sinks})
    for sub in (model.config, getattr(model.config, "text_config", None)):
        if sub is not None and sub is not model.config:
            setattr(sub, CONFIG_KEY, {"window": window, "sinks": sinks})
    model.set_attn_implementation(NAME)
