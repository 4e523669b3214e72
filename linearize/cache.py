"""A transformers ``Cache`` whose converted layers hold a constant-size recurrent state.

Softmax layers (in a layer-level hybrid) keep the cache layer the model would have given them
(``DynamicCache(config)``'s choice). Converted layers get a ``LinearAttentionState``: the
transformers ``LinearAttentionLayer`` holding

    0: S      (B, H, F, Dv) float32   sum of phi(k)^T v over the keys before the window
    1: z      (B, H, F)     float32   sum of phi(k) (the normalizer)
   and, for a sliding-window hybrid (window W), a fixed-size buffer of the newest W-1 keys:
    2: k      (B, W-1, H, D)    raw keys for the softmax part
    3: phi(k) (B, W-1, H, F)    their features, folded into S when they leave the window
    4: v      (B, W-1, H, Dv)
    5: log_g  (B, W-1, H[, F])  their decay gates (zeros without a gate)
    6: valid  (B, W-1)          1.0 for real tokens, 0.0 for padding / not yet filled

All shapes are fixed, so memory does not grow with the sequence length, and beam search reorders
every state through ``LinearAttentionLayer.reorder_cache``.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, LinearAttentionLayer

STATE_NAMES = ("S", "z", "k", "phi_k", "v", "log_g", "valid")  # a window hybrid's; Gated DeltaNet keeps ("S",)


class LinearAttentionState(LinearAttentionLayer):
    # python-int token counter and lazily sized states: keep generate() from auto-compiling
    is_compileable = False
    is_sliding = False

    def __init__(self, names: tuple[str, ...] = ("S", "z")):
        super().__init__(number_of_states=len(names))
        self.names = names
        self.seen_tokens = 0

    def read(self) -> dict[str, torch.Tensor] | None:
        """The stored tensors by name, or None before the first write."""
        if not self.has_previous_state[0]:
            return None
        return {name: self.recurrent_states[i] for i, name in enumerate(self.names)}

    def write(self, num_new_tokens: int, **states: torch.Tensor) -> None:
        for i, name in enumerate(self.names):
            self.update_recurrent_state(states[name], state_idx=i)
            # there is no conv state, which is what normally sets this flag (see DESIGN.md)
            self.has_previous_state[i] = True
        self.seen_tokens += num_new_tokens

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # behave like a full-attention layer so the model builds an ordinary causal mask, from
        # which the layer reads which tokens are padding
        return self.seen_tokens + query_length, 0

    def reset(self) -> None:
        super().reset()
        self.seen_tokens = 0

    @property
    def is_croppable(self) -> bool:
        return False

    def crop(self, tokens_to_remove: int):
        raise NotImplementedError(
            "A linear-attention state cannot be rolled back to an earlier token, so assisted / speculative "
            "decoding and other generation modes that crop the cache are not supported by converted layers. "
            "Use greedy, sampling or beam search."
        )

    def batch_repeat_interleave(self, repeats: int) -> None:
        for i in range(self.number_of_states):
            if self.is_recurrent_states_initialized[i]:
                self.recurrent_states[i] = self.recurrent_states[i].repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for i in range(self.number_of_states):
            if self.is_recurrent_states_initialized[i]:
                self.recurrent_states[i] = self.recurrent_states[i][indices, ...]

    def nbytes(self) -> int:
        states = [*self.recurrent_states.values(), *self.conv_states.values()]
        return sum(t.numel() * t.element_size() for t in states if t is not None)


class LinearizeCache(Cache):
    """The cache of a converted model: pass it as ``past_key_values`` or let ``generate()`` build it.

    Args:
        config: the converted model's config (it carries ``config.linearize``).
    """

    def __init__(self, config):
        conv = getattr(config, "linearize", None)
        if not conv:
            raise ValueError("LinearizeCache needs the config of a converted model (it has no `linearize` entry)")
        text_config = config.get_text_config(decoder=True)
        n = text_config.num_hidden_layers
        layers = list(DynamicCache(config=text_config).layers)
        layers += [DynamicLayer() for _ in range(n - len(layers))]
        if conv.get("method") == "gdn":
            names = ("S",)  # (B, H, K, V); the short conv state rides in conv_states[0]
        elif conv.get("window"):
            names = STATE_NAMES
        else:
            names = ("S", "z")
        for i in conv["layers"]:
            layers[i] = LinearAttentionState(names)
        super().__init__(layers=layers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if layer_idx >= len(self.layers):
            return 0
        return self.layers[layer_idx].get_seq_length()

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        if layer_idx >= len(self.layers):
            return query_length, 0
        return self.layers[layer_idx].get_mask_sizes(query_length)

    def nbytes(self, linear_only: bool = False) -> int:
        """Bytes held by the cache (optionally only by the converted layers)."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, LinearAttentionState):
                total += layer.nbytes()
            elif not linear_only:
                for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                    if t is not None:
                        total += t.numel() * t.element_size()
        return total
