"""The chunked distillation loss: same value and gradients as the plain loss over whole logits,
on the heads of llama (plain lm_head) and gemma2 (final logit softcapping), and used by stage 2."""

import copy

import pytest
import torch

import linearize
from linearize.recipes.distill import DistillConfig, make_kd_loss, next_token_labels
from linearize.recipes.kd import HEAD_SOFTCAP, LogitHead, kd_loss_chunked, kd_loss_plain, logit_head

from conftest import tiny_model


def batch(B=2, T=13, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 90, (B, T), generator=g)
    pos = torch.arange(T).expand(B, T).clone()
    pos[1, 6:] -= 6  # a packed row: a second document starts at 6
    return {"input_ids": ids, "position_ids": pos}


@pytest.mark.parametrize("ce_weight", [0.0, 0.5])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_chunked_loss_matches_the_plain_loss_value_and_gradients(softcap, ce_weight):
    torch.manual_seed(0)
    B, T, H, V = 3, 7, 16, 53
    s_lin, t_lin = torch.nn.Linear(H, V, bias=True), torch.nn.Linear(H, V, bias=True)
    s_head, t_head = LogitHead(s_lin, softcap), LogitHead(t_lin, softcap)
    s_h = (torch.randn(B, T, H) * 2).requires_grad_(True)
    t_h = torch.randn(B, T, H) * 2
    labels = next_token_labels(torch.randint(0, V, (B, T)))
    ref = kd_loss_plain(s_head(s_h), t_head(t_h), labels, 1.5, ce_weight)
    ref_grads = torch.autograd.grad(ref, [s_h, s_lin.weight, s_lin.bias])
    for chunk in (4, 21, 100):  # not dividing B*T, exactly one chunk, larger than B*T
        loss = kd_loss_chunked(s_h, t_h, s_head, t_head, labels, 1.5, ce_weight, chunk)
        grads = torch.autograd.grad(loss * 3.0, [s_h, s_lin.weight, s_lin.bias])  # the incoming gradient scales
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, 3.0 * r, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_stage2_loss_is_chunked_and_equals_the_plain_loss(model_type, finetune):
    from peft import LoraConfig, get_peft_model

    teacher = tiny_model(model_type)
    if model_type == "gemma2":  # a cap the logits reach, so a head without it would differ
        teacher.config.final_logit_softcapping = 2.0
    model = linearize.linearize(copy.deepcopy(teacher), linearize.LinearAttentionConfig(feature_map="hedgehog", window=4))
    if finetune == "lora":
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        teacher = None
    else:
        teacher.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    b = batch()

    def run(chunk):
        cfg = DistillConfig(kd_chunk_size=chunk, ce_weight=0.3, kd_temperature=2.0)
        fn = make_kd_loss(cfg, teacher, log=lambda *a: None)
        loss = fn(model, b)
        return fn.path, loss, torch.autograd.grad(loss, trainable)

    path, loss, grads = run(5)
    plain_path, ref, ref_grads = run(0)
    assert path == "chunked" and plain_path.startswith("plain")
    assert ref.item() > 1e-3
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


def test_a_head_it_cannot_reproduce_uses_the_plain_loss_and_says_why(monkeypatch):
    model = linearize.linearize(tiny_model("llama"), linearize.LinearAttentionConfig())
    monkeypatch.delitem(HEAD_SOFTCAP, "llama")
    assert "no entry in recipes/kd.py HEAD_SOFTCAP" in logit_head(model)
    said = []
    fn = make_kd_loss(DistillConfig(), tiny_model("llama").requires_grad_(False), log=said.append)
    fn(model, batch())
    assert fn.path.startswith("plain: model_type 'llama'") and len(said) == 1


def test_a_wrong_head_stops_instead_of_training_another_function(monkeypatch):
    model = linearize.linearize(tiny_model("gemma2"), linearize.LinearAttentionConfig())
    model.config.final_logit_softcapping = 2.0
    monkeypatch.setitem(HEAD_SOFTCAP, "gemma2", None)  # forget the softcap
    fn = make_kd_loss(DistillConfig(), tiny_model("gemma2", final_logit_softcapping=2.0).requires_grad_(False))
    with pytest.raises(RuntimeError, match="does not reproduce the student's logits.*--kd-chunk-size 0"):
        fn(model, batch())


def test_activation_checkpointing_with_the_chunked_loss_keeps_loss_and_gradients():
    """The long-row path (--gradient-checkpointing, chunked loss): same loss and gradients as the
    plain loss without checkpointing, on packed rows."""
    teacher = tiny_model("llama").requires_grad_(False)
    b = batch(B=2, T=64)
    results = []
    for chunk, checkpointing in ((0, False), (24, True)):
        model = linearize.linearize(copy.deepcopy(teacher).requires_grad_(True), linearize.LinearAttentionConfig(window=8))
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        fn = make_kd_loss(DistillConfig(kd_chunk_size=chunk), teacher)
        loss = fn(model, b)
        loss.backward()
        results.append((loss.item(), {n: p.grad for n, p in model.named_parameters()}))
    (ref, ref_grads), (loss, grads) = results
    assert loss == pytest.approx(ref, rel=1e-5)
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("autocast", [False, True])
def test_compiled_chunks_give_the_eager_chunked_loss_and_gradients(autocast):
    # what --compile runs: each chunk one inductor graph; the same value and gradients as eager,
    # in fp32 and under bf16 autocast (the weights then cast once per call, not per chunk)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    B, T, H, V = 2, 9, 16, 53
    s_lin, t_lin = torch.nn.Linear(H, V, bias=True), torch.nn.Linear(H, V, bias=True)
    s_head, t_head = LogitHead(s_lin, 3.0), LogitHead(t_lin, 3.0)
    s_h = (torch.randn(B, T, H) * 2).requires_grad_(True)
    t_h = torch.randn(B, T, H) * 2
    labels = next_token_labels(torch.randint(0, V, (B, T)))
    out = {}
    for compiled in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = kd_loss_chunked(s_h, t_h, s_head, t_head, labels, 1.5, 0.4, 4, compiled=compiled)
        out[compiled] = loss, torch.autograd.grad(loss * 2.0, [s_h, s_lin.weight, s_lin.bias])
    (ref, ref_grads), (loss, grads) = out[False], out[True]
    assert ref.item() > 1e-3
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        assert g.dtype == r.dtype
        torch.testing.assert_close(g, r, rtol=1e-4 if not autocast else 2e-2, atol=1e-6 if not autocast else 1e-3)
    # 18 tokens in chunks of 4: one graph for the full chunks and one for the last (2 tokens)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
