"""`accelerate launch` of `linearize distill` on 2 CPU processes (gloo): the losses of a 1-process
run with the same global batch, files written once (rank 0), and a checkpoint of a 1-process run
resumed on 2 processes giving the uninterrupted run's losses."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch

from conftest import free_port, tiny_model
from test_recipes import corpus

STEPS = ["--stage1-steps", "3", "--stage2-steps", "8", "--stage1-lr", "0.05", "--stage2-lr", "0.01", "--warmup-steps", "1"]
COMMON = ["--data", "corpus.txt", "--seq-len", "32", "--window", "4", "--lora-rank", "4", "--save-every", "2", "--no-eval", *STEPS]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("ddp")
    vocab = {"<pad>": 0, "<s>": 1, **{f"w{i}": i for i in range(2, 96)}, "</s>": 96}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    model = tiny_model("llama")
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    (root / "corpus.txt").write_text("\n\n\n".join(corpus()))
    return root


def command(processes: int, out: str, batch_size: int, *extra, fsdp: bool = False):
    cli = ["-m", "linearize.cli", "distill", "model", "--out", out, "--batch-size", str(batch_size), *COMMON, *extra]
    if processes == 1:
        return [sys.executable, *cli]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
              "--num_machines", "1", "--main_process_port", str(free_port()), "--mixed_precision", "no", "--dynamo_backend", "no"]
    return [*launch, *cli, *(["--fsdp"] if fsdp else [])]


# PYTHONFAULTHANDLER: a process that crashes prints its Python stack into the stderr a failure shows
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONFAULTHANDLER": "1"}


def crash(stderr: str) -> str | None:
    """The stack of a process that died from a signal (faulthandler's block; else torchrun's word of
    it), or None."""
    for mark in ("Fatal Python error", "Signal 11 (SIGSEGV)"):
        if (i := stderr.find(mark)) >= 0:
            return stderr[i:i + 4000]
    return None


def run(workdir, *args, fsdp=False, env=None):
    """Launch ``command(*args)``; a launch whose process died from a signal (rank 0 of an FSDP launch, once
    on CI, while rank 1 waited in a gloo collective; cause unknown, never in 57 launches here) is launched
    once more, with a warning that shows the crash. A Python error, a wrong loss or a second crash fails."""
    for attempt in (1, 2):
        proc = subprocess.run(command(*args, fsdp=fsdp), cwd=workdir, env={**ENV, **(env or {})},
                              capture_output=True, text=True, timeout=600)
        stack = crash(proc.stderr) if proc.returncode else None
        if stack is None or attempt == 2:
            break
        warnings.warn(f"launch {args} crashed with a signal; launched once more. Its stack:\n{stack}")
        if "--resume" not in args:  # a fresh run starts from nothing; a resumed one from its last checkpoint
            shutil.rmtree(workdir / args[1], ignore_errors=True)
    assert proc.returncode == 0, ((stack + "\n...\n") if stack else "") + proc.stderr[-3000:]
    return proc


def metrics(path):
    return [json.loads(l) for l in path.read_text().splitlines()]


def kill_after_stage2_checkpoint(workdir, name, cmd):
    """Start ``cmd`` (writing into ``workdir / name``), SIGKILL it once a stage-2 checkpoint is on
    disk and before the run ends; returns the run's folder."""
    out = workdir / name
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.Popen(cmd, cwd=workdir, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    meta = out / "checkpoints" / "stage2_kd" / "meta.json"
    deadline = time.time() + 300
    while not meta.is_file() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not json.loads(meta.read_text())["done"], "the run finished before it could be interrupted"
    return out


def losses(path):
    return {(m["stage"], m["step"]): m["loss"] for m in metrics(path)}


def test_two_processes_train_like_one_with_the_same_global_batch(workdir):
    one = run(workdir, 1, "one", 4)
    two = run(workdir, 2, "two", 2)  # 2 processes x 2 rows = the same 4 rows per step
    a, b = losses(workdir / "one" / "metrics.jsonl"), losses(workdir / "two" / "metrics.jsonl")
    assert len(metrics(workdir / "two" / "metrics.jsonl")) == 11  # one line per step: rank 0 alone writes
    assert a.keys() == b.keys() and min(a.values()) > 1e-4
    assert list(b.values()) == pytest.approx(list(a.values()), rel=1e-4)
    # rank 0 alone logs, shows progress and saves
    assert two.stdout.count("stage 1 (attention transfer)") == 1 and two.stdout.count("distilled model ->") == 1
    # one bar per stage (its 0% line is printed once; how often tqdm redraws 100% depends on timing)
    for shown in ("stage1_attention_transfer:   0%", "stage2_kd:   0%", "Writing model shards:   0%"):
        assert two.stderr.count(shown) == one.stderr.count(shown) == 1, shown
    assert "stage2_kd: 100%" in two.stderr
    for run_dir in ("one", "two"):
        meta = json.loads((workdir / run_dir / "checkpoints" / "stage2_kd" / "meta.json").read_text())
        assert meta == {"step": 8, "done": True}
    assert (workdir / "two" / "model.safetensors").is_file() and (workdir / "two" / "distill.json").is_file()
    for run_dir, n in (("one", 1), ("two", 2)):  # what scripts/results.py reports as the run's GPUs
        summary = json.loads((workdir / run_dir / "distill.json").read_text())
        assert summary["stage1"]["processes"] == summary["stage2"]["processes"] == n


def test_compiled_graph_replay_under_two_processes_trains_like_one(workdir):
    """`--compile --cuda-graphs` under `accelerate launch` (DDP; on a GPU each process replays its
    own CUDA graphs, on CPU the same compiled code without graphs): the losses of one process with
    the same flags and global batch."""
    # stage 2 alone (the LoRA student and its own teacher pass through the compiled layers). The
    # graphs go to aot_eager (LINEARIZE_COMPILE_BACKEND): dynamo, DDP and AOTAutograd as with
    # Inductor, without its C++ build, which took over 10 minutes for the three processes on CI's CPU
    flags = ("--compile", "--cuda-graphs", "--stage1-steps", "0", "--stage2-steps", "4")
    env = {"LINEARIZE_COMPILE_BACKEND": "aot_eager"}
    run(workdir, 1, "one_cg", 4, *flags, env=env)
    two = run(workdir, 2, "two_cg", 2, *flags, env=env)
    assert "dynamo backend 'aot_eager'" in two.stderr
    a, b = losses(workdir / "one_cg" / "metrics.jsonl"), losses(workdir / "two_cg" / "metrics.jsonl")
    assert list(a) == [("stage2_kd", s) for s in range(1, 5)] and min(a.values()) > 1e-4
    assert list(b.values()) == pytest.approx(list(a.values()), rel=1e-4)
    assert two.stdout.count("distilled model ->") == 1
    # its rows pack one to three documents each, with boundaries that move from batch to batch: under
    # DDP the compiled step still builds one graph per kind of layer (the teacher's, the student's
    # first, the rest) in its first step and none after it (rank 0's dynamo counters, in distill.json)
    stage2 = json.loads((workdir / "two_cg" / "distill.json").read_text())["stage2"]
    assert stage2["steps"] == 4 and 1 <= stage2["compiled_graphs"] <= 3 and stage2["recompiles"] == 0, stage2


def test_a_checkpoint_resumes_on_another_number_of_processes(workdir):
    """Kill a 1-process run after a stage-2 checkpoint, resume it on 2 processes: same losses."""
    if not (workdir / "one" / "metrics.jsonl").is_file():
        run(workdir, 1, "one", 4)
    out = kill_after_stage2_checkpoint(workdir, "killed", command(1, "killed", 4))
    meta = out / "checkpoints" / "stage2_kd" / "meta.json"
    run(workdir, 2, "killed", 2, "--resume")
    a, b = losses(workdir / "one" / "metrics.jsonl"), losses(out / "metrics.jsonl")
    assert a.keys() == b.keys()
    assert list(b.values()) == pytest.approx(list(a.values()), rel=1e-4)
    assert json.loads(meta.read_text()) == {"step": 8, "done": True}


# the lolcats-hybrid preset's long-row stage: the last half of stage 2's 16 steps on rows of 64 tokens,
# training the conversion's own weights (a smaller trained set than stage 2's, sharded anew)
LONG = ("--stage2-steps", "16", "--long-seq-len", "64", "--long-share", "0.5", "--long-finetune", "new")


def test_fsdp_trains_like_one_process_and_its_checkpoint_resumes_on_one(workdir):
    """FSDP (fully_shard over 2 gloo processes), stage 2 and a long-row stage on other weights: the
    1-process losses for the same global batch, the distilled model written once and whole; a run
    killed after a stage-2 checkpoint (gathered from the shards) resumes on 1 process with the
    uninterrupted losses."""
    from safetensors.torch import load_file

    run(workdir, 1, "one_long", 4, *LONG)
    sharded = run(workdir, 2, "fsdp", 2, *LONG, fsdp=True)
    a, b = losses(workdir / "one_long" / "metrics.jsonl"), losses(workdir / "fsdp" / "metrics.jsonl")
    assert len(metrics(workdir / "fsdp" / "metrics.jsonl")) == 3 + 8 + 8
    assert [k for k in a if k[0] == "stage3_long"] == [("stage3_long", s) for s in range(1, 9)]
    assert a.keys() == b.keys() and list(b.values()) == pytest.approx(list(a.values()), rel=1e-4)
    assert sharded.stdout.count("distilled model ->") == 1
    # stages 2 and 3 sharded (stage 1's per-layer losses bypass the output FSDP hooks: replicated)
    assert sharded.stdout.count("sharded over 2 processes (FSDP)") == 2
    assert "stage stage2_kd: weights" in sharded.stdout and "stage stage3_long: weights" in sharded.stdout
    assert "training the conversion's" in sharded.stdout  # stage 3 on the new weights alone
    # the saved model is whole: the weights of the 1-process run, shape for shape
    w1, w2 = load_file(workdir / "one_long" / "model.safetensors"), load_file(workdir / "fsdp" / "model.safetensors")
    assert w1.keys() == w2.keys()
    for n in w1:
        # Adam moves a weight whose gradient is near 0 by up to lr a step either way, so two processes'
        # summation order can part such weights by a few lr (1.8e-4 with lolcats' sinks, lr 1e-4); a
        # checkpoint that lost or mixed up a shard is off by the weights' own size (~0.1)
        diff = (w2[n].float() - w1[n].float()).abs().max().item()
        assert w2[n].shape == w1[n].shape and torch.allclose(w2[n].float(), w1[n].float(), rtol=1e-3, atol=1e-3), (n, diff)

    out = kill_after_stage2_checkpoint(workdir, "fsdp_killed", command(2, "fsdp_killed", 2, *LONG, fsdp=True))
    optim = torch.load(out / "checkpoints" / "stage2_kd" / "optimizer.pt", weights_only=True)
    assert all(isinstance(k, str) for k in optim["state"])  # by parameter name: any launch can read it
    run(workdir, 1, "fsdp_killed", 4, *LONG, "--resume")
    c = losses(out / "metrics.jsonl")
    assert c.keys() == a.keys() and list(c.values()) == pytest.approx(list(a.values()), rel=1e-4)


def test_launches_the_loop_cannot_run_are_refused_with_the_command_that_works(tmp_path):
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from linearize.recipes.distill import attention_transfer_loss
    from linearize.recipes.train import TrainConfig, train_stage

    model = tiny_model("llama")
    for kind in (DistributedType.DEEPSPEED, DistributedType.FSDP):  # accelerate's own sharding plugins
        launched = SimpleNamespace(distributed_type=kind)
        with pytest.raises(ValueError, match=r"launch with `accelerate launch --multi_gpu --num_processes N` and add --fsdp"):
            train_stage("s", model, attention_transfer_loss, {}, TrainConfig(steps=1), tmp_path, accelerator=launched)
    with pytest.raises(ValueError, match=r"--compile is not supported with --fsdp yet"):
        TrainConfig(steps=1, compile=True, fsdp=True)
    with pytest.raises(ValueError, match=r"--cuda-graphs replays the compiled decoder: add --compile"):
        TrainConfig(steps=1, cuda_graphs=True)
    with pytest.raises(ValueError, match=r"--cuda-graphs takes one micro-batch per step"):
        TrainConfig(steps=1, compile=True, cuda_graphs=True, grad_accum=2)
    # stage 1's loss bypasses the output FSDP hooks gather and reduce with: refused, not sharded
    two = SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, num_processes=2)
    with pytest.raises(ValueError, match=r"does not flow back through the model's output.*without --fsdp"):
        train_stage("s", model, attention_transfer_loss, {}, TrainConfig(steps=1, fsdp=True), tmp_path, accelerator=two)
    assert not any(tmp_path.iterdir())  # nothing written


def test_checkpoints_name_optimizer_state_and_the_earlier_integer_layout_still_resumes(tmp_path):
    from types import SimpleNamespace

    from safetensors.torch import save_file

    from linearize.recipes.train import TrainConfig, load_whole_state, make_optimizer, trainable_state, whole_state

    torch.manual_seed(0)
    model = tiny_model("llama")
    for n, p in model.named_parameters():
        p.requires_grad_("layers.1." in n)  # a subset, so names and positions differ
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad], TrainConfig(lr=0.01))
    model(torch.randint(0, 96, (2, 16)), labels=torch.randint(0, 96, (2, 16))).loss.backward()
    opt.step()
    acc = SimpleNamespace(unwrap_model=lambda m: m, is_main_process=True)
    weights, named = whole_state(acc, model, opt, sharded=False)
    assert set(named["state"]) == set(weights) and all(n.startswith("model.layers.1.") for n in weights)
    assert named["param_groups"][0]["params"] == list(weights)

    for layout, state in (("named", named), ("integer ids (before names)", opt.state_dict())):
        ckpt = tmp_path / layout
        ckpt.mkdir()
        save_file(trainable_state(model), str(ckpt / "trainable.safetensors"))
        torch.save(state, ckpt / "optimizer.pt")
        fresh = tiny_model("llama")
        for n, p in fresh.named_parameters():
            p.requires_grad_("layers.1." in n)
        opt2 = make_optimizer([p for p in fresh.parameters() if p.requires_grad], TrainConfig(lr=0.01))
        load_whole_state(acc, fresh, opt2, ckpt, sharded=False)
        for (n, p), p2 in zip([(n, p) for n, p in model.named_parameters() if p.requires_grad],
                              [p for p in fresh.parameters() if p.requires_grad]):
            assert torch.equal(p, p2), (layout, n)
            assert torch.equal(opt.state[p]["exp_avg"], opt2.state[p2]["exp_avg"]), (layout, n)
