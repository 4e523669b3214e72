"""Probe: does stage 1's fit of lolcats' linear branch carry from the training sources to the Bible?

For a model after stage 1 (attention transfer) and for the same conversion untrained, on held-out rows
of each corpus: every converted layer's MSE to the teacher's attention output (``attention_mode
"transfer"``), with the linear branch on and with it zeroed (``window_only``). ``recovered`` is the
share of the window-only error the linear branch removes, 1 - MSE(full) / MSE(window only), averaged
over layers: what the branch adds, on that text.

    python scripts/probe_stage1_fit.py RUN_FOLDER SOURCE[,SOURCE...] --held-out SOURCE[,SOURCE...]
"""

from __future__ import annotations

import argparse

import torch

import linearize
from linearize.api import attention_mode
from linearize.loading import load_model_and_tokenizer
from linearize.recipes.data import load_documents, pack, split_documents, tokenize
from linearize.recipes.evaluate import window_only


def rows(tokenizer, docs, seq_len, n_rows):
    ids, pos = pack(tokenize(docs, tokenizer), seq_len, tokenizer.eos_token_id)
    return ids[:n_rows], pos[:n_rows]


@torch.no_grad()
def layer_errors(model, ids, pos):
    out = []
    for i in range(len(ids)):
        with attention_mode(model, "transfer") as layers:
            model(input_ids=ids[i:i + 1], position_ids=pos[i:i + 1], use_cache=False, logits_to_keep=1)
            out.append(torch.stack([m.transfer_loss for m in layers]))
    return torch.stack(out).mean(0)  # (layers,)


def measure(model, ids, pos):
    full = layer_errors(model, ids, pos)
    with window_only(model):
        alone = layer_errors(model, ids, pos)
    return full, alone


def main():
    p = argparse.ArgumentParser()
    p.add_argument("run")
    p.add_argument("sources", help="corpora read whole (never trained on), comma-separated")
    p.add_argument("--held-out", default="", help="training sources: their held-out documents")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--rows", type=int, default=8)
    args = p.parse_args()
    torch.manual_seed(0)
    trained, tokenizer = load_model_and_tokenizer(args.run)
    fresh, _ = load_model_and_tokenizer(None)
    w = trained.config.linearize
    linearize.linearize(fresh, linearize.LinearAttentionConfig(feature_map=w.get("feature_map", "hedgehog"),
                                                               window=w["window"]))
    corpora = {}
    for s in filter(None, args.held_out.split(",")):
        corpora[s.rstrip("/").split("/")[-1] + " (held out)"] = split_documents(load_documents(s, tokenizer), 5.0)[1]
    for s in filter(None, args.sources.split(",")):
        corpora[s.rstrip("/").split("/")[-1]] = load_documents(s, tokenizer)
    print(f"| corpus | model | MSE, linear branch on | MSE, window only | recovered by the branch (mean of layers) |")
    print("|---|---|---|---|---|")
    for name, docs in corpora.items():
        ids, pos = rows(tokenizer, docs, args.seq_len, args.rows)
        for label, model in (("after stage 1", trained), ("untrained", fresh)):
            model.eval()
            full, alone = measure(model, ids, pos)
            rec = (1 - full / alone).mean().item()
            print(f"| {name} | {label} | {full.mean():.3e} | {alone.mean():.3e} | {rec:.3f} |", flush=True)


if __name__ == "__main__":
    main()
