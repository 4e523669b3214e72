"""Gated DeltaNet layers built from a pretrained attention module.

Per key head, with the state S of shape (K, V), L2-normalised q and k, alpha_t = exp(g_t):

    S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T        o_t = q_t S_t

The delta rule overwrites what a key already stored (instead of adding to it) and the gate
forgets on purpose, which is why it holds up over long contexts where a plain sum of features
does not. New parameters: a Mamba2-style decay ``g = -exp(A_log) * softplus(x W_a + dt_bias)``
initialised for slow decay, a write strength ``beta = sigmoid(x W_b + b_b)``, an optional short
causal depthwise convolution on q/k/v initialised as the identity, and a gated RMSNorm on the
output, ``(o + lambda (w RMSNorm(o) - o)) * 2 sigmoid(x W_o)``, that starts as a pass-through
(lambda = 0 per head, W_o = 0) and learns how much normalisation and gating to apply.

GQA: ``kv_heads="expand"`` repeats key/value heads to the query heads (a state per query head);
``"group"`` keeps one state per key head shared by its group of queries (smaller cache).
Padding: a pad token has beta = 0 and g = 0 (it writes nothing and does not decay the state) and
its conv input is zero.

With a window W (``GatedDeltaNetConfig.window``), the layer adds softmax attention over the newest W
keys (and each document's first ``sinks``), computed from the original q, k, v and RoPE before the
short conv, and weighs the Gated DeltaNet's output per head by ``gamma``, which starts at 0:

    o_t = softmax-window_t(q, k, v) + gamma_h * gdn_t

so the converted layer starts as exact sliding-window attention and the state learns what the
window cannot see. The cache keeps the newest W-1 keys and values, time-ordered, beside the state.
The Gated DeltaNet part takes the same paths as without a window (the fused decode and prefill kernels
included); the window's softmax runs on the window kernel (``kernels/linear_attn/window.py``) for a
call without earlier tokens (padding at most on the left) and for a longer call after earlier tokens
without padding (a chunk of a chunked prefill, a later turn: the cached keys in front of the call's,
``window_softmax_prefill``), and for a one-token decode step on the window's decode kernel
(``window_softmax_decode``: RoPE, the softmax over the cached keys, the token and the sinks, the
Gated DeltaNet's output added with its gamma, the cache's window moved on, in one launch beside the
fused decode kernel); else (logit soft-capping in a prefill, padding after earlier tokens, gradients
through a cache, q/k norms) in PyTorch.

Decode steps on the kernels (a stored state, at most ``DECODE_TOKENS`` tokens, no gradients) run
the input projections as one GEMM, then everything up to the output projection as one op
(``kernels/gated_delta/decode.py``: conv cache, RoPE, L2 norms, gates, padding, state, output norm
and gate; a kernel per state head, then one that shifts the conv cache); prefill, training, the
CPU and layers with q/k norms take the step-by-step path below.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .arch import ArchSpec
from .attention import (DECODE_TOKENS, _doc_start, _needs_grad, _warn_once, kernel_dtype, linear_attention, project,
                        project_with, reset_log_decay, use_kernels)
from .layers import (ConvertedAttention, _state_layer, identity_conv, layer_validity, packed_starts, short_conv, sink_reads,
                     sinks_after)

try:  # optional: remote-code checkpoints run without the kernels (the PyTorch reference below)
    from linearize.kernels.gated_delta.chunk import chunk_gated_delta_rule
    from linearize.kernels.gated_delta.decode import MAX_HEAD_DIM, fused_gated_delta_decode, gated_delta_decode_columns
    from linearize.kernels.gated_delta.prefill import gdn_prefill_epilogue, gdn_prefill_prologue
    from linearize.kernels.gated_delta.recurrent import fused_recurrent_gated_delta_rule
    from linearize.kernels.linear_attn.window import window_softmax_attn
    from linearize.kernels.linear_attn.window_decode import window_softmax_decode, window_softmax_prefill
except Exception:
    chunk_gated_delta_rule = fused_recurrent_gated_delta_rule = fused_gated_delta_decode = None
    gdn_prefill_prologue = gdn_prefill_epilogue = window_softmax_attn = window_softmax_prefill = None
    window_softmax_decode = None
    MAX_HEAD_DIM = 0


def delta_rule(q, k, v, g, beta, initial_state=None, restart=None):
    """Readable reference: one token at a time.

    q: (B, T, Hk, R, K) (R queries share each key head's state), k: (B, T, Hk, K), v: (B, T, Hk, V),
    g, beta: (B, T, Hk); ``restart``: (B, T) bool, packed documents: the state is zeroed before the
    token (``PackedDocs.restart``). Returns o (B, T, Hk, R, V) and the final state (B, Hk, K, V), float32+.
    """
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    B, T, Hk, R, K = q.shape
    S = q.new_zeros(B, Hk, K, v.shape[-1]) if initial_state is None else initial_state.to(dt)
    outs = []
    for t in range(T):
        S = S * torch.exp(g[:, t])[..., None, None]
        if restart is not None:
            S = S * (~restart[:, t]).to(dt)[:, None, None, None]
        kt = k[:, t]  # (B, Hk, K)
        pred = torch.einsum("bhk,bhkv->bhv", kt, S)  # what the state already returns for k_t
        S = S + torch.einsum("bhk,bhv->bhkv", kt, beta[:, t, :, None] * (v[:, t] - pred))
        outs.append(torch.einsum("bhrk,bhkv->bhrv", q[:, t], S))
    return torch.stack(outs, dim=1), S


def _kernel_delta_rule(q, k, v, g, beta, initial_state, activation_dtype=torch.float32, state_in_place=False):
    """The Triton chunk kernel (expanded heads only: R == 1), fed the dtype ``kernel_dtype`` picks."""
    dt = kernel_dtype(q, activation_dtype)
    q, k, v = (x.to(dt) for x in (q, k, v))
    if initial_state is not None and q.shape[1] <= DECODE_TOKENS and not _needs_grad(q, k, v, g, beta):
        # decode: the fused recurrent step, on a copy of the state (it updates what it is given)
        S = initial_state
        if not (state_in_place and S.dtype == torch.float32 and S.is_contiguous()):  # else advance a copy
            S = initial_state.float().clone(memory_format=torch.contiguous_format)
        o = fused_recurrent_gated_delta_rule(q[:, :, :, 0], k, v, g=g.float(), beta=beta.float(), scale=1.0, state=S)
        return o[:, :, :, None], S
    init = None if initial_state is None else initial_state.float().contiguous()
    o, S = chunk_gated_delta_rule(q[:, :, :, 0].contiguous(), k.contiguous(), v.contiguous(), g=g.float().contiguous(),
                                  beta=beta.float().contiguous(), scale=1.0, initial_state=init, output_final_state=True)
    return o[:, :, :, None], S


def _use_kernels(x, R) -> bool:
    if not use_kernels(x):
        return False
    if chunk_gated_delta_rule is None:
        raise RuntimeError("linearize.kernels.gated_delta cannot be imported; set LINEARIZE_KERNELS=torch to run "
                           "the PyTorch math on purpose")
    if R != 1:  # one state per key head shared by R queries (kv_heads="group") has no kernel yet
        if x.is_cuda:
            _warn_once("Gated DeltaNet with kv_heads='group' runs the PyTorch math (no Triton kernel for shared "
                       "states yet): convert with kv_heads='expand' for the kernels")
        return False
    return True


class GatedDeltaNet(ConvertedAttention):

    def __init__(self, attn: nn.Module, config, spec: ArchSpec, layer_idx: int):
        super().__init__()
        mcfg = attn.config
        self._adopt(attn, spec, layer_idx)
        self.window_rope = self.use_rope  # the softmax window applies RoPE as the original layer does
        # RoPE where both the method config and the original layer (not a NoPE layer) want it
        self.kv_heads, self.use_rope, self.conv_size = config.kv_heads, config.use_rope and self.use_rope, config.conv_size

        weight = getattr(attn, spec.projections[0]).weight
        self.state_heads = self.num_heads if self.kv_heads == "expand" else self.num_kv_heads
        Hs, hidden = self.state_heads, mcfg.hidden_size
        # decay: g = -exp(A_log) * softplus(x W_a + dt_bias); A = 1, dt in [dt_min, dt_max] (1e-3, 1e-2) -> slow decay
        self.a_proj = nn.Linear(hidden, Hs, bias=False)
        nn.init.normal_(self.a_proj.weight, std=1e-3)
        self.A_log = nn.Parameter(torch.zeros(Hs))
        dt = torch.exp(torch.linspace(math.log(config.dt_min), math.log(config.dt_max), Hs))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        # write strength
        self.b_proj = nn.Linear(hidden, Hs, bias=True)
        nn.init.normal_(self.b_proj.weight, std=1e-3)
        nn.init.zeros_(self.b_proj.bias)
        if self.conv_size:
            D, Hkv = self.head_dim, self.num_kv_heads
            channels = (self.num_heads + 2 * Hkv) * D
            self.conv = identity_conv(channels, self.conv_size)
        self.o_norm_weight = nn.Parameter(torch.ones(self.head_dim))
        self.o_norm_mix = nn.Parameter(torch.zeros(self.num_heads))
        self.o_gate = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        nn.init.zeros_(self.o_gate.weight)  # 2 * sigmoid(0) = 1
        self.window, self.sinks = config.window, config.sinks
        if self.window:
            if self.local_window and self.window > self.local_window:
                raise ValueError(f"window {self.window} is wider than layer {layer_idx}'s own sliding window "
                                 f"({self.local_window}): pass window <= {self.local_window}")
            self.scaling = attn.scaling  # the original's softmax scale
            self.softcap = getattr(attn, spec.softcap, None) if spec.softcap else None  # gemma2's logit soft-capping
            # the Gated DeltaNet's weight per head beside the window: 0, so the layer starts as the window alone
            self.window_gamma = nn.Parameter(torch.zeros(self.num_heads))
        self.to(device=weight.device, dtype=weight.dtype)

    def decode_projection_names(self) -> tuple[str, ...]:
        qkv = (self.spec.fused_qkv,) if self.spec.fused_qkv else ("q_proj", "k_proj", "v_proj")
        return (*qkv, "a_proj", "b_proj", "o_gate")

    def _project(self, hidden_states, pre=None):
        return self._qkv(hidden_states, pre)

    def _linear_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs):
        return self._gdn_forward(hidden_states, position_embeddings, attention_mask, past_key_values, kwargs.get("position_ids"),
                                 kwargs)

    def _gdn_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, position_ids=None,
                     kwargs=None):

        B, T, _ = hidden_states.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        state_layer = _state_layer(past_key_values, self.layer_idx)
        valid = layer_validity(attention_mask, B, T, state_layer, kwargs)
        # packed documents: each gets its own state (reset at its start) and conv history (taps masked)
        packed = packed_starts(state_layer, valid, position_ids, B, T, kwargs)
        decoding = state_layer is not None and state_layer.has_previous_state[0]
        if decoding and self._fused_decode(hidden_states, position_embeddings, state_layer):
            return self._decode_step(hidden_states, position_embeddings, valid, state_layer), None
        pre = self.fused_projections(hidden_states)
        if pre is not None and packed is None and self._fused_prefill(hidden_states, position_embeddings, state_layer):
            return self._prefill_step(hidden_states, pre, position_embeddings, valid, state_layer), None
        q, k, v = self._project(hidden_states, pre)
        window_state = {}
        if self.window:  # before the conv update below: the cache's window tensors as the last call left them
            o_window, window_state = self._window_attention(q, k, v, position_embeddings, valid, packed, state_layer)
        if self.conv_size:
            if pre is not None and self.spec.qkv_layout != "per_head" and self.spec.qk_norm != "flat":
                x = pre["*"][..., : (H + 2 * Hkv) * D]  # the fused GEMM's q | k | v columns: no cat
            else:
                x = torch.cat([q, k, v], dim=-1)  # (B, T, C)
            x = short_conv(self.conv, x, valid, packed, state_layer)
            q, k, v = x.split([H * D, Hkv * D, Hkv * D], dim=-1)
        q, k, v = q.reshape(B, T, H, D), k.reshape(B, T, Hkv, D), v.reshape(B, T, Hkv, D)
        if self.spec.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._apply_rope(q, k, position_embeddings)
        q, k = F.normalize(q.float(), dim=-1, eps=1e-6), F.normalize(k.float(), dim=-1, eps=1e-6)
        # v stays in its dtype: both paths cast it to what they compute in (no fp32 round trip on the GPU)
        rep = H // Hkv
        if self.kv_heads == "expand" and rep > 1:
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        Hs = self.state_heads
        q = q.view(B, T, Hs, H // Hs, D)
        proj = (lambda n: pre[n]) if pre is not None else (lambda n: getattr(self, n)(hidden_states))  # noqa: E731
        neg_A, dt_bias, norm_w, mix = self._float_params()
        # a half-precision projection + an fp32 bias adds in fp32 (type promotion): no cast launch
        g = neg_A * F.softplus(proj("a_proj") + dt_bias)
        beta = torch.sigmoid(proj("b_proj").float())
        if valid is not None:  # a pad token writes nothing and does not decay the state
            g = g * valid[..., None]
            beta = beta * valid[..., None]
        stored = state_layer.read() if state_layer is not None else None
        init = stored["S"] if stored is not None else None  # None too right after the first conv update
        if _use_kernels(q, H // Hs):
            if packed is not None:  # the state decays to 0 at a document restart
                g = reset_log_decay(packed.restart, g, g.shape)
            o, S = _kernel_delta_rule(q, k, v, g, beta, init, activation_dtype=self.out_proj.weight.dtype,
                                      state_in_place=getattr(state_layer, "updates_in_place", False))
        else:
            o, S = delta_rule(q, k, v, g, beta, init, restart=None if packed is None else packed.restart)
        o = o.float()
        if state_layer is not None:
            state_layer.write(T, S=S.float(), **window_state)
        o = o.reshape(B, T, H, D)
        # o + mix * (RMSNorm(o) w - o): one fused norm kernel on the GPU and one lerp, not ten elementwise ops
        normed = F.rms_norm(o, (D,), norm_w, eps=1e-6)
        o = torch.lerp(o, normed, mix)
        o = o * 2 * torch.sigmoid(proj("o_gate").float()).view(B, T, H, D)
        return self._output(o, o_window if self.window else None, hidden_states), None

    def _output(self, o, o_window, hidden_states):
        """The output projection of the Gated DeltaNet's gated output o (B, T, H*D or H, D), beside a
        window: of ``o_window + gamma_h * o``."""
        B, T = hidden_states.shape[:2]
        if o_window is not None:
            o = o_window.float() + self.window_gamma.float()[:, None] * o.reshape(B, T, self.num_heads, self.head_dim).float()
        return project_with(self.out_proj, o.reshape(B, T, -1).to(hidden_states.dtype))

    def _window_attention(self, q, k, v, position_embeddings, valid, packed, state_layer):
        """The softmax window over the original flat q (B, T, H*D), k and v (B, T, Hkv*D), with the
        original's q/k norms and RoPE: o (B, T, H, D) in v's dtype, and the cache's new window
        tensors (empty without a cache)."""
        B, T = q.shape[:2]
        H, Hkv, D, W = self.num_heads, self.num_kv_heads, self.head_dim, self.window
        q, k, v = q.reshape(B, T, H, D), k.reshape(B, T, Hkv, D), v.reshape(B, T, Hkv, D)
        if self.spec.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.window_rope and position_embeddings is not None:
            cos, sin = position_embeddings
            q, k = (x.transpose(1, 2) for x in self._rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin))
        if H != Hkv:  # head h reads kv head h // rep, as the original's repeat_kv
            k, v = k.repeat_interleave(H // Hkv, dim=2), v.repeat_interleave(H // Hkv, dim=2)
        stored = state_layer.read() if state_layer is not None else None
        cur_valid = None  # with a cache: which of this call's tokens the stored window and sinks count
        if state_layer is not None:
            cur_valid = torch.ones(B, T, device=k.device) if valid is None else valid.float()
        sinks = {}  # with a cache: the sink slots once this call's tokens are seen
        if self.sinks and state_layer is not None:
            sinks = sinks_after(self.sinks, stored, k, v, cur_valid, state_layer.get_seq_length())
        if (stored is None and self.softcap is None and window_softmax_attn is not None and use_kernels(q)
                and (valid is None or bool((valid[:, 1:] >= valid[:, :-1]).all()))):  # left padding at most
            o = self._window_kernel(q, k, v, packed, valid)
        elif (stored is not None and T > 1 and valid is None and self.softcap is None
              and window_softmax_prefill is not None and use_kernels(q) and not _needs_grad(q, k, v)):
            # a later chunk or turn: the cached keys in front of the call's, on the window kernel
            o = window_softmax_prefill(q.to(kernel_dtype(q, v.dtype)), k, v, buf=stored, sm_scale=self.scaling,
                                       sinks=sinks or None, pos=state_layer.get_seq_length())
        else:
            o = self._window_math(q, k, v, valid, packed, stored, sinks, state_layer)
        if valid is not None:  # a pad token's window reads nothing: 0 on every path (its keys are never read)
            o = o * valid[:, :, None, None].to(o.dtype)
        if state_layer is None:
            return o, {}
        # the newest W-1 keys and values, time-ordered (empty slots in front: zeros, not valid)
        if stored is None:
            W1 = W - 1
            stored = {"k": k.new_zeros(B, W1, H, D), "v": v.new_zeros(B, W1, H, v.shape[-1]),
                      "valid": cur_valid.new_zeros(B, W1)}
        new = {n: torch.cat([stored[n].to(x.dtype), x], dim=1)[:, x.shape[1]:]
               for n, x in (("k", k), ("v", v), ("valid", cur_valid))}
        return o, {**new, **sinks}

    def _window_kernel(self, q, k, v, packed, valid):
        """The window's softmax on the window kernel, no linear terms: every token of every row, each
        query inside its own document (``packed``). Left padding (``valid`` (B, T), real tokens after
        the pad) is a document that starts at the row's first real token; a pad token reads itself
        alone, so its output stays finite (and unread)."""
        B, T, H, D = q.shape
        dt = kernel_dtype(q, v.dtype)
        flat = lambda x: x.reshape(B * T, H, x.shape[-1]).to(dt)  # noqa: E731
        cu = torch.arange(0, B * T + 1, T, device=q.device, dtype=torch.int32)
        none = torch.full((B * T,), -1, device=q.device, dtype=torch.int32)  # no token has linear terms
        q_lo = None if packed is None else _doc_start(packed.doc).reshape(-1)
        if valid is not None:  # (packed rows come without padding)
            idx = torch.arange(T, device=q.device).expand(B, T)
            first = (T - valid.sum(1, keepdim=True)).long()  # the row's first real token
            q_lo = torch.where(valid.bool(), first, idx).to(torch.int32).reshape(-1)
        o = window_softmax_attn(flat(q), flat(k), flat(v), None, None, torch.zeros(H, device=q.device), none, cu,
                                window=self.window, sm_scale=self.scaling, max_len=T, q_lo=q_lo, sinks=self.sinks)
        return o.view(B, T, H, -1).to(v.dtype)

    def _window_math(self, q, k, v, valid, packed, stored, sinks, state_layer):
        """The window's softmax in PyTorch (``linear_attention``'s window part, its linear part weighed 0
        on one zero feature): padding, packed documents, and a call after earlier tokens, whose
        W-1 newest keys come from the cache in front of the call's (``prefix``)."""
        B, T, H, D = q.shape
        zeros = lambda n: q.new_zeros(B, n, H, 1, dtype=torch.float32)  # noqa: E731
        doc = None if packed is None else packed.doc
        if stored is None:
            o, _ = linear_attention(zeros(T), zeros(T), v, key_valid=valid, window=self.window, q_sm=q, k_sm=k,
                                    sm_scale=self.scaling, softcap=self.softcap, window_weight=0.0, doc=doc,
                                    sinks=self.sinks)
            return o
        W1 = stored["k"].shape[1]
        cur_valid = torch.ones(B, T, dtype=torch.bool, device=q.device) if valid is None else valid.bool()
        sink_cache = sink_reads(sinks, self.window, state_layer.get_seq_length(), T) if self.sinks else None
        if T == 1:  # a decode step: every cached key is in its window, one softmax over them (and the sinks)
            keys, values = torch.cat([stored["k"].to(k.dtype), k], dim=1), torch.cat([stored["v"].to(v.dtype), v], dim=1)
            # its own key always: a pad token's query reads itself alone (finite, and unread)
            ok = torch.cat([stored["valid"].bool(), torch.ones_like(cur_valid)], dim=1)
            if sink_cache is not None:
                keys, values = torch.cat([sink_cache[0], keys], dim=1), torch.cat([sink_cache[1], values], dim=1)
                ok = torch.cat([sink_cache[2][:, 0], ok], dim=1)
            scores = torch.einsum("bhd,bnhd->bhn", q[:, 0].float(), keys.float()) * self.scaling
            if self.softcap is not None:
                scores = self.softcap * torch.tanh(scores / self.softcap)
            p = scores.masked_fill(~ok[:, None, :], float("-inf")).softmax(-1)
            return torch.einsum("bhn,bnhd->bhd", p, values.float())[:, None].to(v.dtype)
        o, _ = linear_attention(
            zeros(T), zeros(W1 + T), torch.cat([stored["v"].to(v.dtype), v], dim=1),
            initial_state=(q.new_zeros(B, H, 1, v.shape[-1], dtype=torch.float32), q.new_zeros(B, H, 1, dtype=torch.float32)),
            key_valid=torch.cat([stored["valid"].bool(), cur_valid], dim=1), window=self.window, q_sm=q,
            k_sm=torch.cat([stored["k"].to(k.dtype), k], dim=1), sm_scale=self.scaling, softcap=self.softcap,
            window_weight=0.0, prefix=W1, sink_cache=sink_cache)
        return o

    def _float_params(self):
        """-exp(A_log), dt_bias, the norm weight and the mix (H, 1) in fp32. Without gradients they are
        cached until a parameter changes (version counters) or moves: a bf16 model's prefill chunk
        then runs no cast launches for them."""
        params = (self.A_log, self.dt_bias, self.o_norm_weight, self.o_norm_mix)

        def build():
            return -torch.exp(self.A_log.float()), self.dt_bias.float(), self.o_norm_weight.float(), self.o_norm_mix.float()[:, None]

        if torch.compiler.is_compiling() or (torch.is_grad_enabled() and any(p.requires_grad for p in params)):
            return build()  # compiled code: the compiler fuses the casts (and traces no cache bookkeeping)
        key = tuple((p._version, p.data_ptr(), p.device) for p in params)
        if getattr(self, "_float_key", None) != key:
            with torch.no_grad():
                self._float_cache = build()
            self._float_key = key
        return self._float_cache

    def _fused_decode(self, hidden_states, position_embeddings, state_layer) -> bool:
        """Whether this call is a decode step that runs as one fused kernel (``_decode_step``): a stored
        state, few tokens, no gradients, the kernels on, and a layer the kernel covers. Layers with q/k
        norms (qk_norm "head": qwen3, qwen3_moe, gemma3_text; "flat": olmo2) keep the unfused path: the
        norms are the original model's modules (gemma's (1 + w), a norm over all heads); so do heads
        wider than the kernel's ``MAX_HEAD_DIM`` (gemma2's 256)."""
        if (hidden_states.shape[1] > DECODE_TOKENS or self.spec.qk_norm is not None or fused_gated_delta_decode is None
                or self.head_dim > MAX_HEAD_DIM):
            return False
        stored = state_layer.read()
        if stored is None or stored["S"] is None:
            return False
        if self.conv_size:
            conv = state_layer.conv_states[0]
            if conv is None or conv.shape[-1] != self.conv_size or not conv.is_contiguous():
                return False
        if self.use_rope and position_embeddings is not None:
            R = position_embeddings[0].shape[-1]  # rotary dims (partial rotary: the first R of each head)
            if R % 2 or R > self.head_dim:
                return False
        if self._training(hidden_states):
            return False
        return use_kernels(hidden_states)

    def _fused_prefill(self, hidden_states, position_embeddings, state_layer) -> bool:
        """Whether this call (no gradients, the fused projection built: see ``fused_projections``) runs
        its glue in the two prefill kernels around the chunk kernel (``_prefill_step``): the layers the
        decode kernel covers (no q/k norms, rotate-half RoPE on an even number of dims), one state per
        query head (``kv_heads="expand"``), heads of at most 256 dims, the kernels on."""
        if (gdn_prefill_prologue is None or self.spec.qk_norm is not None or self.state_heads != self.num_heads
                or self.head_dim > 256 or not use_kernels(hidden_states)):
            return False
        if self.use_rope and position_embeddings is not None:
            cos = position_embeddings[0]
            if cos.dim() != 3 or cos.shape[-1] % 2 or cos.shape[-1] > self.head_dim:
                return False
        if self.conv_size and state_layer is not None and state_layer.has_previous_state[0]:
            conv = state_layer.conv_states[0]
            if conv is None or conv.shape[-1] != self.conv_size or not conv.is_contiguous():
                return False
        return True

    def _prefill_step(self, hidden_states, pre, position_embeddings, valid, state_layer):
        """A prefill (or a chunk of one) on the kernels: the fused projection's output goes through the
        prologue kernel (conv from the cache, RoPE, L2 norms, k and v repeated: q, k, v in the kernels'
        dtype), the chunk kernel, and the epilogue kernel (output norm mix and gate, in the model's
        dtype) into the output projection. The conv cache then keeps the newest inputs, as
        ``update_conv_state`` does on the unfused path."""
        B, T, _ = hidden_states.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        names = self.decode_projection_names()
        cols = gated_delta_decode_columns(dict(zip(names, self._decode_splits)), qkv=self.spec.qkv,
                                          per_head=self.spec.qkv_layout == "per_head", num_heads=H, num_kv_heads=Hkv,
                                          head_dim=D)
        y = pre["*"]
        o_window, window_state = None, {}
        if self.window:  # before the conv update below: the cache's window tensors as the last call left them
            o_window, window_state = self._window_attention(*self._project(hidden_states, pre), position_embeddings,
                                                            valid, None, state_layer)
        had_past = state_layer is not None and state_layer.has_previous_state[0]
        cos, sin = position_embeddings if self.use_rope and position_embeddings is not None else (None, None)
        dt = kernel_dtype(y, self.out_proj.weight.dtype)
        q, k, v = gdn_prefill_prologue(
            y, cols=cols, num_heads=H, num_kv_heads=Hkv, head_dim=D,
            conv_state=state_layer.conv_states[0] if had_past and self.conv_size else None,
            conv_weight=self.conv.weight if self.conv_size else None, cos=cos, sin=sin, valid=valid, out_dtype=dt)
        if state_layer is not None and self.conv_size:  # after the prologue read the old columns
            n = min(T, self.conv_size)
            tail = self._project(None, {name: t[:, -n:] for name, t in pre.items()})
            x = torch.cat(tail, dim=-1)
            if valid is not None:
                x = x * valid[:, -n:, None].to(x.dtype)
            state_layer.update_conv_state(x.transpose(1, 2), state_idx=0, conv_kernel_size=self.conv_size)
        neg_A, dt_bias, norm_w, mix = self._float_params()
        g = neg_A * F.softplus(pre["a_proj"] + dt_bias)
        beta = torch.sigmoid(pre["b_proj"].float())
        if valid is not None:  # a pad token writes nothing and does not decay the state
            g, beta = g * valid[..., None], beta * valid[..., None]
        stored = state_layer.read() if state_layer is not None else None
        init = stored["S"] if stored is not None else None
        o, S = _kernel_delta_rule(q.view(B, T, H, 1, D), k, v, g, beta, init, activation_dtype=self.out_proj.weight.dtype,
                                  state_in_place=getattr(state_layer, "updates_in_place", False))
        if state_layer is not None:
            state_layer.write(T, S=S.float(), **window_state)
        o = gdn_prefill_epilogue(o.view(B, T, H, D), y, norm_weight=norm_w, norm_mix=mix, g_off=cols[6],
                                 out_dtype=hidden_states.dtype)
        return self._output(o, o_window, hidden_states)

    def _decode_step(self, hidden_states, position_embeddings, valid, state_layer):
        """The decode step on the fused kernel: one GEMM for the input projections, one op for the
        conv, RoPE, norms, gates, state update and output gate, and the output projection. The conv
        cache is advanced in place, as transformers' ``update_conv_state`` does in both caches; the
        state in place where the cache allows it (``updates_in_place``), else on a copy written back."""
        names = self.decode_projection_names()
        if self._decode_weight is not None:  # built by the converted model's forward
            y = project(hidden_states, self._decode_weight, self._decode_bias)
            widths = dict(zip(names, self._decode_splits))
        else:  # a layer called on its own, or LoRA-wrapped projections
            parts = [getattr(self, n)(hidden_states) for n in names]
            y, widths = torch.cat(parts, dim=-1), {n: p.shape[-1] for n, p in zip(names, parts)}
        cols = gated_delta_decode_columns(widths, qkv=self.spec.qkv, per_head=self.spec.qkv_layout == "per_head",
                                          num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                          head_dim=self.head_dim)
        o_window, window_state, window_qkv = None, {}, None
        if self.window:  # the window's softmax from the same GEMM's q, k and v columns
            pre = dict(zip(names, y.split([widths[n] for n in names], dim=-1)))
            window_qkv = self._project(hidden_states, pre)
            if not self._fused_window_decode(hidden_states, position_embeddings, state_layer):
                o_window, window_state = self._window_attention(*window_qkv, position_embeddings, valid, None, state_layer)
                window_qkv = None
        S = state_layer.read()["S"]
        if not (getattr(state_layer, "updates_in_place", False) and S.dtype == torch.float32 and S.is_contiguous()):
            S = S.float().clone(memory_format=torch.contiguous_format)
        cos, sin = position_embeddings if self.use_rope and position_embeddings is not None else (None, None)
        o = fused_gated_delta_decode(
            y, cols=cols, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, state=S,
            A_log=self.A_log, dt_bias=self.dt_bias, norm_weight=self.o_norm_weight, norm_mix=self.o_norm_mix,
            conv_state=state_layer.conv_states[0] if self.conv_size else None,
            conv_weight=self.conv.weight if self.conv_size else None, cos=cos, sin=sin, valid=valid)
        if window_qkv is not None:
            return self._window_decode_step(o, *window_qkv, position_embeddings, valid, state_layer, S)
        state_layer.write(hidden_states.shape[1], S=S, **window_state)
        return self._output(o, o_window, hidden_states)

    def _fused_window_decode(self, hidden_states, position_embeddings, state_layer) -> bool:
        """Whether the window's part of a fused decode step (``_decode_step``) is one kernel too
        (``_window_decode_step``): one token, a window of at least 2 keys, RoPE on an even number of dims."""
        if window_softmax_decode is None or hidden_states.shape[1] != 1 or self.window < 2:
            return False
        if self.window_rope and position_embeddings is not None:
            cos = position_embeddings[0]
            if cos.dim() != 3 or cos.shape[-1] % 2 or cos.shape[-1] > self.head_dim:
                return False
        return True

    def _window_decode_step(self, o, q, k, v, position_embeddings, valid, state_layer, S):
        """The window's part of a decode step in one kernel (``window_softmax_decode``): RoPE of the flat
        q (B, 1, H*D), k and v (B, 1, Hkv*D), the softmax over the cached keys, the token and the sinks,
        ``o_window + gamma_h * o`` beside the Gated DeltaNet's output o, and the cache's window and sinks moved on
        (in place in the static cache; on copies in the dynamic one, as the state). Then the output projection."""
        B = o.shape[0]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        stored = state_layer.read()
        if getattr(state_layer, "updates_in_place", False):
            own = lambda t: t  # noqa: E731
        else:
            own = lambda t: t.clone(memory_format=torch.contiguous_format)  # noqa: E731
        buf = {n: own(stored[n]) for n in ("k", "v", "valid")}
        sinks = {n: own(stored[n]) for n in ("sink_k", "sink_v", "sink_at")} if self.sinks else None
        cos, sin = position_embeddings if self.window_rope and position_embeddings is not None else (None, None)
        out = window_softmax_decode(
            q.reshape(B, 1, H, D), k.reshape(B, 1, Hkv, D), v.reshape(B, 1, Hkv, D), buf=buf,
            pos=state_layer.get_seq_length(), sm_scale=self.scaling, softcap=self.softcap, cos=cos, sin=sin,
            valid=valid, sinks=sinks, extra=o.view(B, 1, H, D), gamma=self.window_gamma)
        state_layer.write(1, S=S, **buf, **(sinks or {}))
        return project_with(self.out_proj, out.reshape(B, 1, H * D))
