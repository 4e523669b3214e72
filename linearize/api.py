"""``linearize(model, config)``: convert a Hugging Face causal LM in place (and ``unlinearize`` back)."""

from __future__ import annotations

import contextlib

from .arch import EncoderSpec, check_supported, get_arch, get_submodule, local_window
from .config import ENCODER_METHODS, FORMAT_VERSION, LinearAttentionConfig, _MethodConfig, config_from_dict
from .gdn_qwen3_5 import softmax_layer_for
from .hybrid_sdpa import restore_sdpa
from .modeling_linearize import (BASE_MODEL_CLASSES, CONFIG_CLASSES, CONVERTED, MODEL_CLASSES, apply_conversion,
                                 remove_decode_mlps, use_softmax_decode_kernel)


def linearize(model, config: _MethodConfig | None = None):
    """Swap the softmax attention of ``config.layers`` (default: all) for linear attention, in place.

    The new layers reuse the original q/k/v/o weights by reference and add only their own
    parameters (feature maps, gates). The conversion is recorded in ``model.config.linearize``
    and the model's class becomes ``Linearized<Class>``, so ``save_pretrained`` writes a
    checkpoint that ``AutoModelForCausalLM.from_pretrained`` loads after ``import linearize``.

    Returns the same model object.
    """
    config = LinearAttentionConfig() if config is None else config
    if not isinstance(config, _MethodConfig):
        raise TypeError(f"config must be a linearize method config (e.g. LinearAttentionConfig), got {type(config).__name__}")
    if getattr(model.config, "linearize", None):
        raise ValueError("this model is already converted (config.linearize is set); load the original to convert again")
    model_type = model.config.model_type
    spec = check_supported(model.config)
    encoder = isinstance(spec, EncoderSpec)
    if encoder != (config.method in ENCODER_METHODS):
        raise TypeError(
            f"{type(config).__name__} converts {'encoders' if not encoder else 'causal decoders'}, but this is a "
            f"{model_type} {'encoder' if encoder else 'decoder'}: use "
            + ("LinformerConfig or EncoderLinearAttentionConfig" if encoder else "LinearAttentionConfig or GatedDeltaNetConfig")
        )
    if encoder and not isinstance(model, BASE_MODEL_CLASSES[spec.model_type]):
        expected = BASE_MODEL_CLASSES[spec.model_type].__name__
        raise TypeError(f"expected a {expected} (the base encoder, as AutoModel loads it), got {type(model).__name__}")
    blocks = get_submodule(model, spec.layers)
    n = len(blocks)
    layers, kept_local = config.layers, []
    if layers is None:
        if encoder:
            layers = list(range(n))
        else:
            layers, kept_local = default_layers([getattr(b, spec.attention) for b in blocks])
    bad = [i for i in layers if i >= n]
    if bad:
        raise ValueError(f"layers {bad} do not exist: the model has {n} layers (0..{n - 1})")

    apply_conversion(model, config, layers)
    record = config.to_dict()
    record["layers"] = layers
    if kept_local:
        record["softmax_layers"] = kept_local
    record["format_version"] = FORMAT_VERSION
    base = getattr(model.config, "_name_or_path", "") or ""
    record["base_model"] = base if base and not base.startswith(("/", ".", "~")) else None
    model.config.__class__ = CONFIG_CLASSES[spec.model_type]
    model.config.linearize = record
    model.__class__ = MODEL_CLASSES[spec.model_type]
    return model


def default_layers(attentions) -> tuple[list[int], list[int]]:
    """(layers to convert, local layers kept softmax) when the config names no layers.

    A model that mixes sliding-window (local) and global layers (Gemma 2/3, Qwen2/3 or SmolLM3 with
    sliding layers) keeps its local layers as they are: their KV cache is already bounded by the
    window and their cost linear in the length, so converting them would add error and save
    nothing; the global layers, whose cache grows with the context, are converted. A model whose
    layers are all local (Mistral v0.1, Phi-3-mini, Mixtral with sliding_window) has nothing to
    keep: every layer is converted, and a window hybrid's window must fit inside the original's.
    Layers named in ``config.layers`` are converted whatever they are.
    """
    local = [i for i, attn in enumerate(attentions) if local_window(attn)]
    if not local or len(local) == len(attentions):
        return list(range(len(attentions))), []
    return [i for i in range(len(attentions)) if i not in local], local


def unlinearize(model):
    """Put the original softmax attention modules back (new parameters are dropped). In place."""
    conv = getattr(model.config, "linearize", None)
    if not conv:
        raise ValueError("this model is not converted")
    spec = get_arch(model.config.model_type)
    for i, block in enumerate(get_submodule(model, spec.layers)):
        attn = block.get_submodule(spec.attention)
        if isinstance(attn, CONVERTED):
            block.set_submodule(spec.attention, attn.original)
    remove_decode_mlps(model)
    restore_sdpa(model)
    model.__class__ = BASE_MODEL_CLASSES[spec.model_type]
    model.config.__class__ = CONFIG_CLASSES[spec.model_type].__mro__[1]
    del model.config.linearize
    return model


def converted_layers(model) -> list[int]:
    conv = getattr(model.config, "linearize", None)
    return list(conv["layers"]) if conv else []


@contextlib.contextmanager
def attention_mode(model, mode: str):
    """Temporarily run every converted layer as ``"linear"`` (default), ``"softmax"`` (the original
    attention with the same weights: the teacher), ``"transfer"`` (both; each layer records
    ``transfer_loss`` and passes the teacher's output on), ``"record"`` (the teacher, each layer keeping
    its output in ``attention_target``, which outlives the context) or ``"joint"`` (the converted layers,
    each recording ``transfer_loss`` against that ``attention_target``; both go when "joint" ends)."""
    from .layers import ConvertedAttention

    if mode not in ConvertedAttention.MODES:
        raise ValueError(f"mode must be one of {ConvertedAttention.MODES}, got {mode!r}")
    layers = [m for m in model.modules() if isinstance(m, CONVERTED)]
    if not layers:
        raise ValueError("the model has no converted layers")
    previous = [m.mode for m in layers]
    for m in layers:
        m.mode = mode
    try:
        yield layers
    finally:
        for m, p in zip(layers, previous):
            m.mode = p
            m.__dict__.pop("transfer_loss", None)  # a graph's tensor: nothing outlives the step (or blocks deepcopy)
            if mode == "joint":  # a record is kept until the "joint" pass that reads it
                m.__dict__.pop("attention_target", None)


def restore_softmax(model, layers) -> None:
    """Put the original softmax attention back into ``layers`` (a layer-level hybrid); recorded in
    ``config.linearize``."""
    spec = get_arch(model.config.model_type)
    blocks = get_submodule(model, spec.layers)
    conv = model.config.linearize
    method_config = config_from_dict({k: v for k, v in conv.items() if k != "layers"})
    for i in layers:
        attn = blocks[i].get_submodule(spec.attention)
        if not isinstance(attn, CONVERTED) or getattr(attn, "keeps_softmax", False):
            raise ValueError(f"layer {i} is not converted")
        # the original, or its form beside the layout's layers (GatedDeltaNetConfig(layout="qwen3_5"))
        blocks[i].set_submodule(spec.attention, softmax_layer_for(attn.original, method_config, spec, i))
    conv["layers"] = [i for i in conv["layers"] if i not in set(layers)]
    conv["softmax_layers"] = sorted(set(conv.get("softmax_layers") or []) | set(layers))
    use_softmax_decode_kernel(model)


def select_softmax_layers(model, k: int, input_ids, position_ids=None) -> tuple[list[int], dict[int, float]]:
    """Choose the ``k`` converted layers whose conversion costs the most, to keep as softmax.

    Each converted layer runs alone in linear mode (every other layer as the original softmax
    attention) on the calibration tokens; its cost is the mean KL(teacher || model) of the
    next-token distributions, the teacher being all layers in softmax mode (same weights). The
    rows run one at a time, so long rows need the memory of one.
    Returns (chosen layers, {layer: KL}).
    """
    import torch
    import torch.nn.functional as F

    layers = [m for m in model.modules() if isinstance(m, CONVERTED) and not getattr(m, "keeps_softmax", False)]
    if not 0 < k < len(layers) + 1:
        raise ValueError(f"k must be in 1..{len(layers)} (the converted layers), got {k}")
    total = {m.layer_idx: 0.0 for m in layers}
    with torch.no_grad(), attention_mode(model, "softmax"):
        for r in range(input_ids.shape[0]):
            kw = dict(input_ids=input_ids[r : r + 1], use_cache=False,
                      position_ids=None if position_ids is None else position_ids[r : r + 1])
            teacher = F.log_softmax(model(**kw).logits.float(), -1)
            for m in layers:
                m.mode = "linear"
                student = F.log_softmax(model(**kw).logits.float(), -1)
                m.mode = "softmax"
                total[m.layer_idx] += F.kl_div(student, teacher, log_target=True, reduction="none").sum().item()
    kl = {i: v / input_ids.numel() for i, v in total.items()}
    chosen = sorted(sorted(kl, key=kl.get, reverse=True)[:k])
    return chosen, kl
