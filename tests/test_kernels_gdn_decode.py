"""The fused Gated DeltaNet decode step (kernels/gated_delta/decode.py): the kernel against its
float64 reference, the op's registration, and a converted layer's fused decode path against its
unfused path (same outputs, same state, same conv cache) over several calls, with padding, GQA,
fused q|k|v layouts, partial rotary, fp32 and bf16, on the dynamic and the static cache.

Runs where the kernels run: on CUDA, or on CPU under TRITON_INTERPRET=1 (CI's kernel pass)."""

import os

import pytest
import torch

import linearize
from linearize import LinearizeCache, StaticLinearizeCache
from linearize.gdn import GatedDeltaNet
from linearize.kernels import ops
from linearize.kernels.gated_delta import fused_gated_delta_decode, gated_delta_decode_columns, gated_delta_decode_ref

from conftest import attention, converted
from conftest import rel_err

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs CUDA or TRITON_INTERPRET=1",
)
DEV = "cuda" if torch.cuda.is_available() else "cpu"



# -- the kernel against the reference -----------------------------------------------------------------

CASES = {  # B, T, H, Hkv, D, conv width, rotary dims, states ("expand" | "group"), padding, q|k|v layout
    "expand-gqa-T3-pad": dict(B=2, T=3, H=4, Hkv=2, D=16, W=3, R=16, kv="expand", pad=True, qkv="separate"),
    "group-gqa-T2-pad": dict(B=2, T=2, H=4, Hkv=2, D=16, W=4, R=16, kv="group", pad=True, qkv="separate"),
    "T1-no-pad": dict(B=2, T=1, H=3, Hkv=1, D=16, W=3, R=16, kv="expand", pad=False, qkv="separate"),
    "partial-rotary-odd-D": dict(B=1, T=2, H=2, Hkv=2, D=24, W=2, R=12, kv="expand", pad=False, qkv="concat"),
    "per-head-qkv": dict(B=2, T=2, H=2, Hkv=2, D=16, W=3, R=4, kv="expand", pad=True, qkv="per_head"),
    "no-conv-no-rope": dict(B=2, T=2, H=4, Hkv=2, D=16, W=0, R=0, kv="group", pad=True, qkv="separate"),
    # three programs (query heads) read each k/v head's conv channels; T > W replaces the whole cache;
    # 320 conv channels span two blocks of the conv update, the second partly masked
    "expand-rep3-T4-two-channel-blocks": dict(B=2, T=4, H=6, Hkv=2, D=32, W=3, R=32, kv="expand", pad=True,
                                              qkv="separate"),
    "group-rep3-T3-concat": dict(B=2, T=3, H=6, Hkv=2, D=16, W=4, R=8, kv="group", pad=True, qkv="concat"),
}


def _case_inputs(c, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, T, H, Hkv, D = c["B"], c["T"], c["H"], c["Hkv"], c["D"]
    Hs = H if c["kv"] == "expand" else Hkv
    separate = {"q_proj": H * D, "k_proj": Hkv * D, "v_proj": Hkv * D}
    qkv = separate if c["qkv"] == "separate" else {"qkv": (H + 2 * Hkv) * D}
    widths = {**qkv, "a_proj": Hs, "b_proj": Hs, "o_gate": H * D}
    cols = gated_delta_decode_columns(widths, qkv=tuple(qkv), per_head=c["qkv"] == "per_head", num_heads=H,
                                      num_kv_heads=Hkv, head_dim=D)
    kw = dict(cols=cols, num_heads=H, num_kv_heads=Hkv, head_dim=D,
              A_log=torch.randn(Hs, generator=g) * 0.5, dt_bias=torch.randn(Hs, generator=g),
              norm_weight=torch.rand(D, generator=g) + 0.5, norm_mix=torch.rand(H, generator=g),
              state=torch.randn(B, Hs, D, D, generator=g) * 0.1)
    y = torch.randn(B, T, sum(widths.values()), generator=g).to(dtype)
    if c["W"]:
        C = (H + 2 * Hkv) * D
        kw["conv_state"] = torch.randn(B, C, c["W"], generator=g).to(dtype)
        kw["conv_weight"] = torch.randn(C, 1, c["W"], generator=g) * 0.5
    if c["R"]:
        angle = torch.rand(1, T, c["R"] // 2, generator=g) * 6
        kw["cos"], kw["sin"] = (torch.cat([f(angle)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    if c["pad"]:
        valid = torch.ones(B, T, dtype=torch.bool)
        valid[-1, 0] = False  # a pad token before a real one (left padding), and one after
        valid[0, -1] = False
        kw["valid"] = valid
    return y, kw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_reference(case, dtype):
    y, kw = _case_inputs(CASES[case], dtype)
    f64 = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() and v.dtype == torch.float32 else v
           for k, v in kw.items()}
    o_ref, S_ref, conv_ref = gated_delta_decode_ref(y.double() if dtype == torch.float32 else y, **f64)
    dev = {k: v.to(DEV) if torch.is_tensor(v) else v for k, v in kw.items()}
    S, conv = dev["state"].clone(), None if "conv_state" not in dev else dev["conv_state"].clone()
    ptrs = S.data_ptr(), None if conv is None else conv.data_ptr()
    with torch.no_grad():
        o = fused_gated_delta_decode(y.to(DEV), **{**dev, "state": S, "conv_state": conv})
    assert o.dtype == dtype and o.shape == (y.shape[0], y.shape[1], kw["num_heads"] * kw["head_dim"])
    assert (S.data_ptr(), None if conv is None else conv.data_ptr()) == ptrs  # advanced in place
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(o, o_ref) < tol and rel_err(S, S_ref) < 1e-5
    if conv is not None:
        assert torch.equal(conv.cpu(), conv_ref)  # a copy of inputs: exact
        assert not torch.equal(conv.cpu(), kw["conv_state"])


@pytest.mark.parametrize("block_v", [8, 64], ids=["split-columns", "whole-columns"])
@pytest.mark.parametrize("case", ["expand-gqa-T3-pad", "group-rep3-T3-concat", "no-conv-no-rope",
                                  "partial-rotary-odd-D"])
def test_split_or_whole_value_columns_match_reference(case, block_v, monkeypatch):
    """The state's value columns over several programs per state head (the output's norm and gate then
    applied by the finish kernel, beside the conv cache update) or one: both equal the reference."""
    decode = __import__("importlib").import_module("linearize.kernels.gated_delta.decode")
    monkeypatch.setattr(decode, "BLOCK_V", block_v)
    grids = []
    finish = decode._gdn_finish_kernel
    monkeypatch.setattr(decode, "_gdn_finish_kernel", type("Spy", (), {
        "__getitem__": lambda self, grid: grids.append(grid) or finish[grid]})())
    y, kw = _case_inputs(CASES[case], torch.float32, seed=3)
    f64 = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in kw.items()}
    o_ref, S_ref, conv_ref = gated_delta_decode_ref(y.double(), **f64)
    dev = {k: v.to(DEV) if torch.is_tensor(v) else v for k, v in kw.items()}
    S, conv = dev["state"].clone(), None if "conv_state" not in dev else dev["conv_state"].clone()
    with torch.no_grad():
        o = fused_gated_delta_decode(y.to(DEV), **{**dev, "state": S, "conv_state": conv})
    assert rel_err(o, o_ref) < 1e-5 and rel_err(S, S_ref) < 1e-5
    if conv is not None:
        assert torch.equal(conv.cpu(), conv_ref.float())
    c = CASES[case]
    rows = c["T"] * c["H"] if block_v < c["D"] else 0  # output rows the finish kernel normalizes
    assert [g[0] for g in grids] == ([] if rows == 0 and not c["W"] else [rows + (1 if c["W"] else 0)])


def test_reference_is_the_layers_math():
    """The reference's pad handling and state step: a pad token leaves the state as it was, and a
    token's conv reads the cache first (so the reference does not just agree with the kernel)."""
    c = dict(CASES["expand-gqa-T3-pad"], T=1, pad=True)
    y, kw = _case_inputs(c, torch.float64)
    kw = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in kw.items()}
    kw["valid"] = torch.tensor([[False], [True]])
    _, S, conv = gated_delta_decode_ref(y, **kw)
    assert torch.equal(S[0], kw["state"][0]) and not torch.allclose(S[1], kw["state"][1])
    assert torch.equal(conv[0, :, -1], torch.zeros_like(conv[0, :, -1]))  # the pad's conv input is zero
    assert torch.equal(conv[:, :, :-1], kw["conv_state"][:, :, 1:])  # shifted by one


def test_opcheck():
    y, kw = _case_inputs(CASES["expand-gqa-T3-pad"], torch.float32)
    kw = {k: v.to(DEV) if torch.is_tensor(v) else v for k, v in kw.items()}
    args = (y.to(DEV), kw["state"], kw["conv_state"], kw["conv_weight"].reshape(-1, 3), kw["cos"], kw["sin"],
            kw["valid"], kw["A_log"], kw["dt_bias"], kw["norm_weight"], kw["norm_mix"], kw["cols"], 4, 2)
    torch.library.opcheck(ops.OPS["gated_delta_decode"], args)


def test_bad_arguments_are_refused():
    y, kw = _case_inputs(CASES["expand-gqa-T3-pad"], torch.float32)
    with pytest.raises(ValueError, match="contiguous float32"):
        fused_gated_delta_decode(y, **{**kw, "state": kw["state"].double()})
    with pytest.raises(ValueError, match="conv_state and conv_weight together"):
        fused_gated_delta_decode(y, **{**kw, "conv_weight": None})
    with pytest.raises(ValueError, match="head_dim 256 is above"):
        fused_gated_delta_decode(y, **{**kw, "head_dim": 256})
    with pytest.raises(RuntimeError, match="inference-only"):
        fused_gated_delta_decode(y.requires_grad_(), **kw)


# -- a converted layer: fused decode path == unfused path ---------------------------------------------

LAYER_CASES = {  # model type, GDN config, dtype, cache
    "llama-expand-fp32-dynamic": ("llama", dict(conv_size=3), torch.float32, "dynamic"),
    "llama-group-bf16-static": ("llama", dict(conv_size=4, kv_heads="group"), torch.bfloat16, "static"),
    "phi3-partial-rotary-static": ("phi3", dict(conv_size=3), torch.float32, "static"),  # fused [q|k|v] projection
    "gpt_neox-per-head-dynamic": ("gpt_neox", dict(conv_size=2), torch.float32, "dynamic"),  # per-head q|k|v
    "llama-no-conv-no-rope-bf16-dynamic": ("llama", dict(conv_size=0, use_rope=False), torch.bfloat16, "dynamic"),
}


def _rotary(model):
    return next(m for n, m in model.named_modules() if n.endswith("rotary_emb"))


def _run_layer(model, layer, dtype, cache_kind):
    """Feed one layer a padded prompt, then decode calls of 1, 1, 3 (a pad token inside) and 1 tokens.
    Returns every call's output and the layer's final state and conv cache."""
    B, hidden = 2, model.config.hidden_size
    g = torch.Generator().manual_seed(5)
    chunks = [5, 1, 1, 3, 1]
    x = torch.randn(B, sum(chunks), hidden, generator=g).to(DEV, dtype)
    mask = torch.ones(B, sum(chunks), dtype=torch.long, device=DEV)
    mask[1, :2] = 0  # left padding in the prompt
    mask[0, 8] = 0  # a pad token in the middle of the 3-token decode call
    pos = torch.arange(sum(chunks), device=DEV)[None].expand(B, -1)
    if cache_kind == "static":
        cache = StaticLinearizeCache(model.config, max_batch_size=B, max_cache_len=sum(chunks), device=DEV)
    else:
        cache = LinearizeCache(model.config)
    outs, start = [], 0
    with torch.no_grad():
        layer.refresh_decode_weights()  # the fused input GEMM, as the model's forward builds it
        for n in chunks:
            sl = slice(start, start + n)
            pe = _rotary(model)(x[:, sl], pos[:, sl])
            out, _ = layer(x[:, sl], position_embeddings=pe, attention_mask=mask[:, : start + n],
                           position_ids=pos[:, sl], **{layer.cache_kwarg: cache})
            outs.append(out.float())
            start += n
    state = cache.layers[layer.layer_idx]
    return outs, state.read()["S"].clone(), None if not layer.conv_size else state.conv_states[0].clone()


@pytest.mark.parametrize("case", sorted(LAYER_CASES))
def test_layer_fused_decode_matches_unfused_path(case, monkeypatch):
    arch, cfg, dtype, cache_kind = LAYER_CASES[case]
    monkeypatch.setenv("LINEARIZE_KERNELS", "auto")
    model = converted(arch, linearize.GatedDeltaNetConfig(**cfg)).to(DEV, dtype)
    layer = attention(model, 0)
    assert isinstance(layer, GatedDeltaNet)
    import linearize.gdn as gdn

    calls = []
    real = gdn.fused_gated_delta_decode
    monkeypatch.setattr(gdn, "fused_gated_delta_decode", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    fused = _run_layer(model, layer, dtype, cache_kind)
    assert len(calls) == 4  # every call after the prompt took the fused kernel
    monkeypatch.setattr(GatedDeltaNet, "_fused_decode", lambda *a: False)
    monkeypatch.setattr(GatedDeltaNet, "_fused_prefill", lambda *a: False)  # the prompt too: the PyTorch glue
    unfused = _run_layer(model, layer, dtype, cache_kind)
    assert len(calls) == 4
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for i, (a, b) in enumerate(zip(fused[0], unfused[0])):
        assert rel_err(a, b) < tol, f"output of call {i}: {rel_err(a, b)}"
    assert rel_err(fused[1], unfused[1]) < tol, "state"
    if fused[2] is not None:
        assert fused[2].dtype == unfused[2].dtype and rel_err(fused[2], unfused[2]) < 1e-6, "conv cache"


def test_qk_norm_rows_keep_the_unfused_path(monkeypatch):
    """qwen3's per-head q/k norms are not in the kernel: its decode steps run the unfused path."""
    monkeypatch.setenv("LINEARIZE_KERNELS", "auto")
    model = converted("qwen3", linearize.GatedDeltaNetConfig(conv_size=3)).to(DEV)
    import linearize.gdn as gdn

    calls = []
    monkeypatch.setattr(gdn, "fused_gated_delta_decode", lambda *a, **kw: calls.append(1))
    with torch.no_grad():
        model.generate(torch.randint(2, 97, (1, 4), device=DEV), max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert not calls
