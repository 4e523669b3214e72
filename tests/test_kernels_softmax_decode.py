"""A hybrid's softmax decode step (kernels/softmax_decode.py) against its float64 twin: grouped heads
(G = 1, 3, 4, 8), head dims that are not powers of two, lengths that are not multiples of a block,
masks with padding and an empty static-cache tail, a row with nothing to attend, several splits,
strided cache views; the op's checks and refusals; and the hybrid model's softmax layers on it,
eager and compiled, with the tokens of transformers' sdpa path."""

import os

import pytest
import torch

pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET, reason="needs a GPU or TRITON_INTERPRET=1")

import linearize  # noqa: E402
import linearize.hybrid_sdpa as hybrid_sdpa  # noqa: E402
import linearize.kernels.softmax_decode as sd  # noqa: E402
from conftest import converted  # noqa: E402
from linearize.kernels.ops import OPS  # noqa: E402
from conftest import rel_err

TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2, torch.float16: 2e-3}



def _data(B, H, Hkv, L, D, dtype, seed=0, pad=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, D, generator=g)
    k = torch.randn(B, Hkv, L, D, generator=g) * 2  # peaked scores: the softmax's max matters
    v = torch.randn(B, Hkv, L, D, generator=g)
    mask = torch.ones(B, L, dtype=torch.bool)
    if pad:
        mask[:, L - L // 5:] = False  # the static cache's unfilled tail
        mask[B - 1, : L // 3] = False  # left padding of the last row
    return [t.to(DEVICE) for t in (q.to(dtype), k.to(dtype), v.to(dtype), mask)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("B,H,Hkv,L,D", [(1, 9, 3, 200, 64), (2, 4, 4, 67, 17), (3, 8, 2, 300, 128),
                                         (2, 8, 1, 129, 40)])
def test_matches_float64(B, H, Hkv, L, D, dtype):
    q, k, v, mask = _data(B, H, Hkv, L, D, dtype, seed=B * L + D)
    for m in (mask, None):
        got = sd.softmax_decode(q, k, v, m)
        assert got.dtype == dtype and got.shape == (B, H, D)
        assert rel_err(got, sd.softmax_decode_ref(q, k, v, m)) < TOL[dtype]


def test_splits_merge_to_one_softmax(monkeypatch):
    """One split over every block (the online softmax's rescaling from block to block) and one split
    per block (the merge; some splits with nothing to attend) both give the float64 result."""
    q, k, v, mask = _data(2, 6, 2, 500, 32, torch.float32, seed=3)
    want = sd.softmax_decode_ref(q, k, v, mask)
    monkeypatch.setattr(sd, "_splits", lambda B, Hkv, L, device: (-(-L // 64) * 64, 1))
    one = sd.softmax_decode(q, k, v, mask)
    assert rel_err(one, want) < 1e-5
    monkeypatch.setattr(sd, "_splits", lambda B, Hkv, L, device: (64, -(-L // 64)))
    many = sd.softmax_decode(q, k, v, mask)
    assert rel_err(many, want) < 1e-5
    torch.testing.assert_close(many, one, rtol=1e-5, atol=1e-6)
    assert sd._splits(1, 3, 4096, torch.device("cpu"))[1] > 1  # a long cache is split over the programs
    monkeypatch.setattr(sd, "BL", 128)  # the large block: the same result
    torch.testing.assert_close(sd.softmax_decode(q, k, v, mask), one, rtol=1e-5, atol=1e-6)
    assert sd._block(1, 3, 4096) == 128
    monkeypatch.setattr(sd, "BL", None)
    assert sd._block(1, 3, 4096) == 64 and sd._block(8, 3, 65536) == 128


def test_scale_strided_views_and_an_empty_row():
    q, k, v, mask = _data(2, 4, 2, 90, 24, torch.float32, seed=5)
    wide = torch.randn(2, 2, 90, 48, device=DEVICE)[..., :24]  # a view with a row stride of 48
    mask[0] = False
    got = sd.softmax_decode(q, wide, v, mask, scale=0.3)
    want = sd.softmax_decode_ref(q, wide, v, mask, scale=0.3)
    assert torch.equal(got[0], torch.zeros_like(got[0]))  # nothing to attend: zeros, not NaN
    assert rel_err(got[1], want[1]) < 1e-5


def test_opcheck_and_refusals():
    q, k, v, mask = _data(2, 4, 2, 70, 16, torch.float32)
    torch.library.opcheck(OPS["softmax_decode"], (q, k, v, mask, 0.25))
    torch.library.opcheck(OPS["softmax_decode"], (q, k, v, None, 0.25))
    with pytest.raises(ValueError, match="multiple of Hkv"):
        sd.softmax_decode(q[:, :3], k, v)
    with pytest.raises(ValueError, match="one dtype"):
        sd.softmax_decode(q.half(), k, v)
    with pytest.raises(ValueError, match="bool"):
        sd.softmax_decode(q, k, v, mask.long())
    with pytest.raises(ValueError, match="at most 256"):
        sd.softmax_decode(torch.zeros(1, 2, 300, device=DEVICE), torch.zeros(1, 1, 4, 300, device=DEVICE),
                          torch.zeros(1, 1, 4, 300, device=DEVICE))


# -- the hybrid model's softmax layers -------------------------------------------------------------

def _spy(monkeypatch):
    calls = []
    real = sd.softmax_decode
    monkeypatch.setattr(sd, "softmax_decode", lambda q, *a, **kw: calls.append(tuple(q.shape)) or real(q, *a, **kw))
    return calls


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_hybrid_decodes_its_softmax_layers_on_the_kernel(cache, monkeypatch):
    """A padded batch: the tokens and the logits of transformers' sdpa path (LINEARIZE_KERNELS=torch
    turns the kernel off), every softmax layer's decode step on the kernel."""
    monkeypatch.setenv("LINEARIZE_KERNELS", "auto")
    model = converted("llama", linearize.GatedDeltaNetConfig(layers=[1]), initializer_range=0.2).to(DEVICE)
    assert model.config._attn_implementation == hybrid_sdpa.DECODE_NAME
    ids = torch.randint(2, 97, (2, 9), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0, output_logits=True,
              return_dict_in_generate=True, cache_implementation=None if cache == "dynamic" else "static")
    calls = _spy(monkeypatch)
    with torch.no_grad():
        got = model.generate(ids, **kw)
        assert len(calls) == 2 * 4  # two softmax layers (0 and 2), four decode steps
        monkeypatch.setenv("LINEARIZE_KERNELS", "torch")
        want = model.generate(ids, **kw)
    assert len(calls) == 8
    torch.testing.assert_close(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())


def test_only_hybrids_switch_and_unlinearize_restores_sdpa():
    every = converted("llama", linearize.GatedDeltaNetConfig())
    assert every.config._attn_implementation == "sdpa"  # no softmax layer left: nothing to decode on it
    eager = converted("llama", linearize.GatedDeltaNetConfig(layers=[1]), attn_implementation="eager")
    assert eager.config._attn_implementation == "eager"  # the user's choice stays
    model = converted("llama", linearize.GatedDeltaNetConfig(layers=[0, 1, 2]))
    assert model.config._attn_implementation == "sdpa"
    linearize.restore_softmax(model, [2])  # a hybrid now
    assert model.config._attn_implementation == hybrid_sdpa.DECODE_NAME
    linearize.unlinearize(model)
    assert model.config._attn_implementation == "sdpa"
