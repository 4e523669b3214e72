"""End-to-end benchmark, original vs converted model: prefill and decode speed and peak memory.

The logic lives in ``benchmarks/`` (also ``linearize bench``, same flags); this wrapper runs it
from a checkout where ``linearize`` is not installed (the GPU machine), loading the package and its
``kernels/`` folder by path.

    python scripts/bench_e2e.py --help
    python scripts/bench_e2e.py --smoke                      # tiny model on CPU: every preset and part, no CUDA graphs
    python scripts/bench_e2e.py --write-docs --time-budget 450   # the full run, on a GPU (resumable)
    python scripts/bench_e2e.py --write-docs --parts none    # docs/reports/end-to-end.md + PNG from the JSON
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def load_bench():
    if importlib.util.find_spec("linearize") is None:
        spec = importlib.util.spec_from_file_location(
            "linearize", REPO / "linearize" / "__init__.py", submodule_search_locations=[str(REPO / "linearize")])
        module = importlib.util.module_from_spec(spec)
        sys.modules["linearize"] = module
        spec.loader.exec_module(module)
    return importlib.import_module("linearize.benchmarks.cli")


if __name__ == "__main__":
    sys.exit(load_bench().main())
