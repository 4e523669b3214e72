"""Config and model classes of converted checkpoints, registered with the Auto classes.

For each supported architecture X there is ``LinearizedXConfig`` (model_type ``linearize_<x>``) and
``LinearizedXForCausalLM``: the stock classes plus the conversion recorded in ``config.linearize``,
which ``__init__`` re-applies, so ``AutoModelForCausalLM.from_pretrained(dir)`` rebuilds the
converted layers and loads their weights. The models bring their own state cache to ``generate()``
and to ``forward(use_cache=True)``.
"""

from __future__ import annotations

import functools

import torch
import transformers
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .arch import ARCHITECTURES, ENCODER_ARCHITECTURES, get_arch, get_submodule
from .attention import gated_mlp
from .cache import CACHE_KWARG, LinearizeCache, StaticLinearizeCache
from .config import config_from_dict
from .encoders import EncoderLinearAttention, Linformer
from .gdn import GatedDeltaNet
from .gdn_qwen3_5 import Qwen35Attention, Qwen35GatedDeltaNet, softmax_layer_for
from .hybrid_sdpa import applies as _maskless_chunk, prefill_without_mask
from .hybrid_sdpa import DECODE_NAME, NAME
from .hybrid_sdpa import use_for as use_softmax_decode_kernel
from .layers import NO_PADDING_KWARG, PACKED_KWARG, LinearAttention, document_starts, static_packing_on
from .swa import NAME as SWA_NAME

# transformers' names of static cache implementations (its deprecated aliases included); a converted
# model takes "static" only
STATIC_CACHE_NAMES = ("static", "offloaded_static", "sliding_window", "hybrid", "hybrid_chunked", "offloaded_hybrid",
                      "offloaded_hybrid_chunked")

# conversion method -> the module it puts in place of an attention module
LAYER_CLASSES = {"linear_attention": LinearAttention, "gdn": GatedDeltaNet,
                 "linformer": Linformer, "encoder_linear_attention": EncoderLinearAttention}
# (method, layout) -> the module of a method's other layer forms (GatedDeltaNetConfig.layout)
LAYOUT_CLASSES = {("gdn", "qwen3_5"): Qwen35GatedDeltaNet}
# kept softmax layers in a layout's form (see softmax_layer_for) are converted modules too: modes, unlinearize
CONVERTED = (*LAYER_CLASSES.values(), *LAYOUT_CLASSES.values(), Qwen35Attention)

CONFIG_CLASSES: dict[str, type] = {}
MODEL_CLASSES: dict[str, type] = {}
BASE_MODEL_CLASSES: dict[str, type] = {}


def apply_conversion(model, method_config, layers: list[int]) -> dict[int, LinearAttention]:
    """The one swap walker: replace the attention of ``layers`` in place; returns the new modules."""
    spec = get_arch(model.config.model_type)
    decoder_layers = get_submodule(model, spec.layers)
    swapped = {}
    for i in layers:
        block = decoder_layers[i]
        attn = block.get_submodule(spec.attention)  # a dotted path for BERT's attention.self
        if isinstance(attn, CONVERTED):
            raise ValueError(f"layer {i} is already converted")
        with torch.random.fork_rng(devices=[]):  # reproducible new parameters, caller's RNG untouched
            torch.manual_seed(getattr(method_config, "seed", 0) * 100_003 + i)
            cls = LAYOUT_CLASSES.get((method_config.method, getattr(method_config, "layout", None)),
                                     LAYER_CLASSES[method_config.method])
            new = cls(attn, method_config, spec, layer_idx=i)
        block.set_submodule(spec.attention, new)
        swapped[i] = new
    for i, block in enumerate(decoder_layers):  # the layers left softmax, in the form the method's layout wants
        attn = block.get_submodule(spec.attention)
        if i not in swapped and not isinstance(attn, CONVERTED):
            block.set_submodule(spec.attention, softmax_layer_for(attn, method_config, spec, i))
    tie = getattr(LAYER_CLASSES[method_config.method], "tie_shared", None)
    if tie is not None:  # parameters shared across layers (Linformer sharing="model")
        tie(swapped)
    install_decode_mlps(model)
    use_softmax_decode_kernel(model)  # a hybrid's softmax layers decode on linearize.kernels.softmax_decode
    return swapped


def _decode_mlp_forward(mlp, x):
    y = gated_mlp(mlp, x)
    return type(mlp).forward(mlp, x) if y is None else y


def _mlps(model) -> list:
    """The MLP modules of the decoder layers where the architecture's row names one (``mlp``)."""
    spec = get_arch(model.config.model_type)
    name = getattr(spec, "mlp", None)
    if name is None:
        return []
    return [m for block in get_submodule(model, spec.layers) if (m := getattr(block, name, None)) is not None]


def install_decode_mlps(model) -> int:
    """Run the gated MLPs of the decoder layers (the row's ``mlp``) of a decode step on the decode
    GEMVs: ``silu(gate) * up`` in one kernel, ``down`` in another, instead of three cuBLAS GEMMs and an
    elementwise kernel (``linearize.attention.gated_mlp``; any other call, or a LoRA-wrapped or
    otherwise different MLP, runs the module's own forward). The modules, their weights and
    state-dict names are untouched: an instance attribute ``forward`` routes the call. Returns the
    number of MLPs routed; :func:`remove_decode_mlps` undoes it."""
    todo = [m for m in _mlps(model) if "forward" not in vars(m)]
    for mlp in todo:
        mlp.forward = functools.partial(_decode_mlp_forward, mlp)
    return len(todo)


def remove_decode_mlps(model) -> int:
    """Undo :func:`install_decode_mlps`; returns the number of MLPs it unrouted."""
    n = 0
    for mlp in _mlps(model):
        fwd = vars(mlp).get("forward")
        if isinstance(fwd, functools.partial) and fwd.func is _decode_mlp_forward:
            del mlp.forward
            n += 1
    return n


class _LinearizedMixin:
    """What a converted model adds to its stock class."""

    def _converted_modules(self) -> list:
        return [m for m in self.modules() if isinstance(m, CONVERTED)]

    def _init_conversion(self):
        conv = self.config.linearize
        try:
            method_config = config_from_dict({k: v for k, v in conv.items() if k != "layers"})
        except ValueError as err:  # name the checkpoint: the message reaches the CLI as one line
            where = getattr(self.config, "_name_or_path", "") or "this model"
            raise ValueError(f"{where}: config.linearize: {err}") from None
        apply_conversion(self, method_config, conv["layers"])

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        # transformers calls this with (generation_config, model_kwargs, generation_mode, batch_size,
        # max_cache_length) from 5.17 to 5.24; the cache goes under `cache` from 5.24 (`past_key_values` before)
        implementation = generation_config.cache_implementation
        if model_kwargs.get(CACHE_KWARG) is None and generation_config.use_cache is not False:
            if implementation in (None, "dynamic"):
                model_kwargs[CACHE_KWARG] = LinearizeCache(self.config)
                return
            if implementation == "static":
                model_kwargs[CACHE_KWARG] = self._static_cache_for_generation(generation_config, *args, **kwargs)
                return
            if implementation in STATIC_CACHE_NAMES:
                raise ValueError(
                    f"cache_implementation={implementation!r} is not supported by a converted model; use "
                    "cache_implementation='static' (a StaticLinearizeCache) or leave it unset (the dynamic LinearizeCache)"
                )
        return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)

    def _prefill(self, input_ids, generation_config, model_kwargs, *args, **kwargs):
        # generate(full_sequence, attention_mask=full_mask, past_key_values=returned_cache) continues a
        # cache: the tokens it holds are cut here, once, for the one-call and the chunked prefill alike.
        # transformers cuts them itself only when some cache layer is a KV layer (5.24 trusts no
        # all-linear cache to count its tokens; ours does); a prompt shorter than its mask is new tokens.
        # transformers >= 5.24 drops an all-ones mask before this point and keeps its length aside.
        cache, mask = model_kwargs.get(CACHE_KWARG), model_kwargs.get("attention_mask")
        mask_length = mask.shape[1] if mask is not None else getattr(generation_config, "_mask_length", -1)
        if isinstance(cache, LinearizeCache) and mask_length == input_ids.shape[1]:
            past = int(cache.get_seq_length())
            if 0 < past < input_ids.shape[1]:
                input_ids = input_ids[:, past:]
                if model_kwargs.get("inputs_embeds") is not None:
                    model_kwargs["inputs_embeds"] = model_kwargs["inputs_embeds"][:, past:]
        return super()._prefill(input_ids, generation_config, model_kwargs, *args, **kwargs)

    def _static_cache_for_generation(self, generation_config, generation_mode=None, batch_size=None,
                                     max_cache_length=None, *args, **kwargs) -> StaticLinearizeCache:
        batch_size = kwargs.get("batch_size", batch_size)
        # as transformers sizes its StaticCache: beams / returned sequences expand the batch; a length
        # kept from earlier calls (and generation_config.max_cache_len) avoids recompiling the decode step
        rows = batch_size * max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
        length = max(generation_config.max_length, getattr(generation_config, "max_cache_len", None) or 0,
                     getattr(self, "_previous_max_cache_length", -1))
        self._previous_max_cache_length = length
        return StaticLinearizeCache(self.config, max_batch_size=rows, max_cache_len=length, device=self.device,
                                    dtype=self.dtype)


def _wrap_forward(base_forward):
    @functools.wraps(base_forward)
    def forward(self, *args, **kwargs):
        if CACHE_KWARG != "past_key_values" and "past_key_values" in kwargs:
            # transformers >= 5.24 names it `cache`; the old name is still what most callers pass
            if kwargs.get(CACHE_KWARG) is not None:
                raise ValueError("pass the cache once, as `cache` (past_key_values is its deprecated name)")
            kwargs[CACHE_KWARG] = kwargs.pop("past_key_values")
        # the stock model would build a DynamicCache when none is given; converted layers need ours
        use_cache = kwargs.get("use_cache")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and kwargs.get(CACHE_KWARG) is None and len(args) < 4:
            kwargs[CACHE_KWARG] = LinearizeCache(self.config)
        cache = kwargs.get(CACHE_KWARG)
        if len(args) <= 1 and PACKED_KWARG not in kwargs:
            # packed documents are found once per forward here, not in every layer (one host read,
            # and none at all without explicit position ids: a compiled step stays one graph)
            pos = kwargs.get("position_ids")
            packed = document_starts(pos, kwargs.get("attention_mask"), cache)
            kwargs[PACKED_KWARG] = packed
            # no mask given: no padding, so the layers need not read the 4D mask (which a compiled
            # model builds even without padding) nor check it on the host
            kwargs[NO_PADDING_KWARG] = kwargs.get("attention_mask") is None
            if packed is not None and kwargs.get("attention_mask") is None and static_packing_on():
                # softmax layers (kept, or the teacher's) get the same mask tensor in every batch
                mask = packed_attention_mask(packed, self.config._attn_implementation, self.dtype)
                if mask is not None:
                    kwargs["attention_mask"] = mask
        if not torch.compiler.is_compiling():
            # without gradients the layers run one fused projection GEMM; every forward checks it
            # against the weights (a weight changed in place since the last cached call must not
            # leave a cache-free forward on the old copy), and drops it when gradients are on
            for layer in self._converted_modules():
                layer.refresh_decode_weights()
        if isinstance(cache, StaticLinearizeCache) and not torch.compiler.is_compiling():
            # clear errors before anything is written (Python checks, no host read in decode)
            x = kwargs.get("input_ids", args[0] if args else None)
            x = kwargs.get("inputs_embeds") if x is None else x
            if x is not None:
                cache.check_inputs(batch_size=x.shape[0], num_tokens=x.shape[1])
        if len(args) <= 1 and _maskless_chunk(self, {"input_ids": args[0] if args else None, **kwargs}, cache):
            # a chunk continuing the cache: the softmax layers attend lower-right causally without the
            # (chunk, keys) mask transformers would materialise (linearize/hybrid_sdpa.py)
            with prefill_without_mask(self.config):
                return base_forward(self, *args, **kwargs)
        return base_forward(self, *args, **kwargs)

    return forward


def _make_classes(model_type: str):
    cfg_name, model_name = ARCHITECTURES[model_type].classes
    base_cfg = getattr(transformers, cfg_name)
    base_model = getattr(transformers, model_name)
    cfg_cls = type(f"Linearized{cfg_name}", (base_cfg,), {"model_type": f"linearize_{model_type}", "__module__": __name__})

    def __init__(self, config, *args, **kwargs):
        base_model.__init__(self, config, *args, **kwargs)
        self._init_conversion()

    model_cls = type(
        f"Linearized{model_name}",
        (_LinearizedMixin, base_model),
        {"config_class": cfg_cls, "__init__": __init__, "forward": _wrap_forward(base_model.forward), "__module__": __name__},
    )
    # save_pretrained then copies this file (and the flat files it imports) next to the weights and
    # writes `auto_map`, so the checkpoint loads with trust_remote_code=True where linearize is absent
    cfg_cls._auto_class = "AutoConfig"
    model_cls._auto_class = "AutoModelForCausalLM"
    return cfg_cls, model_cls


def _register_weight_conversions(model_type: str, base_model) -> None:
    """Give ``linearize_<type>`` the checkpoint-layout conversions transformers keeps for the base model
    (gpt_neox's ``embed_out`` -> ``lm_head``, MoE experts stacked on load and split on save): they are
    looked up by class name or model_type, which the converted classes change, so without this a
    converted checkpoint would be saved in one layout and read in another."""
    try:
        from transformers import conversion_mapping as cm

        mapping = cm.get_checkpoint_conversion_mapping(base_model.__name__) or cm.get_checkpoint_conversion_mapping(model_type)
        if mapping:
            cm.register_checkpoint_conversion_mapping(f"linearize_{model_type}", mapping, overwrite=True)
    except ImportError:  # a transformers without checkpoint conversions: nothing to mirror
        pass


def _make_encoder_classes(spec):
    """``Linearized<X>Config`` / ``Linearized<X>Model`` for an encoder row: the base model (what
    ``AutoModel``, ``pipeline("feature-extraction")`` and sentence-transformers load) plus the
    conversion, re-applied in ``__init__``."""
    cfg_name, model_name = spec.base_classes
    base_cfg, base_model = getattr(transformers, cfg_name), getattr(transformers, model_name)
    cfg_cls = type(f"Linearized{cfg_name}", (base_cfg,), {"model_type": f"linearize_{spec.model_type}", "__module__": __name__})

    def __init__(self, config, *args, **kwargs):
        base_model.__init__(self, config, *args, **kwargs)
        conv = self.config.linearize
        apply_conversion(self, config_from_dict({k: v for k, v in conv.items() if k != "layers"}), conv["layers"])

    def _linear_only(self) -> bool:
        """Every layer converted and running linear: no (B, 1, T, T) mask is needed, the 2D padding
        mask says everything (at 8K tokens and batch 8 the 4D mask alone is 512 MiB)."""
        attns = [blk.get_submodule(spec.attention) for blk in get_submodule(self, spec.layers)]
        return all(isinstance(a, CONVERTED) and a.mode == "linear" for a in attns)

    body = {"config_class": cfg_cls, "__init__": __init__, "_linear_only": _linear_only, "__module__": __name__}
    if hasattr(base_model, "_create_attention_masks"):  # bert, roberta, xlm-roberta
        def _create_attention_masks(self, attention_mask, encoder_attention_mask, *args, **kwargs):
            if self._linear_only() and not self.config.is_decoder:
                return attention_mask, encoder_attention_mask
            return base_model._create_attention_masks(self, attention_mask, encoder_attention_mask, *args, **kwargs)

        body["_create_attention_masks"] = _create_attention_masks
    else:  # modernbert takes a per-layer-type mapping of masks as it is
        @functools.wraps(base_model.forward)
        def forward(self, input_ids=None, attention_mask=None, *args, **kwargs):
            if self._linear_only() and not isinstance(attention_mask, dict):
                attention_mask = {"full_attention": attention_mask, "sliding_attention": attention_mask}
            return base_model.forward(self, input_ids, attention_mask, *args, **kwargs)

        body["forward"] = forward
    model_cls = type(f"Linearized{model_name}", (base_model,), body)
    cfg_cls._auto_class = "AutoConfig"
    model_cls._auto_class = "AutoModel"
    return cfg_cls, model_cls


def register_all() -> None:
    for model_type in ARCHITECTURES:
        if model_type in CONFIG_CLASSES:
            continue
        cfg_cls, model_cls = _make_classes(model_type)
        _register_weight_conversions(model_type, model_cls.__mro__[2])
        CONFIG_CLASSES[model_type], MODEL_CLASSES[model_type] = cfg_cls, model_cls
        BASE_MODEL_CLASSES[model_type] = model_cls.__mro__[2]
        globals()[cfg_cls.__name__], globals()[model_cls.__name__] = cfg_cls, model_cls
        AutoConfig.register(cfg_cls.model_type, cfg_cls, exist_ok=True)
        AutoModelForCausalLM.register(cfg_cls, model_cls, exist_ok=True)
    for model_type, spec in ENCODER_ARCHITECTURES.items():
        if model_type in CONFIG_CLASSES:
            continue
        cfg_cls, model_cls = _make_encoder_classes(spec)
        CONFIG_CLASSES[model_type], MODEL_CLASSES[model_type] = cfg_cls, model_cls
        BASE_MODEL_CLASSES[model_type] = model_cls.__mro__[1]
        globals()[cfg_cls.__name__], globals()[model_cls.__name__] = cfg_cls, model_cls
        AutoConfig.register(cfg_cls.model_type, cfg_cls, exist_ok=True)
        AutoModel.register(cfg_cls, model_cls, exist_ok=True)


register_all()


def packed_attention_mask(packed, attn_implementation: str, dtype: torch.dtype):
    """(B, 1, T, T) causal mask within each document (``packed``: ``layers.PackedDocs``), for the softmax layers of a packed call under
    ``static_packing``: transformers builds this mask itself only when a host read finds a packed
    row, and leaves it None for a batch without one, a different input to a compiled layer (a
    recompile); passed ready, it is always a tensor. sdpa (and a hybrid's linearize_* sdpa): bool
    (True = attend); eager: additive float. None for other implementations (transformers then decides, as without static packing)."""
    doc = packed.doc
    T = doc.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc.device).tril()
    mask = (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]
    if attn_implementation in ("sdpa", DECODE_NAME, NAME, SWA_NAME):  # these names narrow or route sdpa's masks
        return mask
    if attn_implementation == "eager":
        return torch.zeros(mask.shape, dtype=dtype, device=doc.device).masked_fill(~mask, torch.finfo(dtype).min)
    return None
