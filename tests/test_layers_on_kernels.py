"""Converted layers running on the Triton kernels give what the PyTorch path gives.

The tiny models live on the CPU, so this runs under TRITON_INTERPRET=1 (CI's kernel pass) only: on
a GPU machine they would hand CPU tensors to the compiled kernels (40 failures of that kind on an
H200).  On a GPU, the same paths are checked by `linearize bench`'s graph-vs-eager and
chunked-prefill checks and by the tests/test_kernels_*.py files, which put their tensors on CUDA."""

import os

import pytest
import torch

import linearize

from conftest import converted, tiny_model

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU models on the kernels: needs TRITON_INTERPRET=1")


def decode_after_padded_prefill(model, ids, steps, cache: str, layers, before_decode=None):
    """Prefill ``ids`` (row 1 left-padded by two tokens) into a fresh ``cache`` ("static" or
    "dynamic"), then one decode step per column of ``steps``; returns the steps' logits and copies of
    the listed layers' cached tensors. ``before_decode``: called between the prefill and the steps."""
    pkv = (linearize.StaticLinearizeCache(model.config, 2, 16) if cache == "static"
           else linearize.LinearizeCache(model.config))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    logits = []
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=pkv, use_cache=True)
        if before_decode is not None:
            before_decode()
        for t in range(steps.shape[1]):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
            logits.append(model(steps[:, t : t + 1], attention_mask=mask, past_key_values=pkv, use_cache=True).logits)
    return torch.cat(logits, 1), [{n: x.clone() for n, x in pkv.layers[i].read().items() if x is not None}
                                  for i in layers]


def spread_gates(model, seed=1):
    """Gates away from their start (weights 0, bias 6: every channel decays alike, by 0.25%): each
    head, step and channel then forgets at its own rate, some of them strongly."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.self_attn, "gate", None)
            if gate is not None:
                gate.weight.normal_(0, 0.3, generator=g)
                gate.bias.normal_(1.0, 2.0, generator=g)
            out_gate = getattr(layer.self_attn, "out_gate_out", None)  # the output gate away from 1 too
            if out_gate is not None:
                out_gate.weight.normal_(0, 0.5, generator=g)
                out_gate.bias.normal_(0, 1.0, generator=g)


@pytest.fixture
def short_channel_chunks(monkeypatch):
    """The per-channel chunk kernel on chunks of 16 (one sub-chunk), as test_kernels_channel_gate.py's
    ``short_chunks``: the interpreter's time goes with the chunk length (64 by default, 4 sub-chunks and
    their 10 pairs whatever T is), not with T. Restarts and state carries at a sub-chunk's edge inside
    a 64-token chunk are tested on the kernel itself, at the real sizes (test_reset_restarts_the_state,
    test_a_document_gets_nothing_from_the_next, test_other_chunk_lengths)."""
    from linearize.kernels.linear_attn import chunk_channel

    monkeypatch.setitem(chunk_channel.CONFIG, "BT", 16)
    monkeypatch.setitem(chunk_channel.CONFIG, "BC", 16)


# ("scalar", 0, 256): the kernels' widest feature space (distill --feature-dim 256); "channel": one gate
# per feature channel, on its own chunk kernel; conv_size 4: the short conv before the features (its
# decode steps take q and k after RoPE, not from the fused projection); output_gate 4: the output gate
# after the fused decode kernels (its first factor in the fused projection)
@pytest.mark.parametrize("decay,window,feature_dim,conv_size,output_gate", [
    (None, 0, None, 0, 0), (None, 3, None, 0, 0), ("scalar", 0, None, 0, 0), ("scalar", 3, None, 0, 0),
    ("scalar", 0, 256, 0, 0), ("channel", 0, None, 0, 0), ("scalar", 0, None, 4, 0), ("channel", 0, None, 0, 4),
    ("scalar", 3, None, 0, 4)])
def test_kernel_path_matches_pytorch_path(monkeypatch, request, decay, window, feature_dim, conv_size, output_gate):
    if decay == "channel":  # its chunk kernel on chunks of 16: see short_channel_chunks (11 tokens: 1 chunk)
        request.getfixturevalue("short_channel_chunks")
    cfg = linearize.LinearAttentionConfig(feature_map="hedgehog", feature_dim=feature_dim, decay=decay, window=window,
                                          conv_size=conv_size, output_gate=output_gate, layers=[0, 2])
    model = converted("llama", cfg)
    spread_gates(model)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # per-head window weights away from 1, conv taps away from the identity
        for layer in (model.model.layers[0].self_attn, model.model.layers[2].self_attn):
            if window:
                layer.window_log_gamma.copy_(torch.tensor([-1.0, 0.0, 0.5, 1.0]))
            if conv_size:
                layer.conv.weight.add_(torch.randn(layer.conv.weight.shape, generator=g) * 0.3)
    ids = torch.randint(2, 97, (2, 11))
    mask = torch.ones_like(ids)
    if not window:
        mask[1, :3] = 0  # left padding reaches the kernel path as zeroed keys (window + padding: PyTorch)
    runs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("LINEARIZE_KERNELS", backend)
        with torch.no_grad():
            logits = model(ids, attention_mask=mask, use_cache=False).logits
            tokens = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        runs[backend] = (logits, tokens)
    torch.testing.assert_close(runs["triton"][0], runs["torch"][0], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(runs["triton"][1], runs["torch"][1])


@pytest.mark.parametrize("decay", ["scalar", "channel"])
def test_split_prefill_under_bf16_autocast_keeps_the_state(monkeypatch, decay):
    """Without gradients a long prompt may be cut into segments run in parallel (the scalar gate's
    ``auto_splits`` on a GPU only, the per-channel gate's ``CONFIG["splits"]`` when set: forced here),
    and an evaluation under ``accelerate``'s bf16 autocast takes that path: the
    first converted layer's cached state (its inputs the same in both runs) equals the unsplit
    prefill's to fp32 rounding. In -30a the per-channel split mixed its segments' states in bf16 under
    autocast (about 1e-3 off) and the state kernel refused them: the run died in its evaluation."""
    from linearize.kernels.linear_attn import chunk, chunk_channel

    monkeypatch.setenv("LINEARIZE_KERNELS", "triton")
    monkeypatch.setitem(chunk.CONFIG, "BT", 16)  # chunks of 16: a 70-token prompt in 3 segments of 32 / 32 / 6
    monkeypatch.setitem(chunk_channel.CONFIG, "BT", 16)
    monkeypatch.setitem(chunk_channel.CONFIG, "BC", 16)
    # 2 heads on 1 key/value head (the interpreter runs a program per head): the split is along time
    model = converted("llama", linearize.LinearAttentionConfig(feature_map="hedgehog", decay=decay, layers=[0, 2]),
                      num_attention_heads=2, num_key_value_heads=1)
    spread_gates(model)
    ids = torch.randint(2, 97, (1, 70), generator=torch.Generator().manual_seed(3))
    runs, real = {}, chunk_channel.split_fwd
    for n in (1, 3):
        splits = []
        monkeypatch.setattr(chunk, "auto_splits", lambda q, v, n=n: splits.append(n) or n)
        monkeypatch.setitem(chunk_channel.CONFIG, "splits", n)
        monkeypatch.setattr(chunk_channel, "split_fwd", lambda *a: splits.append(a[-1]) or real(*a))
        pkv = linearize.LinearizeCache(model.config)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids, past_key_values=pkv, use_cache=True).logits
        assert splits == ([n, n] if decay == "scalar" or n > 1 else []), splits  # both layers split (n > 1)
        runs[n] = (logits.float(), {k: x.clone() for k, x in pkv.layers[0].read().items() if x is not None})
    for name in ("S", "z"):
        torch.testing.assert_close(runs[3][1][name], runs[1][1][name], atol=1e-5, rtol=1e-5, msg=name)
    torch.testing.assert_close(runs[3][0], runs[1][0], atol=0.05, rtol=0.02)


def test_kernels_are_really_used(monkeypatch):
    import linearize.attention as att

    calls = []
    real = att._triton_chunk
    monkeypatch.setattr(att, "_triton_chunk", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv("LINEARIZE_KERNELS", "auto")
    model = converted("llama", linearize.LinearAttentionConfig(feature_map="elu"))
    with torch.no_grad():
        model(torch.randint(2, 97, (1, 5)), use_cache=False)
    assert len(calls) == 3


def test_channel_decay_runs_its_kernel_and_says_when_it_cannot(monkeypatch, short_channel_chunks):
    """Per-channel gates run their chunk kernel (no warning); beside a window they have none, and a
    forward with the kernels on warns once that the PyTorch math runs instead (a silent fallback
    would hide a slower step)."""
    import warnings

    import linearize.attention as att

    calls = []
    real = att._la_kernels.chunk_linear_attn_channel
    monkeypatch.setattr(att._la_kernels, "chunk_linear_attn_channel", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv("LINEARIZE_KERNELS", "auto")
    monkeypatch.setattr(att, "_WARNED", set())
    ids = torch.randint(2, 97, (1, 7))
    for window in (0, 2):
        calls.clear()
        model = converted("llama", linearize.LinearAttentionConfig(feature_map="t2r", decay="channel", window=window))
        with warnings.catch_warnings(record=True) as seen, torch.no_grad():
            warnings.simplefilter("always")
            model(ids, use_cache=False)
            model(ids, use_cache=False)
        said = [w for w in seen if "decay='channel'" in str(w.message)]
        assert len(said) == (window > 0), [str(w.message) for w in seen]
        assert len(calls) == (0 if window else 6), (window, len(calls))  # 3 layers, 2 calls
    # generation: the prompt on the chunk kernel, each decode step on the fused recurrent step with
    # the per-channel gate (not a chunk of one token)
    steps = []
    real_step = att._la_kernels.fused_recurrent_linear_attn
    monkeypatch.setattr(att._la_kernels, "fused_recurrent_linear_attn",
                        lambda *a, **k: steps.append(tuple(k["log_g"].shape)) or real_step(*a, **k))
    calls.clear()
    model = converted("llama", linearize.LinearAttentionConfig(feature_map="t2r", decay="channel"))
    with torch.no_grad():
        model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    F = model.model.layers[0].self_attn.feature_dim
    assert len(calls) == 3 and steps == [(1, 1, 4, F)] * 6, (len(calls), steps)  # 2 decode steps x 3 layers


@pytest.mark.parametrize("method", ["hedgehog", "gdn", "gdn-window"])
def test_packed_rows_on_the_kernels_equal_each_document_alone(method):
    """On the chunk kernels a document restart resets the state by a decay of exp(-128) = 0 there
    (linearize/attention.py RESET_LOG_DECAY), the static packed form; each document's outputs and the
    gradients it sends back are its own, within the kernels' float32 tolerance (the in-chunk
    cumulative decays carry ~1e-5 rounding at the reset's magnitude)."""
    dev = "cpu"  # the interpreter's kernels (this file runs in CI's kernel pass)
    cfg = {"gdn": linearize.GatedDeltaNetConfig(), "gdn-window": linearize.GatedDeltaNetConfig(window=16, sinks=2),
           "hedgehog": linearize.LinearAttentionConfig(feature_map="hedgehog")}[method]
    torch.manual_seed(0)
    model = linearize.linearize(tiny_model("llama", num_hidden_layers=1), cfg).to(dev)
    if method == "gdn-window":  # the state's output weighed in (it starts at 0: the window alone)
        with torch.no_grad():
            model.model.layers[0].self_attn.window_gamma.fill_(0.7)
    lens = ((30, 5, 45), (80,))  # a restart inside a 64-token chunk, one past it, and a row of one document
    docs = [[torch.randint(2, 97, (1, n), device=dev) for n in row] for row in lens]
    ids = torch.cat([torch.cat(row, 1) for row in docs])
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lens]).to(dev)
    emb = model.model.embed_tokens.weight
    out = model(ids, position_ids=pos, use_cache=False).logits
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    packed_grad, emb.grad = emb.grad.clone(), None

    def rel(a, b):
        return ((a - b).float().pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt()).item()

    for r, row in enumerate(docs):
        a = 0
        for doc in row:
            alone = model(doc, use_cache=False).logits
            assert rel(out[r:r + 1, a:a + doc.shape[1]], alone) < 1e-4, (method, r, a)
            (alone * weights[r:r + 1, a:a + doc.shape[1]]).sum().backward()
            a += doc.shape[1]
    assert rel(packed_grad, emb.grad) < 1e-4


def test_channel_gates_train_on_packed_rows_as_each_document_alone(monkeypatch, short_channel_chunks):
    """A training forward and backward of per-channel gates on the kernel: packed rows (a restart
    inside a 16-token chunk, one on a chunk's edge) give each document's own outputs and gradients,
    and the gradients of every parameter, the gates' included, are the PyTorch path's."""
    monkeypatch.setenv("LINEARIZE_KERNELS", "auto")
    torch.manual_seed(0)
    # 1 layer, 2 heads on 1 key/value head: the kernel's backward still gives dq, dk, dv and dlog_g (the
    # q/k/v projections, the gates, the feature map and the embeddings all take gradients through it)
    model = converted("llama", linearize.LinearAttentionConfig(feature_map="hedgehog", decay="channel"),
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    spread_gates(model)
    lens = ((7, 9, 21), (37,))
    docs = [[torch.randint(2, 97, (1, n)) for n in row] for row in lens]
    ids = torch.cat([torch.cat(row, 1) for row in docs])
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lens])
    out = model(ids, position_ids=pos, use_cache=False).logits
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert any("gate" in n for n in grads)

    def rel(a, b):
        return ((a - b).float().pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt()).item()

    model.zero_grad()
    for r, row in enumerate(docs):
        a = 0
        for doc in row:
            alone = model(doc, use_cache=False).logits
            assert rel(out[r:r + 1, a:a + doc.shape[1]], alone) < 1e-4, (r, a)
            (alone * weights[r:r + 1, a:a + doc.shape[1]]).sum().backward()
            a += doc.shape[1]
    for n, p in model.named_parameters():
        if n in grads:
            assert rel(grads[n], p.grad) < 1e-4, n
    model.zero_grad()
    monkeypatch.setenv("LINEARIZE_KERNELS", "torch")
    (model(ids, position_ids=pos, use_cache=False).logits * weights).sum().backward()
    for n, p in model.named_parameters():
        if n in grads:
            assert rel(grads[n], p.grad) < 1e-4, n


def test_gdn_kernel_path_matches_pytorch_path(monkeypatch):
    import linearize.gdn as gdn

    calls = []
    real = gdn._kernel_delta_rule
    monkeypatch.setattr(gdn, "_kernel_delta_rule", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    model = converted("llama", linearize.GatedDeltaNetConfig(conv_size=3, layers=[0, 2]))
    ids = torch.randint(2, 97, (2, 11))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    runs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("LINEARIZE_KERNELS", backend)
        with torch.no_grad():
            runs[backend] = (model(ids, attention_mask=mask, use_cache=False).logits,
                             model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0))
    torch.testing.assert_close(runs["triton"][0], runs["torch"][0], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(runs["triton"][1], runs["torch"][1])
    assert calls  # the kernel really ran


def test_gdn_window_kernel_path_matches_pytorch_path(monkeypatch):
    """Gated DeltaNet beside a softmax window: a left-padded prompt's window on the window kernel (the
    row's padding as a document that starts at its first real token), its decode steps on the fused
    Gated DeltaNet kernel with the window's softmax beside it, and the gradients of a packed batch on
    the kernels, all as the PyTorch path computes them."""
    import linearize.gdn as gdn

    calls, decodes, windows = [], [], []
    real, real_decode, real_window = gdn.window_softmax_attn, gdn.fused_gated_delta_decode, gdn.window_softmax_decode
    monkeypatch.setattr(gdn, "window_softmax_attn", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(gdn, "fused_gated_delta_decode", lambda *a, **kw: decodes.append(1) or real_decode(*a, **kw))
    monkeypatch.setattr(gdn, "window_softmax_decode", lambda *a, **kw: windows.append(1) or real_window(*a, **kw))
    model = converted("llama", linearize.GatedDeltaNetConfig(conv_size=3, window=4, sinks=1, layers=[0, 2]))
    ids = torch.randint(2, 97, (2, 11))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    pos = torch.cat([torch.arange(5), torch.arange(6)])[None].expand(2, -1)
    runs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("LINEARIZE_KERNELS", backend)
        with torch.no_grad():
            logits = model(ids, attention_mask=mask, use_cache=False).logits
            gen = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        model.zero_grad()
        model(ids, position_ids=pos, use_cache=False).logits.float().pow(2).mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if "window_gamma" in n or "q_proj" in n}
        runs[backend] = (logits, gen, grads)
    torch.testing.assert_close(runs["triton"][0][1, 3:], runs["torch"][0][1, 3:], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(runs["triton"][0][0], runs["torch"][0][0], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(runs["triton"][1], runs["torch"][1])
    assert sum("window_gamma" in n for n in runs["torch"][2]) == 2
    for n, g in runs["torch"][2].items():
        assert g.abs().sum() > 0, n
        torch.testing.assert_close(runs["triton"][2][n], g, atol=1e-5, rtol=1e-3)
    assert len(calls) >= 4  # the window kernel really ran: the padded forward, the prefill and the packed rows
    assert len(decodes) == 5 * 2  # each decode step (W - 1 = 3 < 5: keys leave the window) on the fused GDN kernel
    assert len(windows) == 5 * 2  # and its window on the window's decode kernel


def test_gdn_window_chunks_after_earlier_tokens_on_the_kernel_match_one_call(monkeypatch):
    """A chunked prefill of Gated DeltaNet beside a softmax window and sinks, through the static cache
    (its position a tensor, as in a captured chunk; the int position of the dynamic cache is checked
    in test_kernels_sinks.py): the chunk after the first reads the cached keys on the window kernel
    (``window_softmax_prefill``), with the cache not yet full and the sinks inside the queries'
    window, then outside it; the chunks' logits are the PyTorch path's over the whole prompt in one
    call."""
    import linearize.gdn as gdn

    calls = []
    real = gdn.window_softmax_prefill
    monkeypatch.setattr(gdn, "window_softmax_prefill", lambda *a, **kw: calls.append(kw["pos"]) or real(*a, **kw))
    model = converted("llama", linearize.GatedDeltaNetConfig(conv_size=3, window=8, sinks=2), num_hidden_layers=1)
    ids = torch.randint(2, 97, (2, 25))
    # the cache holds 5 of W - 1 = 7 keys before the second chunk, which is longer than a decode step (16
    # tokens: the prefill path); its sinks are read from p = 8
    sizes = (5, 20)
    monkeypatch.setenv("LINEARIZE_KERNELS", "torch")
    with torch.no_grad():
        whole = model(ids, use_cache=False).logits
    monkeypatch.setenv("LINEARIZE_KERNELS", "triton")
    past = linearize.StaticLinearizeCache(model.config, max_batch_size=2, max_cache_len=32)
    chunks, a = [], 0
    with torch.no_grad():
        for n in sizes:
            pos = torch.arange(a, a + n)[None].expand(2, -1)
            chunks.append(model(ids[:, a:a + n], position_ids=pos, past_key_values=past, use_cache=True,
                                cache_position=torch.arange(a, a + n)).logits)
            a += n
    torch.testing.assert_close(torch.cat(chunks, 1), whole, atol=2e-4, rtol=1e-4)
    assert len(calls) == 1 and isinstance(calls[0], torch.Tensor), calls  # the second chunk, at a tensor position


DECODE_METHODS = {  # config, and the module attribute its decode steps must call
    "hedgehog-decay": (linearize.LinearAttentionConfig(feature_map="hedgehog", decay="scalar"),
                       "linearize.kernels.linear_attn", "fused_recurrent_hedgehog"),
    "elu-decay": (linearize.LinearAttentionConfig(feature_map="elu", decay="scalar"),
                  "linearize.kernels.linear_attn", "fused_recurrent_linear_attn"),
    # conv, RoPE, norms, gates and state in one kernel (see test_kernels_gdn_decode.py)
    "gdn": (linearize.GatedDeltaNetConfig(conv_size=3), "linearize.gdn", "fused_gated_delta_decode"),
    "gdn-group": (linearize.GatedDeltaNetConfig(conv_size=3, kv_heads="group"), "linearize.gdn",
                  "fused_gated_delta_decode"),
    # Gated DeltaNet beside a window and a sink: the window's decode step in one kernel beside the fused one,
    # its buffer moved on in place (static) or on a copy (dynamic); W - 1 = 3 < 4 steps: keys leave the window
    "gdn-window": (linearize.GatedDeltaNetConfig(conv_size=3, window=4, sinks=1), "linearize.gdn",
                   "window_softmax_decode"),
    # the window hybrid: ring buffer + state advanced in place by one kernel (W - 1 = 3 < 4 steps: the ring
    # wraps); Hedgehog's features computed inside it
    "lolcats-decay": (linearize.LinearAttentionConfig(feature_map="hedgehog", window=4, decay="scalar"),
                      "linearize.kernels.linear_attn", "fused_window_decode_hedgehog"),
    "window-channel": (linearize.LinearAttentionConfig(feature_map="t2r", window=2, decay="channel"),
                       "linearize.kernels.linear_attn", "window_decode"),
}


@pytest.mark.parametrize("method", sorted(DECODE_METHODS))
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_decode_steps_run_on_the_recurrent_kernels(monkeypatch, method, cache):
    """After the prefill every decode step takes the fused recurrent kernel (on the static cache's
    own storage, or a copy of the dynamic cache's state), and the tokens equal the PyTorch path's
    (left padding included). Hedgehog layers compute their features inside that kernel."""
    import importlib

    cfg, module, name = DECODE_METHODS[method]
    mod = importlib.import_module(module)
    calls = []
    real = getattr(mod, name)
    monkeypatch.setattr(mod, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    model = converted("llama", cfg)
    ids = torch.randint(2, 97, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    kw = {"cache_implementation": "static"} if cache == "static" else {}
    runs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("LINEARIZE_KERNELS", backend)
        with torch.no_grad():
            runs[backend] = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0, **kw)
    torch.testing.assert_close(runs["triton"], runs["torch"])
    assert len(calls) == 4 * len(linearize.converted_layers(model))  # 4 decode steps after the prefill


def test_gdn_window_decode_step_moves_its_window_inside_the_kernel(monkeypatch):
    """Gated DeltaNet beside a window and a sink, decoding on the static cache: the layer's step is its
    input GEMV, the fused Gated DeltaNet kernel, the window's kernel, the output GEMV and the token count;
    the window's buffer, validity and sinks move on inside the window's kernel (a copy into the cache
    would be a kernel more in every layer's step). The tokens match the PyTorch path's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    model = converted("llama", linearize.GatedDeltaNetConfig(conv_size=3, window=4, sinks=1, layers=[1]))
    layer = model.model.layers[1].self_attn
    ops = Ops()
    layer.register_forward_pre_hook(lambda *_: ops.__enter__() and None)
    layer.register_forward_hook(lambda *_: ops.__exit__(None, None, None))
    ids = torch.randint(2, 97, (2, 9))
    tokens = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("LINEARIZE_KERNELS", backend)
        past = linearize.StaticLinearizeCache(model.config, max_batch_size=2, max_cache_len=32)
        with torch.no_grad():
            steps = [model(ids, past_key_values=past, use_cache=True).logits[:, -1:].argmax(-1)]
            for i in range(4):  # W - 1 = 3 < 4 steps: keys leave the window
                ops.seen.clear()
                logits = model(steps[-1], past_key_values=past, use_cache=True, cache_position=torch.tensor([9 + i]))
                steps.append(logits.logits[:, -1:].argmax(-1))
        tokens[backend] = torch.cat(steps, 1)
    views = ("view", "reshape", "expand", "slice", "select", "squeeze", "transpose", "detach", "alias", "as_strided",
             "split", "t.default")
    heavy = sorted(o for o in ops.seen if not any(v in o for v in views))  # the triton run's last step
    assert heavy == sorted(["linearize.decode_linear.default", "linearize.decode_linear.default",
                            "linearize.gated_delta_decode.default", "linearize.window_softmax_decode.default",
                            "aten.add_.Tensor"]), heavy
    torch.testing.assert_close(tokens["triton"], tokens["torch"])


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_window_chunked_prefill_runs_on_the_kernels(monkeypatch, cache):
    """A prompt fed in chunks (each after the first continues from the ring and the state) runs
    window_prefill, not the PyTorch math, and gives the PyTorch path's logits and the one-call logits."""
    import linearize.kernels.linear_attn as la

    calls = []
    real = la.window_prefill
    monkeypatch.setattr(la, "window_prefill", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    cfg = linearize.LinearAttentionConfig(feature_map="hedgehog", window=5, decay="scalar", layers=[0, 2])
    model = converted("llama", cfg)
    with torch.no_grad():
        for i in (0, 2):
            model.model.layers[i].self_attn.window_log_gamma.copy_(torch.tensor([-1.0, 0.0, 0.5, 1.0]))
    ids = torch.randint(2, 97, (2, 47))
    runs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("LINEARIZE_KERNELS", backend)
        pkv = (linearize.StaticLinearizeCache(model.config, 2, 64) if cache == "static"
               else linearize.LinearizeCache(model.config))
        with torch.no_grad():
            chunks = [model(ids[:, a:b], past_key_values=pkv, use_cache=True).logits for a, b in ((0, 3), (3, 24), (24, 47))]
        runs[backend] = torch.cat(chunks, 1)
    assert len(calls) == 2 * 2  # two chunks from a state x two converted layers, on the triton run
    torch.testing.assert_close(runs["triton"], runs["torch"], atol=2e-4, rtol=1e-4)
    with torch.no_grad():
        whole = model(ids, use_cache=False).logits
    torch.testing.assert_close(runs["triton"], whole, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("decay,dtype,cache", [  # every pair of the three choices once, in 4 cases instead of 8
    (None, torch.float32, "dynamic"), (None, torch.bfloat16, "static"),
    ("scalar", torch.float32, "static"), ("scalar", torch.bfloat16, "dynamic")])
def test_fused_window_decode_matches_the_unfused_kernel_path(monkeypatch, decay, dtype, cache):
    """A LoLCATs layer's decode step on one fused kernel (Hedgehog features inside, GQA as an index:
    4 query heads on 2 kv heads) gives the unfused kernel path's logits, and leaves the same state and
    ring in the cache, over decode steps after a left-padded prefill (W - 1 = 3 < 6 steps: the ring wraps)."""
    import linearize.layers as layers

    cfg = linearize.LinearAttentionConfig(feature_map="hedgehog", window=4, decay=decay, layers=[0, 2])
    model = converted("llama", cfg).to(dtype)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # per-head window weights away from 1, gates that differ per token and head
        for i in (0, 2):
            attn = model.model.layers[i].self_attn
            attn.window_log_gamma.copy_(torch.tensor([-1.0, 0.0, 0.5, 1.0]))
            if decay:
                attn.gate.weight.copy_(torch.randn(attn.gate.weight.shape, generator=g) * 0.3)
                attn.gate.bias.fill_(1.0)
    ids = torch.randint(2, 97, (2, 9), generator=g)
    steps = torch.randint(2, 97, (2, 6), generator=g)
    monkeypatch.setenv("LINEARIZE_KERNELS", "triton")
    calls = {"fused": 0, "unfused": 0}
    for name, key in (("hedgehog_window_decode", "fused"), ("window_decode", "unfused")):
        def counted(*a, _real=getattr(layers, name), _key=key, **kw):
            calls[_key] += 1
            return _real(*a, **kw)
        monkeypatch.setattr(layers, name, counted)

    def run(fused):
        if not fused:
            monkeypatch.setattr(layers.LinearAttention, "_fused_decode", lambda self, q, stored, state_layer: False)
        return decode_after_padded_prefill(model, ids, steps, cache, (0, 2))

    fused_logits, fused_states = run(True)
    assert calls == {"fused": 2 * 6, "unfused": 0}
    logits, states = run(False)
    assert calls == {"fused": 2 * 6, "unfused": 2 * 6}

    def close(a, b, msg):
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=msg)
        else:  # bf16 noise over 3 layers x 6 steps (the interpreter's bf16 stores truncate: ~1.5% here)
            a, b = a.double(), b.double()
            assert ((a - b).norm() / b.norm().clamp_min(1e-12)).item() < 3e-2, msg

    close(fused_logits, logits, "logits")
    for fused_state, state in zip(fused_states, states):
        assert fused_state.keys() == state.keys() == set(linearize.cache.STATE_NAMES)
        for n in state:
            assert fused_state[n].dtype == state[n].dtype, n
            close(fused_state[n].float(), state[n].float(), n)


@pytest.mark.parametrize("window,cache", [(0, "static"), (4, "dynamic")])
def test_channel_gate_decode_steps_run_the_fused_hedgehog_kernel(monkeypatch, window, cache):
    """A decay="channel" Hedgehog layer's decode steps run the fused kernel (recurrent step, or the
    window hybrid's with its ring: W - 1 = 3 slots, the ring wraps), one launch per step, and give the PyTorch path's
    logits and cached state, and the logits of the whole sequence in one call. The prompt runs on
    the PyTorch math (the per-channel chunk kernel is slow under the interpreter and tested apart);
    the gates are spread, so a kernel that misread them would change the logits."""
    import linearize.layers as layers

    cfg = linearize.LinearAttentionConfig(feature_map="hedgehog", decay="channel", window=window, layers=[1])
    model = converted("llama", cfg)
    spread_gates(model)
    g = torch.Generator().manual_seed(7)
    ids, steps = torch.randint(2, 97, (2, 7), generator=g), torch.randint(2, 97, (2, 3), generator=g)
    name = "hedgehog_window_decode" if window else "hedgehog_decode"
    seen = []
    real = getattr(layers, name)
    def counted(*a, **kw):  # hedgehog_decode takes log_g as its 6th argument, the window step by name
        seen.append(tuple(kw["log_g"].shape if "log_g" in kw else a[5].shape))
        return real(*a, **kw)

    monkeypatch.setattr(layers, name, counted)

    def run(decode_backend):  # the prompt on the PyTorch math, the steps on decode_backend
        monkeypatch.setenv("LINEARIZE_KERNELS", "torch")
        logits, (state,) = decode_after_padded_prefill(
            model, ids, steps, cache, [1], before_decode=lambda: monkeypatch.setenv("LINEARIZE_KERNELS", decode_backend))
        return logits, state

    fused_logits, fused_states = run("triton")
    F = model.model.layers[1].self_attn.feature_dim
    assert seen == [(2, 1, 4, F)] * steps.shape[1]  # the fused kernel, with the (B, T, H, F) gate
    seen.clear()
    logits, state = run("torch")
    assert not seen
    torch.testing.assert_close(fused_logits, logits, atol=1e-4, rtol=1e-4)
    assert fused_states.keys() == state.keys()
    for n in state:  # (S, z), and the window's ring
        torch.testing.assert_close(fused_states[n].float(), state[n].float(), atol=1e-5, rtol=1e-4, msg=n)
    mask = torch.ones(2, ids.shape[1] + steps.shape[1], dtype=ids.dtype)
    mask[1, :2] = 0  # decode_after_padded_prefill's padding
    with torch.no_grad():
        whole = model(torch.cat([ids, steps], 1), attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(fused_logits, whole[:, ids.shape[1]:], atol=1e-4, rtol=1e-4)


# both caches for llama, with and without the window; the other layouts on the static cache only: the
# cache decides where the state is stored, not how q and k are rotated (both caches' decode steps are
# tested on the kernels in test_decode_steps_run_on_the_recurrent_kernels and
# test_fused_window_decode_matches_the_unfused_kernel_path)
@pytest.mark.parametrize("arch,window,cache", [
    ("llama", 0, "dynamic"), ("llama", 0, "static"), ("llama", 4, "dynamic"), ("llama", 4, "static"),
    ("gpt_neox", 0, "static"), ("phi3", 0, "static"), ("smollm3", 0, "static"), ("gpt_neox", 3, "static")])
def test_hedgehog_decode_rotates_q_and_k_inside_the_kernel(monkeypatch, arch, window, cache):
    """A Hedgehog decode step hands the kernel q, k and v as views of the fused projection output,
    before RoPE, with cos and sin: the same logits, state (and window ring) as the layer's own RoPE
    followed by the kernel, for separate q/k/v (llama), per-head fused qkv with partial rotary
    (gpt_neox), fused [q|k|v] (phi3) and NoPE layers (smollm3: the tiny config leaves RoPE out of
    layer 1), with and without the softmax window (LoLCATs: the ring keeps rotated keys). The prompt
    runs on the PyTorch math (the same for both runs; the chunk kernels are tested apart): only the
    decode steps are under test."""
    import linearize.layers as layers

    # 2 layers: the decode steps' second layer reads the first's output, and smollm3 still has a RoPE
    # layer 0 and a NoPE layer 1 (no_rope_layer_interval=2)
    model = converted(arch, linearize.LinearAttentionConfig(feature_map="hedgehog", decay="scalar", window=window),
                      num_hidden_layers=2)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # feature maps and gates away from their start, so RoPE changes the features
        for name, p in model.named_parameters():
            if "feature_map" in name or ".gate." in name:
                p.add_(0.5 * torch.randn(p.shape, generator=g))
    ids = torch.randint(2, 97, (2, 7), generator=g)
    steps = torch.randint(2, 97, (2, 4), generator=g)
    seen = []
    name = "hedgehog_window_decode" if window else "hedgehog_decode"
    real = getattr(layers, name)
    monkeypatch.setattr(layers, name, lambda *a, **kw: seen.append(kw.get("cos") is not None) or real(*a, **kw))

    def run(in_kernel):
        if not in_kernel:
            monkeypatch.setattr(layers.LinearAttention, "_rope_in_kernel", lambda self, pre, pe: None)
        monkeypatch.setenv("LINEARIZE_KERNELS", "torch")  # the prompt on the PyTorch math, the steps on the kernels
        return decode_after_padded_prefill(model, ids, steps, cache, range(model.config.num_hidden_layers),
                                           before_decode=lambda: monkeypatch.setenv("LINEARIZE_KERNELS", "triton"))

    fused_logits, fused_states = run(True)
    n_layers = model.config.num_hidden_layers
    assert len(seen) == n_layers * steps.shape[1]
    if arch != "smollm3":
        assert all(seen)  # every step's layers took cos and sin into the kernel
    else:
        assert any(seen) and not all(seen)  # NoPE layers: the raw views, no rotation
    seen.clear()
    layer_logits, layer_states = run(False)
    assert not any(seen) and len(seen) == n_layers * steps.shape[1]
    torch.testing.assert_close(fused_logits, layer_logits, atol=1e-4, rtol=1e-4)
    for a, b in zip(fused_states, layer_states):
        for n in a:
            torch.testing.assert_close(a[n], b[n], atol=1e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize("arch,window", [("llama", 0), ("phi3", 0), ("gpt_neox", 0), ("smollm3", 0), ("phi3", 4)])
def test_gdn_fused_prefill_equals_the_unfused_kernel_path(monkeypatch, arch, window):
    """The prefill glue kernels (kernels/gated_delta/prefill.py) give the unfused layer's logits and
    cache: fused q|k|v (phi3), per-head layout and partial rotary (gpt_neox), a NoPE layer (smollm3),
    left padding, a prompt shorter than the conv, and a second call continuing the cache (chunked
    prefill: the conv reads its cache), and a softmax window beside the layer (its keys from the fused
    GEMM's columns, cached beside the state). The reference is the PyTorch path: the unfused kernel path
    equals it at this tolerance (test_gdn_kernel_path_matches_pytorch_path), and it runs no chunk kernel."""
    import linearize.gdn as gdn

    # 1 layer: each layout is a property of every layer alike, and the first layer's prologue already
    # reads its conv cache and carries RoPE; smollm3 keeps 2, as layer 1 is its NoPE layer
    # (no_rope_layer_interval=2), so both a RoPE and a NoPE layer run
    model = converted(arch, linearize.GatedDeltaNetConfig(conv_size=4, window=window), initializer_range=0.2,
                      num_hidden_layers=2 if arch == "smollm3" else 1)
    with torch.no_grad():  # gates, conv and norm away from their identity initialisation
        for layer in model.modules():
            if isinstance(layer, gdn.GatedDeltaNet):
                layer.conv.weight.normal_(0, 0.5)
                layer.o_gate.weight.normal_(0, 0.2)
                layer.a_proj.weight.normal_(0, 0.2)
                layer.b_proj.weight.normal_(0, 0.2)
                layer.o_norm_mix.uniform_(0.2, 0.9)
                layer.o_norm_weight.uniform_(0.5, 1.5)
    calls = []
    real = gdn.gdn_prefill_prologue
    monkeypatch.setattr(gdn, "gdn_prefill_prologue", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    ids = torch.randint(2, 97, (2, 13))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0

    def run():
        out = []
        with torch.no_grad():
            for cut in (13, 2):  # one call; a 2-token prompt (shorter than the conv), then the rest
                cache = linearize.LinearizeCache(model.config)
                a = model(ids[:, :cut], attention_mask=mask[:, :cut], past_key_values=cache, use_cache=True).logits
                parts = [a]
                if cut < 13:
                    parts.append(model(ids[:, cut:], attention_mask=mask, past_key_values=cache, use_cache=True).logits)
                states = [{**(layer.read() or {}), "conv": layer.conv_states[0].clone()} for layer in cache.layers
                          if hasattr(layer, "read")]
                assert states
                out.append((torch.cat(parts, 1), states))
        return out

    fused = run()
    # both prompts (13 and 2 tokens) in every layer; the 11-token continuation is short enough for the
    # fused decode step (DECODE_TOKENS), which the PyTorch reference now checks too
    n_fused = len(calls)
    assert n_fused >= 2 * model.config.num_hidden_layers, "the fused prefill did not run in every layer"
    monkeypatch.setenv("LINEARIZE_KERNELS", "torch")
    plain = run()
    assert len(calls) == n_fused  # the reference ran none of the prefill kernels
    for (lf, cf), (lp, cp) in zip(fused, plain):
        torch.testing.assert_close(lf, lp, atol=2e-4, rtol=1e-4)
        for a, b in zip(cf, cp):
            for name in a:
                if a[name] is not None:
                    torch.testing.assert_close(a[name], b[name], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("arch,cfg", [
    ("llama", linearize.LinearAttentionConfig(feature_map="hedgehog", window=3)),
    ("smollm3", linearize.LinearAttentionConfig(feature_map="hedgehog")),
    ("llama", linearize.GatedDeltaNetConfig()),
    ("gpt_neox", linearize.LinearAttentionConfig(feature_map="hedgehog")),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_projections_run_on_the_gemvs(monkeypatch, arch, cfg, dtype):
    """A decode step takes the decode GEMVs for the fused input projection, the output projection
    and (a gated SiLU MLP) silu(gate) * up and down, and gives the tokens and logits of the same
    model with cuBLAS-style F.linear everywhere; the prefill (more rows than a GEMV takes) does not."""
    import linearize.attention as att
    from linearize.kernels import decode_linear as gemv

    calls = {"linear": 0, "gated": 0}
    for name in calls:
        real = getattr(gemv, f"decode_{name}")
        monkeypatch.setattr(gemv, f"decode_{name}",
                            lambda *a, _n=name, _r=real, **k: calls.__setitem__(_n, calls[_n] + 1) or _r(*a, **k))
    monkeypatch.setenv("LINEARIZE_KERNELS", "triton")
    # 2 layers: the GEMVs are the same in every layer; a second one takes the first one's output (and
    # smollm3 keeps its NoPE layer 1). The counts below scale with n_layers
    model = converted(arch, cfg, num_hidden_layers=2).to(dtype)
    n_layers = model.config.num_hidden_layers
    ids = torch.randint(2, 97, (2, 20))
    runs = {}
    for gemvs in (True, False):
        if not gemvs:
            monkeypatch.setattr(att, "_few_rows", lambda x, w: False)
        for k in calls:
            calls[k] = 0
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True,
                                 return_dict_in_generate=True)
        runs[gemvs] = (out.sequences, torch.stack(out.logits), dict(calls))
    got, want = runs[True], runs[False]
    gated = arch != "gpt_neox"  # GPT-NeoX's MLP is ungated GELU: left to itself (its row's mlp=None)
    # 3 decode steps after the prefill: in each layer the fused in-projection and out_proj (+ down)
    assert got[2]["linear"] == 3 * n_layers * (2 + gated), got[2]
    assert got[2]["gated"] == (3 * n_layers if gated else 0), got[2]
    assert want[2] == {"linear": 0, "gated": 0}
    # logits[0] come from the prefill (20 rows: F.linear both ways), logits[1] from the first decode
    # step on the same prefix; in bf16 later steps may take another token at a near tie (the fused
    # silu(gate) * up rounds once where F.linear and the eager MLP round three times)
    assert torch.equal(got[1][0], want[1][0])
    steps = slice(None) if dtype == torch.float32 else slice(1, 2)
    if dtype == torch.float32:
        torch.testing.assert_close(got[0], want[0])
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    diff = (got[1][steps].float() - want[1][steps].float()).abs().max() / want[1][steps].float().abs().max()
    assert 0 < float(diff) < tol if dtype == torch.bfloat16 else float(diff) < tol


def test_decode_mlps_are_installed_once_and_removed():
    from linearize.modeling_linearize import install_decode_mlps

    model = converted("llama", linearize.LinearAttentionConfig(feature_map="hedgehog"))
    mlps = [b.mlp for b in model.model.layers]
    assert all("forward" in vars(m) for m in mlps)
    assert install_decode_mlps(model) == 0  # already routed
    keys = set(model.state_dict())
    assert not any("forward" in k for k in keys)
    linearize.unlinearize(model)
    assert not any("forward" in vars(m) for m in mlps)
    neox = converted("gpt_neox", linearize.LinearAttentionConfig(feature_map="hedgehog"))
    assert not any("forward" in vars(b.mlp) for b in neox.gpt_neox.layers)
