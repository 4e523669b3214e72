"""What the measurement scripts share: the error measure, the memory floor's bandwidth, kernel
counting and writing a script's section of a report page under docs/reports/.

Scripts import it as ``from benchlib import ...`` (Python puts a script's own folder first on
``sys.path``); it needs the installed ``linearize`` package (the wheel on a GPU machine).
"""

from __future__ import annotations

import math
import pathlib

import torch

from linearize.benchmarks.measure import count_kernels, measure_bandwidth, versions  # noqa: F401  (re-exported)

REPO = pathlib.Path(__file__).resolve().parents[1]
REPORTS = REPO / "docs" / "reports"


def rel(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0, norm_floor: float = 0.0) -> float:
    """Relative error ||a - b|| / ||b|| in float64; inf if ``a`` is not finite. ``floor`` (per element,
    scaled by sqrt(numel)) and ``norm_floor`` bound the denominator from below, for references whose
    norm is below what the compared dtype can represent; an exactly-zero reference gives ||a||."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if not torch.isfinite(a).all():
        return math.inf
    nb = b.norm()
    if nb == 0 and not norm_floor:
        return a.norm().item()
    nb = max(nb, floor * math.sqrt(b.numel()), norm_floor)
    return ((a - b).norm() / nb).item()


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def write_section(path, name: str, text: str) -> pathlib.Path:
    """Put ``text`` between ``<!-- name:start -->`` and ``<!-- name:end -->`` in the page at ``path``,
    leaving the page's hand-written parts as they are; a page without the markers gets them appended
    (a new page is created). Returns the path."""
    path = pathlib.Path(path)
    start, end = markers(name)
    block = f"{start}\n{text.rstrip()}\n{end}"
    old = path.read_text() if path.exists() else ""
    if start in old and end in old:
        new = old[:old.index(start)] + block + old[old.index(end) + len(end):]
    else:
        new = (old.rstrip() + "\n\n" if old.strip() else "") + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(new)
    tmp.replace(path)
    return path
