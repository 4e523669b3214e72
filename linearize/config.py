"""One dataclass per conversion method, validated on construction and JSON round-trippable.

The dict form (``to_dict``) is what a converted checkpoint stores under ``config.linearize``,
so a saved model describes its own conversion.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

# keys of config.linearize that describe the conversion but are not method options
RECORD_ONLY = ("base_model", "base_license", "softmax_layers", "softmax_selection", "format_version")

# Version of the checkpoint format (the layout of config.linearize and of the converted layers'
# weights).  Bump it when a change would make an older linearize misread a new checkpoint: an
# older version then refuses the checkpoint instead of loading it wrongly.  Checkpoints written
# before it was recorded are version 1. 2: LinformerConfig.exact_short (format 1 loads with False).
FORMAT_VERSION = 2

# method name -> config class; filled by @register_method
METHODS: dict[str, type] = {}


def register_method(cls):
    METHODS[cls.method] = cls
    return cls


@dataclass
class _MethodConfig:
    method: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, **dataclasses.asdict(self)}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> "_MethodConfig":
        data = dict(data)
        version = data.get("format_version", 1)
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise ValueError(f"this checkpoint was converted by a newer linearize (format_version {version!r}, this "
                             f"version reads <= {FORMAT_VERSION}): upgrade with `pip install -U linearize`")
        method = data.pop("method", "linear_attention")
        for key in RECORD_ONLY:  # written by linearize() beside the method fields
            data.pop(key, None)
        if method not in METHODS:
            raise ValueError(f"unknown conversion method {method!r}; known: {sorted(METHODS)}")
        cls = METHODS[method]
        if method == "linformer" and version < 2:
            data.setdefault("exact_short", False)  # format 1 projected every input
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown fields for {cls.__name__}: {sorted(unknown)}; valid: {sorted(names)}")
        for f in dataclasses.fields(cls):  # JSON from disk: wrong types get named, not a TypeError deep inside
            if f.name in data and not _has_type(data[f.name], str(f.type)):
                raise ValueError(f"{cls.__name__}.{f.name} must be {f.type}, got {data[f.name]!r}")
        return cls(**data)


def _has_type(value, annotation: str) -> bool:
    """Whether a JSON value fits a field annotation such as ``int | None`` or ``list[int] | None``."""
    checks = {"None": lambda v: v is None, "bool": lambda v: isinstance(v, bool),
              "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              "str": lambda v: isinstance(v, str),
              "list[int]": lambda v: isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in v)}
    options = [a.strip() for a in annotation.split("|")]
    if any(a not in checks for a in options):
        return True  # an annotation this check does not know: the dataclass validates it
    return any(checks[a](value) for a in options)


def _check_conv_size(size, default: int) -> int:
    """conv_size: None (the method's default) or an int >= 0 (0 = no convolution)."""
    if size is None:
        return default
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ValueError(f"conv_size must be an int >= 0 (0 = no convolution, e.g. 4), got {size!r}")
    return size


def _check_gate_rank(rank, decay) -> None:
    """gate_rank: an int >= 0, and > 0 only beside a decay gate (it factors that gate)."""
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ValueError(f"gate_rank must be an int >= 0 (0 = the full-width gate, e.g. 16 for a low-rank one), "
                         f"got {rank!r}")
    if rank and decay in (None, "none"):
        raise ValueError(f"gate_rank {rank} factors the decay gate, and there is none: pass decay 'scalar' or "
                         f"'channel' (--decay) with it, or gate_rank 0")


@register_method
@dataclass
class LinearAttentionConfig(_MethodConfig):
    """Feature-map linear attention that reuses the original q/k/v/o projections.

    Args:
        feature_map: name in ``linearize.feature_maps.FEATURE_MAPS``
            (``hedgehog``, ``t2r``, ``elu``, ``relu``, ``performer``).
        feature_dim: size F of the feature space; ``None`` picks the map's default
            (2 * head_dim for hedgehog, head_dim otherwise). Fixed maps (elu, relu) ignore it.
        window: if > 0, softmax attention over the newest ``window`` tokens plus linear
            attention over the older ones, under one normalizer (the LoLCATs layer).
        sinks: with a window, the first ``sinks`` tokens of each document also stay in the softmax
            part (attention sinks, as in StreamingLLM); the cache keeps their keys beside the window.
        decay: ``None`` or ``"none"`` (plain sum), ``"scalar"`` (one learned, data-dependent gate per head
            and step) or ``"channel"`` (one gate per head, step and feature channel).
        gate_rank: with a decay, 0 (default) makes the gate one full-width projection (hidden x
            heads, or hidden x heads*F with "channel"); r > 0 factors it through r channels, hidden ->
            r -> width (GLA's low-rank gate, e.g. 16: a per-channel gate then costs hidden*r +
            r*heads*F instead of hidden*heads*F parameters a layer).
        conv_size: width of a short causal depthwise convolution over q, k and v before the feature
            maps, as in the Gated DeltaNet layer (0 or None = none, e.g. 4); it starts as the identity.
        output_gate: 0 (default) none; r > 0 multiplies the attention output, before the output
            projection, by a learned, data-dependent gate per channel, ``2 * sigmoid(W2 W1 x + b)``
            through rank r (hidden -> r -> heads*head_dim, as GLA and Gated DeltaNet gate their
            outputs); it starts at 1, so the converted layer starts where it would without it.
        layers: indices of the layers to convert; ``None`` converts all of them. Layers not
            listed keep softmax attention (a layer-level hybrid).
        eps: added to the normalizer ``phi(q) . z`` (pure linear layers).
        chunk_size: chunk length of the chunkwise form.
        seed: seed of the random features (performer); the matrix is saved with the weights.
    """

    method: ClassVar[str] = "linear_attention"

    feature_map: str = "hedgehog"
    feature_dim: int | None = None
    window: int = 0
    sinks: int = 0
    decay: str | None = None
    gate_rank: int = 0
    conv_size: int | None = None
    output_gate: int = 0
    layers: list[int] | None = None
    eps: float = 1e-6
    chunk_size: int = 64
    seed: int = 0

    def __post_init__(self):
        _check_feature_map(self.feature_map, self.feature_dim)
        if not isinstance(self.window, int) or self.window < 0:
            raise ValueError(f"window must be an int >= 0 (0 = no softmax window), got {self.window!r}")
        if not isinstance(self.sinks, int) or self.sinks < 0:
            raise ValueError(f"sinks must be an int >= 0, got {self.sinks!r}")
        if self.sinks and not self.window:
            raise ValueError(f"sinks ({self.sinks}) join the softmax window's keys: pass window > 0 with them, or sinks 0")
        if self.decay == "none":  # the CLI's word for no gate (`--decay none`, as `linearize distill` takes it)
            self.decay = None
        if self.decay not in (None, "scalar", "channel"):
            raise ValueError(f"decay must be None, 'scalar' or 'channel', got {self.decay!r}")
        _check_gate_rank(self.gate_rank, self.decay)
        self.conv_size = _check_conv_size(self.conv_size, default=0)
        if not isinstance(self.output_gate, int) or isinstance(self.output_gate, bool) or self.output_gate < 0:
            raise ValueError(f"output_gate is the output gate's rank, an int >= 0 (0 = none, e.g. 16), "
                             f"got {self.output_gate!r}")
        if self.layers is not None:
            self.layers = normalize_layers(self.layers)
        if self.eps <= 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if not isinstance(self.chunk_size, int) or self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive int, got {self.chunk_size!r}")

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        for key in ("gate_rank", "conv_size", "output_gate"):  # off: recorded as before the option existed, so an
            if not data[key]:                   # older linearize still reads the checkpoint (from_dict
                del data[key]                   # defaults it to 0)
        return data


@register_method
@dataclass
class GatedDeltaNetConfig(_MethodConfig):
    """Gated DeltaNet layers built from the pretrained attention (see ``linearize.gdn``).

    Args:
        layers: indices of the layers to convert; ``None`` converts all of them.
        conv_size: width of the short causal convolution on q/k/v (0 = none; None: 4); starts as identity.
        use_rope: apply the model's RoPE to q and k before the L2 normalisation; None: the layout's
            choice (yes for "default", no for "qwen3_5", whose layer has no RoPE).
        kv_heads: "expand" (a state per query head) or "group" (one state per key head, shared by
            its query group: a smaller cache).
        seed: initialisation seed of the new parameters.
        layout: "default" (linearize's layer, which starts as a pass-through) or "qwen3_5" (exactly
            transformers' Qwen3.5 Gated DeltaNet: SiLU after the conv, gated RMSNorm times silu(z),
            no RoPE), so that ``linearize export --format qwen3_5`` writes a checkpoint plain
            transformers loads (docs/export.md).
        window: if > 0, a softmax window beside the Gated DeltaNet: the layer's output is softmax
            attention over the newest ``window`` keys (the original q, k, v and RoPE) plus
            ``gamma_h`` times the Gated DeltaNet's output, with ``gamma`` a learned weight per head
            that starts at 0, so the converted layer starts as exact sliding-window attention.
            The cache keeps the newest W-1 keys and values beside the state.
        sinks: with a window, each document's first ``sinks`` tokens also stay in the softmax part
            (attention sinks, as in the window hybrid of ``LinearAttentionConfig``).
        dt_min, dt_max: the range of the decay's initial time steps, log-spaced over the state heads
            (the names of Mamba2 and fla): head h starts forgetting at ``alpha = exp(-dt_h)`` per token,
            so it remembers about ``1 / dt_h`` tokens (1e-3 to 1e-2: 1,000 down to 100).
    """

    method: ClassVar[str] = "gdn"

    layers: list[int] | None = None
    conv_size: int | None = None
    use_rope: bool = None  # None resolves to the layout's choice in __post_init__: a saved config holds a bool
    kv_heads: str = "expand"
    seed: int = 0
    layout: str = "default"
    window: int = 0
    sinks: int = 0
    dt_min: float = 1e-3
    dt_max: float = 1e-2

    def __post_init__(self):
        if self.layers is not None:
            self.layers = normalize_layers(self.layers)
        self.conv_size = _check_conv_size(self.conv_size, default=4)
        if not (isinstance(self.dt_min, (int, float)) and isinstance(self.dt_max, (int, float))
                and 0 < self.dt_min <= self.dt_max):
            raise ValueError(f"dt_min and dt_max must be numbers with 0 < dt_min <= dt_max (e.g. 1e-4 and 1e-2), got "
                             f"{self.dt_min!r} and {self.dt_max!r}")
        if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 0:
            raise ValueError(f"window must be an int >= 0 (0 = no softmax window), got {self.window!r}")
        if not isinstance(self.sinks, int) or isinstance(self.sinks, bool) or self.sinks < 0:
            raise ValueError(f"sinks must be an int >= 0, got {self.sinks!r}")
        if self.sinks and not self.window:
            raise ValueError(f"sinks ({self.sinks}) join the softmax window's keys: pass window > 0 with them, or sinks 0")
        if self.kv_heads not in ("expand", "group"):
            raise ValueError(f"kv_heads must be 'expand' or 'group', got {self.kv_heads!r}")
        if self.layout not in GDN_LAYOUTS:
            raise ValueError(f"layout must be one of {GDN_LAYOUTS}, got {self.layout!r}")
        if self.use_rope is None:  # resolved here, so a saved config says what the layer does
            self.use_rope = self.layout == "default"
        if self.layout == "qwen3_5":
            # what Qwen3.5's layer cannot hold: each is refused rather than silently changed
            if self.use_rope:
                raise ValueError("layout 'qwen3_5' has no RoPE in its Gated DeltaNet layers: drop --use-rope "
                                 "(or use layout 'default')")
            if self.conv_size < 1:
                raise ValueError("layout 'qwen3_5' always has the short convolution: pass conv_size >= 1 (e.g. 4)")
            if self.kv_heads != "expand":
                raise ValueError("layout 'qwen3_5' keeps a state per query head (its key heads may not outnumber "
                                 "its value heads): pass kv_heads='expand'")
            if self.window:
                raise ValueError("layout 'qwen3_5' has no softmax window beside its Gated DeltaNet layers: drop "
                                 "--window (or use layout 'default')")

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        if data["layout"] == "default":  # absent = default: such checkpoints stay readable by linearize before layouts
            del data["layout"]
        for key in ("window", "sinks"):  # off: absent, as before the window existed
            if not data[key]:
                del data[key]
        for key in ("dt_min", "dt_max"):  # the default: absent, as before the option
            if data[key] == self.__dataclass_fields__[key].default:
                del data[key]
        return data



# Gated DeltaNet layer forms: linearize's own, and transformers' Qwen3.5 (linearize/gdn_qwen3_5.py)
GDN_LAYOUTS = ("default", "qwen3_5")

LINFORMER_SHARING = ("head", "layer", "kv", "model")


@register_method
@dataclass
class LinformerConfig(_MethodConfig):
    """Linformer (Wang et al. 2020) for bidirectional encoders: keys and values are projected along
    the sequence axis to ``k`` positions by learned ``E, F`` of shape (k, max_length), so attention
    costs O(n k): ``softmax(Q (E K)^T / sqrt(d)) (F V)``. Padding is removed before the projection
    (the real tokens are moved to the front and only the first L columns of E, F are used), so a
    padded batch gives what each input gives alone; inputs longer than ``max_length`` are refused.

    Args:
        k: projection length (the number of projected key/value positions).
        max_length: the longest input n (columns of E, F); None takes the model's
            max_position_embeddings.
        sharing: "head" (E, F per head), "layer" (E, F per layer, shared by its heads), "kv"
            (one matrix per layer for both keys and values) or "model" (one matrix for keys and
            values of every converted layer).
        layers: indices of the layers to convert; None converts all of them.
        seed: initialisation seed of E and F.
        exact_short: an input of at most ``k`` real tokens attends exactly (softmax over its own
            keys, what the original layer does): it costs at most O(k^2) <= O(n k), while projecting
            its L tokens would leave it about L k / n useful rows. Checkpoints of format 1 (before
            this field) load with False, as they were trained.
    """

    method: ClassVar[str] = "linformer"

    k: int = 64
    max_length: int | None = None
    sharing: str = "layer"
    layers: list[int] | None = None
    seed: int = 0
    exact_short: bool = True

    def __post_init__(self):
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k <= 0:
            raise ValueError(f"k (projection length) must be a positive int, got {self.k!r}")
        if self.max_length is not None:
            if not isinstance(self.max_length, int) or self.max_length <= 0:
                raise ValueError(f"max_length must be a positive int or None, got {self.max_length!r}")
            if self.k > self.max_length:
                raise ValueError(f"k={self.k} is larger than max_length={self.max_length}: choose k <= max_length")
        if not isinstance(self.exact_short, bool):
            raise ValueError(f"exact_short must be True or False, got {self.exact_short!r}")
        if self.sharing not in LINFORMER_SHARING:
            raise ValueError(f"sharing must be one of {LINFORMER_SHARING}, got {self.sharing!r}")
        if self.layers is not None:
            self.layers = normalize_layers(self.layers)


@register_method
@dataclass
class EncoderLinearAttentionConfig(_MethodConfig):
    """Non-causal feature-map linear attention for bidirectional encoders:
    ``phi(Q) (phi(K)^T V) / (phi(Q) sum_j phi(k_j) + eps)`` over the real (non-pad) keys, with any
    registered feature map and no state to carry.

    Args:
        feature_map: name in ``linearize.feature_maps.FEATURE_MAPS``.
        feature_dim: size F of the feature space; None picks the map's default.
        layers: indices of the layers to convert; None converts all of them.
        eps: added to the normalizer.
        seed: seed of the feature maps' random parts (performer).
    """

    method: ClassVar[str] = "encoder_linear_attention"

    feature_map: str = "hedgehog"
    feature_dim: int | None = None
    layers: list[int] | None = None
    eps: float = 1e-6
    seed: int = 0

    def __post_init__(self):
        _check_feature_map(self.feature_map, self.feature_dim)
        if self.layers is not None:
            self.layers = normalize_layers(self.layers)
        if self.eps <= 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")


# methods that convert bidirectional encoders (the others convert causal decoders)
ENCODER_METHODS = ("linformer", "encoder_linear_attention")


def normalize_layers(layers) -> list[int]:
    """Accepts a list of ints or a string like ``"0,2,4-7"``; returns sorted unique ints."""
    if isinstance(layers, str):
        out = []
        for part in layers.split(","):
            part = part.strip()
            if not part:
                continue
            lo, dash, hi = part.partition("-")
            if not (lo.isdigit() and (hi.isdigit() if dash else True)) or (dash and int(hi) < int(lo)):
                raise ValueError(f"layers: {part!r} is not a layer index or an ascending range (e.g. 0,2,4-7)")
            out.extend(range(int(lo), int(hi) + 1) if dash else [int(lo)])
        layers = out
    layers = list(layers)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers):
        raise ValueError(f"layers must be non-negative layer indices, got {layers!r}")
    if not layers:
        raise ValueError("layers is empty: name at least one layer (e.g. 0,2,4-7), or none to convert them all")
    return sorted(set(layers))


def config_from_dict(data: dict[str, Any]):
    return _MethodConfig.from_dict(data)


def _check_feature_map(feature_map: str, feature_dim) -> None:
    """The feature-map fields both linear-attention configs share (causal and encoder)."""
    from .feature_maps import FEATURE_MAPS

    if feature_map not in FEATURE_MAPS:
        raise ValueError(f"unknown feature_map {feature_map!r}; choose one of {sorted(FEATURE_MAPS)}")
    if feature_dim is not None and (not isinstance(feature_dim, int) or feature_dim <= 0):
        raise ValueError(f"feature_dim must be a positive int or None, got {feature_dim!r}")
    if feature_map == "hedgehog" and feature_dim is not None and feature_dim % 2:
        raise ValueError(f"hedgehog feature_dim must be even ([xW, -xW]), got {feature_dim}")
