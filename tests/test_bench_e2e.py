"""The end-to-end benchmark on CPU: the smoke run through `linearize bench` (every preset and part
recorded, resumed without rerunning, stopped at a time budget, docs rendered between markers), the
targets' arithmetic on known numbers, the kernel count's attribution to layers, the memory floor,
the cache snapshot behind DecodeGraph, and the errors for bad flags."""

import importlib.util
import json
import sys

import pytest
import torch
from conftest import load_script, tiny_model
from transformers import StaticCache

import linearize
from linearize.benchmarks import checks, cli, measure, plan, render
from linearize.benchmarks.plan import PRESETS, SMOKE, Point, key

SMOKE_PRESETS = SMOKE["presets"].split(",")
from linearize.benchmarks.render import MARK_END, MARK_START
from linearize.cli import main
from linearize.graphs import CacheSnapshot, DecodeGraph, HostReads


def _args(*argv):
    return cli.resolve(cli.build_parser().parse_args(list(argv)))


def test_smoke_run_records_every_preset_and_part_resumes_and_renders(tmp_path, capsys):
    js, docs = tmp_path / "e2e.json", tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\n## Kernels\n\nkernel table stays\n")
    # the original's compiled step is transformers' own code; each dynamo trace costs seconds on CPU
    argv = ["bench", "--smoke", "--json", str(js), "--docs", str(docs), "--compile-original", "none", "--write-docs"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    expected = {p.key for p in plan.plan(_args(*argv[1:-1]))}
    assert f"plan: {len(expected)} points, 0 already in" in out  # the estimate printed before the run
    data = json.loads(js.read_text())
    points = data["points"]
    assert set(points) == expected
    assert {r["status"] for r in points.values()} == {"ok"}, {k: r.get("message") for k, r in points.items()}
    # every preset beside the original, in every part
    for part in plan.PARTS:
        assert {r["model"] for r in points.values() if r["part"] == part or (part == "generate" and
                r["variant"] == "generate-static")} >= set(SMOKE_PRESETS), part
    assert data["models"]["tiny/gdn-hybrid"]["conversion"]["layers"] == [1]  # layer 0 kept softmax
    assert data["models"]["tiny/gdn-hybrid"]["conversion"]["window"] == plan.SMOKE_WINDOW  # the preset's window
    assert data["models"]["tiny/lolcats"]["conversion"]["window"] == plan.SMOKE_WINDOW
    # decode: the three variants of every model, each with its memory floor
    for m in ["original", *SMOKE_PRESETS]:
        eager = "eager-dynamic" if m == "original" else "eager-default"
        for v in (eager, "graph-static") + (("compiled-static", "compiled-graph") if m != "original" else ()):
            r = points[key("decode", "tiny", m, v, 64, 1)]
            assert r["ms"] > 0 and r["floor_ms"] > 0 and r["x_floor"] == pytest.approx(r["ms"] / r["floor_ms"], rel=0.01)
        assert key("decode", "tiny", m, "compiled-static", 128, 2) not in points  # compiled only where planned
        if m != "original":
            for v in ("compiled-static", "compiled-graph"):
                compiled = points[key("decode", "tiny", m, v, 64, 1)]
                assert compiled["compile"].startswith("dynamo") and compiled["rel_logit_diff_vs_eager"] <= 1e-4
    assert key("decode", "tiny", "original", "compiled-static", 64, 1) not in points
    assert key("decode", "tiny", "original", "compiled-graph", 64, 1) not in points
    assert points[key("decode", "tiny", "hedgehog", "graph-static", 64, 1)]["cache"] == "StaticLinearizeCache"
    assert points[key("decode", "tiny", "original", "graph-static", 64, 1)]["cache"] == "StaticCache"
    # the floor counts every weight once plus what the step reads: the original's keys/values grow with T
    w = data["models"]["tiny/original"]["weight_bytes"]
    kv_token = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 kv heads, head_dim 16, fp32
    assert points[key("decode", "tiny", "original", "eager-dynamic", 64, 1)]["bytes_per_step"] == w + 64 * kv_token
    assert points[key("decode", "tiny", "original", "eager-dynamic", 128, 2)]["bytes_per_step"] == w + 128 * 2 * kv_token
    # kernels per step: attributed to the attention layers; the rest of the step is the same model
    kern = {m: points[key("kernels", "tiny", m, "eager-static", 64, 1)] for m in ["original", *SMOKE_PRESETS]}
    outside = {m: r["total"] - sum(r["per_layer"]) for m, r in kern.items()}
    assert len(set(outside.values())) == 1 and outside["original"] > 0, outside
    assert kern["original"]["per_converted_layer"] is None and kern["original"]["per_softmax_layer"] > 0
    hybrid = kern["gdn-hybrid"]  # its kept softmax layer as the original's; its GDN layer adds the window's ops
    assert hybrid["per_layer"][0] == kern["original"]["per_layer"][0]
    assert hybrid["per_layer"][1] > kern["gdn"]["per_layer"][1]
    assert kern["lolcats"]["per_converted_layer"] > kern["hedgehog"]["per_converted_layer"]  # the window costs ops
    # prefill: one call and chunked for the presets, the memory points chunked only
    assert points[key("prefill", "tiny", "gdn", "chunk32", 128, 2)]["chunk"] == 32
    # the captured and the compiled chunks' check is calibrated by the eager one call's distance from the
    # eager chunks (the captured ones are checked too: a graph on a wrongly reset cache once went unchecked)
    cg = [r for r in points.values() if r["variant"].startswith(("cgraph", "graph")) and r["part"] == "prefill"]
    assert {r["variant"][:2] for r in cg} == {"cg", "gr"}
    assert cg and all(r["rel_logit_diff_vs_eager"] <= 1e-4 and 0 <= r["rel_logit_diff_one_call_vs_chunks"] < 1e-3
                      for r in cg), cg
    assert key("prefill", "tiny", "gdn", "one-call", 64, 1) not in points
    assert key("prefill", "tiny", "gdn", "chunk32", 64, 1) in points
    # on CPU the graph check compares the static caches with the default ones, token for token
    check = points["check/tiny/hedgehog/graph-vs-eager"]
    assert check["compared"] == "eager-default vs eager-static" and check["rel_logit_diff"] <= check["tolerance"]
    assert check["host_reads_per_step"] == [] == points["check/tiny/original/graph-vs-eager"]["host_reads_per_step"]
    gen = points["check/tiny/gdn-hybrid/generate-static"]
    assert gen["static_tokens"] == gen["default_tokens"]

    text = docs.read_text()
    assert text.startswith("# Benchmarks\n\n## Kernels\n\nkernel table stays\n")
    section = text[text.index(MARK_START):text.index(MARK_END)]
    for heading in ("### Targets (issue 13)", "#### Checks", "#### Decode (ms per step", "#### Kernels per decode step",
                    "#### Prefill (tokens/s"):
        assert heading in section
    assert "| target | shape | baseline | hedgehog | linear | linear-scalar | lolcats | gdn | gdn-hybrid |" in section
    assert "| 128 | 2 | gdn-hybrid |" in section  # a table row
    # the presets as measured: the window the run's conversion recorded (the smoke's), not the full preset's 192
    assert f"`lolcats` (hedgehog features + a {plan.SMOKE_WINDOW}-token softmax window + 4 sinks)" in section
    assert f"`gdn-hybrid` (Gated DeltaNet beside a {plan.SMOKE_WINDOW}-token softmax window + 4 sinks; softmax kept" in section
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "data" / "bench_e2e.png").stat().st_size > 1000

    # second run: nothing is measured again, the file is unchanged
    before = js.read_text()
    assert main(argv[:-1]) == 0
    out = capsys.readouterr().out
    assert sum(line.startswith("skip ") for line in out.splitlines()) == len(expected)
    assert "done: 0 run" in out
    assert json.loads(js.read_text())["points"] == json.loads(before)["points"]

    # a lost point is measured again, alone
    data = json.loads(before)
    del data["points"]["decode/tiny/gdn/eager-default/T=64/B=1"]
    js.write_text(json.dumps(data))
    assert main(argv[:-1]) == 0
    out = capsys.readouterr().out
    assert "[1/1] decode/tiny/gdn/eager-default/T=64/B=1" in out and "done: 1 run" in out


def test_time_budget_stops_between_points_and_the_same_command_continues(tmp_path, monkeypatch, capsys):
    now = [0.0]

    def measure_point(self, p):  # each point takes 10 s of a fake clock
        now[0] += 10
        return {"status": "ok"}

    monkeypatch.setattr(cli.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(cli.Runner, "measure", measure_point)
    monkeypatch.setattr(measure, "measure_bandwidth", lambda device: 1e9)
    argv = ["bench", "--smoke", "--json", str(tmp_path / "e.json"), "--parts", "check", "--presets", "gdn",
            "--time-budget", "15"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    done = json.loads((tmp_path / "e.json").read_text())["points"]
    assert len(done) == 2 and "time budget of 15 s spent: 1 points left" in out
    assert main(argv) == 0  # the same command measures what is left
    assert len(json.loads((tmp_path / "e.json").read_text())["points"]) == 3
    assert "0 left for the next call" in capsys.readouterr().out


def test_presets_match_the_distill_recipes_and_the_hybrid_lists_are_fixed():
    from linearize.recipes.distill import PRESETS as RECIPES

    assert PRESETS["lolcats"]["window"] == RECIPES["lolcats"]["window"] == 192
    assert PRESETS["lolcats"]["sinks"] == RECIPES["lolcats"]["sinks"] == 4
    assert PRESETS["hedgehog"]["window"] == RECIPES["linear"]["window"] == 0
    assert PRESETS["linear"]["decay"] == RECIPES["linear"]["decay"] == "channel"  # the gate users run
    assert PRESETS["linear"]["gate_rank"] == RECIPES["linear"]["gate_rank"] == 16
    assert plan.preset_config("linear", "smollm2-135m").gate_rank == 16
    assert "decay" not in PRESETS["hedgehog"]
    assert PRESETS["gdn"]["method"] == RECIPES["gdn"]["method"]
    cfg = plan.preset_config("gdn-hybrid", "smollm2-135m")
    assert sorted(set(range(30)) - set(cfg.layers)) == [0, 1, 10, 17, 18, 20, 23, 24]
    assert (cfg.window, cfg.sinks) == (RECIPES["gdn-hybrid"]["window"], RECIPES["gdn-hybrid"]["sinks"]) == (192, 4)
    w0 = plan.preset_config("gdn-hybrid-w0", "smollm2-135m")  # the preset before its window, the qwen3_5 layout's layer
    assert (w0.window, w0.sinks, w0.layers) == (RECIPES["gdn-hybrid"]["qwen3_5"]["window"], 0, cfg.layers)
    cfg = plan.preset_config("gdn-hybrid", "llama-3.2-1b")
    kept = sorted(set(range(16)) - set(cfg.layers))
    assert kept == plan.HYBRID_SOFTMAX_LAYERS["llama-3.2-1b"] and len(kept) / 16 == 0.25
    assert (plan.preset_config("lolcats", "smollm2-135m").window, plan.preset_config("lolcats", "smollm2-135m").sinks) == (192, 4)
    assert plan.preset_config("lolcats", "tiny", smoke=True).window == plan.SMOKE_WINDOW
    hyb = plan.preset_config("lolcats-hybrid", "smollm2-135m")  # lolcats' layers, gdn-hybrid's kept list
    assert (hyb.window, hyb.sinks) == (RECIPES["lolcats-hybrid"]["window"], RECIPES["lolcats-hybrid"]["sinks"]) == (192, 4)
    assert sorted(set(range(30)) - set(hyb.layers)) == plan.HYBRID_SOFTMAX_LAYERS["smollm2-135m"]


def test_a_hybrid_decodes_from_a_prefill_of_the_whole_context():
    """A linear state's cost does not grow with T, so --decode-prefill shortens its prefill; a hybrid's
    softmax layers must hold all T keys/values, as the original's cache does."""
    m = measure.Measure(torch.device("cpu"), torch.float32, 0, 3, 32, 16, 24)
    linear = linearize.linearize(tiny_model("llama"), plan.preset_config("gdn", "tiny"))
    hybrid = linearize.linearize(tiny_model("llama"), plan.preset_config("gdn-hybrid", "tiny"))
    assert m.state_tokens(linear, 64) == 16 and m.state_tokens(hybrid, 64) == 64


def test_count_kernels_puts_each_op_in_its_layer():
    """One attention layer made to run extra ops: the count of that layer alone grows by them."""
    model = tiny_model("llama")
    model.eval()
    ids = torch.randint(2, 97, (1, 5))

    def step():
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)

    base = measure.count_kernels(step, model, cuda=False)
    attn = model.model.layers[1].self_attn
    forward = attn.forward

    def noisy(*a, **kw):
        out = forward(*a, **kw)
        return (out[0] + 0.0 * torch.ones(1).exp().neg(), *out[1:])  # ones, exp, neg, mul, add: 5 ops

    attn.forward = noisy
    more = measure.count_kernels(step, model, cuda=False)
    assert more["per_layer"][1] == base["per_layer"][1] + 5
    assert more["per_layer"][0] == base["per_layer"][0] and more["total"] == base["total"] + 5
    assert base["per_softmax_layer"] > 0 and base["per_converted_layer"] is None


def _pt(points, part, model, variant, T, B, shape="smollm2-135m", **rec):
    points[key(part, shape, model, variant, T, B)] = dict(status=rec.pop("status", "ok"), part=part, shape=shape,
                                                          model=model, variant=variant, T=T, B=B, run=0, **rec)


def _synthetic(gdn_ms_4k: float) -> dict:
    """The original and two presets on the SmolLM2 shape at the target points (known numbers)."""
    K, pts = 1024, {}
    for m in ("original", "hedgehog", "gdn"):
        _pt(pts, "kernels", m, "eager-static", 4 * K, 1, unit="CUDA kernels", total=600, per_layer=[10] * 30,
            per_converted_layer=None if m == "original" else (12.0 if m == "gdn" else 40.0),
            per_softmax_layer=10.0 if m == "original" else None)
    # decode B=1 at 4K: original best 2.0 ms (compiled), eager 4.0
    _pt(pts, "decode", "original", "eager-dynamic", 4 * K, 1, ms=4.0, tokens_per_s=250.0)
    _pt(pts, "decode", "original", "compiled-static", 4 * K, 1, ms=2.0, tokens_per_s=500.0)
    _pt(pts, "decode", "hedgehog", "graph-static", 4 * K, 1, ms=1.6, tokens_per_s=625.0, floor_ms=0.1, x_floor=16.0)
    _pt(pts, "decode", "gdn", "graph-static", 4 * K, 1, ms=1.2, tokens_per_s=1000 / 1.2)
    _pt(pts, "decode", "gdn", "compiled-static", 4 * K, 1, ms=gdn_ms_4k, tokens_per_s=1000 / gdn_ms_4k)
    # decode B=8 at 64K: the original ran out of memory compiled, 80 ms eager
    _pt(pts, "decode", "original", "eager-dynamic", 64 * K, 8, ms=80.0, tokens_per_s=100.0)
    _pt(pts, "decode", "original", "compiled-static", 64 * K, 8, status="oom")
    _pt(pts, "decode", "hedgehog", "graph-static", 64 * K, 8, ms=8.0, tokens_per_s=1000.0)
    _pt(pts, "decode", "gdn", "graph-static", 64 * K, 8, ms=16.0, tokens_per_s=500.0)
    for B, orig in ((1, 100_000.0), (8, 150_000.0)):
        _pt(pts, "prefill", "original", "one-call", 64 * K, B, tokens_per_s=orig, ms=1.0)
        _pt(pts, "prefill", "hedgehog", "one-call", 64 * K, B, tokens_per_s=3 * orig, ms=1.0)
        _pt(pts, "prefill", "hedgehog", "chunk8192", 64 * K, B, tokens_per_s=2.8 * orig, ms=1.0)
        _pt(pts, "prefill", "gdn", "one-call", 64 * K, B, tokens_per_s=2 * orig, ms=1.0)
        _pt(pts, "prefill", "gdn", "chunk8192", 64 * K, B, tokens_per_s=1.0 * orig, ms=1.0)
        _pt(pts, "prefill", "gdn", "graph8192", 64 * K, B, tokens_per_s=1.9 * orig, ms=1.0)  # the faster chunked
    for m, grow in (("hedgehog", 1.05), ("gdn", 1.5)):
        _pt(pts, "prefill", m, "chunk8192", 16 * K, 1, tokens_per_s=1.0, ms=1.0, peak_gib=2.0)
        _pt(pts, "prefill", m, "chunk8192", 128 * K, 1, tokens_per_s=1.0, ms=1.0, peak_gib=2.0 * grow)
    return {"format": 2, "smoke": False, "shapes": {}, "models": {}, "points": pts,
            "runs": [{"started": "2026-01-01 00:00 UTC", "device": "NVIDIA H100", "torch": "2.11.0",
                      "triton": "3.6.0", "transformers": "5.17.0", "cuda": "13.0", "dtype": "bfloat16",
                      "kernels": "linearize.kernels", "linearize_kernels": "triton", "bandwidth_gbs": 2900.0}]}


def test_targets_met_and_missed_on_known_numbers(tmp_path):
    rows = {(r["target"], r["preset"]): r for r in render.targets(_synthetic(gdn_ms_4k=0.8))}

    def get(prefix, preset):
        return next(r for (t, p), r in rows.items() if t.startswith(prefix) and p == preset)

    # decode B=1 at 4K: gdn's best is the compiled 0.8 ms (beats its graph), 2.5x the original's compiled 2.0 ms
    r = get("decode B=1 at 4K <= 1.0", "gdn")
    assert r["met"] is True and r["measured"] == "0.800 ms (compiled)"
    r = get("decode B=1 at 4K >= 1.5x", "gdn")
    assert r["met"] is True and r["measured"] == "0.800 ms (compiled) = 2.50x" and r["against"] == "2.000 ms (compiled)"
    assert get("decode B=1 at 4K <= 1.0", "hedgehog")["met"] is False  # 1.6 ms
    r = get("decode B=1 at 4K >= 1.5x", "hedgehog")
    assert r["met"] is False and r["measured"].endswith("= 1.25x")
    # B=8 at 64K: the compiled original ran out of memory, so its best is the eager 80 ms
    assert get("decode B=8 at 64K >= 8x", "hedgehog")["met"] is True  # 10x
    assert get("decode B=8 at 64K >= 8x", "gdn")["met"] is False  # 5x
    assert get("decode B=8 at 64K", "gdn")["against"] == "80.000 ms (eager)"
    assert get("<= 15 kernels", "gdn")["met"] is True and get("<= 15 kernels", "hedgehog")["met"] is False
    assert get("prefill at 64K B=8, one call", "hedgehog")["met"] is True  # 3x
    assert get("prefill at 64K B=1, one call", "gdn")["met"] is False  # 2x
    r = get("prefill at 64K B=1, chunked", "hedgehog")
    assert r["met"] is True and r["measured"] == "280,000 tok/s (eager) = 93%"
    # gdn's chunked prefill: the graph-replayed one (95%) is the faster, not the eager one (50%)
    r = get("prefill at 64K B=8, chunked", "gdn")
    assert r["met"] is True and r["measured"].endswith("(graph) = 95%"), r
    r = get("chunked prefill peak memory flat", "hedgehog")
    assert r["met"] is True and r["measured"] == "2.00 -> 2.10 GiB = 1.050"
    assert get("chunked prefill peak memory flat", "gdn")["met"] is False
    # the 1.0 ms and 8x targets are SmolLM2's: a Llama-1B run is held to 1.5x at 4K only
    slow = render.targets(_synthetic(gdn_ms_4k=1.5))
    assert next(r for r in slow if r["target"].startswith("decode B=1 at 4K <= 1.0") and r["preset"] == "gdn")["met"] is False

    docs = tmp_path / "b.md"
    docs.write_text(f"intro\n{MARK_START}\nold\n{MARK_END}\noutro\n")
    render.write_docs(_synthetic(0.8), docs)
    text = docs.read_text()
    assert text.startswith("intro\n") and text.endswith("\noutro\n") and "old" not in text
    assert "NVIDIA H100" in text and "2,900 GB/s" in text
    assert "{" not in text, "a placeholder left unformatted (a string missing its f prefix)"
    # whether the decode kernels ran with programmatic dependent launch (a run before the switch: off)
    assert "programmatic dependent launch (LINEARIZE_PDL): off;" in text
    with_pdl = _synthetic(0.8)
    with_pdl["runs"][0]["pdl"] = True
    render.write_docs(with_pdl, docs)
    assert "programmatic dependent launch (LINEARIZE_PDL): on;" in docs.read_text()
    with_pdl["runs"].append({**with_pdl["runs"][0], "pdl": False})
    with_pdl["points"][next(iter(with_pdl["points"]))]["run"] = 1
    render.write_docs(with_pdl, docs)
    assert "LINEARIZE_PDL): **differs between runs: off; on**;" in docs.read_text()
    with_pdl["runs"] = [{**run, "pdl": "graphs"} for run in with_pdl["runs"]]  # the default since 2026-11-26
    render.write_docs(with_pdl, docs)
    assert ("LINEARIZE_PDL): in the CUDA graphs of linearize.DecodeGraph and PrefillGraph (graph and compiled-graph "
            "variants, chunked graph prefill), off elsewhere;") in docs.read_text()
    render.write_docs(_synthetic(0.8), docs)
    text = docs.read_text()
    assert "| decode B=1 at 4K >= 1.5x the original's best | smollm2-135m | 2.000 ms (compiled) |" in text
    assert "| 64K | 8 | original | 80.000 | - | OOM |" in text
    assert "| 4K | 1 | hedgehog | - | 1.600 | - | - | 1.25x (graph / compiled) | 0.100 | 16.0x |" in text


def test_the_original_best_counts_its_captured_compiled_step_too():
    """The compiled step captured by DecodeGraph is measured for the original as well, and a faster
    one becomes the original's best: no preset is judged against a slower baseline than exists."""
    data = _synthetic(gdn_ms_4k=0.8)
    _pt(data["points"], "decode", "original", "compiled-graph", 4096, 1, ms=1.6, tokens_per_s=625.0)
    _pt(data["points"], "decode", "gdn", "compiled-graph", 4096, 1, ms=0.7, tokens_per_s=1000 / 0.7)
    rows = render.targets(data)
    r = next(r for r in rows if r["target"].startswith("decode B=1 at 4K >= 1.5x") and r["preset"] == "gdn")
    assert r["against"] == "1.600 ms (compiled, graph)" and r["measured"] == "0.700 ms (compiled, graph) = 2.29x"
    r = next(r for r in rows if r["target"].startswith("decode B=1 at 4K >= 1.5x") and r["preset"] == "hedgehog")
    assert r["met"] is False and r["measured"] == "1.600 ms (graph) = 1.00x"
    # a ratio that two decimals would round onto the line shows a third: 1.495x is no 1.50x
    _pt(data["points"], "decode", "lolcats", "compiled-graph", 4096, 1, ms=1.6 / 1.495, tokens_per_s=625.0 * 1.495)
    r = next(r for r in render.targets(data) if r["target"].startswith("decode B=1 at 4K >= 1.5x") and
             r["preset"] == "lolcats")
    assert r["met"] is False and r["measured"].endswith("= 1.495x"), r
    # a chunked prefill replaying the compiled chunk counts as the preset's chunked prefill when faster
    _pt(data["points"], "prefill", "gdn", "cgraph8192", 65536, 8, tokens_per_s=2.1 * 150_000.0, ms=1.0)
    r = next(r for r in render.targets(data) if r["target"].startswith("prefill at 64K B=8, chunked") and
             r["preset"] == "gdn")
    assert r["measured"] == "315,000 tok/s (compiled graph) = 105%", r
    assert "| 64K | 8 | gdn | 300,000 | 150,000 | 285,000 | 315,000 | 105% | 2.00x |" in "\n".join(
        render._prefill_table(data["points"], "smollm2-135m"))
    table = "\n".join(render._decode_table(data["points"], "smollm2-135m"))
    assert "| 4K | 1 | original | 4.000 | - | 2.000 | 1.600 | 1.00x (compiled, graph / compiled, graph) |" in table


def test_without_matplotlib_the_markdown_is_written_and_a_warning_printed(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as on the GPU machine
    docs = tmp_path / "b.md"
    render.write_docs(_synthetic(0.8), docs)
    assert "WARNING: matplotlib is not installed" in capsys.readouterr().out
    assert "#### Decode" in docs.read_text() and "bench_e2e.png" not in docs.read_text()
    assert not (tmp_path / "data" / "bench_e2e.png").exists()


def _step(model, cache, tok, pos):
    out = model(input_ids=tok, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1]


@pytest.mark.parametrize("kind", ["original", "converted-window"])
def test_cache_snapshot_undoes_decode_steps(kind):
    """What DecodeGraph relies on: warm-up steps are undone exactly, in place, for both static caches."""
    model = tiny_model("llama")
    if kind == "original":
        cache = StaticCache(config=model.config, max_cache_len=40)
    else:
        linearize.linearize(model, linearize.LinearAttentionConfig(feature_map="hedgehog", window=4))
        cache = linearize.StaticLinearizeCache(model.config, max_batch_size=2, max_cache_len=40)
    g = torch.Generator().manual_seed(0)
    prompt, toks = torch.randint(2, 97, (2, 12), generator=g), torch.randint(2, 97, (2, 2), generator=g)
    pos = torch.full((2, 1), 12)
    with torch.no_grad():
        measure.prefill(model, prompt, cache)
        snap = CacheSnapshot(cache)
        a = _step(model, cache, toks[:, :1], pos)
        b = _step(model, cache, toks[:, 1:], pos + 1)
        assert int(cache.get_seq_length()) == 14
        snap.restore()
        assert int(cache.get_seq_length()) == 12 and not snap.changed_tensors()
        assert torch.equal(_step(model, cache, toks[:, :1], pos), a)
        assert torch.equal(_step(model, cache, toks[:, 1:], pos + 1), b)
    # and the steps did change the cache: continuing without the restore gives other logits
    with torch.no_grad():
        assert not torch.allclose(_step(model, cache, toks[:, :1], pos), a)


def test_cache_snapshot_sees_a_replaced_tensor_and_puts_it_back():
    class Layer:
        def __init__(self):
            self.states = {0: torch.zeros(3)}
            self.count = 0

    class Cache:
        def __init__(self):
            self.layers = [Layer()]

    cache = Cache()
    original = cache.layers[0].states[0]
    snap = CacheSnapshot(cache)
    cache.layers[0].states[0] = torch.ones(3)  # what a non-static cache does every step
    cache.layers[0].count = 5
    assert snap.changed_tensors() == ["layers[0].states[0]"]
    snap.restore()
    assert cache.layers[0].states[0] is original and cache.layers[0].count == 0


def test_host_reads_name_the_line_that_reads():
    x = torch.randn(3)
    with HostReads() as reads:
        y = x * 2  # fine: stays a tensor
        positive = bool((y > 0).all())  # a host read
    assert len(reads.found) == 1 and reads.found[0].startswith("aten._local_scalar_dense at test_bench_e2e.py:")
    assert isinstance(positive, bool)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_decode_graph_needs_cuda():
    model = tiny_model("llama")
    with pytest.raises(RuntimeError, match="DecodeGraph needs CUDA"):
        DecodeGraph(model, StaticCache(config=model.config, max_cache_len=16), batch_size=1)


@pytest.mark.parametrize("argv, message", [
    (["--decode-points", "4K:1,0:8"], "'0:8' is not CONTEXT:BATCH (e.g. 64K:8)"),
    (["--kernels-at", "64K"], "'64K' is not CONTEXT:BATCH (e.g. 64K:8)"),
    (["--steps", "eight"], "'eight' is not a positive integer"),
    (["--shapes", "gpt-5"], "unknown shape 'gpt-5'; known: smollm2-135m, llama-3.2-1b, tiny"),
    (["--presets", "mamba"], "unknown preset 'mamba'; known: hedgehog, linear, linear-scalar, lolcats, gdn, gdn-hybrid"),
    (["--parts", "prefil"], "unknown part 'prefil'; choose from check,kernels,decode,prefill,generate"),
])
def test_bad_flags_say_what_is_wrong(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_settings_say_what_to_do(tmp_path, capsys):
    js = str(tmp_path / "x.json")
    if not torch.cuda.is_available():
        assert main(["bench", "--json", js]) == 2
        assert "the full benchmark needs a GPU; on CPU use --smoke" in capsys.readouterr().err
    assert main(["bench", "--json", js, "--parts", "none"]) == 2
    assert "--parts none measures nothing" in capsys.readouterr().err
    (tmp_path / "x.json").write_text(json.dumps({"format": 2, "smoke": False, "runs": [], "shapes": {}, "points": {}}))
    assert main(["bench", "--smoke", "--json", js]) == 2
    assert "holds a full run; use another --json for --smoke" in capsys.readouterr().err
    (tmp_path / "x.json").write_text(json.dumps({"smoke": False, "runs": [], "shapes": {}, "points": {}}))
    assert main(["bench", "--smoke", "--json", js]) == 2
    assert "is in the format 1 of an older benchmark" in capsys.readouterr().err


def test_script_wrapper_reaches_the_same_entry_point():
    assert load_script("bench_e2e").load_bench() is cli


def test_the_modeling_files_do_not_import_the_benchmark():
    from pathlib import Path

    # the command line's files name it (their one registration point), nothing else of the library does
    for path in (Path(linearize.__file__).parent).glob("*.py"):
        assert "benchmark" not in path.read_text().replace("linearize bench", "") or path.name in ("cli.py", "flags.py"), path


def test_generate_check_reports_where_the_static_tokens_leave_the_default(tmp_path):
    """A static generate that takes another token at step 3 fails the check, which names the step,
    how far below the default's best that token scored, and compares scores only up to there."""
    runner = cli.Runner(_args("--smoke", "--json", str(tmp_path / "e2e.json")))
    model = linearize.linearize(tiny_model("llama"), linearize.LinearAttentionConfig(feature_map="hedgehog"))
    model.eval()
    real = model.generate

    def generate(ids, **kw):
        out = real(ids, **kw)
        if kw.get("cache_implementation") == "static":  # pretend the compiled step picked the runner-up at step 3
            s = out.scores[2][0]
            out.sequences[0, ids.shape[1] + 2] = s.topk(2).indices[1]
        return out

    model.generate = generate
    rec = checks.check_generate(runner.m, model)
    assert rec["status"] == "fail"
    assert rec["first_difference"]["step"] == 3
    gap = rec["first_difference"]["static_choice_below_default_best"]
    assert gap == pytest.approx(rec["first_difference"]["default_top2_gap"]) and gap > 0
    assert "from step 3" in rec["message"]
    model.generate = real
    assert checks.check_generate(runner.m, model)["status"] == "ok"


def test_plan_of_the_full_run_holds_every_target_point():
    """The full run (GPU) plans what the targets read, for both shapes and every preset."""
    args = _args("--json", "/nonexistent/x.json", "--write-docs")  # on CPU: render-only, but the plan is the same
    args.parts = [p for p in plan.PARTS if p != "generate"]
    keys = {p.key for p in plan.plan(args)}
    full = plan.FULL["presets"].split(",")  # the presets users run; linear-scalar only when asked for
    assert full == [m for m in PRESETS if m not in ("linear-scalar", "gdn-hybrid-w0")]
    assert not any("/linear-scalar/" in k for k in keys)
    for shape in ("smollm2-135m", "llama-3.2-1b"):
        assert key("decode", shape, "original", "compiled-static", 4096, 1) in keys
        assert key("decode", shape, "original", "compiled-graph", 4096, 1) in keys
        for m in full:
            assert key("decode", shape, m, "compiled-static", 4096, 1) in keys
            assert key("decode", shape, m, "compiled-graph", 4096, 1) in keys
            assert key("kernels", shape, m, "eager-static", 4096, 1) in keys
            assert key("prefill", shape, m, "one-call", 65536, 1) in keys
            assert key("prefill", shape, m, "chunk8192", 65536, 1) in keys
            assert key("prefill", shape, m, "cgraph8192", 65536, 1) in keys
            assert key("prefill", shape, m, "chunk8192", 16384, 1) in keys
            assert key("prefill", shape, m, "chunk8192", 131072, 1) in keys
    # the B=8 targets at 64K are measured on SmolLM2's shape
    assert key("decode", "smollm2-135m", "original", "compiled-static", 65536, 8) in keys
    for m in full:
        assert key("decode", "smollm2-135m", m, "graph-static", 65536, 8) in keys
        assert key("prefill", "smollm2-135m", m, "one-call", 65536, 8) in keys
        assert key("prefill", "smollm2-135m", m, "chunk8192", 65536, 8) in keys
    # a flag's points hold for every shape
    args = _args("--json", "/nonexistent/x.json", "--write-docs", "--decode-points", "4K:8")
    assert args.decode_points == {s: [(4096, 8)] for s in plan.SHAPES}
    assert Point("check", "tiny", "gdn", "generate-static").key not in keys


class _FakeMeasure:
    """What check_chunked reads of a Measure, on CPU in bf16."""

    prefill_chunk, cuda, dtype = 32, False, torch.bfloat16

    def random_ids(self, B, T, vocab, salt=0):
        return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(salt))

    def converted_cache(self, model, B, T, static):
        return linearize.LinearizeCache(model.config)


@pytest.mark.parametrize("chunked_error, verdict", [(0.001, "ok"), (0.05, "ok"), (0.2, "fail")])
def test_chunked_check_judges_16_bit_results_by_their_own_rounding(monkeypatch, chunked_error, verdict):
    """A random model's bf16 one call can sit 0.07 from its float32 one call (the SmolLM2 shape), above
    the check's fixed 0.03: chunked logits that are no further from float32 than 1.5x the one call's
    own distance pass; a chunked result far off fails whatever the rounding."""
    model = tiny_model("llama")
    linearize.linearize(model, linearize.GatedDeltaNetConfig())
    model.to(torch.bfloat16)
    ref = torch.ones(2, 8)
    out = {"whole": ref * 1.04, "parts": ref * (1.04 - chunked_error), "ref": ref}

    def fake_prefill(mdl, ids, cache, chunk=None):
        return out["ref"] if next(mdl.parameters()).dtype == torch.float32 else out["parts" if chunk else "whole"]

    monkeypatch.setattr(checks, "prefill", fake_prefill)
    monkeypatch.setattr(measure, "prefill", fake_prefill)  # float32_prefill lives in measure.py
    rec = checks.check_chunked(_FakeMeasure(), model)
    assert rec["status"] == verdict, rec
    assert rec["one_call_vs_float32"] == pytest.approx(0.04, rel=1e-3)
    if verdict == "fail":
        assert "from float32" in rec["message"]


def test_a_compiled_chunked_prefill_beyond_the_16_bit_tolerance_is_judged_against_float32():
    # the check of a cgraph point: within the tolerance it passes; beyond it in bf16 a float32 copy's
    # eager chunks decide (at most 1.5x as far as the eager bf16 chunks), never a fixed line alone
    g = torch.Generator().manual_seed(0)
    exact = torch.randn(8, 512, generator=g)
    noise = lambda scale: exact + scale * exact.norm() / (4096 ** 0.5) * torch.randn(8, 512, generator=g)  # noqa: E731
    ref = noise(0.08)  # the eager bf16 chunks, ~0.08 from float32
    one = ref + 0.01 * (ref - exact)  # the eager one call: rounding moves it ~0.001 from ref
    bf16, f32 = torch.bfloat16, torch.float32
    near = noise(0.05)
    ok = measure.judge_graph_prefill(near, ref, one, bf16)
    assert "status" not in ok and "needs_float32" not in ok and 0.05 < ok["rel_logit_diff_vs_eager"] < 0.1
    far = exact - 1.2 * (ref - exact)  # rounded the other way: ~0.18 from ref, ~0.1 from float32
    assert measure.judge_graph_prefill(far, ref, one, bf16)["needs_float32"] is True
    judged = measure.judge_graph_prefill(far, ref, one, bf16, exact)
    assert judged["rel_logit_diff_vs_eager"] > 0.1 and "status" not in judged and judged["judged_by"] == "float32"
    assert judged["compiled_vs_float32"] <= checks.NOISE_FACTOR * judged["eager_chunks_vs_float32"]
    wrong = noise(0.5)  # far from float32 too: a fast prefill computing something else
    bad = measure.judge_graph_prefill(wrong, ref, one, bf16, exact)
    assert bad["status"] == "fail" and "from a float32 copy's, more than 1.5x the eager 16-bit chunks'" in bad["message"]
    # in float32 the dtype's tolerance alone decides
    assert measure.judge_graph_prefill(near, ref, one, f32)["status"] == "fail"
