"""Attention sinks in the window hybrid (LoLCATs): the first S keys of each query's document join the
softmax part (its max and both sums) where they are not in the window already; the linear terms
are unchanged. Checked on the PyTorch references (recurrent against quadratic, against a plain
masked softmax written here at gamma 0, varlen against each sequence alone) and on the PyTorch
path of ``linearize.attention.linear_attention`` (every form against the reference, gradients
included; packed documents against each document alone)."""

from __future__ import annotations

import json

import pytest
import torch

from linearize.attention import linear_attention

la = pytest.importorskip("linearize.kernels.linear_attn.reference")

f64 = torch.float64
TOL = dict(rtol=1e-10, atol=1e-10)
SCALE = 0.5


def make(B=2, T=17, H=2, F=4, D=8, Dv=3, gate=True, seed=0):
    """Feature-mapped qf, kf (positive, like Hedgehog's), raw q_sm, k_sm ~ randn (with SCALE the
    softmax is far from flat), v, an optional scalar gate and a window weight per head."""
    g = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g, dtype=f64)  # noqa: E731
    return dict(qf=rn(B, T, H, F).softmax(-1), kf=rn(B, T, H, F).softmax(-1), v=rn(B, T, H, Dv),
                q_sm=rn(B, T, H, D), k_sm=rn(B, T, H, D),
                log_g=-0.3 * torch.rand(B, T, H, generator=g, dtype=f64) if gate else None,
                gamma=0.5 + torch.rand(H, generator=g, dtype=f64))


def ref(x, W, S, fn=None, **kw):
    fn = fn or la.linear_attn_ref
    return fn(x["qf"], x["kf"], x["v"], log_g=x["log_g"], window=W, q_sm=x["q_sm"], k_sm=x["k_sm"], sm_scale=SCALE,
              window_weight=x["gamma"], output_final_state=True, sinks=S, **kw)


def ours(x, W, S, form, **kw):
    kw = dict(dict(window_weight=x["gamma"], chunk_size=4), **kw)
    return linear_attention(x["qf"], x["kf"], x["v"], log_g=x["log_g"], window=W, q_sm=x["q_sm"], k_sm=x["k_sm"],
                            sm_scale=SCALE, form=form, sinks=S, **kw)


def masked_softmax(q_sm, k_sm, v, W, S, starts=None, valid=None, softcap=None):
    """Softmax of each query over its window-plus-sinks set, straight from the definition:
    {s : t-W < s <= t, s >= d_t} u {s : d_t <= s < d_t + S, s <= t}, d_t its document's start;
    ``valid`` (B, T) drops padding keys; a query with no key gets 0."""
    B, T, H, _ = q_sm.shape
    out = torch.zeros(B, T, H, v.shape[-1], dtype=f64)
    for b in range(B):
        for t in range(T):
            d = 0 if starts is None else int(starts[b][t])
            keys = {s for s in range(d, t + 1) if t - s < W} | {s for s in range(d, min(d + S, t + 1))}
            keys = sorted(s for s in keys if valid is None or valid[b, s])
            if not keys:
                continue
            for h in range(H):
                a = torch.stack([SCALE * q_sm[b, t, h] @ k_sm[b, s, h] for s in keys])
                if softcap is not None:
                    a = softcap * torch.tanh(a / softcap)
                out[b, t, h] = a.softmax(0) @ v[b, keys, h]
    return out


def grads(o, xs, seed=1):
    cot = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed), dtype=f64)
    return torch.autograd.grad((o * cot).sum(), xs)


NAMES = ("q_sm", "k_sm", "v", "qf", "kf", "log_g")


def with_grad(x):
    return {n: (t.clone().requires_grad_(n in NAMES) if isinstance(t, torch.Tensor) else t) for n, t in x.items()}


@pytest.mark.parametrize("gate", [True, False])
@pytest.mark.parametrize("W,S", [(1, 1), (1, 3), (3, 2), (3, 6), (6, 4), (4, 40)])  # S > W; S > T
def test_recurrent_ref_matches_quadratic_ref_with_sinks(W, S, gate):
    x = with_grad(make(gate=gate))
    o_rec, (S_rec, z_rec) = ref(x, W, S, fn=la.linear_attn_recurrent_ref)
    o_quad, (S_quad, z_quad) = ref(x, W, S)
    torch.testing.assert_close(o_quad, o_rec, **TOL)
    torch.testing.assert_close(S_quad, S_rec, **TOL)  # the state does not see the sinks
    torch.testing.assert_close(z_quad, z_rec, **TOL)
    names = [n for n in NAMES if x[n] is not None]
    g_quad = grads(o_quad, [x[n] for n in names])
    g_rec = grads(o_rec, [x[n] for n in names])
    for n, a, b in zip(names, g_quad, g_rec):
        assert torch.isfinite(a).all() and a.abs().max() > 0, n
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"d{n}: {m}")
    # the sinks matter here: the same call without them differs
    o0, _ = ref(x, W, 0)
    assert (o_quad - o0).abs().max() > 1e-3


@pytest.mark.parametrize("W,S", [(1, 2), (3, 3), (2, 7), (5, 40)])
def test_window_weight_zero_is_a_softmax_over_window_and_sinks(W, S):
    x = make(gate=True, seed=3)
    x["gamma"] = 0.0
    want = masked_softmax(x["q_sm"], x["k_sm"], x["v"], W, S)
    for fn in (la.linear_attn_ref, la.linear_attn_recurrent_ref):
        torch.testing.assert_close(ref(x, W, S, fn=fn)[0], want, **TOL)
    for form in ("parallel", "recurrent", "chunk"):
        torch.testing.assert_close(ours(x, W, S, form, window_weight=0.0)[0], want, **TOL)


def test_sinks_inside_the_window_count_once():
    """With W >= T every sink is in every query's window already: sinks change nothing."""
    x = make(T=9, seed=4)
    o0, _ = ref(x, 9, 0)
    for S in (1, 4, 9):
        torch.testing.assert_close(ref(x, 9, S)[0], o0, **TOL)
        torch.testing.assert_close(ref(x, 9, S, fn=la.linear_attn_recurrent_ref)[0], o0, **TOL)
        torch.testing.assert_close(ours(x, 9, S, "chunk")[0], o0, **TOL)


def test_sinks_zero_is_the_old_result():
    x = make(seed=5)
    for fn in (la.linear_attn_ref, la.linear_attn_recurrent_ref):
        base = fn(x["qf"], x["kf"], x["v"], log_g=x["log_g"], window=3, q_sm=x["q_sm"], k_sm=x["k_sm"],
                  sm_scale=SCALE, window_weight=x["gamma"], output_final_state=True)
        o, (S_, z) = ref(x, 3, 0, fn=fn)
        assert torch.equal(o, base[0]) and torch.equal(S_, base[1][0]) and torch.equal(z, base[1][1])
    for form in ("parallel", "recurrent", "chunk"):
        base = linear_attention(x["qf"], x["kf"], x["v"], log_g=x["log_g"], window=3, q_sm=x["q_sm"],
                                k_sm=x["k_sm"], sm_scale=SCALE, window_weight=x["gamma"], form=form, chunk_size=4)
        o, (S_, z) = ours(x, 3, 0, form)
        assert torch.equal(o, base[0]) and torch.equal(S_, base[1][0]) and torch.equal(z, base[1][1])


@pytest.mark.parametrize("fn", [la.linear_attn_ref, la.linear_attn_recurrent_ref])
def test_varlen_sequences_each_have_their_own_sinks(fn):
    lens, W, S = (2, 11, 6), 2, 3
    x = make(B=1, T=sum(lens), seed=6)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    o, (S_, z) = ref(x, W, S, fn=fn, cu_seqlens=cu)
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        part = {k: (t[:, a:b] if isinstance(t, torch.Tensor) and k != "gamma" else t) for k, t in x.items()}
        o_n, (S_n, z_n) = ref(part, W, S, fn=fn)
        torch.testing.assert_close(o[:, a:b], o_n, **TOL)
        torch.testing.assert_close(S_[n : n + 1], S_n, **TOL)
        torch.testing.assert_close(z[n : n + 1], z_n, **TOL)
    # against the unsplit row: later sequences lose the row's first keys as sinks and gain their own
    assert (o - ref(x, W, S, fn=fn)[0])[:, lens[0]:].abs().max() > 1e-3


@pytest.mark.parametrize("form", ["parallel", "recurrent", "chunk"])
@pytest.mark.parametrize("gate", [True, False])
@pytest.mark.parametrize("W,S", [(1, 2), (3, 5), (6, 4), (2, 30)])
def test_linear_attention_forms_match_the_reference_with_grads(form, W, S, gate):
    x = with_grad(make(T=19, gate=gate, seed=7))
    o, (S_, z) = ours(x, W, S, form)
    o_ref, (S_ref, z_ref) = ref(x, W, S)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(S_, S_ref, **TOL)
    torch.testing.assert_close(z, z_ref, **TOL)
    names = [n for n in NAMES if x[n] is not None]
    for n, a, b in zip(names, grads(o, [x[n] for n in names]), grads(o_ref, [x[n] for n in names])):
        assert a.abs().max() > 0, n
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"d{n}: {m}")


@pytest.mark.parametrize("form", ["parallel", "recurrent", "chunk"])
def test_packed_documents_match_each_document_alone(form):
    """Row 0: a document shorter than S, a long one, one shorter than W; row 1 another packing.
    Outputs and gradients as if each document ran alone."""
    W, S = 6, 4
    rows = [(3, 30, 5), (12, 1, 25)]
    T = 38
    x = with_grad(make(T=T, seed=8))
    doc = torch.tensor([[i for i, n in enumerate(lens) for _ in range(n)] for lens in rows])
    o, (S_, z) = ours(x, W, S, form, doc=doc)
    names = [n for n in NAMES if x[n] is not None]
    g_packed = grads(o, [x[n] for n in names])
    cot = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=f64)  # grads()'s cotangent
    for b, lens in enumerate(rows):
        a = 0
        for n in lens:
            sl = slice(a, a + n)
            part = {k: (t[b : b + 1, sl] if isinstance(t, torch.Tensor) and k != "gamma" else t) for k, t in x.items()}
            o_n, (S_n, z_n) = ours(part, W, S, form)
            torch.testing.assert_close(o[b : b + 1, sl], o_n, **TOL)
            g_n = torch.autograd.grad((o_n * cot[b : b + 1, sl]).sum(), [part[k] for k in names], allow_unused=True)
            for k, gp, gn in zip(names, g_packed, g_n):  # gn None: unused alone (kf of a document < W)
                gp = gp[b : b + 1, sl]
                torch.testing.assert_close(gp, torch.zeros_like(gp) if gn is None else gn, **TOL,
                                           msg=lambda m: f"d{k}: {m}")
            a += n
        if lens[-1] >= W:  # the last document's state (a shorter one leaves the state at t-W to the one before)
            torch.testing.assert_close(S_[b : b + 1], S_n, **TOL)
            torch.testing.assert_close(z[b : b + 1], z_n, **TOL)
    # gamma 0: the plain masked softmax over each document's window and sinks
    starts = [[sum(lens[:i]) for i, n in enumerate(lens) for _ in range(n)] for lens in rows]
    want = masked_softmax(x["q_sm"].detach(), x["k_sm"].detach(), x["v"].detach(), W, S, starts=starts)
    torch.testing.assert_close(ours(x, W, S, form, doc=doc, window_weight=0.0)[0].detach(), want, **TOL)


@pytest.mark.parametrize("form", ["parallel", "chunk"])
def test_padding_and_softcap_apply_to_sinks_like_window_keys(form):
    W, S, cap = 3, 4, 1.5
    x = make(T=15, seed=9)
    x["q_sm"] = 2.0 * x["q_sm"]  # scores well past the cap
    valid = torch.ones(2, 15, dtype=torch.bool)
    valid[0, 1] = False  # a sink
    valid[1, 9] = False  # a window key
    want = masked_softmax(x["q_sm"], x["k_sm"], x["v"], W, S, valid=valid, softcap=cap)
    got, _ = ours(x, W, S, form, window_weight=0.0, key_valid=valid, softcap=cap)
    torch.testing.assert_close(got, want, **TOL)
    assert (got - masked_softmax(x["q_sm"], x["k_sm"], x["v"], W, S, valid=valid)).abs().max() > 1e-3
    assert (got - masked_softmax(x["q_sm"], x["k_sm"], x["v"], W, S, softcap=cap)).abs().max() > 1e-3


def test_bad_sinks_are_refused():
    x = make(T=6)
    for fn in (la.linear_attn_ref, la.linear_attn_recurrent_ref):
        with pytest.raises(ValueError, match="sinks must be >= 0"):
            ref(x, 2, -1, fn=fn)
        with pytest.raises(ValueError, match="sinks need a window > 0"):
            fn(x["qf"], x["kf"], x["v"], sinks=2)
    with pytest.raises(ValueError, match="sinks must be >= 0"):
        ours(x, 2, -1, "chunk")
    with pytest.raises(ValueError, match="sinks need a window > 0"):
        linear_attention(x["qf"], x["kf"], x["v"], sinks=2)
    with pytest.raises(ValueError, match="cached prefix"):
        linear_attention(x["qf"][:, 2:], x["kf"], x["v"], window=3, q_sm=x["q_sm"][:, 2:], k_sm=x["k_sm"],
                         prefix=2, sinks=1)
    B, _, H, F = x["qf"].shape
    state = (torch.zeros(B, H, F, x["v"].shape[-1], dtype=f64), torch.zeros(B, H, F, dtype=f64))
    with pytest.raises(ValueError, match="cached prefix"):
        ours(x, 2, 1, "chunk", initial_state=state)


def test_lolcats_preset_has_four_sinks_and_flags_override_them():
    """The lolcats preset keeps 4 sinks beside its window (the 2026-11-29 run); --sinks sets another
    number, and --window 0 (no window) drops the preset's sinks with it instead of refusing them."""
    from linearize.recipes.distill import DistillConfig

    cfg = DistillConfig(preset="lolcats").method_config()
    assert (cfg.window, cfg.sinks) == (192, 4)
    assert DistillConfig(preset="lolcats", sinks=0).method_config().sinks == 0
    assert DistillConfig(preset="lolcats", window=32, sinks=2).method_config().sinks == 2
    assert (DistillConfig(preset="lolcats", window=0).method_config().window,
            DistillConfig(preset="lolcats", window=0).method_config().sinks) == (0, 0)
    assert DistillConfig(preset="linear").method_config().sinks == 0
    with pytest.raises(ValueError, match="window"):
        DistillConfig(preset="lolcats", window=0, sinks=2)
    # an encoder given the lolcats preset hears about the preset, not about sinks it did not ask for
    with pytest.raises(ValueError, match="encoders take --preset linformer or --preset linear"):
        DistillConfig(preset="lolcats").method_config(encoder=True)
    with pytest.raises(ValueError, match="--sinks is for the window presets of decoders"):
        DistillConfig(preset="lolcats", sinks=2).method_config(encoder=True)


# ----------------------------------------------------------------------------- a converted model with sinks

def _sinks_model(window=6, sinks=2, seed=0):
    import linearize
    from conftest import converted

    torch.manual_seed(seed)
    model = converted("llama", linearize.LinearAttentionConfig(window=window, sinks=sinks, chunk_size=4))
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "window_log_gamma"):
                m.window_log_gamma.normal_()
    return model.eval()


def test_layer_with_sinks_and_no_linear_weight_is_the_swa_baseline():
    """The lolcats layer with sinks and its linear branch weighted 0 is exactly the SWA baseline
    (linearize/swa.py: softmax over the window plus the first S tokens of each document), on one
    document, on a packed row, and with left padding; with the branch's weight the two differ."""
    import copy

    from conftest import tiny_model
    from linearize.swa import apply_swa

    import linearize

    torch.manual_seed(0)
    base = tiny_model("llama", num_hidden_layers=2).eval()
    model = copy.deepcopy(base)
    linearize.linearize(model, linearize.LinearAttentionConfig(window=6, sinks=2, chunk_size=4))
    baseline = copy.deepcopy(base)
    apply_swa(baseline, window=6, sinks=2)
    T = 30
    ids = torch.randint(2, 90, (2, T))
    pos = torch.cat([torch.arange(11), torch.arange(T - 11)])[None].expand(2, T)  # two documents a row
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :5] = 0
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        assert (full - baseline(ids, use_cache=False).logits).abs().max() > 1e-2  # the branch counts
        for m in model.modules():
            if hasattr(m, "window_log_gamma"):
                m.window_log_gamma.fill_(-1e4)  # gamma = 0
        for kw in (dict(), dict(position_ids=pos), dict(attention_mask=mask)):
            got, want = model(ids, use_cache=False, **kw).logits, baseline(ids, use_cache=False, **kw).logits
            keep = kw.get("attention_mask", torch.ones(2, T)).bool()
            torch.testing.assert_close(got[keep], want[keep], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_cache_with_sinks_equals_a_full_recompute(static):
    """Left-padded rows, a chunked prefill and token-by-token decoding through the cache (its sink
    buffer filled from each row's first real tokens) give the logits of one forward without a
    cache; and the sinks change them."""
    import linearize

    model = _sinks_model(window=3, sinks=2)
    B, D = 2, 7
    T = 9 + D
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 97, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :4], ids[1, :4] = 0, 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        cache = (linearize.StaticLinearizeCache(model.config, max_batch_size=B, max_cache_len=T) if static
                 else linearize.LinearizeCache(model.config))
        steps, s = [], 0
        for c in [2, 5, 2] + [1] * D:
            out = model(ids[:, s:s + c], attention_mask=mask[:, :s + c], position_ids=pos[:, s:s + c],
                        past_key_values=cache, use_cache=True)
            steps.append(out.logits)
            s += c
        real = mask.bool()
        torch.testing.assert_close(torch.cat(steps, 1)[real], full[real], atol=2e-4, rtol=2e-4)
        at = cache.layers[0].recurrent_states[9]  # sink_at: each row's first two real tokens
        assert at.tolist() == [[0.0, 1.0], [4.0, 5.0]]
        plain = _sinks_model(window=3, sinks=0)
        plain.load_state_dict(model.state_dict())
        assert (plain(ids, attention_mask=mask, position_ids=pos, use_cache=False).logits[real] - full[real]).abs().max() > 1e-2


@pytest.mark.parametrize("first", [1, 5], ids=["short-prompt", "long-prompt"])
def test_unpadded_prompt_fills_the_sinks_without_a_host_read(first):
    """A prompt without padding (the one-call prefill) fills the sinks and sets the cache's
    ``sinks_full`` flag without reading a tensor on the host (one read a layer stalled a 64K-token
    prefill); a prompt shorter than the sinks leaves the flag down and the decode steps fill them;
    the logits equal one forward without a cache either way."""
    import linearize
    from linearize.graphs import HostReads

    model = _sinks_model(window=3, sinks=2)
    T = first + 6
    ids = torch.randint(2, 97, (2, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = linearize.LinearizeCache(model.config)
        with HostReads() as reads:
            steps = [model(ids[:, :first], past_key_values=cache, use_cache=True).logits]
        assert not [r for r in reads.found if "layers.py" in r], reads.found
        assert [layer.sinks_full for layer in cache.layers] == [first >= 2] * len(cache.layers)
        for s in range(first, T):
            steps.append(model(ids[:, s:s + 1], past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=2e-4, rtol=2e-4)
    assert cache.layers[0].recurrent_states[9].tolist() == [[0.0, 1.0], [0.0, 1.0]]


def test_cli_converts_and_distills_with_sinks(tmp_path, capsys):
    """`linearize convert --window W --sinks S` and `linearize distill --preset lolcats --sinks S`
    record the sinks in the checkpoint, which loads and generates with them, as `--preset gdn --window W
    --sinks S` does beside Gated DeltaNet; --sinks without a window is refused with a one-line error."""
    from conftest import tiny_model_dir, word_docs
    from linearize.cli import main
    from transformers import AutoModelForCausalLM

    src = tiny_model_dir(tmp_path / "tiny", "llama")
    out = tmp_path / "conv"
    assert main(["convert", str(src), "--out", str(out), "--window", "4", "--sinks", "2"]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.config.linearize["sinks"] == 2
    assert all(m.sinks == 2 for m in loaded.modules() if hasattr(m, "window_log_gamma"))
    assert main(["generate", str(out), "--prompt", "w5 w6 w7 w8 w9 w10 w11", "--max-new-tokens", "4"]) == 0

    docs = word_docs(tmp_path / "docs")
    common = ["distill", str(src), "--data", str(docs), "--held-out-percent", "50", "--seq-len", "32",
              "--batch-size", "2", "--stage1-steps", "1", "--stage2-steps", "1", "--eval-rows", "2",
              "--eval-prompts", "1", "--passkey", "none"]
    assert main([*common, "--out", str(tmp_path / "run"), "--preset", "lolcats", "--window", "8", "--sinks", "3"]) == 0
    run = json.loads((tmp_path / "run" / "config.json").read_text())
    assert run["linearize"]["sinks"] == 3 and run["linearize"]["window"] == 8
    # a gdn preset takes a window and its sinks beside its Gated DeltaNet layers
    assert main([*common, "--out", str(tmp_path / "gdn"), "--preset", "gdn", "--window", "8", "--sinks", "2"]) == 0
    run = json.loads((tmp_path / "gdn" / "config.json").read_text())
    assert (run["linearize"]["method"], run["linearize"]["window"], run["linearize"]["sinks"]) == ("gdn", 8, 2)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "gdn")
    assert {(m.window, m.sinks) for m in loaded.modules() if hasattr(m, "window_gamma")} == {(8, 2)}
    capsys.readouterr()
    assert main([*common, "--out", str(tmp_path / "bad"), "--preset", "gdn", "--sinks", "2"]) == 2
    assert "--sinks" in capsys.readouterr().err
    assert main(["convert", str(src), "--out", str(tmp_path / "bad2"), "--sinks", "2"]) == 2
    assert "window" in capsys.readouterr().err


def test_lolcats_hybrid_preset_through_the_cli(tmp_path, capsys):
    """`linearize distill --preset lolcats-hybrid`: window hybrids with sinks in every layer but the quarter
    kept softmax (chosen by KL on the training rows, the long rows' choice recorded beside it), the last
    quarter of stage 2 on long rows; the result loads with AutoModelForCausalLM and generates."""
    from conftest import tiny_model_dir, word_docs
    from linearize.cli import main
    from transformers import AutoModelForCausalLM

    src = tiny_model_dir(tmp_path / "tiny", "llama")
    docs = word_docs(tmp_path / "docs", n=24)
    out = tmp_path / "run"
    assert main(["distill", str(src), "--data", str(docs), "--held-out-percent", "20", "--seq-len", "32",
                 "--batch-size", "2", "--stage1-steps", "2", "--stage2-steps", "4", "--eval-rows", "2",
                 "--eval-prompts", "1", "--passkey", "none", "--out", str(out), "--preset", "lolcats-hybrid",
                 "--window", "8", "--long-seq-len", "64", "--long-min-doc-tokens", "100"]) == 0
    conv = json.loads((out / "config.json").read_text())["linearize"]
    assert (conv["method"], conv["window"], conv["sinks"]) == ("linear_attention", 8, 4)
    (kept,) = conv["softmax_layers"]  # 25% of tiny's layers, at least one
    loaded = AutoModelForCausalLM.from_pretrained(out)
    attn = [layer.self_attn for layer in loaded.model.layers]
    assert conv["layers"] == [i for i in range(len(attn)) if i != kept] and len(attn) > 1
    assert (conv["softmax_selection"]["on"], conv["softmax_selection"]["alternative"]["on"]) == ("training rows", "long rows")
    record = json.loads((out / "distill.json").read_text())
    assert record["stage3"]["steps"] == 1  # the long rows' quarter of 4 steps
    assert record["data"]["long_min_doc_tokens"] == 100  # every document here (120 words) is that long
    # ... on the conversion's own weights alone, at lr 1e-3 (the preset since 2026-12-06a)
    assert (record["config"]["long_finetune"], record["config"]["long_lr"]) == ("new", 1e-3)
    assert type(attn[kept]).__name__ == "LlamaAttention"
    assert all(attn[i].window == 8 and attn[i].sinks == 4 for i in conv["layers"])
    capsys.readouterr()
    assert main(["generate", str(out), "--prompt", "w5 w6 w7 w8 w9 w10 w11", "--max-new-tokens", "4"]) == 0
    # a teacher's-weights rate where the preset's long-row stage trains none of them: one line, exit 2, nothing written
    capsys.readouterr()
    bad = tmp_path / "bad"
    assert main(["distill", str(src), "--data", str(docs), "--out", str(bad), "--preset", "lolcats-hybrid",
                 "--long-teacher-lr", "1e-5"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--long-teacher-lr" in err and "--long-finetune mlp" in err and len(err.splitlines()) == 1
    assert not bad.exists()
    # long rows of documents longer than any here, or for a preset without long rows: one line each, nothing written
    for flags, says in ((["--preset", "lolcats-hybrid", "--seq-len", "32", "--long-seq-len", "64",
                          "--long-min-doc-tokens", "500"],
                         "documents of at least 500 tokens"),
                        (["--preset", "lolcats", "--long-min-doc-tokens", "100"], "--preset lolcats has no such stage")):
        assert main(["distill", str(src), "--data", str(docs), "--out", str(bad), *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]  # after the model's loading bar, if any
        assert err.startswith("linearize distill: error:") and says in err and "--long-min-doc-tokens" in err
        assert not bad.exists()
