"""The glue around the kernels in a chunked prefill: what one converted layer launches in a continuation
chunk (counted by scripts/profile_prefill.py --count-ops, under TRITON_INTERPRET=1 so the layers take
their kernel path) stays under the bounds reached in issue 13, and the fast paths give the results of
the plain ones (chunked = one call, Hedgehog.features = the map's forward)."""

import pytest
import torch

import linearize
from conftest import load_script
from linearize.benchmarks.measure import prefill
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
    # gdn: 1 sequence and chunks of 96 only. GDN's chunk kernel runs whole 64-token rows, however short the
    # call, and per sequence: 160 tokens in one call and in two (96, then 64 starting mid-row) already
    # carry the state and conv cache across a call boundary that is not a row boundary. Short GDN
    # continuations: test_compiled_chunk_continues_the_static_cache (chunks of 20) and
    # test_gdn_fused_prefill_equals_the_unfused_kernel_path (2 tokens, then the rest)
    B, chunks = (1, (96,)) if preset == "gdn" else (2, (96, 40))
    ids = torch.randint(0, m.config.vocab_size, (B, 160))
    with torch.no_grad():
        one = m(input_ids=ids).logits[:, -1]
        for chunk in chunks:  # chunks longer than lolcats' window on the tiny shape (8), and 160 tokens past it
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
    # one Triton kernel since this session: fp32 products (tf32x3 on a GPU), its own softmax rounding
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    # an in-place update of the map reaches the features
    with torch.no_grad():
        fm.weight.mul_(2)
    torch.testing.assert_close(fm.features(x, torch.float32), fm(x.float().repeat_interleave(rep, dim=2)),
                               atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("B,T,Hx,H,D,P,dtype", [
    (2, 37, 3, 9, 64, 64, torch.bfloat16),  # the SmolLM2 keys: GQA, rep 3
    (1, 5, 2, 2, 20, 7, torch.float32),  # odd head dim and feature columns
    (1, 70, 1, 4, 16, 33, torch.float16),
    (2, 3, 4, 4, 65, 64, torch.float32),
])
def test_hedgehog_feature_kernel_matches_float64(B, T, Hx, H, D, P, dtype):
    from linearize.kernels.linear_attn.features import hedgehog_features, hedgehog_features_ref
    from linearize.kernels.ops import OPS

    g = torch.Generator().manual_seed(B * T + D)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = (2 * torch.randn(B, T, Hx, D + 5, generator=g))[..., :D].to(dtype).to(dev)  # a strided view
    w = (0.3 * torch.randn(H, D, P, generator=g)).to(dev)
    got = hedgehog_features(x, w, dtype)
    want = hedgehog_features_ref(x.double(), w.double(), torch.float64)
    assert got.shape == (B, T, H, 2 * P) and got.dtype == dtype and got.is_contiguous()
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    assert (got.double() - want).abs().max().item() < tol
    assert (want - hedgehog_features_ref(x, w, torch.float32).double()).abs().max() < 1e-5  # fp32 twin
    torch.library.opcheck(OPS["hedgehog_features"], (x.contiguous(), w, dtype))
    with pytest.raises(ValueError, match="do not divide"):
        hedgehog_features(torch.zeros(1, 1, 2, D, device=dev, dtype=dtype), torch.zeros(3, D, P, device=dev), dtype)
