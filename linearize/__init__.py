"""linearize: convert Hugging Face causal LMs to linear attention with a constant-size state.

    import linearize
    model = AutoModelForCausalLM.from_pretrained(...)
    linearize.linearize(model, linearize.LinearAttentionConfig(feature_map="hedgehog", window=64))
    model.generate(...)                       # uses linearize.LinearizeCache
    model.generate(..., cache_implementation="static")  # linearize.StaticLinearizeCache: compiled decode
    model.save_pretrained(out)                # AutoModelForCausalLM.from_pretrained(out) after `import linearize`
    linearize.export(model, out)              # GatedDeltaNetConfig(layout="qwen3_5"): a plain Qwen3.5 checkpoint
"""

from .api import attention_mode, converted_layers, linearize, restore_softmax, select_softmax_layers, unlinearize
from .cache import LinearizeCache, StaticLinearizeCache
from .config import EncoderLinearAttentionConfig, GatedDeltaNetConfig, LinearAttentionConfig, LinformerConfig
from .feature_maps import FEATURE_MAPS, register_feature_map
from .arch import ARCHITECTURES
from .graphs import DecodeGraph, PrefillGraph
from .hub import push_to_hub
from .native import export

from ._version import __version__  # noqa: E402

__all__ = [
    "linearize",
    "unlinearize",
    "converted_layers",
    "attention_mode",
    "select_softmax_layers",
    "restore_softmax",
    "LinearAttentionConfig",
    "GatedDeltaNetConfig",
    "LinformerConfig",
    "EncoderLinearAttentionConfig",
    "LinearizeCache",
    "StaticLinearizeCache",
    "DecodeGraph",
    "PrefillGraph",
    "FEATURE_MAPS",
    "register_feature_map",
    "ARCHITECTURES",
    "push_to_hub",
    "export",
]
