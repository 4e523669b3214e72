"""scripts/sass_gdn.py: the GDN chunk kernels compiled for sm_90a here on the CPU (ptxas, nvdisasm from
the triton wheel), as the GPU would run them. The bf16 inference UT transform at K = 64 and 128 really compiles the merged
block inverse on single tf32 products (more tensor-core products than substitution), and the
pairwise decays stay off the per-pair multiply path (exp2 of scaled decays: the output kernel had
190 FMUL at D=64 with exp() of differences, 96 with exp2)."""
import os

import pytest

from conftest import load_script

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter compiles nothing")


def test_inference_ut_transform_compiles_the_merged_inverse_and_output_kernel_has_no_per_pair_multiply():
    s = load_script("sass_gdn")
    for D in (128, 64):
        jobs = {name: (kern, consts, nw, ns) for name, kern, consts, nw, ns in s.jobs(D)}
        kern, consts, nw, ns = jobs["UT transform, inference"]
        assert consts["DIAG"] == "merge" and consts["TPREC"] == "tf32", consts
        merge, subst = s.sass(kern, consts, nw, ns), s.sass(kern, {**consts, "DIAG": "subst"}, nw, ns)
        assert merge["registers"] > 0 and merge["spill"] == 0, merge
        # the merges' 24 [16, 16] products (two HMMA each at 2 warps: 48) in place of 15 substitution steps
        assert merge["HMMA"] >= subst["HMMA"] + 40, (D, merge["HMMA"], subst["HMMA"])
    out = s.sass(*jobs["output"])
    # a [64, 64] tile over 128 threads is 32 pairs a thread: 32 multiplies by the decay, 32 by exp(g) and
    # 32 by the scale; scaling each pair's difference by log2(e) would add 32 more
    assert out["MUFU"] >= 32 and out["FMUL"] <= 100, out
