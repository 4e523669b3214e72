"""The encoders' non-causal linear attention with Hedgehog's maps in the kernels
(kernels/linear_attn/bidirectional.py): against its float64 twin (padding, odd head dims, several
segments of the keys' pass, strided views, fp32 and bf16), inside a converted encoder (the same
outputs as the PyTorch math, a padded batch equal to each input alone), and under torch.compile
(the graph holds the op)."""

import pytest
import torch

import linearize
from linearize.config import EncoderLinearAttentionConfig
from linearize.kernels.linear_attn import bidirectional, bidirectional_hedgehog, bidirectional_hedgehog_ref

from test_encoders import perturb_new_parameters, tiny_encoder

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEV == "cpu" and __import__("os").environ.get("TRITON_INTERPRET") != "1",
                                reason="the kernels run on CUDA or under TRITON_INTERPRET=1")


def _case(B, T, H, D, P, DV, dtype, pad, seed=0, fused=False):
    g = torch.Generator().manual_seed(seed)
    if fused:  # q, k, v as views of one fused projection (BERT-like strides)
        qkv = torch.randn(B, T, H, 2 * D + DV, generator=g)
        q, k, v = qkv.to(DEV, dtype).split([D, D, DV], dim=-1)
    else:
        q, k, v = (torch.randn(B, T, H, n, generator=g).to(DEV, dtype) for n in (D, D, DV))
    wq, wk = (torch.randn(H, D, P, generator=g).to(DEV) * 0.4 for _ in range(2))
    valid = None
    if pad:
        valid = torch.ones(B, T, device=DEV)
        valid[0, T // 3:] = 0  # a padded row
        valid[-1, :2] = 0  # pad on the left too
    return q, k, v, wq, wk, valid


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("segment", [512, 64])
def test_matches_float64_reference(dtype, pad, segment, monkeypatch):
    monkeypatch.setitem(bidirectional.CONFIG, "tokens_per_segment", segment)  # 64: three segments at T=150
    q, k, v, wq, wk, valid = _case(2, 150, 3, 24, 12, 20, dtype, pad, fused=dtype == torch.bfloat16)
    o = bidirectional_hedgehog(q, k, v, wq, wk, valid, eps=1e-6)
    ref = bidirectional_hedgehog_ref(*(x.double() for x in (q, k, v, wq, wk)),
                                     valid=None if valid is None else valid.double(), eps=1e-6)
    assert o.dtype == dtype and o.shape == (2, 150, 3, 20)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    if valid is not None:  # pad queries' outputs are junk by contract: compare the real ones
        o, ref = o[valid.bool()], ref[valid.bool()]
    torch.testing.assert_close(o.double(), ref, **tol)


def test_pad_keys_change_nothing():
    """A pad key's values and features must add nothing: scribbling over them leaves every real output."""
    q, k, v, wq, wk, valid = _case(2, 70, 2, 16, 16, 16, torch.float32, pad=True, seed=4)
    o1 = bidirectional_hedgehog(q, k, v, wq, wk, valid)
    junk = ~valid.bool()
    k2, v2 = k.clone(), v.clone()
    k2[junk], v2[junk] = 100.0, -50.0
    o2 = bidirectional_hedgehog(q, k2, v2, wq, wk, valid)
    torch.testing.assert_close(o2[valid.bool()], o1[valid.bool()], atol=1e-5, rtol=1e-5)
    assert (o2[valid.bool()] - o1[valid.bool()]).abs().max() < 1e-5


def test_bad_inputs_are_refused_with_one_line():
    q, k, v, wq, wk, _ = _case(1, 8, 2, 16, 8, 16, torch.float32, pad=False)
    with pytest.raises(ValueError, match="do not fit"):
        bidirectional_hedgehog(q, k[:, :, :1], v, wq, wk)
    with pytest.raises(ValueError, match="valid must be"):
        bidirectional_hedgehog(q, k, v, wq, wk, torch.ones(1, 9, device=DEV))


def _converted(seed=0):
    model = linearize.linearize(tiny_encoder("bert", seed=seed), EncoderLinearAttentionConfig(feature_map="hedgehog"))
    perturb_new_parameters(model, scale=0.3)
    return model.to(DEV).eval()


def test_encoder_on_the_kernel_matches_the_pytorch_math(monkeypatch):
    model = _converted()
    ids = torch.randint(5, 100, (3, 37), device=DEV)
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0
    calls = []
    real = bidirectional._bidirectional_hedgehog
    monkeypatch.setattr(bidirectional, "_bidirectional_hedgehog", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        fast = model(input_ids=ids, attention_mask=mask).last_hidden_state
        assert len(calls) == 3, "the kernel must run in every converted layer"
        monkeypatch.setenv("LINEARIZE_KERNELS", "torch")
        slow = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert len(calls) == 3
    real_tokens = mask.bool()
    torch.testing.assert_close(fast[real_tokens], slow[real_tokens], atol=2e-4, rtol=2e-4)
    assert (fast - slow)[real_tokens].abs().max() > 0  # two different computations, not one twice
    # a padded row equals the same input alone
    with torch.no_grad():
        monkeypatch.setenv("LINEARIZE_KERNELS", "auto")
        alone = model(input_ids=ids[1:2, :20]).last_hidden_state
    torch.testing.assert_close(fast[1, :20], alone[0], atol=2e-4, rtol=2e-4)


def test_training_runs_the_pytorch_math(monkeypatch):
    """Gradients: the kernel has no backward, so a training forward must not call it."""
    model = _converted().train()
    calls = []
    monkeypatch.setattr(bidirectional, "_bidirectional_hedgehog", lambda *a: calls.append(1))
    out = model(input_ids=torch.randint(5, 100, (2, 9), device=DEV)).last_hidden_state
    out.float().pow(2).mean().backward()
    assert not calls
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "feature_map" in n)


def test_compiled_encoder_calls_the_op(monkeypatch):
    from test_kernels_ops import _recording

    model = _converted(seed=1)
    ids = torch.randint(5, 100, (2, 21), device=DEV)
    with torch.no_grad():
        eager = model(input_ids=ids).last_hidden_state
        torch._dynamo.reset()
        graphs = []
        compiled = torch.compile(model, backend=_recording(graphs, "aot_eager"), fullgraph=True)
        out = compiled(input_ids=ids).last_hidden_state
    assert graphs and any("linearize.bidirectional_hedgehog" in g for g in graphs), graphs
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(10))
def test_random_shapes_match_float64_reference(seed, monkeypatch):
    """Random shapes (odd head dims and feature columns, T from 1, whole rows of padding, one or several
    segments) in fp32 against the float64 twin."""
    g = torch.Generator().manual_seed(1000 + seed)
    ri = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    B, T, H, D, P, DV = ri(1, 3), ri(1, 200), ri(1, 4), ri(1, 70), ri(1, 40), ri(1, 70)
    monkeypatch.setitem(bidirectional.CONFIG, "tokens_per_segment", 64 * ri(1, 3))
    q, k, v, wq, wk, _ = _case(B, T, H, D, P, DV, torch.float32, pad=False, seed=seed)
    valid = (torch.rand(B, T, generator=g) > 0.3).float().to(DEV) if seed % 2 else None
    if valid is not None:
        valid[0] = 0.0  # a row with no real key: its outputs are 0 / eps = 0
    o = bidirectional_hedgehog(q, k, v, wq, wk, valid)
    ref = bidirectional_hedgehog_ref(*(x.double() for x in (q, k, v, wq, wk)),
                                     valid=None if valid is None else valid.double())
    assert torch.isfinite(o).all(), (B, T, H, D, P, DV)
    torch.testing.assert_close(o.double(), ref, atol=5e-5, rtol=5e-5, msg=str((B, T, H, D, P, DV)))


def test_each_pass_launches_at_its_configured_warps(monkeypatch):
    """CONFIG["kv_warps"] sets the keys' pass alone, CONFIG["warps"] the queries' pass, and the bench's
    wrapper (scripts/bench_encoders.py --kv-warps) changes the keys' pass for its calls only."""
    from conftest import load_script

    launches = []
    real = bidirectional.launch
    monkeypatch.setattr(bidirectional, "launch",
                        lambda kern, grid, *a, **kw: launches.append((getattr(kern, "fn", kern).__name__, kw["num_warps"]))
                        or real(kern, grid, *a, **kw))
    q, k, v, wq, wk, valid = _case(1, 40, 2, 16, 8, 16, torch.float32, pad=False)
    monkeypatch.setitem(bidirectional.CONFIG, "kv_warps", 8)
    o8 = bidirectional_hedgehog(q, k, v, wq, wk, valid)
    assert launches == [("_kv_kernel", 8), ("_out_kernel", 4)]
    monkeypatch.setitem(bidirectional.CONFIG, "kv_warps", 4)
    torch.testing.assert_close(bidirectional_hedgehog(q, k, v, wq, wk, valid), o8)

    be = load_script("bench_encoders")
    model = _converted()
    ids = torch.randint(5, 100, (2, 21), device=DEV)
    launches.clear()
    with torch.no_grad():
        be._WithConfig(model, kv_warps=2)(input_ids=ids)
    assert launches and {w for name, w in launches if name == "_kv_kernel"} == {2}
    assert {w for name, w in launches if name == "_out_kernel"} == {4}
    assert bidirectional.CONFIG["kv_warps"] == 4  # restored after the call
