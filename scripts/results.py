"""The distillation runs behind docs/reports/quality.md, and the page itself.

    # on a GPU: distill and evaluate inside a wall-clock budget (linearize distill --max-minutes)
    python scripts/results.py run lolcats --model smollm2/ --data Documentation/ --minutes 20
    # the same run's stages 1-2 with another long-row stage: waits for lolcats-hybrid's stage 2, then
    # trains only the long-row stage and evaluates (the two runs differ in that stage alone)
    python scripts/results.py run lolcats-hybrid-long-same --from lolcats-hybrid --model ... --minutes 20
    # anywhere: collect the finished runs into docs/reports/quality.md
    python scripts/results.py write runs/

Each named run is a row of RUNS: ordinary ``linearize distill`` flags (the stage step counts give the
stages' shares; ``--max-minutes`` fits the counts to the rate the run measures). The exact command is
stored in ``runs/<name>.command.txt``, so every figure can be reproduced without this script.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shlex
import statistics
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchlib import REPORTS, markers, write_section

COMMON = ["--seq-len", "1024", "--batch-size", "16", "--mixed-precision", "bf16", "--compile", "--cuda-graphs",
          "--save-every", "0",
          "--eval-rows", "64", "--eval-prompts", "32", "--passkey", "1024,2048,4096,8192", "--passkey-trials", "20",
          "--max-skipped-steps", "10", "--max-tokens", "100000000"]

# name -> distill flags; stage steps 300 / 700: the stages' shares of the budget
SHARES = ["--stage1-steps", "300", "--stage2-steps", "700"]
RUNS = {
    "lolcats": ["--preset", "lolcats", *SHARES],
    # the lever named by the Linux-docs runs: stage 2 as a full fine-tune (lr 1e-4) instead of LoRA rank 8,
    # at the 64-token window the preset had then (2026-11-28c)
    "lolcats-full": ["--preset", "lolcats", "--finetune", "full", "--stage2-lr", "1e-4", "--window", "64", *SHARES],
    # a capacity lever: a 128-token softmax window (stage 2's loss was flat from a fifth of its steps at
    # 64); it won (2026-11-28d), and was the preset's window until 2026-11-28f
    "lolcats-w128": ["--preset", "lolcats", "--window", "128", *SHARES],
    # the same lever once more: from 128 to 256 keys the Linux docs' gap fell from +5.1% to +2.0% and the
    # Bible's from +9.4% to +4.9% (2026-11-28f); the preset's window now ("lolcats" is the same run)
    "lolcats-w256": ["--preset", "lolcats", "--window", "256", *SHARES],
    # the other difference from the SWA baseline, which beat lolcats at 256 keys (2026-11-28f) with all 100M
    # tokens in stage 2: stage 1 at a tenth of the budget. It changed nothing (2026-11-28g: +1.9% / +4.8%
    # against +2.0% / +4.9%), so stage 1's share is not what separates lolcats from the baseline
    "lolcats-s1-10": ["--preset", "lolcats", "--stage1-steps", "100", "--stage2-steps", "900"],
    # the sinks the baseline has, in lolcats' softmax part (the first 4 tokens of each document beside the
    # 256-key window, the linear branch over the rest); with its branch weighted 0 the layer is the baseline
    # itself (tests/test_sinks.py). It won (2026-11-29: +1.4% / +1.8% at 66M tokens, against lolcats' +2.0% /
    # +4.9% and the baseline's +1.9% / +2.5% at 100M) and is the preset since: "lolcats" is the same run now
    "lolcats-sinks4": ["--preset", "lolcats", "--sinks", "4", *SHARES],
    # the branch's share once the sinks are in: zeroed, it cost +6.1% at 256 keys (target: at least 10%); at
    # 128 keys it covers more of the attention (without sinks, zeroing it cost +80% at 128, +30% at 256).
    # It did (2026-11-29b: +22.9%), and the perplexity missed: +3.8% / +6.3% against +1.4% / +1.8% at 256
    "lolcats-w128-sinks4": ["--preset", "lolcats", "--window", "128", *SHARES],
    # in between: the window at which both the ablation (>= 10%) and the Bible (within 5%) may hold. They
    # did (2026-11-29c: window only +11.1%; +2.7% / +3.1%, 92M tokens): the preset's window since
    # ("lolcats" is the same run now)
    "lolcats-w192-sinks4": ["--preset", "lolcats", "--window", "192", *SHARES],
    # the out-of-domain lever of 2026-11-28e: stage 2 trains the attention modules at full rank and leaves
    # the embeddings and MLPs the teacher's (LoRA's scope; the full fine-tune widened the Bible's gap to
    # 1.9-2.3x the Linux docs' gap, LoRA kept it at 1.15x). It lost in both domains on all three presets
    # (gdn-attn at the gdn preset's lr of then, 1e-4, pinned here)
    "lolcats-attn": ["--preset", "lolcats", "--finetune", "attention", *SHARES],
    "gdn-attn": ["--preset", "gdn", "--finetune", "attention", "--stage2-lr", "1e-4", *SHARES],
    "gdn-hybrid-attn": ["--preset", "gdn-hybrid", "--finetune", "attention", *SHARES],
    # lolcats' baseline: its softmax window plus 4 sink tokens, no linear part (stage 2 only); at 192 tokens
    # (the preset since 2026-11-29c, 256 since 2026-11-28f; the run "swa" of 2026-11-28e had 128, its
    # command.txt says so) and at 64, the window of lolcats-full
    "swa": ["--preset", "swa", *SHARES],
    # the baseline at lolcats' window since 2026-11-29c (the "swa" preset's now; the row names it)
    "swa-w192": ["--preset", "swa", "--window", "192", *SHARES],
    "swa-w64": ["--preset", "swa", "--window", "64", *SHARES],
    # the baseline of lolcats-w256 (at 128 the baseline won out of domain: +8.4% against lolcats' +10.4%;
    # at 256 it won on both corpora, 2026-11-28f)
    "swa-w256": ["--preset", "swa", "--window", "256", *SHARES],
    "swa-w128": ["--preset", "swa", "--window", "128", *SHARES],
    # the preset: stage 2 at lr 3e-4 since 2026-11-30c (1e-4 before: the rows below that ran at it pin it), a
    # decay gate per key channel at rank 16 since 2026-11-29l (full width from -29k: "linear-channel";
    # a scalar gate from 2026-11-29e: the runs "linear" of -29e to -29j, which "linear-decay" runs; LoRA rank 8
    # and no gate before: 2026-11-28b and earlier)
    "linear": ["--preset", "linear", *SHARES],
    # lolcats' lever applied to pure linear attention: a full fine-tune at lr 1e-4 instead of LoRA rank 8
    # (without the gate: the preset's recipe of then; its -28d command under "Reproduce" needs --decay none now)
    "linear-full": ["--preset", "linear", "--finetune", "full", "--stage2-lr", "1e-4", "--decay", "none", *SHARES],
    # gdn-lr3e-4's lever on pure linear attention: a full fine-tune at 3x linear-full's learning rate. It
    # lost (2026-11-28g: +69.3% on the Linux docs against +39.2%); linear's stage 2 stays at 1e-4
    "linear-lr3e-4": ["--preset", "linear", "--finetune", "full", "--stage2-lr", "3e-4", "--decay", "none", *SHARES],
    # a learned, data-dependent decay gate per head and step (GLA / RetNet-style forgetting, on the kernels;
    # no softmax still), since linear's plain running sum weighs every older token alike. It won
    # (2026-11-29e: +22.0% / +52.9% against +39.2% / +87.5%) and was the preset until -29k (the runs
    # "linear" of -29e to -29j; -29i: +20.0% / +51.4%)
    "linear-decay": ["--preset", "linear", "--finetune", "full", "--stage2-lr", "1e-4", "--decay", "scalar", *SHARES],
    # the gate per feature channel too (GLA's form: each of the state's key channels forgets at its own
    # rate), on its own chunk kernel (kernels/linear_attn/chunk_channel.py). 2026-11-29h, sharing a GPU:
    # +33.6% / +47.2% at 25.7M tokens (its step 3.2x the scalar gate's) against +22.0% / +52.9% at 89.4M;
    # the Bible gap only 1.4x the docs gap (scalar 2.4x) and stage 1's loss 0.46 against 0.66 at equal
    # tokens. Worth a faster kernel; at equal time it lost. 2026-11-29i, on the kernel's second layout (2.1x the
    # scalar step), one GPU each: +20.5% / +39.6% at 64.5M against linear's +20.0% / +51.4% at 100M in the same
    # 20 minutes: a tie in domain, ahead on every other corpus. At the full 100M tokens (2026-11-29k, one run on
    # both H200s of a host, --processes 2): +15.6% / +35.5% against +20.0% / +51.4%; the preset from then,
    # at full width (--gate-rank 0), until -29l
    "linear-channel": ["--preset", "linear", "--decay", "channel", "--gate-rank", "0", "--stage2-lr", "1e-4", *SHARES],
    # the per-channel gate factored hidden -> 16 -> 1152 (GLA's low-rank gate): 0.86M parameters for the gates
    # instead of 19.9M. It tied (2026-11-29l, the same two H200s and data: +15.6% / +36.0% against +15.6% /
    # +35.5%, top-1 75.1% / 66.3% against 75.1% / 66.5%) and is the preset's gate since
    "linear-rank16": ["--preset", "linear", "--gate-rank", "16", "--stage2-lr", "1e-4", *SHARES],
    # an output gate (o * 2 sigmoid(W2 W1 x + b) before o_proj, rank 16, starting at 1), GLA's and Gated
    # DeltaNet's: the layer may scale each output channel by what the token is, where the linear readout
    # of the state is poor; gdn, which has one, is 6 points closer in domain (+9.3%). 0.6M parameters. It
    # tied (2026-11-30b, the same two H200s and data, 93.9M tokens: +15.5% / +34.8% against +15.6% / +36.0%,
    # top-1 75.1% / 66.3% both, greedy agreement 0.18 against 0.21): the preset has no output gate
    "linear-ogate16": ["--preset", "linear", "--output-gate", "16", "--stage2-lr", "1e-4", *SHARES],
    # stage 2 at twice and three times the preset's learning rate (1e-4): gdn, the other gated layer, gained 6
    # points in domain from 1e-4 to 3e-4 (2026-11-28g), while ungated linear lost at 3e-4 and the scalar gate
    # at 5e-5. Screened one H200 each with EXTRA='... --max-tokens 64500000': the tokens of -29i's one-GPU run
    # of the per-channel gate at lr 1e-4 (+20.5% / +39.6%; full width, which tied rank 16 at 100M), same data.
    # Both won (2026-11-30c): lr 2e-4 +15.9% / +36.7%, lr 3e-4 +13.1% / +34.7% (stage 2's KD loss 0.246 and
    # 0.233 against 0.270); 3e-4 is the preset's since, so "linear-rank16-lr3e-4" runs the preset
    "linear-rank16-lr2e-4": ["--preset", "linear", "--stage2-lr", "2e-4", *SHARES],
    "linear-rank16-lr3e-4": ["--preset", "linear", "--stage2-lr", "3e-4", *SHARES],
    # the scalar gate (one decay per head and step) at the learning rate that won for the per-channel one. The
    # scalar gate prefills 64K tokens 3.17x faster than the original (-29l), the per-channel 1.58x against the
    # 2.5x target, and trains at half the step time; it lost at lr 1e-4 (+20.0% / +51.4% against +15.6% /
    # +36.0%, 100M) but was never run at 3e-4. At 3e-4 (2026-11-30f, alone on an H200, -29i's data, 100M in 587 s
    # of training): +11.7% / +43.7%, the best linear run in domain and 9 points behind the preset's +34.7% on the
    # Bible; its 64K prefill 3.13x against the preset's 1.59x. The preset keeps the per-channel gate (both miss the
    # 1.5x ratio, the per-channel gate by less); `--decay scalar` is this run
    "linear-scalar-lr3e-4": ["--preset", "linear", "--decay", "scalar", "--stage2-lr", "3e-4", *SHARES],
    # stage 2 keeps an attention-transfer MSE beside KD (--transfer-weight W): linear's Bible gap stays 2.6x its
    # docs gap after the full fine-tune at lr 3e-4 (2026-11-30c), and the full fine-tune is what widened it
    # before (-28e: LoRA, which leaves the MLPs alone, kept it at 1.15x). Its first form (each layer against
    # the softmax of its own input and its own trained projections) diverged in both runs at 64.5M tokens
    # (2026-11-30d: stage-2 KD 0.4 -> 4-5 from step 150-300, perplexity 917 and 4,809): a target moving with
    # the weights it trains. The form since (each layer against the teacher's attention output at that layer)
    # ran at 12M tokens beside linear-rank16-lr3e-4 (EXTRA='... --max-tokens 12000000 --passkey none'):
    # W=1 stable, KD the same, +49.8% / +62.4% against +45.9% / +60.9%. Not screened at 64.5M yet
    "linear-transfer025": ["--preset", "linear", "--transfer-weight", "0.25", *SHARES],
    "linear-transfer1": ["--preset", "linear", "--transfer-weight", "1", *SHARES],
    # half the steps in stage 1 (30% by default): linear's attention transfer loss still fell at the end of
    # its stage 1 (0.63 to 0.56 over its second half, -29e). It changed nothing (2026-11-29f: +23.0% / +53.0%
    # against +22.0% / +52.9%): stage 1's loss flattens at about 0.55 either way, so the recipe stays at 30%
    "linear-s1-50": ["--preset", "linear", "--decay", "scalar", "--stage1-steps", "500", "--stage2-steps", "500", "--stage2-lr", "1e-4"],
    # twice the feature space (F = 256: hedgehog's [xW, -xW] at 128 columns, a state of 256 x 64 per head), since
    # stage 1's loss flattened at about 0.55 whether it had 30% or 50% of the steps. It lost at equal time
    # (2026-11-29g, sharing a GPU: +26.1% / +54.9% at 65.8M tokens against the preset's +22.0% / +52.9% at
    # 89.4M): stage 1 fit a little closer (0.538 against 0.564) but the step is 18% slower; the preset stays at 128
    "linear-f256": ["--preset", "linear", "--decay", "scalar", "--feature-dim", "256", "--stage2-lr", "1e-4", *SHARES],
    # a short causal conv over q, k and v before the feature maps (4 taps, the gdn layer's, starting as the
    # identity): each token's query, key and value may mix in its three predecessors', the local mixing that
    # a window gives lolcats and a conv gives gdn (+9.3% in the same data), which linear lacks. It lost
    # (2026-11-29j, alone on an H200, -29i's data: +22.8% / +63.0% against the preset's +20.0% / +51.4%):
    # stage 1 fit closer (0.541 against 0.595), stage 2 ended worse (KD 0.297 against 0.272)
    "linear-conv4": ["--preset", "linear", "--decay", "scalar", "--conv-size", "4", "--stage2-lr", "1e-4", *SHARES],
    # the preset at half its stage-2 learning rate: lr 3e-4 lost to 1e-4 (2026-11-28g, no gate), and
    # its loss fell fastest while the schedule annealed; nothing below 1e-4 was tried. It lost too
    # (2026-11-29j, the same stage 1 bit for bit: +26.6% / +58.1% against +20.0% / +51.4%)
    "linear-lr5e-5": ["--preset", "linear", "--decay", "scalar", "--stage2-lr", "5e-5", *SHARES],
    # the gdn preset before 2026-11-28g (stage 2 at lr 1e-4): the runs of 2026-11-28, -28b and -28d
    "gdn": ["--preset", "gdn", "--finetune", "full", "--stage2-lr", "1e-4", *SHARES],
    # gdn's two levers of 2026-11-28g. The 8K-row tail that gave gdn-hybrid its 4K-8K passkey did nothing
    # for pure gdn (passkey 0% at every length, +15.0% on the Linux docs against +15.4%; at the preset's lr
    # of then, 1e-4, pinned here)
    "gdn-long": ["--preset", "gdn", "--stage2-lr", "1e-4", "--long-seq-len", "8192", "--long-share", "0.25", *SHARES],
    # stage 2 at 3x the learning rate (at 1e-4 its KD loss still fell slowly): it won on every measure
    # (+9.3% on the Linux docs against +15.4%, +25.9% on the Bible against +30.0%) and is now the
    # preset's stage 2 ("--preset gdn" alone runs it)
    "gdn-lr3e-4": ["--preset", "gdn", "--stage2-lr", "3e-4", *SHARES],
    # the same lever once more, at 6e-4, for gdn's Bible gap (2.8x its in-domain gap at 3e-4, target 1.5x).
    # It widened it (2026-11-29h, sharing a GPU: +8.6% / +31.0% at 64.8M tokens against +9.3% / +25.9% at
    # 100M alone; 3.6x): the preset stays at 3e-4
    "gdn-lr6e-4": ["--preset", "gdn", "--stage2-lr", "6e-4", *SHARES],
    # pure gdn misses on recall (2026-11-30e: on the tokens that complete a bigram seen earlier in their
    # document 1.30x the teacher's perplexity in domain, 1.52x on the Bible; passkey 0-5%). With RoPE on q
    # and k the state holds each key turned by its position, and a query far later meets it turned by the
    # distance; Mamba-style layers leave position to the decay gate and the short conv. The preset with
    # its state's RoPE off. No better (2026-12-07d, sharing one H100 with "gdn-lr3e-4": +17.0% / +38.1% at
    # 36.7M tokens against +16.4% / +33.1% at 34.0M; passkey 18 / 3 / 0 / 0% against 10 / 2 / 0 / 0%):
    "gdn-norope": ["--preset", "gdn", "--no-use-rope", *SHARES],
    # Passkey at 1K needs a head that keeps a key 1,000 tokens: the decay's initial time steps, 1e-3 to 1e-2,
    # start every head at 1,000 tokens or fewer (0.999^1000 = 0.37, 0.99^1000 = 4e-5), and Adam at 3e-4 moves
    # dt_bias by ~2.3 (a 10x slower decay) only in thousands of steps. The preset with its slowest heads started
    # at 10,000 tokens:
    "gdn-dt1e-4": ["--preset", "gdn", "--dt-min", "1e-4", *SHARES],
    # the runs of 2026-11-28 and 2026-11-28b kept 8 of 30 layers ("--preset gdn --finetune full --stage2-lr
    # 1e-4 --softmax-layers auto:8", their command.txt); the preset keeps 25%, 7 of 30. Run again beside
    # gdn-hybrid-lr3e-4's setting (sharing a GPU, 2026-11-29f): +0.3% / +9.8% at 78M tokens, passkey 100% at 8K
    "gdn-hybrid": ["--preset", "gdn-hybrid", *SHARES],
    # gdn's winning lever (stage 2 at lr 3e-4: +9.3% against +15.4%, 2026-11-28g) on the hybrid, whose misses
    # were the Bible (+7.5%), passkey at 8K (85%) and greedy agreement (0.20). Sharing a GPU (68M tokens,
    # 2026-11-29e): passkey 100% at 8K, greedy 0.24, but the Bible +11.1%; the preset at 78M (-29f) did as
    # well or better on each, so stage 2 stays at 1e-4
    "gdn-hybrid-lr3e-4": ["--preset", "gdn-hybrid", "--stage2-lr", "3e-4", *SHARES],
    # the layer choice. The preset keeps the 7 layers whose conversion raises the KL to the teacher most after
    # stage 1 ([0, 10, 17, 18, 20, 23, 24] at -29f, bunched at the top); this keeps every fourth layer instead
    # (Qwen3.5's own pattern: 3, 7, ..., 27). It lost on every measure (2026-11-29g, sharing a GPU, 70.0M
    # tokens: +6.4% / +20.1%, passkey 95 / 100 / 65 / 20%, against the preset's +0.3% / +9.8% and 100% at 78.4M)
    "gdn-hybrid-every4": ["--preset", "gdn-hybrid", "--softmax-layers", "3,7,11,15,19,23,27", *SHARES],
    # the last quarter of stage 2 on 8K-token rows (documents concatenated): retrieval at 4K-8K
    "gdn-hybrid-long": ["--preset", "gdn-hybrid", "--long-seq-len", "8192", "--long-share", "0.25", *SHARES],
    # the preset with Jane Austen's six novels added at 7 parts in 87 of the rows (MORE_DATA below; a narrative
    # source, `scripts/device/corpus.py`): gdn-hybrid's Bible gap sat in the tokens no earlier occurrence predicts
    # (2026-11-30e: ratio 1.097 there against 1.071 on the recall tokens), so the genre of the data is the lever
    # tried. Beside the preset, both at 16M tokens on one H200 (2026-11-30e): Austen's held-out gap +11.7% -> +2.5%,
    # the Bible's +16.8% -> +15.1% (within run-to-run noise), the Linux docs +4.4% both; no preset adds it
    "gdn-hybrid-austen": ["--preset", "gdn-hybrid", *SHARES],
    # the preset with the teacher's own continuations of the mix's training-document openings at 8 parts in 88 of
    # the rows (`generate-data --continue-from`, made at the lease's start: launch_runs.sh TEXT_MINUTES):
    # sequence-level distillation, for gdn-hybrid's greedy agreement (0.20-0.29 against 0.5). It changed
    # nothing (2026-11-30f, 3.6M tokens of text, 100M tokens, one H200: -0.6% / +8.9%, greedy 0.27, against the
    # preset's -0.8% / +8.9% and 0.22 on the same data in -30e); no preset adds it
    "gdn-hybrid-text": ["--preset", "gdn-hybrid", *SHARES],
    # stage 1 at a tenth of the token budget instead of 30%: 90M tokens of KD instead of 70M under the 100M cap.
    # Tokens are the one thing that has moved gdn-hybrid's Bible gap (+16.8% at 16M, +9.8% at 78M, +7.5-8.9%
    # at 100M), and the stage-1 loss of both gdn presets is within about 5% of its end a third of the way in
    # (0.598-0.603 at step 600 of 1,830, 0.573 at the end; -30e/-30f), while stage 2's KD still falls at its end. For
    # lolcats the share changed nothing (lolcats-s1-10, 2026-11-28g). Baselines: -30e's gdn-hybrid and
    # gdn-lr3e-4, at the same cap on the same data
    # Outcome (2026-11-30g, one H200 each): gdn +6.5% / +25.7% (against +7.5% / +26.7%), gdn-hybrid +0.1% / +10.1%
    # (against -0.8% / +8.9%, but gcide and chat a point better, and its KL choice kept layer 1 instead of 8): a
    # point either way, no case for a change; the presets keep stage 1 at 30%
    "gdn-hybrid-s1-10": ["--preset", "gdn-hybrid", "--stage1-steps", "100", "--stage2-steps", "900"],
    "gdn-s1-10": ["--preset", "gdn", "--stage1-steps", "100", "--stage2-steps", "900"],
    # the preset with another seed (data order and the new layers' initialisation): beside -30e's run (seed 0) on
    # the same data, what two runs of one recipe differ by at the 100M cap, the yardstick for the one-point moves of
    # -30f and -30g; with EXTRA='--passkey-trials 60', the preset's 8K passkey against the teacher's 95%. Beside it,
    # gdn-hybrid-austen at the cap: the one lever that moved the Bible at 16M (-1.7 points), never run at 100M. (Not
    # a lower learning rate: keeping the teacher's MLPs, the least drift, widened the Bible's gap, -28e)
    # Outcome (2026-11-30h, one H200 each, passkey at 60 trials): seed 1 -0.8% / +9.2% against seed 0's -0.8% / +8.9%
    # (the chat held-out ratio 0.904 against 0.975: the seed moves that one by 7 points), 8K passkey 75% (the teacher 95%); Austen
    # -0.4% / +7.9%, its own held-out ratio 0.995 (1.060), 8K 75%: a point on the Bible, as at 16M; the mix stays
    # Since -30i the preset measures its softmax choice on the long rows, so this row runs the new preset with seed 1
    # (stage 1 as -30h's; the probe there showed its long-row choice [7, 8, ...]); -30h's run: add --no-select-long
    # Outcome (2026-11-30j): the same 7 layers, -0.8% / +7.9% (seed 0: -0.9% / +8.7%), 8K 53 of 60 as seed 0: the
    # long-row choice holds its passkey across seeds (159 of 180 over three runs; the teacher 57 of 60, p = 0.21)
    "gdn-hybrid-seed1": ["--preset", "gdn-hybrid", "--seed", "1", *SHARES],
    # the preset with its seventh softmax layer chosen on two 8K-token long rows (`--select-long`) instead of
    # 2,048 tokens of the 1K rows: there layers 1, 8 and 10 tie (KL 0.013-0.017), and the 8K passkey followed
    # the pick: 70-90% in the seven runs that kept layer 8 (75% twice at 60 trials, -30h), 95-100% in the
    # three that kept 1 or 10 (95% at 60 trials, -30g); the teacher 95%. Baselines: -30h's two runs
    # Probe (2026-11-30h, stage 1 of this row and of gdn-hybrid-seed1, then given back): on the long rows both seeds
    # keep [7, 8, 17, 18, 20, 23, 24], on the 1K rows [0, 8, ...]: layer 7 in place of 0, layer 8 kept
    # Outcome (2026-11-30i, one H200, passkey at 60 trials): [7, 8, 17, 18, 20, 23, 24], 8K 88% (53 of 60, against 45 of
    # 60 twice), the Linux docs -0.9%, the Bible +8.7%, fluency 2.21: the preset's measure since (--select-long is its
    # default now; --no-select-long the 1K rows')
    "gdn-hybrid-select-long": ["--preset", "gdn-hybrid", "--select-long", *SHARES],
    # the preset's layers with 10 in place of 8 (the -29e and -29f runs' KL choice, 100% at 8K at 20 trials): does the
    # near-tied seventh pick decide the 8K passkey? Beside -30h's two runs that kept 8 (75% at 60 trials)
    # Outcome (2026-11-30i, beside gdn-hybrid-select-long): 8K 92% (55 of 60; the teacher 57), -0.7% / +9.7%: the pair
    # [0, 8] was what cost the 8K passkey; a fixed list is SmolLM2's, so the preset took the long-row measure instead
    "gdn-hybrid-keep10": ["--preset", "gdn-hybrid", "--softmax-layers", "0,10,17,18,20,23,24", *SHARES],
    # the preset with the teacher's own text at 8 parts in 88 of the rows: samples from its start token alone
    # (`generate-data --unconditional --temperature 1`, made at the lease's start: TEXT_MINUTES=4
    # TEXT_FROM=unconditional). -30f's continuations of the mix's openings stayed in the mix's genres and moved
    # nothing; free samples are the teacher's own distribution (essays, stories, lists, code; 2% dropped against the
    # continuations' 62%; one H200 wrote 3.3M tokens in 2.3 minutes, 2026-11-30i), the prose
    # the Bible's gap sits in (Austen's novels, one genre, took a point). Baseline: -30i's gdn-hybrid-select-long
    # (the preset since, seed 0, the same data)
    # Outcome (2026-11-30j, TEXT_MINUTES=3 on two H200s: 53K samples, 10.3M tokens, 9% of the rows): the Bible +7.9%,
    # as gdn-hybrid-seed1 beside it (+7.9%; seed 0 +8.7%); docs -0.8%, 8K passkey 53 of 60 in both: no gain
    "gdn-hybrid-free": ["--preset", "gdn-hybrid", *SHARES],
    # lolcats' layers (hedgehog + a 192-key window + 4 sinks) with gdn-hybrid's quarter of full softmax, chosen on the
    # 8K rows, and its last quarter of stage 2 on them. Every data lever moved gdn-hybrid's Bible gap by a point at
    # most (+7.9% to +9.2% at 100M), while the window presets keep the Bible in step with the docs (lolcats +2.7% /
    # +3.1%, swa +4.4% / +4.1%): does a window in the converted layers carry the Bible, and the kept layers the
    # 8K passkey (gdn-hybrid 88%, lolcats 0%)? Baselines: -30j's gdn-hybrid-seed1, -29c's lolcats
    # Outcome (2026-11-30k): kept [1, 3, 7, 8, 10, 18, 23] (on the mix's 8K rows; a 5-minute check on the Linux docs
    # alone had chosen [7, 8, 17, 18, 19, 20, 23]). The Bible +0.4%, docs -1.7%, top-1 90.1% / 86.2%, greedy 0.38, the
    # window alone 3.1% worse: the best perplexity of any conversion. Passkey 95 / 98 / 15 / 67% (the teacher 95 / 98 /
    # 100 / 95%), a dip around 4K (3K 97%, 5K 88% at 40 trials) that a batch of one gives too
    # (results.py's "lolcats-hybrid" until 2026-12-01a, the runs of -30k under that name)
    "lolcats-hybrid-select-long": ["--preset", "lolcats", "--softmax-layers", "auto:25%", "--select-long",
                                   "--long-seq-len", "8192", *SHARES],
    # lolcats-hybrid keeping gdn-hybrid's layers (its choice on the 8K rows, 100% at 4K and 88% at 8K there) in place
    # of its own [1, 3, 7, 8, 10, 18, 23], which lack 17, 20 and 24: is the 4K dip the layers? Baseline: -30k's run
    # Outcome (2026-12-01a): yes. Passkey 93 / 98 / 97 / 92% at 1K / 2K / 4K / 8K (3K 97%, 5K 98%; at 40 more trials
    # 4K 97%, 8K 93%), the Bible -0.4%, docs -1.7%, top-1 90.9% / 86.9%, greedy 0.39; generated = teacher-forced, and
    # the window alone keeps 4K at 100%: the softmax layers retrieve
    "lolcats-hybrid-layers": ["--preset", "lolcats", "--softmax-layers", "7,8,17,18,20,23,24", "--long-seq-len", "8192",
                              *SHARES],
    # the same with a decay gate on the linear branch (one per head and step, `--decay scalar`): the hedgehog state
    # sums every token past the window without forgetting; is that what a 4K prompt of repeated filler upsets?
    # Outcome (2026-12-01a): 4K 100% but 8K 83% (with 40 more trials 84 of 100, against 92 without the gate, p = 0.13);
    # top-1 92.1% / 89.3% and greedy 0.49, the highest of any conversion; the Bible -1.0%, docs -1.6%; its 8K step 1.5x
    "lolcats-hybrid-decay": ["--preset", "lolcats", "--softmax-layers", "7,8,17,18,20,23,24", "--long-seq-len", "8192",
                             "--decay", "scalar", *SHARES],
    # the lolcats-hybrid preset: lolcats-hybrid-layers' recipe with the layers its own KL choice on the training rows
    # keeps (the same [7, 8, 17, 18, 20, 23, 24]), and since 2026-12-06a its 8K stage on the conversion's weights alone
    # at lr 1e-3 (lolcats-hybrid-long-new's run); the run to repeat for the preset's own row at the full 100M tokens,
    # and with --seed 1 for its spread
    # Outcome (2026-12-06b, alone on one H100, 100.0M tokens, stage 3 17.5M): 8K did not come back, 48% (29 of 60;
    # -06a at 79M 68%, p = 0.04); docs +0.1%, the Bible +1.0%, top-1 94.4% / 92.0%, greedy 0.72, chat 0.511, passkey
    # 93 / 97 / 97 / 98 / 95% at 1K-5K. The preset keeps its recipe. Next: this run again with
    # lolcats-hybrid-long-new-lr1e-4@lolcats-hybrid beside it (a branch: its long-row stage on this run's stages 1-2),
    # and on a second GPU lolcats-hybrid-decay-new (at 8K the linear branch's normalizer sums ~8K keys against the
    # window's 192, and a decay bounds that sum; prompts inside the window, as the greedy ones, do not reach the
    # linear branch, so its agreement should stay)
    # Outcome (2026-12-06e, beside lolcats-hybrid-long-attention@lolcats-hybrid on one H100; -06d's stages 1-2 choice,
    # layer 14 for 24): 8K 62% (37 of 60; -06b 29), and 83% with the linear branch zeroed; 1K-5K 93 / 97 / 98 / 100 / 95%,
    # zeroed 50 / 90 / 90 / 90 / 90%; docs +0.1%, the Bible +1.4%, greedy 0.71: the trained branch helps to 5K, costs at 8K
    "lolcats-hybrid": ["--preset", "lolcats-hybrid", *SHARES],
    "lolcats-hybrid-seed1": ["--preset", "lolcats-hybrid", "--seed", "1", *SHARES],
    # the preset without its long-row stage: its greedy agreement (0.39) is lolcats' (0.66) less weight drift, all inside
    # the window; pure lolcats had no 8K stage. Its softmax layers retrieve alone (window only: 4K 100%, 8K 85%): does
    # the 8K stage cost the agreement, and does the passkey need it? Baseline: the preset's run beside it
    # Outcome (2026-12-01b, alone on one H200; baseline -01a's lolcats-hybrid-layers): yes to both. It kept the same
    # seven layers; greedy 0.73 (0.39), top-1 95.0% / 92.1% (90.9 / 86.9), docs 0.0% and the Bible -0.9%, but passkey
    # 93 / 95 / 45 / 7 / 5 / 0% at 1K / 2K / 3K / 4K / 5K / 8K: the stage stays, trained otherwise
    "lolcats-hybrid-no-long": ["--preset", "lolcats-hybrid", "--long-seq-len", "0", *SHARES],
    # the preset with its 8K stage training the linear branch alone (`--long-finetune new`: feature maps and the window's
    # weight of the linear part; the teacher's weights stay as the 1K rows left them, so a prompt inside the 192-key
    # window runs exactly as without the stage): greedy 0.73 as lolcats-hybrid-no-long, and the passkey of the preset?
    # At lr 1e-3 (stage 1 trains these weights at 1e-2, stage 2 at 1e-4), and at stage 2's 1e-4. Baselines: -01a's
    # lolcats-hybrid-layers (the stage on every weight) and -01b's lolcats-hybrid-no-long
    # Outcome (2026-12-06a, alone on one H200, 79M tokens: the machine's start took 6.5 minutes of the lease): yes, but
    # for 8K. Greedy 0.69, top-1 94.1% / 91.5%, docs +0.3%, the Bible +1.8%; passkey 93 / 98 / 98 / 100 / 93 / 68% at
    # 1K-8K (the stage on every weight: 8K 92%): the preset since (-01c ran it too; that session was cut off, nothing kept)
    # the preset's stages 1-2 with -01a's long-row stage (every weight, at stage 2's 1e-4): on the same stage-2 model
    # as the preset's run (`run lolcats-hybrid-long-same --from lolcats-hybrid`), the two stages side by side: 8K
    # passkey and greedy agreement of each, without the noise of a second stage 1-2 (-01a: 92% and 0.39; -06b: 48%
    # and 0.72, on other stage-2 models)
    "lolcats-hybrid-long-same": ["--preset", "lolcats-hybrid", "--long-finetune", "same", *SHARES],
    "lolcats-hybrid-long-new": ["--preset", "lolcats-hybrid", "--long-finetune", "new", "--long-lr", "1e-3", *SHARES],
    # the lr: at 1e-3 the stage's loss fell further at 100M than at 79M (0.035 against 0.048) and 8K fell with it
    # (48% against 68%): does a tenth of the rate keep 8K? Baseline: -06b's run of the preset
    # Outcome (2026-12-06d, a branch on a run of the preset, one H100): no. Its loss ended at 0.27 (1e-3: 0.035) and
    # it retrieves 5% at 4K and 8K; with the linear branch zeroed 88% / 70%: the untrained linear branch drowns them
    "lolcats-hybrid-long-new-lr1e-4": ["--preset", "lolcats-hybrid", "--long-finetune", "new", "--long-lr", "1e-4",
                                       *SHARES],
    # the 8K stage on every attention module (kept softmax layers too) at stage 2's 1e-4, the MLPs, norms and embeddings
    # as the 1K rows left them (`--long-finetune attention`): between "new" (greedy 0.72, 8K 48%, -06b) and every weight
    # (greedy 0.39, 8K 92%, -01a). Does 8K come from the attention weights and the greedy drift from the rest? As a
    # branch on a run of the preset (`lolcats-hybrid lolcats-hybrid-long-attention@lolcats-hybrid`), which also gives
    # the preset's whole and window-only passkey on one stage-2 model (-06d's base lost them to an OOM)
    # Outcome (2026-12-06e, a branch on the preset's run, one H100): 8K no (52%; zeroed 92%), the greedy drift yes
    # (0.42; every weight 0.39). Passkey 98 / 100 / 98 / 100 / 93% at 1K-5K, docs -0.6%, the Bible +1.5%, chat 0.11
    "lolcats-hybrid-long-attention": ["--preset", "lolcats-hybrid", "--long-finetune", "attention", *SHARES],
    # the preset (its 8K stage on the conversion's weights) with a scalar decay gate on the linear branch: on every
    # weight the gate gave 4K 100% and greedy 0.49 (-01a); here the gate is one of the weights the 8K stage trains,
    # and it bounds what the linear state holds at 8K. Does it lift the preset's 8K (68% at 79M tokens, -06a; 48% at
    # 100M, -06b)? Baseline: -06b's run of the preset. -06d's branch at lr 1e-4 retrieved 70% at 8K with the linear
    # branch zeroed and 5% whole: a linear branch whose weight grows with the keys it sums drowns the softmax layers;
    # -06e: trained, it still costs at 8K (the preset 62% whole, 83% zeroed; the attention stage 52%, 92% zeroed)
    # Outcome (2026-12-06f, sharing one H100 with the next run, stage 3 13.7M tokens): 8K 70% (the preset 48% and
    # 62%), 1K-5K 93 / 98 / 98 / 100 / 97%, docs +0.0%, the Bible +0.9%, greedy 0.67, chat 0.42: a few points at
    # 8K, within two standard errors of the preset's runs, and 25 short of the target; the window-only 8K was cut
    "lolcats-hybrid-decay-new": ["--preset", "lolcats-hybrid", "--decay", "scalar", *SHARES],
    # the same with its 8K stage on every attention module, a branch on its stages 1-2
    # (`lolcats-hybrid-decay-new lolcats-hybrid-decay-long-attention@lolcats-hybrid-decay-new`): without the gate that
    # stage retrieved 98-100% at 1K-4K and 92% at 8K with the linear branch zeroed, 52% whole (-06e). With the branch
    # bounded, does the whole layer keep the 92%?
    # Outcome (2026-12-06f, stage 3 8.6M tokens sharing the GPU): no: 8K 60% (without the gate 52%), 4K 95%,
    # greedy 0.48, chat 0.05; docs -1.0%, the Bible +0.1%
    "lolcats-hybrid-decay-long-attention": ["--preset", "lolcats-hybrid", "--decay", "scalar", "--long-finetune",
                                            "attention", *SHARES],
    # the preset's 8K stage on the conversion's weights and every layer's MLP and norms, the teacher's attention
    # projections as stage 2 left them (`--long-finetune mlp`), at stage 2's lr 1e-4, as a branch on a run of the
    # preset (`lolcats-hybrid lolcats-hybrid-long-mlp@lolcats-hybrid`). The stage on every weight retrieved 92% at 8K
    # with greedy 0.39 (-01a), on the attention modules alone 52% with greedy 0.42 (-06e), on the conversion's
    # weights alone 48-62% with greedy 0.71-0.72 (-06b, -06e): if 8K comes from outside the attention modules and
    # the greedy drift from their projections, this stage keeps both
    # Outcome (2026-12-06g, stage 3 11.2M tokens sharing the GPU): no: 8K 82% and 1K-4K 100 / 100 / 100%, but
    # greedy 0.33, chat 0.14, top-1 88.9%; docs -0.7%, the Bible +1.7%; zeroed, its linear branch leaves 85% at 8K
    "lolcats-hybrid-long-mlp": ["--preset", "lolcats-hybrid", "--long-finetune", "mlp", *SHARES],
    # the same stage with the conversion's weights at the preset's 1e-3 and the teacher's MLPs and norms at 1e-5
    # (`--long-teacher-lr`), as a branch on a run of the preset. The mode at one rate (1e-4) fitted the 8K rows'
    # KD worse (0.109 against 0.039 at steps 600-684, -06g): its conversion's weights learn at 1e-3 (1e-4 alone: 5%
    # at 8K, -06d). Does a tenth of stage 2's rate on the MLPs keep greedy near 0.7 and lift 8K above 70%?
    # Outcome (2026-12-06h, stage 3 13.1M tokens sharing the GPU): no: 8K 67%, its base's own 40 of 60 beside it,
    # greedy 0.62 and chat 0.23 against the base's 0.73 and 0.43; docs -0.5%, the Bible +0.3%. With -06g's 1e-4
    # (82%, greedy 0.33) no rate on the MLPs gives both: 3e-5, planned beside it, was not run
    "lolcats-hybrid-long-mlp-teacher1e-5": ["--preset", "lolcats-hybrid", "--long-finetune", "mlp", "--long-lr", "1e-3",
                                            "--long-teacher-lr", "1e-5", *SHARES],
    # the preset's 8K-row stage on long documents alone (`--long-min-doc-tokens 8192`), as a branch on a run of the
    # preset (`lolcats-hybrid lolcats-hybrid-long-docs@lolcats-hybrid`). Its 8K rows are the mix's stream cut 8x
    # longer: chat (9 of the weights' 80), dictionary entries, fortunes, short pages; about 40% of their text (by bytes)
    # is in documents of 8K tokens or more, so most keys older than the window belong to other documents. Four runs of the
    # preset retrieve 59% at 8K whole and 83-92% with the linear branch zeroed: does a linear branch trained on 8K
    # tokens of one text stop drowning the softmax layers there (greedy, trained on the conversion's weights, kept)?
    # The carried corpora (chat left out) give 4,767 such rows (39.0M tokens; gcide, foldoc, wordnet, fortunes and
    # gnome-help none) against 11,941 without the flag (prepare_mix on this machine, 2026-12-06h); stage 3 takes ~2.2K.
    # -06i: not answered; a lease an hour late left 9-minute runs, whose stage 3 took one step each (its 8K graphs
    # compiled for 28 s of its ~30; stage 2 sets that first step aside since). Its 4,767 rows were built as measured
    # Outcome (2026-12-06j, stage 3 17.5M tokens, 1,069 steps, beside its base): no: 8K 41 of 60 against the base's 37
    # (one standard error 8.7 points), 5K 98% against 95%, the rest the base's: greedy 0.74, docs +0.3%, the Bible +1.3%
    "lolcats-hybrid-long-docs": ["--preset", "lolcats-hybrid", "--long-min-doc-tokens", "8192", *SHARES],
    # gdn-hybrid, the same long rows (a run of its own: the preset chooses its kept layers on the long rows, so they
    # may change too); baseline -30i / -30j: 100 / 100 / 100 / 88% at 1K / 2K / 4K / 8K, the Bible +8.7%, greedy 0.16
    "gdn-hybrid-long-docs": ["--preset", "gdn-hybrid", "--long-min-doc-tokens", "8192", *SHARES],
    # the preset's 8K-row stage at 3x its rate, as a branch on a run of the preset (`lolcats-hybrid
    # lolcats-hybrid-long-lr3e-3@lolcats-hybrid`). On the conversion's weights the rate is what bought 8K so far:
    # at 1e-4 5% (-06d), at the preset's 1e-3 60% over five runs, with greedy 0.71-0.74 (the teacher's weights stay
    # as stage 2 left them). Does 3e-3 lift 8K toward the window alone's 75-92% with the greedy answers kept?
    # Outcome (2026-12-06k, stage 3 12.1M tokens, 739 steps, beside its base's 998 at 1e-3, a lease 10 minutes late):
    # no: 8K 29 of 60 against the base's 32, 4K 95% against 98%, its stage-3 loss lower (0.032 against 0.036); the
    # rest the base's: greedy 0.77, docs +0.2%, the Bible +1.2% / +1.1%. Past 1e-3 the rate is not the lever
    "lolcats-hybrid-long-lr3e-3": ["--preset", "lolcats-hybrid", "--long-lr", "3e-3", *SHARES],
    # gdn-hybrid's 8K-row stage on the conversion's weights alone at 1e-3 (lolcats-hybrid's choice), as a branch on a
    # run of the preset: on lolcats-hybrid that stage instead of one on every weight kept greedy at 0.69-0.74
    # against 0.39, with 4K at 100%. gdn-hybrid misses greedy (0.16, 0.5 wanted) and the Bible (+8.7%): are they the
    # 8K-row stage's drift too, and what does its 8K (88%) keep?
    # Outcome (2026-12-06l, stage 3 17.1M tokens, 1,044 steps, beside its base's 1,081 on one H100): no: greedy 0.22
    # against the base's 0.16 (2 and 1 exact of 32), the Bible +8.0% against +8.7%, 8K 49 of 60 against 54, docs
    # -0.6% / -0.9%, top-1 86.0 / 85.8%. The greedy miss is stages 1-2's: at the same top-1 (84-86%) the window
    # layers (lolcats, swa at 128) give 0.46-0.48 and every gdn-hybrid run 0.16-0.29
    "gdn-hybrid-long-new": ["--preset", "gdn-hybrid", "--long-finetune", "new", "--long-lr", "1e-3", *SHARES],
    # the preset with half of stage 2 on the 8K rows instead of a quarter: the quarter raised 4K / 8K from 55% / 20%
    # to 100% / 85% (-28c); at 60 trials the preset's 8K is 53 of 60 in three runs, the teacher 57 (target 95%)
    # Outcome (2026-11-30k): 47 of 60 at 8K (78%; the preset 159 of 180), the Bible +8.6%, docs -0.9%: no gain
    "gdn-hybrid-long50": ["--preset", "gdn-hybrid", "--long-share", "0.5", *SHARES],
    # gdn-hybrid with a softmax window of 192 keys and 4 sinks beside every Gated DeltaNet layer
    # (GatedDeltaNetConfig(window=192, sinks=4): o = window + gamma_h * gdn, gamma from 0, so the layer starts as
    # lolcats' window alone). Both of the preset's misses sit where a window would hold the context: its greedy
    # answers (0.16-0.29 over 19 runs; lolcats-hybrid's window layers 0.71-0.77) and the Bible's first 256 tokens
    # (1.08-1.10 of the teacher's perplexity there; lolcats-hybrid 0.99-1.01). Does the window fix them and keep
    # Gated DeltaNet's 8K (89% over three runs; lolcats-hybrid 59%)?
    # Outcome (2026-12-07a, stage 3 12.2M tokens, 747 steps, beside the next run on one H100): yes for both misses:
    # the docs -0.7%, the Bible +1.1% (by position 0.97 / 1.01 / 1.02, level), top-1 92.5%, greedy 0.51 (12 exact of
    # 32), chat 0.20; passkey 95 / 98 / 100 / 92% at 1K / 2K / 4K / 8K (the window alone 92 / 97 / 100 / 83%)
    # (the preset's 8K stage on every weight, as the preset had it then: `--long-finetune same` since the preset's is "new")
    "gdn-hybrid-window": ["--preset", "gdn-hybrid", "--window", "192", "--sinks", "4", "--long-finetune", "same",
                          *SHARES],
    # the same with its 8K stage on the conversion's weights at 1e-3 (the window's projections stay as stage 2 left
    # them): on lolcats-hybrid a stage on every weight drifted the greedy answers (0.39 against 0.69-0.77); a branch
    # `gdn-hybrid-window-long-new@gdn-hybrid-window`
    # Outcome (2026-12-07a, stage 3 8.0M tokens, 490 steps): every gdn-hybrid target in one run: the docs +0.1%, the
    # Bible +0.8%, top-1 93.6%, greedy 0.64 (16 exact of 32), chat 0.34, passkey 95 / 98 / 100 / 95% (the teacher's
    # own; the window alone 92 / 97 / 98 / 70%): the gdn-hybrid preset since (so `gdn-hybrid` runs it too).
    # Again as `gdn-hybrid` (2026-12-07b, alone on one H100, stage 3 18.8M tokens, 1,145 steps, the chat answers made
    # afresh): the docs -0.2%, the Bible -0.4%, top-1 93.6%, greedy 0.62, chat 0.24, passkey 93 / 98 / 100 / 87%
    # (the window alone 58 / 93 / 98 / 37%): 8K 109 of 120 over the two runs, 91%. A third time (2026-12-07c, alone on
    # one H100, 69M tokens, passkey at 120 trials): 0.0% / -0.4%, greedy 0.65, 94 / 98 / 100 / 96% (the teacher 96 / 98
    # / 100 / 97%): over the three 8K 224 and 1K 226 of 240 (the teacher 231 and 229)
    "gdn-hybrid-window-long-new": ["--preset", "gdn-hybrid", "--window", "192", "--sinks", "4", "--long-finetune",
                                   "new", "--long-lr", "1e-3", *SHARES],
    # gdn-hybrid-window's recipe as a branch of the preset (`gdn-hybrid-long-same@gdn-hybrid`: a branch differs from
    # its base in the 8K stage's flags alone): its 8K stage on every weight at stage 2's rate, 92% at 8K in -07a
    # against the preset's 95% and 87% (-07a, -07b): the two on one stage-2 model
    "gdn-hybrid-long-same": ["--preset", "gdn-hybrid", "--long-finetune", "same", *SHARES],
    # the same recipe in transformers' Qwen3.5 layer form: exported with `linearize export` (run `export`)
    "gdn-hybrid-qwen3_5": ["--preset", "gdn-hybrid", "--layout", "qwen3_5", *SHARES],
}

# held-out perplexity of a model folder in a fresh process, one document per row (transformers' Qwen3.5
# layer does not restart its state inside a packed row); argv[3] "linearize": import it first (a run's
# own model class), else the process must never import it (an export)
_PLAIN_PPL = r"""
import json, math, sys
import torch, torch.nn.functional as F
from transformers import AutoModelForCausalLM
folder, rows_file, with_linearize = sys.argv[1], sys.argv[2], sys.argv[3] == "linearize"
if with_linearize:
    import linearize
rows = torch.load(rows_file)
dev = "cuda" if torch.cuda.is_available() else "cpu"
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(dev).eval()
nll = n = 0
with torch.no_grad():
    for ids in rows:
        x = ids[None].to(dev)
        logits = model(input_ids=x, use_cache=False).logits[0, :-1].float()
        nll += F.cross_entropy(logits, x[0, 1:], reduction="sum").item()
        n += x.shape[1] - 1
assert with_linearize or not any(m.split(".")[0] == "linearize" for m in sys.modules), "linearize was imported"
print(json.dumps({"perplexity": math.exp(nll / n), "tokens": n, "class": type(model).__name__}))
"""


def _passkey_about(rows: list[tuple]) -> str:
    """The page's passkey sentence: the prompts behind every figure where they are one recorded number
    (the table's trials column otherwise; no sentence for runs without passkey)."""
    trials = {row[3] for row in rows}
    if not rows:
        return ""
    if len(trials) == 1 and isinstance(min(trials), int):
        return f" Passkey: {min(trials)} synthetic prompts per length."
    return " Passkey: synthetic prompts per length, as many as its table's trials column gives."


def _value(cmd: list[str], name: str) -> str:
    """The value argparse will use: the last occurrence."""
    return cmd[len(cmd) - 1 - cmd[::-1].index(name) + 1]


def _flag(cmd: list[str], name: str) -> int:
    return int(_value(cmd, name))


# sources a run adds to the lease's --data mix (folders under the data root of its --data, with weights)
MORE_DATA = {"gdn-hybrid-austen": "austen@7", "gdn-hybrid-text": "teacher-text@8", "gdn-hybrid-free": "teacher-text@8"}


def base_command(name: str, model: str, data: str, extra: str = "", split_batch: int = 1,
                 processes: int = 1) -> tuple[list[str], int]:
    """The run's ``linearize distill`` command without output and step flags, and its tokens per optimizer
    step. ``processes`` P > 1: the command under ``accelerate launch`` on P GPUs (DDP), each process
    taking 1/P of the run's rows a step, so that the optimizer steps on the same global batch."""
    if name in MORE_DATA:  # beside the mix's first source: /root/data/Documentation@5 -> /root/data/austen@7
        data += "," + os.path.join(os.path.dirname(data.split(",")[0]), MORE_DATA[name])
    base = ["linearize", "distill", model, "--data", data, *COMMON, *RUNS[name], *shlex.split(extra)]
    accum = _flag(base, "--grad-accum") if "--grad-accum" in base else 1
    for k, what in ((split_batch, "--split-batch"), (processes, "--processes")):
        batch = _flag(base, "--batch-size")
        if k > 1 and batch % k:
            raise SystemExit(f"{what} {k} does not divide the batch size {batch}")
    if split_batch > 1:  # the same tokens per optimizer step in 1/K of the activation memory
        accum *= split_batch
        base += ["--batch-size", str(_flag(base, "--batch-size") // split_batch), "--grad-accum", str(accum)]
    per_step = _flag(base, "--seq-len") * _flag(base, "--batch-size") * accum
    if processes > 1:
        base += ["--batch-size", str(_flag(base, "--batch-size") // processes)]
        mixed = _value(base, "--mixed-precision") if "--mixed-precision" in base else "no"
        # the launcher by module (no console script needed); one port per run (several runs on a host)
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
                  "--num_machines", "1", "--main_process_port", str(29500 + sum(map(ord, name)) % 1000),
                  "--mixed_precision", mixed, "--dynamo_backend", "no", "-m", "linearize.cli"]
        base = [*launch, *base[1:]]
    return base, per_step


# the flags in which a branch (`run NAME --from BASE`) may differ from its base: the long-row stage's
STAGE3_FLAGS = ("--long-finetune", "--long-lr", "--long-teacher-lr", "--long-min-doc-tokens")
EARLY_STAGES = {"stage1": "stage1_attention_transfer", "stage2": "stage2_kd"}  # distill.json key -> stage name


def _without_stage3(argv: list[str]) -> list[str]:
    return [a for i, a in enumerate(argv) if a not in STAGE3_FLAGS and (i == 0 or argv[i - 1] not in STAGE3_FLAGS)]


def _stage_done(ckpt: Path) -> bool:
    # read only: recipes/train.py's read_checkpoint first recovers an interrupted swap, which here would race
    # the base run's own save; meta.json is written last, inside that atomic swap (save_checkpoint)
    meta = ckpt / "meta.json"
    return meta.is_file() and json.loads(meta.read_text()).get("done", False)


def branch_from(name: str, base: str, runs: Path, timeout_s: float, poll_s: float = 5.0) -> float:
    """Start run ``name`` from run ``base``'s stages 1 and 2: wait for its finished stage-2 checkpoint,
    then copy its stage checkpoints, their metrics lines and the fitted step counts into ``name``'s
    folder, so that ``linearize distill --resume`` trains only the long-row stage (the two recipes may
    differ in STAGE3_FLAGS alone: the same data, seed and stages 1-2, a clean comparison of that
    stage). Returns the seconds waited."""
    if base not in RUNS:
        raise SystemExit(f"--from {base}: not a run of RUNS")
    if RUNS[name] == RUNS[base] or _without_stage3(RUNS[name]) != _without_stage3(RUNS[base]):
        raise SystemExit(f"{name} cannot start from {base}'s stage 2: the two must differ in the long-row stage's flags "
                         f"({', '.join(STAGE3_FLAGS)}) and nothing else")
    src, out = runs / base, runs / name
    if (out / "branch.json").is_file():  # copied before; an interrupted branch resumes itself
        return 0.0
    ckpt = src / "checkpoints" / EARLY_STAGES["stage2"]
    t0 = time.time()
    while not _stage_done(ckpt):
        if (runs / f"{base}.rc").exists():
            raise SystemExit(f"{base} ended without a finished stage 2 in {ckpt}: nothing to start {name} from")
        if time.time() - t0 > timeout_s:
            raise SystemExit(f"{base}'s stage 2 did not finish within {timeout_s:.0f} s ({ckpt})")
        time.sleep(poll_s)
    waited = time.time() - t0
    tmp = runs / f".{name}.partial"  # the branch's folder appears whole or not at all
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "checkpoints").mkdir(parents=True)
    for stage in EARLY_STAGES.values():
        if (src / "checkpoints" / stage).is_dir():
            shutil.copytree(src / "checkpoints" / stage, tmp / "checkpoints" / stage)
        if (src / f"loss_{stage}.png").is_file():
            shutil.copy(src / f"loss_{stage}.png", tmp)
    lines = (src / "metrics.jsonl").read_text().splitlines(keepends=True)
    (tmp / "metrics.jsonl").write_text("".join(x for x in lines if json.loads(x).get("stage") in EARLY_STAGES.values()))
    if (src / "budget.json").is_file():  # the counts --max-minutes fitted; the base's stage 3 fits its own
        fitted = json.loads((src / "budget.json").read_text())["fitted_steps"]
        (tmp / "budget.json").write_text(json.dumps({"fitted_steps": {k: fitted[k] for k in EARLY_STAGES if k in fitted}},
                                                    indent=2))
    (tmp / "branch.json").write_text(json.dumps({"from": base, "stages": list(EARLY_STAGES)}, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"{name}: stages 1-2 from {base} (waited {waited:.0f} s for them)", flush=True)
    return waited


def cmd_run(args) -> None:
    runs = Path(args.runs)
    out = runs / args.name
    if (out / "eval.json").exists():
        print(f"{out} is finished; nothing to do")
        return
    minutes = args.minutes
    if args.from_run:  # the budget counts from when the base's stage 2 is there
        minutes -= branch_from(args.name, args.from_run, runs, timeout_s=minutes * 60) / 60
    base, _ = base_command(args.name, args.model, args.data, args.extra, args.split_batch, args.processes)
    if args.from_run and "--budget-reserve" in base:
        # the evaluation a branch ends with is its base's, whatever its shorter budget: the same seconds for it
        share = float(_value(base, "--budget-reserve")) * args.minutes / max(minutes, 1e-9)
        base += ["--budget-reserve", f"{min(share, 0.85):.3g}"]
    command = runs / f"{args.name}.command.txt"  # beside the run: --overwrite empties the run folder
    cmd = [*base, "--out", str(out), "--max-minutes", f"{minutes:g}"]
    runs.mkdir(parents=True, exist_ok=True)
    command.write_text(shlex.join(cmd) + (f"  # stages 1-2: {args.from_run}'s\n" if args.from_run else "\n"))
    if (out / "metrics.jsonl").exists():  # interrupted, or a branch: continue it (the budget is kept in the run folder)
        cmd.append("--resume")
    else:
        cmd.append("--overwrite")
    subprocess.run(cmd, check=True)


def cmd_export(args) -> None:
    """Export a finished run to transformers' Qwen3.5 layout and compare held-out perplexity: the run's
    model in a process that imports linearize, the export in one that imports transformers only, on the
    same documents (one per row, up to --seq-len tokens). Writes ``<run>/export_check.json``."""
    import torch
    from transformers import AutoTokenizer

    run = Path(args.runs) / args.name
    out = Path(args.runs) / f"{args.name}-export"
    subprocess.run(["linearize", "export", str(run), "--format", "qwen3_5", "--out", str(out), "--overwrite"], check=True)
    tok = AutoTokenizer.from_pretrained(run)
    docs = json.loads((run / "held_out.json").read_text())
    rows = [torch.tensor(t[: args.seq_len]) for t in tok(docs, add_special_tokens=False).input_ids if len(t) >= 32]
    rows = rows[: args.max_docs]
    rows_file = out / "rows.pt"
    torch.save(rows, rows_file)

    def perplexity(folder: Path, mode: str) -> dict:
        done = subprocess.run([sys.executable, "-c", _PLAIN_PPL, str(folder), str(rows_file), mode], check=True,
                              capture_output=True, text=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    ours, exported = perplexity(run, "linearize"), perplexity(out, "plain")
    check = {"documents": len(rows), "tokens": exported["tokens"], "linearize_perplexity": ours["perplexity"],
             "exported_perplexity": exported["perplexity"], "exported_class": exported["class"]}
    check["relative_difference"] = check["exported_perplexity"] / check["linearize_perplexity"] - 1
    (run / "export_check.json").write_text(json.dumps(check, indent=2))
    rows_file.unlink()
    print(json.dumps(check))


def _fmt(x, digits=3) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def _fmt_se(ev: dict, key: str) -> str:
    """A greedy agreement and, where the run recorded it (runs after 2026-12-06l), its standard error."""
    se = ev.get(f"{key}_se")
    return _fmt(ev.get(key)) + ("" if se is None else f" ± {se:.3f}")


def _beyond_rows(name: str, ev: dict) -> list[str]:
    """The run's row of fluency, chat and window-only figures; none for an eval.json from before them."""
    wo = ev.get("window_only", {})
    keys = ("fluency_teacher_ppl_of_student", "chat_prefix_agreement")
    if not wo and not any(k in ev for k in keys):
        return []
    return [f"| {name} | {_fmt(ev.get('fluency_teacher_ppl_of_student'), 2)} | {_fmt(ev.get('fluency_teacher_ppl_of_teacher'), 2)} | "
            f"{_fmt_se(ev, 'chat_prefix_agreement')} | {_fmt(ev.get('chat_exact_match'))} | "
            f"{_fmt(ev.get('chat_teacher_ppl_of_student'), 2)} | {_fmt(ev.get('chat_teacher_ppl_of_teacher'), 2)} | "
            f"{_fmt(wo.get('perplexity'), 2)} | {_fmt(ev.get('perplexity') if wo else None, 2)} | "
            f"{_fmt(wo.get('top1_agreement'))} |"]


def median_step_seconds(run: Path) -> dict[str, float]:
    """Each stage's median seconds a step, from the run's ``metrics.jsonl`` (or the ``.gz`` kept in
    docs/): the step-to-step differences of its elapsed time (tokens over the stage's tokens/s so far).
    The median leaves out the first steps' compilation, which the stage's tokens/s includes."""
    path = next((p for p in (run / "metrics.jsonl", run / "metrics.jsonl.gz") if p.exists()), None)
    if path is None:
        return {}
    elapsed: dict[str, list[float]] = {}
    with (gzip.open(path, "rt") if path.suffix == ".gz" else path.open()) as f:
        for line in f:
            r = json.loads(line)
            if r.get("tok_per_s"):
                elapsed.setdefault(r["stage"], []).append(r["tokens"] / r["tok_per_s"])
    return {stage: statistics.median(b - a for a, b in zip(e, e[1:])) for stage, e in elapsed.items() if len(e) > 1}


def _section(title: str, head: list[str], rows: list[str]) -> list[str]:
    """A page section with its table, or nothing when no run has its figures."""
    return [f"## {title}", "", *head, *rows, ""] if rows else []


def _position_section(rows: list[tuple[str, str, dict]]) -> list[str]:
    """The perplexity ratio to the teacher by band of document positions (recipes/evaluate.py
    ``position_bands``), a column per band any run recorded, in the order they were recorded."""
    bands = list(dict.fromkeys(b for _, _, ratios in rows for b in ratios))
    return _section("By position in the document", [
        "The perplexity ratio to the teacher on each corpus, by how many tokens of its own document precede",
        "the predicted token in its row, the context the model sees (`recipes/evaluate.py` `position_bands`).",
        "A ratio that grows with the position is context the student's state loses; one that stays level is",
        "its fit to the text itself.", "",
        f"| run | corpus | {' | '.join(bands)} |", "|---|---|" + "---|" * len(bands)],
        [f"| {name} | {corpus} | {' | '.join(_fmt(ratios.get(b)) for b in bands)} |" for name, corpus, ratios in rows])


def _about_data(sources: list[dict] | None) -> list[str]:
    """What the runs trained on: the Linux docs, or the mix that ``distill.json`` records."""
    if not sources or len(sources) == 1:
        return ["Data: the Linux kernel documentation (`linux-doc-6.1`, every `.rst`/`.txt` file one document), packed",
                "to 1024 tokens with position ids restarting at each document; 5% of the documents (chosen by text",
                "hash) are held out, and every figure below is measured on them, beside the teacher on the same inputs."]
    tokens = sum(x.get("distinct_tokens", x.get("tokens", 0)) for x in sources)
    return [f"Data: a weighted mix of {len(sources)} sources (`--data` in the commands below; "
            f"{tokens / 1e6:.0f}M distinct training tokens, `scripts/device/corpus.py`), packed to 1024 tokens with",
            "position ids restarting at each document; 5% of each source's documents (chosen by text hash) are",
            "held out. The in-domain figures are the first `--eval-rows` packed rows of the held-out documents,",
            "beside the teacher on the same inputs."]


def cmd_write(args) -> None:
    from linearize.hub import passkey_disagreements, stage_records

    runs = Path(args.runs)
    sections = []
    summary = [("| run | GPUs | training tokens | training time (s) | tokens/s | peak GPU mem (GiB) | perplexity | teacher | ratio "
               "| top-1 agreement | greedy agreement (prefix share) | greedy exact match |"),
               "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    passkey_rows, beyond, corpora_rows, export_rows, step_rows, recall_rows = [], [], [], [], [], []
    position_rows = []  # (run, corpus, {band: ratio}): the table's columns are the bands any run recorded
    sources = None
    for name in RUNS:
        d = runs / name
        if not (d / "eval.json").exists():
            continue
        ev = json.loads((d / "eval.json").read_text())
        dj = json.loads((d / "distill.json").read_text())
        if (d / "branch.json").is_file():  # stages 1-2 trained once, in the base run: its records count here
            branch = json.loads((d / "branch.json").read_text())
            base_dj = runs / branch["from"] / "distill.json"
            if not base_dj.is_file():
                raise SystemExit(f"{name} took its stages 1-2 from {branch['from']}, whose distill.json is not in {runs}")
            dj.update({k: json.loads(base_dj.read_text())[k] for k in branch["stages"]})
        stages = stage_records(dj)
        tokens = sum(s["tokens"] for s in stages)
        seconds = sum(s["seconds"] for s in stages)
        peak = max((s.get("peak_gpu_mem_gib", 0) for s in stages), default=0)
        ppl, tppl = ev.get("perplexity"), ev.get("teacher_perplexity")
        ratio = ppl / tppl if ppl and tppl else None
        gpus = max((s.get("processes", 1) for s in stages), default=1)  # runs before it was recorded: one
        summary.append(f"| {name} | {gpus} | {tokens / 1e6:.1f}M | {seconds:.0f} | {tokens / max(seconds, 1e-9):,.0f} | {peak:.1f} | "
                       f"{_fmt(ppl, 2)} | {_fmt(tppl, 2)} | {_fmt(ratio)} | {_fmt(ev.get('top1_agreement'))} | "
                       f"{_fmt_se(ev, 'generation_prefix_agreement')} | {_fmt(ev.get('generation_exact_match'))} |")
        step_rows += [f"| {name} | {stage} | {sec:.3f} |" for stage, sec in median_step_seconds(d).items()]
        for L, acc in ev.get("passkey", {}).items():
            # the student's trials behind the figure (fewer than --passkey-trials once the deadline cut
            # them); runs from before 2026-11-29b did not record them ("n/a")
            n = ev.get("passkey_trials", {}).get(L, "n/a")
            wo = ev.get("window_only", {})
            w, wn = wo.get("passkey", {}).get(L), wo.get("passkey_trials", {}).get(L)
            if w is None and "window-only passkey trials" in ev.get("cut_by_deadline", []):
                w = "cut by the deadline"  # the evaluation ran out of its budget before this length
            elif w is not None:
                w = _fmt(w, 2) + (f" ({wn} trials)" if wn is not None and wn != n else "")
            # the trials one of the two retrieved and the other did not, on the same prompts (recorded since
            # 2026-12-07c): the only trials that tell the student from the teacher
            mine, theirs = ev.get("passkey_hits", {}).get(L), ev.get("teacher_passkey_hits", {}).get(L)
            one = None if mine is None or theirs is None else "%d / %d" % passkey_disagreements(mine, theirs)
            passkey_rows.append((name, L, acc, n, ev.get("teacher_passkey", {}).get(L), w, one))
        beyond += _beyond_rows(name, ev)
        for corpus, c in [("held-out (in domain)", ev), *ev.get("corpora", {}).items()]:
            if "recall" in c and "other" in c:
                r, o = c["recall"], c["other"]
                recall_rows.append(f"| {name} | {corpus} | {r['share']:.1%} | {_fmt(r.get('perplexity_ratio'))} | "
                                   f"{_fmt(o.get('perplexity_ratio'))} |")
            if c.get("by_position"):
                position_rows.append((name, corpus, {b: f.get("perplexity_ratio") for b, f in c["by_position"].items()}))
        for corpus, c in ev.get("corpora", {}).items():
            corpora_rows.append(f"| {name} | {corpus} | {_fmt(c.get('perplexity'), 2)} | {_fmt(c.get('teacher_perplexity'), 2)} | "
                                f"{_fmt(c.get('perplexity_ratio'))} | {_fmt(c.get('top1_agreement'))} |")
        if (d / "export_check.json").exists():
            x = json.loads((d / "export_check.json").read_text())
            export_rows.append(f"| {name} | {x['documents']} | {x['tokens']} | {x['linearize_perplexity']:.4f} | "
                               f"{x['exported_perplexity']:.4f} | {x['relative_difference']:.1e} | `{x['exported_class']}` |")
        sources = sources or dj.get("data_sources")
        extra = f"softmax layers kept: {dj['softmax_layers']}\n\n" if dj.get("softmax_layers") else ""
        sections.append(f"### {name}\n\n{extra}```bash\n{(runs / f'{name}.command.txt').read_text().strip()}\n```\n")
    # the window hybrids' passkey with the linear branch zeroed: a column once any run recorded it
    wo_column = any(row[5] is not None for row in passkey_rows)
    # and the trials only one of student and teacher retrieved: a column once any run recorded them
    one_column = any(row[6] is not None for row in passkey_rows)
    passkey_head = ["| run | context | passkey | trials | teacher |" + (" window only |" if wo_column else "")
                    + (" retrieved by one alone (student / teacher) |" if one_column else ""),
                    "|---|---|---|---|---|" + ("---|" if wo_column else "") + ("---|" if one_column else "")]
    passkey_lines = [f"| {n} | {L} | {_fmt(a, 2)} | {k} | {_fmt(t, 2)} |" + (f" {w or 'n/a'} |" if wo_column else "")
                     + (f" {one or 'n/a'} |" if one_column else "") for n, L, a, k, t, w, one in passkey_rows]
    device = (runs / "device.txt").read_text().strip() if (runs / "device.txt").exists() else "unknown device"
    text = "\n".join([
        "# Distillation results: SmolLM2-135M-Instruct",
        "",
        f"Written by `python scripts/results.py write` from the runs of `python scripts/results.py run` on {device}.",
        "Teacher: the embedded SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to fp32).",
        *_about_data(sources),
        "Training in bf16 mixed precision; evaluation in fp32." + _passkey_about(passkey_rows),
        "",
        "## Summary",
        "",
        *summary,
        "",
        *_section("Passkey retrieval", passkey_head, passkey_lines),
        *_section("Fluency, chat answers and the window alone", [
            "Fluency: the teacher's perplexity of the student's greedy continuations of the held-out",
            "openings, beside that of its own (the floor). Chat: greedy answers to `--chat-prompts` through",
            "the chat template. Window only: the held-out perplexity of the window hybrids with their",
            "linear branch zeroed, beside the full layer's (what the linear part adds).",
            "",
            "| run | fluency | floor | chat agreement (prefix share) | chat exact match | teacher's ppl of the chat "
            "answers | teacher's ppl of its own | window-only perplexity | full layer | window-only top-1 |",
            "|---|---|---|---|---|---|---|---|---|---|"], beyond),
        *_section("Other corpora", [
            "Corpora never trained on (`--eval-data`), and a training source's own held-out documents alone",
            "(`--eval-held-out`, named `<source>-held-out`: comparable across runs on different mixes), each",
            "beside the teacher on the same rows.", "",
            "| run | corpus | perplexity | teacher | ratio | top-1 agreement |", "|---|---|---|---|---|---|"], corpora_rows),
        *_section("Recall tokens and the others", [
            "The perplexity ratio to the teacher on each corpus, split in two. Recall tokens complete a bigram",
            "already seen earlier in their document (Zoology's associative-recall hits, `recipes/evaluate.py`",
            "`recall_mask`): the model can predict them by finding that earlier occurrence. The other tokens",
            "are the rest.", "",
            "| run | corpus | recall tokens | ratio on them | ratio on the others |", "|---|---|---|---|---|"], recall_rows),
        *_position_section(position_rows),
        *_section("Step times", [
            "Each stage's median seconds a training step, from the run's `metrics.jsonl` (the first steps'",
            "compilation left out, unlike the summary's tokens/s).", "",
            "| run | stage | median step (s) |", "|---|---|---|"], step_rows),
        *_section("Export to the Qwen3.5 layout", [
            "`python scripts/results.py export RUN`: `linearize export RUN --format qwen3_5`, then held-out",
            "perplexity of the run's model through linearize and of the export in a process that imports",
            "transformers only (`Qwen3_5ForCausalLM`), on the same documents, one per row (1024 tokens at most).", "",
            "| run | documents | tokens | linearize model | exported model | relative difference | loaded as |",
            "|---|---|---|---|---|---|---|"], export_rows),
        "## Reproduce",
        "",
        "Each run is one `linearize distill` command (its step counts fitted to its `--max-minutes` budget",
        "from the rate it measured; the model folder is the GGUF saved with `save_pretrained`):",
        "",
        *sections,
        *([Path(args.notes).read_text()] if args.notes else []),
    ])
    start, end = markers(args.section)
    if Path(args.out).is_file() and start not in Path(args.out).read_text():
        # appended at the end of a page that has the other runs, it would land below its summary (a run's
        # section once did: quality.md had a second copy of -29i's at its end)
        raise SystemExit(f"{args.out} has no section {args.section!r}: put its heading and the markers "
                         f"{start} / {end} under 'Runs (generated)' first")
    write_section(args.out, args.section, text)
    print(text)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("name", choices=sorted(RUNS))
    r.add_argument("--model", required=True)
    r.add_argument("--data", required=True)
    r.add_argument("--runs", default="runs")
    r.add_argument("--minutes", type=float, required=True,
                   help="the whole run's budget (training, save, evaluation): linearize distill --max-minutes")
    r.add_argument("--split-batch", type=int, default=1, metavar="K",
                   help="micro-batches of 1/K of the run's batch with K-step gradient accumulation (runs sharing a GPU)")
    r.add_argument("--processes", type=int, default=1, metavar="P",
                   help="train on P GPUs under `accelerate launch` (DDP), each process 1/P of the run's batch: the "
                        "same global batch and recipe in about 1/P of the time (CUDA_VISIBLE_DEVICES picks the GPUs)")
    r.add_argument("--extra", default="", help="more distill flags, e.g. '--seq-len 128' (later flags win)")
    r.add_argument("--from", dest="from_run", default=None, metavar="BASE",
                   help="take stages 1-2 from run BASE (in --runs; waits for its stage 2) and train only the long-row "
                        f"stage: the two runs may differ in {', '.join(STAGE3_FLAGS)} alone")
    r.set_defaults(func=cmd_run)
    x = sub.add_parser("export", help="export a finished qwen3_5-layout run and compare its perplexity (GPU)")
    x.add_argument("name", choices=sorted(RUNS))
    x.add_argument("--runs", default="runs")
    x.add_argument("--seq-len", type=int, default=1024)
    x.add_argument("--max-docs", type=int, default=64)
    x.set_defaults(func=cmd_export)
    w = sub.add_parser("write")
    w.add_argument("runs")
    w.add_argument("--out", default=str(REPORTS / "quality.md"))
    w.add_argument("--section", default="results", help="the marked section of --out to write (<!-- NAME:start -->)")
    w.add_argument("--notes", default=None, help="markdown appended at the end (analysis of the runs)")
    w.set_defaults(func=cmd_write)
    args = p.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    sys.exit(main())
