"""Static sm_90a instruction counts of the GDN chunk kernels, compiled here on the CPU (no GPU).

Each kernel is compiled by Triton for sm_90 (``triton.compile`` with a ``GPUTarget``), assembled by
the wheel's ``ptxas-blackwell`` (the plain ``ptxas`` beside it is too old for triton 3.9's PTX) and
disassembled by ``nvdisasm``; the table gives registers, spill bytes and the SASS opcode counts
(static: a loop body counts once). A count is a lead, not a time: the GPU's time is the result.

    python scripts/sass_gdn.py [--out docs/gdn_runs/sass.md] [--fla]   # --fla: fla's output kernel beside (needs fla)
"""
from __future__ import annotations

import argparse
import collections
import pathlib
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from linearize.kernels.gated_delta import chunk as ch

BIN = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
F32 = {n: "*fp32" for n in ("g", "beta", "gc", "Tm", "dgc", "dg", "dbeta", "h0", "ht", "dht", "dh0")}
F32.update({"cu": "*i32", "ci": "*i32", "co": "*i32"})
SCALARS = {"scale": "fp32", "TT": "i32", "T": "i32"}
OPS = ("HGMMA", "HMMA", "LDG", "STG", "LDS", "STS", "BAR", "SHFL", "MUFU", "FMUL", "FFMA", "FADD", "IMAD", "SEL", "FSEL")


def sass(kernel, consts: dict, num_warps: int, num_stages: int) -> dict:
    """{"registers", "spill", opcode: count, "total"} of ``kernel`` (a JITFunction) for sm_90a."""
    sig, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in consts:
            sig[name], constexprs[(i,)] = "constexpr", consts[name]
        elif name in SCALARS:
            sig[name] = SCALARS[name]
        else:
            sig[name], attrs[(i,)] = F32.get(name, "*bf16"), [["tt.divisibility", 16]]
    ptx = triton.compile(ASTSource(kernel, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": num_warps, "num_stages": num_stages}).asm["ptx"]
    with tempfile.TemporaryDirectory() as d:
        (pathlib.Path(d) / "k.ptx").write_text(ptx)
        log = subprocess.run([str(BIN / "ptxas-blackwell"), "-v", "--gpu-name", "sm_90a", f"{d}/k.ptx", "-o",
                              f"{d}/k.cubin"], capture_output=True, text=True, check=True).stderr
        text = subprocess.run([str(BIN / "nvdisasm"), f"{d}/k.cubin"], capture_output=True, text=True, check=True).stdout
    ops = collections.Counter(m.group(2) for m in re.finditer(
        r"^\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", text, re.M))
    row = {"registers": int(re.search(r"Used (\d+) registers", log).group(1)),
           "spill": int(re.search(r"(\d+) bytes spill stores", log).group(1)), "total": sum(ops.values())}
    row.update({op: ops.get(op, 0) for op in OPS})
    return row


def jobs(D: int):
    """(name, kernel, constexprs, warps, stages): each GDN chunk kernel at head dim D, bf16, in the config
    the H100 tuner picked (or the launch's fixed one)."""
    b = min(D, 64)
    base = dict(H=32, K=D, V=D, BT=64, PREC="tf32")
    tprec = ch._t_prec(torch.bfloat16, store_tm=False)
    return [
        ("UT transform, inference", ch._wy_fwd_kernel.fn,
         {**base, "BK": ch._wy_bk(D, tprec), "BV": b, "STORE_T": False, "TPREC": tprec, "DIAG": ch._diag(tprec, D)},
         2, 3),
        ("UT transform, training", ch._wy_fwd_kernel.fn,
         {**base, "BK": b, "BV": b, "STORE_T": True, "TPREC": "ieee", "DIAG": "subst"}, 4, 3),
        ("output", ch._fwd_o_kernel.fn, {**base, "BK": 64, "BV": 64}, 4, 2),
        ("bwd dv_local", ch._bwd_dv_local_kernel, {**base, "BK": b, "BV": b}, 4, 3),
        ("bwd dq dk dw dg", ch._bwd_dqkwg_kernel.fn, {**base, "BK": b, "BV": b}, 4, 2),
        ("bwd UT transform", ch._bwd_wy_kernel, {**base, "BK": b, "BV": b, "DA_PREC": ch.WY_DA_PREC},
         ch.WY_NUM_WARPS, 2),
    ]


def fla_jobs(D: int):
    """fla 0.6.0's chunk_fwd_kernel_o in the config its list has for D (BK=BV=64 w4 s3 at 64, 128 w8 s3 at 128)."""
    import fla.ops.common.chunk_o as co

    kern = co.chunk_fwd_kernel_o
    while not isinstance(kern, triton.runtime.jit.JITFunction):
        kern = kern.fn
    b, nw = (64, 4) if D == 64 else (128, 8)
    consts = dict(g_gamma=None, cu_seqlens=None, chunk_indices=None, H=32, HV=32, K=D, V=D, BT=64, BK=b, BV=b,
                  USE_G=True, USE_G_GAMMA=False, STATE_V_FIRST=False, IS_VARLEN=False)
    return [("fla output", kern, consts, nw, 3)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--D", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--out", default=None, help="also write the table (markdown) here")
    ap.add_argument("--fla", action="store_true", help="add fla's output kernel (fla importable)")
    args = ap.parse_args()
    cols = ["D", "kernel", "warps", "registers", "spill", "total", *OPS]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for D in args.D:
        for name, kern, consts, nw, ns in jobs(D) + (fla_jobs(D) if args.fla else []):
            row = {"D": D, "kernel": name, "warps": nw, **sass(kern, consts, nw, ns)}
            lines.append("| " + " | ".join(str(row[c]) for c in cols) + " |")
            print(lines[-1], flush=True)
    if args.out:
        pathlib.Path(args.out).write_text(
            f"`scripts/sass_gdn.py` (triton {triton.__version__}, ptxas-blackwell for sm_90a, static counts)\n\n"
            + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
