"""End-to-end benchmark: an original Hugging Face Llama beside the presets users pick (``hedgehog``,
``linear``, ``lolcats``, ``gdn``, ``gdn-hybrid``, ``lolcats-hybrid``), each converted from it, in one process on one GPU.

  plan.py     shapes, presets, the points of a run, the results JSON
  measure.py  timers, copy bandwidth, models, prefill / decode / kernel-count runners
  checks.py   token-equality checks (graph vs eager, chunked vs one-call prefill, static generate)
  render.py   issue 13's targets with met / missed, tables, plot, the docs section
  cli.py      flags, the resumable run loop, ``main``

For each shape (random weights, bf16, sdpa) and model:

  decode   ms/step at context T and batch B: eager (DynamicCache / LinearizeCache), one step captured
           by ``linearize.DecodeGraph`` over a static cache, and ``torch.compile(mode="reduce-overhead")``
           over the same static cache (what ``generate(cache_implementation="static")`` does: the
           original's best as transformers users get it); beside each, the memory floor (bytes a step
           must move over the measured copy bandwidth)
  kernels  CUDA kernels of one decode step (torch.profiler), in total and per attention layer
  prefill  tokens/s and peak memory, one call and in chunks of ``--prefill-chunk`` tokens (a preset's
           state carries over, so chunked peak memory stays flat in T)
  check    greedy tokens of each graph equal eager decoding; chunked == one-call prefill;
           (``--parts generate``) ``generate(cache_implementation="static")`` == ``generate()``

Results go to a JSON file written after every point; points already there are skipped, so a run
can be split over several calls (``--time-budget`` stops starting points in time). ``--write-docs``
renders the "End-to-end" section of docs/reports/end-to-end.md (between ``<!-- e2e:start -->`` and
``<!-- e2e:end -->``) and a PNG.

    python scripts/bench_e2e.py --write-docs --time-budget 450     # the full run, on a GPU
    python scripts/bench_e2e.py --shapes llama-3.2-1b --presets gdn --parts decode
    python scripts/bench_e2e.py --smoke --json /tmp/e2e.json       # tiny model, CPU, every preset and part
    python scripts/bench_e2e.py --write-docs --parts none          # render from the JSON only (no CUDA)

The modeling files of ``linearize`` never import this package (a saved checkpoint's code stays flat).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

from linearize.loading import UserError
from .plan import (DEFAULT_DOCS, DEFAULT_JSON, FULL, PARTS, PRESETS, REPO, SHAPES, SMOKE, Point, _positive_int, load_results,
                   plan, point, point_list, preset_config, save_results)

# ----------------------------------------------------------------------------- flags

PER_SHAPE = ("decode_points", "compile_original", "compile_converted", "prefill_points", "memory_points")


def _names(text: str, known, what: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(map(repr, bad)) or '(none)'}; known: {', '.join(known)}")
    return list(dict.fromkeys(names))


def shape_list(text: str) -> list[str]:
    return _names(text, SHAPES, "shape")


def preset_list(text: str) -> list[str]:
    return _names(text, PRESETS, "preset")


def part_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if names == ["none"]:
        return []
    bad = [n for n in names if n not in PARTS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown part {', '.join(map(repr, bad)) or '(none)'}; "
                                         f"choose from {','.join(PARTS)} (comma-separated) or 'none'")
    return [p for p in PARTS if p in names]


def decode_prefill_arg(text: str) -> int | None:
    return None if text == "full" else _positive_int(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The bench flags (shared by ``scripts/bench_e2e.py`` and ``linearize bench``)."""
    F = FULL
    what = p.add_argument_group("what to run (defaults: the full GPU run, sized for one ~8-minute H100 command; "
                                "--smoke changes them)")
    what.add_argument("--shapes", type=shape_list, default=None, help=f"model shapes, of: {', '.join(SHAPES)} "
                      f"(default {F['shapes']})")
    what.add_argument("--presets", type=preset_list, default=None,
                      help=f"conversions measured beside the original, of: {', '.join(PRESETS)} (default {F['presets']})")
    what.add_argument("--parts", type=part_list, default=None, metavar="P,..",
                      help="any of check (graph == eager, chunked == one-call prefill), kernels (CUDA kernels per "
                           "decode step, with torch.profiler), decode, prefill, generate (generate(cache_implementation="
                           "'static') == generate(): ~1 min of compilation per preset and shape on CUDA, so not in "
                           "the full run's default), or none (default: all but generate; --smoke: all)")
    what.add_argument("--decode-points", type=point_list, default=None, metavar="T:B,..",
                      help="decode context:batch points, for every shape (default "
                           + "; ".join(f"{v} on {k}" for k, v in F["decode_points"].items()) + ")")
    what.add_argument("--compile-original", type=point_list, default=None, metavar="T:B,..|none",
                      help="decode points where the original also runs under torch.compile(mode='reduce-overhead') + "
                           f"StaticCache, what generate(cache_implementation='static') does (default {F['compile_original']})")
    what.add_argument("--compile-converted", type=point_list, default=None, metavar="T:B,..|none",
                      help="decode points where each preset also runs under torch.compile(mode='reduce-overhead') + "
                           f"StaticLinearizeCache (default {F['compile_converted']})")
    what.add_argument("--prefill-points", type=point_list, default=None, metavar="T:B,..",
                      help="prefill points, for every shape: one call for every model, chunked too for the presets "
                           "(default " + "; ".join(f"{v} on {k}" for k, v in F["prefill_points"].items()) + ")")
    what.add_argument("--memory-points", type=point_list, default=None, metavar="T:B,..",
                      help=f"chunked prefill points of the presets for the flat-memory target (default {F['memory_points']})")
    what.add_argument("--kernels-at", type=point, default=None, metavar="T:B",
                      help=f"context:batch of the kernel count (default {F['kernels_at']})")
    what.add_argument("--steps", type=_positive_int, default=None, help=f"decode steps timed per point (default {F['steps']})")
    what.add_argument("--prefill-chunk", type=_positive_int, default=None, metavar="N",
                      help=f"chunk length of the presets' chunked prefill (default {F['prefill_chunk']})")
    what.add_argument("--decode-prefill", type=decode_prefill_arg, default=1024, metavar="P|full",
                      help="a preset's state before decode at context T comes from a real prefill of min(T, P) tokens, "
                           "then positions continue from T ('full': all T tokens; a preset that keeps softmax layers "
                           "always prefills all T, so their keys/values hold the whole context) (default 1024)")
    run = p.add_argument_group("where")
    run.add_argument("--device", default=None, help="cuda (default) or cpu (only with --smoke)")
    run.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                     help="default bfloat16 on CUDA, float32 on CPU")
    run.add_argument("--smoke", action="store_true",
                     help="tiny shape and contexts, every preset and part in seconds (CPU: no CUDA graphs, the static "
                          "caches step eagerly, torch.compile uses the eager backend); default files in a temp folder")
    run.add_argument("--json", default=None, help=f"results file, read and extended (default {_rel(DEFAULT_JSON)})")
    run.add_argument("--docs", default=None, help=f"markdown file whose End-to-end section --write-docs renders "
                     f"(default {_rel(DEFAULT_DOCS)}); the PNG goes beside it")
    run.add_argument("--write-docs", action="store_true",
                     help="render the docs section (and the PNG, if matplotlib is installed) from the JSON; "
                          "without CUDA (and without --smoke) it only renders")
    run.add_argument("--time-budget", type=_positive_int, default=None, metavar="SECONDS",
                     help="start no new point after this many seconds (the same command continues later)")
    run.add_argument("--retry-errors", action="store_true", help="run again the points recorded as errors")
    run.add_argument("--seed", type=int, default=0)


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


def resolve(args) -> argparse.Namespace:
    """Fill the defaults that depend on --smoke and the device; check what argparse cannot."""
    base = SMOKE if args.smoke else FULL
    parse = {"shapes": shape_list, "presets": preset_list, "decode_points": point_list,
             "compile_original": point_list, "compile_converted": point_list, "prefill_points": point_list,
             "memory_points": point_list, "kernels_at": point}
    for name, fn in parse.items():
        if getattr(args, name) is None:
            setattr(args, name, fn(base[name]) if isinstance(base[name], str) else
                    {shape: fn(text) for shape, text in base[name].items()})
    for name in PER_SHAPE:  # a flag's points hold for every shape; the defaults may differ by shape
        if not isinstance(getattr(args, name), dict):
            setattr(args, name, {shape: getattr(args, name) for shape in SHAPES})
    if args.parts is None:
        args.parts = list(PARTS) if args.smoke else [p for p in PARTS if p != "generate"]
    args.steps = args.steps or base["steps"]
    args.prefill_chunk = args.prefill_chunk or base["prefill_chunk"]
    args.check_prompt = base["check_prompt"]
    for shape in args.shapes:
        for preset in args.presets:
            try:
                preset_config(preset, shape, args.smoke)
            except ValueError as err:
                raise UserError(f"preset {preset} on {shape}: {err}") from None
    if args.smoke:
        tmp = Path(tempfile.gettempdir()) / "linearize_bench_smoke"
        args.json = args.json or str(tmp / "bench_e2e.json")
        args.docs = args.docs or str(tmp / "benchmarks.md")
    args.json = Path(args.json or DEFAULT_JSON)
    args.docs = Path(args.docs or DEFAULT_DOCS)

    import torch

    cuda = torch.cuda.is_available()
    args.device = args.device or ("cuda" if cuda else "cpu")
    if not args.device.startswith(("cuda", "cpu")):
        raise UserError(f"--device must be cuda[:N] or cpu, got {args.device!r}")
    args.render_only = not args.parts
    if not args.render_only and args.device.startswith("cuda") and not cuda:
        if args.smoke:
            raise UserError("no CUDA device: run the smoke test on CPU (--device cpu, the default here)")
        if not args.write_docs:
            raise UserError("no CUDA device: run with --smoke (tiny model on CPU), or --write-docs to render the "
                            "docs from the JSON")
        args.render_only = True  # a CPU machine rendering a GPU run's JSON
    if not args.render_only and args.device == "cpu" and not args.smoke:
        if not args.write_docs:
            raise UserError("the full benchmark needs a GPU; on CPU use --smoke (or --write-docs to render only)")
        args.render_only = True
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    return args


# ----------------------------------------------------------------------------- the run


def rough_seconds(p: Point, args) -> float:
    """A guess of a point's wall time on an H100/H200 (a fixed cost model, to plan runs)."""
    s = SHAPES[p.shape]
    H, L, V = s["hidden_size"], s["num_hidden_layers"], s["vocab_size"]
    params = L * (4 * H * H + 3 * H * s["intermediate_size"])
    if p.part == "check":
        return 90.0 if p.variant == "generate-static" else 3.0
    if p.part == "kernels":
        return 3.0
    if p.part == "prefill":
        tokens = p.T * p.B
        flops = 2 * params * tokens + (0 if p.converted else 2 * L * H * p.T * tokens)
        reps = 3 if flops / 3e14 < 0.3 else 1
        compile_s = 30.0 * L / 30 if p.variant.startswith("cgraph") else 0.0  # Inductor, once per point
        return 1.0 + (reps + 0.3) * flops / 3e14 + compile_s
    kv = 0 if p.converted else 2 * L * s["num_key_value_heads"] * s["head_dim"] * 2 * p.T * p.B
    ms = max(L * 0.7e-3, (2 * (params + V * H) + kv) / 3e12) if p.variant.startswith("eager") else (2 * params + kv) / 3e12
    compile_s = 30.0 * L / 30 if p.variant in ("compiled-static", "compiled-graph") else 0.0
    return 2.0 + kv / 5e11 + (args.steps + 4) * ms + compile_s


def ensure_kernels() -> str:
    """Make ``linearize.kernels`` importable from the repo's kernels/ when linearize is not installed
    (the GPU machine runs from a checkout), so the layers use the Triton kernels there."""
    try:
        importlib.import_module("linearize.kernels.linear_attn")
        return "linearize.kernels"
    except ImportError:
        pass
    path = REPO / "kernels"
    if not (path / "__init__.py").exists():
        return "unavailable"
    import linearize

    spec = importlib.util.spec_from_file_location("linearize.kernels", path / "__init__.py",
                                                  submodule_search_locations=[str(path)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["linearize.kernels"] = mod
    spec.loader.exec_module(mod)
    linearize.kernels = mod
    try:
        importlib.import_module("linearize.kernels.linear_attn")
    except ImportError as err:
        return f"unavailable ({err})"
    return f"{_rel(path)} (loaded by path)"


class Runner:
    """Measures the planned points not in the JSON yet, one model at a time, recording each at once."""

    def __init__(self, args):
        import torch

        from .measure import Measure

        self.args = args
        device = torch.device(args.device)
        self.cuda = device.type == "cuda"
        if self.cuda and device.index is not None:
            torch.cuda.set_device(device)  # memory statistics and events follow the current device
        self.m = Measure(device, getattr(torch, args.dtype), args.seed, args.steps, args.prefill_chunk,
                         args.decode_prefill, args.check_prompt)
        self.original = None  # (shape, model)
        self.converted = None  # (shape, preset, model)
        self.data = load_results(args.json, args.smoke)
        self.counts = {"run": 0, "skip": 0, "ok": 0, "oom": 0, "error": 0, "fail": 0, "left": 0}

    def get_model(self, shape: str, name: str):
        from .measure import build_original, convert, free_memory, model_record

        m = self.m
        if self.original is None or self.original[0] != shape:
            self.original = self.converted = None
            m.forget_compiled()
            free_memory(m.device)
            t = time.perf_counter()
            a = self.args
            positions = max(131072, *(T for T, _ in a.decode_points[shape] + a.prefill_points[shape]
                                      + a.memory_points[shape])) + 4096
            model = build_original(shape, self.args.seed, positions, m.device, m.dtype)
            self.original = (shape, model)
            self.data["shapes"][shape] = dict(SHAPES[shape])
            self.data["models"][f"{shape}/original"] = model_record(model, None)
            print(f"built {shape} original in {time.perf_counter() - t:.1f} s", flush=True)
        if name == "original":
            if self.converted is not None:  # back to the original: the presets' compiled steps go
                self.converted = None
                m.forget_compiled()
            return self.original[1]
        if self.converted is None or self.converted[:2] != (shape, name):
            self.converted = None
            m.forget_compiled()
            free_memory(m.device)
            t = time.perf_counter()
            model = convert(self.original[1], name, shape, self.args.smoke, m.device, m.dtype)
            self.converted = (shape, name, model)
            self.data["models"][f"{shape}/{name}"] = model_record(model, name)
            print(f"converted {shape} to {name} (sharing the original's weights) in {time.perf_counter() - t:.1f} s",
                  flush=True)
        return self.converted[2]

    def run(self, points: list[Point]) -> None:
        import torch

        from .measure import free_memory, measure_bandwidth, versions

        pts = self.data["points"]
        pending = [p for p in points if p.key not in pts or (self.args.retry_errors and pts[p.key]["status"] == "error")]
        guess = sum(rough_seconds(p, self.args) for p in pending) + 10 * len({(p.shape, p.model) for p in pending})
        print(f"plan: {len(points)} points, {len(points) - len(pending)} already in {self.args.json}, {len(pending)} to run; "
              f"rough guess {guess / 60:.1f} min on an H100/H200 (a cost model, not a measurement)", flush=True)
        if self.cuda and os.environ.get("LINEARIZE_KERNELS") is None:
            os.environ["LINEARIZE_KERNELS"] = "triton"  # fail loudly rather than time the PyTorch fallback
        self.m.bandwidth = measure_bandwidth(self.m.device) if pending else None
        run = dict(started=_now(), device=self._device_name(), argv=sys.argv[1:], dtype=self.args.dtype,
                   kernels=ensure_kernels(), linearize_kernels=os.environ.get("LINEARIZE_KERNELS", "auto"),
                   pdl=_pdl_setting(),  # kernels/pdl.py: part of how a preset runs
                   bandwidth_gbs=round(self.m.bandwidth / 1e9, 1) if self.m.bandwidth else None, **versions())
        print("run:", run, flush=True)
        if pending:
            self.data["runs"].append(run)
        self.run_id = len(self.data["runs"]) - 1
        t0 = time.perf_counter()
        done = 0
        budget = self.args.time_budget
        for p in points:
            if p not in pending:
                self.counts["skip"] += 1
                print(f"skip {p.key} (in JSON: {pts[p.key]['status']})", flush=True)
                continue
            if budget and time.perf_counter() - t0 > budget:
                self.counts["left"] = len(pending) - done
                print(f"time budget of {budget} s spent: {self.counts['left']} points left; run the same command again "
                      "to measure them", flush=True)
                break
            t = time.perf_counter()
            rec = self.measure(p)
            self.record(p, rec, time.perf_counter() - t)
            done += 1
            self.counts["run"] += 1
            self.counts[rec["status"]] = self.counts.get(rec["status"], 0) + 1
            print(f"[{done}/{len(pending)}] {p.key}: {summary(rec)}{self.beside_original(p, rec)}  "
                  f"({rec['elapsed_s']:.1f} s; total {_mmss(time.perf_counter() - t0)})", flush=True)
        self.original = self.converted = None
        self.m.forget_compiled()
        free_memory(self.m.device)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def beside_original(self, p: Point, rec: dict) -> str:
        """', 2.61x the original (...)' for a preset's prefill or decode point, when both are measured."""
        from .render import best_decode

        if not p.converted or rec["status"] != "ok" or p.part not in ("prefill", "decode"):
            return ""
        pts = self.data["points"]
        if p.part == "prefill":
            o = pts.get(Point("prefill", p.shape, "original", "one-call", p.T, p.B).key)
            if o and o["status"] == "ok":
                return f", {rec['tokens_per_s'] / o['tokens_per_s']:.2f}x the original's one call"
            return ""
        best = best_decode(pts, p.shape, "original", p.T, p.B)
        if best:
            return f", {rec['tokens_per_s'] / best[0]['tokens_per_s']:.2f}x the original's best ({best[1]})"
        return ""

    def record(self, p: Point, rec: dict, seconds: float) -> None:
        rec.update(part=p.part, shape=p.shape, model=p.model, variant=p.variant, T=p.T, B=p.B, run=self.run_id,
                   elapsed_s=round(seconds, 2))
        self.data["points"][p.key] = rec
        save_results(self.args.json, self.data)

    def _device_name(self) -> str:
        import platform

        import torch

        if self.cuda:
            return torch.cuda.get_device_name(self.m.device)
        return f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"

    def measure(self, p: Point) -> dict:
        """One point's record; out of memory and other errors are recorded, not raised. GPU memory
        is returned before the next point (gc costs ~0.2 s, so once per point)."""
        import torch

        from .checks import run_check
        from .measure import GiB, free_memory

        m = self.m
        try:
            model = self.get_model(p.shape, p.model)
            if p.part == "decode" and p.variant == "graph-static":
                check = self.ensure_graph_check(p.shape, p.model)
                if check["status"] != "ok":
                    return {"status": "error", "message": f"not timed: graph check failed ({check.get('message', '')})"}
            m.reset_peak()
            base = torch.cuda.memory_allocated() if self.cuda else None
            run = {"check": lambda: run_check(m, p, model), "kernels": lambda: m.kernels_point(p, model),
                   "decode": lambda: m.decode_point(p, model), "prefill": lambda: m.prefill_point(p, model)}[p.part]
            rec = run()
            if self.cuda:
                rec["peak_gib"] = round(torch.cuda.max_memory_allocated() / GiB, 3)
                rec["resident_gib"] = round(base / GiB, 3)
            rec.setdefault("status", "ok")
        except torch.OutOfMemoryError as err:
            rec = {"status": "oom", "message": str(err).splitlines()[0][:300]}
        except Exception as err:  # noqa: BLE001 - one failing point must not end a 10-minute GPU call
            tb = traceback.format_exception(type(err), err, err.__traceback__)
            rec = {"status": "error", "message": f"{type(err).__name__}: {err}"[:500], "traceback": "".join(tb[-6:])[-3000:]}
        free_memory(m.device)
        return rec

    def ensure_graph_check(self, shape: str, model_label: str) -> dict:
        """The graph-vs-eager check of this model, run now if the JSON lacks it: graph rows are only
        timed after their graph decoded the same tokens as eager decoding."""
        point = Point("check", shape, model_label, "graph-vs-eager")
        pts = self.data["points"]
        if point.key not in pts:
            t = time.perf_counter()
            self.record(point, self.measure(point), time.perf_counter() - t)
            print(f"(prerequisite) {point.key}: {summary(pts[point.key])}", flush=True)
        return pts[point.key]


def summary(rec: dict) -> str:
    """One line for the console."""
    s = rec["status"]
    if s == "ok" and "tokens_per_s" in rec:
        unit = "ms/step" if "steps" in rec else "ms"
        mem = f", peak {rec['peak_gib']:.2f} GiB" if rec.get("peak_gib") is not None else ""
        floor = f", {rec['x_floor']}x the memory floor" if rec.get("x_floor") else ""
        return f"{rec['tokens_per_s']:,.0f} tok/s, {rec['ms']:.3f} {unit}{floor}{mem}"
    if s == "ok" and "total" in rec:
        return f"{rec['total']} {rec['unit']} per step, {rec['per_converted_layer']} per converted layer"
    if s in ("ok", "fail"):  # a check
        return f"{s.upper()} {rec.get('message') or rec.get('compared') or ''}".strip()
    return f"{s.upper()}: {rec.get('message', '')}"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _mmss(s: float) -> str:
    return f"{int(s // 60)}m{int(s % 60):02d}s"


# ----------------------------------------------------------------------------- entry points


def run(args) -> dict:
    """Measure the planned points that are not in the JSON yet, then optionally render the docs.
    Returns the counts of points by outcome. Raises UserError for bad settings."""
    from .render import write_docs

    args = resolve(args)
    if args.render_only:
        if not args.write_docs:
            raise UserError("--parts none measures nothing: add --write-docs to render the docs from the JSON")
        if not args.json.exists():
            raise UserError(f"{args.json} does not exist: nothing to render")
        data = load_results(args.json, None)
        print(f"rendering only (no measurement) from {args.json}", flush=True)
        write_docs(data, args.docs)
        return {"run": 0, "skip": 0}
    import torch

    runner = Runner(args)
    threads = torch.get_num_threads()
    if not runner.cuda:
        torch.set_num_threads(1)  # a tiny model gains nothing from threads on a shared CPU
    try:
        runner.run(plan(args))
    finally:
        torch.set_num_threads(threads)
    if args.write_docs:
        write_docs(runner.data, args.docs)
    c = runner.counts
    print(f"done: {c['run']} run ({c.get('ok', 0)} ok, {c.get('oom', 0)} OOM, {c.get('fail', 0)} failed checks, "
          f"{c.get('error', 0)} errors), {c['skip']} skipped, {c['left']} left for the next call; results in "
          f"{args.json}", flush=True)
    return c


def build_parser(prog: str = "bench_e2e.py") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        counts = run(args)
    except UserError as err:
        print(f"bench_e2e: error: {err}", file=sys.stderr)
        return 2
    return 1 if counts.get("error") else 0


def _pdl_setting() -> str:
    """Where the decode kernels launched with PDL: "on" / "off" (LINEARIZE_PDL), "graphs" (the default:
    in the captures of linearize.DecodeGraph / PrefillGraph)."""
    try:
        from linearize.kernels.pdl import setting
    except Exception:
        return "off"
    return setting()


# ---------------------------------------------------------------- `linearize bench`

EPILOG_BENCH = """examples:
  linearize bench --smoke                                   # tiny model on CPU: every preset and part, no CUDA graphs
  linearize bench --write-docs --time-budget 450            # full run on a GPU -> docs/bench_e2e.json, docs (resumable)
  linearize bench --shapes llama-3.2-1b --presets gdn,lolcats --parts decode --decode-points 4K:1,64K:8
  linearize bench --write-docs --parts none                 # docs/reports/end-to-end.md + PNG from the JSON
same flags as scripts/bench_e2e.py
"""


def cmd_bench(args) -> None:
    counts = run(args)
    if counts.get("error"):
        raise UserError(f"{counts['error']} points failed with an error (recorded in the JSON with a traceback); "
                        "fix and rerun with --retry-errors")


def register(sub, fmt) -> None:
    """Add ``bench`` to the ``linearize`` command line's subparsers (``linearize.cli.COMMAND_MODULES``)."""
    k = sub.add_parser("bench", help="end-to-end speed and memory: original vs converted model, prefill and decode",
                       epilog=EPILOG_BENCH, formatter_class=fmt)
    add_arguments(k)
    k.set_defaults(func=cmd_bench)
