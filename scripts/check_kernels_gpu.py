"""GPU correctness checks that CI (CPU, Triton interpreter) cannot make. Writes a markdown report.

1. The sliding-window hybrid on the kernels against the float64 reference at a real shape
   (B=2, H=32, T=2048, W=64; fp32 inputs as the layers pass them, and bf16): output, final state and every gradient, as relative RMS.
   The same over rows that pack several documents, against each document alone.
2. Converted models generate the same greedy tokens with the Triton kernels as with the PyTorch
   reference path (``LINEARIZE_KERNELS=triton`` against ``torch``, same process, same weights).

    python scripts/check_kernels_gpu.py --models runs/lolcats runs/gdn 
"""

from __future__ import annotations

import argparse
import os
import platform
from pathlib import Path

import torch

from benchlib import REPORTS, rel, write_section


def window_inputs(T, B, H, D, device, dtype) -> tuple[torch.Tensor, ...]:
    """Seeded inputs of the window hybrid: hedgehog features q, k (width 2D), v, the softmax part's
    q_sm, k_sm, a log decay, the per-head window weight and an output gradient."""
    g = torch.Generator(device=device).manual_seed(0)
    F = 2 * D  # hedgehog feature width
    q = torch.rand(B, T, H, F, device=device, generator=g).to(dtype)
    k = torch.rand(B, T, H, F, device=device, generator=g).to(dtype)
    v, qs, ks = (torch.randn(B, T, H, D, device=device, generator=g).to(dtype) for _ in range(3))
    log_g = -0.05 * torch.rand(B, T, H, device=device, generator=g)
    gamma = torch.rand(H, device=device, generator=g) + 0.5
    do = torch.randn(B, T, H, D, device=device, generator=g)
    return q, k, v, qs, ks, log_g, gamma, do


def window_check(T=2048, B=2, H=32, D=64, W=64, device="cuda", dtype=torch.bfloat16) -> list[str]:
    from linearize.kernels import linear_attn as la
    from linearize.kernels.linear_attn import reference as ref

    q, k, v, qs, ks, log_g, gamma, do = window_inputs(T, B, H, D, device, dtype)
    names = ("q", "k", "v", "q_sm", "k_sm", "log_g")
    lines = []
    for gated in (False, True):
        outs = {}
        for impl, dt in (("kernels", None), ("reference", torch.float64)):
            xs = [x.detach().clone().to(dt or x.dtype).requires_grad_(True) for x in (q, k, v, qs, ks, log_g)]
            fn = la.chunk_linear_attn if impl == "kernels" else ref.linear_attn_ref
            o, (S, z) = fn(xs[0], xs[1], xs[2], log_g=xs[5] if gated else None, window=W, q_sm=xs[3], k_sm=xs[4],
                           sm_scale=D ** -0.5, window_weight=gamma, output_final_state=True)
            (o.float() * do.to(o.dtype).float()).sum().backward()
            outs[impl] = {"o": o, "S": S, "z": z, **{f"d{n}": x.grad for n, x in zip(names, xs) if x.grad is not None}}
        errs = {n: rel(outs["kernels"][n], outs["reference"][n]) for n in outs["kernels"]}
        lines.append(f"| window {W}, {'gated' if gated else 'no gate'}, T={T}, {str(dtype).split('.')[-1]} inputs | "
                     + ", ".join(f"{n} {e:.1e}" for n, e in errs.items()) + f" | {max(errs.values()):.1e} |")
        print(lines[-1], flush=True)
    return lines


def packed_window_check(T=2048, B=2, H=32, D=64, W=64, device="cuda", dtype=torch.bfloat16) -> list[str]:
    """The window hybrid over rows that pack several documents (training's static packed form: the
    window starts at each query's document start ``q_lo``, the linear state resets by a decay of
    exp(-128) at a document's first token) against the float64 reference run on each document alone
    (``cu_seqlens``): output and the gradients of q, k, v, q_sm, k_sm. Documents of 1 to T/3 tokens,
    so windows, chunks and restarts meet in every arrangement."""
    from linearize.kernels import linear_attn as la
    from linearize.kernels.linear_attn import reference as ref

    g = torch.Generator(device="cpu").manual_seed(1)
    lens = []
    for _ in range(B):
        row, t = [], 0
        while t < T:
            n = min(int(torch.randint(1, max(T // 3, 2), (1,), generator=g)), T - t)
            row.append(n)
            t += n
        lens.append(row)
    q_lo = torch.cat([torch.cat([torch.full((n,), sum(row[:i])) for i, n in enumerate(row)])[None] for row in lens]).to(device)
    restart = torch.zeros(B, T, dtype=torch.bool)
    for b, row in enumerate(lens):
        for i in range(1, len(row)):
            restart[b, sum(row[:i])] = True
    restart = restart.to(device)
    cu = torch.tensor([0, *torch.tensor([n for row in lens for n in row]).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q, k, v, qs, ks, log_g, gamma, do = window_inputs(T, B, H, D, device, dtype)
    names = ("q", "k", "v", "q_sm", "k_sm")
    kw = dict(window=W, sm_scale=D ** -0.5, window_weight=gamma)
    lines = []
    for gated in (False, True):
        xs = [x.detach().clone().requires_grad_(True) for x in (q, k, v, qs, ks)]
        reset = torch.where(restart[..., None], -128.0, log_g if gated else torch.zeros_like(log_g))
        o, _ = la.chunk_linear_attn(*xs[:3], log_g=reset, q_sm=xs[3], k_sm=xs[4], q_lo=q_lo, **kw)
        (o.float() * do.float()).sum().backward()
        rs = [x.detach().double().reshape(1, B * T, *x.shape[2:]).requires_grad_(True) for x in (q, k, v, qs, ks)]
        ro, _ = ref.linear_attn_ref(*rs[:3], log_g=log_g.double().reshape(1, B * T, H) if gated else None, q_sm=rs[3],
                                    k_sm=rs[4], cu_seqlens=cu, output_final_state=True, **kw)
        (ro * do.double().reshape(1, B * T, H, D)).sum().backward()
        errs = {"o": rel(o.reshape(ro.shape), ro)}
        errs.update({f"d{n}": rel(x.grad.reshape(r.grad.shape), r.grad) for n, x, r in zip(names, xs, rs)})
        docs = sum(len(row) for row in lens)
        lines.append(f"| window {W}, {'gated' if gated else 'no gate'}, {B} rows of T={T} packing {docs} documents, "
                     f"{str(dtype).split('.')[-1]} inputs | " + ", ".join(f"{n} {e:.1e}" for n, e in errs.items())
                     + f" | {max(errs.values()):.1e} |")
        print(lines[-1], flush=True)
    return lines


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [
    "The Linux kernel's memory management subsystem",
    "To configure the network interface, first",
    "What is the capital of France?",
    "def fibonacci(n):",
]


CONVERSIONS = {  # --base: convert the base model freshly (untrained new parameters) with each of these
    "hedgehog": lambda lz: lz.LinearAttentionConfig(feature_map="hedgehog"),
    "lolcats": lambda lz: lz.LinearAttentionConfig(feature_map="hedgehog", window=128),
    "gdn": lambda lz: lz.GatedDeltaNetConfig(),
}


def load(source: str, conversion: str | None):
    """A saved converted checkpoint, or (``conversion`` given) a base model converted now."""
    import linearize
    from linearize.loading import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(source, dtype=torch.float32)
    if conversion:
        linearize.linearize(model, CONVERSIONS[conversion](linearize))
    return model.to(DEVICE).eval(), tok, f"{Path(source).name} + {conversion}" if conversion else Path(source).name


def greedy_check(folder: str, conversion: str | None = None, new_tokens: int = 48) -> str:
    model, tok, label = load(folder, conversion)
    conv = model.config.linearize
    tokens = {}
    for mode in ("triton", "torch"):
        os.environ["LINEARIZE_KERNELS"] = mode
        tokens[mode] = []
        for p in PROMPTS:
            x = tok(p, return_tensors="pt").to(DEVICE)
            with torch.no_grad():
                out = model.generate(**x, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.eos_token_id)
            tokens[mode].append(out[0, x["input_ids"].shape[1]:].tolist())
    os.environ.pop("LINEARIZE_KERNELS")
    same = sum(a == b for a, b in zip(tokens["triton"], tokens["torch"]))
    first = next((i for i, (a, b) in enumerate(zip(*tokens.values())) if a != b), None)
    line = (f"| {label} ({conv['method']}, window {conv.get('window') or 0}, {len(conv['layers'])} converted layers) "
            f"| {same}/{len(PROMPTS)} prompts identical over {new_tokens} tokens"
            + ("" if first is None else f" (first difference: prompt {first})") + " |")
    print(line, flush=True)
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=[], help="converted checkpoints to run greedy generation on")
    ap.add_argument("--base", default=None, help="a base model (folder or .gguf) to convert freshly for the greedy check")
    ap.add_argument("--conversions", default="hedgehog,lolcats,gdn", help=f"with --base: any of {sorted(CONVERSIONS)}")
    ap.add_argument("--skip-window", action="store_true", help="skip the kernel-level window check")
    ap.add_argument("--out", default=str(REPORTS / "kernels.md"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this check needs a CUDA GPU")
    import transformers
    import triton

    head = [
        "# Kernel checks on the GPU",
        "",
        (f"Written by `python scripts/check_kernels_gpu.py` on {torch.cuda.get_device_name()} "
        f"(torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}, "
        f"Python {platform.python_version()})."),
        "",
        "## Window hybrid on the kernels against float64 (relative RMS error)",
        "",
        "| case | per tensor | max |",
        "|---|---|---|",
    ]
    body = []

    def save(rows):  # after every check, so a run stopped by a time limit keeps what it measured
        body.extend(rows)
        write_section(args.out, "check_kernels_gpu", "\n".join(head + body))

    if not args.skip_window:
        save(window_check(dtype=torch.float32))
        save(window_check(dtype=torch.bfloat16))
        # the training dtype first: the packed path's fp32 variants spend 1.5-4 minutes in Triton's
        # compiler on an H200 (94 s on 2026-11-28d, over 240 s on -28c), bf16 about 16 s
        save(packed_window_check(dtype=torch.bfloat16))
        save(packed_window_check(dtype=torch.float32))
    save(["", "## Greedy tokens: Triton kernels against the PyTorch path, fp32 weights", "",
          "| checkpoint | result |", "|---|---|"])
    for m in args.models:
        save([greedy_check(m)])
    for c in args.conversions.split(",") if args.base else []:
        save([greedy_check(args.base, c)])


if __name__ == "__main__":
    main()
