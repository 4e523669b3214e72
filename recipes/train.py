"""The training loop both stages share: accelerate, atomic checkpoints, exact resume, NaN guard,
progress, JSONL metrics and a loss-curve PNG.

Resume is exact because everything a step depends on is a function of the step number: the rows
of step ``i`` come from a permutation seeded by ``seed + epoch``; the trainable weights, the
optimizer and the scheduler are restored from the last checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file
from torch.profiler import record_function

from linearize.layers import static_packing
from linearize.loading import recover_interrupted_save, save_atomically


class TrainingDiverged(RuntimeError):
    pass


@dataclass
class TrainConfig:
    """Args:
    steps: optimizer steps of this stage.
    batch_size: rows per micro-batch.
    grad_accum: micro-batches per optimizer step.
    lr: peak learning rate (linear warmup, cosine decay to 10%).
    warmup_steps: warmup length.
    weight_decay: AdamW weight decay.
    mixed_precision: "no", "bf16" or "fp16" (through accelerate).
    gradient_checkpointing: recompute activations in backward to save memory (with the chunked
        KD loss, what makes 4K-8K-token rows trainable).
    compile: run the model's decoder layers through torch.compile (inductor) for this stage, each
        layer on its own (regional compilation: identical layers share one graph, see
        ``compile_decoder``); the first step pays for the compilation. Packed rows compile once
        (``linearize.layers.PackedDocs``: shapes that depend on the batch size and row length only).
        Under several processes (DDP) each layer stays one graph (dynamo's ``optimize_ddp`` off).
    cuda_graphs: with ``compile``, compile the decoder with ``mode="reduce-overhead"``: each step's
        forward passes and backward replay as CUDA graphs (Inductor's CUDA-graph trees), so the host
        launches a few graphs instead of thousands of kernels, each of the converted layers' ops
        costing ~0.2 ms of Python (docs/reports/training.md, the profiles). One
        micro-batch per step (``grad_accum`` 1); under several processes (DDP) each replays its own
        graphs and DDP's gradient all-reduce follows the backward graph, outside it; not with
        ``fsdp`` (which does not compile yet). Packed rows of any packing replay the same graphs.
    save_every: write a checkpoint every N steps (0 = only at the end).
    seed: data order and initialisation seed.
    fsdp: under ``accelerate launch --multi_gpu`` with several processes, shard the trained model's
        weights, gradients and optimizer state over them (PyTorch's FSDP2 ``fully_shard``: each
        decoder layer, then the model) instead of replicating it (DDP); checkpoints stay whole.
    max_skipped_steps: a step whose loss or gradient norm is not finite stops the stage (0, the
        default), or is skipped without an update, at most this many in a row (like fp16 loss
        scaling does); skipped steps are recorded in ``metrics.jsonl`` and the stage summary.
    """

    steps: int = 100
    batch_size: int = 8
    grad_accum: int = 1
    lr: float = 1e-3
    warmup_steps: int = 10
    weight_decay: float = 0.0
    mixed_precision: str = "no"
    gradient_checkpointing: bool = False
    save_every: int = 50
    seed: int = 0
    max_skipped_steps: int = 0
    compile: bool = False
    cuda_graphs: bool = False
    fsdp: bool = False

    def __post_init__(self):
        if self.cuda_graphs and not self.compile:
            raise ValueError("--cuda-graphs replays the compiled decoder: add --compile")
        if self.cuda_graphs and self.grad_accum > 1:
            raise ValueError("--cuda-graphs takes one micro-batch per step: drop --grad-accum (or --cuda-graphs)")
        if self.fsdp and self.compile:
            raise ValueError("--compile is not supported with --fsdp yet: drop one of them (DDP, without --fsdp, "
                             "runs the compiled decoder)")
        if self.steps < 1 or self.batch_size < 1 or self.grad_accum < 1:
            raise ValueError("steps, batch_size and grad_accum must be >= 1")
        if self.max_skipped_steps < 0:
            raise ValueError(f"max_skipped_steps must be >= 0, got {self.max_skipped_steps}")
        if self.mixed_precision not in ("no", "bf16", "fp16"):
            raise ValueError(f"mixed_precision must be 'no', 'bf16' or 'fp16', got {self.mixed_precision!r}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


@dataclass
class StageBudget:
    """A wall-clock budget for one stage (``DistillConfig.max_minutes``): the stage stops before a
    step would end past ``deadline`` (``time.time()`` seconds), and its step count is fitted to the
    rate it measures. The first step (compilation included) and ``probe_steps`` more are timed; then
    ``fit(first_step_s, s_per_step, steps_done)`` gives the stage's step count, which fixes the LR
    schedule. ``s_per_step`` is the median of the probe's later half: under ``--cuda-graphs`` the
    steps after the first record their graphs and take seconds each (an H200, 2026-11-28: a probe
    that averaged them read 1.0 s/step against a steady 0.13, and the runs fitted an eighth of
    their budget). The stage's step count is kept from there on: it fixes the LR
    schedule from there on (the probe steps run inside the warmup, whose LR does not depend on the
    total). ``fixed_steps``: a count fitted before (a resumed run keeps its schedule); no probe.
    The stage fills in what it measured (``record``).

    A rate that drifts (a GPU shared with another run, a throttled one) would leave the fitted count
    out of reach: the deadline then cut the stage with its learning rate still high (2026-11-29h: a
    run sharing its GPU stopped at 1,158 of 2,318 steps, its cosine half done). So every
    ``refit_every`` steps ``fit`` runs again on the median of those steps, and a count at least 3%
    lower replaces the stage's: the schedule then decays by the deadline. Only ever lower: the
    learning rate may step down, never back up."""

    deadline: float
    fit: Callable[[float, float, int], int] | None = None
    probe_steps: int = 8
    refit_every: int = 50
    fixed_steps: int | None = None
    on_fit: Callable[[int], None] | None = None  # told the fitted count (to write it down for a resume)
    record: dict | None = None

    def __post_init__(self):
        self.record = {} if self.record is None else self.record


def process_state():
    """This process's place in the run: one process, or one of ``accelerate launch``'s (gloo on
    CPU, NCCL on GPUs). Made once per process; every later Accelerator shares it."""
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())


def rows_for_step(step: int, n_rows: int, rows_per_step: int, seed: int) -> torch.Tensor:
    """Row indices of optimizer step ``step`` (0-based): consecutive slices of per-epoch permutations."""
    start = step * rows_per_step
    out = []
    while len(out) < rows_per_step:
        epoch, offset = divmod(start + len(out), n_rows)
        perm = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        take = min(rows_per_step - len(out), n_rows - offset)
        out.extend(perm[offset : offset + take].tolist())
    return torch.tensor(out)


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def trainable_state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad}


def load_trainable_state(model, state: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    missing = [n for n in state if n not in params]
    if missing:
        raise ValueError(f"checkpoint does not match the model: unknown parameters {missing[:3]}...")
    with torch.no_grad():
        for n, t in state.items():
            params[n].copy_(t.to(params[n].dtype))


def save_checkpoint(ckpt_dir: Path, weights: dict, optimizer_state: dict, step: int, done: bool) -> None:
    """``weights``: the trainable parameters by name (``whole_state``); ``optimizer_state``: keyed
    by parameter name (``whole_state``), so any process count and DDP or FSDP can resume it."""
    def write(tmp: Path):
        save_file(weights, str(tmp / "trainable.safetensors"))
        if os.environ.get("LINEARIZE_TEST_SLOW_SAVE"):  # test hook: a wide window to kill the writer in
            time.sleep(float(os.environ["LINEARIZE_TEST_SLOW_SAVE"]))
        torch.save(optimizer_state, tmp / "optimizer.pt")
        (tmp / "meta.json").write_text(json.dumps({"step": step, "done": done}))

    save_atomically(ckpt_dir, write)


def whole_state(accelerator, model, optimizer, sharded: bool, everywhere: bool = False):
    """(trainable weights, optimizer state keyed by parameter name), whole and on the CPU, on the
    main process (and on every process with ``everywhere``); None elsewhere. Under FSDP every
    process must call it: the shards are gathered (torch.distributed.checkpoint's state-dict API)."""
    if sharded:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        options = StateDictOptions(full_state_dict=True, cpu_offload=not everywhere)
        full = get_model_state_dict(model, options=options)
        optim = (get_optimizer_state_dict(model, getattr(optimizer, "optimizer", optimizer), options=options)
                 if optimizer is not None else None)  # the torch optimizer under accelerate's wrapper
        if not (everywhere or accelerator.is_main_process):
            return None
        names = [n for n, p in model.named_parameters() if p.requires_grad]  # FSDP2 keeps the names
        weights = {n: full[n].detach().float().cpu().contiguous() for n in names}
        return weights, optim
    if not (everywhere or accelerator.is_main_process):
        return None
    unwrapped = accelerator.unwrap_model(model)
    return trainable_state(unwrapped), (_named_optimizer_state(unwrapped, optimizer) if optimizer is not None else None)


def _named_optimizer_state(model, optimizer) -> dict:
    """``optimizer.state_dict()`` with parameter names for its integer ids (torch.distributed.checkpoint's
    layout, which FSDP reads and writes)."""
    order = _optimizer_order(model, optimizer)
    sd = optimizer.state_dict()
    return {"state": {order[i]: st for i, st in sd["state"].items()},
            "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in sd["param_groups"]]}


def load_whole_state(accelerator, model, optimizer, ckpt_dir: Path, sharded: bool) -> None:
    """Restore what ``save_checkpoint`` wrote, on every process (each reads the files)."""
    weights = load_file(str(ckpt_dir / "trainable.safetensors"))
    optim = torch.load(ckpt_dir / "optimizer.pt", weights_only=True)
    unwrapped = accelerator.unwrap_model(model)
    trainable = [n for n, p in unwrapped.named_parameters() if p.requires_grad]
    unknown = sorted(set(weights) - set(trainable))
    if unknown:
        raise ValueError(f"checkpoint {ckpt_dir} does not match the model: unknown parameters {unknown[:3]}...")
    if optim["state"] and all(isinstance(k, int) for k in optim["state"]):  # written before names (ids = order)
        optim = {"state": {trainable[i]: st for i, st in optim["state"].items()},
                 "param_groups": [{**g, "params": [trainable[i] for i in g["params"]]} for g in optim["param_groups"]]}
    if sharded:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=False))
        set_optimizer_state_dict(model, getattr(optimizer, "optimizer", optimizer), optim,
                                 options=StateDictOptions(full_state_dict=True))
        return
    load_trainable_state(unwrapped, weights)
    index = {n: i for i, n in enumerate(_optimizer_order(unwrapped, optimizer))}
    optimizer.load_state_dict({"state": {index[n]: st for n, st in optim["state"].items()},
                               "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                                                for g in optim["param_groups"]]})


def _optimizer_order(model, optimizer) -> list[str]:
    """The parameter names in the order of the optimizer's integer ids."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id[id(p)] for g in optimizer.param_groups for p in g["params"]]


def read_checkpoint(ckpt_dir: Path) -> dict | None:
    recover_interrupted_save(ckpt_dir)  # a run killed while swapping checkpoints left the last one aside
    meta = ckpt_dir / "meta.json"
    if not meta.is_file():
        return None
    return json.loads(meta.read_text())


def train_stage(
    name: str,
    model,
    loss_fn: Callable[[object, dict], torch.Tensor],
    rows: dict[str, torch.Tensor],
    cfg: TrainConfig,
    run_dir: Path,
    resume: bool = False,
    accelerator=None,
    budget: StageBudget | None = None,
    lr_scale: dict[str, float] | None = None,
) -> dict:
    """Train the parameters of ``model`` that require grad for ``cfg.steps`` steps (with ``budget``:
    as many as its deadline allows, see ``StageBudget``).

    ``lr_scale``: parameter name -> the factor of the schedule's learning rate it trains at (the
    others at 1): one optimizer parameter group per factor, the same warmup and decay.

    ``rows``: tensors with the same first dimension (e.g. input_ids, position_ids); a micro-batch is
    a dict of their slices. ``loss_fn(model, batch)`` returns a scalar. Checkpoints go to
    ``run_dir/checkpoints/<name>``; metrics to ``run_dir/metrics.jsonl``; the curve to
    ``run_dir/loss_<name>.png``. Returns ``{"steps", "tokens", "seconds", "final_loss"}``.

    Under ``accelerate launch`` each of the P processes takes a distinct 1/P of every step's rows
    (a global batch of ``batch_size * grad_accum * P`` rows), the logged loss is the mean over the
    processes, and only the main process writes metrics, plots and checkpoints. A checkpoint holds
    whole (unsharded) trainable weights and optimizer state, so it resumes on any process count.
    """
    from accelerate import Accelerator

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    accelerator = accelerator or Accelerator(mixed_precision=cfg.mixed_precision, cpu=not torch.cuda.is_available())
    kind = str(accelerator.distributed_type).rsplit(".", 1)[-1]
    if kind not in ("NO", "MULTI_GPU", "MULTI_CPU"):
        # accelerate's own FSDP and DeepSpeed plugins are not what this loop shards with (--fsdp is)
        raise ValueError(f"the training loop runs on one process or on several under `accelerate launch --multi_gpu`, "
                         f"not {kind}: launch with `accelerate launch --multi_gpu --num_processes N` and add --fsdp "
                         "to shard the model over the processes")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"stage {name}: no trainable parameters")
    sharded = cfg.fsdp and accelerator.num_processes > 1
    if sharded and not getattr(loss_fn, "shardable", True):
        raise ValueError(f"stage {name}: its loss does not flow back through the model's output, which FSDP "
                         "hooks to gather and reduce: train this stage without --fsdp (DDP)")
    # fully_shard turns the module it is given into shards in place: the stage trains a sharded copy
    # and gathers the trained weights back into ``model``, which leaves the stage whole
    work = shard(copy.deepcopy(model).to(accelerator.device)) if sharded else model
    if sharded:
        accelerator.print(f"stage {name}: weights, gradients and optimizer state sharded over "
                          f"{accelerator.num_processes} processes (FSDP)")
    named = [(n, p) for n, p in work.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    unknown = set(lr_scale or ()) - {n for n, _ in named}
    if unknown:
        raise ValueError(f"stage {name}: lr_scale names weights the stage does not train: {sorted(unknown)[:3]}")
    torch.manual_seed(cfg.seed)
    optimizer = make_optimizer(named if lr_scale else params, cfg, lr_scale)
    if cfg.gradient_checkpointing and hasattr(work, "gradient_checkpointing_enable"):
        work.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compiled = compile_decoder(work, cuda_graphs=cfg.cuda_graphs) if cfg.compile else None
    # under DDP, one graph per compiled layer: dynamo's default cuts graphs at every 25 MB gradient
    # bucket to overlap the all-reduce, which cost more than it saved on 2 GPUs (docs/reports/training.md:
    # gdn stage 1 1.58x with the cuts, 1.85x without, H200; the all-reduce is a few ms of a 100+ ms step)
    # Past dynamo's recompile limit (8 graphs per code object) a layer would run eagerly without a word:
    # the layers share one code object (their kinds, modes and grad modes each add a graph), so the
    # limit is raised, and hitting it fails the step instead of slowing it silently
    ddp_graphs = (torch._dynamo.config.patch(optimize_ddp=False, recompile_limit=64, fail_on_recompile_limit_hit=True)
                  if compiled is not None else contextlib.nullcontext())
    # rows that pack documents take the packed path in every batch (linearize.layers.static_packing):
    # one graph whatever the packing, no host read per forward
    packing = static_packing(rows_pack_documents(rows))
    try:
        with ddp_graphs, packing:
            out = _run(name, work, loss_fn, rows, cfg, run_dir, resume, accelerator, optimizer, sharded, budget)
    finally:
        if compiled is not None:  # the model leaves the stage as it came (eval, merge, save)
            uncompile_decoder(work, compiled)
    if sharded:
        weights, _ = whole_state(accelerator, out.pop("_model"), None, sharded=True, everywhere=True)
        load_trainable_state(model, weights)
        model.eval()
    out.pop("_model", None)
    return out


def shard(model):
    """FSDP2 over the processes of the run: each decoder layer is a unit (its weights gathered for
    its forward and again for its backward), the rest (embeddings, final norm, head) the root's."""
    from torch.distributed.fsdp import fully_shard

    from .kd import unwrap

    inner = unwrap(model)
    layers = getattr(getattr(inner, inner.base_model_prefix), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"--fsdp needs the decoder layers as `{inner.base_model_prefix}.layers`; "
                         f"{type(inner).__name__} has none: train without --fsdp (DDP)")
    import torch.distributed as dist

    with torch.no_grad():  # every process shards rank 0's weights (DDP broadcasts them the same way)
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=0)
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def rows_pack_documents(rows: dict) -> bool:
    """Whether any row holds a document restart (position ids back to 0 inside the row)."""
    pos = rows.get("position_ids")
    return pos is not None and pos.dim() == 2 and pos.shape[1] > 1 and bool((pos[:, 1:] == 0).any())


def compile_decoder(model, cuda_graphs: bool = False):
    """Compile each decoder layer in place (regional compilation): every call of it, through peft,
    DDP or the teacher pass of a LoRA student, runs compiled (``cuda_graphs``: and replays as CUDA
    graphs, ``TrainConfig.cuda_graphs``). The layers share one code object, and dynamo guards on
    their parameters' properties rather than their identity (``inline_inbuilt_nn_modules``), so
    identical layers reuse one compiled graph: the first step compiles one layer (and its backward)
    per kind of layer (converted, kept softmax, teacher mode) instead of the whole stack as one
    graph, whose compile time grew with the depth (216 s on an H100 for SmolLM2-135M's 30 layers).
    The embeddings, the final norm and the mask construction run eagerly between the layers.
    The decode-step MLP routing (``install_decode_mlps``: a per-layer ``functools.partial`` that
    dynamo guards by identity, one recompile per layer) is taken off while compiled: training never
    runs a decode step. Returns the decoder; ``uncompile_decoder`` undoes it."""
    from linearize.modeling_linearize import remove_decode_mlps

    from .kd import unwrap

    inner = unwrap(model)
    decoder = getattr(inner, inner.base_model_prefix)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"--compile compiles each decoder layer: {type(decoder).__name__} has no `layers` "
                         "ModuleList; train without --compile")
    decoder._linearize_decode_mlps = remove_decode_mlps(inner)
    for layer in layers:
        layer.compile(**compile_mode(cuda_graphs))
    decoder._linearize_compiled = True
    return decoder


def uncompile_decoder(model, decoder) -> None:
    """Undo ``compile_decoder``: the layers run eagerly again, the decode MLP routing is back."""
    from linearize.modeling_linearize import install_decode_mlps

    from .kd import unwrap

    for layer in decoder.layers:
        layer._compiled_call_impl = None
    decoder._compiled_call_impl = None
    decoder._linearize_compiled = False
    if getattr(decoder, "_linearize_decode_mlps", 0):
        install_decode_mlps(unwrap(model))


def release_compiled() -> None:
    """Free what compiled training holds once its last stage is done: dynamo's compiled code and
    Inductor's CUDA-graph trees, whose memory pools outlive ``uncompile_decoder`` (the graphs' inputs,
    activations and outputs). A distill run then evaluates in the same process: after lolcats-hybrid's
    8K-row stage those pools held 28.4 GiB through the evaluation, and with a second run training
    beside it on the same H100 the evaluation's 8K passkey ran out of memory (2026-12-06d). The next
    compiled call compiles afresh."""
    torch._dynamo.reset()  # the code caches, and the CUDA-graph trees with their pools
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def compile_mode(cuda_graphs: bool) -> dict:
    """torch.compile's keyword arguments for a decoder: Inductor's default, or CUDA graphs.
    ``LINEARIZE_COMPILE_BACKEND`` (e.g. ``aot_eager``) names another dynamo backend instead: the same
    graphs without Inductor's code generation, for CPU tests where Inductor's C++ build takes minutes;
    never for speed (it runs the graphs op by op), and said on stderr when it applies."""
    backend = os.environ.get("LINEARIZE_COMPILE_BACKEND")
    if backend:
        print(f"linearize: --compile uses the dynamo backend {backend!r} (LINEARIZE_COMPILE_BACKEND), not Inductor",
              file=sys.stderr)
        return {"backend": backend}
    return {"mode": "reduce-overhead"} if cuda_graphs else {}


def _agree(accelerator, value: float) -> float:
    """The main process's ``value`` on every process (a step count, a stop decision): the processes
    time their steps apart, and one that decided otherwise would hang the others in a collective."""
    if accelerator.num_processes == 1:
        return value
    from accelerate.utils import broadcast

    t = torch.tensor([float(value)], device=accelerator.device, dtype=torch.float64)
    return float(broadcast(t, from_process=0).item())


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _run(name, model, loss_fn, rows, cfg, run_dir, resume, accelerator, optimizer, sharded, budget=None) -> dict:
    from tqdm.auto import tqdm

    ckpt_dir = run_dir / "checkpoints" / name
    metrics_path = run_dir / "metrics.jsonl"
    main = accelerator.is_main_process
    if sharded:  # already sharded (``shard``): accelerate would wrap it in DDP
        optimizer = accelerator.prepare(optimizer)
    else:
        model, optimizer = accelerator.prepare(model, optimizer)
    params = [p for p in model.parameters() if p.requires_grad]

    start = 0
    meta = read_checkpoint(ckpt_dir) if resume else None
    if meta is not None:
        load_whole_state(accelerator, model, optimizer, ckpt_dir, sharded)
        start = meta["step"]
        if main:
            _truncate_metrics(metrics_path, name, start)
    elif main:  # a fresh start (or a resume killed before its first checkpoint): no lines of this stage yet
        _truncate_metrics(metrics_path, name, 0)
    accelerator.wait_for_everyone()  # nobody reads metrics.jsonl before it is truncated
    if meta is not None and meta["done"]:
        return {"steps": start, "tokens": 0, "seconds": 0.0, "final_loss": _last_loss(metrics_path, name),
                "resumed": True, "_model": model}
    if budget is not None and budget.fixed_steps is not None:  # fitted by the run this one resumes
        cfg = dataclasses.replace(cfg, steps=budget.fixed_steps)
    fitted = budget is None or budget.fit is None or budget.fixed_steps is not None
    probe_until = min(start + 1 + (budget.probe_steps if budget else 0), cfg.steps)

    n_rows = next(iter(rows.values())).shape[0]
    rows_per_step = cfg.batch_size * cfg.grad_accum * accelerator.num_processes
    model.train()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    tokens, t0, loss_value = 0, time.time(), float("nan")
    in_a_row, skipped, skips_before = 0, [], cudagraph_skips()
    graphs_before, graphs_first, first_step_s, t_first, stopped = _graphs(), None, None, None, False
    durations, t_last = [], None  # with a budget: each step's seconds after the first
    last_fit = None  # the step count at the last (re)fit
    bar = tqdm(total=cfg.steps, desc=name, initial=start, disable=not accelerator.is_main_process)
    if cfg.compile and start < cfg.steps and main:  # a silent bar for minutes looks like a hang
        bar.write(f"stage {name}: the first step compiles the decoder layers (one layer graph per kind of layer)")
    step = start - 1
    while step + 1 < cfg.steps:
        step += 1
        idx = rows_for_step(step, n_rows, rows_per_step, cfg.seed)
        idx = idx[accelerator.process_index :: accelerator.num_processes]
        for g in optimizer.param_groups:
            g["lr"] = lr_at(step, cfg) * g.get("lr_scale", 1.0)
        batches = [{k: v[micro].to(accelerator.device) for k, v in rows.items()} for micro in idx.split(cfg.batch_size)]
        tokens += sum(b["input_ids"].numel() for b in batches) * accelerator.num_processes
        total, bad = train_step(model, loss_fn, batches, accelerator, optimizer, params)
        bar.update(1)
        if step == start:
            first_step_s, t_first, graphs_first = time.time() - t0, time.time(), _graphs()
            if cfg.compile and main:
                bar.write(f"stage {name}: the first step, compilation included, took {first_step_s:.0f} s "
                          "(tokens/s counts it)")
        if step == start and cfg.cuda_graphs and (n := cudagraph_skips() - skips_before):
            bar.write(f"stage {name}: --cuda-graphs: Inductor runs {n} compiled graph(s) of the step without CUDA "
                      "graphs (TORCH_LOGS=perf_hints says why); the step runs, with their launches on the host")
        if bad is not None:  # no update from this step
            in_a_row += 1
            if in_a_row > cfg.max_skipped_steps:
                more = f" ({in_a_row} steps in a row)" if cfg.max_skipped_steps else ""
                raise TrainingDiverged(
                    f"stage {name}: {bad} at step {step}{more}; nothing was saved for this step. The last good "
                    f"checkpoint is {ckpt_dir} (resume with --resume); lower --lr, use fp32, or allow a few "
                    f"skipped steps with --max-skipped-steps."
                )
            skipped.append(step + 1)
            bar.write(f"stage {name}: {bad} at step {step}; step skipped without an update ({len(skipped)} so far)")
        else:
            in_a_row = 0
            loss_value = total
        elapsed = time.time() - t0
        bar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{tokens / max(elapsed, 1e-9):.0f}")
        if main:
            row = {"stage": name, "step": step + 1, "loss": total if bad is None else None, "lr": lr_at(step, cfg),
                   "tokens": tokens, "tok_per_s": tokens / max(elapsed, 1e-9)}
            # a loss made of terms (the KD loss with --transfer-weight) names them: this process's last micro-batch
            if bad is None:
                row.update({k: v.item() for k, v in getattr(loss_fn, "parts", {}).items()})
            with open(metrics_path, "a") as f:
                f.write(json.dumps(row if bad is None else {**row, "skipped": bad}) + "\n")
        if budget is not None:
            now = time.time()
            if step > start:
                durations.append(now - t_last)
            t_last = now
            # the recent steps' median: the first steps after the compiled one record CUDA graphs
            recent = sorted(durations[-max(1, budget.probe_steps // 2):])
            rate = recent[len(recent) // 2] if recent else first_step_s
            if not fitted and step + 1 >= probe_until:
                # the rate after the first (compiling) step fixes the stage's length and LR schedule
                n = int(_agree(accelerator, max(step + 1, budget.fit(first_step_s, rate, step + 1))))
                cfg = dataclasses.replace(cfg, steps=n)
                bar.total = n
                fitted, last_fit = True, step + 1
                budget.record.update(fitted_steps=n, first_step_s=first_step_s, probe_s_per_step=rate)
                if budget.on_fit is not None and main:
                    budget.on_fit(n)
                if main:
                    bar.write(f"stage {name}: {rate:.3g} s/step after a first step of {first_step_s:.1f} s: "
                              f"{n} steps fit the time budget")
            elif (last_fit is not None and budget.refit_every and step + 1 - last_fit >= budget.refit_every
                  and step + 1 < cfg.steps):
                last_fit = step + 1
                window = sorted(durations[-budget.refit_every:])
                now_rate = window[len(window) // 2]
                n = int(_agree(accelerator, max(step + 1, budget.fit(first_step_s, now_rate, step + 1))))
                if n < 0.97 * cfg.steps:
                    if main:
                        bar.write(f"stage {name}: {now_rate:.3g} s/step over the last {len(window)} steps: "
                                  f"{n} steps fit the time left (was {cfg.steps})")
                    cfg = dataclasses.replace(cfg, steps=n)
                    bar.total = n
                    budget.record.setdefault("refits", []).append({"step": step + 1, "steps": n, "s_per_step": now_rate})
                    budget.record["fitted_steps"] = n
                    if budget.on_fit is not None and main:
                        budget.on_fit(n)
            # stop before a step that would end past the deadline (the save and evaluation have their own time)
            if step + 1 < cfg.steps and _agree(accelerator, float(now + rate > budget.deadline)):
                stopped = True
                if main:
                    bar.write(f"stage {name}: stopped by the time budget after {step + 1} of {cfg.steps} steps")
                cfg = dataclasses.replace(cfg, steps=step + 1)
        last = step + 1 == cfg.steps
        if last or (cfg.save_every and (step + 1) % cfg.save_every == 0):
            state = whole_state(accelerator, model, optimizer, sharded)  # every process: FSDP gathers
            if main:
                save_checkpoint(ckpt_dir, *state, step + 1, done=last)
                plot_losses(metrics_path, run_dir / f"loss_{name}.png", name)
    bar.close()
    accelerator.wait_for_everyone()  # the last checkpoint is on disk before any process goes on
    model.eval()
    out = {"steps": cfg.steps, "tokens": tokens, "seconds": time.time() - t0, "final_loss": loss_value, "_model": model,
           "processes": accelerator.num_processes}
    if first_step_s is not None:
        out["first_step_s"] = first_step_s  # compilation included under --compile
        ran = step - start  # steps after the first
        if ran > 0:
            out["s_per_step"] = (time.time() - t_first) / ran
        # graphs dynamo compiled in the first step, and after it (recompiles: new shapes or guards)
        out["compiled_graphs"] = graphs_first - graphs_before
        out["recompiles"] = _graphs() - graphs_first
    if budget is not None:
        out["stopped_by_budget"] = stopped
        out["budget"] = dict(budget.record)
    if skipped:
        out["skipped_steps"] = skipped
    if torch.cuda.is_available():
        out["peak_gpu_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def cudagraph_skips() -> int:
    """Compiled graphs Inductor has run without CUDA graphs in this process under
    ``mode="reduce-overhead"`` (it says why only in its perf_hints log)."""
    if not torch.cuda.is_available():
        return 0
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def train_step(model, loss_fn, batches, accelerator, optimizer, params) -> tuple[float, str | None]:
    """One optimizer step over the micro-batches ``batches`` (dicts of tensors on the device):
    ``(loss, None)`` after an update, or ``(partial loss, reason)`` when a non-finite loss or
    gradient norm made it skip the update. ``loss`` is the mean over the processes."""
    total, bad = 0.0, None
    # a new step for CUDA-graph trees (TrainConfig.cuda_graphs): the last step's graph outputs are
    # dead, their memory reused (a no-op without CUDA graphs)
    torch.compiler.cudagraph_mark_step_begin()
    for i, batch in enumerate(batches):
        # gradients are all-reduced once per step, at the last micro-batch
        sync = contextlib.nullcontext() if i + 1 == len(batches) else accelerator.no_sync(model)
        with sync:
            with accelerator.autocast():
                loss = loss_fn(model, batch) / len(batches)
            # one reduction: the mean loss over the processes (what one process with the whole
            # global batch would log), non-finite if any process's is
            mean = accelerator.reduce(loss.detach().float(), reduction="mean").item()
            if not math.isfinite(mean):
                bad = f"loss became {loss.item()}" if not torch.isfinite(loss) else "loss became non-finite in another process"
                break
            with record_function("train.backward"):
                accelerator.backward(loss)
        total += mean
    with record_function("train.optimizer"):
        if bad is None:
            norm = accelerator.clip_grad_norm_(params, 1.0)  # unscales fp16 gradients first
            if not torch.isfinite(norm) and accelerator.scaler is None:  # fp16 loss scaling skips overflows itself
                bad = f"gradient norm became {norm.item()}"
        if bad is None:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return total, bad


def make_optimizer(params, cfg: TrainConfig, lr_scale: dict[str, float] | None = None) -> torch.optim.Optimizer:
    """AdamW over ``params`` at ``cfg.lr``; with ``lr_scale`` (name -> factor), ``params`` are
    (name, parameter) pairs, grouped by their factor (kept in the group as ``lr_scale``)."""
    if lr_scale:
        by_scale: dict[float, list] = {}
        for name, p in params:
            by_scale.setdefault(float(lr_scale.get(name, 1.0)), []).append(p)
        groups = [{"params": ps, "lr": cfg.lr * k, "lr_scale": k} for k, ps in by_scale.items()]
        params = [p for g in groups for p in g["params"]]
    else:
        groups = params
    # the fused CUDA kernel: one launch for all parameters instead of a few per tensor
    fused = bool(params) and all(p.is_cuda for p in params)
    return torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused or None)


def _read_metrics(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # the torn last line of a killed run (it is past the checkpoint)
            continue
    return rows


def _truncate_metrics(path: Path, stage: str, step: int) -> None:
    """Drop this stage's lines after ``step`` (they belong to a run that was interrupted)."""
    if not path.is_file():
        return
    keep = [m for m in _read_metrics(path) if m["stage"] != stage or m["step"] <= step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(m) + "\n" for m in keep))
    os.replace(tmp, path)  # a kill here keeps the old file whole


def _last_loss(path: Path, stage: str) -> float:
    losses = [m["loss"] for m in _read_metrics(path) if m["stage"] == stage and m["loss"] is not None]
    return losses[-1] if losses else float("nan")


def plot_losses(metrics_path: Path, png: Path, stage: str) -> None:
    try:
        import matplotlib
    except ImportError:  # a GPU image without matplotlib: metrics.jsonl has everything, plot later
        import warnings

        warnings.warn("matplotlib is not installed: no loss PNG (metrics.jsonl holds the curve)")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [m for m in _read_metrics(metrics_path) if m["stage"] == stage and m["loss"] is not None]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([m["step"] for m in rows], [m["loss"] for m in rows])
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.set_title(f"{stage}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = png.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, png)
