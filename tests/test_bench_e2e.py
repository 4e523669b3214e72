"""The end-to-end benchmark on CPU: the smoke run through `linearize bench` (every point recorded,
resumed without rerunning, docs rendered between markers), the targets' arithmetic on known numbers,
the cache snapshot behind DecodeGraph, and the errors for bad flags."""

import importlib.util
import json
import sys

import pytest
import torch
from conftest import load_script, tiny_model
from transformers import StaticCache

import linearize
from linearize import bench
from linearize.bench import MARK_END, MARK_START, Point
from linearize.cli import main
from linearize.graphs import CacheSnapshot, DecodeGraph, HostReads


def _expected_keys(json_path, docs_path) -> set[str]:
    args = bench.build_parser().parse_args(["--smoke", "--json", str(json_path), "--docs", str(docs_path)])
    return {p.key for p in bench.plan(bench.resolve(args))}


def test_smoke_run_records_every_point_resumes_and_renders(tmp_path, capsys):
    js, docs = tmp_path / "e2e.json", tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\n## Kernels\n\nkernel table stays\n")
    argv = ["bench", "--smoke", "--json", str(js), "--docs", str(docs), "--write-docs"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    expected = _expected_keys(js, docs)
    assert "plan: 32 points, 0 already in" in out  # the estimate printed before the run
    data = json.loads(js.read_text())
    points = data["points"]
    assert set(points) == expected and len(expected) == 32
    assert {r["status"] for r in points.values()} == {"ok"}, {k: r.get("message") for k, r in points.items()}
    # every part and variant is there: chunked prefill above the chunk, both caches of both models
    assert points["prefill/tiny/hedgehog/chunk32/T=128/B=2"]["chunk"] == 32
    assert points["decode/tiny/hedgehog/graph-static/T=64/B=2"]["cache"] == "StaticLinearizeCache"
    assert points["decode/tiny/original/graph-static/T=64/B=2"]["cache"] == "StaticCache"
    assert points["decode/tiny/original/eager-dynamic/T=128/B=1"]["state"] == "random K/V of T tokens"
    assert points["decode/tiny/hedgehog/eager-default/T=128/B=1"]["cache"] == "LinearizeCache"
    for r in points.values():
        if r["part"] in ("prefill", "decode"):
            assert r["tokens_per_s"] > 0 and r["ms"] > 0
    # on CPU the graph check compares the static caches with the default ones, token for token
    check = points["check/tiny/hedgehog/graph-vs-eager"]
    assert check["compared"] == "eager-default vs eager-static" and check["rel_logit_diff"] <= check["tolerance"]
    # and what CUDA-graph capture needs holds on CPU already: no host read in a static decode step
    assert check["host_reads_per_step"] == [] == points["check/tiny/original/graph-vs-eager"]["host_reads_per_step"]
    assert points["check/tiny/hedgehog/generate-static"]["static_tokens"] == points["check/tiny/hedgehog/generate-static"]["default_tokens"]

    text = docs.read_text()
    assert text.startswith("# Benchmarks\n\n## Kernels\n\nkernel table stays\n")
    section = text[text.index(MARK_START):text.index(MARK_END)]
    for heading in ("#### Targets", "#### Checks", "#### Prefill (tokens/s)", "#### Decode (tokens/s",
                    "#### Peak memory"):
        assert heading in section
    assert "- decode at 64K, batch 8" in section and "- peak memory, decode at 128K batch 8" in section
    assert "| 128 | 2 |" in section  # a table row
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "bench_e2e.png").stat().st_size > 1000

    # second run: nothing is measured again, the file is unchanged, the section is replaced, not appended
    before = js.read_text()
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert sum(line.startswith("skip ") for line in out.splitlines()) == 32
    assert "to run" in out and "32 to run" not in out and "done: 0 run" in out
    assert json.loads(js.read_text())["points"] == json.loads(before)["points"]
    assert docs.read_text().count(MARK_START) == 1

    # a lost point is measured again, alone
    data = json.loads(before)
    del data["points"]["decode/tiny/original/eager-dynamic/T=64/B=1"]
    js.write_text(json.dumps(data))
    assert main(argv[:-1]) == 0
    out = capsys.readouterr().out
    assert "[1/1] decode/tiny/original/eager-dynamic/T=64/B=1" in out and "done: 1 run" in out


def _pt(points, part, model, variant, T, B, **rec):
    key = Point(part, "smollm2-135m", model, variant, T, B).key
    points[key] = dict(status=rec.pop("status", "ok"), part=part, shape="smollm2-135m", model=model, variant=variant,
                       T=T, B=B, run=0, **rec)


def _synthetic(conv_decode_64k: float) -> dict:
    pts = {}
    K = 1024
    for T in (4 * K, 16 * K, 64 * K, 128 * K):
        orig = 2000.0 * 4 * K / T
        if T == 128 * K:
            _pt(pts, "decode", "original", "eager-dynamic", T, 8, status="oom")
            _pt(pts, "decode", "original", "graph-static", T, 8, status="oom")
        else:
            _pt(pts, "decode", "original", "eager-dynamic", T, 8, tokens_per_s=orig, ms=8000 / orig, peak_gib=3 + T / K / 10)
            _pt(pts, "decode", "original", "graph-static", T, 8, tokens_per_s=orig * 1.2, ms=8000 / orig / 1.2, peak_gib=3 + T / K / 10)
        conv = conv_decode_64k if T == 64 * K else 7000.0
        _pt(pts, "decode", "hedgehog", "eager-default", T, 8, tokens_per_s=500.0, ms=16.0, peak_gib=1.5)
        _pt(pts, "decode", "hedgehog", "graph-static", T, 8, tokens_per_s=conv, ms=8000 / conv, peak_gib=1.6)
        _pt(pts, "prefill", "original", "dynamic", T, 8, tokens_per_s=4e5 * 4 * K / T, ms=1.0, peak_gib=2 + T / K)
        _pt(pts, "prefill", "hedgehog", "cache", T, 8, tokens_per_s=3e5 if T != 64 * K else 2.9e5, ms=1.0, peak_gib=2 + T / K)
        _pt(pts, "prefill", "hedgehog", "chunk8192", T, 8, tokens_per_s=2.8e5, ms=1.0, peak_gib=4.0)
    return {"format": 1, "smoke": False, "shapes": {}, "points": pts,
            "runs": [{"started": "2026-01-01 00:00 UTC", "device": "NVIDIA H200", "torch": "2.11.0",
                      "triton": "3.6.0", "transformers": "5.17.0", "cuda": "13.0", "dtype": "bfloat16",
                      "kernels": "linearize.kernels", "static_cache": "StaticLinearizeCache"}]}


def test_targets_pass_and_miss_on_known_numbers(tmp_path):
    lines = bench.targets(_synthetic(conv_decode_64k=7000.0)["points"], "smollm2-135m", "hedgehog")
    text = "\n".join(lines)
    # original best at 64K batch 8: graph 2000 * 4/64 * 1.2 = 150 tok/s; converted 7000 -> 46.67x
    assert "converted 7,000 tok/s (graph-static) vs the original's best 150 tok/s (graph-static): 46.67x" in text
    assert "flat from 4K to 128K" in text and "min/max 1.000" in text
    # prefill: 290K at 64K vs 300K at 4K = 0.97; original 400K * 4/64 = 25K -> 11.6x
    assert "converted 290,000 tok/s at 64K vs 300,000 at 4K = 0.97" in text and "11.60x" in text
    # decode memory: the original ran out of memory at 128K, the converted did not
    assert "peak memory, decode at 128K batch 8: converted 1.50 GiB (eager-default), original OOM -> PASS" in text
    # prefill memory: best converted (chunked, 4 GiB) vs the original's 130 GiB
    assert "peak memory, prefill at 128K batch 8: converted 4.00 GiB (chunk8192) vs original 130.00 GiB" in text
    assert "chunked prefill peak memory (8192-token chunks, batch 8): 4.00 GiB at 4K, 4.00 GiB at 128K" in text
    assert text.count("PASS") == 6 and "MISS" not in text

    slow = "\n".join(bench.targets(_synthetic(conv_decode_64k=600.0)["points"], "smollm2-135m", "hedgehog"))
    assert "4.00x (target >= 5x) -> MISS" in slow
    assert "min/max 0.086 (target: within 10%) -> MISS" in slow

    docs = tmp_path / "b.md"
    docs.write_text(f"intro\n{MARK_START}\nold\n{MARK_END}\noutro\n")
    bench.write_docs(_synthetic(7000.0), docs)
    text = docs.read_text()
    assert text.startswith("intro\n") and text.endswith("\noutro\n") and "old" not in text
    assert "NVIDIA H200" in text and "| 128K | 8 | OOM | OOM |" in text


def test_without_matplotlib_the_markdown_is_written_and_a_warning_printed(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as on the GPU machine
    docs = tmp_path / "b.md"
    bench.write_docs(_synthetic(7000.0), docs)
    assert "WARNING: matplotlib is not installed" in capsys.readouterr().out
    assert "#### Decode" in docs.read_text() and "bench_e2e.png" not in docs.read_text()
    assert not (tmp_path / "bench_e2e.png").exists()


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
        bench.prefill(model, prompt, cache)
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
    (["--contexts", "4K,0"], "'0' is not a positive integer (write e.g. 4096 or 4K)"),
    (["--decode-batches", "eight"], "'eight' is not a positive integer"),
    (["--shapes", "gpt-5"], "unknown shape 'gpt-5'; known: smollm2-135m, llama-3.2-1b, tiny"),
    (["--parts", "prefil"], "unknown part 'prefil'; choose from check,prefill,decode,generate"),
    (["--compile-at", "64K"], "'64K' is not CONTEXT:BATCH (e.g. 64K:8)"),
])
def test_bad_flags_say_what_is_wrong(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_settings_say_what_to_do(tmp_path, capsys):
    js = str(tmp_path / "x.json")
    assert main(["bench", "--smoke", "--json", js, "--method", "gdn", "--window", "4"]) == 2
    assert "--window and --feature-map belong to --method linear_attention" in capsys.readouterr().err
    assert main(["bench", "--smoke", "--json", js, "--feature-map", "bogus"]) == 2
    assert "unknown feature_map 'bogus'; choose one of" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["bench", "--json", js]) == 2
        assert "the full benchmark needs a GPU; on CPU use --smoke" in capsys.readouterr().err
    assert main(["bench", "--json", js, "--parts", "none"]) == 2
    assert "--parts none measures nothing" in capsys.readouterr().err
    (tmp_path / "x.json").write_text(json.dumps({"smoke": False, "runs": [], "shapes": {}, "points": {}}))
    assert main(["bench", "--smoke", "--json", js]) == 2
    assert "holds a full run; use another --json for --smoke" in capsys.readouterr().err


def test_script_wrapper_reaches_the_same_entry_point():
    assert load_script("bench_e2e").load_bench() is bench


def test_generate_check_reports_where_the_static_tokens_leave_the_default(tmp_path):
    """A static generate that takes another token at step 3 fails the check, which names the step,
    how far below the default's best that token scored, and compares scores only up to there."""
    args = bench.build_parser().parse_args(["--smoke", "--json", str(tmp_path / "e2e.json")])
    runner = bench.Runner(bench.resolve(args))
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
    rec = runner.check_generate(model)
    assert rec["status"] == "fail"
    assert rec["first_difference"]["step"] == 3
    gap = rec["first_difference"]["static_choice_below_default_best"]
    assert gap == pytest.approx(rec["first_difference"]["default_top2_gap"]) and gap > 0
    assert "from step 3" in rec["message"]
    model.generate = real
    assert runner.check_generate(model)["status"] == "ok"
