"""What the end-to-end benchmark measures: model shapes, conversion presets, the points of a run,
and the results file they are recorded in.

A point is one measurement (a prefill, a decode, a kernel count or a check) of one model of one
shape; its key names it in the JSON, so a stopped run continues where it stopped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

from linearize.loading import UserError

REPO = Path(__file__).resolve().parents[1]
DEFAULT_JSON = REPO / "docs" / "reports" / "data" / "bench_e2e.json"
DEFAULT_DOCS = REPO / "docs" / "reports" / "end-to-end.md"
PARTS = ("check", "kernels", "decode", "prefill", "generate")
FORMAT = 2  # of the JSON; format 1 (one conversion per run, context x batch grids) is not read

# Llama shapes (random weights: decode and prefill speed do not depend on the values)
SHAPES: dict[str, dict] = {
    "smollm2-135m": {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152,
                     "tie_word_embeddings": True, "rope_theta": 100000.0},
    "llama-3.2-1b": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 8192, "vocab_size": 128256,
                     "tie_word_embeddings": True, "rope_theta": 500000.0},
    # --smoke: small enough for two CPU cores, large enough to exercise GQA and tied embeddings
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "intermediate_size": 128, "vocab_size": 512, "tie_word_embeddings": True,
             "rope_theta": 10000.0},
}

# the layers the gdn-hybrid preset keeps as softmax attention: a fixed list per shape (random weights
# have no KL to choose by). 8 of 30 for SmolLM2; for Llama-1B the 30-layer list's spread scaled to 16
# layers at the same ~25% (0, 10, 17, 23 of 30 -> 0, 5, 9, 12 of 16); tiny keeps its first layer.
HYBRID_SOFTMAX_LAYERS: dict[str, list[int]] = {
    "smollm2-135m": [0, 1, 10, 17, 18, 20, 23, 24],
    "llama-3.2-1b": [0, 5, 9, 12],
    "tiny": [0],
}

# the presets users pick (recipes/distill.py PRESETS: "linear" is the preset, with its decay gate per key
# channel since 2026-11-29k, at rank 16 since -29l; "hedgehog" is the same layer without a gate, the linear preset measured until
# 2026-11-29e; the lolcats window and the gdn method are the same, tests/test_bench_e2e.py checks it)
PRESETS: dict[str, dict] = {
    "hedgehog": {"method": "linear_attention", "feature_map": "hedgehog", "window": 0},
    "linear": {"method": "linear_attention", "feature_map": "hedgehog", "window": 0, "decay": "channel",
               "gate_rank": 16},
    # linear with a scalar gate per head and step (`--decay scalar`): the preset from 2026-11-29e to -29j, what
    # "linear" measured in docs/reports/end-to-end.md until then. Not in a full run's default presets
    # (--presets linear-scalar asks for it): each preset costs a full run minutes
    "linear-scalar": {"method": "linear_attention", "feature_map": "hedgehog", "window": 0, "decay": "scalar"},
    # the figures in docs/reports/end-to-end.md up to 2026-11-28 ran the window of 64 the preset had then
    # (and no attention sinks: the preset has 4 since 2026-11-29, and 192 keys since 2026-11-29c)
    "lolcats": {"method": "linear_attention", "feature_map": "hedgehog", "window": 192, "sinks": 4},
    "gdn": {"method": "gdn"},
    # Gated DeltaNet beside lolcats' window (192 keys + 4 sinks) in every converted layer: the preset since 2026-12-07a
    "gdn-hybrid": {"method": "gdn", "window": 192, "sinks": 4, "softmax_layers": "HYBRID_SOFTMAX_LAYERS"},
    # the same without the window: the preset until 2026-12-07a (its points were measured under the name
    # gdn-hybrid), and the layer `--layout qwen3_5` still runs (Qwen3.5 holds no window). Not in a full run's
    # default presets (--presets gdn-hybrid-w0 asks for it)
    "gdn-hybrid-w0": {"method": "gdn", "window": 0, "softmax_layers": "HYBRID_SOFTMAX_LAYERS"},
    # lolcats' layers with gdn-hybrid's softmax layers kept (the recipe's quarter, here the same fixed list)
    "lolcats-hybrid": {"method": "linear_attention", "feature_map": "hedgehog", "window": 192, "sinks": 4,
                       "softmax_layers": "HYBRID_SOFTMAX_LAYERS"},
}
OFF_BY_DEFAULT = ("linear-scalar", "gdn-hybrid-w0")  # earlier presets, measured when asked for by name
SMOKE_WINDOW = 8  # lolcats' window in --smoke (192 would cover the whole tiny context)


def preset_config(preset: str, shape: str, smoke: bool = False):
    """The linearize method config of ``preset`` on ``shape`` (validated)."""
    import linearize

    p = PRESETS[preset]
    layers = None
    if "softmax_layers" in p:
        keep = set(HYBRID_SOFTMAX_LAYERS[shape])
        layers = [i for i in range(SHAPES[shape]["num_hidden_layers"]) if i not in keep]
    window = min(p.get("window", 0), SMOKE_WINDOW) if smoke else p.get("window", 0)
    if p["method"] == "gdn":
        return linearize.GatedDeltaNetConfig(layers=layers, window=window, sinks=p.get("sinks", 0))
    return linearize.LinearAttentionConfig(feature_map=p["feature_map"], window=window, sinks=p.get("sinks", 0),
                                           decay=p.get("decay"), gate_rank=p.get("gate_rank", 0), layers=layers)


@dataclasses.dataclass(frozen=True)
class Point:
    part: str  # check | kernels | decode | prefill
    shape: str
    model: str  # "original", or a preset name
    variant: str
    T: int = 0
    B: int = 0

    @property
    def key(self) -> str:
        tail = f"/T={self.T}/B={self.B}" if self.part != "check" else ""
        return f"{self.part}/{self.shape}/{self.model}/{self.variant}{tail}"

    @property
    def converted(self) -> bool:
        return self.model != "original"


def key(part, shape, model, variant, T=0, B=0) -> str:
    return Point(part, shape, model, variant, T, B).key


# What a full run measures, chosen for the targets (docs/reports/end-to-end.md lists them) and to fit
# one ~8-minute GPU command; --smoke keeps the same structure at tiny sizes.
FULL = {"shapes": "smollm2-135m,llama-3.2-1b", "presets": ",".join(p for p in PRESETS if p not in OFF_BY_DEFAULT),
        # decode targets: B=1 at 4K on both shapes, B=8 at 64K on SmolLM2's (a flag applies to every shape)
        "decode_points": {"smollm2-135m": "4K:1,64K:8", "llama-3.2-1b": "4K:1"},
        "compile_original": "4K:1,64K:8",    # the original's best (torch.compile reduce-overhead) where compared
        # a compile per preset, shape and point costs ~30 s: the 1 ms point, and B=8 at 64K where the
        # hybrid's softmax layers (eager in a DecodeGraph: 19 ms on 2026-11-23) need the compiler too
        "compile_converted": "4K:1,64K:8",
        # one call and chunked, every model: B=1 and B=8 on SmolLM2's shape, B=1 on Llama-1B's (the
        # original's B=8 prefill at 64K alone takes ~10 s there)
        "prefill_points": {"smollm2-135m": "64K:1,64K:8", "llama-3.2-1b": "64K:1"},
        "memory_points": "16K:1,128K:1",     # chunked prefill only: peak memory flat in T
        "kernels_at": "4K:1", "steps": 32, "prefill_chunk": 8192, "check_prompt": 96}
# --smoke: every preset but gdn-hybrid-w0 (gdn's layer on gdn-hybrid's list, both in it)
SMOKE = {"shapes": "tiny", "presets": ",".join(p for p in PRESETS if p != "gdn-hybrid-w0"),
         "decode_points": "64:1,128:2", "compile_original": "64:1",
         "compile_converted": "64:1", "prefill_points": "128:1,128:2", "memory_points": "64:1,128:1",
         "kernels_at": "64:1", "steps": 3, "prefill_chunk": 32, "check_prompt": 24}

# the targets are stated at these points (docs keep them even when a run measures others)
TARGET_SMALL = (4096, 1)       # decode: <= 1 ms and >= 1.5x the original's best, every preset
TARGET_LARGE = (65536, 8)      # decode: >= 8x the original's best
TARGET_PREFILL_T = 65536       # one call >= 2.5x the original; chunked >= 90% of one call
TARGET_MEMORY = (16384, 131072)  # chunked prefill peak memory flat within 10%
TARGET_KERNELS_PER_LAYER = 15


def plan(args) -> list[Point]:
    """The points of a run, model by model (each model is built once and its compiled steps reused)."""
    pts: list[Point] = []
    for shape in args.shapes:
        for model in ["original", *args.presets]:
            conv = model != "original"
            if "check" in args.parts:
                pts.append(Point("check", shape, model, "graph-vs-eager"))
                if conv:
                    pts.append(Point("check", shape, model, "chunked-prefill"))
            if "kernels" in args.parts:
                T, B = args.kernels_at
                pts.append(Point("kernels", shape, model, "eager-static", T, B))
            if "decode" in args.parts:
                compiled = set((args.compile_converted if conv else args.compile_original)[shape])
                for T, B in args.decode_points[shape]:
                    pts += [Point("decode", shape, model, "eager-default" if conv else "eager-dynamic", T, B),
                            Point("decode", shape, model, "graph-static", T, B)]
                    if (T, B) in compiled:
                        pts += [Point("decode", shape, model, "compiled-static", T, B),
                                Point("decode", shape, model, "compiled-graph", T, B)]
            if "prefill" in args.parts:
                for T, B in args.prefill_points[shape]:
                    pts.append(Point("prefill", shape, model, "one-call", T, B))
                    if conv and T > args.prefill_chunk:
                        pts.append(Point("prefill", shape, model, f"chunk{args.prefill_chunk}", T, B))
                        pts.append(Point("prefill", shape, model, f"graph{args.prefill_chunk}", T, B))
                        pts.append(Point("prefill", shape, model, f"cgraph{args.prefill_chunk}", T, B))
                if conv:
                    for T, B in args.memory_points[shape]:
                        p = Point("prefill", shape, model, f"chunk{args.prefill_chunk}", T, B)
                        if p not in pts:
                            pts.append(p)
            if "generate" in args.parts and conv:
                pts.append(Point("check", shape, model, "generate-static"))
    return pts


# ----------------------------------------------------------------------------- results file


def load_results(path: Path, smoke: bool | None) -> dict:
    """The results so far (``smoke``: the kind of run this must be; None: any)."""
    if path.exists():
        data = json.loads(path.read_text())
        if data.get("format", 1) != FORMAT:
            raise UserError(f"{path} is in the format {data.get('format', 1)} of an older benchmark (one conversion "
                            f"per run); move it away (or use another --json) to start a format-{FORMAT} run")
        if smoke is not None and data.get("smoke", False) != smoke:
            raise UserError(f"{path} holds {'a smoke' if data.get('smoke') else 'a full'} run; use another --json "
                            f"for {'--smoke' if smoke else 'the full run'}")
        return data
    return {"format": FORMAT, "smoke": smoke, "runs": [], "shapes": {}, "models": {}, "points": {}}


def save_results(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, path)  # never a half-written file, even when the call is killed


# -- CONTEXT:BATCH arguments (flags and the smoke plan)

def _positive_int(text: str) -> int:
    t = text.strip()
    mult = 1
    if t[-1:] in ("k", "K"):
        t, mult = t[:-1], 1024
    try:
        value = int(t) * mult
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer (write e.g. 4096 or 4K)")
    return value


def point(text: str) -> tuple[int, int]:
    try:
        t, b = text.split(":")
        return _positive_int(t), _positive_int(b)
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"{text!r} is not CONTEXT:BATCH (e.g. 64K:8)") from None


def point_list(text: str) -> list[tuple[int, int]]:
    """'4K:1,64K:8' -> [(4096, 1), (65536, 8)]; 'none' -> []."""
    if text.strip() == "none":
        return []
    items = [x for x in text.split(",") if x.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected CONTEXT:BATCH,... (e.g. 4K:1,64K:8) or 'none', got nothing")
    return sorted({point(x) for x in items})
