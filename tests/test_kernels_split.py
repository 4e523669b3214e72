"""The split-time inference forward (``split_time_fwd`` in kernels/linear_attn/chunk.py) against the float64 reference.

Runs under TRITON_INTERPRET=1 on CPU (how CI runs it) or on a GPU."""

from __future__ import annotations

import os

import pytest
import torch

la = pytest.importorskip("linearize.kernels.linear_attn")
from linearize.kernels.linear_attn import chunk as split_mod  # noqa: E402  (the split-time pass lives in chunk.py)
from conftest import rel_err

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
pytestmark = pytest.mark.skipif(not (HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1"),
                                reason="no GPU and TRITON_INTERPRET=1 not exported: Triton kernels cannot run")



CASES = {
    # id: (B, T, H, F, Dv, gate, h0, normalize, splits)
    "T200-2-segments": (2, 200, 3, 16, 24, False, False, True, 3),
    "T200-gate-h0": (2, 200, 3, 16, 24, True, True, True, 3),
    "T330-6-segments-gate": (1, 330, 2, 32, 16, True, False, True, 6),
    "T130-last-segment-2-tokens-h0": (2, 130, 2, 16, 16, False, True, True, 5),
    "unnormalized-gate-h0": (1, 256, 2, 16, 16, True, True, False, 4),
    "more-splits-than-chunks": (1, 100, 2, 16, 16, True, False, True, 50),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_split_forward_matches_float64_reference(case, monkeypatch):
    B, T, H, F, Dv, gate, h0, normalize, n = CASES[case]
    g = torch.Generator().manual_seed(1)
    q = torch.rand(B, T, H, F, generator=g, dtype=torch.float64)
    k = torch.rand(B, T, H, F, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, H, Dv, generator=g, dtype=torch.float64)
    lg = -torch.rand(B, T, H, generator=g, dtype=torch.float64) * 0.2 if gate else None
    init = (torch.rand(B, H, F, Dv, generator=g, dtype=torch.float64) * 3,
            torch.rand(B, H, F, generator=g, dtype=torch.float64) * 3) if h0 else None
    o_ref, (S_ref, z_ref) = la.linear_attn_ref(q, k, v, log_g=lg, normalize=normalize, initial_state=init,
                                               output_final_state=True)
    calls = []
    real = split_mod.split_time_fwd
    monkeypatch.setattr(split_mod, "split_time_fwd", lambda *a, **kw: calls.append(a[9]) or real(*a, **kw))
    dev = lambda x: None if x is None else x.float().to(DEVICE)  # noqa: E731
    o, (S, z) = la.chunk_linear_attn(dev(q), dev(k), dev(v), log_g=dev(lg), normalize=normalize,
                                     initial_state=None if init is None else tuple(map(dev, init)),
                                     output_final_state=True, num_splits=n)
    assert calls == [n], "the split path did not run"
    for name, a, b in (("o", o, o_ref), ("S", S, S_ref), ("z", z, z_ref)):
        assert rel_err(a.cpu(), b) < 2e-5, f"{name}: relative RMS {rel_err(a.cpu(), b):.2e}"


def test_split_keeps_fp32_states_under_bf16_autocast():
    """Evaluation under ``accelerate``'s bf16 autocast runs the split forward with autocast on: the scan
    over the segments' states must stay in fp32 (a bf16 einsum there rounds every entering state to 3
    digits and returns a bf16 final state for the cache)."""
    g = torch.Generator().manual_seed(3)
    B, T, H, F, Dv = 1, 200, 2, 16, 16
    q, k = torch.rand(B, T, H, F, generator=g), torch.rand(B, T, H, F, generator=g)
    v, lg = torch.randn(B, T, H, Dv, generator=g), -torch.rand(B, T, H, generator=g) * 0.05
    init = (torch.rand(B, H, F, Dv, generator=g) * 3, torch.rand(B, H, F, generator=g) * 3)
    args = [x.to(DEVICE) for x in (q, k, v)]
    kw = dict(log_g=lg.to(DEVICE), initial_state=tuple(x.to(DEVICE) for x in init), output_final_state=True,
              num_splits=4)
    o, (S, z) = la.chunk_linear_attn(*args, **kw)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        o_ac, (S_ac, z_ac) = la.chunk_linear_attn(*args, **kw)
    assert S_ac.dtype == z_ac.dtype == torch.float32
    for name, a, b in (("o", o_ac, o), ("S", S_ac, S), ("z", z_ac, z)):
        assert rel_err(a.float().cpu(), b.cpu()) < 1e-6, f"{name}: relative RMS {rel_err(a.float().cpu(), b.cpu()):.2e}"


def test_split_is_skipped_when_gradients_are_needed(monkeypatch):
    monkeypatch.setattr(split_mod, "split_time_fwd", lambda *a, **kw: pytest.fail("split ran under autograd"))
    q = torch.rand(1, 130, 2, 16, device=DEVICE, requires_grad=True)
    k, v = torch.rand(1, 130, 2, 16, device=DEVICE), torch.randn(1, 130, 2, 16, device=DEVICE)
    o, _ = la.chunk_linear_attn(q, k, v, num_splits=3)
    o.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_split_segments_see_the_state_of_earlier_ones():
    """A scan that drops the earlier segments' states fails here: late queries then miss early keys."""
    T = 192
    q = torch.ones(1, T, 1, 16, device=DEVICE)
    k = torch.zeros(1, T, 1, 16, device=DEVICE)
    k[0, 0] = 1.0  # only the first key carries weight
    v = torch.zeros(1, T, 1, 16, device=DEVICE)
    v[0, 0] = 5.0
    o, (S, _) = la.chunk_linear_attn(q, k, v, output_final_state=True, num_splits=3)
    assert torch.allclose(o[0, -1, 0], torch.full((16,), 5.0, device=DEVICE), atol=1e-4)
    assert torch.allclose(S[0, 0], torch.full((16, 16), 5.0, device=DEVICE))


def test_auto_splits_is_one_on_cpu():
    q = torch.zeros(1, 4096, 2, 16)
    assert split_mod.auto_splits(q, q) == 1


@pytest.mark.parametrize("gate,h0,splits,F", [(False, False, 1, 16), (True, True, 1, 16), (True, False, 4, 16),
                                               (False, True, 3, 16), (True, True, 2, 20)])  # F=20: padded to 32
def test_numerator_and_denominator_in_one_pass_equal_two_passes(gate, h0, splits, F):
    """chunk_num_den (the window hybrid's linear terms, one pass, split or not) against the float64
    reference's unnormalized passes: values v for the numerator, ones for the denominator."""
    from linearize.kernels.linear_attn.chunk import chunk_num_den

    B, T, H, Dv = 2, 150, 3, 24
    g = torch.Generator().manual_seed(7)
    q, k = torch.rand(B, T, H, F, generator=g, dtype=torch.float64), torch.rand(B, T, H, F, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, H, Dv, generator=g, dtype=torch.float64)
    lg = -torch.rand(B, T, H, generator=g, dtype=torch.float64) * 0.2 if gate else None
    init = (torch.rand(B, H, F, Dv, generator=g, dtype=torch.float64),
            torch.rand(B, H, F, generator=g, dtype=torch.float64)) if h0 else None
    n_ref, (S_ref, z_ref) = la.linear_attn_ref(q, k, v, log_g=lg, normalize=False, initial_state=init,
                                               output_final_state=True)
    ones_init = None if init is None else (init[1][..., None].expand(B, H, F, 16), init[1])
    d_ref, _ = la.linear_attn_ref(q, k, torch.ones(B, T, H, 16, dtype=torch.float64), log_g=lg, normalize=False,
                                  initial_state=ones_init)
    dev = lambda x: None if x is None else x.float().to(DEVICE)  # noqa: E731
    with torch.no_grad():
        n, d, (S, z) = chunk_num_den(dev(q), dev(k), dev(v), log_g=dev(lg), num_splits=splits,
                                     initial_state=None if init is None else tuple(map(dev, init)))
    assert d.shape == (H, B * T)
    d = d.view(H, B, T).permute(1, 2, 0)
    for name, a, b in (("n", n, n_ref), ("d", d, d_ref[..., 0]), ("S", S, S_ref), ("z", z, z_ref)):
        assert rel_err(a.cpu(), b) < 2e-5, f"{name}: relative RMS {rel_err(a.cpu(), b):.2e}"
    with pytest.raises(RuntimeError, match="no backward"):
        chunk_num_den(dev(q).requires_grad_(), dev(k), dev(v))
    assert S.shape == (B, H, F, Dv) and z.shape == (B, H, F)


@pytest.mark.parametrize("gate", [False, True])
def test_window_rows_of_one_length_equal_the_packed_path(gate):
    """The window hybrid over B rows of one length (slices; one pass without gradients) gives the packed
    varlen path's outputs, final state and gradients."""
    B, T, H, F, Dv, W = 2, 140, 2, 16, 16, 24
    g = torch.Generator().manual_seed(3)
    mk = lambda *s: torch.rand(*s, generator=g).to(DEVICE)  # noqa: E731
    q, k, v = mk(B, T, H, F), mk(B, T, H, F), mk(B, T, H, Dv) - 0.5
    qs, ks = mk(B, T, H, 16) - 0.5, mk(B, T, H, 16) - 0.5
    lg = -mk(B, T, H) * 0.1 if gate else None
    kw = dict(window=W, q_sm=qs, k_sm=ks, sm_scale=0.5, window_weight=0.7, output_final_state=True)
    cu = torch.arange(0, (B + 1) * T, T, device=DEVICE, dtype=torch.int32)
    flat = lambda x: None if x is None else x.reshape(1, B * T, *x.shape[2:])  # noqa: E731
    with torch.no_grad():
        o_rows, (S_rows, z_rows) = la.chunk_linear_attn(q, k, v, log_g=lg, **kw)
        o_pack, (S_pack, z_pack) = la.chunk_linear_attn(
            flat(q), flat(k), flat(v), log_g=flat(lg), cu_seqlens=cu,
            **{**kw, "q_sm": flat(qs), "k_sm": flat(ks)})
    assert rel_err(o_rows.cpu(), o_pack.view(B, T, H, Dv).cpu()) < 1e-5
    assert rel_err(S_rows.cpu(), S_pack.cpu()) < 1e-5 and rel_err(z_rows.cpu(), z_pack.cpu()) < 1e-5
    # with gradients (two passes, slices): the same gradients as the packed path
    grads = []
    for rows in (True, False):
        qq = q.clone().requires_grad_()
        if rows:
            o, _ = la.chunk_linear_attn(qq, k, v, log_g=lg, **kw)
        else:
            o, _ = la.chunk_linear_attn(flat(qq), flat(k), flat(v), log_g=flat(lg), cu_seqlens=cu,
                                        **{**kw, "q_sm": flat(qs), "k_sm": flat(ks)})
        o.float().pow(2).sum().backward()
        grads.append(qq.grad)
    assert rel_err(grads[0].cpu(), grads[1].cpu()) < 1e-5


# -- the gated delta rule's split state pass (in kernels/gated_delta/chunk.py) ------------------------------

GDN_CASES = {
    # id: (B, T, H, K, V, h0, splits, dtype)
    "T200-3-segments-h0": (2, 200, 2, 16, 32, True, 3, torch.float32),
    "T330-6-segments": (1, 330, 3, 32, 16, False, 6, torch.float32),
    "K20-not-a-power-of-2-h0": (2, 130, 2, 20, 24, True, 5, torch.float32),
    "bf16-h0": (1, 260, 2, 64, 64, True, 4, torch.bfloat16),
}


def _gdn_inputs(B, T, H, K, V, h0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    gate = -torch.rand(B, T, H, generator=g, dtype=torch.float64) * 0.3
    beta = torch.rand(B, T, H, generator=g, dtype=torch.float64)
    init = torch.randn(B, H, K, V, generator=g, dtype=torch.float64) if h0 else None
    return q, k, v, gate, beta, init


@pytest.mark.parametrize("case", list(GDN_CASES), ids=list(GDN_CASES))
def test_gated_delta_split_matches_float64_reference(case, monkeypatch):
    """Outputs and final state of the split state pass (passes 1-3, the scan's composition of the
    segments' [M | R]) against the token loop in float64, and against the unsplit kernel in bf16."""
    from linearize.kernels.gated_delta import chunk_gated_delta_rule, gated_delta_rule_ref
    from linearize.kernels.gated_delta import chunk as gsplit

    B, T, H, K, V, h0, n, dtype = GDN_CASES[case]
    q, k, v, gate, beta, init = _gdn_inputs(B, T, H, K, V, h0)
    q, k, v = (x.to(dtype).double() for x in (q, k, v))  # the reference sees the kernel's rounded inputs
    o_ref, S_ref = gated_delta_rule_ref(q, k, v, g=gate, beta=beta, initial_state=init, output_final_state=True)
    calls = []
    real = gsplit.split_fwd_h
    monkeypatch.setattr(gsplit, "split_fwd_h", lambda *a: calls.append(a[-1]) or real(*a))
    dev = lambda x, dt=torch.float32: None if x is None else x.to(dt).to(DEVICE)  # noqa: E731
    args = (dev(q, dtype), dev(k, dtype), dev(v, dtype))
    kw = dict(g=dev(gate), beta=dev(beta), initial_state=dev(init), output_final_state=True)
    o, S = chunk_gated_delta_rule(*args, **kw, num_splits=n)
    assert calls == [n], "the split path did not run"
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert o.dtype == dtype and S.dtype == torch.float32
    assert rel_err(o.cpu(), o_ref) < tol, f"o: relative RMS {rel_err(o.cpu(), o_ref):.2e}"
    assert rel_err(S.cpu(), S_ref) < tol, f"S: relative RMS {rel_err(S.cpu(), S_ref):.2e}"
    if dtype != torch.float32:  # as close to the float64 loop as the unsplit kernel is
        o1, S1 = chunk_gated_delta_rule(*args, **kw, num_splits=1)
        assert rel_err(o.cpu(), o_ref) < 1.5 * rel_err(o1.cpu(), o_ref) + 1e-3
        assert rel_err(S.cpu(), S_ref) < 1.5 * rel_err(S1.cpu(), S_ref) + 1e-3


def test_gated_delta_split_segments_carry_the_decayed_state():
    """One write at t=0, then pure decay: every later output and the final state are that write scaled
    by the decay since t=0. A scan that drops M (the decay of earlier segments) or R fails here."""
    from linearize.kernels.gated_delta import chunk_gated_delta_rule

    T, K = 200, 16
    q = torch.zeros(1, T, 1, K, device=DEVICE)
    q[..., 0] = 1.0
    k = torch.zeros(1, T, 1, K, device=DEVICE)
    k[0, 0, 0, 0] = 1.0  # only the first token writes
    v = torch.full((1, T, 1, K), 3.0, device=DEVICE)
    beta = torch.zeros(1, T, 1, device=DEVICE)
    beta[0, 0] = 1.0
    gate = torch.full((1, T, 1), -0.01, device=DEVICE)
    o, S = chunk_gated_delta_rule(q, k, v, g=gate, beta=beta, scale=1.0, output_final_state=True, num_splits=3)
    decay = torch.exp(-0.01 * torch.arange(T, dtype=torch.float64))  # o_t = 3 exp(sum g_1..g_t) (g_0 decays nothing yet)
    assert torch.allclose(o[0, :, 0, 0].double().cpu(), 3 * decay, rtol=1e-4)
    assert torch.allclose(S[0, 0, 0].double().cpu(), 3 * decay[-1].expand(K), rtol=1e-4)


def test_gated_delta_split_is_skipped_under_autograd(monkeypatch):
    from linearize.kernels.gated_delta import chunk_gated_delta_rule
    from linearize.kernels.gated_delta import chunk as gsplit

    monkeypatch.setattr(gsplit, "split_fwd_h", lambda *a: pytest.fail("split ran under autograd"))
    q, k, v, gate, beta, _ = (x.float().to(DEVICE) if x is not None else None
                              for x in _gdn_inputs(1, 130, 2, 16, 16, False))
    q.requires_grad_()
    o, _ = chunk_gated_delta_rule(q, k, v, g=gate, beta=beta, num_splits=3)
    o.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    big = torch.zeros(1, 130, 1, 160, device=DEVICE)
    with pytest.raises(ValueError, match="num_splits=3 takes key dims up to 128"):
        chunk_gated_delta_rule(big, big, big, g=gate[..., :1], beta=beta[..., :1], num_splits=3)


def test_gated_delta_splits_only_on_request(monkeypatch):
    # the default (num_splits=None) never splits: measured on an H100, the split lost at 8K and
    # gained nothing at 64K (kernels.md); an explicit num_splits still does
    from linearize.kernels.gated_delta import chunk_gated_delta_rule
    from linearize.kernels.gated_delta import chunk as gsplit

    calls = []
    real = gsplit.split_fwd_h
    monkeypatch.setattr(gsplit, "split_fwd_h", lambda *a: calls.append(a[-1]) or real(*a))
    q, k, v, gate, beta, _ = (x.float().to(DEVICE) if x is not None else None
                              for x in _gdn_inputs(1, 130, 2, 16, 16, False))
    with torch.no_grad():
        o1, _ = chunk_gated_delta_rule(q, k, v, g=gate, beta=beta)
        assert calls == []
        o2, _ = chunk_gated_delta_rule(q, k, v, g=gate, beta=beta, num_splits=2)
    assert calls == [2]
    torch.testing.assert_close(o2, o1, atol=1e-5, rtol=1e-4)


def test_gated_delta_splits_for_rule():
    """The candidate rule the bench measures on an H100/H200 (132 SMs): one prompt of the SmolLM2 shape
    (9 heads of 64), as one call and as 8K chunks; not at B=8, not with Llama-1B's 32 heads, not for
    short inputs."""
    from linearize.kernels.gated_delta.chunk import splits_for

    assert splits_for(1, 65536, 9, 64, 132) == 15
    assert splits_for(1, 8192, 9, 64, 132) == 8
    assert splits_for(8, 65536, 9, 64, 132) == 1
    assert splits_for(1, 65536, 32, 64, 132) == 1
    assert splits_for(1, 1000, 9, 64, 132) == 1
