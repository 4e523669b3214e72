"""Training speed: tokens/s and peak memory of the distillation stages beside the plain softmax
training step of the same model, in one process, on random SmolLM2-135M-shaped weights.

    python scripts/bench_train.py                                    # one GPU -> docs/reports/training.md
    accelerate launch --multi_gpu --num_processes 2 scripts/bench_train.py   # then 2 GPUs: + scaling
    python scripts/bench_train.py --smoke --json /tmp/t.json --doc /tmp/t.md # tiny shape on CPU (CI)

Rows: "plain" (the unconverted model, its own loss, compiled whole, bf16 autocast, fused AdamW),
then for each preset stage 1 (attention transfer) and stage 2 (KD, training what the preset trains:
every weight for lolcats, gdn and gdn-hybrid; ``lolcats:finetune=lora`` for LoRA), each through the
recipes' own ``train_step`` (the loop body of ``train_stage``) with the decoder compiled as ``--compile``
does. Each of ``--steps`` steps is timed on its own (the row gives the median) after ``--warmup`` steps
(compilation happens there). Under ``accelerate launch`` each of N processes runs ``--batch-size``
rows (the global batch is N times larger) and the scaling column is tokens/s on N GPUs over the
1-GPU figure of the same ``--presets`` already in ``--json`` (run the 1-GPU command first). Results accumulate in
``--json``; the page ``--doc`` is rewritten from it each time.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from benchlib import REPORTS, write_section

ROOT = Path(__file__).resolve().parents[1]


TRAINS = {"lora": "LoRA", "full": "full fine-tune", "attention": "attention modules"}  # stage 2's row names
SMOKE_WINDOW = 64  # lolcats' window in --smoke, below its 96-token rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shape on CPU in fp32, eager, 2 steps per row (CI)")
    p.add_argument("--shape", default="smollm2-135m", help="a shape of benchmarks/plan.py SHAPES")
    p.add_argument("--presets", default="lolcats,gdn", help="distillation presets (stage 2 trains what the preset "
                   "trains); PRESET:FIELD=V changes a config field, e.g. lolcats:sinks=0 or lolcats:finetune=lora")
    p.add_argument("--batch-size", type=int, default=16, help="rows per GPU per step")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=6, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per row (compilation)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--cuda-graphs", action="store_true",
                   help="every row compiled with mode='reduce-overhead' (`linearize distill --compile --cuda-graphs`; "
                        "the plain row too)")
    p.add_argument("--gradient-checkpointing", action="store_true", help="for the stage-2 rows")
    p.add_argument("--stages", default="1,2", choices=["1,2", "1", "2"],
                   help="the stages timed beside the plain row (long rows: `--stages 2` skips stage 1's compile)")
    p.add_argument("--plain-again", action="store_true",
                   help="time the plain row again after the stages; shares and the scaling's lean use the faster of the two")
    p.add_argument("--kd-chunk-size", type=int, default=1024, help="0 = the plain KD loss over whole logits")
    p.add_argument("--packed", action="store_true", help="rows of packed documents (position ids restart)")
    p.add_argument("--data", default=None,
                   help="also time every stage row on packed real documents from this source, as `linearize distill "
                        "--data` packs them (the Linux docs on the GPU, `stdlib-docs` on the CPU), with the "
                        "recompiles its timed steps met; token ids beyond the shape's vocabulary wrap around")
    p.add_argument("--tokenizer", default=None,
                   help="with --data: a tokenizer folder (default: the embedded SmolLM2's, from its GGUF)")
    p.add_argument("--distill-minutes", type=float, default=0.0,
                   help="also run `linearize distill --max-minutes M` on --data for each preset (the embedded SmolLM2 "
                        "or --model) and record its end-to-end rate (compilation, save and evaluation included) beside "
                        "its steady s/step")
    p.add_argument("--model", default=None, help="with --distill-minutes: the model `linearize distill` converts")
    p.add_argument("--profile", action="store_true",
                   help="after timing a row, profile one more step: GPU busy time against the step's wall "
                        "time, kernels per step and the top kernels (the row's `profile` in the JSON)")
    p.add_argument("--fsdp", action="store_true",
                   help="under several processes, the stage-2 rows shard the student with FSDP2 as "
                        "`linearize distill --fsdp` does (eager: --fsdp does not combine with --compile yet)")
    p.add_argument("--optimize-ddp", action=argparse.BooleanOptionalAction, default=False,
                   help="torch._dynamo.config.optimize_ddp under several processes. Off (default), as "
                        "`linearize distill` trains: the compiled decoder is one graph and the all-reduce follows "
                        "the backward. --optimize-ddp: torch's default, the graph cut at DDP's 25 MB gradient "
                        "buckets to overlap the all-reduce")
    p.add_argument("--json", default=str(REPORTS / "data" / "training_speed.json"))
    p.add_argument("--doc", default=str(REPORTS / "training.md"))
    a = p.parse_args(argv)
    # seq 96 > SMOKE_WINDOW: at or below lolcats' window no key reaches the linear part, whose k feature map
    # then gets no gradient (DDP stops on unused parameters)
    if a.smoke:  # every code path but compilation (tests/test_train_fast.py covers that) and bf16
        a.shape, a.batch_size, a.seq_len, a.steps, a.warmup, a.compile = "tiny", 2, 96, 2, 1, False
    return a


def build_rows(a, vocab, n_rows):
    from linearize.recipes.data import synthetic_rows

    return synthetic_rows(n_rows, a.seq_len, vocab, seed=0, packed=a.packed)


def real_rows(a, vocab):
    """Packed rows of real documents, as `linearize distill --data` packs them (``prepare_data``):
    position ids restart at every document, so the batches differ in their documents' number and
    lengths. Ids wrap into the shape's vocabulary (speed does not depend on which tokens)."""
    from linearize.recipes.data import DataConfig
    from linearize.recipes.distill import prepare_data

    if a.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(a.tokenizer)
    else:
        from linearize.loading import load_model_and_tokenizer

        _, tokenizer = load_model_and_tokenizer()
    rows, _, _ = prepare_data(tokenizer, DataConfig(data=a.data, seq_len=a.seq_len))
    rows["input_ids"] = rows["input_ids"] % vocab
    return rows


def preset_changes(name: str) -> tuple[str, dict[str, int | str]]:
    """"lolcats:sinks=0:finetune=lora" -> ("lolcats", {"sinks": 0, "finetune": "lora"}): a preset with
    config fields changed (integers, or words)."""
    preset, *fields = name.split(":")
    return preset, {k: int(v) if v.lstrip("-").isdigit() else v for k, v in (f.split("=") for f in fields)}


def distill_end_to_end(a, preset: str, out: Path) -> dict:
    """A whole `linearize distill --max-minutes` run of ``preset`` (the CLI in a subprocess: its
    compilation, save and evaluation included): its wall time against the budget, the tokens it
    trained, and its end-to-end tokens/s beside each stage's steady s/step, first-step seconds and
    recompiles (its distill.json)."""
    import shutil
    import subprocess

    shutil.rmtree(out, ignore_errors=True)
    cuda = torch.cuda.is_available() and not a.smoke
    preset, fields = preset_changes(preset)  # "lolcats:sinks=0" -> --preset lolcats --sinks 0
    changes = [x for k, v in fields.items() for x in ("--" + k.replace("_", "-"), str(v))]
    cmd = [sys.executable, "-m", "linearize.cli", "distill", *([a.model] if a.model else []), "--out", str(out),
           *changes, "--preset", preset, "--data", a.data, "--seq-len", str(a.seq_len), "--batch-size", str(a.batch_size),
           "--max-minutes", str(a.distill_minutes), "--save-every", "0",
           *(["--compile"] if a.compile else []), *(["--cuda-graphs"] if a.cuda_graphs else []),
           *(["--mixed-precision", "bf16"] if cuda else [])]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - t0
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300], "command": " ".join(cmd[2:])}
    summary = json.loads((out / "distill.json").read_text())
    stages = {k: {f: summary[k].get(f) for f in ("steps", "tokens", "first_step_s", "s_per_step", "recompiles",
                                                 "compiled_graphs", "stopped_by_budget")}
              for k in ("stage1", "stage2") if k in summary}
    tokens = sum(st["tokens"] or 0 for st in stages.values())
    return {"command": "linearize " + " ".join(cmd[3:]), "wall_s": wall, "budget_s": 60 * a.distill_minutes,
            "within": wall <= 60 * a.distill_minutes, "tokens": tokens, "tok_per_s_end_to_end": tokens / wall,
            "eval_s": summary.get("eval_s"), "save_s": summary.get("save_s"), "stages": stages}


def plain_loss(model, batch):
    return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["input_ids"],
                 use_cache=False).loss


def stage2_models(original, cfg, compile_teacher: bool, cuda_graphs: bool = False):
    """(student, teacher) of a stage-2 row as `linearize distill` builds them: LoRA students are their
    own teacher (adapter off, softmax mode: teacher None); a full fine-tune trains every weight
    beside a frozen copy of the original, compiled as `--compile` does."""
    import linearize
    from linearize.recipes.distill import attach_lora, set_trainable, stage2_parameter_names

    model = linearize.linearize(copy.deepcopy(original), cfg.method_config())
    if cfg.finetune == "lora":
        return attach_lora(model, cfg), None
    set_trainable(model, stage2_parameter_names(model, cfg.finetune))
    teacher = copy.deepcopy(original).requires_grad_(False).eval()
    if compile_teacher:
        from linearize.recipes.train import compile_decoder

        compile_decoder(teacher, cuda_graphs)
    return model, teacher


def make_rows_spec(a, original):
    """(name, build) for each row: build() -> (model, loss_fn, teardown)."""
    import linearize
    from linearize.recipes.distill import (DistillConfig, attention_transfer_loss, make_kd_loss, new_parameter_names,
                                           set_trainable)
    from linearize.recipes.train import compile_decoder

    def plain():
        model = copy.deepcopy(original)
        model.requires_grad_(True)
        if a.compile:
            from linearize.recipes.train import compile_mode

            model.compile(**compile_mode(a.cuda_graphs))  # the whole model and its loss: the ceiling
        return model, plain_loss, None

    specs = [(f"plain softmax{' (compiled whole)' if a.compile else ''}", plain)]
    for name in [p for p in a.presets.split(",") if p]:
        preset, changes = preset_changes(name)  # e.g. lolcats:sinks=0, the sinks' cost in one process
        window = SMOKE_WINDOW if a.smoke and preset == "lolcats" else None  # else the preset's (192)
        # stage 2 trains what the preset trains (DistillConfig resolves it: lolcats, gdn, gdn-hybrid full)
        cfg = DistillConfig(**{"preset": preset, "kd_chunk_size": a.kd_chunk_size, "window": window, **changes})
        finetune = cfg.finetune

        def stage1(cfg=cfg):
            model = linearize.linearize(copy.deepcopy(original), cfg.method_config())
            set_trainable(model, new_parameter_names(model))
            return model, attention_transfer_loss, None

        def stage2(cfg=cfg):
            model, teacher = stage2_models(original, cfg, compile_teacher=a.compile, cuda_graphs=a.cuda_graphs)
            if a.gradient_checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            return model, make_kd_loss(cfg, teacher, log=lambda *x: None), teacher

        if "1" in a.stages:
            specs.append((f"{name} stage 1 (attention transfer)", stage1))
        if "2" in a.stages:
            specs.append((f"{name} stage 2 (KD, {TRAINS[finetune]})", stage2))
    if a.plain_again:  # a plain step slowed by something passing (a neighbour's compilation) shows as two rates
        specs.append((specs[0][0] + AGAIN, plain))
    return specs, compile_decoder


def sharded_row(a, name: str, processes: int) -> bool:
    """--fsdp shards the rows `linearize distill --fsdp` shards: stage 2, under several processes."""
    return a.fsdp and processes > 1 and "stage 2" in name


def measure(a, name, build, compile_decoder, rows, accelerator) -> dict:
    from linearize.recipes.train import TrainConfig, make_optimizer, rows_for_step, train_step

    device = accelerator.device
    cuda = device.type == "cuda"
    from linearize.recipes.train import shard

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    model, loss_fn, teacher = build()
    model.to(device)
    if teacher is not None:
        teacher.to(device)
    sharded = sharded_row(a, name, accelerator.num_processes)
    if sharded:
        model = shard(model)  # before the optimizer: fully_shard replaces the parameters
    elif a.compile and not name.startswith("plain"):
        compile_decoder(model, cuda_graphs=a.cuda_graphs)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, TrainConfig(lr=1e-6, warmup_steps=1))
    model.train()
    if sharded:  # accelerate would wrap it in DDP
        prepared, optimizer = model, accelerator.prepare(optimizer)
    else:
        prepared, optimizer = accelerator.prepare(model, optimizer)
    P, rank, B = accelerator.num_processes, accelerator.process_index, a.batch_size
    n_rows = rows["input_ids"].shape[0]

    def step(i):
        idx = rows_for_step(i, n_rows, B * P, seed=0)[rank::P]
        batch = {k: v[idx].to(device) for k, v in rows.items()}
        loss, bad = train_step(prepared, loss_fn, [batch], accelerator, optimizer, params)
        if bad is not None:
            raise RuntimeError(f"{name}: {bad}")
        return loss

    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def timed(first):
        """Each step timed on its own; the median: a step that compiles again (a guard, DDP's
        no_sync) or meets a stall of the host is one step of the window, not a share of its mean."""
        times = []
        for i in range(a.steps):
            sync()
            t0 = time.perf_counter()
            loss = step(first + i)
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
        return loss, statistics.median(times), times

    from torch._dynamo.utils import counters

    sync()
    t0 = time.perf_counter()
    for i in range(a.warmup):
        step(i)
        if i == 0:  # the first step compiles (and records the CUDA graphs): the row's compile time
            sync()
            first_step_s = time.perf_counter() - t0
            print(f"{name}: first step {first_step_s:.1f} s", flush=True)
    sync()
    graphs_warm = counters["stats"]["unique_graphs"]
    if cuda and not a.cuda_graphs:
        # CUDA graphs allocate their memory pools while recording (in the warm-up) and nothing
        # after: their rows keep the peak from the row's start, the pools included
        torch.cuda.reset_peak_memory_stats()
    accelerator.wait_for_everyone()
    loss, dt, times = timed(a.warmup)
    out = {"tok_per_s": B * a.seq_len * P / dt * 1e3, "ms_per_step": dt, "ms_steps": times, "loss": loss,
           "first_step_s": first_step_s if a.warmup else None,
           # graphs compiled during the timed steps: recompiles for new batch shapes or guards (0 wanted)
           "recompiles": counters["stats"]["unique_graphs"] - graphs_warm,
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
           "trainable": sum(p.numel() for p in params)}
    if sharded:
        out["fsdp"] = True
    elif P > 1:
        # the same steps without DDP's gradient all-reduce (each process updates from its own
        # gradients): the difference to ms_per_step is what synchronising the gradients costs
        accelerator.wait_for_everyone()
        with accelerator.no_sync(prepared):
            step(a.warmup + a.steps)  # untimed: no_sync may compile the decoder once more
            _, out["ms_no_sync"], _ = timed(a.warmup + a.steps + 1)
        out["grad_mb"] = sum(p.numel() * p.element_size() for p in params) / 1e6
    if a.cuda_graphs:
        from linearize.recipes.train import cudagraph_skips

        out["cudagraph_skips"] = cudagraph_skips()  # this row's (dynamo and its counters reset per row)
    if a.profile:
        out["profile"] = profile_step(step, a.warmup + a.steps + 2, sync)
    if getattr(loss_fn, "path", None):
        out["kd_loss"] = loss_fn.path
    del prepared, optimizer, model, teacher, params
    accelerator.free_memory()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def profile_step(step, i: int, sync, top: int = 12) -> dict:
    """One step under torch.profiler: its wall time, the GPU's busy time (kernels and copies; their
    sum, which overlaps nothing on one stream) and the kernels taking the most of it. Busy far below
    wall means the host is the bottleneck (launches, Python, synchronisations), not the GPU."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync()
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        step(i)
        sync()
        wall = (time.perf_counter() - t0) * 1e3
    # record_function ranges (kd.student, train.optimizer...) also appear on the GPU's timeline:
    # user annotations, not kernels, and they would count their kernels twice
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False)]
    by_name: dict[str, list] = {}
    for e in kernels:
        slot = by_name.setdefault(e.name, [0, 0.0])
        slot[0] += 1
        slot[1] += e.device_time_total / 1e3
    busy = sum(v[1] for v in by_name.values())
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    host = sorted((e for e in prof.key_averages() if e.self_cpu_time_total > 0), key=lambda e: -e.self_cpu_time_total)
    return {"wall_ms": wall, "gpu_busy_ms": busy, "kernels": len(kernels),
            "top": [{"name": n[:120], "calls": c, "ms": ms} for n, (c, ms) in ranked],
            "top_host": [{"name": e.key[:120], "calls": e.count, "ms": e.self_cpu_time_total / 1e3} for e in host[:top]]}


def allreduce_busbw(accelerator, nbytes: int = 256 * 2**20, iters: int = 5) -> float:
    """All-reduce bus bandwidth (GB/s) between the processes, nccl-tests' convention: the bytes each
    process sends and receives, 2 (P - 1) / P x the buffer, over the time of one all-reduce."""
    import torch.distributed as dist

    P = accelerator.num_processes
    buf = torch.ones(nbytes // 4, device=accelerator.device)
    dist.all_reduce(buf)  # warm-up (connection set-up)
    sync = torch.cuda.synchronize if accelerator.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf)
    sync()
    return 2 * (P - 1) / P * nbytes * iters / (time.perf_counter() - t0) / 1e9


def matmul_tflops(device, n: int = 8192, iters: int = 10) -> float:
    """Dense bf16 GEMM throughput of this device (fp32 on CPU), measured: the rate a training step's
    matrix products could run at, for the floor of each row."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = n if device.type == "cuda" else 512
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ b
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync()
    return 2 * n**3 * iters / (time.perf_counter() - t0) / 1e12


def step_flops(name: str, config, tokens: int, seq_len: int) -> float | None:
    """FLOPs a row's step cannot do without, per process: matrix products only (N = the weights a
    token meets, the LM head included; causal softmax attention 2 L T d per token forward). Plain:
    forward + backward = 3 x forward. Stage 2: the teacher's forward, the student's forward, its
    backward to the activations (2N) and, for a full fine-tune, to the weights (2N more); the
    student's linear attention is counted as free. Stage 1: None (teacher and student attention in
    every layer, logits of one position: no simple count)."""
    d, L, inter, V = config.hidden_size, config.num_hidden_layers, config.intermediate_size, config.vocab_size
    hd = getattr(config, "head_dim", None) or d // config.num_attention_heads
    attn_w = d * hd * (config.num_attention_heads * 2 + config.num_key_value_heads * 2)
    N = L * (attn_w + 3 * d * inter) + d * V
    fwd, att = 2 * N, 2 * L * seq_len * config.num_attention_heads * hd
    if name.startswith("plain"):
        return 3 * (fwd + att) * tokens
    if "stage 2" in name:
        return ((fwd + att) + fwd + fwd + (fwd if "LoRA" not in name else 0)) * tokens
    return None


def device_name(accelerator) -> str:
    if accelerator.device.type == "cuda":
        return torch.cuda.get_device_name(accelerator.device)
    import platform

    return f"CPU ({platform.machine()})"


def run(a, save=lambda record: None) -> dict:
    from accelerate import Accelerator
    from transformers import LlamaConfig, LlamaForCausalLM

    from linearize.benchmarks.measure import versions
    from linearize.benchmarks.plan import SHAPES
    from linearize.recipes.train import process_state

    process_state()
    cuda = torch.cuda.is_available() and not a.smoke
    accelerator = Accelerator(mixed_precision="bf16" if cuda else "no", cpu=not cuda)
    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES[a.shape], initializer_range=0.02, max_position_embeddings=max(8192, a.seq_len))
    config._attn_implementation = "sdpa"
    original = LlamaForCausalLM(config).eval()
    rows = build_rows(a, config.vocab_size, a.batch_size * accelerator.num_processes * (a.warmup + 2 * a.steps + 1))
    specs, compile_decoder = make_rows_spec(a, original)
    results = {}
    record = {"device": device_name(accelerator), "processes": accelerator.num_processes, "presets": a.presets,
              "versions": versions(),
              "shape": a.shape, "batch_per_gpu": a.batch_size, "seq_len": a.seq_len, "steps": a.steps,
              "warmup": a.warmup, "compile": a.compile, "packed": a.packed, "kd_chunk_size": a.kd_chunk_size,
              "gradient_checkpointing": a.gradient_checkpointing, "optimize_ddp": a.optimize_ddp, "fsdp": a.fsdp,
              "cuda_graphs": a.cuda_graphs, "stages": a.stages,
              "command": command_line(accelerator.num_processes), "rows": results}
    record["matmul_tflops"] = matmul_tflops(accelerator.device)
    if accelerator.num_processes > 1:
        record["allreduce_busbw_gbps"] = allreduce_busbw(accelerator)
    todo = [(name, build, rows) for name, build in specs]
    if a.data:  # each stage row again on packed real documents
        real = real_rows(a, config.vocab_size)
        record["data"] = a.data
        todo += [(f"{name}{REAL.format(a.data)}", build, real) for name, build in specs if not name.startswith("plain")]
    for name, build, rows in todo:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()  # per row: e.g. cudagraph_skips
        t_row = time.perf_counter()
        try:
            from linearize.layers import static_packing
            from linearize.recipes.train import rows_pack_documents

            with static_packing(rows_pack_documents(rows)):  # as train_stage runs packed rows
                results[name] = measure(a, name, build, compile_decoder, rows, accelerator)
            results[name]["row_seconds"] = time.perf_counter() - t_row  # build, compile, warm-up, timing
            flops = step_flops(name, config, a.batch_size * a.seq_len, a.seq_len)
            if flops is not None:
                results[name]["floor_ms"] = flops / (record["matmul_tflops"] * 1e12) * 1e3
        except Exception as err:  # noqa: BLE001 - one failing row is recorded, the others still run
            if a.smoke:
                raise
            results[name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
            traceback.print_exc()
        if accelerator.is_main_process:
            print(f"{name}: {fmt_row(results[name])}", flush=True)
            save(record)  # row by row: a run cut short keeps what it measured
    if a.distill_minutes and a.data and accelerator.is_main_process and accelerator.num_processes == 1:
        record["end_to_end"] = {}
        for preset in [p for p in a.presets.split(",") if p]:
            import tempfile

            with tempfile.TemporaryDirectory() as tmp:
                record["end_to_end"][preset] = distill_end_to_end(a, preset, Path(tmp) / "run")
            print(f"linearize distill --preset {preset} --max-minutes {a.distill_minutes:g}: "
                  f"{record['end_to_end'][preset]}", flush=True)
            save(record)
    return record


REAL = " (packed {})"  # a row timed on packed real documents (--data)


def command_line(processes: int) -> str:
    args = " ".join(sys.argv[1:])
    if processes > 1:
        return f"accelerate launch --multi_gpu --num_processes {processes} scripts/bench_train.py {args}".strip()
    return f"python scripts/bench_train.py {args}".strip()


def fmt_row(r: dict) -> str:
    if "error" in r:
        return r["error"]
    mem = f", peak {r['peak_gib']:.1f} GiB" if r.get("peak_gib") is not None else ""
    took = f", {r['row_seconds']:.0f} s for the row" if "row_seconds" in r else ""
    again = f", {r['recompiles']} recompiles in the timed steps" if r.get("recompiles") else ""
    return f"{r['tok_per_s']:,.0f} tok/s ({r['ms_per_step']:.0f} ms/step){mem}{took}{again}"


def long_rows(record: dict) -> bool:
    """Rows beyond 1,024 tokens: their record, section title and targets name the length."""
    return record.get("seq_len", 1024) > 1024


def record_key(record: dict) -> str:
    """Records accumulate in ``--json`` under "<processes>:<presets>[:no-optimize-ddp][:fsdp][:cuda-graphs][:seq<T>][:checkpointing][:stage<S>]@<device>"
    (the sequence length only beyond 1024: long rows keep their own record):
    a 2-process run of ``--presets gdn`` is scaled against the 1-process run of the same presets on
    the same device (``baseline_row``)."""
    extra = ":no-optimize-ddp" if record["processes"] > 1 and not record.get("optimize_ddp", True) else ""
    extra += ":fsdp" if record["processes"] > 1 and record.get("fsdp") else ""
    extra += ":cuda-graphs" if record.get("cuda_graphs") else ""
    extra += f":seq{record['seq_len']}" if long_rows(record) else ""
    extra += ":checkpointing" if record.get("gradient_checkpointing") else ""
    extra += f":stage{record['stages']}" if record.get("stages", "1,2") != "1,2" else ""
    return f"{record['processes']}:{record.get('presets', '')}{extra}@{record['device']}"


SAME_RUN_SETUP = ("device", "shape", "batch_per_gpu", "seq_len", "compile", "packed", "kd_chunk_size",
                  "gradient_checkpointing", "cuda_graphs")


def _setup(record: dict, key: str):
    """A record's set-up field; records written before a field existed ran with its default (off)."""
    value = record.get(key)
    return bool(value) if key == "cuda_graphs" else value


def one_process_runs(data: dict, record: dict) -> list[dict]:
    """The 1-process runs of ``record``'s device and set-up, that of the same presets first."""
    ones = [r for _, r in sorted(data.items())
            if r["processes"] == 1 and all(_setup(r, k) == _setup(record, k) for k in SAME_RUN_SETUP)]
    return sorted(ones, key=lambda r: r.get("presets") != record.get("presets"))


def baseline_row(data: dict, record: dict, name: str) -> dict:
    """The 1-process row ``name`` that a several-process ``record`` scales against: from the 1-process
    run of the same presets if there is one, else from any 1-process run of that device and set-up
    holding the row (the presets run side by side, one process each)."""
    run = baseline_run(data, record, name)
    return run["rows"][name] if run else {}


def baseline_run(data: dict, record: dict, name: str) -> dict | None:
    """The 1-process run holding the row ``name`` that ``baseline_row`` takes."""
    return next((r for r in one_process_runs(data, record) if "tok_per_s" in r["rows"].get(name, {})), None)


TARGET_SHARE, TARGET_SCALING = 0.5, {2: 1.8, 4: 3.4}
AGAIN = " (again)"  # the plain row timed a second time, after the stages (--plain-again)


def plain_rate(rows: dict) -> float | None:
    """The plain row's tokens/s: the faster of its two timings under --plain-again."""
    name = next(iter(rows), "")
    rates = [rows.get(n, {}).get("tok_per_s") for n in (name, name + AGAIN)]
    rates = [x for x in rates if x is not None]
    return max(rates) if rates else None


def plain_lean(data: dict, record: dict, name: str | None = None) -> float:
    """How much faster per GPU a several-process run's plain row stepped than the plain row of the
    1-process run that row ``name`` scales against (the plain row's own baseline by default); 1.0
    when not faster by more than 2%. The 1-process run was slowed by something the several-process
    run was not (its host's load, another call), and the row's scaling leans high by as much."""
    P, rows = record["processes"], record["rows"]
    plain_name = next(iter(rows), "")
    run = baseline_run(data, record, name or plain_name)
    plain, base = plain_rate(rows), plain_rate(run["rows"]) if run else None
    if P == 1 or plain is None or base is None:
        return 1.0
    lean = plain / (P * base)
    return lean if lean > 1.02 else 1.0


def render_profiles(r: dict) -> list[str]:
    """Lines for the rows profiled with --profile: one step's wall time beside the GPU's busy time,
    and its top kernels."""
    rows = [(n, row["profile"]) for n, row in r["rows"].items() if "profile" in row]
    if not rows:
        return []
    lines = ["", "One more step of each row under torch.profiler (`--profile`): wall time, the GPU's busy time "
             "(the sum of its kernels and copies) and the kernels taking the most of it.", "",
             "| step | wall ms | GPU busy ms | busy / wall | kernels | top kernels (ms, calls) |", "|---|---|---|---|---|---|"]
    for name, pr in rows:
        top = "; ".join(f"`{t['name'][:48]}` {t['ms']:.1f} ({t['calls']})" for t in pr["top"][:5])
        lines.append(f"| {name} | {pr['wall_ms']:.0f} | {pr['gpu_busy_ms']:.0f} | {pr['gpu_busy_ms'] / pr['wall_ms']:.0%} | "
                     f"{pr['kernels']} | {top} |")
    return lines


def render_end_to_end(r: dict) -> list[str]:
    """Lines for whole `linearize distill --max-minutes` runs (``--distill-minutes``): wall time against
    the budget and the end-to-end rate beside each stage's steady rate, first step and recompiles."""
    e2e = r.get("end_to_end")
    if not e2e:
        return []
    lines = ["", f"Whole `linearize distill --max-minutes` runs on `{r.get('data')}` (compilation, save and evaluation "
             "included; the end-to-end rate is the tokens trained over the wall time):", "",
             "| preset | wall s / budget s | tokens | end-to-end tok/s | stage 1: steps, first step s, s/step, recompiles "
             "| stage 2: steps, first step s, s/step, recompiles | eval s |", "|---|---|---|---|---|---|---|"]
    for preset, e in e2e.items():
        if "error" in e:
            lines.append(f"| {preset} | error: {e['error']} | | | | | |")
            continue

        def st(k):
            x = e["stages"].get(k)
            if not x or not x.get("steps"):
                return "skipped by the budget" if x else "-"
            rate = f"{x['s_per_step']:.3f}" if x.get("s_per_step") else "-"
            return f"{x['steps']}, {x['first_step_s']:.0f}, {rate}, {x['recompiles']}"

        lines.append(f"| {preset} | {e['wall_s']:.0f} / {e['budget_s']:.0f} | {e['tokens']:,} | "
                     f"{e['tok_per_s_end_to_end']:,.0f} | {st('stage1')} | {st('stage2')} | {e.get('eval_s') or 0:.0f} |")
    return lines


def render(data: dict) -> str:
    """The markdown page from every recorded run: one section per presets and process count, each
    with its own plain row (same process, same GPU); then the issue-14 targets from them."""
    runs = sorted(data.values(), key=lambda r: (r["device"], r.get("presets", ""), r["processes"],
                                                 not r.get("optimize_ddp", True), bool(r.get("fsdp"))))
    devices = {r["device"] for r in runs}
    lines = ["# Training speed: distillation steps beside the plain training step", "",
             "Written by `scripts/bench_train.py` (see its docstring). Random SmolLM2-135M-shaped weights; "
             "the same process times the plain softmax training step of the same model (compiled whole with "
             "its own loss, bf16 autocast, fused AdamW) and each distillation stage through the recipes' "
             "`train_step` (bf16 autocast, fused AdamW, decoder compiled as `--compile` does, chunked KD "
             "loss; fp32 without autocast on CPU). Tokens/s count the global batch (all GPUs); peak memory "
             "is per GPU. Under `accelerate launch` each process runs `--batch-size` rows (DDP): N GPUs "
             "train N times the rows per step, and scaling is tokens/s over the 1-process run of the same "
             "presets.", ""]
    targets = []
    for r in runs:
        P = r["processes"]
        on = f" ({r['device']})" if len(devices) > 1 else ""
        ddp = " (DDP, dynamo's DDP graph splitting off)" if P > 1 and not r.get("optimize_ddp", True) else ""
        ddp += " (stage 2 sharded with FSDP2, eager)" if P > 1 and r.get("fsdp") else ""
        ddp += " (CUDA graphs: `--cuda-graphs`)" if r.get("cuda_graphs") else ""
        ddp += (f" ({r['batch_per_gpu']} x {r['seq_len']} tokens"
                f"{', activation checkpointing' if r.get('gradient_checkpointing') else ''})" if long_rows(r) else "")
        lines += [f"## {r.get('presets') or 'all presets'}: {P} process{'es' if P > 1 else ''}{ddp} on {r['device']}", "",
                  f"`{r['command']}`", "",
                  f"torch {r['versions']['torch']}, triton {r['versions']['triton']}, transformers "
                  f"{r['versions']['transformers']}, CUDA {r['versions']['cuda']}; shape {r['shape']}, "
                  f"{r['batch_per_gpu']} x {r['seq_len']} tokens per GPU per step, "
                  f"{'packed documents' if r['packed'] else 'one document per row'}, compile {r['compile']}, "
                  f"KD chunk {r['kd_chunk_size']}, activation checkpointing in stage 2 "
                  f"{r['gradient_checkpointing']}; {r['steps']} timed steps after {r['warmup']} "
                  f"({'the median step' if any('ms_steps' in x for x in r['rows'].values()) else 'their mean'}).", "",
                  *([r["note"], ""] if r.get("note") else []),
                  *(["The plain row was timed before the stages and again after them (`--plain-again`): the shares "
                     "and the scaling's lean use the faster of the two.", ""] if any(n.endswith(AGAIN) for n in r["rows"]) else []),
                  *([f"All-reduce bus bandwidth between the processes: {r['allreduce_busbw_gbps']:.1f} GB/s "
                     "(256 MiB, nccl-tests' convention). *Without sync*: the same steps under DDP's `no_sync` (no "
                     "gradient all-reduce); *all-reduce floor*: the trainable gradients' bytes x 2 (P - 1) / P over "
                     "that bandwidth; *P x without / with sync*: the scaling this run alone implies if one process "
                     "stepped as fast as these steps without sync (it needs no 1-process run, and it ignores what "
                     "DDP costs besides the all-reduce).", ""] if "allreduce_busbw_gbps" in r else []),
                  *([f"Floor: the step's matrix-product FLOPs per GPU (`step_flops`) at the {r['matmul_tflops']:.0f} "
                     "TFLOP/s a bf16 GEMM reached on this device in the same process.", ""]
                    if "matmul_tflops" in r else []),
                  "| step | tokens/s | ms/step | share of plain | peak memory (GiB) | floor ms | x floor |"
                  + (" scaling over 1 process | ms/step without sync | all-reduce floor ms | P x without / with sync |"
                     if P > 1 else ""),
                  "|---|---|---|---|---|---|---|" + ("---|---|---|---|" if P > 1 else "")]
        plain = plain_rate(r["rows"])
        lean = plain_lean(data, r)
        for i, (name, row) in enumerate(r["rows"].items()):
            if "error" in row:
                lines.append(f"| {name} | error: {row['error']} | | | | | |" + (" | | | |" if P > 1 else ""))
                continue
            share = row["tok_per_s"] / plain if plain else float("nan")
            mem = f"{row['peak_gib']:.1f}" if row.get("peak_gib") is not None else "-"
            floor = (f"{row['floor_ms']:.0f} | {row['ms_per_step'] / row['floor_ms']:.1f}x"
                     if row.get("floor_ms") else "- | -")
            cells = f"| {name} | {row['tok_per_s']:,.0f} | {row['ms_per_step']:.0f} | {share:.0%} | {mem} | {floor} |"
            stage = i > 0 and not name.endswith(AGAIN)
            if P == 1 and stage:
                targets.append((f"{name}: share of plain, 1 GPU{ddp}{on}, run `--presets {r.get('presets', '')}`", f"{share:.0%}", f">= {TARGET_SHARE:.0%}",
                                share >= TARGET_SHARE))
            if P > 1:
                base = baseline_row(data, r, name)
                if "tok_per_s" in base:
                    scale = row["tok_per_s"] / base["tok_per_s"]
                    cells += f" {scale:.2f}x |"
                    if stage and P in TARGET_SCALING:
                        # judged on the figure with the plain row's lean taken out, when it leans
                        fair = scale / plain_lean(data, r, name)
                        shown = f"{scale:.2f}x" + (f" ({fair:.2f}x without the plain row's lean)" if fair < scale else "")
                        targets.append((f"{name}: scaling, {P} GPUs{ddp}{on}", shown, f">= {TARGET_SCALING[P]}x",
                                        fair >= TARGET_SCALING[P]))
                else:
                    cells += " (no 1-process run) |"
                nosync = f"{row['ms_no_sync']:.0f}" if "ms_no_sync" in row else "-"
                bw = r.get("allreduce_busbw_gbps")
                floor = (f"{row['grad_mb'] * 2 * (P - 1) / P / bw:.1f}" if bw and "grad_mb" in row else "-")
                within = f"{P * row['ms_no_sync'] / row['ms_per_step']:.2f}x" if "ms_no_sync" in row else "-"
                cells += f" {nosync} | {floor} | {within} |"
            lines.append(cells)
        if P > 1:
            wanted = set(r.get("presets", "").split(","))
            missing = list(dict.fromkeys(n for o in one_process_runs(data, r) for n in o["rows"]
                                         if n not in r["rows"] and n.split(" ")[0] in wanted))
            lines += [f"| {n} | not measured (the run stopped before it) | | | | | | | | | |" for n in missing]
            if lean > 1:
                lines += ["", f"The plain row scales by more than {P}x: per GPU this run's plain step was faster than the "
                          "1-process run's (another call, another machine or host load), so the scaling figures of this "
                          f"section lean high by up to {lean - 1:.0%}; the targets below judge each figure divided by "
                          f"the lean of its own 1-process run's plain row ({lean:.2f} here)."]
        lines += render_profiles(r)
        lines += render_end_to_end(r)
        lines.append("")
    if targets:
        lines += ["## Targets (issue 14)", "", "| target | measured | wanted | |", "|---|---|---|---|"]
        lines += [f"| {t} | {m} | {w} | {'met' if ok else '**missed**'} |" for t, m, w, ok in targets]
        lines.append("")
    lines += ["The floor: a KD step is a teacher forward plus the student's forward and backward, about 4/3 of "
              "a plain step's work, so stage 2 can reach at most ~75% of the plain rate; stage 1 trains only the "
              "feature maps but runs teacher and student attention in every layer. Packed rows (what `linearize "
              "distill` trains on; `--data` times them) reach the compiled layers as per-token document ids of "
              "shape (B, T) (`linearize/layers.py` `PackedDocs`): a new packing compiles nothing.", ""]
    return "\n".join(lines)


def main(argv=None) -> dict:
    a = parse_args(argv)
    path = Path(a.json)

    def save(record):
        data = json.loads(path.read_text()) if path.is_file() else {}
        data[record_key(record)] = record
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n")
        write_section(a.doc, "bench_train", render(data))

    # for this run only (tests share the process); the recompile limit as train_stage sets it
    with torch._dynamo.config.patch(optimize_ddp=a.optimize_ddp, recompile_limit=64, fail_on_recompile_limit_hit=True):
        record = run(a, save)
    from linearize.recipes.train import process_state

    if process_state().is_main_process:
        print(Path(a.doc).read_text())
    return record


if __name__ == "__main__":
    main()
