"""Supported architectures: one table row per Hugging Face ``model_type``.

A row says where the decoder layers and their attention modules live, what the projections are
called and how the attention module turns hidden states into per-head q/k/v (separate or fused
projections, a fused projection's layout, q/k norms before or after the head split), which
attention-module attribute switches RoPE off in a layer (NoPE layers), how the decoder layer hands
the attention its cache, and which attention implementation the original needs. RoPE itself
(bases, partial rotary), the softmax scale and logit softcapping are read from the original module
and its modeling file, so each model keeps doing them its own way; everything outside attention
(MoE MLPs, residual / embedding / logit multipliers, parallel residuals) is left as it is, except
that a decode step runs a gated SiLU MLP (the row's ``mlp``) on the decode GEMVs: same weights, same
math, fewer kernels.

This file is copied into converted checkpoints (remote code): keep it free of imports beyond the
standard library.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    classes: tuple[str, str]  # transformers config class and *ForCausalLM class
    layers: str = "model.layers"  # attribute path from the *ForCausalLM to the decoder layers
    attention: str = "self_attn"  # attribute of a decoder layer
    fused_qkv: str | None = None  # name of a fused q|k|v projection, else q_proj/k_proj/v_proj
    # layout of the fused projection's output: "concat" = [q heads | k heads | v heads] (phi3);
    # "per_head" = per head [q_h | k_h | v_h] (gpt_neox's query_key_value)
    qkv_layout: str = "concat"
    o_proj: str = "o_proj"  # the output projection
    qk_norm: str | None = None  # "head": norm over head_dim after the split (qwen3); "flat": before (olmo2)
    softcap: str | None = None  # attention-module attribute holding the logit softcap (gemma2)
    head_dim: str = "head_dim"  # attention-module attribute holding the head size
    rope_flag: str | None = None  # attention-module attribute that is falsy in a layer without RoPE (smollm3)
    # keyword under which the decoder layer passes the cache; None: the installed transformers' own
    # (``past_key_values`` up to 5.23, ``cache`` from 5.24)
    cache_kwarg: str | None = None
    # what transformers should run the original with: "sdpa" where the original supports it, "eager"
    # where only eager does all the original does (gemma2's logit softcapping)
    attn_implementation: str = "sdpa"
    # attribute of a decoder layer holding a gated MLP down(silu(gate(x)) * up(x)) with gate_proj,
    # up_proj and down_proj, which a decode step runs on the decode GEMVs (the module is left as it is,
    # see modeling_linearize.install_decode_mlps); None: another kind of MLP (fused, GELU, MoE, ungated)
    mlp: str | None = "mlp"
    # (config attribute, what to do): a truthy value means a variant that converted layers cannot be
    refuse: tuple[tuple[str, str], ...] = ()
    # why transformers' Qwen3.5 text model cannot hold this family (``linearize export --format
    # qwen3_5`` refuses it with this reason); None: it can (linearize/native.py checks the rest per model)
    qwen3_5: str | None = None

    @property
    def qkv(self) -> tuple[str, ...]:
        return (self.fused_qkv,) if self.fused_qkv else ("q_proj", "k_proj", "v_proj")

    @property
    def projections(self) -> tuple[str, ...]:
        norms = ("q_norm", "k_norm") if self.qk_norm else ()
        return (*self.qkv, self.o_proj, *norms)


ARCHITECTURES: dict[str, ArchSpec] = {
    spec.model_type: spec
    for spec in [
        ArchSpec("llama", ("LlamaConfig", "LlamaForCausalLM")),
        ArchSpec("mistral", ("MistralConfig", "MistralForCausalLM")),
        ArchSpec("qwen2", ("Qwen2Config", "Qwen2ForCausalLM")),
        ArchSpec("qwen3", ("Qwen3Config", "Qwen3ForCausalLM"), qk_norm="head"),
        ArchSpec("phi3", ("Phi3Config", "Phi3ForCausalLM"), fused_qkv="qkv_proj", mlp=None),
        # logit softcapping runs only in eager attention (transformers 5.23 refuses sdpa; 5.17 drops the cap)
        ArchSpec("gemma2", ("Gemma2Config", "Gemma2ForCausalLM"), softcap="attn_logit_softcapping",
                 attn_implementation="eager", mlp=None,
                 qwen3_5="logit softcapping, GELU MLPs, scaled embeddings and pre/post feed-forward norms"),
        ArchSpec("olmo2", ("Olmo2Config", "Olmo2ForCausalLM"), qk_norm="flat",
                 qwen3_5="norms after attention and MLP (not before) and q/k norms over all heads"),
        # the text model (Gemma3ForCausalLM): each layer gets the position embeddings of its own type
        # (local / global RoPE base) from the model; scale = query_pre_attn_scalar ** -0.5 (attn.scaling)
        ArchSpec("gemma3_text", ("Gemma3TextConfig", "Gemma3ForCausalLM"), qk_norm="head",
                 softcap="attn_logit_softcapping", mlp=None,
                 qwen3_5="logit softcapping, GELU MLPs, scaled embeddings and pre/post feed-forward norms",
                 refuse=(("use_bidirectional_attention", "bidirectional Gemma 3 (e.g. EmbeddingGemma) is not a causal "
                          "LM; converted layers are causal. Convert a causal Gemma 3 checkpoint"),)),
        ArchSpec("smollm3", ("SmolLM3Config", "SmolLM3ForCausalLM"), rope_flag="use_rope"),
        # attention_multiplier is the softmax scale (attn.scaling); the residual, embedding and logit
        # multipliers act outside attention
        ArchSpec("granite", ("GraniteConfig", "GraniteForCausalLM"),
                 qwen3_5="attention, residual, embedding and logit multipliers"),
        # Pythia: per-head interleaved fused qkv, partial rotary (in its apply_rotary_pos_emb), parallel
        # residual (outside attention), the cache passed as layer_past
        ArchSpec("gpt_neox", ("GPTNeoXConfig", "GPTNeoXForCausalLM"), layers="gpt_neox.layers", attention="attention",
                 fused_qkv="query_key_value", qkv_layout="per_head", o_proj="dense", head_dim="head_size",
                 cache_kwarg="layer_past", mlp=None,
                 qwen3_5="parallel residual, LayerNorm with biases and GELU MLPs"),
        # mixture-of-experts MLPs are left untouched: only attention is converted
        ArchSpec("mixtral", ("MixtralConfig", "MixtralForCausalLM"), mlp=None,
                 qwen3_5="mixture-of-experts MLPs (Qwen3.5's text model has a dense MLP in every layer)"),
        ArchSpec("qwen3_moe", ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"), qk_norm="head", mlp=None,
                 qwen3_5="mixture-of-experts MLPs (Qwen3.5's text model has a dense MLP in every layer)"),
    ]
}

# model types people try that are not rows, with what to do instead
NOT_SUPPORTED = {
    "gemma3": "this is the multimodal Gemma 3 (Gemma3ForConditionalGeneration); convert a text-only Gemma 3 "
              "checkpoint (model_type gemma3_text, Gemma3ForCausalLM, e.g. gemma-3-1b)",
}


@dataclass(frozen=True)
class EncoderSpec:
    """A bidirectional encoder (BERT family): converted with ``LinformerConfig`` or
    ``EncoderLinearAttentionConfig``. Paths start at the base model (what ``AutoModel`` returns).

    BERT-style models keep the output projection outside the self-attention module (in
    ``BertSelfOutput``, with the residual and LayerNorm), so only q/k/v are reused there.
    """

    model_type: str
    base_classes: tuple[str, str]  # transformers (config, base model) class names
    layers: str = "encoder.layer"
    attention: str = "attention.self"  # dotted path from a layer to the self-attention module
    qkv: tuple[str, ...] = ("query", "key", "value")  # one name: a fused q|k|v projection
    out_proj: str | None = None  # output projection inside the attention module (modernbert)
    rope: bool = False  # apply the model's apply_rotary_pos_emb to q and k (modernbert)

    @property
    def projections(self) -> tuple[str, ...]:
        return (*self.qkv, *((self.out_proj,) if self.out_proj else ()))


ENCODER_ARCHITECTURES: dict[str, EncoderSpec] = {
    spec.model_type: spec
    for spec in [
        EncoderSpec("bert", ("BertConfig", "BertModel")),  # MiniLM and most sentence-transformers models
        EncoderSpec("roberta", ("RobertaConfig", "RobertaModel")),
        EncoderSpec("xlm-roberta", ("XLMRobertaConfig", "XLMRobertaModel")),
        # RoPE; every third layer global, the others a local window: both become the chosen method
        EncoderSpec("modernbert", ("ModernBertConfig", "ModernBertModel"), layers="layers", attention="attn",
                    qkv=("Wqkv",), out_proj="Wo", rope=True),
    ]
}


def get_arch(model_type: str) -> ArchSpec | EncoderSpec:
    base = model_type.removeprefix("linearize_")
    if base in ENCODER_ARCHITECTURES:
        return ENCODER_ARCHITECTURES[base]
    if base not in ARCHITECTURES:
        hint = f" ({NOT_SUPPORTED[base]})" if base in NOT_SUPPORTED else ""
        raise ValueError(
            f"model_type {model_type!r} is not supported{hint}; supported architectures: "
            f"{', '.join(sorted(ARCHITECTURES))} (decoders), {', '.join(sorted(ENCODER_ARCHITECTURES))} (encoders). "
            "Adding one is a row in linearize/arch.py."
        )
    return ARCHITECTURES[base]


def check_supported(config) -> ArchSpec:
    """The row of ``config``'s model type, after refusing the variants the row names."""
    spec = get_arch(config.model_type)
    for attr, what in getattr(spec, "refuse", ()):
        if getattr(config, attr, None):
            raise ValueError(f"{config.model_type} with {attr}={getattr(config, attr)!r} is not supported: {what}")
    return spec


def attn_implementation_for(config) -> str | None:
    """The attention implementation the original runs correctly with: the row's choice, or eager
    when the config sets a logit softcap (sdpa ignores it); None (transformers' default) for a model
    type that is not a row."""
    base = getattr(config, "model_type", "").removeprefix("linearize_")
    spec = ARCHITECTURES.get(base)
    if spec is None:
        return None
    if spec.softcap and getattr(config, spec.softcap, None):
        return "eager"
    return spec.attn_implementation


def local_window(attn) -> int | None:
    """The original layer's sliding window (it attends to its newest ``window`` keys), or None for a
    global layer. Per-layer models set ``attn.sliding_window`` (None on global layers: gemma2/3,
    qwen2/3, smollm3); the others pass ``config.sliding_window`` to every layer (mistral, phi3,
    mixtral, qwen3_moe)."""
    if hasattr(attn, "sliding_window"):
        return attn.sliding_window or None
    return getattr(attn.config, "sliding_window", None) or None


def get_submodule(root, path: str):
    for name in path.split("."):
        root = getattr(root, name)
    return root
