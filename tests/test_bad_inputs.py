"""Bad inputs get one clear line on stderr (exit status 2) and leave nothing behind.

Each row of BAD_INPUTS builds a broken input in a temporary folder, runs the CLI in process and
checks the message and that the output folder never appeared (no temporary folders either).  The
disk and network failures are simulated: a read-only file system and a full disk by making the
writes raise EROFS / ENOSPC (the tests run as root, for whom a chmod'ed folder stays writable), an
interrupted hub download by the OSError transformers raises for it.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import linearize
from linearize.cli import main

from conftest import tiny_model


def _tokenizer():
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 97)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """(original tiny qwen3 folder, its converted checkpoint folder)."""
    root = tmp_path_factory.mktemp("bad")
    model = tiny_model("qwen3")
    model.save_pretrained(root / "tiny")
    _tokenizer().save_pretrained(root / "tiny")
    linearize.linearize(model, linearize.LinearAttentionConfig(feature_map="t2r"))
    model.save_pretrained(root / "conv")
    _tokenizer().save_pretrained(root / "conv")
    return root / "tiny", root / "conv"


def _copy(src, tmp_path, name="src"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _edit_linearize(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg["linearize"].update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _truncate(path):
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _garbage(path):
    (path / "model.safetensors").write_bytes(b"\x00\xff" * 64)


def _data(tmp_path, name, content: bytes):
    f = tmp_path / name
    f.write_bytes(content)
    return f


def _distill(src, data, out):
    return ["distill", str(src), "--out", str(out), "--data", str(data), "--stage1-steps", "1", "--stage2-steps", "0",
            "--seq-len", "16", "--no-eval"]


def _raise(err):
    def f(*a, **kw):
        raise err
    return f


def _never_load(monkeypatch):
    never = _raise(AssertionError("the model was loaded before the bad input was refused"))
    for module in ("linearize.cli", "linearize.recipes.cli"):  # convert/generate/export; distill/eval
        monkeypatch.setattr(f"{module}.load_model_and_tokenizer", never)


# (id, build(tiny, conv, tmp_path, monkeypatch) -> argv, expected message part)
BAD_INPUTS = [
    ("truncated-safetensors",
     lambda t, c, p, m: (_truncate(src := _copy(t, p)), ["convert", str(src), "--out", str(p / "out")])[1],
     "are corrupt or truncated"),
    ("corrupt-safetensors-header",
     lambda t, c, p, m: (_garbage(src := _copy(t, p)), ["convert", str(src), "--out", str(p / "out")])[1],
     "are corrupt or truncated"),
    ("unknown-method-in-config.linearize",
     lambda t, c, p, m: (_edit_linearize(src := _copy(c, p), method="mamba"),
                         ["generate", str(src), "--prompt", "w5 w6"])[1],
     "config.linearize: unknown conversion method 'mamba'"),
    ("wrong-type-field-in-config.linearize",
     lambda t, c, p, m: (_edit_linearize(src := _copy(c, p), window="64"),
                         ["generate", str(src), "--prompt", "w5 w6"])[1],
     "LinearAttentionConfig.window must be int, got '64'"),
    ("checkpoint-from-a-newer-version",
     lambda t, c, p, m: (_edit_linearize(src := _copy(c, p), format_version=99),
                         ["eval", str(src), "--data", "stdlib-docs"])[1],
     "converted by a newer linearize (format_version 99"),
    ("empty-data-file",
     lambda t, c, p, m: _distill(t, _data(p, "empty.txt", b"\n\n  \n"), p / "out"),
     "no documents found"),
    ("empty-data-folder",
     lambda t, c, p, m: _distill(t, (p / "docs").mkdir() or p / "docs", p / "out"),
     "no .txt/.rst/.md or .jsonl files under"),
    ("invalid-utf8-text",
     lambda t, c, p, m: _distill(t, _data(p, "bad.txt", b"w5 w6\n\nw7 \xff\xfe w8\n"), p / "out"),
     "bad.txt line 3: invalid UTF-8"),
    ("invalid-json-line",
     lambda t, c, p, m: _distill(t, _data(p, "bad.jsonl", b'{"text": "w5 w6"}\n{"text": "w7\n'), p / "out"),
     "bad.jsonl line 2: invalid JSON"),
    ("json-line-not-an-object",
     lambda t, c, p, m: _distill(t, _data(p, "list.jsonl", b'{"text": "w5 w6"}\n[1, 2]\n'), p / "out"),
     "a record must be a JSON object"),
    ("cuda-graphs-without-compile",
     lambda t, c, p, m: (_never_load(m), _distill(t, "stdlib-docs", p / "out") + ["--cuda-graphs"])[1],
     "--cuda-graphs replays the compiled decoder: add --compile"),
    ("layers-out-of-range",
     lambda t, c, p, m: (_never_load(m), ["convert", str(t), "--out", str(p / "out"), "--layers", "0,7"])[1],
     "--layers [7] do not exist"),
    ("layers-naming-no-layer",
     lambda t, c, p, m: (_never_load(m), ["convert", str(t), "--out", str(p / "out"), "--layers", ","])[1],
     "layers is empty"),
    ("layers-not-a-range",
     lambda t, c, p, m: (_never_load(m), ["convert", str(t), "--out", str(p / "out"), "--layers", "3-1"])[1],
     "'3-1' is not a layer index or an ascending range"),
    ("out-on-a-read-only-disk",
     lambda t, c, p, m: (m.setattr(tempfile, "mkdtemp", _raise(OSError(errno.EROFS, "Read-only file system"))),
                         _never_load(m), ["convert", str(t), "--out", str(p / "out")])[2],
     "the file system is read-only; nothing was written"),
    ("out-on-a-full-disk",  # the weights are written, then the tokenizer hits ENOSPC
     lambda t, c, p, m: (m.setattr(PreTrainedTokenizerFast, "save_pretrained",
                                   _raise(OSError(errno.ENOSPC, "No space left on device"))),
                         ["convert", str(t), "--out", str(p / "out")])[1],
     "no space left on the device; nothing was written"),
    ("interrupted-hub-download",
     lambda t, c, p, m: (m.setattr("transformers.AutoConfig.from_pretrained", _raise(OSError(
         "Consistency check failed: file should be of size 538090408 but has size 12288 (model.safetensors)."))),
                         ["convert", "someorg/somemodel", "--out", str(p / "out")])[1],
     "could not load someorg/somemodel from the Hub (Consistency check failed"),
    ("missing-model-folder",
     lambda t, c, p, m: ["convert", str(p / "nowhere"), "--out", str(p / "out")],
     "model folder not found"),
    ("odd-hedgehog-feature-dim",
     lambda t, c, p, m: (_never_load(m), ["convert", str(t), "--out", str(p / "out"), "--feature-dim", "7"])[1],
     "hedgehog feature_dim must be even"),
    ("push-of-a-folder-that-is-not-a-checkpoint",
     lambda t, c, p, m: (m.setenv("HF_TOKEN", "hf_test"), (p / "out").mkdir() or None,
                         ["push", str(p / "out"), "me/x", "--endpoint", "http://127.0.0.1:9"])[2],
     "is not a checkpoint folder (no config.json)"),
    ("distill-with-no-evaluation-rows",  # refused before loading, not after training (a division by 0 then)
     lambda t, c, p, m: (_never_load(m), [*_distill(t, "stdlib-docs", p / "out")[:-1], "--eval-rows", "0"])[1],
     "--eval-rows must be >= 1, got 0; pass --no-eval"),
    ("eval-of-no-rows",
     lambda t, c, p, m: (_never_load(m), ["eval", str(c), "--data", "stdlib-docs", "--max-rows", "0"])[1],
     "--max-rows must be >= 1, got 0"),
    ("eval-with-empty-openings",
     lambda t, c, p, m: (_never_load(m), ["eval", str(c), "--data", "stdlib-docs", "--prompt-tokens", "0"])[1],
     "--prompt-tokens must be >= 1, got 0"),
    ("distill-with-empty-openings",  # refused before loading, not after training
     lambda t, c, p, m: (_never_load(m), [*_distill(t, "stdlib-docs", p / "out")[:-1], "--eval-prompt-tokens", "0"])[1],
     "--eval-prompt-tokens must be >= 1, got 0"),
    ("distill-into-a-used-folder-without-resume",
     lambda t, c, p, m: (_never_load(m), (p / "out").mkdir(), (p / "out" / "keep.txt").write_text("x"),
                         _distill(t, "stdlib-docs", p / "out"))[3],
     "exists and is not empty; pass --resume"),
]


@pytest.mark.parametrize("name,build,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_one_clear_line_and_writes_nothing(name, build, message, dirs, tmp_path, monkeypatch, capsys):
    argv = build(*dirs, tmp_path, monkeypatch)
    before = {p for p in tmp_path.rglob("*")}
    capsys.readouterr()
    assert main(argv) == 2
    stderr = capsys.readouterr().err
    # progress bars may come first (tqdm draws on stderr); the error is the last line, alone
    errors = [line for line in stderr.replace("\r", "\n").splitlines() if ": error: " in line]
    assert "Traceback" not in stderr and len(errors) == 1, stderr
    assert stderr.rstrip().endswith(errors[0]) and errors[0].startswith(f"linearize {argv[0]}: error: "), stderr
    assert message in errors[0], errors[0]
    monkeypatch.undo()
    after = {p for p in tmp_path.rglob("*")}
    assert after == before, f"written: {sorted(map(str, after - before))}"
    if argv[0] != "push":
        assert not (tmp_path / "out").exists() or name == "distill-into-a-used-folder-without-resume"


def test_prompt_longer_than_the_static_cache_is_refused_before_anything_is_written():
    model = tiny_model("llama")
    linearize.linearize(model, linearize.LinearAttentionConfig(feature_map="t2r"))
    cache = linearize.StaticLinearizeCache(model.config, max_batch_size=1, max_cache_len=8)
    ids = torch.randint(3, 90, (1, 12))
    with pytest.raises(ValueError, match=r"0 cached \+ 12 new tokens do not fit this StaticLinearizeCache \(max_cache_len=8\)"):
        model.generate(ids, past_key_values=cache, max_new_tokens=2, do_sample=False)
    assert int(cache.get_seq_length()) == 0
    # the same cache still serves a prompt that fits
    out = model.generate(ids[:, :4], past_key_values=cache, max_new_tokens=2, do_sample=False)
    assert out.shape == (1, 6)


def test_config_type_check_names_the_field_and_format_version_is_recorded():
    from linearize.config import FORMAT_VERSION, config_from_dict

    with pytest.raises(ValueError, match=r"LinearAttentionConfig.eps must be float, got 'small'"):
        config_from_dict({"method": "linear_attention", "eps": "small"})
    with pytest.raises(ValueError, match=r"GatedDeltaNetConfig.use_rope must be bool, got 1"):
        config_from_dict({"method": "gdn", "use_rope": 1})
    assert config_from_dict({"method": "linear_attention", "format_version": FORMAT_VERSION, "eps": 1}).eps == 1
    model = tiny_model("llama")
    linearize.linearize(model, linearize.LinearAttentionConfig(feature_map="elu"))
    assert model.config.linearize["format_version"] == FORMAT_VERSION
