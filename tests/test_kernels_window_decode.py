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
    from linearize.kernels.linear_attn.window_decode import window_prefill

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


@pytest.mark.parametrize("gate", [None, "scalar"])
def test_prefill_op_passes_opcheck_and_leaves_the_state(gate):
    """window_prefill is a registered op (compiled chunked prefill traces it): its fake tensors,
    schema and dispatch hold (opcheck), and the cached state it continues from is not modified."""
    from linearize.kernels.ops import OPS

    B, T, H, D, F, W = 2, 20, 2, 16, 16, 5
    c = make_case(B, T, H, D, F, W, gate, True, torch.float32, pos=3, seed=4)
    buf = unroll(c["ring"], 3, W - 1)
    gamma = torch.as_tensor(c["gamma"], device=DEV).float().reshape(-1).expand(H).contiguous()
    S0, z0 = (x.clone() for x in c["state"])
    args = (c["q_sm"], c["qf"], c["k_sm"], c["kf"], c["v"], c["log_g"], c["valid"], buf["k"], buf["phi_k"], buf["v"],
            buf["valid"], buf["log_g"] if gate else None, c["state"][0], c["state"][1], gamma, float(c["sm_scale"]))
    torch.library.opcheck(OPS["window_prefill"], args)
    o, S, z = OPS["window_prefill"](*args)
    assert o.shape == (B, T, H, c["v"].shape[-1]) and S.shape == S0.shape and z.shape == z0.shape
    assert torch.equal(c["state"][0], S0) and torch.equal(c["state"][1], z0) and not torch.equal(S, S0)


# -- Hedgehog's features inside the kernel (the LoLCATs layer's decode step in one launch) -----------------

def make_hedgehog_case(B, T, H, Hkv, D, P, DV, W, gate, pad, dtype, pos, seed=0, strided=False):
    """Raw q [B, T, H, D], k [B, T, Hkv, D], v [B, T, Hkv, DV] with a ring and a state (make_case's), and
    Hedgehog weights [H, D, P]; ``strided``: q, k, v as views with padded rows and permuted heads."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    c = make_case(B, T, H, D, 2 * P, W, gate, pad, dtype, pos, seed=seed)
    c["ring"]["v"] = r(B, W - 1, H, DV).to(dtype).to(DEV)
    c["state"] = (torch.rand(B, H, 2 * P, DV, generator=g).to(DEV), c["state"][1])
    q, k, v = r(B, T, H, D).to(dtype), r(B, T, Hkv, D).to(dtype), r(B, T, Hkv, DV).to(dtype)
    if strided:
        q = q.transpose(1, 2).contiguous().transpose(1, 2)  # head stride T * D
        k = torch.cat([k, r(B, T, Hkv, 3).to(dtype)], -1)[..., :D]  # rows of D + 3
        v = torch.cat([r(B, T, 2, DV).to(dtype), v], 2)[:, :, 2:]  # slots before the heads (a fused GEMM's)
    wq, wk = (r(H, D, P) * 0.5).to(dtype), (r(H, D, P) * 0.5).to(dtype)
    log_gamma = (torch.rand(H, generator=g) - 0.5).to(DEV)
    drop = ("q_sm", "qf", "k_sm", "kf", "v", "gamma", "sm_scale")
    return {**{n: x for n, x in c.items() if n not in drop}, "q": q.to(DEV), "k": k.to(DEV), "v": v.to(DEV),
            "wq": wq.to(DEV), "wk": wk.to(DEV), "log_gamma": log_gamma}


def _f64(c):
    """The case in float64 (ring and state included) for the reference."""
    f = lambda x: x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x  # noqa: E731
    return {n: ({m: f(t) for m, t in x.items()} if isinstance(x, dict) else tuple(f(t) for t in x)
                if isinstance(x, tuple) else f(x)) for n, x in c.items()}


@pytest.mark.parametrize("W", [2, 9])
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("gate,H,Hkv", [(None, 2, 2), (None, 4, 2), ("scalar", 2, 2), ("scalar", 4, 2), ("channel", 4, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_hedgehog_window_decode_matches_reference(W, T, gate, pad, H, Hkv, dtype):
    """No gate, a gate per head, or one per key channel (``decay="channel"``: log_g and the ring's
    [.., H, F]) against the twin, ring and state included."""
    from linearize.kernels.linear_attn import fused_window_decode_hedgehog, window_decode_hedgehog_ref

    B, D, P, DV = 2, 24, 12, 20  # D and F = 2P not powers of two
    c = make_hedgehog_case(B, T, H, Hkv, D, P, DV, W, gate, pad, dtype, pos=37, seed=5, strided=T > 1)
    o_ref, ring_ref, (S_ref, z_ref) = window_decode_hedgehog_ref(**_f64(c), sm_scale=D ** -0.5)
    S, z = (x.clone() for x in c["state"])
    ring = {n: t.clone() for n, t in c["ring"].items()}
    o = fused_window_decode_hedgehog(**{**c, "ring": ring, "state": (S, z)}, sm_scale=D ** -0.5)
    assert o.dtype == dtype and o.shape == (B, T, H, DV)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(o.double(), o_ref, **tol)
    torch.testing.assert_close(S.double(), S_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(z.double(), z_ref, atol=1e-5, rtol=1e-5)
    for n in ("k", "v", "log_g", "valid"):  # raw keys and values copied per query head, flags 0 / 1
        torch.testing.assert_close(ring[n].double(), ring_ref[n], atol=0, rtol=0, msg=n)
    torch.testing.assert_close(ring["phi_k"].double(), ring_ref["phi_k"], atol=1e-6, rtol=1e-5)



def window_prefill_ref(q_sm, qf, k_sm, kf, v, *, log_g=None, valid=None, buf, state, gamma, sm_scale):
    """The PyTorch twin of ``window_prefill``: the layer's own PyTorch math (``linearize.attention.linear_attention``
    with a prefix) over the buffer and the chunk. It lives here, not in kernels/, since kernels never
    import the library."""
    B, T = v.shape[:2]
    W1 = buf["k"].shape[1]
    cat = lambda a, b: torch.cat([a.to(b.dtype), b], 1)  # noqa: E731
    cur_valid = torch.ones(B, T, dtype=torch.bool, device=v.device) if valid is None else valid.bool()
    return linear_attention(
        qf, cat(buf["phi_k"], kf), cat(buf["v"], v), log_g=None if log_g is None else cat(buf["log_g"], log_g.float()),
        initial_state=state, key_valid=torch.cat([buf["valid"] > 0, cur_valid], 1), window=W1 + 1, q_sm=q_sm,
        k_sm=cat(buf["k"], k_sm), sm_scale=sm_scale, window_weight=gamma, prefix=W1)


def test_fused_hedgehog_reference_is_the_layers_feature_map_and_window_step():
    """The twin equals the unfused step fed with the layer's own Hedgehog modules (k, v repeated as the
    layer's repeat_interleave does)."""
    from linearize.feature_maps import Hedgehog
    from linearize.kernels.linear_attn import window_decode_hedgehog_ref

    B, T, H, Hkv, D, P = 2, 3, 4, 2, 16, 8
    c = _f64(make_hedgehog_case(B, T, H, Hkv, D, P, D, 5, "scalar", True, torch.float32, pos=3, seed=6))
    fm_q, fm_k = Hedgehog(H, D, 2 * P).double().to(DEV), Hedgehog(H, D, 2 * P).double().to(DEV)
    fm_q.weight.data, fm_k.weight.data = c["wq"], c["wk"]
    k, v = (x.repeat_interleave(H // Hkv, dim=2) for x in (c["k"], c["v"]))
    kw = dict(log_g=c["log_g"], valid=c["valid"], ring=c["ring"], state=c["state"], pos=c["pos"], sm_scale=0.3)
    o, ring, (S, z) = window_decode_ref(c["q"], fm_q(c["q"]), k, fm_k(k), v, gamma=c["log_gamma"].exp(), **kw)
    o2, ring2, (S2, z2) = window_decode_hedgehog_ref(c["q"], c["k"], c["v"], c["wq"], c["wk"],
                                                     log_gamma=c["log_gamma"], **kw)
    for a, b in ((o, o2), (S, S2), (z, z2), *((ring[n], ring2[n]) for n in ring)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("gate", ["scalar", "channel"])
def test_fused_hedgehog_window_decode_softcap_and_no_ring(gate):
    """Softcapped scores (gemma2) and W = 1 (no ring: the token itself is folded, with its own gate) on
    the fused kernel."""
    from linearize.kernels.linear_attn import fused_window_decode_hedgehog, window_decode_hedgehog_ref

    for W, softcap in ((1, None), (4, 2.0)):
        c = make_hedgehog_case(2, 2, 4, 1, 16, 8, 16, W, gate, True, torch.float32, pos=6, seed=7)
        o_ref, _, (S_ref, z_ref) = window_decode_hedgehog_ref(**_f64(c), sm_scale=0.25, softcap=softcap)
        S, z = (x.clone() for x in c["state"])
        o = fused_window_decode_hedgehog(**{**c, "state": (S, z)}, sm_scale=0.25, softcap=softcap)
        for a, b in ((o, o_ref), (S, S_ref), (z, z_ref)):
            torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5)


def test_opcheck_window_decode_ops():
    """Schema (the in-place arguments declared), fake tensors and dispatch of both decode ops."""
    from linearize.kernels import ops

    c = make_hedgehog_case(2, 2, 4, 2, 16, 8, 16, 5, "scalar", True, torch.float32, pos=3, seed=8)
    ring = [c["ring"][n] for n in ("k", "phi_k", "v", "log_g", "valid")]
    args = (c["q"], c["k"], c["v"], c["wq"], c["wk"], c["log_g"], c["valid"].float(), *ring, *c["state"], c["pos"],
            c["log_gamma"], 0.25, 0.0)
    torch.library.opcheck(ops.OPS["window_decode_hedgehog"], args)
    u = make_case(2, 2, 2, 16, 16, 5, "scalar", True, torch.float32, pos=3, seed=9)
    ring = [u["ring"][n] for n in ("k", "phi_k", "v", "log_g", "valid")]
    args = (u["q_sm"], u["qf"], u["k_sm"], u["kf"], u["v"], u["log_g"], u["valid"].float(), *ring, *u["state"],
            u["pos"], u["gamma"], 0.25, 0.0)
    torch.library.opcheck(ops.OPS["window_decode"], args)


def test_fused_hedgehog_window_decode_rejects_bad_input():
    from linearize.kernels.linear_attn import fused_window_decode_hedgehog

    c = make_hedgehog_case(2, 1, 4, 2, 16, 8, 16, 5, None, False, torch.float32, pos=3)
    with pytest.raises(ValueError, match="H a multiple of Hkv"):
        fused_window_decode_hedgehog(**{**c, "k": c["k"][:, :, :1].expand(2, 1, 3, 16)}, sm_scale=0.25)
    with pytest.raises(ValueError, match="one gate per head"):  # neither per head nor per channel (F = 16)
        fused_window_decode_hedgehog(**{**c, "log_g": torch.zeros(2, 1, 4, 15, device=DEV)}, sm_scale=0.25)


@pytest.mark.skipif(INTERPRET, reason="the interpreter runs the programs one after another: no race to find")
@pytest.mark.parametrize("B,T,H,Hkv", [(1, 1, 9, 3), (64, 1, 32, 8), (16, 4, 9, 3)])
def test_fused_hedgehog_window_decode_shared_valid_flags_on_gpu(B, T, H, Hkv):
    """At a real shape (many programs at once) the ring's valid flags, shared by a row's heads and
    written by the last head to have read them, come out exactly as the twin's, step after step."""
    from linearize.kernels.linear_attn import fused_window_decode_hedgehog, window_decode_hedgehog_ref

    c = make_hedgehog_case(B, T, H, Hkv, 64, 64, 64, 64, "scalar", True, torch.bfloat16, pos=37)
    for step in range(8):
        c["valid"] = torch.rand(B, T, generator=torch.Generator().manual_seed(step)).to(DEV) > 0.2
        o_ref, ring_ref, (S_ref, z_ref) = window_decode_hedgehog_ref(**_f64(c), sm_scale=0.125)
        o = fused_window_decode_hedgehog(**c, sm_scale=0.125)
        assert torch.equal(c["ring"]["valid"].double(), ring_ref["valid"]), step
        for a, b in ((o, o_ref), *zip(c["state"], (S_ref, z_ref))):
            assert ((a.double() - b).norm() / b.norm()).item() < 2e-2, step
        c["ring"] = {n: t.to(torch.bfloat16 if n in ("k", "v") else torch.float32) for n, t in ring_ref.items()}
        c["state"] = (S_ref.float(), z_ref.float())
        c["pos"] = c["pos"] + T
