"""Property: running through the state cache equals a full recompute, whatever the shapes.

Hypothesis draws a tiny model (every architecture of conftest.ARCH_CONFIGS), a conversion (every
feature map, a softmax window with or without attention sinks, a decay gate, Gated DeltaNet with or without its convolution and
grouped heads, layer-level hybrids), a batch of left-padded prompts of random lengths, a chunked
prefill (random chunk sizes), a continuation of random length decoded token by token, and the
dynamic or a static cache of a random size.  The logits of every real token must equal those of
one forward over the whole sequence without a cache.  The same property is drawn through
``generate()`` too (transformers' own cache set-up, prompt cutting, chunked prefill and the
continuation of a returned cache).  Examples are derandomized (CI is reproducible) and bounded
(~2 minutes on two CPU cores); a failure prints the example to replay.  400 random examples of the
generate property and 300 of the forward one passed locally on transformers 5.24 (2026-11-24).
"""

from __future__ import annotations

import pytest
import torch

import linearize

from conftest import ARCH_CONFIGS, converted

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

N_LAYERS = 3


@st.composite
def methods(draw):
    layers = draw(st.sampled_from([None, None, [0], [1, 2], [0, 2]]))  # a list: a layer-level hybrid
    if draw(st.booleans()) and draw(st.booleans()):
        return linearize.GatedDeltaNetConfig(layers=layers, conv_size=draw(st.sampled_from([0, 2, 4])),
                                             kv_heads=draw(st.sampled_from(["expand", "group"])),
                                             use_rope=draw(st.booleans()))
    fmap = draw(st.sampled_from(["hedgehog", "t2r", "elu", "relu", "performer"]))
    window = draw(st.sampled_from([0, 0, 1, 3, 5]))
    return linearize.LinearAttentionConfig(feature_map=fmap, layers=layers, window=window,
                                           sinks=draw(st.sampled_from([0, 1, 2])) if window else 0,
                                           decay=draw(st.sampled_from([None, "scalar", "channel"])),
                                           chunk_size=draw(st.sampled_from([4, 16, 64])))


@st.composite
def runs(draw):
    B = draw(st.integers(1, 3))
    prompt_lens = [draw(st.integers(1, 12)) for _ in range(B)]
    P = max(prompt_lens)
    chunks, left = [], P
    while left:  # chunked prefill: random chunk sizes covering the padded prompt
        chunks.append(draw(st.integers(1, left)))
        left -= chunks[-1]
    return dict(arch=draw(st.sampled_from(sorted(ARCH_CONFIGS))), method=draw(methods()), B=B, lens=prompt_lens,
                chunks=chunks, decode=draw(st.integers(0, 6)), static=draw(st.booleans()),
                spare=draw(st.integers(0, 5)), seed=draw(st.integers(0, 2**16)))


@settings(max_examples=40, deadline=None, derandomize=True, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(run=runs())
def test_cached_prefill_and_decode_equal_a_full_recompute(run):
    torch.manual_seed(0)
    model = converted(run["arch"], run["method"])
    g = torch.Generator().manual_seed(run["seed"])
    B, P, D = run["B"], max(run["lens"]), run["decode"]
    T = P + D
    ids = torch.randint(2, 97, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    for b, n in enumerate(run["lens"]):
        mask[b, : P - n] = 0  # left padding
        ids[b, : P - n] = 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)

    with torch.no_grad():
        full = model(ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        if run["static"]:
            cache = linearize.StaticLinearizeCache(model.config, max_batch_size=B + (run["spare"] % 2),
                                                   max_cache_len=T + run["spare"])
        else:
            cache = linearize.LinearizeCache(model.config)
        steps, s = [], 0
        for c in run["chunks"] + [1] * D:  # chunked prefill, then one token at a time
            e = s + c
            out = model(ids[:, s:e], attention_mask=mask[:, :e], position_ids=pos[:, s:e], past_key_values=cache,
                        use_cache=True)
            steps.append(out.logits)
            s = e
    cached = torch.cat(steps, 1)
    real = mask.bool()
    torch.testing.assert_close(cached[real], full[real], atol=2e-4, rtol=2e-4,
                               msg=lambda m: f"{m}\nrun: {run}")


@st.composite
def generations(draw):
    B = draw(st.integers(1, 3))
    return dict(arch=draw(st.sampled_from(sorted(ARCH_CONFIGS))), method=draw(methods()), B=B,
                lens=[draw(st.integers(1, 10)) for _ in range(B)], new=draw(st.integers(1, 5)),
                static=draw(st.booleans()), chunk=draw(st.sampled_from([None, None, 1, 3, 8])),
                more=draw(st.integers(0, 3)), seed=draw(st.integers(0, 2**16)))


@settings(max_examples=60, deadline=None, derandomize=True, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(run=generations())
def test_generate_equals_a_full_recompute(run):
    """The same property through ``generate()``, where transformers prepares the cache, cuts the
    prompt, feeds it in chunks (``prefill_chunk_size``) and continues a returned cache: every logit
    generate returns equals one cache-free forward over the final sequence. Logits, not tokens, are
    compared, so a near tie cannot make the test flaky; the dynamic cache is continued by a second
    generate() call (transformers 5.24 changed how a continued all-linear cache is cut: it broke)."""
    torch.manual_seed(0)
    model = converted(run["arch"], run["method"])
    g = torch.Generator().manual_seed(run["seed"])
    B, P = run["B"], max(run["lens"])
    ids = torch.randint(2, 97, (B, P), generator=g)
    mask = torch.ones(B, P, dtype=torch.long)
    for b, n in enumerate(run["lens"]):
        mask[b, : P - n], ids[b, : P - n] = 0, 0  # left padding
    kw = dict(do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=run["new"], prefill_chunk_size=run["chunk"],
                             cache_implementation="static" if run["static"] else None, **kw)
        seq, logits = out.sequences, list(out.logits)
        if run["more"] and not run["static"]:  # a static cache is sized for the first call
            mask = torch.cat([mask, mask.new_ones(B, seq.shape[1] - P)], 1)
            out = model.generate(seq, attention_mask=mask, past_key_values=out.past_key_values,
                                 max_new_tokens=run["more"], **kw)
            seq, logits = out.sequences, logits + list(out.logits)
        mask = torch.cat([mask, mask.new_ones(B, seq.shape[1] - mask.shape[1])], 1)
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        full = model(seq, attention_mask=mask, position_ids=pos, use_cache=False).logits
    n = len(logits)
    assert seq.shape[1] == P + n
    torch.testing.assert_close(torch.stack(logits, 1), full[:, P - 1 : P - 1 + n], atol=2e-4, rtol=2e-4,
                               msg=lambda m: f"{m}\nrun: {run}")
