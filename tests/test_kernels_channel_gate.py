"""The per-channel gate (GLA form) chunk kernels (kernels/linear_attn/chunk_channel.py) against the
float64 step-by-step reference: outputs, final state and every gradient, with strong decays and
resets (log g = -128), plus the torch.library ops (opcheck, torch.compile) and the reset semantics.

Without a GPU the kernels run only in the interpreter: export TRITON_INTERPRET=1 before pytest
starts. The interpreter cannot do bf16 dots, so on CPU the kernels are checked in fp32 and fp16
(bf16 on CUDA only). Shapes are small, yet the interpreter takes 5-10 minutes of one core for the file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as Fn
from conftest import rel_err

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

la = pytest.importorskip("linearize.kernels.linear_attn")

DEVICE = "cuda" if HAS_CUDA else "cpu"
needs_triton = pytest.mark.skipif(not (HAS_CUDA or INTERPRET),
                                  reason="no GPU and TRITON_INTERPRET=1 not exported: Triton kernels cannot run")

# Relative-RMS tolerances per input dtype (errors are ||x - ref|| / ||ref||), as in test_kernels_linear_attn.py.
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


@dataclass(frozen=True)
class Case:
    id: str
    T: int = 37
    F: int = 16
    D: int = 16
    normalize: bool = True
    h0: bool = False
    resets: bool = True
    dtype: torch.dtype = torch.float32
    B: int = 2
    H: int = 2
    reset_at: tuple = ()  # steps at which every channel of every head of every row resets (documents)
    strong: bool = False  # every other channel decays by log g = -30 a step


# The kernels work in chunks of 64 steps (CONFIG["BT"]) cut into sub-chunks of 16: T around 64 and
# resets at chunk (64) and sub-chunk (16, 96) boundaries and inside them (100) are the edge cases. The
# interpreter runs one program per row and head: the wide (F 40-64) and long (T 110) cases take one or
# two, the default B=2, H=2 cases check the strides between rows and heads.
CASES = [
    Case("T37-F16-D16-h0", h0=True),
    Case("T37-F32-D16-unnormalized", F=32, normalize=False, resets=False),
    Case("T1-F16-D32-h0", T=1, D=32, h0=True, resets=False),
    Case("T1-F16-unnormalized", T=1, normalize=False),
    Case("T37-F40-D32-padded-features-h0", F=40, D=32, h0=True, B=1),
    Case("T37-F64-D32-unnormalized-h0", F=64, D=32, normalize=False, h0=True, B=1, H=1),
    Case("T20-F64-D16-fp16", T=20, F=64, dtype=torch.float16, B=1, H=1),
    Case("T37-F32-D16-fp16-unnormalized-h0", F=32, normalize=False, h0=True, dtype=torch.float16),
    Case("T63-F16-D16", T=63, B=1),
    Case("T64-F16-D16-h0-unnormalized", T=64, B=1, h0=True, normalize=False),
    Case("T65-F32-D16", T=65, F=32, B=1),
    Case("T110-F32-D32-h0-resets-16-64-96-100", T=110, F=32, D=32, h0=True, reset_at=(16, 64, 96, 100), B=1),
    Case("T80-F64-D16-strong-decay-unnormalized", T=80, F=64, normalize=False, strong=True, B=1),
    Case("T80-F32-D16-fp16-h0-resets-64", T=80, F=32, h0=True, reset_at=(64,), dtype=torch.float16, B=1),
] + ([Case("T70-F64-D32-bf16-h0", T=70, F=64, D=32, h0=True, dtype=torch.bfloat16)] if HAS_CUDA else [])


def make_inputs(c: Case, seed=0):
    """Non-negative features, strong per-channel decays (log g = logsigmoid(3 randn - 2)), some
    channels of some steps reset to -128, and an fp32 initial state."""
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(c.B, c.T, c.H, c.F, generator=g)
    k = torch.rand(c.B, c.T, c.H, c.F, generator=g)
    v = torch.randn(c.B, c.T, c.H, c.D, generator=g)
    log_g = Fn.logsigmoid(torch.randn(c.B, c.T, c.H, c.F, generator=g) * 3 - 2)
    if c.resets:
        log_g[0, 7 % c.T] = -128.0  # every channel of every head of row 0
        log_g[-1, 20 % c.T, -1, ::3] = -128.0  # some channels of the last head of the last row
        log_g[:, (c.T - 1) // 2, 0, :4] = -128.0
    if c.strong:
        log_g[..., ::2] = -30.0
    for t in c.reset_at:
        log_g[:, t] = -128.0
    h0 = (torch.randn(c.B, c.H, c.F, c.D, generator=g), torch.rand(c.B, c.H, c.F, generator=g) * 5) if c.h0 else None
    dev = lambda x: x.to(DEVICE)  # noqa: E731
    q, k, v = (dev(x).to(c.dtype) for x in (q, k, v))
    return q, k, v, dev(log_g), (None if h0 is None else tuple(dev(x) for x in h0))


def run_with_grads(fn, q, k, v, log_g, h0, normalize, *, seed=1, state_loss=True):
    """Outputs, final state and the gradients of <o, w> + <S_T, w2> + <z_T, w3> for every input
    (<o, w> alone without ``state_loss``: the final state then gets no gradient)."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, log_g, *(h0 or ()))]
    init = tuple(leaves[4:]) if h0 is not None else None
    if fn is la.linear_attn_channel_ref:
        o, (S, z) = fn(*leaves[:4], normalize=normalize, initial_state=init)
    else:
        o, (S, z) = fn(*leaves[:4], normalize=normalize, initial_state=init, output_final_state=True)
    g = torch.Generator().manual_seed(seed)
    w, w2, w3 = (torch.randn(x.shape, generator=g).to(DEVICE).double() for x in (o, S, z))
    loss = (o.double() * w).sum()
    if state_loss:
        loss = loss + (S.double() * w2).sum() + (z.double() * w3).sum()
    return o, S, z, torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True)


def assert_close(name, got, ref, tol):
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err = rel_err(got, ref)
    assert err <= tol, f"{name}: relative RMS error {err:.2e} > {tol:.0e}"


def test_reference_is_the_scalar_gate_reference_with_equal_channels():
    """A gate equal over the channels is chunk.py's scalar gate: the two references agree."""
    c = Case("ref", T=9, F=16, D=16, h0=True, resets=False)
    q, k, v, log_g, h0 = (x.double() if torch.is_tensor(x) else x for x in make_inputs(c))
    h0 = tuple(x.double() for x in h0)
    lg = log_g[..., :1]
    for normalize in (True, False):
        o, (S, z) = la.linear_attn_channel_ref(q, k, v, lg.expand_as(q), normalize=normalize, initial_state=h0)
        ro, (rS, rz) = la.linear_attn_ref(q, k, v, log_g=lg[..., 0], normalize=normalize, initial_state=h0,
                                          output_final_state=True)
        for a, b in ((o, ro), (S, rS), (z, rz)):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_chunk_channel_matches_float64_reference(case):
    q, k, v, log_g, h0 = make_inputs(case)
    o, S, z, grads = run_with_grads(la.chunk_linear_attn_channel, q, k, v, log_g, h0, case.normalize)
    f64 = [x.double() for x in (q, k, v, log_g)]
    h0_64 = None if h0 is None else tuple(x.double() for x in h0)
    ro, rS, rz, rgrads = run_with_grads(la.linear_attn_channel_ref, *f64, h0_64, case.normalize)
    tol = TOL[case.dtype]
    assert o.dtype == v.dtype and o.shape == v.shape and S.dtype == z.dtype == torch.float32
    assert_close("o", o, ro, tol)
    assert_close("S_T", S, rS, tol)
    assert_close("z_T", z, rz, tol)
    names = ["dq", "dk", "dv", "dlog_g"] + (["dS0", "dz0"] if h0 else [])
    for name, a, b in zip(names, grads, rgrads):
        if name == "dz0" and not case.normalize:
            a, b = a + 1, b + 1  # z0 only reaches the loss through z_T (mostly reset away): compare near 1
        # dlog_g is a reverse cumulative sum of differences: allow it a little more.
        assert_close(name, a, b, tol * (4 if name == "dlog_g" else 1))
    if h0 is None:  # the first gate multiplies a zero state
        assert grads[3][:, 0].abs().max() == 0


@needs_triton
@pytest.mark.parametrize("normalize", [True, False])
def test_gradients_without_a_final_state_loss(normalize):
    """A loss on o alone: the backward runs without a final-state gradient."""
    c = Case("o-only", F=32, h0=True, normalize=normalize)
    q, k, v, log_g, h0 = make_inputs(c, seed=2)
    *_, grads = run_with_grads(la.chunk_linear_attn_channel, q, k, v, log_g, h0, normalize, state_loss=False)
    *_, rgrads = run_with_grads(la.linear_attn_channel_ref, q.double(), k.double(), v.double(), log_g.double(),
                                tuple(x.double() for x in h0), normalize, state_loss=False)
    for name, a, b in zip(["dq", "dk", "dv", "dlog_g", "dS0", "dz0"], grads, rgrads):
        if name == "dz0" and not normalize:
            assert a.abs().max() == 0  # z0 reaches nothing
            continue
        assert_close(name, a, b, TOL[torch.float32] * (4 if name == "dlog_g" else 1))


@needs_triton
@pytest.mark.parametrize("T, t", [(40, 21), (140, 64), (140, 96)], ids=["in-chunk", "chunk-start", "sub-chunk-start"])
def test_reset_restarts_the_state(T, t):
    """log g = -128 at step t in every channel: the outputs from t on and the final state equal a
    run of the suffix alone from an empty state, and nothing up to t gets a gradient from them (not
    even rounding noise in dlog_g)."""
    c = Case("reset", T=T, F=32, D=16, h0=True, resets=False, B=1 if T > 64 else 2)
    q, k, v, log_g, h0 = make_inputs(c, seed=3)
    log_g[:, t] = -128.0
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, log_g, *h0)]
    o, (S, z) = la.chunk_linear_attn_channel(*leaves[:4], initial_state=tuple(leaves[4:]), output_final_state=True)
    so, (sS, sz) = la.chunk_linear_attn_channel(q[:, t:], k[:, t:], v[:, t:], log_g[:, t:], output_final_state=True)
    # Not bit for bit: past the reset the in-chunk cumulative gates carry the reset's -128, so their
    # differences are rounded at that magnitude (~4e-6), where the suffix's own are not.
    assert_close("o after the reset", o[:, t:], so, TOL[torch.float32])
    assert_close("S_T", S, sS, TOL[torch.float32])
    assert_close("z_T", z, sz, TOL[torch.float32])
    loss = (o[:, t:] * torch.randn_like(so)).sum() + S.sum() + z.sum()
    grads = torch.autograd.grad(loss, leaves)
    for name, gr in zip(["dq", "dk", "dv"], grads[:3]):
        assert gr[:, :t].abs().max() == 0, f"{name} before the reset"
    # the reset gate's own gradient is exactly 0 as well (the kernel's reverse sum stops there)
    assert grads[3][:, :t + 1].abs().max() == 0, "dlog_g up to the reset"
    assert grads[4].abs().max() == 0 and grads[5].abs().max() == 0


@needs_triton
@pytest.mark.parametrize("normalize", [True, False])
def test_a_document_gets_nothing_from_the_next(normalize):
    """Packed rows (resets at a sub-chunk start, a chunk start, inside a chunk): changing the loss on
    the last document of each row (its outputs and the final state) changes no gradient of any
    earlier step, bit for bit, and the reset gate's own gradient is exactly 0."""
    c = Case("docs", T=110, F=16, D=16, h0=True, resets=False, B=3, H=1, normalize=normalize)
    q, k, v, log_g, h0 = make_inputs(c, seed=4)
    starts = (16, 64, 100)  # the last document of row b starts there
    for b, t in enumerate(starts):
        log_g[b, t] = -128.0
    g = torch.Generator().manual_seed(5)
    out = []
    for trial in range(2):
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, log_g, *h0)]
        o, (S, z) = la.chunk_linear_attn_channel(*leaves[:4], normalize=normalize, initial_state=tuple(leaves[4:]),
                                                 output_final_state=True)
        if trial == 0:
            w, w2, w3 = (torch.randn(x.shape, generator=g).to(x.device) for x in (o, S, z))
        else:  # another loss on the last documents only
            for b, t in enumerate(starts):
                w[b, t:] = torch.randn(w[b, t:].shape, generator=g).to(w.device)
            w2, w3 = (torch.randn(x.shape, generator=g).to(x.device) for x in (w2, w3))
        loss = (o * w).sum() + (S * w2).sum() + (z * w3).sum()
        out.append(torch.autograd.grad(loss, leaves))
    for name, a, b_ in zip(["dq", "dk", "dv", "dlog_g"], out[0][:4], out[1][:4]):
        for b, t in enumerate(starts):
            assert torch.equal(a[b, :t], b_[b, :t]), f"{name} before the reset at {t}"
            assert not torch.equal(a[b, t:], b_[b, t:]), f"{name} after the reset at {t}: the loss did change"
    for b, t in enumerate(starts):
        assert out[0][3][b, t].abs().max() == 0 and out[1][3][b, t].abs().max() == 0, "the reset gate's gradient"
    for name, a, b_ in zip(["dS0", "dz0"], out[0][4:], out[1][4:]):
        assert torch.equal(a, b_), name


@needs_triton
@pytest.mark.parametrize("bt, bc", [(16, 16), (32, 16), (64, 32)])
def test_other_chunk_lengths(bt, bc, monkeypatch):
    """CONFIG's chunk length and sub-chunk are tunable: other splits give the same results."""
    from linearize.kernels.linear_attn import chunk_channel

    monkeypatch.setitem(chunk_channel.CONFIG, "BT", bt)
    monkeypatch.setitem(chunk_channel.CONFIG, "BC", bc)
    c = Case("cfg", T=70, F=32, D=16, h0=True, reset_at=(32,), B=1)
    q, k, v, log_g, h0 = make_inputs(c, seed=6)
    o, S, z, grads = run_with_grads(la.chunk_linear_attn_channel, q, k, v, log_g, h0, True)
    f64 = [x.double() for x in (q, k, v, log_g)]
    ro, rS, rz, rgrads = run_with_grads(la.linear_attn_channel_ref, *f64, tuple(x.double() for x in h0), True)
    for name, a, b in zip(["o", "S_T", "z_T", "dq", "dk", "dv", "dlog_g", "dS0", "dz0"], (o, S, z, *grads),
                          (ro, rS, rz, *rgrads)):
        assert_close(name, a, b, TOL[torch.float32] * (4 if name == "dlog_g" else 1))


@pytest.fixture
def short_chunks(monkeypatch):
    """Chunks of 16 (one sub-chunk): the op-level checks below run the kernels many times on a few
    steps; the interpreter's time goes with the chunk length, not with T."""
    from linearize.kernels.linear_attn import chunk_channel

    monkeypatch.setitem(chunk_channel.CONFIG, "BT", 16)
    monkeypatch.setitem(chunk_channel.CONFIG, "BC", 16)


def _op_inputs(T=9, F=16, D=16, seed=0):
    c = Case("op", T=T, F=F, D=D, h0=True)
    q, k, v, log_g, (S0, z0) = make_inputs(c, seed)
    return [x.requires_grad_() for x in (q, k, v, log_g, S0, z0)]


@needs_triton
@pytest.mark.parametrize("normalize", [True, False])
def test_opcheck_chunk_linear_attn_channel(normalize, short_chunks):
    from linearize.kernels.linear_attn import chunk_channel

    args = _op_inputs()
    torch.library.opcheck(chunk_channel.chunk_linear_attn_channel_fwd_op, (*args, normalize, 1e-6, True))
    if normalize:  # without initial state
        torch.library.opcheck(chunk_channel.chunk_linear_attn_channel_fwd_op, (*args[:4], None, None, True, 1e-6, True),
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@needs_triton
def test_compiles_without_graph_breaks(short_chunks):
    """torch.compile(fullgraph=True) traces the ops forward and backward (aot_eager: no Inductor)."""
    args = _op_inputs(T=5)

    def f(q, k, v, log_g, S0, z0):
        o, (S, z) = la.chunk_linear_attn_channel(q, k, v, log_g, initial_state=(S0, z0), output_final_state=True)
        return (o * o).sum() + S.sum() + z.sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    grads = torch.autograd.grad(compiled(*args), args)
    ref = torch.autograd.grad(f(*args), args)
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b)


@needs_triton
@pytest.mark.parametrize("T, n, h0", [(70, 3, True), (90, 2, False), (40, 4, True)],
                         ids=["T70-3-segments-h0", "T90-2-segments", "T40-more-segments-than-chunks-h0"])
def test_split_time_forward_matches_the_sequential_one(T, n, h0, short_chunks):
    """Without gradients a prompt may be cut into segments run in parallel (``num_splits``, chosen from the
    GPU's size by ``auto_splits``): outputs and final state equal the float64 reference and the unsplit
    forward, with an initial state, resets inside and at segment boundaries (every channel, some
    channels), strong decays, and a length no segment count divides (zero tokens pad the last one)."""
    from linearize.kernels.linear_attn import chunk_channel

    # chunks of 16 here: segments of 32 (T70: boundaries 32, 64), 48 (T90) or 16 (T40: 3 segments, not 4)
    c = Case("split", T=T, F=32, D=16, h0=h0, reset_at=tuple(t for t in (16, 32, 50) if t < T), strong=T == 90, B=2)
    q, k, v, log_g, init = make_inputs(c, seed=4)
    with torch.no_grad():
        o1, (S1, z1) = la.chunk_linear_attn_channel(q, k, v, log_g, initial_state=init, output_final_state=True,
                                                    num_splits=1)
        on, (Sn, zn) = la.chunk_linear_attn_channel(q, k, v, log_g, initial_state=init, output_final_state=True,
                                                    num_splits=n)
    f64 = [x.double() for x in (q, k, v, log_g)]
    ro, (rS, rz) = la.linear_attn_channel_ref(*f64, normalize=True,
                                              initial_state=None if init is None else tuple(x.double() for x in init))
    for name, got, one, ref in (("o", on, o1, ro), ("S_T", Sn, S1, rS), ("z_T", zn, z1, rz)):
        assert_close(name, got, ref, TOL[torch.float32])
        torch.testing.assert_close(got, one, atol=1e-5, rtol=1e-5)
    # the segments really ran: the split forward's first pass asks for final states alone
    calls = []
    real = chunk_channel._states
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(chunk_channel, "_states", lambda *a, **kw: calls.append(kw.get("store_chunks", True)) or real(*a, **kw))
        with torch.no_grad():
            la.chunk_linear_attn_channel(q, k, v, log_g, initial_state=init, num_splits=n)
    assert calls == [False, True]
    # with gradients the sequential forward runs, whatever num_splits says (the backward needs its chunk states)
    o_grad, _ = la.chunk_linear_attn_channel(q.clone().requires_grad_(), k, v, log_g, initial_state=init, num_splits=n)
    torch.testing.assert_close(o_grad.detach(), o1)


@needs_triton
def test_split_time_forward_keeps_fp32_states_under_bf16_autocast(short_chunks):
    """Evaluation under ``accelerate``'s bf16 autocast runs the split forward with autocast on (2026-11-30:
    the scan's einsums then gave bf16 entering states, which the state kernel cannot take, and the run
    died in its evaluation): the states stay fp32 and the results equal those without autocast."""
    c = Case("split-autocast", T=96, F=16, D=16, h0=True, resets=False, B=1, H=2)
    q, k, v, log_g, init = make_inputs(c, seed=6)
    kw = dict(initial_state=init, output_final_state=True, num_splits=3)
    with torch.no_grad():
        o, (S, z) = la.chunk_linear_attn_channel(q, k, v, log_g, **kw)
        with torch.autocast(q.device.type, dtype=torch.bfloat16):
            o_ac, (S_ac, z_ac) = la.chunk_linear_attn_channel(q, k, v, log_g, **kw)
    assert S_ac.dtype == z_ac.dtype == torch.float32
    for name, got, want in (("o", o_ac, o), ("S_T", S_ac, S), ("z_T", z_ac, z)):
        torch.testing.assert_close(got.float(), want, atol=1e-6, rtol=1e-6, msg=name)


@needs_triton
def test_forward_splits_only_when_asked(monkeypatch, short_chunks):
    """Without gradients the forward cuts the time axis only when asked (num_splits, or
    CONFIG["splits"]): the split did not pay on an H200 (2026-11-30b), so the default runs unsplit."""
    from linearize.kernels.linear_attn import chunk_channel

    calls = []
    real = chunk_channel.split_fwd
    monkeypatch.setattr(chunk_channel, "split_fwd", lambda *a: calls.append(a[-1]) or real(*a))
    q, k, v, lg, _ = make_inputs(Case("T96-F16-D16", T=96, B=1), seed=4)
    with torch.no_grad():
        o, _ = la.chunk_linear_attn_channel(q, k, v, lg)
        assert calls == []
        o3, _ = la.chunk_linear_attn_channel(q, k, v, lg, num_splits=3)
        monkeypatch.setitem(chunk_channel.CONFIG, "splits", 2)
        o2, _ = la.chunk_linear_attn_channel(q, k, v, lg)
    assert calls == [3, 2]
    torch.testing.assert_close(o3, o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(o2, o, atol=1e-5, rtol=1e-5)


@needs_triton
def test_split_time_forward_keeps_small_decays_after_many_resets(short_chunks):
    """The states entering the segments come from sums of log gates over whole segments. After strong
    resets those sums are large, and the decay between two later segments, their difference, must keep
    its small value: the split forward matches the float64 reference (in fp32 the difference of the
    two sums is off by their rounding, 0.03 here, and the first segment's state by 3%)."""
    c = Case("split-resets", T=96, F=16, D=16, h0=True, resets=False, B=1, H=2)
    q, k, v, log_g, init = make_inputs(c, seed=5)
    log_g[:, :16] = -3e4  # 16 resets opening the first of 3 segments of 32 steps
    log_g[:, 16:64] = -1e-3  # then almost no decay: the first segment's state reaches the last
    log_g[:, 64:] = -1e-2
    with torch.no_grad():
        o, (S, z) = la.chunk_linear_attn_channel(q, k, v, log_g, initial_state=init, output_final_state=True,
                                                 num_splits=3)
    ro, (rS, rz) = la.linear_attn_channel_ref(*(x.double() for x in (q, k, v, log_g)), normalize=True,
                                              initial_state=tuple(x.double() for x in init))
    for name, got, ref in (("o", o, ro), ("S_T", S, rS), ("z_T", z, rz)):
        assert_close(name, got, ref, TOL[torch.float32])
