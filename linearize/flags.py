"""Command-line flags from config dataclasses (one source of truth: a field's docstring entry is its
--help), shared by the command line's modules (``linearize.cli``, ``linearize.recipes.cli``,
``linearize.benchmarks.cli``)."""

from __future__ import annotations

import argparse
import dataclasses
import re
import textwrap


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


def add_dataclass_args(parser: argparse.ArgumentParser, cls, exclude=(), title=None) -> None:
    helps = _field_help(cls)
    group = parser.add_argument_group(title or cls.__name__)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        if f.name in exclude or flag in parser._option_string_actions:  # shared with an earlier class
            continue
        t = str(f.type)
        default = f.default if f.default is not dataclasses.MISSING else None
        text = f"{helps.get(f.name, '')} (default: {default})".replace("%", "%%")
        if t in ("bool", "bool | None"):  # None: the preset's or the code's choice
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, dest=f.name, help=text)
            continue
        kind = str if "list" in t else int if "int" in t else float if "float" in t else str
        group.add_argument(flag, type=kind, default=default, dest=f.name, help=text)


def dataclass_from_args(cls, args, **fixed):
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    return cls(**{**values, **fixed})


def _add_attn_implementation(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--attn-implementation", default=None, metavar="NAME",
                        help="attention implementation transformers loads the model(s) with: sdpa, eager, ... "
                             "(default: the architecture's own choice, sdpa where the original supports it, "
                             "eager where it must)")


def _lengths(text: str) -> tuple[int, ...]:
    return () if text in ("", "none", "0") else tuple(int(x) for x in text.split(","))


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
