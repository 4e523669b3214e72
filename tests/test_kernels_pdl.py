"""Programmatic dependent launch (kernels/pdl.py): the decode kernels keep its rules in the code they
compile to for a Hopper GPU, and the GEMV's early-weight path computes the same product.

No GPU here: each kernel is compiled ahead of time for sm_90 (Triton's own compiler, to PTX) and the
PTX is read. The rules: no global load or store before ``griddepcontrol.wait`` (except the GEMV's
weight block when the caller vouches for it), ``launch_dependents`` only after the wait, and
nothing of the kind when PDL is off.
"""

import importlib
import os
import re

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from linearize.kernels import pdl  # noqa: E402
from linearize.kernels.launch import launch  # noqa: E402

# modules, not the functions of the same name the packages export
dl, gdn, recurrent, window_decode = (importlib.import_module(f"linearize.kernels.{m}") for m in (
    "decode_linear", "gated_delta.decode", "linear_attn.recurrent", "linear_attn.window_decode"))

SCALARS = {"M", "N", "K", "sxm", "sym", "T", "eps", "sm_scale", "softcap"}
FLOATS = {"eps", "sm_scale", "softcap"}
# (kernel, its compile-time constants at a SmolLM2-like decode shape)
KERNELS = {
    "gemv": (dl._decode_linear_kernel, dict(BM=16, BN=16, BK=128, GATED=False, BIAS=True, PREC="tf32", UPCAST=False,
                                            EARLY=False)),
    "gemv-gated-early": (dl._decode_linear_kernel, dict(BM=16, BN=32, BK=128, GATED=True, BIAS=False, PREC="tf32",
                                                        UPCAST=False, EARLY=True)),
    "recurrent": (recurrent._recurrent_kernel, dict(H=9, F=128, DV=64, BK=128, BV=64, GATE=True, NORMALIZE=True)),
    "hedgehog": (recurrent._hedgehog_recurrent_kernel, dict(H=9, HKV=3, D=64, P=64, DV=64, BD=64, BK=128, BV=64,
                                                            GATE=False, VALID=True, ROT=64)),
    "hedgehog-channel": (recurrent._hedgehog_recurrent_kernel, dict(H=9, HKV=3, D=64, P=64, DV=64, BD=64, BK=128, BV=64,
                                                                    GATE=2, VALID=True, ROT=64)),
    "window": (window_decode._window_decode_kernel, dict(H=9, HKV=3, D=64, F=128, DV=64, W1=63, BD=64, BK=128, BDV=64,
                                                          BW=64, GATE=1, VALID=True, SOFTCAP=False, HEDGEHOG=True,
                                                          LOG_GAMMA=True, ROT=64, SINKS=0, BSN=1)),
    "window-channel": (window_decode._window_decode_kernel, dict(H=9, HKV=3, D=64, F=128, DV=64, W1=63, BD=64, BK=128,
                                                                  BDV=64, BW=64, GATE=2, VALID=True, SOFTCAP=False,
                                                                  HEDGEHOG=True, LOG_GAMMA=True, ROT=64, SINKS=0, BSN=1)),
    "gdn": (gdn._gdn_decode_kernel, dict(Q_OFF=0, K_OFF=576, V_OFF=768, HEAD_STRIDE=64, A_OFF=960, B_OFF=963,
                                         G_OFF=966, H=9, HKV=3, NS=1, D=64, BD=64, BV=16, W=4, ROT=64,
                                         HAS_VALID=False)),
    "gdn-finish": (gdn._gdn_finish_kernel, dict(Q_OFF=0, K_OFF=576, V_OFF=768, HEAD_STRIDE=64, G_OFF=966, H=9, HKV=3,
                                                D=64, BD=64, W=4, BW=4, BC=256, NC=4, HAS_VALID=False)),
}


def _ptx(kernel, consts: dict) -> str:
    names = kernel.arg_names
    sig, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(names):
        if name in consts:
            sig[name] = "constexpr"
            constexprs[(i,)] = consts[name]
        elif name in SCALARS or name.startswith("stride_") or re.fullmatch(r"s[qkvc]_[bth]", name):
            sig[name] = "fp32" if name in FLOATS else "i32"
        else:
            sig[name] = "*fp32" if name in ("S", "z", "z_out", "raw", "lg", "valid", "rlg", "rvalid", "gamma",
                                            "A_log", "dt_bias") else ("*i64" if name == "pos_ptr" else "*bf16")
            attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(kernel, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "num_stages": 2})
    return compiled.asm["ptx"]


def _before(ptx: str, marker: str, pattern: str) -> int:
    return len(re.findall(pattern, ptx[:ptx.index(marker)]))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter compiles nothing")
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_pdl_rules_hold_in_the_compiled_kernel(name):
    kernel, consts = KERNELS[name]
    on = _ptx(kernel, {**consts, "PDL": True})
    assert on.count("griddepcontrol.wait") >= 1 and "griddepcontrol.launch_dependents" in on
    wait = on.index("griddepcontrol.wait")
    assert wait < on.index("griddepcontrol.launch_dependents"), "dependents released before the wait (rule 2)"
    assert _before(on, "griddepcontrol.wait", r"\b(st|atom|red)\.global") == 0, "a write before the wait (rule 1)"
    loads = _before(on, "griddepcontrol.wait", r"\bld\.global")
    if consts.get("EARLY"):
        assert loads > 0, "the early path reads no weight before the wait"
    else:
        assert loads == 0, "a read before the wait (rule 1)"
    off = _ptx(kernel, {**consts, "PDL": False})
    assert "griddepcontrol" not in off


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("M,N,K", [(1, 96, 576), (3, 40, 200), (2, 24, 100)])
def test_gemv_early_block_matches_float64(gated, M, N, K):
    """The EARLY path (the peeled first K block read before the wait, the rest in the loop) computes
    the same product; run here under the interpreter with PDL off (it only moves the wait)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernels run on CPU only under TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(M * N + K)
    x = torch.randn(M, K, generator=g)
    w, w2 = (torch.randn(N, K, generator=g) / K ** 0.5 for _ in range(2))
    y = torch.empty(M, N)
    BN, BK, warps, stages = dl._config(N, K, gated)
    launch(dl._decode_linear_kernel, (triton.cdiv(N, BN),), x, w, w2 if gated else None, None, y, M, N, K,
           x.stride(0), y.stride(0), BM=16, BN=BN, BK=BK, GATED=gated, BIAS=False, PREC="ieee", UPCAST=False,
           PDL=False, EARLY=True, num_warps=warps, num_stages=stages)
    ref = dl.decode_gated_ref(x, w, w2) if gated else dl.decode_linear_ref(x, w)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_pdl_is_on_in_graph_captures_by_default_and_off_off_the_gpu(monkeypatch):
    """Unset LINEARIZE_PDL: PDL only inside pdl.default() blocks (DecodeGraph / PrefillGraph captures);
    1 / 0: on / off everywhere; anything else is refused; never on a CPU tensor or before sm_90."""
    monkeypatch.delenv("LINEARIZE_PDL", raising=False)
    assert pdl.launch_options(False) == {} and pdl.launch_options(True) == {"launch_pdl": True}
    with pdl.default(True):
        assert not pdl.enabled(torch.zeros(1))  # a CPU tensor
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(pdl, "_supported", lambda index: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    x = torch.zeros(1)
    assert pdl.setting() == "graphs" and not pdl.enabled(x)
    with pdl.default(True):
        assert pdl.enabled(x)
        with pdl.default(False):
            assert not pdl.enabled(x)
        assert pdl.enabled(x)
    assert not pdl.enabled(x)
    monkeypatch.setattr(pdl, "_supported", lambda index: False)  # before sm_90, or the interpreter
    with pdl.default(True):
        assert not pdl.enabled(x)
    monkeypatch.setattr(pdl, "_supported", lambda index: True)
    monkeypatch.setenv("LINEARIZE_PDL", "1")
    assert pdl.setting() == "on" and pdl.enabled(x)
    monkeypatch.setenv("LINEARIZE_PDL", "0")
    with pdl.default(True):
        assert pdl.setting() == "off" and not pdl.enabled(x)
    monkeypatch.setenv("LINEARIZE_PDL", "yes")
    with pytest.raises(ValueError, match="LINEARIZE_PDL='yes'"):
        pdl.enabled(x)