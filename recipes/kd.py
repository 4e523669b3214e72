"""The distillation loss, KL(teacher || student) over the vocabulary (+ optional cross-entropy),
computed in chunks of tokens from the final hidden states.

The plain loss holds the teacher's and the student's float32 logits whole: at batch 16 x 1024 and a
49K vocabulary that is 3 GiB each, plus their log-softmaxes and gradients. Here each chunk of
tokens goes through the LM head, the loss and the loss's gradient in one pass, so only
``(chunk, vocab)`` floats live at a time. The gradients w.r.t. the student's hidden states and head
weight are computed in that forward pass (which saves recomputing the chunk's logits in the
backward) and only scaled by the incoming gradient in the backward.

The final hidden states come from the model's own forward with its head set aside
(:func:`final_hidden_states`), not from ``output_hidden_states=True``: transformers 5 collects
hidden states through forward hooks it installs on first use, and hooks graph-break a compiled
decoder (measured on an H200: the LoRA KD step ran at 25% of the plain step, its decoder falling
back to eager frame by frame).

The head is reproduced exactly as each model's ``ForCausalLM`` applies it (``HEAD_SOFTCAP``: all
supported architectures are ``lm_head(h)``; gemma2 then softcaps with
``config.final_logit_softcapping``), and the first call checks the reproduction against the
model's own logits at the last position, so a head we get wrong stops with an error instead of
training on a different function.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn.functional as F
from torch import nn

# model_type -> the config attribute holding a final logit softcap (None: plain lm_head(h)).
# Read from each model's *ForCausalLM.forward (transformers 5.17 / 5.23); a model_type missing here
# uses the plain loss, with the reason said once.
HEAD_SOFTCAP: dict[str, str | None] = {
    "llama": None,
    "mistral": None,
    "qwen2": None,
    "qwen3": None,
    "phi3": None,
    "olmo2": None,
    "gemma2": "final_logit_softcapping",
}


def unwrap(model, keep_peft: bool = False):
    """The module under DDP / FSDP / torch.compile wrappers (and under peft's unless ``keep_peft``)."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel) or type(model).__name__ == "FullyShardedDataParallel":
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif not keep_peft and hasattr(model, "get_base_model"):
            model = model.get_base_model()
        else:
            return model


_TEACHER_LAYERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def as_teacher(peft_model, mode: str = "softmax"):
    """A LoRA student as its own teacher: every adapter off and every converted layer on the
    original softmax attention (``mode="record"``: each also keeping its output, the targets of a
    "joint" pass), what ``peft_model.disable_adapter()`` with
    ``attention_mode(model, "softmax")`` computes (test). The layers are found once per model and
    switched by their own flags: peft's context walks every module and sets ``requires_grad`` on
    every adapter weight on the way in and out, 25 ms of host time a step on the SmolLM2-135M shape,
    during which a CUDA-graph step's GPU has nothing to do (docs/reports/training.md, the profiles)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    from linearize.modeling_linearize import CONVERTED

    found = _TEACHER_LAYERS.get(peft_model)
    if found is None:
        mods = list(peft_model.modules())
        found = ([m for m in mods if isinstance(m, BaseTunerLayer)], [m for m in mods if isinstance(m, CONVERTED)])
        if not found[1]:
            raise ValueError("the model has no converted layers")
        _TEACHER_LAYERS[peft_model] = found
    adapters, converted = found
    before = [m._disable_adapters for m in adapters], [m.mode for m in converted]
    for m in adapters:
        m._disable_adapters = True  # what LoraLayer.forward reads (peft's `disable_adapters` property)
    for m in converted:
        m.mode = mode
    try:
        yield
    finally:
        for m, b in zip(adapters, before[0]):
            m._disable_adapters = b
        for m, b in zip(converted, before[1]):
            m.mode = b


def decoder_compiled(model) -> bool:
    """Whether the model's decoder stack runs compiled (``recipes/train.py`` ``compile_decoder``,
    ``--compile``): the chunked KD loss then compiles its chunk too."""
    inner = unwrap(model)
    decoder = getattr(inner, inner.base_model_prefix, None)
    return bool(getattr(decoder, "_linearize_compiled", False)) or getattr(decoder, "_compiled_call_impl", None) is not None


class LogitHead(nn.Module):
    """``softcap * tanh(lm_head(h) / softcap)`` or ``lm_head(h)``: the model's logits from its final hidden states."""

    def __init__(self, linear: nn.Linear, softcap: float | None):
        super().__init__()
        self.linear, self.softcap = linear, softcap

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return _softcap(self.linear(h).float(), self.softcap)[0]


def logit_head(model) -> LogitHead | str:
    """The model's head, or a one-line reason why the chunked loss cannot reproduce it."""
    inner = unwrap(model)
    model_type = inner.config.model_type.removeprefix("linearize_")
    if model_type not in HEAD_SOFTCAP:
        return f"model_type {model_type!r} has no entry in recipes/kd.py HEAD_SOFTCAP (how its logits are made)"
    if any(type(m).__name__ in ("FullyShardedDataParallel", "FSDPModule") or hasattr(m, "unshard")
           for m in (model, inner, inner.get_output_embeddings())):
        return "FSDP shards the LM head outside the model's forward"
    head = inner.get_output_embeddings()
    if type(head) is not nn.Linear:
        return f"its output embedding is a {type(head).__name__}, not an nn.Linear"
    attr = HEAD_SOFTCAP[model_type]
    return LogitHead(head, getattr(inner.config, attr, None) if attr else None)


@contextlib.contextmanager
def final_hidden_states(model):
    """Within this context ``model(...).logits`` are the final hidden states (after the final
    norm), ``(B, T, hidden)``: the LM head is an identity and the softcap (if the model has one) is
    off. The call still goes through every wrapper (DDP, compile, peft), so gradients sync as usual;
    the head's weight is the same Parameter, used by the chunked loss."""
    inner = unwrap(model)
    head_name = next(n for n, m in inner.named_children() if m is inner.get_output_embeddings())
    head = getattr(inner, head_name)
    attr = HEAD_SOFTCAP.get(inner.config.model_type.removeprefix("linearize_"))
    cap = getattr(inner.config, attr, None) if attr else None
    setattr(inner, head_name, nn.Identity())
    if attr:
        setattr(inner.config, attr, None)
    try:
        yield
    finally:
        setattr(inner, head_name, head)
        if attr:
            setattr(inner.config, attr, cap)


def _softcap(logits: torch.Tensor, cap: float | None):
    """(capped logits, d capped / d logits or None)."""
    if not cap:
        return logits, None
    t = torch.tanh(logits / cap)
    return t * cap, 1 - t * t


def kd_loss_plain(s_logits, t_logits, labels, temperature: float, ce_weight: float) -> torch.Tensor:
    """The reference: ``(B, T, V)`` logits whole. ``labels (B, T)``: next token, -100 where none."""
    T = temperature
    t_logp = F.log_softmax(t_logits.float() / T, -1)
    s_logp = F.log_softmax(s_logits.float() / T, -1)
    loss = F.kl_div(s_logp, t_logp, log_target=True, reduction="none").sum(-1).mean() * T * T
    if ce_weight:
        loss = loss + ce_weight * F.cross_entropy(s_logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
    return loss


def _kd_chunk(h, t_h, s_w, s_b, t_w, t_b, lab, n_ce, softcap, T: float, N: int, ce_weight: float,
              need_h: bool, need_w: bool, need_b: bool, autocast: bool):
    """One chunk of tokens: (its share of the loss, d loss / d h, its share of d loss / d s_w and
    d loss / d s_b). ``h``, ``t_h``: (chunk, hidden); ``lab``: (chunk,)."""
    # the matmuls run under the caller's autocast like the model's own lm_head; the softmaxes in
    # float32 like the plain loss
    s, dcap = _softcap(F.linear(h, s_w, s_b).float(), softcap)
    t = _softcap(F.linear(t_h, t_w, t_b).float(), softcap)[0]
    s_logp, t_logp = F.log_softmax(s / T, -1), F.log_softmax(t / T, -1)
    t_p = t_logp.exp()
    loss = (t_p * (t_logp - s_logp)).sum() * (T * T / N)
    g_h = g_w = g_b = None
    if not (need_h or need_w or need_b) and not ce_weight:
        return loss, g_h, g_w, g_b
    g = (s_logp.exp_() - t_p).mul_(T / N)  # d loss / d s (in place: eager holds fewer (chunk, vocab) floats)
    del t_p, t_logp
    if ce_weight:
        ok = lab != -100
        logp = F.log_softmax(s, -1)
        picked = logp.gather(1, lab.clamp(min=0)[:, None])[:, 0]
        loss = loss - ce_weight * (picked * ok).sum() / n_ce
        p = logp.exp_()
        p[torch.arange(len(lab), device=p.device), lab.clamp(min=0)] -= 1
        g += p.mul_((ok / n_ce * ce_weight)[:, None])
        del p, logp
    if dcap is not None:
        g *= dcap
    # under autocast the matmuls cast themselves (bf16, like the plain loss's lm_head backward);
    # without it they run in the weight's dtype
    gc = g if autocast else g.to(s_w.dtype)
    if need_h:
        g_h = (gc @ s_w).to(h.dtype)
    if need_w:
        g_w = gc.T @ (h if autocast else h.to(s_w.dtype))
    if need_b:
        g_b = g.sum(0)
    return loss, g_h, g_w, g_b


_kd_chunk_compiled = None


def _chunk_fn(compiled: bool):
    """The chunk function, eager or compiled (static shapes: every chunk but a shorter last one
    has one shape, so two graphs; fullgraph: a graph break would be an error, not a slow loss)."""
    global _kd_chunk_compiled
    if not compiled:
        return _kd_chunk
    if _kd_chunk_compiled is None:
        _kd_chunk_compiled = torch.compile(_kd_chunk, dynamic=False, fullgraph=True)
    return _kd_chunk_compiled


class _ChunkedKD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, s_h, t_h, s_w, s_b, t_w, t_b, labels, softcap, temperature, ce_weight, chunk, want_grad,
                compiled):
        # s_h, t_h: (N, hidden); s_w, t_w: (V, hidden); labels: (N,) next token or -100
        N = s_h.shape[0]
        ctx.dtypes = (s_h.dtype, s_w.dtype, None if s_b is None else s_b.dtype)
        n_ce = (labels != -100).sum().clamp(min=1)
        need_h, need_w = want_grad and ctx.needs_input_grad[0], want_grad and ctx.needs_input_grad[2]
        need_b = want_grad and s_b is not None and ctx.needs_input_grad[3]
        autocast = torch.is_autocast_enabled(s_h.device.type)
        if autocast:
            # the weights cast to the autocast dtype once per call, not once per chunk and matmul
            # (autocast caches no cast of a frozen or detached weight); the same values the casts
            # inside F.linear would give
            dt = torch.get_autocast_dtype(s_h.device.type)
            cast = {}
            s_w, s_b, t_w, t_b = [None if w is None else cast.setdefault(id(w), w.to(dt)) for w in (s_w, s_b, t_w, t_b)]
        fn = _chunk_fn(compiled)
        loss = torch.zeros((), dtype=torch.float32, device=s_h.device)
        g_h = torch.empty_like(s_h) if need_h else None
        g_w = torch.zeros_like(s_w, dtype=torch.float32) if need_w else None
        g_b = torch.zeros_like(s_b, dtype=torch.float32) if need_b else None
        for a in range(0, N, chunk):
            part, gh, gw, gb = fn(s_h[a:a + chunk], t_h[a:a + chunk], s_w, s_b, t_w, t_b, labels[a:a + chunk], n_ce,
                                  softcap, temperature, N, ce_weight, need_h, need_w, need_b, autocast)
            loss += part
            if need_h:
                g_h[a:a + chunk] = gh
            if need_w:
                g_w += gw
            if need_b:
                g_b += gb
        ctx.save_for_backward(g_h, g_w, g_b)
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        g_h, g_w, g_b = ctx.saved_tensors
        scaled = [None if g is None else (g * grad_out).to(dt) for g, dt in zip((g_h, g_w, g_b), ctx.dtypes)]
        return scaled[0], None, scaled[1], scaled[2], *[None] * 9


def kd_loss_chunked(s_hidden, t_hidden, s_head: LogitHead, t_head: LogitHead, labels, temperature: float,
                    ce_weight: float, chunk: int, compiled: bool = False) -> torch.Tensor:
    """Same value and gradient as ``kd_loss_plain(s_head(s_hidden), t_head(t_hidden), ...)``.

    ``s_hidden``, ``t_hidden``: ``(B, T, hidden)`` final hidden states (after the final norm);
    ``labels``: ``(B, T)``; ``chunk``: tokens per chunk; ``compiled``: each chunk runs as one
    torch.compile graph (a few fused kernels) instead of ~25 eager ops over ``(chunk, vocab)``
    floats, each a full pass over memory.
    """
    s_w, s_b = s_head.linear.weight, s_head.linear.bias
    t_w, t_b = t_head.linear.weight.detach(), None if t_head.linear.bias is None else t_head.linear.bias.detach()
    want = torch.is_grad_enabled()
    loss = _ChunkedKD.apply(s_hidden.flatten(0, 1), t_hidden.flatten(0, 1).detach(), s_w, s_b, t_w, t_b,
                            labels.flatten(), s_head.softcap, temperature, ce_weight, chunk, want, compiled)
    return loss
