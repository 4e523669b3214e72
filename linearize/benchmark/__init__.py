"""End-to-end benchmark: an original Hugging Face Llama beside the presets users pick (``hedgehog``,
``lolcats``, ``gdn``, ``gdn-hybrid``), each converted from it, in one process on one GPU.

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
renders the "End-to-end" section of docs/benchmarks.md (between ``<!-- e2e:start -->`` and
``<!-- e2e:end -->``) and a PNG.

    python scripts/bench_e2e.py --write-docs --time-budget 450     # the full run, on a GPU
    python scripts/bench_e2e.py --shapes llama-3.2-1b --presets gdn --parts decode
    python scripts/bench_e2e.py --smoke --json /tmp/e2e.json       # tiny model, CPU, every preset and part
    python scripts/bench_e2e.py --write-docs --parts none          # render from the JSON only (no CUDA)

The modeling files of ``linearize`` never import this package (a saved checkpoint's code stays flat).
"""

from .cli import add_arguments, build_parser, main, run

__all__ = ["add_arguments", "build_parser", "main", "run"]
