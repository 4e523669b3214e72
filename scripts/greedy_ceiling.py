"""What greedy-generation agreement can reach: the teacher against itself at a lower precision.

Greedy agreement (``linearize eval``: the share of the teacher's greedy tokens a student reproduces before
the first difference) stops at the first token whose top two logits swap. The precision the same
weights run in is enough to swap some. This script scores the teacher, cast to each dtype, against
itself in float32 on the held-out openings the runs use. The result is the ceiling to read a
converted model's figure against. The comparison, prompts and the fluency figure are those of
``recipes/evaluate.py`` ``generation_agreement``. It runs on a CPU in under a minute for the
embedded SmolLM2.

    python scripts/greedy_ceiling.py --data DIR/Documentation   # the Linux docs the runs hold out from
    python scripts/greedy_ceiling.py --out /tmp/g.md            # stdlib-docs, always on disk

Writes its section (``greedy_ceiling``) of docs/reports/quality.md.
"""

from __future__ import annotations

import argparse
import copy
import platform
import time

import torch
import transformers

from benchlib import REPORTS, write_section

from linearize.recipes.data import load_documents, split_documents
from linearize.recipes.evaluate import generation_agreement

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def ceiling(teacher, tokenizer, docs: list[str], dtypes: list[str], n_prompts: int = 32,
            prompt_tokens: int = 48, new_tokens: int = 32) -> dict[str, dict]:
    """For each dtype name: ``generation_agreement`` of the teacher cast to it against the float32 teacher."""
    out = {}
    for name in dtypes:
        copy_ = copy.deepcopy(teacher).to(DTYPES[name]).eval()
        out[name] = generation_agreement(copy_, teacher, tokenizer, docs, n_prompts, prompt_tokens, new_tokens)
        del copy_
    return out


def render(results: dict[str, dict], data: str, held_out_percent: float, seconds: float) -> str:
    lines = [f"### Greedy agreement of the teacher with itself (CPU, {platform.machine()}, {time.strftime('%Y-%m-%d')})", "",
             f"`python scripts/greedy_ceiling.py --data {data}`: torch {torch.__version__}, transformers "
             f"{transformers.__version__}; the embedded SmolLM2-135M-Instruct in float32 (the teacher every run "
             f"is scored against) and cast to each dtype; the openings of the held-out documents "
             f"({held_out_percent:g}% by text hash), as `linearize eval` takes them; {seconds:.0f} s.", "",
             "| teacher cast to | greedy agreement (prefix share) | exact match | prompts | fluency (teacher's ppl of the copy's text) | floor |",
             "|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['generation_prefix_agreement']:.3f} | {r['generation_exact_match']:.3f} | "
                     f"{r['generation_prompts']} | {r['fluency_teacher_ppl_of_student']:.3f} | "
                     f"{r['fluency_teacher_ppl_of_teacher']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    from linearize.loading import load_model_and_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="the teacher (default: the embedded SmolLM2)")
    ap.add_argument("--data", default="stdlib-docs", help="documents whose held-out split gives the openings")
    ap.add_argument("--held-out-percent", type=float, default=5.0)
    ap.add_argument("--dtypes", default="bfloat16,float16", help=f"comma-separated, of {sorted(DTYPES)}")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--out", default=str(REPORTS / "quality.md"))
    args = ap.parse_args(argv)
    dtypes = args.dtypes.split(",")
    if bad := [d for d in dtypes if d not in DTYPES]:
        raise SystemExit(f"unknown dtype {bad[0]!r}: pick from {sorted(DTYPES)}")
    torch.manual_seed(0)
    teacher, tokenizer = load_model_and_tokenizer(args.model, dtype=torch.float32)
    teacher.eval()
    held = split_documents(load_documents(args.data, tokenizer), args.held_out_percent)[1]
    t = time.time()
    results = ceiling(teacher, tokenizer, held, dtypes, args.prompts)
    text = render(results, args.data, args.held_out_percent, time.time() - t)
    print(text)
    print(f"wrote {write_section(args.out, 'greedy_ceiling', text)}")


if __name__ == "__main__":
    main()
