"""Packed rows (several documents per row, recipes/data.py) through the compiled training step: the
layers get per-token document ids and offsets of shape (B, T) (linearize/layers.py PackedDocs), so a
new packing is neither a recompile nor, under --cuda-graphs, a new CUDA graph. Before, the documents
reached the decoder as (n_docs, L) tensors and every new count recompiled (lolcats: every step).

The recompile counts run under dynamo with the ``aot_eager`` backend: recompiles come from dynamo's
guards on the inputs, whatever backend then compiles the graph, and Inductor on two shared CPU cores
would spend minutes on the same graphs."""

import pytest
import torch

import linearize
from linearize.recipes.distill import (DistillConfig, attach_lora, attention_transfer_loss, make_kd_loss,
                                       new_parameter_names, record_teacher_attention, set_trainable)
from linearize.recipes.train import TrainConfig, train_stage

from conftest import tiny_model

PRESETS = {
    "lolcats": dict(preset="lolcats", window=4),
    "linear": dict(preset="linear"),
    "gdn": dict(preset="gdn"),
    # layer 0 keeps softmax attention (SDPA); the converted one has the preset's softmax window beside it
    "gdn-hybrid": dict(preset="gdn", softmax_layers="0", window=4, sinks=1),
    "gdn-hybrid-qwen3_5": dict(preset="gdn", softmax_layers="0", layout="qwen3_5"),  # the exportable layout
}
DOCS_PER_ROW = (1, 3, 17)


def packed_rows(T=24, seed=0) -> dict[str, torch.Tensor]:
    """Six rows packing 1, 3 or 17 documents each (position ids restart at every document), cut at
    random places, so every batch of two packs differently."""
    g = torch.Generator().manual_seed(seed)
    n = 2 * len(DOCS_PER_ROW)
    pos = torch.arange(T).expand(n, T).clone()
    for r in range(n):
        docs = DOCS_PER_ROW[r % len(DOCS_PER_ROW)]
        cuts = sorted(torch.randperm(T - 2, generator=g)[: docs - 1].add(1).tolist())
        for c in cuts:
            pos[r, c:] = torch.arange(T - c)
    return {"input_ids": torch.randint(2, 90, (n, T), generator=g), "position_ids": pos}


def graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def counted(loss_fn, seen):
    """``loss_fn`` noting dynamo's graph count after each call."""

    def fn(model, batch):
        out = loss_fn(model, batch)
        seen.append(graphs())
        if hasattr(loss_fn, "parts"):  # the terms the metrics name
            fn.parts = loss_fn.parts
        return out

    fn.shardable = getattr(loss_fn, "shardable", True)
    return fn


@pytest.mark.parametrize("preset", list(PRESETS))
def test_packed_batches_compile_once_per_stage(preset, tmp_path, monkeypatch):
    import linearize.recipes.train as train

    monkeypatch.setattr(train, "compile_mode", lambda cuda_graphs: {"backend": "aot_eager"})
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cfg = DistillConfig(lora_rank=4, kd_chunk_size=32, **PRESETS[preset])
    # one layer (two for the hybrid: a kept softmax one and a converted one): the smallest stack
    # that has every kind of layer graph
    layers = 2 if cfg.softmax_layers else 1
    model = linearize.linearize(tiny_model("llama", num_hidden_layers=layers), cfg.method_config())
    _, fixed = cfg.softmax_choice()
    if fixed:
        linearize.restore_softmax(model, fixed)
    rows = packed_rows()
    steps = 3  # every row once, each step two rows of the 1-, 3- and 17-document kinds
    tc = TrainConfig(steps=steps, batch_size=2, lr=1e-3, warmup_steps=1, save_every=0, compile=True)

    set_trainable(model, new_parameter_names(model))
    seen1 = []
    train_stage("s1", model, counted(attention_transfer_loss, seen1), rows, tc, tmp_path)
    peft_model = attach_lora(model, cfg)
    seen2 = []
    train_stage("s2", peft_model, counted(make_kd_loss(cfg), seen2), rows, tc, tmp_path)
    assert len(seen1) == len(seen2) == steps
    # the first step compiles the layers (one graph per kind of layer, shared by identical layers: in
    # stage 2 the teacher's, the student's first layer (its input needs no gradient) and the rest);
    # later packings add none
    assert seen1[1:] == [seen1[0]] * (steps - 1), seen1
    assert seen2[1:] == [seen2[0]] * (steps - 1), seen2
    assert seen1[0] <= 2 and seen2[0] - seen1[0] <= 6, (seen1, seen2)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    torch._dynamo.reset()


def test_full_fine_tune_teacher_compiles_once_when_a_batch_packs_nothing(tmp_path, monkeypatch):
    """A full fine-tune's teacher is the unconverted transformers model, which builds the packed mask
    itself only for a batch with a packed row and gives its layers None otherwise: a recompile ~470
    steps into stage 2 on the Linux docs (gdn, gdn-hybrid). One row packs 17 documents, five hold
    one: some batch of two has a packed row, another has none."""
    import copy

    import linearize.recipes.train as train
    from linearize.layers import static_packing
    from linearize.recipes.distill import plain_teacher_mask

    monkeypatch.setattr(train, "compile_mode", lambda cuda_graphs: {"backend": "aot_eager"})
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cfg = DistillConfig(preset="gdn", softmax_layers="0", finetune="full", kd_chunk_size=32)
    base = tiny_model("llama", num_hidden_layers=2)
    teacher = copy.deepcopy(base).eval().requires_grad_(False)
    rows = packed_rows()
    with torch.no_grad(), static_packing(True):  # the ready mask is the one transformers builds
        ids, pos = rows["input_ids"][1:3], rows["position_ids"][1:3]
        own = teacher(input_ids=ids, position_ids=pos, use_cache=False).logits
        ready = teacher(input_ids=ids, position_ids=pos, use_cache=False, attention_mask=plain_teacher_mask(teacher, pos))
        torch.testing.assert_close(ready.logits, own)
    train.compile_decoder(teacher)
    model = linearize.linearize(base, cfg.method_config())
    linearize.restore_softmax(model, cfg.softmax_choice()[1])
    T = rows["position_ids"].shape[1]
    rows["position_ids"][[0, 1, 3, 4, 5]] = torch.arange(T)  # row 2 keeps its 17 documents
    steps = 3
    tc = TrainConfig(steps=steps, batch_size=2, lr=1e-3, warmup_steps=1, save_every=0, compile=True)
    seen = []
    train_stage("s2", model, counted(make_kd_loss(cfg, teacher), seen), rows, tc, tmp_path)
    assert seen[1:] == [seen[0]] * (steps - 1), seen
    torch._dynamo.reset()


def test_swa_baseline_compiles_once_for_any_packing(tmp_path, monkeypatch):
    """--preset swa (linearize/swa.py): the plain transformers student with LoRA, against its separate
    teacher, gets the packed mask ready in every batch, also in one that packs nothing."""
    import copy

    import linearize.recipes.train as train
    from linearize.swa import apply_swa

    monkeypatch.setattr(train, "compile_mode", lambda cuda_graphs: {"backend": "aot_eager"})
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cfg = DistillConfig(preset="swa", window=4, sinks=1, lora_rank=4, kd_chunk_size=32)
    model = tiny_model("llama", num_hidden_layers=1)
    teacher = copy.deepcopy(model).eval().requires_grad_(False)
    train.compile_decoder(teacher)
    apply_swa(model, 4, 1)
    rows = packed_rows()
    T = rows["position_ids"].shape[1]
    rows["position_ids"][[0, 1, 3, 4, 5]] = torch.arange(T)  # one batch of two packs nothing
    steps = 3
    tc = TrainConfig(steps=steps, batch_size=2, lr=1e-3, warmup_steps=1, save_every=0, compile=True)
    seen = []
    train_stage("s2", attach_lora(model, cfg), counted(make_kd_loss(cfg, teacher), seen), rows, tc, tmp_path)
    assert seen[1:] == [seen[0]] * (steps - 1), seen
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    torch._dynamo.reset()


@pytest.mark.parametrize("preset,finetune", [("linear", "lora"), ("linear", "full"), ("gdn-hybrid", "full")])
def test_stage2_with_transfer_weight_compiles_once(preset, finetune, tmp_path, monkeypatch):
    """--transfer-weight runs stage 2's teacher in the layers' "record" mode (a separate teacher: hooks on
    its attention) and the student in "joint" (its own output on, the MSE to the record beside it): its
    graphs are all made on the first step (the heads' check runs the student once in "linear" too), none
    after, none for new packings, no graph break, and the terms reach the metrics."""
    import copy
    import json

    import linearize.recipes.train as train

    monkeypatch.setattr(train, "compile_mode", lambda cuda_graphs: {"backend": "aot_eager"})
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cfg = DistillConfig(finetune=finetune, kd_chunk_size=32, transfer_weight=0.5, lora_rank=4, **PRESETS[preset])
    base = tiny_model("llama", num_hidden_layers=2 if cfg.softmax_layers else 1)
    teacher = None
    if finetune == "full":
        teacher = copy.deepcopy(base).eval().requires_grad_(False)
        record_teacher_attention(teacher)  # before compiling, as distill() does
        train.compile_decoder(teacher)
    model = linearize.linearize(base, cfg.method_config())
    if kept := cfg.softmax_choice()[1]:
        linearize.restore_softmax(model, kept)
    with torch.no_grad():  # a window beside Gated DeltaNet starts as the window alone, the teacher itself on
        for m in model.modules():  # documents shorter than it: weigh the state in, so every step has both terms
            if hasattr(m, "window_gamma"):
                m.window_gamma.fill_(0.5)
    if finetune == "lora":
        model = attach_lora(model, cfg)
    steps = 3
    tc = TrainConfig(steps=steps, batch_size=2, lr=1e-3, warmup_steps=1, save_every=0, compile=True)
    seen = []
    loss_fn = make_kd_loss(cfg, teacher)
    train_stage("s2", model, counted(loss_fn, seen), packed_rows(), tc, tmp_path)
    assert len(seen) == steps and seen[1:] == [seen[0]] * (steps - 1), seen
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == steps and all(r["transfer"] > 0 and r["kd"] > 0 for r in rows)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    train_stage("s2b", model, counted(loss_fn, seen), packed_rows(seed=1), tc, tmp_path)
    assert seen[steps:] == [seen[0]] * steps, seen  # new packings, the same graphs
    torch._dynamo.reset()


def test_transfer_weight_refuses_a_teacher_compiled_before_it_records(monkeypatch):
    """A separate teacher's attention outputs come from forward hooks, which dynamo does not see when
    they are added after the teacher's layers first ran compiled: stage 2 then says so, not a KeyError."""
    import copy

    import linearize.recipes.train as train

    monkeypatch.setattr(train, "compile_mode", lambda cuda_graphs: {"backend": "aot_eager"})
    torch._dynamo.reset()
    cfg = DistillConfig(finetune="full", kd_chunk_size=0, transfer_weight=0.5, **PRESETS["linear"])
    base = tiny_model("llama", num_hidden_layers=1)
    teacher = copy.deepcopy(base).eval().requires_grad_(False)
    train.compile_decoder(teacher)
    batch = {k: v[:2] for k, v in packed_rows().items()}
    model = linearize.linearize(base, cfg.method_config())
    make_kd_loss(DistillConfig(finetune="full", kd_chunk_size=0, **PRESETS["linear"]), teacher)(model, batch)
    with pytest.raises(RuntimeError, match=r"call record_teacher_attention\(teacher\) before"):
        make_kd_loss(cfg, teacher)(model, batch)
    torch._dynamo.reset()
