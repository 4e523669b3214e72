"""Converted self-attention for bidirectional encoders (BERT, RoBERTa, XLM-R, ModernBERT).

Two layers, both built from the original attention module, reusing its q/k/v (and output)
projections by reference, with the original kept reachable for ``unlinearize`` and as the
attention-transfer target:

- ``Linformer``: keys and values projected along the sequence axis by learned ``E, F`` (k, n):
  ``softmax(Q (E K)^T * scale) (F V)``, O(n k). The real tokens of each row are moved to the front
  before the projection, so column j of E always meets the j-th real token and padding never enters
  the projected keys or values: a padded batch gives what each input gives alone. A shorter input
  uses the first L columns of E, F; projected rows with no weight on any real token are masked out
  of the softmax (they would otherwise be zero keys that take softmax mass). An input of at most k
  real tokens attends exactly (``LinformerConfig.exact_short``): its L^2 costs no more than L k.
- ``EncoderLinearAttention``: ``phi(Q) (phi(K)^T V) / (phi(Q) sum_j phi(k_j) + eps)`` over the real
  keys, with any registered feature map. No state, no cache. With Hedgehog's maps, in inference and
  with the kernels on (``_fast_features``), two Triton kernels compute it with the maps inside
  (``kernels/linear_attn/bidirectional.py``); training and the other maps run the PyTorch math.

Tensors are (B, T, H, D) as in the decoder layers.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from .config import EncoderLinearAttentionConfig, LinformerConfig
from .feature_maps import build_feature_map
from .layers import ConvertedAttention, token_validity


class EncoderAttention(ConvertedAttention):
    """What both encoder layers share: the reused projections, q/k/v (with RoPE where the model
    has it), padding from the attention mask, and the modes of ``ConvertedAttention``.

    The forward takes what the original self-attention takes (BERT: hidden states and the mask;
    ModernBERT: also ``position_embeddings``) and returns ``(output, None)`` like it.
    """

    def __init__(self, attn: nn.Module, spec, layer_idx: int):
        super().__init__()
        mcfg = attn.config
        self.spec, self.layer_idx = spec, layer_idx
        self.num_heads = mcfg.num_attention_heads
        self.head_dim = getattr(attn, "head_dim", None) or attn.attention_head_size
        self.scaling = getattr(attn, "scaling", None) or self.head_dim**-0.5
        for name in spec.projections:
            self.add_module(name, getattr(attn, name))
        self._rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb if spec.rope else None
        object.__setattr__(self, "_original", attn)

    def project(self, hidden_states, position_embeddings=None):
        """hidden (B, T, hidden) -> q, k, v (B, T, H, D), RoPE applied as the original does."""
        B, T, _ = hidden_states.shape
        H, D = self.num_heads, self.head_dim
        if len(self.spec.qkv) == 1:  # fused q|k|v (modernbert: viewed as (B, T, 3, H, D))
            q, k, v = getattr(self, self.spec.qkv[0])(hidden_states).view(B, T, 3, H, D).unbind(2)
        else:
            q, k, v = (getattr(self, n)(hidden_states).view(B, T, H, D) for n in self.spec.qkv)
        if self._rope is not None:
            cos, sin = position_embeddings
            q, k = self._rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        return q, k, v

    def finish(self, o: torch.Tensor, dtype) -> torch.Tensor:
        """o (B, T, H, D) -> (B, T, H * D), through the output projection when it lives here."""
        o = o.reshape(*o.shape[:2], -1).to(dtype)
        return getattr(self, self.spec.out_proj)(o) if self.spec.out_proj else o

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, **kwargs):
        if self.mode == "linear":
            return self._linear_forward(hidden_states, position_embeddings, attention_mask)
        valid = token_validity(attention_mask, *hidden_states.shape[:2])

        def mse(own, target):  # pad rows are junk in both: the loss reads the real tokens only
            err = (own.float() - target.float()).pow(2).mean(-1)
            return err.mean() if valid is None else err[valid].mean()

        return self._other_modes(lambda: self._teacher(hidden_states, position_embeddings, attention_mask, **kwargs),
                                 lambda: self._linear_forward(hidden_states, position_embeddings, attention_mask), mse)

    def _teacher(self, hidden_states, position_embeddings, attention_mask, **kwargs):
        for name in ("past_key_values", "cache"):  # an encoder keeps no cache (the name by version)
            kwargs.pop(name, None)
        if self.spec.rope:
            kwargs["position_embeddings"] = position_embeddings
        return self._original(hidden_states, attention_mask=attention_mask, **kwargs)

    @staticmethod
    def key_validity(attention_mask, B: int, T: int):
        """(B, T) bool of real tokens, or None when every token is real. Under ``torch.compile`` the
        mask is taken as it is (a mask of ones gives the same result as none): asking whether every
        token is real reads a value on the host, which breaks the graph in every layer."""
        valid = token_validity(attention_mask, B, T)
        if valid is None or torch.compiler.is_compiling():
            return valid
        return None if bool(valid.all()) else valid


class Linformer(EncoderAttention):
    def __init__(self, attn: nn.Module, config: LinformerConfig, spec, layer_idx: int):
        super().__init__(attn, spec, layer_idx)
        n = config.max_length or attn.config.max_position_embeddings
        if config.k > n:
            raise ValueError(f"Linformer k={config.k} is larger than the longest input n={n}: choose k <= {n}")
        self.k, self.max_length, self.sharing = config.k, n, config.sharing
        self.exact_short = config.exact_short
        heads = self.num_heads if config.sharing == "head" else 1
        weight = getattr(attn, spec.qkv[0]).weight
        # start as block means: projected row i is the mean of the keys (values) of positions
        # [i n/k, (i+1) n/k), so the pretrained attention is roughly kept; the rows then train freely
        block = torch.div(torch.arange(n) * config.k, n, rounding_mode="floor")  # row of each position
        pool = (block[None, :] == torch.arange(config.k)[:, None]).float()
        pool = (pool / pool.sum(-1, keepdim=True)).expand(heads, -1, -1).clone()
        self.proj_e = nn.Parameter(pool.to(device=weight.device, dtype=weight.dtype))
        if config.sharing in ("head", "layer"):
            self.proj_f = nn.Parameter(pool.clone().to(device=weight.device, dtype=weight.dtype))

    @staticmethod
    def tie_shared(modules: dict[int, "Linformer"]) -> None:
        """sharing="model": every converted layer uses the first one's matrix. It is registered in
        that layer only (saved once); the others reach it through the owning module, which stays
        the same object when from_pretrained replaces parameters."""
        layers = sorted(modules)
        if not layers or modules[layers[0]].sharing != "model":
            return
        owner = modules[layers[0]]
        for i in layers[1:]:
            del modules[i].proj_e
            object.__setattr__(modules[i], "_owner", owner)

    def projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """E, F: (H or 1, k, n)."""
        owner = getattr(self, "_owner", self)
        e = owner.proj_e
        return e, getattr(owner, "proj_f", e)

    def _linear_forward(self, hidden_states, position_embeddings=None, attention_mask=None, *_, **__):
        B, T, _ = hidden_states.shape
        # compiled: no value is read on the host (each read breaks the graph and waits for the GPU):
        # a padded batch keeps all T columns, and the row mask and the short rows' exact attention
        # are applied whether or not they change anything
        static = torch.compiler.is_compiling()
        valid = self.key_validity(attention_mask, B, T)
        q, k, v = self.project(hidden_states, position_embeddings)
        lengths = None
        if valid is not None:
            # real tokens first, in order (a stable sort of the pad flags), pads zeroed: they add
            # nothing to E K and F V, and real token j always meets column j
            order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices
            lengths = valid.sum(1)  # (B,)
            # eager: only the longest row's real tokens (a padded batch past n still fits if its rows do)
            L = T if static and T <= self.max_length else int(lengths.max())
            order, keep = order[:, :L], valid.gather(1, order[:, :L])
            k = k.gather(1, order[:, :, None, None].expand(-1, -1, *k.shape[2:])) * keep[:, :, None, None]
            v = v.gather(1, order[:, :, None, None].expand(-1, -1, *v.shape[2:])) * keep[:, :, None, None]
        L = k.shape[1]
        if self.exact_short and L <= self.k:  # every input short: the original attention, at O(L^2) <= O(L k)
            return self.finish(self._exact(q, k, v, lengths), hidden_states.dtype), None
        if L > self.max_length:
            raise ValueError(
                f"an input of {L} tokens is longer than this Linformer layer's n={self.max_length} (the columns of its "
                "projections E, F): truncate inputs to that length or convert with a larger LinformerConfig.max_length"
            )
        e, f = self.projections()
        e, f = e[..., :L].to(k.dtype), f[..., :L].to(v.dtype)  # a shorter input uses the first L columns
        if e.shape[0] == 1:  # shared by the heads: (k, L) @ (B, L, H*D), no (B, H, L, D) copy of k and v
            pk, pv = (torch.matmul(m[0], x.reshape(B, L, -1)).view(B, m.shape[1], *x.shape[2:]).transpose(1, 2)
                      for m, x in ((e, k), (f, v)))
        else:  # (H, k, L) @ (B, H, L, D) -> (B, H, k, D): one batched GEMM, E broadcast over the batch
            pk, pv = torch.matmul(e, k.transpose(1, 2)), torch.matmul(f, v.transpose(1, 2))
        mask = self._row_mask(e, f, L, lengths, static)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), pk, pv, attn_mask=mask, scale=self.scaling).transpose(1, 2)
        if self.exact_short and lengths is not None and (static or bool((lengths <= self.k).any())):
            # a padded batch mixing short and long inputs: each short row attends exactly over its
            # real tokens, which the sort put within the first k positions
            short = (lengths <= self.k)[:, None, None, None]
            o = torch.where(short, self._exact(q, k[:, :self.k], v[:, :self.k], lengths), o)
        return self.finish(o, hidden_states.dtype), None

    def _exact(self, q, k, v, lengths):
        """Softmax attention of every query over the first ``lengths[b]`` keys of its row (all of
        them when ``lengths`` is None): (B, T, H, D). A row with no real token keeps one key, so its
        (junk, like every pad query's) output stays finite."""
        mask = None
        if lengths is not None:
            n = torch.arange(k.shape[1], device=k.device)
            mask = (n[None, :] < lengths.clamp_min(1)[:, None])[:, None, None, :]  # (B, 1, 1, L)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                           scale=self.scaling)
        return o.transpose(1, 2)

    def _row_mask(self, e, f, L, lengths, static=False):
        """(B or 1, H or 1, 1, k) bool: projected rows that see at least one real token, or None
        when all do (``static``: the mask always, without reading it on the host). Row i of a
        length-l input sees a real token iff E[i, :l] (or F) has a non-zero."""
        nz = (e != 0) | (f != 0)  # (H|1, k, L)
        first = torch.where(nz.any(-1), nz.float().argmax(-1), torch.full(nz.shape[:2], L, device=nz.device))
        if lengths is None:
            lengths = torch.full((1,), L, device=nz.device)
        rows = first[None] < lengths.to(first.device)[:, None, None]  # (B|1, H|1, k)
        return rows[:, :, None, :] if static or not bool(rows.all()) else None


class EncoderLinearAttention(EncoderAttention):
    def __init__(self, attn: nn.Module, config: EncoderLinearAttentionConfig, spec, layer_idx: int):
        super().__init__(attn, spec, layer_idx)
        fm = dict(num_heads=self.num_heads, head_dim=self.head_dim, feature_dim=config.feature_dim,
                  seed=config.seed + layer_idx)
        self.feature_map_q = build_feature_map(config.feature_map, **fm)
        self.feature_map_k = build_feature_map(config.feature_map, **fm)
        self.feature_dim = self.feature_map_q.feature_dim
        self.eps = config.eps
        weight = getattr(attn, spec.qkv[0]).weight
        self.to(device=weight.device, dtype=weight.dtype)

    def _linear_forward(self, hidden_states, position_embeddings=None, attention_mask=None, *_, **__):
        B, T, _ = hidden_states.shape
        valid = self.key_validity(attention_mask, B, T)
        q, k, v = self.project(hidden_states, position_embeddings)
        if self._fast_features(q):  # inference on the kernels: the maps inside, no feature tensor in memory
            from linearize.kernels.linear_attn import bidirectional_hedgehog

            o = bidirectional_hedgehog(q, k, v, self.feature_map_q.weight, self.feature_map_k.weight, valid, self.eps)
            return self.finish(o, hidden_states.dtype), None
        # features in the activation dtype (a softmax feature map accumulates in float32 inside),
        # the sums over the sequence as GEMMs with float32 accumulation (tensor cores in bf16)
        qf, kf = self.feature_map_q(q), self.feature_map_k(k)  # (B, T, H, F)
        if valid is not None:  # a pad key adds nothing to the sums
            kf = kf * valid[:, :, None, None].to(kf.dtype)
        qh = qf.transpose(1, 2)  # (B, H, T, F)
        kv = torch.matmul(kf.permute(0, 2, 3, 1), v.to(kf.dtype).transpose(1, 2))  # (B, H, F, D)
        k_sum = kf.sum(1, dtype=torch.float32).to(kf.dtype)[..., None]  # (B, H, F, 1)
        num, den = torch.matmul(qh, kv).float(), torch.matmul(qh, k_sum).float() + self.eps
        return self.finish((num / den).transpose(1, 2), hidden_states.dtype), None
