"""Random cases for every Triton kernel against the float64 references (scripts/fuzz_kernels_gpu.py
holds the generator, the runner and the tolerances; on a GPU it runs 2,000 larger cases).

CI runs this under TRITON_INTERPRET=1 with tiny shapes: 30 cases per op of the default generator
version (13 ops in version 2: the 7 of version 1 and the inference-only ops hedgehog_features,
window_decode, window_decode_hedgehog, gdn_decode, gdn_prologue, gdn_epilogue; version 3: version 2's
cases, the three window ops' with attention sinks; version 4, the default: version 3's and
chunk_channel, the per-channel decay chunk kernel, whose cases take seconds each here, so CI runs a
few chosen seeds of it (CHUNK_CHANNEL_SEEDS) instead of 30; the Hedgehog decode ops with per-channel
gates).  Every case id starts with its seed:

    TRITON_INTERPRET=1 python -m pytest -q tests/test_kernels_fuzz.py -k seed_17-      # one of the CI cases
    LINEARIZE_FUZZ_SEED=1234,99 TRITON_INTERPRET=1 python -m pytest -q tests/test_kernels_fuzz.py  # any seeds
    LINEARIZE_FUZZ_CASES=1000 TRITON_INTERPRET=1 python -m pytest -q tests/test_kernels_fuzz.py    # more cases
    LINEARIZE_FUZZ_GENERATOR=1 LINEARIZE_FUZZ_SEED=99 TRITON_INTERPRET=1 python -m pytest -q tests/test_kernels_fuzz.py
                                                                        # a seed of generator version 1

A failure names the case, the errors over tolerance and the replay command.  Generator versions
never change their cases (tests below pin every version's): the GPU records replay as run.
"""

from __future__ import annotations

import importlib
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

GENERATOR = int(os.environ.get("LINEARIZE_FUZZ_GENERATOR", fz.GENERATOR))
CI_CASES_PER_OP = 30
# Ops CI's sweep leaves out: chunk_channel's cases (forward and backward, a dozen launches) take
# seconds each under the interpreter, so CI runs its chosen seeds (test_chunk_channel_case) instead.
CI_SWEEP_SKIPS = () if HAS_CUDA else ("chunk_channel",)
if os.environ.get("LINEARIZE_FUZZ_SEED"):
    SEEDS = [int(s) for s in os.environ["LINEARIZE_FUZZ_SEED"].split(",")]
elif os.environ.get("LINEARIZE_FUZZ_CASES"):
    SEEDS = list(range(int(os.environ["LINEARIZE_FUZZ_CASES"])))
else:
    _ops = fz.ops_of(GENERATOR)
    SEEDS = [s for s in range(CI_CASES_PER_OP * len(_ops)) if _ops[s % len(_ops)] not in CI_SWEEP_SKIPS]
CASES = [fz.gen_case(s, tiny=not HAS_CUDA, generator=GENERATOR) for s in SEEDS]
# Known failures among the CI's tiny cases, (generator, seed): reason. Strict: the fix makes the case
# pass and the xfail fail, and its entry goes.
KNOWN_TINY_FAILURES: dict[tuple[int, int], str] = {}


def _param(c):
    reason = None if HAS_CUDA else KNOWN_TINY_FAILURES.get((c.get("generator", 1), c["seed"]))
    marks = [pytest.mark.xfail(strict=True, raises=AssertionError, reason=reason)] if reason else []
    return pytest.param(c, marks=marks, id=fz.case_id(c) + "-")


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
@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_kernel_fuzz_case(case, bf16_dots):
    # on the CPU every tensor the case allocates is fenced: a store out of bounds fails the case too
    fz.check_case(case, DEVICE, guard=True)


# Version 4's chunk_channel in CI: seeds picked for their second or so each under the interpreter and
# what they cover: fp16 packed documents (a reset at each start) with an initial state and strong
# decays; fp32 unnormalized documents; bf16 with length-1 documents and an initial state (unnormalized:
# dz0 reaches nothing); a refused head dim.
CHUNK_CHANNEL_SEEDS = (2309, 937, 83, 2015)


@needs_triton
@pytest.mark.parametrize("seed", CHUNK_CHANNEL_SEEDS)
def test_chunk_channel_case(seed, bf16_dots):
    c = fz.gen_case(seed, generator=4)
    assert c["op"] == "chunk_channel"
    fz.check_case(c, DEVICE, guard=True)


def test_chunk_channel_seeds_cover_its_flags():
    cases = [fz.gen_case(s, generator=4) for s in CHUNK_CHANNEL_SEEDS]
    run = [c for c in cases if not c["reject"]]
    assert {c["dtype"] for c in run} == set(fz.DTYPES) and len(run) < len(cases)
    assert all(len(c["lens"]) > 1 for c in run) and any(1 in c["lens"] for c in run)
    assert {c["normalize"] for c in run} == {True, False} and any(c["decay"] for c in run)
    assert any(c["h0"] and c["normalize"] for c in run) and any(c["h0"] and not c["normalize"] for c in run)


@needs_triton
@pytest.mark.parametrize("seed", [2309, 18, 79], ids=["chunk_channel", "hedgehog", "window_decode_hedgehog"])
def test_per_channel_gates_are_checked_channel_by_channel(seed, monkeypatch, bf16_dots):
    """Version 4's per-channel gate cases fail against a reference that decays by each head's mean
    gate instead of each channel's own (what a kernel reading the gate per head would compute)."""
    from linearize.kernels import linear_attn as la

    wd = importlib.import_module("linearize.kernels.linear_attn.window_decode")
    c = fz.gen_case(seed, generator=4)  # (each passes in CI: CHUNK_CHANNEL_SEEDS, the sweep)
    assert c["gate"] == (True if c["op"] == "chunk_channel" else "channel")  # (chunk_channel's: a mild decay)
    mean = lambda g: None if g is None else g.mean(-1, keepdim=True).expand_as(g)  # noqa: E731
    chunk_ref, hh_ref, win_ref = la.linear_attn_channel_ref, la.hedgehog_recurrent_ref, wd.window_decode_hedgehog_ref
    monkeypatch.setattr(la, "linear_attn_channel_ref", lambda q, k, v, log_g, **kw: chunk_ref(q, k, v, mean(log_g), **kw))
    monkeypatch.setattr(la, "hedgehog_recurrent_ref", lambda *a, log_g=None, **kw: hh_ref(*a, log_g=mean(log_g), **kw))
    monkeypatch.setattr(wd, "window_decode_hedgehog_ref", lambda *a, log_g=None, **kw: win_ref(*a, log_g=mean(log_g), **kw))
    with pytest.raises(AssertionError, match=r"over tolerance: (.*, )?(o|S) \d"):  # not a copy's error alone
        fz.check_case(c, DEVICE)


# GPU fuzz failures (2026-11-24, H200) that the interpreter replays at full size: chunk bf16 T=1
# F=D=256 (1603: the first gate's gradient, exactly 0, came out as the rounding of the sequence's
# whole sum); window fp16 (1856: dgamma's 428 per-token terms cancel to 9e-5, judged against a floor
# that did not grow with the count).
CPU_REPLAYED_GPU_SEEDS = (1603, 1856)


@needs_triton
@pytest.mark.parametrize("seed", CPU_REPLAYED_GPU_SEEDS)
def test_gpu_failures_replayed_at_full_size(seed, bf16_dots):
    fz.check_case(fz.gen_case(seed, tiny=False, pool=140, generator=1), DEVICE)


# The 2026-11-25 H200 run of version 2 (--pool 260): gdn_chunk fp32 with log gates down to -30
# (1253: dg's sum cancels to 1e-7 from terms of 14; the kernel's was their float rounding).
@needs_triton
def test_gpu_failure_of_version_2_replayed_at_full_size(bf16_dots):
    fz.check_case(fz.gen_case(1253, tiny=False, pool=260, generator=2), DEVICE)


def test_a_gate_gradient_is_judged_by_the_size_of_its_terms():
    """dg_t sums (q_s . dq_s - k_s . dk_s) over s >= t of its sequence: a value that cancels to
    nothing is judged against the terms' size, a few roundings of it; an error of a thousandth of
    the terms (a wrong or missing term) still fails, and so does any error without gradients of q, k."""
    g = torch.Generator().manual_seed(0)
    q, k, dq, dk = (torch.randn(1, 6, 2, 16, generator=g, dtype=torch.float64) for _ in range(4))
    lens = [4, 2]
    scale = fz.gate_term_scale(q, k, dq, dk, lens)
    terms = (q.abs() * dq.abs()).sum(-1) + (k.abs() * dk.abs()).sum(-1)
    assert torch.allclose(scale[:, 3], terms[:, 3]) and torch.allclose(scale[:, 4], terms[:, 4] + terms[:, 5])
    assert torch.allclose(scale[:, 0], terms[:, :4].sum(1))  # the first sequence stops at its end
    c = {"op": "gdn_chunk", "dtype": "fp32", "lens": lens, "decay": 0.0}
    want = torch.full((1, 6, 2), 1e-9, dtype=torch.float64)
    ulp = want + 2.0**-24 * scale  # one rounding of the terms' size
    wrong = want + 1e-3 * scale
    pairs = lambda got: {"dg": (got, want), "dq": (dq, dq), "dk": (dk, dk)}  # noqa: E731
    leaves = {"q": q, "k": k}
    tol = fz.tolerance(c, "dg")
    assert fz._errors(pairs(ulp))["dg"] > tol  # judged by its value: fails
    assert fz._errors(pairs(ulp), norm_floors=fz._gate_floors(c, pairs(ulp), leaves))["dg"] <= tol
    assert fz._errors(pairs(wrong), norm_floors=fz._gate_floors(c, pairs(wrong), leaves))["dg"] > tol
    assert fz._gate_floors(c, {"dg": (ulp, want)}, leaves) == {}


# Version-1 interpreter seeds (a sweep of 1,000 window seeds, 2026-11-25): bf16 window dgamma whose
# per-token terms cancel 240-650x to less than their bf16 rounding; judged by the terms' size.
@needs_triton
@pytest.mark.parametrize("seed", (2122, 2654, 5825))
def test_window_weight_gradient_judged_by_its_terms(seed, bf16_dots):
    fz.check_case(fz.gen_case(seed, tiny=True, generator=1), DEVICE)


def test_window_weight_terms_sum_to_its_gradient():
    """The per-token terms the window weight's floor is sized by are the terms of its gradient: their
    sum is the float64 reference's dgamma for the cotangent _grads draws."""
    from linearize.kernels import linear_attn as la

    g = torch.Generator().manual_seed(3)
    B, T, H, F, D, Dsm = 2, 9, 2, 8, 5, 4
    leaves = dict(q=torch.rand(B, T, H, F, generator=g), k=torch.rand(B, T, H, F, generator=g),
                  v=torch.randn(B, T, H, D, generator=g), log_g=-torch.rand(B, T, H, generator=g) * 0.3,
                  S0=None, z0=None, q_sm=torch.randn(B, T, H, Dsm, generator=g),
                  k_sm=torch.randn(B, T, H, Dsm, generator=g), gamma=torch.tensor([0.7, 1.6]))

    def ref(q, k, v, log_g, S0, z0, q_sm, k_sm, gamma):
        o, _ = la.linear_attn_ref(q, k, v, log_g=log_g, window=3, q_sm=q_sm, k_sm=k_sm, sm_scale=0.35,
                                  window_weight=gamma, output_final_state=True)
        return {"o": o}

    terms = fz.window_weight_terms(ref, leaves, "cpu")
    assert terms.shape == (B, T, H)
    xs = {n: None if x is None else x.double().requires_grad_(n == "gamma") for n, x in leaves.items()}
    (dgamma,) = fz._grads([ref(**xs)["o"]], [xs["gamma"]], torch.Generator().manual_seed(1))
    torch.testing.assert_close(terms.sum((0, 1)), dgamma)
    assert terms.abs().sum((0, 1)).gt(dgamma.abs()).all()  # they partly cancel


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


# Seeds the GPU fuzz (--pool 140, full size, generator version 1) failed on an H200 and that were fixed after: chunk dv in
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
    fz.check_case(fz.gen_case(seed, tiny=False, pool=140, generator=1), DEVICE)


@pytest.mark.skipif(not HAS_CUDA, reason="GPU-only failures: replayed on CUDA")
@pytest.mark.parametrize("seed", GPU_ILLEGAL_ADDRESS_SEEDS)
def test_gpu_fuzz_illegal_address_regressions(seed):
    import subprocess
    import sys

    script = fz.__file__
    r = subprocess.run([sys.executable, script, "--seed", str(seed), "--pool", "140", "--generator", "1"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]


def test_generator_covers_every_op_and_the_edge_shapes():
    """Version 1's 210 first seeds (its CI cases until version 2) reach every op and dtype, T=1, T past
    one chunk, length-1 packed sequences, odd head dims, 256-wide heads, initial states and refused
    head dims."""
    cases = [fz.gen_case(s, generator=1) for s in range(210)]
    assert {c["op"] for c in cases} == set(fz.OPS_V1)
    assert {c["dtype"] for c in cases} == set(fz.DTYPES)
    assert any(c["T"] == 1 for c in cases) and any(c["T"] > 64 for c in cases)
    assert any(c["lens"] and 1 in c["lens"] for c in cases)
    dims = {c[k] for c in cases for k in ("F", "D", "K", "V", "Dv") if k in c}
    assert {17, 31, 33, 256} <= dims
    assert any(c["h0"] for c in cases if c["op"] == "chunk") and any(not c["h0"] for c in cases if c["op"] == "chunk")
    assert {c["op"] for c in cases if c["reject"]} == {"chunk", "gdn_chunk"}
    assert fz.gen_case(1234) == fz.gen_case(1234)  # replayable


def test_ci_cases_cover_every_op_of_the_default_version_and_their_flags():
    """The CI's cases (30 per op of the default version, chunk_channel's on seeds of their own)
    reach every op, and the inference-only ops their flags: gate kinds (per channel in both Hedgehog
    decode ops), padding, softcap, W = 1 and rings, RoPE full / partial / none, GQA,
    T = 1 and several decode steps, conv with and without a cache, both GDN state layouts and the
    three projection layouts, strided inputs, an output dtype other than the input's, odd head dims."""
    assert fz.OPS == fz.ops_of(fz.GENERATOR) and fz.GENERATOR == max(fz.OPS_BY_VERSION)
    assert fz.OPS[:len(fz.OPS_V1)] == fz.OPS_V1  # a new version appends ops
    n = CI_CASES_PER_OP * len(fz.OPS)
    cases = [fz.gen_case(s) for s in range(n)]
    if GENERATOR == fz.GENERATOR and not (os.environ.get("LINEARIZE_FUZZ_SEED") or os.environ.get("LINEARIZE_FUZZ_CASES")):
        # the ones parametrized above
        assert [c["seed"] for c in CASES] == [c["seed"] for c in cases if c["op"] not in CI_SWEEP_SKIPS]
    ops = [c["op"] for c in cases]
    assert set(ops) == set(fz.OPS) and all(ops.count(op) == CI_CASES_PER_OP for op in fz.OPS)
    assert all(c["generator"] == fz.GENERATOR for c in cases)
    assert {c["dtype"] for c in cases} == set(fz.DTYPES)
    by = {op: [c for c in cases if c["op"] == op] for op in fz.OPS}
    for op in ("hedgehog_features", "window_decode", "window_decode_hedgehog", "gdn_decode", "gdn_prologue",
               "gdn_epilogue"):
        assert {c["dtype"] for c in by[op]} == set(fz.DTYPES), op
        assert any(c["B"] == 2 for c in by[op]), op
        assert any(c["D"] % 2 for c in by[op]), op  # odd head dims
    for op in ("hedgehog_features", "window_decode_hedgehog", "gdn_decode", "gdn_prologue"):
        assert any(c["H"] > c["Hkv"] for c in by[op]) and any(c["H"] == c["Hkv"] for c in by[op]), op
        assert any(c["H"] == 3 * c["Hkv"] for c in by[op]), op
    for op in ("window_decode", "window_decode_hedgehog", "gdn_decode"):
        Ts = {c["T"] for c in by[op] if not c["reject"]}
        assert 1 in Ts and max(Ts) > 1 and any(c["valid"] for c in by[op]) and not all(c["valid"] for c in by[op]), op
    for op in ("window_decode", "window_decode_hedgehog"):
        assert 1 in {c["W"] for c in by[op]} and max(c["W"] for c in by[op]) > 9, op
        assert any(c["softcap"] for c in by[op]) and not all(c["softcap"] for c in by[op]), op
    assert {c["gate"] for c in by["window_decode"]} == {False, "scalar", "channel"}
    assert {c["gate"] for c in by["window_decode_hedgehog"]} == {False, "scalar", "channel"}
    assert {c["gate"] for c in by["hedgehog"]} == {False, True, "channel"}
    assert {c["fdtype"] for c in by["window_decode"]} > {"fp32"}
    for op in ("window_decode_hedgehog", "gdn_decode", "gdn_prologue"):
        rot = [(c["R"], c["D"]) for c in by[op]]
        assert any(R == 0 for R, D in rot) and any(0 < R < D - 1 for R, D in rot) and any(R >= D - 1 for R, D in rot), op
    for op in ("gdn_decode", "gdn_prologue"):
        assert {c["layout"] for c in by[op]} == {"separate", "concat", "per_head"}, op
        assert 0 in {c["conv"] for c in by[op]} and len({c["conv"] for c in by[op]}) > 2, op
    assert {c["kv"] for c in by["gdn_decode"]} == {"expand", "group"}
    assert any(c["cache"] for c in by["gdn_prologue"]) and any(c["conv"] and not c["cache"] for c in by["gdn_prologue"])
    for op in ("hedgehog_features", "window_decode_hedgehog", "gdn_decode", "gdn_prologue"):
        assert any(c["strided"] for c in by[op]) and not all(c["strided"] for c in by[op]), op
    for op in ("hedgehog_features", "gdn_prologue", "gdn_epilogue"):
        assert any(c["out"] != c["dtype"] for c in by[op]), op
        assert max(c["T"] for c in by[op]) > 64, op  # more than one block of tokens
    assert any(c["P"] % 2 for c in by["hedgehog_features"])
    # refused head dims of the new ops (the feature kernel above 256, the fused GDN decode above 128,
    # the per-channel chunk kernel outside [16, 256])
    more = [fz.gen_case(s) for s in range(2000)]
    assert {c["op"] for c in more if c["reject"]} == {"chunk", "gdn_chunk", "hedgehog_features", "gdn_decode",
                                                      "chunk_channel"}


# Version 1 as it was before version 2 (captured from the generator at commit 61625f4): whole dicts of a
# few seeds, their case ids, and digests of 2,000 seeds' dicts (tiny, and GPU-size with and without a pool).
V1_TINY = [
    {'seed': 0, 'op': 'chunk', 'dtype': 'bf16', 'B': 2, 'H': 1, 'gate': True, 'h0': False, 'lens': None, 'reject': None,
     'pool': 0, 'T': 40, 'F': 24, 'D': 31, 'normalize': True},
    {'seed': 1, 'op': 'window', 'dtype': 'fp32', 'B': 1, 'H': 2, 'gate': True, 'h0': False, 'lens': None,
     'reject': None, 'pool': 0, 'T': 50, 'F': 16, 'D': 33, 'normalize': True, 'W': 1, 'Dsm': 24},
    {'seed': 2, 'op': 'split', 'dtype': 'fp32', 'B': 1, 'H': 1, 'gate': True, 'h0': True, 'lens': None, 'reject': None,
     'pool': 0, 'T': 165, 'F': 24, 'D': 20, 'normalize': False, 'num_splits': 4},
    {'seed': 3, 'op': 'recurrent', 'dtype': 'fp32', 'B': 1, 'H': 2, 'gate': False, 'h0': True, 'lens': None,
     'reject': None, 'pool': 0, 'T': 1, 'F': 128, 'D': 24, 'normalize': True},
    {'seed': 4, 'op': 'hedgehog', 'dtype': 'fp32', 'B': 2, 'H': 1, 'gate': False, 'h0': True, 'lens': None,
     'reject': None, 'pool': 0, 'T': 1, 'D': 64, 'Dv': 16, 'P': 12, 'Hkv': 1, 'valid': True},
    {'seed': 5, 'op': 'gdn_chunk', 'dtype': 'fp16', 'B': 1, 'H': 1, 'gate': False, 'h0': False, 'lens': None,
     'reject': 15, 'pool': 0, 'T': 3, 'K': 40, 'V': 33, 'l2norm': False, 'decay': 0.0},
    {'seed': 6, 'op': 'gdn_recurrent', 'dtype': 'fp32', 'B': 2, 'H': 2, 'gate': True, 'h0': True, 'lens': None,
     'reject': None, 'pool': 0, 'T': 1, 'K': 24, 'V': 33, 'l2norm': False, 'decay': 0.0},
]
V1_TINY_IDS = ['seed_0-chunk-bf16-B2-T40-H1-F24-D31-gate', 'seed_1-window-fp32-B1-T50-H2-F16-D33-Dsm24-W1-gate',
               'seed_2-split-fp32-B1-T165-H1-F24-D20-gate-h0-unnorm', 'seed_3-recurrent-fp32-B1-T1-H2-F128-D24-h0',
               'seed_4-hedgehog-fp32-B2-T1-H1-D64-Dv16-P12-h0', 'seed_5-gdn_chunk-fp16-B1-T3-H1-K40-V33-reject15',
               'seed_6-gdn_recurrent-fp32-B2-T1-H2-K24-V33-gate-h0']
V1_GPU_POOL140 = {  # GPU seeds the docs and the regression tests name
    5: {'seed': 5, 'op': 'gdn_chunk', 'dtype': 'fp16', 'B': 1, 'H': 3, 'gate': False, 'h0': False,
        'lens': [256, 161, 1, 253], 'reject': None, 'pool': 140, 'T': 671, 'K': 48, 'V': 128, 'l2norm': False,
        'decay': 30.0},
    12: {'seed': 12, 'op': 'gdn_chunk', 'dtype': 'bf16', 'B': 1, 'H': 3, 'gate': True, 'h0': False, 'lens': [495],
         'reject': None, 'pool': 140, 'T': 495, 'K': 128, 'V': 100, 'l2norm': False, 'decay': 0.0},
    1603: {'seed': 1603, 'op': 'chunk', 'dtype': 'bf16', 'B': 1, 'H': 4, 'gate': True, 'h0': False, 'lens': None,
           'reject': None, 'pool': 140, 'T': 1, 'F': 256, 'D': 256, 'normalize': True},
    1856: {'seed': 1856, 'op': 'window', 'dtype': 'fp16', 'B': 2, 'H': 3, 'gate': True, 'h0': False, 'lens': None,
           'reject': None, 'pool': 140, 'T': 214, 'F': 31, 'D': 16, 'normalize': True, 'W': 110, 'Dsm': 32},
}
V1_DIGESTS = {  # sha256 over json.dumps(gen_case(s, tiny, pool), sort_keys=True) for s in range(2000)
    (True, 0): "6df7cf3df81fd92bb594858fa3364296b248a49071549046c509553e38a8bccf",
    (False, 140): "52b16c385fd00b9d22400af4388e6b737ec2164d0679f7603d34cb680db8da5f",
    (False, 0): "1e0d2105ba76584bf314414d8d54575c0b0298dbb4f2d1115a53437d36acb432",
}


def test_version_1_seeds_draw_exactly_the_cases_they_drew():
    """Old GPU records (docs/archive/kernels_fuzz_runs/*.json) name version-1 seeds: with generator=1 each seed
    gives the very dict (and id) the generator gave before version 2, for every seed of a 2,000-case run."""
    import hashlib

    assert [fz.gen_case(s, generator=1) for s in range(7)] == V1_TINY
    assert [fz.case_id(fz.gen_case(s, generator=1)) for s in range(7)] == V1_TINY_IDS
    for seed, want in V1_GPU_POOL140.items():
        assert fz.gen_case(seed, tiny=False, pool=140, generator=1) == want
    assert fz.case_id(fz.gen_case(1603, tiny=False, pool=140, generator=1)) == "seed_1603-chunk-bf16-B1-T1-H4-F256-D256-gate"
    for (tiny, pool), want in V1_DIGESTS.items():
        h = hashlib.sha256()
        for s in range(2000):
            h.update(json.dumps(fz.gen_case(s, tiny=tiny, pool=pool, generator=1), sort_keys=True).encode())
        assert h.hexdigest() == want, (tiny, pool)
    # the deal of seeds to workers and the default GPU pool of version 1 are as they were too
    assert fz.split_seeds(range(30), 4, 14, generator=1) == [[0, 9, 4, 6, 14, 23, 18, 20, 28], [7, 2, 11, 13, 21, 16, 25, 27],
                                                             [1, 3, 5, 15, 17, 19, 29], [8, 10, 12, 22, 24, 26]]
    assert fz.default_pool(False, 1) == 140 and fz.round_pool(140, 1) == 140
    # the default version draws other cases for the same seeds (more ops), and says so
    assert fz.gen_case(7)["op"] == "hedgehog_features" and fz.gen_case(7, generator=1)["op"] == "chunk"
    assert "generator" not in fz.gen_case(7, generator=1) and fz.gen_case(7)["generator"] == fz.GENERATOR
    with pytest.raises(ValueError, match="unknown generator version"):
        fz.gen_case(0, generator=99)


# Versions 2 and 3 as they were before version 4 (captured from the generator at commit aa9edfc), and
# version 4 as it came: sha256 over json.dumps(gen_case(s, tiny, pool, generator), sort_keys=True) for
# s in range(2000), tiny and GPU-size with the version's default pool (260, 280) and without one.
DIGESTS = {
    (2, True, 0): "00f1827a572dd899db758fceb09f6f7c718e50681aeb7bf077dede5b888778ee",
    (2, False, 260): "53ce14233676bddb0f509287775691978682e92d4cbd0fb3198b8d55f1b88c7e",
    (2, False, 0): "d464fbba2ab6d8c2d069d19da8c60d89d21b767e33de1068c23aad2b9465a52d",
    (3, True, 0): "d16728b926761392dc6f04c159e834ad9c47b5f10145b7690f4480fae3a27ecc",
    (3, False, 260): "b50956a43ae6fbeb4855f536ff9a0354cdffa85a7643399dfb216c66aa77d569",
    (3, False, 0): "c1826c045583cf0cdbe32234511a1fb8f17d738e29ac6609e5c5f526952204a5",
    (4, True, 0): "0fc048671b30a6a5276b81e998f6af5037c144357a02f1621d55f2a79536989c",
    (4, False, 280): "aa8f4dadd87a770898e34c589b1ef4e50f89fd109faea2b0d0538db2ca769560",
    (4, False, 0): "5391e9e889d4c2f6cd3fb5afc88832eda1e46ddf3f0a447be07a4c60785334c2",
}


@pytest.mark.parametrize("generator", [2, 3, 4])
def test_later_versions_draw_exactly_the_cases_they_drew(generator):
    """Versions 2 to 4 keep their cases as version 1 does (test above): every seed of a 2,000-case run
    gives the dict it gave when its version came."""
    import hashlib

    for (g, tiny, pool), want in DIGESTS.items():
        if g != generator:
            continue
        h = hashlib.sha256()
        for s in range(2000):
            h.update(json.dumps(fz.gen_case(s, tiny=tiny, pool=pool, generator=g), sort_keys=True).encode())
        assert h.hexdigest() == want, (g, tiny, pool)
    assert fz.default_pool(False, generator) == fz.POOL_PER_OP * len(fz.ops_of(generator))


@pytest.mark.parametrize("tiny, pool", [(True, 0), (False, 280)], ids=["tiny", "gpu-pool"])
def test_version_4_draws_version_3s_cases_but_per_channel_hedgehog_gates(tiny, pool):
    """A version-4 case of one of version 3's ops is what version 3 draws for its seed and op
    (draw_case), its gate aside: the Hedgehog decode ops' gates turn per-channel in about half of
    their gated cases, from a stream of their own (with a pool, the variant's), and nothing else does."""
    turned, gated = {}, {}
    for s in range(1400):
        c = fz.gen_case(s, tiny=tiny, pool=pool, generator=4)
        if c["op"] == "chunk_channel":
            continue
        old = fz.draw_case(s, c["op"], tiny, c["pool"], 3)
        assert {**c, "generator": 3, "gate": old["gate"]} == old, s
        if c["gate"] != old["gate"]:
            assert c["op"] in ("hedgehog", "window_decode_hedgehog") and c["gate"] == "channel", s
            turned[c["op"]] = turned.get(c["op"], 0) + 1
        if old["gate"] and c["op"] in ("hedgehog", "window_decode_hedgehog"):
            gated[c["op"]] = gated.get(c["op"], 0) + 1
    for op in ("hedgehog", "window_decode_hedgehog"):
        assert 0 < turned[op] < gated[op], op
        if not pool:  # about half (with a pool: half of a few variants)
            assert 0.3 < turned[op] / gated[op] < 0.7, (op, turned[op], gated[op])
    if pool:  # a compiled variant keeps its gate's kind: seed and seed + pool alike
        for s in range(pool):
            assert fz.gen_case(s, False, pool, 4)["gate"] == fz.gen_case(s + 3 * pool, False, pool, 4)["gate"]


def test_an_old_record_resumes_with_version_1(tmp_path, monkeypatch):
    """A record written before versions existed (no "generator" key: version 1) resumes with version 1:
    its seeds are skipped, the new ones drawn by version 1, its counts and table name version 1's ops
    only; asking for another version is refused."""
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "docs/archive/kernels_fuzz_runs/2026-11-25-0140-h100-two-calls.json"
    old = json.loads(path.read_text())
    assert "generator" not in old and not old["failures"]
    ops = [fz.gen_case(s, tiny=False, pool=old["pool"], generator=1)["op"] for s in old["ran"]]
    assert {op: ops.count(op) for op in set(ops)} == old["counts"]  # its cases were version 1's
    calls = []

    def fake_case(seed, device, tiny, pool=0, log=print, generator=fz.GENERATOR):
        calls.append((seed, generator))
        return seed, fz.gen_case(seed, tiny=tiny, pool=pool, generator=generator)["op"], "fp32", {"o": 1e-7}, None

    monkeypatch.setattr(fz, "one_case", fake_case)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"  # what main() records
    rec = tmp_path / "rec.json"
    rec.write_text(json.dumps({**old, "device": device}))
    out = tmp_path / "t.md"
    assert fz.main(["--cases", "1000", "--resume", str(rec), "--out", str(out), "--pool", "140"]) == 0
    done = set(old["ran"])
    assert [s for s, _ in calls] == [s for s in range(1000) if s not in done]
    assert {g for _, g in calls} == {1}
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["generator"] == 1 and set(saved["counts"]) == set(fz.OPS_V1)
    assert sum(saved["counts"].values()) == len(old["ran"]) + len(calls) == len(saved["ran"])
    md = out.read_text()
    assert "--generator 1" in md and "Generator version 1" in md and "gdn_decode" not in md
    with pytest.raises(SystemExit, match="recorded with --generator 1"):
        fz.main(["--cases", "10", "--resume", str(rec), "--out", str(out), "--pool", "140", "--generator", "2"])
    assert fz.resolve_generator(None, old) == 1 and fz.resolve_generator(None, None) == fz.GENERATOR
    assert fz.resolve_generator(1, None) == 1
    # --retry-failed: a failed seed's op is looked up with the record's version
    failed = {**old, "failures": [[7, "seed_7", "AssertionError"]]}
    assert fz.drop_failures(failed)["counts"]["chunk"] == old["counts"]["chunk"] - 1


def test_a_failure_names_its_seed_and_the_replay_command(monkeypatch):
    """check_case fails, with the replay command, when an fp32 output is off by 1%; a case of another
    generator version than the default names its version in the command."""
    monkeypatch.setattr(fz, "run_case", lambda c, device: {"o": 1e-2, "S": 0.0})
    c = next(c for c in (fz.gen_case(s) for s in range(50)) if c["op"] == "recurrent" and c["dtype"] == "fp32")
    with pytest.raises(AssertionError, match=f"LINEARIZE_FUZZ_SEED={c['seed']}") as info:
        fz.check_case(c, "cpu")
    assert "generator" not in str(info.value).lower()
    old = fz.gen_case(3, tiny=False, pool=140, generator=1)
    with pytest.raises(AssertionError, match="LINEARIZE_FUZZ_GENERATOR=1 LINEARIZE_FUZZ_SEED=3 .*"
                                             "--seed 3 --pool 140 --generator 1"):
        fz.check_case(old, "cpu")


def test_inference_ops_copies_must_be_exact(monkeypatch):
    """The version-2 ops' pure copies (ring slots, valid flags, conv cache) get tolerance 0, their
    outputs the inference family's; the fused Hedgehog op's ring keys are rotated (not copies) with RoPE."""
    cases = [fz.gen_case(s) for s in range(400)]
    win = next(c for c in cases if c["op"] == "window_decode" and c["dtype"] == "bf16")
    assert fz.tolerance(win, "ring_v") == 0 and fz.tolerance(win, "ring_phi_k") == 0
    assert fz.tolerance(win, "o") == fz.TOL["inference"]["bf16"][0]
    hh = next(c for c in cases if c["op"] == "window_decode_hedgehog" and c["R"])
    assert fz.tolerance(hh, "ring_k") > 0 and fz.tolerance(hh, "ring_phi_k") > 0 and fz.tolerance(hh, "ring_valid") == 0
    gdn = next(c for c in cases if c["op"] == "gdn_decode" and c["conv"])
    assert fz.tolerance(gdn, "conv") == 0 and fz.tolerance(gdn, "S") > 0
    monkeypatch.setattr(fz, "run_case", lambda c, device: {"o": 0.0, "ring_v": 1e-9})
    with pytest.raises(AssertionError, match="ring_v 1.00e-09 > 0e"):
        fz.check_case(win, "cpu")


@needs_triton
def test_script_runs_cases_and_writes_the_worst_errors(tmp_path, capsys):
    out = tmp_path / "fuzz.md"
    assert fz.main(["--cases", "3", "--start", "7", "--out", str(out), "--generator", "1"]) == 0
    md = out.read_text()
    assert "3 random cases" in md and "0 failure(s)" in md
    assert "The 3 seeds run" in md and "\n7 8 9\n" in md  # which cases a time-cut run drew
    assert "--generator 1" in md and "Generator version 1" in md
    rows = [line for line in md.splitlines() if line.startswith("| chunk |")]
    assert rows and all(float(line.split("|")[4]) < 1e-3 for line in rows)  # v1 seed 7: an fp16 chunk case
    assert json.loads(out.with_suffix(".json").read_text())["generator"] == 1


def test_ops_keeps_only_the_named_ops_seeds(tmp_path, monkeypatch):
    """--ops gdn_chunk (after a change to the GDN kernels): only the seeds whose op is named run; an
    unknown op is refused with the list to pick from."""
    ops = fz.ops_of(fz.GENERATOR)
    ran = []
    monkeypatch.setattr(fz, "one_case", lambda seed, *a, **k: ran.append(seed)
                        or (seed, ops[seed % len(ops)], "fp32", {"o": 0.0}, None))
    out = tmp_path / "fuzz.md"
    assert fz.main(["--cases", str(3 * len(ops)), "--out", str(out), "--ops", "gdn_chunk,window"]) == 0
    assert len(ran) == 6 and {ops[s % len(ops)] for s in ran} == {"gdn_chunk", "window"}
    assert "6 random cases" in out.read_text() and f"--cases {3 * len(ops)} " in out.read_text()
    assert "--ops gdn_chunk,window`" in out.read_text()
    with pytest.raises(SystemExit, match="--ops nope: not an op of generator .* pick from chunk, window"):
        fz.main(["--cases", "4", "--out", str(out), "--ops", "nope"])


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
    assert first["generator"] == both["generator"] == fz.GENERATOR  # a new run records its version
    assert {fz.gen_case(s)["op"] for s in range(7, 11)} <= set(both["counts"])
    with pytest.raises(SystemExit, match=f"recorded with --generator {fz.GENERATOR}"):
        fz.main(["--cases", "4", "--out", str(out), "--resume", str(out.with_suffix(".json")), "--generator", "1"])


# what a case's compiled kernels depend on (dtype, head dims and counts, flags, layouts, ring size)
VARIANT_KEYS = ("op", "dtype", "gate", "h0", "F", "D", "normalize", "H", "Hkv", "P", "Dv", "W", "R", "conv", "valid",
                "strided", "cache", "kv", "layout", "out", "fdtype", "g_off", "extra")


@pytest.mark.parametrize("generator", sorted(fz.OPS_BY_VERSION))
def test_pool_shares_compiled_variants_not_shapes(generator):
    # --pool on the GPU: cases seed and seed + pool compile the same kernels (dtype, head dims,
    # flags) but draw their own shapes, so 2,000 cases need few compilations and still vary
    n = len(fz.ops_of(generator))
    p = 2 * n
    gen = lambda s, **kw: fz.gen_case(s, tiny=False, generator=generator, **kw)  # noqa: E731
    for seed in range(p):
        a, b = gen(seed, pool=p), gen(seed + p * 5, pool=p)
        if a["reject"] or b["reject"]:
            continue
        # (version 1's ops draw their head count and window with the shapes, as they always did)
        keys = VARIANT_KEYS if a["op"] not in fz.OPS_V1 else ("op", "dtype", "gate", "h0", "F", "D", "normalize")
        assert {k: a.get(k) for k in keys} == {k: b.get(k) for k in keys}, seed
    # (seed 0: the chunk op in every version; a decode op's few lengths (seed 3's recurrent) gave version 4
    # only 3 distinct shapes in 10 seeds)
    shapes = {(gen(p * i, pool=p)["T"], gen(p * i, pool=p)["B"]) for i in range(10)}
    assert len(shapes) > 3
    # without a pool the draws are the historical ones: every seed its own variant
    assert gen(3) != gen(3, pool=p)
    assert fz.round_pool(14, generator) % n == 0 and fz.default_pool(False, generator) == fz.POOL_PER_OP * n


def test_sigterm_still_writes_the_cases_run_so_far(tmp_path, monkeypatch):
    """`timeout` stops a GPU fuzz with SIGTERM: the table of the cases run so far is still written
    (an H200 run of 7 minutes lost its table that way)."""
    import signal

    calls = []

    def fake_case(seed, device, tiny, pool=0, log=print, generator=fz.GENERATOR):
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


def test_a_run_killed_outright_leaves_a_record_that_resumes(tmp_path, monkeypatch):
    """A lent machine's time limit kills the whole command (no SIGTERM to catch): the record on disk,
    rewritten as cases finish, still holds the cases run so far, and --resume goes on from it (a
    2026-11-25 GPU call cut at 418 s returned nothing before this)."""
    out, left = tmp_path / "fuzz.md", {}
    monkeypatch.setattr(fz, "SAVE_EVERY", 0.0)

    def fake_case(seed, device, tiny, pool=0, log=print, generator=fz.GENERATOR):
        if seed == 5:  # what a kill during the sixth case would leave on disk
            left.update(json.loads(out.with_suffix(".json").read_text()))
        return seed, "recurrent", "fp32", {"o": 1e-7 * (seed + 1)}, None

    monkeypatch.setattr(fz, "one_case", fake_case)
    assert fz.main(["--cases", "8", "--out", str(out), "--pool", "0"]) == 0
    assert left["ran"] == [0, 1, 2, 3, 4] and left["counts"] == {"recurrent": 5}
    assert [w[:3] + w[4:] for w in left["worst"]] == [["recurrent", "fp32", "o", 4]]
    assert not out.with_suffix(".json.tmp").exists()  # written aside, then renamed into place
    killed = tmp_path / "killed.json"
    killed.write_text(json.dumps(left))
    ran = []
    monkeypatch.setattr(fz, "one_case", lambda seed, *a, **k: ran.append(seed) or fake_case(seed, *a, **k))
    assert fz.main(["--cases", "8", "--out", str(tmp_path / "next.md"), "--pool", "0", "--resume", str(killed)]) == 0
    assert ran == [5, 6, 7]
    assert json.loads((tmp_path / "next.json").read_text())["ran"] == list(range(8))


@pytest.mark.parametrize("generator", sorted(fz.OPS_BY_VERSION))
@pytest.mark.parametrize("workers", [7, 14, 16])
@pytest.mark.parametrize("pool", [0, "default"])
def test_parallel_workers_each_get_every_op(workers, pool, generator):
    """Dealt in order, 14 workers each got one op (seed % 7): the chunk op's two workers compiled all
    its variants while the rest idled on recurrent cases (976 of 2,000 cases in the first GPU run).
    (Dealt by variant, a worker gets every op when an op has at least as many variants as there are
    workers: the default pool's 20 per op, 140 in version 1 and 260 in version 2.)"""
    pool = fz.default_pool(False, generator) if pool == "default" else pool
    shares = fz.split_seeds(range(2000), workers, pool, generator)
    assert sorted(s for share in shares for s in share) == list(range(2000))
    for share in shares:
        ops = {fz.gen_case(s, tiny=False, pool=140, generator=generator)["op"] for s in share}
        assert ops == set(fz.ops_of(generator)), (workers, ops)


@pytest.mark.parametrize("generator", sorted(fz.OPS_BY_VERSION))
@pytest.mark.parametrize("workers", [12, 16])
def test_each_compiled_variant_is_dealt_to_one_worker(workers, generator):
    """Dealt seed by seed, every worker compiled nearly every one of the 140 variants (170 cases in
    514 s on an H200); dealt by variant, each is compiled once, and a worker meets all of its variants
    in its first cases (a run cut by its budget has compiled what it was dealt)."""
    P = fz.default_pool(False, generator)  # 140 (version 1), 260 (version 2)
    shares = fz.split_seeds(range(2000), workers, P, generator)
    owners = {}
    for w, share in enumerate(shares):
        for s in share:
            assert owners.setdefault(s % P, w) == w, f"variant {s % P} in workers {owners[s % P]} and {w}"
        mine = {s % P for s in share}
        assert {s % P for s in share[:len(mine)]} == mine
    assert max(map(len, shares)) - min(map(len, shares)) <= 2 * (2000 // P + 1)


def test_a_sticky_cuda_error_hands_the_remaining_seeds_to_a_new_worker(monkeypatch):
    """An illegal address poisons a process's CUDA context: in the first 2,000-case H200 run, every
    worker's cases after its first such error failed with it too (984 of 988 failures). The worker
    stops and hands its remaining seeds back, and the parent starts a fresh process for them."""
    import queue

    def fake_case(seed, device, tiny, pool=0, log=print, generator=fz.GENERATOR):
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

    def fake_case(seed, device, tiny, pool=0, log=print, generator=fz.GENERATOR):
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

    def fake_case(seed, device, tiny, pool=0, log=print, generator=fz.GENERATOR):
        calls.append(seed)
        op = fz.gen_case(seed, tiny=tiny, pool=pool, generator=generator)["op"]
        return seed, op, "fp32", {"o": 1e-7}, None

    monkeypatch.setattr(fz, "one_case", fake_case)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    first = fz.gen_case(2, tiny=True, generator=1)["op"]  # the record has no "generator": version 1
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
