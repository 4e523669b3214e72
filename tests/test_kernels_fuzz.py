"""Random cases for every Triton kernel against the float64 references (scripts/fuzz_kernels_gpu.py
holds the generator, the runner and the tolerances; on a GPU it runs 2,000 larger cases).

CI runs this under TRITON_INTERPRET=1 with tiny shapes.  Every case id starts with its seed:

    TRITON_INTERPRET=1 python -m pytest -q tests/test_kernels_fuzz.py -k seed_17-      # one of the CI cases
    LINEARIZE_FUZZ_SEED=1234,99 TRITON_INTERPRET=1 python -m pytest -q tests/test_kernels_fuzz.py  # any seeds
    LINEARIZE_FUZZ_CASES=1000 TRITON_INTERPRET=1 python -m pytest -q tests/test_kernels_fuzz.py    # more cases

A failure names the case, the errors over tolerance and the replay command.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from conftest import load_script

pytest.importorskip("triton")

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
HAS_CUDA = torch.cuda.is_available() and not INTERPRET
DEVICE = "cuda" if HAS_CUDA else "cpu"
needs_triton = pytest.mark.skipif(not (HAS_CUDA or INTERPRET),
                                  reason="no GPU and TRITON_INTERPRET=1 not exported: Triton kernels cannot run")

fz = load_script("fuzz_kernels_gpu")

if os.environ.get("LINEARIZE_FUZZ_SEED"):
    SEEDS = [int(s) for s in os.environ["LINEARIZE_FUZZ_SEED"].split(",")]
else:
    SEEDS = list(range(int(os.environ.get("LINEARIZE_FUZZ_CASES", "210"))))
CASES = [fz.gen_case(s, tiny=not HAS_CUDA) for s in SEEDS]


@pytest.fixture(scope="module")
def bf16_dots():
    """bf16 dots in the interpreter are computed on raw bits (triton 3.9): upcast them."""
    if not INTERPRET:
        yield
        return
    undo = fz.patch_interpreter_bf16_dots()
    yield
    undo()


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=[fz.case_id(c) + "-" for c in CASES])
def test_kernel_fuzz_case(case, bf16_dots):
    # on the CPU every tensor the case allocates is fenced: a store out of bounds fails the case too
    fz.check_case(case, DEVICE, guard=True)


# GPU fuzz failures (2026-11-24, H200) that the interpreter replays at full size: chunk bf16 T=1
# F=D=256 (1603: the first gate's gradient, exactly 0, came out as the rounding of the sequence's
# whole sum); window fp16 (1856: dgamma's 428 per-token terms cancel to 9e-5, judged against a floor
# that did not grow with the count).
CPU_REPLAYED_GPU_SEEDS = (1603, 1856)


@needs_triton
@pytest.mark.parametrize("seed", CPU_REPLAYED_GPU_SEEDS)
def test_gpu_failures_replayed_at_full_size(seed, bf16_dots):
    fz.check_case(fz.gen_case(seed, tiny=False, pool=140), DEVICE)


def test_a_sum_over_tokens_gets_a_floor_that_grows_with_their_count():
    """A gradient summed over n tokens (the window weight's) carries the rounding of n terms: its
    floor is the dtype's floor times sqrt(n); other tensors keep the plain floor."""
    want = torch.full((3,), 1e-5, dtype=torch.float64)
    got = want + 1e-5
    pairs = {"dgamma": (got, want), "dq": (got, want)}
    plain = fz._errors(pairs, 2.0**-14)
    summed = fz._errors(pairs, 2.0**-14, sums={"dgamma": 400})
    assert summed["dq"] == plain["dq"] and summed["dgamma"] == pytest.approx(plain["dgamma"] / 20)
    assert fz._errors(pairs, 0.0, sums={"dgamma": 400})["dgamma"] == pytest.approx(1.0)  # no floor: no change


# Seeds the GPU fuzz (--pool 140, full size) failed on an H200 and that were fixed after: chunk dv in
# bf16 at T=1 (0, 532: Triton's T == 1 specialization), GDN chunk fp16 gradients (47, 187, 271, 376:
# native fp16 products), GDN chunk fp32 at head dim 256 out of shared memory (33). The interpreter
# passed them before the fixes too: only a GPU replays what went wrong.
# Added after the 2026-11-23 evening H200 run: GDN chunk bf16 at K = 17, V = 24 (1748, 1188: dq, dk, dg;
# native bf16 products at small head dims) and the GDN forward's illegal address from a 1-stage
# config (355, 383, 803: o wrong, before the 1-stage configs were pruned).
# 2026-11-24 H200 run: chunk bf16 T=1 F=D=256 (1603, the first gate's gradient) and window fp16
# (1856, dgamma's floor), both replayed on CPU too (CPU_REPLAYED_GPU_SEEDS).
GPU_REGRESSION_SEEDS = (0, 532, 47, 187, 271, 376, 33, 1748, 1188, 355, 383, 803, 1856, 1603)
# Illegal addresses, each replayed in a process of its own (one poisons its process's CUDA context):
# the 2026-11-23 run's (window bf16 F=65 D=31: 99, 1079; split fp16: 590; chunk fp16 at T=1: 1925;
# gdn_recurrent fp32: 370; F not a power of two, cured by padding F in the 2026-11-24 run: 71, 268)
# and the 2026-11-24 run's (chunk fp16 B=T=1 F=200: 1785 with 1925; split fp32 F=33 D=31: 1787).
GPU_ILLEGAL_ADDRESS_SEEDS = (99, 1079, 590, 1925, 370, 71, 268, 1785, 1787)


@pytest.mark.skipif(not HAS_CUDA, reason="GPU-only failures: replayed on CUDA")
@pytest.mark.parametrize("seed", GPU_REGRESSION_SEEDS)
def test_gpu_fuzz_regressions(seed):
    fz.check_case(fz.gen_case(seed, tiny=False, pool=140), DEVICE)


@pytest.mark.skipif(not HAS_CUDA, reason="GPU-only failures: replayed on CUDA")
@pytest.mark.parametrize("seed", GPU_ILLEGAL_ADDRESS_SEEDS)
def test_gpu_fuzz_illegal_address_regressions(seed):
    import subprocess
    import sys

    script = fz.__file__
    r = subprocess.run([sys.executable, script, "--seed", str(seed), "--pool", "140"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]


def test_generator_covers_every_op_and_the_edge_shapes():
    """The 210 CI seeds reach every op and dtype, T=1, T past one chunk, length-1 packed
    sequences, odd head dims, 256-wide heads, initial states and refused head dims."""
    cases = [fz.gen_case(s) for s in range(210)]
    assert {c["op"] for c in cases} == set(fz.OPS)
    assert {c["dtype"] for c in cases} == set(fz.DTYPES)
    assert any(c["T"] == 1 for c in cases) and any(c["T"] > 64 for c in cases)
    assert any(c["lens"] and 1 in c["lens"] for c in cases)
    dims = {c[k] for c in cases for k in ("F", "D", "K", "V", "Dv") if k in c}
    assert {17, 31, 33, 256} <= dims
    assert any(c["h0"] for c in cases if c["op"] == "chunk") and any(not c["h0"] for c in cases if c["op"] == "chunk")
    assert {c["op"] for c in cases if c["reject"]} == {"chunk", "gdn_chunk"}
    assert fz.gen_case(1234) == fz.gen_case(1234)  # replayable


def test_a_failure_names_its_seed_and_the_replay_command(monkeypatch):
    """check_case fails, with the replay command, when an fp32 output is off by 1%."""
    monkeypatch.setattr(fz, "run_case", lambda c, device: {"o": 1e-2, "S": 0.0})
    c = next(c for c in (fz.gen_case(s) for s in range(50)) if c["op"] == "recurrent" and c["dtype"] == "fp32")
    with pytest.raises(AssertionError, match=f"LINEARIZE_FUZZ_SEED={c['seed']}"):
        fz.check_case(c, "cpu")


@needs_triton
def test_script_runs_cases_and_writes_the_worst_errors(tmp_path, capsys):
    out = tmp_path / "fuzz.md"
    assert fz.main(["--cases", "3", "--start", "7", "--out", str(out)]) == 0
    md = out.read_text()
    assert "3 random cases" in md and "0 failure(s)" in md
    assert "The 3 seeds run" in md and "\n7 8 9\n" in md  # which cases a time-cut run drew
    rows = [line for line in md.splitlines() if line.startswith("| chunk |")]
    assert rows and all(float(line.split("|")[4]) < 1e-3 for line in rows)  # seed 7: an fp16 chunk case


@needs_triton
def test_a_run_continues_over_several_calls(tmp_path, monkeypatch):
    # 2,000 GPU cases take more than one 10-minute call: --resume skips the recorded seeds and the
    # table (and its JSON) covers every call
    out = tmp_path / "fuzz.md"
    assert fz.main(["--cases", "2", "--start", "7", "--out", str(out)]) == 0
    first = json.loads(out.with_suffix(".json").read_text())
    assert first["ran"] == [7, 8]
    ran = []
    real = fz.one_case
    monkeypatch.setattr(fz, "one_case", lambda seed, *a, **k: ran.append(seed) or real(seed, *a, **k))
    assert fz.main(["--cases", "4", "--start", "7", "--out", str(out), "--resume", str(out.with_suffix(".json"))]) == 0
    assert ran == [9, 10]  # the first call's seeds are not run again
    both = json.loads(out.with_suffix(".json").read_text())
    assert both["ran"] == [7, 8, 9, 10] and sum(both["counts"].values()) == 4
    md = out.read_text()
    assert "4 random cases" in md and "\n7 8 9 10\n" in md
    worst = {tuple(w[:3]): w[3] for w in both["worst"]}
    for w in first["worst"]:  # the merged worst error is never below the first call's
        assert worst[tuple(w[:3])] >= w[3]
    with pytest.raises(SystemExit, match="same --pool"):
        fz.main(["--cases", "4", "--out", str(out), "--resume", str(out.with_suffix(".json")), "--pool", "14"])


def test_pool_shares_compiled_variants_not_shapes():
    # --pool on the GPU: cases seed and seed + pool compile the same kernels (dtype, head dims,
    # flags) but draw their own shapes, so 2,000 cases need few compilations and still vary
    a, b = fz.gen_case(3, tiny=False, pool=14), fz.gen_case(3 + 14 * 5, tiny=False, pool=14)
    keys = ("op", "dtype", "gate", "h0", "F", "D", "normalize")
    assert {k: a.get(k) for k in keys} == {k: b.get(k) for k in keys}
    shapes = {(fz.gen_case(3 + 14 * i, tiny=False, pool=14)["T"], fz.gen_case(3 + 14 * i, tiny=False, pool=14)["B"])
              for i in range(10)}
    assert len(shapes) > 3
    # without a pool the draws are the historical ones: every seed its own variant
    assert fz.gen_case(3, tiny=False) != fz.gen_case(3, tiny=False, pool=14)


def test_sigterm_still_writes_the_cases_run_so_far(tmp_path, monkeypatch):
    """`timeout` stops a GPU fuzz with SIGTERM: the table of the cases run so far is still written
    (an H200 run of 7 minutes lost its table that way)."""
    import signal

    calls = []

    def fake_case(seed, device, tiny, pool=0, log=print):
        calls.append(seed)
        if len(calls) == 4:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives during the fourth case
        return seed, "recurrent", "fp32", {"o": 1e-7 * seed}, None

    monkeypatch.setattr(fz, "one_case", fake_case)
    before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "fuzz.md"
    try:
        fz.main(["--cases", "50", "--out", str(out), "--pool", "0"])
        restored = signal.getsignal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert restored is before  # the caller's handler is back: a later SIGTERM is not a KeyboardInterrupt
    assert len(calls) == 4
    md = out.read_text()
    assert "3 random cases" in md and "| recurrent | fp32 | o | 2.00e-07 | 2 |" in md


@pytest.mark.parametrize("workers", [7, 14, 16])
@pytest.mark.parametrize("pool", [0, 140])
def test_parallel_workers_each_get_every_op(workers, pool):
    """Dealt in order, 14 workers each got one op (seed % 7): the chunk op's two workers compiled all
    its variants while the rest idled on recurrent cases (976 of 2,000 cases in the first GPU run)."""
    shares = fz.split_seeds(range(2000), workers, pool)
    assert sorted(s for share in shares for s in share) == list(range(2000))
    for share in shares:
        ops = {fz.gen_case(s, tiny=False, pool=140)["op"] for s in share}
        assert ops == set(fz.OPS), (workers, ops)


@pytest.mark.parametrize("workers", [12, 16])
def test_each_compiled_variant_is_dealt_to_one_worker(workers):
    """Dealt seed by seed, every worker compiled nearly every one of the 140 variants (170 cases in
    514 s on an H200); dealt by variant, each is compiled once, and a worker meets all of its variants
    in its first cases (a run cut by its budget has compiled what it was dealt)."""
    shares = fz.split_seeds(range(2000), workers, 140)
    owners = {}
    for w, share in enumerate(shares):
        for s in share:
            assert owners.setdefault(s % 140, w) == w, f"variant {s % 140} in workers {owners[s % 140]} and {w}"
        mine = {s % 140 for s in share}
        assert {s % 140 for s in share[:len(mine)]} == mine
    assert max(map(len, shares)) - min(map(len, shares)) <= 2 * (2000 // 140 + 1)


def test_a_sticky_cuda_error_hands_the_remaining_seeds_to_a_new_worker(monkeypatch):
    """An illegal address poisons a process's CUDA context: in the first 2,000-case H200 run, every
    worker's cases after its first such error failed with it too (984 of 988 failures). The worker
    stops and hands its remaining seeds back, and the parent starts a fresh process for them."""
    import queue

    def fake_case(seed, device, tiny, pool=0, log=print):
        if seed == 12:
            return seed, "gdn_chunk", "bf16", None, (seed, "case", "AcceleratorError: CUDA error: an illegal memory access was encountered")
        return seed, "recurrent", "fp32", {"o": 0.0}, None

    monkeypatch.setattr(fz, "one_case", fake_case)
    q = queue.Queue()
    fz._worker([10, 11, 12, 13, 14], "cuda", False, math.inf, 0, q)
    items = [q.get_nowait() for _ in range(q.qsize())]
    assert [i[0] for i in items[:3]] == [10, 11, 12] and items[3] == ("restart", [13, 14], None) and len(items) == 4
    assert not fz.sticky("RuntimeError: CUDA error: out of memory")  # the allocator recovers from that
    assert not fz.sticky("AssertionError: relative RMS errors over tolerance: o 1.2 > 0.05")


def test_workers_spread_over_gpus_and_a_restarted_one_stays_on_its_gpu(monkeypatch):
    """--gpus 2: worker i sees GPU i % 2 only (set before it touches CUDA), within the parent's own
    CUDA_VISIBLE_DEVICES, and a worker restarted after a sticky error goes back to the same GPU."""
    import queue

    assert [fz.gpu_for(i, 2, None) for i in range(4)] == ["0", "1", "0", "1"]
    assert [fz.gpu_for(i, 2, "3, 5") for i in range(3)] == ["3", "5", "3"]
    assert fz.gpu_for(7, 1, "2") is None  # one GPU: the environment is left as it is
    with pytest.raises(SystemExit, match="names only 1 GPU"):
        fz.gpu_for(0, 2, "4")
    seen = []

    def fake_case(seed, device, tiny, pool=0, log=print):
        seen.append(os.environ["CUDA_VISIBLE_DEVICES"])
        failure = (seed, "case", "AcceleratorError: CUDA error: an illegal memory access was encountered")
        return seed, "recurrent", "fp32", None if seed == 21 else {"o": 0.0}, failure if seed == 21 else None

    monkeypatch.setattr(fz, "one_case", fake_case)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    q = queue.Queue()
    fz._worker([20, 21, 22], "cuda", False, math.inf, 0, q, gpu="1")
    assert seen == ["1", "1"] and q.get_nowait()[0] == 20 and q.get_nowait()[0] == 21
    assert q.get_nowait() == ("restart", [22], "1")


def test_gdn_state_kernels_offer_one_stage_configs_only_where_two_do_not_fit():
    """The 1-stage configs are for fp32 at K > 128 only: offered to every shape, the H200 tuner chose
    them and the GDN forward gave illegal addresses and wrong bf16 outputs at small head dims."""
    import triton

    from linearize.kernels.gated_delta import chunk as gc

    configs = [triton.Config({"BV": 32}, num_warps=4, num_stages=2), triton.Config({"BV": 16}, num_warps=4, num_stages=1)]
    prune = gc._PRUNE["early_config_prune"]
    small = prune(configs, {"k": torch.empty(1, dtype=torch.bfloat16), "K": 32})
    assert [c.num_stages for c in small] == [2]
    assert [c.num_stages for c in prune(configs, {"k": torch.empty(1, dtype=torch.float32), "K": 64})] == [2]
    assert [c.num_stages for c in prune(configs, {"k": torch.empty(1, dtype=torch.float32), "K": 256})] == [2, 1]
    for kernel in (gc._fwd_h_kernel, gc._bwd_dhu_kernel, gc._bwd_dqkwg_kernel):
        assert kernel.early_config_prune is prune
    assert all(c.num_stages > 1 for c in gc._fwd_o_kernel.configs)


def test_a_failure_names_the_launch_it_came_from():
    """On the GPU an illegal address surfaces at the failing launch (CUDA_LAUNCH_BLOCKING=1): the
    failure line names the package frame it was raised in, so the table tells which kernel to look at."""
    from linearize.kernels.linear_attn import window

    x = torch.zeros(4, 1, 16)
    with pytest.raises(ValueError) as info:
        window.window_fwd(x, x, x.double(), None, None, None, None, torch.tensor([0, 4]), 4, 2, 1.0)
    assert fz.where(info.value).startswith(" (at kernels/linear_attn/window.py:") and "in _geometry)" in fz.where(info.value)
    assert fz.where(ValueError("no traceback")) == ""


def test_gdn_small_head_dims_multiply_16_bit_operands_as_tf32(monkeypatch):
    """The H200 got the GDN backward wrong with native 16-bit products at small head dims (fp16
    K = 16..31; bf16 K = 17, V = 24): those run as tf32 products of float32 copies, the converted
    models' bf16 heads (64 and up) keep native products, fp32 keeps true fp32 products."""
    from linearize.kernels.gated_delta import chunk as gc

    assert gc._prec(torch.float32, 17, 24) == "ieee"
    assert gc._prec(torch.float16, 128, 128) == "upcast"
    assert gc._prec(torch.bfloat16, 17, 24) == "upcast" and gc._prec(torch.bfloat16, 64, 32) == "upcast"
    assert gc._prec(torch.bfloat16, 64, 64) == "tf32" and gc._prec(torch.bfloat16, 128, 256) == "tf32"
    monkeypatch.setattr(gc, "_NATIVE_DOTS", True)
    assert gc._prec(torch.bfloat16, 17, 24) == "tf32" and gc._prec(torch.float16, 17, 24) == "tf32"


@needs_triton
def test_guarded_allocations_catch_a_store_past_the_end():
    """GuardedAllocations under the interpreter: a kernel whose store runs past its output is caught
    (the byte count named), a masked one is not, and the ops' own outputs are allocated guarded."""
    import triton
    import triton.language as tl

    @triton.jit
    def fill(x, n, MASKED: tl.constexpr, B: tl.constexpr):
        o = tl.arange(0, B)
        if MASKED:
            tl.store(x + o, o.to(tl.float32), mask=o < n)
        else:
            tl.store(x + o, o.to(tl.float32))

    for masked in (True, False):
        with fz.GuardedAllocations() as g:
            out = torch.empty(20)
            fill[(1,)](out, 20, MASKED=masked, B=32)
        assert out[19] == 19
        if masked:
            g.check()
        else:
            with pytest.raises(AssertionError, match=r"out-of-bounds write: a \(20,\) float32 tensor .* 48 bytes past its end"):
                g.check()
    c = next(c for c in (fz.gen_case(s) for s in range(20)) if c["op"] == "window")
    with fz.GuardedAllocations() as g:
        fz.run_case(c, "cpu")
    g.check()
    assert len(g.buffers) > 10  # the kernels' outputs and scratch came from the guarded allocator


def test_resume_with_retry_failed_runs_the_failed_seeds_again(tmp_path, monkeypatch):
    """--resume skips the recorded seeds; --retry-failed (after a fix) takes the failed ones out of
    the record first, so they run again and the table counts each case once."""
    calls = []

    def fake_case(seed, device, tiny, pool=0, log=print):
        calls.append(seed)
        op = fz.gen_case(seed, tiny=tiny, pool=pool)["op"]
        return seed, op, "fp32", {"o": 1e-7}, None

    monkeypatch.setattr(fz, "one_case", fake_case)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    first = fz.gen_case(2, tiny=True)["op"]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"  # what main() records
    record = {"device": device, "pool": 0, "seconds": 5.0, "worst": [], "counts": {first: 2, "other": 1},
              "failures": [[2, "seed_2", "AssertionError: over tolerance"], [-1, "worker 3", "exit code 1"]],
              "ran": [0, 1, 2]}
    dropped = fz.drop_failures(record, tiny=True)
    assert dropped["ran"] == [0, 1] and dropped["failures"] == [] and dropped["counts"][first] == 1
    path = tmp_path / "rec.json"
    path.write_text(json.dumps(record))
    out = tmp_path / "t.md"
    pool = ["--pool", "0"]
    rc = fz.main(["--cases", "4", "--resume", str(path), "--retry-failed", "--out", str(out), *pool])
    saved = json.loads(out.with_suffix(".json").read_text())
    assert rc == 0 and sorted(calls) == [2, 3] and saved["ran"] == [0, 1, 2, 3] and saved["failures"] == []
    assert sum(saved["counts"].values()) == 4
    calls.clear()
    fz.main(["--cases", "4", "--resume", str(path), "--out", str(out), *pool])  # without the flag: 2 stays failed
    assert sorted(calls) == [3]
