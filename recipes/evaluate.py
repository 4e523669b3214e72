"""Evaluation beside the teacher: perplexity, next-token top-1 agreement, greedy-generation
agreement on held-out prompts, the teacher's perplexity of the student's own text (fluency),
chat answers, out-of-domain corpora, a window-only ablation of window hybrids, and passkey
retrieval at several context lengths.

Perplexity alone hides failures of converted models (a hybrid close in likelihood can still fail
to generate or retrieve), so every figure is reported for the student and the teacher together.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .data import pack, tokenize
from linearize.gdn import GatedDeltaNet
from linearize.layers import LinearAttention
from linearize.hub import format_table, passkey_disagreements  # noqa: F401  (the CLI prints what the model card shows)


def recall_mask(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """(rows, T - 1) bool, one per next-token target: whether the target completes a bigram that already
    occurred earlier in its own document (a new document starts where the position id is 0).
    These are Zoology's associative-recall hits (Arora et al., 2023), where most of the gap between
    attention and efficient language models lay. Such a token is predictable by finding its earlier
    occurrence in the context, which a fixed-size state does imprecisely. Common bigrams fall in this
    class too, and a model knows those without looking back."""
    out = torch.zeros(ids.shape[0], ids.shape[1] - 1, dtype=torch.bool)
    for r, (row, prow) in enumerate(zip(ids.tolist(), pos.tolist())):
        seen: set[tuple[int, int]] = set()
        for t in range(1, len(row)):
            if prow[t] == 0:  # the target opens a document: nothing before it in its context
                seen = set()
                continue
            bigram = (row[t - 1], row[t])
            out[r, t - 1] = bigram in seen
            seen.add(bigram)
    return out


# where each band of document positions ends: a target token's position id (how many tokens of its own
# document precede it in its row, the context the model sees: `pack` restarts it where a row starts
# mid-document) falls in 0-63, 64-255, 256-1023, 1024-4095 or 4096+
POSITION_EDGES = (64, 256, 1024, 4096)


def position_bands(pos: torch.Tensor) -> dict[str, torch.Tensor]:
    """(rows, T - 1) bool per band of document positions (``POSITION_EDGES``), one per next-token target
    (the target's own position id), the empty bands left out. Perplexity by band shows where beside the
    teacher a converted model falls behind: a gap that widens with the position is context the state
    loses, one that stays level is the layers' fit to the text itself."""
    band = torch.bucketize(pos[:, 1:].contiguous(), torch.tensor(POSITION_EDGES, dtype=pos.dtype), right=True)
    lows, out = (0, *POSITION_EDGES), {}
    for b, lo in enumerate(lows):
        mask = band == b
        if mask.any():
            out[f"{lo}-{lows[b + 1] - 1}" if b + 1 < len(lows) else f"{lo}+"] = mask
    return out


def _split_figures(nll: dict, n: int, total: int) -> dict:
    """Perplexities of one token class (recall or other, a band of positions) from its summed NLLs."""
    out = {"tokens": n, "share": n / total, "perplexity": math.exp(nll["student"] / n)}
    if "teacher" in nll:
        out["teacher_perplexity"] = math.exp(nll["teacher"] / n)
        out["perplexity_ratio"] = out["perplexity"] / out["teacher_perplexity"]
    return out


@torch.no_grad()
def likelihood_metrics(model, teacher, tokenizer, docs, seq_len=512, max_rows=64, device="cpu",
                       deadline: float | None = None, window_only_ablation: bool = False) -> dict:
    """``deadline`` (``time.time()`` seconds): no row starts after it (the first always runs).
    ``window_only_ablation``: each row is scored once more with the window hybrids' linear branch
    zeroed (``window_only``), giving ``out["window_only"]`` on the same rows. The perplexity is also
    split by token class: ``out["recall"]`` and ``out["other"]`` (``recall_mask``), and
    ``out["by_position"][band]`` (``position_bands``)."""
    ids, pos = pack(tokenize(docs, tokenizer), seq_len, tokenizer.eos_token_id)
    ids, pos = ids[:max_rows], pos[:max_rows]
    recall = recall_mask(ids, pos)
    bands = position_bands(pos)
    classes = {"recall": recall, "other": ~recall, **bands}  # name -> (rows, T - 1) bool
    split = {k: {"student": 0.0} | ({"teacher": 0.0} if teacher is not None else {}) for k in classes}  # NLL sums
    counts = dict.fromkeys(classes, 0)
    nll = {"student": 0.0, "teacher": 0.0, "window_only": 0.0}
    agree = {"student": 0, "window_only": 0}
    total = 0
    cut = False
    for i in range(ids.shape[0]):
        if i and _past(deadline):
            cut = True
            break
        x, p = ids[i : i + 1].to(device), pos[i : i + 1].to(device)
        target = x[0, 1:]
        masks = {k: m[i].to(device) for k, m in classes.items()}
        t = None
        if teacher is not None:
            t = teacher(input_ids=x, position_ids=p, use_cache=False).logits[0, :-1].float()
            per_token = F.cross_entropy(t, target, reduction="none")
            nll["teacher"] += per_token.sum().item()
            for k, m in masks.items():
                split[k]["teacher"] += per_token[m].sum().item()
        for name in ("student", "window_only") if window_only_ablation else ("student",):
            with window_only(model) if name == "window_only" else contextlib.nullcontext():
                s = model(input_ids=x, position_ids=p, use_cache=False).logits[0, :-1].float()
            per_token = F.cross_entropy(s, target, reduction="none")
            nll[name] += per_token.sum().item()
            if name == "student":
                for k, m in masks.items():
                    split[k]["student"] += per_token[m].sum().item()
            if t is not None:
                agree[name] += (t.argmax(-1) == s.argmax(-1)).sum().item()
        for k, m in masks.items():
            counts[k] += int(m.sum())
        total += target.numel()
    out = {"tokens": total, "perplexity": math.exp(nll["student"] / total)}
    for kind in ("recall", "other"):  # recall: the bigram was seen earlier in the document (recall_mask)
        if counts[kind]:
            out[kind] = _split_figures(split[kind], counts[kind], total)
    out["by_position"] = {k: _split_figures(split[k], counts[k], total) for k in bands if counts[k]}
    if cut:
        out["cut_by_deadline"] = ["likelihood rows"]
    if teacher is not None:
        out["teacher_perplexity"] = math.exp(nll["teacher"] / total)
        out["top1_agreement"] = agree["student"] / total
    if window_only_ablation:
        out["window_only"] = {"perplexity": math.exp(nll["window_only"] / total)}
        if teacher is not None:
            out["window_only"]["top1_agreement"] = agree["window_only"] / total
    return out


def window_layers(model) -> list[nn.Module]:
    """The converted layers with a softmax window beside their recurrent part: the window hybrids
    (sliding softmax window + linear attention) and Gated DeltaNet layers given a window."""
    return [m for m in model.modules() if isinstance(m, (LinearAttention, GatedDeltaNet)) and m.window]


def _branch_weight(layer) -> tuple[nn.Parameter, float]:
    """The parameter that weighs a window layer's recurrent branch, and the value that zeroes it: the
    window hybrid mixes ``(window + gamma * linear) / (window_den + gamma * linear_den)`` with ``gamma =
    exp(window_log_gamma)`` (reference, Triton prefill and decode kernels alike): a finite -1e4 (``exp``
    is exactly 0 in every float dtype, no inf arithmetic in the kernels); Gated DeltaNet with a window
    adds ``window_gamma * gdn``: 0."""
    return (layer.window_log_gamma, -1e4) if isinstance(layer, LinearAttention) else (layer.window_gamma, 0.0)


@contextlib.contextmanager
def window_only(model):
    """Run every window layer with its linear (or Gated DeltaNet) branch's contribution zeroed: the
    softmax window alone, the ablation that shows what the recurrent part adds. The weight is set in
    place (CUDA graphs keep their pointers, ``_branch_weight``), and the learned values put back."""
    layers = window_layers(model)
    if not layers:
        raise ValueError("the model has no window layers (a linear-attention or gdn conversion with window > 0)")
    saved = [_branch_weight(m)[0].detach().clone() for m in layers]
    try:
        with torch.no_grad():
            for m in layers:
                param, off = _branch_weight(m)
                param.fill_(off)
        yield layers
    finally:
        with torch.no_grad():
            for m, g in zip(layers, saved):
                _branch_weight(m)[0].copy_(g)


def _teacher_nll(teacher, prompt: list[int], continuation: list[int], device) -> tuple[float, int]:
    """The teacher's summed negative log-likelihood (nats) of ``continuation`` after ``prompt``, and
    its token count."""
    if not continuation:
        return 0.0, 0
    x = torch.tensor([prompt + continuation], device=device)
    logits = teacher(input_ids=x, use_cache=False).logits[0, len(prompt) - 1 : -1].float()
    return F.cross_entropy(logits, x[0, len(prompt):], reduction="sum").item(), len(continuation)


# prompts per `generate` call: one prompt a call leaves a GPU idle between small decode steps, and the
# generation is, by estimate, most of the evaluation's time (`eval_seconds` measures it); each prompt's
# answer is the one it gets alone (tests/test_recipes.py)
GENERATE_BATCH = 16
GENERATE_TOKENS = 32768  # and at most this many prompt tokens a call (the passkey's long prompts)


def _batches(items: list, size: int, deadline: float | None, first_always: bool = True):
    """``items`` in batches of ``size``; none starts after ``deadline`` (the first does if ``first_always``)."""
    for i in range(0, len(items), size):
        if (i or not first_always) and _past(deadline):
            return
        yield items[i : i + size]


def _greedy(model, tokenizer, prompts: list[list[int]], new_tokens: int, device) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (token lists) in one left-padded ``generate`` call, each
    what the prompt alone gives: cut after its first end-of-sequence token (the batch pads a row
    that ended before the others). A tokenizer without pad and eos ids leaves the pad id to
    ``generate`` (the padding itself is masked)."""
    pad_id = tokenizer.pad_token_id or tokenizer.eos_token_id
    width = max(map(len, prompts))
    x = torch.full((len(prompts), width), 0 if pad_id is None else pad_id, dtype=torch.long)
    mask = torch.zeros_like(x)
    for i, p in enumerate(prompts):
        x[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    out = model.generate(x.to(device), attention_mask=mask.to(device), max_new_tokens=new_tokens, do_sample=False,
                         pad_token_id=pad_id)[:, width:].tolist()
    eos = model.generation_config.eos_token_id
    eos = set(eos) if isinstance(eos, (list, tuple)) else {eos}
    return [row[: next((n + 1 for n, t in enumerate(row) if t in eos), len(row))] for row in out]


def _greedy_pairs(model, teacher, tokenizer, prompts, new_tokens, device, deadline,
                  batch_size: int = GENERATE_BATCH) -> list[tuple]:
    """(prompt, teacher's, student's greedy continuation) per prompt (token lists), ``batch_size``
    prompts a ``generate`` call; no batch starts after ``deadline`` (the first always runs)."""
    pairs = []
    for batch in _batches(prompts, batch_size, deadline):
        a = _greedy(teacher, tokenizer, batch, new_tokens, device)
        b = _greedy(model, tokenizer, batch, new_tokens, device)
        pairs += zip(batch, a, b)
    return pairs


def _agreement_and_fluency(teacher, pairs, device, prefix: str) -> dict:
    """Greedy agreement (prefix share, exact match) and the teacher's perplexity of each side's
    continuations: of the student's (fluency) and of its own (the floor). ``{prefix}_prefix_agreement_se``
    is the prefix share's standard error over the prompts (None for one prompt), to read two runs'
    difference against."""
    shares, exact = [], 0
    nll = {"student": [0.0, 0], "teacher": [0.0, 0]}
    for p, a, b in pairs:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        shares.append(n / max(len(a), 1))
        exact += a == b
        for side, cont in (("teacher", a), ("student", b)):
            s, k = _teacher_nll(teacher, p, cont, device)
            nll[side][0] += s
            nll[side][1] += k
    ppl = {side: math.exp(s / k) if k else None for side, (s, k) in nll.items()}
    names = {"generation": "fluency", "chat": "chat"}
    n, mean = len(shares), sum(shares) / len(shares)
    se = math.sqrt(sum((s - mean) ** 2 for s in shares) / (n - 1) / n) if n > 1 else None
    return {f"{prefix}_prefix_agreement": mean, f"{prefix}_prefix_agreement_se": se,
            f"{prefix}_exact_match": exact / len(pairs), f"{prefix}_prompts": len(pairs),
            f"{names[prefix]}_teacher_ppl_of_student": ppl["student"],
            f"{names[prefix]}_teacher_ppl_of_teacher": ppl["teacher"]}


@torch.no_grad()
def generation_agreement(model, teacher, tokenizer, docs, n_prompts=16, prompt_tokens=48, new_tokens=32, device="cpu",
                         deadline: float | None = None, batch_size: int = GENERATE_BATCH) -> dict:
    """Greedy continuations of held-out document openings: the share of the teacher's tokens the
    student reproduces before the first divergence, the share of exact matches, and on the same
    continuations the teacher's perplexity of the student's (``fluency_teacher_ppl_of_student``)
    beside that of its own (``fluency_teacher_ppl_of_teacher``, the floor). ``deadline``: no batch of
    ``batch_size`` prompts starts after it (the first always runs)."""
    prompts = [t[:prompt_tokens] for t in tokenize(docs, tokenizer) if len(t) >= prompt_tokens][:n_prompts]
    if not prompts:
        raise ValueError(f"no held-out document has {prompt_tokens} tokens for a generation prompt")
    pairs = _greedy_pairs(model, teacher, tokenizer, prompts, new_tokens, device, deadline, batch_size)
    return _agreement_and_fluency(teacher, pairs, device, "generation")


def load_chat_prompts(path) -> list[list[dict]]:
    """The conversations of a ``.jsonl`` file, each ending on a user turn: records with ``prompt``
    (one user turn) or ``messages`` (a trailing assistant turn is dropped: the models answer it)."""
    from .data import _json_records, _read_text

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"chat prompts not found: {path} (pass a .jsonl file of {{'prompt': ...}} or {{'messages': [...]}} records)")
    convs = []
    for n, rec in enumerate(_json_records(path, _read_text(path)), 1):
        if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
            convs.append([{"role": "user", "content": rec["prompt"]}])
        elif isinstance(rec, dict) and isinstance(rec.get("messages"), list) and rec["messages"]:
            msgs = list(rec["messages"])
            if msgs[-1].get("role") == "assistant":
                msgs = msgs[:-1]
            if not msgs:
                raise ValueError(f"{path} record {n}: 'messages' holds only an assistant turn; give the user turn to answer")
            convs.append(msgs)
        else:
            raise ValueError(f"{path} record {n}: needs 'prompt' (a string) or 'messages' (a list of turns)")
    if not convs:
        raise ValueError(f"no chat prompts in {path}")
    return convs


@torch.no_grad()
def chat_answers(model, teacher, tokenizer, conversations, new_tokens=64, device="cpu",
                 deadline: float | None = None, batch_size: int = GENERATE_BATCH) -> tuple[dict, list[dict]]:
    """Greedy answers of student and teacher to each conversation through the tokenizer's chat
    template: agreement (``chat_prefix_agreement``, ``chat_exact_match``), the teacher's perplexity of
    the student's answers (``chat_teacher_ppl_of_student``) beside its own (``..._of_teacher``), and
    the answers side by side (``prompt``, ``teacher``, ``student`` texts). ``deadline``: no batch of
    ``batch_size`` conversations (left-padded) starts after it (the first always runs)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template: chat prompts need one (evaluate a chat model, "
                         "or leave out the chat prompts)")
    # the template writes the special tokens itself
    prompts = [tokenizer(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False),
                         add_special_tokens=False).input_ids for c in conversations]
    pairs = _greedy_pairs(model, teacher, tokenizer, prompts, new_tokens, device, deadline, batch_size)
    metrics = _agreement_and_fluency(teacher, pairs, device, "chat")
    text = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    answers = [{"prompt": c[-1]["content"] if len(c) == 1 else c, "teacher": text(a), "student": text(b)}
               for c, (_, a, b) in zip(conversations, pairs)]
    return metrics, answers


FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")


def passkey_prompt(tokenizer, context_tokens: int, rng: random.Random) -> tuple[list[int], str]:
    """A synthetic haystack of about ``context_tokens`` tokens with a 5-digit pass key at a random depth."""
    key = str(rng.randint(10000, 99999))
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    question = " What is the pass key? The pass key is"
    filler_ids = tokenizer(FILLER, add_special_tokens=False).input_ids
    budget = context_tokens - len(tokenizer(needle + question, add_special_tokens=False).input_ids)
    reps = max(1, budget // len(filler_ids))
    depth = rng.randint(0, reps)
    text = FILLER * depth + needle + FILLER * (reps - depth) + question
    return tokenizer(text, add_special_tokens=False).input_ids, key


@torch.no_grad()
def passkey_accuracy(model, tokenizer, lengths=(512, 1024), trials=5, seed=0, device="cpu",
                     deadline: float | None = None, counts: dict | None = None,
                     batch_size: int = GENERATE_BATCH, hits: dict | None = None) -> dict:
    """``deadline``: no batch of ``batch_size`` trials (left-padded; at most ``GENERATE_TOKENS`` prompt
    tokens) starts after it; a length reached with none left is left out. ``counts``: filled with
    the trials each length ran (fewer than ``trials`` once cut). ``hits``: filled with each length's
    trials in order, "1" retrieved and "0" not: the prompts depend only on ``seed``, the length and their
    index, so two models' strings compare trial by trial (``passkey_disagreements``), and the first N
    trials of a longer run are a shorter run's N."""
    out = {}
    for L in lengths:
        rng = random.Random(seed * 1000 + L)
        prompts = [passkey_prompt(tokenizer, L, rng) for _ in range(trials)]
        got = []
        size = max(1, min(batch_size, GENERATE_TOKENS // L))
        for batch in _batches(prompts, size, deadline, first_always=False):
            gen = _greedy(model, tokenizer, [ids for ids, _ in batch], 8, device)
            got += [key in tokenizer.decode(g, skip_special_tokens=True) for (_, key), g in zip(batch, gen)]
        if got:
            out[str(L)] = sum(got) / len(got)
            if counts is not None:
                counts[str(L)] = len(got)
            if hits is not None:
                hits[str(L)] = "".join("1" if h else "0" for h in got)
    return out


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.time() >= deadline


def evaluate_all(model, teacher, tokenizer, docs, seq_len=512, max_rows=64, n_prompts=16,
                 passkey_lengths=(512, 1024), passkey_trials=5, device="cpu", deadline: float | None = None,
                 corpora: dict[str, list[str]] | None = None, chat_prompts: list[list[dict]] | None = None,
                 chat_tokens: int = 64, window_only_ablation: bool | None = None,
                 generate_batch_size: int = GENERATE_BATCH, prompt_tokens: int = 48,
                 progress=None) -> dict:
    """Every figure beside the teacher's. ``deadline`` (``time.time()`` seconds, ``distill --max-minutes``):
    each part stops taking rows, batches of prompts or trials once it is past (the first of each
    always runs, the passkey as time allows), and ``result["cut_by_deadline"]`` names the parts it cut.

    ``corpora``: name -> documents (never trained on), each scored like ``docs`` (at most ``max_rows``
    rows) under ``result["corpora"][name]``. ``chat_prompts`` (``load_chat_prompts``): greedy answers
    of up to ``chat_tokens`` tokens, their figures at the top level and the answers in
    ``result["chat_answers"]``. ``window_only_ablation`` (None: whenever the model has window hybrid
    layers): ``result["window_only"]``, the held-out figures with the linear branch zeroed, and its passkey
    at ``passkey_lengths`` (run last: a deadline cuts it first).
    ``generate_batch_size``: prompts per ``generate`` call (left-padded; each prompt's answer is the one
    it gets alone). ``prompt_tokens``: the length of each held-out opening for greedy agreement (48:
    inside a 192-key window with its 32 answer tokens, so for window hybrids the figure measures the
    window; longer openings measure what lies beyond it). ``result["eval_seconds"]``: the seconds each
    part took. ``progress``: called with the figures so far after each part (``distill`` writes them to
    ``eval.partial.json``, so that a part that fails later loses only itself)."""
    if window_only_ablation is None:
        window_only_ablation = bool(window_layers(model))
    result: dict = {}
    clock = _Clock(result, progress)
    result.update(likelihood_metrics(model, teacher, tokenizer, docs, seq_len, max_rows, device, deadline,
                                     window_only_ablation=window_only_ablation))
    cut = result.pop("cut_by_deadline", [])
    clock.lap("likelihood")
    if corpora:
        result["corpora"] = {}
        for name, corpus_docs in corpora.items():
            r = likelihood_metrics(model, teacher, tokenizer, corpus_docs, seq_len, max_rows, device, deadline)
            cut += [f"corpus {name} rows"] if r.pop("cut_by_deadline", None) else []
            if "teacher_perplexity" in r:
                r["perplexity_ratio"] = r["perplexity"] / r["teacher_perplexity"]
            result["corpora"][name] = r
        clock.lap("corpora")
    if teacher is not None:
        result.update(generation_agreement(model, teacher, tokenizer, docs, n_prompts, prompt_tokens=prompt_tokens,
                                           device=device, deadline=deadline, batch_size=generate_batch_size))
        result["generation_prompt_tokens"] = prompt_tokens
        if _past(deadline) and result["generation_prompts"] < n_prompts:
            cut.append("generation prompts")
        clock.lap("generation")
        if chat_prompts:
            metrics, answers = chat_answers(model, teacher, tokenizer, chat_prompts, chat_tokens, device, deadline,
                                            generate_batch_size)
            result.update(metrics)
            result["chat_answers"] = answers
            if metrics["chat_prompts"] < len(chat_prompts):
                cut.append("chat prompts")
            clock.lap("chat")
    if passkey_lengths:
        result["passkey_trials"] = {}  # the trials behind each accuracy: fewer than asked once the deadline cut them
        result["passkey_hits"] = {}  # each trial, in order, so that runs and the teacher compare prompt by prompt
        result["passkey"] = passkey_accuracy(model, tokenizer, passkey_lengths, passkey_trials, device=device,
                                             deadline=deadline, counts=result["passkey_trials"],
                                             batch_size=generate_batch_size, hits=result["passkey_hits"])
        if teacher is not None:
            result["teacher_passkey_hits"] = {}
            result["teacher_passkey"] = passkey_accuracy(teacher, tokenizer, passkey_lengths, passkey_trials,
                                                         device=device, deadline=deadline, batch_size=generate_batch_size,
                                                         hits=result["teacher_passkey_hits"])
        if _past(deadline):
            cut.append("passkey trials")
        clock.lap("passkey")
        if window_only_ablation and "window_only" in result and not _past(deadline):
            # the same prompts with the linear branch zeroed: whether what lies past the window helps the
            # retrieval or drowns it (last, so that a deadline cuts it before the figures above)
            with window_only(model):
                wo = result["window_only"]["passkey_trials"] = {}
                wo_hits = result["window_only"]["passkey_hits"] = {}
                result["window_only"]["passkey"] = passkey_accuracy(
                    model, tokenizer, passkey_lengths, passkey_trials, device=device, deadline=deadline,
                    counts=wo, batch_size=generate_batch_size, hits=wo_hits)
            if _past(deadline):
                cut.append("window-only passkey trials")
            clock.lap("window_only_passkey")
    if cut:
        result["cut_by_deadline"] = cut
    result["eval_seconds"] = clock.laps  # where the evaluation's time went (a run's --budget-reserve)
    return result


class _Clock:
    """Seconds per part of the evaluation, each from the end of the one before; after each part,
    ``progress`` (if any) gets the figures so far with the parts done."""

    def __init__(self, result: dict | None = None, progress=None):
        self.laps, self.t = {}, time.time()
        self.result, self.progress = result, progress

    def lap(self, name: str) -> None:
        now = time.time()
        self.laps[name] = round(now - self.t, 1)
        self.t = now
        if self.progress is not None:
            self.progress({**self.result, "eval_seconds": dict(self.laps), "parts_done": list(self.laps)})


def corpus_name(source: str) -> str:
    """A corpus's name in ``result["corpora"]``: the folder or file stem (``stdlib-docs`` as is)."""
    stem = Path(source.rstrip("/")).name
    for suffix in (".gz", ".txt", ".jsonl", ".json", ".parquet"):
        stem = stem.removesuffix(suffix)
    return stem or source


def load_corpora(sources: str, tokenizer) -> dict[str, list[str]]:
    """``--eval-data``: comma-separated sources in ``--data``'s syntax, each whole (no held-out split:
    pass corpora the model never trained on), by ``corpus_name``."""
    from .data import load_documents

    corpora = {}
    for source in (s.strip() for s in sources.split(",") if s.strip()):
        name = corpus_name(source)
        corpora[name if name not in corpora else source] = load_documents(source, tokenizer)
    return corpora
