"""Programmatic dependent launch (PDL) for the kernels of a decode step, on Hopper and newer GPUs.

A decode step of a small model is a chain of ~250 short kernels, and each one normally starts only
after the one before it has finished and its writes have drained: a microsecond or more per kernel
in which no program of either runs, against 3-10 us of work (``scripts/profile_decode.py``). With
PDL (sm_90+, CUDA 12.3+, kept by CUDA-graph capture) a kernel launched with the programmatic
serialization attribute may be scheduled as soon as every program of the kernel before it has
executed ``griddepcontrol.launch_dependents``; it runs ``griddepcontrol.wait`` to block until that
kernel has finished and its memory is visible. Triton exposes both (``tl.extra.cuda.gdc_wait``,
``gdc_launch_dependents``, the ``launch_pdl`` launch option).

The rule every kernel here follows, which is what makes it safe:

1. No write, and no read of anything but weights (below), before its ``gdc_wait``. (Writes too:
   the caching allocator may hand out memory the kernel before is still reading.)
2. ``gdc_launch_dependents`` only after its own ``gdc_wait``. So when a kernel starts, the kernel
   two launches back has finished (the one just before passed its wait), and by induction every
   earlier one: only the kernel just before can still be running.
3. A weight may be read before the wait only where the caller vouches that the launch just before
   did not write it: a module's parameter, which a forward never writes (the decode GEMV's
   ``weight_ready``; see ``kernels/decode_linear.py``). Its load then overlaps the kernel before.

Kernels that do not use PDL (cuBLAS, Inductor's, PyTorch's copies) launch as usual and wait for
everything before them, so they end any chain. :func:`enabled` says whether a launch on a tensor's
device uses PDL: ``LINEARIZE_PDL=1``, CUDA, compute capability 9 or more, not the interpreter.
Results do not depend on it, only the overlap.

**Where it is on.** Inside :func:`default` blocks, which ``linearize.DecodeGraph`` and
``linearize.PrefillGraph`` put around their warm-up and capture: a step replayed from one of them
(``compile=True`` or not) was 7-10% faster with it for every preset on an H100 (``docs/reports/end-to-end.md``,
2026-11-26; 2.6-4.1% for the eager step captured, 2026-11-25). Everywhere else it is off: the step
``torch.compile(mode="reduce-overhead")`` captures (what ``generate(cache_implementation="static")``
runs) varied by up to 50% between captures on that machine, PDL on or off, and was slower with it in
3 of 5 pairs. ``LINEARIZE_PDL=1`` turns it on everywhere, ``LINEARIZE_PDL=0`` off everywhere.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import triton
import triton.language as tl


_DEFAULTS: list[bool] = []  # the innermost default() block's setting


@contextlib.contextmanager
def default(on: bool = True):
    """Launches inside the block use PDL (where the GPU has it) unless ``LINEARIZE_PDL`` says otherwise."""
    _DEFAULTS.append(on)
    try:
        yield
    finally:
        _DEFAULTS.pop()


def setting() -> str:
    """"on" / "off" (``LINEARIZE_PDL`` set to 1 / 0: everywhere), else "graphs" (in :func:`default`
    blocks only: the CUDA graphs of linearize.DecodeGraph and linearize.PrefillGraph)."""
    value = os.environ.get("LINEARIZE_PDL", "")
    if value not in ("", "0", "1"):
        raise ValueError(f"LINEARIZE_PDL={value!r}: set it to 1 (PDL on everywhere), 0 (off everywhere) or leave it "
                         "unset (on in linearize's CUDA graphs)")
    return {"1": "on", "0": "off"}.get(value, "graphs")


def enabled(x: torch.Tensor) -> bool:
    """Whether kernels launched for tensor ``x`` use PDL."""
    if not x.is_cuda:
        return False
    mode = setting()
    if mode == "off" or (mode == "graphs" and not (_DEFAULTS and _DEFAULTS[-1])):
        return False
    return _supported(x.device.index if x.device.index is not None else torch.cuda.current_device())


@functools.cache
def _supported(index: int) -> bool:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


def launch_options(on: bool) -> dict:
    """The launch keyword a kernel call adds: ``launch_pdl=True`` when PDL is on, else nothing (the
    interpreter and older Triton versions take no such option)."""
    return {"launch_pdl": True} if on else {}


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """Rules 1 and 2 above, at the point of a kernel where it starts reading its inputs: wait for the
    kernel before to finish, then let the next kernel be scheduled. Nothing when ``PDL`` is off."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
