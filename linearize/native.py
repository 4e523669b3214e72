"""Export a converted model to a native transformers architecture: a checkpoint that loads without linearize.

    linearize.export(model, "out", format="qwen3_5")     # or: linearize export DIR --format qwen3_5 --out OUT
    AutoModelForCausalLM.from_pretrained("out")           # a plain Qwen3_5ForCausalLM

``qwen3_5``: transformers' Qwen3.5 text model (``model_type: qwen3_5_text``, transformers >= 5.17)
is a hybrid of Gated DeltaNet layers and softmax attention layers, picked per layer by
``layer_types``, with a dense gated SiLU MLP in every layer and RMSNorms with (1 + w) weights. A
model converted with ``GatedDeltaNetConfig(layout="qwen3_5")`` from a Llama-style family writes
into it as it is:

- its Gated DeltaNet layers are Qwen3.5's layer (``linearize/gdn_qwen3_5.py``): exact;
- its kept softmax layers become Qwen3.5 attention: the output gate (a doubled ``q_proj``) gets zero
  weights, so sigmoid(0) = 1/2, folded exactly into ``o_proj`` (scaled by 2); q/k RMSNorms, which
  Qwen3.5 always applies, are the model's own where it has them (Qwen3: exact) and otherwise added
  with unit weights, the one deviation (``export_report`` names it; distillation heals it);
- norms, MLPs, embeddings and RoPE (base, partial rotary, scaling) carry over as they are.

Whatever Qwen3.5 cannot express is refused in one line naming the layer and what to do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .arch import ARCHITECTURES, EncoderSpec, get_arch, get_submodule, local_window
from .loading import UserError, prepare_out_dir, save_atomically

FORMATS = ("qwen3_5",)

# RoPE types whose parameters Qwen3.5's rotary embedding reads as the source model does (compared
# number by number below before anything is written)
_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

CONVERT_HINT = "convert it with `linearize convert MODEL --method gdn --layout qwen3_5` (or distill with --layout qwen3_5)"


class ExportError(UserError):
    """The model cannot be written in the requested format; the message says which layer and why."""


@dataclass
class ExportReport:
    """What an export wrote: per-layer kinds and where it is not exact."""

    format: str
    linear_layers: list[int] = field(default_factory=list)
    softmax_layers: list[int] = field(default_factory=list)
    deviations: list[str] = field(default_factory=list)  # empty: the export computes what the model does
    warnings: list[str] = field(default_factory=list)  # how transformers itself may fall short running it


def export(model, out, format: str = "qwen3_5", tokenizer=None, overwrite: bool = False) -> ExportReport:
    """Write ``model`` (converted by linearize) to ``out`` in a native transformers format.

    ``out`` gets ``config.json``, safetensors weights under transformers' own parameter names,
    ``generation_config.json``, the tokenizer (and its chat template) when ``tokenizer`` is given, and a
    model card (README.md). Written into a temporary folder beside ``out`` and moved into place; an
    existing non-empty ``out`` is refused unless ``overwrite``. Raises ``ExportError`` (one line:
    which layer, why, what to do) when the model cannot be expressed. Returns an ``ExportReport``.
    """
    if format not in FORMATS:
        raise ExportError(f"unknown export format {format!r}; choose one of {list(FORMATS)}")
    config, state_dict, report = qwen3_5_checkpoint(model)
    out = prepare_out_dir(out, overwrite)

    def write(tmp: Path):
        _save_qwen3_5(tmp, config, state_dict, model)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / "README.md").write_text(_model_card(model, config, report), encoding="utf-8")

    save_atomically(out, write)
    return report


def export_qwen3_5(model, out, tokenizer=None, overwrite: bool = False) -> ExportReport:
    """``export(model, out, format="qwen3_5", ...)``."""
    return export(model, out, format="qwen3_5", tokenizer=tokenizer, overwrite=overwrite)


# ---------------------------------------------------------------- model -> (config, state dict)


def qwen3_5_checkpoint(model):
    """(``Qwen3_5TextConfig``, state dict in ``Qwen3_5ForCausalLM``'s names, ``ExportReport``) of a
    converted model, or ``ExportError``. Nothing is written."""
    from transformers import Qwen3_5TextConfig

    from .gdn_qwen3_5 import Qwen35GatedDeltaNet
    from .modeling_linearize import CONVERTED

    cfg = model.config
    conv = getattr(cfg, "linearize", None)
    if not conv:
        raise ExportError(f"this {cfg.model_type} model is not converted (no config.linearize); {CONVERT_HINT}")
    spec = get_arch(cfg.model_type)
    if isinstance(spec, EncoderSpec):
        raise ExportError(f"{spec.model_type} is a bidirectional encoder; Qwen3.5 is a causal LM: export converts decoders")
    if spec.qwen3_5:
        ok = ", ".join(a for a, row in ARCHITECTURES.items() if not row.qwen3_5)
        raise ExportError(f"{spec.model_type} cannot be written as Qwen3.5: it has {spec.qwen3_5}, which Qwen3.5's "
                          f"text model lacks; export supports the {ok} families")
    lora = [n for n, m in model.named_modules() if hasattr(m, "base_layer")]
    if lora:
        raise ExportError(f"{lora[0]} is a LoRA adapter: merge the adapters first (peft's merge_and_unload())")
    if getattr(cfg, "hidden_act", None) != "silu":
        raise ExportError(f"the MLPs use {getattr(cfg, 'hidden_act', None)!r}; Qwen3.5's MLP (and its conv) use silu")

    eps = float(cfg.rms_norm_eps)
    blocks = get_submodule(model, spec.layers)
    base = get_submodule(model, spec.layers.rsplit(".", 1)[0])
    report = ExportReport("qwen3_5")
    sd: dict[str, torch.Tensor] = {}
    H = cfg.num_attention_heads
    Hkv = getattr(cfg, "num_key_value_heads", None) or H
    D = None
    conv_size = None
    softmax = {}  # layer -> its q/k/v/o parts, written once attention_bias is known
    for i, block in enumerate(blocks):
        where = f"layer {i}"
        attn = getattr(block, spec.attention)
        allowed = {spec.attention, "mlp", "input_layernorm", "post_attention_layernorm"}
        extra = [n for n, m in block.named_children() if n not in allowed and any(True for _ in m.parameters())]
        if extra:
            raise ExportError(f"{where} has {extra[0]} ({type(getattr(block, extra[0])).__name__}), which Qwen3.5's "
                              "decoder layer lacks")
        prefix = f"model.layers.{i}."
        sd[prefix + "input_layernorm.weight"] = _qwen_norm(block.input_layernorm, eps, f"{where} input_layernorm")
        sd[prefix + "post_attention_layernorm.weight"] = _qwen_norm(block.post_attention_layernorm, eps,
                                                                    f"{where} post_attention_layernorm")
        sd.update({prefix + "mlp." + k: v for k, v in _mlp(block.mlp, where).items()})
        if isinstance(attn, Qwen35GatedDeltaNet):
            if attn.mode != "linear":
                raise ExportError(f"{where} runs in {attn.mode!r} mode; export the model in its linear mode")
            if getattr(attn.out_proj, "bias", None) is not None:
                raise ExportError(f"{where}'s output projection has a bias, which Qwen3.5's Gated DeltaNet out_proj "
                                  "lacks; export a model without attention biases on o_proj")
            D, conv_size = attn.head_dim, attn.conv_size
            sd.update({prefix + "linear_attn." + k: v for k, v in attn.qwen3_5_state_dict().items()})
            report.linear_layers.append(i)
        elif isinstance(attn, CONVERTED) and not getattr(attn, "keeps_softmax", False):
            raise ExportError(f"{where} is {_layer_kind(conv)}, which Qwen3.5 cannot express; {CONVERT_HINT}")
        else:
            softmax[i] = _softmax_parts(attn, spec, where, eps)
            D = softmax[i]["head_dim"]
            report.softmax_layers.append(i)
    head_dims = {p["head_dim"] for p in softmax.values()} | ({D} if report.linear_layers else set())
    if len(head_dims) > 1:
        raise ExportError(f"the layers have different head sizes {sorted(head_dims)}; Qwen3.5 has one")

    attention_bias = any(p["bias"] for p in softmax.values())
    for i, parts in softmax.items():
        prefix = f"model.layers.{i}.self_attn."
        sd.update({prefix + k: v for k, v in _qwen_attention(parts, H, Hkv, attention_bias).items()})
        if parts["deviation"]:
            report.deviations.append(f"layer {i}: {parts['deviation']}")

    sd["model.embed_tokens.weight"] = model.get_input_embeddings().weight.detach().clone()
    sd["model.norm.weight"] = _qwen_norm(base.norm, eps, "the final norm")
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ExportError("the LM head has a bias, which Qwen3.5's lacks")
    if not tied:
        sd["lm_head.weight"] = head.weight.detach().clone()

    rope = dict(getattr(cfg, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
    rope.setdefault("rope_type", "default")
    rotary_dim = 2 * get_submodule(base, "rotary_emb").inv_freq.numel() if softmax else D
    # Qwen3.5 defaults partial_rotary_factor to 1/4: always say it (1.0 when the whole head rotates)
    rope["partial_rotary_factor"] = rotary_dim / D
    n_layers = len(blocks)
    types = ["linear_attention" if i in report.linear_layers else "full_attention" for i in range(n_layers)]
    intermediate = sd["model.layers.0.mlp.gate_proj.weight"].shape[0]
    qcfg = Qwen3_5TextConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=intermediate,
        num_hidden_layers=n_layers, num_attention_heads=H, num_key_value_heads=Hkv, head_dim=D,
        hidden_act="silu", max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=eps,
        tie_word_embeddings=tied, rope_parameters=rope, attention_bias=attention_bias,
        linear_conv_kernel_dim=conv_size or 4, linear_key_head_dim=D, linear_value_head_dim=D,
        linear_num_key_heads=H, linear_num_value_heads=H, layer_types=types,
        initializer_range=getattr(cfg, "initializer_range", 0.02), pad_token_id=cfg.pad_token_id,
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
    )
    if softmax:
        _check_rope(rope, qcfg, get_submodule(base, "rotary_emb"))
    else:
        # checked on transformers 5.24: Qwen3_5TextModel asks its cache for the number of tokens seen, which
        # only a full_attention layer can answer (DynamicCache.get_seq_length raises otherwise)
        report.warnings.append(
            "every layer is Gated DeltaNet: transformers' Qwen3.5 (5.24) runs it with use_cache=False only "
            "(generate() raises in DynamicCache.get_seq_length); keep at least one softmax layer "
            "(--softmax-layers) for generate() in transformers, or serve it where all-linear models run")
    qcfg.architectures = ["Qwen3_5ForCausalLM"]
    return qcfg, sd, report


def _layer_kind(conv: dict) -> str:
    """A converted layer as the refusal names it, from the conversion record."""
    if conv["method"] == "gdn":
        return f"a Gated DeltaNet layer of layout {conv.get('layout', 'default')!r}"
    if conv["method"] == "linear_attention":
        return f"a linear_attention layer (feature map {conv.get('feature_map')}, window {conv.get('window')})"
    return f"a {conv['method']} layer"


def _qwen_norm(norm: nn.Module, eps: float, where: str) -> torch.Tensor:
    """The weight w' that gives ``norm`` as Qwen3.5's ``x / rms(x) * (1 + w')``, found by probing the
    module (Llama-style norms multiply by w, Gemma-style by 1 + w), or ExportError."""
    w = getattr(norm, "weight", None)
    if w is None or getattr(norm, "bias", None) is not None:
        raise ExportError(f"{where} ({type(norm).__name__}) is not an RMSNorm with a weight, as Qwen3.5's norms are")
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4, w.shape[-1], generator=g).to(device=w.device, dtype=torch.float32)
        y = norm(x.to(w.dtype)).float()
        xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        wf = w.detach().float()
        tol = dict(rtol=1e-2 if w.dtype != torch.float32 else 1e-4, atol=1e-5)
        if torch.allclose(y, xn * wf, **tol):
            return (wf - 1).to(w.dtype)
        if torch.allclose(y, xn * (1 + wf), **tol):
            return w.detach().clone()
    raise ExportError(f"{where} ({type(norm).__name__}) does not compute x / rms(x) * w with eps {eps} as Qwen3.5's "
                      "RMSNorm does")


def _linear(module: nn.Module, where: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    if type(module) is not nn.Linear:
        raise ExportError(f"{where} is a {type(module).__name__}, not a plain nn.Linear")
    return module.weight.detach(), None if module.bias is None else module.bias.detach()


def _mlp(mlp: nn.Module, where: str) -> dict[str, torch.Tensor]:
    """gate_proj / up_proj / down_proj; a fused gate_up_proj (Phi-3: [gate | up]) is split."""
    names = dict(mlp.named_children())
    if "gate_up_proj" in names:
        w, b = _linear(mlp.gate_up_proj, f"{where} mlp.gate_up_proj")
        gate, up = w.chunk(2, dim=0)
        biases = [b]
    elif {"gate_proj", "up_proj"} <= set(names):
        (gate, bg), (up, bu) = (_linear(getattr(mlp, n), f"{where} mlp.{n}") for n in ("gate_proj", "up_proj"))
        biases = [bg, bu]
    else:
        raise ExportError(f"{where}'s MLP ({type(mlp).__name__}) is not a gated MLP down(silu(gate(x)) * up(x)), "
                          "which Qwen3.5 has in every layer")
    down, bd = _linear(getattr(mlp, "down_proj", None), f"{where} mlp.down_proj")
    if any(b is not None for b in (*biases, bd)):
        raise ExportError(f"{where}'s MLP has biases (mlp_bias), which Qwen3.5's MLP lacks")
    return {n: t.clone().contiguous() for n, t in (("gate_proj.weight", gate), ("up_proj.weight", up),
                                                   ("down_proj.weight", down))}


def _softmax_parts(kept: nn.Module, spec, where: str, eps: float) -> dict:
    """A kept softmax layer's projections, norms and what in it Qwen3.5 cannot hold. ``kept``: the
    original module, or its Qwen3.5 form (``Qwen35Attention``: the original plus q/k norms)."""
    normed = getattr(kept, "keeps_softmax", False)
    if normed and kept.mode != "linear":
        raise ExportError(f"{where} runs in {kept.mode!r} mode; export the model in its linear mode")
    attn = kept.original if normed else kept
    window = local_window(attn)
    if window:
        raise ExportError(f"{where} keeps sliding-window softmax attention (window {window}), which Qwen3.5 lacks; "
                          f"convert that layer too (leave it out of --softmax-layers) or {CONVERT_HINT}")
    if spec.rope_flag and not getattr(attn, spec.rope_flag):
        raise ExportError(f"{where} keeps softmax attention without RoPE (a NoPE layer), which Qwen3.5 lacks; "
                          "convert that layer too (leave it out of --softmax-layers)")
    cfg = attn.config
    D = getattr(attn, spec.head_dim)
    H = cfg.num_attention_heads
    Hkv = getattr(cfg, "num_key_value_heads", None) or H
    if abs(float(attn.scaling) - D ** -0.5) > 1e-9 * D ** -0.5:
        raise ExportError(f"{where}'s softmax scale is {attn.scaling}, not 1/sqrt(head_dim) as in Qwen3.5")
    if spec.softcap and getattr(attn, spec.softcap, None):
        raise ExportError(f"{where} caps its attention logits, which Qwen3.5 does not")
    if spec.fused_qkv:
        w, b = _linear(getattr(attn, spec.fused_qkv), f"{where} {spec.fused_qkv}")
        if spec.qkv_layout == "per_head":
            parts = [t.unflatten(0, (H, 3 * D)).chunk(3, dim=1) for t in (w, b) if t is not None]
            split = [[p.flatten(0, 1) for p in ps] for ps in parts]
        else:
            split = [t.split([H * D, Hkv * D, Hkv * D]) for t in (w, b) if t is not None]
        (wq, wk, wv), (bq, bk, bv) = split[0], (split[1] if b is not None else (None, None, None))
    else:
        (wq, bq), (wk, bk), (wv, bv) = (_linear(getattr(attn, n), f"{where} {n}")
                                        for n in ("q_proj", "k_proj", "v_proj"))
    wo, bo = _linear(getattr(attn, spec.o_proj), f"{where} {spec.o_proj}")
    deviation = None
    if normed or spec.qk_norm == "head":
        norms = kept if normed else attn
        qn = _qwen_norm(norms.q_norm, eps, f"{where} q_norm")
        kn = _qwen_norm(norms.k_norm, eps, f"{where} k_norm")
    elif spec.qk_norm is None:
        # Qwen3.5 always normalises q and k per head; unit weights are the nearest it has to none. Only
        # a model converted before layout "qwen3_5" carried the norms itself gets here
        qn = kn = torch.zeros(D, dtype=wq.dtype, device=wq.device)
        deviation = ("softmax attention gains per-head q/k RMSNorms (unit weights), which the source model lacks "
                     "(convert with --layout qwen3_5 to train them)")
    else:
        raise ExportError(f"{where}'s q/k norms span all heads ({spec.qk_norm}); Qwen3.5's are per head")
    return dict(head_dim=D, wq=wq, wk=wk, wv=wv, wo=wo, bq=bq, bk=bk, bv=bv, bo=bo, q_norm=qn, k_norm=kn,
                bias=any(t is not None for t in (bq, bk, bv, bo)), deviation=deviation)


def _qwen_attention(p: dict, H: int, Hkv: int, attention_bias: bool) -> dict[str, torch.Tensor]:
    """Qwen3.5 attention weights: q_proj holds per head [q_h | gate_h]; the gate's zero weights (and
    zero bias) give sigmoid(0) = 1/2 everywhere, which o_proj * 2 undoes exactly (powers of two)."""
    D = p["head_dim"]
    wq = p["wq"]

    def with_gate(t):  # (H * D, ...) -> (H * 2D, ...), the gate rows zero
        t = t.unflatten(0, (H, D))
        return torch.cat([t, torch.zeros_like(t)], dim=1).flatten(0, 1)

    out = {"q_proj.weight": with_gate(wq), "k_proj.weight": p["wk"], "v_proj.weight": p["wv"],
           "o_proj.weight": p["wo"] * 2, "q_norm.weight": p["q_norm"], "k_norm.weight": p["k_norm"]}
    if attention_bias:  # one flag for all four projections in Qwen3.5: absent biases are zeros
        zeros = lambda n: wq.new_zeros(n)  # noqa: E731
        out["q_proj.bias"] = with_gate(p["bq"] if p["bq"] is not None else zeros(H * D))
        out["k_proj.bias"] = p["bk"] if p["bk"] is not None else zeros(Hkv * D)
        out["v_proj.bias"] = p["bv"] if p["bv"] is not None else zeros(Hkv * D)
        out["o_proj.bias"] = p["bo"] if p["bo"] is not None else zeros(p["wo"].shape[0])
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def _check_rope(rope: dict, qcfg, source_rotary: nn.Module) -> None:
    """Qwen3.5's rotary embedding built from ``qcfg`` must give the source's frequencies and scaling."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    if rope["rope_type"] not in _ROPE_TYPES:
        raise ExportError(f"RoPE type {rope['rope_type']!r} is not one export carries over ({', '.join(_ROPE_TYPES)}); "
                          "convert the softmax layers too (all-GDN models need no RoPE)")
    try:
        target = Qwen3_5TextRotaryEmbedding(qcfg)
    except Exception as err:  # noqa: BLE001 - transformers' own validation of the parameters
        raise ExportError(f"Qwen3.5 cannot build the source's RoPE ({type(err).__name__}: {err})") from err
    src = source_rotary.inv_freq.detach()
    # model.to(bfloat16) rounds the source's buffer too: compare within that rounding
    rtol = max(1e-6, 2 * torch.finfo(src.dtype).eps)
    src = src.float().cpu()
    ok = (target.inv_freq.shape == src.shape and torch.allclose(target.inv_freq.float(), src, rtol=rtol)
          and abs(float(target.attention_scaling) - float(getattr(source_rotary, "attention_scaling", 1.0))) < 1e-6)
    if not ok:
        raise ExportError(f"Qwen3.5's RoPE from {rope} does not reproduce the source's frequencies; convert the softmax "
                          "layers too (all-GDN models need no RoPE)")


# ---------------------------------------------------------------- writing


def _save_qwen3_5(folder: Path, qcfg, state_dict: dict, model) -> None:
    """Through transformers' own class: it checks every name and shape (strict load), ties the
    embeddings, shards and writes config.json, the safetensors and generation_config.json."""
    from transformers import Qwen3_5ForCausalLM

    dtype = next(iter(state_dict.values())).dtype
    qcfg.dtype = dtype
    with torch.device("meta"):
        native = Qwen3_5ForCausalLM(qcfg)
    missing, unexpected = native.load_state_dict(state_dict, strict=False, assign=True)
    missing = [k for k in missing if not (qcfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:  # a bug here, not the user's: say what did not match
        raise RuntimeError(f"Qwen3.5 export: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if qcfg.tie_word_embeddings:
        native.lm_head.weight = native.model.embed_tokens.weight
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        native.generation_config = gen
    native.save_pretrained(folder, safe_serialization=True)


def _model_card(model, qcfg, report: ExportReport) -> str:
    from ._version import __version__

    conv = model.config.linearize
    family = model.config.model_type.removeprefix("linearize_")
    # the original model where linearize recorded it (a hub id), else the converted checkpoint's folder
    base = conv.get("base_model")
    via = getattr(model.config, "_name_or_path", "") or ""
    source = f"**{base}** ({family})" if base else f"a local {family} model" + (f" (via {via})" if via else "")
    lic = conv.get("base_license")
    n = qcfg.num_hidden_layers
    front = ["---", "library_name: transformers", "pipeline_tag: text-generation",
             "tags: [linearize, gated-deltanet, qwen3_5, linear-attention]"]
    if conv.get("base_model"):
        front.append(f"base_model: {conv['base_model']}")
    if lic:
        front.append(f"license: {lic}")
    front.append("---")
    notes = "".join(f"\n\nNote: {w}." for w in report.warnings)
    exact = ("The weights compute what the linearize model computes (float32 logits agree to 1e-4 of the largest)."
             if not report.deviations else
             "Where it is not exactly the linearize model: " + "; ".join(report.deviations) + ".")
    body = f"""
# {Path(str(base or family)).name} as a Qwen3.5 Gated DeltaNet hybrid

Converted from {source} by linearize {__version__}:
{len(report.linear_layers)} of {n} layers are Gated DeltaNet (constant-size state, no KV cache)
{_ranges(report.linear_layers)}; {len(report.softmax_layers)} keep softmax attention {_ranges(report.softmax_layers)}.
It is written as transformers' own Qwen3.5 text model (`Qwen3_5ForCausalLM`, `model_type: qwen3_5_text`,
transformers >= 5.17), so it loads and generates without linearize:

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("<this folder or repo>")
```

{exact}{notes}

Conversion record (linearize): `{json.dumps({k: conv[k] for k in sorted(conv) if k != 'softmax_selection'})}`
"""
    return "\n".join(front) + "\n" + body


def _ranges(layers: list[int]) -> str:
    return f"({', '.join(map(str, layers))})" if layers else ""
