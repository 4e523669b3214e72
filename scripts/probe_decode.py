"""A quick GPU probe of the compiled decode step (not the benchmark: `linearize bench` is).

For each preset on the SmolLM2-135M shape (random bf16 weights): `generate(cache_implementation=
"static")` (transformers compiles the decode step) against the default dynamic cache (same tokens?),
then one decode step under `torch.compile(mode="reduce-overhead")` over a StaticLinearizeCache
after a prefill of --context tokens, timed with CUDA events, and the CUDA kernels it launches (eager,
profiler) — beside the original model compiled the same way over transformers' StaticCache.

    python scripts/probe_decode.py --context 4096 --batch 1
"""

from __future__ import annotations

import argparse
import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

import linearize

SMOLLM2 = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
               intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True)
HYBRID_SOFTMAX = [0, 1, 10, 17, 18, 20, 23, 24]
PRESETS = {
    "hedgehog": lambda: linearize.LinearAttentionConfig(feature_map="hedgehog"),
    "lolcats": lambda: linearize.LinearAttentionConfig(feature_map="hedgehog", window=64),
    "gdn": lambda: linearize.GatedDeltaNetConfig(),
    "gdn-hybrid": lambda: linearize.GatedDeltaNetConfig(layers=[i for i in range(30) if i not in HYBRID_SOFTMAX]),
}


def build(dtype=torch.bfloat16):
    cfg = LlamaConfig(**SMOLLM2, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                      max_position_embeddings=200_000, bos_token_id=1, eos_token_id=None, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = LlamaForCausalLM(cfg).to(dtype).eval()
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    return m


def kernels_per_step(step, *args):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(*args)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def time_step(step, args, n=50):
    for _ in range(5):
        step(*args)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        step(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def probe(model, cache, B, T, label, compiled_fn):
    ids = torch.randint(2, model.config.vocab_size, (B, T), device="cuda")
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        tok = ids[:, -1:].clone()
        pos = torch.full((B, 1), T, device="cuda")

        def eager(t, p):
            return model(t, position_ids=p, past_key_values=cache, use_cache=True, logits_to_keep=1).logits

        n_kernels = kernels_per_step(eager, tok, pos)

        def compiled(t, p):
            return compiled_fn(t, position_ids=p, past_key_values=cache, use_cache=True, logits_to_keep=1).logits

        ms = time_step(compiled, (tok, pos))
    print(f"{label:>12}  B={B} T={T}: {ms:.3f} ms/step (compiled, reduce-overhead), {n_kernels} kernels eager", flush=True)
    return ms


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--presets", default=",".join(PRESETS))
    args = p.parse_args()
    B, T = args.batch, args.context
    original = build()
    torch._dynamo.config.cache_size_limit = 64
    base = probe(original, StaticCache(config=original.config, max_cache_len=T + 128), B, T, "original",
                 torch.compile(original, mode="reduce-overhead", fullgraph=True))
    for name in args.presets.split(","):
        shared = {id(t): t for t in [*original.parameters(), *original.buffers()]}
        model = copy.deepcopy(original, shared)
        linearize.linearize(model, PRESETS[name]())
        model.to(device="cuda", dtype=torch.bfloat16).eval()
        ids = torch.randint(2, 49152, (2, 24), device="cuda")
        with torch.no_grad():
            dyn = model.generate(ids, max_new_tokens=16, do_sample=False)
            sta = model.generate(ids, max_new_tokens=16, do_sample=False, cache_implementation="static")
        same = torch.equal(dyn, sta)
        first = (dyn != sta).any(0).nonzero()
        print(f"{name:>12}  static generate == dynamic: {same}" + ("" if same else f" (first diff at {int(first[0])})"))
        torch._dynamo.reset()
        ms = probe(model, linearize.StaticLinearizeCache(model.config, B, T + 128, device="cuda"), B, T, name,
                   torch.compile(model, mode="reduce-overhead", fullgraph=True))
        print(f"{name:>12}  speed-up over the compiled original: {base / ms:.2f}x", flush=True)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
