"""Export to transformers' native Qwen3.5 hybrid (``linearize export --format qwen3_5``): the layer
against transformers' own ``Qwen3_5GatedDeltaNet``, exports of every expressible family loaded in a
process that cannot import linearize, refusals, the CLI path, and distillation of the layout."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

import linearize
from linearize.arch import ARCHITECTURES
from linearize.cache import CACHE_KWARG
from linearize.cli import main
from linearize.config import config_from_dict
from linearize.native import ExportError, export
from linearize.gdn_qwen3_5 import Qwen35Attention, Qwen35GatedDeltaNet

from conftest import attention, tiny_model

# the families Qwen3.5 can hold (rows without a qwen3_5 reason); a new row must be added here or refused
EXPRESSIBLE = ["llama", "mistral", "phi3", "qwen2", "qwen3", "smollm3"]
REFUSED = sorted(a for a, spec in ARCHITECTURES.items() if spec.qwen3_5)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared CI machine spinning threads made
    this file 4x slower (101 s against 23 s on 2 busy cores): one thread here, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def qwen35(model_type="llama", layers=None, seed=0, **kw):
    """A tiny model converted to the qwen3_5 layout, every new parameter moved off its initial value
    (in_proj_z starts at zero, the q/k norms at unit weight) so that each one matters in the checks."""
    model = tiny_model(model_type, seed=seed, **kw)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # transformers starts biases at zero: Qwen2's q/k/v biases must matter here
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.add_(0.5 * torch.randn(p.shape, generator=g))
    linearize.linearize(model, linearize.GatedDeltaNetConfig(layout="qwen3_5", layers=layers))
    new = ("conv1d", "in_proj_", "A_log", "dt_bias", "self_attn.norm.", "q_norm", "k_norm")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in new):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


def test_every_family_is_exported_or_refused():
    assert sorted(a for a, spec in ARCHITECTURES.items() if not spec.qwen3_5) == EXPRESSIBLE
    assert set(EXPRESSIBLE).isdisjoint(REFUSED)


def test_layout_config_validates_and_round_trips():
    cfg = linearize.GatedDeltaNetConfig(layout="qwen3_5", layers=[0, 2])
    assert cfg.use_rope is False  # the layout's choice, stored resolved
    assert config_from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert linearize.GatedDeltaNetConfig().use_rope is True  # the default layout keeps RoPE
    # a default-layout record has no layout key: older linearize versions still read such checkpoints
    assert "layout" not in linearize.GatedDeltaNetConfig().to_dict() and cfg.to_dict()["layout"] == "qwen3_5"
    for bad, match in [(dict(use_rope=True), "no RoPE"), (dict(kv_heads="group"), "kv_heads='expand'"),
                       (dict(conv_size=0), "conv_size >= 1")]:
        with pytest.raises(ValueError, match=match):
            linearize.GatedDeltaNetConfig(layout="qwen3_5", **bad)
    with pytest.raises(ValueError, match="layout must be one of"):
        linearize.GatedDeltaNetConfig(layout="qwen3")


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3", "qwen2"])
def test_layer_equals_transformers_qwen3_5_gated_deltanet(arch):
    """The layout's layer and transformers' Qwen3_5GatedDeltaNet given the exported weights: a
    37-token prefill, then decode steps through each one's cache (ours: LinearizeCache; theirs:
    DynamicCache of a Qwen3.5 config). llama: GQA (2 kv heads repeated to 4); qwen3: q/k norm
    weights folded into in_proj_qkv; phi3: fused qkv; qwen2: q/k/v biases left out."""
    from transformers import DynamicCache

    model = qwen35(arch)
    layer = attention(model, 0)
    assert isinstance(layer, Qwen35GatedDeltaNet)
    c = model.config
    qcfg = Qwen3_5TextConfig(hidden_size=c.hidden_size, num_hidden_layers=1, layer_types=["linear_attention"],
                             linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=16,
                             linear_value_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=c.rms_norm_eps)
    ref = Qwen3_5GatedDeltaNet(qcfg, 0).eval()
    ref.load_state_dict(layer.qwen3_5_state_dict(), strict=True)
    x = torch.randn(2, 40, c.hidden_size)
    ours_cache, their_cache = linearize.LinearizeCache(c), DynamicCache(config=qcfg)
    with torch.no_grad():
        full = ref(x)
        torch.testing.assert_close(layer(x)[0], full, atol=1e-5 * full.abs().max().item(), rtol=1e-5)
        ours = [layer(x[:, :37], **{CACHE_KWARG: ours_cache})[0]]
        theirs = [ref(x[:, :37], cache=their_cache)]
        for t in range(37, 40):  # one token at a time: the conv cache and the recurrent state carry over
            ours.append(layer(x[:, t:t + 1], **{CACHE_KWARG: ours_cache})[0])
            theirs.append(ref(x[:, t:t + 1], cache=their_cache))
    ours, theirs = torch.cat(ours, 1), torch.cat(theirs, 1)
    scale = theirs.abs().max().item()
    torch.testing.assert_close(ours, theirs, atol=1e-5 * scale, rtol=1e-5)
    torch.testing.assert_close(theirs, full, atol=1e-5 * scale, rtol=1e-5)  # their cache path is their full path


def test_layout_trains_and_kept_layers_carry_qwen3_5_norms():
    """Attention transfer reaches every new parameter, the kept softmax layer's q/k norms included,
    and softmax mode (the teacher) is the original model."""
    model = qwen35("llama", layers=[0, 2])
    kept = attention(model, 1)
    assert isinstance(kept, Qwen35Attention) and kept.original.__class__.__name__ == "LlamaAttention"
    from linearize.recipes.distill import attention_transfer_loss, new_parameter_names, set_trainable

    names = new_parameter_names(model)
    assert {"model.layers.1.self_attn.q_norm.weight", "model.layers.0.self_attn.in_proj_z.weight"} <= set(names)
    set_trainable(model, names)
    ids = torch.randint(2, 97, (2, 12))
    pos = torch.arange(12).expand(2, 12)
    attention_transfer_loss(model, {"input_ids": ids, "position_ids": pos}).backward()
    params = dict(model.named_parameters())
    for n in names:
        assert params[n].grad is not None and params[n].grad.abs().sum() > 0, n
    reference = tiny_model("llama")
    with torch.no_grad(), linearize.attention_mode(model, "softmax"):
        torch.testing.assert_close(model(ids, use_cache=False).logits, reference(ids).logits)


EXPORTS_SCRIPT = textwrap.dedent("""
    import json, sys

    class NoLinearize:  # the export must load where linearize cannot be imported
        def find_spec(self, name, path=None, target=None):
            if name == "linearize" or name.startswith("linearize."):
                raise ImportError("linearize is not available in this process")

    sys.meta_path.insert(0, NoLinearize())
    import torch
    from transformers import AutoModelForCausalLM

    result = {}
    for folder in sys.argv[1:]:
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        ref = torch.load(folder + "/ref.pt")
        with torch.no_grad():
            logits = model(ref["ids"], attention_mask=ref["mask"], use_cache=False).logits
        valid = ref["mask"].bool()
        err = ((logits - ref["logits"])[valid].abs().max() / ref["logits"][valid].abs().max()).item()
        tokens = None
        if ref["prompt"] is not None:
            tokens = model.generate(ref["prompt"], attention_mask=ref["prompt_mask"], max_new_tokens=6,
                                    do_sample=False, pad_token_id=0).tolist()
        result[folder] = {"class": type(model).__name__, "err": err, "tokens": tokens}
    result["linearize_imported"] = any(m == "linearize" or m.startswith("linearize.") for m in sys.modules)
    print(json.dumps(result))
""")


def test_exports_load_without_linearize_and_match(tmp_path):
    """Every expressible family as a hybrid (layer 0 kept softmax, in Qwen3.5's form; layers 1-2 Gated
    DeltaNet; smollm3's layer 1 is its NoPE layer) plus an all-GDN llama: the export loads in a fresh
    process that cannot import linearize, as Qwen3_5ForCausalLM, with the converted model's logits
    (left-padded batch, float32, 1e-4 of the largest) and greedy tokens."""
    cases = [(arch, [1, 2]) for arch in EXPRESSIBLE] + [("llama", None)]
    folders = []
    for n, (arch, layers) in enumerate(cases):
        model = qwen35(arch, layers=layers, seed=n)
        model.config.linearize["base_model"] = f"org/tiny-{arch}"  # what linearize records for a hub id
        folder = tmp_path / f"{arch}-{'all' if layers is None else 'hybrid'}"
        report = export(model, folder)
        assert f"base_model: org/tiny-{arch}\n" in (folder / "README.md").read_text()
        assert report.linear_layers == (layers or [0, 1, 2]) and not report.deviations
        assert bool(report.warnings) == (layers is None)  # all-GDN: transformers cannot generate it
        ids = torch.randint(2, 97, (2, 11))
        mask = torch.ones_like(ids)
        mask[1, :3] = 0  # left padding
        prompt, prompt_mask = ids[:, 4:], mask[:, 4:].clone()
        prompt_mask[1, :2] = 0
        with torch.no_grad():
            logits = model(ids, attention_mask=mask, use_cache=False).logits
            tokens = None
            if layers is not None:
                tokens = model.generate(prompt, attention_mask=prompt_mask, max_new_tokens=6, do_sample=False,
                                        pad_token_id=0)
        torch.save({"ids": ids, "mask": mask, "logits": logits, "prompt": prompt if layers else None,
                    "prompt_mask": prompt_mask, "tokens": tokens}, folder / "ref.pt")
        folders.append((str(folder), tokens))
        cfg = json.loads((folder / "config.json").read_text())
        assert cfg["architectures"] == ["Qwen3_5ForCausalLM"] and cfg["model_type"] == "qwen3_5_text"
        assert "linearize" not in cfg and "auto_map" not in cfg
        assert cfg["layer_types"] == ["linear_attention" if i in (layers or [0, 1, 2]) else "full_attention"
                                      for i in range(3)]
        assert (cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_key_head_dim"]) == (4, 4, 16)
        assert not list(folder.glob("*.py"))
    env = {**os.environ, "PYTHONPATH": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", EXPORTS_SCRIPT, *[f for f, _ in folders]], capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result.pop("linearize_imported") is False
    for folder, tokens in folders:
        got = result[folder]
        assert got["class"] == "Qwen3_5ForCausalLM", folder
        assert got["err"] < 1e-4, (folder, got["err"])
        if tokens is not None:
            assert got["tokens"] == tokens.tolist(), folder


@pytest.mark.parametrize("arch", REFUSED)
def test_families_qwen3_5_cannot_express_are_refused_in_one_line(arch):
    model = tiny_model(arch)
    linearize.linearize(model, linearize.GatedDeltaNetConfig(layout="qwen3_5"))
    with pytest.raises(ExportError) as err:
        linearize.export(model, "unused")
    msg = str(err.value)
    assert "\n" not in msg and arch in msg and ARCHITECTURES[arch].qwen3_5 in msg


@pytest.mark.parametrize("case", ["default-layout", "hedgehog-window", "sliding-softmax", "nope-softmax", "lora",
                                  "not-converted", "encoder"])
def test_layers_qwen3_5_cannot_express_are_refused_naming_the_layer(case, tmp_path):
    if case == "default-layout":
        model, want = tiny_model("llama"), ["layer 0", "layout 'default'", "--layout qwen3_5"]
        linearize.linearize(model, linearize.GatedDeltaNetConfig())
    elif case == "hedgehog-window":
        model, want = tiny_model("qwen3"), ["layer 0", "linear_attention", "hedgehog", "window 4"]
        linearize.linearize(model, linearize.LinearAttentionConfig(window=4))
    elif case == "sliding-softmax":  # Mistral's sliding window kept in softmax layer 0
        model, want = tiny_model("mistral", sliding_window=8), ["layer 0", "sliding-window", "window 8"]
        linearize.linearize(model, linearize.GatedDeltaNetConfig(layout="qwen3_5", layers=[1, 2]))
    elif case == "nope-softmax":  # smollm3's layer 1 has no RoPE
        model, want = tiny_model("smollm3"), ["layer 1", "NoPE"]
        linearize.linearize(model, linearize.GatedDeltaNetConfig(layout="qwen3_5", layers=[0, 2]))
    elif case == "not-converted":
        model, want = tiny_model("llama"), ["not converted", "--layout qwen3_5"]
    elif case == "encoder":
        from transformers import BertConfig, BertModel

        model = BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37,
                                     vocab_size=50))
        model, want = linearize.linearize(model, linearize.LinformerConfig(k=4, max_length=16)), ["bert", "encoder"]
    else:
        from peft import LoraConfig, get_peft_model

        model, want = qwen35("llama"), ["LoRA", "merge_and_unload"]
        model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"])).base_model.model
    with pytest.raises(ExportError) as err:
        export(model, tmp_path / "out")
    msg = str(err.value)
    assert "\n" not in msg and all(w in msg for w in want), msg
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())  # nothing half-written


@pytest.fixture
def tiny_dir(tmp_path):
    """A tiny Llama saved with a tokenizer and a chat template, as a user's source folder."""
    path = tmp_path / "tiny"
    model = tiny_model("llama")
    model.config._name_or_path = "org/tiny-llama"
    model.save_pretrained(path)
    vocab = {"<pad>": 0, "<s>": 1, **{f"w{i}": i for i in range(2, 97)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(path)
    return path


def test_cli_convert_then_export(tiny_dir, tmp_path, capsys):
    conv, out = tmp_path / "conv", tmp_path / "native"
    assert main(["convert", str(tiny_dir), "--out", str(conv), "--method", "gdn", "--layout", "qwen3_5",
                 "--softmax-layers", "1"]) == 0
    assert main(["export", str(conv), "--format", "qwen3_5", "--out", str(out)]) == 0
    assert "1/3" not in capsys.readouterr().out  # 2 of 3 layers are Gated DeltaNet
    files = set(os.listdir(out))
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja", "README.md"} <= files
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".native.")]  # no temporaries left
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["layer_types"] == ["linear_attention", "full_attention", "linear_attention"]
    assert cfg["rope_parameters"]["partial_rotary_factor"] == 1.0  # Llama rotates the whole head
    card = (out / "README.md").read_text()
    assert "a local llama model" in card and "Qwen3_5ForCausalLM" in card
    converted = AutoModelForCausalLM.from_pretrained(conv).eval()
    native = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(native).__name__ == "Qwen3_5ForCausalLM"
    ids = torch.randint(2, 97, (1, 9))
    with torch.no_grad():
        want = converted(ids).logits
        torch.testing.assert_close(native(ids).logits, want, atol=1e-4 * want.abs().max().item(), rtol=0)

    (out / "keep.txt").write_text("precious")
    capsys.readouterr()
    assert main(["export", str(conv), "--out", str(out)]) == 2  # a non-empty --out needs --overwrite
    assert "--overwrite" in capsys.readouterr().err and (out / "keep.txt").exists()

    plain = tmp_path / "gdn-default"
    assert main(["convert", str(tiny_dir), "--out", str(plain), "--method", "gdn"]) == 0
    capsys.readouterr()
    assert main(["export", str(plain), "--out", str(tmp_path / "refused")]) == 2
    (err,) = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # one line (beside progress bars)
    assert err.startswith("linearize export: error: layer 0") and "--layout qwen3_5" in err, err
    assert not (tmp_path / "refused").exists()


def test_distill_trains_the_layout_and_the_result_exports(tiny_dir, tmp_path):
    from linearize.recipes.data import DataConfig
    from linearize.recipes.distill import DistillConfig, distill
    from linearize.recipes.train import TrainConfig

    data = tmp_path / "corpus.txt"
    g = torch.Generator().manual_seed(0)
    data.write_text("\n\n\n".join(" ".join(f"w{int(i)}" for i in torch.randint(2, 90, (40,), generator=g))
                                  for _ in range(30)))
    model = tiny_model("llama")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    cfg = DistillConfig(preset="gdn", layout="qwen3_5", softmax_layers="1", stage1_steps=3, stage2_steps=2,
                        lora_rank=2)
    train = TrainConfig(steps=1, lr=1.0, batch_size=2, warmup_steps=1)
    summary = distill(model, tokenizer, cfg, DataConfig(data=str(data), seq_len=24), train, tmp_path / "run",
                      log=lambda *a: None)
    assert summary["stage1"]["steps"] == 3
    assert isinstance(attention(model, 1), Qwen35Attention)
    assert attention(model, 1).q_norm.weight.abs().sum() > 0  # stage 1 trained the kept layer's q/k norms
    report = export(AutoModelForCausalLM.from_pretrained(tmp_path / "run"), tmp_path / "native")
    assert report.linear_layers == [0, 2] and report.softmax_layers == [1] and not report.deviations
    native = AutoModelForCausalLM.from_pretrained(tmp_path / "native").eval()
    ids = torch.randint(2, 90, (1, 10))
    with torch.no_grad():
        want = model(ids).logits
        torch.testing.assert_close(native(ids).logits, want, atol=1e-4 * want.abs().max().item(), rtol=0)


def test_layout_hybrid_cache_packing_and_static_cache():
    """The layout's hybrid (Gated DeltaNet layers 0 and 2, Qwen3.5-form softmax layer 1): tokens fed one
    at a time through the cache give the full forward's logits; two packed documents give what each
    gives alone; the static cache generates what the dynamic one does."""
    model = qwen35("llama", layers=[0, 2]).to(torch.float64)
    ids = torch.randint(2, 97, (2, 11))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = linearize.LinearizeCache(model.config)
        steps = [model(ids[:, t:t + 1], **{CACHE_KWARG: cache}, use_cache=True).logits for t in range(11)]
        # float64 model, the layer's gates and L2 norms in float32 as Qwen3.5 computes them
        torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-4, rtol=1e-5)
        pos = torch.cat([torch.arange(5), torch.arange(6)])[None]
        packed = model(ids[:1], position_ids=pos, use_cache=False).logits
        alone = torch.cat([model(ids[:1, :5], use_cache=False).logits, model(ids[:1, 5:], use_cache=False).logits], 1)
        torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
        model.float()
        kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        dynamic = model.generate(ids[:, :4], **kw)
        static = model.generate(ids[:, :4], cache_implementation="static", **kw)
    assert static.tolist() == dynamic.tolist()


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_layout_converts_every_row_and_its_cache_equals_the_full_forward(arch):
    """The layout is a conversion like any other on every row, exportable or not (its kept softmax
    layers stay the original modules where export refuses the family: Gemma keeps its softcapping)."""
    moe = arch in ("mixtral", "qwen3_moe")  # transformers' grouped expert GEMM takes no float64
    model = qwen35(arch, layers=[0, 2]).to(torch.float32 if moe else torch.float64)
    kept = attention(model, 1)
    assert isinstance(kept, Qwen35Attention) == (arch in EXPRESSIBLE and ARCHITECTURES[arch].qk_norm is None)
    ids = torch.randint(2, 97, (2, 9))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = linearize.LinearizeCache(model.config)
        steps = [model(ids[:, t:t + 1], **{CACHE_KWARG: cache}, use_cache=True).logits for t in range(9)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=2e-4, rtol=1e-4)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU models on the kernels: needs TRITON_INTERPRET=1 (CI's kernel pass)")
def test_layout_on_the_kernels_matches_the_pytorch_path(monkeypatch):
    """Prefill (chunk kernel), decode (recurrent kernel) and a training step's gradients (chunk
    backward) of the layout's hybrid on linearize's Triton kernels give what the PyTorch path gives."""
    import linearize.gdn_qwen3_5 as q35

    calls = []
    real = q35._kernel_delta_rule
    monkeypatch.setattr(q35, "_kernel_delta_rule", lambda *a, **kw: calls.append(a[0].shape[1]) or real(*a, **kw))
    model = qwen35("llama", layers=[0, 2])
    ids = torch.randint(2, 97, (2, 11))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    runs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("LINEARIZE_KERNELS", backend)
        model.zero_grad()
        model(ids, attention_mask=mask, use_cache=False).logits.square().mean().backward()
        grads = [p.grad.clone() for n, p in model.named_parameters() if "in_proj_a" in n or "conv1d" in n]
        with torch.no_grad():
            runs[backend] = (model(ids, attention_mask=mask, use_cache=False).logits, grads,
                             model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0))
    torch.testing.assert_close(runs["triton"][0], runs["torch"][0], atol=2e-4, rtol=1e-4)
    for a, b in zip(runs["triton"][1], runs["torch"][1]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(runs["triton"][2], runs["torch"][2])
    assert 1 in calls and 11 in calls  # decode steps and the prefill really ran on the kernels


def test_layout_flags_reach_the_configs(tmp_path, capsys):
    from linearize.cli import build_parser, dataclass_from_args
    from linearize.recipes.distill import DistillConfig

    args = build_parser().parse_args(["distill", "--out", str(tmp_path), "--preset", "gdn", "--layout", "qwen3_5"])
    assert dataclass_from_args(DistillConfig, args).method_config().layout == "qwen3_5"
    with pytest.raises(ValueError, match="use it with a gdn preset"):
        DistillConfig(preset="lolcats", layout="qwen3_5")
    assert main(["convert", "--out", str(tmp_path / "x"), "--layout", "qwen3_5"]) == 2  # default method: feature maps
    assert "--layout belongs to --method gdn" in capsys.readouterr().err
