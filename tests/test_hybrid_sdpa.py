"""Chunked prefill of hybrid models (softmax layers kept beside converted ones): a chunk that
continues the cache runs its softmax layers lower-right causal without the (chunk, keys) mask
transformers would materialise (linearize/hybrid_sdpa.py), with the logits of one call."""

import pytest
import torch
import torch.nn.attention.bias

import linearize
import linearize.hybrid_sdpa as hybrid_sdpa
from conftest import ARCH_CONFIGS, converted
from linearize.cache import LinearizeCache, StaticLinearizeCache

# sdpa models whose kept layers are global: the mask-free path must run there
MASK_FREE = ("llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2", "smollm3", "granite", "gpt_neox", "mixtral",
             "qwen3_moe")


def chunked_logits(model, ids, chunk):
    cache = LinearizeCache(model.config)
    outs = [model(input_ids=ids[:, s:s + chunk], past_key_values=cache, use_cache=True).logits
            for s in range(0, ids.shape[1], chunk)]
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("model_type", sorted(ARCH_CONFIGS))
def test_hybrid_chunks_without_a_mask_give_the_one_call_logits(model_type, monkeypatch):
    model = converted(model_type, linearize.GatedDeltaNetConfig(layers=[1]), initializer_range=0.2)
    ids = torch.randint(0, model.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    calls = []
    real = torch.nn.attention.bias.causal_lower_right
    monkeypatch.setattr(torch.nn.attention.bias, "causal_lower_right", lambda *s: calls.append(s) or real(*s))
    with torch.no_grad():
        full = model(input_ids=ids).logits
        chunked = chunked_logits(model, ids, 16)
    torch.testing.assert_close(chunked, full, rtol=1e-4, atol=1e-4 * full.abs().max().item())
    # restored after each call: a hybrid on sdpa keeps hybrid_sdpa.DECODE_NAME (its decode steps' kernel)
    assert model.config._attn_implementation in (hybrid_sdpa.DECODE_NAME, "eager")
    if model_type in MASK_FREE:
        assert model.config._attn_implementation == hybrid_sdpa.DECODE_NAME
        # chunks 2 and 3, in each global softmax layer: (16 queries, 32 or 48 keys)
        assert calls and {s for s in calls} <= {(16, 32), (16, 48)} and (16, 48) in calls


def test_mask_free_path_only_where_it_is_exact():
    model = converted("llama", linearize.GatedDeltaNetConfig(layers=[1]), initializer_range=0.2)
    ids = torch.zeros(1, 4, dtype=torch.long)
    cache = LinearizeCache(model.config)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    assert hybrid_sdpa.applies(model, {"input_ids": ids}, cache)
    assert not hybrid_sdpa.applies(model, {"input_ids": ids[:, :1]}, cache)  # a decode step: no mask anyway
    assert not hybrid_sdpa.applies(model, {"input_ids": ids, "attention_mask": torch.ones(1, 8)}, cache)  # padding
    assert not hybrid_sdpa.applies(model, {"input_ids": ids}, LinearizeCache(model.config))  # nothing cached yet
    static = StaticLinearizeCache(model.config, max_batch_size=1, max_cache_len=16)
    assert not hybrid_sdpa.applies(model, {"input_ids": ids}, static)  # keys beyond the chunk: the mask says so
    every = converted("llama", linearize.GatedDeltaNetConfig())
    assert not hybrid_sdpa.applies(every, {"input_ids": ids}, cache)  # no softmax layer left

    from transformers.masking_utils import causal_mask_function

    plain = dict(batch_size=1, q_length=16, kv_length=48, q_offset=32, kv_offset=0, mask_function=causal_mask_function,
                 attention_mask=None, allow_is_causal_skip=True)
    assert hybrid_sdpa.lower_right_ok(plain)
    for change in ({"kv_length": 64}, {"attention_mask": torch.ones(1, 48, dtype=torch.bool)}, {"local_size": 8},
                   {"allow_is_causal_skip": False}, {"mask_function": lambda *a: True}, {"q_offset": 0}):
        assert not hybrid_sdpa.lower_right_ok({**plain, **change}), change

