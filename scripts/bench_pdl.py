"""Decode steps with programmatic dependent launch off and on (kernels/pdl.py), in one process on one
GPU: each preset's step timed exactly as `linearize bench` times a decode point (``Measure.decode_point``:
greedy steps over the static cache, after warm-up), alternating PDL off / on ``--repeats`` times, each
time a fresh capture (LINEARIZE_PDL is read when the kernels are launched, i.e. captured).

    python scripts/bench_pdl.py --out docs/pdl.md                      # smollm2-135m, 4K, B=1
    python scripts/bench_pdl.py --presets lolcats,gdn --variants compiled-static --repeats 3
"""
import argparse
import datetime
import os
import statistics

import torch

from linearize.benchmark.measure import Measure, build_original, convert
from linearize.benchmark.plan import Point


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2-135m")
    p.add_argument("--presets", default="hedgehog,lolcats,gdn")
    p.add_argument("--variants", default="compiled-static,graph-static")
    p.add_argument("-T", type=int, default=4096)
    p.add_argument("-B", type=int, default=1)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=None, help="write the table here (markdown)")
    a = p.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    m = Measure(dev, dtype, seed=0, steps=a.steps, prefill_chunk=8192, decode_prefill=1024, check_prompt=96)
    original = build_original(a.shape, 0, a.T + a.steps + 512, dev, dtype)
    rows = []
    for preset in a.presets.split(","):
        model = convert(original, preset, a.shape, False, dev, dtype)
        for variant in a.variants.split(","):
            times = {"0": [], "1": []}
            for _ in range(a.repeats):
                for flag in ("0", "1"):
                    os.environ["LINEARIZE_PDL"] = flag
                    rec = m.decode_point(Point("decode", a.shape, preset, variant, a.T, a.B), model)
                    times[flag].append(rec["ms"])
                    m.forget_compiled()
                    print(preset, variant, "PDL", flag, rec["ms"], "ms", rec.get("status", ""), flush=True)
            off, on = statistics.median(times["0"]), statistics.median(times["1"])
            rows.append((preset, variant, off, on, times))
        del model
        torch.cuda.empty_cache()
    os.environ.pop("LINEARIZE_PDL", None)
    lines = [
        "# Decode steps with programmatic dependent launch off and on",
        "",
        f"Written by `scripts/bench_pdl.py` on {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; "
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {a.shape}, T={a.T}, B={a.B}, bf16; "
        f"ms per decode step as `linearize bench` times it ({a.steps} steps), the median of {a.repeats} "
        "alternating captures each.",
        "",
        "| preset | variant | PDL off ms | PDL on ms | on / off | runs (off; on) |",
        "|---|---|---|---|---|---|",
    ]
    for preset, variant, off, on, times in rows:
        lines.append(f"| {preset} | {variant} | {off:.3f} | {on:.3f} | {on / off:.3f} | "
                     f"{', '.join(f'{t:.3f}' for t in times['0'])}; {', '.join(f'{t:.3f}' for t in times['1'])} |")
    md = "\n".join(lines) + "\n"
    print(md)
    if a.out:
        open(a.out, "w").write(md)


if __name__ == "__main__":
    main()
