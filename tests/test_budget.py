"""`linearize distill --max-minutes M`: the whole run (training, save, evaluation) ends within M minutes,
step counts fitted to the rate the run measures, and distill.json records the budget, the rates, the
compile seconds and the recompiles. On a lent GPU a run that overran lost everything (DESIGN.md 9)."""

import json
import time

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from conftest import tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model folder, corpus) of a tiny llama and word-level documents long enough for the
    evaluation's 48-token generation prompts."""
    root = tmp_path_factory.mktemp("budget")
    tiny_model("llama", num_hidden_layers=2).save_pretrained(root / "tiny")
    vocab = {"<pad>": 0, "<s>": 1, **{f"w{i}": i for i in range(2, 96)}, "</s>": 96}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(root / "tiny")
    g = torch.Generator().manual_seed(0)
    docs = [" ".join(f"w{int(w)}" for w in torch.randint(2, 96, (int(n),), generator=g))
            for n in torch.randint(50, 120, (80,), generator=g)]
    (root / "corpus.txt").write_text("\n\n\n".join(docs))
    return root / "tiny", root / "corpus.txt"


def test_max_minutes_ends_the_run_with_its_checkpoint_and_evaluation_on_time(tiny, tmp_path):
    from linearize.cli import main

    model, data = tiny
    out = tmp_path / "run"
    budget_min = 0.4  # 24 s: a few steps of each stage on two shared CPU cores, then save and evaluate
    t0 = time.time()
    rc = main(["distill", str(model), "--out", str(out), "--data", str(data), "--preset", "linear",
               "--lora-rank", "4", "--stage1-steps", "1", "--stage2-steps", "1", "--seq-len", "32", "--batch-size", "2",
               "--save-every", "0", "--max-minutes", str(budget_min), "--eval-rows", "2", "--eval-prompts", "1",
               "--passkey", "none"])
    wall = time.time() - t0
    assert rc == 0
    assert wall <= 60 * budget_min, wall  # training, save and evaluation inside the budget
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert "perplexity" in json.dumps(json.loads((out / "eval.json").read_text()))
    summary = json.loads((out / "distill.json").read_text())
    budget = summary["budget"]
    assert budget["max_minutes"] == budget_min and budget["reserve_s"] >= 10 and budget["within"]
    assert summary["wall_s"] <= 60 * budget_min and summary["eval_s"] > 0
    # eval.json names the tokens the model trained on: every stage's
    trained = summary["stage1"]["tokens"] + summary["stage2"]["tokens"]
    assert trained > 0 and json.loads((out / "eval.json").read_text())["training_tokens"] == trained
    for stage in ("stage1", "stage2"):
        s = summary[stage]
        if stage == "stage2" and s.get("skipped_by_budget"):  # a loaded machine: not one step of it fit
            assert s["steps"] == 0
            continue
        assert s["steps"] >= 1 and s["first_step_s"] > 0
        assert s["compiled_graphs"] == 0 and s["recompiles"] == 0  # eager: nothing compiled
        assert "stopped_by_budget" in s
    # the step counts came from the measured rate (stage 1: with the 1:1 share of stage 2), and
    # are written down for a resume to keep the same LR schedule
    assert summary["stage1"]["budget"]["fitted_steps"] == summary["stage1"]["steps"] or summary["stage1"]["stopped_by_budget"]
    fitted = json.loads((out / "budget.json").read_text())["fitted_steps"]
    assert fitted["stage1"] == summary["stage1"]["budget"]["fitted_steps"]
    assert summary["stage1"]["budget"]["probe_s_per_step"] > 0


def _stage_student():
    """A one-layer Hedgehog student with its new parameters trainable, and 8 rows of 16 tokens."""
    import linearize
    from linearize.recipes.distill import new_parameter_names, set_trainable

    torch.manual_seed(0)
    model = linearize.linearize(tiny_model("llama", num_hidden_layers=1),
                                linearize.LinearAttentionConfig(feature_map="hedgehog"))
    set_trainable(model, new_parameter_names(model))
    rows = {"input_ids": torch.randint(2, 90, (8, 16)), "position_ids": torch.arange(16).expand(8, 16).clone()}
    return model, rows


def test_a_stage_budget_fits_the_step_count_fixes_the_schedule_and_a_resume_keeps_it(tmp_path):
    # train_stage with a StageBudget: the first step and the probe steps are timed, fit() gives the
    # count, the cosine schedule runs to it (the probe steps sit in the warmup, whose LR does not
    # depend on the total); a resumed stage takes the written-down count (fixed_steps) and no probe
    from linearize.recipes.distill import attention_transfer_loss
    from linearize.recipes.train import StageBudget, TrainConfig, lr_at, train_stage

    model, rows = _stage_student()
    cfg = TrainConfig(steps=10**9, batch_size=2, lr=1e-2, warmup_steps=4, save_every=0)
    told, fits = [], []
    budget = StageBudget(deadline=time.time() + 600, probe_steps=2, on_fit=told.append,
                         fit=lambda first, rate, done: fits.append((first, rate, done)) or 7)
    out = train_stage("s", model, attention_transfer_loss, rows, cfg, tmp_path, budget=budget)
    assert out["steps"] == 7 and told == [7] and not out["stopped_by_budget"]
    assert len(fits) == 1 and fits[0][2] == 3 and fits[0][0] > 0 and fits[0][1] > 0  # after 1 + 2 probe steps
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    fitted = TrainConfig(steps=7, batch_size=2, lr=1e-2, warmup_steps=4, save_every=0)
    assert lrs == pytest.approx([lr_at(i, fitted) for i in range(7)])

    # a resumed run: the count written down (budget.json) is the stage's, no probe and no fit
    fits.clear()
    again = StageBudget(deadline=time.time() + 600, fixed_steps=5, fit=lambda *a: fits.append(a) or 99)
    out = train_stage("u", model, attention_transfer_loss, rows, cfg, tmp_path, resume=True, budget=again)
    assert out["steps"] == 5 and not fits
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
           if json.loads(line)["stage"] == "u"]
    assert lrs == pytest.approx([lr_at(i, TrainConfig(steps=5, lr=1e-2, warmup_steps=4)) for i in range(5)])

    # a deadline already past: the stage stops after its first step, saved as done
    late = StageBudget(deadline=time.time(), fit=lambda *a: 50)
    out = train_stage("t", model, attention_transfer_loss, rows, cfg, tmp_path, budget=late)
    assert out["steps"] == 1 and out["stopped_by_budget"]
    assert json.loads((tmp_path / "checkpoints" / "t" / "meta.json").read_text()) == {"step": 1, "done": True}


def test_long_row_stage_ends_stage_2_on_long_rows_and_compiles_once(tiny, tmp_path, monkeypatch):
    """``--long-seq-len``: the last ``--long-share`` of stage 2 trains on rows of that length (the same
    tokens a step), as stage 3, with its own budget share, compiled once for its new shape."""
    from linearize.cli import main

    monkeypatch.setenv("LINEARIZE_COMPILE_BACKEND", "aot_eager")  # dynamo's guards, no Inductor build
    model, data = tiny
    out = tmp_path / "run"
    rc = main(["distill", str(model), "--out", str(out), "--data", str(data), "--preset", "linear",
               "--lora-rank", "4", "--stage1-steps", "1", "--stage2-steps", "8", "--long-share", "0.5", "--seq-len", "32",
               "--long-seq-len", "64", "--batch-size", "2", "--save-every", "0", "--compile", "--no-eval"])
    assert rc == 0
    summary = json.loads((out / "distill.json").read_text())
    assert summary["stage2"]["steps"] == 4 and summary["stage3"]["steps"] == 4
    assert summary["stage3"]["tokens"] == summary["stage2"]["tokens"]  # 1 x 64 tokens a step against 2 x 32
    assert summary["stage3"]["recompiles"] == 0, summary["stage3"]
    stages = [json.loads(line)["stage"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert stages.count("stage3_long") == 4 and stages[-1] == "stage3_long"
    # the run lets go of the graphs it trained with before it evaluates: on a GPU their CUDA-graph pools
    # held 28 GiB through an evaluation, which ran out of memory beside another run (2026-12-06d)
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list as compiled_entries
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    assert compiled_entries(LlamaDecoderLayer.forward.__code__) == []
    assert (out / "model.safetensors").is_file()


def test_long_row_stage_gets_its_share_of_the_time_left(tmp_path):
    from linearize.recipes.distill import DistillConfig, _stage_budgets

    cfg = DistillConfig(preset="gdn", stage1_steps=10, stage2_steps=30, long_share=0.25, max_minutes=10)
    plan = {"train_end": time.time() + 400}
    b = _stage_budgets(cfg, plan, tmp_path, {}, long=True)
    n2 = b["stage2"].fit(5.0, 1.0, 3)
    assert 3 + 290 <= n2 <= 3 + 293  # 3/4 of the ~400 s left less stage 3's first step (2 x 5 s), at 1 s a step
    assert b["stage2"].deadline < plan["train_end"] - 50  # it may not run into stage 3's quarter
    assert 398 <= b["stage3"].fit(5.0, 1.0, 0) <= 400  # stage 3 takes what is left
    assert set(_stage_budgets(cfg, plan, tmp_path, {})) == {"stage1", "stage2"}


def test_a_short_budget_leaves_the_long_row_stage_its_compilation_and_its_share(tmp_path):
    # a 9-minute run (2026-12-06i): stage 2 took 3/4 of the time left, the 8K rows' first step (28 s
    # of compilation) the rest, and stage 3 trained one step. Stage 2 now leaves that first step out
    # of its share, guessed as LONG_FIRST_STEP_COST times its own first step
    from linearize.recipes.distill import LONG_FIRST_STEP_COST, DistillConfig, _stage_budgets

    cfg = DistillConfig(preset="lolcats-hybrid", stage1_steps=10, stage2_steps=30, long_share=0.25, max_minutes=10)
    plan = {"train_end": time.time() + 60}
    b = _stage_budgets(cfg, plan, tmp_path, {}, long=True)
    first_s, rate = 10.0, 0.5
    n2 = b["stage2"].fit(first_s, rate, 3)
    compile3 = LONG_FIRST_STEP_COST * first_s
    assert compile3 == 20.0
    assert 3 + 58 <= n2 <= 3 + 60  # 3/4 of the 40 s left once stage 3's first step is set aside
    left_for_stage3 = 60 - (n2 - 3) * rate - compile3
    assert left_for_stage3 >= 0.25 * (60 - compile3) - rate  # its quarter, after its compilation
    # a stage 2 without a long-row stage after it takes all the time left
    assert 3 + 116 <= _stage_budgets(cfg, plan, tmp_path, {})["stage2"].fit(first_s, rate, 3) <= 3 + 120


def test_max_tokens_caps_the_fitted_counts_in_the_stages_shares(tmp_path):
    """--max-tokens: the fitted step counts add up to at most that many tokens (a fast machine ends
    early), stage 1 at its share, stage 2 and the long-row stage at what the stages before left."""
    from linearize.recipes.distill import DistillConfig, _stage_budgets

    cfg = DistillConfig(preset="gdn", stage1_steps=10, stage2_steps=30, long_share=0.25, max_minutes=10,
                        max_tokens=100 * 64)
    plan = {"train_end": time.time() + 10_000}  # time allows thousands of steps at 1 s each
    b = _stage_budgets(cfg, plan, tmp_path, {}, long=True, tokens_per_step=64)
    assert b["stage1"].fit(1.0, 1.0, 2) == 25 and b["stage1"].on_fit(25) is None  # 10 / 40 of 100 steps
    assert b["stage2"].fit(1.0, 1.0, 3) == 56  # 75 left, stage 3 keeps a quarter
    b["stage2"].on_fit(56)
    assert b["stage3"].fit(1.0, 1.0, 0) == 19
    assert json.loads((tmp_path / "budget.json").read_text())["fitted_steps"] == {"stage1": 25, "stage2": 56}
    uncapped = _stage_budgets(DistillConfig(preset="gdn", stage1_steps=10, stage2_steps=30, max_minutes=10),
                              plan, tmp_path, {}, tokens_per_step=64)
    assert uncapped["stage1"].fit(1.0, 1.0, 2) > 1000
    with pytest.raises(ValueError, match="max_tokens must be >= 0"):
        DistillConfig(max_tokens=-1)


def test_a_slower_rate_refits_the_count_lower_so_the_schedule_still_decays(tmp_path):
    # a stage whose steps get slower (a shared GPU): every refit_every steps fit() runs again on the
    # recent median; a count at least 3% lower replaces the stage's (the cosine then ends by the deadline
    # instead of being cut half way), a higher or nearly equal one changes nothing
    from linearize.recipes.distill import attention_transfer_loss
    from linearize.recipes.train import StageBudget, TrainConfig, lr_at, train_stage

    model, rows = _stage_student()
    cfg = TrainConfig(steps=10**9, batch_size=2, lr=1e-2, warmup_steps=2, save_every=0)
    counts = iter([40, 41, 39, 20])  # the fit, then refits after steps 8, 13, 18: higher, within 3%, lower
    told, calls = [], []
    budget = StageBudget(deadline=time.time() + 600, probe_steps=2, refit_every=5, on_fit=told.append,
                         fit=lambda first, rate, done: calls.append(done) or next(counts))
    out = train_stage("s", model, attention_transfer_loss, rows, cfg, tmp_path, budget=budget)
    assert calls == [3, 8, 13, 18] and told == [40, 20] and out["steps"] == 20
    assert budget.record["fitted_steps"] == 20 and [r["step"] for r in budget.record["refits"]] == [18]
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    first, then = TrainConfig(steps=40, lr=1e-2, warmup_steps=2), TrainConfig(steps=20, lr=1e-2, warmup_steps=2)
    assert lrs == pytest.approx([lr_at(i, first) for i in range(18)] + [lr_at(i, then) for i in range(18, 20)])
    assert lrs[-1] < 0.12 * 1e-2  # near the schedule's floor (0.1 x lr): it decayed
