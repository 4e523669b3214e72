"""scripts/results.py builds the distill commands behind docs/reports/quality.md: the flags the real CLI parser
ends up with (later flags win) and the tokens per optimizer step its step counts are fitted with."""

import pytest

from conftest import load_script
from linearize.cli import build_parser


def _script():
    return load_script("results")


def _parsed(cmd):
    return build_parser().parse_args([*cmd[1:], "--out", "x"])


@pytest.mark.parametrize("name,seq,batch", [("lolcats", 1024, 16), ("gdn-hybrid", 1024, 16)])
def test_split_batch_keeps_tokens_per_step_and_divides_the_micro_batch(name, seq, batch):
    rs = _script()
    alone, tokens_alone = rs.base_command(name, "m", "d")
    shared, tokens_shared = rs.base_command(name, "m", "d", split_batch=2)
    a, s = _parsed(alone), _parsed(shared)
    assert (a.seq_len, a.batch_size, a.grad_accum) == (seq, batch, 1)
    assert (s.seq_len, s.batch_size, s.grad_accum) == (seq, batch // 2, 2)
    assert tokens_alone == tokens_shared == 16384
    # --processes 2: the same distill command under accelerate's launcher on 2 GPUs, each half the rows
    ddp, tokens_ddp = rs.base_command(name, "m", "d", processes=2)
    cli = ddp.index("linearize.cli")
    assert ddp[ddp.index("--num_processes") + 1] == "2" and ddp[ddp.index("--mixed_precision") + 1] == "bf16"
    d = build_parser().parse_args([*ddp[cli + 1:], "--out", "x"])
    assert (d.seq_len, d.batch_size, d.grad_accum, tokens_ddp) == (seq, batch // 2, 1, 16384)
    with pytest.raises(SystemExit, match="--processes 3 does not divide"):
        rs.base_command(name, "m", "d", processes=3)


def test_split_batch_must_divide_the_batch_and_extra_flags_win():
    rs = _script()
    gdn = _parsed(rs.base_command("gdn", "m", "d")[0])
    assert gdn.max_skipped_steps == 10 and gdn.compile and gdn.cuda_graphs
    assert (gdn.stage1_steps, gdn.stage2_steps) == (300, 700)  # the stages' shares of a --max-minutes budget
    with pytest.raises(SystemExit, match="does not divide"):
        rs.base_command("lolcats", "m", "d", split_batch=3)
    cmd, tokens = rs.base_command("lolcats", "m", "d", extra="--seq-len 128 --grad-accum 3")
    assert tokens == 128 * 16 * 3 and _parsed(cmd).seq_len == 128


def test_write_shows_the_new_figures_and_reads_older_runs(tmp_path):
    """`write` on run folders from before the corpora, fluency, chat and window-only figures (the
    stored ones in docs/reports/data) gives the page without those tables; a run with them adds its rows."""
    import json
    import shutil
    from pathlib import Path

    old = Path(__file__).resolve().parents[1] / "docs" / "reports" / "data" / "results_runs"
    runs = tmp_path / "runs"
    shutil.copytree(old, runs)
    rs = _script()
    rs.main(["write", str(runs), "--out", str(tmp_path / "old.md")])
    page = (tmp_path / "old.md").read_text()
    assert "| lolcats | 1 |" in page and "Other corpora" not in page and "window-only perplexity" not in page
    assert "| run | context | passkey | trials | teacher |\n" in page  # no run recorded a window-only passkey
    assert "Recall tokens and the others" not in page and "By position in the document" not in page
    dj = json.loads((runs / "lolcats" / "distill.json").read_text())
    for stage in ("stage1", "stage2"):
        dj[stage]["processes"] = 2  # trained under accelerate launch on 2 GPUs
    (runs / "lolcats" / "distill.json").write_text(json.dumps(dj))
    ev = json.loads((runs / "lolcats" / "eval.json").read_text())
    ev.update(fluency_teacher_ppl_of_student=9.5, fluency_teacher_ppl_of_teacher=2.25, chat_prefix_agreement=0.5,
              chat_prefix_agreement_se=0.125, generation_prefix_agreement_se=0.05,
              chat_exact_match=0.25, chat_teacher_ppl_of_student=4.0, chat_teacher_ppl_of_teacher=1.5,
              window_only={"perplexity": 31.0, "top1_agreement": 0.6, "passkey": {"1024": 0.75}}, passkey={"1024": 0.5, "2048": 0.0},
              passkey_trials={"1024": 4}, cut_by_deadline=["passkey trials"],
              corpora={"wiki": {"perplexity": 30.0, "teacher_perplexity": 20.0, "perplexity_ratio": 1.5, "top1_agreement": 0.7,
                                "recall": {"share": 0.25, "perplexity_ratio": 2.0}, "other": {"share": 0.75, "perplexity_ratio": 1.25},
                                "by_position": {"0-63": {"perplexity_ratio": 1.25}, "64-255": {"perplexity_ratio": 1.75}}}})
    (runs / "lolcats" / "eval.json").write_text(json.dumps(ev))
    rs.main(["write", str(runs), "--out", str(tmp_path / "new.md")])
    page = (tmp_path / "new.md").read_text()
    assert f"| lolcats | 9.50 | 2.25 | 0.500 ± 0.125 | 0.250 | 4.00 | 1.50 | 31.00 | {ev['perplexity']:.2f} | 0.600 |" in page
    assert f"| {ev['generation_prefix_agreement']:.3f} ± 0.050 | {ev['generation_exact_match']:.3f} |" in page  # its error
    assert "| lolcats | wiki | 30.00 | 20.00 | 1.500 | 0.700 |" in page and "| lolcats | 2 |" in page
    assert "| lolcats | wiki | 25.0% | 2.000 | 1.250 |" in page  # the recall split, only where recorded
    assert "| lolcats | held-out (in domain) |" not in page
    assert "| run | corpus | 0-63 | 64-255 |" in page and "| lolcats | wiki | 1.250 | 1.750 |" in page  # by position
    # an existing page without the section's markers is refused (appended, it would land after the page's end)
    with pytest.raises(SystemExit, match="has no section 'results_x'"):
        rs.main(["write", str(runs), "--out", str(tmp_path / "new.md"), "--section", "results_x"])
    assert (tmp_path / "new.md").read_text() == page
    # the trials behind each passkey figure: 4 recorded, "n/a" where a run did not record them
    assert "| lolcats | 1024 | 0.50 | 4 |" in page and "| lolcats | 2048 | 0.00 | n/a |" in page
    # the passkey with the linear branch zeroed: a column once a run recorded it ("n/a" where it did not)
    assert "| run | context | passkey | trials | teacher | window only |" in page
    assert "| lolcats | 1024 | 0.50 | 4 | 1.00 | 0.75 |" in page and "| lolcats | 2048 | 0.00 | n/a | 1.00 | n/a |" in page
    # a window-only passkey the evaluation's deadline cut: its own trials where fewer, "cut" where none ran
    ev["window_only"].update(passkey={"1024": 0.75}, passkey_trials={"1024": 3})
    ev["cut_by_deadline"] = ["window-only passkey trials"]
    (runs / "lolcats" / "eval.json").write_text(json.dumps(ev))
    rs.main(["write", str(runs), "--out", str(tmp_path / "cut.md")])
    cut = (tmp_path / "cut.md").read_text()
    assert "| lolcats | 1024 | 0.50 | 4 | 1.00 | 0.75 (3 trials) |" in cut
    assert "| lolcats | 2048 | 0.00 | n/a | 1.00 | cut by the deadline |" in cut
    # the trials only one of student and teacher retrieved, on the same prompts: a column once a run kept its trials
    assert "retrieved by one alone" not in cut
    ev.update(passkey_hits={"1024": "1100"}, teacher_passkey_hits={"1024": "1011"})
    (runs / "lolcats" / "eval.json").write_text(json.dumps(ev))
    rs.main(["write", str(runs), "--out", str(tmp_path / "paired.md")])
    paired = (tmp_path / "paired.md").read_text()
    assert "| run | context | passkey | trials | teacher | window only | retrieved by one alone (student / teacher) |" in paired
    assert "| lolcats | 1024 | 0.50 | 4 | 1.00 | 0.75 (3 trials) | 1 / 2 |" in paired
    assert "| lolcats | 2048 | 0.00 | n/a | 1.00 | cut by the deadline | n/a |" in paired
    del ev["passkey_hits"], ev["teacher_passkey_hits"]
    # the page's passkey sentence names a count only where every figure stands on that many prompts
    assert "as many as its table's trials column gives" in page and "Passkey: 20 synthetic" not in page
    ev["passkey_trials"] = {"1024": 60, "2048": 60}
    (runs / "lolcats" / "eval.json").write_text(json.dumps(ev))
    only = tmp_path / "only"
    only.mkdir()
    shutil.copytree(runs / "lolcats", only / "lolcats")
    shutil.copy(runs / "lolcats.command.txt", only / "lolcats.command.txt")
    rs.main(["write", str(only), "--out", str(tmp_path / "sixty.md")])
    assert "Passkey: 60 synthetic prompts per length." in (tmp_path / "sixty.md").read_text()
    # runs evaluated with --passkey none: no passkey section, rather than a table head with no rows
    assert "## Passkey retrieval" in page
    for ej in runs.glob("*/eval.json"):
        ev = json.loads(ej.read_text())
        ev.pop("passkey", None)
        ej.write_text(json.dumps(ev))
    rs.main(["write", str(runs), "--out", str(tmp_path / "nopasskey.md")])
    page = (tmp_path / "nopasskey.md").read_text()
    assert "Passkey" not in page and "| lolcats | 9.50 |" in page



def test_step_times_are_the_median_of_each_stage_from_its_metrics(tmp_path):
    """median_step_seconds reads metrics.jsonl (or .jsonl.gz) rows of cumulative tokens and tokens/s per
    stage: the median step leaves out a first step slowed by compilation."""
    import gzip
    import json

    rs = _script()
    rows, t = [], 0.0
    for stage, steps in (("s1", [30.0, 5.0, 0.1, 0.1, 0.1]), ("s2", [20.0, 0.2, 0.25, 0.2])):
        t = tokens = 0.0
        for dt in steps:
            t, tokens = t + dt, tokens + 100
            rows.append({"stage": stage, "step": len(rows), "tokens": tokens, "tok_per_s": tokens / t})
    with gzip.open(tmp_path / "metrics.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    steps = rs.median_step_seconds(tmp_path)
    assert steps.keys() == {"s1", "s2"}
    assert abs(steps["s1"] - 0.1) < 1e-9 and abs(steps["s2"] - 0.2) < 1e-9
    assert rs.median_step_seconds(tmp_path / "none") == {}


def test_every_run_is_a_valid_distill_command():
    """Each RUNS row parses with the real CLI and builds its DistillConfig (a misspelt flag or a bad value
    would otherwise surface on the GPU, minutes into a lease)."""
    from linearize.flags import dataclass_from_args
    from linearize.recipes.distill import DistillConfig

    rs = _script()
    for name in rs.RUNS:
        args = _parsed(rs.base_command(name, "m", "d")[0])
        cfg = dataclass_from_args(DistillConfig, args)
        assert cfg.max_tokens == 100_000_000 and (cfg.stage1_steps, cfg.stage2_steps) in ((300, 700), (100, 900), (500, 500)), name
    # the linear runs before 2026-11-29e ran without the gate the preset has now: their rows say so
    for name in ("linear-full", "linear-lr3e-4"):
        assert dataclass_from_args(DistillConfig, _parsed(rs.base_command(name, "m", "d")[0])).method_config().decay is None
    preset = dataclass_from_args(DistillConfig, _parsed(rs.base_command("linear", "m", "d")[0])).method_config()
    assert (preset.decay, preset.gate_rank) == ("channel", 16)
    # the full-width gate of -29i and -29k keeps its width now that the preset's gate is rank 16
    full = dataclass_from_args(DistillConfig, _parsed(rs.base_command("linear-channel", "m", "d")[0])).method_config()
    assert (full.decay, full.gate_rank) == ("channel", 0)
    # the scalar gate's levers of 2026-11-29f to -29j keep the gate they ran with
    for name in ("linear-decay", "linear-s1-50", "linear-f256", "linear-conv4", "linear-lr5e-5", "linear-scalar-lr3e-4"):
        assert dataclass_from_args(DistillConfig, _parsed(rs.base_command(name, "m", "d")[0])).method_config().decay == "scalar"
    assert dataclass_from_args(DistillConfig, _parsed(rs.base_command("swa-w64", "m", "d")[0])).resolved()["window"] == 64
    assert dataclass_from_args(DistillConfig, _parsed(rs.base_command("lolcats", "m", "d")[0])).resolved()["window"] == 192
    # the stage-1 share levers change the shares only: each keeps its preset's learning rate and long-row tail
    for name, preset in (("gdn-hybrid-s1-10", "gdn-hybrid"), ("gdn-s1-10", "gdn-lr3e-4")):  # "gdn" pins lr 1e-4
        lever, base = (dataclass_from_args(DistillConfig, _parsed(rs.base_command(n, "m", "d")[0])) for n in (name, preset))
        assert (lever.stage1_steps, lever.stage2_steps) == (100, 900) != (base.stage1_steps, base.stage2_steps)
        same = {k: v for k, v in vars(base).items() if k not in ("stage1_steps", "stage2_steps", "_from_preset")}
        assert {k: vars(lever)[k] for k in same} == same and lever.resolved() == base.resolved()


def test_a_run_adds_its_own_sources_beside_the_lease_mix():
    """MORE_DATA: gdn-hybrid-austen trains on the lease's --data mix plus the Austen folder found beside
    the mix's first source; the other runs keep the mix as given."""
    rs = _script()
    mix = "/root/data/Documentation@5,/root/data/gcide@4,/root/data/chat@9"
    assert _parsed(rs.base_command("gdn-hybrid-austen", "m", mix)[0]).data == mix + ",/root/data/austen@7"
    assert _parsed(rs.base_command("gdn-hybrid-text", "m", mix)[0]).data == mix + ",/root/data/teacher-text@8"
    assert _parsed(rs.base_command("gdn-hybrid-free", "m", mix)[0]).data == mix + ",/root/data/teacher-text@8"
    assert _parsed(rs.base_command("gdn-hybrid", "m", mix)[0]).data == mix


def _fake_run(folder, stages=("stage1_attention_transfer", "stage2_kd", "stage3_long"), stage2_done=True):
    """A run folder as distill leaves it mid-way: a checkpoint per stage, their metrics lines, the fitted steps."""
    import json

    for s in stages:
        (folder / "checkpoints" / s).mkdir(parents=True)
        (folder / "checkpoints" / s / "trainable.safetensors").write_bytes(s.encode())
        done = stage2_done or s != "stage2_kd"
        (folder / "checkpoints" / s / "meta.json").write_text(json.dumps({"step": 3, "done": done}))
        (folder / f"loss_{s}.png").write_bytes(b"png")
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"stage": s, "step": i, "loss": 1.0}) + "\n"
                                                  for s in stages for i in range(2)))
    (folder / "budget.json").write_text(json.dumps({"fitted_steps": {"stage1": 10, "stage2": 20, "stage3": 5}}))


def test_a_branch_takes_its_base_stages_1_and_2_and_trains_the_long_stage_alone(tmp_path, monkeypatch):
    """`run NAME --from BASE`: only a recipe that differs in the long-row stage's flags may branch; it waits
    for the base's finished stage 2, copies stages 1-2 (not 3) and resumes from them."""
    import json

    rs = _script()
    runs = tmp_path / "runs"
    base = runs / "lolcats-hybrid"
    _fake_run(base, stage2_done=False)
    for other in ("lolcats-hybrid-decay-new", "lolcats-hybrid", "gdn-hybrid"):  # stage 1-2 flags differ, or nothing
        with pytest.raises(SystemExit, match="cannot start from"):
            rs.branch_from(other, "lolcats-hybrid", runs, timeout_s=0)
    with pytest.raises(SystemExit, match="did not finish within"):  # stage 2 still running
        rs.branch_from("lolcats-hybrid-long-same", "lolcats-hybrid", runs, timeout_s=0, poll_s=0)
    (runs / "lolcats-hybrid.rc").write_text("1\n")
    with pytest.raises(SystemExit, match="ended without a finished stage 2"):
        rs.branch_from("lolcats-hybrid-long-same", "lolcats-hybrid", runs, timeout_s=60, poll_s=0)
    assert not (runs / "lolcats-hybrid-long-same").exists()
    (base / "checkpoints" / "stage2_kd" / "meta.json").write_text(json.dumps({"step": 3, "done": True}))

    ran = []
    monkeypatch.setattr(rs.subprocess, "run", lambda cmd, check: ran.append(cmd))
    rs.main(["run", "lolcats-hybrid-long-same", "--from", "lolcats-hybrid", "--model", "m", "--data", "d",
             "--runs", str(runs), "--minutes", "12"])
    out = runs / "lolcats-hybrid-long-same"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["stage1_attention_transfer", "stage2_kd"]
    assert (out / "checkpoints" / "stage2_kd" / "trainable.safetensors").read_bytes() == b"stage2_kd"
    stages = {json.loads(x)["stage"] for x in (out / "metrics.jsonl").read_text().splitlines()}
    assert stages == {"stage1_attention_transfer", "stage2_kd"}  # the base's stage-3 lines are not the branch's
    assert json.loads((out / "budget.json").read_text()) == {"fitted_steps": {"stage1": 10, "stage2": 20}}
    assert json.loads((out / "branch.json").read_text())["from"] == "lolcats-hybrid"
    assert not (out / "loss_stage3_long.png").exists()
    cmd = ran[0]
    assert cmd[-1] == "--resume" and cmd[cmd.index("--max-minutes") + 1] == "12"
    args = _parsed(cmd[:-1])
    assert (args.preset, args.long_finetune, cmd[cmd.index("--out") + 1]) == ("lolcats-hybrid", "same", str(out))
    assert "stages 1-2: lolcats-hybrid's" in (runs / "lolcats-hybrid-long-same.command.txt").read_text()
    # run again (interrupted): the branch resumes itself, nothing is copied over its own stage 3
    (out / "checkpoints" / "stage3_long").mkdir()
    rs.main(["run", "lolcats-hybrid-long-same", "--from", "lolcats-hybrid", "--model", "m", "--data", "d",
             "--runs", str(runs), "--minutes", "5"])
    assert (out / "checkpoints" / "stage3_long").is_dir() and ran[1][-1] == "--resume"
    # the minutes count from when the base's stage 2 was there: the wait comes off the budget
    monkeypatch.setattr(rs, "branch_from", lambda *a, **kw: 120.0)
    rs.main(["run", "lolcats-hybrid-long-same", "--from", "lolcats-hybrid", "--model", "m", "--data", "d",
             "--runs", str(runs), "--minutes", "12", "--extra=--budget-reserve 0.2"])
    assert ran[2][ran[2].index("--max-minutes") + 1] == "10"
    # ... and its evaluation keeps the seconds its base keeps: 0.2 of 12 minutes is 0.24 of 10
    assert _parsed(ran[2][:-1]).budget_reserve == pytest.approx(0.24)


def test_write_counts_a_branch_base_stages(tmp_path):
    """A branch's own distill.json has its resumed stages 1-2 at 0 tokens: `write` takes them from the base."""
    import json
    import shutil
    from pathlib import Path

    rs = _script()
    stored = Path(__file__).resolve().parents[1] / "docs" / "reports" / "data" / "results_runs_2026-12-06b"
    runs = tmp_path / "runs"
    shutil.copytree(stored, runs)
    branch = runs / "lolcats-hybrid-long-same"
    shutil.copytree(runs / "lolcats-hybrid", branch)
    shutil.copy(runs / "lolcats-hybrid.command.txt", runs / "lolcats-hybrid-long-same.command.txt")
    dj = json.loads((branch / "distill.json").read_text())
    for k in ("stage1", "stage2"):
        dj[k] = {"steps": dj[k]["steps"], "tokens": 0, "seconds": 0.0, "final_loss": 0.1, "resumed": True}
    dj["stage3"].update(tokens=10_000_000, seconds=100.0)
    (branch / "distill.json").write_text(json.dumps(dj))
    (branch / "branch.json").write_text(json.dumps({"from": "lolcats-hybrid", "stages": ["stage1", "stage2"]}))
    rs.main(["write", str(runs), "--out", str(tmp_path / "page.md")])
    page = (tmp_path / "page.md").read_text()
    assert "| lolcats-hybrid | 1 | 100.0M | 874 |" in page
    assert "| lolcats-hybrid-long-same | 1 | 92.5M | 783 |" in page  # 29.9M + 52.6M of the base, 10M of its own
    shutil.rmtree(runs / "lolcats-hybrid")
    with pytest.raises(SystemExit, match="took its stages 1-2 from lolcats-hybrid"):
        rs.main(["write", str(runs), "--out", str(tmp_path / "page2.md")])


def test_a_branch_resumes_through_distill_from_the_base_stage_2(tmp_path):
    """End to end on a tiny model: the base run (the lolcats-hybrid preset: its long-row stage on the new
    weights alone), then a branch from its stage-2 checkpoint with the long-row stage on every weight:
    stages 1-2 are resumed, not retrained, and only the branch's long-row stage moves the MLPs."""
    import json

    from conftest import tiny_model_dir, word_docs
    from linearize.cli import main
    from safetensors.torch import load_file

    rs = _script()
    src, docs, runs = tiny_model_dir(tmp_path / "tiny", "llama"), word_docs(tmp_path / "docs", n=24), tmp_path / "runs"
    tiny = ["distill", str(src), "--data", str(docs), "--held-out-percent", "20", "--seq-len", "32", "--batch-size", "2",
            "--stage1-steps", "2", "--stage2-steps", "4", "--eval-rows", "2", "--eval-prompts", "1", "--passkey", "none",
            "--preset", "lolcats-hybrid", "--window", "8", "--long-seq-len", "64"]
    base, branch = runs / "lolcats-hybrid", runs / "lolcats-hybrid-long-same"
    assert main([*tiny, "--out", str(base)]) == 0
    rs.branch_from("lolcats-hybrid-long-same", "lolcats-hybrid", runs, timeout_s=0)
    assert main([*tiny, "--long-finetune", "same", "--out", str(branch), "--resume"]) == 0
    a, b = (json.loads((d / "distill.json").read_text()) for d in (base, branch))
    assert [b[s].get("resumed") for s in ("stage1", "stage2", "stage3")] == [True, True, None]
    assert b["stage3"]["tokens"] == a["stage3"]["tokens"] > 0 and b["softmax_layers"] == a["softmax_layers"]
    assert (a["config"]["long_finetune"], b["config"]["long_finetune"]) == ("new", "same")
    stage2 = load_file(str(base / "checkpoints" / "stage2_kd" / "trainable.safetensors"))
    mlp = "model.layers.0.mlp.down_proj.weight"
    wa, wb = (load_file(str(d / "model.safetensors"))[mlp] for d in (base, branch))
    assert (wa == stage2[mlp].to(wa.dtype)).all() and not (wb == stage2[mlp].to(wb.dtype)).all()
