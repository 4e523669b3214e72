"""Launching a Triton kernel with the deepest software pipelining the GPU's shared memory holds.

A kernel's ``num_stages`` buffers that many tiles of its inputs in shared memory.  The tuned
depths fit bf16/fp16 at every head dim and fp32 up to 128, but fp32 tiles at head dim 256 need
more than an H100/H200 SM has (the GPU fuzz: 287-336 KB against 227 KB), and Triton refuses the
launch.  :func:`launch` then retries with one stage fewer, down to 1, and remembers the depth that
fit for that kernel and set of compile-time arguments, so only the first launch pays.  The math
does not change with the depth, only the overlap of loads with compute.
"""

from __future__ import annotations

import logging

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

try:
    from triton.runtime.errors import OutOfResources
except ImportError:  # pragma: no cover - older triton
    from triton.runtime.autotuner import OutOfResources  # type: ignore

_FITS: dict[tuple, int] = {}
_log = logging.getLogger("linearize.kernels")


def _identity(kernel):
    """A kernel's module-qualified name: two modules' ``_fwd_kernel`` are different kernels."""
    fn = getattr(kernel, "fn", None)
    if fn is not None:
        return f"{fn.__module__}.{fn.__qualname__}"
    return getattr(kernel, "__name__", None) or id(kernel)


def _key(kernel, args, kwargs) -> tuple:
    """What selects a compilation: the kernel, its compile-time constants (keyword ones, and the
    positional parameters the kernel declares ``tl.constexpr``) and the tensors' dtypes."""
    consts = [(k, v) for k, v in kwargs.items() if isinstance(v, (bool, int, float, str))]
    params = getattr(kernel, "params", None) or []
    consts += [(p.name, a) for p, a in zip(params, args) if getattr(p, "is_constexpr", False)]
    dtypes = tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
    return (_identity(kernel), tuple(sorted(consts, key=lambda kv: kv[0])), dtypes)


def launch(kernel, grid, *args, num_stages: int, **kwargs):
    """``kernel[grid](*args, num_stages=num_stages, **kwargs)``, with fewer stages when the tiles
    at that depth do not fit in shared memory; a kernel that does not fit at depth 1 raises. The
    key of a compilation (its constants and dtypes) is only built for kernels that once needed fewer
    stages: the usual launch pays no host time for it. Each lowering is logged (logger
    ``linearize.kernels``, level INFO)."""
    name = _identity(kernel)
    key, stages = None, num_stages
    if name in _LOWERED:
        key = _key(kernel, args, kwargs)
        stages = min(num_stages, _FITS.get(key, num_stages))
    while True:
        try:
            out = kernel[grid](*args, num_stages=stages, **kwargs)
        except OutOfResources:
            if stages <= 1:
                raise
            stages -= 1
            continue
        if stages < num_stages:
            _LOWERED.add(name)
            key = key if key is not None else _key(kernel, args, kwargs)
            if _FITS.get(key) != stages:
                _log.info("%s: %d pipeline stage(s) instead of %d (shared memory), for %s", name, stages,
                          num_stages, key[1:])
            _FITS[key] = stages
        return out


_LOWERED: set = set()  # kernels (by identity) of which some compilation launched with fewer stages


def call_directly(grad: bool) -> bool:
    """Whether a public function may call its op's Python implementation itself instead of going
    through ``torch.ops.linearize.*``: in eager inference (no gradients, not tracing, no dispatch mode
    such as fake tensors active). The dispatcher's round trip (autograd key, alias checks) costs tens
    of microseconds of host time per call, which a chunked prefill of a small model pays per layer and
    chunk while the GPU waits; compiled code, tracing and training keep the op."""
    return not grad and not torch.compiler.is_compiling() and not is_in_torch_dispatch_mode()
