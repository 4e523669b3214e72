"""Surgery on every supported architecture: weights reused, config recorded, cache == full
forward, save/load round trip, hybrids, errors."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

import linearize
from linearize.arch import ARCHITECTURES
from linearize.cache import CACHE_KWARG
from linearize.layers import LinearAttention

from conftest import ARCH_CONFIGS, attention, converted, default_converted_layers, tiny_model

ARCHS = sorted(ARCH_CONFIGS)

# every layer type the method config can produce
VARIANTS = {
    "hedgehog": linearize.LinearAttentionConfig(feature_map="hedgehog"),
    "t2r-scalar-decay": linearize.LinearAttentionConfig(feature_map="t2r", decay="scalar"),
    "elu-window4": linearize.LinearAttentionConfig(feature_map="elu", window=4),
    "relu-channel-decay": linearize.LinearAttentionConfig(feature_map="relu", decay="channel"),
    "performer-window3-scalar": linearize.LinearAttentionConfig(feature_map="performer", window=3, decay="scalar"),
    "hybrid-layers-0-2": linearize.LinearAttentionConfig(feature_map="hedgehog", layers=[0, 2], window=2),
    "gdn-expand-conv4": linearize.GatedDeltaNetConfig(conv_size=4),
    "gdn-group-noconv-hybrid": linearize.GatedDeltaNetConfig(kv_heads="group", conv_size=0, layers=[1, 2], use_rope=False),
    "gdn-window3-sinks1": linearize.GatedDeltaNetConfig(conv_size=3, window=3, sinks=1),
}


def test_every_architecture_in_table_is_tested():
    assert set(ARCHITECTURES) == set(ARCH_CONFIGS)


@pytest.mark.parametrize("arch", ARCHS)
def test_surgery_reuses_weights_and_records_config(arch):
    model = tiny_model(arch)
    ids = torch.randint(2, 97, (2, 10))
    before = model(ids).logits
    layers = default_converted_layers(arch)
    originals = [attention(model, i) for i in range(3)]
    proj_names = ARCHITECTURES[arch].projections
    ptrs = {n: getattr(originals[1], n).weight.data_ptr() for n in proj_names}
    n_params = sum(p.numel() for p in model.parameters())

    linearize.linearize(model, linearize.LinearAttentionConfig(feature_map="hedgehog"))
    new1 = attention(model, 1)
    assert isinstance(new1, LinearAttention)
    assert new1.original is originals[1]
    for n in proj_names:  # by reference, not copied
        assert getattr(new1, n).weight.data_ptr() == ptrs[n]
    for i in range(3):  # a mixed local/global model keeps its local layers as they were
        assert (attention(model, i) is originals[i]) == (i not in layers)
    added = sum(p.numel() for p in model.parameters()) - n_params
    assert 0 < added < n_params  # only the feature maps
    assert model.config.model_type == f"linearize_{arch}"
    assert model.config.linearize["layers"] == layers
    assert model.config.linearize.get("softmax_layers", []) == [i for i in range(3) if i not in layers]
    assert model.config.linearize["feature_map"] == "hedgehog"
    after = model(ids).logits
    assert torch.isfinite(after).all()
    assert (after - before).abs().max() > 1e-2  # the attention really changed

    linearize.unlinearize(model)
    torch.testing.assert_close(model(ids).logits, before)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("arch", ARCHS)
def test_step_by_step_cache_equals_full_forward(arch, variant):
    """mamba-style: feed tokens one at a time (and in uneven chunks) through the cache; logits must
    reproduce the full, cache-free forward."""
    # float64: a cache that carries the right state reproduces the full forward to rounding, where
    # float32 rounding alone, amplified by a tiny random model, reached 5e-4 (olmo2's gdn hybrid on
    # transformers 5.24); the q/k RMSNorms of qwen3 / olmo2 still round through float32 inside.
    # The MoE rows stay float32 (transformers' grouped expert GEMM takes no float64).
    moe = arch in ("mixtral", "qwen3_moe")
    model = converted(arch, VARIANTS[variant]).to(torch.float32 if moe else torch.float64)
    tol = dict(atol=2e-4, rtol=1e-4) if moe else dict(atol=1e-4, rtol=1e-5)
    ids = torch.randint(2, 97, (2, 11))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = linearize.LinearizeCache(model.config)
        # the installed transformers' own keyword (`cache` from 5.24) here, the old name below
        steps = [model(ids[:, t : t + 1], **{CACHE_KWARG: cache}, use_cache=True).logits for t in range(11)]
        torch.testing.assert_close(torch.cat(steps, 1), full, **tol)
        cache = linearize.LinearizeCache(model.config)
        chunks = [model(ids[:, a:b], past_key_values=cache, use_cache=True).logits for a, b in [(0, 5), (5, 6), (6, 11)]]
        torch.testing.assert_close(torch.cat(chunks, 1), full, **tol)


def test_hybrid_keeps_softmax_layers():
    model = tiny_model("llama")
    attn1 = model.model.layers[1].self_attn
    linearize.linearize(model, linearize.LinearAttentionConfig(layers=[0, 2]))
    assert model.model.layers[1].self_attn is attn1
    assert isinstance(model.model.layers[0].self_attn, LinearAttention)
    cache = linearize.LinearizeCache(model.config)
    assert [type(l).__name__ for l in cache.layers] == ["LinearAttentionState", "DynamicLayer", "LinearAttentionState"]


@pytest.mark.parametrize("arch", ARCHS)
def test_save_load_round_trip(arch, tmp_path):
    cfg = linearize.LinearAttentionConfig(feature_map="performer", decay="scalar", window=2, layers=[0, 1])
    model = converted(arch, cfg)
    ids = torch.randint(2, 97, (1, 9))
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["linearize"]["feature_map"] == "performer" and saved["linearize"]["layers"] == [0, 1]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded).__name__ == type(model).__name__
    # the performer's random matrix travels with the checkpoint
    torch.testing.assert_close(attention(loaded, 0).feature_map_q.projection, attention(model, 0).feature_map_q.projection)
    with torch.no_grad():
        # not bitwise: loaded weights sit at other (mmap) alignments, which can move CPU matmuls by an ulp
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=2e-6, rtol=1e-5)


# -- the low-rank decay gate (gate_rank) -------------------------------------------------------------


def _gate_size(model) -> int:
    return sum(p.numel() for i in range(3) for n, p in attention(model, i).named_parameters() if n.startswith("gate"))


def test_low_rank_gate_size_and_start():
    """gate_rank r: hidden -> r -> width in place of hidden -> width; it starts where the full gate
    does, logsigmoid(6) for every head and channel, whatever the input."""
    full = converted("llama", linearize.LinearAttentionConfig(decay="channel"))
    low = converted("llama", linearize.LinearAttentionConfig(decay="channel", gate_rank=16))
    hidden, width = 64, 4 * 32  # TINY: 4 heads, hedgehog F = 2 x head_dim 16
    assert _gate_size(full) == 3 * (hidden * width + width)
    assert _gate_size(low) == 3 * (hidden * 16 + 16 * width + width)
    n_params = [sum(p.numel() for p in m.parameters()) for m in (full, low)]
    assert n_params[0] - n_params[1] == _gate_size(full) - _gate_size(low)
    layer = attention(low, 0)
    assert not hasattr(layer, "gate") and layer.gate_in.bias is None
    assert layer.decode_projection_names()[-1] == "gate_in"  # the first factor rides the fused GEMM
    from linearize.recipes.distill import new_parameter_names, stage2_parameter_names

    ours = {"model.layers.0.self_attn." + n for n in ("gate_in.weight", "gate_out.weight", "gate_out.bias")}
    assert ours <= set(new_parameter_names(low)) and ours <= set(stage2_parameter_names(low, "attention"))
    x = torch.randn(2, 5, hidden)
    start = torch.nn.functional.logsigmoid(torch.tensor(6.0))
    for m in (full, low):
        log_g = attention(m, 1).log_gate(x)
        assert log_g.shape == (2, 5, 4, 32)
        torch.testing.assert_close(log_g, start.expand_as(log_g).contiguous())


def test_low_rank_gate_trains_like_the_full_one():
    """At init the two gates are the same constant: the same logits and the same gradient at the gate's
    output (bias), the second factor's weight gradient the full one's seen through the first factor;
    the first factor gets none until the second moves, then does."""
    ids = torch.randint(2, 97, (2, 12))
    full = converted("llama", linearize.LinearAttentionConfig(decay="channel")).train()
    low = converted("llama", linearize.LinearAttentionConfig(decay="channel", gate_rank=8)).train()
    out_full, out_low = full(ids).logits, low(ids).logits
    torch.testing.assert_close(out_low, out_full)
    out_full.square().mean().backward()
    out_low.square().mean().backward()
    for i in range(3):
        f, l = attention(full, i), attention(low, i)
        assert l.gate_out.bias.grad.abs().max() > 0
        torch.testing.assert_close(l.gate_out.bias.grad, f.gate.bias.grad)
        torch.testing.assert_close(l.gate_out.weight.grad, f.gate.weight.grad @ l.gate_in.weight.T)
        assert torch.count_nonzero(l.gate_in.weight.grad) == 0  # the second factor is still zero
    opt = torch.optim.Adam([p for n, p in low.named_parameters() if ".gate_" in n], lr=1e-2)
    opt.step()
    opt.zero_grad()
    low(ids).logits.square().mean().backward()
    for i in range(3):
        assert attention(low, i).gate_in.weight.grad.abs().max() > 0


def off_start_fused_cache_and_round_trip(cfg, moved: str, field: str, tmp_path):
    """A float64 model of ``cfg`` with the parameters named ``*moved*`` random (off their start): the
    cache-free forward without gradients (the fused projection) equals the one with gradients (each
    Linear apart) and the cache's token by token; the checkpoint records ``field`` and loads with the
    same logits. Returns the model, the loaded one, the ids and the fused logits."""
    model = converted("llama", cfg).double()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if moved in n:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)
    ids = torch.randint(2, 97, (2, 9))
    with torch.no_grad():
        fused = model(ids, use_cache=False).logits
        assert attention(model, 0)._decode_weight is not None  # the fused path ran
        cache = linearize.LinearizeCache(model.config)
        steps = torch.cat([model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(9)], 1)
    plain = model(ids, use_cache=False).logits.detach()  # gradients on: no fused projection
    torch.testing.assert_close(fused, plain)
    torch.testing.assert_close(steps, plain, atol=1e-4, rtol=1e-5)  # the cache keeps its state in float32
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["linearize"][field] == getattr(cfg, field)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, fused)
    return model, loaded, ids, fused


def test_low_rank_gate_cache_fused_and_round_trip(tmp_path):
    """Off its start (random factors), the first factor in the fused projection: fused == unfused ==
    the cache token by token, and the checkpoint records gate_rank and loads the two factors."""
    cfg = linearize.LinearAttentionConfig(feature_map="elu", decay="channel", gate_rank=4, layers=[0, 2])
    _, loaded, _, _ = off_start_fused_cache_and_round_trip(cfg, ".gate_", "gate_rank", tmp_path)
    assert attention(loaded, 2).gate_rank == 4 and attention(loaded, 2).gate_out.weight.dtype == torch.float64


# -- the short conv of feature-map layers (conv_size) -------------------------------------------------


def test_short_conv_starts_as_identity_then_continues_in_cache_packing_and_checkpoint(tmp_path):
    """conv_size 4: at init the model computes what it did without the conv. Off its start (random
    taps), the cache continues a prompt token by token and in chunks as the full forward does (the
    conv state rides in the cache), packed documents do not see each other's tokens, the taps get
    gradients and count as new parameters, and the checkpoint records the width and loads the same."""
    from linearize.recipes.distill import new_parameter_names

    ids = torch.randint(2, 97, (2, 11))
    plain = converted("llama", linearize.LinearAttentionConfig(decay="scalar"))
    model = converted("llama", linearize.LinearAttentionConfig(decay="scalar", conv_size=4))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits)
    model = model.double()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("conv.weight"):
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)
        full = model(ids, use_cache=False).logits
        assert (full - plain.double()(ids).logits).abs().max() > 1  # the taps matter
        cache = linearize.LinearizeCache(model.config)
        steps = torch.cat([model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(11)], 1)
        cache = linearize.LinearizeCache(model.config)
        chunks = torch.cat([model(ids[:, a:b], past_key_values=cache, use_cache=True).logits
                            for a, b in ((0, 2), (2, 7), (7, 8), (8, 11))], 1)
        pos = torch.cat([torch.arange(5), torch.arange(6)])[None].expand(2, 11)
        packed = model(ids, position_ids=pos, use_cache=False).logits
        apart = torch.cat([model(ids[:, :5], use_cache=False).logits, model(ids[:, 5:], use_cache=False).logits], 1)
    torch.testing.assert_close(steps, full, atol=1e-4, rtol=1e-5)  # the cache keeps its state in float32
    torch.testing.assert_close(chunks, full, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(packed, apart, atol=1e-4, rtol=1e-5)
    model(ids, use_cache=False).logits.square().mean().backward()
    assert attention(model, 0).conv.weight.grad.abs().max() > 0
    assert "model.layers.0.self_attn.conv.weight" in new_parameter_names(model)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["linearize"]["conv_size"] == 4
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, full)


def test_performer_matrix_is_not_redrawn(tmp_path):
    """Loading must use the saved random features, not the seed: change the saved seed and the
    logits must still match."""
    model = converted("llama", linearize.LinearAttentionConfig(feature_map="performer"))
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["linearize"]["seed"] = 1234
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(2, 97, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_unsupported_architecture_names_the_supported_ones():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="supported architectures: gemma2, gemma3_text, gpt_neox, granite, llama, mistral, "
                                         "mixtral, olmo2, phi3, qwen2, qwen3, qwen3_moe, smollm3"):
        linearize.linearize(model, linearize.LinearAttentionConfig())


def test_bad_layer_index_and_double_conversion():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="model has 3 layers"):
        linearize.linearize(model, linearize.LinearAttentionConfig(layers=[5]))
    linearize.linearize(model, linearize.LinearAttentionConfig())
    with pytest.raises(ValueError, match="already converted"):
        linearize.linearize(model, linearize.LinearAttentionConfig())


def test_wrong_cache_gets_a_clear_error():
    from transformers import DynamicCache

    model = converted("llama")
    with pytest.raises(TypeError, match="LinearizeCache"):
        model(torch.randint(2, 97, (1, 4)), past_key_values=DynamicCache(config=model.config), use_cache=True)


@pytest.mark.parametrize("fm", ["hedgehog", "t2r", "elu", "relu", "performer"])
def test_fresh_conversion_is_finite_in_bf16_on_long_input(fm):
    """A freshly converted model in bf16 on a few thousand tokens: no NaN/inf anywhere."""
    model = tiny_model("llama", num_hidden_layers=2, max_position_embeddings=4096).to(torch.bfloat16)
    linearize.linearize(model, linearize.LinearAttentionConfig(feature_map=fm, chunk_size=256))
    ids = torch.randint(2, 97, (1, 3000))
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", ["llama", "gemma2", "phi3"])
def test_softmax_mode_is_the_original_and_transfer_records_mse(arch):
    original = tiny_model(arch)
    ids = torch.randint(2, 97, (2, 10))
    with torch.no_grad():
        teacher = original(ids).logits
    model = linearize.linearize(original, linearize.LinearAttentionConfig(window=2))
    with torch.no_grad(), linearize.attention_mode(model, "softmax"):
        torch.testing.assert_close(model(ids, use_cache=False).logits, teacher)
    with linearize.attention_mode(model, "transfer") as layers:
        out = model(ids, use_cache=False).logits
        torch.testing.assert_close(out, teacher)  # the teacher's outputs flow on
        losses = [m.transfer_loss for m in layers]
    assert all(l.item() > 0 and l.requires_grad for l in losses)
    sum(losses).backward()
    first = attention(model, model.config.linearize["layers"][0])
    fm = first.feature_map_q.weight
    assert fm.grad is not None and fm.grad.abs().sum() > 0
    assert first.mode == "linear"  # restored


@pytest.mark.parametrize("config", [linearize.LinearAttentionConfig(window=2, decay="channel"),
                                    linearize.GatedDeltaNetConfig(conv_size=2)], ids=["window-channel", "gdn"])
def test_record_then_joint_mode_records_mse_to_the_teachers_attention_output(config):
    """Stage 2 with --transfer-weight: "record" runs the teacher and keeps each layer's softmax output;
    "joint" then computes what "linear" computes, each layer recording MSE(its output on its own input,
    the kept teacher output), which leaves with the context. "joint" without a record is refused."""
    original = tiny_model("llama")
    ids = torch.randint(2, 97, (2, 12))
    with torch.no_grad():
        teacher = original(ids).logits
    model = linearize.linearize(original, config)
    with torch.no_grad():
        student = model(ids, use_cache=False).logits
    with pytest.raises(ValueError, match="run the teacher in 'record' mode first"), linearize.attention_mode(model, "joint"):
        model(ids, use_cache=False)
    with torch.no_grad(), linearize.attention_mode(model, "record") as layers:
        torch.testing.assert_close(model(ids, use_cache=False).logits, teacher)  # the teacher's outputs flow on
    kept = [m.attention_target for m in layers]
    # the last layer's record: the softmax output on the teacher's own input
    seen = {}
    last = layers[-1]
    hook = last.register_forward_pre_hook(lambda m, a, kw: seen.update(args=a, kwargs=dict(kw)), with_kwargs=True)
    with torch.no_grad(), linearize.attention_mode(model, "softmax"):
        model(ids, use_cache=False)
        torch.testing.assert_close(kept[-1], last(*seen["args"], **seen["kwargs"])[0])
    with linearize.attention_mode(model, "joint") as layers:
        joint = model(ids, use_cache=False).logits
        losses = [m.transfer_loss for m in layers]
    hook.remove()
    torch.testing.assert_close(joint, student)  # its own output flows on
    assert all(l.requires_grad for l in losses) and last.mode == "linear"
    assert not any(hasattr(m, n) for m in layers for n in ("attention_target", "transfer_loss"))
    with torch.no_grad():  # the last layer's output on the student's input (what joint saw) against the record
        own = last(*seen["args"], **seen["kwargs"])[0]
    expected = torch.nn.functional.mse_loss(own.float(), kept[-1].float())
    assert expected > 1e-4
    torch.testing.assert_close(losses[-1].detach(), expected)
    with torch.no_grad(), linearize.attention_mode(model, "transfer") as layers:
        model(ids, use_cache=False)
        same_input = [m.transfer_loss for m in layers]
    torch.testing.assert_close(losses[0].detach(), same_input[0])  # the same embeddings go in
    assert not torch.allclose(losses[-1].detach(), same_input[-1], rtol=1e-3)


@pytest.mark.parametrize("variant", ["hedgehog", "elu-window4", "relu-channel-decay", "gdn-expand-conv4",
                                     "gdn-window3-sinks1"])
def test_packed_documents_do_not_attend_across_boundaries(variant):
    """Rows packing several documents (position ids restart) equal each document alone, and the
    gradient reaches the new parameters (rows: [7 | 5] and [3 | 4 | 5])."""
    model = converted("llama", VARIANTS[variant])
    docs = [torch.randint(2, 97, (1, n)) for n in (7, 5, 3, 4, 5)]
    packed = torch.cat([torch.cat(docs[:2], 1), torch.cat(docs[2:], 1)])
    pos = torch.stack([torch.cat([torch.arange(7), torch.arange(5)]),
                       torch.cat([torch.arange(3), torch.arange(4), torch.arange(5)])])
    out = model(packed, position_ids=pos, use_cache=False).logits
    with torch.no_grad():
        for row, offsets, parts in ((0, (0, 7), docs[:2]), (1, (0, 3, 7), docs[2:])):
            for a, doc in zip(offsets, parts):
                alone = model(doc, use_cache=False).logits[0]
                torch.testing.assert_close(out[row, a : a + doc.shape[1]], alone, atol=1e-5, rtol=1e-4)
    out.float().pow(2).mean().backward()
    new = [p for n, p in model.named_parameters() if any(s in n for s in ("feature_map", "A_log", "window_log_gamma", "gate.",
                                                                         "window_gamma"))]
    assert new and all(p.grad is not None and p.grad.abs().sum() > 0 for p in new)

    # gradients through the regrouping (packed rows <-> one document per row) are the documents' own:
    # the embedding gradient (upstream of every layer) and a reused projection's (inside the layers)
    model.zero_grad()
    weights = torch.randn_like(out)
    (model(packed, position_ids=pos, use_cache=False).logits * weights).sum().backward()
    packed_grads = [p.grad.clone() for p in (model.model.embed_tokens.weight, model.model.layers[0].self_attn.q_proj.weight)]
    model.zero_grad()
    for row, offsets, parts in ((0, (0, 7), docs[:2]), (1, (0, 3, 7), docs[2:])):
        for a, doc in zip(offsets, parts):
            (model(doc, use_cache=False).logits[0] * weights[row, a : a + doc.shape[1]]).sum().backward()
    for got, p in zip(packed_grads, (model.model.embed_tokens.weight, model.model.layers[0].self_attn.q_proj.weight)):
        assert (got - p.grad).norm() <= 1e-5 * p.grad.norm(), ((got - p.grad).norm() / p.grad.norm()).item()


def test_gdn_layer_structure_and_first_prompt_shorter_than_conv():
    from linearize.gdn import GatedDeltaNet

    model = converted("llama", linearize.GatedDeltaNetConfig(conv_size=4))
    layer = model.model.layers[0].self_attn
    assert isinstance(layer, GatedDeltaNet)
    assert layer.q_proj is layer.original.q_proj  # reused by reference
    g = -torch.exp(layer.A_log) * torch.nn.functional.softplus(layer.dt_bias)
    assert (g < 0).all() and (g > -0.02).all()  # slow decay at the start
    ids = torch.randint(2, 97, (1, 9))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = linearize.LinearizeCache(model.config)
        parts = [model(ids[:, :2], past_key_values=cache, use_cache=True).logits]  # 2 < conv_size
        assert cache.layers[0].conv_states[0].shape[-1] == 4
        parts += [model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits for t in range(2, 9)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=2e-4, rtol=1e-4)


def test_gdn_fresh_conversion_is_near_pass_through_where_it_should_be():
    """Identity conv and pass-through norm/gate at init: the conv changes nothing."""
    a = tiny_model("llama")
    b = tiny_model("llama")
    linearize.linearize(a, linearize.GatedDeltaNetConfig(conv_size=4))
    linearize.linearize(b, linearize.GatedDeltaNetConfig(conv_size=0))
    ids = torch.randint(2, 97, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(a(ids, use_cache=False).logits, b(ids, use_cache=False).logits)


@pytest.mark.parametrize("cfg", [linearize.LinearAttentionConfig(), linearize.GatedDeltaNetConfig()], ids=["la", "gdn"])
def test_kl_guided_selection_keeps_the_costliest_layers_softmax(cfg, tmp_path):
    model = converted("llama", cfg, num_hidden_layers=4)
    ids = torch.randint(2, 97, (2, 16))
    chosen, kl = linearize.select_softmax_layers(model, 2, ids)
    assert len(kl) == 4 and chosen == sorted(sorted(kl, key=kl.get)[-2:])
    with torch.no_grad():
        teacher = tiny_model("llama", num_hidden_layers=4)(ids).logits.log_softmax(-1)
        for i in range(4):  # a layer's KL is that of converting it alone, measured independently
            m = converted("llama", cfg, num_hidden_layers=4)
            linearize.restore_softmax(m, [j for j in range(4) if j != i])
            logp = m(ids, use_cache=False).logits.log_softmax(-1)
            solo = torch.nn.functional.kl_div(logp, teacher, log_target=True, reduction="none").sum(-1).mean().item()
            assert solo == pytest.approx(kl[i], rel=1e-4, abs=1e-7)
    assert len(set(kl.values())) == 4  # the layers really differ
    linearize.restore_softmax(model, chosen)
    rest = [i for i in range(4) if i not in chosen]
    assert model.config.linearize["layers"] == rest and model.config.linearize["softmax_layers"] == chosen
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert all(type(loaded.model.layers[i].self_attn).__name__ == "LlamaAttention" for i in chosen)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


# -- the output gate (output_gate) ---------------------------------------------------------------------


def test_output_gate_starts_at_one_and_trains():
    """output_gate r: o * 2 sigmoid(W2 W1 x + b) before o_proj, hidden -> r -> heads*head_dim. It starts at
    exactly 1 (the same logits as without it); the gradient reaches its bias and second factor at once,
    its first factor once the second has moved; the stages train it (new parameters, attention's)."""
    ids = torch.randint(2, 97, (2, 12))
    cfg = dict(feature_map="hedgehog", decay="channel", gate_rank=4)
    plain = converted("llama", linearize.LinearAttentionConfig(**cfg)).train()
    gated = converted("llama", linearize.LinearAttentionConfig(**cfg, output_gate=8)).train()
    hidden, width = 64, 4 * 16  # TINY: 4 heads of 16
    sizes = [sum(p.numel() for p in m.parameters()) for m in (plain, gated)]
    assert sizes[1] - sizes[0] == 3 * (hidden * 8 + 8 * width + width)
    layer = attention(gated, 0)
    assert layer.out_gate_in.bias is None and layer.decode_projection_names()[-1] == "out_gate_in"
    from linearize.recipes.distill import new_parameter_names, stage2_parameter_names

    ours = {"model.layers.0.self_attn." + n for n in ("out_gate_in.weight", "out_gate_out.weight", "out_gate_out.bias")}
    assert ours <= set(new_parameter_names(gated)) and ours <= set(stage2_parameter_names(gated, "attention"))
    out_plain, out_gated = plain(ids).logits, gated(ids).logits
    torch.testing.assert_close(out_gated, out_plain, atol=0, rtol=0)
    out_gated.square().mean().backward()
    for i in range(3):
        l = attention(gated, i)
        assert l.out_gate_out.bias.grad.abs().max() > 0 and l.out_gate_out.weight.grad.abs().max() > 0
        assert torch.count_nonzero(l.out_gate_in.weight.grad) == 0  # the second factor is still zero
    opt = torch.optim.Adam([p for n, p in gated.named_parameters() if ".out_gate_" in n], lr=1e-2)
    opt.step()
    opt.zero_grad()
    moved = gated(ids).logits
    assert (moved - out_plain).abs().max() > 1e-3  # the gate now changes the output
    moved.square().mean().backward()
    for i in range(3):
        assert attention(gated, i).out_gate_in.weight.grad.abs().max() > 0


@pytest.mark.parametrize("window", [0, 3])
def test_output_gate_cache_fused_and_round_trip(tmp_path, window):
    """Off its start (random factors), the first factor in the fused projection, with and without a
    window: fused == unfused == the cache token by token, and the checkpoint records output_gate and
    loads the two factors; zeroing the gate's factors moves the logits (it is applied)."""
    cfg = linearize.LinearAttentionConfig(feature_map="elu", decay="scalar", window=window, output_gate=4, layers=[0, 2])
    model, loaded, ids, fused = off_start_fused_cache_and_round_trip(cfg, ".out_gate_", "output_gate", tmp_path)
    assert attention(loaded, 2).output_gate == 4 and attention(loaded, 2).out_gate_out.weight.dtype == torch.float64
    with torch.no_grad():
        for i in (0, 2):
            attention(model, i).out_gate_out.weight.zero_()
            attention(model, i).out_gate_out.bias.zero_()
        assert (model(ids, use_cache=False).logits - fused).abs().max() > 1e-3
