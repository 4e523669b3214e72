"""scripts/bench_train.py --smoke: every row runs the recipes' step on CPU and the page shows it;
a 2-process record gets a scaling column against the 1-process one."""

import json

import pytest
import torch

from conftest import free_port, load_script


def test_smoke_measures_every_row_and_writes_the_page(tmp_path):
    bench = load_script("bench_train")
    out_json, doc = tmp_path / "t.json", tmp_path / "t.md"
    before = torch._dynamo.config.optimize_ddp
    record = bench.main(["--smoke", "--json", str(out_json), "--doc", str(doc)])
    assert torch._dynamo.config.optimize_ddp == before  # its --no-optimize-ddp default does not leak
    names = list(record["rows"])
    # stage 2 trains what the preset trains: lolcats and gdn, every weight
    assert names == ["plain softmax", "lolcats stage 1 (attention transfer)", "lolcats stage 2 (KD, full fine-tune)",
                     "gdn stage 1 (attention transfer)", "gdn stage 2 (KD, full fine-tune)"]
    for name, row in record["rows"].items():
        assert row["tok_per_s"] > 0 and row["loss"] > 0, name
    rows = record["rows"]
    assert rows["lolcats stage 2 (KD, full fine-tune)"]["kd_loss"] == "chunked"
    assert rows["lolcats stage 2 (KD, full fine-tune)"]["trainable"] > rows["plain softmax"]["trainable"]  # + its new weights
    page = doc.read_text()
    assert "| lolcats stage 2 (KD, full fine-tune) |" in page and "| plain softmax | " in page and "100% |" in page
    # the floor: rows with a FLOP count get one, stage 1 (no simple count) does not
    assert record["matmul_tflops"] > 0 and "| floor ms | x floor |" in page
    floors = {n: r.get("floor_ms") for n, r in record["rows"].items()}
    assert floors["plain softmax"] > 0 and floors["lolcats stage 2 (KD, full fine-tune)"] > floors["plain softmax"] / 3
    assert floors["lolcats stage 1 (attention transfer)"] is None

    # a 2-process record beside it: scaling = its tokens/s over the 1-process figure
    data = json.loads(out_json.read_text())
    key = f"1:lolcats,gdn@{record['device']}"
    assert list(data) == [key]
    two = json.loads(json.dumps(data[key]))
    two["processes"] = 2
    two["optimize_ddp"] = True  # torch's default: dynamo cuts the graph at the gradient buckets
    for i, row in enumerate(two["rows"].values()):
        row["tok_per_s"] *= 1.9 if i != 2 else 1.7
    data[bench.record_key(two)] = two
    other = json.loads(json.dumps(two))  # 2 processes on another device: no 1-process run to scale by
    other["device"] = "another GPU"
    data[bench.record_key(other)] = other
    page = bench.render(data)
    assert f"## lolcats,gdn: 2 processes on {record['device']}" in page and page.count(" 1.90x | - | - | - |") == 4 and page.count(" 1.70x | - | - | - |") == 1
    assert page.count("(no 1-process run)") == 5
    # the targets: 4 stage rows against 50% of plain, and the 2-process scaling against 1.8x
    on = f" ({record['device']})"  # two devices in the record: each target names its own
    assert f"| lolcats stage 2 (KD, full fine-tune): scaling, 2 GPUs{on} | 1.70x | >= 1.8x | **missed** |" in page
    assert f"| gdn stage 2 (KD, full fine-tune): scaling, 2 GPUs{on} | 1.90x | >= 1.8x | met |" in page
    assert page.count(f": share of plain, 1 GPU{on}, run `--presets {record['presets']}` |") == 4
    # a CUDA-graph run of the same presets: its own record, section and targets, scaled by nothing else
    graphed = json.loads(json.dumps(record))
    graphed["cuda_graphs"] = True
    assert bench.record_key(graphed) == bench.record_key(record).replace("@", ":cuda-graphs@")
    assert bench.one_process_runs({**data, bench.record_key(graphed): graphed}, two) == bench.one_process_runs(data, two)
    # long rows with activation checkpointing: a record of their own, never the 1K rows' baseline
    long = json.loads(json.dumps(record))
    long["seq_len"], long["gradient_checkpointing"] = 8192, True
    assert bench.record_key(long) == bench.record_key(record).replace("@", ":seq8192:checkpointing@")
    assert bench.one_process_runs({**data, bench.record_key(long): long}, two) == bench.one_process_runs(data, two)
    assert ": share of plain, 1 GPU (2 x 8192 tokens, activation checkpointing)" in bench.render({bench.record_key(long): {**long, "batch_per_gpu": 2}})
    page2 = bench.render({**data, bench.record_key(graphed): graphed})
    assert page2.count(f": share of plain, 1 GPU (CUDA graphs: `--cuda-graphs`){on}") == 4
    # the same 2 processes with dynamo's DDP graph splitting off: a record and a section of their own
    nosplit = json.loads(json.dumps(two))
    nosplit["optimize_ddp"] = False
    data[bench.record_key(nosplit)] = nosplit
    assert bench.record_key(nosplit) == f"2:lolcats,gdn:no-optimize-ddp@{record['device']}" and len(data) == 4
    page = bench.render(data)
    assert "## lolcats,gdn: 2 processes (DDP, dynamo's DDP graph splitting off)" in page
    assert page.count(" 1.90x | - | - | - |") == 8  # scaled against the same 1-process run
    assert "not measured" not in page and "lean high" not in page
    # a run cut before its last row, whose plain step ran faster per GPU than the 1-process one's
    cut = json.loads(json.dumps(nosplit))
    last = list(cut["rows"])[-1]
    del cut["rows"][last]
    next(iter(cut["rows"].values()))["tok_per_s"] *= 2.2 / 1.9
    data[bench.record_key(cut)] = cut
    page = bench.render(data)
    assert page.count(f"| {last} | not measured (the run stopped before it) |") == 1
    assert "the scaling figures of this section lean high by up to 10%" in page


def test_scaling_takes_each_row_from_the_one_process_runs_of_its_device():
    # presets measured one process each, side by side (--presets lolcats; --presets gdn), then one
    # several-process run of both: each row scales against its own preset's 1-process row, never
    # against another device's run of the same presets
    bench = load_script("bench_train")
    setup = {"shape": "s", "batch_per_gpu": 16, "seq_len": 1024, "compile": True, "packed": False,
             "kd_chunk_size": 1024, "gradient_checkpointing": False, "steps": 6, "warmup": 3,
             "versions": {"torch": "t", "triton": "t", "transformers": "t", "cuda": "c"}, "command": "c"}

    def rec(device, P, presets, rates, **kw):
        rows = {"plain softmax (compiled whole)": {"tok_per_s": rates[0], "ms_per_step": 1.0}}
        for preset, rate in zip(presets.split(","), rates[1:]):
            rows[f"{preset} stage 1 (attention transfer)"] = {"tok_per_s": rate, "ms_per_step": 1.0}
        return {**setup, "device": device, "processes": P, "presets": presets, "rows": rows, **kw}

    runs = [rec("H100", 1, "lolcats", [100, 60]), rec("H100", 1, "gdn", [100, 50]),
            rec("H200", 1, "lolcats,gdn", [150, 10, 10]),  # another device: never a baseline here
            rec("H100", 4, "lolcats,gdn", [380, 228, 150], optimize_ddp=False)]
    data = {bench.record_key(r): r for r in runs}
    assert len(data) == 4 and "4:lolcats,gdn:no-optimize-ddp@H100" in data
    page = bench.render(data)
    assert "| lolcats stage 1 (attention transfer): scaling, 4 GPUs (DDP, dynamo's DDP graph splitting off) (H100) | 3.80x | >= 3.4x | met |" in page
    assert "| gdn stage 1 (attention transfer): scaling, 4 GPUs (DDP, dynamo's DDP graph splitting off) (H100) | 3.00x | >= 3.4x | **missed** |" in page
    assert "not measured" not in page
    # the same run cut before gdn's row: said so, not silently left out
    del runs[-1]["rows"]["gdn stage 1 (attention transfer)"]
    page = bench.render({bench.record_key(r): r for r in runs})
    assert page.count("| gdn stage 1 (attention transfer) | not measured (the run stopped before it) |") == 1
    # a 1-process run slowed by its host: the 2-process plain row scales 2.5x, so each stage's
    # figure leans high by 25% and is judged without it
    runs.append(rec("H100", 2, "lolcats", [250, 132], optimize_ddp=False))
    page = bench.render({bench.record_key(r): r for r in runs})
    assert "lean high by up to 25%; the targets below judge each figure divided by the lean of its own 1-process run's plain row (1.25 here)" in page
    assert ("| lolcats stage 1 (attention transfer): scaling, 2 GPUs (DDP, dynamo's DDP graph splitting off) (H100) | "
            "2.20x (1.76x without the plain row's lean) | >= 1.8x | **missed** |") in page


def test_two_processes_record_the_cost_of_the_gradient_sync(tmp_path):
    # the multi-GPU command of the docs, on 2 CPU processes (gloo): every row runs under DDP (a
    # parameter without a gradient would stop it), and the record says what the all-reduce costs
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_train.py"
    out_json, doc = tmp_path / "t.json", tmp_path / "t.md"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--main_process_port", str(free_port()), "--mixed_precision", "no", "--dynamo_backend", "no", str(script), "--smoke",
           "--presets", "lolcats:finetune=lora", "--json", str(out_json), "--doc", str(doc)]
    proc = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (record,) = json.loads(out_json.read_text()).values()
    assert record["presets"] == "lolcats:finetune=lora"
    assert record["processes"] == 2 and record["allreduce_busbw_gbps"] > 0
    lora = "lolcats:finetune=lora stage 2 (KD, LoRA)"
    assert list(record["rows"]) == ["plain softmax", "lolcats:finetune=lora stage 1 (attention transfer)", lora]
    for name, row in record["rows"].items():
        assert row["ms_no_sync"] > 0 and row["grad_mb"] > 0, name
    # LoRA trains far fewer bytes than the whole model: the all-reduce floor follows the trainable weights
    assert record["rows"][lora]["grad_mb"] < record["rows"]["plain softmax"]["grad_mb"] / 5
    page = doc.read_text()
    assert "| ms/step without sync | all-reduce floor ms | P x without / with sync |" in page
    row = record["rows"][lora]
    assert f" | {2 * row['ms_no_sync'] / row['ms_per_step']:.2f}x |" in page
    assert len(row["ms_steps"]) == 2 and row["ms_per_step"] == pytest.approx(sum(row["ms_steps"]) / 2)


def test_step_flops_count_every_weight_a_token_meets():
    # forward FLOPs = 2 x the weights of the matrix products (every parameter but the norms, the
    # tied embedding counted once, as the head) + causal attention; plain = 3 x forward
    from transformers import LlamaConfig, LlamaForCausalLM

    from linearize.benchmarks.plan import SHAPES

    bench = load_script("bench_train")
    config = LlamaConfig(**SHAPES["smollm2-135m"])
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    matmul = sum(p.numel() for n, p in model.named_parameters() if "norm" not in n)
    T = 1024
    att = 2 * config.num_hidden_layers * T * config.num_attention_heads * config.head_dim
    assert bench.step_flops("plain softmax", config, 1, T) == 3 * (2 * matmul + att)
    assert bench.step_flops("x stage 2 (KD, LoRA)", config, 10, T) == 10 * (3 * 2 * matmul + att)
    assert bench.step_flops("x stage 2 (KD, full fine-tune)", config, 10, T) == 10 * (4 * 2 * matmul + att)
    assert bench.step_flops("x stage 1 (attention transfer)", config, 10, T) is None


def test_fsdp_rows_shard_stage_2_and_train_like_ddp(tmp_path):
    # --fsdp: the stage-2 row of a full fine-tune runs sharded (FSDP2), in a record of its own, and
    # computes the DDP row's loss (same rows, same weights; at the bench's lr the updates are too
    # small to tell apart: tests/test_distributed.py compares FSDP training with one process)
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_train.py"
    out_json = tmp_path / "t.json"
    for extra in ([], ["--fsdp"]):
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--main_process_port", str(free_port()), "--mixed_precision", "no", "--dynamo_backend", "no", str(script), "--smoke",
               "--presets", "gdn", "--json", str(out_json), "--doc", str(tmp_path / "t.md"), *extra]
        proc = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    data = {k.split("@")[0]: v for k, v in json.loads(out_json.read_text()).items()}
    assert set(data) == {"2:gdn:no-optimize-ddp", "2:gdn:no-optimize-ddp:fsdp"}
    ddp, fsdp = data["2:gdn:no-optimize-ddp"]["rows"], data["2:gdn:no-optimize-ddp:fsdp"]["rows"]
    row = "gdn stage 2 (KD, full fine-tune)"
    assert fsdp[row].get("fsdp") and "fsdp" not in fsdp["gdn stage 1 (attention transfer)"]
    assert "ms_no_sync" not in fsdp[row] and "ms_no_sync" in ddp[row]
    assert fsdp[row]["loss"] == pytest.approx(ddp[row]["loss"], rel=1e-4)
    assert "(stage 2 sharded with FSDP2, eager)" in (tmp_path / "t.md").read_text()


def test_stages_2_times_only_the_plain_row_and_stage_2_under_a_record_of_its_own(tmp_path):
    bench = load_script("bench_train")
    record = bench.main(["--smoke", "--presets", "gdn", "--stages", "2", "--gradient-checkpointing",
                         "--json", str(tmp_path / "t.json"), "--doc", str(tmp_path / "t.md")])
    assert list(record["rows"]) == ["plain softmax", "gdn stage 2 (KD, full fine-tune)"]
    assert list(json.loads((tmp_path / "t.json").read_text())) == [f"1:gdn:checkpointing:stage2@{record['device']}"]
    assert record["rows"]["gdn stage 2 (KD, full fine-tune)"]["tok_per_s"] > 0


def test_plain_again_times_the_plain_row_twice_and_judges_by_the_faster(tmp_path):
    bench = load_script("bench_train")
    record = bench.main(["--smoke", "--presets", "gdn", "--stages", "2", "--plain-again",
                         "--json", str(tmp_path / "t.json"), "--doc", str(tmp_path / "t.md")])
    plain, stage2 = "plain softmax", "gdn stage 2 (KD, full fine-tune)"
    assert list(record["rows"]) == [plain, stage2, plain + " (again)"]
    assert record["rows"][plain + " (again)"]["tok_per_s"] > 0
    # known rates: the first plain timing slowed by a neighbour (50 / s), the second not (100 / s)
    one = json.loads(json.dumps(record))
    one["rows"][plain]["tok_per_s"], one["rows"][plain + " (again)"]["tok_per_s"] = 50.0, 100.0
    one["rows"][stage2]["tok_per_s"] = 60.0
    page = bench.render({bench.record_key(one): one})
    assert "(`--plain-again`)" in page
    assert f"| {stage2}: share of plain, 1 GPU, run `--presets gdn` | 60% | >= 50% | met |" in page
    assert page.count("share of plain, 1 GPU") == 1  # the second plain timing is no stage
    # 2 processes whose plain row ran 2 x 100 / s: no lean against the faster 1-process timing
    two = json.loads(json.dumps(one))
    two["processes"], two["optimize_ddp"] = 2, False
    two["rows"][plain]["tok_per_s"], two["rows"][plain + " (again)"]["tok_per_s"] = 200.0, 200.0
    two["rows"][stage2]["tok_per_s"] = 114.0
    data = {bench.record_key(one): one, bench.record_key(two): two}
    assert bench.plain_lean(data, two) == 1.0
    assert "| 1.90x | >= 1.8x | met |" in bench.render(data)
    one["rows"][plain + " (again)"]["tok_per_s"] = 50.0  # both timings slow: the 2-process figures lean 2x
    assert bench.plain_lean(data, two) == 2.0
    assert "| 1.90x (0.95x without the plain row's lean) | >= 1.8x | **missed** |" in bench.render(data)


def test_packed_real_documents_and_a_whole_budgeted_distill_run_are_timed_beside_the_random_rows(tmp_path):
    # --data: each stage row again on packed real documents (the CLI's data path), with the
    # recompiles its timed steps met; --distill-minutes: a whole `linearize distill --max-minutes`
    # run, its end-to-end rate (compilation, save, evaluation included) beside the steady s/step
    from test_budget import tiny as tiny_fixture

    model, corpus = tiny_fixture.__wrapped__(type("F", (), {"mktemp": lambda self, n: tmp_path / n})())
    bench = load_script("bench_train")
    record = bench.main(["--smoke", "--presets", "linear", "--stages", "1", "--data", str(corpus), "--tokenizer",
                         str(model), "--model", str(model), "--distill-minutes", "0.5", "--json",
                         str(tmp_path / "t.json"), "--doc", str(tmp_path / "t.md")])
    real = f"linear stage 1 (attention transfer) (packed {corpus})"
    assert list(record["rows"]) == ["plain softmax", "linear stage 1 (attention transfer)", real]
    assert record["rows"][real]["tok_per_s"] > 0 and record["rows"][real]["recompiles"] == 0
    e2e = record["end_to_end"]["linear"]
    assert "error" not in e2e, e2e
    # (whether it ended within the budget depends on the load of the machine: tests/test_budget.py
    # asserts it in-process, without a second interpreter's start-up)
    assert e2e["wall_s"] > 0 and e2e["budget_s"] == 30 and isinstance(e2e["within"], bool)
    assert e2e["tokens"] > 0 and e2e["tok_per_s_end_to_end"] > 0 and e2e["stages"]["stage1"]["steps"] >= 1
    page = (tmp_path / "t.md").read_text()
    assert f"| {real} |" in page and "end-to-end tok/s" in page
