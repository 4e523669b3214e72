"""The chat prompt set (recipes/prompts.py) and `linearize generate-data` on a tiny saved model."""

import json
from collections import Counter

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from linearize.cli import main
from linearize.recipes.data import load_documents
from linearize.recipes.generate_data import is_degenerate, start_openings
from linearize.loading import UserError
from linearize.recipes.prompts import _all_prompts, build_prompts, heading_prompts, is_held_out_prompt

from conftest import tiny_model

CHAT_TEMPLATE = ("{% for m in messages %}w2 {{ m['content'] }} w3 {% endfor %}"
                 "{% if add_generation_prompt %}w4{% endif %}")


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    """A tiny qwen3 with a word-level tokenizer that has a chat template (prompt words are unknown: <pad>)."""
    path = tmp_path_factory.mktemp("tiny-chat")
    torch.manual_seed(0)
    tiny_model("qwen3").save_pretrained(path)
    vocab = {"<pad>": 0, "<s>": 1, **{f"w{i}": i for i in range(2, 97)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return path


def test_prompt_set_is_large_diverse_and_deterministic():
    prompts = build_prompts("all")
    assert len(prompts) > 30_000
    assert len({p.text for p in prompts}) == len(prompts)  # no duplicates
    tasks, domains = Counter(p.task for p in prompts), Counter(p.domain for p in prompts)
    assert len(tasks) >= 15 and len(domains) >= 12 and len({p.topic for p in prompts}) >= 400
    assert min(tasks.values()) >= 100, tasks  # every task family is well represented
    first = [p.task for p in prompts[:200]]  # the fixed order mixes tasks: any prefix is varied
    assert len(set(first)) >= 12
    _all_prompts.cache_clear()
    assert build_prompts("all") == prompts


def test_prompt_split_is_disjoint_and_stable():
    every = build_prompts("all")
    train, held = build_prompts("train"), build_prompts("held_out")
    assert not {p.text for p in train} & {p.text for p in held}
    assert len(train) + len(held) == len(every)
    assert 0.03 < len(held) / len(every) < 0.07
    # a prompt's side is a function of its text alone (the data split's hash), not of order or size
    assert all(is_held_out_prompt(p.text) for p in held[:500])
    assert [p.text for p in held] == [p.text for p in every if is_held_out_prompt(p.text)]
    with pytest.raises(ValueError, match="split must be one of"):
        build_prompts("test")


def test_heading_prompts(tmp_path):
    (tmp_path / "guide.md").write_text("# Installing the toolkit\n\ntext\n\n## GPU set-up\n\nmore text\n")
    (tmp_path / "notes.rst").write_text("Packing documents\n=================\n\nbody\n")
    texts = {p.text for p in heading_prompts(str(tmp_path))}
    assert {"Explain installing the toolkit.", "Explain GPU set-up.", "Explain packing documents."} <= texts


def test_degenerate_answers():
    assert is_degenerate("") and is_degenerate("  \n ")
    assert is_degenerate("I am sorry. " * 30)
    assert is_degenerate(" ".join(["the cat sat on"] * 12))
    prose = ("Photosynthesis is how plants make food. Leaves take in light, water from the roots and carbon "
             "dioxide from the air, and turn them into sugar, releasing oxygen as they do.")
    assert not is_degenerate(prose) and not is_degenerate("Paris.")


def test_sampling_follows_flags_then_generation_config():
    from types import SimpleNamespace

    from linearize.recipes.generate_data import GenerateDataConfig, sampling_kwargs

    plain = SimpleNamespace(generation_config=SimpleNamespace(do_sample=None, temperature=None, top_p=None))
    own = SimpleNamespace(generation_config=SimpleNamespace(do_sample=True, temperature=0.2, top_p=0.8))
    assert sampling_kwargs(plain, GenerateDataConfig()) == dict(do_sample=True, temperature=0.7, top_p=0.9)
    assert sampling_kwargs(own, GenerateDataConfig()) == dict(do_sample=True, temperature=0.2, top_p=0.8)
    assert sampling_kwargs(own, GenerateDataConfig(temperature=1.0)) == dict(do_sample=True, temperature=1.0, top_p=0.8)
    assert sampling_kwargs(own, GenerateDataConfig(temperature=0)) == dict(do_sample=False)
    with pytest.raises(ValueError, match="cache must be"):
        GenerateDataConfig(cache="paged")


def test_generate_data_writes_readable_chat_jsonl_and_resumes(chat_dir, tmp_path, capsys):
    out = tmp_path / "chat.jsonl"
    common = ["generate-data", str(chat_dir), "--out", str(out), "--batch-size", "4", "--max-new-tokens", "4"]
    assert main([*common, "--samples", "6"]) == 0
    printed = capsys.readouterr().out
    assert "6 chat samples" in printed and "tokens/s" in printed
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 6
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] and r["messages"][1]["content"]
               for r in records)
    train = {p.text for p in build_prompts("train")}
    assert all(r["messages"][0]["content"] in train for r in records)
    tokenizer = AutoTokenizer.from_pretrained(chat_dir)
    docs = load_documents(str(out), tokenizer)
    assert len(docs) == 6 and docs[0].startswith("w2 ")

    # a kill in the middle of a write leaves half a line: it goes, and the run continues after the last id
    with open(out, "a") as f:
        f.write('{"messages": [{"role": "us')
    assert main([*common, "--samples", "10"]) == 0
    assert "resumed with 6" in capsys.readouterr().out
    records = [json.loads(line) for line in out.read_text().splitlines()]
    ids = [r["id"] for r in records]
    assert len(records) == 10 and ids == sorted(set(ids))
    assert len({r["messages"][0]["content"] for r in records}) == 10

    # the held-out prompts' file is another prompt set: refused, not mixed in
    assert main([*common, "--samples", "11", "--split", "held_out"]) == 2
    assert "another prompt set" in capsys.readouterr().err


def test_generate_data_shards_are_disjoint_and_resume(chat_dir, tmp_path, capsys):
    def ids(path):
        return [json.loads(line)["id"] for line in path.read_text().splitlines()]

    common = ["generate-data", str(chat_dir), "--batch-size", "4", "--max-new-tokens", "2", "--temperature", "0"]
    whole, parts = tmp_path / "whole.jsonl", [tmp_path / "chat" / "part-0.jsonl", tmp_path / "chat" / "part-1.jsonl"]
    assert main([*common, "--out", str(whole), "--samples", "8"]) == 0
    assert main([*common, "--out", str(parts[0]), "--samples", "4", "--shard", "0/2"]) == 0
    # shard 1 in two goes: the second continues after the last id of the shard, not after the split's next prompt
    assert main([*common, "--out", str(parts[1]), "--samples", "2", "--shard", "1/2"]) == 0
    assert main([*common, "--out", str(parts[1]), "--samples", "4", "--shard", "1/2"]) == 0
    assert "resumed with 2" in capsys.readouterr().out
    assert ids(parts[0]) == [0, 2, 4, 6] and ids(parts[1]) == [1, 3, 5, 7]  # ids stay the split's indices
    assert sorted(ids(parts[0]) + ids(parts[1])) == ids(whole)
    train = build_prompts("train")
    assert all(json.loads(line)["messages"][0]["content"] == train[i].text
               for line, i in zip(parts[1].read_text().splitlines(), ids(parts[1])))
    tokenizer = AutoTokenizer.from_pretrained(chat_dir)
    docs = load_documents(str(tmp_path / "chat"), tokenizer)  # the folder of the shards' files is one source
    assert len(docs) == 8 and docs == load_documents(f"{parts[0]},{parts[1]}", tokenizer)

    # another shard's file is refused, and so is a shard that is not K/N with 0 <= K < N
    assert main([*common, "--out", str(parts[1]), "--samples", "5", "--shard", "0/2"]) == 2
    assert "another shard" in capsys.readouterr().err
    for bad in ("2/2", "1", "a/b", "-1/2"):
        assert main([*common, "--out", str(tmp_path / "bad.jsonl"), f"--shard={bad}"]) == 2
        assert "shard must be K/N with 0 <= K < N" in capsys.readouterr().err


def test_write_prompts(tmp_path, capsys):
    path = tmp_path / "held_out.jsonl"
    assert main(["generate-data", "--write-prompts", str(path), "--split", "held_out"]) == 0
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records and all(set(r) >= {"prompt", "id"} for r in records)
    assert [r["prompt"] for r in records] == [p.text for p in build_prompts("held_out")]
    assert f"wrote {len(records)} held_out prompts" in capsys.readouterr().out


def test_continue_from_writes_teacher_continuations_of_training_openings_only(chat_dir, tmp_path, capsys):
    """--continue-from: each record is a training document's opening and the teacher's continuation of it;
    no held-out document's opening is continued (evaluation continues those); resumes, refuses another source."""
    from linearize.recipes.data import split_documents

    src = tmp_path / "docs"
    src.mkdir()
    docs = {f"d{i:02d}.txt": " ".join(f"w{2 + (i * 7 + j * (i % 5 + 1)) % 90}" for j in range(12)) for i in range(40)}
    docs["short.txt"] = "w5 w6 w7"  # not longer than its opening: skipped
    for name, text in docs.items():
        (src / name).write_text(text)
    out = tmp_path / "text.jsonl"
    common = ["generate-data", str(chat_dir), "--out", str(out), "--continue-from", str(src), "--opening-tokens", "4",
              "--held-out-percent", "30", "--batch-size", "4", "--max-new-tokens", "3"]
    assert main([*common, "--samples", "8"]) == 0
    assert "8 continuations" in capsys.readouterr().out
    records = [json.loads(line) for line in out.read_text().splitlines()]
    train, held = split_documents(load_documents(str(src)), 30)
    assert len(held) >= 5  # the split has both sides, so the check below can fail
    openings = lambda texts: {" ".join(t.split()[:4]) for t in texts if len(t.split()) > 4}  # noqa: E731
    got = {" ".join(r["text"].split()[:4]) for r in records}
    assert len(got) == 8 and got <= openings(train) and not got & (openings(held) - openings(train))
    assert all(len(r["text"].split()) > 4 for r in records)  # the continuation follows the opening
    tokenizer = AutoTokenizer.from_pretrained(chat_dir)
    assert load_documents(str(out), tokenizer) == [r["text"] for r in records]  # a --data source as written

    with open(out, "a") as f:  # a kill mid-write: the half line goes, the run continues after the last id
        f.write('{"text": "w2 w')
    assert main([*common, "--samples", "12"]) == 0
    assert "resumed with 8" in capsys.readouterr().out
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert len(ids) == 12 and ids == sorted(set(ids))
    other = tmp_path / "other"
    other.mkdir()
    for i in range(40):  # as many openings as the first source's, none of them the same
        (other / f"a{i:02d}.txt").write_text(" ".join(f"w{96 - (i + j) % 40}" for j in range(12)))
    common[common.index(str(src))] = str(other)
    assert main([*common, "--samples", "13"]) == 2
    assert "another prompt set, source or split" in capsys.readouterr().err
    assert main([*common, "--out", str(tmp_path / "new.jsonl"), "--opening-tokens", "20"]) == 2
    assert "longer than --opening-tokens 20" in capsys.readouterr().err


def test_unconditional_writes_the_teachers_own_text_from_its_start_token(chat_dir, tmp_path, capsys):
    """--unconditional: every sample starts from the model's start token alone and holds only what the teacher
    wrote (the token is not in the text); batches draw different text; the file is a --data source; resumes;
    refuses --continue-from and --split beside it, and a model with no start token."""
    from types import SimpleNamespace

    out = tmp_path / "free.jsonl"
    common = ["generate-data", str(chat_dir), "--out", str(out), "--unconditional", "--batch-size", "4",
              "--max-new-tokens", "6", "--temperature", "1"]
    assert main([*common, "--samples", "8"]) == 0
    assert "8 unconditional samples" in capsys.readouterr().out
    records = [json.loads(line) for line in out.read_text().splitlines()]
    texts = [r["text"] for r in records]
    assert [r["id"] for r in records] == list(range(8))
    assert all(t.split() and "<s>" not in t for t in texts) and len(set(texts)) >= 4
    tokenizer = AutoTokenizer.from_pretrained(chat_dir)
    assert load_documents(str(out), tokenizer) == texts
    assert main([*common, "--samples", "12"]) == 0
    assert "resumed with 8" in capsys.readouterr().out
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == list(range(12))
    assert main([*common, "--continue-from", str(tmp_path)]) == 2
    assert "pass one" in capsys.readouterr().err
    assert main([*common, "--split", "held_out"]) == 2
    assert "--unconditional writes text, not answers to prompts" in capsys.readouterr().err

    model = lambda bos: SimpleNamespace(generation_config=SimpleNamespace(bos_token_id=bos))  # noqa: E731
    assert start_openings(model(5), SimpleNamespace(bos_token_id=1))[0].ids == (5,)  # the model's own first
    assert start_openings(model(None), SimpleNamespace(bos_token_id=1))[3].ids == (1,)
    with pytest.raises(UserError, match="names one"):
        start_openings(model(None), SimpleNamespace(bos_token_id=None))
