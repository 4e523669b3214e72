"""Profile distillation steps (stage 1 attention transfer and stage 2 KD) on CUDA: step time,
tokens/s and the top GPU ops (torch.profiler), on the recipes' own loss functions and data packing.

    python scripts/profile_train.py --model smollm2/ --data Documentation/ --preset lolcats
    python scripts/profile_train.py --preset gdn --finetune full          # random SmolLM2-shaped model

Without --model the model is a random-weight SmolLM2-135M shape and the rows are synthetic packed
documents (lengths drawn like the Linux docs': median ~560 tokens): speed does not depend on weights.
"""
import argparse
import time

import torch


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--data", default=None)
    p.add_argument("--preset", default="lolcats")
    p.add_argument("--finetune", default="lora")
    p.add_argument("--stages", default="1,2")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=6, help="timed steps per stage (after 2 warm-up steps)")
    p.add_argument("--rows", type=int, default=12)
    p.add_argument("--device", default="cuda")
    p.add_argument("--compile", action="store_true", help="compile the decoder as `linearize distill --compile` does")
    p.add_argument("--kd-chunk-size", type=int, default=1024, help="0 = the plain KD loss over whole logits")
    a = p.parse_args()

    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from linearize.api import linearize
    from linearize.recipes.data import DataConfig, synthetic_rows
    from linearize.recipes.distill import (DistillConfig, attach_lora, attention_transfer_loss, make_kd_loss,
                                           new_parameter_names, prepare_data, set_trainable)

    if a.model:
        model = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(a.model)
        rows, _ = prepare_data(tok, DataConfig(data=a.data, seq_len=a.seq_len))
    else:
        cfg = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                          head_dim=64, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True)
        model = LlamaForCausalLM(cfg)
        rows = synthetic_rows(a.batch_size * 4, a.seq_len, cfg.vocab_size)
    model.to(a.device)
    dcfg = DistillConfig(preset=a.preset, finetune=a.finetune, kd_chunk_size=a.kd_chunk_size)
    import copy
    teacher = copy.deepcopy(model).eval().requires_grad_(False) if a.finetune == "full" else None
    linearize(model, dcfg.method_config())
    n_rows = rows["input_ids"].shape[0]
    cuda = a.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def run(name, m, loss_fn, params):
        from linearize.recipes.train import TrainConfig, compile_decoder, make_optimizer

        opt = make_optimizer(params, TrainConfig(lr=1e-4))
        m.train()
        if a.compile:
            compile_decoder(m)
            if teacher is not None:
                teacher.model.compile()

        def step(i):
            idx = torch.arange(i * a.batch_size, (i + 1) * a.batch_size) % n_rows
            batch = {k: v[idx].to(a.device) for k, v in rows.items()}
            with torch.autocast(a.device, dtype=torch.bfloat16):
                loss = loss_fn(m, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()

        for i in range(2):
            step(i)
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.time()
        for i in range(a.steps):
            step(i + 2)
        sync()
        dt = (time.time() - t0) / a.steps
        tokens = a.batch_size * a.seq_len
        print(f"== {name}: {dt * 1e3:.0f} ms/step, {tokens / dt:,.0f} tok/s, peak {torch.cuda.max_memory_allocated() / 2**30 if cuda else 0:.1f} GiB",
              flush=True)
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            step(a.steps + 2)
            sync()
        print(prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=a.rows, max_name_column_width=70))

    if "1" in a.stages:
        set_trainable(model, new_parameter_names(model))
        run("stage 1 (attention transfer)", model, attention_transfer_loss, [p for p in model.parameters() if p.requires_grad])
    if "2" in a.stages:
        if a.finetune == "lora":
            pm = attach_lora(model, dcfg)
            run("stage 2 (KD, LoRA)", pm, make_kd_loss(dcfg), [q for q in pm.parameters() if q.requires_grad])
        else:
            set_trainable(model, [n for n, _ in model.named_parameters()])
            run("stage 2 (KD, full)", model, make_kd_loss(dcfg, teacher), list(model.parameters()))


if __name__ == "__main__":
    main()
