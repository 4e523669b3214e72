"""Distillation: stage 1 attention transfer, stage 2 end-to-end KD (LoRA or full fine-tune), merge.

    linearize distill --out runs/lolcats --preset lolcats            # embedded SmolLM2, stdlib-docs
    linearize distill MODEL --out DIR --data corpus.jsonl --stage2-steps 2000 --mixed-precision bf16

Stage 1 trains only the new parameters (feature maps, gates): every converted layer runs its
original softmax attention and its linear attention on the same inputs in the same forward pass
and the loss is the mean MSE between their outputs; the softmax output flows on, so all layers
train at once on the teacher's activations (LoLCATs). Stage 2 matches the teacher's next-token
distribution (KL, optionally plus cross-entropy). With LoRA the teacher is the same model with the
adapter off and the layers in softmax mode: no second copy of the weights.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import record_function

from linearize.api import attention_mode, linearize, restore_softmax, select_softmax_layers
from linearize.arch import get_arch, get_submodule
from linearize.config import (EncoderLinearAttentionConfig, GatedDeltaNetConfig, LinearAttentionConfig, LinformerConfig,
                              normalize_layers)

from .data import DataConfig, prepare_mix
from .kd import as_teacher, decoder_compiled, final_hidden_states, kd_loss_chunked, kd_loss_plain, logit_head, unwrap
from .train import TrainConfig, process_state, train_stage

# stage 2's trainable weights (DistillConfig.finetune)
FINETUNES = ("lora", "full", "attention")

# Every preset's stage steps are 300 and 700 unless it says otherwise (DistillConfig): the stages' shares of
# each measured run below, kept when --max-minutes scales them (10% instead of 30% moved no preset by more
# than a point: 2026-11-28g, -30g; 50% did no better on linear: -29f). Encoders take the steps of their
# measured recipe (scripts/encoder_quality.py)
ENCODER_STEPS = dict(stage1_steps=200, stage2_steps=2000)

PRESETS = {
    # LoLCATs: Hedgehog features + a 192-token softmax window with 4 attention sinks (each document's first
    # tokens), attention transfer, then a full fine-tune at lr 1e-4 (on the Linux docs: LoRA rank 8 at
    # window 64 +16.3% of perplexity, the full fine-tune +8.4%, at window 128 +4.6-5.1%, at 256 +2.0%,
    # with the sinks +1.4%; on the Bible +10.4%, +9.4%, +4.9%, +1.8%: docs/reports/quality.md,
    # 2026-11-28c/d/f and 2026-11-29). 192 keys, not 256: with the sinks in, the window alone (linear
    # branch zeroed) was only +6.1% worse at 256 keys; at 192 it is +11.1%, the branch carrying weight,
    # at +2.7% / +3.1% (2026-11-29c; at 128 +22.9%, but the Bible +6.3%)
    "lolcats": dict(method="linear_attention", feature_map="hedgehog", window=192, sinks=4, lora_rank=8,
                    finetune="full", stage2_lr=1e-4),
    # no softmax anywhere: pure linear attention with a learned, data-dependent decay gate per key channel,
    # step and head (GLA's form) through a rank-16 projection, full fine-tune at lr 3e-4 (on the Linux docs
    # +13.1% of perplexity, the Bible +34.7%, at 64.3M tokens; at the same tokens lr 2e-4 +15.9% / +36.7%,
    # lr 1e-4 +20.5% / +39.6%, and lr 1e-4 at 100M +15.6% / +36.0%; the scalar gate, one per head and step:
    # +20.0% / +51.4% at 100M; no gate +39.2% / +87.5%: docs/reports/quality.md, 2026-11-28d, -29i, -29l and
    # -30c). The rank goes with the preset's gate: another --decay drops it. Also the encoders' preset:
    # "encoder" holds what differs for them (non-causal, so no decay; LoRA at lr 1e-3; ENCODER_STEPS)
    "linear": dict(method="linear_attention", feature_map="hedgehog", window=0, lora_rank=8, decay="channel",
                   gate_rank=16, finetune="full", stage2_lr=3e-4,
                   encoder=dict(decay="none", gate_rank=0, finetune="lora", stage2_lr=1e-3, **ENCODER_STEPS)),
    # Gated DeltaNet in every converted layer; full fine-tune at lr 3e-4 (on the Linux docs +9.3% of
    # perplexity against +15.4% at 1e-4, the Bible +25.9% against +30.0%: docs/reports/quality.md, 2026-11-28g)
    "gdn": dict(method="gdn", feature_map="hedgehog", window=0, lora_rank=8, finetune="full", stage2_lr=3e-4),
    # Gated DeltaNet, a quarter of the layers kept softmax (those whose conversion costs most, measured on
    # two of the long rows: select_long), full fine-tune in stage 2, its last quarter on 8K-token rows
    # (passkey at 4K / 8K: 55 / 20% without, 100 / 85% with; docs/reports/quality.md). The KL on 2,048
    # tokens of the 1K rows kept [0, 8, 17, 18, 20, 23, 24] on SmolLM2, 75% at 8K in both 60-trial runs
    # (-30h); on the long rows [7, 8, ...], 88% (-30i), beside 92% for layer 10 in place of 8
    # Since 2026-12-07a a softmax window of lolcats' 192 keys and 4 sinks beside every Gated DeltaNet layer (the layer
    # starts as the window alone, the state weighed in from 0), and the 8K-row quarter on the conversion's weights at
    # lr 1e-3 (lolcats-hybrid's): on SmolLM2 the Linux docs +0.1%, the Bible +0.8%, top-1 93.6%, greedy agreement
    # 0.64, passkey 95 / 98 / 100 / 95% at 1K / 2K / 4K / 8K (the teacher's own), 90M tokens, keeping [3, 7, 8, 17, 18,
    # 20, 23]; again (-07b, 98M tokens, the same layers) -0.2% / -0.4%, greedy 0.62, 93 / 98 / 100 / 87%; a third
    # time (-07c, 69M tokens, 120 trials) 0.0% / -0.4%, greedy 0.65, 94 / 98 / 100 / 96% (the teacher 96 / 98 / 100 /
    # 97%): over the three 93% at 8K, 94% at 1K (the teacher 96%, 95%). With its 8K stage on every weight 0.51 and 92%
    # at 8K. Without the window (three runs, -30i to -06l) -0.9% / +8.7%, greedy 0.16-0.29, 8K 89%. "qwen3_5": the
    # exportable layout's recipe, which has no window (the Qwen3.5 layer holds none), with its 8K stage on every weight
    # as measured (-30i)
    "gdn-hybrid": dict(method="gdn", feature_map="hedgehog", window=192, sinks=4, lora_rank=8, softmax_layers="auto:25%",
                       finetune="full", stage2_lr=1e-4, long_seq_len=8192, select_long=True, long_finetune="new",
                       long_lr=1e-3, qwen3_5=dict(window=0, sinks=0, long_finetune="same", long_lr=None)),
    # lolcats' layers (hedgehog + the 192-key window + 4 sinks) with a quarter of the layers kept softmax, chosen by
    # KL after stage 1 on 2,048 tokens of the training rows, and gdn-hybrid's last quarter of stage 2 on 8K rows,
    # training there only the conversion's own weights at lr 1e-3 (long_finetune "new"): on SmolLM2 the Linux docs
    # +0.1%, the Bible +1.0%, top-1 94.4%, greedy agreement 0.72, passkey 93 / 97 / 98 / 48% at 1K-8K (the teacher
    # 95 / 98 / 100 / 95%), 100M tokens, keeping [7, 8, 17, 18, 20, 23, 24] (2026-12-06b; at 79M, -06a, 8K 68%). The
    # stage on every weight (until -06a): -1.7% / -0.4%, 8K 92%, but greedy 0.39; without the stage greedy 0.73 and
    # 4K 7% (2026-12-01a/b).
    # The same choice on the 8K rows (gdn-hybrid's select_long) kept [1, 3, 7, 8, 10, 18, 23]: 15% at 4K (-30k)
    "lolcats-hybrid": dict(method="linear_attention", feature_map="hedgehog", window=192, sinks=4, lora_rank=8,
                           softmax_layers="auto:25%", finetune="full", stage2_lr=1e-4, long_seq_len=8192,
                           long_finetune="new", long_lr=1e-3),
    # the ablation baseline for window hybrids: softmax over lolcats' window (the newest 192 keys) plus 4 sink tokens, no
    # linear part and no new parameter (linearize/swa.py); stage 2 only, against a separate teacher,
    # with lolcats' stage 2 (a full fine-tune at lr 1e-4), so that the two differ by the layer alone
    "swa": dict(method="swa", feature_map="hedgehog", window=192, sinks=4, lora_rank=8, finetune="full",
                stage2_lr=1e-4),
    # encoders only: low-rank Linformer attention (the "linear" preset gives encoders non-causal
    # hedgehog linear attention); see recipes/encoder_distill.py
    "linformer": dict(method="linformer", feature_map="hedgehog", window=0, lora_rank=8, **ENCODER_STEPS),
}


@dataclass
class DistillConfig:
    """Args:
    preset: "lolcats" (hedgehog + window 192 + 4 sinks, transfer then a full fine-tune at lr 1e-4), "linear" (no
        softmax: hedgehog with a rank-16 decay gate per key channel, full fine-tune at lr 3e-4; encoders: no decay,
        LoRA), "gdn" (Gated DeltaNet; full fine-tune, stage 2 lr 3e-4), "gdn-hybrid" (Gated DeltaNet
        beside a 192-key softmax window with 4 sinks, 25% of the layers kept softmax, chosen by KL; full
        fine-tune, stage 2 lr 1e-4, its last quarter on 8192-token rows training only the conversion's
        weights, at lr 1e-3), "lolcats-hybrid" (lolcats' layers with 25% of the layers kept softmax, chosen
        by KL on the training rows, and gdn-hybrid's stage 2, its 8K-row quarter training only the conversion's
        weights, at lr 1e-3), "swa" (the baseline of window hybrids: softmax over a window plus
        ``sinks`` first tokens, no linear part; stage 2 only), or "none". Flags given explicitly
        override the preset's.
    feature_map: feature map (overrides the preset).
    feature_dim: size F of the feature space, the state's key dimension (default: the map's own,
        2 x head_dim for hedgehog; at most 256 on the Triton kernels). Feature-map layers only.
    window: softmax window (overrides the preset; 0 = none). With the gdn presets, a softmax window beside
        each Gated DeltaNet layer (``GatedDeltaNetConfig.window``: the layer starts as the window alone).
    sinks: a document's first tokens every query attends besides its window (attention sinks), for the
        window presets and a gdn preset given --window (overrides the preset's: 4 for swa and lolcats; 0
        turns them off).
    decay: the linear layers' decay gate: "none", "scalar" or "channel" (default: the preset's, else none).
    gate_rank: the decay gate's rank: 0 a full-width projection, r > 0 hidden -> r -> width (GLA's
        low-rank gate; 16 makes "channel"'s gate 1/23 the size on SmolLM2-135M). Needs a decay. Default:
        the preset's where its own decay gate is kept (16 for "linear"), else 0.
    output_gate: the feature-map layers' output gate: 0 (default) none, r > 0 a learned gate per output
        channel, 2 sigmoid(x W1 W2 + b) through rank r, starting at 1 (GLA's and Gated DeltaNet's).
    layers: layers to convert, e.g. "0-11" (default all).
    softmax_layers: keep these layers softmax ("3,7"), or "auto:K" to keep the K layers whose
        conversion raises the KL to the teacher most, measured after stage 1 ("auto:P%": P% of the
        converted layers, rounded down, at least one).
    select_long: with "auto" softmax_layers, measure each layer's KL on two of the long rows
        (``--long-seq-len`` tokens each, positions running across documents, as in stage 2's long-row
        stage and the passkey) instead of 2,048 tokens of the training rows. Default: the preset's
        (gdn-hybrid: on the long rows where the run has them, else on the training rows; lolcats-hybrid:
        on the training rows, where its choice keeps the layers that retrieve), else off;
        ``--no-select-long`` measures on the training rows. Whichever measure picks, a run with long
        rows records both in ``config.json`` (``softmax_selection``, the other one under "alternative").
    conv_size: width of the short causal convolution over q/k/v, starting as the identity (default:
        4 for Gated DeltaNet layers; for the feature-map layers the preset's, else 0 = none).
    kv_heads: Gated DeltaNet GQA handling, "expand" or "group" (gdn preset).
    use_rope: Gated DeltaNet layers apply the model's RoPE to q and k before the state (default: the
        layout's: on for "default", off for "qwen3_5", which holds none). ``--no-use-rope`` leaves
        position to the decay gate and the short convolution, as Mamba-style layers do, so that a key
        stored far back matches its query by content alone; a softmax window beside the state
        (gdn-hybrid) keeps RoPE either way.
    dt_min: Gated DeltaNet layers: the shortest initial time step of the decay (default 1e-3, with dt_max 1e-2:
        heads that start remembering about 1,000 down to 100 tokens; 1e-4 gives the slowest heads 10,000, for
        retrieval far back). The gdn presets only.
    layout: Gated DeltaNet layer form, "default" or "qwen3_5" (transformers' Qwen3.5 layer, kept softmax
        layers with its q/k norms: the result exports with `linearize export --format qwen3_5`). Qwen3.5's
        layer holds no softmax window: with "qwen3_5", gdn-hybrid runs its recipe without one (and its
        8K-row quarter on stage 2's weights, as measured for that form).
    stage1_steps: attention-transfer steps (0 skips stage 1). Default: the preset's, 300 for the
        decoder presets with stage2_steps 700, the stages' shares of every measured preset run
        (docs/reports/quality.md), which max_minutes scales to its budget; 200 and 2,000 for encoders.
    stage1_lr: stage 1 learning rate.
    stage2_steps: end-to-end steps (0 skips stage 2; default: the preset's, see stage1_steps).
    stage2_lr: stage 2 learning rate (default: the preset's, else 1e-3).
    finetune: stage 2's trainable weights (default: the preset's, else "lora"): "lora" (adapters on
        q/k/v/o), "full" (every weight), or "attention" (every weight of every layer's attention module:
        the converted layers' projections and new parameters, and kept softmax layers; the embeddings,
        MLPs and the norms between them stay the teacher's, as with LoRA, at full rank).
    lora_rank: LoRA rank on q/k/v/o (overrides the preset).
    train_feature_maps_in_stage2: keep training the new parameters in stage 2.
    kd_temperature: softmax temperature of the KL term.
    ce_weight: weight of next-token cross-entropy added to the KL (0 = pure distillation).
    transfer_weight: weight of an attention-transfer MSE kept in stage 2, added to its KD loss: each
        converted layer's output against the teacher's attention output at that layer, recorded in the
        teacher's pass of the same step (the layers' "record" and "joint" modes; 0 = KD alone).
        Decoders only, not with ``--fsdp``; each step's value goes to ``metrics.jsonl`` as "transfer"
        beside "kd".
    kd_chunk_size: tokens per chunk of the stage-2 loss, computed from the final hidden states so
        the whole (tokens x vocab) logits never exist (0 = the plain loss over whole logits).
    linformer_k: encoders, linformer preset: projection length k.
    linformer_max_length: encoders, linformer preset: longest input n (default: the model's
        max_position_embeddings).
    linformer_sharing: encoders, linformer preset: "head", "layer", "kv" or "model".
    linformer_exact_short: encoders, linformer preset: inputs of at most k tokens attend exactly
        (``LinformerConfig.exact_short``).
    cosine_weight: encoders: weight of (1 - cosine) between the teacher's and the student's
        sentence embeddings, added to the MSE of last hidden states and of the embeddings.
    similarity_weight: encoders: weight of the MSE between the teacher's and the student's in-batch
        cosine-similarity matrices of the sentence embeddings (how each passage ranks the others:
        what retrieval reads); 0 leaves it out.
    max_minutes: wall-clock budget of the whole run in minutes (0 = none): stage 1, stage 2, the
        save and the evaluation end within it. The step counts are then fitted to the rate each
        stage measures after its first (compiling) steps, in the ratio of stage1_steps to
        stage2_steps, and fix the LR schedule; a stage past its time stops early, and the run still
        saves and evaluates. The budget, the rates, the compile seconds and the recompiles go to
        distill.json.
    budget_reserve: with max_minutes, the share of the budget kept for the save and the
        evaluation (at least 10 s, 5% and 5 s without evaluation).
    max_tokens: with max_minutes, the most training tokens the fitted step counts may add up to, in
        the stages' shares (0 = no cap): a fast machine then ends early instead of training more.
    long_share: with ``--long-seq-len`` (the data's long rows), the share of stage 2's steps (of its
        time, under max_minutes) that ends it on those long rows, as a stage of its own
        ("stage3_long": the same loss, stage 2's trainable weights unless long_finetune says otherwise,
        the same tokens a step in fewer, longer rows, its own LR schedule), so that the student meets contexts of that length in training.
    long_finetune: the weights that long-row stage trains: "same" (stage 2's), "attention" (every
        layer's attention module, converted or kept softmax, as ``finetune="attention"``: the MLPs,
        norms and embeddings stay as stage 2 left them), "new" (only those the conversion added, as
        stage 1: feature maps, the window's weight of the linear part, gates) or "mlp" ("new" and
        every decoder layer's weights outside its attention module: the MLPs and the layers' norms;
        the teacher's attention projections, the embeddings and the final norm stay). "attention",
        "new" and "mlp" need a full or attention stage 2. With "new", a window hybrid computes any
        context inside its window exactly as stage 2 left it: the long rows teach the linear branch alone. Default:
        the preset's ("new" for lolcats-hybrid, unless stage 2 is LoRA), else "same".
    long_lr: the long-row stage's learning rate. Default: the preset's where its long_finetune is kept
        (1e-3 for lolcats-hybrid's "new"), else stage2_lr.
    long_teacher_lr: the long-row stage's learning rate for the teacher's own weights it trains (with
        long_finetune "same", "attention" or "mlp" after a full or attention stage 2), the conversion's
        weights staying at long_lr: e.g. 1e-3 for the feature maps and 1e-5 for the MLPs. Default: long_lr.
    """

    preset: str = "lolcats"
    feature_map: str | None = None
    feature_dim: int | None = None
    window: int | None = None
    sinks: int | None = None
    decay: str | None = None
    gate_rank: int | None = None
    output_gate: int = 0
    layers: str | None = None
    softmax_layers: str | None = None
    select_long: bool | None = None
    conv_size: int | None = None
    kv_heads: str = "expand"
    use_rope: bool | None = None
    dt_min: float | None = None
    layout: str = "default"
    stage1_steps: int | None = None
    stage1_lr: float = 1e-2
    stage2_steps: int | None = None
    stage2_lr: float | None = None
    finetune: str | None = None
    lora_rank: int | None = None
    train_feature_maps_in_stage2: bool = True
    kd_temperature: float = 1.0
    ce_weight: float = 0.0
    transfer_weight: float = 0.0
    kd_chunk_size: int = 1024
    linformer_k: int = 64
    linformer_max_length: int | None = None
    linformer_sharing: str = "layer"
    linformer_exact_short: bool = True
    cosine_weight: float = 1.0
    similarity_weight: float = 0.0
    max_minutes: float = 0.0
    budget_reserve: float = 0.15
    max_tokens: int = 0
    long_share: float = 0.25
    long_finetune: str | None = None
    long_lr: float | None = None
    long_teacher_lr: float | None = None

    def __post_init__(self):
        if self.preset not in (*PRESETS, "none"):
            raise ValueError(f"preset must be one of {[*PRESETS, 'none']}, got {self.preset!r}")
        # the recipe's own settings, where no flag set them (the record then shows what ran)
        preset = self._preset()
        self._from_preset = set()  # what for_encoder may change: the fields no argument set
        for key, default in (("softmax_layers", None), ("finetune", "lora"), ("stage2_lr", 1e-3), ("decay", None),
                             ("stage1_steps", 300), ("stage2_steps", 700)):
            if getattr(self, key) is None:
                setattr(self, key, preset.get(key, default))
                self._from_preset.add(key)
        if self.decay not in (None, "none", "scalar", "channel"):
            raise ValueError(f"decay must be 'none', 'scalar' or 'channel', got {self.decay!r}")
        if self.gate_rank is None:
            # the preset's rank factors the preset's gate: with another --decay the gate is full width
            self.gate_rank = preset.get("gate_rank", 0) if self.decay == preset.get("decay") else 0
            self._from_preset.add("gate_rank")
        if self.long_finetune is None:  # the preset's long-row weights belong to its full stage 2
            self.long_finetune = preset.get("long_finetune", "same") if self.finetune != "lora" else "same"
            self._from_preset.add("long_finetune")
        if self.long_lr is None and self.long_finetune == preset.get("long_finetune", "same"):
            self.long_lr = preset.get("long_lr")  # its rate goes with its choice of weights; None: stage2_lr
        if self.finetune not in FINETUNES:
            raise ValueError(f"finetune must be one of {FINETUNES}, got {self.finetune!r}")
        if self.stage1_steps < 0 or self.stage2_steps < 0:
            raise ValueError("stage steps must be >= 0")
        if self.cosine_weight < 0 or self.similarity_weight < 0:
            raise ValueError("cosine_weight and similarity_weight must be >= 0")
        if self.max_minutes < 0:
            raise ValueError(f"max_minutes must be >= 0 (0 = no budget), got {self.max_minutes}")
        if not 0 <= self.budget_reserve < 0.9:
            raise ValueError(f"budget_reserve is a share of the budget in [0, 0.9), got {self.budget_reserve}")
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0 (0 = no cap), got {self.max_tokens}")
        if not 0 < self.long_share < 1:
            raise ValueError(f"long_share is a share of stage 2 in (0, 1), got {self.long_share}")
        if self.long_finetune != "same" and self.long_finetune not in LONG_FINETUNE:
            others = ", ".join(f"'{k}' ({what})" for k, (what, _) in LONG_FINETUNE.items())
            raise ValueError(f"long_finetune must be 'same' (stage 2's weights), {others}, "
                             f"got {self.long_finetune!r}")
        if self.long_finetune != "same" and self.finetune == "lora":
            what = LONG_FINETUNE[self.long_finetune][0]
            raise ValueError(f"--long-finetune {self.long_finetune} trains {what} after a full stage 2: "
                             "add --finetune full (or attention), or drop --long-finetune")
        if self.long_lr is not None and self.long_lr <= 0:
            raise ValueError(f"long_lr must be > 0 (default: stage2_lr), got {self.long_lr}")
        if self.long_teacher_lr is not None:
            if self.long_teacher_lr <= 0:
                raise ValueError(f"long_teacher_lr must be > 0 (default: long_lr), got {self.long_teacher_lr}")
            if self.long_finetune == "new" or self.finetune == "lora":
                trains = "the conversion's weights alone" if self.finetune != "lora" else "LoRA adapters"
                raise ValueError(f"--long-teacher-lr sets the rate of the teacher's weights in the long-row stage, "
                                 f"which trains {trains} here: drop it, or use --long-finetune mlp, attention "
                                 "or same after a full stage 2")
        if self.transfer_weight < 0:
            raise ValueError(f"transfer_weight must be >= 0 (0 = KD alone), got {self.transfer_weight}")
        if self.transfer_weight and self.resolved()["method"] == "swa":
            raise ValueError("the swa baseline has no converted layer to transfer attention into: drop --transfer-weight")
        if self.kd_chunk_size < 0:
            raise ValueError(f"kd_chunk_size must be >= 0 (0 = the plain loss), got {self.kd_chunk_size}")
        self.method_config()  # validates feature map, window, decay, layers
        self.softmax_choice()
        if self.select_long and not (self.softmax_layers or "").startswith("auto:"):
            raise ValueError("--select-long is how auto softmax layers are chosen: use it with --softmax-layers auto:K "
                             "(or --preset gdn-hybrid)")

    def _preset(self) -> dict:
        """The preset's settings; with ``layout="qwen3_5"``, its "qwen3_5" entries replace the others (the
        exportable layer's own recipe: gdn-hybrid's without the softmax window, which Qwen3.5 does not hold)."""
        preset = dict(PRESETS.get(self.preset, {}))
        if self.layout == "qwen3_5":
            preset.update(preset.get("qwen3_5", {}))
        return preset

    def for_encoder(self) -> "DistillConfig":
        """The config for a bidirectional encoder: the preset's "encoder" settings (the "linear"
        preset's: no decay, LoRA at lr 1e-3) where no argument set the field."""
        changes = {k: v for k, v in PRESETS.get(self.preset, {}).get("encoder", {}).items() if k in self._from_preset}
        return dataclasses.replace(self, **changes) if changes else self

    @property
    def decay_gate(self) -> str | None:
        """The conversion's ``decay``: None for "none"."""
        return None if self.decay in (None, "none") else self.decay

    def resolved(self) -> dict:
        base = self._preset() if self.preset in PRESETS else dict(PRESETS["linear"])
        for key in ("feature_map", "window", "sinks", "lora_rank"):
            if getattr(self, key) is not None:
                base[key] = getattr(self, key)
        if self.window == 0 and self.sinks is None:
            base["sinks"] = 0  # the preset's sinks belong to its window: --window 0 drops both
        return base

    def method_config(self, encoder: bool = False):
        """The conversion config; ``encoder``: for a bidirectional encoder (linformer, or the
        "linear" preset as non-causal feature-map linear attention)."""
        r = self.resolved()
        # the feature-map layers' own flags that are set (swa and encoders refuse them below, with their own messages)
        own = [flag for flag, on in (("--decay", self.decay_gate), ("--gate-rank", self.gate_rank),
                                     ("--output-gate", self.output_gate)) if on]
        wrong = ("--feature-dim" if self.feature_dim is not None and r["method"] != "linear_attention" else
                 own[0] if own and r["method"] in ("gdn", "linformer") else None)
        if wrong:
            raise ValueError(f"{wrong} is for the feature-map layers of the lolcats and linear presets; --preset "
                             f"{self.preset} has {r['method']} layers: drop {wrong}")
        if self.feature_dim is not None and self.feature_dim > 256:
            raise ValueError(f"--feature-dim must be in [1, 256] (the Triton kernels' widest feature space), "
                             f"got {self.feature_dim}")
        if self.conv_size is not None and (r["method"] in ("swa", "linformer") or encoder):
            raise ValueError(f"--conv-size is for decoders' gdn and feature-map layers; --preset {self.preset}"
                             f"{' on an encoder' if encoder else ''} has none: drop --conv-size")
        if self.use_rope is not None and (r["method"] != "gdn" or encoder):
            raise ValueError(f"--use-rope / --no-use-rope is for the Gated DeltaNet layers of the gdn presets; "
                             f"--preset {self.preset}{' on an encoder' if encoder else ''} has none: drop it")
        if self.dt_min is not None and (r["method"] != "gdn" or encoder):
            raise ValueError(f"--dt-min is for the Gated DeltaNet layers of the gdn presets; --preset {self.preset}"
                             f"{' on an encoder' if encoder else ''} has none: drop it")
        if r["method"] == "swa":
            if encoder or self.layers or self.softmax_layers or own:
                raise ValueError("--preset swa is a baseline for decoders: every layer, no --layers, "
                                 "--softmax-layers, --decay, --gate-rank or --output-gate")
            if r["window"] < 1 or r["sinks"] < 0:
                raise ValueError(f"--preset swa needs --window >= 1 and --sinks >= 0, got {r['window']}, {r['sinks']}")
            return None  # no conversion: linearize/swa.py changes the attention function
        if r.get("sinks") and (r["method"] not in ("linear_attention", "gdn") or encoder) and self.sinks is not None:
            raise ValueError(f"--sinks is for the window presets of decoders (lolcats, swa) and a gdn preset given "
                             f"--window, not {self.preset!r}")
        if r["method"] == "linformer" or encoder:
            if r["method"] == "linformer":
                return LinformerConfig(k=self.linformer_k, max_length=self.linformer_max_length,
                                       sharing=self.linformer_sharing, layers=self.layers,
                                       exact_short=self.linformer_exact_short)
            if r["method"] != "linear_attention" or r["window"] or own:
                raise ValueError("encoders take --preset linformer or --preset linear (no window, no decay, "
                                 "no --gate-rank, no --output-gate)")
            return EncoderLinearAttentionConfig(feature_map=r["feature_map"], feature_dim=self.feature_dim,
                                                layers=self.layers)
        if r["method"] == "gdn":
            if r.get("sinks") and not r["window"]:
                raise ValueError("--sinks join a softmax window: give the gdn preset --window W with them, or drop --sinks")
            return GatedDeltaNetConfig(layers=self.layers, conv_size=self.conv_size, kv_heads=self.kv_heads,
                                       use_rope=self.use_rope, layout=self.layout, window=r["window"],
                                       sinks=r.get("sinks") or 0,
                                       **({} if self.dt_min is None else {"dt_min": self.dt_min}))
        if self.layout != "default":
            raise ValueError(f"layout {self.layout!r} is a Gated DeltaNet form: use it with a gdn preset")
        return LinearAttentionConfig(feature_map=r["feature_map"], feature_dim=self.feature_dim, window=r["window"],
                                     sinks=r.get("sinks") or 0, decay=self.decay_gate, gate_rank=self.gate_rank,
                                     output_gate=self.output_gate,
                                     conv_size=r.get("conv_size", 0) if self.conv_size is None else self.conv_size,
                                     layers=self.layers)

    def softmax_choice(self, n_layers: int | None = None) -> tuple[int | None, list[int] | None]:
        """(K of "auto:K", explicit list): at most one is set. "auto:P%" needs ``n_layers``, the
        number of converted layers (without it, only checked)."""
        if not self.softmax_layers:
            return None, None
        if self.softmax_layers.startswith("auto:"):
            k = self.softmax_layers.split(":", 1)[1]
            try:
                share = float(k[:-1]) / 100 if k.endswith("%") else None
                count = None if share is not None else int(k)
            except ValueError:
                raise ValueError(f"softmax_layers {self.softmax_layers!r}: use auto:K (a count) or auto:P% (a share)") from None
            if (share is not None and not 0 < share < 1) or (count is not None and count < 1):
                raise ValueError(f"softmax_layers {self.softmax_layers!r}: K must be >= 1 and P in (0, 100)")
            if share is None:
                return count, None
            return (max(1, int(share * n_layers)) if n_layers else None), None
        return None, normalize_layers(self.softmax_layers)


def new_parameter_names(model) -> list[str]:
    """Parameters added by the conversion (feature maps, gates, convs...): everything inside a
    converted layer except the reused projections and norms."""
    from linearize.modeling_linearize import CONVERTED

    names = []
    for mod_name, mod in model.named_modules():
        if isinstance(mod, CONVERTED):
            reused = set(mod.spec.projections)
            names += [f"{mod_name}.{n}" for n, _ in mod.named_parameters() if n.split(".")[0] not in reused]
    return names


def stage2_parameter_names(model, finetune: str) -> list[str]:
    """The weights a ``full`` or ``attention`` stage 2 trains (see ``DistillConfig.finetune``): for
    ``attention``, those inside every layer's attention module (converted or kept softmax), in any
    layout (the Qwen3.5 form's ``in_proj_*`` too), and nothing else."""
    names = [n for n, _ in model.named_parameters()]
    if finetune == "full":
        return names
    spec = get_arch(model.config.model_type)  # every layer's attention module, converted or kept
    inside = re.compile(rf"(^|\.){re.escape(spec.layers)}\.\d+\.{re.escape(spec.attention)}\.")
    return [n for n in names if inside.search(n)]


def mlp_parameter_names(model) -> list[str]:
    """The weights ``long_finetune="mlp"`` trains: those the conversion added (``new_parameter_names``)
    and every decoder layer's outside its attention module (its MLP, experts or not, and its norms), in
    any architecture; the teacher's attention projections, the embeddings and the final norm stay."""
    layer = re.compile(rf"(^|\.){re.escape(get_arch(model.config.model_type).layers)}\.\d+\.")
    attention = set(stage2_parameter_names(model, "attention"))
    around = [n for n, _ in model.named_parameters() if layer.search(n) and n not in attention]
    return new_parameter_names(model) + around


# the long-row stage's choices besides "same" (stage 2's weights): what each trains, and the names of those weights
LONG_FINETUNE = {
    "attention": ("every attention module's weights", lambda model: stage2_parameter_names(model, "attention")),
    "new": ("the conversion's own weights", new_parameter_names),
    "mlp": ("the conversion's weights and the MLPs", mlp_parameter_names),
}


def set_trainable(model, names) -> int:
    names = set(names)
    count = 0
    for n, p in model.named_parameters():
        p.requires_grad_(n in names)
        count += p.numel() if n in names else 0
    return count


def attention_transfer_loss(model, batch) -> torch.Tensor:
    # through the model's own forward (not its decoder alone) so that DDP / compile wrappers see
    # the call; logits_to_keep=1 makes the LM head's share negligible
    with attention_mode(unwrap(model), "transfer") as layers:
        model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False, logits_to_keep=1)
        return torch.stack([m.transfer_loss for m in layers]).mean()


# each layer's loss is read beside its output, not through the model's output, whose backward hooks
# FSDP gathers and reduces with: train_stage refuses to shard this loss (stage 1 runs replicated)
attention_transfer_loss.shardable = False


def next_token_labels(ids: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B, T): the next token, -100 at the last position (no target)."""
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)


def plain_teacher_mask(teacher, pos):
    """The packed-documents mask of a full fine-tune's teacher (an unconverted transformers model)
    under static packing, else None. transformers builds that mask itself only when a host read finds
    a row packing several documents, and leaves it None for a batch without one: a different input
    to the compiled layers, so a recompile hundreds of steps into stage 2 (docs/reports/training.md).
    Passed ready, it is a tensor in every batch, as the converted model's own forward does."""
    from linearize.layers import packed_docs, static_packing_on
    from linearize.modeling_linearize import packed_attention_mask

    if not static_packing_on() or pos is None:
        return None
    packed = packed_docs(pos, *pos.shape)
    return packed_attention_mask(packed, teacher.config._attn_implementation, next(teacher.parameters()).dtype)


def record_teacher_attention(teacher) -> None:
    """A separate (plain) teacher's attention modules keep their outputs in ``attention_target`` from now
    on (forward hooks: what a converted layer's "record" mode keeps), the targets of ``--transfer-weight``.
    Call it before the teacher's layers first run compiled: dynamo does not see hooks added after."""
    spec = get_arch(teacher.config.model_type)
    for block in get_submodule(unwrap(teacher), spec.layers):
        getattr(block, spec.attention).register_forward_hook(
            lambda mod, args, out: setattr(mod, "attention_target", out[0].detach()))
    teacher._records_attention = True


def _teacher_records(teacher, layers: list[int]) -> list:
    """``record_teacher_attention``'s modules of the converted ``layers``, their records taken."""
    spec = get_arch(teacher.config.model_type)
    blocks = get_submodule(unwrap(teacher), spec.layers)
    mods = [getattr(blocks[i], spec.attention) for i in sorted(layers)]
    if not all(hasattr(m, "attention_target") for m in mods):
        raise RuntimeError("the teacher kept no attention outputs: call record_teacher_attention(teacher) "
                           "before its layers first run compiled")
    return [m.__dict__.pop("attention_target") for m in mods]


def make_kd_loss(cfg: DistillConfig, teacher=None, log=print):
    """KL(teacher || student) on next-token distributions (+ ce_weight * CE, + transfer_weight * the
    mean over converted layers of MSE(the layer's output, the teacher's attention output at that
    layer)). ``teacher``: a frozen model (full or attention fine-tune), or None to use the student's
    own weights with adapter and conversion off.

    With ``cfg.kd_chunk_size`` the loss runs chunked from the final hidden states (``recipes/kd.py``);
    a head it cannot reproduce uses the plain loss, said once through ``log``. ``loss_fn.path`` is
    "chunked" or "plain: <reason>" after the first call.
    """

    if cfg.transfer_weight and teacher is not None and not getattr(teacher, "_records_attention", False):
        record_teacher_attention(teacher)  # distill() has done it before compiling the teacher

    def forward(m, ids, pos, chunked):
        """Logits (plain) or final hidden states (chunked), all positions."""
        # a plain transformers model (the teacher, the swa baseline) gets its packed mask ready
        plain = m is teacher or not hasattr(unwrap(m).config, "linearize")
        kw = {"attention_mask": plain_teacher_mask(unwrap(m), pos)} if plain else {}
        if not chunked:
            return m(input_ids=ids, position_ids=pos, use_cache=False, **kw).logits
        with final_hidden_states(m):
            return m(input_ids=ids, position_ids=pos, use_cache=False, **kw).logits

    def last_logits(m, ids, pos):
        return m(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=1).logits

    def teacher_pass(model, fn, mode="softmax"):
        with torch.no_grad():
            if teacher is not None:  # a plain model: it records through record_teacher_attention's hooks
                return fn(teacher)
            peft_model = unwrap(model, keep_peft=True)
            with as_teacher(peft_model, mode):
                return fn(peft_model)

    def loss_fn(model, batch):
        ids, pos = batch["input_ids"], batch["position_ids"]
        if loss_fn.path is None:
            loss_fn.heads = _heads(model, teacher) if cfg.kd_chunk_size else "--kd-chunk-size 0"
            loss_fn.path = "chunked" if isinstance(loss_fn.heads, tuple) else f"plain: {loss_fn.heads}"
            if not isinstance(loss_fn.heads, tuple) and cfg.kd_chunk_size:
                log(f"stage 2 uses the plain KD loss over whole logits: {loss_fn.heads}")
        chunked = loss_fn.path == "chunked"
        # the phases are named for torch.profiler (scripts/profile_kd_eager.py, GPU traces)
        with record_function("kd.teacher"):
            # with --transfer-weight each layer keeps its softmax output: the target of the student's layer
            t_out = teacher_pass(model, lambda m: forward(m, ids, pos, chunked),
                                 "record" if cfg.transfer_weight else "softmax")
        with record_function("kd.student"):
            if cfg.transfer_weight:
                # the layers pass their own output on and record MSE(own, the teacher's at that layer)
                with attention_mode(unwrap(model), "joint") as layers:
                    if teacher is not None:  # the separate teacher's records, layer by layer
                        for mine, target in zip(layers, _teacher_records(teacher, unwrap(model).config.linearize["layers"])):
                            mine.attention_target = target
                    s_out = forward(model, ids, pos, chunked)
                    transfer = torch.stack([m.transfer_loss for m in layers]).mean()
            else:
                s_out, transfer = forward(model, ids, pos, chunked), None
        labels = next_token_labels(ids)
        if not chunked:
            with record_function("kd.loss"):
                kd = kd_loss_plain(s_out, t_out, labels, cfg.kd_temperature, cfg.ce_weight)
        else:
            s_head, t_head = loss_fn.heads
            if not loss_fn.checked:  # once: the reproduced heads against the models' own last logits
                _check_head(s_head, s_out, last_logits(model, ids, pos).detach(), "student")
                _check_head(t_head, t_out, teacher_pass(model, lambda m: last_logits(m, ids, pos)), "teacher")
                loss_fn.checked = True
            with record_function("kd.loss"):
                kd = kd_loss_chunked(s_out, t_out, s_head, t_head, labels, cfg.kd_temperature, cfg.ce_weight,
                                     cfg.kd_chunk_size, compiled=decoder_compiled(model))
        if transfer is None:
            return kd
        loss_fn.parts = {"kd": kd.detach(), "transfer": transfer.detach()}
        return kd + cfg.transfer_weight * transfer

    loss_fn.path, loss_fn.heads, loss_fn.checked = None, None, False
    # the transfer term is read beside the layers' outputs, not through the model's output, whose
    # backward hooks FSDP gathers and reduces with (as stage 1's loss)
    loss_fn.shardable = not cfg.transfer_weight
    return loss_fn


def _heads(model, teacher):
    s_head = logit_head(model)
    t_head = s_head if teacher is None else logit_head(teacher)
    for head in (s_head, t_head):
        if isinstance(head, str):
            return head
    return s_head, t_head


def _check_head(head, hidden, logits, who: str) -> None:
    """The reproduced head must give the model's own logits (last position) or training would
    optimise another function: stop and say so."""
    with torch.no_grad():
        mine, theirs = head(hidden[:, -1:]), logits[:, -1:].float()
        err = (mine - theirs).abs().max().item()
        scale = theirs.abs().max().item()
    if not err <= 2e-2 * scale + 1e-4:
        raise RuntimeError(f"the chunked KD loss does not reproduce the {who}'s logits (max difference {err:.3g} "
                           f"at scale {scale:.3g}): add the model's head to recipes/kd.py HEAD_SOFTCAP correctly, "
                           "or train with --kd-chunk-size 0")


def lora_targets(model) -> list[str]:
    spec = get_arch(model.config.model_type)
    return [n for n in spec.projections if not n.endswith("norm")]


def attach_lora(model, cfg: DistillConfig):
    """Stage 2's student: LoRA on q/k/v/o (peft), the base weights frozen, and the new parameters
    still training when ``cfg.train_feature_maps_in_stage2``."""
    from peft import LoraConfig, get_peft_model

    new_names = new_parameter_names(model)
    set_trainable(model, [])
    rank = cfg.resolved()["lora_rank"]
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                  target_modules=lora_targets(model)))
    if cfg.train_feature_maps_in_stage2:
        wanted = {f"base_model.model.{n}" for n in new_names}
        for n, p in peft_model.named_parameters():
            if n in wanted:
                p.requires_grad_(True)
    return peft_model


def prepare_data(tokenizer, data_cfg: DataConfig):
    """Packed training rows, held-out documents and a record per source (see ``prepare_mix``)."""
    return prepare_mix(data_cfg, tokenizer)


# A stage-2 (KD) step against a stage-1 (attention transfer) step of the same rows, for the first
# fit of the step counts under a time budget: the teacher's forward, the student's forward and
# backward through every weight, against one forward of both attentions and a backward through the
# new parameters. Only a first guess: stage 2 refits its count to the rate it measures itself.
STAGE2_COST = 2.0
# The long-row stage's first step (its 8K rows' graphs compiled) against stage 2's first step, for
# stage 2's fit: measured 1.4-2.0x on an H100 (lolcats-hybrid, 2026-12-01a to -06h: 20-36 s against
# 13-25 s). Left out, a short budget gave that compilation the long-row stage's whole share: a
# 9-minute run (2026-12-06i) compiled for 28 s of its ~30 and trained one step at 8K.
LONG_FIRST_STEP_COST = 2.0
MIN_RESERVE_S = 10.0


def plan_budget(cfg: DistillConfig, started: float, evaluates: bool) -> dict:
    """The run's time budget: its deadline and the end of training (the deadline less the reserve
    for the save and the evaluation), as ``time.time()`` seconds."""
    total = cfg.max_minutes * 60
    reserve = max(cfg.budget_reserve * total, MIN_RESERVE_S) if evaluates else max(0.05 * total, 5.0)
    reserve = min(reserve, 0.9 * total)
    return {"max_minutes": cfg.max_minutes, "reserve_s": reserve, "started": started,
            "deadline": started + total, "train_end": started + total - reserve}


def _stage_budgets(cfg: DistillConfig, plan: dict, out: Path, fixed: dict, long: bool = False,
                   tokens_per_step: int = 0) -> dict:
    """A ``StageBudget`` per stage. Stage 1 fits its count so that both stages, in the ratio of
    stage1_steps to stage2_steps, end by the end of training (stage 2's rate guessed as
    STAGE2_COST times stage 1's, its compilation as long as stage 1's); stage 2 takes the rest at its
    own measured rate (with ``long``: ``1 - long_share`` of the time left, and the long-row stage
    the rest at its own, after its first step, guessed as LONG_FIRST_STEP_COST times stage 2's).
    ``cfg.max_tokens`` caps the counts (``tokens_per_step`` in every stage):
    stage 1 at its share of them, the later stages at what the earlier ones left. A fitted count is
    written to ``budget.json`` at once: a resumed run keeps it (and so its LR schedule)."""
    from .train import StageBudget

    train_end = plan["train_end"]
    s1, s2 = cfg.stage1_steps, cfg.stage2_steps
    cap = cfg.max_tokens // tokens_per_step if cfg.max_tokens and tokens_per_step else 0  # in steps

    def remember(stage):
        def write(n):
            fixed[stage] = n
            (out / "budget.json").write_text(json.dumps({"fitted_steps": fixed}, indent=2))
        return write

    def late_by_a_margin(budget, n, done, rate):
        """A stage may run late by a margin, not into the next stage's share."""
        budget.deadline = min(train_end, time.time() + 1.15 * (n - done) * rate + 1.0)

    def fit1(first_s, rate, done):
        left = train_end - time.time()
        if not s2:
            n = done + int(left / rate)
        else:
            r2, c2 = STAGE2_COST * rate, max(first_s - rate, 0.0)
            x = (left - c2 + done * rate) / (s1 * rate + s2 * r2)
            n = max(done, int(s1 * x))
        if cap:
            n = max(done, min(n, int(cap * s1 / (s1 + s2))))
        late_by_a_margin(b1, n, done, rate)
        return n

    def fit2(first_s, rate, done):
        keep = 1 - cfg.long_share if long else 1  # the long-row stage's share is left to it
        compile3 = LONG_FIRST_STEP_COST * first_s if long else 0.0  # and the time to compile its graphs
        n = done + int(max(train_end - time.time() - compile3, 0.0) * keep / rate)
        if cap:  # what stage 1 left
            n = max(done, min(n, int((cap - fixed.get("stage1", 0)) * keep)))
        if long:
            late_by_a_margin(b2, n, done, rate)
        return n

    def fit_rest(first_s, rate, done):
        n = done + int((train_end - time.time()) / rate)
        return max(done, min(n, cap - fixed.get("stage1", 0) - fixed.get("stage2", 0))) if cap else n

    b1 = StageBudget(deadline=train_end, fit=fit1, fixed_steps=fixed.get("stage1"), on_fit=remember("stage1"))
    b2 = StageBudget(deadline=train_end, fit=fit2, fixed_steps=fixed.get("stage2"), on_fit=remember("stage2"))
    budgets = {"stage1": b1, "stage2": b2}
    if long:
        budgets["stage3"] = StageBudget(deadline=train_end, fit=fit_rest, fixed_steps=fixed.get("stage3"),
                                        on_fit=remember("stage3"))
    return budgets


# a stage's step count before a budget fits it: an upper bound the fit replaces
UNFITTED_STEPS = 10**9


def distill(model, tokenizer, cfg: DistillConfig, data_cfg: DataConfig, train_cfg: TrainConfig, out: Path,
            resume: bool = False, log=print, started: float | None = None, evaluates: bool = False) -> dict:
    """Convert ``model`` (in place), distill it, merge, and save a plain converted checkpoint to ``out``.

    Returns a summary (tokens, seconds, final losses per stage). ``out`` also receives
    ``metrics.jsonl``, ``loss_<stage>.png``, ``checkpoints/`` and ``distill.json``. Under
    ``accelerate launch`` every process trains (see ``train_stage``) and the main one alone logs
    and writes files. With ``cfg.max_minutes`` the run's budget counts from ``started``
    (``time.time()``, default now) and keeps a reserve for the evaluation when ``evaluates``.
    """
    started = time.time() if started is None else started
    state = process_state()
    main = state.is_main_process
    if cfg.transfer_weight and cfg.stage2_steps and train_cfg.fsdp and state.num_processes > 1:
        # found here, before stage 1 runs, not when stage 2's loss reaches train_stage
        raise ValueError("--transfer-weight's term is read beside the layers' outputs, which FSDP cannot "
                         "shard: drop --fsdp (stage 2 then runs replicated, DDP) or --transfer-weight")
    if data_cfg.long_seq_len is None:  # the preset's long-row stage, if any
        long = PRESETS.get(cfg.preset, {}).get("long_seq_len", 0) if cfg.stage2_steps else 0
        if data_cfg.long_min_doc_tokens and not long:
            raise ValueError(f"--long-min-doc-tokens picks the long-row stage's documents, and "
                             f"{'--preset ' + cfg.preset if cfg.preset else 'this run'} has no such stage: give "
                             "--long-seq-len (e.g. 8192) or drop --long-min-doc-tokens")
        try:
            data_cfg = dataclasses.replace(data_cfg, long_seq_len=long)
        except ValueError as err:
            raise ValueError(f"--preset {cfg.preset} ends stage 2 on rows of {long} tokens: {err}; or pass "
                             "--long-seq-len 0 to leave that stage out") from None
    if cfg.select_long and not data_cfg.long_seq_len:  # asked for (None: the preset's rule, below)
        raise ValueError("--select-long measures the layers on the long rows: give --long-seq-len (the gdn-hybrid "
                         "preset's 8192) and stage 2 steps, or drop --select-long")
    log = log if main else (lambda *a, **k: None)
    out = Path(out)
    rows, held_docs, sources = prepare_data(tokenizer, data_cfg)  # bad data fails before anything is written
    long_rows = rows.pop("long", None)
    out.mkdir(parents=True, exist_ok=True)
    log(f"data: {rows['input_ids'].shape[0]} rows of {data_cfg.seq_len} tokens for training, "
        f"{len(held_docs)} held-out documents")
    if long_rows is not None:
        docs = (f" from documents of at least {data_cfg.long_min_doc_tokens} tokens"
                if data_cfg.long_min_doc_tokens else "")
        log(f"long-row stage: {long_rows['input_ids'].shape[0]} rows of {data_cfg.long_seq_len} tokens{docs}, "
            f"the last {cfg.long_share:.0%} of stage 2")
    if len(sources) > 1:
        for s in sources:
            log(f"  {s['source']}: {s['documents']} documents ({s['held_out_documents']} held out), "
                f"{s['tokens']} distinct training tokens, {s['rows']} rows ({s['share']:.1%}, x{s['repeats']})"
                + (f"; {s['long_rows']} long rows from {s['long_tokens']} tokens" if "long_rows" in s else ""))
    if main:
        (out / "held_out.json").write_text(json.dumps(held_docs))

    swa = cfg.resolved()["method"] == "swa"
    # a separate teacher: for a full or attention fine-tune, and for the swa baseline (its attention function
    # changes for the whole model, so the student with its adapters off is not the teacher)
    teacher = copy.deepcopy(model).eval() if (cfg.finetune != "lora" or swa) and cfg.stage2_steps else None
    if teacher is not None:
        teacher.requires_grad_(False)
        if cfg.transfer_weight:
            record_teacher_attention(teacher)
        if train_cfg.compile:
            from .train import compile_decoder

            teacher_decoder = compile_decoder(teacher, train_cfg.cuda_graphs)
    if swa:
        from linearize.swa import apply_swa

        apply_swa(model, cfg.resolved()["window"], cfg.resolved()["sinks"])
        if cfg.stage1_steps:
            log("stage 1 skipped: the swa baseline adds no parameter to transfer attention into")
        cfg = dataclasses.replace(cfg, stage1_steps=0)
    else:
        linearize(model, cfg.method_config())
    auto_k, fixed_softmax = cfg.softmax_choice(None if swa else len(model.config.linearize["layers"]))
    if fixed_softmax:
        restore_softmax(model, fixed_softmax)
    summary = {"config": dataclasses.asdict(cfg), "data": dataclasses.asdict(data_cfg), "train": dataclasses.asdict(train_cfg),
               "data_sources": sources}
    budgets = {}
    if cfg.max_minutes:
        plan = plan_budget(cfg, started, evaluates)
        fixed = {}
        if resume and (out / "budget.json").is_file():
            fixed = json.loads((out / "budget.json").read_text()).get("fitted_steps", {})
        per_step = train_cfg.batch_size * train_cfg.grad_accum * process_state().num_processes * data_cfg.seq_len
        budgets = _stage_budgets(cfg, plan, out, fixed, long=long_rows is not None and bool(cfg.stage2_steps),
                                 tokens_per_step=per_step)
        summary["budget"] = {k: v for k, v in plan.items()}
        log(f"time budget: {cfg.max_minutes:g} min, {plan['reserve_s']:.0f} s of it kept for the save and evaluation")
    budgeted = lambda steps: UNFITTED_STEPS if cfg.max_minutes else steps  # noqa: E731

    if cfg.stage1_steps:
        n = set_trainable(model, new_parameter_names(model))
        log(f"stage 1 (attention transfer): {n} trainable parameters")
        # each layer's graph is local in stage 1 (the teacher's output flows on), so activation
        # checkpointing would save little; it is used in stage 2
        # stage 1 trains the new parameters only (a few MB): replicated, never sharded (--fsdp is
        # for stage 2, and its per-layer losses do not reach the output FSDP hooks)
        s1 = dataclasses.replace(train_cfg, steps=budgeted(cfg.stage1_steps), lr=cfg.stage1_lr,
                                 gradient_checkpointing=False, fsdp=False)
        summary["stage1"] = train_stage("stage1_attention_transfer", model, attention_transfer_loss, rows, s1, out, resume,
                                        budget=budgets.get("stage1"))

    if auto_k:
        # choose the softmax layers with the trained conversion, then hand them back to the original
        # attention for stage 2; measured on fixed slices: 2,048 tokens of the training rows and, where
        # the run has long rows, two of those (--select-long picks by them, the other is recorded)
        device = next(model.parameters()).device
        measures = {"training rows": {k: v[: max(1, 2048 // data_cfg.seq_len)] for k, v in rows.items()}}
        if long_rows is not None:
            measures["long rows"] = {k: v[:2] for k, v in long_rows.items()}
        picks = {}
        for on, calib in measures.items():
            chosen, kl = select_softmax_layers(model, auto_k, calib["input_ids"].to(device),
                                               calib["position_ids"].to(device))
            picks[on] = {"on": on, "tokens": calib["input_ids"].numel(), "chosen": chosen,
                         "kl": {str(i): v for i, v in kl.items()}}
        select_long = cfg.select_long
        if select_long is None:  # the preset's rule: the long rows where the run has them
            select_long = bool(PRESETS.get(cfg.preset, {}).get("select_long")) and "long rows" in picks
        used = picks.pop("long rows" if select_long else "training rows")
        other = next(iter(picks.values()), None)
        restore_softmax(model, used["chosen"])
        model.config.linearize["softmax_selection"] = {"k": auto_k, "by": "kl", "after": "stage 1", **used,
                                                       **({"alternative": other} if other else {})}
        summary["softmax_layers"] = used["chosen"]
        log(f"softmax kept in layers {used['chosen']} (largest KL when converted alone, on {used['tokens']} tokens of the "
            f"{used['on']})" + (f"; on the {other['on']} the choice would be {other['chosen']}" if other else ""))

    stage2 = bool(cfg.stage2_steps)
    if stage2 and cfg.max_minutes and "stage1" in summary and not budgets["stage2"].fixed_steps:
        # not even one stage-2 step fits (guessed from stage 1's first step): skip it, save and evaluate
        first = summary["stage1"].get("first_step_s") or 0.0
        if time.time() + STAGE2_COST * first > plan["train_end"]:
            stage2 = False
            summary["stage2"] = {"steps": 0, "tokens": 0, "skipped_by_budget": True}
            log(f"stage 2 skipped: no step of it fits the time budget (a guess of {STAGE2_COST * first:.0f} s "
                "for its first step)")
    if stage2:
        long_steps = max(1, round(cfg.long_share * cfg.stage2_steps)) if long_rows is not None else 0
        s2 = dataclasses.replace(train_cfg, steps=budgeted(max(1, cfg.stage2_steps - long_steps)), lr=cfg.stage2_lr)
        if cfg.finetune == "lora":
            # the adapters' random A matrices are a function of the seed: a run without stage 1
            # (whose train_stage seeds) drew them from whatever state the process was in
            torch.manual_seed(train_cfg.seed)
            student = peft_model = attach_lora(model, cfg)
            n = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
            log(f"stage 2 (KD, LoRA r={cfg.resolved()['lora_rank']}): {n} trainable parameters")
        else:
            student = model
            n = set_trainable(model, stage2_parameter_names(model, cfg.finetune))
            log(f"stage 2 (KD, {cfg.finetune} fine-tune): {n} trainable parameters")
        kd = make_kd_loss(cfg, teacher, log=log)
        summary["stage2"] = train_stage("stage2_kd", student, kd, rows, s2, out, resume, budget=budgets.get("stage2"))
        if long_steps:
            # the same tokens a step in rows of long_seq_len; one new graph per compiled layer at
            # its first step, static like the others (no dynamic-shape graphs from the second shape)
            s3 = dataclasses.replace(train_cfg, steps=budgeted(long_steps), lr=cfg.long_lr or cfg.stage2_lr,
                                     batch_size=max(1, train_cfg.batch_size * data_cfg.seq_len // data_cfg.long_seq_len))
            trains = "stage 2's weights"
            if cfg.long_finetune != "same":  # "new": contexts inside the window stay as stage 2 left them
                what, names = LONG_FINETUNE[cfg.long_finetune]
                trains = f"{what} ({set_trainable(student, names(student))})"
            lr_scale = None
            if cfg.long_teacher_lr is not None:  # the teacher's weights at their own rate, the conversion's at s3.lr
                new = set(new_parameter_names(student))
                teachers = [n for n, p in student.named_parameters() if p.requires_grad and n not in new]
                lr_scale = dict.fromkeys(teachers, cfg.long_teacher_lr / s3.lr)
                trains += f", the teacher's {len(teachers)} tensors of them at lr {cfg.long_teacher_lr:g}"
            log(f"stage 3 (KD on long rows): {s3.batch_size} x {data_cfg.long_seq_len} tokens a step at lr "
                f"{s3.lr:g}, training {trains}")
            with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
                summary["stage3"] = train_stage("stage3_long", student, kd, long_rows, s3, out, resume,
                                                budget=budgets.get("stage3"), lr_scale=lr_scale)
        if cfg.finetune == "lora":
            model = peft_model.merge_and_unload()
    model.requires_grad_(False)
    model.eval()
    if teacher is not None and train_cfg.compile:
        from .train import uncompile_decoder

        uncompile_decoder(teacher, teacher_decoder)
    if train_cfg.compile:  # the evaluation after it (the CLI's) runs without the training's graphs and their memory
        from .train import release_compiled

        release_compiled()
    if main:
        t_save = time.time()
        save_model_into(out, model, tokenizer)
        summary["save_s"] = time.time() - t_save
        summary["wall_s"] = time.time() - started  # to the saved checkpoint (the CLI adds the evaluation)
        (out / "distill.json").write_text(json.dumps(summary, indent=2, default=str))
    process_state().wait_for_everyone()  # the checkpoint is whole before any process reads it
    return summary


def save_model_into(out: Path, model, tokenizer) -> None:
    """Write the model files into ``out`` (which holds the run's other files too) so that a reader
    never sees a half-written checkpoint: everything goes to a temporary folder first, each file is
    moved with an atomic rename, ``config.json`` last."""
    tmp = Path(tempfile.mkdtemp(prefix=".model.tmp-", dir=out))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        files = sorted(tmp.iterdir(), key=lambda p: p.name == "config.json")
        for f in files:
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
