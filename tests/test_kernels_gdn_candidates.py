"""scripts/bench_gdn.py's autotune candidates (``CANDIDATES``: configs tried beside the GDN forward
kernels' committed lists by ``--tune-compare`` and scripts/probe_gdn_configs.py): each one, alone in
its kernel's list, computes the forward the committed configs compute. The interpreter runs the
tiling (BK, BV) and the masks; warps and stages are the GPU's to check (the probe script). Named
test_kernels_* to run in the interpreter half of the README's test command."""

import os

import pytest
import torch
import torch.nn.functional as F

from conftest import load_script

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs CUDA or TRITON_INTERPRET=1")


def test_each_candidate_config_computes_the_committed_forward():
    b = load_script("bench_gdn")
    lists = b.config_lists()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    T, H, K, V = 130, 2, 48, 40  # a partial last chunk, head dims that are not powers of two, K != V
    q = torch.randn(1, T, H, K, generator=gen)
    k = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    v = torch.randn(1, T, H, V, generator=gen)
    g = F.logsigmoid(torch.randn(1, T, H, generator=gen) + 3.0)
    beta = torch.rand(1, T, H, generator=gen) * 0.9 + 0.05
    h0 = torch.randn(1, H, K, V, generator=gen) * 0.1
    xs = [x.to(device) for x in (q, k, v, g, beta, h0)]

    def forward():
        return b.gd.chunk_gated_delta_rule(*xs[:3], g=xs[3], beta=xs[4], initial_state=xs[5],
                                           output_final_state=True)

    ref_o, ref_ht = b.gd.gated_delta_rule_chunk_ref(*xs[:3], g=xs[3], beta=xs[4], initial_state=xs[5],
                                                    output_final_state=True)
    checked = []
    try:
        for name, (kern, committed, widened) in lists.items():
            committed_ids = {b._short(c) for c in committed}  # meta-parameters, warps and stages
            for cfg in widened[len(committed):]:
                assert b._short(cfg) not in committed_ids
                for other, (kern2, committed2, _) in lists.items():
                    kern2.configs = [cfg] if other == name else committed2[:1]
                    kern2.cache.clear()
                o, ht = forward()
                assert b.rel(o, ref_o) < 1e-5 and b.rel(ht, ref_ht) < 1e-5, (name, b._short(cfg))
                checked.append(b._short(cfg))
    finally:
        for kern, committed, _ in lists.values():
            kern.configs = committed
            kern.cache.clear()
    assert len(checked) == sum(len(c) for c in b.CANDIDATES.values())


def test_tune_compare_keeps_only_the_candidates_the_probe_passed(tmp_path):
    """bench_gdn --tune-compare --candidates-from: a candidate the probe saw fail (an error, a NaN, an
    output off the reference at any head dim) never enters the tuner's list."""
    import json

    b = load_script("bench_gdn")
    name = "_fwd_h_kernel"
    cands = b.config_lists()[name][2][len(b.config_lists()[name][1]):]
    good, wrong, nan = (b._short(c) for c in cands[:3])
    lines = [{"kernel": name, "config": good, "D=64 o vs ref": 4e-3, "D=128 o vs ref": 4e-3},
             {"kernel": name, "config": wrong, "D=64 o vs ref": 1.17, "D=128 o vs ref": 4e-3},
             {"kernel": name, "config": nan, "D=64 o vs ref": float("nan"), "D=128 o vs ref": 4e-3},
             {"kernel": name, "index": 9, "returncode": 1, "error": ["illegal memory access"]}]
    path = tmp_path / "probe.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    passed = b.passed_probe(path)
    assert passed == {(name, good)}
    lists = b.config_lists(passed)
    _, committed, widened = lists[name]
    assert [b._short(c) for c in widened[len(committed):]] == [good]
    assert all(len(w) == len(c) for n, (_, c, w) in lists.items() if n != name)


def test_solve_variants_set_settings_the_kernel_module_reads_and_the_first_is_the_old_default():
    """bench_gdn --solve-compare sets module attributes by name: a renamed setting (WY_POW_MAX_K became
    WY_DIAG_MAX_K) would make setattr create a dead attribute and time the default under another name.
    Every variant names only settings chunk.py has, in the values it accepts, and the second one is the
    committed default (bf16: single tf32 products, merged diagonal inverses, K tile 32)."""
    from linearize.kernels.gated_delta import chunk as ch

    b = load_script("bench_gdn")
    for name, settings in b.SOLVE_VARIANTS:
        assert all(hasattr(ch, n) for n in settings), (name, settings)
        assert settings["WY_T_PREC"] in ("tf32", "tf32x3") and settings["WY_DIAG"] in ("merge", "pow", "subst"), name
    default = dict(b.SOLVE_VARIANTS[1][1])
    assert default.pop("WY_T_PREC") == ch.WY_T_PREC[torch.bfloat16]
    assert default == {n: getattr(ch, n) for n in default}, default


def test_forward_floor_counts_the_chunked_forms_bytes():
    """fwd_floor: io = q, k, v, o (4 bf16 [B, T, H, D] tensors); chunked = 12 such tensors (k x 3, q, v, o,
    w, u, v' x 2) plus the per-chunk states [T / 64, H, D, D] written and read; at 1 GB/s, ms = bytes / 1e6."""
    b = load_script("bench_gdn")
    unit = 2 * 32768 * 32 * 64 * 2
    f = b.fwd_floor(2, 32, 64, 32768, 1.0)
    assert f["floor io"] == pytest.approx(4 * unit / 1e6)
    assert f["floor chunked"] == pytest.approx(14 * unit / 1e6)  # at D = 64 the states are one more unit
    f = b.fwd_floor(1, 4, 128, 4096, 1.0)
    assert f["floor chunked"] == pytest.approx((12 * 4096 * 4 * 128 * 2 + 2 * 64 * 4 * 128 * 128 * 2) / 1e6)
