"""What a stage-2 (KD) training step runs outside compiled code: aten ops dispatched eagerly
(not inside a torch.compile region) per phase, and how many graphs compile over several steps.

    python scripts/profile_kd_eager.py                         # tiny Llama on CPU, bf16 autocast
    python scripts/profile_kd_eager.py --device cuda --shape smollm2-135m --batch-size 16 --seq-len 1024 \
        --kd-chunk-size 1024 --doc docs/kd_eager_ops.md              # + GPU ms per phase

The step is the recipes' own: ``make_kd_loss`` (teacher pass, student pass, chunked KD loss),
``attach_lora`` (lolcats: teacher = the same model, adapter off, softmax mode) or a separate
teacher (gdn, full fine-tune), ``compile_decoder`` and ``train_step`` (backward, clip, AdamW).
After ``--warmup`` steps one step runs under torch.profiler; every aten op whose caller is not an
aten op (one dispatch from Python or from the autograd engine) is counted as *eager* unless it
runs inside a compiled region (dynamo's ``Torch-Compiled Region``, AOTAutograd's
``CompiledFunction`` / ``CompiledFunctionBackward``), and filed under the phase named by the
``record_function`` scopes of ``recipes/distill.py`` and ``recipes/train.py``. Eager ops on a GPU
are kernel launches paid one by one (with their Python), which is what this counts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections import Counter

import torch

PHASES = ("kd.teacher", "kd.student", "kd.loss", "train.backward", "train.optimizer")
COMPILED = ("Torch-Compiled Region", "CompiledFunction", "CompiledFunctionBackward", "## Call CompiledFxGraph")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default="lolcats,gdn", help="lolcats: LoRA stage 2; others: full fine-tune")
    p.add_argument("--shape", default="tiny", help="'tiny' or a shape of linearize/benchmark/plan.py SHAPES")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--kd-chunk-size", type=int, default=32)
    p.add_argument("--warmup", type=int, default=3, help="steps before the profiled one (compilation)")
    p.add_argument("--steps", type=int, default=4, help="steps after warm-up over which new graphs are counted")
    p.add_argument("--mixed-precision", default="bf16", choices=("no", "bf16"))
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--top", type=int, default=6, help="most frequent eager ops shown per phase")
    p.add_argument("--json", default=None, help="also write the counts here")
    p.add_argument("--doc", default=None, help="also write the table here (markdown), e.g. docs/kd_eager_ops.md")
    return p.parse_args(argv)


def build_original(a):
    from transformers import LlamaConfig, LlamaForCausalLM

    if a.shape == "tiny":
        shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     intermediate_size=128, vocab_size=512, tie_word_embeddings=True)
    else:
        from linearize.benchmark.plan import SHAPES

        shape = SHAPES[a.shape]
    torch.manual_seed(0)
    config = LlamaConfig(**shape, initializer_range=0.2, max_position_embeddings=max(2048, a.seq_len))
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


def build_stage2(a, original, preset):
    from linearize.recipes.distill import DistillConfig, make_kd_loss

    finetune = "lora" if preset == "lolcats" else "full"
    cfg = DistillConfig(preset=preset, finetune=finetune, kd_chunk_size=a.kd_chunk_size)
    model, teacher = _bench_train().stage2_models(original, cfg, compile_teacher=a.compile)
    return model, make_kd_loss(cfg, teacher, log=lambda *x: None), teacher


def _bench_train():
    """scripts/bench_train.py (scripts are not a package): the stage-2 rows are built the same way."""
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location("bench_train_script", pathlib.Path(__file__).with_name("bench_train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def classify(events) -> tuple[dict, dict]:
    """({phase: Counter(op name -> eager dispatches)}, {phase: GPU ms}) from the profiler's events.
    On a GPU the backward runs on the autograd engine's own thread, outside the main thread's
    ``train.backward`` scope: ops of any other thread count as backward."""
    out = {p: Counter() for p in (*PHASES, "other")}
    gpu_ms = dict.fromkeys(out, 0.0)
    main = next((e.thread for e in events if e.name == "kd.student"), None)
    for e in events:
        parent, phase, compiled = e.cpu_parent, "other", False
        nested = parent is not None and parent.name.startswith("aten::")  # a decomposition of a counted op
        while parent is not None:
            if parent.name in PHASES and phase == "other":
                phase = parent.name
            if parent.name.startswith(COMPILED):
                compiled = True
            parent = parent.cpu_parent
        if e.name in PHASES:
            phase = e.name
        if phase == "other" and main is not None and e.thread != main:
            phase = "train.backward"
        gpu_ms[phase] += getattr(e, "self_device_time_total", 0.0) / 1e3
        if e.name.startswith("aten::") and not nested and not compiled:
            out[phase][e.name] += 1
    return out, gpu_ms


def top_kernels(events, n: int = 25) -> dict:
    """GPU kernels of the profiled step: how many ran, their total ms, and the ``n`` names that took
    the most time (name cut to 90 characters, ms, launches)."""
    from torch.autograd import DeviceType

    ms, launches = Counter(), Counter()
    for e in events:
        if e.device_type == DeviceType.CUDA:
            name = e.name[:90]
            ms[name] += e.self_device_time_total / 1e3
            launches[name] += 1
    return {"count": sum(launches.values()), "ms": sum(ms.values()),
            "top": [(k, round(v, 3), launches[k]) for k, v in ms.most_common(n)]}


def measure(a, preset, original, rows) -> dict:
    from accelerate import Accelerator
    from torch.profiler import ProfilerActivity, profile

    from linearize.recipes.train import TrainConfig, compile_decoder, make_optimizer, train_step

    torch._dynamo.reset()
    device = torch.device(a.device)
    accelerator = Accelerator(mixed_precision=a.mixed_precision, cpu=device.type == "cpu")
    model, loss_fn, teacher = build_stage2(a, original, preset)
    model.to(device)
    if teacher is not None:
        teacher.to(device)
    if a.compile:
        compile_decoder(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, TrainConfig(lr=1e-6, warmup_steps=1))
    model.train()
    prepared, optimizer = accelerator.prepare(model, optimizer)
    B, n_rows = a.batch_size, rows["input_ids"].shape[0]

    def step(i):
        idx = torch.arange(i * B, (i + 1) * B) % n_rows
        batch = {k: v[idx].to(device) for k, v in rows.items()}
        _, bad = train_step(prepared, loss_fn, [batch], accelerator, optimizer, params)
        if bad is not None:
            raise RuntimeError(f"{preset}: {bad}")

    counters = torch._dynamo.utils.counters
    counters.clear()
    for i in range(a.warmup):
        step(i)
    graphs_warm = counters["stats"]["unique_graphs"]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for i in range(a.steps):
        step(a.warmup + i)
    sync()
    ms_per_step = (time.perf_counter() - t0) * 1e3 / max(a.steps, 1)
    graphs_after = counters["stats"]["unique_graphs"]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step(a.warmup + a.steps)
    per_phase, gpu_ms = classify(prof.events())
    kernels = top_kernels(prof.events()) if device.type == "cuda" else None
    return {"graphs_after_warmup": graphs_warm, "new_graphs_in_later_steps": graphs_after - graphs_warm,
            "graph_breaks": sum(counters["graph_break"].values()), "kd_loss": loss_fn.path,
            "eager_ops": {p: sum(c.values()) for p, c in per_phase.items()},
            "gpu_ms": gpu_ms if device.type == "cuda" else None, "ms_per_step": ms_per_step,
            "kernels": kernels,
            "top": {p: c.most_common(a.top) for p, c in per_phase.items()}}


def render(a, results: dict) -> str:
    lines = [f"eager aten ops in one stage-2 step after {a.warmup} warm-up steps ({a.shape}, {a.batch_size} x "
             f"{a.seq_len} tokens, KD chunk {a.kd_chunk_size}, {a.mixed_precision}, compile {a.compile}, {a.device})", "",
             "| preset | " + " | ".join(PHASES) + " | other | total | graphs after warm-up | new graphs in "
             f"{a.steps} more steps | graph breaks |",
             "|---" * (len(PHASES) + 6) + "|"]
    for preset, r in results.items():
        ops = r["eager_ops"]
        lines.append(f"| {preset} | " + " | ".join(str(ops[p]) for p in (*PHASES, "other"))
                     + f" | {sum(ops.values())} | {r['graphs_after_warmup']} | {r['new_graphs_in_later_steps']} | "
                     f"{r['graph_breaks']} |")
        if r.get("gpu_ms"):
            lines.append(f"| {preset} GPU ms | " + " | ".join(f"{r['gpu_ms'][p]:.1f}" for p in (*PHASES, "other"))
                         + f" | {sum(r['gpu_ms'].values()):.1f} | | | |")
    lines.append("")
    for preset, r in results.items():
        lines.append(f"{preset}: {r['ms_per_step']:.1f} ms per step (wall, mean of {a.steps} unprofiled steps)")
        k = r.get("kernels")
        if k:
            lines += ["", f"{preset}: {k['count']} GPU kernels, {k['ms']:.1f} ms of GPU time in the profiled step; "
                      "the longest:", "", "| kernel | ms | launches |", "|---|---:|---:|"]
            lines += [f"| `{name}` | {ms:.2f} | {n} |" for name, ms, n in k["top"]]
            lines.append("")
    for preset, r in results.items():
        for phase, top in r["top"].items():
            if top:
                lines.append(f"{preset} {phase}: " + ", ".join(f"{n.removeprefix('aten::')} {k}" for n, k in top))
    return "\n".join(lines)


def main(argv=None) -> dict:
    a = parse_args(argv)
    from linearize.recipes.data import synthetic_rows

    original = build_original(a)
    rows = synthetic_rows(a.batch_size * 4, a.seq_len, original.config.vocab_size, seed=0, packed=False)
    results, failed = {}, {}

    def write():  # after every preset: a run cut short, or a preset that fails, keeps what was measured
        text = render(a, results) + "".join(f"\n{p}: failed: {e}" for p, e in failed.items())
        if a.doc:
            with open(a.doc, "w") as f:
                f.write("# Eager work in a stage-2 KD step\n\nWritten by `scripts/profile_kd_eager.py` (see its docstring): `"
                        + " ".join(["python scripts/profile_kd_eager.py", *(argv if argv is not None else sys.argv[1:])])
                        + "`\n\n" + text + "\n")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({**results, **{p: {"failed": e} for p, e in failed.items()}}, f, indent=2)

    for preset in [p for p in a.presets.split(",") if p]:
        try:
            results[preset] = measure(a, preset, original, rows)
        except Exception as e:  # noqa: BLE001 - the next preset still runs; the run fails at the end
            traceback.print_exc()
            failed[preset] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        else:
            print(render(a, {preset: results[preset]}), flush=True)
        write()
    print(render(a, results), flush=True)
    if failed:
        raise RuntimeError("; ".join(f"{p} failed: {e}" for p, e in failed.items()))
    return results


if __name__ == "__main__":
    main()
