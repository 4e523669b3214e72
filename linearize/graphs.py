"""One decode step captured in a CUDA graph: ``DecodeGraph(model, cache, batch_size).step(ids, pos)``.

A decode step of a small model is launch-bound: hundreds of small kernels whose Python and launch
overhead dwarfs their run time. Capturing the step once and replaying it removes that overhead.
This works when every tensor the step reads or writes keeps its address from step to step:
a converted model with ``linearize.StaticLinearizeCache`` (fixed-size states updated in place) or
an original model with transformers' ``StaticCache`` (a preallocated KV buffer and a tensor
position counter). A ``DynamicCache`` reallocates its keys every step and cannot be captured.

    cache = StaticLinearizeCache(model.config, max_batch_size=B, max_cache_len=T + new, device="cuda", dtype=bf16)
    model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)   # prefill (eager)
    graph = DecodeGraph(model, cache, batch_size=B)
    logits = graph.step(next_ids, next_pos)            # (B, vocab); next_ids, next_pos: (B, 1)

Limits:
  - no padding: the captured step has no attention mask, so every row must be a real token at
    every step. For padded batches use ``model.generate(..., cache_implementation="static")``.
  - the graph owns the cache while it is used: Python-side counters of the cache (token counts
    kept as ints) do not advance on replay; pass ``position_ids`` (the graph reads only those).
  - the returned logits are the graph's output buffer, overwritten by the next ``step``.
"""

from __future__ import annotations

import contextlib
import os
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

try:  # remote-code checkpoints may run without linearize.kernels: nothing to launch with PDL then
    from linearize.kernels.pdl import default as _pdl_default
except Exception:
    _pdl_default = contextlib.nullcontext

__all__ = ["CacheSnapshot", "DecodeGraph", "HostReads", "PrefillGraph"]

_SCALARS = (bool, int, float)


class CacheSnapshot:
    """The values of every tensor and Python scalar a cache holds, to put back in place later.

    Walks the cache object and each of its layers generically (attributes, and the dicts, lists and
    tuples inside them), so it covers transformers' layers and ours without knowing their fields.
    Tensors are restored *in place* (``copy_``), keeping their addresses, which is what a captured
    graph needs. Exception, to avoid copying a whole KV cache: a non-sliding transformers
    ``StaticLayer`` only appends at ``cumulative_length``; restoring that counter is enough,
    because whatever was written past it is masked out and overwritten by the next real step.
    """

    def __init__(self, cache, copy: bool = True):
        self.cache, self.copy = cache, copy
        # (path, read the current value, put a value back, the tensor seen, its saved copy)
        self.tensors: list[tuple[str, object, object, torch.Tensor, torch.Tensor | None]] = []
        self.scalars: list[tuple[object, object]] = []  # (write a value back, the value)
        objects = [("cache", cache)] + [(f"layers[{i}]", layer) for i, layer in enumerate(getattr(cache, "layers", []))]
        for path, obj in objects:
            skip = {"layers"} | _append_only_buffers(obj)
            for name, value in vars(obj).items():
                if name not in skip:
                    self._collect(f"{path}.{name}", value,
                                  read=lambda o=obj, n=name: getattr(o, n),
                                  write=lambda v, o=obj, n=name: setattr(o, n, v))

    def _collect(self, path, value, read, write):
        if isinstance(value, torch.Tensor):
            self.tensors.append((path, read, write, value, value.detach().clone() if self.copy else None))
        elif isinstance(value, _SCALARS) or value is None:
            # None too: a lazily allocated state must go back to "not allocated"
            self.scalars.append((write, value))
        elif isinstance(value, (dict, list)):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for k, v in items:
                self._collect(f"{path}[{k!r}]", v, read=lambda c=value, k=k: c[k],
                              write=lambda x, c=value, k=k: c.__setitem__(k, x))
        elif isinstance(value, tuple):
            # tensors inside tuples are restored in place; the tuple itself cannot change
            for i, v in enumerate(value):
                if isinstance(v, torch.Tensor):
                    self._collect(f"{path}[{i}]", v, read=lambda c=value, i=i: c[i], write=None)

    def changed_tensors(self) -> list[str]:
        """Paths whose tensor object was replaced since the snapshot (then the cache is not static)."""
        return [path for path, read, _, tensor, _ in self.tensors if _current(read) is not tensor]

    def restore(self) -> None:
        """Put every recorded value back (tensors in place, on the current stream)."""
        if not self.copy:
            raise RuntimeError("this snapshot recorded no values (copy=False)")
        for _, read, write, tensor, saved in self.tensors:
            if write is not None and _current(read) is not tensor:
                write(tensor)  # a cache that swapped the tensor out gets the original object back
            tensor.copy_(saved)
        self.restore_scalars()

    def restore_scalars(self) -> None:
        """Put back the Python-side values only (flags, sizes): what a replayed graph does not run."""
        for write, value in self.scalars:
            write(value)

    def paths(self) -> set[str]:
        return {path for path, *_ in self.tensors}

    def nbytes(self) -> int:
        """Bytes of the saved copies."""
        return sum(s.numel() * s.element_size() for *_, s in self.tensors if s is not None)


def _current(read):
    try:
        return read()
    except (AttributeError, KeyError, IndexError):
        return None


def _append_only_buffers(layer) -> set[str]:
    from transformers.cache_utils import StaticLayer

    if isinstance(layer, StaticLayer) and not getattr(layer, "is_sliding", False):
        return {"keys", "values"}
    return set()


class HostReads(TorchDispatchMode):
    """Records the ops that read a tensor's value on the host: ``.item()``, ``bool(t)``, ``int(t)``
    and ops whose output shape depends on the data (``nonzero``, boolean masks, ...).

    One of them in a decode step forces a CPU-GPU sync in eager decoding and makes CUDA-graph
    capture fail. It works on CPU tensors too, so a CPU run can tell whether capture will work:

        with HostReads() as reads:
            model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True)
        assert not reads.found, reads.found      # ["aten._local_scalar_dense at layers.py:123", ...]
    """

    OPS = frozenset({"aten._local_scalar_dense", "aten.is_nonzero", "aten.nonzero", "aten.masked_select",
                     "aten._unique2", "aten.unique_consecutive", "aten.unique_dim"})

    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in self.OPS:
            self.found.append(f"{name} at {_caller()}")
        return func(*args, **(kwargs or {}))


def _caller() -> str:
    """The innermost frame outside torch itself: the line that asked for the value."""
    torch_dir = os.path.dirname(torch.__file__)
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not frame.filename.startswith(torch_dir):
            return f"{os.path.basename(frame.filename)}:{frame.lineno} ({frame.name})"
    return "?"


class DecodeGraph:
    """One decode step of ``model`` over ``cache``, captured in a ``torch.cuda.CUDAGraph``.

    Args:
        model: a causal LM on a CUDA device (converted or original), in eval mode.
        cache: a static cache that already holds the prefill (``StaticLinearizeCache`` or
            transformers' ``StaticCache``); the graph reads and writes it in place.
        batch_size: rows per step (B); ``step`` takes exactly (B, tokens) inputs.
        tokens: tokens per step (1 for decoding; a chunk length for :class:`PrefillGraph`).
        warmup: eager iterations on a side stream before capture (lets cuBLAS, Triton and the
            caching allocator settle, as PyTorch's CUDA-graph notes advise).
        compile: capture ``torch.compile(model.forward, fullgraph=True, dynamic=False)`` (Inductor's
            default mode: fused glue kernels, no CUDA graphs of its own) instead of the eager
            forward; the warm-up compiles it. A replay is then one graph launch, where
            ``mode="reduce-overhead"`` spends host time per step in dynamo's guards and the CUDA-graph
            tree's input checks (a step of a small model at batch 1 waits on it).

    Warm-up and capture run the model, which would advance the cache; every value the cache holds
    is snapshotted before and restored after, so the first ``step`` continues exactly from the
    prefill. No padding support (see the module docstring).
    """

    def __init__(self, model, cache, batch_size: int, warmup: int = 3, pool=None, tokens: int = 1,
                 compile: bool = False):
        device = next(model.parameters()).device
        if not torch.cuda.is_available() or device.type != "cuda":
            raise RuntimeError(
                f"DecodeGraph needs CUDA (a model on a CUDA device); the model is on {device}. "
                "On CPU decode eagerly: model(input_ids, position_ids=..., past_key_values=cache, use_cache=True)."
            )
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if not isinstance(tokens, int) or tokens <= 0:
            raise ValueError(f"tokens must be a positive int, got {tokens!r}")
        self.model, self.cache, self.batch_size, self.tokens = model, cache, batch_size, tokens
        self.forward = torch.compile(model.forward, fullgraph=True, dynamic=False) if compile else model
        self.input_ids = torch.zeros(batch_size, tokens, dtype=torch.long, device=device)
        # any valid positions will do for warm-up and capture: the cache is restored afterwards
        self.position_ids = torch.arange(tokens, device=device).expand(batch_size, -1).contiguous()
        snapshot = CacheSnapshot(cache)

        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        # the kernels of linearize.kernels launch with programmatic dependent launch here (a replayed
        # step of every preset 7-10% faster on an H100, docs/reports/end-to-end.md), unless LINEARIZE_PDL=0
        with torch.no_grad(), torch.cuda.stream(side), _pdl_default(True):
            for _ in range(warmup):
                self._forward()
                snapshot.restore()
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)

        self.graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(self.graph, pool=pool), _pdl_default(True):
            self.logits = self._forward()
        new = sorted(CacheSnapshot(cache, copy=False).paths() - snapshot.paths())
        replaced = snapshot.changed_tensors()
        # capture only records kernels, but Python-side state (counters, flags) moved on
        snapshot.restore()
        torch.cuda.synchronize(device)
        if new:
            raise RuntimeError(
                f"the cache allocated {', '.join(new[:4])} during the decode step: the graph would write to tensors "
                "the cache forgets. Run the prefill through this cache before building the DecodeGraph."
            )
        if replaced:
            raise RuntimeError(
                f"the cache is not static: {', '.join(replaced[:4])} got a new tensor during the step, so a replayed "
                "graph would write to memory the cache no longer uses. Use linearize.StaticLinearizeCache "
                "(converted models) or transformers.StaticCache (original models)."
            )

    def _forward(self) -> torch.Tensor:
        out = self.forward(
            input_ids=self.input_ids, position_ids=self.position_ids, past_key_values=self.cache,
            use_cache=True, logits_to_keep=1,
        )
        return out.logits[:, -1]  # (B, vocab)

    def step(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Run one captured step. ``input_ids``, ``position_ids``: (B, tokens) int64 on the model's device.

        Returns the last token's logits (B, vocab) in the graph's output buffer (valid until the next step)."""
        shape = (self.batch_size, self.tokens)
        if tuple(input_ids.shape) != shape or tuple(position_ids.shape) != shape:
            raise ValueError(
                f"step takes (batch_size, tokens) = {shape} input_ids and position_ids, got "
                f"{tuple(input_ids.shape)} and {tuple(position_ids.shape)}"
            )
        self.input_ids.copy_(input_ids)
        self.position_ids.copy_(position_ids)
        self.graph.replay()
        return self.logits


class PrefillGraph:
    """A long prompt fed through a static cache in chunks, each full chunk replayed from one CUDA graph.

    A chunked prefill keeps memory flat (one chunk's activations at a time), but run eagerly each
    chunk of a small model pays the host time of its launches, dozens per layer: at batch 1 the GPU
    waits on Python (a 64K-token prefill of the SmolLM2 shape in 8K chunks spent twice its GPU time
    on the host). Capturing one chunk's forward over the cache and replaying it for every chunk
    removes that. Capture once per (batch size, chunk length) and reuse it for every prompt:

        cache = StaticLinearizeCache(model.config, max_batch_size=1, max_cache_len=T + new, device="cuda")
        prefill = PrefillGraph(model, cache, batch_size=1, chunk_size=8192)   # the cache is left empty
        logits = prefill(input_ids)          # (1, vocab): the prompt's last token; the cache holds it
        ...decode (DecodeGraph, or generate with the same cache)...
        cache.reset(); logits = prefill(next_prompt)

    The captured chunk is a continuation (it reads the state the cache holds: zeros after
    ``reset()``, where it equals a first chunk), so a prompt may also continue a cache that holds
    tokens. A prompt's last ``T % chunk_size`` tokens run eagerly. No padding (no attention mask),
    as :class:`DecodeGraph`. Layer-level hybrids work, their softmax layers attending over the static
    cache's ``max_cache_len`` keys under a mask (slower than a dynamic cache's causal attention).
    """

    def __init__(self, model, cache, batch_size: int, chunk_size: int, warmup: int = 2, pool=None,
                 compile: bool = False):
        if not getattr(cache, "is_compileable", False):
            raise ValueError(
                f"PrefillGraph needs a static cache (linearize.StaticLinearizeCache or transformers.StaticCache), "
                f"got {type(cache).__name__}: its tensors must keep their addresses between chunks"
            )
        if not isinstance(chunk_size, int) or chunk_size < 2:
            raise ValueError(f"chunk_size must be an int >= 2, got {chunk_size!r}")
        device = next(model.parameters()).device
        self.model, self.cache, self.batch_size, self.chunk_size = model, cache, batch_size, chunk_size
        # one eager chunk allocates the cache's storage (capture must not allocate it) and puts its
        # Python-side flags ("a previous state exists") where every chunk after the first has them
        cache.reset()
        ids = torch.zeros(batch_size, chunk_size, dtype=torch.long, device=device)
        with torch.no_grad():
            model(input_ids=ids, position_ids=torch.arange(chunk_size, device=device).expand(batch_size, -1),
                  past_key_values=cache, use_cache=True, logits_to_keep=1)
        self._continued = CacheSnapshot(cache, copy=False)
        self.graph = DecodeGraph(model, cache, batch_size, warmup=warmup, pool=pool, tokens=chunk_size,
                                 compile=compile)
        cache.reset()

    def __call__(self, input_ids: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Feed ``input_ids`` (B, T) at positions ``start .. start+T-1`` (the tokens the cache already
        holds); returns the last token's logits (B, vocab), a tensor of its own."""
        B, T = input_ids.shape
        if B != self.batch_size:
            raise ValueError(f"this PrefillGraph was captured for batch_size={self.batch_size}, got {B} rows")
        device = self.graph.input_ids.device
        input_ids = input_ids.to(device)
        C, logits, s = self.chunk_size, None, 0
        if T >= C:
            check = getattr(self.cache, "check_inputs", None)
            if check is not None:
                check(batch_size=B, num_tokens=T)  # clear errors before the replays write anything
            arange = torch.arange(C, device=device).expand(B, -1)
            while s + C <= T:
                logits = self.graph.step(input_ids[:, s:s + C], arange + (start + s))
                s += C
            self._continued.restore_scalars()  # the replays ran the kernels, not the Python side
            logits = logits.clone()
        if s < T:
            pos = torch.arange(start + s, start + T, device=device).expand(B, -1)
            with torch.no_grad():
                logits = self.model(input_ids=input_ids[:, s:], position_ids=pos, past_key_values=self.cache,
                                    use_cache=True, logits_to_keep=1).logits[:, -1]
        return logits
