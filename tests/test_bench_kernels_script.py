"""scripts/bench_kernels.py keeps its measurements as they come (``--json``) and a run stopped midway
continues from them: no GPU needed to check that bookkeeping."""

import math

import pytest

from conftest import load_script

pytest.importorskip("triton")


def _script():
    return load_script("bench_kernels")


def test_progress_round_trip_is_atomic_and_keeps_nan(tmp_path):
    bk = _script()
    path = tmp_path / "k.json"
    assert bk.load_progress(None) == {} and bk.load_progress(path) == {}
    bk.save_progress(path, {"dec": [[64, 1, True, 0.01, float("nan")]]})
    got = bk.load_progress(path)
    assert math.isnan(got["dec"][0][4]) and got["dec"][0][:4] == [64, 1, True, 0.01]
    assert not (tmp_path / "k.json.tmp").exists()


def test_run_bench_skips_finished_points_and_drops_half_finished_ones():
    bk = _script()
    Ts = [1024, 2048]
    rows = [[D, T, name, 1.0, 2.0] for D in (64, 128) for T in Ts for name in ("ours normalize=True", "SDPA causal (flash)")]
    rows.append([64, 4096, "ours normalize=True", 1.0, 2.0])  # a point cut before its SDPA row
    agree = [[64, 1024, True, 1e-3], [64, 4096, True, 1e-3]]
    calls = []
    out_rows, out_agree = bk.run_bench(False, None, None, Ts, rows, agree, on_point=lambda r, a: calls.append(1))
    assert calls == []  # nothing left to measure at these T (no GPU touched)
    assert [64, 4096] not in [list(r[:2]) for r in out_rows]
    assert len(out_rows) == 8 and out_agree == [(64, 1024, True, 1e-3)]


def test_channel_benchmark_imports_and_counts_its_floor():
    """scripts/bench_kernels_channel.py imports without a GPU or fla (one run a lease: an import error there
    costs a lease's slot), and its memory floor counts what a call must move: the forward reads q, k (bf16),
    the fp32 log gates and v, and writes o; the backward reads them again with do and writes a gradient for
    each (dlog g in fp32)."""
    bc = load_script("bench_kernels_channel")
    H, F, DV = bc.H, bc.F, bc.DV
    n = 2 * 1024  # B x T
    fwd = n * H * (2 * F * 2 + F * 4 + 2 * DV * 2)
    assert bc.floor_bytes(2, 1024, False) == fwd
    assert bc.floor_bytes(2, 1024, True) == fwd + n * H * (2 * F * 2 + F * 4 + DV * 2) + n * H * (DV * 2) \
        + n * H * (2 * F * 2 + DV * 2 + F * 4)
