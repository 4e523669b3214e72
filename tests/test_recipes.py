"""Recipes on a tiny model on CPU: data sources and packing, attention transfer, KD with LoRA and
full fine-tune, merge, exact resume, NaN guard, metrics and plots, evaluation."""

import dataclasses
import json
import math
import random
import time

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

import linearize
from linearize.recipes.data import DataConfig, is_held_out, load_documents, pack, split_documents, stdlib_documents
from linearize.recipes.distill import DistillConfig, attach_lora, attention_transfer_loss, distill, make_kd_loss
from linearize.recipes.evaluate import evaluate_all, format_table, passkey_prompt
from linearize.recipes.kd import unwrap
from linearize.recipes.train import TrainConfig, TrainingDiverged, rows_for_step, train_stage

from conftest import tiny_model


@pytest.fixture(scope="module")
def tokenizer():
    vocab = {"<pad>": 0, "<s>": 1, **{f"w{i}": i for i in range(2, 96)}, "</s>": 96}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def corpus(n_docs=60, seed=0):
    """Documents with learnable structure (arithmetic progressions of word ids)."""
    g = torch.Generator().manual_seed(seed)
    docs = []
    for _ in range(n_docs):
        start, step, n = (torch.randint(2, 90, (3,), generator=g) % torch.tensor([88, 5, 40])).tolist()
        docs.append(" ".join(f"w{2 + (start + i * (step + 1)) % 90}" for i in range(20 + n)))
    return docs


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n\n".join(corpus()))
    return path


def test_sources_txt_jsonl_parquet_folder(tmp_path, tokenizer):
    docs = corpus(6)
    (tmp_path / "a.txt").write_text("\n\n\n".join(docs))
    assert load_documents(str(tmp_path / "a.txt")) == docs
    with open(tmp_path / "b.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    assert load_documents(str(tmp_path / "b.jsonl")) == docs
    import datasets

    datasets.Dataset.from_dict({"text": docs}).to_parquet(str(tmp_path / "c.parquet"))
    assert load_documents(str(tmp_path / "c.parquet")) == docs
    folder = tmp_path / "docs"
    folder.mkdir()
    for i, d in enumerate(docs):
        (folder / f"{i}.rst").write_text(d)
    assert sorted(load_documents(str(folder))) == sorted(docs)
    chat = tmp_path / "chat"  # a folder of JSONL files (generate-data's shards): their records in file order
    chat.mkdir()
    for i, part in enumerate((docs[:2], docs[2:], [])):
        (chat / f"part-{i}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
    assert load_documents(str(chat)) == docs
    with pytest.raises(ValueError, match="unsupported data file"):
        (tmp_path / "x.csv").write_text("a,b")
        load_documents(str(tmp_path / "x.csv"))


def test_chat_records_use_the_template(smollm2, tmp_path):
    _, tok = smollm2
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n"
                    + json.dumps({"prompt": "2+2?", "response": "4"}) + "\n")
    docs = load_documents(str(path), tok)
    assert "<|im_start|>user\nhi<|im_end|>" in docs[0] and "<|im_start|>assistant\n4" in docs[1]


def test_stdlib_docs_is_a_real_local_corpus():
    docs = stdlib_documents()
    assert len(docs) > 100 and sum(map(len, docs)) > 1_000_000


def test_held_out_split_is_fixed_and_disjoint():
    docs = corpus(200)
    train, held = split_documents(docs, 10.0)
    assert set(train).isdisjoint(held) and len(train) + len(held) == len(docs)
    assert 5 <= len(held) <= 40
    train2, held2 = split_documents(list(reversed(docs)), 10.0)  # order does not matter
    assert sorted(held2) == sorted(held) and all(is_held_out(d, 10.0) for d in held)


def _folder(path, docs):
    path.mkdir()
    for i, d in enumerate(docs):
        (path / f"{i}.txt").write_text(d)
    return str(path)


def test_data_mix_weights_give_row_shares_and_a_split_per_source(tmp_path, tokenizer):
    from linearize.recipes.data import prepare_mix

    big, small_ = _folder(tmp_path / "big", corpus(120, seed=1)), _folder(tmp_path / "small", corpus(30, seed=2))
    plain = [prepare_mix(DataConfig(data=s, seq_len=16, held_out_percent=10), tokenizer) for s in (big, small_)]
    n_big, n_small = (r["input_ids"].shape[0] for r, _, _ in plain)
    assert n_big > 3 * n_small  # sizes ~4:1; weights 1:3 swap them, the small one repeated
    rows, held, rec = prepare_mix(DataConfig(data=f"{big}@1,{small_}@3", seq_len=16, held_out_percent=10), tokenizer)
    total = n_big + n_small
    assert rows["input_ids"].shape == (total, 16) and [r["rows"] for r in rec] == [round(total / 4), round(3 * total / 4)]
    assert rec[1]["repeats"] > 2 and rec[0]["repeats"] < 0.5 and rec[0]["weight"] == 1.0
    # the rows come from the right sources: the big one's are a subset of its rows, the small one's cover all of its rows
    big_rows = {tuple(r) for r in plain[0][0]["input_ids"].tolist()}
    assert all(tuple(r) in big_rows for r in rows["input_ids"][: rec[0]["rows"]].tolist())
    assert {tuple(r) for r in rows["input_ids"][rec[0]["rows"]:].tolist()} == {tuple(r) for r in plain[1][0]["input_ids"].tolist()}
    # per source, by hash, as alone; taken one of each source in turn (the evaluation's first rows span the mix)
    a, b = plain[0][1], plain[1][1]
    assert sorted(held) == sorted(a + b)
    n = min(len(a), len(b))
    assert held[: 2 * n] == [d for pair in zip(a, b) for d in pair]
    again, _, _ = prepare_mix(DataConfig(data=f"{big}@1,{small_}@3", seq_len=16, held_out_percent=10), tokenizer)
    assert torch.equal(again["input_ids"], rows["input_ids"])  # deterministic
    concat, _, rec = prepare_mix(DataConfig(data=f"{big},{small_}", seq_len=16, held_out_percent=10), tokenizer)
    assert torch.equal(concat["input_ids"], torch.cat([plain[0][0]["input_ids"], plain[1][0]["input_ids"]]))
    assert [r["rows"] for r in rec] == [n_big, n_small]


def test_data_single_source_is_unchanged(data_file, tokenizer):
    from linearize.recipes.data import prepare_mix, tokenize

    rows, held, rec = prepare_mix(DataConfig(data=str(data_file), seq_len=32, held_out_percent=15), tokenizer)
    train, held_before = split_documents(load_documents(str(data_file)), 15)
    ids, pos = pack([tokenizer(d, add_special_tokens=False).input_ids for d in train], 32, tokenizer.eos_token_id)
    assert torch.equal(rows["input_ids"], ids) and torch.equal(rows["position_ids"], pos) and held == held_before
    assert tokenize(train, tokenizer, batch=7) == [tokenizer(d, add_special_tokens=False).input_ids for d in train]
    assert rec == [{"source": str(data_file), "weight": None, "documents": 60, "held_out_documents": len(held),
                    "tokens": ids.numel(), "rows": ids.shape[0], "share": 1.0, "repeats": 1.0}]


def test_long_rows_pack_the_same_documents_into_one_context_each_and_mix_alike(tmp_path, tokenizer):
    from linearize.recipes.data import prepare_mix

    big, tiny_ = _folder(tmp_path / "big", corpus(120, seed=1)), _folder(tmp_path / "tiny", corpus(6, seed=2))
    short, _, _ = prepare_mix(DataConfig(data=big, seq_len=16, held_out_percent=10), tokenizer)
    rows, _, _ = prepare_mix(DataConfig(data=big, seq_len=16, held_out_percent=10, long_seq_len=64), tokenizer)
    long = rows.pop("long")
    assert torch.equal(rows["input_ids"], short["input_ids"])  # the short rows are unchanged
    n = long["input_ids"].shape[0]
    assert long["input_ids"].shape == (n, 64) and n == short["input_ids"].shape[0] // 4
    # the same token stream, cut 4x longer: long row i is short rows 4i..4i+3; positions run over
    # the whole row (no restart at a document's EOS), one context of 64 tokens
    assert torch.equal(long["input_ids"], short["input_ids"][: 4 * n].reshape(n, 64))
    assert torch.equal(long["position_ids"], torch.arange(64).expand(n, 64))
    eos = tokenizer.eos_token_id
    # and that stream is the training documents themselves, each followed by EOS, in order
    train, _ = split_documents(load_documents(big), 10)
    stream = [t for d in train for t in tokenizer(d, add_special_tokens=False).input_ids + [eos]]
    assert long["input_ids"].flatten().tolist() == stream[: 64 * n]
    assert (long["input_ids"][:, :-1] == eos).any()  # documents do end inside the rows
    # a mix: a source too small for one long row is left out of them (not an error); weights apply
    rows, _, rec = prepare_mix(DataConfig(data=f"{big}@1,{tiny_}@1", seq_len=16, held_out_percent=10,
                                          long_seq_len=256), tokenizer)
    assert rows["long"]["input_ids"].shape[1] == 256 and rec[1]["rows"] > 0
    with pytest.raises(ValueError, match="no source holds 4096 training tokens"):
        prepare_mix(DataConfig(data=tiny_, seq_len=16, held_out_percent=50, long_seq_len=4096), tokenizer)
    with pytest.raises(ValueError, match="long_seq_len must be a multiple of seq_len"):
        DataConfig(seq_len=16, long_seq_len=40)


def test_long_min_doc_tokens_makes_the_long_rows_of_long_documents_alone(tmp_path, tokenizer):
    """--long-min-doc-tokens: the long rows are the long training documents alone, packed (each followed by
    EOS) into rows whose keys older than the window are mostly the same document's; a source without
    enough of them drops out of the long rows (not of the short ones)."""
    from linearize.recipes.data import prepare_mix

    g = torch.Generator().manual_seed(5)
    long_docs = [" ".join(f"w{int(x)}" for x in torch.randint(2, 90, (150,), generator=g)) for _ in range(12)]
    mixed = _folder(tmp_path / "mixed", corpus(60, seed=3) + long_docs)
    cfg = DataConfig(data=mixed, seq_len=16, held_out_percent=10, long_seq_len=64, long_min_doc_tokens=100)
    rows, _, rec = prepare_mix(cfg, tokenizer)
    long = rows["long"]["input_ids"]
    eos = tokenizer.eos_token_id
    train, _ = split_documents(load_documents(mixed), 10)
    kept = [t for t in (tokenizer(d, add_special_tokens=False).input_ids for d in train) if len(t) >= 100]
    assert 8 <= len(kept) <= 12  # the long documents in training (a few held out), no short one
    stream = [x for t in kept for x in [*t, eos]]
    n = len(stream) // 64
    assert long.shape == (n, 64) and long.flatten().tolist() == stream[: 64 * n]
    assert torch.equal(rows["long"]["position_ids"], torch.arange(64).expand(n, 64))
    assert (rec[0]["long_rows"], rec[0]["long_tokens"]) == (n, 64 * n)
    # without it the long rows are the whole stream, the 60 short documents in it too
    everything, _, _ = prepare_mix(dataclasses.replace(cfg, long_min_doc_tokens=0), tokenizer)
    assert torch.equal(everything["input_ids"], rows["input_ids"])  # the short rows do not change
    assert everything["long"]["input_ids"].shape[0] > n
    # a mix: the source of short documents alone keeps its short rows and gives no long row
    shorts = _folder(tmp_path / "shorts", corpus(60, seed=4))
    rows, _, rec = prepare_mix(dataclasses.replace(cfg, data=f"{mixed}@1,{shorts}@1"), tokenizer)
    assert rec[1]["rows"] > 0 and (rec[1]["long_rows"], rec[1]["long_tokens"]) == (0, 0)
    assert rows["long"]["input_ids"].shape[0] == rec[0]["long_rows"] > 0
    with pytest.raises(ValueError, match="in documents of at least 100 tokens for one long row"):
        prepare_mix(dataclasses.replace(cfg, data=shorts), tokenizer)
    with pytest.raises(ValueError, match="long_min_doc_tokens must be >= 0"):
        DataConfig(long_min_doc_tokens=-1)
    with pytest.raises(ValueError, match="long_seq_len is 0"):
        DataConfig(long_seq_len=0, long_min_doc_tokens=8192)


def test_gdn_hybrid_preset_ends_on_8k_rows_unless_told_otherwise(data_file, tmp_path, tokenizer):
    """--preset gdn-hybrid's long-row stage (8192-token rows) is resolved by distill from the preset when
    --long-seq-len is unset; data too small for one such row fails at once with what to pass, and
    --long-seq-len 0 leaves the stage out."""
    from linearize.recipes.distill import distill

    cfg = DistillConfig(preset="gdn-hybrid", stage1_steps=0, stage2_steps=1)
    with pytest.raises(ValueError, match="--preset gdn-hybrid ends stage 2 on rows of 8192 tokens.*--long-seq-len 0"):
        distill(tiny_model("llama"), tokenizer, cfg, DataConfig(data=str(data_file), seq_len=300), TrainConfig(steps=1),
                tmp_path / "x")
    with pytest.raises(ValueError, match="no source holds 8192 training tokens for one long row; lower --long-seq-len"):
        distill(tiny_model("llama"), tokenizer, cfg, DataConfig(data=str(data_file), seq_len=32), TrainConfig(steps=1),
                tmp_path / "x")
    assert not (tmp_path / "x").exists()  # nothing written
    out = distill(tiny_model("llama"), tokenizer, cfg, DataConfig(data=str(data_file), seq_len=32, long_seq_len=0),
                  TrainConfig(steps=1, batch_size=2, save_every=0), tmp_path / "y")
    assert "stage3" not in out and out["data"]["long_seq_len"] == 0


def test_eval_held_out_scores_a_training_source_s_own_held_out_documents(tmp_path, tokenizer):
    """distill --eval-held-out SOURCE: the documents of SOURCE that --data held out (the same split,
    whatever the mix), as a corpus of their own; none of its training documents."""
    import argparse

    from linearize.recipes.cli import _eval_inputs
    from linearize.recipes.data import prepare_mix

    a, b = _folder(tmp_path / "a", corpus(120, seed=1)), _folder(tmp_path / "b", corpus(40, seed=2))
    _, held_mix, _ = prepare_mix(DataConfig(data=f"{a}@1,{b}@3", seq_len=16, held_out_percent=10), tokenizer)
    args = argparse.Namespace(eval_data=None, eval_held_out=a, held_out_percent=10, chat_prompts=None)
    corpora, _ = _eval_inputs(args, tokenizer, has_teacher=True)
    docs_a = set(load_documents(a))
    assert list(corpora) == ["a-held-out"] and corpora["a-held-out"] == [d for d in held_mix if d in docs_a]
    assert 0 < len(corpora["a-held-out"]) < len(docs_a) / 4
    args.held_out_percent = 0.001
    with pytest.raises(Exception, match="none of its documents is held out"):
        _eval_inputs(args, tokenizer, has_teacher=True)


@pytest.mark.parametrize("spec, message", [
    ("{f}@x", r"data item '.*@x': bad weight 'x'"),
    ("{f}@-1", r"bad weight '-1'"),
    ("{f},,{f}", "an empty item"),
    ("{f},{f}@2", "named twice"),
    ("{f},/nowhere/docs.txt", "data not found: /nowhere/docs.txt"),
    ("{f},{empty}", "no .txt/.rst/.md or .jsonl files under .*empty"),
], ids=["weight-not-a-number", "negative-weight", "empty-item", "twice", "missing", "no-documents"])
def test_data_mix_bad_items_fail_naming_the_item(data_file, tmp_path, tokenizer, spec, message):
    from linearize.recipes.data import prepare_mix

    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=message):
        prepare_mix(DataConfig(data=spec.format(f=data_file, empty=tmp_path / "empty"), seq_len=16), tokenizer)


def test_pack_restarts_positions_at_document_starts():
    ids, pos = pack([[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]], seq_len=4, eos_id=1)
    # stream: 5 6 7 1 | 8 9 1 10 | 11 12 13 14 | (1 dropped)
    assert ids.tolist() == [[5, 6, 7, 1], [8, 9, 1, 10], [11, 12, 13, 14]]
    assert pos.tolist() == [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 2, 3]]


def test_data_order_is_a_function_of_the_step():
    a = torch.cat([rows_for_step(s, 10, 4, seed=3) for s in range(5)])
    assert torch.equal(a, torch.cat([rows_for_step(s, 10, 4, seed=3) for s in range(5)]))
    first_epoch = torch.cat([rows_for_step(s, 10, 5, seed=3) for s in range(2)])
    assert sorted(first_epoch.tolist()) == list(range(10))  # each epoch is a permutation


def small(**kw):
    base = dict(batch_size=4, grad_accum=1, warmup_steps=2, save_every=2, seed=0)
    return TrainConfig(**{**base, **kw})


def rows_from(tokenizer, seq_len=32):
    from linearize.recipes.data import tokenize

    ids, pos = pack(tokenize(corpus(), tokenizer), seq_len, tokenizer.eos_token_id)
    return {"input_ids": ids, "position_ids": pos}


def converted_tiny(cfg=None):
    model = tiny_model("llama")
    return linearize.linearize(model, cfg or linearize.LinearAttentionConfig(feature_map="hedgehog", window=4))


def test_attention_transfer_trains_only_new_parameters_and_lowers_mse(tokenizer, tmp_path):
    from linearize.recipes.distill import new_parameter_names, set_trainable

    model = converted_tiny()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    names = new_parameter_names(model)
    assert names and all("feature_map" in n or "window_log_gamma" in n for n in names)
    set_trainable(model, names)
    rows = rows_from(tokenizer)
    fixed = {k: v[:8] for k, v in rows.items()}
    with torch.no_grad():
        start = attention_transfer_loss(model, fixed).item()
    result = train_stage("s1", model, attention_transfer_loss, rows, small(steps=12, lr=5e-2), tmp_path)
    with torch.no_grad():
        end = attention_transfer_loss(model, fixed).item()
    assert end < 0.8 * start
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 12
    for n, p in model.named_parameters():
        changed = not torch.equal(p, before[n])
        assert changed == (n in names), n
    assert (tmp_path / "loss_s1.png").stat().st_size > 1000
    assert result["tokens"] == 12 * 4 * 32


def test_kd_teacher_is_the_original_weights_with_adapter_and_conversion_off(tokenizer):
    from peft import LoraConfig, get_peft_model

    original = tiny_model("llama")
    rows = rows_from(tokenizer)
    batch = {k: v[:2] for k, v in rows.items()}
    with torch.no_grad():
        teacher_logits = original(**batch, use_cache=False).logits
    model = linearize.linearize(original, linearize.LinearAttentionConfig())
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False))
    with torch.no_grad(), peft_model.disable_adapter(), linearize.attention_mode(peft_model, "softmax"):
        torch.testing.assert_close(peft_model(**batch, use_cache=False).logits, teacher_logits)
    loss = make_kd_loss(DistillConfig())(peft_model, batch)
    assert loss.item() > 0
    loss.backward()
    assert any(p.grad is not None for n, p in peft_model.named_parameters() if "lora_" in n)


def _attention_outputs(model, layers, run) -> list[torch.Tensor]:
    """The outputs of decoder ``layers``' attention modules while ``run()`` runs (forward hooks)."""
    from conftest import attention

    got = []
    hooks = [attention(model, i).register_forward_hook(lambda m, a, out: got.append(out[0].detach()))
             for i in layers]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return got


@pytest.mark.parametrize("chunk", [0, 8], ids=["plain", "chunked"])
@pytest.mark.parametrize("teacher_kind", ["lora", "separate"])
def test_kd_with_transfer_weight_adds_each_layers_mse_to_the_teachers_attention(tokenizer, chunk, teacher_kind):
    """--transfer-weight W: stage 2's loss is the KD loss plus W times the layers' mean MSE between each
    converted layer's output (on the student's own input) and the teacher's attention output at that
    layer (on the teacher's). The target is the teacher's: with LoRA on, not the softmax of the adapted
    projections, a target that moves with the weights the loss trains (it diverged, 2026-11-30c).
    The parts are named for the metrics, the layers go back to "linear", and FSDP is refused for it."""
    import copy

    original = tiny_model("llama")
    plain_teacher = copy.deepcopy(original).eval()
    rows = rows_from(tokenizer)
    batch = {k: v[:2] for k, v in rows.items()}
    cfg = DistillConfig(preset="linear", kd_chunk_size=chunk)
    with_w = DistillConfig(preset="linear", kd_chunk_size=chunk, transfer_weight=0.5)
    model = linearize.linearize(original, cfg.method_config())
    layers = model.config.linearize["layers"]
    if teacher_kind == "lora":  # the student is its own teacher, adapters off; they are on and nonzero
        model = attach_lora(model, cfg)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.05)
        teacher = None
    else:
        teacher = copy.deepcopy(plain_teacher).requires_grad_(False)
    kd_fn, joint_fn = make_kd_loss(cfg, teacher), make_kd_loss(with_w, teacher)
    kd, joint = kd_fn(model, batch), joint_fn(model, batch)
    with torch.no_grad():
        want = _attention_outputs(plain_teacher, layers, lambda: plain_teacher(**batch, use_cache=False))
        own = _attention_outputs(unwrap(model), layers, lambda: model(**batch, use_cache=False))
    transfer = torch.stack([torch.nn.functional.mse_loss(o.float(), w.float()) for o, w in zip(own, want)]).mean()
    assert transfer > 1e-3 and not hasattr(kd_fn, "parts")
    torch.testing.assert_close(joint_fn.parts["transfer"], transfer)
    torch.testing.assert_close(joint_fn.parts["kd"], kd.detach())
    torch.testing.assert_close(joint.detach(), kd.detach() + 0.5 * transfer)
    converted = [m for m in unwrap(model).modules() if hasattr(m, "mode")]
    assert converted and all(m.mode == "linear" and not hasattr(m, "attention_target") for m in converted)
    # the MSE's gradient reaches the feature maps beyond what KD gives them
    fm = next(p for n, p in model.named_parameters() if "feature_map_q" in n)
    kd.backward()
    g_kd, fm.grad = fm.grad.clone(), None
    joint.backward()
    assert not torch.allclose(fm.grad, g_kd, rtol=1e-3)
    assert kd_fn.shardable and not joint_fn.shardable
    with pytest.raises(ValueError, match="transfer_weight must be >= 0"):
        DistillConfig(transfer_weight=-1)
    with pytest.raises(ValueError, match="drop --transfer-weight"):
        DistillConfig(preset="swa", transfer_weight=1)


def test_transfer_weight_with_fsdp_is_refused_before_stage_1(tokenizer, data_file, tmp_path, monkeypatch):
    """Sharded over processes (--fsdp), stage 2 could not read the transfer term: the run stops before
    it trains or writes anything, not after stage 1."""
    import types

    import linearize.recipes.distill as distill_module

    monkeypatch.setattr(distill_module, "process_state", lambda: types.SimpleNamespace(is_main_process=True, num_processes=2))
    cfg = DistillConfig(preset="linear", transfer_weight=1.0, stage1_steps=2, stage2_steps=2)
    data = DataConfig(data=str(data_file), seq_len=32, held_out_percent=15)
    with pytest.raises(ValueError, match="drop --fsdp"):
        distill(tiny_model("llama"), tokenizer, cfg, data, small(steps=1, fsdp=True), tmp_path / "run", log=lambda *a: None)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("finetune", ["lora", "full", "attention"])
def test_distill_end_to_end_and_merge(tokenizer, data_file, tmp_path, finetune):
    model = tiny_model("qwen3")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = DistillConfig(preset="lolcats", window=4, stage1_steps=6, stage2_steps=6, finetune=finetune, lora_rank=4)
    data = DataConfig(data=str(data_file), seq_len=32, held_out_percent=15)
    summary = distill(model, tokenizer, cfg, data, small(steps=1, lr=1.0), tmp_path / "run", log=lambda *a: None)
    run = tmp_path / "run"
    assert summary["stage1"]["steps"] == 6 and summary["stage2"]["steps"] == 6
    assert (run / "loss_stage1_attention_transfer.png").exists() and (run / "loss_stage2_kd.png").exists()
    stages = {json.loads(l)["stage"] for l in (run / "metrics.jsonl").read_text().splitlines()}
    assert stages == {"stage1_attention_transfer", "stage2_kd"}
    loaded = AutoModelForCausalLM.from_pretrained(run).eval()
    assert not any("lora" in n for n, _ in loaded.named_parameters())  # merged
    assert loaded.config.linearize["window"] == 4
    # what stage 2 moved: every weight (full), or the attention modules' alone (LoRA merged into
    # q/k/v/o; attention: all of each layer's attention module, at full rank)
    weights = dict(loaded.named_parameters())
    moved = {n for n in before if not torch.equal(weights[n], before[n])}
    attention = {n for n in before if ".self_attn." in n}
    if finetune == "full":
        assert any(".mlp." in n for n in moved) and "model.embed_tokens.weight" in moved, sorted(moved)
    else:
        assert moved <= attention and any(n.endswith("q_proj.weight") for n in moved), sorted(moved - attention)
    if finetune == "attention":
        assert any(n.endswith("q_norm.weight") for n in moved)  # beyond LoRA's targets: the module's norms too
    ids = torch.randint(2, 90, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)
    held = json.loads((run / "held_out.json").read_text())
    assert sorted(held) == sorted(split_documents(load_documents(str(data_file)), 15)[1])
    assert json.loads((run / "distill.json").read_text())["data_sources"] == summary["data_sources"]
    assert summary["data_sources"][0]["held_out_documents"] == len(held)


def test_lora_stage_without_stage_1_is_a_function_of_the_seed(tokenizer, data_file, tmp_path):
    # the adapters' A matrices are drawn when stage 2 starts: a run without stage 1 (no train_stage
    # before it to seed) must not draw them from whatever state the process's generator is in
    cfg = DistillConfig(preset="lolcats", window=4, stage1_steps=0, stage2_steps=3, finetune="lora", lora_rank=4,
                        stage2_lr=0.05)
    data = DataConfig(data=str(data_file), seq_len=32, held_out_percent=15)
    runs = []
    for i, draws in enumerate((1, 7)):
        torch.manual_seed(0)
        model = tiny_model("llama")
        torch.rand(draws)  # another process state when the stage starts
        distill(model, tokenizer, cfg, data, small(steps=1, lr=1.0, warmup_steps=1), tmp_path / str(i), log=lambda *a: None)
        runs.append([json.loads(l)["loss"] for l in (tmp_path / str(i) / "metrics.jsonl").read_text().splitlines()])
    assert len(runs[0]) == 3 and runs[0][1] != runs[0][0]
    assert runs[1] == runs[0]


def stage1_model():
    """The same converted tiny model every call, its conversion's weights trainable (stage 1's)."""
    from linearize.recipes.distill import new_parameter_names, set_trainable

    torch.manual_seed(0)
    m = converted_tiny()
    set_trainable(m, new_parameter_names(m))
    return m


def test_resume_gives_the_same_losses_as_an_uninterrupted_run(tokenizer, tmp_path):
    rows = rows_from(tokenizer)
    cfg = small(steps=6, lr=1e-2, save_every=2)
    train_stage("s1", stage1_model(), attention_transfer_loss, rows, cfg, tmp_path / "a")
    straight = [json.loads(l)["loss"] for l in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]

    calls = {"n": 0}

    def interrupted(model, batch):
        calls["n"] += 1
        if calls["n"] == 6:  # dies during step 6 (after the step-4 checkpoint, mid-way to the next)
            raise KeyboardInterrupt
        return attention_transfer_loss(model, batch)

    with pytest.raises(KeyboardInterrupt):
        train_stage("s1", stage1_model(), interrupted, rows, cfg, tmp_path / "b")
    assert json.loads((tmp_path / "b" / "checkpoints" / "s1" / "meta.json").read_text())["step"] == 4
    train_stage("s1", stage1_model(), attention_transfer_loss, rows, cfg, tmp_path / "b", resume=True)
    resumed = [json.loads(l) for l in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in resumed] == [1, 2, 3, 4, 5, 6]
    assert [m["loss"] for m in resumed] == pytest.approx(straight, rel=1e-6, abs=1e-9)


def test_lr_scale_trains_its_weights_at_their_own_rate_and_resumes_with_it(tokenizer, tmp_path):
    """train_stage(lr_scale=...): one parameter group per factor of the schedule's rate; a factor of 0
    holds its weights to the bit while the others learn, and a resumed run keeps the groups (the same
    losses as one run straight through)."""
    from linearize.recipes.distill import new_parameter_names

    rows = rows_from(tokenizer)
    cfg = small(steps=4, lr=1e-2, save_every=2)
    names = new_parameter_names(stage1_model())
    held = {n: 0.0 for n in names if ".layers.0." in n}
    scale = {**held, **{n: 3.0 for n in names if ".layers.1." in n}}
    assert held and len(scale) < len(names)
    model = stage1_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train_stage("s1", model, attention_transfer_loss, rows, cfg, tmp_path / "a", lr_scale=scale)
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and not moved & set(held) and moved - set(scale)  # the held ones stay, the rest learn
    straight = [json.loads(l)["loss"] for l in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    calls = {"n": 0}

    def interrupted(m, batch):
        calls["n"] += 1
        if calls["n"] == 4:  # dies during step 4, after the step-2 checkpoint
            raise KeyboardInterrupt
        return attention_transfer_loss(m, batch)

    with pytest.raises(KeyboardInterrupt):
        train_stage("s1", stage1_model(), interrupted, rows, cfg, tmp_path / "b", lr_scale=scale)
    train_stage("s1", stage1_model(), attention_transfer_loss, rows, cfg, tmp_path / "b", resume=True, lr_scale=scale)
    resumed = [json.loads(l)["loss"] for l in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert resumed == pytest.approx(straight, rel=1e-6, abs=1e-9)
    with pytest.raises(ValueError, match="lr_scale names weights the stage does not train"):
        train_stage("s1", stage1_model(), attention_transfer_loss, rows, cfg, tmp_path / "c", lr_scale={"model.norm.weight": 2.0})


def test_nan_loss_stops_clearly_and_keeps_the_last_good_checkpoint(tokenizer, tmp_path):
    model = stage1_model()
    calls = {"n": 0}

    def loss_fn(m, batch):
        calls["n"] += 1
        loss = attention_transfer_loss(m, batch)
        return loss * float("nan") if calls["n"] == 3 else loss

    with pytest.raises(TrainingDiverged, match=r"loss became nan at step 2.*last good checkpoint.*--resume"):
        train_stage("s1", model, loss_fn, rows_from(tokenizer), small(steps=6, lr=1e-2, save_every=2), tmp_path)
    ckpt = tmp_path / "checkpoints" / "s1"
    assert json.loads((ckpt / "meta.json").read_text()) == {"step": 2, "done": False}
    from safetensors.torch import load_file

    assert all(torch.isfinite(t).all() for t in load_file(str(ckpt / "trainable.safetensors")).values())


def test_skipped_steps_make_no_update_are_recorded_and_have_a_limit(tokenizer, tmp_path):
    """--max-skipped-steps: a non-finite loss or gradient norm skips the step (no update, recorded);
    more of them in a row than allowed stops the stage like the default does at the first one."""
    model = stage1_model()
    trainable = [p for p in model.parameters() if p.requires_grad]
    calls, seen = {"n": 0}, {}

    def loss_fn(m, batch):  # call 3 (step 3): nan loss; calls 5, 6 (steps 5, 6): finite loss, nan gradient
        calls["n"] += 1
        seen[calls["n"]] = [p.detach().clone() for p in trainable]
        loss = attention_transfer_loss(m, batch)
        if calls["n"] == 3:
            return loss * float("nan")
        if calls["n"] in (5, 6):
            return loss + torch.sqrt(trainable[0].flatten()[0] * 0.0)  # value + 0, gradient 0 * inf = nan
        return loss

    out = train_stage("s1", model, loss_fn, rows_from(tokenizer), small(steps=7, lr=1e-2, max_skipped_steps=2), tmp_path)
    assert out["skipped_steps"] == [3, 5, 6]
    unchanged = lambda a, b: all(torch.equal(x, y) for x, y in zip(seen[a], seen[b]))  # noqa: E731
    assert unchanged(3, 4) and unchanged(5, 6) and unchanged(6, 7)  # the skipped steps did not update
    assert not unchanged(1, 2) and not unchanged(4, 5)  # the others did
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("skipped")] == [3, 5, 6]
    assert "loss became nan" in rows[2]["skipped"] and "gradient norm became nan" in rows[4]["skipped"]
    assert rows[2]["loss"] is None and all(r["loss"] is not None for r in rows if not r.get("skipped"))
    assert all(torch.isfinite(p).all() for p in trainable)

    calls["n"] = 0
    model = stage1_model()
    trainable = [p for p in model.parameters() if p.requires_grad]

    def always_bad_from_3(m, batch):
        calls["n"] += 1
        loss = attention_transfer_loss(m, batch)
        return loss + torch.sqrt(trainable[0].flatten()[0] * 0.0) if calls["n"] >= 3 else loss

    with pytest.raises(TrainingDiverged, match=r"gradient norm became nan at step 4 \(3 steps in a row\).*--resume"):
        train_stage("s1", model, always_bad_from_3, rows_from(tokenizer), small(steps=7, lr=1e-2, max_skipped_steps=2),
                    tmp_path / "b")


def test_bf16_mixed_precision_and_gradient_checkpointing_run(tokenizer, tmp_path):
    from linearize.recipes.distill import set_trainable

    from accelerate.state import AcceleratorState

    teacher = tiny_model("llama")
    model = converted_tiny()
    set_trainable(model, [n for n, _ in model.named_parameters()])
    AcceleratorState._reset_state(True)  # accelerate keeps one precision per process
    try:
        out = train_stage("s", model, make_kd_loss(DistillConfig(), teacher), rows_from(tokenizer),
                          small(steps=2, lr=1e-3, mixed_precision="bf16", gradient_checkpointing=True), tmp_path)
    finally:
        AcceleratorState._reset_state(True)
    assert math.isfinite(out["final_loss"])
    assert model.is_gradient_checkpointing


def test_evaluation_reports_each_figure_beside_the_teacher(tokenizer, monkeypatch):
    from linearize.recipes import evaluate

    teacher = tiny_model("llama")
    student = converted_tiny()
    docs = corpus(8)
    zeroed = []  # each passkey call: was the student's linear branch zeroed (window only) while it ran?
    real = evaluate.passkey_accuracy

    def spy(model, *a, **kw):
        zeroed.append([bool((m.window_log_gamma <= -1e4).all()) for m in evaluate.window_layers(model)])
        return real(model, *a, **kw)

    monkeypatch.setattr(evaluate, "passkey_accuracy", spy)
    result = evaluate_all(student, teacher, tokenizer, docs, seq_len=32, max_rows=4, n_prompts=3, passkey_lengths=(64,), passkey_trials=2)
    assert 0 <= result["top1_agreement"] < 1 and result["perplexity"] > 1 and result["teacher_perplexity"] > 1
    assert 0 <= result["generation_prefix_agreement"] < 1
    assert set(result["passkey"]) == {"64"} and set(result["teacher_passkey"]) == {"64"}
    assert result["passkey_trials"] == {"64": 2} and "| passkey @ 64 tokens (2 trials) |" in format_table(result)
    # each trial kept, in order, for the student and the teacher: the rate is their share of "1"s
    for hits, rate in ((result["passkey_hits"], result["passkey"]), (result["teacher_passkey_hits"], result["teacher_passkey"])):
        assert set(hits) == {"64"} and len(hits["64"]) == 2 and set(hits["64"]) <= {"0", "1"}
        assert hits["64"].count("1") / 2 == rate["64"]
    s_only, t_only = evaluate.passkey_disagreements(result["passkey_hits"]["64"], result["teacher_passkey_hits"]["64"])
    assert f"| passkey @ 64 tokens: retrieved where the other did not | {s_only} | {t_only} |" in format_table(result)
    # the window hybrid's passkey once more with its linear branch zeroed, after the student's and the teacher's
    n = len(evaluate.window_layers(student))
    assert n and zeroed == [[False] * n, [], [True] * n]
    assert set(result["window_only"]["passkey"]) == {"64"} and result["window_only"]["passkey_trials"] == {"64": 2}
    assert len(result["window_only"]["passkey_hits"]["64"]) == 2
    assert "| window only: passkey @ 64 tokens (2 trials) |" in format_table(result)
    assert not any((m.window_log_gamma <= -1e4).any() for m in evaluate.window_layers(student))  # put back
    same = evaluate_all(teacher, teacher, tokenizer, docs, seq_len=32, max_rows=4, n_prompts=3, passkey_lengths=())
    assert same["top1_agreement"] == 1.0 and same["generation_exact_match"] == 1.0
    assert "| perplexity |" in format_table(result)


def test_recall_mask_marks_bigrams_seen_earlier_in_the_same_document():
    """A target completes a bigram seen before it in its own document; a document's first token, and
    a bigram seen only in the document before, are not hits."""
    from linearize.recipes.evaluate import recall_mask

    ids = torch.tensor([[5, 6, 7, 5, 6, 8, 6, 7, 5, 6]])
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 0, 1]])  # a second document opens at index 8
    # targets 6 7 5 6 8 6 7 5 6: (5,6) again at index 4, (6,7) again at 7; 5 opens a document, and
    # (5,6) at index 9 was seen only in the first document
    want = [False, False, False, True, False, False, True, False, False]
    assert recall_mask(ids, pos)[0].tolist() == want


def test_evaluation_splits_perplexity_into_recall_and_other_tokens(tokenizer):
    """Each corpus' perplexity splits into recall tokens (recall_mask) and the rest: the counts are the
    mask's, and the two classes recombine to the whole; a document that repeats itself has recall hits."""
    from linearize.recipes.data import pack, tokenize
    from linearize.recipes.evaluate import likelihood_metrics, recall_mask

    teacher, student = tiny_model("llama"), converted_tiny()
    docs = [d + " " + d for d in corpus(4)]  # each document twice over: its second half recalls its first
    r = likelihood_metrics(student, teacher, tokenizer, docs, seq_len=32, max_rows=3)
    ids, pos = pack(tokenize(docs, tokenizer), 32, tokenizer.eos_token_id)
    hits = int(recall_mask(ids[:3], pos[:3]).sum())
    assert r["recall"]["tokens"] == hits > 0 and r["recall"]["tokens"] + r["other"]["tokens"] == r["tokens"]
    for who in ("perplexity", "teacher_perplexity"):
        mixed = sum(r[k]["share"] * math.log(r[k][who]) for k in ("recall", "other"))
        assert math.exp(mixed) == pytest.approx(r[who], rel=1e-6)
    assert r["recall"]["perplexity_ratio"] == pytest.approx(r["recall"]["perplexity"] / r["recall"]["teacher_perplexity"])
    mask = recall_mask(ids[:3], pos[:3])
    with torch.no_grad():  # each model's recall-token perplexity, from its own per-token losses
        for who, m in (("perplexity", student), ("teacher_perplexity", teacher)):
            logits = m(input_ids=ids[:3], position_ids=pos[:3], use_cache=False).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:3, 1:], reduction="none")
            assert r["recall"][who] == pytest.approx(math.exp(nll[mask].mean().item()), rel=1e-4)
            assert r["other"][who] == pytest.approx(math.exp(nll[~mask].mean().item()), rel=1e-4)
    table = format_table(r)
    assert f"perplexity on recall tokens (bigram seen earlier in the document), {r['recall']['share']:.0%} of tokens" in table
    assert "| perplexity on other tokens," in table


def test_evaluation_splits_perplexity_by_document_position(tokenizer):
    """position_bands: each target's band is its own position id's (a document packed mid-row starts again
    in 0-63); likelihood_metrics' by_position figures are each model's perplexity over those targets, the
    bands partition the tokens, and the table shows them in one row."""
    from linearize.recipes.data import pack, tokenize
    from linearize.recipes.evaluate import likelihood_metrics, position_bands

    bands = position_bands(torch.tensor([[0, 1, 62, 63, 64, 255, 256, 0, 1023, 1024, 4096]]))
    assert {k: v[0].nonzero().flatten().tolist() for k, v in bands.items()} == {
        "0-63": [0, 1, 2, 6], "64-255": [3, 4], "256-1023": [5, 7], "1024-4095": [8], "4096+": [9]}
    teacher, student = tiny_model("llama"), converted_tiny()
    docs = [" ".join([d] * 6) for d in corpus(4)]  # documents past 64 tokens
    r = likelihood_metrics(student, teacher, tokenizer, docs, seq_len=160, max_rows=2)
    ids, pos = pack(tokenize(docs, tokenizer), 160, tokenizer.eos_token_id)
    bands = position_bands(pos[:2])
    assert list(r["by_position"]) == list(bands) == ["0-63", "64-255"]
    assert sum(b["tokens"] for b in r["by_position"].values()) == r["tokens"]
    with torch.no_grad():  # each band's perplexity, from each model's own per-token losses
        for who, m in (("perplexity", student), ("teacher_perplexity", teacher)):
            logits = m(input_ids=ids[:2], position_ids=pos[:2], use_cache=False).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:2, 1:], reduction="none")
            for k, mask in bands.items():
                assert r["by_position"][k][who] == pytest.approx(math.exp(nll[mask].mean().item()), rel=1e-4)
    b = r["by_position"]
    assert (f"| perplexity at document positions 0-63 / 64-255 | {b['0-63']['perplexity']:.2f} / "
            f"{b['64-255']['perplexity']:.2f} | {b['0-63']['teacher_perplexity']:.2f} / ") in format_table(r)


def test_greedy_ceiling_scores_copies_of_the_teacher_cast_to_each_dtype(tokenizer, tmp_path, monkeypatch):
    """scripts/greedy_ceiling.py: each copy is the teacher cast to its dtype, scored against the float32
    teacher by generation_agreement; a float32 copy agrees exactly; the page gets its section only."""
    from conftest import load_script

    gc = load_script("greedy_ceiling")
    teacher = tiny_model("llama")
    seen, real = [], gc.generation_agreement

    def spy(model, t, *a, **kw):
        seen.append((next(model.parameters()).dtype, next(t.parameters()).dtype, model is t))
        return real(model, t, *a, **kw)

    monkeypatch.setattr(gc, "generation_agreement", spy)
    res = gc.ceiling(teacher, tokenizer, corpus(8), ["float32", "bfloat16"], n_prompts=4, prompt_tokens=8, new_tokens=6)
    assert seen == [(torch.float32, torch.float32, False), (torch.bfloat16, torch.float32, False)]
    assert res["float32"]["generation_prefix_agreement"] == 1.0 and res["float32"]["generation_exact_match"] == 1.0
    assert res["bfloat16"]["generation_prompts"] == 4
    page = tmp_path / "q.md"
    page.write_text("# Q\n\n<!-- greedy_ceiling:start -->\n<!-- greedy_ceiling:end -->\n\nkept\n")
    gc.write_section(page, "greedy_ceiling", gc.render(res, "docs", 5.0, 1.0))
    text = page.read_text()
    assert "| float32 | 1.000 | 1.000 | 4 |" in text and "| bfloat16 |" in text and text.endswith("kept\n")


CHAT_TEMPLATE = ("{% for m in messages %}w2 {{ m['content'] }} w3 {% endfor %}"
                 "{% if add_generation_prompt %}w4{% endif %}")


def test_evaluation_of_corpora_fluency_chat_and_window_only(tokenizer):
    """Each new figure on a window hybrid (tiny llama converted with window 4) beside its original."""
    teacher, student = tiny_model("llama"), converted_tiny()
    tokenizer.chat_template = CHAT_TEMPLATE
    chats = load_chat_prompts_from([{"prompt": "w5 w6 w7"},
                                    {"messages": [{"role": "user", "content": "w9 w8"}, {"role": "assistant", "content": "w7"}]}])
    assert chats[1] == [{"role": "user", "content": "w9 w8"}]  # the last assistant turn is the models' to answer
    result = evaluate_all(student, teacher, tokenizer, corpus(8), seq_len=32, max_rows=2, n_prompts=1, passkey_lengths=(),
                          corpora={"ood": corpus(4, seed=1)}, chat_prompts=chats, chat_tokens=6)
    ood = result["corpora"]["ood"]
    assert ood["perplexity"] > 1 and ood["teacher_perplexity"] > 1 and 0 <= ood["top1_agreement"] < 1
    assert ood["perplexity_ratio"] == pytest.approx(ood["perplexity"] / ood["teacher_perplexity"])
    assert ood["perplexity"] != result["perplexity"]  # its own documents
    # the teacher's own greedy text is its most likely: the floor under the student's
    assert 1 <= result["fluency_teacher_ppl_of_teacher"] < result["fluency_teacher_ppl_of_student"]
    assert result["chat_prompts"] == 2 and 0 <= result["chat_prefix_agreement"] <= 1
    assert 1 <= result["chat_teacher_ppl_of_teacher"] < result["chat_teacher_ppl_of_student"]
    assert [set(a) for a in result["chat_answers"]] == [{"prompt", "teacher", "student"}] * 2
    assert result["chat_answers"][0]["prompt"] == "w5 w6 w7" and result["chat_answers"][0]["teacher"]
    wo = result["window_only"]  # on by default for a window hybrid
    assert wo["perplexity"] != result["perplexity"] and 0 <= wo["top1_agreement"] <= 1
    table = format_table(result)
    for row in ("| ood: perplexity (ratio", "fluency", "chat answers: exact match", "window only"):
        assert row in table
    assert "window_only" not in evaluate_all(converted_tiny(linearize.LinearAttentionConfig(feature_map="hedgehog")),
                                             None, tokenizer, corpus(8), seq_len=32, max_rows=1, passkey_lengths=())


def test_greedy_agreement_has_its_standard_error(monkeypatch):
    """The prefix share's standard error over the prompts: what tells a run's 0.16 from another's 0.22."""
    from linearize.recipes import evaluate

    monkeypatch.setattr(evaluate, "_teacher_nll", lambda teacher, p, cont, device: (float(len(cont)), len(cont)))
    # prefix shares 0.5, 1 and 0: mean 0.5, sample sd 0.5, standard error 0.5 / sqrt(3)
    pairs = [([7], [1, 2, 3, 4], [1, 2, 9, 9]), ([7], [1, 2], [1, 2]), ([7], [5], [6])]
    r = evaluate._agreement_and_fluency(None, pairs, "cpu", "generation")
    assert r["generation_prefix_agreement"] == pytest.approx(0.5) and r["generation_exact_match"] == pytest.approx(1 / 3)
    assert r["generation_prefix_agreement_se"] == pytest.approx(0.5 / math.sqrt(3))
    assert evaluate._agreement_and_fluency(None, pairs[:1], "cpu", "chat")["chat_prefix_agreement_se"] is None
    r.update(perplexity=2.0, teacher_perplexity=2.0, tokens=10)
    assert "| greedy generation agreement (prefix share) | 0.500 ± 0.289 | 1.000 |" in format_table(r)


def test_batched_generation_gives_each_prompt_the_answer_it_gets_alone(tokenizer):
    """The evaluation generates several prompts a call, left-padded: each figure and answer equals one
    prompt a call, on a window hybrid with attention sinks, prompts of different lengths, and answers
    that stop at the end-of-sequence token at different steps (a padded row must be cut there)."""
    teacher = tiny_model("llama")
    student = converted_tiny(linearize.LinearAttentionConfig(feature_map="hedgehog", window=4, sinks=2))
    tokenizer.chat_template = CHAT_TEMPLATE
    chats = [[{"role": "user", "content": c}] for c in ("w5 w6 w7 w8 w9 w10", "w7", "w11 w12", "w20 w21 w22 w23")]
    ids = tokenizer(tokenizer.apply_chat_template(chats[0], add_generation_prompt=True, tokenize=False),
                    add_special_tokens=False).input_ids
    x = torch.tensor([ids])
    stop = teacher.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=3, do_sample=False,
                            pad_token_id=0)[0, -1].item()
    for m in (teacher, student):  # the teacher's third token ends its first answer
        m.generation_config.eos_token_id = stop
    kw = dict(seq_len=32, max_rows=1, n_prompts=3, passkey_lengths=(64, 96), passkey_trials=3, chat_prompts=chats,
              chat_tokens=8, window_only_ablation=False)
    one = evaluate_all(student, teacher, tokenizer, corpus(12), generate_batch_size=1, **kw)
    many = evaluate_all(student, teacher, tokenizer, corpus(12), generate_batch_size=3, **kw)
    assert len(one["chat_answers"][0]["teacher"].split()) == 3  # stopped at the end-of-sequence token
    assert one["chat_answers"] == many["chat_answers"]
    assert one["generation_prompts"] == 3 and one["passkey_trials"] == many["passkey_trials"] == {"64": 3, "96": 3}
    for key in ("generation_prefix_agreement", "generation_exact_match", "fluency_teacher_ppl_of_student",
                "chat_prefix_agreement", "chat_exact_match", "chat_teacher_ppl_of_student", "passkey", "teacher_passkey"):
        assert one[key] == many[key], key
    assert set(one["eval_seconds"]) == {"likelihood", "generation", "chat", "passkey"}


def load_chat_prompts_from(records):
    import tempfile
    from pathlib import Path

    from linearize.recipes.evaluate import load_chat_prompts

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "chat.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return load_chat_prompts(path)


@pytest.mark.parametrize("method", ["hedgehog", "gdn"])
def test_window_only_is_the_original_sliding_window_and_restores_the_model(method):
    """A Mistral whose layers all attend a sliding window of 4, converted to window-4 hybrids (or Gated
    DeltaNet beside a window of 4): with the recurrent branch zeroed each layer is exactly the original's
    sliding-window softmax (rows longer than the window, so the branch has keys to read), and the
    hybrid comes back after. Gated DeltaNet's branch starts at weight 0: the conversion is the
    original sliding window until it trains."""
    from linearize.recipes.evaluate import window_layers, window_only

    original = tiny_model("mistral", sliding_window=4)
    cfg = (linearize.LinearAttentionConfig(feature_map="hedgehog", window=4) if method == "hedgehog"
           else linearize.GatedDeltaNetConfig(window=4))
    model = linearize.linearize(tiny_model("mistral", sliding_window=4), cfg)
    x = torch.randint(2, 90, (2, 24))
    with torch.no_grad():
        ref = original(x).logits
        if method == "gdn":
            assert torch.allclose(model(x).logits, ref, atol=1e-4)  # the start: the window alone
            for layer in window_layers(model):
                layer.window_gamma.fill_(0.8)
        before = model(x).logits
        with window_only(model) as layers:
            alone = model(x).logits
        after = model(x).logits
    assert len(layers) == 3
    assert torch.allclose(alone, ref, atol=1e-4) and not torch.allclose(before, ref, atol=1e-2)
    assert torch.equal(before, after)
    with pytest.raises(ValueError, match="no window layers"), window_only(original):
        pass


def test_a_past_deadline_runs_one_of_each_part_and_names_the_cuts(tokenizer):
    teacher, student = tiny_model("llama"), converted_tiny()
    tokenizer.chat_template = CHAT_TEMPLATE
    chats = [[{"role": "user", "content": "w5 w6"}], [{"role": "user", "content": "w7"}]]
    result = evaluate_all(student, teacher, tokenizer, corpus(8), seq_len=16, max_rows=3, n_prompts=2, passkey_lengths=(),
                          corpora={"ood": corpus(6, seed=1)}, chat_prompts=chats, chat_tokens=3, deadline=0.0,
                          generate_batch_size=1)
    assert result["tokens"] == 15 and result["corpora"]["ood"]["tokens"] == 15  # one row each
    assert result["generation_prompts"] == 1 and result["chat_prompts"] == 1 and len(result["chat_answers"]) == 1
    assert "perplexity" in result["window_only"] and result["fluency_teacher_ppl_of_student"] is not None
    assert result["cut_by_deadline"] == ["likelihood rows", "corpus ood rows", "generation prompts", "chat prompts"]


def test_passkey_hits_follow_the_prompts_so_two_models_compare_trial_by_trial(smollm2, monkeypatch):
    from linearize.recipes import evaluate

    tokenizer = smollm2[1]

    def answers(keep):  # a model that answers the pass key on the trials where keep(i) holds
        def greedy(model, tok, prompts, n, device):
            out = []
            for ids in prompts:
                key = tok.decode(ids).split("The pass key is ")[1][:5]
                i = order.index(key)
                out.append(tok(" " + (key if keep(i) else "00000"), add_special_tokens=False).input_ids)
            return out
        return greedy

    rng = random.Random(7 * 1000 + 96)  # the prompts passkey_accuracy makes for seed 7 at length 96, in order
    order = [evaluate.passkey_prompt(tokenizer, 96, rng)[1] for _ in range(6)]
    hits, counts = {}, {}
    monkeypatch.setattr(evaluate, "_greedy", answers(lambda i: i % 3 != 1))
    acc = evaluate.passkey_accuracy(None, tokenizer, (96,), trials=6, seed=7, counts=counts, hits=hits, batch_size=4)
    assert hits == {"96": "101101"} and acc == {"96": 4 / 6} and counts == {"96": 6}
    teacher = {}
    monkeypatch.setattr(evaluate, "_greedy", answers(lambda i: i != 2))
    evaluate.passkey_accuracy(None, tokenizer, (96,), trials=6, seed=7, hits=teacher, batch_size=4)
    assert teacher == {"96": "110111"}
    # trials 1 and 4 only the teacher retrieved, trial 2 only the student; a shorter run is compared on its trials
    assert evaluate.passkey_disagreements(hits["96"], teacher["96"]) == (1, 2)
    assert evaluate.passkey_disagreements("1011", teacher["96"]) == (1, 1)
    assert evaluate.passkey_disagreements("0000", "1111") == (0, 4)


def test_passkey_prompt_holds_the_key_at_the_requested_length(smollm2):
    import random

    _, tok = smollm2
    ids, key = passkey_prompt(tok, 1024, random.Random(0))
    assert 900 <= len(ids) <= 1024 and key in tok.decode(ids)


def test_gdn_recipe_with_auto_selected_softmax_layers(tokenizer, data_file, tmp_path):
    model = tiny_model("llama", num_hidden_layers=4)
    # auto:25% of 4 converted layers: one (the gdn-hybrid preset's share; its recipe is tested below)
    cfg = DistillConfig(preset="gdn", softmax_layers="auto:25%", stage1_steps=3, stage2_steps=3, lora_rank=4)
    data = DataConfig(data=str(data_file), seq_len=32, held_out_percent=15)
    summary = distill(model, tokenizer, cfg, data, small(steps=1, lr=1.0), tmp_path / "run", log=lambda *a: None)
    (kept,) = summary["softmax_layers"]
    conv = model.config.linearize
    assert conv["method"] == "gdn" and conv["softmax_layers"] == [kept] and kept not in conv["layers"]
    assert set(conv["softmax_selection"]["kl"]) == {"0", "1", "2", "3"}
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "run").eval()
    assert type(loaded.model.layers[kept].self_attn).__name__ == "LlamaAttention"
    ids = torch.randint(2, 90, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)


def test_select_long_picks_the_softmax_layers_on_the_long_rows_and_both_measures_are_kept(tokenizer, tmp_path):
    """--select-long: the KL choice of auto softmax layers is measured on two long rows (positions across
    documents) instead of 2,048 tokens of the training rows; a run with long rows records the measure it
    did not pick by as "alternative". Two runs alike but for the flag train the same stage 1, so each
    one's choice is the other's alternative."""
    from linearize.recipes.distill import distill

    data_file = tmp_path / "corpus.txt"
    data_file.write_text("\n\n\n".join(corpus(150)))  # more than 2,048 training tokens
    data = DataConfig(data=str(data_file), seq_len=32, long_seq_len=128, held_out_percent=10)
    runs = {}
    for long in (False, True):
        cfg = DistillConfig(preset="gdn", softmax_layers="auto:1", select_long=long, stage1_steps=3, stage2_steps=2)
        summary = distill(tiny_model("llama", num_hidden_layers=4), tokenizer, cfg, data,
                          small(steps=1, lr=1.0, save_every=0), tmp_path / f"run{long}", log=lambda *a: None)
        sel = json.loads((tmp_path / f"run{long}" / "config.json").read_text())["linearize"]["softmax_selection"]
        assert summary["softmax_layers"] == sel["chosen"] == [int(max(sel["kl"], key=sel["kl"].get))]
        runs[long] = sel
    short, long = runs[False], runs[True]
    assert (short["on"], short["tokens"], short["alternative"]["on"], short["alternative"]["tokens"]) == (
        "training rows", 2048, "long rows", 256)
    assert (long["on"], long["tokens"], long["alternative"]["on"]) == ("long rows", 256, "training rows")
    assert long["kl"] != short["kl"]  # two measures, not one twice
    for a, b in ((long, short["alternative"]), (short, long["alternative"])):
        assert a["chosen"] == b["chosen"]
        assert a["kl"] == pytest.approx(b["kl"], rel=1e-4)
    with pytest.raises(ValueError, match="--select-long is how auto softmax layers are chosen"):
        DistillConfig(preset="gdn", softmax_layers="3", select_long=True)
    with pytest.raises(ValueError, match="--select-long measures the layers on the long rows: give --long-seq-len"):
        distill(tiny_model("llama"), tokenizer, DistillConfig(preset="gdn-hybrid", select_long=True),
                DataConfig(data=str(data_file), seq_len=32, long_seq_len=0), small(steps=1), tmp_path / "none")
    assert not (tmp_path / "none").exists()


def test_gdn_hybrid_measures_its_softmax_choice_on_the_long_rows_unless_told_or_it_has_none(tokenizer, tmp_path):
    """The gdn-hybrid preset picks its softmax layers by their KL on the long rows where the run has
    them (select_long None: the preset's rule), on the training rows with --no-select-long or without
    long rows (no error: the preset asked for nothing the user must give); --preset gdn keeps the
    training rows. Each run records which measure chose."""
    from linearize.recipes.distill import distill

    data_file = tmp_path / "corpus.txt"
    data_file.write_text("\n\n\n".join(corpus(150)))
    with_long = DataConfig(data=str(data_file), seq_len=32, long_seq_len=128, held_out_percent=10)
    without = dataclasses.replace(with_long, long_seq_len=0)

    def selection(name, data, **kw):
        cfg = DistillConfig(stage1_steps=3, stage2_steps=2, **kw)
        distill(tiny_model("llama", num_hidden_layers=4), tokenizer, cfg, data,
                small(steps=1, lr=1.0, save_every=0), tmp_path / name, log=lambda *a: None)
        return json.loads((tmp_path / name / "config.json").read_text())["linearize"]["softmax_selection"]

    preset = selection("preset", with_long, preset="gdn-hybrid")
    told = selection("told", with_long, preset="gdn-hybrid", select_long=False)
    short = selection("short", without, preset="gdn-hybrid")
    gdn = selection("gdn", with_long, preset="gdn", softmax_layers="auto:1")
    # lolcats-hybrid chooses on the training rows (its choice on the 8K rows kept layers that did not retrieve)
    lolcats = selection("lolcats", with_long, preset="lolcats-hybrid")
    assert (preset["on"], preset["alternative"]["on"]) == ("long rows", "training rows")
    assert (told["on"], told["alternative"]["on"]) == ("training rows", "long rows")
    assert preset["chosen"] == told["alternative"]["chosen"] and told["chosen"] == preset["alternative"]["chosen"]
    assert (short["on"], "alternative" in short) == ("training rows", False)
    assert (gdn["on"], gdn["alternative"]["on"]) == ("training rows", "long rows")
    assert (lolcats["on"], lolcats["alternative"]["on"], len(lolcats["chosen"])) == ("training rows", "long rows", 1)


def test_long_finetune_trains_its_weights_and_new_keeps_contexts_inside_the_window(
        tokenizer, tmp_path, monkeypatch):
    """--long-finetune new: the long-row stage trains only the weights the conversion added (feature maps,
    the window's weight of the linear part), at --long-lr. Every weight the teacher had stays as stage 2 left
    it, so a window hybrid's logits on a prompt inside its window are those of the model before the long
    stage, to the bit; with "same" (stage 2's weights, the default) they move. "attention": every layer's
    attention module (the kept softmax layer's too) and nothing outside them: the MLPs stay. "mlp": the
    conversion's weights and every layer's MLP and norms, not the teacher's attention projections."""
    import linearize.recipes.distill as distill_mod
    from linearize.recipes.distill import mlp_parameter_names, new_parameter_names, stage2_parameter_names

    data_file = tmp_path / "corpus.txt"
    data_file.write_text("\n\n\n".join(corpus(150)))
    data = DataConfig(data=str(data_file), seq_len=32, long_seq_len=128, held_out_percent=10)
    short = torch.randint(2, 90, (1, 8))  # inside the 8-key window (the linear branch reads keys s <= t - 8, sinks too)
    seen = {}
    real = distill_mod.train_stage

    def spy(name, model, loss, rows, cfg, *a, **kw):
        if name != "stage3_long":
            return real(name, model, loss, rows, cfg, *a, **kw)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            logits = model(short).logits
        out = real(name, model, loss, rows, cfg, *a, **kw)
        with torch.no_grad():
            seen["logits"] = (logits, model(short).logits)
        seen["new"] = set(new_parameter_names(model))
        seen["attention"] = set(stage2_parameter_names(model, "attention"))
        seen["mlp"] = set(mlp_parameter_names(model))
        seen["moved"] = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
        seen["lr"], seen["lr_scale"] = cfg.lr, kw.get("lr_scale")
        return out

    monkeypatch.setattr(distill_mod, "train_stage", spy)
    runs = {}
    for mode in ("new", "same", "attention", "mlp", "mlp-split"):
        # mlp-split: --long-teacher-lr 1e-30, the teacher's MLPs and norms at a rate too small to change a bit
        cfg = DistillConfig(preset="lolcats-hybrid", softmax_layers="1", window=8, stage1_steps=2, stage2_steps=8,
                            long_share=0.5, long_finetune=mode.split("-")[0], long_lr=3e-2,
                            long_teacher_lr=1e-30 if mode == "mlp-split" else None)
        summary = distill(tiny_model("llama"), tokenizer, cfg, data, small(steps=1, save_every=0), tmp_path / mode,
                          log=lambda *a: None)
        assert summary["stage3"]["steps"] == 4
        runs[mode] = dict(seen)
    new, same = runs["new"], runs["same"]
    assert new["lr"] == same["lr"] == 3e-2
    assert new["moved"] and new["moved"] <= new["new"]  # the feature maps and gamma learn, nothing else
    assert any(n.endswith("window_log_gamma") for n in new["moved"])
    torch.testing.assert_close(*new["logits"], rtol=0, atol=0)
    assert same["moved"] - same["new"]  # stage 2's weights: the teacher's projections and MLPs move too
    assert not torch.allclose(*same["logits"], atol=1e-4)
    attention = runs["attention"]
    assert attention["moved"] <= attention["attention"] and attention["new"] <= attention["attention"]
    assert any(".layers.1.self_attn.q_proj" in n for n in attention["moved"])  # the kept softmax layer learns
    assert any(".layers.0.self_attn.q_proj" in n for n in attention["moved"])  # and the converted one's projections
    assert not any(".mlp." in n for n in attention["moved"]) and any(".mlp." in n for n in same["moved"])
    assert not torch.allclose(*attention["logits"], atol=1e-4)
    mlp = runs["mlp"]
    assert mlp["moved"] <= mlp["mlp"] and mlp["new"] <= mlp["mlp"]
    assert any(".layers.1.mlp." in n for n in mlp["moved"]) and any(".layers.0.mlp." in n for n in mlp["moved"])
    assert any(".layers.0.input_layernorm" in n for n in mlp["moved"])  # the layers' norms learn too
    assert any(n.endswith("window_log_gamma") for n in mlp["moved"])  # and the linear branch
    assert not any(n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")) for n in mlp["moved"])
    assert not any("embed_tokens" in n or n.endswith("model.norm.weight") for n in mlp["moved"])
    assert not torch.allclose(*mlp["logits"], atol=1e-4)
    assert all(runs[m]["lr_scale"] is None for m in ("new", "same", "attention", "mlp"))
    split = runs["mlp-split"]  # the conversion's weights at --long-lr, the teacher's at --long-teacher-lr
    assert set(split["lr_scale"]) == split["mlp"] - split["new"] and set(split["lr_scale"].values()) == {1e-30 / 3e-2}
    assert split["moved"] and split["moved"] <= split["new"]  # what moves is the conversion's: the MLPs held still
    assert any(n.endswith("window_log_gamma") for n in split["moved"])
    with pytest.raises(ValueError, match="--long-teacher-lr sets the rate of the teacher's weights"):
        DistillConfig(preset="lolcats-hybrid", long_teacher_lr=1e-5)  # its "new" trains none of them
    with pytest.raises(ValueError, match="long_teacher_lr must be > 0"):
        DistillConfig(preset="lolcats-hybrid", long_finetune="mlp", long_teacher_lr=0)
    with pytest.raises(ValueError, match="--long-finetune new trains the conversion's own weights"):
        DistillConfig(preset="lolcats", finetune="lora", long_finetune="new")
    with pytest.raises(ValueError, match="--long-finetune attention trains every attention module's weights"):
        DistillConfig(preset="lolcats", finetune="lora", long_finetune="attention")
    with pytest.raises(ValueError, match="--long-finetune mlp trains the conversion's weights and the MLPs"):
        DistillConfig(preset="lolcats", finetune="lora", long_finetune="mlp")
    with pytest.raises(ValueError, match="long_finetune must be 'same'"):
        DistillConfig(preset="lolcats-hybrid", long_finetune="all")


def test_gdn_hybrid_preset_sets_its_recipe_and_flags_override_it():
    """--preset gdn-hybrid: Gated DeltaNet beside a 192-key softmax window with 4 sinks, a quarter of the
    converted layers kept softmax (chosen by KL), a full fine-tune at lr 1e-4, the 8K stage on the
    conversion's weights at 1e-3; a flag given on the command line wins over the preset."""
    from linearize.cli import build_parser
    from linearize.flags import dataclass_from_args
    from linearize.recipes.distill import DistillConfig

    cfg = DistillConfig(preset="gdn-hybrid")
    assert (cfg.resolved()["method"], cfg.softmax_layers, cfg.finetune, cfg.stage2_lr) == ("gdn", "auto:25%", "full", 1e-4)
    lol = DistillConfig(preset="lolcats")
    assert (lol.resolved()["window"], lol.finetune, lol.stage2_lr) == (192, "full", 1e-4)
    hyb = DistillConfig(preset="lolcats-hybrid")  # lolcats' layers, gdn-hybrid's quarter of softmax and stage 2
    assert (hyb.resolved()["method"], hyb.resolved()["window"], hyb.resolved()["sinks"], hyb.softmax_layers,
            hyb.finetune, hyb.stage2_lr, hyb.select_long) == ("linear_attention", 192, 4, "auto:25%", "full", 1e-4, None)
    assert hyb.softmax_choice(30) == (7, None)
    # its 8K stage trains the conversion's weights alone, at 1e-3 (2026-12-06a); the rate goes with that choice;
    # gdn-hybrid's too since it gained a softmax window (2026-12-07a)
    assert (hyb.long_finetune, hyb.long_lr, cfg.long_finetune, cfg.long_lr) == ("new", 1e-3, "new", 1e-3)
    gdn_cfg = cfg.method_config()
    assert (type(gdn_cfg).__name__, gdn_cfg.window, gdn_cfg.sinks) == ("GatedDeltaNetConfig", 192, 4)
    # the exportable Qwen3.5 layer holds no window: that layout runs the recipe measured for it, without one and
    # with its 8K stage on stage 2's weights; flags still win
    exportable = DistillConfig(preset="gdn-hybrid", layout="qwen3_5")
    assert (exportable.method_config().window, exportable.method_config().sinks, exportable.long_finetune,
            exportable.long_lr, exportable.softmax_layers) == (0, 0, "same", None, "auto:25%")
    assert DistillConfig(preset="gdn-hybrid", layout="qwen3_5", long_finetune="new").long_finetune == "new"
    with pytest.raises(ValueError, match="layout 'qwen3_5' has no softmax window"):
        DistillConfig(preset="gdn-hybrid", layout="qwen3_5", window=64)
    assert DistillConfig(preset="gdn-hybrid", window=0).method_config().window == 0
    for flags, want in (([], ("new", 1e-3)), (["--long-finetune", "same"], ("same", None)),
                        (["--long-finetune", "attention"], ("attention", None)),
                        (["--long-finetune", "mlp"], ("mlp", None)),
                        (["--long-finetune", "mlp", "--long-lr", "1e-3", "--long-teacher-lr", "1e-5"], ("mlp", 1e-3, 1e-5)),
                        (["--long-lr", "5e-4"], ("new", 5e-4)), (["--finetune", "lora"], ("same", None))):
        mine = dataclass_from_args(DistillConfig, build_parser().parse_args(
            ["distill", "--out", "x", "--preset", "lolcats-hybrid", *flags]))
        assert (mine.long_finetune, mine.long_lr, mine.long_teacher_lr)[:len(want)] == want, flags
    assert cfg.softmax_choice(30) == (7, None) and cfg.softmax_choice(2) == (1, None)  # rounded down, at least one
    # gdn's stage 2 at 3e-4 since 2026-11-28g (docs/reports/quality.md); gdn-hybrid's stays at 1e-4
    assert (DistillConfig(preset="gdn").finetune, DistillConfig(preset="gdn").stage2_lr) == ("full", 3e-4)
    args = build_parser().parse_args(["distill", "--out", "x", "--preset", "gdn-hybrid", "--finetune", "lora",
                                      "--stage2-lr", "2e-4", "--softmax-layers", "auto:3"])
    cfg = dataclass_from_args(DistillConfig, args)
    assert (cfg.finetune, cfg.stage2_lr, cfg.softmax_choice(30)) == ("lora", 2e-4, (3, None))
    assert cfg.select_long is None  # the preset's rule, at run time: the long rows where there are some
    for flag, value in (("--select-long", True), ("--no-select-long", False)):
        assert dataclass_from_args(DistillConfig, build_parser().parse_args(
            ["distill", "--out", "x", "--preset", "gdn-hybrid", flag])).select_long is value
    for bad in ("auto:x%", "auto:0", "auto:100%"):
        with pytest.raises(ValueError, match="softmax_layers"):
            DistillConfig(preset="gdn", softmax_layers=bad)


def test_presets_train_in_the_stage_shares_their_runs_were_measured_at(tmp_path):
    """Every measured preset run trained 300 stage-1 steps to 700 of stage 2, the shares --max-minutes
    keeps (docs/reports/quality.md), so `--preset NAME --max-minutes M` alone repeats the recipe; encoders
    take their measured 200 + 2,000; explicit counts win, and they reach the budget fitting."""
    from linearize.cli import build_parser
    from linearize.flags import dataclass_from_args
    from linearize.recipes.distill import PRESETS, DistillConfig, _stage_budgets

    for preset in ("lolcats", "linear", "gdn", "gdn-hybrid", "lolcats-hybrid", "swa"):
        cfg = dataclass_from_args(DistillConfig, build_parser().parse_args(["distill", "--out", "x", "--preset", preset]))
        assert (cfg.stage1_steps, cfg.stage2_steps) == (300, 700), preset
        if "encoder" not in PRESETS[preset]:
            assert cfg.for_encoder() is cfg
    for cfg in (DistillConfig(preset="linformer"), DistillConfig(preset="linear").for_encoder()):
        assert (cfg.stage1_steps, cfg.stage2_steps) == (200, 2000), cfg.preset
    mine = DistillConfig(preset="linear", stage1_steps=5, stage2_steps=0).for_encoder()
    assert (mine.stage1_steps, mine.stage2_steps, mine.finetune) == (5, 0, "lora")
    args = build_parser().parse_args(["distill", "--out", "x", "--preset", "gdn", "--stage1-steps", "100"])
    assert dataclass_from_args(DistillConfig, args).stage1_steps == 100
    # under --max-minutes and a 1,000-step token cap, stage 1 fits 30% of it
    cfg = DistillConfig(preset="gdn", max_minutes=10, max_tokens=1000 * 64)
    budgets = _stage_budgets(cfg, {"train_end": time.time() + 10_000}, tmp_path, {}, tokens_per_step=64)
    assert budgets["stage1"].fit(1.0, 1.0, 2) == 300


def test_linear_preset_decays_for_decoders_and_stays_lora_without_decay_for_encoders():
    """--preset linear: for a decoder a rank-16 decay gate per key channel and a full fine-tune at lr 3e-4 (the
    runs of 2026-11-29k, -29l and -30c: +15.6% at lr 1e-4 against +20.0% with a scalar gate and +39.2% without
    one; at 3e-4 +13.1% with 64M tokens); for an encoder (non-causal: no decay) LoRA at
    lr 1e-3, as before; flags win over both, and a bad --decay is refused in one line."""
    from linearize.cli import build_parser
    from linearize.flags import dataclass_from_args
    from linearize.recipes.distill import DistillConfig

    dec = DistillConfig(preset="linear")
    assert (dec.decay, dec.finetune, dec.stage2_lr, dec.method_config().decay) == ("channel", "full", 3e-4, "channel")
    # its gate at rank 16 (-29l: the full width's +15.6% with 19M parameters fewer); --gate-rank 0: full width
    assert dec.method_config().gate_rank == 16 and DistillConfig(preset="linear", decay="channel").gate_rank == 16
    assert DistillConfig(preset="linear", gate_rank=0).method_config().gate_rank == 0
    # the rank belongs to the preset's gate: another --decay drops it (a rank-16 factor of a 9-wide scalar gate
    # would be larger than the gate), and --decay none is not refused for a rank it did not ask for
    scalar = DistillConfig(preset="linear", decay="scalar").method_config()
    assert (scalar.decay, scalar.gate_rank) == ("scalar", 0)  # the gate of -29e to -29j
    assert DistillConfig(preset="linear", decay="none").method_config().gate_rank == 0
    enc = dec.for_encoder()
    assert (enc.decay, enc.gate_rank, enc.finetune, enc.stage2_lr) == ("none", 0, "lora", 1e-3)
    assert enc.method_config(encoder=True).method == "encoder_linear_attention"
    with pytest.raises(ValueError, match="no decay"):
        dec.method_config(encoder=True)  # the decoder's gate on an encoder is refused, not dropped
    args = build_parser().parse_args(["distill", "--out", "x", "--preset", "linear", "--decay", "none",
                                      "--finetune", "full", "--stage2-lr", "2e-4"])
    flags = dataclass_from_args(DistillConfig, args)
    assert flags.method_config().decay is None and (flags.finetune, flags.stage2_lr) == ("full", 2e-4)
    assert (flags.for_encoder().finetune, flags.for_encoder().stage2_lr) == ("full", 2e-4)
    assert DistillConfig(preset="lolcats").method_config().decay is None  # the gate is linear's alone
    with pytest.raises(ValueError, match="decay must be 'none', 'scalar' or 'channel'"):
        DistillConfig(preset="linear", decay="exp")
    # --gate-rank: the gate's rank through distill's flags; refused where there is no such gate
    args = build_parser().parse_args(["distill", "--out", "x", "--preset", "linear", "--decay", "channel",
                                      "--gate-rank", "16"])
    assert dataclass_from_args(DistillConfig, args).method_config().gate_rank == 16
    for kw, match in ((dict(preset="gdn"), "drop --gate-rank"), (dict(preset="swa"), "--gate-rank"),
                      (dict(preset="linear", decay="none"), "gate_rank 16 factors the decay gate")):
        with pytest.raises(ValueError, match=match):
            DistillConfig(gate_rank=16, **kw)
    with pytest.raises(ValueError, match="no --gate-rank"):
        DistillConfig(preset="linear", gate_rank=16).method_config(encoder=True)
    # --output-gate: off unless given; its rank reaches the conversion; refused where there are no such layers
    assert dec.method_config().output_gate == 0
    args = build_parser().parse_args(["distill", "--out", "x", "--preset", "linear", "--output-gate", "16"])
    assert dataclass_from_args(DistillConfig, args).method_config().output_gate == 16
    assert DistillConfig(preset="lolcats", output_gate=8).method_config().output_gate == 8
    for kw, match in ((dict(preset="gdn"), "drop --output-gate"), (dict(preset="swa"), "--output-gate")):
        with pytest.raises(ValueError, match=match):
            DistillConfig(output_gate=8, **kw)
    with pytest.raises(ValueError, match="no --output-gate"):
        DistillConfig(preset="linear", output_gate=8).for_encoder().method_config(encoder=True)
    # --conv-size: off for the feature-map presets and 4 for gdn unless given; refused where there is no conv
    assert (dec.method_config().conv_size, DistillConfig(preset="gdn").method_config().conv_size) == (0, 4)
    args = build_parser().parse_args(["distill", "--out", "x", "--preset", "linear", "--conv-size", "4"])
    assert dataclass_from_args(DistillConfig, args).method_config().conv_size == 4
    assert DistillConfig(preset="gdn", conv_size=0).method_config().conv_size == 0
    for kw in (dict(preset="swa"), dict(preset="linformer")):
        with pytest.raises(ValueError, match="drop --conv-size"):
            DistillConfig(conv_size=4, **kw)
    with pytest.raises(ValueError, match="on an encoder has none: drop --conv-size"):
        DistillConfig(preset="linear", decay="none", conv_size=4).method_config(encoder=True)


def test_no_use_rope_takes_rope_off_the_gdn_state_through_distill_and_keeps_it_in_the_window():
    """--no-use-rope: distill's flag reaches the Gated DeltaNet layers, whose state then matches keys by
    content alone (positions spaced twice as far apart change nothing, where with RoPE they change the
    output); a softmax window beside the state keeps its RoPE; presets without such layers refuse it."""
    from conftest import converted
    from linearize.cli import build_parser
    from linearize.flags import dataclass_from_args

    args = build_parser().parse_args(["distill", "--out", "x", "--preset", "gdn", "--no-use-rope"])
    off = dataclass_from_args(DistillConfig, args).method_config()
    assert off.use_rope is False and DistillConfig(preset="gdn").method_config().use_rope is True
    assert DistillConfig(preset="gdn-hybrid", layout="qwen3_5").method_config().use_rope is False
    ids = torch.randint(2, 97, (1, 24))
    pos = torch.arange(24)[None]
    for use_rope in (False, True):
        model = converted("llama", config=dataclasses.replace(off, use_rope=use_rope))
        with torch.no_grad():
            moved = (model(ids, position_ids=2 * pos).logits - model(ids, position_ids=pos).logits).abs().max().item()
        assert (moved < 1e-5) == (not use_rope), (use_rope, moved)
    hybrid = DistillConfig(preset="gdn-hybrid", window=8, sinks=2, use_rope=False).method_config()
    layer = converted("llama", config=hybrid).model.layers[0].self_attn
    assert (layer.use_rope, layer.window_rope) == (False, True)
    for kw in (dict(preset="linear"), dict(preset="lolcats"), dict(preset="swa")):
        with pytest.raises(ValueError, match="--no-use-rope is for the Gated DeltaNet layers"):
            DistillConfig(use_rope=False, **kw)


def test_dt_min_sets_the_gdn_decays_slowest_start_through_distill_and_the_saved_config():
    """--dt-min: distill's flag reaches the Gated DeltaNet layers (both layouts), whose heads then start
    with decay time steps log-spaced from dt_min to 1e-2 (the slowest head remembers ~1 / dt_min tokens);
    the saved config keeps a non-default value and leaves the default out (older checkpoints' record);
    presets without such layers and bad values are refused in one line."""
    import json

    from conftest import converted
    from linearize.cli import build_parser
    from linearize.config import GatedDeltaNetConfig, config_from_dict
    from linearize.flags import dataclass_from_args

    args = build_parser().parse_args(["distill", "--out", "x", "--preset", "gdn", "--dt-min", "1e-4"])
    slow = dataclass_from_args(DistillConfig, args).method_config()
    assert (slow.dt_min, slow.dt_max) == (1e-4, 1e-2)
    assert DistillConfig(preset="gdn").method_config().dt_min == 1e-3
    assert config_from_dict(json.loads(json.dumps(slow.to_dict()))) == slow
    assert not {"dt_min", "dt_max"} & set(GatedDeltaNetConfig().to_dict())
    for cfg in (slow, dataclasses.replace(slow, layout="qwen3_5", use_rope=False)):
        layer = converted("llama", config=cfg).model.layers[0].self_attn
        dt = torch.nn.functional.softplus(layer.dt_bias.detach().float())
        torch.testing.assert_close(dt[0], torch.tensor(1e-4), rtol=1e-3, atol=0)
        torch.testing.assert_close(dt[-1], torch.tensor(1e-2), rtol=1e-3, atol=0)
    for kw in (dict(preset="linear"), dict(preset="lolcats")):
        with pytest.raises(ValueError, match="--dt-min is for the Gated DeltaNet layers"):
            DistillConfig(dt_min=1e-4, **kw)
    with pytest.raises(ValueError, match="0 < dt_min <= dt_max"):
        GatedDeltaNetConfig(dt_min=0.05)


def test_feature_dim_sizes_the_feature_map_through_distill_and_the_saved_model_and_gdn_refuses_it(tokenizer, data_file, tmp_path):
    """--feature-dim: the state's key dimension of the feature-map presets (hedgehog's default is 2 x
    head_dim), carried through stage 1 and 2, the saved config and a reload; refused in one line where
    the layers have no feature map, as --decay is where they have their own gates (it was ignored)."""
    from linearize.cli import build_parser
    from linearize.flags import dataclass_from_args

    args = build_parser().parse_args(["distill", "--out", "x", "--preset", "linear", "--feature-dim", "64"])
    assert dataclass_from_args(DistillConfig, args).method_config().feature_dim == 64
    model = tiny_model("llama", num_hidden_layers=2)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    cfg = DistillConfig(preset="linear", feature_dim=4 * head_dim, stage1_steps=2, stage2_steps=2)
    data = DataConfig(data=str(data_file), seq_len=32, held_out_percent=15)
    distill(model, tokenizer, cfg, data, small(steps=1, lr=1e-3), tmp_path / "run", log=lambda *a: None)
    assert model.config.linearize["feature_dim"] == 4 * head_dim
    attn = model.model.layers[0].self_attn
    assert attn.feature_map_q.weight.shape[-1] == 2 * head_dim  # [xW, -xW]: F / 2 columns
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "run").eval()
    ids = torch.randint(2, 90, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model.eval()(ids).logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"--feature-dim must be in \[1, 256\]"):
        DistillConfig(preset="linear", feature_dim=512)
    for preset in ("gdn", "gdn-hybrid", "swa"):
        with pytest.raises(ValueError, match="drop --feature-dim"):
            DistillConfig(preset=preset, feature_dim=256)
        if preset != "swa":  # a gate asked of Gated DeltaNet layers is refused, not ignored
            with pytest.raises(ValueError, match="drop --decay"):
                DistillConfig(preset=preset, decay="scalar")
            assert DistillConfig(preset=preset, decay="none").decay_gate is None


def test_swa_baseline_attends_its_window_and_sinks_in_training_packing_and_generate():
    """linearize/swa.py: each query sees the newest W keys and the first S of its document; the same in
    a packed row (sinks restart at each document), and generate() with a cache gives the tokens of
    full forwards without one."""
    import copy

    from linearize.swa import apply_swa

    torch.manual_seed(0)
    base = tiny_model("llama", num_hidden_layers=2).eval()
    model = copy.deepcopy(base)
    apply_swa(model, window=8, sinks=2)
    T = 40
    ids = torch.randint(2, 90, (1, T))
    allowed = torch.tensor([[t - j < 8 or j < 2 for j in range(T)] for t in range(T)]) & torch.ones(T, T, dtype=torch.bool).tril()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, use_cache=False).logits,
                                   base(ids, attention_mask=allowed[None, None], use_cache=False).logits)
        assert (model(ids, use_cache=False).logits - base(ids, use_cache=False).logits).abs().max() > 1e-2
        # a packed row of two documents: each as alone
        pos = torch.cat([torch.arange(15), torch.arange(T - 15)])[None]
        packed = model(ids, position_ids=pos, use_cache=False).logits
        torch.testing.assert_close(packed[:, 15:], model(ids[:, 15:], use_cache=False).logits)
    prompt = ids[:, :20]
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False)
    x = prompt
    with torch.no_grad():
        for _ in range(12):
            x = torch.cat([x, model(x, use_cache=False).logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(out, x)


def test_swa_preset_distills_stage_2_only_against_the_full_attention_teacher(tokenizer, data_file, tmp_path):
    model = tiny_model("llama", num_hidden_layers=2)
    cfg = DistillConfig(preset="swa", window=4, sinks=1, stage1_steps=3, stage2_steps=3, lora_rank=4)
    data = DataConfig(data=str(data_file), seq_len=32, held_out_percent=15)
    logs = []
    summary = distill(model, tokenizer, cfg, data, small(steps=1, lr=1.0), tmp_path / "run", log=logs.append)
    assert "stage1" not in summary and summary["stage2"]["steps"] == 3 and summary["config"]["stage1_steps"] == 0
    assert any("stage 1 skipped" in str(m) for m in logs)
    assert model.config._attn_implementation == "linearize_swa" and model.config.linearize_swa == {"window": 4, "sinks": 1}
    from linearize.loading import load_model_and_tokenizer

    loaded, _ = load_model_and_tokenizer(str(tmp_path / "run"))  # what linearize eval / generate load
    assert loaded.config._attn_implementation == "linearize_swa"
    ids = torch.randint(2, 90, (1, 24))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model.eval()(ids).logits)
    with pytest.raises(ValueError, match="swa"):
        DistillConfig(preset="swa", softmax_layers="0")


def test_token_cache_tokenizes_once_per_text_and_tokenizer(tokenizer, tmp_path, monkeypatch):
    """DataConfig.token_cache: a second run on the same documents reads the ids (the same rows); a
    changed document tokenizes again; two runs starting together tokenize once (file lock)."""
    import dataclasses
    import threading
    import time

    import linearize.recipes.data as data
    from linearize.recipes.data import prepare_mix

    calls = []
    real = data.tokenize
    def counted(docs, tok, **kw):  # slow enough that runs starting together would overlap
        calls.append(len(docs))
        time.sleep(0.3)
        return real(docs, tok, **kw)

    monkeypatch.setattr(data, "tokenize", counted)
    (tmp_path / "d").mkdir()
    for n, doc in enumerate(corpus(12)):
        (tmp_path / "d" / f"{n}.txt").write_text(doc)
    cfg = DataConfig(data=str(tmp_path / "d"), seq_len=16, held_out_percent=10, token_cache=str(tmp_path / "cache"))
    first, held, _ = prepare_mix(cfg, tokenizer)
    again, held2, _ = prepare_mix(cfg, tokenizer)
    assert len(calls) == 1 and held == held2
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert torch.equal(first["input_ids"], prepare_mix(dataclasses.replace(cfg, token_cache="none"), tokenizer)[0]["input_ids"])
    assert len(calls) == 2  # "none" tokenized
    (tmp_path / "d" / "0.txt").write_text(corpus(13)[12])
    prepare_mix(cfg, tokenizer)
    assert len(calls) == 3
    calls.clear()
    cfg2 = dataclasses.replace(cfg, token_cache=str(tmp_path / "cache2"))
    threads = [threading.Thread(target=prepare_mix, args=(cfg2, tokenizer)) for _ in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(calls) == 1
