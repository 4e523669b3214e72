"""Evaluation beside the teacher: perplexity, next-token top-1 agreement, greedy-generation
agreement on held-out prompts, and passkey retrieval at several context lengths.

Perplexity alone hides failures of converted models (a hybrid close in likelihood can still fail
to generate or retrieve), so every figure is reported for the student and the teacher together.
"""

from __future__ import annotations

import math
import random
import time

import torch
import torch.nn.functional as F

from .data import pack, tokenize
from linearize.hub import format_table  # noqa: F401  (the CLI prints what the model card shows)


@torch.no_grad()
def likelihood_metrics(model, teacher, tokenizer, docs, seq_len=512, max_rows=64, device="cpu",
                       deadline: float | None = None) -> dict:
    """``deadline`` (``time.time()`` seconds): no row starts after it (the first always runs)."""
    ids, pos = pack(tokenize(docs, tokenizer), seq_len, tokenizer.eos_token_id)
    ids, pos = ids[:max_rows], pos[:max_rows]
    nll = {"student": 0.0, "teacher": 0.0}
    agree = total = 0
    cut = False
    for i in range(ids.shape[0]):
        if i and _past(deadline):
            cut = True
            break
        x, p = ids[i : i + 1].to(device), pos[i : i + 1].to(device)
        s = model(input_ids=x, position_ids=p, use_cache=False).logits[0, :-1].float()
        target = x[0, 1:]
        nll["student"] += F.cross_entropy(s, target, reduction="sum").item()
        if teacher is not None:
            t = teacher(input_ids=x, position_ids=p, use_cache=False).logits[0, :-1].float()
            nll["teacher"] += F.cross_entropy(t, target, reduction="sum").item()
            agree += (t.argmax(-1) == s.argmax(-1)).sum().item()
        total += target.numel()
    out = {"tokens": total, "perplexity": math.exp(nll["student"] / total)}
    if cut:
        out["cut_by_deadline"] = ["likelihood rows"]
    if teacher is not None:
        out["teacher_perplexity"] = math.exp(nll["teacher"] / total)
        out["top1_agreement"] = agree / total
    return out


@torch.no_grad()
def generation_agreement(model, teacher, tokenizer, docs, n_prompts=16, prompt_tokens=48, new_tokens=32, device="cpu",
                         deadline: float | None = None) -> dict:
    """Greedy continuations of held-out document openings: the share of the teacher's tokens the
    student reproduces before the first divergence, and the share of exact matches. ``deadline``:
    no prompt starts after it (the first always runs)."""
    prefix_shares, exact = [], 0
    prompts = [t[:prompt_tokens] for t in tokenize(docs, tokenizer) if len(t) >= prompt_tokens][:n_prompts]
    if not prompts:
        raise ValueError(f"no held-out document has {prompt_tokens} tokens for a generation prompt")
    kw = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    done = 0
    for p in prompts:
        if done and _past(deadline):
            break
        done += 1
        x = torch.tensor([p], device=device)
        a = teacher.generate(x, attention_mask=torch.ones_like(x), **kw)[0, len(p):].tolist()
        b = model.generate(x, attention_mask=torch.ones_like(x), **kw)[0, len(p):].tolist()
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        prefix_shares.append(n / max(len(a), 1))
        exact += a == b
    return {"generation_prefix_agreement": sum(prefix_shares) / len(prefix_shares),
            "generation_exact_match": exact / done, "generation_prompts": done}


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
                     deadline: float | None = None) -> dict:
    """``deadline``: no trial starts after it; a length reached with none left is left out."""
    out = {}
    for L in lengths:
        rng = random.Random(seed * 1000 + L)
        hits = done = 0
        for _ in range(trials):
            if _past(deadline):
                break
            done += 1
            ids, key = passkey_prompt(tokenizer, L, rng)
            x = torch.tensor([ids], device=device)
            gen = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
            hits += key in tokenizer.decode(gen[0, len(ids):], skip_special_tokens=True)
        if done:
            out[str(L)] = hits / done
    return out


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.time() >= deadline


def evaluate_all(model, teacher, tokenizer, docs, seq_len=512, max_rows=64, n_prompts=16,
                 passkey_lengths=(512, 1024), passkey_trials=5, device="cpu", deadline: float | None = None) -> dict:
    """Every figure beside the teacher's. ``deadline`` (``time.time()`` seconds, ``distill --max-minutes``):
    each part stops taking rows, prompts or trials once it is past (one of each always runs, the
    passkey as time allows), and ``result["cut_by_deadline"]`` names the parts it cut."""
    result = likelihood_metrics(model, teacher, tokenizer, docs, seq_len, max_rows, device, deadline)
    cut = result.pop("cut_by_deadline", [])
    if teacher is not None:
        result.update(generation_agreement(model, teacher, tokenizer, docs, n_prompts, device=device, deadline=deadline))
        if _past(deadline) and result["generation_prompts"] < n_prompts:
            cut.append("generation prompts")
    if passkey_lengths:
        result["passkey"] = passkey_accuracy(model, tokenizer, passkey_lengths, passkey_trials, device=device,
                                             deadline=deadline)
        if teacher is not None:
            result["teacher_passkey"] = passkey_accuracy(teacher, tokenizer, passkey_lengths, passkey_trials,
                                                         device=device, deadline=deadline)
        if _past(deadline):
            cut.append("passkey trials")
    if cut:
        result["cut_by_deadline"] = cut
    return result
