"""The linear-attention layer that replaces a softmax attention module.

It reuses the original q/k/v/o projections (and q/k norms) *by reference*, so their weights and
state-dict names stay as they were, applies RoPE the way the original model does, and adds only
the feature maps and the optional decay gate, short conv and output gate. The original module stays reachable (not
registered, so it is not saved twice) for ``unlinearize`` and for attention-transfer targets.
"""

from __future__ import annotations

import contextlib
import sys
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .arch import ArchSpec, local_window
from .attention import (DECODE_TOKENS, hedgehog_decode, hedgehog_window_decode, kernel_dtype, linear_attention,
                        project, project_with, use_kernels, window_decode, window_prefill)
from .cache import CACHE_KWARG, SINK_NAMES, LinearAttentionState
from .config import LinearAttentionConfig
from .feature_maps import Hedgehog, build_feature_map


class ConvertedAttention(nn.Module):
    """What every converted layer shares: the modes, and the original module kept reachable.

    "linear": the converted layer; "softmax": the original attention (the teacher, same weights);
    "transfer": both, recording MSE(converted, softmax) in ``transfer_loss`` and passing the softmax
    output on, so every layer trains on the teacher's inputs (attention transfer, stage 1);
    "record": the original softmax attention, its output kept in ``attention_target`` (the teacher pass
    of stage 2 with ``--transfer-weight``);
    "joint": the converted layer, recording MSE(its output, ``attention_target``) in ``transfer_loss``:
    the teacher's attention output at this layer is a fixed target. (A softmax target recomputed on the
    student's own input moves with the weights the loss trains, and chasing it diverged: 2026-11-30d.)
    Subclasses implement ``_linear_forward``.
    """

    MODES = ("linear", "softmax", "transfer", "record", "joint")
    mode = "linear"
    _decode_weight = _decode_bias = None  # see refresh_decode_weights

    def _training(self, x) -> bool:
        """Whether this call builds a graph for gradients: the inference kernels (no backward) stay off."""
        return torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters()))

    def _fast_features(self, q) -> bool:
        """Hedgehog maps on both sides, no gradients, the kernels on: the layer's Hedgehog kernels
        (``Hedgehog.features`` in a decoder, the fused encoder kernels) may run."""
        return (isinstance(getattr(self, "feature_map_q", None), Hedgehog)
                and isinstance(getattr(self, "feature_map_k", None), Hedgehog)
                and not self._training(q) and use_kernels(q))

    def _other_modes(self, teacher, student, mse):
        """Every mode but "linear", from calls of the original attention (``teacher()``) and the converted
        one (``student()``), each returning ``(output, None)``, and ``mse(own, target)``, the loss."""
        if self.mode in ("softmax", "record"):
            out = teacher()
            if self.mode == "record":
                self.attention_target = out[0].detach()
            return out
        if self.mode == "joint":
            target = getattr(self, "attention_target", None)
            if target is None:
                raise ValueError("attention mode 'joint' compares with the teacher's output: "
                                 "run the teacher in 'record' mode first")
        else:
            with torch.no_grad():
                target = teacher()[0]
        own = student()[0]
        self.transfer_loss = mse(own, target)
        return (own if self.mode == "joint" else target), None

    def decode_projection_names(self) -> tuple[str, ...]:
        """The nn.Linear children that read the layer's input, in the order of the fused decode GEMM."""
        return ()

    def refresh_decode_weights(self) -> None:
        """Concatenate the input projections' weights into one matrix, so a decode step (one token: a
        matrix-vector product per projection, each a kernel launch) or a prefill chunk runs one GEMM
        (``fused_projections``). Called outside
        compiled code (the converted model's forward, before the layers run, when gradients are off);
        rebuilt when a source weight changed in place (its version counter), was replaced or moved to
        another dtype or device (``model.to``); dropped
        while a projection is not a plain nn.Linear (a LoRA adapter), gradients are on or the layer
        runs its original attention (softmax / transfer mode: a KD teacher keeps no copy)."""
        names = self.decode_projection_names()
        mods = [getattr(self, n, None) for n in names]
        if not names or self.mode != "linear" or torch.is_grad_enabled() or not all(type(m) is nn.Linear for m in mods):
            self._decode_weight = self._decode_bias = None
            return
        # the storage's address and dtype too: model.to(dtype / device) swaps a parameter's data
        # without a new Parameter or a version bump
        key = tuple((id(t), t._version, t.data_ptr(), t.dtype) for m in mods for t in (m.weight, m.bias)
                    if t is not None)
        if self._decode_weight is not None and key == self._decode_key:
            return
        self._decode_key = key
        self._decode_splits = [m.out_features for m in mods]
        self._decode_weight = torch.cat([m.weight.detach() for m in mods])
        self._decode_bias = None
        if any(m.bias is not None for m in mods):
            self._decode_bias = torch.cat([m.bias.detach() if m.bias is not None
                                           else m.weight.new_zeros(m.out_features) for m in mods])

    def fused_projections(self, hidden_states) -> dict[str, torch.Tensor] | None:
        """The input projections from the fused weight, by name (views of one output; ``"*"``: all of
        it, the projections side by side), or None (not built: gradients on, LoRA). A decode
        step saves launches, a prefill chunk reads the input once instead of once per projection."""
        if self._decode_weight is None or torch.is_grad_enabled():
            return None
        y = project(hidden_states, self._decode_weight, self._decode_bias)
        return {"*": y, **dict(zip(self.decode_projection_names(), y.split(self._decode_splits, dim=-1)))}

    @property
    def original(self) -> nn.Module:
        return self._original

    def _adopt(self, attn: nn.Module, spec: ArchSpec, layer_idx: int) -> None:
        """Take over what the original layer defines: sizes, projections and norms (by reference), RoPE."""
        mcfg = attn.config
        self.layer_idx, self.spec = layer_idx, spec
        self.head_dim = getattr(attn, spec.head_dim)
        self.num_heads = mcfg.num_attention_heads
        self.num_kv_heads = getattr(mcfg, "num_key_value_heads", None) or self.num_heads
        for name in spec.projections:
            self.add_module(name, getattr(attn, name))
        # RoPE exactly as the original model applies it (partial rotary etc. live in that function);
        # NoPE layers (spec.rope_flag falsy) apply none
        self._rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        self.use_rope = bool(getattr(attn, spec.rope_flag)) if spec.rope_flag else True
        self.local_window = local_window(attn)  # the original's sliding window (None: a global layer)
        object.__setattr__(self, "_original", attn)

    @property
    def cache_kwarg(self) -> str:
        """The keyword the decoder layer passes the cache under: the row's (gpt_neox's ``layer_past``),
        else the installed transformers' (``cache`` from 5.24, ``past_key_values`` before)."""
        return self.spec.cache_kwarg or CACHE_KWARG

    @property
    def out_proj(self) -> nn.Module:
        return getattr(self, self.spec.o_proj)

    def _qkv(self, hidden_states: torch.Tensor, pre: dict | None = None):
        """hidden (B, T, hidden) -> flat q (B, T, H*D), k and v (B, T, Hkv*D), after "flat" q/k norms.
        ``pre``: the projections' outputs by name, already computed (``fused_projections``)."""
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        proj = (lambda n: pre[n]) if pre is not None else (lambda n: getattr(self, n)(hidden_states))  # noqa: E731
        if self.spec.fused_qkv is None:
            q, k, v = proj("q_proj"), proj("k_proj"), proj("v_proj")
        elif self.spec.qkv_layout == "per_head":  # [q_h | k_h | v_h] per head (gpt_neox)
            qkv = proj(self.spec.fused_qkv)
            q, k, v = (x.flatten(-2) for x in qkv.unflatten(-1, (H, 3 * D)).chunk(3, dim=-1))
        else:  # [q heads | k heads | v heads] (phi3)
            q, k, v = proj(self.spec.fused_qkv).split([H * D, Hkv * D, Hkv * D], dim=-1)
        if self.spec.qk_norm == "flat":
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def _apply_rope(self, q: torch.Tensor, k: torch.Tensor, position_embeddings):
        """q (B, T, H, D), k (B, T, Hkv, D) with the original's RoPE (none in a NoPE layer)."""
        if position_embeddings is None or not self.use_rope:
            return q, k
        cos, sin = position_embeddings
        q, k = self._rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # (B, H, T, D)
        return q.transpose(1, 2), k.transpose(1, 2)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        past_key_values = kwargs.pop(self.cache_kwarg, past_key_values)
        if self.mode == "linear":
            return self._linear_forward(hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
        if past_key_values is not None:
            raise ValueError(f"attention mode {self.mode!r} runs the original softmax attention: call with use_cache=False")
        return self._other_modes(
            lambda: self._original(hidden_states, position_embeddings=position_embeddings, attention_mask=attention_mask, **kwargs),
            lambda: self._linear_forward(hidden_states, position_embeddings, attention_mask, None, **kwargs),
            lambda own, target: F.mse_loss(own.float(), target.float()))


class LinearAttention(ConvertedAttention):
    def __init__(self, attn: nn.Module, config: LinearAttentionConfig, spec: ArchSpec, layer_idx: int):
        super().__init__()
        mcfg = attn.config
        self._adopt(attn, spec, layer_idx)
        self.scaling = attn.scaling  # the original's softmax scale (granite: attention_multiplier)
        self.softcap = getattr(attn, spec.softcap, None) if spec.softcap else None
        self.window, self.decay, self.eps, self.chunk_size = config.window, config.decay, config.eps, config.chunk_size
        self.sinks = config.sinks
        if self.local_window and config.window > self.local_window:
            raise ValueError(
                f"window {config.window} is wider than layer {layer_idx}'s own sliding window ({self.local_window}): "
                f"its softmax part would read keys the original never attended to; pass window <= {self.local_window}"
            )

        weight = getattr(attn, spec.projections[0]).weight
        fm = dict(num_heads=self.num_heads, head_dim=self.head_dim, feature_dim=config.feature_dim, seed=config.seed + layer_idx)
        self.feature_map_q = build_feature_map(config.feature_map, **fm)
        self.feature_map_k = build_feature_map(config.feature_map, **fm)
        self.feature_dim = self.feature_map_q.feature_dim
        if config.window:
            # weight of the linear part against the window's shifted softmax scores, per head
            self.window_log_gamma = nn.Parameter(torch.zeros(self.num_heads))
        self.conv_size = config.conv_size
        if config.conv_size:
            # a short causal conv over q | k | v before the feature maps (the GDN layer's), starting
            # as the identity: each token's q, k and v may mix in its few predecessors'
            self.conv = identity_conv((self.num_heads + 2 * self.num_kv_heads) * self.head_dim, config.conv_size)
        self.gate_rank = config.gate_rank
        if config.decay is not None:
            width = self.num_heads * (self.feature_dim if config.decay == "channel" else 1)
            if config.gate_rank:
                # low rank (GLA's gate): hidden -> r -> width. The second factor starts at zero, so
                # the gate starts as the full one does; the first keeps its default init, so that
                # gradients reach it once the second moves
                self.gate_in = nn.Linear(mcfg.hidden_size, config.gate_rank, bias=False)
                self.gate_out = nn.Linear(config.gate_rank, width, bias=True)
                last = self.gate_out
            else:
                self.gate = last = nn.Linear(mcfg.hidden_size, width, bias=True)
            nn.init.zeros_(last.weight)
            nn.init.constant_(last.bias, 6.0)  # logsigmoid(6) ~ -0.0025: slow decay at the start
        self.output_gate = config.output_gate
        if config.output_gate:
            # o * 2 sigmoid(W2 W1 x + b) per output channel, before o_proj. W2 and b start at zero: the
            # gate starts at 1 (the layer as without it), and W1 keeps its default init so that
            # gradients reach it once W2 moves (as the low-rank decay gate)
            self.out_gate_in = nn.Linear(mcfg.hidden_size, config.output_gate, bias=False)
            self.out_gate_out = nn.Linear(config.output_gate, self.num_heads * self.head_dim, bias=True)
            nn.init.zeros_(self.out_gate_out.weight)
            nn.init.zeros_(self.out_gate_out.bias)
        self.to(device=weight.device, dtype=weight.dtype)

    def decode_projection_names(self) -> tuple[str, ...]:
        qkv = (self.spec.fused_qkv,) if self.spec.fused_qkv else ("q_proj", "k_proj", "v_proj")
        # a low-rank gate's first factor joins the fused GEMM (its r-wide output); log_gate applies the
        # second, as _output does the output gate's
        gate = () if self.decay is None else ("gate_in" if self.gate_rank else "gate",)
        return (*qkv, *gate, *(("out_gate_in",) if self.output_gate else ()))

    def project(self, hidden_states: torch.Tensor, position_embeddings=None, pre: dict | None = None,
                valid=None, packed: PackedDocs | None = None, state_layer=None):
        """hidden (B, T, hidden) -> q (B, T, H, D), k and v (B, T, Hkv, D), after the short conv (with
        ``conv_size``), norms and RoPE. ``pre``: the projections' outputs by name, already computed
        (``fused_projections``); ``valid``, ``packed`` and ``state_layer`` are what the conv reads."""
        B, T, _ = hidden_states.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self._qkv(hidden_states, pre)
        if self.conv_size:
            x = short_conv(self.conv, torch.cat([q, k, v], dim=-1), valid, packed, state_layer)
            q, k, v = x.split([H * D, Hkv * D, Hkv * D], dim=-1)
        q, k, v = q.reshape(B, T, H, D), k.reshape(B, T, Hkv, D), v.reshape(B, T, Hkv, D)
        if self.spec.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        return (*self._apply_rope(q, k, position_embeddings), v)

    def log_gate(self, hidden_states: torch.Tensor, pre: dict | None = None) -> torch.Tensor | None:
        """(B, T, H) or (B, T, H, F) float32 log decay, or None."""
        if self.decay is None:
            return None
        if self.gate_rank:
            g = self.gate_out(pre["gate_in"] if pre is not None else self.gate_in(hidden_states))
        else:
            g = pre["gate"] if pre is not None else self.gate(hidden_states)
        g = F.logsigmoid(g.float())
        B, T = hidden_states.shape[:2]
        return g.view(B, T, self.num_heads, -1) if self.decay == "channel" else g.view(B, T, self.num_heads)

    def _output(self, o: torch.Tensor, hidden_states: torch.Tensor, pre: dict | None = None) -> torch.Tensor:
        """The attention output (B, T, H, D) through the output gate, if any, and the output projection."""
        B, T = hidden_states.shape[:2]
        o = o.reshape(B, T, -1)
        if self.output_gate:
            u = self.out_gate_out(pre["out_gate_in"] if pre is not None else self.out_gate_in(hidden_states))
            o = o * (2 * torch.sigmoid(u.float())).to(o.dtype)
        return project_with(self.out_proj, o.to(hidden_states.dtype))

    def _linear_forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        B, T, _ = hidden_states.shape
        state_layer = _state_layer(past_key_values, self.layer_idx)
        valid = layer_validity(attention_mask, B, T, state_layer, kwargs)
        packed = packed_starts(state_layer, valid, kwargs.get("position_ids"), B, T, kwargs)
        doc = packed.doc if packed is not None else None  # packed documents: no attention across them
        stored = state_layer.read() if state_layer is not None else None
        pre = self.fused_projections(hidden_states)
        fused = self._fused_decode(hidden_states, stored, state_layer)
        rope = self._rope_in_kernel(pre, position_embeddings) if fused else None
        if rope is not None:
            # a decode step reads q, k and v straight from the fused projection's output and applies
            # RoPE in the kernel: no launch between the GEMM and the decode kernel
            (q, k, v), (cos, sin) = self._raw_qkv(pre), rope
        else:
            q, k, v = self.project(hidden_states, position_embeddings, pre, valid, packed, state_layer)
            cos = sin = None
        if fused:
            log_g, wq, wk = self.log_gate(hidden_states, pre), self.feature_map_q.weight, self.feature_map_k.weight
            if self.window:
                ring, (S, z), pos = self._decode_buffers(stored, state_layer, k.device)
                sinks = {n: stored[n] for n in SINK_NAMES} if self.sinks else {}  # full: read only
                o = hedgehog_window_decode(
                    q, k, v, wq, wk, log_g=log_g, valid=valid, ring=ring, state=(S, z), pos=pos,
                    log_gamma=self.window_log_gamma, sm_scale=self.scaling, softcap=self.softcap, cos=cos, sin=sin,
                    sinks=sinks or None)
                state_layer.write(T, S=S, z=z, **ring, **sinks)
            else:
                o, (S, z) = hedgehog_decode(q, k, v, wq, wk, log_g, valid, (stored["S"], stored["z"]), self.eps,
                                            state_in_place=getattr(state_layer, "updates_in_place", False),
                                            cos=cos, sin=sin)
                state_layer.write(T, S=S, z=z)
            return self._output(o, hidden_states, pre), None
        rep = self.num_heads // self.num_kv_heads
        if self._fast_features(q):
            # inference on the kernels: Hedgehog features in the kernels' dtype straight from the raw
            # q and k (k's kv heads read in place), see Hedgehog.features
            dt = kernel_dtype(q, v.dtype)
            qf, kf = self.feature_map_q.features(q, dt), self.feature_map_k.features(k, dt)
            if rep > 1:
                v = v.repeat_interleave(rep, dim=2)
                if self.window:  # the softmax part and the window buffer read the heads' keys
                    k = k.repeat_interleave(rep, dim=2)
        else:
            if rep > 1:  # GQA: head h reads kv head h // rep, as the original's repeat_kv
                k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
            qf, kf = self.feature_map_q(q.float()), self.feature_map_k(k.float())
        log_g = self.log_gate(hidden_states, pre)
        if self.window and state_layer is not None:
            o = self._window_cached(q, k, v, qf, kf, log_g, valid, stored, state_layer)
            return self._output(o, hidden_states, pre), None
        init = (stored["S"], stored["z"]) if stored is not None else None
        o, (S, z) = linear_attention(
            qf, kf, v, log_g=log_g, initial_state=init, key_valid=valid,
            window=self.window, q_sm=q, k_sm=k, sm_scale=self.scaling, softcap=self.softcap,
            window_weight=self._window_weight(), eps=self.eps, chunk_size=self.chunk_size,
            state_in_place=getattr(state_layer, "updates_in_place", False), doc=doc, sinks=self.sinks,
        )
        if state_layer is not None:
            state_layer.write(T, S=S.float(), z=z.float())
        return self._output(o, hidden_states, pre), None

    def _fused_decode(self, q, stored, state_layer) -> bool:
        """A decode step (a stored state, few tokens, no gradients) of a Hedgehog layer runs one fused
        kernel: features, (window,) state update and readout, with no gate, a gate per head or a gate
        per key channel (``decay="channel"``); with sinks: once they are all filled, since the kernel
        only reads them."""
        return (stored is not None and q.shape[1] <= DECODE_TOKENS
                and (not self.sinks or getattr(state_layer, "sinks_full", False))
                and isinstance(self.feature_map_q, Hedgehog) and isinstance(self.feature_map_k, Hedgehog)
                and not self._training(q) and use_kernels(q))

    def _rope_in_kernel(self, pre, position_embeddings) -> tuple | None:
        """(cos, sin) (or (None, None): no RoPE) when the fused decode kernel can take q and k before
        RoPE from the fused projection output: no q/k norm between the projection and RoPE,
        rotate-half RoPE on an even number of leading dims. None: the layer rotates first
        (``project``)."""
        if pre is None or self.spec.qk_norm is not None or self.conv_size:  # the conv comes first
            return None
        if not self.use_rope or position_embeddings is None:
            return None, None
        cos, sin = position_embeddings
        R = cos.shape[-1]
        if R % 2 or R > self.head_dim or cos.dim() != 3:
            return None
        return cos, sin

    def _raw_qkv(self, pre: dict):
        """q (B, T, H, D), k and v (B, T, Hkv, D) as strided views of the fused projection output,
        before RoPE (copies of nothing)."""
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if self.spec.fused_qkv is None:
            q, k, v = pre["q_proj"], pre["k_proj"], pre["v_proj"]
        elif self.spec.qkv_layout == "per_head":  # [q_h | k_h | v_h] per head (gpt_neox)
            return pre[self.spec.fused_qkv].unflatten(-1, (H, 3 * D)).split(D, dim=-1)
        else:  # [q heads | k heads | v heads] (phi3)
            q, k, v = pre[self.spec.fused_qkv].split([H * D, Hkv * D, Hkv * D], dim=-1)
        return q.unflatten(-1, (H, D)), k.unflatten(-1, (Hkv, D)), v.unflatten(-1, (Hkv, D))

    def _window_weight(self):
        return torch.exp(self.window_log_gamma.float()) if self.window else 1.0

    def _window_cached(self, q, k, v, qf, kf, log_g, valid, stored, state_layer):
        """The window hybrid with a cache: the state (S, z) over every key but the newest W-1, which
        sit in a ring buffer, the token at position p in slot p mod (W-1) (see linearize/cache.py).
        The position comes from the layer's token counter (a device tensor in the static cache), so
        a decode step reads nothing on the host."""
        B, T = q.shape[:2]
        W1 = self.window - 1
        pos = state_layer.get_seq_length()  # an int, or a 0-dim device tensor (the static cache)
        cur = dict(k=k, phi_k=kf, v=v, log_g=log_g,
                   valid=valid if valid is not None else torch.ones(B, T, dtype=torch.bool, device=k.device))
        sinks = sinks_after(self.sinks, stored, k, v, cur["valid"], pos) if self.sinks else {}
        if self.sinks and not state_layer.sinks_full:
            if stored is None and valid is None:  # a prompt without padding fills the slots iff it is long enough
                state_layer.sinks_full = T >= self.sinks
            elif (stored is None or T > DECODE_TOKENS) and _host_reads_ok():
                # a padded prompt may read the host (once a layer), until the slots are full (they stay so)
                state_layer.sinks_full = bool((sinks["sink_at"] >= 0).all())
        if stored is None:  # the first call: the prompt alone (the one-call fast path)
            o, (S, z) = linear_attention(
                qf, kf, v, log_g=log_g, key_valid=valid, window=self.window, q_sm=q, k_sm=k,
                sm_scale=self.scaling, softcap=self.softcap, window_weight=self._window_weight(),
                eps=self.eps, chunk_size=self.chunk_size, sinks=self.sinks)
            state_layer.write(T, S=S.float(), z=z.float(), **self._ring_from(cur, pos + T, B, k, v), **sinks)
            return o
        training = self._training(q)
        if T <= DECODE_TOKENS and not training and use_kernels(q):
            # decode: one kernel reads the ring and the state and advances both in place
            ring, (S, z), pos = self._decode_buffers(stored, state_layer, k.device)
            o = window_decode(q, qf, k, kf, v, log_g=log_g, valid=valid, ring=ring, state=(S, z), pos=pos,
                              gamma=self._window_weight(), sm_scale=self.scaling, softcap=self.softcap,
                              sinks=sinks or None)
            state_layer.write(T, S=S, z=z, **ring, **sinks)
            return o
        # a chunk after the first: the buffer in time order, then the chunk (prefix W-1 keys)
        names = ("k", "phi_k", "v", "valid") + (() if log_g is None else ("log_g",))  # no gate: zeros, unread
        if isinstance(pos, int):
            buf = {n: torch.roll(stored[n], -(pos % max(W1, 1)), dims=1) for n in names}
        else:
            order = (pos + torch.arange(W1, device=k.device)) % W1
            buf = {n: stored[n].index_select(1, order) for n in names}
        if not training and use_kernels(q) and self.softcap is None and self.decay != "channel":
            o, (S, z) = window_prefill(q, qf, k, kf, v, log_g=log_g, valid=valid, buf=buf,
                                       state=(stored["S"], stored["z"]), gamma=self._window_weight(),
                                       sm_scale=self.scaling, sinks=sinks or None, pos=pos)
        else:
            seen = {n: None if x is None else torch.cat([buf[n].to(x.dtype), x], dim=1) for n, x in cur.items()}
            o, (S, z) = linear_attention(
                qf, seen["phi_k"], seen["v"], log_g=seen["log_g"], initial_state=(stored["S"], stored["z"]),
                key_valid=seen["valid"], window=self.window, q_sm=q, k_sm=seen["k"], sm_scale=self.scaling,
                softcap=self.softcap, window_weight=self._window_weight(), prefix=W1, eps=self.eps,
                chunk_size=self.chunk_size, sink_cache=sink_reads(sinks, self.window, pos, T) if self.sinks else None)
        newest = cur if T >= W1 else {
            n: None if x is None else torch.cat([buf[n].to(x.dtype), x], dim=1) for n, x in cur.items()}
        state_layer.write(T, S=S.float(), z=z.float(), **self._ring_from(newest, pos + T, B, k, v), **sinks)
        return o

    @staticmethod
    def _decode_buffers(stored, state_layer, device):
        """The ring, the state (S, z) and the position of the first token, for a decode kernel that
        advances them in place: the static cache's own storage, or copies of the dynamic cache's
        tensors (its earlier tensors may still be referenced)."""
        in_place = getattr(state_layer, "updates_in_place", False)
        ring = {n: stored[n] if in_place else stored[n].clone() for n in ("k", "phi_k", "v", "log_g", "valid")}
        S, z = (stored[n] if in_place else stored[n].clone() for n in ("S", "z"))
        return ring, (S, z), torch.as_tensor(state_layer.get_seq_length(), device=device)

    def _ring_from(self, tokens, end, B, k, v):
        """The ring buffer holding the newest W-1 of ``tokens`` (a time-ordered dict of (B, L, ...)
        tensors whose last token sits at position end - 1): slot s gets position p = s mod (W-1).
        ``end``: an int (one roll per tensor) or a 0-dim device tensor (the static cache: a gather)."""
        W1 = self.window - 1
        if W1 == 0:
            return self._empty_buffers(B, k.device, k.dtype, v.dtype)
        perm = None if isinstance(end, int) else (torch.arange(W1, device=k.device) - end) % W1
        ring = {}
        for n, x in tokens.items():
            short = x is None or x.shape[1] < W1  # (front-)filled with empty (invalid) slots
            e = self._empty_buffers(B, k.device, k.dtype, v.dtype, names=(n,))[n] if short else None
            if x is None:
                ring[n] = e
                continue
            x = x[:, -W1:].to(torch.float32 if n in ("phi_k", "log_g", "valid") else x.dtype)
            if short:
                x = torch.cat([e[:, x.shape[1]:], x.to(e.dtype)], dim=1)
            ring[n] = torch.roll(x, end % W1, dims=1) if perm is None else x.index_select(1, perm)
        return ring

    def _empty_buffers(self, B, device, k_dtype, v_dtype, names=("k", "phi_k", "v", "log_g", "valid")):
        W1, H = self.window - 1, self.num_heads
        shapes = {"k": ((B, W1, H, self.head_dim), k_dtype), "phi_k": ((B, W1, H, self.feature_dim), torch.float32),
                  "v": ((B, W1, H, self.head_dim), v_dtype),
                  "log_g": ((B, W1, H, self.feature_dim) if self.decay == "channel" else (B, W1, H), torch.float32),
                  "valid": ((B, W1), torch.float32)}
        return {n: torch.zeros(shapes[n][0], device=device, dtype=shapes[n][1]) for n in names}


def sinks_after(n: int, stored, k, v, valid, pos) -> dict[str, torch.Tensor]:
    """A window layer's ``n`` attention sinks once this call's tokens are seen: the keys and values of
    each row's first ``n`` real tokens and their positions (``sink_at``, -1 while a slot is empty),
    filled from the cache's and then from this call's real tokens, in order (tensor ops only: no
    host read, so a static cache's decode step stays graph-friendly). Each empty slot gathers
    the one token that takes it, so a 64K-token prompt moves n tokens, not all of them.
    k (B, T, H, D), v (B, T, H, Dv), valid (B, T); ``pos``: the position of the call's first token."""
    B, T, H, D = k.shape
    if stored is None:
        sk, sv = k.new_zeros(B, n, H, D), v.new_zeros(B, n, H, v.shape[-1])
        at = torch.full((B, n), -1.0, device=k.device)
    else:
        sk, sv, at = stored["sink_k"].to(k.dtype), stored["sink_v"].to(v.dtype), stored["sink_at"]
    real = valid.to(torch.bool)
    rank = (at >= 0).sum(1, keepdim=True) + real.long().cumsum(1) - 1  # (B, T): the slot a real token would take
    takes = real.unsqueeze(-1) & (rank.unsqueeze(-1) == torch.arange(n, device=k.device))  # (B, T, n)
    new = takes.any(1)  # (B, n): the slot is filled by this call
    first = takes.to(torch.uint8).argmax(1)  # (B, n): the token that fills it (0 where none does)
    gather = lambda x: x.gather(1, first.view(B, n, *[1] * (x.dim() - 2)).expand(B, n, *x.shape[2:]))  # noqa: E731
    keep = lambda x: new.view(B, n, *[1] * (x.dim() - 2))  # noqa: E731
    sk = torch.where(keep(k), gather(k), sk)
    sv = torch.where(keep(v), gather(v), sv)
    at = torch.where(new, pos + first.float(), at)
    return {"sink_k": sk, "sink_v": sv, "sink_at": at}


def sink_reads(sinks: dict, window: int, pos, T: int):
    """The cached sinks as ``linear_attention``'s ``sink_cache``: keys, values and, per query of a call
    of T tokens (at position pos + t), which sinks it reads: the filled ones outside its window
    (sink_at <= p - window)."""
    p = (pos + torch.arange(T, device=sinks["sink_at"].device)).float()
    at = sinks["sink_at"][:, None, :]  # (B, 1, S)
    return sinks["sink_k"], sinks["sink_v"], (at >= 0) & (at <= p[None, :, None] - window)


def _host_reads_ok() -> bool:
    """Neither compiling nor capturing a CUDA graph: a tensor may be read on the host."""
    return not (torch.compiler.is_compiling()
                or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()))


def token_validity(attention_mask, batch_size: int, q_len: int, offset=None) -> torch.Tensor | None:
    """(B, q_len) bool marking real (non-pad) tokens of the current step, or None if all are real.

    Under sdpa the mask is None without padding and a bool (B, 1, q, kv) mask with it; under eager
    it is a float mask (0 = attend); flash-attention passes the 2D padding mask. A token is real
    iff it may attend to itself: the diagonal starting at key column ``offset``, by default the last
    ``q_len`` columns (a mask of seen + q columns). A static cache's mask has a fixed number of
    columns and passes its token count (a 0-dim tensor: indexing with it reads nothing on the host).
    """
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(
            f"converted layers read padding from a tensor attention mask, got {type(attention_mask).__name__}; "
            "load the model with attn_implementation='sdpa' or 'eager'"
        )
    if attention_mask.dim() == 2:
        valid = attention_mask[:, -q_len:].bool()
    else:
        idx = torch.arange(q_len, device=attention_mask.device)
        if offset is None:
            offset = attention_mask.shape[-1] - q_len
        elif isinstance(offset, torch.Tensor):
            offset = offset.to(attention_mask.device)
        diag = attention_mask[:, 0, idx, idx + offset]  # (B or 1, q_len)
        valid = diag if diag.dtype == torch.bool else diag > torch.finfo(diag.dtype).min / 2
    return valid.expand(batch_size, q_len)


class PackedDocs(NamedTuple):
    """Packed rows (several documents in a row, position ids restarting at 0) with shapes that
    depend on (B, T) only, so a compiled layer sees the same shapes whatever the packing (no
    recompile, one CUDA graph): ``doc (B, T)`` long, the index of each token's document within its
    row (0 for the row's first document, which continues from an initial state when there is one),
    and ``offset (B, T)`` long, the tokens since its document's first (0 at a restart). The layers
    mask across documents with them (the PyTorch math, the short conv) or reset their state at a
    restart (the chunk kernels: a decay of exp(-RESET_LOG_DECAY) there, see ``attention.reset_log_decay``).
    The window hybrid on the kernels takes the same form (each token's document start masks its
    window, see ``attention._triton_window``)."""

    doc: torch.Tensor
    offset: torch.Tensor

    @property
    def restart(self) -> torch.Tensor:
        """(B, T) bool: the token starts a document after another one in its row."""
        return (self.offset == 0) & (self.doc > 0)



def identity_conv(channels: int, size: int) -> nn.Conv1d:
    """A depthwise causal conv of ``size`` taps over ``channels`` that starts as the identity (only
    the current token's tap is 1), so a layer that gains it computes what it did before."""
    conv = nn.Conv1d(channels, channels, size, groups=channels, bias=False)
    with torch.no_grad():
        conv.weight.zero_()
        conv.weight[:, 0, -1] = 1.0
    return conv


def short_conv(conv: nn.Conv1d, x: torch.Tensor, valid, packed: PackedDocs | None, state_layer) -> torch.Tensor:
    """The short causal depthwise convolution of x (B, T, C) over time, (B, T, C) in x's dtype:
    padding tokens read as zeros, packed documents see none of each other's tokens, and with a
    cache the newest ``kernel_size`` inputs ride in its conv state (transformers'
    ``update_conv_state``), so a decode step continues the prompt exactly."""
    size, T, dtype = conv.kernel_size[0], x.shape[1], x.dtype
    if valid is not None:
        x = x * valid[..., None].to(x.dtype)
    x = x.transpose(1, 2)  # (B, C, T)
    had_past = state_layer is not None and state_layer.has_previous_state[0]
    if state_layer is not None:
        # the real transformers conv cache: keeps the last `size` inputs (zero-padded when the first
        # prompt is shorter) and returns them with the new ones
        full = state_layer.update_conv_state(x, state_idx=0, conv_kernel_size=size)
    x = full if had_past else F.pad(x, (size - 1, 0))
    if T == 1:  # one token: the depthwise conv is a sum over its taps (fuses with the cache update)
        return (x[..., -size:] * conv.weight[:, 0, :]).sum(-1, keepdim=True).transpose(1, 2)
    if torch.compiler.is_compiling() or packed is not None:
        # compiled (training, `--compile`): the conv as a sum of shifted taps in fp32, which Inductor
        # fuses into one kernel each way; aten's depthwise conv took 0.17 ms a layer forward at
        # 16 x 1024 tokens on an H100, ~8x the bytes it moves (docs/reports/training.md).
        # Packed documents: tap i reads the token size - 1 - i back, kept only inside its document
        w = conv.weight[:, 0, :].float()
        return sum(x[..., i: x.shape[-1] - size + 1 + i].float() * w[:, i: i + 1]
                   * (1.0 if packed is None else (packed.offset >= size - 1 - i)[:, None, :].float())
                   for i in range(size))[..., -T:].to(dtype).transpose(1, 2)
    return conv(x)[..., -T:].transpose(1, 2)


_STATIC_PACKING = [False]


@contextlib.contextmanager
def static_packing(on: bool = True):
    """Inside, every call with position ids (and no cache or padding) takes the packed path
    (``PackedDocs``), also for a batch whose rows hold one document each: the path is a property of
    the data set, not of a batch, so a compiled training step never meets a second graph for an
    unpacked batch, and no call reads the device on the host to decide. ``recipes/train.py`` turns
    it on for rows that pack documents."""
    before = _STATIC_PACKING[0]
    _STATIC_PACKING[0] = on
    try:
        yield
    finally:
        _STATIC_PACKING[0] = before


def packed_docs(position_ids, B: int, T: int) -> PackedDocs | None:
    """``PackedDocs`` of rows whose position ids restart at 0 inside the row, or None if no row
    packs more than one document. Tensor ops on the ids' device; the host reads one bool (whether
    any row is packed: unpacked rows keep the plain path), none inside ``static_packing`` or when
    compiling."""
    if position_ids is None or T < 2 or position_ids.shape[-1] != T:
        return None
    pos = position_ids.expand(B, T)
    start = pos == 0
    start[:, 0] = False  # the row's first token continues whatever came before the row
    if not (_STATIC_PACKING[0] or torch.compiler.is_compiling()) and not bool(start.any()):
        return None
    idx = torch.arange(T, device=pos.device).expand(B, T)
    last = torch.cummax(torch.where(start, idx, 0), dim=1).values  # the latest restart at or before t
    return PackedDocs(start.cumsum(1), idx - last)


def static_packing_on() -> bool:
    return _STATIC_PACKING[0]


# what the converted model's forward hands its layers (found once per call, see modeling_linearize)
PACKED_KWARG = "linearize_packed_starts"
NO_PADDING_KWARG = "linearize_no_padding"


def layer_validity(attention_mask, B: int, T: int, state_layer, kwargs) -> torch.Tensor | None:
    """``token_validity`` unless the model's forward said the call has no padding."""
    if kwargs is not None and kwargs.get(NO_PADDING_KWARG):
        return None
    return token_validity(attention_mask, B, T, offset=None if state_layer is None else state_layer.mask_offset())


def packed_starts(state_layer, valid, position_ids, B: int, T: int, kwargs=None) -> PackedDocs | None:
    """The documents of each row when a call without cache or padding packs several documents in
    a row (``PackedDocs``), else None. A converted model's forward finds them once for all layers
    (``document_starts``) and passes them in ``kwargs``; a layer called on its own finds them
    itself. With a stored state it reads nothing on the
    host: the decode step stays free of CPU-GPU syncs (compiled / CUDA-graph capture)."""
    if state_layer is not None:
        return None
    if kwargs is not None and PACKED_KWARG in kwargs:
        return kwargs[PACKED_KWARG]
    if valid is not None and not bool(valid.all()):
        return None
    return packed_docs(position_ids, B, T)


def document_starts(position_ids, attention_mask, cache) -> PackedDocs | None:
    """``packed_starts`` for a whole model call, outside compiled code: None (no host read) with a
    cache or without explicit position ids, so plain training and compiled decoding stay one graph;
    else one host read (whether any row packs several documents)."""
    if cache is not None or position_ids is None or position_ids.dim() != 2:
        return None
    B, T = position_ids.shape
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        return None  # padding: the layers read it from the mask, no packing
    return packed_docs(position_ids, B, T)


def _state_layer(past_key_values, layer_idx: int) -> LinearAttentionState | None:
    if past_key_values is None:
        return None
    layers = getattr(past_key_values, "layers", None)
    layer = layers[layer_idx] if layers is not None and layer_idx < len(layers) else None
    if not isinstance(layer, LinearAttentionState):
        raise TypeError(
            f"layer {layer_idx} is a converted linear-attention layer but the cache gave it "
            f"{type(layer).__name__}; pass `linearize.LinearizeCache(model.config)` as past_key_values "
            "(generate() and the model's forward build one for you when you pass none)"
        )
    return layer
