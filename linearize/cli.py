"""The ``linearize`` command line: convert, generate, push, export here; distill and eval from the recipes
(``recipes/cli.py``), generate-data from ``recipes/generate_data.py``, bench from the benchmark harness
(``benchmarks/cli.py``).

Conversion flags are generated from the method dataclass's fields (one source of truth).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
import time

from .flags import _add_attn_implementation, add_dataclass_args, dataclass_from_args
from .config import (ENCODER_METHODS, METHODS, EncoderLinearAttentionConfig, GatedDeltaNetConfig, LinearAttentionConfig,
                     LinformerConfig, normalize_layers)
from .loading import (UserError, check_writable, has_no_tokenizer, load_model_and_tokenizer, no_tokenizer_error,
                      prepare_out_dir, recover_interrupted_save, save_atomically)

# The command line's one door to the recipes and the benchmark harness: each of these modules adds
# its own subcommands (``register(subparsers, formatter_class)``); the library's core imports neither.
COMMAND_MODULES = ("linearize.recipes.cli", "linearize.recipes.generate_data", "linearize.benchmarks.cli")

EPILOG_CONVERT = """examples:
  linearize convert --out smollm2-linear                      # the embedded SmolLM2-135M-Instruct
  linearize convert HuggingFaceTB/SmolLM2-360M --out out --feature-map hedgehog --window 192 --sinks 4
  linearize convert ./model.gguf --out out --layers 0-11 --decay scalar
  linearize convert --out smollm2-gdn --method gdn --softmax-layers auto:8
  linearize convert --out minilm-linformer --method linformer --k 64 --max-length 256   # embedded all-MiniLM-L6-v2
  linearize convert ./my-bert --out out --method encoder_linear_attention --feature-map hedgehog
"""
EPILOG_GENERATE = """examples:
  linearize generate smollm2-linear --prompt "What is the capital of France?"
  linearize generate smollm2-linear --prompt "Once upon a time" --no-chat-template --max-new-tokens 64
"""
EPILOG_PUSH = """examples:
  linearize push runs/lolcats me/smollm2-135m-lolcats
  linearize push runs/lolcats me/smollm2-135m-lolcats --private --revision v1
needs a token: `hf auth login` or HF_TOKEN
"""
EPILOG_EXPORT = """examples:
  linearize convert MODEL --out gdn --method gdn --layout qwen3_5 --softmax-layers 3,7
  linearize export gdn --format qwen3_5 --out gdn-qwen3_5     # loads with plain transformers (docs/export.md)
"""


# ---------------------------------------------------------------- commands


def cmd_convert(args) -> None:
    import linearize
    from tqdm.auto import tqdm

    cls = METHODS[args.method]
    _refuse_foreign_flags(args, cls, [c for c in METHODS.values() if c is not cls])
    config = dataclass_from_args(cls, args)
    recover_interrupted_save(args.out)  # a killed earlier convert: its previous output back, temporaries gone
    out = prepare_out_dir(args.out, args.overwrite)
    check_writable(out)
    if args.method in ENCODER_METHODS or _is_encoder(args.model):
        return _convert_encoder(args, config, out)
    if config.layers is not None:
        _check_layers_exist(args.model, config.layers)
    # a folder without tokenizer files converts (written without one) unless auto:K must tokenize
    need = bool(args.softmax_layers) and args.softmax_layers.startswith("auto:")
    if need and args.model is not None and has_no_tokenizer(str(args.model)):
        raise no_tokenizer_error(args.model)  # before the progress bar: one line
    with tqdm(total=3, desc="convert", unit="step") as bar:
        bar.set_postfix_str("loading")
        model, tokenizer = load_model_and_tokenizer(args.model, args.dtype, args.attn_implementation, need_tokenizer=need)
        bar.update()
        bar.set_postfix_str("converting")
        linearize.linearize(model, config)
        if args.softmax_layers:
            _apply_softmax_layers(model, tokenizer, args)
        bar.update()
        bar.set_postfix_str("saving")

        def write(tmp):
            model.save_pretrained(tmp, safe_serialization=True)
            if os.environ.get("LINEARIZE_TEST_SLOW_SAVE"):  # test hook: a wide window to kill the writer in
                time.sleep(float(os.environ["LINEARIZE_TEST_SLOW_SAVE"]))
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)

        save_atomically(out, write)
        bar.update()
    conv = model.config.linearize
    what = (conv["method"] + (f", window {conv['window']}" if conv.get("window") else "")
            + (f", sinks {conv['sinks']}" if conv.get("sinks") else "")) if conv["method"] != "linear_attention" else (
        f"{conv['feature_map']}, window {conv['window']}, decay {conv['decay']}"
        + (f", gate rank {conv['gate_rank']}" if conv.get("gate_rank") else "")
        + (f", conv {conv['conv_size']}" if conv.get("conv_size") else "")
        + (f", output gate rank {conv['output_gate']}" if conv.get("output_gate") else ""))
    soft = f"; softmax kept in {conv['softmax_layers']}" if conv.get("softmax_layers") else ""
    print(f"converted {len(conv['layers'])}/{model.config.num_hidden_layers} layers ({what}){soft} -> {out}")
    if tokenizer is None:
        print(f"note: {args.model} has no tokenizer files, so {out} has none; copy the base model's tokenizer "
              "files into it before generate, eval or distill", file=sys.stderr)


def _check_layers_exist(source, layers: list[int]) -> None:
    """--layers against the model's layer count, read from its config before the weights load."""
    from pathlib import Path

    from transformers import AutoConfig

    from .loading import default_model_path

    src = Path(default_model_path() if source is None else source)
    try:
        if str(src).endswith(".gguf"):
            config = AutoConfig.from_pretrained(str(src.parent), gguf_file=src.name)
        else:
            config = AutoConfig.from_pretrained(str(src))
    except Exception:  # noqa: BLE001 - loading the model reports a bad source with its own message
        return
    n = getattr(config, "num_hidden_layers", None)
    bad = [i for i in layers if n is not None and i >= n]
    if bad:
        raise UserError(f"--layers {bad} do not exist: {src} has {n} layers (0..{n - 1})")


def _is_encoder(model) -> bool:
    from .encoder_io import is_encoder

    return is_encoder(model)


def _convert_encoder(args, config, out) -> None:
    """An encoder (MODEL, or the embedded all-MiniLM-L6-v2): saved as AutoModel loads it, plus the
    sentence-transformers modules when it came from a sentence-transformers folder."""
    import linearize

    from .encoder_io import load_encoder, save_encoder

    if args.softmax_layers:
        raise UserError("--softmax-layers is for decoders; for an encoder list the layers to convert with --layers")
    model, tokenizer, folder = load_encoder(args.model, dtype=args.dtype, need_tokenizer=False)
    if tokenizer is None:
        print(f"note: {args.model} has no tokenizer files; the converted folder has none either "
              "(save one there before distilling or encoding text)", file=sys.stderr)
    linearize.linearize(model, config)
    save_atomically(out, lambda tmp: save_encoder(tmp, model, tokenizer, folder))
    conv = model.config.linearize
    what = (f"linformer k={conv['k']}, sharing {conv['sharing']}" if conv["method"] == "linformer"
            else f"non-causal {conv['feature_map']} linear attention")
    print(f"converted {len(conv['layers'])}/{model.config.num_hidden_layers} encoder layers ({what}) -> {out}")


def _refuse_foreign_flags(args, cls, others) -> None:
    """A flag of another method, changed from its default, is a mistake: say so instead of ignoring it."""
    own = {f.name for f in dataclasses.fields(cls)}
    for other in others:
        for f in dataclasses.fields(other):
            if f.name not in own and getattr(args, f.name, f.default) != f.default:
                raise UserError(f"--{f.name.replace('_', '-')} belongs to --method {other.method}, not {cls.method}")


def _apply_softmax_layers(model, tokenizer, args) -> None:
    """--softmax-layers 3,7 keeps those layers softmax; auto:K picks the K costliest by KL."""
    import linearize

    spec = args.softmax_layers
    if spec.startswith("auto:"):
        k = int(spec.split(":", 1)[1])
        recipes = importlib.import_module(COMMAND_MODULES[0])  # the calibration rows come from the data recipe
        ids, pos = recipes.calibration_batch(tokenizer, args.calibration_data, args.calibration_tokens)
        device = next(model.parameters()).device
        chosen, kl = linearize.select_softmax_layers(model, k, ids.to(device), pos.to(device))
        model.config.linearize["softmax_selection"] = {"k": k, "by": "kl", "data": args.calibration_data,
                                                       "tokens": int(ids.numel()), "kl": {str(i): v for i, v in kl.items()}}
    else:
        chosen = normalize_layers(spec)
    linearize.restore_softmax(model, chosen)


def build_inputs(tokenizer, prompt: str, chat: bool):
    if chat and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
    return tokenizer(prompt, return_tensors="pt")


def cmd_generate(args) -> None:
    import torch
    from transformers import TextStreamer

    model, tokenizer = load_model_and_tokenizer(args.model, args.dtype, args.attn_implementation)
    inputs = build_inputs(tokenizer, args.prompt, chat=not args.no_chat_template)
    if inputs["input_ids"].shape[-1] == 0:
        raise UserError(f"the prompt {args.prompt!r} is 0 tokens for this tokenizer; pass a prompt it can encode")
    runs = [("", model)]
    if args.compare_teacher:
        source = None if args.compare_teacher == "default" else args.compare_teacher
        teacher, _ = load_model_and_tokenizer(
            source, dtype=args.dtype, attn_implementation=args.attn_implementation, need_tokenizer=False)
        runs = [("teacher: ", teacher), ("student: ", model)]
    for label, m in runs:
        print(label, end="", flush=True)
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        if args.seed is not None:
            torch.manual_seed(args.seed)
        with torch.no_grad():
            m.generate(
                **inputs, max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, temperature=args.temperature,
                streamer=streamer, pad_token_id=tokenizer.pad_token_id,
            )


def cmd_push(args) -> None:
    from .hub import PushError, push_to_hub

    try:
        url = push_to_hub(args.folder, args.repo_id, private=args.private, revision=args.revision,
                          license=args.license, endpoint=args.endpoint)
    except PushError as err:
        raise UserError(str(err)) from err
    print(f"pushed {args.folder} -> {url}")


def cmd_export(args) -> None:
    from .native import export

    recover_interrupted_save(args.out)
    out = prepare_out_dir(args.out, args.overwrite)  # before the weights load
    check_writable(out)
    model, tokenizer = load_model_and_tokenizer(args.model, args.dtype, need_tokenizer=False)
    report = export(model, out, format=args.format, tokenizer=tokenizer, overwrite=args.overwrite)
    n = model.config.num_hidden_layers
    print(f"exported {args.model} as {args.format}: {len(report.linear_layers)}/{n} Gated DeltaNet layers, "
          f"softmax in {report.softmax_layers or 'none'} -> {out}")
    for line in report.deviations + report.warnings:
        print(f"note: {line}", file=sys.stderr)


# ---------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="linearize", description="Convert Hugging Face causal LMs to linear attention.")
    sub = p.add_subparsers(dest="command", required=True)
    fmt = argparse.RawDescriptionHelpFormatter

    c = sub.add_parser("convert", help="swap softmax attention for linear attention and save", epilog=EPILOG_CONVERT, formatter_class=fmt)
    c.add_argument("model", nargs="?", default=None, help="hub id, local folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    c.add_argument("--out", required=True, help="output folder (safetensors, config, tokenizer)")
    c.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    c.add_argument("--dtype", default=None, help="load dtype, e.g. bfloat16 (default: the checkpoint's)")
    _add_attn_implementation(c)
    c.add_argument("--method", choices=sorted(METHODS), default="linear_attention",
                   help="linear_attention (feature maps) or gdn (Gated DeltaNet)")
    c.add_argument("--softmax-layers", default=None, metavar="LIST|auto:K",
                   help="keep these layers softmax (e.g. 3,7), or auto:K to keep the K layers whose conversion "
                        "raises the KL to the original most, measured on --calibration-data")
    c.add_argument("--calibration-data", default="stdlib-docs")
    c.add_argument("--calibration-tokens", type=int, default=1024)
    add_dataclass_args(c, LinearAttentionConfig, title="--method linear_attention (LinearAttentionConfig)")
    add_dataclass_args(c, GatedDeltaNetConfig, title="--method gdn (GatedDeltaNetConfig)")
    add_dataclass_args(c, LinformerConfig, title="--method linformer, encoders (LinformerConfig)")
    add_dataclass_args(c, EncoderLinearAttentionConfig, title="--method encoder_linear_attention, encoders (EncoderLinearAttentionConfig)")
    c.set_defaults(func=cmd_convert)

    g = sub.add_parser("generate", help="generate text from a (converted) model", epilog=EPILOG_GENERATE, formatter_class=fmt)
    g.add_argument("model", help="converted folder (or any model source)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--no-chat-template", action="store_true", help="feed the prompt as plain text")
    g.add_argument("--do-sample", action="store_true")
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--compare-teacher", default=None, metavar="MODEL",
                   help="also generate with this model first ('default' = the embedded SmolLM2) and label both")
    g.add_argument("--dtype", default=None)
    _add_attn_implementation(g)
    g.set_defaults(func=cmd_generate)

    u = sub.add_parser("push", help="upload a converted checkpoint with a model card", epilog=EPILOG_PUSH, formatter_class=fmt)
    u.add_argument("folder", help="a converted checkpoint folder (from convert or distill)")
    u.add_argument("repo_id", help="namespace/name on the Hub")
    u.add_argument("--private", action="store_true")
    u.add_argument("--revision", default=None, help="branch to commit to (created if missing)")
    u.add_argument("--license", default=None, help="license of the base model for the card (default: read from the checkpoint)")
    u.add_argument("--endpoint", default=None, help="Hub endpoint (default: HF_ENDPOINT or huggingface.co)")
    u.set_defaults(func=cmd_push)

    x = sub.add_parser("export", help="write a converted checkpoint as a native transformers model (loads without linearize)",
                       epilog=EPILOG_EXPORT, formatter_class=fmt)
    x.add_argument("model", help="a converted checkpoint folder (from convert or distill)")
    x.add_argument("--format", choices=["qwen3_5"], default="qwen3_5",
                   help="qwen3_5: transformers' Qwen3.5 text model (Qwen3_5ForCausalLM), needs --layout qwen3_5 layers")
    x.add_argument("--out", required=True, help="output folder (config, safetensors, tokenizer, README.md)")
    x.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    x.add_argument("--dtype", default=None, help="load (and write) dtype, e.g. bfloat16 (default: the checkpoint's)")
    x.set_defaults(func=cmd_export)

    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub, fmt)
    return p


def process_start() -> float:
    """When this process started (``time.time()`` seconds; Linux /proc), so that a time budget counts
    the interpreter's start and the imports too; now where /proc is absent."""
    import os
    import time

    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks since boot
        with open("/proc/stat") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def main(argv=None) -> int:
    import time

    # the command line's own process started with the command; a caller's argv runs in its process
    started = process_start() if argv is None else time.time()
    args = build_parser().parse_args(argv)
    args.started = started
    try:
        args.func(args)
    except (UserError, ValueError, TypeError) as err:
        if isinstance(err, (ValueError, TypeError)) and not _is_user_facing(err):
            raise
        print(f"linearize {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


def _is_user_facing(err: Exception) -> bool:
    """Our own validation errors (raised in linearize / linearize.recipes code) are messages for
    the user; anything raised elsewhere keeps its traceback."""
    import os

    roots = (os.path.dirname(__file__), os.path.dirname(importlib.import_module(COMMAND_MODULES[0]).__file__))
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename.startswith(roots)


if __name__ == "__main__":
    sys.exit(main())
