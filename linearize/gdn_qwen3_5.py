"""Gated DeltaNet in the exact form of transformers' Qwen3.5 text model (``GatedDeltaNetConfig(layout="qwen3_5")``).

transformers' ``Qwen3_5GatedDeltaNet`` computes, per token and head (key heads = value heads here):

    q | k | v = silu(causal_depthwise_conv(in_proj_qkv x))          # one conv over all three
    q, k     = l2norm(q), l2norm(k);  q = q / sqrt(head_dim)          # no RoPE
    g        = -exp(A_log) * softplus(in_proj_a x + dt_bias);  beta = sigmoid(in_proj_b x)
    o        = delta rule (S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,  o_t = q_t S_t)
    out      = out_proj(RMSNorm(o) * norm.weight * silu(in_proj_z x))  # per head

This layer computes exactly that, built from a pretrained attention module: q/k/v/o projections are
the original modules (by reference, as in ``linearize.gdn``), so ``in_proj_qkv`` is written at export
time as ``[W_q; W_k; W_v]`` with each key/value head repeated for the query heads it served (Qwen3.5
needs as many key heads as query heads and at most as many as value heads). Differences from the
original attention that Qwen3.5 cannot hold, and that distillation heals:

- q/k/v biases (Qwen2) are not applied: ``in_proj_qkv`` has none.
- q/k norms (Qwen3: an RMSNorm per head before RoPE) keep only their weight, folded into the
  projection rows: the RMS division is per token and the conv mixes tokens, so it has no place in
  Qwen3.5's layer (the L2 norm after the conv removes most of what it did).

Unlike linearize's default layout this layer cannot start as a pass-through (the gated RMSNorm and
the SiLUs are always on); it starts as close as its form allows: the conv is ``CONV_INIT`` times the
identity, so the SiLU works near its linear part (silu(x) ~ x / 2) and the scale cancels in the L2
norms of q, k and in the output RMSNorm; ``in_proj_z`` starts at zero, so the layer's output starts
at zero (the block starts as its MLP alone, never as noise) and the gate opens in the first step
(silu'(0) = 1/2).

The recurrence runs on the same kernels as ``linearize.gdn`` (chunk kernel for training and prefill,
recurrent kernel for decode, the PyTorch reference on the CPU), with the same cache, padding and
packing handling.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

from .arch import ArchSpec
from .gdn import _kernel_delta_rule, _use_kernels, delta_rule
from .attention import reset_log_decay
from .layers import ConvertedAttention, _state_layer, layer_validity, packed_starts

# conv taps start as CONV_INIT * identity: silu(0.05 x) is within ~2.5% of 0.025 x for |x| < 1 and
# within 25% up to |x| = 20 (outlier key channels), so q, k and v keep the pretrained directions
CONV_INIT = 0.05


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """Qwen3.5's (and fla's) L2 norm, ``x / sqrt(|x|^2 + 1e-6)``: not F.normalize's max(|x|, eps),
    which differs where the conv makes q or k small."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


class Qwen35GatedDeltaNet(ConvertedAttention):
    """transformers' ``Qwen3_5GatedDeltaNet`` built from a pretrained attention module (see the module
    docstring); ``qwen3_5_state_dict`` gives its weights under transformers' names. Input (B, T, hidden)."""

    def __init__(self, attn: nn.Module, config, spec: ArchSpec, layer_idx: int):
        super().__init__()
        mcfg = attn.config
        self._adopt(attn, spec, layer_idx)
        self.use_rope = False  # Qwen3.5's linear layers have none
        self.conv_size = config.conv_size
        H, Hkv, D, hidden = self.num_heads, self.num_kv_heads, self.head_dim, mcfg.hidden_size
        weight = getattr(attn, spec.projections[0]).weight
        # Qwen3.5 reads this one epsilon for every RMSNorm, the gated one included
        self.norm_eps = float(getattr(mcfg, "rms_norm_eps", 1e-6))

        channels = (H + 2 * Hkv) * D  # q | k | v before the key/value heads are repeated
        self.conv1d = nn.Conv1d(channels, channels, self.conv_size, groups=channels, bias=False)
        with torch.no_grad():
            self.conv1d.weight.zero_()
            self.conv1d.weight[:, 0, -1] = CONV_INIT
        self.in_proj_z = nn.Linear(hidden, H * D, bias=False)
        nn.init.zeros_(self.in_proj_z.weight)
        self.in_proj_b = nn.Linear(hidden, H, bias=False)  # beta = sigmoid(.) starts near 1/2
        nn.init.normal_(self.in_proj_b.weight, std=1e-3)
        self.in_proj_a = nn.Linear(hidden, H, bias=False)
        nn.init.normal_(self.in_proj_a.weight, std=1e-3)
        # decay -exp(A_log) * softplus(a + dt_bias): A = 1, dt in [dt_min, dt_max] -> slow decay (as linearize.gdn)
        self.A_log = nn.Parameter(torch.zeros(H))
        dt = torch.exp(torch.linspace(math.log(config.dt_min), math.log(config.dt_max), H))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        self.norm = _GatedNorm(D, self.norm_eps)
        self.to(device=weight.device, dtype=weight.dtype)

    # ------------------------------------------------------------------ what the projections give

    def _qk_scales(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The per-channel weights of the original q/k norms (None without norms), as flat (H*D,) and
        (Hkv*D,) vectors: the norm applied to ones, times sqrt(1 + eps) to undo its RMS division.
        Read from the modules themselves, so each family's convention (w, 1 + w, per head or flat)
        is the one its norm class implements."""
        if self.spec.qk_norm is None:
            return None, None
        out = []
        for name, heads in (("q_norm", self.num_heads), ("k_norm", self.num_kv_heads)):
            norm = getattr(self, name)
            w = norm.weight
            width = w.shape[-1]
            eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
            scale = norm(torch.ones(1, width, device=w.device, dtype=torch.float32).to(w.dtype)).float()
            scale = (scale * math.sqrt(1.0 + eps)).flatten()
            out.append(scale.repeat(heads * self.head_dim // width))  # a per-head norm: the same for every head
        return out[0], out[1]

    def decode_projection_names(self) -> tuple[str, ...]:
        # without gradients one GEMM computes all six (ConvertedAttention.fused_projections): a decode
        # step runs one projection launch instead of six
        return (*self.spec.qkv, "in_proj_z", "in_proj_b", "in_proj_a")

    def _qkv_no_bias(self, hidden_states, pre=None):
        """q (B, T, H*D), k and v (B, T, Hkv*D) as Qwen3.5's bias-free ``in_proj_qkv`` gives them.
        ``pre``: the projections' outputs by name, already computed (``fused_projections``)."""
        q, k, v = self._qkv_raw(hidden_states, pre)
        q_scale, k_scale = self._qk_scales()
        if q_scale is not None:
            q, k = q * q_scale.to(q.dtype), k * k_scale.to(k.dtype)
        return q, k, v

    def _qkv_raw(self, hidden_states, pre=None):
        """The original projections without their biases (LoRA adapters included: peft's layers
        expose the base layer's bias)."""
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        run = (lambda n: _unbiased_output(getattr(self, n), pre[n])) if pre is not None else (  # noqa: E731
            lambda n: _unbiased(getattr(self, n), hidden_states))
        if self.spec.fused_qkv is None:
            q, k, v = (run(n) for n in ("q_proj", "k_proj", "v_proj"))
        else:
            qkv = run(self.spec.fused_qkv)
            if self.spec.qkv_layout == "per_head":
                q, k, v = (x.flatten(-2) for x in qkv.unflatten(-1, (H, 3 * D)).chunk(3, dim=-1))
            else:
                q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
        return q, k, v

    def _qkv_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """W_q (H*D, hidden), W_k and W_v (Hkv*D, hidden) of the original projections (plain nn.Linear:
        linearize.export refuses unmerged LoRA adapters first)."""
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if self.spec.fused_qkv is None:
            return tuple(getattr(self, n).weight for n in ("q_proj", "k_proj", "v_proj"))
        w = getattr(self, self.spec.fused_qkv).weight
        if self.spec.qkv_layout == "per_head":
            return tuple(x.flatten(0, 1) for x in w.unflatten(0, (H, 3 * D)).chunk(3, dim=1))
        return tuple(w.split([H * D, Hkv * D, Hkv * D], dim=0))

    # ------------------------------------------------------------------ forward

    def _linear_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs):
        return self._gdn_forward(hidden_states, attention_mask, past_key_values, kwargs.get("position_ids"), kwargs), None

    def _gdn_forward(self, hidden_states, attention_mask, past_key_values, position_ids=None, kwargs=None):
        B, T, _ = hidden_states.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        state_layer = _state_layer(past_key_values, self.layer_idx)
        valid = layer_validity(attention_mask, B, T, state_layer, kwargs)
        # packed documents (static shapes): each gets its own state (a decay of 0 at its start) and conv
        # history (taps that reach into the previous document masked)
        packed = packed_starts(state_layer, valid, position_ids, B, T, kwargs)

        pre = self.fused_projections(hidden_states)  # None with gradients on or LoRA adapters
        proj = (lambda n: pre[n]) if pre is not None else (lambda n: getattr(self, n)(hidden_states))  # noqa: E731
        x = torch.cat(self._qkv_no_bias(hidden_states, pre), dim=-1)  # (B, T, C)
        if valid is not None:  # a pad token's conv input is zero, as Qwen3.5 zeroes pad hidden states
            x = x * valid[..., None].to(x.dtype)
        x = x.transpose(1, 2)  # (B, C, T)
        had_past = state_layer is not None and state_layer.has_previous_state[0]
        if state_layer is not None:  # the last conv_size inputs, returned with the new ones
            full = state_layer.update_conv_state(x, state_idx=0, conv_kernel_size=self.conv_size)
        x = full if had_past else F.pad(x, (self.conv_size - 1, 0))
        if packed is None:
            x = F.conv1d(x, self.conv1d.weight, groups=x.shape[1])[..., -T:]
        else:  # tap i reads the token C - 1 - i back, kept only inside its document
            C, w = self.conv_size, self.conv1d.weight[:, 0, :]
            x = sum(x[..., i: x.shape[-1] - C + 1 + i] * w[:, i: i + 1]
                    * (packed.offset >= C - 1 - i)[:, None, :].to(x.dtype) for i in range(C))[..., -T:]
        x = F.silu(x).transpose(1, 2)
        q, k, v = x.split([H * D, Hkv * D, Hkv * D], dim=-1)
        q, k, v = q.reshape(B, T, H, D), k.reshape(B, T, Hkv, D), v.reshape(B, T, Hkv, D)
        rep = H // Hkv
        if rep > 1:  # key heads = value heads = query heads (Qwen3.5's in_proj_qkv repeats them)
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        q = _l2norm(q.float()) * D ** -0.5  # Qwen3.5 scales q by 1/sqrt(head_dim) after the L2 norm
        k = _l2norm(k.float())
        g = -torch.exp(self.A_log.float()) * F.softplus(proj("in_proj_a").float() + self.dt_bias.float())
        beta = torch.sigmoid(proj("in_proj_b").float())
        if valid is not None:  # a pad token writes nothing and does not decay the state
            g, beta = g * valid[..., None], beta * valid[..., None]
        stored = state_layer.read() if state_layer is not None else None
        init = stored["S"] if stored is not None else None
        q = q.view(B, T, H, 1, D)
        if _use_kernels(q, 1):
            if packed is not None:  # the state decays to 0 at a document restart
                g = reset_log_decay(packed.restart, g, g.shape)
            o, S = _kernel_delta_rule(q, k, v, g, beta, init, activation_dtype=self.out_proj.weight.dtype,
                                      state_in_place=getattr(state_layer, "updates_in_place", False))
        else:
            o, S = delta_rule(q, k, v, g, beta, init, restart=None if packed is None else packed.restart)
        if state_layer is not None:
            state_layer.write(T, S=S.float())
        o = o.reshape(B, T, H, D).to(hidden_states.dtype)
        z = proj("in_proj_z").reshape(B, T, H, D)
        o = self.norm(o, z)
        return self.out_proj(o.reshape(B, T, H * D))

    # ------------------------------------------------------------------ export

    def qwen3_5_state_dict(self) -> dict[str, torch.Tensor]:
        """This layer's weights under the names of transformers' ``Qwen3_5GatedDeltaNet`` (relative to
        ``linear_attn``): key/value heads repeated for the query heads, the q/k norm weights folded
        into ``in_proj_qkv``'s rows, the conv's k/v channels repeated alike."""
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        rep = H // Hkv
        with torch.no_grad():
            wq, wk, wv = self._qkv_weights()  # (out, hidden) each
            q_scale, k_scale = self._qk_scales()
            if q_scale is not None:  # the norm weights, per output row
                wq, wk = wq * q_scale[:, None].to(wq.dtype), wk * k_scale[:, None].to(wk.dtype)

            def heads(w):  # (Hkv*D, ...) -> (H*D, ...): each head repeated for its query group
                return w.unflatten(0, (Hkv, D)).repeat_interleave(rep, dim=0).flatten(0, 1)

            conv = self.conv1d.weight
            cq, ck, cv = conv.split([H * D, Hkv * D, Hkv * D], dim=0)
            out = {
                "in_proj_qkv.weight": torch.cat([wq, heads(wk), heads(wv)]),
                "in_proj_z.weight": self.in_proj_z.weight,
                "in_proj_b.weight": self.in_proj_b.weight,
                "in_proj_a.weight": self.in_proj_a.weight,
                "conv1d.weight": torch.cat([cq, heads(ck), heads(cv)]),
                "A_log": self.A_log,
                "dt_bias": self.dt_bias,
                "norm.weight": self.norm.weight,
                "out_proj.weight": self.out_proj.weight,
            }
        return {name: t.detach().clone().contiguous() for name, t in out.items()}


class _GatedNorm(nn.Module):
    """Qwen3.5's ``Qwen3_5RMSNormGated``: ``weight * RMSNorm(o) * silu(z)`` per head, the norm in fp32,
    the weight applied in the input dtype (its order of casts, so bf16 rounds as it does there)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = o.dtype
        x = o.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = self.weight * x.to(dtype)
        return (x * F.silu(z.float())).to(dtype)


def _unbiased_output(module: nn.Module, y: torch.Tensor) -> torch.Tensor:
    """A projection's output computed elsewhere (the fused GEMM, bias included) without the bias."""
    bias = getattr(module, "bias", None)
    return y if bias is None else y - bias


def _unbiased(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` without the module's bias (Qwen3.5's ``in_proj_qkv`` has none): a plain nn.Linear
    skips it, a LoRA-wrapped one subtracts it."""
    if type(module) is nn.Linear:
        return F.linear(x, module.weight)
    return _unbiased_output(module, module(x))


class Qwen35Attention(ConvertedAttention):
    """A softmax layer kept beside ``layout="qwen3_5"`` Gated DeltaNet layers, in Qwen3.5's attention
    form: the original attention (its projections by reference, its RoPE, scale, cache and attention
    implementation) plus the per-head q/k RMSNorms that Qwen3.5 always applies before RoPE, which a
    Llama-style source lacks. They start at unit weight (Qwen3.5's ``x / rms(x) * (1 + w)``, w = 0):
    the one place the converted model starts away from the original in a kept layer, and what
    attention transfer then trains (``transfer`` mode compares this layer with the original, like
    any converted layer). So the converted model and its export compute the same thing. Qwen3.5's
    output gate is the identity and is not modelled (export writes it as zero weights with o_proj * 2).

    It is not in ``config.linearize["layers"]``: the cache gives it a KV layer, and ``softmax`` mode
    (the teacher) runs the original without the norms.
    """

    keeps_softmax = True  # a softmax layer in a converted layer's clothes: not a candidate for restore_softmax

    def __init__(self, attn: nn.Module, config, spec: ArchSpec, layer_idx: int):
        super().__init__()
        self._adopt(attn, spec, layer_idx)
        eps = float(getattr(attn.config, "rms_norm_eps", 1e-6))
        self.q_norm, self.k_norm = _UnitRMSNorm(self.head_dim, eps), _UnitRMSNorm(self.head_dim, eps)
        weight = getattr(attn, spec.projections[0]).weight
        self.to(device=weight.device, dtype=weight.dtype)

    def _linear_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        attn = self._original
        B, T, _ = hidden_states.shape
        q, k, v = self._qkv(hidden_states)  # biases applied: Qwen3.5's attention has them (attention_bias)
        q = self.q_norm(q.view(B, T, -1, self.head_dim)).transpose(1, 2)  # (B, H, T, D)
        k = self.k_norm(k.view(B, T, -1, self.head_dim)).transpose(1, 2)
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)
        if self.use_rope and position_embeddings is not None:
            q, k = self._rope(q, k, *position_embeddings)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx, kwargs)
        eager = sys.modules[type(attn).__module__].eager_attention_forward  # the original's own eager path
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager)
        window = getattr(attn, "sliding_window", None)
        extra = {"sliding_window": window} if window else {}
        out, weights = interface(attn, q, k, v, attention_mask, dropout=0.0 if not self.training else
                                 getattr(attn, "attention_dropout", 0.0), scaling=attn.scaling, **extra, **kwargs)
        return self.out_proj(out.reshape(B, T, -1).contiguous()), weights


class _UnitRMSNorm(nn.Module):
    """Qwen3.5's RMSNorm, ``x / rms(x) * (1 + w)`` in fp32 with w starting at zero."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


def softmax_layer_for(attn: nn.Module, method_config, spec: ArchSpec, layer_idx: int) -> nn.Module:
    """What a kept softmax layer of a model converted with ``method_config`` is: the original module,
    or, beside Qwen3.5-layout layers in a family that exports to Qwen3.5 and lacks per-head q/k norms,
    ``Qwen35Attention``. Qwen3 already normalises q and k per head as Qwen3.5 does; a family export
    refuses (``ArchSpec.qwen3_5``: Gemma's softcapping, ...) keeps what its original layer does."""
    if getattr(method_config, "layout", None) != "qwen3_5" or spec.qk_norm is not None or spec.qwen3_5:
        return attn
    return Qwen35Attention(attn, method_config, spec, layer_idx)
