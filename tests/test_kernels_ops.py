"""The Triton kernels as torch.library ops: schema, fake tensors and autograd (opcheck), the ops
against the float64 references eagerly and under torch.compile (Inductor on the CPU), and a
compiled converted model that calls the ops rather than the PyTorch math.

Runs where the kernels run: on CUDA, or on CPU under TRITON_INTERPRET=1 (CI's kernel pass)."""

import os

import pytest
import torch

import linearize
from linearize.kernels import ops
from linearize.kernels.gated_delta import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, gated_delta_rule_ref
from linearize.kernels.linear_attn import chunk_linear_attn, fused_recurrent_linear_attn, linear_attn_ref
from linearize import StaticLinearizeCache

from conftest import converted
from conftest import rel_err

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs CUDA or TRITON_INTERPRET=1",
)
DEV = "cuda" if torch.cuda.is_available() else "cpu"



def _la_inputs(B=2, T=19, H=2, F=16, DV=16, gate=True, state=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(B, T, H, F, generator=g)
    k = torch.rand(B, T, H, F, generator=g)
    v = torch.randn(B, T, H, DV, generator=g)
    lg = -torch.rand(B, T, H, generator=g) * 0.2 if gate else None
    S0 = (torch.rand(B, H, F, DV, generator=g), torch.rand(B, H, F, generator=g) + 1) if state else None
    dev = lambda x: None if x is None else x.to(DEV)  # noqa: E731
    return dev(q), dev(k), dev(v), dev(lg), None if S0 is None else tuple(dev(x) for x in S0)


def _gdn_inputs(B=2, T=19, H=2, K=16, V=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    v = torch.randn(B, T, H, V, generator=g)
    gg = -torch.rand(B, T, H, generator=g) * 0.3
    beta = torch.rand(B, T, H, generator=g)
    h0 = torch.randn(B, H, K, V, generator=g) * 0.1
    return tuple(x.to(DEV) for x in (q, k, v, gg, beta, h0))


# -- opcheck: schema, fake tensor, autograd registration, AOT dispatch ------------------------------

@pytest.mark.parametrize("normalize", [True, False])
def test_opcheck_chunk_linear_attn(normalize):
    q, k, v, lg, (S0, z0) = _la_inputs(T=9)
    args = [x.requires_grad_() for x in (q, k, v, lg, S0, z0)]
    torch.library.opcheck(ops.OPS["chunk_linear_attn_fwd"], (*args, None, normalize, 1e-6, True, 1))
    cu = torch.tensor([0, 4, 9, 18], dtype=torch.int32, device=DEV)
    packed = [x.detach().reshape(1, 18, *x.shape[2:]).requires_grad_() for x in (q, k, v, lg)]
    torch.library.opcheck(ops.OPS["chunk_linear_attn_fwd"], (*packed, None, None, cu, normalize, 1e-6, True, 1))


def test_opcheck_window_and_recurrent():
    from linearize.kernels.linear_attn.chunk import _window_attn  # noqa: F401  (builds the window op's inputs)

    TT, H, D = 12, 2, 16
    g = torch.Generator().manual_seed(1)
    q_sm, k_sm, v = (torch.randn(TT, H, D, generator=g).to(DEV).requires_grad_() for _ in range(3))
    n_lin = torch.randn(TT, H, D, generator=g).to(DEV).requires_grad_()
    d_lin = (torch.rand(TT, H, generator=g) + 1).to(DEV).requires_grad_()
    gamma = torch.rand(H, generator=g).to(DEV).requires_grad_()
    lin_idx = torch.tensor([-1] * 3 + list(range(3)) + [-1] * 3 + list(range(3, 6)), dtype=torch.int32, device=DEV)
    cu = torch.tensor([0, 6, 12], dtype=torch.int32, device=DEV)
    torch.library.opcheck(ops.OPS["window_attn_fwd"], (q_sm, k_sm, v, n_lin, d_lin, gamma, lin_idx, cu, 6, 3, 0.25))
    torch.library.opcheck(ops.OPS["window_attn_fwd"], (q_sm, k_sm, v, None, None, gamma, lin_idx, cu, 6, 3, 0.25))

    q, k, v, lg, (S, z) = _la_inputs(T=2)
    torch.library.opcheck(ops.OPS["recurrent_linear_attn"], (q, k, v, lg, S.contiguous(), z.contiguous(), True, 1e-6),
                          test_utils=("test_schema", "test_faketensor"))
    q, k, v, gg, beta, h0 = _gdn_inputs(T=2)
    torch.library.opcheck(ops.OPS["recurrent_gated_delta"], (q, k, v, gg, beta, h0.contiguous(), 1.0, False),
                          test_utils=("test_schema", "test_faketensor"))


def test_opcheck_chunk_gated_delta():
    q, k, v, gg, beta, h0 = _gdn_inputs(T=9)
    B, T, H, K = q.shape
    packed = [x.reshape(B * T, *x.shape[2:]).contiguous().requires_grad_() for x in (q, k, v, gg, beta)]
    torch.library.opcheck(ops.OPS["chunk_gated_delta_fwd"],
                          (*packed, h0.requires_grad_(), None, B, T, 1.0, True, 1))
    # inference with the state pass split along time (in kernels/gated_delta/chunk.py)
    packed = [x.detach() for x in packed]
    torch.library.opcheck(ops.OPS["chunk_gated_delta_fwd"], (*packed, h0.detach(), None, B, T, 1.0, False, 2),
                          test_utils=("test_schema", "test_faketensor"))


# -- the public functions, eager and compiled, against float64 ---------------------------------------

def _la_loss(fn, q, k, v, lg, S0, weights):
    o, (S, z) = fn(q, k, v, log_g=lg, initial_state=S0, output_final_state=True)
    return (o * weights[0]).sum() + (S * weights[1]).sum() + (z * weights[2]).sum(), o


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_chunk_linear_attn_compiled_matches_reference(backend):
    q, k, v, lg, S0 = _la_inputs()
    leaves = [q, k, v, lg, *S0]
    g = torch.Generator().manual_seed(2)
    weights = [torch.randn(2, 19, 2, 16, generator=g).to(DEV), torch.randn(2, 2, 16, 16, generator=g).to(DEV),
               torch.randn(2, 2, 16, generator=g).to(DEV)]

    def run(fn, dtype):
        xs = [x.detach().to(dtype).requires_grad_() for x in leaves]
        loss, o = _la_loss(fn, *xs[:4], tuple(xs[4:]), [w.to(dtype) for w in weights])
        loss.backward()
        return o, [x.grad for x in xs]

    def ref(q, k, v, log_g, initial_state, output_final_state):
        return linear_attn_ref(q, k, v, log_g=log_g, normalize=True, initial_state=initial_state, output_final_state=True)

    torch._dynamo.reset()
    fn = torch.compile(chunk_linear_attn, backend=backend, fullgraph=True) if backend != "eager" else chunk_linear_attn
    o, grads = run(fn, torch.float32)
    o_ref, grads_ref = run(ref, torch.float64)
    assert rel_err(o, o_ref) < 1e-5
    for name, a, b in zip(("dq", "dk", "dv", "dlog_g", "dS0", "dz0"), grads, grads_ref):
        assert rel_err(a, b) < 1e-4, name


def test_window_hybrid_compiled_matches_eager():
    from linearize.kernels.linear_attn.reference import linear_attn_ref as ref

    B, T, H, F, D, W = 2, 21, 2, 16, 16, 5
    g = torch.Generator().manual_seed(3)
    q, k = (torch.rand(B, T, H, F, generator=g).to(DEV) for _ in range(2))
    q_sm, k_sm, v = (torch.randn(B, T, H, D, generator=g).to(DEV) for _ in range(3))
    gamma = torch.tensor([0.5, 2.0], device=DEV)

    def run(fn, dtype):
        xs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v, q_sm, k_sm)]
        o, _ = fn(*xs[:3], window=W, q_sm=xs[3], k_sm=xs[4], sm_scale=0.25, window_weight=gamma.to(dtype),
                  output_final_state=True)
        (o * o).sum().backward()
        return o, [x.grad for x in xs]

    def reference(q, k, v, **kw):
        return ref(q, k, v, normalize=True, **kw)

    torch._dynamo.reset()
    compiled = torch.compile(chunk_linear_attn, backend="inductor", fullgraph=True)
    o, grads = run(compiled, torch.float32)
    o_ref, grads_ref = run(reference, torch.float64)
    assert rel_err(o, o_ref) < 1e-5
    for a, b in zip(grads, grads_ref):
        assert rel_err(a, b) < 1e-4


def test_gated_delta_compiled_matches_reference():
    q, k, v, gg, beta, h0 = _gdn_inputs()

    def run(fn, dtype):
        xs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v, gg, beta, h0)]
        o, ht = fn(*xs[:3], g=xs[3], beta=xs[4], scale=1.0, initial_state=xs[5], output_final_state=True)
        (o.pow(2).sum() + ht.sum()).backward()
        return o, [x.grad for x in xs]

    torch._dynamo.reset()
    compiled = torch.compile(chunk_gated_delta_rule, backend="inductor", fullgraph=True)
    o, grads = run(compiled, torch.float32)
    o_ref, grads_ref = run(gated_delta_rule_ref, torch.float64)
    assert rel_err(o, o_ref) < 1e-5
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads, grads_ref):
        assert rel_err(a, b) < 1e-4, name


def test_decode_ops_update_the_state_in_place_under_compile():
    q, k, v, lg, (S, z) = _la_inputs(T=3)
    S, z = S.contiguous(), z.contiguous()
    S2, z2 = S.clone(), z.clone()
    o_ref, (S_ref, z_ref) = linear_attn_ref(q.double(), k.double(), v.double(), log_g=lg.double(), normalize=True,
                                            initial_state=(S.double(), z.double()), output_final_state=True)
    torch._dynamo.reset()
    step = torch.compile(lambda *a: fused_recurrent_linear_attn(*a[:3], log_g=a[3], state=(a[4], a[5])),
                         backend="inductor", fullgraph=True)
    o = step(q, k, v, lg, S2, z2)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(S2, S_ref) < 1e-5 and rel_err(z2, z_ref) < 1e-5

    q, k, v, gg, beta, h0 = _gdn_inputs(T=3)
    state = h0.clone().contiguous()
    o_ref, h_ref = gated_delta_rule_ref(q.double(), k.double(), v.double(), g=gg.double(), beta=beta.double(),
                                        scale=1.0, initial_state=h0.double(), output_final_state=True)
    step = torch.compile(lambda *a: fused_recurrent_gated_delta_rule(*a[:3], g=a[3], beta=a[4], scale=1.0, state=a[5]),
                         backend="inductor", fullgraph=True)
    o = step(q, k, v, gg, beta, state)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(state, h_ref) < 1e-5


# -- a compiled converted model runs the ops ---------------------------------------------------------

# Inductor on the CPU builds C++ for every graph (1-3 minutes a model on CI's two cores): the model
# tests compile one preset with it and the others with aot_eager, which traces the same graph
# (dynamo, AOTAutograd, the ops' fake kernels) without the C++ build.
INDUCTOR_PRESET = "lolcats"


def _inner(name: str) -> str:
    return "inductor" if name == INDUCTOR_PRESET else "aot_eager"


def _recording(graphs, inner="inductor"):
    """A dynamo backend that records the ops of each graph it gets, then hands it to ``inner``."""
    from torch._dynamo.backends.registry import lookup_backend

    def backend(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return lookup_backend(inner)(gm, example_inputs)
    return backend


MODELS = {
    "hedgehog": linearize.LinearAttentionConfig(feature_map="hedgehog", decay="scalar"),
    "lolcats": linearize.LinearAttentionConfig(feature_map="hedgehog", window=4),
    "gdn": linearize.GatedDeltaNetConfig(),
}
TRAIN_OPS = {"hedgehog": "linearize.chunk_linear_attn_fwd", "lolcats": "linearize.window_attn_fwd",
             "gdn": "linearize.chunk_gated_delta_fwd"}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_compiled_model_calls_the_ops_forward_and_backward(name, monkeypatch):
    monkeypatch.setenv("LINEARIZE_KERNELS", "auto")
    model = converted("llama", MODELS[name]).to(DEV).train()
    ids = torch.randint(2, 97, (2, 13), device=DEV)

    def loss_and_grads(m):
        model.zero_grad()
        loss = m(ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    eager_loss, eager_grads = loss_and_grads(model)
    torch._dynamo.reset()
    graphs = []
    compiled = torch.compile(model, backend=_recording(graphs, "aot_eager"), fullgraph=True)
    loss, grads = loss_and_grads(compiled)
    assert len(graphs) == 1 and TRAIN_OPS[name] in graphs[0], sorted(o for o in graphs[0] if "linearize" in o)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-5)
    assert grads.keys() == eager_grads.keys()
    for key in grads:
        torch.testing.assert_close(grads[key], eager_grads[key], rtol=1e-4, atol=1e-5, msg=key)


DECODE_MODELS = {**MODELS, "gdn-hybrid": linearize.GatedDeltaNetConfig(layers=[1])}  # layers 0 and 2 softmax
# "gdn" on 1 layer: a model of GDN layers only (its cache has no softmax layer), whose one layer does all
# a GDN layer's compiled cache work; 3 identical layers only tripled its chunk kernels (the interpreter's
# time), and a GDN layer between softmax layers is "gdn-hybrid"
DECODE_LAYERS = {"gdn": {"num_hidden_layers": 1}}


@pytest.mark.parametrize("name,op", [("hedgehog", "linearize.recurrent_hedgehog"),
                                     ("gdn", "linearize.gated_delta_decode"),
                                     ("lolcats", "linearize.window_decode_hedgehog"),
                                     ("gdn-hybrid", "linearize.softmax_decode")])
def test_compiled_static_decode_runs_the_kernels(name, op, monkeypatch):
    """The static-cache decode step compiled (Inductor for INDUCTOR_PRESET, aot_eager else) calls the decode op (a hybrid's softmax
    layers theirs) and gives the tokens of the eager default-cache generate."""
    monkeypatch.setenv("LINEARIZE_KERNELS", "auto")
    model = converted("llama", DECODE_MODELS[name], **DECODE_LAYERS.get(name, {})).to(DEV)
    ids = torch.randint(2, 97, (2, 7), device=DEV)
    new = 5
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0)
        cache = StaticLinearizeCache(model.config, max_batch_size=2, max_cache_len=ids.shape[1] + new, device=DEV)
        mask = torch.ones(2, ids.shape[1] + new, dtype=torch.long, device=DEV)
        logits = model(ids, attention_mask=mask[:, : ids.shape[1]], past_key_values=cache, use_cache=True).logits
        torch._dynamo.reset()
        graphs = []
        step = torch.compile(model, backend=_recording(graphs, _inner(name)), fullgraph=True, dynamic=False)
        tokens = [logits[:, -1].argmax(-1, keepdim=True)]
        for i in range(new - 1):
            logits = step(tokens[-1], attention_mask=mask, past_key_values=cache, use_cache=True).logits
            tokens.append(logits[:, -1].argmax(-1, keepdim=True))
    assert len(graphs) == 1 and op in graphs[0]
    torch.testing.assert_close(torch.cat([ids, *tokens], dim=1), expected)


# -- Hedgehog features fused into the decode step ------------------------------------------------------

@pytest.mark.parametrize("gate,pad,H,Hkv,T", [(None, False, 2, 2, 1), ("scalar", True, 4, 2, 3), ("scalar", False, 3, 1, 2),
                                               ("channel", True, 4, 2, 3), ("channel", False, 3, 1, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_hedgehog_decode_matches_reference(gate, pad, H, Hkv, T, dtype):
    """The fused step against its twin, with no gate, a gate per head or one per key channel
    (``decay="channel"``: [B, T, H, F], each row of the state decaying at its own rate)."""
    from linearize.kernels.linear_attn.recurrent import fused_recurrent_hedgehog, hedgehog_recurrent_ref

    B, D, P, DV = 2, 24, 12, 20  # odd sizes: D and F = 2P not powers of two
    g = torch.Generator().manual_seed(4)
    q = torch.randn(B, T, H, D, generator=g)
    k, v = torch.randn(B, T, Hkv, D, generator=g), torch.randn(B, T, Hkv, DV, generator=g)
    wq, wk = torch.randn(H, D, P, generator=g) * 0.5, torch.randn(H, D, P, generator=g) * 0.5
    gshape = {"scalar": (B, T, H), "channel": (B, T, H, 2 * P)}.get(gate)
    lg = -torch.rand(*gshape, generator=g) * (0.3 if gate == "scalar" else 1.5) if gate else None
    valid = torch.ones(B, T, dtype=torch.bool)
    if pad:
        valid[1, 0] = False
    S0, z0 = torch.rand(B, H, 2 * P, DV, generator=g), torch.rand(B, H, 2 * P, generator=g) + 1
    o_ref, (S_ref, z_ref) = hedgehog_recurrent_ref(*(x.double() for x in (q, k, v, wq, wk)),
                                                   log_g=None if lg is None else lg.double(),
                                                   valid=valid if pad else None, state=(S0.double(), z0.double()))
    S, z = S0.clone().to(DEV), z0.clone().to(DEV)
    o = fused_recurrent_hedgehog(*(x.to(DEV, dtype) for x in (q, k, v)), wq.to(DEV, dtype), wk.to(DEV, dtype),
                                 log_g=None if lg is None else lg.to(DEV), valid=valid.to(DEV) if pad else None,
                                 state=(S, z))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(o, o_ref) < tol and rel_err(S, S_ref) < tol and rel_err(z, z_ref) < tol
    # the reference really is Hedgehog's feature map (the layer's module) and the plain decode step
    from linearize.feature_maps import Hedgehog
    from linearize.kernels.linear_attn import linear_attn_recurrent_ref
    from linearize.kernels.linear_attn.reference import linear_attn_channel_ref

    fm_q, fm_k = Hedgehog(H, D, 2 * P), Hedgehog(H, D, 2 * P)
    fm_q.weight.data, fm_k.weight.data = wq.double(), wk.double()
    rep = H // Hkv
    kv = [x.double().repeat_interleave(rep, dim=2) for x in (k, v)]
    if not pad:
        init = (S0.double(), z0.double())
        if gate == "channel":
            o2, (S2, z2) = linear_attn_channel_ref(fm_q(q.double()), fm_k(kv[0]), kv[1], lg.double(), initial_state=init)
            assert rel_err(S_ref, S2) < 1e-10 and rel_err(z_ref, z2) < 1e-10
        else:
            o2, _ = linear_attn_recurrent_ref(fm_q(q.double()), fm_k(kv[0]), kv[1],
                                              log_g=None if lg is None else lg.double(), initial_state=init,
                                              output_final_state=True)
        assert rel_err(o_ref, o2) < 1e-10


@pytest.mark.parametrize("layout,R", [("flat", 24), ("flat", 8), ("per_head", 12)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_hedgehog_decode_rotates_strided_views_of_the_projection(layout, R, dtype):
    """q, k and v as views of one fused projection output ([q | k | v] heads, or gpt_neox's per-head
    [q_h | k_h | v_h]) before RoPE, with cos/sin of R <= D rotary dims (one row of cos for the batch):
    the kernel reads them in place and rotates q and k as transformers' rotate-half RoPE does."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from linearize.kernels.linear_attn.recurrent import fused_recurrent_hedgehog, hedgehog_recurrent_ref

    B, T, D, P = 2, 2, 24, 12
    H, Hkv = (4, 2) if layout == "flat" else (3, 3)
    g = torch.Generator().manual_seed(6)
    y = torch.randn(B, T, (H + 2 * Hkv) * D, generator=g)
    if layout == "flat":
        q, k, v = (x.unflatten(-1, (n, D)) for x, n in zip(y.split([H * D, Hkv * D, Hkv * D], -1), (H, Hkv, Hkv)))
    else:
        q, k, v = y.unflatten(-1, (H, 3 * D)).split(D, dim=-1)
    ang = torch.rand(1, T, R // 2, generator=g) * 6
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    wq, wk = torch.randn(H, D, P, generator=g) * 0.5, torch.randn(H, D, P, generator=g) * 0.5
    S0, z0 = torch.rand(B, H, 2 * P, D, generator=g), torch.rand(B, H, 2 * P, generator=g) + 1

    def rope(x):  # (B, T, h, D) in float64 through transformers' own function (partial: first R dims)
        xr, rest = x[..., :R].transpose(1, 2), x[..., R:]
        rot, _ = apply_rotary_pos_emb(xr, xr, cos.double(), sin.double())
        return torch.cat([rot.transpose(1, 2), rest], -1)

    yd = y.to(dtype).double()  # the same rounded values
    if layout == "flat":
        qd, kd, vd = (x.unflatten(-1, (n, D)) for x, n in zip(yd.split([H * D, Hkv * D, Hkv * D], -1), (H, Hkv, Hkv)))
    else:
        qd, kd, vd = yd.unflatten(-1, (H, 3 * D)).split(D, dim=-1)
    o_ref, (S_ref, z_ref) = hedgehog_recurrent_ref(rope(qd), rope(kd), vd, wq.double(), wk.double(),
                                                   state=(S0.double(), z0.double()))
    yy = y.to(DEV, dtype)
    if layout == "flat":
        args = [x.unflatten(-1, (n, D)) for x, n in zip(yy.split([H * D, Hkv * D, Hkv * D], -1), (H, Hkv, Hkv))]
    else:
        args = list(yy.unflatten(-1, (H, 3 * D)).split(D, dim=-1))
    assert not args[0].is_contiguous()  # really views
    S, z = S0.clone().to(DEV), z0.clone().to(DEV)
    o = fused_recurrent_hedgehog(*args, wq.to(DEV, dtype), wk.to(DEV, dtype), state=(S, z),
                                 cos=cos.to(DEV), sin=sin.to(DEV))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(o, o_ref) < tol and rel_err(S, S_ref) < tol and rel_err(z, z_ref) < tol
    with pytest.raises(ValueError, match="even R <= head dim"):
        fused_recurrent_hedgehog(*args, wq.to(DEV, dtype), wk.to(DEV, dtype), state=(S, z),
                                 cos=cos[..., :3].to(DEV), sin=sin[..., :3].to(DEV))


@pytest.mark.parametrize("name", sorted(DECODE_MODELS))
def test_compiled_chunk_continues_the_static_cache(name, monkeypatch):
    """A chunk of a chunked prefill compiled (Inductor for INDUCTOR_PRESET, else aot_eager; what ``PrefillGraph(compile=True)``
    captures) continues the static cache on the kernels, in one graph, and leaves the logits and
    the next chunk's of an eager chunked prefill."""
    monkeypatch.setenv("LINEARIZE_KERNELS", "auto")
    model = converted("llama", DECODE_MODELS[name], **DECODE_LAYERS.get(name, {})).to(DEV)
    B, C = 2, 20  # chunks longer than a decode step
    ids = torch.randint(2, 97, (B, 3 * C), device=DEV)

    def chunked(step):
        cache = StaticLinearizeCache(model.config, max_batch_size=B, max_cache_len=3 * C, device=DEV)
        out = []
        for s in range(0, 3 * C, C):
            f = model if s == 0 else step  # the first chunk allocates the cache's storage, eagerly
            pos = torch.arange(s, s + C, device=DEV).expand(B, -1)
            out.append(f(input_ids=ids[:, s:s + C], position_ids=pos, past_key_values=cache, use_cache=True).logits)
        return torch.cat(out, 1)

    with torch.no_grad():
        expected = chunked(model)
        torch._dynamo.reset()
        graphs = []
        got = chunked(torch.compile(model.forward, backend=_recording(graphs, _inner(name)), fullgraph=True, dynamic=False))
    assert len(graphs) == 1, len(graphs)
    assert any(o.startswith("linearize.") for o in graphs[0]), sorted(graphs[0])
    assert rel_err(got, expected) < 1e-4
