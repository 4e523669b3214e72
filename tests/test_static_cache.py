"""StaticLinearizeCache: a fixed-size cache whose decode step can be compiled / captured in a CUDA graph.

Checked here: generate(cache_implementation="static") gives the tokens of the dynamic cache (every
architecture and layer type, left padding under sdpa and eager, sampling, beam search); the storage
is allocated once and then updated in place; a decode step compiles with fullgraph=True and does not
recompile from step to step; clear errors. The CUDA tests at the end (graph capture, transformers'
own compile path) run only where a GPU is present.
"""

import pytest
import torch
from transformers.cache_utils import StaticLayer

import linearize
from linearize import StaticLinearizeCache
from linearize.cache import StaticLinearAttentionState

from conftest import ARCH_CONFIGS, converted

CONFIGS = {
    "hedgehog": linearize.LinearAttentionConfig(feature_map="hedgehog"),
    "window4-scalar": linearize.LinearAttentionConfig(feature_map="t2r", window=4, decay="scalar"),
    "channel-decay": linearize.LinearAttentionConfig(feature_map="elu", decay="channel"),
    "gdn": linearize.GatedDeltaNetConfig(conv_size=3),
    "layer-hybrid": linearize.LinearAttentionConfig(feature_map="hedgehog", window=3, decay="channel", layers=[0, 2]),
    "gdn-group-hybrid": linearize.GatedDeltaNetConfig(kv_heads="group", conv_size=4, layers=[1]),
    "gdn-window4-sinks1": linearize.GatedDeltaNetConfig(conv_size=3, window=4, sinks=1, layers=[0, 2]),
}
GEN = dict(max_new_tokens=10, pad_token_id=0)


def prompt(n=9, b=1, seed=0):
    return torch.randint(2, 97, (b, n), generator=torch.Generator().manual_seed(seed))


def static_generate(model, ids, **kw):
    out = model.generate(ids, cache_implementation="static", return_dict_in_generate=True, **kw)
    assert isinstance(out.past_key_values, StaticLinearizeCache)  # the static path really ran
    return out.sequences


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_static_greedy_equals_dynamic_every_arch(arch, name):
    model = converted(arch, CONFIGS[name])
    ids = prompt(b=2)
    dynamic = model.generate(ids, do_sample=False, **GEN)
    torch.testing.assert_close(static_generate(model, ids, do_sample=False, **GEN), dynamic)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_static_left_padded_batch(name, attn):
    model = converted("llama", CONFIGS[name], attn_implementation=attn)
    batch = torch.zeros(2, 10, dtype=torch.long)
    mask = torch.zeros(2, 10, dtype=torch.long)
    batch[0], mask[0] = prompt(n=10, seed=1)[0], 1
    batch[1, 4:], mask[1, 4:] = prompt(n=6, seed=2)[0], 1
    dynamic = model.generate(batch, attention_mask=mask, do_sample=False, **GEN)  # = each prompt alone (test_generate)
    static = static_generate(model, batch, attention_mask=mask, do_sample=False, **GEN)
    torch.testing.assert_close(static, dynamic)
    alone = model.generate(prompt(n=6, seed=2), do_sample=False, **GEN)
    torch.testing.assert_close(static[1, 10:], alone[0, 6:])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_static_seeded_sampling_and_beam_search(name):
    model = converted("llama", CONFIGS[name])
    ids = prompt(b=2)
    runs = []
    for static in (False, True):
        torch.manual_seed(7)
        kw = dict(do_sample=True, top_k=0, temperature=1.0, **GEN)
        runs.append(static_generate(model, ids, **kw) if static else model.generate(ids, **kw))
    torch.testing.assert_close(runs[1], runs[0])
    beams = model.generate(ids, num_beams=3, do_sample=False, **GEN)
    torch.testing.assert_close(static_generate(model, ids, num_beams=3, do_sample=False, **GEN), beams)


def test_generate_sizes_the_cache_and_returns_it_for_continuation():
    model = converted("llama", CONFIGS["layer-hybrid"])
    ids = prompt(b=2)
    out = model.generate(ids, cache_implementation="static", return_dict_in_generate=True, num_beams=2,
                         do_sample=False, **GEN)
    cache = out.past_key_values
    assert cache.max_batch_size == 4 and cache.max_cache_len >= ids.shape[1] + GEN["max_new_tokens"]
    assert cache.is_compileable and not cache.is_croppable
    assert [type(layer) for layer in cache.layers][:2] == [StaticLinearAttentionState, linearize.cache.StaticKVLayer]
    assert isinstance(cache.layers[1], StaticLayer)
    # continue from a returned static cache (greedy): equals one longer run
    cache = StaticLinearizeCache(model.config, max_batch_size=1, max_cache_len=40)
    first = model.generate(ids[:1], past_key_values=cache, do_sample=False, max_new_tokens=5, pad_token_id=0)
    more = model.generate(first, attention_mask=torch.ones_like(first), past_key_values=cache, do_sample=False,
                          max_new_tokens=7, pad_token_id=0)
    whole = model.generate(ids[:1], do_sample=False, max_new_tokens=12, pad_token_id=0)
    torch.testing.assert_close(more, whole)


def _storage(cache):
    """Every tensor the cache holds: (layer, name) -> tensor."""
    out = {}
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, StaticLinearAttentionState):
            out.update({(i, f"state{j}"): t for j, t in layer.recurrent_states.items() if t is not None})
            out.update({(i, f"conv{j}"): t for j, t in layer.conv_states.items() if t is not None})
        elif layer.is_initialized:
            out.update({(i, "keys"): layer.keys, (i, "values"): layer.values})
        out[(i, "length")] = layer.cumulative_length
    return out


@pytest.mark.parametrize("name", ["hedgehog", "window4-scalar", "gdn", "layer-hybrid", "gdn-group-hybrid"])
def test_storage_is_allocated_once_and_updated_in_place(name):
    model = converted("llama", CONFIGS[name])
    ids = prompt(b=2)
    cache = StaticLinearizeCache(model.config, max_batch_size=2, max_cache_len=16)
    dynamic = linearize.LinearizeCache(model.config)
    assert cache.get_seq_length() == 0 and _storage(cache).keys() == {(i, "length") for i in range(3)}
    with torch.no_grad():
        logits = model(ids, past_key_values=cache, use_cache=True).logits
        ref = model(ids, past_key_values=dynamic, use_cache=True).logits
        torch.testing.assert_close(logits, ref)
        before = _storage(cache)
        assert sum(1 for key in before if key[1] in ("state0", "keys")) == 3  # every layer allocated
        ptrs = {key: (t, t.data_ptr()) for key, t in before.items()}
        for step in range(4):
            values = {key: t.clone() for key, t in before.items()}
            tok = logits[:, -1].argmax(-1, keepdim=True)
            logits = model(tok, past_key_values=cache, use_cache=True).logits
            torch.testing.assert_close(logits, model(tok, past_key_values=dynamic, use_cache=True).logits)
            now = _storage(cache)
            assert now.keys() == before.keys()
            for key, (tensor, ptr) in ptrs.items():
                assert now[key] is tensor and now[key].data_ptr() == ptr, f"{key} was reallocated at step {step}"
            for i in range(3):  # every layer's state (or KV buffer) and its counter moved on, in place
                main = (i, "state0") if (i, "state0") in now else (i, "keys")
                assert not torch.equal(now[main], values[main]), f"{main} did not change at step {step}"
            assert int(cache.get_seq_length()) == ids.shape[1] + step + 1
    # beam search's reorder: rows permuted in place
    rows = {key: t.clone() for key, t in before.items()}
    cache.reorder_cache(torch.tensor([1, 0]))
    for key, t in _storage(cache).items():
        assert t is ptrs[key][0] and t.data_ptr() == ptrs[key][1]
        torch.testing.assert_close(t, rows[key] if key[1] == "length" else rows[key].flip(0))
    # reset(): zeroed in place, the storage kept, and a new prefill reproduces the first
    cache.reset()
    assert all(t is ptrs[key][0] and not t.any() for key, t in _storage(cache).items())
    with torch.no_grad():
        torch.testing.assert_close(model(ids, past_key_values=cache, use_cache=True).logits, ref)


# graph nodes that read a device value on the host (a CPU-GPU sync; CUDA graphs cannot hold them)
HOST_READS = {"item", "tolist", "nonzero", "_local_scalar_dense", "is_nonzero", "__bool__", "cpu", "numpy"}


def _no_host_reads(graphs):
    """A dynamo backend: records each traced graph, fails on host reads, runs the graph as is."""
    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
            assert target.split(".")[0] not in HOST_READS, f"the decode step reads the device on the host: {node.format_node()}"
        graphs.append(gm)
        return gm.forward
    return backend


@pytest.mark.parametrize("arch,name", [("llama", "hedgehog"), ("qwen3", "window4-scalar"), ("phi3", "gdn"),
                                       ("gemma2", "layer-hybrid"), ("olmo2", "gdn-group-hybrid"),
                                       ("llama", "gdn-window4-sinks1")])
def test_decode_step_compiles_without_recompiling(arch, name):
    """fullgraph=True: one graph, no break; no host reads in it (.item(), bool(tensor), nonzero: with
    recent torch dynamo keeps .item() inside the graph, so the nodes are checked); error_on_recompile:
    the step count lives in a tensor, not in a Python attribute that changes every step."""
    model = converted(arch, CONFIGS[name])
    B, L = 2, 20
    ids = prompt(n=8, b=B)
    mask = torch.ones(B, L, dtype=torch.long)  # a fixed-size padding mask: row 1 left-padded by 3
    mask[1, :3] = 0
    ids[1, :3] = 0
    caches = [StaticLinearizeCache(model.config, max_batch_size=B, max_cache_len=L) for _ in range(2)]
    torch._dynamo.reset()
    graphs = []
    compiled = torch.compile(model, backend=_no_host_reads(graphs), fullgraph=True, dynamic=False)
    with torch.no_grad():
        for cache in caches:  # the prefill is never compiled
            logits = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits
        steps = 0
        for step in range(5):
            tok = logits[:, -1].argmax(-1, keepdim=True)
            logits = model(tok, attention_mask=mask, past_key_values=caches[0], use_cache=True).logits
            with torch._dynamo.config.patch(error_on_recompile=step > 0):  # step 0 compiles
                out = compiled(tok, attention_mask=mask, past_key_values=caches[1], use_cache=True).logits
            torch.testing.assert_close(out, logits, rtol=1e-5, atol=1e-5)
            steps += 1
    assert len(graphs) == 1
    assert int(caches[1].get_seq_length()) == ids.shape[1] + steps
    for a, b in zip(_storage(caches[0]).values(), _storage(caches[1]).values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_errors_are_clear():
    model = converted("llama", CONFIGS["layer-hybrid"])
    ids = prompt(b=2)
    with pytest.raises(ValueError, match="max_batch_size >= 2"):
        model(ids, past_key_values=StaticLinearizeCache(model.config, max_batch_size=1, max_cache_len=32))
    with pytest.raises(ValueError, match="max_cache_len >= prompt length"):
        model(ids, past_key_values=StaticLinearizeCache(model.config, max_batch_size=2, max_cache_len=5))
    with pytest.raises(ValueError, match="max_batch_size >= 2"):
        model.generate(ids, past_key_values=StaticLinearizeCache(model.config, 1, 32), **GEN)
    cache = StaticLinearizeCache(model.config, max_batch_size=1, max_cache_len=24)
    model(prompt(n=20), past_key_values=cache)  # fits; 20 + 5 more tokens do not
    with pytest.raises(ValueError, match="20 cached \\+ 5 new tokens do not fit"):
        model(prompt(n=5), past_key_values=cache)
    # the converted layer checks too (a call that bypasses the model's forward)
    all_linear = converted("llama", CONFIGS["gdn"])
    with pytest.raises(ValueError, match="max_batch_size"):
        all_linear.model(ids, past_key_values=StaticLinearizeCache(all_linear.config, 1, 32), use_cache=True)
    cache = StaticLinearizeCache(model.config, max_batch_size=2, max_cache_len=32)
    model(ids, past_key_values=cache)
    with pytest.raises(NotImplementedError, match="cannot be rolled back"):
        cache.crop(-1)
    with pytest.raises(ValueError, match="holds states for a batch of 2"):
        model(prompt(), past_key_values=cache)
    with pytest.raises(ValueError, match="cache_implementation='static'"):
        model.generate(ids, cache_implementation="offloaded_static", **GEN)
    with pytest.raises(ValueError, match="positive int max_cache_len"):
        StaticLinearizeCache(model.config, max_batch_size=1, max_cache_len=0)


# -- CUDA only: a raw CUDA graph and transformers' own compile path ---------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("name", ["window4-scalar", "gdn", "layer-hybrid"])
def test_decode_step_in_a_cuda_graph(name):
    model = converted("llama", CONFIGS[name]).cuda()
    B, L = 2, 32
    ids = prompt(b=B).cuda()
    mask = torch.ones(B, L, dtype=torch.long, device="cuda")
    eager, graphed = (StaticLinearizeCache(model.config, B, L, device="cuda") for _ in range(2))
    tok = torch.zeros(B, 1, dtype=torch.long, device="cuda")
    with torch.no_grad():
        for cache in (eager, graphed):
            logits = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits
        tok.copy_(logits[:, -1].argmax(-1, keepdim=True))
        # warm up on a side stream (as torch.cuda.graph asks), on a copy of the state, then capture
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        snapshot = {k: t.clone() for k, t in _storage(graphed).items()}
        with torch.cuda.stream(side):
            model(tok, attention_mask=mask, past_key_values=graphed, use_cache=True)
        torch.cuda.current_stream().wait_stream(side)
        for key, t in _storage(graphed).items():
            t.copy_(snapshot[key])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_logits = model(tok, attention_mask=mask, past_key_values=graphed, use_cache=True).logits
        for key, t in _storage(graphed).items():  # capture ran nothing: restore the state
            t.copy_(snapshot[key])
        for _ in range(6):
            ref = model(tok, attention_mask=mask, past_key_values=eager, use_cache=True).logits
            graph.replay()
            torch.testing.assert_close(static_logits, ref, rtol=1e-4, atol=1e-4)
            tok.copy_(ref[:, -1].argmax(-1, keepdim=True))
    assert int(graphed.get_seq_length()) == int(eager.get_seq_length()) == ids.shape[1] + 6


@cuda
@pytest.mark.parametrize("name", ["hedgehog", "gdn", "layer-hybrid"])
def test_generate_static_on_cuda_uses_transformers_compile(name):
    model = converted("llama", CONFIGS[name]).cuda()
    ids = prompt(b=2).cuda()
    dynamic = model.generate(ids, do_sample=False, **GEN)
    static = static_generate(model, ids, do_sample=False, **GEN)
    assert model._valid_auto_compile_criteria({"past_key_values": StaticLinearizeCache(model.config, 2, 32)},
                                              model.generation_config)
    torch.testing.assert_close(static, dynamic)


@pytest.mark.parametrize("name", ["window4-scalar", "gdn-group-hybrid"])
def test_converted_layers_share_one_token_counter_advanced_once(name, monkeypatch):
    """The converted layers of a StaticLinearizeCache hold one counter (a decode step adds to it once,
    in the last converted layer, not once per layer), and it counts every call's tokens."""
    model = converted("llama", CONFIGS[name])
    cache = StaticLinearizeCache(model.config, max_batch_size=2, max_cache_len=16)
    lin = [layer for layer in cache.layers if isinstance(layer, StaticLinearAttentionState)]
    assert len({id(layer.cumulative_length) for layer in lin}) == 1
    assert [layer.advances for layer in lin] == [False] * (len(lin) - 1) + [True]
    adds = []
    real = torch.Tensor.add_
    monkeypatch.setattr(torch.Tensor, "add_", lambda t, *a, **k: adds.append(t) or real(t, *a, **k))
    ids = prompt(b=2)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        assert int(cache.layers[model.config.linearize["layers"][0]].get_seq_length()) == ids.shape[1]
        adds.clear()
        model(ids[:, :1], past_key_values=cache, use_cache=True)
    counter = lin[0].cumulative_length
    assert sum(t is counter for t in adds) == 1
    assert all(int(layer.get_seq_length()) == ids.shape[1] + 1 for layer in lin)
    cache.reset()
    assert int(counter) == 0 and lin[-1].cumulative_length is counter
