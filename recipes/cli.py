"""The recipes' subcommands of the ``linearize`` command line: ``distill`` and ``eval``.

``linearize.cli`` reaches this module through its one registration point (``COMMAND_MODULES``), so the
library's core never imports the recipes.
"""

from __future__ import annotations

import argparse
import json

from linearize.encoder_io import is_encoder
from linearize.flags import _add_attn_implementation, _lengths, add_dataclass_args, dataclass_from_args, torch_cuda
from linearize.hub import stage_records
from linearize.loading import UserError, check_writable, load_model_and_tokenizer

EPILOG_EVAL = """examples:
  linearize eval smollm2-linear --data held_out.txt
  linearize eval runs/lolcats --data stdlib-docs --split held_out --teacher default --json
  linearize eval runs/lolcats --data stdlib-docs --split held_out --teacher default --eval-data other_docs/ \
      --chat-prompts chat.jsonl --chat-answers answers.jsonl
"""
EPILOG_DISTILL = """examples:
  linearize distill --out runs/lolcats --preset lolcats                   # embedded SmolLM2 on stdlib-docs
  linearize distill --out runs/linear --preset linear --max-minutes 20 --mixed-precision bf16   # the preset's 300 + 700 steps, fitted to 20 minutes
  linearize distill MODEL --out DIR --data corpus.jsonl --finetune full --resume
  linearize distill --out runs/minilm-linformer --preset linformer --linformer-k 32 --seq-len 128   # embedded all-MiniLM-L6-v2
  linearize distill ./my-sentence-model --out DIR --preset linear                  # encoders: non-causal hedgehog
"""


def calibration_batch(tokenizer, source: str, tokens: int, seq_len: int = 256):
    from .data import is_held_out, load_documents, pack, tokenize

    token_docs, total = [], 0
    for doc in load_documents(source, tokenizer):
        if is_held_out(doc, 5.0):  # never calibrate on the evaluation split
            continue
        token_docs += tokenize([doc], tokenizer)
        total += len(token_docs[-1]) + 1
        if total >= tokens:
            break
    ids, pos = pack(token_docs, min(seq_len, tokens), tokenizer.eos_token_id)
    n = max(1, tokens // min(seq_len, tokens))
    return ids[:n], pos[:n]


def cmd_eval(args) -> None:
    from .data import load_documents, split_documents
    from .evaluate import evaluate_all, format_table

    if args.max_rows < 1:
        raise UserError(f"--max-rows must be >= 1, got {args.max_rows}")
    if args.prompt_tokens < 1:
        raise UserError(f"--prompt-tokens must be >= 1, got {args.prompt_tokens}")
    model, tokenizer = load_model_and_tokenizer(args.model, args.dtype, args.attn_implementation)
    docs = load_documents(args.data, tokenizer)
    if args.split == "held_out":
        docs = split_documents(docs, args.held_out_percent)[1]
    teacher = None
    if args.teacher:
        source = None if args.teacher == "default" else args.teacher
        teacher, _ = load_model_and_tokenizer(
            source, dtype=args.dtype, attn_implementation=args.attn_implementation, need_tokenizer=False)
    device = "cuda" if torch_cuda() else "cpu"
    model.to(device)
    if teacher is not None:
        teacher.to(device)
    corpora, chat = _eval_inputs(args, tokenizer, has_teacher=teacher is not None)
    result = evaluate_all(model, teacher, tokenizer, docs, seq_len=args.seq_len, max_rows=args.max_rows,
                          n_prompts=args.prompts, prompt_tokens=args.prompt_tokens, passkey_lengths=_lengths(args.passkey),
                          passkey_trials=args.passkey_trials, device=device, corpora=corpora, chat_prompts=chat,
                          chat_tokens=args.chat_tokens, window_only_ablation=args.window_only_ablation)
    answers = result.pop("chat_answers", None)
    if answers and args.chat_answers:
        _write_jsonl(args.chat_answers, answers)
    if args.json:
        print(json.dumps({**result, "chat_answers": answers} if answers else result))
    else:
        print(format_table(result))


def _eval_inputs(args, tokenizer, has_teacher: bool) -> tuple[dict | None, list | None]:
    """``--eval-data``'s corpora and ``--chat-prompts``' conversations, read before the evaluation
    (``distill``: before the training) so that a wrong path fails at once."""
    from .evaluate import load_chat_prompts, load_corpora

    corpora = load_corpora(args.eval_data, tokenizer) if args.eval_data else None
    if getattr(args, "eval_held_out", None):
        # a training source's own held-out documents (the split --data took), scored alone: comparable
        # across runs whose mixes differ, where the mix's held-out rows are not
        from .data import load_documents, parse_sources, split_documents
        from .evaluate import corpus_name

        corpora = corpora or {}
        for source, _ in parse_sources(args.eval_held_out):
            held = split_documents(load_documents(source, tokenizer), args.held_out_percent, need_both=False)[1]
            if not held:
                raise UserError(f"--eval-held-out {source}: none of its documents is held out at "
                                f"{args.held_out_percent}%; pass a larger source")
            corpora[f"{corpus_name(source)}-held-out"] = held
    chat = None
    if args.chat_prompts:
        if not has_teacher:
            raise UserError("--chat-prompts compares the student's answers with the teacher's: pass --teacher too")
        if not getattr(tokenizer, "chat_template", None):
            raise UserError("--chat-prompts needs a tokenizer with a chat template; this model's has none")
        chat = load_chat_prompts(args.chat_prompts)
    return corpora, chat


def _write_jsonl(path, records) -> None:
    from pathlib import Path

    Path(path).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def cmd_distill(args) -> None:
    import shutil
    import time
    from pathlib import Path

    # --max-minutes counts the whole command: from the process's start (``main``) through loading,
    # training, the save and the evaluation
    started = getattr(args, "started", None) or time.time()
    from .data import DataConfig
    from .distill import DistillConfig, distill
    from .evaluate import evaluate_all, format_table
    from .train import TrainConfig, process_state

    if args.eval and args.eval_rows < 1:
        raise UserError(f"--eval-rows must be >= 1, got {args.eval_rows}; pass --no-eval to skip the evaluation")
    if args.eval and args.eval_prompt_tokens < 1:
        raise UserError(f"--eval-prompt-tokens must be >= 1, got {args.eval_prompt_tokens}")
    cfg = dataclass_from_args(DistillConfig, args)
    data_cfg = dataclass_from_args(DataConfig, args)
    train_cfg = dataclass_from_args(TrainConfig, args, steps=1, lr=1.0)
    out = Path(args.out)
    state = process_state()  # one process, or one of `accelerate launch`'s: the main one clears --out
    if out.exists() and any(out.iterdir()) and not args.resume:
        if not args.overwrite:
            raise UserError(f"output {out} exists and is not empty; pass --resume to continue that run or --overwrite to start over")
        state.wait_for_everyone()  # every process has seen the folder before it goes
        if state.is_main_process:
            shutil.rmtree(out)
    if cfg.preset == "linformer" or is_encoder(args.model):
        return _distill_encoder(args, cfg, data_cfg, train_cfg, out)
    if state.is_main_process:
        check_writable(out)
    state.wait_for_everyone()
    model, tokenizer = load_model_and_tokenizer(args.model, args.dtype, args.attn_implementation)
    device = state.device
    model.to(device)
    corpora, chat = _eval_inputs(args, tokenizer, has_teacher=True) if args.eval else (None, None)
    summary = distill(model, tokenizer, cfg, data_cfg, train_cfg, out, resume=args.resume, started=started,
                      evaluates=args.eval)
    if not state.is_main_process:  # the others trained their share; the main one reports
        return
    print(f"distilled model -> {out}")
    t_eval = time.time()
    if args.eval:
        held = json.loads((out / "held_out.json").read_text())
        teacher, _ = load_model_and_tokenizer(args.model, args.dtype, args.attn_implementation, need_tokenizer=False)
        teacher.to(device)
        partial = out / "eval.partial.json"  # the figures of the parts done, should a later part fail

        def progress(so_far: dict) -> None:
            tmp = partial.with_name(partial.name + ".tmp")
            tmp.write_text(json.dumps({k: v for k, v in so_far.items() if k != "chat_answers"}, indent=2))
            tmp.replace(partial)

        result = evaluate_all(model, teacher, tokenizer, held, seq_len=args.eval_seq_len or data_cfg.seq_len,
                              max_rows=args.eval_rows,
                              n_prompts=args.eval_prompts, prompt_tokens=args.eval_prompt_tokens,
                              passkey_lengths=_lengths(args.passkey),
                              passkey_trials=args.passkey_trials, device=device,
                              # --max-minutes: the evaluation stops taking prompts and trials in time
                              # to write its files (a few seconds before the budget ends)
                              deadline=summary["budget"]["deadline"] - 3.0 if cfg.max_minutes else None,
                              corpora=corpora, chat_prompts=chat, chat_tokens=args.chat_tokens,
                              window_only_ablation=args.window_only_ablation, progress=progress)
        answers = result.pop("chat_answers", None)
        if answers:
            _write_jsonl(out / "chat_answers.jsonl", answers)
        result["training_tokens"] = sum(s.get("tokens", 0) for s in stage_records(summary))
        (out / "eval.json").write_text(json.dumps(result, indent=2))
        partial.unlink(missing_ok=True)
        table = format_table(result)
        (out / "eval.md").write_text(table + "\n")
        print(table)
    # the whole command's time beside the budget, in the run's summary
    summary["eval_s"] = time.time() - t_eval if args.eval else 0.0
    summary["wall_s"] = time.time() - started
    if cfg.max_minutes:
        summary["budget"]["within"] = summary["wall_s"] <= 60 * cfg.max_minutes
    (out / "distill.json").write_text(json.dumps(summary, indent=2, default=str))


def _distill_encoder(args, cfg, data_cfg, train_cfg, out) -> None:
    from .encoder_distill import distill_encoder

    from linearize.encoder_io import load_encoder

    if cfg.softmax_layers:
        raise UserError("--softmax-layers is for decoders; for an encoder list the layers to convert with --layers")
    model, tokenizer, folder = load_encoder(args.model, dtype=args.dtype)
    model.to("cuda" if torch_cuda() else "cpu")
    distill_encoder(model, tokenizer, folder, cfg, data_cfg, train_cfg, out, resume=args.resume, evaluate=args.eval,
                    max_passages=args.max_passages)
    print(f"distilled encoder -> {out}")


def _add_eval_extras(p, run_folder: bool = False) -> None:
    p.add_argument("--eval-data", default=None, metavar="SOURCES",
                   help="more corpora to evaluate (never trained on, e.g. out of domain): comma-separated sources "
                        "in --data's syntax, each whole, reported by folder/file name")
    where = "chat_answers.jsonl in --out" if run_folder else "--chat-answers or --json"
    if run_folder:
        p.add_argument("--eval-held-out", default=None, metavar="SOURCES",
                       help="training sources (of --data) whose held-out documents are also scored alone, each as "
                            "the corpus '<name>-held-out' (comparable across runs on different mixes)")
    p.add_argument("--chat-prompts", default=None, metavar="FILE.jsonl",
                   help="chat records ('prompt', or 'messages' without the last assistant turn): greedy answers of "
                        f"student and teacher through the chat template, their agreement and the teacher's perplexity "
                        f"of the student's answers; the answers side by side in {where}")
    p.add_argument("--chat-tokens", type=int, default=64, help="the longest chat answer, in new tokens")
    p.add_argument("--window-only-ablation", action=argparse.BooleanOptionalAction, default=None,
                   help="score the held-out rows and run the passkey once more with the window hybrids' linear "
                        "branch zeroed (default: on when the model has window hybrid layers)")


def register(sub, fmt) -> None:
    """Add ``eval`` and ``distill`` to the command line's subparsers."""
    e = sub.add_parser("eval", help="perplexity, agreement with the teacher, generation, passkey", epilog=EPILOG_EVAL, formatter_class=fmt)
    e.add_argument("model", help="converted folder (or any model source)")
    e.add_argument("--data", required=True, help="held-out text: a file (.txt/.jsonl/.parquet), a folder, stdlib-docs, "
                   "or several, comma-separated (weights after @ are ignored here)")
    e.add_argument("--split", choices=["all", "held_out"], default="all", help="use every document, or only the held-out split")
    e.add_argument("--held-out-percent", type=float, default=5.0)
    e.add_argument("--teacher", default=None, help="the original model (hub id, folder, .gguf, or 'default' for the embedded SmolLM2)")
    e.add_argument("--seq-len", type=int, default=512)
    e.add_argument("--max-rows", type=int, default=64, help="evaluate at most this many packed rows")
    e.add_argument("--prompts", type=int, default=16, help="held-out prompts for greedy-generation agreement")
    e.add_argument("--prompt-tokens", type=int, default=48,
                   help="tokens of each held-out opening for greedy agreement (48 fits a 192-key window with the answer)")
    e.add_argument("--passkey", default="512,1024", help="passkey context lengths, comma-separated ('none' to skip)")
    e.add_argument("--passkey-trials", type=int, default=5)
    e.add_argument("--json", action="store_true", help="print one JSON object (with --chat-prompts: the answers too)")
    e.add_argument("--chat-answers", default=None, metavar="FILE.jsonl",
                   help="with --chat-prompts: write the answers side by side (prompt, teacher, student) here")
    _add_eval_extras(e)
    e.add_argument("--dtype", default=None)
    _add_attn_implementation(e)
    e.set_defaults(func=cmd_eval)

    d = sub.add_parser("distill", help="convert, then distill from the original (attention transfer + KD)", epilog=EPILOG_DISTILL, formatter_class=fmt)
    d.add_argument("model", nargs="?", default=None, help="hub id, local folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    d.add_argument("--out", required=True, help="run folder: the distilled checkpoint, metrics.jsonl, loss PNGs, checkpoints/")
    d.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    d.add_argument("--overwrite", action="store_true", help="delete a non-empty --out and start over")
    d.add_argument("--eval", action=argparse.BooleanOptionalAction, default=True, help="evaluate on the held-out split beside the teacher")
    d.add_argument("--eval-rows", type=int, default=16)
    d.add_argument("--eval-seq-len", type=int, default=None,
                   help="row length for the held-out perplexity and top-1 agreement (default: --seq-len)")
    d.add_argument("--eval-prompts", type=int, default=8)
    d.add_argument("--eval-prompt-tokens", type=int, default=48, help="as eval's --prompt-tokens")
    d.add_argument("--passkey", default="256,512", help="passkey context lengths for --eval ('none' to skip)")
    d.add_argument("--passkey-trials", type=int, default=5, help="passkey prompts per context length")
    _add_eval_extras(d, run_folder=True)
    d.add_argument("--dtype", default=None)
    _add_attn_implementation(d)
    d.add_argument("--max-passages", type=int, default=0, help="encoders: train on at most this many passages (0 = all)")
    from .data import DataConfig
    from .distill import DistillConfig
    from .train import TrainConfig

    add_dataclass_args(d, DistillConfig, title="recipe (DistillConfig)")
    add_dataclass_args(d, DataConfig, title="data (DataConfig)")
    add_dataclass_args(d, TrainConfig, exclude=("steps", "lr"), title="training (TrainConfig; steps and lr are per stage above)")
    d.set_defaults(func=cmd_distill)
