"""The per-channel decay gate's chunk kernel (kernels/linear_attn/chunk_channel.py, the `linear` preset's
attention) beside fla's ``chunk_gla`` (the same recurrence: GLA's per-channel gate), in one process.

On a CUDA GPU, bf16 q/k/v, fp32 log gates, the SmolLM2 head layout (H=9, F=128 Hedgehog features, Dv=64):
  1. agreement: our unnormalized forward (GLA's form) against fla's on the same inputs, outputs and
     final states as relative RMS; our split-time forward against our unsplit one;
  2. prefill (B=1, T = 8K, 64K, no gradients): ours as the preset runs it (normalized, unsplit:
     ``CONFIG["splits"]``), ours split in time into 8 segments, ours unnormalized, fla's ``chunk_gla``;
  3. a training step's attention (B=8 rows of 1,024 tokens: one process's rows in distill), forward and
     backward: ours normalized and unnormalized, fla's;
  and the launch settings CONFIG leaves untimed: the warps of the state passes and of the other kernels,
  split or not, at the longest prefill; the warps of a training step's kernels;
and for each the memory floor (the bytes the call must move over the measured copy bandwidth) and the
CUDA kernels one call launches. fla 0.6.0 has no fused_chunk_gla (deprecated there), so chunk_gla is its
fastest path for this op. Writes the ``bench_kernels_channel`` section of docs/reports/kernels.md and
--json.

    python scripts/bench_kernels_channel.py                 # needs fla-core (scripts/device/README.md)
    python scripts/bench_kernels_channel.py --no-fla        # ours alone: minutes faster on a fresh machine
                                                            # (fla autotunes at its first calls); two builds
                                                            # side by side: run it under each PYTHONPATH
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json

import torch
import torch.nn.functional as Fn
from triton.testing import do_bench

from benchlib import REPORTS, measure_bandwidth, rel, versions, write_section
from linearize.kernels.linear_attn import chunk_channel, chunk_linear_attn_channel

H, F, DV = 9, 128, 64
SPLITS = 8  # the split-time forward's segments: 72 state programs x 8 fill an H200's 132 multiprocessors ~4x


def inputs(B, T, seed=0, grad=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.softmax(torch.randn(B, T, H, F, device="cuda", generator=g), -1).bfloat16()  # Hedgehog-like
    k = torch.softmax(torch.randn(B, T, H, F, device="cuda", generator=g), -1).bfloat16()
    v = torch.randn(B, T, H, DV, device="cuda", generator=g).bfloat16()
    lg = Fn.logsigmoid(torch.randn(B, T, H, F, device="cuda", generator=g) * 2 + 4)  # decays of 0.5-1
    return [x.requires_grad_(grad) for x in (q, k, v, lg)]


def kernels_per_call(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


@contextlib.contextmanager
def config(**settings):
    """chunk_channel's launch settings changed for the block, then put back."""
    keep = dict(chunk_channel.CONFIG)
    chunk_channel.CONFIG.update(settings)
    try:
        yield
    finally:
        chunk_channel.CONFIG.clear()
        chunk_channel.CONFIG.update(keep)


def floor_bytes(B, T, backward: bool) -> int:
    """Forward: read q, k (bf16), log g (fp32), v, write o (bf16). With the backward also: read the
    forward's inputs again and do, write dq, dk, dv (bf16) and dlog g (fp32)."""
    qk, gb, vb = 2 * B * T * H * F * 2, B * T * H * F * 4, B * T * H * DV * 2
    fwd = qk + gb + 2 * vb
    return fwd + (qk + gb + vb + vb + qk + vb + gb if backward else 0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPORTS / "kernels.md"))
    ap.add_argument("--json", default=str(REPORTS / "data" / "bench_kernels_channel.json"))
    ap.add_argument("--prefill-T", type=int, nargs="*", default=[8192, 65536])
    ap.add_argument("--no-fla", action="store_true", help="time our kernel alone (fla's points and agreement left out)")
    args = ap.parse_args()
    chunk_gla, fla_version = None, "not run"
    if not args.no_fla:
        from fla.ops.gla import chunk_gla
        import fla
        fla_version = fla.__version__

    bw = measure_bandwidth(torch.device("cuda"))
    info = {"device": torch.cuda.get_device_name(), "date": datetime.datetime.now(datetime.timezone.utc)
            .strftime("%Y-%m-%d %H:%M UTC"), "fla": fla_version, "bandwidth_gbs": round(bw / 1e9), **versions()}
    print(info, flush=True)
    rows, agree = [], []

    def save():  # after every point: a run cut short keeps what it measured
        with open(args.json, "w") as f:
            json.dump({"info": info, "agree": agree, "rows": rows}, f, indent=1)

    def point(part, T, B, name, fn, backward=False, grad_to_none=None):
        ms = do_bench(fn, warmup=25, rep=200, grad_to_none=grad_to_none, return_mode="median")
        floor = floor_bytes(B, T, backward) / bw * 1e3
        r = dict(part=part, T=T, B=B, impl=name, ms=round(ms, 4), floor_ms=round(floor, 4),
                 x_floor=round(ms / floor, 1), kernels=kernels_per_call(fn))
        rows.append(r)
        print(r, flush=True)
        save()

    # 1. agreement
    for B, T in ((1, 8192), (8, 1024)):
        q, k, v, lg = inputs(B, T, seed=1)
        with torch.no_grad():
            o, (S, _) = chunk_linear_attn_channel(q, k, v, lg, normalize=False, output_final_state=True, num_splits=1)
            o_f, S_f = chunk_gla(q, k, v, lg, scale=1.0, output_final_state=True) if chunk_gla else (None, None)
            o_s, (S_s, _) = chunk_linear_attn_channel(q, k, v, lg, normalize=False, output_final_state=True,
                                                      num_splits=4)
        agree.append(dict(B=B, T=T, o_vs_fla=None if o_f is None else rel(o, o_f),
                          S_vs_fla=None if S_f is None else rel(S, S_f), o_split_vs_unsplit=rel(o_s, o),
                          S_split_vs_unsplit=rel(S_s, S)))
        print(agree[-1], flush=True)

    # 2. prefill, no gradients
    for T in args.prefill_T:
        q, k, v, lg = inputs(1, T)
        n = chunk_channel.CONFIG["splits"]
        with torch.no_grad():
            point("prefill", T, 1, f"ours, normalized, {n} segment(s) (the preset)",
                  lambda: chunk_linear_attn_channel(q, k, v, lg))
            point("prefill", T, 1, f"ours, normalized, {SPLITS} segments",
                  lambda: chunk_linear_attn_channel(q, k, v, lg, num_splits=SPLITS))
            point("prefill", T, 1, "ours, unnormalized", lambda: chunk_linear_attn_channel(q, k, v, lg, normalize=False))
            if chunk_gla:
                point("prefill", T, 1, "fla chunk_gla", lambda: chunk_gla(q, k, v, lg, scale=1.0))
        del q, k, v, lg

    # 2b. launch settings of the prefill: warps of the state passes and of the output kernel, split or not
    T = max(args.prefill_T)
    q, k, v, lg = inputs(1, T)
    for sw in (4, 8):
        for w in (4, 8):
            for splits in (1, SPLITS):
                with config(state_warps=sw, warps=w), torch.no_grad():
                    point("prefill settings", T, 1, f"state_warps={sw}, warps={w}, {splits} segments",
                          lambda: chunk_linear_attn_channel(q, k, v, lg, num_splits=splits))
    del q, k, v, lg

    # 3. a training step's attention, forward + backward
    B, T = 8, 1024
    q, k, v, lg = inputs(B, T, grad=True)
    do = torch.randn_like(v)
    ins = [q, k, v, lg]

    def step(fn):  # forward and backward (do_bench clears the inputs' gradients between calls)
        return lambda: fn().backward(do)

    point("train", T, B, "ours, normalized", step(lambda: chunk_linear_attn_channel(q, k, v, lg)[0]), True, ins)
    point("train", T, B, "ours, unnormalized",
          step(lambda: chunk_linear_attn_channel(q, k, v, lg, normalize=False)[0]), True, ins)
    if chunk_gla:
        point("train", T, B, "fla chunk_gla", step(lambda: chunk_gla(q, k, v, lg, scale=1.0)[0]), True, ins)
    for w in (4, 8):  # the warps of the output, dq, dk and dv kernels
        with config(warps=w):
            point("train settings", T, B, f"ours, normalized, warps={w}",
                  step(lambda: chunk_linear_attn_channel(q, k, v, lg)[0]), True, ins)

    save()
    beside = "beside fla's chunk_gla" if chunk_gla else "alone (--no-fla)"
    lines = [f"### The per-channel gate's chunk kernel {beside} ({info['device']}, {info['date'][:10]})",
             "", f"`python scripts/bench_kernels_channel.py{'' if chunk_gla else ' --no-fla'}`: torch {info['torch']}, triton {info['triton']}, "
             f"fla-core {info['fla']}; copy bandwidth {info['bandwidth_gbs']} GB/s; H={H}, F={F}, Dv={DV}, bf16 "
             "q/k/v, fp32 log gates. Floor: the bytes a call must move over that bandwidth.", "",
             "| agreement (relative RMS) | o ours vs fla | S ours vs fla | o split vs unsplit | S split vs unsplit |",
             "|---|---|---|---|---|"]
    e = lambda x: "n/a" if x is None else f"{x:.1e}"  # noqa: E731
    lines += [f"| B={a['B']}, T={a['T']} | {e(a['o_vs_fla'])} | {e(a['S_vs_fla'])} | {e(a['o_split_vs_unsplit'])} "
              f"| {e(a['S_split_vs_unsplit'])} |" for a in agree]
    lines += ["", "| part | B x T | implementation | ms | x its floor | CUDA kernels a call |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['part']} | {r['B']} x {r['T']} | {r['impl']} | {r['ms']:.3f} | {r['x_floor']} | {r['kernels']} |"
              for r in rows]
    write_section(args.out, "bench_kernels_channel", "\n".join(lines))
    print("wrote", args.out, args.json)


if __name__ == "__main__":
    main()
