"""Probe: how much of the teacher's attention falls outside a sliding window, per source.

A window hybrid (lolcats) serves the keys inside its window by softmax and everything older by the
linear branch, so the teacher's attention mass outside the window is what the linear branch must
reproduce. This measures that mass on the held-out documents of each source (the split the runs
hold out, packed into rows of ``--seq-len`` as ``linearize distill`` packs them), for windows of 64,
128 and 256 keys, with and without the document's first 4 tokens (the SWA baseline's sinks).

    .venv/bin/python scripts/probe_window_mass.py /path/Documentation /path/ood-kjv /path/gcide
"""

from __future__ import annotations

import argparse
import json

import torch

from linearize.loading import load_model_and_tokenizer
from linearize.recipes.data import load_documents, pack, split_documents

WINDOWS = (64, 128, 256)
SINKS = 4


def row_masses(attn: tuple, pos: torch.Tensor) -> dict:
    """Per window: (queries with keys beyond it, their summed mass outside it, the same without sinks)."""
    T = pos.shape[-1]
    t = torch.arange(T)
    start = t - pos  # each query's document start
    dist = t[:, None] - t[None, :]  # query t, key s
    sink = t[None, :] < start[:, None] + SINKS
    before = t[None, :] < start[:, None]  # keys of earlier documents in the row: masked by the teacher
    leak = max(float((a[0] * before).sum(-1).max()) for a in attn)
    assert leak < 1e-5, f"attention crosses a document boundary ({leak:.2e}): packed rows are not block-diagonal"
    out = {}
    for W in WINDOWS:
        outside = dist >= W  # older than the window (t - W < s <= t is inside)
        q = pos >= W  # queries that have keys beyond their window
        m = torch.stack([(a[0] * outside).sum(-1) for a in attn])  # [layers, heads, T]
        ms = torch.stack([(a[0] * (outside & ~sink)).sum(-1) for a in attn])
        out[W] = (int(q.sum()), float(m[..., q].mean(dim=(0, 1)).sum()), float(ms[..., q].mean(dim=(0, 1)).sum()))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sources", nargs="+")
    p.add_argument("--rows", type=int, default=6)
    p.add_argument("--seq-len", type=int, default=1024)
    a = p.parse_args(argv)
    torch.manual_seed(0)
    model, tok = load_model_and_tokenizer(None, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    result = {}
    for source in a.sources:
        _, held = split_documents(load_documents(source), 5.0)
        ids, pos = pack([tok(d, add_special_tokens=False).input_ids for d in held], a.seq_len, tok.eos_token_id)
        totals = {W: [0, 0.0, 0.0] for W in WINDOWS}
        for r in range(min(a.rows, ids.shape[0])):
            with torch.no_grad():
                out = model(input_ids=ids[r:r + 1], position_ids=pos[r:r + 1], output_attentions=True, use_cache=False)
            for W, (n, m, ms) in row_masses(out.attentions, pos[r]).items():
                totals[W][0] += n
                totals[W][1] += m
                totals[W][2] += ms
        rows = min(a.rows, ids.shape[0])
        name = source.rstrip("/").split("/")[-1]
        result[name] = {W: {"share_of_queries_with_keys_beyond": n / (rows * a.seq_len),
                            "mass_outside": m / max(n, 1), "mass_outside_without_sinks": ms / max(n, 1)}
                        for W, (n, m, ms) in totals.items()}
        print(name, json.dumps(result[name]), flush=True)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
