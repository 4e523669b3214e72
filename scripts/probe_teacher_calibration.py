"""Probe: is the teacher over-confident on the sources where distilled students beat it?

docs/reports/quality.md (2026-11-28d) found every student at or below the teacher's perplexity on gcide,
wordnet and the chat answers, and above it on the documentation sources. This scores the teacher's own
held-out rows (the split and packing `linearize distill --eval-held-out` uses) with its logits divided
by a temperature tau: a perplexity that falls for tau > 1 means the teacher is over-confident on that
text, where a smoother student loses less.

    python scripts/probe_teacher_calibration.py TEACHER.gguf SOURCE [SOURCE ...] --rows 8
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from linearize.loading import load_model_and_tokenizer
from linearize.recipes.data import load_documents, pack, split_documents, tokenize

TAUS = (0.8, 0.9, 1.0, 1.1, 1.25, 1.5)


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("teacher")
    p.add_argument("sources", nargs="+")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024)
    a = p.parse_args()
    torch.manual_seed(0)
    model, tok = load_model_and_tokenizer(a.teacher, dtype=torch.float32)
    model.eval()
    print("| source | rows x tokens | " + " | ".join(f"tau {t}" for t in TAUS) + " | best tau | mean entropy (nats) | mean NLL (nats) |")
    print("|---|---|" + "---|" * (len(TAUS) + 3))
    for source in a.sources:
        held = split_documents(load_documents(source, tok), 5.0, need_both=False)[1]
        ids, pos = pack(tokenize(held, tok), a.seq_len, tok.eos_token_id)
        ids, pos = ids[: a.rows], pos[: a.rows]
        nll = {t: 0.0 for t in TAUS}
        ent = n = 0
        for x, q in zip(ids, pos):
            logits = model(input_ids=x[None], position_ids=q[None], use_cache=False).logits[0, :-1].float()
            for t in TAUS:
                nll[t] += F.cross_entropy(logits / t, x[1:], reduction="sum").item()
            lp = logits.log_softmax(-1)
            ent += -(lp.exp() * lp).sum().item()
            n += x.numel() - 1
        ppl = {t: math.exp(v / n) for t, v in nll.items()}
        best = min(ppl, key=ppl.get)
        print(f"| {source.rstrip('/').split('/')[-1]} | {len(ids)} x {a.seq_len} | "
              + " | ".join(f"{ppl[t]:.2f}" for t in TAUS) + f" | {best} | {ent / n:.3f} | {nll[1.0] / n:.3f} |", flush=True)


if __name__ == "__main__":
    main()
