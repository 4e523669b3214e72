"""A hybrid's softmax layers in one decode step: ``linearize.kernels.softmax_decode`` beside the PyTorch
paths a transformers model runs, at the benchmark shapes, bf16, in one process on one GPU.

- ``repeat_kv + sdpa``: what transformers' sdpa attention runs for grouped-query heads under
  ``torch.compile`` (every static-cache generate): the keys and values written out once per query
  head, then SDPA with the boolean mask.
- ``grouped query + sdpa``: the query's heads folded onto the key/value heads (transformers 5.24
  in eager decode, ``pack_gqa``), SDPA with the mask.
- ``sdpa enable_gqa``: PyTorch's own grouped-query SDPA with the mask.
- ``softmax_decode``: the kernel (split over the positions, each key/value head read once).

The cache holds T tokens in a static cache of T + 64 slots (the mask says which), B sequences. Each
figure is the time per layer of 8 layers (the SmolLM2 hybrid's softmax layers; each its own cache)
captured in one CUDA graph, the median of ``triton.testing.do_bench_cudagraph``. The floor: the keys
and values of T tokens read once over the measured copy bandwidth; kernels: launches per layer.

    python scripts/bench_softmax_decode.py --out docs/softmax_decode.md
"""
import argparse
import datetime

import torch
import torch.nn.functional as F

from bench_decode_kernels import count_kernels  # (scripts/ is on sys.path)
from bench_decode_linear import bandwidth, per_call_us
from linearize.benchmark.plan import SHAPES

LAYERS = 8
POINTS = [("smollm2-135m", 1, 4096), ("smollm2-135m", 8, 65536), ("llama-3.2-1b", 1, 4096), ("llama-3.2-1b", 8, 16384)]


def paths(q, k, v, mask, G):
    from linearize.kernels.softmax_decode import softmax_decode

    B, H, _, D = q.shape
    Hkv = k.shape[1]

    def repeat_kv():
        kk = k[:, :, None].expand(B, Hkv, G, *k.shape[2:]).reshape(B, H, *k.shape[2:])
        vv = v[:, :, None].expand(B, Hkv, G, *v.shape[2:]).reshape(B, H, *v.shape[2:])
        return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)

    def grouped():
        return F.scaled_dot_product_attention(q.reshape(B, Hkv, G, D), k, v, attn_mask=mask)

    def enable_gqa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def kernel():
        return softmax_decode(q[:, :, 0], k, v, mask[:, 0, 0])

    return {"repeat_kv + sdpa": repeat_kv, "grouped query + sdpa": grouped, "sdpa enable_gqa": enable_gqa,
            "softmax_decode": kernel}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="write the table here (markdown)")
    p.add_argument("--sweep", action="store_true",
                   help="time the kernel's tile rules (positions per block, programs per SM, warps; prints only)")
    a = p.parse_args()
    if a.sweep:
        return sweep()
    dt, dev = torch.bfloat16, "cuda"
    bw = bandwidth()
    rows = []
    for shape, B, T in POINTS:
        s = SHAPES[shape]
        H, Hkv, D = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
        L = T + 64
        layers = []
        for _ in range(LAYERS):
            q = torch.randn(B, H, 1, D, device=dev, dtype=dt)
            k = torch.randn(B, Hkv, L, D, device=dev, dtype=dt)
            v = torch.randn(B, Hkv, L, D, device=dev, dtype=dt)
            mask = torch.zeros(B, 1, 1, L, device=dev, dtype=torch.bool)
            mask[..., :T] = True
            layers.append(paths(q, k, v, mask, H // Hkv))
        ref = layers[0]["repeat_kv + sdpa"]().float()
        floor_us = 2 * B * Hkv * T * D * 2 / bw * 1e6
        for name in layers[0]:
            out = layers[0][name]().reshape(ref.shape).float()
            err = float((out - ref).norm() / ref.norm())
            fns = [lay[name] for lay in layers]
            it = iter(range(10 ** 9))

            def one():  # the 8 layers in turn, one per call
                return fns[next(it) % LAYERS]()

            us = per_call_us(one, calls=LAYERS)
            rows.append((shape, B, T, name, us, floor_us, count_kernels(fns[0]), err))
            print(rows[-1], flush=True)
        del layers
        torch.cuda.empty_cache()
    lines = [
        "# A hybrid's softmax layers in a decode step: the kernel beside the PyTorch paths",
        "",
        f"Written by `scripts/bench_softmax_decode.py` on {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; "
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}; bf16; copy bandwidth {bw / 1e9:,.0f} GB/s. "
        f"Microseconds per layer ({LAYERS} layers, each its own cache of T tokens in T + 64 slots, in one "
        "CUDA graph); floor: the keys and values of T tokens read once; error: relative RMS against "
        "`repeat_kv + sdpa`.",
        "",
        "| shape | B | T | path | us per layer | floor us | / floor | kernels | error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for shape, B, T, name, us, floor_us, kernels, err in rows:
        lines.append(f"| {shape} | {B} | {T // 1024}K | {name} | {us:.1f} | {floor_us:.1f} | {us / floor_us:.1f}x | "
                     f"{kernels} | {err:.1e} |")
    md = "\n".join(lines) + "\n"
    print(md)
    if a.out:
        open(a.out, "w").write(md)


def sweep():
    import linearize.kernels.softmax_decode as sd

    dt, dev = torch.bfloat16, "cuda"
    for shape, B, T in POINTS:
        s = SHAPES[shape]
        H, Hkv, D = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
        L = T + 64
        layers = [paths(torch.randn(B, H, 1, D, device=dev, dtype=dt), torch.randn(B, Hkv, L, D, device=dev, dtype=dt),
                        torch.randn(B, Hkv, L, D, device=dev, dtype=dt),
                        torch.arange(L, device=dev).lt(T).expand(B, 1, 1, L).contiguous(), H // Hkv)["softmax_decode"]
                  for _ in range(LAYERS)]
        for bl, per_sm, warps, stages in [(64, 2, 4, 2), (64, 8, 4, 3), (128, 8, 4, 3), (128, 16, 4, 3)]:
            sd.BL, sd.PROGRAMS_PER_SM, sd.WARPS, sd.STAGES = bl, per_sm, warps, stages  # BL None: the rule
            it = iter(range(10 ** 9))
            us = per_call_us(lambda: layers[next(it) % LAYERS](), calls=LAYERS)
            print(f"{shape} B={B} T={T}: BL={bl} programs/SM={per_sm} warps={warps} stages={stages}: {us:.1f} us",
                  flush=True)


if __name__ == "__main__":
    main()
