"""Runs killed with SIGKILL at any moment resume exactly.

`linearize distill` runs as a subprocess on a tiny local model and corpus; it is killed during
steps, while a checkpoint is being written (LINEARIZE_TEST_SLOW_SAVE makes the writer sleep
between its files, a window wide enough to hit) and while the final model is saved, then resumed
with --resume.  After every kill the checkpoints on disk are complete ones (never a temporary
folder); at the end the loss curve and the weights equal an uninterrupted run's.  `convert`
killed mid-save leaves its output folder absent, or the previous complete one.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from conftest import tiny_model

STAGES = ("stage1_attention_transfer", "stage2_kd", "stage3_long")
SEED = int(os.environ.get("LINEARIZE_KILL_SEED", "0"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model folder, corpus file) of a tiny qwen3 and arithmetic-progression documents."""
    root = tmp_path_factory.mktemp("kill")
    tiny_model("qwen3").save_pretrained(root / "tiny")
    vocab = {"<pad>": 0, "<s>": 1, **{f"w{i}": i for i in range(2, 96)}, "</s>": 96}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(root / "tiny")
    g = torch.Generator().manual_seed(0)
    docs = []
    for _ in range(60):
        start, step, n = (torch.randint(2, 90, (3,), generator=g) % torch.tensor([88, 5, 40])).tolist()
        docs.append(" ".join(f"w{2 + (start + i * (step + 1)) % 90}" for i in range(20 + n)))
    (root / "corpus.txt").write_text("\n\n\n".join(docs))
    return root / "tiny", root / "corpus.txt"


def _distill_cmd(tiny, out, resume=False):
    model, data = tiny
    return [sys.executable, "-m", "linearize.cli", "distill", str(model), "--out", str(out), "--data", str(data),
            "--preset", "lolcats", "--window", "4", "--lora-rank", "4", "--stage1-steps", "5", "--stage2-steps", "6",
            "--long-seq-len", "64", "--long-share", "0.34",  # stage 2's last 2 steps on 64-token rows (stage 3)
            "--save-every", "1", "--seq-len", "32", "--batch-size", "2", "--no-eval"] + (["--resume"] if resume else [])


def _env(slow=0.0):
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    if slow:
        env["LINEARIZE_TEST_SLOW_SAVE"] = str(slow)
    return env


def _losses(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["stage"], r["step"], r["loss"]) for r in rows]


def _wait_for(proc, cond, timeout=300):
    t0 = time.time()
    while not cond():
        if proc.poll() is not None:
            return False  # it finished before the moment came
        if time.time() - t0 > timeout:
            raise TimeoutError("the moment to kill never came")
        time.sleep(0.01)
    return True


def _checkpoints_are_complete(out):
    """Every checkpoint folder a resume would read is whole: meta, weights and optimizer state."""
    for stage in STAGES:
        ckpt = out / "checkpoints" / stage
        if ckpt.exists():
            meta = json.loads((ckpt / "meta.json").read_text())
            load_file(str(ckpt / "trainable.safetensors"))
            torch.load(ckpt / "optimizer.pt", weights_only=True)
            assert meta["step"] >= 1


def _tmp_dirs(out):
    return [p for p in (out / "checkpoints").glob(".*.tmp-*")] if (out / "checkpoints").exists() else []


def test_distill_killed_at_random_moments_resumes_to_the_same_losses_and_weights(tiny, tmp_path):
    rng = random.Random(SEED)
    print(f"kill seed {SEED} (replay: LINEARIZE_KILL_SEED={SEED})")
    straight = tmp_path / "straight"
    subprocess.run(_distill_cmd(tiny, straight), env=_env(), check=True, capture_output=True)

    out = tmp_path / "killed"
    moments = [
        # (what, when to kill)
        ("during a stage-1 step", lambda: (out / "metrics.jsonl").exists()
         and len((out / "metrics.jsonl").read_text().splitlines()) >= rng.randint(1, 3)),
        ("while a checkpoint is written", lambda: bool(_tmp_dirs(out))),
        ("during a stage-2 step", lambda: "stage2_kd" in (out / "metrics.jsonl").read_text()),
        ("while a stage-2 checkpoint is written", lambda: bool(_tmp_dirs(out))
         and (out / "checkpoints" / "stage2_kd").exists()),
        ("during a stage-3 step", lambda: "stage3_long" in (out / "metrics.jsonl").read_text()),
    ]
    kills = []
    for i, (what, when) in enumerate(moments):
        proc = subprocess.Popen(_distill_cmd(tiny, out, resume=i > 0), env=_env(slow=0.5), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        try:
            hit = _wait_for(proc, when)
            if hit:
                time.sleep(rng.uniform(0, 0.3))
                proc.send_signal(signal.SIGKILL)
        finally:
            _, err = proc.communicate()
        if proc.returncode == -signal.SIGKILL:
            kills.append(what)
        else:
            assert proc.returncode == 0, err.decode()[-2000:]
        _checkpoints_are_complete(out)
    assert len(kills) >= 3, f"only killed {kills}"

    subprocess.run(_distill_cmd(tiny, out, resume=True), env=_env(), check=True, capture_output=True)
    assert _losses(out) == _losses(straight)  # every step once, in order, with the same loss
    a, b = load_file(str(straight / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert not _tmp_dirs(out)


def test_checkpoint_swap_cut_between_its_renames_is_recovered(tmp_path):
    """Killed after the old checkpoint was moved aside and before the new one moved in: the
    resume takes the old one back (never the temporary folder, complete or not)."""
    from linearize.loading import save_atomically
    from linearize.recipes.train import read_checkpoint

    ckpt = tmp_path / "checkpoints" / "s1"

    def write(step):
        return lambda tmp: (tmp / "meta.json").write_text(json.dumps({"step": step, "done": False}))

    save_atomically(ckpt, write(3))
    aside = tmp_path / "checkpoints" / ".s1.old-abc"
    aside.mkdir()
    os.replace(ckpt, aside / "x")  # what save_atomically does first ...
    half = tmp_path / "checkpoints" / ".s1.tmp-def"
    half.mkdir()
    (half / "meta.json").write_text(json.dumps({"step": 4, "done": False}))  # ... with the new one not yet moved
    assert read_checkpoint(ckpt) == {"step": 3, "done": False}
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["s1"]


def test_convert_killed_while_saving_leaves_no_output_folder(tiny, tmp_path):
    out = tmp_path / "conv"
    cmd = [sys.executable, "-m", "linearize.cli", "convert", str(tiny[0]), "--out", str(out), "--feature-map", "t2r"]
    proc = subprocess.Popen(cmd, env=_env(slow=2.0), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert _wait_for(proc, lambda: any(tmp_path.glob(".conv.tmp-*/model.safetensors")))
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists()  # absent, not half-written
    # the next convert cleans the leftovers and writes a complete folder
    subprocess.run(cmd, env=_env(), check=True, capture_output=True)
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert not list(tmp_path.glob(".conv.*"))


def test_push_killed_mid_upload_commits_all_files_or_none(tmp_path):
    """A push is one Hub commit: killed while the commit request is in flight, the repo gets the
    whole checkpoint or nothing, and the local folder is never touched."""
    import threading
    from http.server import ThreadingHTTPServer

    import linearize
    from test_hub import FakeHub, snapshot, tiny_tokenizer

    from conftest import converted

    class SlowHub(FakeHub):
        def do_POST(self):
            if "/commit/" in self.path and self.state.get("hold"):
                self.state["commit_started"] = True
                time.sleep(self.state["hold"])  # the client is killed meanwhile
            try:
                super().do_POST()
            except (OSError, ValueError):  # the request was cut: nothing is committed
                pass

    ckpt = tmp_path / "ckpt"
    converted("llama", linearize.LinearAttentionConfig(feature_map="t2r", layers=[0, 2])).save_pretrained(ckpt)
    tiny_tokenizer().save_pretrained(ckpt)
    before = snapshot(ckpt)
    SlowHub.state = {"hold": 3.0}
    server = ThreadingHTTPServer(("127.0.0.1", 0), SlowHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    cmd = [sys.executable, "-m", "linearize.cli", "push", str(ckpt), "me/tiny", "--endpoint", endpoint, "--license", "mit"]
    env = {**_env(), "HF_TOKEN": "hf_test", "HF_HUB_DISABLE_TELEMETRY": "1"}
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            assert _wait_for(proc, lambda: SlowHub.state.get("commit_started")), proc.communicate()[1].decode()[-2000:]
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.communicate()
        time.sleep(SlowHub.state["hold"] + 0.5)
        commits = SlowHub.state.get("commits", [])
        from linearize.hub import files_to_push

        local = {f.name for f in files_to_push(ckpt)} | {"README.md"}
        assert commits == [] or set(commits[0]["files"]) == local  # none, or the whole checkpoint
        assert snapshot(ckpt) == before
        SlowHub.state["hold"] = 0
        subprocess.run(cmd, env=env, check=True, capture_output=True)  # the retry completes it
        assert set(SlowHub.state["commits"][-1]["files"]) == local
    finally:
        server.shutdown()
