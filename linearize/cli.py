"""The ``linearize`` command line: convert, generate, eval.

Conversion flags are generated from the method dataclass's fields (one source of truth).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
import textwrap

from .config import LinearAttentionConfig
from .loading import UserError, load_model_and_tokenizer, prepare_out_dir, save_atomically

EPILOG_CONVERT = """examples:
  linearize convert --out smollm2-linear                      # the embedded SmolLM2-135M-Instruct
  linearize convert HuggingFaceTB/SmolLM2-360M --out out --feature-map hedgehog --window 64
  linearize convert ./model.gguf --out out --layers 0-11 --decay scalar
"""
EPILOG_GENERATE = """examples:
  linearize generate smollm2-linear --prompt "What is the capital of France?"
  linearize generate smollm2-linear --prompt "Once upon a time" --no-chat-template --max-new-tokens 64
"""
EPILOG_EVAL = """examples:
  linearize eval smollm2-linear --data held_out.txt
  linearize eval smollm2-linear --data held_out.txt --teacher path/to/original --json
"""


# ---------------------------------------------------------------- dataclass -> flags


def _field_help(cls) -> dict[str, str]:
    """'name: text' entries of the class docstring's Args section."""
    doc = textwrap.dedent((cls.__doc__ or "").split("Args:", 1)[-1])
    out, name = {}, None
    for line in doc.splitlines():
        m = re.match(r"\s{0,8}(\w+): (.*)", line)
        if m and m.group(1) in {f.name for f in dataclasses.fields(cls)}:
            name = m.group(1)
            out[name] = m.group(2).strip()
        elif name and line.strip():
            out[name] += " " + line.strip()
    return out


def add_dataclass_args(parser: argparse.ArgumentParser, cls) -> None:
    helps = _field_help(cls)
    group = parser.add_argument_group(f"{cls.__name__} (conversion)")
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        t = str(f.type)
        if "list" in t:
            kind = str  # "0,2,4-7"
        elif "int" in t:
            kind = int
        elif "float" in t:
            kind = float
        else:
            kind = str
        default = f.default if f.default is not dataclasses.MISSING else None
        group.add_argument(flag, type=kind, default=default, dest=f.name,
                           help=f"{helps.get(f.name, '')} (default: {default})".replace("%", "%%"))


def dataclass_from_args(cls, args):
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


# ---------------------------------------------------------------- commands


def cmd_convert(args) -> None:
    import linearize
    from tqdm.auto import tqdm

    config = dataclass_from_args(LinearAttentionConfig, args)
    out = prepare_out_dir(args.out, args.overwrite)
    with tqdm(total=3, desc="convert", unit="step") as bar:
        bar.set_postfix_str("loading")
        model, tokenizer = load_model_and_tokenizer(args.model, dtype=args.dtype)
        bar.update()
        bar.set_postfix_str("converting")
        linearize.linearize(model, config)
        bar.update()
        bar.set_postfix_str("saving")

        def write(tmp):
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)

        save_atomically(out, write)
        bar.update()
    conv = model.config.linearize
    print(f"converted {len(conv['layers'])}/{model.config.num_hidden_layers} layers "
          f"({conv['feature_map']}, window {conv['window']}, decay {conv['decay']}) -> {out}")


def build_inputs(tokenizer, prompt: str, chat: bool):
    if chat and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
    return tokenizer(prompt, return_tensors="pt")


def cmd_generate(args) -> None:
    import torch
    from transformers import TextStreamer

    model, tokenizer = load_model_and_tokenizer(args.model, dtype=args.dtype)
    inputs = build_inputs(tokenizer, args.prompt, chat=not args.no_chat_template)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    if args.seed is not None:
        torch.manual_seed(args.seed)
    with torch.no_grad():
        model.generate(
            **inputs, max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, temperature=args.temperature,
            streamer=streamer, pad_token_id=tokenizer.pad_token_id,
        )


def evaluate(model, tokenizer, text: str, teacher=None, seq_len: int = 512, max_tokens: int | None = None):
    """Perplexity over ``text`` in windows of ``seq_len`` tokens, and (with a teacher sharing the
    tokenizer) the teacher's perplexity and next-token top-1 agreement."""
    import torch
    from tqdm.auto import tqdm

    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    if max_tokens:
        ids = ids[:max_tokens]
    n_windows = max(1, math.ceil((len(ids) - 1) / seq_len))
    if len(ids) < 2:
        raise UserError("the evaluation text has fewer than 2 tokens")
    nll = {"student": 0.0, "teacher": 0.0}
    agree = total = 0
    for w in tqdm(range(n_windows), desc="eval", unit="window"):
        chunk = ids[w * seq_len : (w + 1) * seq_len + 1][None]
        if chunk.shape[1] < 2:
            break
        with torch.no_grad():
            logits = model(chunk[:, :-1], use_cache=False).logits.float()
            target = chunk[:, 1:]
            nll["student"] += torch.nn.functional.cross_entropy(logits[0], target[0], reduction="sum").item()
            if teacher is not None:
                t_logits = teacher(chunk[:, :-1], use_cache=False).logits.float()
                nll["teacher"] += torch.nn.functional.cross_entropy(t_logits[0], target[0], reduction="sum").item()
                agree += (t_logits.argmax(-1) == logits.argmax(-1)).sum().item()
        total += target.numel()
    result = {"tokens": total, "perplexity": math.exp(nll["student"] / total)}
    if teacher is not None:
        result["teacher_perplexity"] = math.exp(nll["teacher"] / total)
        result["top1_agreement"] = agree / total
    return result


def cmd_eval(args) -> None:
    from pathlib import Path

    data = Path(args.data)
    if not data.is_file():
        raise UserError(f"data file not found: {data}")
    text = data.read_text(encoding="utf-8", errors="replace")
    model, tokenizer = load_model_and_tokenizer(args.model, dtype=args.dtype)
    teacher = None
    if args.teacher:
        teacher, _ = load_model_and_tokenizer(None if args.teacher == "default" else args.teacher, dtype=args.dtype)
    result = evaluate(model, tokenizer, text, teacher, seq_len=args.seq_len, max_tokens=args.max_tokens)
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>20}: {v:.4f}" if isinstance(v, float) else f"{k:>20}: {v}")


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
    add_dataclass_args(c, LinearAttentionConfig)
    c.set_defaults(func=cmd_convert)

    g = sub.add_parser("generate", help="generate text from a (converted) model", epilog=EPILOG_GENERATE, formatter_class=fmt)
    g.add_argument("model", help="converted folder (or any model source)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--no-chat-template", action="store_true", help="feed the prompt as plain text")
    g.add_argument("--do-sample", action="store_true")
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--dtype", default=None)
    g.set_defaults(func=cmd_generate)

    e = sub.add_parser("eval", help="perplexity and agreement with the teacher", epilog=EPILOG_EVAL, formatter_class=fmt)
    e.add_argument("model", help="converted folder (or any model source)")
    e.add_argument("--data", required=True, help="a UTF-8 text file (held out from training)")
    e.add_argument("--teacher", default=None, help="the original model (hub id, folder, .gguf, or 'default' for the embedded SmolLM2)")
    e.add_argument("--seq-len", type=int, default=512)
    e.add_argument("--max-tokens", type=int, default=None, help="evaluate only the first N tokens")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.add_argument("--dtype", default=None)
    e.set_defaults(func=cmd_eval)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (UserError, ValueError, TypeError) as err:
        if isinstance(err, (ValueError, TypeError)) and not _is_user_facing(err):
            raise
        print(f"linearize {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


def _is_user_facing(err: Exception) -> bool:
    # our own validation errors come from linearize.* modules
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and "linearize" in tb.tb_frame.f_code.co_filename


if __name__ == "__main__":
    sys.exit(main())
