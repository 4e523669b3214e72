"""Supported architectures: one table row per Hugging Face ``model_type``.

A row says where the decoder layers and their attention modules live and how the attention
module turns hidden states into per-head q/k/v (separate or fused projections, q/k norms before
or after the head split). RoPE, the softmax scale and logit softcapping are read from the
original module and its modeling file, so each model keeps doing them its own way.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    layers: str = "model.layers"  # attribute path from the *ForCausalLM to the decoder layers
    attention: str = "self_attn"  # attribute of a decoder layer
    fused_qkv: str | None = None  # name of a fused q|k|v projection (phi3), else q_proj/k_proj/v_proj
    qk_norm: str | None = None  # "head": norm over head_dim after the split (qwen3); "flat": before (olmo2)
    softcap: str | None = None  # attention-module attribute holding the logit softcap (gemma2)

    @property
    def projections(self) -> tuple[str, ...]:
        qkv = (self.fused_qkv,) if self.fused_qkv else ("q_proj", "k_proj", "v_proj")
        norms = ("q_norm", "k_norm") if self.qk_norm else ()
        return (*qkv, "o_proj", *norms)


ARCHITECTURES: dict[str, ArchSpec] = {
    spec.model_type: spec
    for spec in [
        ArchSpec("llama"),
        ArchSpec("mistral"),
        ArchSpec("qwen2"),
        ArchSpec("qwen3", qk_norm="head"),
        ArchSpec("phi3", fused_qkv="qkv_proj"),
        ArchSpec("gemma2", softcap="attn_logit_softcapping"),
        ArchSpec("olmo2", qk_norm="flat"),
    ]
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
        raise ValueError(
            f"model_type {model_type!r} is not supported; supported architectures: "
            f"{', '.join(sorted(ARCHITECTURES))} (decoders), {', '.join(sorted(ENCODER_ARCHITECTURES))} (encoders). "
            "Adding one is a row in linearize/arch.py."
        )
    return ARCHITECTURES[base]


def get_submodule(root, path: str):
    for name in path.split("."):
        root = getattr(root, name)
    return root
