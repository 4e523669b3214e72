"""The linear-attention layer that replaces a softmax attention module.

It reuses the original q/k/v/o projections (and q/k norms) *by reference*, so their weights and
state-dict names stay as they were, applies RoPE the way the original model does, and adds only
the feature maps and the optional decay gate. The original module stays reachable (not
registered, so it is not saved twice) for ``unlinearize`` and for attention-transfer targets.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from .arch import ArchSpec
from .attention import DECODE_TOKENS, hedgehog_decode, linear_attention, use_kernels
from .cache import LinearAttentionState
from .config import LinearAttentionConfig
from .feature_maps import Hedgehog, build_feature_map


class ConvertedAttention(nn.Module):
    """What every converted layer shares: the modes, and the original module kept reachable.

    "linear": the converted layer; "softmax": the original attention (the teacher, same weights);
    "transfer": both, recording MSE(converted, softmax) in ``transfer_loss`` and passing the softmax
    output on, so every layer trains on the teacher's inputs (attention transfer, stage 1).
    Subclasses implement ``_linear_forward``.
    """

    MODES = ("linear", "softmax", "transfer")
    mode = "linear"
    _decode_weight = _decode_bias = None  # see refresh_decode_weights

    def decode_projection_names(self) -> tuple[str, ...]:
        """The nn.Linear children that read the layer's input, in the order of the fused decode GEMM."""
        return ()

    def refresh_decode_weights(self) -> None:
        """Concatenate the input projections' weights into one matrix, so a decode step (one token: a
        matrix-vector product per projection, each a kernel launch) runs one GEMM. Called outside
        compiled code (the converted model's forward, before the layers run, when gradients are off);
        rebuilt when a source weight changed in place (its version counter) or was replaced; dropped
        while a projection is not a plain nn.Linear (a LoRA adapter) or gradients are on."""
        names = self.decode_projection_names()
        mods = [getattr(self, n, None) for n in names]
        if not names or torch.is_grad_enabled() or not all(type(m) is nn.Linear for m in mods):
            self._decode_weight = self._decode_bias = None
            return
        key = tuple((id(t), t._version) for m in mods for t in (m.weight, m.bias) if t is not None)
        if self._decode_weight is not None and key == self._decode_key:
            return
        self._decode_key = key
        self._decode_splits = [m.out_features for m in mods]
        self._decode_weight = torch.cat([m.weight.detach() for m in mods])
        self._decode_bias = None
        if any(m.bias is not None for m in mods):
            self._decode_bias = torch.cat([m.bias.detach() if m.bias is not None
                                           else m.weight.new_zeros(m.out_features) for m in mods])

    def decode_projections(self, hidden_states) -> dict[str, torch.Tensor] | None:
        """The input projections of a decode step from the fused weight, by name, or None (not built)."""
        if self._decode_weight is None or torch.is_grad_enabled() or hidden_states.shape[1] > DECODE_TOKENS:
            return None
        y = F.linear(hidden_states, self._decode_weight, self._decode_bias)
        return dict(zip(self.decode_projection_names(), y.split(self._decode_splits, dim=-1)))

    @property
    def original(self) -> nn.Module:
        return self._original

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        if self.mode == "linear":
            return self._linear_forward(hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
        if past_key_values is not None:
            raise ValueError(f"attention mode {self.mode!r} runs the original softmax attention: call with use_cache=False")
        if self.mode == "softmax":
            return self._original(hidden_states, position_embeddings=position_embeddings, attention_mask=attention_mask, **kwargs)
        with torch.no_grad():
            target, _ = self._original(hidden_states, position_embeddings=position_embeddings, attention_mask=attention_mask, **kwargs)
        student, _ = self._linear_forward(hidden_states, position_embeddings, attention_mask, None, **kwargs)
        self.transfer_loss = F.mse_loss(student.float(), target.float())
        return target, None


class LinearAttention(ConvertedAttention):
    def __init__(self, attn: nn.Module, config: LinearAttentionConfig, spec: ArchSpec, layer_idx: int):
        super().__init__()
        mcfg = attn.config
        self.layer_idx = layer_idx
        self.head_dim = attn.head_dim
        self.num_heads = mcfg.num_attention_heads
        self.num_kv_heads = getattr(mcfg, "num_key_value_heads", None) or self.num_heads
        self.scaling = attn.scaling
        self.softcap = getattr(attn, spec.softcap, None) if spec.softcap else None
        self.spec = spec
        self.window, self.decay, self.eps, self.chunk_size = config.window, config.decay, config.eps, config.chunk_size
        for name in spec.projections:
            self.add_module(name, getattr(attn, name))
        # RoPE exactly as the original model applies it (partial rotary etc. live in that function)
        self._rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        object.__setattr__(self, "_original", attn)

        weight = getattr(attn, spec.projections[0]).weight
        fm = dict(num_heads=self.num_heads, head_dim=self.head_dim, feature_dim=config.feature_dim, seed=config.seed + layer_idx)
        self.feature_map_q = build_feature_map(config.feature_map, **fm)
        self.feature_map_k = build_feature_map(config.feature_map, **fm)
        self.feature_dim = self.feature_map_q.feature_dim
        if config.window:
            # weight of the linear part against the window's shifted softmax scores, per head
            self.window_log_gamma = nn.Parameter(torch.zeros(self.num_heads))
        if config.decay is not None:
            width = self.num_heads * (self.feature_dim if config.decay == "channel" else 1)
            self.gate = nn.Linear(mcfg.hidden_size, width, bias=True)
            nn.init.zeros_(self.gate.weight)
            nn.init.constant_(self.gate.bias, 6.0)  # logsigmoid(6) ~ -0.0025: slow decay at the start
        self.to(device=weight.device, dtype=weight.dtype)

    def decode_projection_names(self) -> tuple[str, ...]:
        qkv = (self.spec.fused_qkv,) if self.spec.fused_qkv else ("q_proj", "k_proj", "v_proj")
        return (*qkv, "gate") if self.decay is not None else qkv

    def project(self, hidden_states: torch.Tensor, position_embeddings=None, pre: dict | None = None):
        """hidden (B, T, hidden) -> q (B, T, H, D), k and v (B, T, Hkv, D), after norms and RoPE.
        ``pre``: the projections' outputs by name, already computed (``decode_projections``)."""
        B, T, _ = hidden_states.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        proj = (lambda n: pre[n]) if pre is not None else (lambda n: getattr(self, n)(hidden_states))  # noqa: E731
        if self.spec.fused_qkv:
            qkv = proj(self.spec.fused_qkv)
            q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
        else:
            q, k, v = proj("q_proj"), proj("k_proj"), proj("v_proj")
        if self.spec.qk_norm == "flat":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.view(B, T, H, D), k.view(B, T, Hkv, D), v.view(B, T, Hkv, D)
        if self.spec.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if position_embeddings is not None:
            cos, sin = position_embeddings
            q, k = self._rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # (B, H, T, D)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        return q, k, v

    def log_gate(self, hidden_states: torch.Tensor, pre: dict | None = None) -> torch.Tensor | None:
        """(B, T, H) or (B, T, H, F) float32 log decay, or None."""
        if self.decay is None:
            return None
        g = F.logsigmoid((pre["gate"] if pre is not None else self.gate(hidden_states)).float())
        B, T = hidden_states.shape[:2]
        return g.view(B, T, self.num_heads, -1) if self.decay == "channel" else g.view(B, T, self.num_heads)

    def _linear_forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        B, T, _ = hidden_states.shape
        state_layer = _state_layer(past_key_values, self.layer_idx)
        valid = layer_validity(attention_mask, B, T, state_layer, kwargs)
        starts = packed_starts(state_layer, valid, kwargs.get("position_ids"), B, T, kwargs)
        if starts is not None:  # packed documents: no attention across their boundaries
            run = lambda x, pe: self._linear_forward(x, pe)[0]  # noqa: E731
            return run_segments(run, hidden_states, position_embeddings, starts), None
        stored = state_layer.read() if state_layer is not None else None
        pre = self.decode_projections(hidden_states) if stored is not None else None
        q, k, v = self.project(hidden_states, position_embeddings, pre)
        if self._fused_decode(q, stored):
            o, (S, z) = hedgehog_decode(
                q, k, v, self.feature_map_q.weight, self.feature_map_k.weight, self.log_gate(hidden_states, pre), valid,
                (stored["S"], stored["z"]), self.eps, state_in_place=getattr(state_layer, "updates_in_place", False))
            state_layer.write(T, S=S, z=z)
            return self.o_proj(o.reshape(B, T, -1).to(hidden_states.dtype)), None
        rep = self.num_heads // self.num_kv_heads
        if rep > 1:  # GQA: head h reads kv head h // rep, as the original's repeat_kv
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        qf, kf = self.feature_map_q(q.float()), self.feature_map_k(k.float())
        log_g = self.log_gate(hidden_states, pre)
        init = (stored["S"], stored["z"]) if stored is not None else None
        # what the math runs on: the current tokens, or the window buffer followed by them
        prefix, run = 0, dict(k=k, phi_k=kf, v=v, log_g=log_g, valid=valid)
        if self.window and state_layer is not None:
            # the buffer holds the W-1 newest keys of earlier calls (before the first write an
            # empty one, valid = 0, which adds nothing: then the prompt runs alone, the fast path)
            buf = stored if stored is not None else self._empty_buffers(B, k.device, k.dtype, v.dtype)
            cur = dict(run, valid=valid if valid is not None else torch.ones(B, T, dtype=torch.bool, device=k.device))
            seen = {n: None if cur[n] is None else torch.cat([buf[n].to(cur[n].dtype), cur[n]], dim=1) for n in cur}
            if stored is not None:
                prefix, run = self.window - 1, seen
        o, (S, z) = linear_attention(
            qf, run["phi_k"], run["v"], log_g=run["log_g"], initial_state=init, key_valid=run["valid"],
            window=self.window, q_sm=q, k_sm=run["k"], sm_scale=self.scaling, softcap=self.softcap,
            window_weight=self._window_weight(), prefix=prefix, eps=self.eps, chunk_size=self.chunk_size,
            state_in_place=getattr(state_layer, "updates_in_place", False),
        )
        if state_layer is not None:
            new = {"S": S.float(), "z": z.float()}
            if self.window:
                keep = slice(-(self.window - 1), None) if self.window > 1 else slice(0, 0)
                new.update({n: seen[n][:, keep] for n in ("k", "phi_k", "v")}, valid=seen["valid"][:, keep].float())
                new["log_g"] = (seen["log_g"][:, keep] if seen["log_g"] is not None
                                else torch.zeros_like(new["valid"], dtype=torch.float32))
            state_layer.write(T, **new)
        out = self.o_proj(o.reshape(B, T, -1).to(hidden_states.dtype))
        return out, None

    def _fused_decode(self, q, stored) -> bool:
        """A decode step (a stored state, few tokens, no gradients) of a Hedgehog layer without a window
        or per-channel gate runs one fused kernel: features, state update and readout."""
        return (stored is not None and not self.window and self.decay != "channel" and q.shape[1] <= DECODE_TOKENS
                and isinstance(self.feature_map_q, Hedgehog) and isinstance(self.feature_map_k, Hedgehog)
                and not (torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters()))
                and use_kernels(q))

    def _window_weight(self):
        return torch.exp(self.window_log_gamma.float()) if self.window else 1.0

    def _empty_buffers(self, B, device, k_dtype, v_dtype):
        W1, H = self.window - 1, self.num_heads
        gate_shape = (B, W1, H, self.feature_dim) if self.decay == "channel" else (B, W1, H)
        return {
            "k": torch.zeros(B, W1, H, self.head_dim, device=device, dtype=k_dtype),
            "phi_k": torch.zeros(B, W1, H, self.feature_dim, device=device),
            "v": torch.zeros(B, W1, H, self.head_dim, device=device, dtype=v_dtype),
            "log_g": torch.zeros(gate_shape, device=device),
            "valid": torch.zeros(B, W1, device=device),
        }


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


def run_segments(fn, hidden_states, position_embeddings, starts):
    """Packed rows (several documents in a row, see ``_segment_starts``): run
    ``fn(hidden, position_embeddings) -> output`` once on all the documents as a right-padded batch,
    one document per row, and put the outputs back in place. Right padding changes nothing before
    it (every form is causal and no state is kept), so no token sees another document; one batched
    call replaces a Python loop over documents."""
    B, T, _ = hidden_states.shape
    segs = [(b, a, e) for b, row in enumerate(starts) for a, e in zip(row, [*row[1:], T])]
    L = max(e - a for _, a, e in segs)
    gather = torch.zeros(len(segs), L, dtype=torch.long)  # padded slot -> flat position (pads read position 0)
    slot_ok = torch.zeros(len(segs), L, dtype=torch.bool)
    back = torch.empty(B * T, dtype=torch.long)  # flat position -> padded slot
    for i, (b, a, e) in enumerate(segs):
        gather[i, : e - a] = torch.arange(b * T + a, b * T + e)
        slot_ok[i, : e - a] = True
        back[b * T + a : b * T + e] = torch.arange(i * L, i * L + e - a)
    dev = hidden_states.device
    gather, slot_ok, back = gather.flatten().to(dev), slot_ok.flatten().to(dev), back.to(dev)

    def to_segments(x):  # (B or 1, T, ...) -> (N, L, ...); pad slots are zero
        x = x.expand(B, *x.shape[1:]).reshape(B * T, *x.shape[2:])
        return _MoveRows.apply(x, gather, slot_ok, back, None).view(len(segs), L, *x.shape[1:])

    pe = None if position_embeddings is None else tuple(to_segments(t) for t in position_embeddings)
    out = fn(to_segments(hidden_states), pe)
    out = _MoveRows.apply(out.reshape(len(segs) * L, *out.shape[2:]), back, None, gather, slot_ok)
    return out.view(B, T, *out.shape[1:])


class _MoveRows(torch.autograd.Function):
    """``y = x[src]`` (rows where ``src_ok`` is False set to zero) when every kept row of x lands in
    exactly one row of y, and ``dst`` is the inverse map (``dst_ok`` marks the rows of x that are
    kept). Both directions are plain gathers: the backward is ``dy[dst]``, not the accumulating
    scatter that autograd would use for ``x[src]`` (which dominated packed training steps)."""

    @staticmethod
    def forward(ctx, x, src, src_ok, dst, dst_ok):
        ctx.save_for_backward(dst, dst_ok)
        return _rows(x, src, src_ok)

    @staticmethod
    def backward(ctx, dy):
        dst, dst_ok = ctx.saved_tensors
        return _rows(dy.contiguous(), dst, dst_ok), None, None, None, None


def _rows(x, index, ok):
    y = x.index_select(0, index)
    if ok is not None:
        y = torch.where(ok.view(-1, *[1] * (x.dim() - 1)), y, 0)
    return y


# what the converted model's forward hands its layers (found once per call, see modeling_linearize)
PACKED_KWARG = "linearize_packed_starts"
NO_PADDING_KWARG = "linearize_no_padding"


def layer_validity(attention_mask, B: int, T: int, state_layer, kwargs) -> torch.Tensor | None:
    """``token_validity`` unless the model's forward said the call has no padding."""
    if kwargs is not None and kwargs.get(NO_PADDING_KWARG):
        return None
    return token_validity(attention_mask, B, T, offset=None if state_layer is None else state_layer.mask_offset())


def packed_starts(state_layer, valid, position_ids, B: int, T: int, kwargs=None) -> list[list[int]] | None:
    """The document offsets of each row when a call without cache or padding packs several
    documents in a row (see ``_segment_starts``), else None. A converted model's forward finds them
    once for all layers (``document_starts``) and passes them in ``kwargs``; a layer called on its
    own finds them itself. With a stored state it reads nothing on the host: the decode step stays
    free of CPU-GPU syncs (compiled / CUDA-graph capture)."""
    if state_layer is not None:
        return None
    if kwargs is not None and PACKED_KWARG in kwargs:
        return kwargs[PACKED_KWARG]
    if valid is not None and not bool(valid.all()):
        return None
    return _segment_starts(position_ids, B, T)


def document_starts(position_ids, attention_mask, cache) -> list[list[int]] | None:
    """``packed_starts`` for a whole model call: None (no host read) with a cache or without explicit
    position ids, so plain training and compiled decoding stay one graph; else one host read."""
    if cache is not None or position_ids is None or position_ids.dim() != 2:
        return None
    B, T = position_ids.shape
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        return None  # padding: the layers read it from the mask, no packing
    return _segment_starts(position_ids, B, T)


def _segment_starts(position_ids, B: int, T: int) -> list[list[int]] | None:
    """Per row, the offsets where position ids restart at 0 (packed documents), or None if no row
    holds more than one document."""
    if position_ids is None or T < 2 or position_ids.shape[-1] != T:
        return None
    restart = position_ids.expand(B, T)[:, 1:] == 0
    if not bool(restart.any()):
        return None
    return [[0] + (torch.nonzero(r).flatten() + 1).tolist() for r in restart]


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
