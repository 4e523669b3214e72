"""linearize.PrefillGraph: a chunked prefill whose full chunks replay one captured chunk.

CUDA graphs need a GPU; on CPU ``Replay`` stands in for ``DecodeGraph`` with what a replay does and
does not do: the captured path is the one taken with the cache's Python-side values as they were at
capture (flags such as "a previous conv state exists"), and a replay runs the kernels only, so those
values do not move. A PrefillGraph that trusted the Python side after its replays (the GDN conv cache
restarted from zeros, a window ring taken as empty) gives different logits here. On CUDA the bench's
chunked-prefill check compares the real graph with one call (benchmarks/checks.py)."""

from __future__ import annotations

import pytest
import torch

import linearize
from linearize import StaticLinearizeCache
from linearize.graphs import CacheSnapshot, PrefillGraph

from conftest import ARCH_CONFIGS, converted

CONFIGS = {
    "hedgehog": linearize.LinearAttentionConfig(feature_map="hedgehog"),
    "lolcats": linearize.LinearAttentionConfig(feature_map="hedgehog", window=4, decay="scalar"),
    # the preset's sinks: a replay reads the reset cache's sink slots as this prompt's (empty, not filled)
    "lolcats-sinks": linearize.LinearAttentionConfig(feature_map="hedgehog", window=4, sinks=2),
    "gdn": linearize.GatedDeltaNetConfig(conv_size=3),
    "gdn-hybrid": linearize.GatedDeltaNetConfig(conv_size=4, layers=[1]),
}


class Replay:
    """DecodeGraph on CPU: ``step`` runs the model with the Python-side cache values of the capture
    and leaves them as they were before the step."""

    made = 0

    def __init__(self, model, cache, batch_size, warmup=3, pool=None, tokens=1, compile=False):
        self.model, self.cache, self.tokens = model, cache, tokens
        # compile: the forward as DecodeGraph(compile=True) captures it, traced whole (dynamo, eager backend)
        self.forward = torch.compile(model.forward, backend="eager", fullgraph=True, dynamic=False) if compile else model
        self.compiled = compile
        self.captured = CacheSnapshot(cache, copy=False)
        self.input_ids = torch.zeros(batch_size, tokens, dtype=torch.long)
        self.steps = 0
        Replay.made += 1

    def step(self, input_ids, position_ids):
        assert input_ids.shape[1] == self.tokens
        now = CacheSnapshot(self.cache, copy=False)
        self.captured.restore_scalars()
        with torch.no_grad():
            out = self.forward(input_ids=input_ids, position_ids=position_ids, past_key_values=self.cache,
                               use_cache=True, logits_to_keep=1).logits[:, -1]
        now.restore_scalars()
        self.steps += 1
        return out


@pytest.fixture
def replay(monkeypatch):
    monkeypatch.setattr(linearize.graphs, "DecodeGraph", Replay)
    Replay.made = 0
    return Replay


def one_call_then_step(model, ids, nxt):
    """Last logits of the prompt in one call on the default cache, and of one decode step after it."""
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        T = ids.shape[1]
        pos = torch.full_like(nxt, T)
        step = model(input_ids=nxt, position_ids=pos, past_key_values=out.past_key_values, use_cache=True)
    return out.logits[:, -1], step.logits[:, -1]


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt_neox"])
def test_prefill_graph_equals_one_call_and_continues(arch, name, replay):
    model = converted(arch, CONFIGS[name]).eval()
    B, C = 2, 8
    ids = torch.randint(2, 97, (B, 3 * C + 5), generator=torch.Generator().manual_seed(3))  # 3 replays + a tail
    nxt = torch.randint(2, 97, (B, 1), generator=torch.Generator().manual_seed(4))
    want, want_next = one_call_then_step(model, ids, nxt)
    cache = StaticLinearizeCache(model.config, max_batch_size=B, max_cache_len=64)
    graph = PrefillGraph(model, cache, batch_size=B, chunk_size=C)
    assert int(cache.layers[0].get_seq_length()) == 0  # capture leaves the cache empty
    for attempt in range(2):  # a second prompt after reset() reuses the capture
        got = graph(ids)
        assert graph.graph.steps == 3 * (attempt + 1)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        with torch.no_grad():
            step = model(input_ids=nxt, position_ids=torch.full_like(nxt, ids.shape[1]), past_key_values=cache,
                         use_cache=True).logits[:, -1]
        torch.testing.assert_close(step, want_next, rtol=1e-4, atol=1e-4)
        cache.reset()
    assert replay.made == 1


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefill_graph_of_the_compiled_chunk_equals_one_call(name, replay):
    """PrefillGraph(compile=True) hands the flag to its captured step, whose forward traces whole
    (fullgraph) as a continuation of the static cache and gives the one call's logits."""
    torch._dynamo.reset()
    model = converted("llama", CONFIGS[name]).eval()
    B, C = 2, 8
    ids = torch.randint(2, 97, (B, 3 * C), generator=torch.Generator().manual_seed(6))
    want, _ = one_call_then_step(model, ids, ids[:, :1])
    cache = StaticLinearizeCache(model.config, max_batch_size=B, max_cache_len=64)
    graph = PrefillGraph(model, cache, batch_size=B, chunk_size=C, compile=True)
    assert graph.graph.compiled
    torch.testing.assert_close(graph(ids), want, rtol=1e-4, atol=1e-4)
    assert graph.graph.steps == 3


def test_prefill_graph_continues_a_cache_and_short_prompts_run_eagerly(replay):
    model = converted("llama", CONFIGS["gdn"]).eval()
    ids = torch.randint(2, 97, (1, 29), generator=torch.Generator().manual_seed(5))
    want, _ = one_call_then_step(model, ids, ids[:, :1])
    cache = StaticLinearizeCache(model.config, max_batch_size=1, max_cache_len=64)
    graph = PrefillGraph(model, cache, batch_size=1, chunk_size=8)
    graph(ids[:, :5])  # shorter than a chunk: eager, no replay
    assert graph.graph.steps == 0
    got = graph(ids[:, 5:], start=5)  # continues the 5 tokens: 3 replays and a tail of 0
    assert graph.graph.steps == 3
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_prefill_graph_errors(replay):
    model = converted("llama", CONFIGS["hedgehog"]).eval()
    with pytest.raises(ValueError, match="needs a static cache"):
        PrefillGraph(model, linearize.LinearizeCache(model.config), batch_size=1, chunk_size=8)
    cache = StaticLinearizeCache(model.config, max_batch_size=1, max_cache_len=20)
    with pytest.raises(ValueError, match="chunk_size must be an int >= 2"):
        PrefillGraph(model, cache, batch_size=1, chunk_size=1)
    graph = PrefillGraph(model, cache, batch_size=1, chunk_size=8)
    with pytest.raises(ValueError, match="captured for batch_size=1"):
        graph(torch.ones(2, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="do not fit this StaticLinearizeCache"):
        graph(torch.ones(1, 24, dtype=torch.long))
    assert graph.graph.steps == 0  # refused before any replay wrote to the cache


def test_decode_graph_needs_cuda_for_real():
    model = converted("llama", CONFIGS["hedgehog"]).eval()
    cache = StaticLinearizeCache(model.config, max_batch_size=1, max_cache_len=32)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs CUDA"):
            PrefillGraph(model, cache, batch_size=1, chunk_size=8)


def test_prefill_graph_of_an_original_model_over_transformers_static_cache(replay):
    """The same capture serves an unconverted model over transformers' StaticCache (the baseline a
    benchmark compares with)."""
    from transformers import StaticCache

    from conftest import tiny_model

    model = tiny_model("llama").eval()
    ids = torch.randint(2, 97, (1, 21), generator=torch.Generator().manual_seed(6))
    want, _ = one_call_then_step(model, ids, ids[:, :1])
    cache = StaticCache(config=model.config, max_cache_len=32)
    graph = PrefillGraph(model, cache, batch_size=1, chunk_size=8)
    got = graph(ids)
    assert graph.graph.steps == 2
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
