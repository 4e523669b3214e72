"""scripts/sass_gdn.py: the GDN chunk kernels compiled for sm_90a here on the CPU (ptxas, nvdisasm from
the triton wheel), as the GPU would run them. The inference UT transform at K = 64 really compiles the
product-form inverse (more tensor-core products than the training variant's substitution), and the
pairwise decays stay off the per-pair multiply path (exp2 of scaled decays: the output kernel had
190 FMUL at D=64 with exp() of differences, 96 with exp2)."""
import os

import pytest

from conftest import load_script

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter compiles nothing")


def test_inference_ut_transform_compiles_the_product_form_and_output_kernel_has_no_per_pair_multiply():
    s = load_script("sass_gdn")
    jobs = {name: (kern, consts, nw, ns) for name, kern, consts, nw, ns in s.jobs(64)}
    kern, consts, nw, ns = jobs["UT transform, inference"]
    assert consts["DIAG"] == "pow"
    pow_, subst = s.sass(kern, consts, nw, ns), s.sass(kern, {**consts, "DIAG": "subst"}, nw, ns)
    assert pow_["registers"] > 0 and pow_["total"] > 0
    # the product form's 24 [16, 16] products (three tf32 parts each) against 15 substitution steps
    assert pow_["HMMA"] > subst["HMMA"] + 100, (pow_["HMMA"], subst["HMMA"])
    out = s.sass(*jobs["output"])
    # a [64, 64] tile over 128 threads is 32 pairs a thread: 32 multiplies by the decay, 32 by exp(g) and
    # 32 by the scale; scaling each pair's difference by log2(e) would add 32 more
    assert out["MUFU"] >= 32 and out["FMUL"] <= 100, out
