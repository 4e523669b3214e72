"""Gated delta rule kernels against a float64 PyTorch reference.

Runs the Triton kernels on CUDA, or on the CPU under TRITON_INTERPRET=1 (CI); skipped
otherwise. The reference tests (chunked form vs. loop form) always run.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from linearize.kernels.gated_delta import gated_delta_rule_chunk_ref, gated_delta_rule_ref
from conftest import rel_err

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAS_TRITON_DEVICE = INTERPRET or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
needs_triton = pytest.mark.skipif(not HAS_TRITON_DEVICE, reason="needs CUDA or TRITON_INTERPRET=1")

# relative RMS error allowed per input dtype (float32 on GPU uses true fp32 products). bf16
# stores w, u, v' and the chunk states in bf16 (as fla does): with an N(0, 1) initial state the
# CPU cases land at 0.4-2e-2; the GPU benchmark shapes at ~4e-3 (docs/reports/kernels.md).
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
GRAD_NAMES = ("q", "k", "v", "g", "beta", "h0")


@dataclass(frozen=True)
class Case:
    B: int
    T: int
    H: int
    K: int
    V: int
    dtype: torch.dtype = torch.float32
    h0: bool = True
    l2norm: bool = False
    cu: tuple[int, ...] | None = None       # packed varlen offsets (B must be 1)
    decay: float = 0.0                      # > 0: strong decay, g ~ -U(0, decay) per token


CASES = {
    "T1": Case(2, 1, 2, 32, 32),
    "T63-not-chunk-multiple": Case(1, 63, 2, 16, 32),
    "T64-one-full-chunk-no-h0": Case(1, 64, 1, 32, 32, h0=False),
    "T130-K32-V48-three-chunks": Case(1, 130, 1, 32, 48),
    "K24-V40-odd-dims": Case(2, 40, 1, 24, 40),
    "bf16-T70": Case(1, 70, 2, 32, 32, dtype=torch.bfloat16),
    "fp16-T70": Case(1, 70, 1, 32, 16, dtype=torch.float16),
    "qk-l2norm-inside": Case(1, 33, 2, 16, 16, l2norm=True),
    "varlen-1-66-63-20": Case(1, 150, 1, 16, 32, cu=(0, 1, 67, 130, 150)),
    "varlen-bf16-no-h0": Case(1, 100, 2, 32, 16, dtype=torch.bfloat16, h0=False, cu=(0, 64, 65, 100)),
    # in-chunk decay sums far below -88 (exp overflows in float32) in partial last chunks: the rows
    # past a chunk's end must not turn 0 * exp(large) into nan (this broke a bf16 training run)
    "strong-decay-T70": Case(1, 70, 2, 16, 16, decay=100.0),
    "strong-decay-varlen-bf16": Case(1, 100, 2, 16, 16, dtype=torch.bfloat16, cu=(0, 30, 100), decay=100.0),
}


def _inputs(c: Case, seed: int = 0):
    """Random inputs (never zeros): k unit-norm unless the kernel normalises, g in (-inf, 0)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (c.B, c.T, c.H)
    q = torch.randn(*shape, c.K, generator=gen)
    k = torch.randn(*shape, c.K, generator=gen)
    if not c.l2norm:
        k = F.normalize(k, dim=-1)
    v = torch.randn(*shape, c.V, generator=gen)
    g = F.logsigmoid(torch.randn(*shape, generator=gen) + 2.0)
    if c.decay:
        g = -torch.rand(*shape, generator=gen) * c.decay
    beta = torch.rand(*shape, generator=gen) * 0.9 + 0.05
    N = c.B if c.cu is None else len(c.cu) - 1
    h0 = torch.randn(N, c.H, c.K, c.V, generator=gen) if c.h0 else None
    return q, k, v, g, beta, h0



def _run(fn, q, k, v, g, beta, h0, do, dht, **kw):
    """Output, final state and the gradients of <o, do> + <ht, dht> w.r.t. all inputs."""
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta)] + ([h0.requires_grad_()] if h0 is not None else [])
    o, ht = fn(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True, **kw)
    loss = (o.double() * do.to(o.device, torch.float64)).sum() + (ht.double() * dht.to(ht.device, torch.float64)).sum()
    grads = torch.autograd.grad(loss, leaves)
    return o, ht, grads


# --------------------------------------------------------------------------------------
# the reference's chunked (WY / UT) form against its loop form: no Triton needed
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["T1", "T130-K32-V48-three-chunks", "varlen-1-66-63-20", "qk-l2norm-inside"])
def test_reference_chunk_form_matches_loop(name):
    c = CASES[name]
    q, k, v, g, beta, h0 = (x.double() if x is not None else None for x in _inputs(c))
    cu = None if c.cu is None else torch.tensor(c.cu, dtype=torch.int32)
    kw = dict(g=g, beta=beta, initial_state=h0, output_final_state=True, use_qk_l2norm=c.l2norm, cu_seqlens=cu)
    o1, s1 = gated_delta_rule_ref(q, k, v, **kw)
    o2, s2 = gated_delta_rule_chunk_ref(q, k, v, chunk_size=16, **kw)
    assert rel_err(o2, o1) < 1e-12 and rel_err(s2, s1) < 1e-12


# --------------------------------------------------------------------------------------
# Triton chunk kernels: outputs, final state and every gradient against float64
# --------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("name", list(CASES))
def test_chunk_matches_float64_reference(name):
    from linearize.kernels.gated_delta import chunk_gated_delta_rule

    c = CASES[name]
    ins = list(_inputs(c))
    ins[:3] = [x.to(c.dtype) for x in ins[:3]]   # the reference sees the same rounded inputs
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(c.B, c.T, c.H, c.V, generator=gen)
    dht = torch.randn(len(c.cu) - 1 if c.cu else c.B, c.H, c.K, c.V, generator=gen)
    cu = None if c.cu is None else torch.tensor(c.cu, dtype=torch.int32)

    ref = _run(gated_delta_rule_ref, *(x.double() if x is not None else None for x in ins), do, dht,
               use_qk_l2norm=c.l2norm, cu_seqlens=cu)
    dev = [x.to(DEVICE) if x is not None else None for x in ins]
    out = _run(chunk_gated_delta_rule, *dev, do, dht, use_qk_l2norm=c.l2norm,
               cu_seqlens=None if cu is None else cu.to(DEVICE))

    tol = TOL[c.dtype]
    assert out[0].dtype == c.dtype and out[0].shape == ref[0].shape
    assert out[1].dtype == torch.float32
    errs = {"o": rel_err(out[0], ref[0]), "ht": rel_err(out[1], ref[1])}
    errs.update({f"d{n}": rel_err(a, b) for n, a, b in zip(GRAD_NAMES, out[2], ref[2])})
    # strong decay: in-chunk cumulative sums reach -3000, where float32 resolves about 2e-4, and dg
    # is built from their differences; everything else keeps the dtype's tolerance
    bad = {n: e for n, e in errs.items() if not e < (10 * tol if c.decay and n == "dg" else tol)}
    assert not bad, f"relative RMS error over {tol}: {bad} (all: {errs})"


@needs_triton
def test_varlen_has_no_leakage_across_sequences():
    """Each packed sequence must equal the same sequence run alone, gradients included."""
    from linearize.kernels.gated_delta import chunk_gated_delta_rule

    c = CASES["varlen-1-66-63-20"]
    q, k, v, g, beta, h0 = (x.to(DEVICE) for x in _inputs(c, seed=3))
    do = torch.randn(c.B, c.T, c.H, c.V, device=DEVICE)
    cu = torch.tensor(c.cu, dtype=torch.int32, device=DEVICE)
    packed = _run(chunk_gated_delta_rule, q.clone(), k.clone(), v.clone(), g.clone(), beta.clone(), h0.clone(),
                  do, torch.zeros(h0.shape), cu_seqlens=cu)
    for n, (s, e) in enumerate(zip(c.cu[:-1], c.cu[1:])):
        one = _run(chunk_gated_delta_rule, *(x[:, s:e].clone() for x in (q, k, v, g, beta)), h0[n:n + 1].clone(),
                   do[:, s:e], torch.zeros(1, *h0.shape[1:]))
        assert rel_err(packed[0][:, s:e], one[0]) < 1e-5, f"output of sequence {n}"
        assert rel_err(packed[1][n:n + 1], one[1]) < 1e-5, f"final state of sequence {n}"
        for name, a, b in zip(GRAD_NAMES, packed[2], one[2]):
            a = a[n:n + 1] if name == "h0" else a[:, s:e]
            assert rel_err(a, b) < 1e-5, f"d{name} of sequence {n}"


def test_inference_solve_variant_choice():
    """The UT transform's inference variants go only where they lose nothing: tensor-core block products
    for 16-bit inputs without autograd (the inverse is rounded to the inputs' dtype there; one tf32
    product for bfloat16, whose mantissa is coarser than tf32's, three for float16, whose is not) and
    the merged diagonal inverse (up to K = 128 with tf32, 64 with tf32x3, which spills above), the K
    tile 32; training (the backward reads the stored inverse) and float32 keep fp32 FMA products and
    substitution."""
    from linearize.kernels.gated_delta import chunk as ch

    s = ch.UT_SOLVE
    assert s.t_prec(torch.bfloat16, store_tm=False) == "tf32" and s.t_prec(torch.float16, store_tm=False) == "tf32x3"
    assert s.t_prec(torch.bfloat16, store_tm=True) == "ieee" == s.t_prec(torch.float32, store_tm=False)
    assert s.diag_for("tf32", 128) == "merge" and s.diag_for("tf32", 129) == "subst"
    assert s.diag_for("tf32x3", 64) == "merge" and s.diag_for("tf32x3", 65) == "subst" and s.diag_for("ieee", 32) == "subst"
    assert s.block_k(64, "tf32") == 32 and s.block_k(64, "ieee") == 64
    assert ch.UTSolve(fast=False).t_prec(torch.bfloat16, store_tm=False) == "ieee"
    with pytest.raises(ValueError, match="UTSolve.diag"):
        ch.UTSolve(diag="lu")


@needs_triton
@pytest.mark.parametrize("K", [32, 128])
@pytest.mark.parametrize("diag", ["merge", "subst", "pow"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_inference_forward_solve_variants_match_reference(diag, dtype, K):
    """The no-grad forward (its own UT-transform variant) against float64, on keys so alike that
    (I + A)'s 16 x 16 blocks are far from I: A_ij ~ beta, so a wrong merge of the diagonal blocks, or a
    dropped factor of the product form (I - A)(I + A^2)(I + A^4)(I + A^8) (A^8 has entries in the
    thousands), shows. The product form runs on tf32x3 products only: with one tf32 product (bf16's
    default) its cancellations gave nan on the H100; it is a variant to compare, never a default."""
    from linearize.kernels.gated_delta import chunk as ch

    x3 = (("bfloat16", "tf32x3"), ("float16", "tf32x3"))
    solve = ch.UTSolve(diag=diag, **({"tprec": x3, "diag_max_k": 64} if diag == "pow" else {}))
    gen = torch.Generator().manual_seed(11)
    B, T, H = 1, 150, 2
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.ones(B, T, H, K) + 0.3 * torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, K, generator=gen)
    g = -torch.rand(B, T, H, generator=gen) * 0.01
    beta = torch.rand(B, T, H, generator=gen) * 0.1 + 0.85
    q, k, v = (x.to(dtype) for x in (q, k, v))
    ref, ref_s = gated_delta_rule_ref(*(x.double() for x in (q, k, v)), g=g.double(), beta=beta.double(),
                                      output_final_state=True)
    packed = [x.to(DEVICE).reshape(B * T, *x.shape[2:]).contiguous() for x in (q, k, v, g, beta)]
    packed[3] = packed[3].float()
    with torch.no_grad():  # the op's inference path (store_tm False), with this solve passed in
        cu, co, ci, NT = ch._meta(B, T, None, packed[0].device)
        o, s, _ = ch.chunk_fwd(*packed, K ** -0.5, None, True, cu, co, ci, NT, B, store_tm=False, solve=solve)
    o = o.view(B, T, H, K)
    assert rel_err(o, ref) < TOL[dtype] and rel_err(s, ref_s) < TOL[dtype], (rel_err(o, ref), rel_err(s, ref_s))


# --------------------------------------------------------------------------------------
# fused recurrent decode
# --------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("T,l2norm", [(1, False), (3, False), (2, True)], ids=["T1", "T3", "T2-l2norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_recurrent_step_matches_reference_and_updates_state_in_place(T, l2norm, dtype):
    from linearize.kernels.gated_delta import fused_recurrent_gated_delta_rule

    c = Case(2, T, 2, 32, 48, l2norm=l2norm)
    q, k, v, g, beta, h0 = _inputs(c, seed=5)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    ref_o, ref_s = gated_delta_rule_ref(*(x.double() for x in (q, k, v)), g=g.double(), beta=beta.double(),
                                        initial_state=h0.double(), output_final_state=True, use_qk_l2norm=l2norm)
    state = h0.clone().to(DEVICE)
    ptr = state.data_ptr()
    o = fused_recurrent_gated_delta_rule(*(x.to(DEVICE, dtype) for x in (q, k, v)), g=g.to(DEVICE),
                                         beta=beta.to(DEVICE), state=state, use_qk_l2norm=l2norm)
    assert o.dtype == dtype and state.data_ptr() == ptr
    assert rel_err(o, ref_o) < TOL[dtype] and rel_err(state, ref_s) < TOL[dtype]


@needs_triton
def test_prefill_then_decode_equals_full_sequence():
    """Chunked prefill's final state, then token-by-token decode, reproduce the full run."""
    from linearize.kernels.gated_delta import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    c = Case(1, 70, 2, 32, 32)
    q, k, v, g, beta, h0 = (x.to(DEVICE) for x in _inputs(c, seed=7))
    P = 66
    with torch.no_grad():
        full, _ = gated_delta_rule_ref(q, k, v, g=g, beta=beta, initial_state=h0)
        pre, state = chunk_gated_delta_rule(q[:, :P], k[:, :P], v[:, :P], g=g[:, :P], beta=beta[:, :P],
                                            initial_state=h0, output_final_state=True)  # no-grad path
        assert rel_err(pre, full[:, :P]) < 1e-4
        outs = [fused_recurrent_gated_delta_rule(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g=g[:, t:t + 1],
                                                 beta=beta[:, t:t + 1], state=state) for t in range(P, c.T)]
    assert rel_err(torch.cat(outs, 1), full[:, P:]) < 1e-4


def test_gates_are_keyword_only():
    from linearize.kernels.gated_delta import gated_delta_rule_ref as f

    q = torch.randn(1, 2, 1, 16)
    with pytest.raises(TypeError):
        f(q, q, q, q[..., 0], q[..., 0])
