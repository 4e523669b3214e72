"""Fuzz every Triton kernel against its float64 PyTorch reference with random cases.

One seeded generator (:func:`gen_case`) draws a case for one op: shapes (T = 1, T not a multiple
of the chunk, varlen with random boundaries and length-1 sequences, head dims 16..256 odd sizes
included), dtype (fp32/fp16/bf16), gate, normalizer, initial state, window.  :func:`run_case`
runs the kernel and the reference and returns the relative RMS error of every output, final
state and gradient; :func:`check_case` asserts them under dtype-aware tolerances.  A few cases
per hundred ask for a head dim the op refuses and check its error message instead.

The ops fuzzed (``OPS_BY_VERSION``; ``seed % len(ops)`` picks a case's op):

- generator 1: ``chunk`` (chunk_linear_attn, varlen, with gradients), ``window`` (the sliding-window
  hybrid, with gradients), ``split`` (split-K chunk forward), ``recurrent`` (decode step), ``hedgehog``
  (fused Hedgehog decode step), ``gdn_chunk`` (gated delta rule, with gradients), ``gdn_recurrent``.
- generator 2 adds the inference-only ops: ``hedgehog_features`` (linearize::
  hedgehog_features: GEMM + softmax over [y, -y], GQA keys read in place, strided x), ``window_decode``
  and ``window_decode_hedgehog`` (decode steps of the window hybrid from a ring buffer and a state
  updated in place: scalar/channel gates (the fused Hedgehog one's scalar only), padding, softcap,
  W = 1 .. 70, RoPE in the kernel, strided q/k/v of one projection), ``gdn_decode``
  (linearize::gated_delta_decode: conv cache, RoPE, norms and the gated delta step, state and conv
  cache in place), ``gdn_prologue`` and ``gdn_epilogue`` (the GDN prefill glue).  Their outputs and
  every tensor they update in place are checked.
- generator 3: version 2's cases, the window ops' (``window``, ``window_decode``,
  ``window_decode_hedgehog``) with attention sinks.
- generator 4 (the default) adds ``chunk_channel`` (chunk_linear_attn_channel, the per-channel decay
  chunk kernel, with gradients: packed documents in one row reset by the gate at each start, an
  initial state, strong decays on some channels) and gives the Hedgehog decode ops (``hedgehog``,
  ``window_decode_hedgehog``) a gate per key channel in half of their gated cases.

Generator versions: a version never changes what its seeds draw, so a GPU record
(docs/archive/kernels_fuzz_runs/*.json, which stores ``"generator"``; missing = 1) resumes and replays exactly as
it was run.  New ops come as a new version (``--generator N``; ``GENERATOR`` is the default): its
op list is longer, so its seed N is another case than version 1's seed N (replay an old seed with
``--generator 1``).  ``--resume`` takes the record's version.

tests/test_kernels_fuzz.py runs 394 tiny cases (30 per op, but 4 chosen seeds for chunk_channel,
seconds a case there) under TRITON_INTERPRET=1 (CI); on a GPU:

    python scripts/fuzz_kernels_gpu.py                  # 2,000 cases, writes docs/reports/kernels.md
    python scripts/fuzz_kernels_gpu.py --workers 12     # the same over 12 processes sharing the GPU
    python scripts/fuzz_kernels_gpu.py --smoke          # 2 tiny cases per op, prints the table only
    python scripts/fuzz_kernels_gpu.py --seed 1234      # replay one case, print its errors
    python scripts/fuzz_kernels_gpu.py --seed 1603 --pool 140 --generator 1   # replay a version-1 GPU seed
    python scripts/fuzz_kernels_gpu.py --resume docs/kernels_fuzz.json   # go on with a run cut by its budget

Relative RMS error: ||x - ref|| / ||ref|| over the whole tensor, ref in float64 from the same
(rounded) inputs.

A GPU case takes milliseconds; what takes the time is Triton compiling a kernel for each new
combination of head dims, dtype and flags (seconds on one CPU core).  ``--workers N`` runs the
seeds round-robin in N processes on the same GPU, so N compilations go on at once (they share
Triton's on-disk cache, so a kernel one worker built is loaded by the others).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import math
import os
import pathlib
import random
import signal
import sys
import time
import traceback

import torch
import torch.nn.functional as Fn

from benchlib import REPORTS, rel, write_section

OPS_V1 = ("chunk", "window", "split", "recurrent", "hedgehog", "gdn_chunk", "gdn_recurrent")
# Version 2 appends the inference-only ops (no autograd: outputs and in-place updated states are checked).
OPS_V2 = OPS_V1 + ("hedgehog_features", "window_decode", "window_decode_hedgehog", "gdn_decode", "gdn_prologue",
                   "gdn_epilogue")
INFERENCE_OPS = OPS_V2[len(OPS_V1):]  # (the others, chunk_channel too, are checked as version 1's are)
# Version 3: version 2's cases, those of the window ops (training and decode) with attention sinks
# (``sinks``, drawn from a stream of their own, so every other draw is version 2's).
# Version 4: version 3's ops and ``chunk_channel`` (the per-channel decay chunk kernel, with
# gradients); the Hedgehog decode ops' gates per key channel in half of their gated cases (from a
# stream of their own: every other draw of an op's case is version 3's).
OPS_V4 = OPS_V2 + ("chunk_channel",)
OPS_BY_VERSION = {1: OPS_V1, 2: OPS_V2, 3: OPS_V2, 4: OPS_V4}
GENERATOR = 4  # the version a run draws from unless told (--generator) or resuming an older record
OPS = OPS_BY_VERSION[GENERATOR]
# A GPU run's default variant pool: 20 compiled variants per op (version 1: the historical 140).
POOL_PER_OP = 20
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# Relative RMS tolerances per dtype for (outputs and states, gradients).  fp32 products are true
# fp32 ("ieee"); bf16/fp16 round the inputs of every dot and the GDN's stored w, u, v'.
TOL = {
    "linear": {"fp32": (5e-5, 2e-4), "fp16": (5e-3, 1e-2), "bf16": (3e-2, 6e-2)},
    "gdn": {"fp32": (2e-4, 5e-4), "fp16": (1e-2, 2e-2), "bf16": (5e-2, 1e-1)},
    # Version 2's inference-only ops (no gradients: both numbers are the outputs'). They compute in
    # fp32 from the rounded inputs with no long low-precision reduction, so in fp16/bf16 their error
    # is the final rounding of the output (worst over 1,200 CPU cases: fp32 2e-6, fp16 3e-4, bf16 4.7e-3;
    # one bf16 ulp is 2^-8..2^-7 relative): tighter than the linear family, a few ulps of headroom.
    # Their ring slots, conv cache and other pure copies must come out exact (tolerance 0).
    "inference": {"fp32": (5e-5, 5e-5), "fp16": (2e-3, 2e-3), "bf16": (2e-2, 2e-2)},
}
# Head dims the ops accept: [16, 256] (window: softmax dim <= 256).  Odd and non-power-of-2 sizes
# are masked tiles of the next power of 2.
DIMS_SMALL = (16, 17, 20, 24, 31, 32, 33, 40, 48)
DIMS_LARGE = (64, 65, 100, 128, 200, 256)
REJECTED_DIMS = (8, 15, 257, 300)


def _dim(rng: random.Random, tiny: bool) -> int:
    # tiny (interpreter) cases: large dims only now and then, and then with short sequences
    if rng.random() < (0.08 if tiny else 0.35):
        return rng.choice(DIMS_LARGE)
    return rng.choice(DIMS_SMALL)


def _lens(rng: random.Random, max_T: int) -> list[int]:
    n = rng.randint(1, 4)
    lens = [1 if rng.random() < 0.25 else rng.randint(1, max_T) for _ in range(n)]
    return lens


def ops_of(generator: int) -> tuple[str, ...]:
    """The ops of generator version ``generator`` (in the order ``seed % len(ops)`` picks them)."""
    if generator not in OPS_BY_VERSION:
        raise ValueError(f"unknown generator version {generator}: known {sorted(OPS_BY_VERSION)}")
    return OPS_BY_VERSION[generator]


def round_pool(pool: int, generator: int = GENERATOR) -> int:
    """A variant pool rounded up to a multiple of the version's op count, so that every op gets its
    share (0: none)."""
    n = len(ops_of(generator))
    return -(-pool // n) * n if pool else 0


def default_pool(tiny: bool, generator: int = GENERATOR) -> int:
    """--pool's default: none under the interpreter, POOL_PER_OP variants per op on a GPU (140 for version 1)."""
    return 0 if tiny else POOL_PER_OP * len(ops_of(generator))


def gen_case(seed: int, tiny: bool = True, pool: int = 0, generator: int = GENERATOR) -> dict:
    """A random case for one op (``seed % len(ops)`` picks the op, so every op gets its share).

    ``pool``: draw what Triton compiles a kernel for (dtype, head dims, flags) from seed % pool and
    the rest (batch, heads, lengths, boundaries, window, values) from the seed itself, so a run of
    many cases compiles at most ``pool`` variants (a multiple of the op count, rounded up).

    ``generator``: the version (``OPS_BY_VERSION``). A version's cases never change: version 1's
    dicts are exactly those of the generator before version 2 (no ``generator`` key); later
    versions' dicts carry ``"generator"``."""
    ops = ops_of(generator)
    return draw_case(seed, ops[seed % len(ops)], tiny, round_pool(pool, generator), generator)


def draw_case(seed: int, op: str, tiny: bool, pool: int, generator: int) -> dict:
    """:func:`gen_case`'s draws for ``op`` (``pool`` already rounded): what version ``generator``
    draws for seed ``seed`` were ``op`` its op (the tests compare versions op by op with it)."""
    rng = random.Random(seed)
    vr = random.Random(seed % pool) if pool else rng  # the variant's draws (the same stream without a pool)
    max_T = 80 if tiny else 600
    c = dict(seed=seed, op=op, dtype=vr.choice(["fp32", "fp32", "fp16", "bf16"]), B=rng.randint(1, 2),
             H=rng.randint(1, 2 if tiny else 4), gate=vr.random() < 0.6, h0=vr.random() < 0.5, lens=None,
             reject=None, pool=pool)
    r = rng.random()
    c["T"] = 1 if r < 0.15 else rng.choice([64, 128]) if r < 0.25 and not tiny else rng.randint(2, max_T)
    if op in ("chunk", "window", "gdn_chunk", "chunk_channel") and rng.random() < 0.35:
        c["lens"] = _lens(rng, max_T)
        c["B"], c["T"] = 1, sum(c["lens"])
    big = False
    if op in ("chunk", "window", "split", "recurrent", "chunk_channel"):
        c["F"], c["D"] = _dim(vr, tiny), _dim(vr, tiny)
        big = max(c["F"], c["D"]) >= 64
        c["normalize"] = True if op == "window" else vr.random() < 0.7
    if op == "chunk_channel":
        # (version 4) packed documents (lens) share one row, reset at each start; ``gate``: a mild
        # decay on every channel (else none); ``decay``: some channels decay by up to exp(-30) a step
        c["H"] = vr.randint(1, 2 if tiny else 4)  # a constexpr of the kernels: the variant's
        c["decay"] = rng.choice([0.0, 0.0, 0.0, 30.0])
    if op == "window":
        c["h0"] = False  # the window hybrid starts from an empty state (reference.py refuses one)
        c["W"] = rng.choice([1, rng.randint(2, 20), rng.randint(2, max(2, c["T"] + 5))])
        c["Dsm"] = vr.choice([8, 16, 17, 24, 32] + ([64, 128] if not tiny else []))
    if op == "split":
        c["lens"] = None
        c["num_splits"] = rng.randint(2, 4)
        c["T"] = rng.randint(65, 200) if tiny else rng.randint(65, 2000)  # more than one chunk (BT = 64)
    if op in ("recurrent", "gdn_recurrent", "hedgehog"):
        c["T"] = rng.choice([1, 1, rng.randint(2, 8)])
        c["h0"] = True  # a decode step always continues a state
    if op == "hedgehog":
        c["D"], c["Dv"] = vr.choice((16, 17, 24, 32, 64)), _dim(vr, tiny)
        c["P"] = vr.choice((8, 12, 16, 32) + ((64, 128) if not tiny else ()))
        c["Hkv"] = rng.choice([1, c["H"]])
        c["valid"] = vr.random() < 0.4
        big = c["Dv"] >= 64
    if op in ("gdn_chunk", "gdn_recurrent"):
        c["K"], c["V"] = _dim(vr, tiny), _dim(vr, tiny)
        big = max(c["K"], c["V"]) >= 64
        c["l2norm"] = vr.random() < 0.3
        c["decay"] = rng.choice([0.0, 0.0, 0.0, 30.0])
    if tiny and big and op not in ("recurrent", "gdn_recurrent", "hedgehog"):
        # the interpreter is slow: large head dims get a short sequence and one head
        c["H"] = 1
        if c["lens"]:
            c["lens"] = [min(n, 40) for n in c["lens"][:2]]
            c["T"] = sum(c["lens"])
        elif op != "split":
            c["T"] = min(c["T"], 40)
    if op in ("chunk", "gdn_chunk", "chunk_channel") and rng.random() < 0.04:
        c["reject"] = rng.choice(REJECTED_DIMS)
        c["T"], c["lens"], c["B"] = 3, None, 1
    if op in INFERENCE_OPS:  # (version 1 never gets here: its draws stay as they were)
        _gen_inference_op(c, rng, vr, tiny)
    if generator >= 3 and op in ("window", "window_decode", "window_decode_hedgehog"):
        c["sinks"] = random.Random(seed * 1_000_003 + 3).choice([0, 1, 2, 4, 9])
    if generator >= 4 and op in ("hedgehog", "window_decode_hedgehog") and c["gate"]:
        # half the gated cases per key channel, from a stream of the variant's own (the gate's kind is
        # compiled in): the gate kept or replaced, every other draw is version 3's
        if random.Random((seed % pool if pool else seed) * 1_000_003 + 4).random() < 0.5:
            c["gate"] = "channel"
    if generator != 1:
        c["generator"] = generator
    return c


# Head dims of the inference-only ops (version 2), each within what the op accepts: the Hedgehog
# feature kernel takes D, P in [1, 256]; the window decode kernels have no limit (registers: kept
# <= 128, as the layers use them); the fused GDN decode D <= 128 (its state lives in registers);
# the GDN prefill glue feeds the chunk kernel, [16, 256].
FEAT_DIMS = ((5, 16, 17, 24, 31, 32, 33, 48), (64, 65, 100, 128, 200, 256))
FEAT_COLS = ((7, 8, 12, 16, 32, 33), (64, 100, 128, 256))
WIN_DIMS = ((8, 16, 17, 24, 31, 32, 33), (64, 65, 128))  # the softmax part's head dim, the values
WIN_FEATS = ((8, 16, 17, 24, 32, 33), (64, 128))
WIN_HH_COLS = ((4, 6, 8, 12, 16, 17), (32, 64))  # Hedgehog's P (F = 2P features)
GDN_DECODE_DIMS = (DIMS_SMALL, (64, 65, 100, 128))
GDN_PREFILL_DIMS = (DIMS_SMALL, DIMS_LARGE)
# refused: the feature kernel above 256, the fused GDN decode above 128 (their messages are checked)
REJECTED_FEATURE_DIMS = (257, 300)
REJECTED_DECODE_DIMS = (129, 192, 256)


def _pick(vr: random.Random, tiny: bool, dims: tuple) -> int:
    # as _dim: large dims only now and then under the interpreter
    small, large = dims
    return vr.choice(large) if vr.random() < (0.08 if tiny else 0.35) else vr.choice(small)


def _rope_dims(vr: random.Random, D: int) -> int:
    """Rotary dims R (even, <= D) of a case: 0 (NoPE), partial or full."""
    kind = vr.choice(["none", "partial", "full"])
    full = D - D % 2
    if kind == "none" or full < 2:
        return 0
    return full if kind == "full" or full < 4 else 2 * vr.randint(1, full // 2 - 1)


def _gen_inference_op(c: dict, rng: random.Random, vr: random.Random, tiny: bool) -> None:
    """The draws of a version-2 op (inference only). Everything a kernel is compiled for (head dims
    and counts, which are constexpr there, flags, layouts, the ring size) comes from ``vr``; batch,
    lengths, positions and values from ``rng`` and the seed. ``gate``, ``h0`` and ``lens`` of the
    common draws are overwritten (``gate``: False or the kind of gate)."""
    op, dt = c["op"], c["dtype"]
    c["lens"], c["gate"], c["h0"] = None, False, op in ("window_decode", "window_decode_hedgehog", "gdn_decode")
    # GQA: Hkv key/value heads, H = Hkv * rep query heads (rep 3 included)
    c["Hkv"] = vr.choice([1, 2])
    c["H"] = c["Hkv"] * (vr.choice([1, 1, 2, 3]) if tiny else vr.choice([1, 2, 3, 4]))
    decode_T = rng.choice([1, 1, rng.randint(2, 4 if tiny else 8)])
    big = False
    if op == "hedgehog_features":
        c["D"], c["P"] = _pick(vr, tiny, FEAT_DIMS), _pick(vr, tiny, FEAT_COLS)
        c["out"] = vr.choice([dt, dt, "fp32"])
        c["strided"] = vr.random() < 0.5  # x a view of a wider projection output (read in place)
        big = max(c["D"], c["P"]) >= 64
        if rng.random() < 0.04:
            c["reject"] = rng.choice(REJECTED_FEATURE_DIMS)
            c["T"], c["B"] = 3, 1
    elif op in ("window_decode", "window_decode_hedgehog"):
        c["T"] = decode_T
        c["D"] = _pick(vr, tiny, WIN_DIMS)
        c["Dv"] = _pick(vr, tiny, WIN_DIMS)
        if op == "window_decode":
            del c["Hkv"]  # no GQA in the unfused op: every tensor per query head
            c["H"] = vr.randint(1, 2 if tiny else 4)
            c["F"] = _pick(vr, tiny, WIN_FEATS)
            c["fdtype"] = vr.choice(["fp32", dt])  # phi(q), phi(k) come in any dtype
            c["gate"] = vr.choice([False, "scalar", "channel"])
        else:
            c["P"] = _pick(vr, tiny, WIN_HH_COLS)
            c["gate"] = vr.choice([False, "scalar"])  # version 2 draws no per-channel gate here (the op takes them since)
            c["R"] = _rope_dims(vr, c["D"])
            c["strided"] = vr.random() < 0.5  # q, k, v views of one fused projection output
        c["W"] = vr.choice([1, 2, vr.randint(3, 9), vr.randint(10, 20 if tiny else 70)])
        c["valid"] = vr.random() < 0.5
        c["softcap"] = round(rng.uniform(1.0, 5.0), 3) if vr.random() < 0.3 else 0.0
        c["pos"] = rng.randint(0, 200)  # the layer's token count: where the ring's slots are
    elif op in ("gdn_decode", "gdn_prologue"):
        c["D"] = _pick(vr, tiny, GDN_DECODE_DIMS if op == "gdn_decode" else GDN_PREFILL_DIMS)
        c["layout"] = vr.choice(["separate", "concat", "per_head"])  # q|k|v columns of the projection
        if c["layout"] == "per_head":  # [q_h | k_h | v_h] per head (gpt_neox): no GQA in that layout
            c["Hkv"] = c["H"]
        c["conv"] = vr.choice([0, 2, 3, 4])  # the causal conv's taps (0: none)
        c["R"] = _rope_dims(vr, c["D"])
        c["valid"] = vr.random() < 0.5
        c["strided"] = vr.random() < 0.5  # y a view with more columns than the projection's
        if op == "gdn_decode":
            c["T"] = decode_T
            c["kv"] = vr.choice(["expand", "group"])  # a state per query head, or per key/value head
            if rng.random() < 0.04:
                c["reject"] = rng.choice(REJECTED_DECODE_DIMS)
                c["T"], c["B"] = 1, 1
        else:
            c["cache"] = c["conv"] > 0 and vr.random() < 0.5  # a continuation chunk reads the conv cache
            c["out"] = vr.choice([dt, dt, "fp32"])
            big = c["D"] >= 64
    elif op == "gdn_epilogue":
        del c["Hkv"]
        c["H"] = vr.randint(1, 2 if tiny else 4)
        c["D"] = _pick(vr, tiny, GDN_PREFILL_DIMS)
        c["g_off"] = vr.randint(0, 40)  # the o_gate columns' offset in the projection output
        c["extra"] = vr.choice([0, 0, 3])  # more columns after them
        c["out"] = vr.choice([dt, dt, "fp32"])
        big = c["D"] >= 64
    if tiny and big:  # the interpreter is slow: large head dims get a short sequence
        c["T"] = min(c["T"], 40)


def case_id(c: dict) -> str:
    if c["op"] in INFERENCE_OPS:
        return _inference_case_id(c)
    dims = "-".join(f"{k}{c[k]}" for k in ("F", "D", "Dsm", "Dv", "P", "K", "V", "W", "sinks") if k in c)
    shape = f"lens{'_'.join(map(str, c['lens']))}" if c["lens"] else f"B{c['B']}-T{c['T']}"
    gate = "-gate_channel" if c["gate"] == "channel" else "-gate" if c["gate"] else ""  # (channel: version 4)
    flags = gate + ("-h0" if c["h0"] else "") + ("" if c.get("normalize", True) else "-unnorm")
    if c["op"] == "chunk_channel" and c["decay"]:
        flags += f"-decay{c['decay']:g}"  # strong decays on some channels (gdn_chunk's ids never named theirs)
    rej = f"-reject{c['reject']}" if c["reject"] else ""
    return f"seed_{c['seed']}-{c['op']}-{c['dtype']}-{shape}-H{c['H']}-{dims}{flags}{rej}"


def _inference_case_id(c: dict) -> str:
    """case_id of a version-2 op (version-1 ids are as they were)."""
    dims = "-".join(f"{k}{c[k]}" for k in ("Hkv", "D", "F", "P", "Dv", "W", "sinks", "R", "conv", "pos", "g_off")
                    if k in c)
    flags = (f"-gate_{c['gate']}" if c["gate"] else "") + (f"-softcap{c['softcap']}" if c.get("softcap") else "")
    flags += "".join(f"-{k}" for k in ("valid", "strided", "cache") if c.get(k))
    flags += "".join(f"-{c[k]}" for k in ("kv", "layout") if k in c)
    flags += "".join(f"-{k}_{c[k]}" for k in ("out", "fdtype") if c.get(k, c["dtype"]) != c["dtype"])
    rej = f"-reject{c['reject']}" if c["reject"] else ""
    return f"seed_{c['seed']}-{c['op']}-{c['dtype']}-B{c['B']}-T{c['T']}-H{c['H']}-{dims}{flags}{rej}"


# ----------------------------------------------------------------------------- running a case

# A floor under the reference's RMS, per case dtype: fp16 flushes values below 2^-14 (its smallest
# normal) to subnormals and below 2^-24 to zero, so a tensor whose float64 RMS is far below that
# (a window gradient through keys decayed by exp(-20), 1e-13) is "zero" in fp16, and its relative
# error says nothing.  The inputs are O(1), so this is an absolute floor.  bf16 has fp32's range.
FLOOR = {"fp32": 0.0, "bf16": 0.0, "fp16": 2.0**-14}


# Unit roundoff of the dtype a case's kernels take their inputs in.
UNIT = {"fp32": 2.0**-24, "fp16": 2.0**-11, "bf16": 2.0**-8}
# A gradient that sums terms (a log gate's, the window weight's) may be off by this many roundings of
# the terms' size (term_norm_floor).
GATE_ROUNDINGS = 4


def gate_term_scale(q: torch.Tensor, k: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor,
                    lens: list[int] | None = None, per_channel: bool = False) -> torch.Tensor:
    """The size of the terms whose sum is a scalar log gate's gradient, (B, T, H); ``per_channel``:
    a per-channel gate's, (B, T, H, F) (channel f's own terms q_sf dq_sf - k_sf dk_sf, not summed over f).

    Scaling every decay by a factor moves q_s against k_r for s > r only, so the chunk kernels
    (as fla's) take dg_t = sum over s >= t of (q_s . dq_s - k_s . dk_s), within t's sequence. Where
    the gates decay hard that sum cancels to a tiny value, and the kernel's is the float rounding of
    terms many times larger (GPU seed 1253, fp32 gated delta rule with log gates down to -30: dg of
    1.6e-7 from terms of 14, computed as 4e-7). This returns sum over s >= t of (|q_s|.|dq_s| + |k_s|.|dk_s|)."""
    q, k, dq, dk = (x.detach().double().cpu() for x in (q, k, dq, dk))
    qs, ks = q.abs() * dq.abs(), k.abs() * dk.abs()
    terms = qs + ks if per_channel else qs.sum(-1) + ks.sum(-1)
    out = torch.empty_like(terms)
    start = 0
    for n in (lens or [terms.shape[1]]):
        seg = terms[:, start:start + n]
        out[:, start:start + n] = seg.flip(1).cumsum(1).flip(1)
        start += n
    return out


def _grads(out: list, leaves: list, gen: torch.Generator) -> list:
    """Gradients of sum_i <out_i, r_i> (random r_i, float64) for every leaf (zeros when unused)."""
    loss = sum((o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device)).sum()
               for o in out)
    gs = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, gs)]


def _both(fn, ref, leaves: dict, dtype, device, grad: bool):
    """Run ``fn`` on the leaves (cast: float tensors named in ``low`` to dtype) and ``ref`` on
    float64 copies of the same rounded values; returns {name: (got, want)}."""
    names = list(leaves)
    results = []
    for impl, dev_dtype in ((fn, None), (ref, torch.float64)):
        xs = {}
        for n, x in leaves.items():
            if x is None:
                xs[n] = None
                continue
            x = x.to(device)
            if dev_dtype is not None and x.is_floating_point():
                x = x.double()
            xs[n] = x.detach().clone().requires_grad_(grad and x.is_floating_point() and not n.startswith("_"))
        with torch.set_grad_enabled(grad):
            outs = impl(**xs)
        got = dict(outs)
        if grad:
            used = [n for n in names if xs[n] is not None and xs[n].requires_grad]
            gs = _grads(list(outs.values()), [xs[n] for n in used], torch.Generator().manual_seed(1))
            got.update({f"d{n}": g for n, g in zip(used, gs)})
        results.append(got)
    return {k: (results[0][k], results[1][k]) for k in results[0]}


class GuardedAllocations:
    """Out-of-bounds writes, found on the CPU: while active, every CPU tensor that ``torch.empty``,
    ``torch.zeros`` (and their ``_like`` / ``Tensor.new_*`` forms) allocates lies inside a larger
    buffer whose ``pad`` bytes on either side hold 0xFF; :meth:`check` raises when a byte of those
    guards changed. Under ``TRITON_INTERPRET=1`` a kernel's stores go straight to these buffers, so
    a store past the end of an output (a tile's unmasked tail) lands in a guard instead of passing
    unseen; and 0xFF bytes read as NaN in every float dtype, so an unmasked load past the end of a
    buffer the op allocated turns its result into NaN (an infinite error) instead of a silent zero. On a GPU the same write corrupts whatever lies next to the tensor, and an illegal address
    may follow much later, in another op (the H200 fuzz: illegal addresses spread over every op)."""

    NAMES = (("torch", "empty"), ("torch", "zeros"), ("torch", "empty_like"), ("torch", "zeros_like"),
             ("Tensor", "new_empty"), ("Tensor", "new_zeros"))

    def __init__(self, pad: int = 1 << 16):
        self.pad, self.buffers, self.saved = pad, [], {}

    def _alloc(self, shape, dtype, zero: bool):
        numel = math.prod(shape)
        nbytes = numel * dtype.itemsize
        buf = self.saved[("torch", "empty")](nbytes + 2 * self.pad, dtype=torch.uint8)
        buf.fill_(0xFF)
        body = buf[self.pad:self.pad + nbytes].view(dtype).view(shape)
        if zero:
            body.zero_()
        self.buffers.append((buf, nbytes, tuple(shape), dtype))
        return body

    def _wrap(self, real, kind: str, zero: bool):
        def alloc(*args, **kwargs):
            like = kind != "factory"
            src = args[0] if like else None
            rest = args[1:] if like else args
            allowed = {"dtype", "device"}
            if set(kwargs) - allowed or (like and kind == "like" and rest):
                return real(*args, **kwargs)
            if kind == "like":
                shape = tuple(src.shape)
                if not src.is_contiguous():
                    return real(*args, **kwargs)
            else:
                size = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)) else rest
                shape = tuple(int(n) for n in size)
            dtype = kwargs.get("dtype") or (src.dtype if like else torch.get_default_dtype())
            device = torch.device(kwargs.get("device") or (src.device if like else "cpu"))
            if device.type != "cpu" or math.prod(shape) == 0:
                return real(*args, **kwargs)
            return self._alloc(shape, dtype, zero)
        return alloc

    def __enter__(self):
        for owner, name in self.NAMES:
            obj = torch if owner == "torch" else torch.Tensor
            self.saved[(owner, name)] = getattr(obj, name)
        for owner, name in self.NAMES:
            obj = torch if owner == "torch" else torch.Tensor
            kind = "factory" if owner == "torch" and not name.endswith("_like") else (
                "like" if name.endswith("_like") else "new")
            setattr(obj, name, self._wrap(self.saved[(owner, name)], kind, "zeros" in name))
        return self

    def __exit__(self, *exc):
        for (owner, name), real in self.saved.items():
            setattr(torch if owner == "torch" else torch.Tensor, name, real)
        return False

    def check(self) -> None:
        for buf, nbytes, shape, dtype in self.buffers:
            before, after = buf[:self.pad], buf[self.pad + nbytes:]
            bad_after = (after != 0xFF).nonzero()
            bad_before = (before != 0xFF).nonzero()
            if len(bad_after) or len(bad_before):
                where = (f"{int(bad_after[-1]) + 1} bytes past its end" if len(bad_after)
                         else f"{self.pad - int(bad_before[0])} bytes before its start")
                raise AssertionError(f"out-of-bounds write: a {tuple(shape)} {str(dtype).removeprefix('torch.')} "
                                     f"tensor allocated during the op was written {where}")


def run_case(c: dict, device: str = "cuda") -> dict[str, float]:
    """Relative RMS error of every output, final state and gradient of case ``c``."""
    from linearize.kernels import gated_delta as gd
    from linearize.kernels import linear_attn as la

    gen = torch.Generator().manual_seed(c["seed"])
    dt = DTYPES[c["dtype"]]
    B, T, H = c["B"], c["T"], c["H"]
    N = len(c["lens"]) if c["lens"] else B
    cu = None
    if c["lens"]:
        cu = torch.tensor([0, *torch.tensor(c["lens"]).cumsum(0).tolist()], dtype=torch.int32, device=device)

    def rnd(*shape, pos=False, dtype=dt):
        x = torch.rand(*shape, generator=gen) if pos else torch.randn(*shape, generator=gen)
        return x.to(dtype)

    op = c["op"]
    if op in INFERENCE_OPS:
        return _run_inference_op(c, device, gen, rnd)
    if op == "chunk_channel":
        return _run_chunk_channel(c, device, gen, rnd)
    if op in ("chunk", "window", "split", "recurrent"):
        F, D = c["F"], c["D"]
        # non-negative features (what a feature map gives) so the normalizer stays away from 0
        leaves = dict(q=rnd(B, T, H, F, pos=True), k=rnd(B, T, H, F, pos=True), v=rnd(B, T, H, D),
                      log_g=-rnd(B, T, H, pos=True, dtype=torch.float32) * 0.3 if c["gate"] else None,
                      S0=rnd(N, H, F, D, dtype=torch.float32) if c["h0"] else None,
                      z0=rnd(N, H, F, pos=True, dtype=torch.float32) * 5 if c["h0"] else None)
        norm = c["normalize"]
        if op == "window":
            leaves.update(q_sm=rnd(B, T, H, c["Dsm"]), k_sm=rnd(B, T, H, c["Dsm"]),
                          gamma=torch.linspace(0.5, 2.0, H))
            W = c["W"]

            def call(impl):
                def f(q, k, v, log_g, S0, z0, q_sm, k_sm, gamma):
                    o, (S, z) = impl(q, k, v, log_g=log_g, window=W, q_sm=q_sm, k_sm=k_sm, sm_scale=0.35,
                                     window_weight=gamma, output_final_state=True, cu_seqlens=cu,
                                     sinks=c.get("sinks", 0))
                    return {"o": o, "S": S, "z": z}
                return f
            pairs = _both(call(la.chunk_linear_attn), call(la.linear_attn_ref), leaves, dt, device, True)
            floors = _gate_floors(c, pairs, leaves)
            # dgamma sums one term per token: judged by their size too (version-1 seeds 2122, 2654,
            # 5825: bf16 terms cancelling 240-650x to a value smaller than their rounding)
            terms = window_weight_terms(call(la.linear_attn_ref), leaves, device)
            floors["dgamma"] = term_norm_floor(c, "dgamma", terms.abs().sum((0, 1)))
            return _errors(pairs, FLOOR[c["dtype"]], sums={"dgamma": B * T}, norm_floors=floors)
        if op == "recurrent":
            def kern(q, k, v, log_g, S0, z0):
                state = (S0.detach().clone(), z0.detach().clone())
                o = la.fused_recurrent_linear_attn(q, k, v, log_g=log_g, normalize=norm, state=state)
                return {"o": o, "S": state[0], "z": state[1]}

            def ref(q, k, v, log_g, S0, z0):
                o, (S, z) = la.linear_attn_ref(q, k, v, log_g=log_g, normalize=norm, initial_state=(S0, z0),
                                               output_final_state=True)
                return {"o": o, "S": S, "z": z}
            return _errors(_both(kern, ref, leaves, dt, device, False), FLOOR[c["dtype"]])

        splits = c.get("num_splits")

        def call(impl, **kw):
            def f(q, k, v, log_g, S0, z0):
                o, (S, z) = impl(q, k, v, log_g=log_g, normalize=norm, output_final_state=True,
                                 initial_state=None if S0 is None else (S0, z0), cu_seqlens=cu, **kw)
                return {"o": o, "S": S, "z": z}
            return f
        if op == "split":
            return _errors(_both(call(la.chunk_linear_attn, num_splits=splits), call(la.linear_attn_ref),
                                 leaves, dt, device, False), FLOOR[c["dtype"]])
        pairs = _both(call(la.chunk_linear_attn), call(la.linear_attn_ref), leaves, dt, device, True)
        errs = _errors(pairs, FLOOR[c["dtype"]], norm_floors=_gate_floors(c, pairs, leaves))
        if norm and not c["h0"] and all(n == 1 for n in (c["lens"] or [T])):
            # every output is o_0 = v_0 (q k / (q k + eps)): dq and dk are eps-sized, all rounding
            del errs["dq"], errs["dk"]
        return errs

    if op == "hedgehog":
        D, Dv, P, Hkv = c["D"], c["Dv"], c["P"], c["Hkv"]
        gshape = (B, T, H, 2 * P) if c["gate"] == "channel" else (B, T, H)  # per key channel, or per head
        leaves = dict(q=rnd(B, T, H, D), k=rnd(B, T, Hkv, D), v=rnd(B, T, Hkv, Dv),
                      wq=rnd(H, D, P) * D ** -0.5, wk=rnd(H, D, P) * D ** -0.5,
                      log_g=-rnd(*gshape, pos=True, dtype=torch.float32) * 0.3 if c["gate"] else None,
                      _valid=(torch.rand(B, T, generator=gen) > 0.3).float() if c["valid"] else None,
                      S0=rnd(B, H, 2 * P, Dv, dtype=torch.float32),
                      z0=rnd(B, H, 2 * P, pos=True, dtype=torch.float32) * 5)

        def kern(q, k, v, wq, wk, log_g, _valid, S0, z0):
            state = (S0.detach().clone(), z0.detach().clone())
            o = la.fused_recurrent_hedgehog(q, k, v, wq, wk, log_g=log_g, valid=_valid, state=state)
            return {"o": o, "S": state[0], "z": state[1]}

        def ref(q, k, v, wq, wk, log_g, _valid, S0, z0):
            o, (S, z) = la.hedgehog_recurrent_ref(q, k, v, wq, wk, log_g=log_g, valid=_valid, state=(S0, z0))
            return {"o": o, "S": S, "z": z}
        return _errors(_both(kern, ref, leaves, dt, device, False), FLOOR[c["dtype"]])

    K, V = c["K"], c["V"]
    k = rnd(B, T, H, K, dtype=torch.float32)
    if not c["l2norm"]:
        k = Fn.normalize(k, dim=-1)
    g = Fn.logsigmoid(rnd(B, T, H, dtype=torch.float32) + 2.0)
    if c["decay"]:
        g = -torch.rand(B, T, H, generator=gen) * c["decay"]
    leaves = dict(q=rnd(B, T, H, K), k=k.to(dt), v=rnd(B, T, H, V), g=g,
                  beta=torch.rand(B, T, H, generator=gen) * 0.9 + 0.05,
                  h0=rnd(N, H, K, V, dtype=torch.float32) if c["h0"] else None)
    l2 = c["l2norm"]
    if op == "gdn_recurrent":
        def kern(q, k, v, g, beta, h0):
            state = h0.detach().clone()
            o = gd.fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, state=state, use_qk_l2norm=l2)
            return {"o": o, "S": state}

        def ref(q, k, v, g, beta, h0):
            o, S = gd.gated_delta_rule_ref(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                                           use_qk_l2norm=l2)
            return {"o": o, "S": S}
        return _errors(_both(kern, ref, leaves, dt, device, False), FLOOR[c["dtype"]])

    def call(impl):
        def f(q, k, v, g, beta, h0):
            o, S = impl(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True, use_qk_l2norm=l2,
                        cu_seqlens=cu)
            return {"o": o, "S": S}
        return f
    pairs = _both(call(gd.chunk_gated_delta_rule), call(gd.gated_delta_rule_ref), leaves, dt, device, True)
    # the inference path too (no autograd: the UT transform's inverse is not kept, and 16-bit inputs take
    # its tensor-core block products, chunk.UT_SOLVE), against the same reference
    with torch.no_grad():
        got = call(gd.chunk_gated_delta_rule)(**{n: None if x is None else x.to(device) for n, x in leaves.items()})
    pairs.update({f"{n} no-grad": (got[n], pairs[n][1]) for n in ("o", "S")})
    return _errors(pairs, FLOOR[c["dtype"]], norm_floors=_gate_floors(c, pairs, leaves))


def _run_chunk_channel(c: dict, device: str, gen: torch.Generator, rnd) -> dict[str, float]:
    """Version 4's ``chunk_channel``: chunk_linear_attn_channel, forward and backward, against
    linear_attn_channel_ref (the float64 step-by-step reference of tests/test_kernels_channel_gate.py).
    The kernel takes no cu_seqlens: packed documents share one row and the log gate resets the state
    at each start (-RESET_LOG_DECAY, as linearize/attention.py packs them for this kernel)."""
    from linearize.attention import reset_log_decay
    from linearize.kernels import linear_attn as la

    dt, B, T, H, F, D = DTYPES[c["dtype"]], c["B"], c["T"], c["H"], c["F"], c["D"]
    q, k, v = rnd(B, T, H, F, pos=True), rnd(B, T, H, F, pos=True), rnd(B, T, H, D)
    log_g = -rnd(B, T, H, F, pos=True, dtype=torch.float32) * 0.3 if c["gate"] else torch.zeros(B, T, H, F)
    if c["decay"]:  # strong decays on about half of the channels (per head)
        strong = torch.rand(H, F, generator=gen) < 0.5
        log_g = torch.where(strong, -torch.rand(B, T, H, F, generator=gen) * c["decay"], log_g)
    if c["lens"]:
        restart = torch.zeros(B, T, dtype=torch.bool)
        restart[:, torch.tensor(c["lens"]).cumsum(0)[:-1]] = True  # each document's first token but the first's
        log_g = reset_log_decay(restart, log_g, log_g.shape)
    leaves = dict(q=q, k=k, v=v, log_g=log_g,
                  S0=rnd(B, H, F, D, dtype=torch.float32) if c["h0"] else None,
                  z0=rnd(B, H, F, pos=True, dtype=torch.float32) * 5 if c["h0"] else None)
    norm = c["normalize"]

    def call(impl, **kw):
        def f(q, k, v, log_g, S0, z0):
            o, (S, z) = impl(q, k, v, log_g, normalize=norm, initial_state=None if S0 is None else (S0, z0), **kw)
            return {"o": o, "S": S, "z": z}
        return f
    pairs = _both(call(la.chunk_linear_attn_channel, output_final_state=True), call(la.linear_attn_channel_ref),
                  leaves, dt, device, True)
    errs = _errors(pairs, FLOOR[c["dtype"]], norm_floors=_gate_floors(c, pairs, leaves))
    docs = c["lens"] or [T]
    if norm and not c["h0"] and all(n == 1 for n in docs):
        del errs["dq"], errs["dk"]  # o_t = v_t for every token: dq, dk are eps-sized (as the chunk op's)
    if not norm and c["h0"] and len(docs) > 1:
        # z0 reaches the loss through z_T alone, across a reset: its gradient is exp(-128)-sized in
        # float64, 0 in float32
        del errs["dz0"]
    return errs


def _rope64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotate-half RoPE (``rotate_half``, as apply_rotary_pos_emb uses it) on the first
    R = cos.shape[-1] dims of x (B, T, h, D); cos, sin (B or 1, T, R). For the references whose
    kernels rotate q and k inside while the twin takes them rotated (window_decode_hedgehog_ref)."""
    from transformers.models.llama.modeling_llama import rotate_half

    R = cos.shape[-1]
    c, s = cos[:, :, None].to(x.dtype), sin[:, :, None].to(x.dtype)
    return torch.cat([x[..., :R] * c + rotate_half(x[..., :R]) * s, x[..., R:]], -1)


def _expect(t: torch.Tensor, dtype: torch.dtype, shape: tuple, name: str) -> None:
    if t.dtype != dtype or tuple(t.shape) != tuple(shape):
        raise AssertionError(f"{name}: {str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}, expected "
                             f"{str(dtype).removeprefix('torch.')} {tuple(shape)}")


def _rope_tables(c: dict, gen: torch.Generator, dt):
    """cos, sin (B or 1, T, R) of random positions in the activation dtype (as a model's rotary
    embedding gives them), or (None, None) without RoPE."""
    R = c.get("R", 0)
    if not R:
        return None, None
    rows = c["B"] if torch.rand((), generator=gen) < 0.5 else 1
    ang = torch.rand(rows, c["T"], R // 2, generator=gen) * 6
    ang = torch.cat([ang, ang], -1)
    return ang.cos().to(dt), ang.sin().to(dt)


def _valid(gen: torch.Generator, B: int, T: int) -> torch.Tensor:
    """[B, T] bool, about a third padding, the first row's last token padding (a pad in decode)."""
    valid = torch.rand(B, T, generator=gen) > 0.3
    valid[0, -1] = False
    return valid


def _run_inference_op(c: dict, device: str, gen: torch.Generator, rnd) -> dict[str, float]:
    """Version 2's ops: no autograd; the errors of the outputs and of every tensor updated in place
    (the kernel runs on clones of the inputs, the reference on float64 copies of the same values)."""
    from linearize.kernels.gated_delta import decode as gdd
    from linearize.kernels.gated_delta import prefill as gdp
    from linearize.kernels.linear_attn import features as hf

    # (the package's ``window_decode`` attribute is the function: the module by its full name)
    wd = importlib.import_module("linearize.kernels.linear_attn.window_decode")

    op, dt, floor = c["op"], DTYPES[c["dtype"]], FLOOR[c["dtype"]]
    B, T, H = c["B"], c["T"], c["H"]
    run = lambda kern, ref, leaves: _errors(_both(kern, ref, leaves, dt, device, False), floor)  # noqa: E731

    if op == "hedgehog_features":
        Hkv, D, P, out = c["Hkv"], c["D"], c["P"], DTYPES[c["out"]]
        pad = 3 if c["strided"] else 0  # x a view of rows D + 3 wide
        leaves = dict(xbuf=(2 * torch.randn(B, T, Hkv, D + pad, generator=gen)).to(dt),
                      w=(0.3 * torch.randn(H, D, P, generator=gen)).to(dt))

        def kern(xbuf, w):
            phi = hf.hedgehog_features(xbuf[..., :D], w, out)
            _expect(phi, out, (B, T, H, 2 * P), "phi")
            return {"phi": phi}

        def ref(xbuf, w):
            return {"phi": hf.hedgehog_features_ref(xbuf[..., :D], w, torch.float64)}
        return run(kern, ref, leaves)

    if op in ("window_decode", "window_decode_hedgehog"):
        hh = op == "window_decode_hedgehog"
        D, Dv, W = c["D"], c["Dv"], c["W"]
        W1 = W - 1
        F = 2 * c["P"] if hh else c["F"]
        Hkv = c["Hkv"] if hh else H
        gshape = {"scalar": (H,), "channel": (H, F)}.get(c["gate"])
        feats = lambda *shape: torch.softmax(torch.randn(*shape, generator=gen), -1)  # noqa: E731
        ring_valid = (torch.rand(B, W1, generator=gen) > (0.3 if c["valid"] else -1.0)).float()
        ring_valid[:, :torch.randint(0, min(2, W1) + 1, (), generator=gen)] = 0.0  # slots never filled (a short prompt)
        leaves = dict(
            log_g=-torch.rand(B, T, *gshape, generator=gen) * 0.5 if gshape else None,
            valid=_valid(gen, B, T) if c["valid"] else None,
            ring_k=rnd(B, W1, H, D), ring_phi_k=feats(B, W1, H, F), ring_v=rnd(B, W1, H, Dv),
            ring_log_g=-torch.rand(B, W1, *(gshape or (H,)), generator=gen) * 0.5 if gshape else torch.zeros(B, W1, H),
            ring_valid=ring_valid, S=torch.rand(B, H, F, Dv, generator=gen), z=torch.rand(B, H, F, generator=gen),
            pos=torch.tensor(c["pos"]))
        kw = dict(sm_scale=D ** -0.5, softcap=c["softcap"] or None)
        names = ("k", "phi_k", "v", "log_g", "valid")

        if c.get("sinks"):  # from a generator of their own: the other values stay version 2's
            gs, n = torch.Generator().manual_seed(c["seed"] + 17), c["sinks"]
            at = torch.randint(-1, c["pos"] + T, (B, n), generator=gs).float()  # -1: an empty slot
            leaves.update(sink_k=(2 * torch.randn(B, n, H, D, generator=gs)).to(dt),
                          sink_v=torch.randn(B, n, H, Dv, generator=gs).to(dt), _sink_at=at)

        def common(x):  # the keyword arguments both sides take, and the names of the updated tensors
            ring = {n: x[f"ring_{n}"] for n in names}
            sinks = None if x.get("sink_k") is None else dict(sink_k=x["sink_k"], sink_v=x["sink_v"],
                                                              sink_at=x["_sink_at"])
            return dict(log_g=x["log_g"], valid=x["valid"], ring=ring, state=(x["S"], x["z"]), pos=x["pos"],
                        sinks=sinks, **kw)

        def results(o, ring, S, z):
            return {"o": o, "S": S, "z": z, **{f"ring_{n}": ring[n] for n in names}}

        if not hh:
            fdt = DTYPES[c["fdtype"]]
            leaves.update(q_sm=rnd(B, T, H, D), qf=feats(B, T, H, F).to(fdt), k_sm=rnd(B, T, H, D),
                          kf=feats(B, T, H, F).to(fdt), v=rnd(B, T, H, Dv), gamma=torch.rand(H, generator=gen) + 0.5)

            def kern(**x):
                a = common(x)
                o = wd.window_decode(x["q_sm"], x["qf"], x["k_sm"], x["kf"], x["v"], gamma=x["gamma"], **a)
                _expect(o, dt, (B, T, H, Dv), "o")
                return results(o, a["ring"], *a["state"])

            def ref(**x):
                o, ring, (S, z) = wd.window_decode_ref(x["q_sm"], x["qf"], x["k_sm"], x["kf"], x["v"],
                                                       gamma=x["gamma"], **common(x))
                return results(o, ring, S, z)
            return run(kern, ref, leaves)

        # fused Hedgehog: q, k, v as views of one projection output [q heads | k heads | v heads]
        P = c["P"]
        nq, nk = H * D, Hkv * D
        width = nq + nk + Hkv * Dv
        cos, sin = _rope_tables(c, gen, dt)
        leaves.update(ybuf=rnd(B, T, width + (5 if c["strided"] else 0)), wq=(0.5 * torch.randn(H, D, P, generator=gen)).to(dt),
                      wk=(0.5 * torch.randn(H, D, P, generator=gen)).to(dt),
                      log_gamma=torch.rand(H, generator=gen) - 0.5, cos=cos, sin=sin)

        def qkv(y):
            q = y[..., :nq].unflatten(-1, (H, D))
            k = y[..., nq:nq + nk].unflatten(-1, (Hkv, D))
            v = y[..., nq + nk:width].unflatten(-1, (Hkv, Dv))
            return (q, k, v) if c["strided"] else (q.contiguous(), k.contiguous(), v.contiguous())

        def kern(**x):
            q, k, v = qkv(x["ybuf"])
            a = common(x)
            o = wd.fused_window_decode_hedgehog(q, k, v, x["wq"], x["wk"], log_gamma=x["log_gamma"], cos=x["cos"],
                                                sin=x["sin"], **a)
            _expect(o, dt, (B, T, H, Dv), "o")
            return results(o, a["ring"], *a["state"])

        def ref(**x):
            q, k, v = qkv(x["ybuf"])
            if x["cos"] is not None:  # the twin takes q and k rotated
                q, k = _rope64(q, x["cos"], x["sin"]), _rope64(k, x["cos"], x["sin"])
            o, ring, (S, z) = wd.window_decode_hedgehog_ref(q, k, v, x["wq"], x["wk"], log_gamma=x["log_gamma"],
                                                            **common(x))
            return results(o, ring, S, z)
        return run(kern, ref, leaves)

    if op in ("gdn_decode", "gdn_prologue"):
        Hkv, D, conv = c["Hkv"], c["D"], c["conv"]
        Hs = H if c.get("kv", "expand") == "expand" else Hkv
        qkv_names = {"q_proj": H * D, "k_proj": Hkv * D, "v_proj": Hkv * D} if c["layout"] == "separate" else \
            {"qkv": (H + 2 * Hkv) * D}
        widths = {**qkv_names, "a_proj": Hs, "b_proj": Hs, "o_gate": H * D}
        cols = gdd.gated_delta_decode_columns(widths, qkv=tuple(qkv_names), per_head=c["layout"] == "per_head",
                                              num_heads=H, num_kv_heads=Hkv, head_dim=D)
        width, C = sum(widths.values()), (H + 2 * Hkv) * D
        cos, sin = _rope_tables(c, gen, dt)
        leaves = dict(ybuf=rnd(B, T, width + (5 if c["strided"] else 0)),
                      conv_state=rnd(B, C, conv) if conv and c.get("cache", True) else None,
                      conv_weight=(0.5 * torch.randn(C, 1, conv, generator=gen)).to(dt) if conv else None,
                      cos=cos, sin=sin, valid=_valid(gen, B, T) if c["valid"] else None)
        heads = dict(cols=cols, num_heads=H, num_kv_heads=Hkv, head_dim=D)
        if op == "gdn_prologue":
            out = DTYPES[c["out"]]

            def kern(ybuf, conv_state, conv_weight, cos, sin, valid):
                q, k, v = gdp.gdn_prefill_prologue(ybuf[..., :width], conv_state=conv_state, conv_weight=conv_weight,
                                                   cos=cos, sin=sin, valid=valid, out_dtype=out, **heads)
                for n, x in zip("qkv", (q, k, v)):
                    _expect(x, out, (B, T, H, D), n)
                return {"q": q, "k": k, "v": v}

            def ref(ybuf, conv_state, conv_weight, cos, sin, valid):
                q, k, v = gdp.gdn_prefill_prologue_ref(ybuf[..., :width], conv_state=conv_state, conv_weight=conv_weight,
                                                       cos=cos, sin=sin, valid=valid, out_dtype=torch.float64, **heads)
                return {"q": q, "k": k, "v": v}
            return run(kern, ref, leaves)

        leaves.update(state=torch.randn(B, Hs, D, D, generator=gen) * 0.1, A_log=(torch.randn(Hs, generator=gen) * 0.5).to(dt),
                      dt_bias=torch.randn(Hs, generator=gen).to(dt), norm_weight=(torch.rand(D, generator=gen) + 0.5).to(dt),
                      norm_mix=torch.rand(H, generator=gen).to(dt))

        def kern(ybuf, state, conv_state, **x):
            o = gdd.fused_gated_delta_decode(ybuf[..., :width], state=state, conv_state=conv_state, **x, **heads)
            _expect(o, dt, (B, T, H * D), "o")
            return {"o": o, "S": state, **({"conv": conv_state} if conv else {})}

        def ref(ybuf, **x):
            o, S, conv_new = gdd.gated_delta_decode_ref(ybuf[..., :width], **x, **heads)
            return {"o": o, "S": S, **({"conv": conv_new} if conv else {})}
        return run(kern, ref, leaves)

    if op == "gdn_epilogue":
        D, g_off, out = c["D"], c["g_off"], DTYPES[c["out"]]
        leaves = dict(o=rnd(B, T, H, D), y=rnd(B, T, g_off + H * D + c["extra"]),
                      norm_weight=(torch.rand(D, generator=gen) + 0.5).to(dt), norm_mix=torch.rand(H, generator=gen).to(dt))

        def kern(o, y, norm_weight, norm_mix):
            r = gdp.gdn_prefill_epilogue(o, y, norm_weight=norm_weight, norm_mix=norm_mix, g_off=g_off, out_dtype=out)
            _expect(r, out, (B, T, H * D), "out")
            return {"out": r}

        def ref(o, y, norm_weight, norm_mix):
            return {"out": gdp.gdn_prefill_epilogue_ref(o, y, norm_weight=norm_weight, norm_mix=norm_mix, g_off=g_off,
                                                        out_dtype=torch.float64)}
        return run(kern, ref, leaves)
    raise ValueError(f"no runner for op {op!r}")


def window_weight_terms(ref, leaves: dict, device) -> torch.Tensor:
    """The per-token terms whose sum is the window weight's gradient, (B, T, H), from the float64
    reference: dgamma_h = sum over b, t of do_t . d o_t / d gamma_h. One Jacobian-vector product gives
    every token's d o_t / d gamma_h at once (each head's output depends on its own gamma only); do is
    the cotangent ``_grads`` draws for ``o`` (its first draw). Their sum is the reference's dgamma.
    (autograd's jvp, by double backward: forward-mode AD would script its decompositions with
    torch.jit, which the guarded allocations' patched factories break.)"""
    xs = {n: None if x is None else x.detach().to(device).double() for n, x in leaves.items()}
    gamma = xs.pop("gamma")
    o, jac = torch.autograd.functional.jvp(lambda g: ref(**xs, gamma=g)["o"], (gamma,), (torch.ones_like(gamma),))
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(o.device)
    return (do * jac).sum(-1).cpu()


def term_norm_floor(c: dict, name: str, scale: torch.Tensor) -> float:
    """The norm floor of a gradient that sums terms of this size: an error of GATE_ROUNDINGS
    roundings (in the case's dtype) of the terms counts as the tolerance, so a cancelling sum is
    judged by its terms and any other error (a missing or wrong term is a fraction of them) still fails."""
    return GATE_ROUNDINGS * UNIT[c["dtype"]] * scale.norm().item() / tolerance(c, name)


def _errors(pairs: dict, floor: float = 0.0, sums: dict[str, int] | None = None,
            norm_floors: dict[str, float] | None = None) -> dict[str, float]:
    """Relative RMS error per tensor. ``sums``: tensors each of whose elements sums this many
    per-token terms (the window weight's gradient, over every token): their floor grows with the
    square root of that count, as the rounding of the terms adds up (GPU seed 1856, fp16: dgamma's
    terms cancel to 9e-5 and the kernel's sum of 428 rounded terms is 1e-5 from it).
    ``norm_floors``: a floor of the reference's norm per tensor (term_norm_floor)."""
    out = {}
    for name, (got, want) in pairs.items():
        assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        out[name] = rel(got, want, floor * math.sqrt((sums or {}).get(name, 1)), (norm_floors or {}).get(name, 0.0))
    return out


def _gate_floors(c: dict, pairs: dict, leaves: dict) -> dict[str, float]:
    """{gate gradient name: its norm floor} of a case with log gates and gradients (else {})."""
    name = "dg" if "dg" in pairs else "dlog_g" if "dlog_g" in pairs else None
    if name is None or "dq" not in pairs or "dk" not in pairs:
        return {}
    per_channel = pairs[name][1].dim() == leaves["q"].dim()  # a gate per key channel (chunk_channel)
    scale = gate_term_scale(leaves["q"], leaves["k"], pairs["dq"][1], pairs["dk"][1], c["lens"], per_channel)
    return {name: term_norm_floor(c, name, scale)}


def exact_copies(c: dict) -> set[str]:
    """Tensors of a version-2 case that the op only copies (the tokens into the ring's slots, the
    conv inputs into the cache, the valid flags): bit-exact. The fused Hedgehog window op stores the
    keys after its RoPE (rounded: not a copy) and computes phi(k) itself."""
    if c["op"] not in INFERENCE_OPS:
        return set()
    names = {"ring_v", "ring_valid", "ring_log_g", "conv"}
    if not c.get("R"):
        names.add("ring_k")
    if c["op"] == "window_decode":
        names.add("ring_phi_k")
    return names


def tolerance(c: dict, name: str) -> float:
    if c["op"] in INFERENCE_OPS:
        return 0.0 if name in exact_copies(c) else TOL["inference"][c["dtype"]][0]
    fam = "gdn" if c["op"].startswith("gdn") else "linear"
    t_out, t_grad = TOL[fam][c["dtype"]]
    t = t_grad if name.startswith("d") else t_out
    if name in ("dlog_g", "dg", "dgamma"):
        t *= 4  # reverse cumulative sums of differences (and the gamma's sum over all tokens)
        if c.get("decay"):
            t *= 10  # in-chunk decay sums near -1000: float32 resolves them to ~1e-4
    return t


def check_case(c: dict, device: str, guard: bool = False) -> dict[str, float]:
    """Run case ``c``; assert every error is within tolerance (or, for a refused head dim, that
    the op refuses it with its message).  ``guard`` (CPU): also fail on a write out of bounds of
    any tensor allocated during the case (:class:`GuardedAllocations`).  Returns the errors."""
    if c["reject"]:
        return check_rejected(c, device)
    if guard and device == "cpu":
        with GuardedAllocations() as g:
            errs = run_case(c, device)
        g.check()
    else:
        errs = run_case(c, device)
    bad = {n: e for n, e in errs.items() if not e <= tolerance(c, n)}
    assert not bad, (f"{case_id(c)}: relative RMS errors over tolerance: "
                     + ", ".join(f"{n} {e:.2e} > {tolerance(c, n):.0e}" for n, e in bad.items()) + replay_hint(c))
    return errs


def replay_hint(c: dict) -> str:
    """How to run case ``c`` again (its generator version named where it is not the default)."""
    g = c.get("generator", 1)
    env = f"LINEARIZE_FUZZ_GENERATOR={g} " if g != GENERATOR else ""
    flags = (f" --pool {c['pool']}" if c.get("pool") else "") + (f" --generator {g}" if g != GENERATOR else "")
    return (f"\n  replay: {env}LINEARIZE_FUZZ_SEED={c['seed']} TRITON_INTERPRET=1 python -m pytest -q "
            f"tests/test_kernels_fuzz.py   (or python scripts/fuzz_kernels_gpu.py --seed {c['seed']}{flags})")


def check_rejected(c: dict, device: str) -> dict:
    from linearize.kernels import gated_delta as gd
    from linearize.kernels import linear_attn as la

    d = c["reject"]
    x = torch.rand(1, 3, 1, d, device=device)
    y = torch.rand(1, 3, 1, 16, device=device)
    if c["op"] == "chunk":
        calls = [lambda: la.chunk_linear_attn(x, x, y), lambda: la.chunk_linear_attn(y, y, x)]
        msg = "feature and value dims must be in [16, 256]"
    elif c["op"] == "chunk_channel":
        calls = [lambda: la.chunk_linear_attn_channel(x, x, y, -x), lambda: la.chunk_linear_attn_channel(y, y, x, -y)]
        msg = "feature and value dims must be in [16, 256]"
    elif c["op"] == "hedgehog_features":
        dt = DTYPES[c["dtype"]]
        calls = [lambda: la.hedgehog_features(x.to(dt), torch.rand(1, d, 16, device=device), dt),
                 lambda: la.hedgehog_features(y.to(dt), torch.rand(1, 16, d, device=device), dt)]
        msg = "head dim and feature columns must be in [1, 256]"
    elif c["op"] == "gdn_decode":
        # one head, no conv, no RoPE: columns q | k | v | a | b | o_gate
        ycols = torch.rand(1, 1, 4 * d + 2, device=device)
        cols = [0, d, 2 * d, d, 3 * d, 3 * d + 1, 3 * d + 2]
        one = torch.ones(1, device=device)

        def decode():
            with torch.no_grad():
                gd.fused_gated_delta_decode(ycols, cols=cols, num_heads=1, num_kv_heads=1, head_dim=d,
                                            state=torch.zeros(1, 1, d, d, device=device), A_log=one, dt_bias=one,
                                            norm_weight=torch.ones(d, device=device), norm_mix=one)
        calls = [decode]
        msg = "above the fused decode's 128"
    else:
        gate = torch.zeros(1, 3, 1, device=device)
        calls = [lambda: gd.chunk_gated_delta_rule(x, x, y, g=gate, beta=gate + 0.5),
                 lambda: gd.chunk_gated_delta_rule(y, y, x, g=gate, beta=gate + 0.5)]
        msg = "head dims must lie in [16, 256]"
    for call in calls:
        try:
            call()
        except ValueError as e:
            assert msg in str(e), f"{case_id(c)}: unclear error for head dim {d}: {e}"
        else:
            raise AssertionError(f"{case_id(c)}: head dim {d} was accepted, the op supports [16, 256]")
    return {}


# ----------------------------------------------------------------------------- GPU run

def patch_interpreter_bf16_dots():
    """The triton 3.9 interpreter multiplies bf16 dot operands as raw bits: upcast them to fp32
    (exact: a bf16 product fits in fp32) so that bf16 cases can run on CPU.  Returns an undo."""
    import triton.language as tl
    from triton.runtime import interpreter

    real = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, *args):
        a, b = (self.cast_impl(x, tl.float32) if x.dtype.scalar == tl.bfloat16 else x for x in (a, b))
        return real(self, a, b, d, *args)

    interpreter.InterpreterBuilder.create_dot = create_dot
    return lambda: setattr(interpreter.InterpreterBuilder, "create_dot", real)


def one_case(seed: int, device: str, tiny: bool, pool: int = 0, log=print, generator: int = GENERATOR) -> tuple:
    """(seed, op, dtype, errors or None, failure or None) of one case."""
    c = gen_case(seed, tiny=tiny, pool=pool, generator=generator)
    try:
        return seed, c["op"], c["dtype"], check_case(c, device), None
    except Exception as e:  # noqa: BLE001 - every failure is reported with its seed
        log(f"FAIL {case_id(c)}: {type(e).__name__}: {e}")
        if not isinstance(e, AssertionError):
            traceback.print_exc()
        first = str(e).splitlines()[0] if str(e) else ""
        return seed, c["op"], c["dtype"], None, (seed, case_id(c), f"{type(e).__name__}: {first}{where(e)}")


def where(e: BaseException) -> str:
    """' (at kernels/x.py:N in f)': the innermost frame of the package in the error's traceback,
    i.e. the launch that failed (with CUDA_LAUNCH_BLOCKING=1, which the GPU run sets, a CUDA error
    is raised by the launch of the kernel that made it)."""
    import linearize
    import linearize.kernels

    # the package and its kernels (a wheel: linearize/kernels/..., an editable install: kernels/...)
    roots = {"": pathlib.Path(linearize.__file__).parent, "kernels/": pathlib.Path(linearize.kernels.__file__).parent}
    for f in reversed(traceback.extract_tb(e.__traceback__)):
        for prefix, root in roots.items():
            path = pathlib.Path(f.filename)
            if path.is_relative_to(root):
                return f" (at {prefix}{path.relative_to(root).as_posix()}:{f.lineno} in {f.name})"
    return ""


def _cuda_diagnostics() -> None:
    """GPU runs: a CUDA error raised by the launch that made it, not at a later sync in another
    op (an illegal address otherwise surfaces wherever the process next synchronizes), and the
    launches that needed fewer pipeline stages logged (kernels/launch.py)."""
    os.environ.setdefault("CUDA_LAUNCH_BLOCKING", "1")
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("linearize.kernels").setLevel(logging.INFO)


SAVE_EVERY = 60.0  # seconds between writes of a running fuzz's record (see Tally)


class Tally:
    """Worst error per (op, dtype, tensor) with its seed, cases per op, failures. ``progress``: called
    with :meth:`result` at most every ``every`` seconds as cases finish (the run's record on disk, so
    a run killed outright, e.g. by a lent machine's time limit, still leaves its cases to resume)."""

    def __init__(self, progress=None, every: float | None = None):
        self.worst: dict[tuple[str, str, str], tuple[float, int]] = {}
        self.counts: dict[str, int] = {}
        self.failures: list[tuple] = []
        self.ran: list[int] = []  # every seed that finished, so a later run knows which cases were drawn
        self.progress, self.saved = progress, time.time()
        self.every = SAVE_EVERY if every is None else every

    def add(self, seed, op, dtype, errs, failure):
        self.counts[op] = self.counts.get(op, 0) + 1
        self.ran.append(seed)
        if failure is not None:
            self.failures.append(failure)
        else:
            for name, e in errs.items():
                if e > self.worst.get((op, dtype, name), (-1.0, 0))[0]:
                    self.worst[(op, dtype, name)] = (e, seed)
        if self.progress is not None and time.time() - self.saved >= self.every:
            self.progress(self.result())
            self.saved = time.time()

    def result(self):
        return self.worst, self.counts, self.failures, sorted(self.ran)


def fuzz(seeds, device: str, tiny: bool, log=print, deadline: float = math.inf, pool: int = 0,
         generator: int = GENERATOR, progress=None):
    """Run the cases (until ``deadline``, a time.time()); returns (worst error per op, dtype and
    tensor with its seed, cases per op, failures). ``progress``: see :class:`Tally`."""
    tally = Tally(progress)
    try:
        for seed in seeds:
            if time.time() > deadline:
                log(f"time budget reached after {sum(tally.counts.values())} cases")
                break
            tally.add(*one_case(seed, device, tiny, pool, log, generator=generator))
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (see _run): the cases so far still make a table
        log(f"interrupted after {sum(tally.counts.values())} cases")
    return tally.result()


def gpu_for(worker: int, gpus: int, visible: str | None) -> str | None:
    """The CUDA_VISIBLE_DEVICES of worker ``worker`` when the run spreads over ``gpus`` GPUs (workers
    dealt round the GPUs, so whole compiled variants stay on one GPU with their worker), within what the
    parent sees (``visible``: its own CUDA_VISIBLE_DEVICES, or None for every GPU); None: leave it."""
    if gpus <= 1:
        return None
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible else [str(i) for i in range(gpus)]
    if len(ids) < gpus:
        raise SystemExit(f"--gpus {gpus}: CUDA_VISIBLE_DEVICES={visible!r} names only {len(ids)} GPU(s); "
                         f"pass --gpus {len(ids)} or widen CUDA_VISIBLE_DEVICES")
    return ids[worker % gpus]


def _worker(seeds, device, tiny, deadline, pool, queue, gpu=None, generator=GENERATOR):
    if gpu is not None:  # before this process touches CUDA: it sees its one GPU as cuda:0
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    if device == "cpu":  # a spawned process starts without the main one's interpreter patch
        patch_interpreter_bf16_dots()
    else:
        _cuda_diagnostics()
    for i, seed in enumerate(seeds):
        if time.time() > deadline:
            break
        result = one_case(seed, device, tiny, pool, generator=generator)
        queue.put(result)
        if result[4] is not None and sticky(result[4][2]):
            queue.put(("restart", seeds[i + 1:], gpu))  # this process's CUDA context is lost: a fresh one goes on
            # leave without tearing the lost context down: its teardown raised again and the exit code 1
            # read as a failed worker (2026-11-23 22:15 run: "worker 8 exited with code 1" after seed 99)
            import multiprocessing

            if multiprocessing.parent_process() is not None:  # a spawned worker (not a test calling it in-process)
                queue.close()
                queue.join_thread()
                os._exit(0)
            return
        if device == "cuda":  # 16 processes' allocator caches (~10 GB each after large cases) filled an H200
            # (after the sticky check: on a lost context empty_cache raises, and the worker exited with
            # code 1 before handing its seeds on; 2026-11-24 run, seed 1925)
            torch.cuda.empty_cache()
    queue.put(None)


def sticky(message: str) -> bool:
    """A CUDA error that poisons the process's context (an illegal address, a device-side assert):
    every later case in that process would fail with it too, so the worker is replaced."""
    return "CUDA error" in message and "out of memory" not in message


def split_seeds(seeds, workers: int, pool: int = 0, generator: int = GENERATOR) -> list:
    """The seeds dealt to ``workers`` processes.

    With a ``pool``, whole compiled variants (``seed % pool``) are dealt, in a fixed shuffled order, so
    each variant is compiled and autotuned by one process only: the 4th GPU run dealt single seeds and
    every worker compiled nearly all 140 variants (170 cases in 514 s, against 976 in 265 s in the first
    run, where each worker compiled 10). Within a worker the seeds run round by round (``seed // pool``),
    so a run cut by its budget has still compiled and checked every variant it was dealt. Without a pool
    the seeds are shuffled (a fixed shuffle) and dealt one by one: dealt in order, a worker count that
    is a multiple of the op count gave every worker a single op (``seed % len(ops)``)."""
    seeds = list(seeds)
    if not pool:
        random.Random(0).shuffle(seeds)
        return [seeds[i::workers] for i in range(workers)]
    pool = round_pool(pool, generator)
    n_ops = len(ops_of(generator))
    rng, variants = random.Random(0), []
    for k in range(n_ops):  # op by op, continuing round the workers: each gets every op's variants
        mine = sorted({s % pool for s in seeds if s % n_ops == k})
        rng.shuffle(mine)
        variants += mine
    rank = {v: i for i, v in enumerate(variants)}  # variant rank i goes to worker i % workers
    shares = [[] for _ in range(workers)]
    for s in sorted(seeds, key=lambda s: (s // pool, rank[s % pool])):
        shares[rank[s % pool] % workers].append(s)
    return shares


def fuzz_parallel(seeds, workers: int, deadline: float, pool: int = 0, grace: float = 60.0, log=print,
                  device: str = "cuda", tiny: bool = False, gpus: int = 1, generator: int = GENERATOR, progress=None):
    """:func:`fuzz` over ``workers`` processes (seeds round-robin), each case's result sent back as
    it finishes; workers still compiling ``grace`` seconds after the deadline are stopped (their
    case in flight is not counted). ``gpus`` > 1: worker i runs on GPU i % gpus. ``progress``: see
    :class:`Tally`."""
    import multiprocessing as mp
    import queue as queue_mod

    ctx = mp.get_context("spawn")  # CUDA cannot be forked
    q = ctx.Queue()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    procs = [ctx.Process(target=_worker, args=(share, device, tiny, deadline, pool, q,
                                               gpu_for(i, gpus, visible) if device == "cuda" else None),
                         kwargs={"generator": generator})
             for i, share in enumerate(split_seeds(seeds, workers, pool, generator))]
    for proc in procs:
        proc.start()
    restarts = 0
    tally, running, interrupted = Tally(progress), workers, False
    try:
        while running:
            try:
                item = q.get(timeout=max(1.0, deadline + grace - time.time()))
            except queue_mod.Empty:
                if time.time() > deadline + grace or not any(p.is_alive() for p in procs):
                    break
                continue
            if item is None:
                running -= 1
            elif item[0] == "restart":  # a worker lost its CUDA context: its remaining seeds go to a new one
                restarts += 1
                log(f"worker restarted after a sticky CUDA error ({restarts} so far)")
                proc = ctx.Process(target=_worker, args=(item[1], device, tiny, deadline, pool, q, item[2]),
                                   kwargs={"generator": generator})
                proc.start()
                procs.append(proc)
            else:
                tally.add(*item)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (see _run): the cases so far still make a table
        log(f"interrupted after {sum(tally.counts.values())} cases")
        interrupted = True
    for i, proc in enumerate(procs):
        proc.join(timeout=1)
        if proc.is_alive():
            proc.terminate()
            log(f"worker {i} stopped at the deadline (a case in flight)")
        elif proc.exitcode and not interrupted:  # a worker that died is a failure, not a silent gap
            tally.failures.append((-1, f"worker {i}", f"worker exited with code {proc.exitcode}"))
    return tally.result()


def table(worst, counts, failures, n_cases, device_name, seconds, requested=None, workers=1, pool=0, ran=(), gpus=1,
          generator: int = GENERATOR, only_ops=None) -> str:
    ops = ops_of(generator)
    gen_flag = f" --generator {generator}" if generator != GENERATOR else ""
    cmd = f"--cases {requested or n_cases}" + (f" --workers {workers}" if workers > 1 else "") + (f" --gpus {gpus}" if gpus > 1 else "") + (f" --pool {pool}" if pool else "") + gen_flag + (f" --ops {only_ops}" if only_ops else "")
    lines = [f"# Kernel fuzzing: worst relative RMS errors against float64",
             "",
             f"`python scripts/fuzz_kernels_gpu.py {cmd}` on {device_name}, torch {torch.__version__}, "
             f"{n_cases} random cases in {seconds:.0f} s, {len(failures)} failure(s). Generator version "
             f"{generator}; cases per op: " + ", ".join(f"{op} {counts.get(op, 0)}" for op in ops) + ".",
             "Each cell: the worst error over the cases of that op and dtype, and the seed that gave it "
             "(replay: `--seed N" + (f" --pool {pool}" if pool else "") + gen_flag + "`). "
             + (f"The cases share {pool} compiled variants (dtype, head dims, flags); shapes, lengths, "
                "boundaries and values are each case's own. " if pool else "")
             + "Tolerances (outputs / gradients): "
             + "; ".join(f"{fam} " + ", ".join(f"{d} {a:.0e}/{b:.0e}" for d, (a, b) in t.items())
                         for fam, t in TOL.items()) + ".",
             "",
             "| op | dtype | tensor | worst error | seed |",
             "|---|---|---|---:|---:|"]
    for (op, dt, name), (e, seed) in sorted(worst.items(), key=lambda kv: (ops.index(kv[0][0]), kv[0][1], kv[0][2])):
        lines.append(f"| {op} | {dt} | {name} | {e:.2e} | {seed} |")
    if failures:
        lines += ["", "## Failures", ""] + [f"- seed {s} `{cid}`: {msg.splitlines()[0] if msg else ''}"
                                            for s, cid, msg in failures]
    if ran:
        lines += ["", f"<details><summary>The {len(ran)} seeds run</summary>", "", " ".join(map(str, ran)), "",
                  "</details>"]
    return "\n".join(lines) + "\n"


def record_path(out) -> pathlib.Path:
    """The resumable JSON record of a run whose table goes to ``out``: docs/reports/data/kernels_fuzz.json
    for the report page, else beside ``out``."""
    out = pathlib.Path(out)
    return out.parent / "data" / "kernels_fuzz.json" if out.name == "kernels.md" else out.with_suffix(".json")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=int, default=2000, help="number of random cases (seeds start..start+cases-1)")
    p.add_argument("--start", type=int, default=0, help="first seed")
    p.add_argument("--seed", type=int, default=None, help="replay one case and print its errors")
    p.add_argument("--smoke", action="store_true",
                   help="2 tiny cases per op, table printed only (CPU: needs TRITON_INTERPRET=1)")
    p.add_argument("--out", default=str(REPORTS / "kernels.md"), help="where the table goes (not written with --smoke)")
    p.add_argument("--max-minutes", type=float, default=7.0, help="the whole run's budget: cases are drawn until shortly before it (the table says how many ran)")
    p.add_argument("--pool", type=int, default=None,
                   help="compiled variants (dtype, head dims, flags) the cases share; 0 = every case its own "
                        f"(default: {POOL_PER_OP} per op on a GPU, i.e. {default_pool(False, 1)} for generator 1 and "
                        f"{default_pool(False, GENERATOR)} for {GENERATOR}; 0 under the interpreter)")
    p.add_argument("--generator", type=int, default=None, choices=sorted(OPS_BY_VERSION),
                   help=f"the case generator's version (default {GENERATOR}; with --resume: the record's). Version 1 "
                        f"draws the {len(OPS_V1)} first ops, as the generator did before the inference-only ops came: "
                        "replay an old record's seed with --generator 1")
    p.add_argument("--full-size", action="store_true",
                   help="draw the GPU's full-size cases under the interpreter too (replay a GPU seed on CPU)")
    p.add_argument("--guard", action="store_true",
                   help="--seed under TRITON_INTERPRET=1: also fail on an out-of-bounds write (GuardedAllocations)")
    p.add_argument("--workers", type=int, default=1, help="processes sharing the GPU (Triton compiles in parallel)")
    p.add_argument("--gpus", type=int, default=1, help="spread the workers over this many GPUs of the host (worker i on GPU i %% N)")
    p.add_argument("--resume", default=None, metavar="JSON",
                   help="continue the run recorded in JSON (written beside --out as <out>.json): its seeds are "
                        "skipped, the table covers both runs, and JSON is rewritten (2,000 cases over several "
                        "10-minute calls)")
    p.add_argument("--retry-failed", action="store_true",
                   help="with --resume: run the recorded run's failed seeds again (after a fix) instead of keeping "
                        "their failures")
    p.add_argument("--ops", default=None, metavar="OP[,OP]",
                   help="only the seeds whose op is one of these (e.g. gdn_chunk after a change to the GDN kernels)")
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0") else "cpu"
    tiny = (device == "cpu" or a.smoke) and not a.full_size
    a.generator = resolve_generator(a.generator, load_record(a.resume) if a.resume else None, a.resume)
    if a.pool is None:
        a.pool = default_pool(tiny, a.generator)
    if device == "cuda":
        _cuda_diagnostics()
    undo = patch_interpreter_bf16_dots() if device == "cpu" else (lambda: None)
    try:
        return _run(a, device, tiny)
    finally:
        undo()


def resolve_generator(asked: int | None, record: dict | None, path=None) -> int:
    """The generator version of a run: a resumed record's own (missing: 1, the records written before
    versions existed), else ``asked``, else GENERATOR. Asking another version than the record's is an
    error: its seeds would be other cases."""
    if record is not None:
        recorded = record.get("generator", 1)
        if asked is not None and asked != recorded:
            raise SystemExit(f"--resume {path}: recorded with --generator {recorded}; resume it with that version "
                             f"(or leave --generator out), or start a new run")
        return recorded
    return GENERATOR if asked is None else asked


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _run(a, device: str, tiny: bool) -> int:
    if a.seed is not None:
        c = gen_case(a.seed, tiny=tiny, pool=a.pool, generator=a.generator)
        print(case_id(c))
        print(check_case(c, device, guard=a.guard))
        return 0
    seeds = range(a.start, a.start + (2 * len(ops_of(a.generator)) if a.smoke else a.cases))
    requested = len(seeds)
    if a.ops:
        ops = ops_of(a.generator)
        unknown = sorted(set(a.ops.split(",")) - set(ops))
        if unknown:
            raise SystemExit(f"--ops {','.join(unknown)}: not an op of generator {a.generator}; pick from {', '.join(ops)}")
        seeds = [s for s in seeds if ops[s % len(ops)] in a.ops.split(",")]
    before = load_record(a.resume) if a.resume else None
    if before is not None:
        if before["pool"] != a.pool or before["device"] != (torch.cuda.get_device_name() if device == "cuda" else "cpu"):
            raise SystemExit(f"--resume {a.resume}: recorded with --pool {before['pool']} on {before['device']}; "
                             f"run it with the same --pool on the same kind of device, or start a new run")
        if a.retry_failed:
            before = drop_failures(before, tiny)
        done = set(before["ran"])
        seeds = [s for s in seeds if s not in done]
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (TRITON_INTERPRET=1)"
    t0 = time.time()
    # the whole run fits in --max-minutes: workers stop drawing cases `grace` seconds before it, and
    # those still compiling then are stopped at it (a `timeout` set to the same budget keeps the table)
    budget = 60 * a.max_minutes
    grace = min(60.0, 0.2 * budget) if a.workers > 1 else 0.0
    deadline = t0 + budget - grace
    path = None if a.smoke else pathlib.Path(a.out)

    def record_of(result, seconds: float) -> dict:
        worst, counts, failures, ran = result
        record = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "pool": a.pool,
                  "generator": a.generator, "seconds": seconds, "worst": [[*k, *v] for k, v in worst.items()],
                  "counts": counts, "failures": [list(f) for f in failures], "ran": sorted(ran)}
        return merge_records(before, record) if before is not None else record

    def save_record(record: dict) -> None:
        """The record, beside --out (what --resume reads), replaced atomically."""
        if path is not None:
            record_path(path).parent.mkdir(parents=True, exist_ok=True)  # data/ beside --out (2026-11-28g: missing)
            tmp = record_path(path).with_suffix(".json.tmp")
            tmp.write_text(json.dumps(record) + "\n")
            os.replace(tmp, record_path(path))

    def progress(result) -> None:  # the record so far, as cases finish
        save_record(record_of(result, time.time() - t0))

    previous = signal.signal(signal.SIGTERM, _interrupt)  # `timeout` and batch systems stop with SIGTERM
    try:
        if a.workers > 1:
            result = fuzz_parallel(seeds, a.workers, deadline, pool=a.pool, device=device, tiny=tiny, grace=grace,
                                   gpus=a.gpus, generator=a.generator, progress=progress)
        else:
            result = fuzz(seeds, device, tiny, deadline=deadline, pool=a.pool, generator=a.generator,
                          progress=progress)
    finally:  # a caller (the tests, a notebook) keeps its own handler
        signal.signal(signal.SIGTERM, previous)
    record = record_of(result, time.time() - t0)
    worst = {tuple(w[:3]): (w[3], w[4]) for w in record["worst"]}
    counts, failures = record["counts"], [tuple(f) for f in record["failures"]]
    md = table(worst, counts, failures, sum(counts.values()), name, record["seconds"], requested=requested,
               workers=a.workers, pool=a.pool, ran=record["ran"], gpus=a.gpus, generator=a.generator,
               only_ops=a.ops)
    print(md)
    if path is not None:
        save_record(record)
        write_section(path, "fuzz_kernels_gpu", md)
        print(f"wrote {path} and {record_path(path)}")
    return 1 if failures else 0


def load_record(path) -> dict | None:
    p = pathlib.Path(path)
    return json.loads(p.read_text()) if p.is_file() else None  # absent: the first call of a series


def drop_failures(record: dict, tiny: bool = False) -> dict:
    """``record`` without its failed cases: their seeds leave ``ran`` and their op's count, so a
    resumed run draws them again; worker exits (seed -1) are dropped too. The ops are the record's
    generator version's (missing: 1)."""
    failed = {f[0] for f in record["failures"] if f[0] >= 0}
    counts = dict(record["counts"])
    for seed in failed:
        op = gen_case(seed, tiny=tiny, pool=record["pool"], generator=record.get("generator", 1))["op"]
        counts[op] = counts.get(op, 0) - 1
    return {**record, "failures": [], "counts": counts, "ran": [s for s in record["ran"] if s not in failed]}


def merge_records(a: dict, b: dict) -> dict:
    """Two runs' results as one: worst error per (op, dtype, tensor) over both, counts and seconds
    summed, failures and seeds together."""
    worst = {tuple(w[:3]): w for w in a["worst"]}
    for w in b["worst"]:
        key = tuple(w[:3])
        if key not in worst or w[3] > worst[key][3]:
            worst[key] = w
    counts = {op: a["counts"].get(op, 0) + b["counts"].get(op, 0) for op in {**a["counts"], **b["counts"]}}
    return {**a, "generator": a.get("generator", 1), "seconds": a["seconds"] + b["seconds"],
            "worst": list(worst.values()), "counts": counts,
            "failures": a["failures"] + b["failures"], "ran": sorted(set(a["ran"]) | set(b["ran"]))}


if __name__ == "__main__":
    sys.exit(main())
