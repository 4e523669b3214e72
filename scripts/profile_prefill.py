"""Profile one prefill of a converted SmolLM2-shaped model (random weights, bf16, hedgehog) on CUDA:
time with the Triton kernels and with the PyTorch path, then the top GPU and CPU ops (torch.profiler).
This is where docs/results.md's "96% of the GPU time in the chunk kernel" comes from.

    python scripts/profile_prefill.py
"""
import os
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import linearize

cfg = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                  intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=131072)
m = LlamaForCausalLM(cfg).cuda().bfloat16().eval()
linearize.linearize(m, linearize.LinearAttentionConfig(feature_map="hedgehog"))
x = torch.randint(0, 49152, (1, 4096), device="cuda")
def t(kw, n=3):
    with torch.no_grad():
        for _ in range(2): m(x, **kw)
        torch.cuda.synchronize(); s = time.time()
        for _ in range(n): m(x, **kw)
        torch.cuda.synchronize(); return (time.time() - s) / n * 1e3
for mode in ("triton", "torch"):
    os.environ["LINEARIZE_KERNELS"] = mode
    print(mode, "cache", t(dict(use_cache=True, logits_to_keep=1)), "nocache", t(dict(use_cache=False, logits_to_keep=1)), flush=True)
os.environ["LINEARIZE_KERNELS"] = "triton"
from torch.profiler import ProfilerActivity, profile

with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
    m(x, use_cache=True, logits_to_keep=1); torch.cuda.synchronize()
print(p.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
print(p.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))
