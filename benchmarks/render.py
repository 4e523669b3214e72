"""Rendering the end-to-end benchmark's JSON: the targets of issue 13 with met / missed, the tables
per shape, the plot, and the section of docs/reports/end-to-end.md between the e2e markers."""

from __future__ import annotations

import datetime
from pathlib import Path

from .measure import DECODE_WARMUP, NOISE_FACTOR
from .plan import (PRESETS, SHAPES, SMOKE, TARGET_KERNELS_PER_LAYER, TARGET_LARGE, TARGET_MEMORY, TARGET_PREFILL_T,
                   TARGET_SMALL, key, point, point_list)

MARK_START, MARK_END = "<!-- e2e:start -->", "<!-- e2e:end -->"

# ----------------------------------------------------------------------------- lookups


def _ok(points: dict, k: str):
    r = points.get(k)
    return r if r and r["status"] == "ok" else None


def _cell(points: dict, k: str, fmt) -> str:
    r = points.get(k)
    if r is None:
        return "-"
    if r["status"] == "oom":
        return "OOM"
    if r["status"] != "ok":
        return r["status"]
    return fmt(r)


def _ctx(T: int) -> str:
    return f"{T // 1024}K" if T % 1024 == 0 else str(T)


def _models(points: dict, shape: str) -> list[str]:
    seen = {r["model"] for r in points.values() if r["shape"] == shape}
    return [m for m in ["original", *PRESETS] if m in seen]


def _variants(points, part, shape, model):
    return list(dict.fromkeys(r["variant"] for r in points.values()
                              if r["part"] == part and r["shape"] == shape and r["model"] == model))


def _points_of(points, part, shape) -> list[tuple[int, int]]:
    return sorted({(r["T"], r["B"]) for r in points.values() if r["part"] == part and r["shape"] == shape})


def best_decode(points: dict, shape: str, model: str, T: int, B: int):
    """(record, variant) of the model's fastest decode at (T, B), or None."""
    found = [(r, v) for v in _variants(points, "decode", shape, model)
             if (r := _ok(points, key("decode", shape, model, v, T, B)))]
    return max(found, key=lambda x: x[0]["tokens_per_s"]) if found else None


def _chunk_variant(points, shape, model, kind: str = "chunk") -> str | None:
    """The model's chunked-prefill variant: ``chunk<N>`` (eager calls), ``graph<N>`` (PrefillGraph) or
    ``cgraph<N>`` (PrefillGraph of the compiled forward)."""
    vs = [v for v in _variants(points, "prefill", shape, model) if v.startswith(kind)]
    return vs[0] if vs else None


def _best_chunked(points, shape, model, T, B):
    """(record, "eager", "graph" or "compiled graph", chunk length) of the fastest chunked prefill at
    (T, B), or Nones."""
    how = {"chunk": "eager", "graph": "graph", "cgraph": "compiled graph"}
    found = [(r, how[kind], v.removeprefix(kind)) for kind in how
             if (v := _chunk_variant(points, shape, model, kind)) and (r := _ok(points, key("prefill", shape, model, v, T, B)))]
    return max(found, key=lambda x: x[0]["tokens_per_s"]) if found else (None, None, None)


# ----------------------------------------------------------------------------- targets


def target_points(data: dict) -> dict:
    """Where the targets are read: the issue's points, or the smoke run's stand-ins."""
    if not data.get("smoke"):
        return {"small": TARGET_SMALL, "large": TARGET_LARGE, "prefill_T": TARGET_PREFILL_T, "memory": TARGET_MEMORY,
                "decode_shapes": ("smollm2-135m",)}
    dec = point_list(SMOKE["decode_points"])
    mem = [T for T, _ in point_list(SMOKE["memory_points"])]
    return {"small": dec[0], "large": dec[-1], "prefill_T": max(T for T, _ in point_list(SMOKE["prefill_points"])),
            "memory": (min(mem), max(mem)), "decode_shapes": ("tiny",), "kernels_at": point(SMOKE["kernels_at"])}


def targets(data: dict) -> list[dict]:
    """Issue 13's targets, one row per (target, shape, preset, batch): the measured value, what it is
    measured against, and met (True / False / None when not measured)."""
    points = data["points"]
    at = target_points(data)
    rows = []

    def row(target, shape, preset, measured, against, met):
        rows.append({"target": target, "shape": shape, "preset": preset, "measured": measured, "against": against,
                     "met": met})

    for shape in [s for s in SHAPES if any(r["shape"] == s for r in points.values())]:
        presets = [m for m in _models(points, shape) if m != "original"]
        (Ts, Bs), (Tl, Bl) = at["small"], at["large"]
        for preset in presets:
            small = best_decode(points, shape, preset, Ts, Bs)
            orig = best_decode(points, shape, "original", Ts, Bs)
            if shape in at["decode_shapes"]:
                row(f"decode B={Bs} at {_ctx(Ts)} <= 1.0 ms/step", shape, preset,
                    f"{small[0]['ms']:.3f} ms ({_short(small[1])})" if small else "not measured", "",
                    small[0]["ms"] <= 1.0 if small else None)
            row(f"decode B={Bs} at {_ctx(Ts)} >= 1.5x the original's best", shape, preset,
                *_ratio(small, orig, 1.5))
            if shape in at["decode_shapes"]:
                large = best_decode(points, shape, preset, Tl, Bl)
                row(f"decode B={Bl} at {_ctx(Tl)} >= 8x the original's best", shape, preset,
                    *_ratio(large, best_decode(points, shape, "original", Tl, Bl), 8.0,
                            orig_oom=_all_oom(points, shape, "original", "decode", Tl, Bl)))
            kp = [r for r in points.values() if r["part"] == "kernels" and r["shape"] == shape and r["model"] == preset
                  and r["status"] == "ok"]
            k = kp[0] if kp else None
            row(f"<= {TARGET_KERNELS_PER_LAYER} kernels per converted layer per decode step", shape, preset,
                f"{k['per_converted_layer']} {k['unit']} ({k['total']} per step)" if k else "not measured", "",
                k["per_converted_layer"] <= TARGET_KERNELS_PER_LAYER if k else None)
            T = at["prefill_T"]
            chunk = _chunk_variant(points, shape, preset)
            for B in sorted({b for t, b in _points_of(points, "prefill", shape) if t == T}):
                one = _ok(points, key("prefill", shape, preset, "one-call", T, B))
                o = _ok(points, key("prefill", shape, "original", "one-call", T, B))
                if one and o:
                    r = one["tokens_per_s"] / o["tokens_per_s"]
                    row(f"prefill at {_ctx(T)} B={B}, one call >= 2.5x the original", shape, preset,
                        f"{one['tokens_per_s']:,.0f} tok/s = {r:.2f}x", f"{o['tokens_per_s']:,.0f} tok/s", r >= 2.5)
                else:
                    row(f"prefill at {_ctx(T)} B={B}, one call >= 2.5x the original", shape, preset, "not measured", "",
                        None)
                ch, how, size = _best_chunked(points, shape, preset, T, B)
                if ch and one:
                    r = ch["tokens_per_s"] / one["tokens_per_s"]
                    row(f"prefill at {_ctx(T)} B={B}, chunked ({size}) >= 90% of one call", shape, preset,
                        f"{ch['tokens_per_s']:,.0f} tok/s ({how}) = {r:.0%}", f"{one['tokens_per_s']:,.0f} tok/s",
                        r >= 0.9)
                else:
                    row(f"prefill at {_ctx(T)} B={B}, chunked >= 90% of one call", shape, preset, "not measured", "",
                        None)
            lo, hi = at["memory"]
            for B in sorted({b for t, b in _points_of(points, "prefill", shape) if t == hi}):
                a = _ok(points, key("prefill", shape, preset, chunk, lo, B)) if chunk else None
                b = _ok(points, key("prefill", shape, preset, chunk, hi, B)) if chunk else None
                name = f"chunked prefill peak memory flat from {_ctx(lo)} to {_ctx(hi)} (B={B}), within 10%"
                if a and b and a.get("peak_gib") and b.get("peak_gib"):
                    r = b["peak_gib"] / a["peak_gib"]
                    row(name, shape, preset, f"{a['peak_gib']:.2f} -> {b['peak_gib']:.2f} GiB = {r:.3f}", "", r <= 1.10)
                else:
                    row(name, shape, preset, "not measured" + (" (no CUDA memory statistics)" if a and b else ""), "",
                        None)
    return rows


def _all_oom(points, shape, model, part, T, B) -> bool:
    recs = [points.get(key(part, shape, model, v, T, B)) for v in _variants(points, part, shape, model)]
    recs = [r for r in recs if r]
    return bool(recs) and all(r["status"] == "oom" for r in recs)


def _ratio(conv, orig, need: float, orig_oom: bool = False):
    if conv and orig:
        r = conv[0]["tokens_per_s"] / orig[0]["tokens_per_s"]
        shown = f"{r:.2f}" if (float(f"{r:.2f}") >= need) == (r >= need) else f"{r:.3f}"  # 1.495x is no 1.50x
        return (f"{conv[0]['ms']:.3f} ms ({_short(conv[1])}) = {shown}x",
                f"{orig[0]['ms']:.3f} ms ({_short(orig[1])})", r >= need)
    if conv and orig_oom:
        return f"{conv[0]['ms']:.3f} ms ({_short(conv[1])})", "OOM", True
    return "not measured", "", None


def _met(v) -> str:
    return "n/a" if v is None else ("**met**" if v else "**missed**")


# ----------------------------------------------------------------------------- tables


def _targets_table(rows) -> list[str]:
    """One row per (target, shape), one column per preset: the measured value and met / missed."""
    presets = list(dict.fromkeys(r["preset"] for r in rows))
    groups: dict[tuple[str, str], dict[str, dict]] = {}
    for r in rows:
        groups.setdefault((r["target"], r["shape"]), {})[r["preset"]] = r
    out = ["| target | shape | baseline | " + " | ".join(presets) + " |", "|---|---|---|" + "---|" * len(presets)]
    for (target, shape), by in groups.items():
        base = {r["against"] for r in by.values() if r["against"]}
        # the original's best is one value for every preset; a preset's own one-call rate is not
        baseline = base.pop() if len(base) == 1 and "chunked" not in target else ("each preset's one call"
                                                                                   if "chunked (" in target else "-")
        cells = [f"{by[p]['measured']}: {_met(by[p]['met'])}" if p in by else "-" for p in presets]
        out.append(f"| {target} | {shape} | {baseline} | " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    met = sum(r["met"] is True for r in rows)
    missed = sum(r["met"] is False for r in rows)
    return out + ["", f"{met} met, {missed} missed, {len(rows) - met - missed} not measured.", ""]


def _checks_table(points, shape) -> list[str]:
    rows = [(m, v, r) for m in _models(points, shape) for v in ("graph-vs-eager", "chunked-prefill", "generate-static")
            if (r := points.get(key("check", shape, m, v)))]
    if not rows:
        return []
    out = ["#### Checks", "", "| model | check | result | detail |", "|---|---|---|---|"]
    for m, v, r in rows:
        if r["status"] == "error":
            d = r.get("message", "")
        elif v == "graph-vs-eager":
            d = (f"{r.get('tokens')} greedy tokens x batch {r.get('batch')} after a {r.get('prompt')}-token prompt, "
                 f"{r.get('compared')}: max logit difference {r.get('rel_logit_diff', float('nan')):.2g} of the "
                 f"largest logit (tol {r.get('tolerance')}); host reads in a decode step: "
                 f"{len(r.get('host_reads_per_step', [])) or 'none'}")
            if "default_cache_agreement" in r:
                d += f"; agreement with the default cache {r['default_cache_agreement']:.2f}"
        elif v == "chunked-prefill":
            d = (f"{r.get('length')} tokens in chunks of {r.get('chunk')} vs one call: relative logit diff "
                 f"{r.get('rel_diff', float('nan')):.2g} (tol {r.get('tolerance')}), same argmax {r.get('same_argmax')}")
            if r.get("one_call_vs_float32") is not None:
                d += (f"; from a float32 copy's one call: chunked {r['chunked_vs_float32']:.2g}, one call "
                      f"{r['one_call_vs_float32']:.2g}" + (f" (judged by these: chunked within {NOISE_FACTOR}x of "
                                                           "the one call's own rounding)" if r.get("judged_by") else ""))
            if r.get("graph_rel_diff") is not None:
                d += (f"; PrefillGraph vs one call {r['graph_rel_diff']:.2g}, the next decode step after it vs the "
                      f"dynamic cache's {r['graph_next_rel_diff']:.2g}")
        else:
            d = r.get("message", "")
            if r.get("seconds") is not None:
                d += f" (the static generate took {r['seconds']} s, torch.compile included on CUDA)"
        out.append(f"| {m} | {v} | {r['status'].upper()} | {d.replace('|', '/')} |")
    return out + [""]


def _decode_table(points, shape) -> list[str]:
    pts = _points_of(points, "decode", shape)
    if not pts:
        return []
    cols = ["eager", "graph-static", "compiled-static", "compiled-graph"]
    out = ["#### Decode (ms per step; tokens/s = B x 1000 / ms)", "",
           "Eager: DynamicCache for the original (what `generate()` does by default), LinearizeCache for a preset. "
           "Graph: one step captured by `linearize.DecodeGraph` over StaticCache / StaticLinearizeCache, replayed. "
           "Compiled: `torch.compile(model.forward, mode=\"reduce-overhead\", fullgraph=True, dynamic=False)` over the "
           "same static caches: what `generate(cache_implementation=\"static\")` runs, i.e. **the original's best "
           "as a transformers user gets it**. Compiled, graph: `linearize.DecodeGraph(model, cache, B, compile=True)`, "
           "the forward compiled by Inductor in its default mode and one step of it captured in a CUDA graph "
           "(one launch per step on the host, no guards or CUDA-graph-tree checks), run for the original too. "
           "Best / original's best compares each model's fastest measured variant "
           "with the original's fastest. Floor: the bytes a step must move (every weight once, plus the converted "
           "layers' state and the softmax layers' keys/values of T tokens, read once) over the measured copy "
           "bandwidth. Kernels: CUDA kernels the profiler saw in one replayed step (empty where it sees none).", "",
           "| T | B | model | eager | graph | compiled | compiled, graph | best / original's best | floor ms | best / floor "
           "| kernels | peak GiB |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for T, B in pts:
        orig = best_decode(points, shape, "original", T, B)
        for m in _models(points, shape):
            vs = {v: points.get(key("decode", shape, m, v, T, B)) for v in _variants(points, "decode", shape, m)}
            eager = "eager-dynamic" if m == "original" else "eager-default"
            if not any(vs.values()):
                continue
            cells = [_cell(points, key("decode", shape, m, eager if c == "eager" else c, T, B),
                           lambda r: f"{r['ms']:.3f}") for c in cols]
            best = best_decode(points, shape, m, T, B)
            ratio = "-"
            if best and orig:
                ratio = (f"{best[0]['tokens_per_s'] / orig[0]['tokens_per_s']:.2f}x ({_short(best[1])} / "
                         f"{_short(orig[1])})")
            elif best and _all_oom(points, shape, "original", "decode", T, B):
                ratio = "original OOM"
            floor = f"{best[0]['floor_ms']:.3f}" if best and best[0].get("floor_ms") else "-"
            xf = f"{best[0]['x_floor']:.1f}x" if best and best[0].get("x_floor") else "-"
            seen = best[0].get("kernels_seen_in_step") if best else None
            peak = f"{best[0]['peak_gib']:.2f}" if best and best[0].get("peak_gib") is not None else "-"
            out.append(f"| {_ctx(T)} | {B} | {m} | " + " | ".join(cells) + f" | {ratio} | {floor} | {xf} | "
                       f"{seen if seen else '-'} | {peak} |")
    return out + [""]


def _short(variant: str) -> str:
    return {"eager-dynamic": "eager", "eager-default": "eager", "graph-static": "graph",
            "compiled-static": "compiled", "compiled-graph": "compiled, graph"}.get(variant, variant)


def _kernels_table(points, shape) -> list[str]:
    rows = [r for m in _models(points, shape) for r in points.values()
            if r["part"] == "kernels" and r["shape"] == shape and r["model"] == m]
    if not rows:
        return []
    unit = rows[0].get("unit", "kernels")
    out = [f"#### Kernels per decode step ({unit}, eager step over the static cache: what a DecodeGraph captures)", "",
           "| model | T | B | per step | per converted attention layer | per softmax attention layer | outside attention |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            out.append(f"| {r['model']} | {_ctx(r['T'])} | {r['B']} | {r['status']} | | | |")
            continue
        inside = sum(r["per_layer"])
        out.append(f"| {r['model']} | {_ctx(r['T'])} | {r['B']} | {r['total']} | {r['per_converted_layer'] or '-'} | "
                   f"{r['per_softmax_layer'] or '-'} | {r['total'] - inside} |")
    return out + [""]


def _prefill_table(points, shape) -> list[str]:
    pts = _points_of(points, "prefill", shape)
    if not pts:
        return []
    out = ["#### Prefill (tokens/s; peak GiB in parentheses)", "",
           "| T | B | model | one call | chunked | chunked, graph | chunked, compiled graph | best chunked / one call "
           "| one call / original |",
           "|---|---|---|---|---|---|---|---|---|"]

    def fmt(r):
        mem = f" ({r['peak_gib']:.2f})" if r.get("peak_gib") is not None else ""
        return f"{r['tokens_per_s']:,.0f}{mem}"

    for T, B in pts:
        o = _ok(points, key("prefill", shape, "original", "one-call", T, B))
        for m in _models(points, shape):
            chunk = _chunk_variant(points, shape, m)
            one_k = key("prefill", shape, m, "one-call", T, B)
            ch_k = key("prefill", shape, m, chunk, T, B) if chunk else None
            if one_k not in points and (ch_k is None or ch_k not in points):
                continue
            graph, cgraph = _chunk_variant(points, shape, m, "graph"), _chunk_variant(points, shape, m, "cgraph")
            gr_k = key("prefill", shape, m, graph, T, B) if graph else None
            cg_k = key("prefill", shape, m, cgraph, T, B) if cgraph else None
            one, (ch, _, _) = _ok(points, one_k), _best_chunked(points, shape, m, T, B)
            r1 = f"{ch['tokens_per_s'] / one['tokens_per_s']:.0%}" if one and ch else "-"
            r2 = f"{one['tokens_per_s'] / o['tokens_per_s']:.2f}x" if one and o and m != "original" else "-"
            out.append(f"| {_ctx(T)} | {B} | {m} | {_cell(points, one_k, fmt)} | "
                       f"{_cell(points, ch_k, fmt) if ch_k else '-'} | "
                       f"{_cell(points, gr_k, fmt) if gr_k and gr_k in points else '-'} | "
                       f"{_cell(points, cg_k, fmt) if cg_k and cg_k in points else '-'} | {r1} | {r2} |")
    return out + [""]


# ----------------------------------------------------------------------------- the section


def render(data: dict, png_name: str | None) -> str:
    points, runs = data["points"], data["runs"]
    used = sorted({r["run"] for r in points.values() if "run" in r})
    L = [MARK_START, "## End-to-end: the original beside every preset (decode and prefill)", ""]
    if not points:
        return "\n".join(L + [("Not measured yet. On a GPU: `python scripts/bench_e2e.py --write-docs` (resumable), "
                               "which writes `docs/bench_e2e.json`, this section and its plot."), "", MARK_END])
    devs = sorted({runs[i]["device"] for i in used})
    last = runs[used[-1]]
    bws = sorted({runs[i]["bandwidth_gbs"] for i in used if runs[i].get("bandwidth_gbs")})
    L.append(f"Written by `scripts/bench_e2e.py` (`linearize bench`) from `bench_e2e.json` on {_now()}; measured "
             f"{runs[used[0]]['started']} .. {last['started']} on {' and '.join(devs)}"
             + (" (**mixed devices: compare rows with care**)" if len(devs) > 1 else "")
             + f"; torch {last['torch']}, triton {last['triton']}, transformers {last['transformers']}, "
               f"CUDA {last['cuda']}; {last['dtype']}, sdpa; kernels: {last['kernels']} (LINEARIZE_KERNELS="
               f"{last['linearize_kernels']}); programmatic dependent launch (LINEARIZE_PDL): "
               f"{_pdl_text(runs, used)}; device-to-device copy bandwidth "
             + (" / ".join(f"{b:,.0f}" for b in bws) + " GB/s" if bws else "not measured") + "."
             + (" **Smoke run (tiny model, CPU): code paths, not speeds.**" if data.get("smoke") else ""))
    L.append("")
    steps = "/".join(str(x) for x in sorted({r["steps"] for r in points.values() if "steps" in r})) or "the"
    measured = [n for n in PRESETS if any(r["model"] == n for r in points.values())]
    convs = {n: next((m["conversion"] for k, m in data.get("models", {}).items()
                      if k.endswith("/" + n) and "conversion" in m), None) for n in measured}
    presets = ", ".join(f"`{n}` ({_preset_text(n, convs[n])})" for n in measured)
    L += [("Presets: " + presets + ". Every preset of a shape lives in one process beside the original on the same "
           "device and shares its weights (converted layers reuse the original q/k/v/o by reference); weights are "
           "random (speed does not depend on their values). Prefill: one forward of B x T random tokens with "
           "`use_cache=True` and `logits_to_keep=1` (the original fills a DynamicCache, a preset its state cache), "
           "in one call or in chunks, timed with CUDA events after a warm-up at a shorter length, median of up to 3 "
           "runs. Chunked, graph: the same chunks through a `StaticLinearizeCache`, each full chunk replayed from "
           "one `linearize.PrefillGraph` (captured once before the timed runs, as a server captures once per batch "
           "size and chunk length; the capture time is the point's `capture_s` in the JSON). "
           f"Decode: {steps} greedy steps after {DECODE_WARMUP} warm-up steps. The original decodes from a "
           "cache filled directly with T random keys/values per layer; a preset's state comes from a real prefill "
           "(the `state` field of each point in the JSON says how many tokens) and positions continue from T. Peak "
           "memory: `torch.cuda.max_memory_allocated` over the point, weights included. OOM: out of GPU memory.")]
    L.append("")
    if data.get("notes"):  # hand-written remarks kept in the JSON (e.g. what changed since the run)
        L += [f"- {n}" for n in data["notes"]] + [""]
    L += ["### Targets (issue 13)", ""] + _targets_table(targets(data))
    for shape in [s for s in SHAPES if any(r["shape"] == s for r in points.values())]:
        sh = data["shapes"].get(shape, SHAPES[shape])
        L += [f"### {shape}", ""]
        recs = {m: data.get("models", {}).get(f"{shape}/{m}") for m in _models(points, shape)}
        desc = [f"{m} {r['params'] / 1e6:.1f}M parameters" + (f", {r['converted_layers']} converted layers"
                                                                if "converted_layers" in r else "")
                for m, r in recs.items() if r]
        L += [f"Shape: {sh['num_hidden_layers']} layers, hidden {sh['hidden_size']}, {sh['num_attention_heads']} heads / "
              f"{sh['num_key_value_heads']} kv heads, head_dim {sh['head_dim']}, intermediate "
              f"{sh['intermediate_size']}, vocab {sh['vocab_size']}, tied embeddings" + ("; " + "; ".join(desc) if desc else "")
              + ".", ""]
        L += _checks_table(points, shape) + _decode_table(points, shape) + _kernels_table(points, shape)
        L += _prefill_table(points, shape)
    if png_name:
        L += [f"![decode ms per step, prefill tokens/s and chunked-prefill memory per preset]({png_name})", ""]
    L.append(MARK_END)
    return "\n".join(L)


def _pdl_text(runs, used) -> str:
    """Whether the runs behind the table launched the decode kernels with PDL (runs from before the
    switch existed ran without it)."""
    names = {True: "on", False: "off", "graphs": "in the CUDA graphs of linearize.DecodeGraph and PrefillGraph "
             "(graph and compiled-graph variants, chunked graph prefill), off elsewhere"}
    on = {names.get(runs[i].get("pdl", False), str(runs[i].get("pdl"))) for i in used}
    return on.pop() if len(on) == 1 else "**differs between runs: " + "; ".join(sorted(on)) + "**"


def _preset_text(name: str, conv: dict | None = None) -> str:
    """The preset as measured: its window, sinks and gate from the conversion the JSON records (a preset's
    window has changed between runs: lolcats measured 64 keys before it had 192), else from PRESETS."""
    from .plan import HYBRID_SOFTMAX_LAYERS

    p = dict(PRESETS[name])
    if conv is not None:  # a config leaves out a window or sinks of 0
        p.update(window=conv.get("window") or 0, sinks=conv.get("sinks") or 0, decay=conv.get("decay"))
    sinks = f" + {p['sinks']} sinks" if p.get("sinks") else ""
    kept = ("; softmax kept in layers " + "; ".join(f"{ids} of {SHAPES[s]['num_hidden_layers']} ({s})"
                                                    for s, ids in HYBRID_SOFTMAX_LAYERS.items() if s != "tiny")
            if "softmax_layers" in p else "")
    if p["method"] == "gdn":
        window = (f" beside a {p['window']}-token softmax window{sinks}" if p.get("window")
                  else ", no window" if "window" in PRESETS[name] else "")
        return f"Gated DeltaNet{window}" + (kept or " in every layer")
    rank = f" of rank {p['gate_rank']}" if p.get("gate_rank") else ""
    gate = f", a {p['decay']} decay gate{rank}" if p.get("decay") else ""
    return (f"{p['feature_map']} features{gate}" + (f" + a {p['window']}-token softmax window{sinks}" if p["window"]
                                                    else ", no window") + kept)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


# ----------------------------------------------------------------------------- plot


def plot(data: dict, path: Path) -> bool | None:
    """Per shape: decode ms per step (each model's best) at each decode point, prefill tokens/s (one
    call and chunked) at each prefill point, and chunked-prefill peak memory at each context.
    False without matplotlib, None when there is nothing to plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    points = data["points"]
    shapes = [s for s in SHAPES if any(r["shape"] == s and r["part"] in ("prefill", "decode") for r in points.values())]
    if not shapes:
        return None
    fig, axes = plt.subplots(len(shapes), 3, figsize=(18, 4.5 * len(shapes)), squeeze=False)
    colors = dict(zip(["original", *PRESETS], ["tab:red", "tab:blue", "tab:cyan", "tab:olive", "tab:green", "tab:purple", "tab:orange", "tab:gray", "tab:brown"]))
    for row, shape in zip(axes, shapes):
        models = _models(points, shape)
        width = 0.8 / max(len(models), 1)
        # decode
        ax = row[0]
        dp = _points_of(points, "decode", shape)
        for j, m in enumerate(models):
            ys = [(b[0]["ms"] if (b := best_decode(points, shape, m, T, B)) else 0) for T, B in dp]
            ax.bar([i + j * width for i in range(len(dp))], ys, width, color=colors[m], label=m)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(dp))], [f"{_ctx(T)}, B={B}" for T, B in dp])
        ax.set_yscale("log")
        ax.set_ylabel("ms per step (best variant)")
        ax.set_title(f"{shape}: decode")
        # prefill
        ax = row[1]
        pp = [(T, B) for T, B in _points_of(points, "prefill", shape)
              if any(key("prefill", shape, m, "one-call", T, B) in points for m in models)]
        for j, m in enumerate(models):
            one = [(r["tokens_per_s"] if (r := _ok(points, key("prefill", shape, m, "one-call", T, B))) else 0) for T, B in pp]
            chunk = _chunk_variant(points, shape, m)
            ch = [(r["tokens_per_s"] if chunk and (r := _ok(points, key("prefill", shape, m, chunk, T, B))) else 0)
                  for T, B in pp]
            xs = [i + j * width for i in range(len(pp))]
            ax.bar(xs, one, width, color=colors[m], label=m)
            ax.scatter(xs, [c or float("nan") for c in ch], color="black", marker="_", s=200, zorder=3,
                       label="chunked" if j == len(models) - 1 else None)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(pp))], [f"{_ctx(T)}, B={B}" for T, B in pp])
        ax.set_ylabel("tokens/s (bar: one call; dash: chunked)")
        ax.set_title(f"{shape}: prefill")
        # memory
        ax = row[2]
        for m in models:
            chunk = _chunk_variant(points, shape, m)
            vals = sorted((r["T"], r["peak_gib"]) for r in points.values() if chunk and r["part"] == "prefill"
                          and r["shape"] == shape and r["model"] == m and r["variant"] == chunk and r["B"] == 1
                          and r["status"] == "ok" and r.get("peak_gib") is not None)
            if vals:
                ax.plot([t for t, _ in vals], [g for _, g in vals], "o-", color=colors[m], label=m)
        if ax.lines:
            ax.set_xscale("log", base=2)
        else:
            ax.text(0.5, 0.5, "no peak memory measured (CPU run)", ha="center", transform=ax.transAxes)
        ax.set_xlabel("tokens (B=1)")
        ax.set_ylabel("peak GiB, chunked prefill")
        ax.set_title(f"{shape}: chunked prefill memory")
        for ax in row:
            ax.grid(True, alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_docs(data: dict, docs: Path) -> None:
    png = docs.parent / "data" / "bench_e2e.png"
    png.parent.mkdir(parents=True, exist_ok=True)
    has_png = plot(data, png)
    if has_png is False:
        print("WARNING: matplotlib is not installed: no PNG written (run --write-docs again where it is)", flush=True)
    section = render(data, f"data/{png.name}" if has_png else None)
    text = docs.read_text() if docs.exists() else ""
    if MARK_START in text and MARK_END in text:
        head, rest = text.split(MARK_START, 1)
        tail = rest.split(MARK_END, 1)[1]
        text = head + section + tail
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + section + "\n"
    docs.parent.mkdir(parents=True, exist_ok=True)
    docs.write_text(text)
    print(f"wrote the End-to-end section of {docs}" + (f" and {png}" if has_png else ""), flush=True)

