"""A transformers ``Cache`` whose converted layers hold a constant-size recurrent state.

Softmax layers (in a layer-level hybrid) keep the cache layer the model would have given them
(``DynamicCache(config)``'s choice). Converted layers get a ``LinearAttentionState``: the
transformers ``LinearAttentionLayer`` holding

    0: S      (B, H, F, Dv) float32   sum of phi(k)^T v over the keys before the window
    1: z      (B, H, F)     float32   sum of phi(k) (the normalizer)
   and, for a sliding-window hybrid (window W), a ring buffer of the newest W-1 keys, the token at
   position p (counting every token the layer has seen, padding included) in slot p mod (W-1), so a
   decode step overwrites the slot of the key that leaves the window, in place (the layer reads p
   from its token counter: a device tensor in the static cache):
    2: k      (B, W-1, H, D)    raw keys for the softmax part
    3: phi(k) (B, W-1, H, F)    their features, folded into S when they leave the window
    4: v      (B, W-1, H, Dv)
    5: log_g  (B, W-1, H[, F])  their decay gates (zeros without a gate)
    6: valid  (B, W-1)          1.0 for real tokens, 0.0 for padding / not yet filled
   and, with attention sinks (``sinks`` S), the row's first S real tokens, which every later query
   attends beside its window:
    7: sink_k (B, S, H, D)      their raw keys
    8: sink_v (B, S, H, Dv)
    9: sink_at (B, S)           their positions (float32), -1.0 while a slot is empty

A Gated DeltaNet layer keeps its state S (B, H, K, V) float32 (its short conv's inputs in the conv
state); beside a softmax window W it also keeps the newest W-1 keys and values in time order (empty
slots in front), their validity, and, with sinks, the sink tensors above:
    0: S      1: k (B, W-1, H, D)    2: v (B, W-1, H, Dv)    3: valid (B, W-1)    [4-6: sink_k, sink_v, sink_at]

All shapes are fixed, so memory does not grow with the sequence length, and beam search reorders
every state through ``LinearAttentionLayer.reorder_cache``.

``StaticLinearizeCache`` is the graph-friendly variant for fast decoding: its tensors are allocated
once (at the prefill) and afterwards only updated in place, and the token count is a device tensor,
so a decode step has fixed shapes and addresses and can be compiled / captured in a CUDA graph.
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, LinearAttentionLayer, StaticLayer
from transformers.generation import GenerationMixin

# the keyword models, attention modules and generate() take the cache under: transformers 5.24
# renamed ``past_key_values`` to ``cache`` (the old name still reaches a model, with a warning)
CACHE_KWARG = ("cache" if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
               else "past_key_values")

STATE_NAMES = ("S", "z", "k", "phi_k", "v", "log_g", "valid")  # a window hybrid's; Gated DeltaNet keeps ("S",)
GDN_WINDOW_NAMES = ("S", "k", "v", "valid")  # Gated DeltaNet with a window: the newest W-1 keys, time-ordered
SINK_NAMES = ("sink_k", "sink_v", "sink_at")  # a window hybrid with attention sinks keeps these too

_CROP_MESSAGE = (
    "A linear-attention state cannot be rolled back to an earlier token, so assisted / speculative "
    "decoding and other generation modes that crop the cache are not supported by converted layers. "
    "Use greedy, sampling or beam search."
)
_REPEAT_MESSAGE = "StaticLinearizeCache keeps a fixed batch size; build it with the expanded batch size instead"
_SELECT_MESSAGE = "StaticLinearizeCache keeps a fixed batch size; build a new one for a different selection of rows"


class LinearAttentionState(LinearAttentionLayer):
    # python-int token counter and lazily sized states: keep generate() from auto-compiling
    is_compileable = False
    is_sliding = False

    def __init__(self, names: tuple[str, ...] = ("S", "z")):
        super().__init__(number_of_states=len(names))
        self.names = names
        self.seen_tokens = 0
        # a window hybrid with sinks: every row's sink slots were filled by a multi-token call (read on
        # the host there), so its decode steps need not fill them (the fused decode kernel then runs)
        self.sinks_full = False

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

    def mask_offset(self):
        """The mask column of the first current token, or None: the last ``q_len`` columns."""
        return None

    def reset(self) -> None:
        super().reset()
        self.seen_tokens = 0
        self.sinks_full = False

    @property
    def is_croppable(self) -> bool:
        return False

    def crop(self, tokens_to_remove: int):
        raise NotImplementedError(_CROP_MESSAGE)

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


def _is_compiling() -> bool:
    return torch.compiler.is_compiling()


def _mark_static(t: torch.Tensor) -> None:
    # tells dynamo (and CUDA graphs) that this tensor keeps its address; not allowed while tracing,
    # and the allocation happens at the prefill, which is never compiled
    if not _is_compiling():
        torch._dynamo.mark_static_address(t)


class StaticLinearAttentionState(LinearAttentionState):
    """A converted layer's state for ``StaticLinearizeCache``: same states as ``LinearAttentionState``,
    allocated once at the first write (the prefill) and then only updated in place (``copy_``), with
    the token count kept in a 0-dim int64 tensor ``cumulative_length`` advanced by ``add_``. Nothing
    that changes per decode step lives in a Python attribute, so a compiled / CUDA-graph decode step
    neither recompiles nor goes stale."""

    is_compileable = True
    updates_in_place = True  # a decode kernel may advance the stored state itself (no copy in and out)

    def __init__(self, names: tuple[str, ...], max_cache_len: int, max_batch_size: int, device=None,
                 counter: list | None = None, advances: bool = True):
        # the token counter lives in a one-element list that the converted layers of one cache share:
        # they all hold the same count, so only the last of them (``advances``) adds the step's tokens
        # (one kernel a step instead of one per layer; each layer reads it before that add)
        self._counter = counter if counter is not None else [torch.zeros((), dtype=torch.int64, device=device)]
        self.advances = advances
        super().__init__(names)
        self.max_cache_len = max_cache_len
        self.max_batch_size = max_batch_size
        self.is_initialized = False  # storage allocated (stays True after reset(): the storage is kept)

    @property
    def cumulative_length(self) -> torch.Tensor:
        return self._counter[0]

    @cumulative_length.setter
    def cumulative_length(self, value: torch.Tensor) -> None:
        self._counter[0] = value

    # -- storage ----------------------------------------------------------------------------------
    def _allocate_counter(self, device) -> None:
        if not self.is_initialized:
            self.cumulative_length = self.cumulative_length.to(device)
            _mark_static(self.cumulative_length)
            self.is_initialized = True

    def check_batch(self, batch_size: int) -> None:
        """Python-only checks (shapes, no device read), run outside compiled code."""
        if batch_size > self.max_batch_size:
            raise ValueError(
                f"a batch of {batch_size} rows does not fit this StaticLinearizeCache (max_batch_size="
                f"{self.max_batch_size}); build it with max_batch_size >= {batch_size} (batch size x num_beams)"
            )
        allocated = getattr(self, "batch_size", None)
        if allocated is not None and batch_size != allocated:
            raise ValueError(
                f"this StaticLinearizeCache holds states for a batch of {allocated} rows, got {batch_size}: "
                "build a new StaticLinearizeCache for a different batch size"
            )

    def _alloc(self, store: dict, initialized: dict, idx: int, shape, dtype, device) -> None:
        if not _is_compiling():
            self.check_batch(shape[0])
        store[idx] = torch.zeros(shape, dtype=dtype, device=device)
        _mark_static(store[idx])
        initialized[idx] = True
        self.batch_size = shape[0]
        if self.device is None:
            self.device, self.dtype = device, dtype
        self._allocate_counter(device)

    def _store(self, store: dict, initialized: dict, idx: int, value: torch.Tensor) -> None:
        if not initialized[idx]:
            self._alloc(store, initialized, idx, value.shape, value.dtype, value.device)
        if store[idx] is not value:  # a decode kernel that advanced the storage itself needs no copy
            store[idx].copy_(value)

    def write(self, num_new_tokens: int, **states: torch.Tensor) -> None:
        if not _is_compiling():
            self.check_batch(states[self.names[0]].shape[0])
            if num_new_tokens > self.max_cache_len:
                raise ValueError(
                    f"{num_new_tokens} tokens do not fit this StaticLinearizeCache (max_cache_len={self.max_cache_len}); "
                    "build it with max_cache_len >= prompt length + max_new_tokens"
                )
        for i, name in enumerate(self.names):
            self._store(self.recurrent_states, self.is_recurrent_states_initialized, i, states[name])
            self.has_previous_state[i] = True
        if self.advances:
            self.cumulative_length.add_(num_new_tokens)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        self._store(self.recurrent_states, self.is_recurrent_states_initialized, state_idx, recurrent_states)
        return self.recurrent_states[state_idx]

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, conv_kernel_size: int | None = None,
                          **kwargs) -> torch.Tensor:
        """Keep the last ``conv_kernel_size`` conv inputs, in place; return them with the new ones
        (at the prefill: the new ones, left-padded with zeros to the kernel size when shorter)."""
        if not self.is_conv_states_initialized[state_idx]:
            size = conv_states.shape[-1] if conv_kernel_size is None else conv_kernel_size
            self.conv_kernel_size[state_idx] = size
            self._alloc(self.conv_states, self.is_conv_states_initialized, state_idx,
                        (*conv_states.shape[:-1], size), conv_states.dtype, conv_states.device)
        size = self.conv_kernel_size[state_idx]
        if self.has_previous_state[state_idx]:
            full = torch.cat([self.conv_states[state_idx], conv_states], dim=-1)
        else:
            full = conv_states
            if full.shape[-1] < size:
                full = torch.nn.functional.pad(full, (size - full.shape[-1], 0))
            self.has_previous_state[state_idx] = True
        self.conv_states[state_idx].copy_(full[..., -size:])
        return full

    # -- what the model asks ----------------------------------------------------------------------
    def get_seq_length(self):
        """The tokens seen so far: a 0-dim tensor once allocated (as transformers' StaticLayer), else 0."""
        return self.cumulative_length if self.is_initialized else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # a fixed-size mask like transformers' StaticLayer: one mask serves softmax and converted layers
        return self.max_cache_len, 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def mask_offset(self):
        # the current tokens sit at mask columns cumulative_length + arange(q)
        return self.cumulative_length

    # -- cache management -------------------------------------------------------------------------
    def reset(self) -> None:
        """Empty every state in place (the storage and its addresses are kept): zeros, and -1 in the
        sinks' positions (an empty slot; 0 would read as a sink filled at position 0, which a captured
        prefill replaying over this cache, as PrefillGraph does, would attend)."""
        LinearAttentionLayer.reset(self)
        self.cumulative_length.zero_()
        if "sink_at" in self.names and self.is_recurrent_states_initialized[self.names.index("sink_at")]:
            self.recurrent_states[self.names.index("sink_at")].fill_(-1.0)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: reorder the batch rows in place (index_select, then copy_ back)."""
        for store in (self.conv_states, self.recurrent_states):
            for t in store.values():
                if t is not None:
                    t.copy_(t.index_select(0, beam_idx.to(t.device)))

    def activate_past_recording(self):
        raise NotImplementedError(_CROP_MESSAGE)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError(_REPEAT_MESSAGE)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError(_SELECT_MESSAGE)


class StaticKVLayer(StaticLayer):
    """transformers' ``StaticLayer`` for the softmax layers of a layer-level hybrid, with a beam-search
    reorder that keeps the storage (the stock one reassigns the tensors and reads the length on the host)."""

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            idx = beam_idx.to(self.keys.device)
            self.keys.copy_(self.keys.index_select(0, idx))
            self.values.copy_(self.values.index_select(0, idx))

    def crop(self, tokens_to_remove: int):
        raise NotImplementedError(_CROP_MESSAGE)


def _state_names(conv: dict) -> tuple[str, ...]:
    if conv.get("method") == "gdn":  # S (B, H, K, V); the short conv state rides in conv_states[0]
        if conv.get("window"):
            return GDN_WINDOW_NAMES + (SINK_NAMES if conv.get("sinks") else ())
        return ("S",)
    if conv.get("window"):
        return STATE_NAMES + (SINK_NAMES if conv.get("sinks") else ())
    return ("S", "z")


def _conversion(config, who: str) -> dict:
    conv = getattr(config, "linearize", None)
    if not conv:
        raise ValueError(f"{who} needs the config of a converted model (it has no `linearize` entry)")
    return conv


class LinearizeCache(Cache):
    """The cache of a converted model: pass it as ``past_key_values`` or let ``generate()`` build it.

    Args:
        config: the converted model's config (it carries ``config.linearize``).
    """

    def __init__(self, config):
        conv = _conversion(config, "LinearizeCache")
        text_config = config.get_text_config(decoder=True)
        n = text_config.num_hidden_layers
        layers = list(DynamicCache(config=text_config).layers)
        layers += [DynamicLayer() for _ in range(n - len(layers))]
        names = _state_names(conv)
        for i in conv["layers"]:
            layers[i] = LinearAttentionState(names)
        super().__init__(layers=layers)
        # no softmax layer reads keys from the past: the mask need only cover the current tokens
        self.all_linear = all(isinstance(layer, LinearAttentionState) for layer in self.layers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if layer_idx >= len(self.layers):
            return 0
        return self.layers[layer_idx].get_seq_length()

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        if layer_idx >= len(self.layers):
            return query_length, 0
        if self.all_linear:
            # the layers read only whether each current token is real (the mask's diagonal): a
            # (query x query) mask over the current columns keeps a long prompt fed in chunks, and
            # every decode step, from building a mask that grows with everything seen before
            return query_length, self.layers[layer_idx].get_seq_length()
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


class StaticLinearizeCache(LinearizeCache):
    """A fixed-size, graph-friendly cache of a converted model, for fast decoding.

    Every tensor is allocated once, at the prefill, and afterwards updated in place, and the token
    count is a device tensor, so a decode step has static shapes and addresses: transformers can
    ``torch.compile`` it (``mode="reduce-overhead"``: CUDA graphs) and it can be captured with
    ``torch.cuda.graph``. Converted layers hold their constant-size state; the softmax layers of a
    layer-level hybrid get transformers' ``StaticLayer`` (a KV buffer of ``max_cache_len`` tokens).
    ``generate(..., cache_implementation="static")`` builds one; or pass it as ``past_key_values``.

    Args:
        config: the converted model's config.
        max_batch_size: the largest batch it will see (batch size x num_beams in ``generate``); the
            states are allocated for the batch of the prefill.
        max_cache_len: the most tokens (prompt + generated) it will hold. It sizes the attention mask
            (and the softmax layers' KV buffers), not the converted layers' states.
        device: where the token counter starts (the model's device); the states take the device and
            dtype of the first write.
        dtype: the model's dtype (kept for reference; the states take the dtype of the first write:
            float32 recurrent states, the model's dtype for the window hybrid's key/value buffer).
    """

    def __init__(self, config, max_batch_size: int, max_cache_len: int, device=None, dtype=None):
        conv = _conversion(config, "StaticLinearizeCache")
        for name, value in (("max_batch_size", max_batch_size), ("max_cache_len", max_cache_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"StaticLinearizeCache needs a positive int {name}, got {value!r}")
        self._max_batch_size, self._max_cache_len = max_batch_size, max_cache_len
        self.device = None if device is None else torch.device(device)
        self.dtype = dtype
        n = config.get_text_config(decoder=True).num_hidden_layers
        names, converted = _state_names(conv), set(conv["layers"])
        counter = [torch.zeros((), dtype=torch.int64, device=device)]  # shared by the converted layers
        layers = []
        for i in range(n):
            if i in converted:
                layers.append(StaticLinearAttentionState(names, max_cache_len, max_batch_size, device=device,
                                                         counter=counter, advances=i == max(converted)))
            else:
                layer = StaticKVLayer(max_cache_len)
                if device is not None:
                    layer.cumulative_length = layer.cumulative_length.to(device)
                layers.append(layer)
        Cache.__init__(self, layers=layers)

    # properties, not attributes: transformers 5.17's Cache defines deprecated read-only ones of these names
    @property
    def max_batch_size(self) -> int:
        return self._max_batch_size

    @property
    def max_cache_len(self) -> int:
        return self._max_cache_len

    @property
    def is_compileable(self) -> bool:
        return True

    @property
    def is_croppable(self) -> bool:
        return False

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._max_cache_len, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self._max_cache_len

    def check_inputs(self, batch_size: int, num_tokens: int) -> None:
        """Clear errors before a forward that would not fit (Python checks; reads the token count from
        the device only for a multi-token call on a cache that already holds tokens, never in decode)."""
        for layer in self.layers:
            if isinstance(layer, StaticLinearAttentionState):
                layer.check_batch(batch_size)
            elif batch_size > self._max_batch_size or (layer.is_initialized and batch_size != layer.keys.shape[0]):
                raise ValueError(
                    f"a batch of {batch_size} rows does not fit this StaticLinearizeCache (max_batch_size="
                    f"{self._max_batch_size}, allocated for {layer.keys.shape[0] if layer.is_initialized else 'none yet'}); "
                    "build a StaticLinearizeCache with max_batch_size >= batch size x num_beams"
                )
        seen = 0
        if num_tokens > 1 and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            # (a chunk captured by linearize.PrefillGraph reads nothing on the host: it checks its own sizes)
            counter = self.layers[0].get_seq_length() if self.layers else 0
            seen = int(counter)  # a multi-token call (prefill / chunk): one host read is fine here
        if seen + num_tokens > self._max_cache_len:
            raise ValueError(
                f"{seen} cached + {num_tokens} new tokens do not fit this StaticLinearizeCache (max_cache_len="
                f"{self._max_cache_len}); build it with max_cache_len >= prompt length + max_new_tokens "
                "(generate() sizes it from max_length)"
            )

    def crop(self, tokens_to_remove: int):
        raise NotImplementedError(_CROP_MESSAGE)

    def batch_repeat_interleave(self, repeats: int):
        raise NotImplementedError(_REPEAT_MESSAGE)

    def batch_select_indices(self, indices: torch.Tensor):
        raise NotImplementedError(_SELECT_MESSAGE)
