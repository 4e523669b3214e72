"""Profile a prefill of a converted SmolLM2-shaped model (random weights, bf16) on CUDA, in one call
or in chunks through the state cache as `linearize bench` does: time per call and tokens/s, then the
top GPU ops (torch.profiler) of one timed prefill. Where docs/results.md's "96% of the GPU time in the
chunk kernel" comes from, and where a slow chunked prefill shows which kernel takes the time.

    python scripts/profile_prefill.py                                   # hedgehog, B=1, 4K, one call
    python scripts/profile_prefill.py --preset lolcats -T 65536 --chunk 8192
"""
import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import linearize
from linearize.benchmark.measure import prefill
from linearize.benchmark.plan import PRESETS, preset_config


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="hedgehog", choices=list(PRESETS))
    p.add_argument("-T", type=int, default=4096, help="prompt tokens")
    p.add_argument("-B", type=int, default=1, help="batch")
    p.add_argument("--chunk", type=int, default=0, help="tokens per call through the cache (0: one call)")
    p.add_argument("--rows", type=int, default=15, help="rows of the profiler table")
    a = p.parse_args()

    cfg = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      head_dim=64, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                      max_position_embeddings=max(131072, a.T))
    m = LlamaForCausalLM(cfg).cuda().bfloat16().eval()
    linearize.linearize(m, preset_config(a.preset, "smollm2-135m"))
    ids = torch.randint(0, cfg.vocab_size, (a.B, a.T), device="cuda")

    def run():
        with torch.no_grad():
            prefill(m, ids, linearize.LinearizeCache(m.config), chunk=a.chunk or None)

    run()  # warm-up (compiles the kernels)
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        s = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - s)
    best = min(times)
    print(f"{a.preset} B={a.B} T={a.T} chunk={a.chunk or 'one call'}: {best * 1e3:.1f} ms, "
          f"{a.B * a.T / best:,.0f} tok/s", flush=True)

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=a.rows, max_name_column_width=70))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=8, max_name_column_width=70))


if __name__ == "__main__":
    main()
