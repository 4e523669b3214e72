"""Gated delta rule: our Triton kernels beside flash-linear-attention (fla) in one process.

  1. correctness on the GPU at benchmark shapes: our forward and every gradient (q, k, v, g,
     beta, initial state) against a float32 PyTorch reference (the chunked WY form, which the
     CPU tests pin to the token loop in float64), as relative RMS errors; fla's forward beside.
  2. chunked forward and forward+backward, B=2, H=32, D in {64, 128}, bf16, T = 1K..32K.
  3. decode step (T=1), B in {1, 8, 64, 256}: ours (state in place) vs fla's fused recurrent.
  4. prefill of one long prompt (B=1, the SmolLM2 and Llama-1B heads, D=64, T = 8K, 64K): our forward
     with the state pass unsplit and split along time (in kernels/gated_delta/chunk.py, the number of
     segments ``splits_for`` proposes), fla's beside; the split's o and final state against the unsplit
     ones and a float32 reference; and the layer's prefill prologue with RoPE from each head's
     halves against the partner lanes convolved again. ``--only-split`` runs this part alone.

Writes a markdown report (device, versions, shapes) to --out.

    python scripts/bench_gdn.py            # -> the bench_gdn section of docs/reports/kernels.md
"""
from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench, do_bench_cudagraph

from benchlib import REPORTS, rel, write_section


def _load_ours():
    try:
        import linearize.kernels.gated_delta as gd
    except ImportError:  # not installed (the GPU machine): load the folder by path
        root = pathlib.Path(__file__).resolve().parents[1] / "kernels" / "gated_delta"
        spec = importlib.util.spec_from_file_location("gated_delta", root / "__init__.py",
                                                      submodule_search_locations=[str(root)])
        gd = importlib.util.module_from_spec(spec)
        sys.modules["gated_delta"] = gd
        spec.loader.exec_module(gd)
    return gd


gd = _load_ours()
try:
    import fla
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent
except ImportError:
    fla = fla_chunk = fla_recurrent = None


def inputs(B, T, H, K, V, dtype, device="cuda", seed=0, h0=False):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, T, H, K, device=device, generator=gen).to(dtype)
    k = F.normalize(torch.randn(B, T, H, K, device=device, generator=gen), dim=-1).to(dtype)
    v = torch.randn(B, T, H, V, device=device, generator=gen).to(dtype)
    g = F.logsigmoid(torch.randn(B, T, H, device=device, generator=gen) + 3.0)
    beta = torch.rand(B, T, H, device=device, generator=gen).to(dtype) * 0.9 + 0.05
    s = torch.randn(B, H, K, V, device=device, generator=gen) * 0.1 if h0 else None
    return q, k, v, g, beta, s


def ms(fn):
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def ms_graph(fn):
    """Median ms of ``fn`` replayed from a CUDA graph (after an eager call, so autotuning is done)."""
    try:
        return do_bench_cudagraph(fn, rep=60, return_mode="median")
    except Exception as e:  # a path that cannot be captured says so in the table
        return f"not capturable: {type(e).__name__}"


def run_with_grads(fn, inp, do, dht, cast=None):
    """o, ht and the gradients of every input (q, k, v, g, beta, h0; cast first if asked) of the loss
    o . do + ht . dht."""
    xs = [x.detach().to(cast or x.dtype).requires_grad_() for x in inp]
    o, ht = fn(*xs[:3], g=xs[3], beta=xs[4], initial_state=xs[5], output_final_state=True)
    loss = (o.float() * do.float()).sum() + (ht.float() * dht).sum()
    return o, ht, torch.autograd.grad(loss, xs)


def check(rows, B, T, H, D, dtype):
    """Ours (dtype) and fla's forward vs the float32 reference; our gradients too."""
    q, k, v, g, beta, h0 = inputs(B, T, H, D, D, dtype, seed=T + D, h0=True)
    do = torch.randn(B, T, H, D, device="cuda").to(dtype)
    dht = torch.randn_like(h0)
    names = ["q", "k", "v", "g", "beta", "h0"]
    ref = run_with_grads(gd.gated_delta_rule_chunk_ref, (q, k, v, g, beta, h0), do, dht, torch.float32)
    ours = run_with_grads(gd.chunk_gated_delta_rule, (q, k, v, g, beta, h0), do, dht)
    row = {"shape": f"B={B} T={T} H={H} D={D} {str(dtype)[6:]}", "o": rel(ours[0], ref[0]), "ht": rel(ours[1], ref[1])}
    row.update({f"d{n}": rel(a, b) for n, a, b in zip(names, ours[2], ref[2])})
    if fla_chunk is not None:
        with torch.no_grad():
            fo, fht = fla_chunk(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True)
        row["fla o"] = rel(fo, ref[0])
        row["fla ht"] = rel(fht, ref[1])
    rows.append(row)
    print(row, flush=True)


def check_varlen(rows, dtype):
    """Packed varlen on the GPU: each sequence equals itself run alone (outputs and grads)."""
    H, D = 4, 128
    cu = [0, 1000, 1001, 3000, 3100]
    q, k, v, g, beta, h0 = inputs(1, cu[-1], H, D, D, dtype, seed=11)
    h0 = torch.randn(len(cu) - 1, H, D, D, device="cuda") * 0.1
    do = torch.randn_like(v)

    def run(xs, s0, cu_t):
        xs = [x.detach().clone().requires_grad_() for x in xs] + [s0.detach().clone().requires_grad_()]
        o, ht = gd.chunk_gated_delta_rule(*xs[:3], g=xs[3], beta=xs[4], initial_state=xs[5],
                                          output_final_state=True, cu_seqlens=cu_t)
        return o, ht, xs

    cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
    o, ht, xs = run((q, k, v, g, beta), h0, cu_t)
    o.backward(do)
    worst = {}
    for n, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        o1, ht1, xs1 = run([x[:, s:e] for x in (q, k, v, g, beta)], h0[n:n + 1], None)
        o1.backward(do[:, s:e])
        errs = {"o": rel(o[:, s:e], o1), "ht": rel(ht[n:n + 1], ht1)}
        errs.update({f"d{name}": rel(a.grad[:, s:e], b.grad) for name, a, b in zip(("q", "k", "v", "g", "beta"), xs, xs1)})
        errs["dh0"] = rel(xs[5].grad[n:n + 1], xs1[5].grad)
        worst = {key: max(worst.get(key, 0.0), val) for key, val in errs.items()}
    rows.append({"shape": f"varlen cu={cu} H={H} D={D} {str(dtype)[6:]}: packed vs each sequence alone (worst)",
                 **worst})
    print(rows[-1], flush=True)


def bench_chunk(rows, B, H, D, T, dtype, bwd=True):
    q, k, v, g, beta, _ = inputs(B, T, H, D, D, dtype, seed=1)
    row = {"D": D, "T": T}
    row["ours fwd"] = ms(lambda: gd.chunk_gated_delta_rule(q, k, v, g=g, beta=beta))
    if fla_chunk is not None:
        row["fla fwd"] = ms(lambda: fla_chunk(q, k, v, g=g, beta=beta))
        ours_o, _ = gd.chunk_gated_delta_rule(q, k, v, g=g, beta=beta)
        fla_o, _ = fla_chunk(q, k, v, g=g, beta=beta)
        row["ours vs fla o"] = rel(ours_o, fla_o)
    # the same forward replayed from a CUDA graph: the GPU's time without the host's launch overhead, which
    # at 4K is most of an eager call and varied between processes (D=128: 0.46 and 0.61 ms, 2026-11-27)
    row["ours fwd graph"] = ms_graph(lambda: gd.chunk_gated_delta_rule(q, k, v, g=g, beta=beta))
    if fla_chunk is not None:
        row["fla fwd graph"] = ms_graph(lambda: fla_chunk(q, k, v, g=g, beta=beta))
        if all(isinstance(row[c], float) for c in ("ours fwd graph", "fla fwd graph")):
            row["graph ratio fla/ours"] = row["fla fwd graph"] / row["ours fwd graph"]
    if not bwd:
        rows.append(row)
        print(row, flush=True)
        return
    xs = [x.detach().requires_grad_() for x in (q, k, v, g, beta)]
    do = torch.randn_like(v)

    def fwd_bwd(fn):
        o, _ = fn(*xs[:3], g=xs[3], beta=xs[4])
        torch.autograd.grad(o, xs, do)

    row["ours fwd+bwd"] = ms(lambda: fwd_bwd(gd.chunk_gated_delta_rule))
    if fla_chunk is not None:
        try:
            row["fla fwd+bwd"] = ms(lambda: fwd_bwd(fla_chunk))
        except Exception as e:  # fla refuses its gated backward on Hopper with triton < 3.7.1
            row["fla fwd+bwd"] = "refused"
            row["fla bwd error"] = f"{type(e).__name__}: {str(e)[:90]}"
    rows.append(row)
    print(row, flush=True)


def bench_split(rows, H, D, T, dtype):
    """One prompt (B=1): the forward unsplit, split as ``splits_for`` proposes, fla; errors of the split
    against the unsplit forward and (T <= 8K) against a float32 reference, with an initial state."""
    splits_for = importlib.import_module(gd.__name__ + ".chunk").splits_for
    q, k, v, g, beta, h0 = inputs(1, T, H, D, D, dtype, seed=T + H, h0=True)
    n = splits_for(1, T, H, D, torch.cuda.get_device_properties(q.device).multi_processor_count)
    row = {"H": H, "D": D, "T": T, "segments": n}
    kw = dict(g=g, beta=beta, initial_state=h0, output_final_state=True)
    with torch.no_grad():
        row["ours unsplit"] = ms(lambda: gd.chunk_gated_delta_rule(q, k, v, **kw, num_splits=1))
        row["ours split"] = ms(lambda: gd.chunk_gated_delta_rule(q, k, v, **kw, num_splits=n))
        if fla_chunk is not None:
            row["fla"] = ms(lambda: fla_chunk(q, k, v, **kw))
        o1, s1 = gd.chunk_gated_delta_rule(q, k, v, **kw, num_splits=1)
        o2, s2 = gd.chunk_gated_delta_rule(q, k, v, **kw, num_splits=n)
        row["split vs unsplit o"], row["split vs unsplit ht"] = rel(o2, o1), rel(s2, s1)
        if T <= 8192:
            ro, rs = gd.gated_delta_rule_chunk_ref(q.float(), k.float(), v.float(), **kw)
            row["unsplit vs ref o"], row["split vs ref o"] = rel(o1, ro), rel(o2, ro)
            row["unsplit vs ref ht"], row["split vs ref ht"] = rel(s1, rs), rel(s2, rs)
    row["speed-up"] = row["ours unsplit"] / row["ours split"]
    rows.append(row)
    print(row, flush=True)


def bench_prologue(rows, H, Hkv, D, T, dtype):
    """The GDN layer's prefill prologue (conv with a cache, whole-head RoPE, L2 norms, GQA repeats) of
    one prompt: RoPE from the two halves of each head (default) against every lane's partner
    convolved again (``prefill.CONFIG["halves"] = False``); their outputs must agree."""
    pf = importlib.import_module(gd.__name__ + ".prefill")
    gen = torch.Generator(device="cuda").manual_seed(T)
    C = (H + 2 * Hkv) * D
    width = C + 2 * H + H * D  # q | k | v | a | b | o_gate
    y = torch.randn(1, T, width, device="cuda", generator=gen).to(dtype)
    ang = torch.randn(1, T, D // 2, device="cuda", generator=gen)
    kw = dict(cols=[0, H * D, (H + Hkv) * D, D], num_heads=H, num_kv_heads=Hkv, head_dim=D,
              conv_weight=torch.randn(C, 1, 4, device="cuda", generator=gen).to(dtype),
              conv_state=torch.randn(1, C, 4, device="cuda", generator=gen).to(dtype),
              cos=torch.cat([ang.cos()] * 2, -1).to(dtype), sin=torch.cat([ang.sin()] * 2, -1).to(dtype))
    row = {"H": H, "Hkv": Hkv, "D": D, "T": T}
    outs = {}
    for name, halves in (("halves", True), ("partners", False)):
        pf.CONFIG["halves"] = halves
        row[f"prologue {name}"] = ms(lambda: pf.gdn_prefill_prologue(y, **kw))
        outs[name] = pf.gdn_prefill_prologue(y, **kw)
    pf.CONFIG["halves"] = True
    row["halves vs partners"] = max(rel(a, b) for a, b in zip(outs["halves"], outs["partners"]))
    # bytes a prologue must move: y's q|k|v columns read once, q, k, v written (k, v repeated to H heads)
    moved = T * (C + 3 * H * D) * torch.finfo(dtype).bits // 8
    row["floor GB"] = moved / 1e9
    row["GB/s (halves)"] = moved / row["prologue halves"] / 1e6
    rows.append(row)
    print(row, flush=True)


def bench_decode(rows, B, H, D, dtype):
    q, k, v, g, beta, s = inputs(B, 1, H, D, D, dtype, seed=2, h0=True)
    row = {"D": D, "B": B}
    s_ours = s.clone()
    with torch.no_grad():
        o1 = gd.fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, state=s_ours)
        row["ours"] = ms(lambda: gd.fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, state=s_ours))
        if fla_recurrent is not None:
            o2, s2 = fla_recurrent(q, k, v, g=g, beta=beta, initial_state=s, output_final_state=True)
            row["fla"] = ms(lambda: fla_recurrent(q, k, v, g=g, beta=beta, initial_state=s, output_final_state=True))
            s_chk = s.clone()
            o1 = gd.fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, state=s_chk)
            row["ours vs fla o"] = rel(o1, o2)
            row["ours vs fla state"] = rel(s_chk, s2)
    # state bytes read + written once
    row["ours GB/s"] = 2 * s.numel() * 4 / (row["ours"] * 1e-3) / 1e9
    rows.append(row)
    print(row, flush=True)


def breakdown(B, H, D, T, dtype):
    """Per-kernel CUDA time (torch.profiler) of one call: where the time goes."""
    q, k, v, g, beta, _ = inputs(B, T, H, D, D, dtype, seed=4)
    xs = [x.detach().requires_grad_() for x in (q, k, v, g, beta)]
    do = torch.randn_like(v)
    runs = {"ours fwd": lambda: gd.chunk_gated_delta_rule(q, k, v, g=g, beta=beta),
            "ours fwd+bwd": lambda: torch.autograd.grad(gd.chunk_gated_delta_rule(*xs[:3], g=xs[3], beta=xs[4])[0],
                                                        xs, do)}
    if fla_chunk is not None:
        runs["fla fwd"] = lambda: fla_chunk(q, k, v, g=g, beta=beta)
    out = []
    for name, fn in runs.items():
        fn()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
        evs = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
        parts = [f"{e.key[:48]} {e.device_time_total / 3 / 1e3:.3f}" for e in evs[:8] if e.device_time_total > 0]
        out.append(f"- {name} (B={B} T={T} H={H} D={D}, ms per call): " + "; ".join(parts))
        print(out[-1], flush=True)
    return out


def fwd_floor(B, H, D, T, gbs) -> dict:
    """The chunked forward's memory floors (ms), bf16 [B, T, H, D] tensors, chunks of 64: io = q, k, v, o;
    chunked = k x 3 + q + v + o + (w, u, v') x 2 + the states [T / 64, H, D, D] x 2, gates aside."""
    unit = B * T * H * D * 2
    states = B * (T // 64) * H * D * D * 2
    return {"floor io": 4 * unit / gbs / 1e6, "floor chunked": (12 * unit + 2 * states) / gbs / 1e6}


def table(rows, cols, fmt=lambda x: f"{x:.3g}" if isinstance(x, float) else str(x)):
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(REPORTS / "kernels.md"), help="the report page whose bench_gdn section is written")
    ap.add_argument("--T", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--D", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--decode-B", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--no-breakdown", dest="breakdown", action="store_false", help="skip the per-kernel profile")
    ap.add_argument("--budget-s", type=float, default=330.0, help="skip what is left after this many seconds")
    ap.add_argument("--split-T", type=int, nargs="+", default=[8192, 65536])
    ap.add_argument("--split-H", type=int, nargs="+", default=[9, 32], help="heads of the one-prompt rows")
    ap.add_argument("--only-split", action="store_true", help="run part 4 (the one-prompt rows) alone")
    ap.add_argument("--only-fwd", action="store_true",
                    help="run part 2 (the chunked forward and forward+backward beside fla) alone: on a fresh "
                         "machine the other parts' compilations took the whole --budget-s (2026-11-27)")
    ap.add_argument("--no-bwd", dest="bwd", action="store_false",
                    help="part 2 without the forward+backward columns (their compilation is most of a fresh call)")
    ap.add_argument("--only-breakdown", action="store_true",
                    help="the per-kernel profile alone, at each --D and the largest --T (B=2, H=32), fla beside")
    args = ap.parse_args()
    if args.only_breakdown:
        dev = torch.cuda.get_device_name()
        lines = [f"Device: {dev}; torch {torch.__version__}, triton {triton.__version__}, fla "
                 f"{getattr(fla, '__version__', 'not installed')}; bf16; torch.profiler, ms per call.", ""]
        for D in args.D:
            lines += breakdown(2, 32, D, max(args.T), torch.bfloat16)
            write_section(args.out, "bench_gdn", "\n".join(lines))
        return
    t_start = time.time()
    B, H, dtype = 2, 32, torch.bfloat16
    checks, fwd, dec, prof, split, prologue = [], [], [], [], [], []
    copy_gbs = None

    def report():
        dev = torch.cuda.get_device_name()
        lines = [
            "# Gated delta rule kernels vs flash-linear-attention",
            "",
            f"Device: {dev}; torch {torch.__version__}, triton {triton.__version__}, "
            f"fla {getattr(fla, '__version__', 'not installed')}. Written by `scripts/bench_gdn.py` "
            "(both implementations in one process, same inputs, `triton.testing.do_bench` median, ms).",
            "",
            "## Correctness on the GPU",
            "",
            "Relative RMS error ||x - ref|| / ||ref|| against a float32 PyTorch reference (the chunked "
            "WY form, itself pinned to the token loop in float64 by the CPU tests), with an initial "
            "state and a final-state gradient. `fla o` / `fla ht`: fla's forward against the same "
            "reference (its backward is refused on this triton).",
            "",
            table(checks, ["shape", "o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0", "fla o", "fla ht"]),
            "",
            f"## Chunked forward and forward+backward (B={B}, H={H}, bf16, ms)",
            "",
            table(fwd, ["D", "T", "ours fwd", "fla fwd", "fwd ratio fla/ours", "ours fwd+bwd", "fla fwd+bwd",
                        "ours vs fla o", "floor io", "floor chunked", "ours / floor chunked", "ours fwd graph",
                        "fla fwd graph", "graph ratio fla/ours"]),
            "",
            "Floors (ms) at the measured copy bandwidth (`fwd_floor`): `io` moves q, k, v in and o out once; "
            "`chunked` adds what the three forward kernels must pass through memory (w, u and v' written and read "
            "back, the per-chunk states written and read, k read by each kernel); measured copy bandwidth "
            f"{copy_gbs or 0:.0f} GB/s. `graph`: the forward replayed from a CUDA graph (no host launch overhead).",
            "",
            f"## Decode step (T=1, H={H}, bf16 inputs, fp32 state, ms)",
            "",
            "Ours updates the state in place; fla reads `initial_state` and writes a new final state "
            "(same bytes). GB/s counts the state read and written once.",
            "",
            table(dec, ["D", "B", "ours", "fla", "ratio fla/ours", "ours GB/s", "ours vs fla o", "ours vs fla state"]),
            "",
        ]
        if split:
            lines += [
                "## One prompt (B=1, bf16, ms): the state pass split along time",
                "",
                "`segments`: what `split.splits_for` proposes on this GPU (1: no split; `chunk_gated_delta_rule` splits only when asked). Errors are relative RMS; "
                "the float32 reference (the chunked WY form) runs up to 8K tokens. With an initial state.",
                "",
                table(split, ["H", "D", "T", "segments", "ours unsplit", "ours split", "speed-up", "fla",
                              "split vs unsplit o", "split vs unsplit ht", "unsplit vs ref o", "split vs ref o",
                              "unsplit vs ref ht", "split vs ref ht"]),
                "",
            ]
        if prologue:
            lines += [
                "## One prompt: the GDN layer's prefill prologue (bf16, ms)",
                "",
                "`kernels/gated_delta/prefill.py` with whole-head RoPE from the two halves of each head (the "
                "default) against each lane's partner convolved again; conv of 4 taps from a cache. Floor: "
                "y's q|k|v columns read once and q, k, v written once.",
                "",
                table(prologue, ["H", "Hkv", "D", "T", "prologue halves", "prologue partners", "halves vs partners",
                                 "floor GB", "GB/s (halves)"]),
                "",
            ]
        if prof:
            lines += ["## Where the time goes (torch.profiler, top kernels)", ""] + prof + [""]
        lines += [
            "## Notes",
            "",
            "- Kernels: `kernels/gated_delta/chunk.py` (chunk size 64; forward = UT transform per chunk "
            "[gc, Tm = (I + A)^-1 from 16x16 blocks, w, u] -> sequential state pass [states at chunk "
            "starts, v'] -> output; backward recomputes the states, then dv_local -> reverse state pass "
            "-> dq/dk/dw/dg -> gradients through the UT transform) and `recurrent.py` (decode).",
            "- Matmul operands are in the input dtype (bf16 here), accumulation and states in fp32; the "
            "intermediates w, u, v' and the per-chunk states are stored in the input dtype (as fla does), "
            "Tm in fp32. This is why bf16 errors sit near 4e-3 against the fp32 reference, the same as "
            "fla's forward.",
            "- The GPU gradient check covers every input (q, k, v, g, beta, initial state) with a "
            "final-state cotangent; the CPU suite (TRITON_INTERPRET=1) checks the same against float64 "
            "on edge shapes (T=1, T not a multiple of 64, K != V, odd dims, varlen, fp16).",
            "",
        ]
        errs = {r["fla bwd error"] for r in fwd if "fla bwd error" in r}
        if errs:
            lines += ["fla's backward refusal: " + "; ".join(sorted(errs)), ""]
        write_section(args.out, "bench_gdn", "\n".join(lines))

    def left():
        return args.budget_s - (time.time() - t_start)

    for Hs in [] if args.only_fwd else args.split_H:  # part 4 first: it is short, and the newest kernel path
        for T in args.split_T:
            bench_split(split, Hs, 64, T, dtype)
            bench_prologue(prologue, Hs, Hs // 3 if Hs % 3 == 0 else Hs // 4, 64, T, dtype)
            torch.cuda.empty_cache()
            report()
    if args.only_split:
        print(open(args.out).read())
        return
    if not args.only_fwd:
        check(checks, B, 4096, H, 128, dtype)
        check(checks, B, 1024, H, 64, dtype)
        check_varlen(checks, dtype)
        report()
        print(f"[{time.time() - t_start:.0f}s] checks done", flush=True)
    if args.breakdown and not args.only_fwd:
        prof.extend(breakdown(B, H, 128, 32768 if 32768 in args.T else max(args.T), dtype))
        print(f"[{time.time() - t_start:.0f}s] breakdown done", flush=True)
    try:  # the e2e bench's yardstick (best of 5 copies); the package, not the kernels folder alone
        from linearize.benchmarks.measure import measure_bandwidth

        copy_gbs = measure_bandwidth(torch.device("cuda")) / 1e9
        print(f"measured copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
    except ImportError:
        print("linearize is not installed: no floors (pip install the wheel for them)", flush=True)
    for D in args.D:
        for T in args.T:
            if left() < 20:
                print("time budget spent: skipping", D, T)
                continue
            bench_chunk(fwd, B, H, D, T, dtype, bwd=args.bwd)
            print(f"[{time.time() - t_start:.0f}s]", flush=True)
            torch.cuda.empty_cache()
            if "fla fwd" in fwd[-1]:
                fwd[-1]["fwd ratio fla/ours"] = fwd[-1]["fla fwd"] / fwd[-1]["ours fwd"]
            if copy_gbs:
                fwd[-1].update(fwd_floor(B, H, D, T, copy_gbs))
                fwd[-1]["ours / floor chunked"] = fwd[-1]["ours fwd"] / fwd[-1]["floor chunked"]
            report()
        for Bd in [] if args.only_fwd else args.decode_B:
            if left() < 10:
                continue
            bench_decode(dec, Bd, H, D, dtype)
            print(f"[{time.time() - t_start:.0f}s]", flush=True)
            if "fla" in dec[-1]:
                dec[-1]["ratio fla/ours"] = dec[-1]["fla"] / dec[-1]["ours"]
            report()
    report()
    print(open(args.out).read())


if __name__ == "__main__":
    main()
