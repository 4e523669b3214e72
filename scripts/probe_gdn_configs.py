"""Each autotune config of the GDN forward's kernels named in bench_gdn.CANDIDATES run alone, one process each.

A config that reads or writes out of bounds poisons its CUDA context, and inside the autotuner it
shows only as an illegal address at some later synchronisation (2026-11-27: while tuning the lists
widened by `bench_gdn.CANDIDATES` at D=64, `scripts/bench_gdn.py --tune-compare`). Here every config
of those kernels, committed and candidate, gets a process of its own (the other kernels on their first
config) with
CUDA_LAUNCH_BLOCKING=1, runs the forward at D=64 and D=128 (B=2, T=4096, H=32, bf16), and its output
is compared with the float32 reference (no timings: the processes share the GPU). One JSON line per
config to --out.

    python scripts/probe_gdn_configs.py --out probe.jsonl [--only-new]

First run on an H100 on 2026-11-27: two of the 14 candidates failed (docs/benchmarks_gdn.md);
`bench_gdn.py --tune-compare --candidates-from probe.jsonl` then tunes over the others only.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_gdn, beside this script


def one(name: str, index: int) -> dict:
    import torch

    import bench_gdn as b

    lists = b.config_lists()
    for other, (kern, committed, widened) in lists.items():
        kern.configs = [widened[index]] if other == name else committed[:1]
    cfg = lists[name][2][index]
    row = {"kernel": name, "config": b._short(cfg), "candidate": index >= len(lists[name][1])}
    for D in (64, 128):
        q, k, v, g, beta, _ = b.inputs(2, 4096, 32, D, D, torch.bfloat16, seed=1)
        ref, _ = b.gd.gated_delta_rule_chunk_ref(q.float(), k.float(), v.float(), g=g, beta=beta)
        errs = []
        for _ in range(3):  # a race would show as a changed output or a late illegal address
            errs.append(b.rel(b.gd.chunk_gated_delta_rule(q, k, v, g=g, beta=beta)[0], ref))
        row[f"D={D} o vs ref"] = max(errs) if all(e == e for e in errs) else float("nan")  # the worst, NaN first
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--only-new", action="store_true", help="bench_gdn.CANDIDATES only")
    ap.add_argument("--one", nargs=2, metavar=("KERNEL", "INDEX"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one[0], int(a.one[1]))), flush=True)
        return
    import bench_gdn as b

    jobs = [(name, i) for name, (_, committed, widened) in b.config_lists().items() for i in range(len(widened))
            if not a.only_new or i >= len(committed)]
    env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1"}
    procs = [(job, subprocess.Popen([sys.executable, __file__, "--out", a.out, "--one", job[0], str(job[1])],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
             for job in jobs]
    with open(a.out, "w") as f:
        for (name, i), p in procs:
            out, err = p.communicate()
            line = out.strip().splitlines()[-1] if p.returncode == 0 and out.strip() else json.dumps(
                {"kernel": name, "index": i, "returncode": p.returncode, "error": err.strip().splitlines()[-1:]})
            f.write(line + "\n")
            f.flush()
            print(line, flush=True)


if __name__ == "__main__":
    main()
