"""Probe: how much of a sliding window's error do 4 exact sink tokens remove?

On the teacher alone, every attention layer computes, from its own q, k, v (the teacher's inputs at every
layer), the full softmax output, the output of the newest W keys only, and that of the newest W keys plus
the document's first 4 tokens; each through the layer's o_proj. The figure is the MSE of the two window
outputs against the full one, per layer (over the queries past the window), and the share of the
window-only error the sinks remove, 1 - MSE(window + sinks) / MSE(window), averaged over layers: the
measure of ``scripts/probe_stage1_fit.py`` (commit b120268), where stage 1's linear branch removed 73-76%
at W = 128 on the training sources and 66% on the Bible.

    python scripts/probe_sinks.py SOURCE[,SOURCE...] --windows 128,256 --seq-len 1024 --rows 6
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from linearize.loading import load_model_and_tokenizer
from linearize.recipes.data import load_documents, pack, split_documents, tokenize
from linearize.swa import swa_mask

ERR = defaultdict(list)  # (W, variant, layer) -> per-row MSE
CFG = {"windows": (128, 256), "sinks": 4}


def _attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    q_len, k_len = query.shape[2], key.shape[2]
    scores = query.float() @ key.float().transpose(-1, -2) * (scaling or query.shape[-1] ** -0.5)

    def out(mask):
        p = torch.softmax(scores.masked_fill(~mask, -math.inf), -1)
        o = (p @ value.float()).transpose(1, 2).reshape(query.shape[0], q_len, -1)
        return module.o_proj(o.to(module.o_proj.weight.dtype)).float()

    base = attention_mask.bool() if attention_mask is not None else None
    full_mask = swa_mask(base, q_len, k_len, k_len + 1, 0, query.device)
    full = out(full_mask)
    for W in CFG["windows"]:
        past = full_mask & ~swa_mask(base, q_len, k_len, W, 0, query.device)  # keys beyond the window
        rows = past.any(-1)[0, 0]  # the queries that have such keys
        for variant, sinks in (("window", 0), ("window + sinks", CFG["sinks"])):
            got = out(swa_mask(base, q_len, k_len, W, sinks, query.device))
            ERR[(W, variant, module.layer_idx)].append(F.mse_loss(got[0, rows], full[0, rows]).item())
    o = torch.softmax(scores.masked_fill(~full_mask, -math.inf), -1) @ value.float()
    return o.transpose(1, 2).to(query.dtype), None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("sources", help="corpora, comma-separated; NAME:held to take a training source's held-out split")
    p.add_argument("--windows", default="128,256")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--rows", type=int, default=6)
    args = p.parse_args()
    CFG["windows"] = tuple(int(w) for w in args.windows.split(","))
    AttentionInterface.register("probe_sinks", _attention)
    AttentionMaskInterface.register("probe_sinks", sdpa_mask)
    model, tok = load_model_and_tokenizer(None, dtype=torch.float32)
    model.set_attn_implementation("probe_sinks")
    model.eval()
    print("| corpus | W | MSE, window only | MSE, window + 4 sinks | removed by the sinks (mean of layers) |")
    print("|---|---|---|---|---|")
    for spec in args.sources.split(","):
        src, _, held = spec.partition(":")
        docs = load_documents(src, tok)
        if held:
            docs = split_documents(docs, 5.0)[1]
        ids, pos = pack(tokenize(docs, tok), args.seq_len, tok.eos_token_id)
        ERR.clear()
        with torch.no_grad():
            for i in range(min(args.rows, len(ids))):
                model(input_ids=ids[i:i + 1], position_ids=pos[i:i + 1], use_cache=False, logits_to_keep=1)
        name = src.rstrip("/").split("/")[-1] + (" (held out)" if held else "")
        for W in CFG["windows"]:
            layers = sorted({k[2] for k in ERR if k[0] == W})
            win = torch.tensor([sum(ERR[(W, "window", i)]) / len(ERR[(W, "window", i)]) for i in layers])
            snk = torch.tensor([sum(ERR[(W, "window + sinks", i)]) / len(ERR[(W, "window + sinks", i)]) for i in layers])
            print(f"| {name} | {W} | {win.mean():.3e} | {snk.mean():.3e} | {(1 - snk / win).mean():.1%} |", flush=True)


if __name__ == "__main__":
    main()
