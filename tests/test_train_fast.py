"""The fast training step: torch.compile of the decoder gives the eager step's losses and updates
(stage 1, stage 2 with LoRA and with a full fine-tune), on a tiny model on CPU (inductor)."""

import copy
import json
import re

import pytest
import torch

import linearize
from linearize.recipes.distill import (DistillConfig, attach_lora, attention_transfer_loss, make_kd_loss,
                                       new_parameter_names, set_trainable)
from linearize.recipes.train import TrainConfig, train_stage

from conftest import load_script, tiny_model

TINY_FAST = dict(num_hidden_layers=2, vocab_size=97)


def rows(n=8, T=24, seed=0, packed=False):
    """Rows of one document each, or (packed) of 1-3 documents with boundaries that differ row to
    row, as recipes/data.py packs real text."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 90, (n, T), generator=g)
    pos = torch.arange(T).expand(n, T).clone()
    if packed:
        for r in range(n):
            for cut in torch.randint(3, T - 2, (r % 3,), generator=g).tolist():
                pos[r, cut:] = torch.arange(T - cut)
    return {"input_ids": ids, "position_ids": pos}


def build(stage):
    teacher = tiny_model("llama", **TINY_FAST)
    model = linearize.linearize(copy.deepcopy(teacher), linearize.LinearAttentionConfig(feature_map="hedgehog", window=4))
    cfg = DistillConfig(lora_rank=4, kd_chunk_size=64, ce_weight=0.2)
    if stage == "transfer":
        set_trainable(model, new_parameter_names(model))
        return model, attention_transfer_loss
    if stage == "lora":
        torch.manual_seed(1)
        model = attach_lora(model, cfg)
        with torch.no_grad():  # LoRA B starts at 0: move it so the adapter matters from step 1
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05)
        return model, make_kd_loss(cfg)
    set_trainable(model, [n for n, _ in model.named_parameters()])
    return model, make_kd_loss(cfg, teacher.requires_grad_(False))


@pytest.mark.parametrize("stage,packed", [("transfer", False), ("lora", False), ("full", False), ("lora", True)])
def test_compiled_step_gives_the_eager_loss_gradients_and_losses(stage, packed, tmp_path):
    torch._dynamo.reset()
    results = {}
    for compiled in (False, True):
        torch._dynamo.utils.counters.clear()
        model, loss_fn = build(stage)
        first = {}  # each trainable parameter's gradient at step 1, before the update

        def keep_first(p, n):
            first.setdefault(n, p.grad.clone())

        for n, p in model.named_parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda p, n=n: keep_first(p, n))
        cfg = TrainConfig(steps=3, batch_size=4, lr=1e-2, warmup_steps=1, save_every=0, compile=compiled)
        train_stage("s", model, loss_fn, rows(packed=packed), cfg, tmp_path / str(compiled))
        losses = [json.loads(l)["loss"] for l in (tmp_path / str(compiled) / "metrics.jsonl").read_text().splitlines()]
        inner = model.get_base_model() if stage == "lora" else model
        assert inner.model._compiled_call_impl is None  # the stage leaves the model uncompiled
        results[compiled] = first, losses
        # one graph per pass: a graph break (such as transformers' output_hidden_states hooks)
        # sends the decoder back to eager frame by frame (the LoRA KD step ran at 25% on an H200)
        assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
        if compiled and packed:
            # each step packs other documents: the layers see (B, T) document ids whatever the
            # packing (linearize/layers.py PackedDocs), so no packing compiles again
            frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            assert frames <= 6, dict(torch._dynamo.utils.counters["stats"])
    (grads_e, losses_e), (grads_c, losses_c) = results[False], results[True]
    assert losses_e[0] > 1e-3 and losses_e[-1] != losses_e[0]
    assert losses_c == pytest.approx(losses_e, rel=1e-4, abs=1e-6)
    assert grads_c.keys() == grads_e.keys() and any(g.abs().sum() > 0 for g in grads_e.values())
    for n in grads_e:
        torch.testing.assert_close(grads_c[n], grads_e[n], rtol=1e-4, atol=1e-6, msg=n)


def test_new_packings_do_not_recompile_the_decoder():
    # packed documents reach the compiled decoder as (B, T) document ids (linearize/layers.py
    # PackedDocs): six packings compile once; the (n_docs, L) layout before them compiled twice
    # (static, then dynamic sizes), and Python lists of boundaries once per packing
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = linearize.linearize(tiny_model("llama", **TINY_FAST),
                                linearize.LinearAttentionConfig(feature_map="hedgehog", window=4))
    model.model.compile(backend="eager")
    torch._dynamo.utils.counters.clear()
    T = 24
    try:
        for cuts in ([5], [9, 15], [3], [7, 12, 20], [11], [4, 8]):
            pos = torch.arange(T).expand(2, T).clone()
            for c in cuts:
                pos[0, c:] = torch.arange(T - c)
            with torch.no_grad():
                model(input_ids=torch.randint(2, 90, (2, T)), position_ids=pos, use_cache=False)
    finally:
        model.model._compiled_call_impl = None
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2, dict(torch._dynamo.utils.counters["stats"])
    assert not torch._dynamo.utils.counters["graph_break"]


def test_a_compiled_stage_keeps_the_decoder_in_one_graph_under_ddp(tmp_path, monkeypatch):
    # dynamo's DDP optimizer cuts a compiled graph at every gradient bucket; the stage turns it off
    # while it trains (measured faster on 2 GPUs, docs/reports/training.md) and restores it after
    import linearize.recipes.train as train

    seen = []
    monkeypatch.setattr(train, "_run", lambda *a: seen.append(torch._dynamo.config.optimize_ddp) or {"_model": None})
    # torch's default, set through the config's own patch: monkeypatch's undo would delete the
    # option (a config module hides deleted options), breaking every later compiled stage
    with torch._dynamo.config.patch(optimize_ddp=True):
        for compiled in (True, False):
            model, loss_fn = build("transfer")
            cfg = TrainConfig(steps=1, batch_size=4, save_every=0, compile=compiled)
            train_stage("s", model, loss_fn, rows(), cfg, tmp_path / str(compiled))
        assert seen == [False, True] and torch._dynamo.config.optimize_ddp


def test_cuda_graphs_compile_the_decoder_for_graph_replay_and_mark_every_step(tmp_path, monkeypatch):
    # --cuda-graphs: the decoder compiled with mode="reduce-overhead" (Inductor's CUDA-graph trees on
    # a GPU; on CPU the same compiled code without graphs) and each optimizer step marked as a new
    # one, so the trees reuse the last step's graph memory instead of recording again
    import linearize.recipes.train as train

    torch._dynamo.reset()
    modes, marks = [], []
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: modes.append(kw.get("mode")) or real_compile(fn, **kw))
    real_mark = torch.compiler.cudagraph_mark_step_begin
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1) or real_mark())
    model, loss_fn = build("lora")
    cfg = TrainConfig(steps=3, batch_size=4, save_every=0, lr=1e-3, compile=True, cuda_graphs=True)
    out = train.train_stage("s", model, loss_fn, rows(), cfg, tmp_path)
    assert out["steps"] == 3 and torch.isfinite(torch.tensor(out["final_loss"]))
    assert modes[0] == "reduce-overhead" and len(marks) == 3
    assert unwrap_decoder(model)._compiled_call_impl is None  # the model leaves the stage as it came
    torch._dynamo.reset()


def unwrap_decoder(model):
    from linearize.recipes.kd import unwrap

    inner = unwrap(model)
    return getattr(inner, inner.base_model_prefix)


@pytest.mark.parametrize("kind", ["decoder", "encoder"])
def test_as_teacher_gives_peft_disable_adapter_with_softmax_and_restores_the_student(kind):
    # the LoRA student's own teacher pass switches its layers by their flags (peft's context costs
    # 25 ms of host time a step): same logits as peft's disable_adapter + attention_mode("softmax")
    from linearize.api import attention_mode
    from linearize.recipes.kd import as_teacher

    from peft import LoraConfig, get_peft_model

    if kind == "decoder":
        # adapters on the MLP too: the softmax path never meets the q/k/v/o adapters (the original
        # attention keeps its own projections), so only these show that every adapter is off
        model = linearize.linearize(tiny_model("llama", **TINY_FAST), linearize.LinearAttentionConfig(feature_map="hedgehog", window=4))
        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05)
        x = dict(input_ids=torch.randint(2, 90, (2, 24), generator=torch.Generator().manual_seed(3)), use_cache=False)
        out = lambda m: m(**x).logits  # noqa: E731
    else:
        from test_encoders import tiny_encoder

        enc = linearize.linearize(tiny_encoder("bert"), linearize.LinformerConfig(k=8, max_length=32))
        torch.manual_seed(1)
        model = get_peft_model(enc, LoraConfig(r=4, target_modules=["query", "key", "value", "dense"]))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05)
        x = dict(input_ids=torch.randint(2, 90, (2, 24), generator=torch.Generator().manual_seed(3)))
        out = lambda m: m(**x).last_hidden_state  # noqa: E731
    model.eval()
    with torch.no_grad():
        student = out(model)
        with model.disable_adapter(), attention_mode(model, "softmax"):
            reference = out(model)
        for _ in range(2):  # the second time from the layers found the first time
            with as_teacher(model):
                mine = out(model)
            assert torch.equal(mine, reference)
        again = out(model)
    assert (student - reference).abs().max() > 1e-2 * reference.abs().max()  # the switch matters
    assert torch.equal(again, student)


def test_cuda_graphs_skipped_by_inductor_are_said_not_silent(tmp_path, monkeypatch, capsys):
    # Inductor runs a graph without CUDA graphs for reasons it logs only under perf_hints (a CPU
    # tensor, a mutated input...): the stage says so after its first step, with where to look
    import linearize.recipes.train as train

    n = iter([0, 2, 2, 2])  # before the stage, then after each step: the first step skipped two graphs
    monkeypatch.setattr(train, "cudagraph_skips", lambda: next(n))
    monkeypatch.setattr(train, "compile_decoder", lambda model, cuda_graphs=False: None)  # eager: the message only
    model, loss_fn = build("transfer")
    cfg = TrainConfig(steps=2, batch_size=4, save_every=0, compile=True, cuda_graphs=True)
    train.train_stage("s", model, loss_fn, rows(), cfg, tmp_path)
    err = capsys.readouterr()
    said = [line for line in (err.out + err.err).splitlines() if "--cuda-graphs" in line]
    assert len(said) == 1 and "2 compiled graph(s) of the step without CUDA graphs" in said[0] and "perf_hints" in said[0]


def test_a_compiled_stage_says_its_first_step_compiles_and_how_long_it_took(tmp_path, monkeypatch, capsys):
    # minutes of compilation before the bar moves (5 for gdn at 8K rows with checkpointing on an H100)
    # read as a hang: the stage says so before its first step, and the first step's time after it
    import linearize.recipes.train as train

    monkeypatch.setattr(train, "compile_decoder", lambda model, cuda_graphs=False: None)  # eager: the messages only
    model, loss_fn = build("transfer")
    for compile_ in (True, False):
        train.train_stage("s", model, loss_fn, rows(), TrainConfig(steps=2, batch_size=4, save_every=0,
                                                                   compile=compile_), tmp_path / str(compile_))
        err = capsys.readouterr()
        said = [line for line in (err.out + err.err).splitlines() if "first step" in line]
        if compile_:
            assert len(said) == 2 and "compiles the decoder" in said[0] and re.search(r"took \d+ s", said[1])
        else:
            assert said == []


def test_a_compiled_gdn_full_fine_tune_with_activation_checkpointing_trains_like_eager(tmp_path, monkeypatch):
    # the long-row path of issue 14 (--compile --gradient-checkpointing, chunked KD loss) on a GDN
    # student: non-reentrant checkpoints inside the compiled decoder, one graph per pass, the losses of
    # the eager step without checkpointing. Dynamo and AOT autograd (which place the checkpoints' recompute)
    # without Inductor's C++ build of the GDN math, which took 2-4 of CI's minutes here; the tests above
    # run Inductor, and every GPU lease's gdn runs train under it.
    monkeypatch.setenv("LINEARIZE_COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    teacher = tiny_model("llama", **TINY_FAST).requires_grad_(False)
    losses = {}
    for compiled in (False, True):
        torch._dynamo.utils.counters.clear()
        model = linearize.linearize(copy.deepcopy(teacher), linearize.GatedDeltaNetConfig())
        set_trainable(model, [n for n, _ in model.named_parameters()])
        cfg = TrainConfig(steps=3, batch_size=4, lr=1e-2, warmup_steps=1, save_every=0, compile=compiled,
                          gradient_checkpointing=compiled)
        train_stage("s", model, make_kd_loss(DistillConfig(kd_chunk_size=16, ce_weight=0.2), teacher), rows(), cfg,
                    tmp_path / str(compiled))
        losses[compiled] = [json.loads(l)["loss"] for l in (tmp_path / str(compiled) / "metrics.jsonl").read_text().splitlines()]
        assert model.is_gradient_checkpointing == compiled
        assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert losses[False][0] > 1e-3 and losses[False][-1] != losses[False][0]
    assert losses[True] == pytest.approx(losses[False], rel=1e-4, abs=1e-6)
