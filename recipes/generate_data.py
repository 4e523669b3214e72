"""``linearize generate-data``: chat samples answered by the teacher, so that an instruct teacher's
student stays an instruct model when it is distilled on them (mixed into ``--data``); or, with
``--continue-from SOURCE``, the teacher's own continuations of the openings of SOURCE's training
documents (sequence-level distillation: text the teacher writes, records ``{"text": ..., "id": ...}``); or,
with ``--unconditional``, text the teacher writes from its start token alone: samples of its own
distribution, the kinds of text it was trained on, whatever the training mix holds.

The prompts are the project's own (``recipes/prompts.py``, split ``train``); the answers come from
``model.generate()`` in left-padded batches with transformers' static cache (on a GPU its decode step
is compiled once and reused by every batch). Each kept sample is one JSONL line

    {"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}], "id": 17, ...}

which ``recipes/data.py`` ``load_documents`` renders with the chat template; ``id`` is the prompt's
index in the split, from which an interrupted run resumes. ``--shard K/N`` answers only the prompts whose
index i has i % N == K, so N processes (one per GPU) write disjoint files that mix as one folder.
"""

from __future__ import annotations

import json
import os
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from linearize.flags import _add_attn_implementation, add_dataclass_args, dataclass_from_args, torch_cuda
from linearize.loading import UserError, load_model_and_tokenizer

from .prompts import HELD_OUT_PERCENT, SPLITS, Prompt, build_prompts, heading_prompts

EPILOG = """examples:
  linearize generate-data --out chat.jsonl --samples 4000 --dtype bfloat16     # embedded SmolLM2, on the GPU
  linearize generate-data MODEL --out chat.jsonl --samples 20000 --batch-size 128 --max-minutes 5
  linearize generate-data --out chat/part-1.jsonl --shard 1/2 --max-minutes 10  # the second of two GPUs
  linearize generate-data --write-prompts held_out.jsonl --split held_out      # the evaluation prompts, no model
  linearize generate-data --out text.jsonl --continue-from docs/ --samples 20000  # the teacher continues docs' openings
  linearize generate-data --out free.jsonl --unconditional --temperature 1 --samples 20000  # the teacher's own text
  linearize distill --out run --data stdlib-docs@3,chat.jsonl@1 ...             # docs/distill.md
"""


@dataclass
class GenerateDataConfig:
    """Args:
    samples: kept chat samples the output file ends with (a resumed file's lines count).
    max_new_tokens: answer length limit in tokens.
    batch_size: prompts answered together (left-padded to a multiple of 32 tokens).
    temperature: sampling temperature, 0 = greedy; unset: the model's generation config's when it samples, else 0.7.
    top_p: nucleus sampling mass; unset: the model's generation config's when it samples, else 0.9.
    seed: sampling seed; batch starting at prompt i uses seed + i, so a resumed run draws as an uninterrupted one.
    split: prompts to answer: train (training data) or held_out (evaluation; never train on these).
    held_out_percent: share of the prompt set held out for evaluation (by a hash of each prompt's text); with
        --continue-from, of the source's documents (by a hash of each document's text, as distill splits them).
    cache: static (transformers' StaticCache; compiled decode on a GPU) or dynamic.
    drop_unfinished: also drop answers cut off at max_new_tokens (default: keep them, they are counted).
    max_minutes: stop starting new batches after this many minutes from the command's start (0 = no limit).
    shard: K/N: answer only the prompts whose index i in the split has i % N == K, so N processes on N GPUs
        write disjoint files (samples then counts this shard's).
    opening_tokens: with --continue-from, the tokens of each training document's opening the teacher
        continues (documents not longer than that are skipped).
    """

    samples: int = 2000
    max_new_tokens: int = 256
    batch_size: int = 64
    temperature: float | None = None
    top_p: float | None = None
    seed: int = 0
    split: str = "train"
    held_out_percent: float = HELD_OUT_PERCENT
    cache: str = "static"
    drop_unfinished: bool = False
    max_minutes: float = 0.0
    shard: str = "0/1"
    opening_tokens: int = 32

    def __post_init__(self):
        if self.samples < 1 or self.max_new_tokens < 1 or self.batch_size < 1 or self.opening_tokens < 1:
            raise ValueError(f"samples, max_new_tokens, batch_size and opening_tokens must be >= 1, got {self.samples}, "
                             f"{self.max_new_tokens}, {self.batch_size}, {self.opening_tokens}")
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {self.split!r}")
        if self.cache not in ("static", "dynamic"):
            raise ValueError(f"cache must be static or dynamic, got {self.cache!r}")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 < self.held_out_percent < 100:
            raise ValueError(f"held_out_percent must be in (0, 100), got {self.held_out_percent}")
        self.shard_index()  # a bad shard fails here, before the model loads

    def shard_index(self) -> tuple[int, int]:
        """``shard`` "K/N" as (K, N)."""
        k, slash, n = self.shard.partition("/")
        try:
            k, n = int(k), int(n)
        except ValueError:
            k = n = -1
        if not slash or not 0 <= k < n:
            raise ValueError(f"shard must be K/N with 0 <= K < N, got {self.shard!r}; e.g. --shard 1/4 for the second of 4 GPUs")
        return k, n


# ---------------------------------------------------------------- answers worth keeping


def is_degenerate(answer: str) -> bool:
    """Empty, or stuck in a loop: a long answer that compresses far better than prose (zlib to under a
    quarter; English text stays near 0.4), or whose word 4-grams are mostly repeats."""
    text = answer.strip()
    if not text:
        return True
    if len(text) >= 200 and len(zlib.compress(text.encode())) < 0.25 * len(text.encode()):
        return True
    words = text.split()
    grams = [tuple(words[i:i + 4]) for i in range(len(words) - 3)]
    return len(grams) >= 20 and len(set(grams)) < 0.5 * len(grams)


# ---------------------------------------------------------------- resuming


@dataclass(frozen=True)
class Opening:
    """The first tokens of a training document, for the teacher to continue (``--continue-from``)."""

    ids: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class Repeated:
    """One opening ``n`` times, as a sequence: ``--unconditional``'s openings (every sample starts from the
    same start token), without a list of them; ``n`` large enough that only ``samples`` or the deadline stop."""

    item: Opening
    n: int = sys.maxsize

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Opening:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.item


def start_openings(model, tokenizer) -> Repeated:
    """``--unconditional``: the model's start token (its generation config's ``bos_token_id``, else the
    tokenizer's) as every sample's opening; the text that follows is the teacher's own."""
    start = model.generation_config.bos_token_id
    start = tokenizer.bos_token_id if start is None else start
    if isinstance(start, list):
        start = start[0]
    if start is None:
        raise UserError("--unconditional starts from the model's start token, and neither its generation config nor its "
                        "tokenizer names one (bos_token_id); use --continue-from SOURCE instead")
    return Repeated(Opening((int(start),), ""))


def _continues(items) -> bool:
    """Whether ``items`` are document openings to continue (``--continue-from``) rather than chat prompts."""
    return bool(items) and isinstance(items[0], Opening)


def _made_from(record: dict, item) -> bool:
    """Whether a written record came from this prompt (chat) or opening (text)."""
    if isinstance(item, Opening):  # a cut multi-byte character decodes differently once continued
        return record["text"].startswith(item.text.rstrip("\ufffd"))
    return record["messages"][0]["content"] == item.text


def resume_point(out: Path, prompts: list, shard: tuple[int, int] = (0, 1)) -> tuple[int, int]:
    """(samples already in ``out``, index of the next prompt or opening: one past the last record's). A
    trailing line cut off by a kill is removed first; a file made from another prompt set or source (its
    last record's prompt or opening differs) or by another ``shard`` (K, N) (its last id is not K mod N)
    is refused."""
    if not out.exists() or out.stat().st_size == 0:
        return 0, 0
    data = out.read_bytes()
    if not data.endswith(b"\n"):  # a partial last line: the batch that wrote it is redone
        data = data[: data.rfind(b"\n") + 1]
        with open(out, "r+b") as f:
            f.truncate(len(data))
    lines = data.decode("utf-8").splitlines()
    if not lines:
        return 0, 0
    text_mode = _continues(prompts)
    try:
        last = json.loads(lines[-1])
        i, prompt = int(last["id"]), (last["text"] if text_mode else last["messages"][0]["content"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise UserError(f"{out} exists but is not a generate-data file of this kind (its last line has no 'id' and "
                        f"{'text' if text_mode else 'messages'}); pass another --out") from None
    if i >= len(prompts) or not _made_from(last, prompts[i]):
        raise UserError(f"{out} was made from another prompt set, source or split (its record {i} starts "
                        f"{prompt!r:.60}); pass the same --continue-from, --split and --held-out-percent, or another --out")
    if i % shard[1] != shard[0]:
        raise UserError(f"{out} was made by another shard (its record {i} is not in --shard {shard[0]}/{shard[1]}); "
                        "pass the --shard that made it, or another --out")
    return len(lines), i + 1


# ---------------------------------------------------------------- generation


def sampling_kwargs(model, cfg: GenerateDataConfig) -> dict:
    """generate()'s sampling arguments: the flags, else the model's generation config when it samples."""
    gen = model.generation_config
    samples = bool(getattr(gen, "do_sample", False))
    temperature = cfg.temperature if cfg.temperature is not None else (gen.temperature if samples and gen.temperature else 0.7)
    top_p = cfg.top_p if cfg.top_p is not None else (gen.top_p if samples and gen.top_p else 0.9)
    if temperature == 0:
        return dict(do_sample=False)
    return dict(do_sample=True, temperature=temperature, top_p=top_p)


def document_openings(source: str, tokenizer, cfg: GenerateDataConfig) -> list[Opening]:
    """The openings (``cfg.opening_tokens`` tokens) of the training documents of ``source`` (a source or a
    mix, as ``--data`` takes it): the documents ``distill --data SOURCE`` trains on at the same
    ``held_out_percent``, never a held-out one, whose openings evaluation continues. In a fixed shuffled
    order, so that a run cut short by ``--max-minutes`` still covers every source of a mix."""
    import random

    from .data import load_documents, split_documents

    train, _ = split_documents(load_documents(source, tokenizer), cfg.held_out_percent, need_both=False)
    n = cfg.opening_tokens
    heads = tokenizer([d[: 16 * n] for d in train], add_special_tokens=False)["input_ids"]  # ~4 characters a token
    openings = [Opening(tuple(ids[:n]), tokenizer.decode(ids[:n])) for ids in heads if len(ids) > n]
    if not openings:
        raise UserError(f"no training document of {source!r} is longer than --opening-tokens {n}; pass a lower "
                        "--opening-tokens or more data")
    random.Random(0).shuffle(openings)
    return openings


def generate_chat_data(model, tokenizer, prompts: list, out: str | os.PathLike, cfg: GenerateDataConfig,
                       device=None, deadline: float | None = None) -> dict:
    """Answer ``prompts`` (those of ``cfg.shard``) in order until ``out`` holds ``cfg.samples`` kept samples
    (or the prompts or the ``deadline``, a ``time.time()`` value, run out); or, when they are ``Opening``s,
    continue each. Appends one batch at a time (one write, flushed and synced), so a kill loses at most the
    batch in flight. A record's ``id`` is its prompt's index in ``prompts``, whatever the shard. Returns
    counts and the decode speed."""
    import torch
    from tqdm.auto import tqdm

    text_mode = _continues(prompts)
    if not text_mode and not getattr(tokenizer, "chat_template", None):
        raise UserError("the tokenizer has no chat template: generate-data answers chat prompts as an instruct "
                        "model does; pick an instruct model (or save a chat template with its tokenizer), or pass "
                        "--continue-from SOURCE for continuations of its documents")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    k, n = cfg.shard_index()
    kept, start = resume_point(out, prompts, (k, n))
    order = range(k, len(prompts), n)  # the shard's prompt indices
    device = device or next(model.parameters()).device
    tokenizer.padding_side = "left"  # generate() continues every row from the same last column
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    kwargs = dict(max_new_tokens=cfg.max_new_tokens, pad_token_id=pad_id, **sampling_kwargs(model, cfg))
    if cfg.cache == "static":
        kwargs["cache_implementation"] = "static"
    stats = dict(resumed_from=kept, kept=kept, dropped=0, unfinished=0, prompts_used=0, new_tokens=0,
                 generate_s=0.0, stopped="samples")
    bar = tqdm(total=cfg.samples, initial=kept, desc="generate-data", unit="sample")
    pos = len(range(k, start, n))  # position in ``order`` of the first index >= start
    with open(out, "a", encoding="utf-8") as f:
        while stats["kept"] < cfg.samples:
            if pos >= len(order):
                stats["stopped"] = "prompts"
                break
            if deadline is not None and time.time() >= deadline:
                stats["stopped"] = "max_minutes"
                break
            index = order[pos:pos + cfg.batch_size]
            i = index[0]
            batch = [prompts[j] for j in index]
            n_real = len(batch)
            batch += batch[-1:] * (cfg.batch_size - n_real)  # a last short batch keeps the shapes compiled
            if text_mode:  # every opening has the same length: no padding
                ids = torch.tensor([p.ids for p in batch], device=device)
                enc = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
            else:
                texts = tokenizer.apply_chat_template([[{"role": "user", "content": p.text}] for p in batch],
                                                      add_generation_prompt=True, tokenize=False)
                enc = tokenizer(texts, return_tensors="pt", padding=True, pad_to_multiple_of=32,
                                add_special_tokens=False).to(device)
            torch.manual_seed(cfg.seed + i)
            t0 = time.time()
            with torch.no_grad():
                ids = model.generate(**enc, **kwargs)
            if device is not None and str(device).startswith("cuda"):
                torch.cuda.synchronize()
            stats["generate_s"] += time.time() - t0
            new = ids[:n_real, enc["input_ids"].shape[1]:].tolist()
            lines = []
            for j, p, toks in zip(index, batch, new):
                ends = [k for k, t in enumerate(toks) if t in eos]
                finished = bool(ends)
                toks = toks[: ends[0]] if ends else toks  # rows pad only after their end token
                stats["new_tokens"] += len(toks) + finished
                answer = tokenizer.decode(toks, skip_special_tokens=True).strip()
                if is_degenerate(answer) or (cfg.drop_unfinished and not finished):
                    stats["dropped"] += 1
                    continue
                stats["unfinished"] += not finished
                if text_mode:  # the opening and its continuation decoded as one text
                    record = {"text": tokenizer.decode([*p.ids, *toks], skip_special_tokens=True), "id": j,
                              "finished": finished}
                else:
                    record = {"messages": [{"role": "user", "content": p.text}, {"role": "assistant", "content": answer}],
                              "id": j, "task": p.task, "domain": p.domain, "finished": finished}
                lines.append(json.dumps(record, ensure_ascii=False) + "\n")
                if stats["kept"] + len(lines) >= cfg.samples:
                    break
            f.write("".join(lines))  # the whole batch in one write, then on disk before the next
            f.flush()
            os.fsync(f.fileno())
            stats["kept"] += len(lines)
            stats["prompts_used"] += n_real
            pos += n_real
            bar.update(len(lines))
            bar.set_postfix(dropped=stats["dropped"], tok_s=f"{stats['new_tokens'] / max(stats['generate_s'], 1e-9):.0f}")
    bar.close()
    stats["tokens_per_s"] = stats["new_tokens"] / max(stats["generate_s"], 1e-9)
    stats["samples_per_s"] = (stats["prompts_used"]) / max(stats["generate_s"], 1e-9)
    return stats


def write_prompts(path: str | os.PathLike, prompts: list[Prompt]) -> int:
    """The prompts as JSONL records ``{"prompt", "id", "task", "topic", "domain"}`` (written atomically)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"prompt": p.text, "id": i, "task": p.task, "topic": p.topic, "domain": p.domain},
                               ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return len(prompts)


# ---------------------------------------------------------------- command


def select_prompts(cfg: GenerateDataConfig, prompts_from: str | None = None, tokenizer=None) -> list[Prompt]:
    """The split's prompts; ``prompts_from`` (a local corpus) adds questions about its headings after them."""
    from .prompts import is_held_out_prompt

    prompts = build_prompts(cfg.split, cfg.held_out_percent)
    if prompts_from:
        extra = heading_prompts(prompts_from, tokenizer)
        if cfg.split != "all":
            extra = [p for p in extra if is_held_out_prompt(p.text, cfg.held_out_percent) == (cfg.split == "held_out")]
        prompts += extra
    return prompts


def cmd_generate_data(args) -> None:
    started = getattr(args, "started", None) or time.time()
    cfg = dataclass_from_args(GenerateDataConfig, args)
    if args.write_prompts:
        n = write_prompts(args.write_prompts, select_prompts(cfg, args.prompts_from))
        print(f"wrote {n} {cfg.split} prompts -> {args.write_prompts}")
        return
    if not args.out:
        raise UserError("pass --out FILE.jsonl (the chat samples), or --write-prompts FILE.jsonl for the prompts alone")
    if args.continue_from and args.unconditional:
        raise UserError("--continue-from continues documents' openings, --unconditional starts from nothing: pass one")
    if (args.continue_from or args.unconditional) and (args.prompts_from or cfg.split != "train"):
        flag = "--continue-from" if args.continue_from else "--unconditional"
        raise UserError(f"{flag} writes text, not answers to prompts: leave out --prompts-from and --split")
    model, tokenizer = load_model_and_tokenizer(args.model, args.dtype, args.attn_implementation)
    device = "cuda" if torch_cuda() else "cpu"
    model.to(device)
    if args.continue_from:
        prompts = document_openings(args.continue_from, tokenizer, cfg)
    elif args.unconditional:
        prompts = start_openings(model, tokenizer)
    else:
        prompts = select_prompts(cfg, args.prompts_from, tokenizer)
    deadline = started + 60 * cfg.max_minutes if cfg.max_minutes else None
    s = generate_chat_data(model, tokenizer, prompts, args.out, cfg, device=device, deadline=deadline)
    resumed = f" (resumed with {s['resumed_from']})" if s["resumed_from"] else ""
    k, n = cfg.shard_index()
    of = f" (shard {k}/{n}: {len(range(k, len(prompts), n))} of them)" if n > 1 else ""
    what = (f"training documents' openings of {args.continue_from}" if args.continue_from else f"{cfg.split} prompts")
    why = {"samples": "", "prompts": f"; the {len(prompts)} {what}{of} ran out",
           "max_minutes": f"; stopped by --max-minutes {cfg.max_minutes:g}"}[s["stopped"]]
    kind = "continuations" if args.continue_from else "unconditional samples" if args.unconditional else "chat samples"
    print(f"{s['kept']} {kind} in {args.out}{resumed}{why}: {s['prompts_used']} prompts answered, "
          f"{s['dropped']} dropped (empty or repetitive), {s['unfinished']} kept unfinished at "
          f"--max-new-tokens {cfg.max_new_tokens}; {s['new_tokens']} tokens at {s['tokens_per_s']:.0f} tokens/s "
          f"({s['samples_per_s']:.2f} samples/s) on {device}")
    if s["kept"] < cfg.samples and s["stopped"] == "prompts" and not args.continue_from:
        print(f"note: asked for {cfg.samples}; add prompts with --prompts-from", file=sys.stderr)


def register(sub, fmt) -> None:
    """Add ``generate-data`` to the command line's subparsers."""
    g = sub.add_parser("generate-data", help="teacher-answered chat samples or teacher-continued text (JSONL) "
                                             "to mix into distill --data",
                       epilog=EPILOG, formatter_class=fmt)
    g.add_argument("model", nargs="?", default=None,
                   help="the teacher: hub id, local folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--out", default=None, help="JSONL file of chat samples; an existing one is continued")
    g.add_argument("--write-prompts", default=None, metavar="FILE.jsonl",
                   help="write the --split prompts ({'prompt': ...} records) and stop; loads no model")
    g.add_argument("--prompts-from", default=None, metavar="SOURCE",
                   help="also ask about the section headings of this local corpus (a folder, .txt, .jsonl)")
    g.add_argument("--continue-from", default=None, metavar="SOURCE",
                   help="instead of chat: continue the openings (--opening-tokens) of this source's or mix's "
                        "training documents, records {'text', 'id'}; no chat template needed")
    g.add_argument("--unconditional", action="store_true",
                   help="instead of chat: text the teacher writes from its start token alone (its own distribution), "
                        "records {'text', 'id'}; sample it (--temperature 1)")
    g.add_argument("--dtype", default=None, help="load dtype, e.g. bfloat16 on a GPU (default: the checkpoint's)")
    _add_attn_implementation(g)
    add_dataclass_args(g, GenerateDataConfig, title="generation (GenerateDataConfig)")
    g.set_defaults(func=cmd_generate_data)
