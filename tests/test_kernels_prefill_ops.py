"""The glue around the kernels in a chunked prefill: what one converted layer launches in a continuation
chunk (counted by scripts/profile_prefill.py --count-ops, under TRITON_INTERPRET=1 so the layers take
their kernel path) stays under the bounds reached in issue 13, and the fast paths give the results of
the plain ones (chunked = one call, Hedgehog.features = the map's forward)."""

import pytest
import torch

import linearize
from conftest import load_script
from linearize.benchmark.measure import prefill
from linearize.feature_maps import Hedgehog

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
    reason="the kernel path on CPU needs TRITON_INTERPRET=1")

# ops per converted layer (aten ops that launch work + Triton launches + custom ops + host reads) in a
# continuation chunk of 128 tokens, bf16, tiny shape. Before issue 13's cuts: 34 / 109 / 64.
BOUNDS = {"hedgehog": 27, "lolcats": 69, "gdn": 49}


@pytest.mark.parametrize("preset", sorted(BOUNDS))
def test_continuation_chunk_ops_per_layer_stay_under_the_bound(preset):
    pp = load_script("profile_prefill")
    counts = pp.count_prefill_ops(preset, T=128)
    assert len(counts) == 2  # both tiny layers converted and counted
    total = pp.per_layer(counts)
    assert total <= BOUNDS[preset], pp.format_counts(preset, 128, 1, counts)
    assert pp.per_layer(counts, "host") == 0  # no CPU-GPU sync inside a layer
    assert pp.per_layer(counts, "triton") >= 1  # the kernels ran (not the PyTorch math)


@pytest.mark.parametrize("preset", ["hedgehog", "lolcats", "gdn"])
def test_chunked_prefill_equals_one_call_on_the_kernels(preset):
    pp = load_script("profile_prefill")
    m = pp.tiny_converted(preset, dtype=torch.float32)
    ids = torch.randint(0, m.config.vocab_size, (2, 160))
    with torch.no_grad():
        one = m(input_ids=ids).logits[:, -1]
        for chunk in (96, 40):  # chunks longer and shorter than lolcats' window (64)
            got = prefill(m, ids, linearize.LinearizeCache(m.config), chunk=chunk)
            torch.testing.assert_close(got, one, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("heads,rep", [(4, 1), (6, 3)])
def test_hedgehog_features_equal_the_forward(heads, rep):
    fm = Hedgehog(heads, 16, 32)
    with torch.no_grad():
        fm.weight.add_(0.3 * torch.randn_like(fm.weight))
    x = torch.randn(2, 7, heads // rep, 16, dtype=torch.bfloat16).transpose(1, 2).contiguous().transpose(1, 2)
    want = fm(x.float().repeat_interleave(rep, dim=2))
    got = fm.features(x, torch.float32)
    assert got.is_contiguous() and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    # the cached grouped weight follows an in-place update of the map
    with torch.no_grad():
        fm.weight.mul_(2)
    torch.testing.assert_close(fm.features(x, torch.float32), fm(x.float().repeat_interleave(rep, dim=2)),
                               atol=1e-6, rtol=1e-5)
