"""The window hybrid's decode kernel (ring buffer + state, in place) against its PyTorch twin and
against ``linear_attention(..., prefix=W-1)`` (the layer's math on the buffer in time order)."""

import pytest
import torch

from linearize.attention import linear_attention
from linearize.kernels.linear_attn.window_decode import window_decode, window_decode_ref

INTERPRET = __import__("os").environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()),
                                reason="needs CUDA or TRITON_INTERPRET=1")
DEV = "cpu" if INTERPRET else "cuda"


def unroll(ring, pos, W1):
    """The ring's slots in time order (oldest first) for a ring whose next position is ``pos``."""
    idx = (pos + torch.arange(W1, device=DEV)) % W1
    return {n: t.index_select(1, idx) for n, t in ring.items()}


def make_case(B, T, H, D, F, W, gate, pad, dtype, pos, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    W1 = W - 1
    q_sm, k_sm, v = r(B, T, H, D).to(dtype), r(B, T, H, D).to(dtype), r(B, T, H, D).to(dtype)
    qf = torch.softmax(r(B, T, H, F), -1)
    kf = torch.softmax(r(B, T, H, F), -1)
    gshape = {"scalar": (H,), "channel": (H, F)}.get(gate)
    log_g = None if gate is None else -torch.rand(B, T, *gshape, generator=g) * 0.5
    valid = None
    if pad:
        valid = torch.rand(B, T, generator=g) > 0.3
        valid[0, -1] = False  # a pad token in decode
    ring = {
        "k": r(B, W1, H, D).to(dtype), "phi_k": torch.softmax(r(B, W1, H, F), -1), "v": r(B, W1, H, D).to(dtype),
        "log_g": (-torch.rand(B, W1, *(gshape or (H,)), generator=g) * 0.5) if gate else torch.zeros(B, W1, H),
        "valid": (torch.rand(B, W1, generator=g) > (0.3 if pad else -1)).float(),
    }
    if W1:
        ring["valid"][:, : min(2, W1)] = 0.0  # slots never filled (a short prompt)
    S = torch.rand(B, H, F, D, generator=g)
    z = torch.rand(B, H, F, generator=g)
    gamma = torch.rand(H, generator=g) + 0.5
    dev = lambda x: None if x is None else x.to(DEV)  # noqa: E731
    return dict(q_sm=dev(q_sm), qf=dev(qf), k_sm=dev(k_sm), kf=dev(kf), v=dev(v), log_g=dev(log_g), valid=dev(valid),
                ring={n: dev(t) for n, t in ring.items()}, state=(dev(S), dev(z)), pos=torch.tensor(pos, device=DEV),
                gamma=dev(gamma), sm_scale=D ** -0.5)


def ground_truth(c, W, softcap):
    """linear_attention over the ring (time order) followed by the new tokens, prefix W-1."""
    B, T = c["v"].shape[:2]
    W1 = W - 1
    buf = unroll(c["ring"], int(c["pos"]), W1)
    valid = c["valid"] if c["valid"] is not None else torch.ones(B, T, dtype=torch.bool, device=DEV)
    cat = lambda a, b: torch.cat([a.double(), b.double()], 1)  # noqa: E731
    log_g = None if c["log_g"] is None else cat(buf["log_g"], c["log_g"])
    o, (S, z) = linear_attention(
        c["qf"].double(), cat(buf["phi_k"], c["kf"]), cat(buf["v"], c["v"]), log_g=log_g,
        initial_state=tuple(x.double() for x in c["state"]), key_valid=torch.cat([buf["valid"] > 0, valid], 1),
        window=W, q_sm=c["q_sm"].double(), k_sm=cat(buf["k"], c["k_sm"]), sm_scale=c["sm_scale"], softcap=softcap,
        window_weight=c["gamma"].double(), prefix=W1, form="recurrent")
    new = {n: cat(buf[n], x)[:, -W1:] if W1 else buf[n] for n, x in (("k", c["k_sm"]), ("phi_k", c["kf"]), ("v", c["v"]))}
    new["valid"] = torch.cat([buf["valid"], valid.float()], 1)[:, -W1:] if W1 else buf["valid"]
    return o, new, (S, z)


@pytest.mark.parametrize("W", [2, 9, 64])
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("gate", [None, "scalar", "channel"])
@pytest.mark.parametrize("pad", [False, True])
def test_decode_kernel_matches_reference_and_linear_attention(W, T, gate, pad):
    B, H, D, F = 2, 2, 16, 16
    c = make_case(B, T, H, D, F, W, gate, pad, torch.float32, pos=37)
    o_ref, ring_ref, (S_ref, z_ref) = window_decode_ref(**c)
    o_gt, new_gt, (S_gt, z_gt) = ground_truth(c, W, None)
    torch.testing.assert_close(o_ref.double(), o_gt, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(S_ref.double(), S_gt, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(z_ref.double(), z_gt, atol=1e-5, rtol=1e-5)
    pos_after = 37 + T
    got = unroll(ring_ref, pos_after, W - 1)
    for n in ("k", "phi_k", "v", "valid"):
        torch.testing.assert_close(got[n].double(), new_gt[n].double())

    S, z = (x.clone() for x in c["state"])
    ring = {n: t.clone() for n, t in c["ring"].items()}
    o = window_decode(**{**c, "ring": ring, "state": (S, z)})
    torch.testing.assert_close(o, o_ref.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(S, S_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(z, z_ref, atol=1e-5, rtol=1e-5)
    for n in ring:
        torch.testing.assert_close(ring[n], ring_ref[n], atol=0, rtol=0)


@pytest.mark.parametrize("W", [9, 64])
def test_decode_kernel_bf16_softcap(W):
    B, T, H, D, F = 2, 2, 2, 32, 16
    c = make_case(B, T, H, D, F, W, "scalar", True, torch.bfloat16, pos=5, seed=1)
    o_gt, _, (S_gt, z_gt) = ground_truth(c, W, 3.0)
    S, z = (x.clone() for x in c["state"])
    ring = {n: t.clone() for n, t in c["ring"].items()}
    o = window_decode(**{**c, "ring": ring, "state": (S, z)}, softcap=3.0)
    assert o.dtype == torch.bfloat16
    torch.testing.assert_close(o.double(), o_gt, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(S.double(), S_gt, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(z.double(), z_gt, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("W", [2, 9, 64])
@pytest.mark.parametrize("gate", [None, "scalar"])
@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    INTERPRET, reason="the chunk kernels' bf16 dots are not emulated faithfully by the interpreter"))])
def test_prefill_from_state_matches_linear_attention(W, gate, pad, dtype):
    from linearize.kernels.linear_attn.window_decode import window_prefill, window_prefill_ref

    B, T, H, D, F = 2, 40, 2, 16, 16
    c = make_case(B, T, H, D, F, W, gate, pad, dtype, pos=11, seed=2)
    buf = unroll(c["ring"], 11, W - 1)
    kw = dict(log_g=c["log_g"], valid=c["valid"], buf=buf, gamma=c["gamma"], sm_scale=c["sm_scale"])
    o, (S, z) = window_prefill(c["q_sm"], c["qf"], c["k_sm"], c["kf"], c["v"], state=c["state"], **kw)
    f64 = lambda x: None if x is None else x.double()  # noqa: E731
    o_gt, (S_gt, z_gt) = window_prefill_ref(
        f64(c["q_sm"]), f64(c["qf"]), f64(c["k_sm"]), f64(c["kf"]), f64(c["v"]),
        state=tuple(x.double() for x in c["state"]), **{**kw, "log_g": f64(c["log_g"]),
                                                       "buf": {n: t.double() for n, t in buf.items()}})
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    assert o.dtype == dtype
    torch.testing.assert_close(o.double(), o_gt, **tol)
    torch.testing.assert_close(S.double(), S_gt, **tol)
    torch.testing.assert_close(z.double(), z_gt, **tol)
