"""Measure cache bytes after a prefill of T tokens: converted model vs the original's KV cache.

Runs both models side by side in one process on the same random tokens and prints a markdown
table (device, versions, shapes). Default: the embedded SmolLM2-135M-Instruct on CPU.

    python scripts/cache_memory.py                      # T = 1024 and 8192
    python scripts/cache_memory.py --model path --lengths 1024 4096 --window 64
"""

from __future__ import annotations

import argparse
import copy
import platform

import torch
import transformers
from transformers import DynamicCache

import linearize
from linearize.loading import load_model_and_tokenizer


def kv_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if t is not None:
                total += t.numel() * t.element_size()
    return total


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="hub id, folder or .gguf (default: embedded SmolLM2)")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--feature-map", default="hedgehog")
    p.add_argument("--window", type=int, default=0)
    args = p.parse_args()

    original, _ = load_model_and_tokenizer(args.model)
    converted = linearize.linearize(
        copy.deepcopy(original), linearize.LinearAttentionConfig(feature_map=args.feature_map, window=args.window)
    )
    rows = []
    for T in args.lengths:
        ids = torch.randint(0, original.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            kv = DynamicCache(config=original.config)
            original(ids, past_key_values=kv, use_cache=True, logits_to_keep=1)
            state = linearize.LinearizeCache(converted.config)
            converted(ids, past_key_values=state, use_cache=True, logits_to_keep=1)
        assert kv.get_seq_length() == state.get_seq_length() == T
        rows.append((T, kv_bytes(kv), state.nbytes()))
        print(f"T={T}: original KV {kv_bytes(kv) / 2**20:.2f} MiB, converted state {state.nbytes() / 2**20:.2f} MiB", flush=True)

    c = original.config
    print()
    print(f"model: {args.model or 'SmolLM2-135M-Instruct (embedded GGUF)'}, {c.num_hidden_layers} layers, "
          f"{c.num_attention_heads} heads / {c.num_key_value_heads} kv heads, head_dim {c.head_dim}, "
          f"dtype {original.dtype}, batch 1; converted: {args.feature_map}, window {args.window}")
    print(f"device: {platform.processor() or platform.machine()} CPU; torch {torch.__version__}, transformers {transformers.__version__}")
    print()
    print("| tokens | original KV cache | converted state cache | ratio |")
    print("|---|---|---|---|")
    for T, kv, st in rows:
        print(f"| {T} | {kv / 2**20:.2f} MiB | {st / 2**20:.2f} MiB | {kv / st:.1f}x |")


if __name__ == "__main__":
    main()
