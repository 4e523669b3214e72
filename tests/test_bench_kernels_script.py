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
