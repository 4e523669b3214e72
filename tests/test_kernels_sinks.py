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
from test_kernels_window_packed import starts_of, window_op_inputs


@needs_triton
@pytest.mark.parametrize("seqs,W,S", [(((3, 30, 37), (5, 65)), 8, 4), (((2, 1, 60), (70,)), 40, 3),
                                      (((70,), (66,)), 1, 2), (((6, 64),), 5, 9),
                                      # W >= the query block (64): the sinks as one key tile; a block that
                                      # holds a document's end and the next one's start (100 | 60)
                                      (((5, 150), (100, 60)), 64, 4), (((3, 90, 97),), 70, 17)],
                         ids=["docs-3-30-37|5-65-W8-S4", "docs-2-1-60|70-W40-S3", "W1-S2", "S9-gt-W5",
                              "tile-docs-5-150|100-60-W64-S4", "tile-docs-3-90-97-W70-S17"])
@pytest.mark.parametrize("packed", [True, False], ids=["q_lo", "sequences"])
@pytest.mark.parametrize("loud", [False, True], ids=["quiet-sinks", "max-on-sinks"])
def test_window_kernel_with_sinks_matches_its_reference(seqs, W, S, packed, loud):
    """window_softmax_attn(sinks=S) against window_softmax_attn_ref(sinks=S) in float64: o and the
    gradients of q_sm, k_sm, v, n_lin, d_lin and gamma (without q_lo each sequence is one document)."""
    from linearize.kernels.linear_attn.window import window_softmax_attn, window_softmax_attn_ref

    if not packed:
        seqs = tuple((sum(s),) for s in seqs)
    leaves, lin_idx, cu, q_lo, do = window_op_inputs(seqs, W, seed=5, loud_sinks=S if loud else 0)
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


# ----------------------------------------------------------------------------- decode steps with sinks

def _sinks_for(B, H, D, DV, pos, W, dtype, seed):
    """Three sinks of a row: one filled long ago, one close enough to sit in the window of the later
    steps' queries (so it must not count there), and an empty slot."""
    g = torch.Generator().manual_seed(seed)
    at = torch.tensor([[0.0, float(pos - W + 1), -1.0]] * B)
    return {"sink_k": (3 * torch.randn(B, 3, H, D, generator=g)).to(dtype).to(DEVICE),
            "sink_v": torch.randn(B, 3, H, DV, generator=g).to(dtype).to(DEVICE), "sink_at": at.to(DEVICE)}


@needs_triton
@pytest.mark.parametrize("gate", [None, "scalar"])
@pytest.mark.parametrize("T", [1, 3])
def test_window_decode_with_sinks_matches_its_reference(gate, T):
    """window_decode(sinks=...) against window_decode_ref(sinks=...): the output, the state and the
    ring; a sink at p - W + 1 is in the window of the first step, outside for the later ones."""
    from test_kernels_window_decode import make_case

    from linearize.kernels.linear_attn.window_decode import window_decode, window_decode_ref

    W, B, H, D, F = 6, 2, 2, 16, 16
    c = make_case(B, T, H, D, F, W, gate, True, torch.float32, pos=40, seed=3)
    sinks = _sinks_for(B, H, D, D, 40, W, torch.float32, seed=4)
    o_ref, ring_ref, (S_ref, z_ref) = window_decode_ref(**c, sinks=sinks)
    plain, _, _ = window_decode_ref(**c)
    assert (o_ref - plain).abs().max() > 1e-2  # the sinks count
    ring = {n: t.clone() for n, t in c["ring"].items()}
    S, z = (x.clone() for x in c["state"])
    o = window_decode(**{**c, "ring": ring, "state": (S, z)}, sinks=sinks)
    torch.testing.assert_close(o.double(), o_ref.double(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(S.double(), S_ref.double(), atol=1e-5, rtol=1e-5)
    for n in ("k", "v", "valid"):
        torch.testing.assert_close(ring[n], ring_ref[n].to(ring[n].dtype), atol=0, rtol=0)


@needs_triton
@pytest.mark.parametrize("H,Hkv", [(2, 2), (4, 2)])
def test_fused_hedgehog_window_decode_with_sinks_matches_its_reference(H, Hkv):
    from test_kernels_window_decode import _f64, make_hedgehog_case

    from linearize.kernels.linear_attn import fused_window_decode_hedgehog, window_decode_hedgehog_ref

    B, T, D, P, DV, W = 2, 3, 24, 12, 20, 9
    c = make_hedgehog_case(B, T, H, Hkv, D, P, DV, W, "scalar", True, torch.float32, pos=37, seed=5, strided=True)
    sinks = _sinks_for(B, H, D, DV, 37, W, torch.float32, seed=6)
    o_ref, _, (S_ref, _) = window_decode_hedgehog_ref(**_f64(c), sm_scale=D ** -0.5,
                                                       sinks={n: x.double() for n, x in sinks.items()})
    S, z = (x.clone() for x in c["state"])
    ring = {n: t.clone() for n, t in c["ring"].items()}
    o = fused_window_decode_hedgehog(**{**c, "ring": ring, "state": (S, z)}, sm_scale=D ** -0.5, sinks=sinks)
    torch.testing.assert_close(o.double(), o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(S.double(), S_ref, atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("pads", [3, 6], ids=["sinks-full", "one-real-token"])
@pytest.mark.parametrize("chunks", [(7,), (3, 17, 20)], ids=["prompt", "chunked-prompt"])
def test_model_with_sinks_decodes_on_the_kernels_as_a_full_recompute(static, pads, chunks, monkeypatch):
    """A converted model with sinks, its prompt's later chunks (the chunked-prefill kernel) and its
    decode steps on the kernels (the PyTorch window math is made to fail for them; the left-padded
    first chunk may use it), left-padded: the logits of every real token equal one forward without a
    cache. With every row's sinks filled by the prompt the fused decode kernel runs; with a row of one
    real token the decode steps fill its second sink (the unfused kernel, fed the filled sinks)."""
    import linearize
    import linearize.attention as attention
    from conftest import tiny_model

    torch.manual_seed(0)
    model = linearize.linearize(tiny_model("llama", num_hidden_layers=2),
                                linearize.LinearAttentionConfig(window=4, sinks=2)).to(DEVICE).eval()
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "window_log_gamma"):
                m.window_log_gamma.normal_()
    B, P, D = 2, sum(chunks), 6
    T = P + D
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(2, 97, (B, T), generator=g).to(DEVICE)
    mask = torch.ones(B, T, dtype=torch.long, device=DEVICE)
    mask[1, :pads], ids[1, :pads] = 0, 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        cache = (linearize.StaticLinearizeCache(model.config, max_batch_size=B, max_cache_len=T) if static
                 else linearize.LinearizeCache(model.config))

        def no_torch_math(*a, **k):
            raise AssertionError("a later chunk or a decode step ran the PyTorch window math")

        steps, s = [], 0
        for c in chunks:
            steps.append(model(ids[:, s:s + c], attention_mask=mask[:, :s + c], position_ids=pos[:, s:s + c],
                               past_key_values=cache, use_cache=True).logits)
            s += c
            monkeypatch.setattr(attention, "_window_combine", no_torch_math)
        # a call of more than 16 tokens reads the flag on the host: the chunked prompt's second fills the sinks
        assert cache.layers[0].sinks_full == (pads == 3 or len(chunks) > 1)
        for s in range(P, T):
            steps.append(model(ids[:, s:s + 1], attention_mask=mask[:, :s + 1], position_ids=pos[:, s:s + 1],
                               past_key_values=cache, use_cache=True).logits)
    real = mask.bool()
    torch.testing.assert_close(torch.cat(steps, 1)[real], full[real], atol=2e-4, rtol=2e-4)


@needs_triton
@pytest.mark.parametrize("tf32", [False, True])
def test_sink_gradients_leave_the_tf32_setting_as_the_trainer_set_it(tf32):
    """The sinks' per-document sums pick TF32 by the inputs' dtype inside the backward and restore
    the trainer's torch.backends.cuda.matmul.allow_tf32 after it."""
    from linearize.kernels.linear_attn.window import window_softmax_attn

    leaves, lin_idx, cu, q_lo, do = window_op_inputs(((3, 30, 37), (5, 65)), 8, seed=5)
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        xs = [x.to(DEVICE).requires_grad_(True) for x in leaves]
        o = window_softmax_attn(*xs, lin_idx.to(DEVICE), cu.to(DEVICE), window=8, sm_scale=0.4, sinks=4,
                                q_lo=q_lo.to(DEVICE))
        dk = torch.autograd.grad((o * do.to(DEVICE)).sum(), xs[1])[0]
        assert dk.abs().sum() > 0 and torch.backends.cuda.matmul.allow_tf32 == tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_window_op_with_sinks_is_captured_in_a_cuda_graph():
    """`linearize distill --cuda-graphs` captures the window op's forward and backward: with sinks, their
    per-document sums must not copy a host tensor to the GPU (capture refuses that), and the replayed
    graph must give the eager gradients on new inputs."""
    from linearize.kernels.linear_attn.window import window_softmax_attn

    kw = dict(window=8, sm_scale=0.4, sinks=4, max_len=70)  # as the layers pass it: no read of cu_seqlens
    first, lin_idx, cu, q_lo, do = window_op_inputs(((3, 30, 37), (5, 65)), 8, seed=5)
    second = window_op_inputs(((3, 30, 37), (5, 65)), 8, seed=6)[0]
    lin_idx, cu, q_lo, do = (x.cuda() for x in (lin_idx, cu, q_lo, do))
    xs = [x.cuda().requires_grad_(True) for x in first]

    def step():
        o = window_softmax_attn(*xs, lin_idx, cu, q_lo=q_lo, **kw)
        return torch.autograd.grad((o * do).sum(), xs)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up: compile the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    with torch.no_grad():
        for x, new in zip(xs, second):
            x.copy_(new)
    graph.replay()
    eager = step()
    for name, a, b in zip(["dq_sm", "dk_sm", "dv", "dn_lin", "dd_lin", "dgamma"], static, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


@needs_triton
@pytest.mark.parametrize("pos", [40, 3], ids=["sinks-filled", "cache-filling"])
def test_window_softmax_prefill_matches_the_layers_window_math(pos):
    """window_softmax_prefill (Gated DeltaNet's window over the cached keys and a chunk, one kernel
    launch) against the layer's PyTorch math (``linear_attention``'s window with a prefix, its linear
    part weighed 0): a buffer with empty slots, a sink filled long ago, one inside the first queries'
    window, an empty one; the position as an int and as a tensor (the static cache's); and the op's
    schema and fake tensors (opcheck)."""
    from linearize.attention import linear_attention
    from linearize.kernels.linear_attn.window_decode import window_softmax_prefill
    from linearize.kernels.ops import OPS
    from linearize.layers import sink_reads

    B, T, H, D, W = 2, 20, 2, 16, 6
    g = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=g).to(DEVICE)  # noqa: E731
    q, k, v = r(B, T, H, D), r(B, T, H, D), r(B, T, H, D)
    buf = {"k": r(B, W - 1, H, D), "v": r(B, W - 1, H, D), "valid": torch.ones(B, W - 1, device=DEVICE)}
    buf["valid"][:, : max(W - 1 - pos, 0)] = 0  # a cache of pos < W - 1 tokens: its oldest slots are empty
    buf["valid"][1, :2] = 0  # the second row's shorter history
    sinks = _sinks_for(B, H, D, D, pos, W, torch.float32, seed=8)
    if pos < W:  # a short history: its sinks are its first tokens, the last one not yet seen
        sinks["sink_at"] = torch.tensor([[0.0, 1.0, -1.0]] * B, device=DEVICE)

    def math(sink_set):
        zeros = lambda n: q.new_zeros(B, n, H, 1, dtype=torch.float64)  # noqa: E731
        cat = lambda a, b: torch.cat([a.double(), b.double()], 1)  # noqa: E731
        sc = None if sink_set is None else tuple(x.double() if x.is_floating_point() and x.dim() == 4 else x
                                                  for x in sink_reads(sink_set, W, pos, T))
        valid = torch.cat([buf["valid"].bool(), torch.ones(B, T, dtype=torch.bool, device=DEVICE)], 1)
        state = (q.new_zeros(B, H, 1, D, dtype=torch.float64), q.new_zeros(B, H, 1, dtype=torch.float64))
        return linear_attention(zeros(T), zeros(W - 1 + T), cat(buf["v"], v), initial_state=state,
                                key_valid=valid, window=W, q_sm=q.double(), k_sm=cat(buf["k"], k), sm_scale=0.3,
                                window_weight=0.0, prefix=W - 1, sink_cache=sc)[0]

    ref = math(sinks)
    assert rel(math(None), ref) > 1e-2  # the sinks count: the comparison below is not vacuous
    for p in (pos, torch.tensor(pos, device=DEVICE)):
        o = window_softmax_prefill(q, k, v, buf=buf, sm_scale=0.3, sinks=sinks, pos=p)
        torch.testing.assert_close(o.double(), ref, atol=1e-5, rtol=1e-5)
    args = (q, k, v, buf["k"], buf["v"], buf["valid"], 0.3, sinks["sink_k"], sinks["sink_v"], sinks["sink_at"],
            torch.tensor(pos, device=DEVICE))
    torch.library.opcheck(OPS["window_softmax_prefill"], args)


@needs_triton
@pytest.mark.parametrize("case", ["filling-gqa-rope-softcap", "filled-bf16"])
def test_window_softmax_decode_matches_its_reference_and_moves_the_cache(case):
    """window_softmax_decode (Gated DeltaNet's window in a decode step, one launch) against its PyTorch
    twin: the output beside gamma * the state's output, the buffer moved one slot on (in place), its new
    validity, and the sinks: a real token takes the first empty slot, a pad token none (its output is
    gamma * extra alone); a sink inside the window is not read. GQA and partial RoPE inside the kernel,
    logit soft-capping; the position as a tensor (the static cache's) and as an int; opcheck."""
    from linearize.kernels.linear_attn.window_decode import window_softmax_decode, window_softmax_decode_ref
    from linearize.kernels.ops import OPS

    filling = case.startswith("filling")
    B, H, Hkv, D, W = 2, 4, 2 if filling else 4, 16, 6
    dt = torch.float32 if filling else torch.bfloat16
    pos = 3 if filling else 40
    g = torch.Generator().manual_seed(12)
    r = lambda *s: torch.randn(*s, generator=g).to(dt).to(DEVICE)  # noqa: E731
    q, k, v = r(B, 1, H, D), r(B, 1, Hkv, D), r(B, 1, Hkv, D)
    buf = {"k": r(B, W - 1, H, D), "v": r(B, W - 1, H, D), "valid": torch.ones(B, W - 1, device=DEVICE)}
    buf["valid"][:, : max(W - 1 - pos, 0)] = 0  # a cache of pos < W - 1 tokens: its oldest slots are empty
    buf["valid"][1, :1] = 0
    sinks = _sinks_for(B, H, D, D, pos, W, dt, seed=13)
    if filling:  # the row's first tokens: two sinks filled, one empty (taken by row 0's real token)
        sinks["sink_at"] = torch.tensor([[0.0, 1.0, -1.0]] * B, device=DEVICE)
    R = 8 if filling else D
    ang = torch.randn(1, 1, R // 2, generator=g).to(DEVICE)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    valid = torch.tensor([[1.0], [0.0 if filling else 1.0]], device=DEVICE)
    extra, gamma = r(B, 1, H, D), torch.tensor([0.5, -1.0, 0.0, 2.0], device=DEVICE)
    kw = dict(sm_scale=0.3, softcap=2.0 if filling else None, cos=cos, sin=sin, valid=valid, extra=extra, gamma=gamma)
    ref, ref_buf, ref_sinks = window_softmax_decode_ref(q, k, v, buf=buf, pos=pos, sinks=sinks, **kw)
    without, _, _ = window_softmax_decode_ref(q, k, v, buf=buf, pos=pos, sinks=None, **kw)
    if not filling:  # the long-ago sink is read: the check below is not vacuous
        assert rel(without, ref) > 1e-2
    else:  # a padding token's output is gamma * extra alone, and it fills no sink
        torch.testing.assert_close(ref[1, 0], gamma[:, None] * extra[1, 0].float())
        assert ref_sinks["sink_at"][1, 2] == -1 and ref_sinks["sink_at"][0, 2] == pos
    tol = dict(atol=1e-5, rtol=1e-5) if dt == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    for p in (torch.tensor(pos, device=DEVICE), pos):
        b2, s2 = {n: t.clone() for n, t in buf.items()}, {n: t.clone() for n, t in sinks.items()}
        o = window_softmax_decode(q, k, v, buf=b2, pos=p, sinks=s2, **kw)
        torch.testing.assert_close(o.float(), ref.float(), **tol)
        torch.testing.assert_close(b2["k"].float(), ref_buf["k"].float(), **tol)  # RoPE in fp32, then rounded
        torch.testing.assert_close(b2["v"], ref_buf["v"])
        # the row's flags, read by every head's program, moved on once (by the row's last program)
        torch.testing.assert_close(b2["valid"], ref_buf["valid"])
        torch.testing.assert_close(s2["sink_k"].float(), ref_sinks["sink_k"].float(), **tol)
        torch.testing.assert_close(s2["sink_v"], ref_sinks["sink_v"])
        torch.testing.assert_close(s2["sink_at"], ref_sinks["sink_at"])
    assert not torch.equal(ref_buf["valid"], buf["valid"]) and not torch.equal(ref_sinks["sink_at"], sinks["sink_at"])
    args = (q, k, v, cos, sin, valid.reshape(B), buf["k"].clone(), buf["v"].clone(), buf["valid"].clone(),
            sinks["sink_k"].clone(), sinks["sink_v"].clone(), sinks["sink_at"].clone(), torch.tensor(pos, device=DEVICE), extra,
            gamma, 0.3, 2.0)
    torch.library.opcheck(OPS["window_softmax_decode"], args)


@needs_triton
def test_window_softmax_decode_hands_the_row_flags_over_once_under_many_programs():
    """Many heads and rows at once (on a GPU their programs run together): every launch moves each row's
    validity and sink positions on exactly once, whichever of the row's programs ends last, and leaves
    its counters at 0 for the next launch (three launches in a row, each checked against the twin)."""
    import importlib

    wd = importlib.import_module("linearize.kernels.linear_attn.window_decode")  # the module, not its function
    B, H, Hkv, D, W, S = 4, 8, 2, 16, 12, 3
    g = torch.Generator().manual_seed(21)
    r = lambda *s: torch.randn(*s, generator=g).to(DEVICE)  # noqa: E731
    for pos in (4, 30):
        q, k, v = r(B, 1, H, D), r(B, 1, Hkv, D), r(B, 1, Hkv, D)
        buf = {"k": r(B, W - 1, H, D), "v": r(B, W - 1, H, D),
               "valid": (torch.rand(B, W - 1, generator=g) > 0.3).float().to(DEVICE)}
        sinks = {"sink_k": r(B, S, H, D), "sink_v": r(B, S, H, D),
                 "sink_at": torch.tensor([[-1.0] * 3, [0.0, -1.0, -1.0], [0.0, 1.0, -1.0], [0.0, 1.0, 2.0]], device=DEVICE)}
        kw = dict(sm_scale=0.25, valid=torch.tensor([[1.0], [1.0], [0.0], [1.0]], device=DEVICE), extra=r(B, 1, H, D),
                  gamma=r(H))
        ref, ref_buf, ref_sinks = wd.window_softmax_decode_ref(q, k, v, buf=buf, pos=pos, sinks=sinks, **kw)
        assert not torch.equal(ref_sinks["sink_at"], sinks["sink_at"])  # a sink is taken: the check bites
        for _ in range(3):
            b2, s2 = {n: t.clone() for n, t in buf.items()}, {n: t.clone() for n, t in sinks.items()}
            o = wd.window_softmax_decode(q, k, v, buf=b2, pos=torch.tensor(pos, device=DEVICE), sinks=s2, **kw)
            torch.testing.assert_close(o.float(), ref.float(), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(b2["valid"], ref_buf["valid"])
            torch.testing.assert_close(s2["sink_at"], ref_sinks["sink_at"])
            assert not wd._handoff_counters(B, q.device).any()
