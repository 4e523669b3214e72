"""kernels/launch.py: a launch whose tiles do not fit in shared memory retries with fewer
pipeline stages (fp32 at head dim 256 on an H100/H200, found by the GPU fuzz), remembers the depth
that fit, and raises when even one stage does not fit."""

import pytest
import torch

from linearize.kernels import launch as L


class FakeKernel:
    """kernel[grid](...) that needs at most ``fits`` stages, recording each try."""

    def __init__(self, fits):
        self.fits, self.tries, self.__name__ = fits, [], f"fake{fits}"

    def __getitem__(self, grid):
        def run(*args, num_stages, **kwargs):
            self.tries.append(num_stages)
            if num_stages > self.fits:
                raise L.OutOfResources(300_000, 232_448, "shared memory")
            return "ran"
        return run


def test_fewer_stages_until_it_fits_then_remembered():
    L._FITS.clear()
    k = FakeKernel(fits=1)
    x = torch.zeros(2)
    assert L.launch(k, (1,), x, num_stages=3, BK=256) == "ran"
    assert k.tries == [3, 2, 1]
    assert L.launch(k, (1,), x, num_stages=3, BK=256) == "ran"
    assert k.tries == [3, 2, 1, 1]  # the second launch starts at the depth that fit
    L.launch(k, (1,), x.half(), num_stages=3, BK=256)
    assert k.tries[-3:] == [3, 2, 1]  # another dtype is another compilation: tried afresh


def test_a_kernel_that_never_fits_raises():
    L._FITS.clear()
    k = FakeKernel(fits=0)
    with pytest.raises(L.OutOfResources):
        L.launch(k, (1,), torch.zeros(1), num_stages=2)
    assert k.tries == [2, 1]


def test_the_remembered_depth_belongs_to_one_kernel_and_its_constexpr_arguments():
    """Two modules' kernels share a __name__ (chunk.py and window.py both have ``_fwd_kernel``), and
    head dims reach some kernels as positional ``tl.constexpr`` parameters: the depth lowered for one
    compilation (fp32 at head dim 256) must not carry over to another kernel or head dim."""
    import types

    L._FITS.clear()
    L._LOWERED.clear()

    def kernel_from(module, fits):
        k = FakeKernel(fits)
        k.__name__ = "_fwd_kernel"
        k.fn = types.SimpleNamespace(__module__=module, __qualname__="_fwd_kernel")
        k.params = [types.SimpleNamespace(name="x", is_constexpr=False), types.SimpleNamespace(name="D", is_constexpr=True)]
        return k

    chunk, window = kernel_from("linearize.kernels.linear_attn.chunk", 1), kernel_from("linearize.kernels.linear_attn.window", 3)
    x = torch.zeros(2)
    L.launch(chunk, (1,), x, 256, num_stages=3)
    assert chunk.tries == [3, 2, 1]
    L.launch(window, (1,), x, 256, num_stages=3)
    assert window.tries == [3]  # another module's kernel of the same name starts at its own depth
    L.launch(chunk, (1,), x, 256, num_stages=3)
    assert chunk.tries[-1:] == [1]  # the same compilation: remembered
    chunk.fits = 3
    L.launch(chunk, (1,), x, 64, num_stages=3)
    assert chunk.tries[-1:] == [3]  # another positional constexpr (head dim): tried afresh
