"""generate() through the state cache gives the tokens of a full recompute without cache."""

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, TextStreamer, pipeline

import linearize
from linearize.cache import LinearAttentionState

from conftest import attention, converted, tiny_model

CONFIGS = {
    "linear": linearize.LinearAttentionConfig(feature_map="hedgehog"),
    "window4-decay": linearize.LinearAttentionConfig(feature_map="t2r", window=4, decay="scalar"),
    "hybrid": linearize.LinearAttentionConfig(feature_map="elu", layers=[1], window=2),
    "gdn": linearize.GatedDeltaNetConfig(conv_size=3),
    "gdn-group-hybrid": linearize.GatedDeltaNetConfig(kv_heads="group", conv_size=4, layers=[0, 2]),
}
GEN = dict(max_new_tokens=12, pad_token_id=0)


def prompt(n=9, b=1, seed=0):
    return torch.randint(2, 97, (b, n), generator=torch.Generator().manual_seed(seed))


# every architecture row: tests/test_architectures.py (greedy, beam, padding, continuation, chunked prefill)


@pytest.fixture(params=sorted(CONFIGS))
def model(request):
    return converted("llama", CONFIGS[request.param])


def test_converted_model_generates_differently_from_original():
    """Guards the tests below: tiny models must be far enough from trivial to tell variants apart."""
    original = tiny_model("llama")
    ids = prompt(n=20)
    a = original.generate(ids, do_sample=False, **GEN)
    b = converted("llama").generate(ids, do_sample=False, **GEN)
    assert not torch.equal(a, b)


def test_seeded_sampling(model):
    ids = prompt(b=2)
    torch.manual_seed(7)
    a = model.generate(ids, do_sample=True, top_k=0, temperature=1.0, **GEN)
    torch.manual_seed(7)
    b = model.generate(ids, do_sample=True, top_k=0, temperature=1.0, use_cache=False, **GEN)
    torch.testing.assert_close(a, b)


def test_beam_search(model):
    ids = prompt(b=2)
    a = model.generate(ids, num_beams=3, do_sample=False, **GEN)
    b = model.generate(ids, num_beams=3, do_sample=False, use_cache=False, **GEN)
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_left_padded_batch_equals_each_prompt_alone(name, attn):
    model = converted("llama", CONFIGS[name], attn_implementation=attn)
    long, short = prompt(n=10, seed=1)[0], prompt(n=6, seed=2)[0]
    batch = torch.zeros(2, 10, dtype=torch.long)
    mask = torch.zeros(2, 10, dtype=torch.long)
    batch[0], mask[0] = long, 1
    batch[1, 4:], mask[1, 4:] = short, 1
    out = model.generate(batch, attention_mask=mask, do_sample=False, **GEN)
    alone_long = model.generate(long[None], do_sample=False, **GEN)
    alone_short = model.generate(short[None], do_sample=False, **GEN)
    torch.testing.assert_close(out[0, 10:], alone_long[0, 10:])
    torch.testing.assert_close(out[1, 10:], alone_short[0, 6:])


def test_continue_from_returned_cache(model):
    ids = prompt()
    first = model.generate(ids, do_sample=False, return_dict_in_generate=True, max_new_tokens=5, pad_token_id=0)
    assert isinstance(first.past_key_values, linearize.LinearizeCache)
    # explicit mask: a generated token may equal pad_token_id and must not be read as padding
    more = model.generate(first.sequences, attention_mask=torch.ones_like(first.sequences),
                          past_key_values=first.past_key_values, do_sample=False, max_new_tokens=7, pad_token_id=0)
    whole = model.generate(ids, do_sample=False, max_new_tokens=12, pad_token_id=0)
    torch.testing.assert_close(more, whole)


def test_chunked_prefill(model):
    ids = prompt(n=23)
    a = model.generate(ids, do_sample=False, prefill_chunk_size=5, **GEN)
    b = model.generate(ids, do_sample=False, use_cache=False, **GEN)
    torch.testing.assert_close(a, b)


@pytest.fixture(scope="module")
def tokenizer():
    vocab = {"<pad>": 0, "<s>": 1, **{f"w{i}": i for i in range(2, 97)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>")


def test_pipeline_and_streamer(model, tokenizer, capsys):
    text = " ".join(f"w{i}" for i in prompt(n=8)[0].tolist())
    expected = model.generate(tokenizer(text, return_tensors="pt").input_ids, do_sample=False, use_cache=False, **GEN)
    expected_text = tokenizer.decode(expected[0, 8:], skip_special_tokens=True)

    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    out = pipe(text, do_sample=False, return_full_text=False, **GEN)[0]["generated_text"]
    assert out.split() == expected_text.split()

    pipe.tokenizer.padding_side = "left"
    texts = [text, " ".join(text.split()[:5])]
    batch = pipe(texts, do_sample=False, return_full_text=False, batch_size=2, **GEN)
    assert batch[0][0]["generated_text"].split() == expected_text.split()

    capsys.readouterr()
    model.generate(tokenizer(text, return_tensors="pt").input_ids, do_sample=False,
                   streamer=TextStreamer(tokenizer, skip_prompt=True), **GEN)
    assert capsys.readouterr().out.split() == expected_text.split()


@pytest.mark.parametrize("cfg", [linearize.LinearAttentionConfig(layers=[0, 2], window=4, decay="channel"),
                                 linearize.GatedDeltaNetConfig(layers=[0, 2], conv_size=4)], ids=["window-decay", "gdn"])
def test_cache_memory_is_constant_in_sequence_length(cfg):
    model = converted("llama", cfg)
    sizes = {}
    for n in (16, 256):
        cache = linearize.LinearizeCache(model.config)
        with torch.no_grad():
            model(prompt(n=n), past_key_values=cache, use_cache=True)
        sizes[n] = (cache.nbytes(linear_only=True), cache.nbytes())
    assert sizes[16][0] == sizes[256][0] > 0  # converted layers: flat
    assert sizes[256][1] > sizes[16][1]  # the kept softmax layer's KV cache grows
    assert all(isinstance(cache.layers[i], LinearAttentionState) for i in (0, 2))


def test_crop_is_refused_clearly():
    model = converted("llama")
    cache = linearize.LinearizeCache(model.config)
    model(prompt(), past_key_values=cache, use_cache=True)
    with pytest.raises(NotImplementedError, match="cannot be rolled back"):
        cache.crop(-1)
    # transformers >= 5.24 refuses first, from the cache's is_croppable (False for our states)
    with pytest.raises((NotImplementedError, ValueError), match="cannot be rolled back|requires a cache that can be cropped"):
        model.generate(prompt(), assistant_model=converted("llama"), do_sample=False, **GEN)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", ["linear", "gdn", "hybrid"])
def test_padded_prompt_in_chunks_and_the_mask_each_chunk_builds(name, attn):
    """A left-padded prompt fed in chunks through the cache ends where one call ends. Without
    softmax layers, the mask a chunk builds covers only that chunk (it does not grow with what was
    seen before); with softmax layers it covers everything seen, as their keys need."""
    model = converted("llama", CONFIGS[name], attn_implementation=attn)
    ids = prompt(n=12, b=2)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    widths = []
    layer = model.model.layers[next(iter(model.config.linearize["layers"]))].self_attn
    hook = layer.register_forward_pre_hook(
        lambda mod, args, kwargs: widths.append(None if kwargs.get("attention_mask") is None
                                                else kwargs["attention_mask"].shape[-1]), with_kwargs=True)
    with torch.no_grad():
        whole = model(ids, attention_mask=mask, use_cache=True).logits[:, -1]
        widths.clear()
        cache = linearize.LinearizeCache(model.config)
        for a in range(0, 12, 4):
            last = model(ids[:, a:a + 4], attention_mask=mask[:, :a + 4], past_key_values=cache, use_cache=True).logits[:, -1]
    hook.remove()
    torch.testing.assert_close(last, whole, atol=1e-5, rtol=1e-4)
    if name == "hybrid":
        assert widths == [4, 8, 12]
    else:  # sdpa drops the mask of a chunk without padding
        assert set(widths) <= {4, None} and 4 in widths, widths


@pytest.mark.parametrize("method", ["hedgehog", "gdn"])
def test_dtype_change_after_a_cached_forward_rebuilds_the_fused_projection(method):
    """A forward with a cache builds one fused input-projection weight per layer; ``model.to(dtype)``
    swaps each parameter's data in place (same Parameter, same version counter), and the fused
    weight kept the old dtype: the next forward raised a dtype mismatch in F.linear."""
    cfg = linearize.GatedDeltaNetConfig() if method == "gdn" else linearize.LinearAttentionConfig(feature_map="hedgehog")
    model = converted("llama", cfg).eval()
    ids = torch.randint(2, 97, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids, use_cache=True)
        model.double()
        got = model(input_ids=ids, use_cache=True).logits
    fresh = converted("llama", cfg).double().eval()
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        want = fresh(input_ids=ids, use_cache=True).logits
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("method", ["hedgehog", "gdn"])
@pytest.mark.parametrize("training", [False, True])
def test_a_weight_changed_after_a_cached_forward_reaches_a_cache_free_forward(method, training):
    """The fused projection weight built by a cached forward is a copy: a weight then changed in place
    (load_state_dict, a LoRA merge, an optimizer step) must reach the next forward without gradients
    even when it passes no cache (perplexity evaluation, a KD teacher in train mode). It used to be
    checked only when a cache was passed, so the cache-free forward ran on the old weights."""
    cfg = linearize.GatedDeltaNetConfig() if method == "gdn" else linearize.LinearAttentionConfig(feature_map="hedgehog")
    model = converted("llama", cfg).eval()
    ids = torch.randint(2, 97, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids, use_cache=True)  # builds the fused weights
        for block in model.model.layers:
            block.self_attn.v_proj.weight.mul_(0.5)  # in place: same Parameter, new values
        model.train(training)
        got = model(input_ids=ids, use_cache=False).logits
    fresh = converted("llama", cfg).train(training)
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        want = fresh(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, want)


def test_a_layer_running_its_original_keeps_no_fused_copy():
    """softmax / transfer mode runs the original attention's own projections (a KD teacher, stage 1):
    the fused input-projection copy is dropped there, and built again back in linear mode."""
    model = converted("llama", linearize.LinearAttentionConfig(feature_map="hedgehog")).eval()
    ids = torch.randint(2, 97, (1, 7), generator=torch.Generator().manual_seed(0))
    layers = [attention(model, i) for i in linearize.converted_layers(model)]
    with torch.no_grad():
        model(input_ids=ids, use_cache=True)
        assert layers and all(layer._decode_weight is not None for layer in layers)
        with linearize.attention_mode(model, "softmax"):
            model(input_ids=ids, use_cache=False)
            assert all(layer._decode_weight is None for layer in layers)
        model(input_ids=ids, use_cache=True)
        assert all(layer._decode_weight is not None for layer in layers)
