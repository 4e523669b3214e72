"""Attention sinks in the window kernels (kernels/linear_attn/window.py, ``sinks``): the first S keys
of each query's document join its softmax where they are outside its window. Checked under
TRITON_INTERPRET=1 (small shapes) against the float64 PyTorch twin: the output and the gradients
of every input, with packed documents (``q_lo``) and without, with sinks that hold the max (their
keys scaled up, so the max's gradient goes to a sink) and without; and the whole hybrid
(``chunk_linear_attn``) against the layer's reference (reference.py)."""

from __future__ import annotations

import pytest
import torch

from conftest import rel_err as rel
from test_kernels_linear_attn import DEVICE, la, needs_triton  # noqa: F401
from test_kernels_window_packed import starts_of


def _inputs(seqs, W, loud_sinks, S, seed):
    g = torch.Generator().manual_seed(seed)
    lens = [sum(s) for s in seqs]
    TT, H, D = sum(lens), 2, 16
    q_lo = torch.cat([starts_of(s) for s in seqs])
    pos = torch.cat([torch.arange(n) for n in lens])
    has = pos - W >= q_lo  # the state at t-W is t's document's: a linear row, else none
    R = TT + 3
    lin_idx = torch.where(has, torch.randperm(R, generator=g)[:TT], -1).to(torch.int32)
    n = torch.randn(R, H, D, generator=g) * 3
    d = torch.rand(R, H, generator=g) * 5 + 0.1
    q_sm, k_sm = (torch.randn(TT, H, D, generator=g) for _ in range(2))
    if loud_sinks:  # the sinks' scores dominate: the max (and its gradient) sits on a sink
        k_sm = torch.where((pos - q_lo < S)[:, None, None], 4 * k_sm.abs() * q_sm.sign().mean(0, keepdim=True).sign(),
                           k_sm)
    v = torch.randn(TT, H, D, generator=g)
    gamma = torch.tensor([0.4, 2.0])
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return (q_sm, k_sm, v, n, d, gamma), lin_idx, cu, q_lo, torch.randn(TT, H, D, generator=g)


@needs_triton
@pytest.mark.parametrize("seqs,W,S", [(((3, 30, 37), (5, 65)), 8, 4), (((2, 1, 60), (70,)), 40, 3),
                                      (((70,), (66,)), 1, 2), (((6, 64),), 5, 9)],
                         ids=["docs-3-30-37|5-65-W8-S4", "docs-2-1-60|70-W40-S3", "W1-S2", "S9-gt-W5"])
@pytest.mark.parametrize("packed", [True, False], ids=["q_lo", "sequences"])
@pytest.mark.parametrize("loud", [False, True], ids=["quiet-sinks", "max-on-sinks"])
def test_window_kernel_with_sinks_matches_its_reference(seqs, W, S, packed, loud):
    """window_softmax_attn(sinks=S) against window_softmax_attn_ref(sinks=S) in float64: o and the
    gradients of q_sm, k_sm, v, n_lin, d_lin and gamma (without q_lo each sequence is one document)."""
    from linearize.kernels.linear_attn.window import window_softmax_attn, window_softmax_attn_ref

    if not packed:
        seqs = tuple((sum(s),) for s in seqs)
    leaves, lin_idx, cu, q_lo, do = _inputs(seqs, W, loud, S, seed=5)
    kw = dict(window=W, sm_scale=0.4, sinks=S, q_lo=q_lo.to(DEVICE) if packed else None)
    results = []
    for fn, dt in [(window_softmax_attn, torch.float32), (window_softmax_attn_ref, torch.float64)]:
        xs = [x.to(DEVICE, dt).requires_grad_(True) for x in leaves]
        o = fn(*xs, lin_idx.to(DEVICE), cu.to(DEVICE), **kw)
        grads = torch.autograd.grad((o * do.to(DEVICE, dt)).sum(), xs)
        results.append((o, grads))
    (o, grads), (ro, rgrads) = results
    without = window_softmax_attn_ref(*(x.double() for x in leaves), lin_idx, cu, **{**kw, "sinks": 0})
    assert rel(without, ro.cpu()) > 1e-3  # the sinks change the output: the check below is not vacuous
    assert rel(o, ro) < 1e-5
    for name, a, b in zip(["dq_sm", "dk_sm", "dv", "dn_lin", "dd_lin", "dgamma"], grads, rgrads):
        assert rel(a, b) < 2e-5, name


@needs_triton
@pytest.mark.parametrize("W,S,gate", [(4, 2, False), (3, 5, True)], ids=["W4-S2", "W3-S5-gate"])
def test_hybrid_with_sinks_on_the_kernels_matches_the_layer_reference(W, S, gate):
    """chunk_linear_attn(window=W, sinks=S) over rows packing documents (q_lo) equals the layer's
    float64 reference run on each document alone: o and the gradients of every input."""
    from linearize.kernels.linear_attn.reference import linear_attn_ref

    g = torch.Generator().manual_seed(11)
    rows = [(5, 2, 18), (25,)]
    B, T, H, F, D = len(rows), 25, 2, 16, 16
    q, k = (torch.rand(B, T, H, F, generator=g) for _ in range(2))
    v, q_sm, k_sm = (torch.randn(B, T, H, D, generator=g) for _ in range(3))
    lg = -torch.rand(B, T, H, generator=g) * 0.3 if gate else None
    gamma = torch.tensor([0.7, 1.6])
    do = torch.randn(B, T, H, D, generator=g)
    leaves = [x for x in (q, k, v, lg, q_sm, k_sm, gamma) if x is not None]

    def run(xs, fn, dt, **kw):
        it = iter(xs)
        a, b, c = next(it), next(it), next(it)
        lgx = next(it) if gate else None
        qs, ks, gm = next(it), next(it), next(it)
        return fn(a, b, c, log_g=lgx, window=W, q_sm=qs, k_sm=ks, sm_scale=0.35, window_weight=gm, sinks=S, **kw)[0]

    xs = [x.to(DEVICE).requires_grad_(True) for x in leaves]
    q_lo = torch.stack([starts_of(r) for r in rows]).to(DEVICE)
    o = run(xs, la.chunk_linear_attn, torch.float32, q_lo=q_lo)
    grads = torch.autograd.grad((o * do.to(DEVICE)).sum(), xs)
    ref_o = torch.zeros(B, T, H, D, dtype=torch.float64)
    ref_g = [torch.zeros_like(x, dtype=torch.float64) for x in leaves]
    for b, r in enumerate(rows):
        a = 0
        for n in r:
            sl = slice(a, a + n)
            ys = [x[b:b + 1, sl].double().requires_grad_(True) if x.dim() > 1 else x.double().requires_grad_(True)
                  for x in leaves]
            ob = run(ys, linear_attn_ref, torch.float64)
            gb = torch.autograd.grad((ob * do[b:b + 1, sl].double()).sum(), ys)
            ref_o[b:b + 1, sl] = ob.detach()
            for i, (x, gx) in enumerate(zip(leaves, gb)):
                if x.dim() > 1:
                    ref_g[i][b:b + 1, sl] += gx
                else:
                    ref_g[i] += gx
            a += n
    assert rel(o, ref_o) < 1e-5
    for i, (a_, b_) in enumerate(zip(grads, ref_g)):
        assert rel(a_, b_) < 3e-5, i


@needs_triton
def test_opcheck_window_op_with_sinks():
    """The window op with sinks passes torch.library's checks (schema, fake tensor, autograd): what
    a compiled training step relies on."""
    from linearize.kernels import ops

    TT, H, D = 12, 2, 16
    g = torch.Generator().manual_seed(1)
    q_sm, k_sm, v = (torch.randn(TT, H, D, generator=g).to(DEVICE).requires_grad_() for _ in range(3))
    n_lin = torch.randn(TT, H, D, generator=g).to(DEVICE).requires_grad_()
    d_lin = (torch.rand(TT, H, generator=g) + 1).to(DEVICE).requires_grad_()
    gamma = torch.rand(H, generator=g).to(DEVICE).requires_grad_()
    # two sequences of 6, each two documents (2 + 4, 5 + 1); W = 2: linear rows where t-2 >= q_lo
    q_lo = torch.tensor([0, 0, 2, 2, 2, 2, 0, 0, 0, 0, 0, 5], dtype=torch.int32, device=DEVICE)
    lin_idx = torch.tensor([-1, -1, -1, -1, 0, 1, -1, -1, 2, 3, 4, -1], dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0, 6, 12], dtype=torch.int32, device=DEVICE)
    torch.library.opcheck(ops.OPS["window_attn_fwd"], (q_sm, k_sm, v, n_lin, d_lin, gamma, lin_idx, cu, 6, 2, 0.25, q_lo, 2))
