"""Distillation for encoders (BERT family): the same two stages as for decoders, on passages.

    linearize distill --preset linformer --out runs/minilm-linformer      # embedded all-MiniLM-L6-v2
    linearize distill ./my-sentence-model --preset linear --out DIR --finetune full

Stage 1 (attention transfer) trains only the new parameters (Linformer's E, F or the feature
maps): every converted layer runs its original softmax attention and the converted one on the same
inputs, the loss is the MSE between their outputs on the real tokens, and the softmax output flows
on. Stage 2 matches the teacher's last hidden states (MSE on the real tokens) and its pooled
sentence embeddings (MSE + ``cosine_weight`` * (1 - cosine), + ``similarity_weight`` * the MSE of the
in-batch similarity matrices), with LoRA on q/k/v(/o) (the teacher is
the same weights with the adapter off and the layers in softmax mode) or a full fine-tune against a
frozen copy.

The training text is split into passages (blank-line paragraphs) of the non-held-out documents;
the evaluation embeds held-out passages with the teacher (before conversion) and the student and
reports their mean cosine and the overlap of each query's top-10 neighbours.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from linearize.api import attention_mode, linearize
from linearize.encoder_io import pool, pooling_of, save_encoder

from .data import DataConfig, load_documents, split_documents
from .distill import DistillConfig, attach_lora, new_parameter_names, set_trainable, stage2_parameter_names
from .kd import as_teacher
from .train import TrainConfig, train_stage


def passages(docs: list[str], min_chars: int = 40) -> list[str]:
    """Blank-line paragraphs of ``docs`` with at least ``min_chars`` characters, whitespace folded."""
    out = []
    for doc in docs:
        for para in re.split(r"\n\s*\n", doc):
            para = " ".join(para.split())
            if len(para) >= min_chars:
                out.append(para)
    return out


def encode(texts: list[str], tokenizer, max_length: int) -> dict[str, torch.Tensor]:
    """input_ids and attention_mask (N, max_length), right-padded (batches are trimmed later)."""
    enc = tokenizer(texts, truncation=True, max_length=max_length, padding="max_length", return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def _trim(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop the columns that are padding in every row of the batch (rows are right-padded)."""
    n = int(batch["attention_mask"].sum(1).max())
    return batch["input_ids"][:, :n], batch["attention_mask"][:, :n]


def encoder_transfer_loss(model, batch) -> torch.Tensor:
    ids, mask = _trim(batch)
    with attention_mode(model, "transfer") as layers:
        model(input_ids=ids, attention_mask=mask)
        return torch.stack([m.transfer_loss for m in layers]).mean()


encoder_transfer_loss.shardable = False  # per-layer losses, like attention_transfer_loss


def similarity_mse(s_emb: torch.Tensor, t_emb: torch.Tensor) -> torch.Tensor:
    """MSE between the student's and the teacher's in-batch cosine-similarity matrices (B, B): zero
    when every pair of passages is as similar for the student as for the teacher, whatever the
    embeddings' own directions."""
    s, t = F.normalize(s_emb, dim=-1), F.normalize(t_emb, dim=-1)
    return (s @ s.T - t @ t.T).pow(2).mean()


def make_embedding_loss(cfg: DistillConfig, pooling: dict, teacher=None):
    """MSE(last hidden states, real tokens) + MSE(embeddings) + cosine_weight * (1 - cos(embeddings))
    + similarity_weight * MSE(in-batch similarity matrices).
    ``teacher``: a frozen model (full or attention fine-tune), or None for the student's own weights with the
    adapter and the conversion off."""

    def loss_fn(model, batch):
        ids, mask = _trim(batch)
        with torch.no_grad():
            if teacher is not None:
                t_hidden = teacher(input_ids=ids, attention_mask=mask).last_hidden_state
            else:
                with as_teacher(model):
                    t_hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
        s_hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
        real = mask.bool()
        hidden_mse = (s_hidden.float() - t_hidden.float()).pow(2).mean(-1)[real].mean()
        t_emb, s_emb = pool(t_hidden.float(), mask, pooling), pool(s_hidden.float(), mask, pooling)
        emb_mse = (s_emb - t_emb).pow(2).mean()
        cosine = F.cosine_similarity(s_emb, t_emb, dim=-1).mean()
        loss = hidden_mse + emb_mse + cfg.cosine_weight * (1 - cosine)
        if cfg.similarity_weight:
            loss = loss + cfg.similarity_weight * similarity_mse(s_emb, t_emb)
        return loss

    return loss_fn


@torch.no_grad()
def embed(model, rows: dict[str, torch.Tensor], pooling: dict, batch_size: int = 32) -> torch.Tensor:
    """(N, hidden) float32 sentence embeddings of encoded rows, on the model's device."""
    device = next(model.parameters()).device
    out = []
    for i in range(0, rows["input_ids"].shape[0], batch_size):
        ids, mask = _trim({k: v[i : i + batch_size].to(device) for k, v in rows.items()})
        out.append(pool(model(input_ids=ids, attention_mask=mask).last_hidden_state.float(), mask, pooling))
    return torch.cat(out)


def retrieval_set(held_docs: list[str], max_passages: int = 512) -> tuple[list[str], list[str]]:
    """(queries, corpus) from held-out documents: each document's first passage is a query, its
    other passages join the corpus (at most ``max_passages``, spread evenly over the documents)."""
    queries, corpus = [], []
    for doc in held_docs:
        ps = passages([doc])
        if len(ps) >= 2:
            queries.append(ps[0])
            corpus.extend(ps[1:])
    if len(queries) < 2 or len(corpus) < 20:
        raise ValueError(f"the held-out split gives {len(queries)} queries and {len(corpus)} passages: add data")
    step = max(1, len(corpus) // max_passages)
    return queries, corpus[::step][:max_passages]


def agreement(t_q, s_q, t_c, s_c, top: int = 10, long_q=None, long_c=None) -> dict:
    """Teacher vs student on a retrieval set: the mean cosine between their embeddings (queries and
    corpus together) and the mean overlap of each query's top-``top`` corpus neighbours. ``long_q``,
    ``long_c``: bool masks of the passages longer than a Linformer's k (the ones it projects; shorter
    ones attend exactly): their mean cosine and count are reported too."""
    cos = torch.cat([F.cosine_similarity(t_q, s_q, dim=-1), F.cosine_similarity(t_c, s_c, dim=-1)])
    top = min(top, t_c.shape[0])
    t_top = (F.normalize(t_q, dim=-1) @ F.normalize(t_c, dim=-1).T).topk(top, dim=-1).indices
    s_top = (F.normalize(s_q, dim=-1) @ F.normalize(s_c, dim=-1).T).topk(top, dim=-1).indices
    overlap = [len(set(a.tolist()) & set(b.tolist())) / top for a, b in zip(t_top, s_top)]
    out = {"cosine": cos.mean().item(), "cosine_min": cos.min().item(), f"top{top}_overlap": sum(overlap) / len(overlap),
           "queries": t_q.shape[0], "corpus": t_c.shape[0]}
    if long_q is not None:
        long = torch.cat([long_q, long_c]).to(cos.device)
        out["long_passages"] = int(long.sum())
        out["cosine_long"] = cos[long].mean().item() if bool(long.any()) else None
    return out


def distill_encoder(model, tokenizer, folder, cfg: DistillConfig, data_cfg: DataConfig, train_cfg: TrainConfig, out: Path,
                    resume: bool = False, evaluate: bool = True, max_passages: int = 0, log=print) -> dict:
    """Convert the encoder ``model`` (in place), distill it, merge, save it to ``out`` (a
    sentence-transformers folder when ``folder`` is one). Returns a summary; with ``evaluate``
    ``out/eval.json`` holds the teacher/student agreement on the held-out retrieval set."""
    cfg = cfg.for_encoder()  # the preset's encoder settings (linear: no decay, LoRA)
    if cfg.transfer_weight:
        raise ValueError("--transfer-weight is the decoders' stage 2 (an encoder's stage 2 compares embeddings): drop it")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    pooling = pooling_of(folder)
    docs = load_documents(data_cfg.data, tokenizer, data_cfg.max_documents)
    train_docs, held_docs = split_documents(docs, data_cfg.held_out_percent)
    train_texts = passages(train_docs)[: max_passages or None]
    rows = encode(train_texts, tokenizer, data_cfg.seq_len)
    log(f"data: {len(train_texts)} training passages of at most {data_cfg.seq_len} tokens, {len(held_docs)} held-out documents")
    (out / "held_out.json").write_text(json.dumps(held_docs))
    if evaluate:  # the teacher's embeddings, before the conversion touches the model
        queries, corpus = retrieval_set(held_docs)
        q_rows, c_rows = encode(queries, tokenizer, data_cfg.seq_len), encode(corpus, tokenizer, data_cfg.seq_len)
        t_q, t_c = embed(model, q_rows, pooling), embed(model, c_rows, pooling)
        method = cfg.method_config(encoder=True)
        k = method.k if getattr(method, "method", "") == "linformer" and method.exact_short else None
        longer = {} if k is None else {"long_q": q_rows["attention_mask"].sum(1) > k,
                                       "long_c": c_rows["attention_mask"].sum(1) > k}

    teacher = copy.deepcopy(model).eval() if cfg.finetune != "lora" and cfg.stage2_steps else None
    if teacher is not None:
        teacher.requires_grad_(False)
    linearize(model, cfg.method_config(encoder=True))
    summary = {"config": dataclasses.asdict(cfg), "data": dataclasses.asdict(data_cfg), "train": dataclasses.asdict(train_cfg),
               "pooling": pooling, "training_passages": len(train_texts)}
    if evaluate:
        summary["converted_before_training"] = agreement(t_q, embed(model, q_rows, pooling), t_c, embed(model, c_rows, pooling),
                                                         **longer)
        log(f"before training: {summary['converted_before_training']}")

    if cfg.stage1_steps:
        n = set_trainable(model, new_parameter_names(model))
        log(f"stage 1 (attention transfer): {n} trainable parameters")
        s1 = dataclasses.replace(train_cfg, steps=cfg.stage1_steps, lr=cfg.stage1_lr, gradient_checkpointing=False)
        summary["stage1"] = train_stage("stage1_attention_transfer", model, encoder_transfer_loss, rows, s1, out, resume)

    if cfg.stage2_steps:
        s2 = dataclasses.replace(train_cfg, steps=cfg.stage2_steps, lr=cfg.stage2_lr)
        if cfg.finetune == "lora":
            peft_model = attach_lora(model, cfg)
            n = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
            log(f"stage 2 (embeddings, LoRA r={cfg.resolved()['lora_rank']}): {n} trainable parameters")
            summary["stage2"] = train_stage("stage2_embeddings", peft_model, make_embedding_loss(cfg, pooling), rows, s2, out, resume)
            model = peft_model.merge_and_unload()
        else:
            n = set_trainable(model, stage2_parameter_names(model, cfg.finetune))
            log(f"stage 2 (embeddings, {cfg.finetune} fine-tune): {n} trainable parameters")
            summary["stage2"] = train_stage("stage2_embeddings", model, make_embedding_loss(cfg, pooling, teacher), rows, s2, out, resume)
    model.requires_grad_(False)
    model.eval()
    save_encoder_into(out, model, tokenizer, folder)
    if evaluate:
        result = agreement(t_q, embed(model, q_rows, pooling), t_c, embed(model, c_rows, pooling), **longer)
        summary["eval"] = result
        (out / "eval.json").write_text(json.dumps(result, indent=2))
        log(f"held-out agreement with the teacher: {result}")
    (out / "distill.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def save_encoder_into(out: Path, model, tokenizer, folder) -> None:
    """``save_encoder`` into the run folder without a reader ever seeing half of it: written to a
    temporary folder, then each entry moved with an atomic rename, ``config.json`` last."""
    tmp = Path(tempfile.mkdtemp(prefix=".model.tmp-", dir=out))
    try:
        save_encoder(tmp, model, tokenizer, folder)
        for entry in sorted(tmp.iterdir(), key=lambda p: p.name == "config.json"):
            if entry.is_dir() and (out / entry.name).exists():
                shutil.rmtree(out / entry.name)
            os.replace(entry, out / entry.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
