"""How far a converted model's chunked prefill is from its one call, beside its own 16-bit rounding.

Runs on CPU, or on a GPU with ``--device cuda`` (where SDPA's flash kernel runs the softmax layers). The bench's chunked-prefill check holds bf16 logits to 0.03 relative, and the gdn-hybrid
preset read 0.086 on an H200. This script measures, on the same random SmolLM2-shaped model in
bf16, prefilled with 529 tokens in chunks of 256:
  - chunked (mask-free lower-right softmax chunks, ``linearize/hybrid_sdpa.py``) against one call;
  - chunked through transformers' own masked path against one call, and the two against each other;
  - the same model in float32: chunked against one call, and the bf16 one call against float32.

    python scripts/hybrid_rounding.py                      # gdn-hybrid, the SmolLM2 shape
    python scripts/hybrid_rounding.py --preset gdn --tiny  # a 2-layer model, in seconds
    python scripts/hybrid_rounding.py --device cuda        # the same on a GPU

The bf16 chunked logits are also measured against the float32 one call: if the chunked run is no
further from float32 than the bf16 one call is, the gap between the two bf16 runs is rounding.
"""
import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import linearize
import linearize.modeling_linearize as modeling
from linearize.benchmark.measure import prefill
from linearize.benchmark.plan import PRESETS, preset_config


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def measure(preset: str = "gdn-hybrid", tiny: bool = False, T: int = 529, chunk: int = 256, seed: int = 0,
            device: str = "cpu") -> dict:
    torch.manual_seed(seed)
    shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=96, vocab_size=97) if tiny else dict(
        hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        intermediate_size=1536, vocab_size=49152)
    model = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=True)).to(device, torch.bfloat16).eval()
    conv = preset_config(preset, "smollm2-135m")
    if tiny and preset == "gdn-hybrid":
        conv.layers = [1]  # layer 0 stays softmax
    linearize.linearize(model, conv)
    ids = torch.randint(0, shape["vocab_size"], (2, T)).to(device)

    def run(chunked: bool):
        with torch.no_grad():
            return prefill(model, ids, linearize.LinearizeCache(model.config), chunk if chunked else None).float()

    whole, maskless = run(False), run(True)
    applies = modeling._maskless_chunk
    modeling._maskless_chunk = lambda *a: False  # transformers' masked path for the softmax chunks
    try:
        masked = run(True)
    finally:
        modeling._maskless_chunk = applies
    model.float()
    whole32, chunked32 = run(False), run(True)
    return {"chunked_vs_one_call_bf16": rel(maskless, whole), "masked_chunked_vs_one_call_bf16": rel(masked, whole),
            "mask_free_vs_masked_bf16": rel(maskless, masked), "chunked_vs_one_call_fp32": rel(chunked32, whole32),
            "one_call_bf16_vs_fp32": rel(whole, whole32), "chunked_bf16_vs_fp32": rel(maskless, whole32)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gdn-hybrid", choices=list(PRESETS))
    p.add_argument("--tiny", action="store_true", help="a 2-layer model instead of the SmolLM2 shape")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    a = p.parse_args()
    if a.device.startswith("cuda"):
        print(torch.cuda.get_device_name(), f"torch {torch.__version__}")
    for name, value in measure(a.preset, a.tiny, device=a.device).items():
        print(f"{name:34s} {value:.3g}")


if __name__ == "__main__":
    main()
