"""Shared fixtures: tiny random models of every supported architecture, and the real SmolLM2.

Tiny models use initializer_range=0.2: with the default 0.02 every variant (softmax, hybrid,
linear) emits the same tokens and generation tests would prove nothing.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys
import tempfile

import pytest
import torch
import transformers

import linearize

TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=97,
    max_position_embeddings=512,
    initializer_range=0.2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=None,
    tie_word_embeddings=False,
)

ARCH_CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"partial_rotary_factor": 0.5}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"query_pre_attn_scalar": 24, "attn_logit_softcapping": 5.0,
                                                     "final_logit_softcapping": 30.0, "sliding_window": 8}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    # local, global, local: two RoPE bases (10k local, 1M global), q/k norm, query_pre_attn_scalar
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "query_pre_attn_scalar": 24, "sliding_window": 8, "final_logit_softcapping": 30.0,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"no_rope_layer_interval": 2}),  # layer 1 has no RoPE
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"attention_multiplier": 0.3, "residual_multiplier": 0.5,
                                                         "embedding_multiplier": 2.0, "logits_scaling": 1.5}),
    # Pythia: no GQA, rotary on a quarter of each head, parallel residual
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"num_key_value_heads": None, "use_parallel_residual": True}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2,
                                                             "moe_intermediate_size": 32}),
}


def attention(model, i: int):
    """The attention module (original or converted) of decoder layer ``i``, wherever the row says it lives."""
    from linearize.arch import get_arch, get_submodule

    spec = get_arch(model.config.model_type)
    return getattr(get_submodule(model, spec.layers)[i], spec.attention)


def default_converted_layers(model_type: str) -> list[int]:
    """What ``LinearAttentionConfig()`` converts in a tiny model: every layer, except in the models that
    mix local (sliding-window) and global layers, whose local layers 0 and 2 stay softmax."""
    return [1] if model_type in ("gemma2", "gemma3_text") else [0, 1, 2]


def load_script(name: str):
    """A module from scripts/ (they are not a package), e.g. ``load_script("results")``. The scripts'
    folder goes on ``sys.path`` as when a script runs (their shared ``benchlib``)."""
    folder = pathlib.Path(__file__).resolve().parents[1] / "scripts"
    if str(folder) not in sys.path:
        sys.path.append(str(folder))
    path = folder / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    """A free TCP port for a 2-process `accelerate launch` (tests run side by side under pytest -n: the
    default port 29500 would be taken twice)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 on the CPU; fails on a non-finite ``a`` (nan must never pass a
    tolerance). The one error measure of the kernel tests."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    assert torch.isfinite(a).all(), "non-finite values"
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def tiny_model(model_type: str = "llama", seed: int = 0, attn_implementation: str = "sdpa", **overrides):
    cfg_name, model_name, extra = ARCH_CONFIGS[model_type]
    kwargs = {**TINY, **extra, **overrides}
    config = getattr(transformers, cfg_name)(**kwargs)
    # an architecture that needs eager (gemma2's softcapping) gets it, as load_model_and_tokenizer does
    needs = linearize.arch.attn_implementation_for(config)
    config._attn_implementation = "eager" if needs == "eager" else attn_implementation
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    # norms start at 1 / 0 which makes layers near-identical; perturb them so layers differ
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def tiny_model_dir(path, model_type: str = "llama"):
    """A tiny model saved with a word-level tokenizer ("w2".."w96") at ``path``: a folder the CLI loads."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    torch.manual_seed(0)
    tiny_model(model_type).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<s>": 1, **{f"w{i}": i for i in range(2, 97)}}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>").save_pretrained(path)
    return path


def word_docs(folder, n: int = 12):
    """``n`` documents of 120 words of tiny_model_dir's vocabulary, each its own sequence, in ``folder``."""
    folder.mkdir()
    for d in range(n):
        (folder / f"{d}.txt").write_text(" ".join(f"w{(i * (d + 3)) % 90 + 2}" for i in range(120)))
    return folder


def converted(model_type: str = "llama", config=None, **kw):
    model = tiny_model(model_type, **kw)
    linearize.linearize(model, config or linearize.LinearAttentionConfig(feature_map="hedgehog"))
    if isinstance(config, linearize.GatedDeltaNetConfig):
        # GDN starts as identity conv / pass-through norm and gate (and, beside a window, weighed 0):
        # move off that point so the conv cache, the norm, the gate and the state all matter in the tests
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if any(k in name for k in ("conv.", "o_norm_mix", "o_gate", "b_proj", "a_proj", "window_gamma")):
                    p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the real SmolLM2-135M-Instruct, loaded once from its GGUF."""
    from linearize.loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer()
    return model, tokenizer


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_configure(config):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # the token cache of recipes/data.py goes to a folder of this run, not the user's ~/.cache
    os.environ.setdefault("LINEARIZE_CACHE", tempfile.mkdtemp(prefix="linearize-tests-"))
    if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n N: one thread per worker, the cores are shared out
        torch.set_num_threads(1)


def _patch_triton_once_per_launch() -> None:
    """Under TRITON_INTERPRET=1, patch triton.language once per kernel launch, not again at every call
    of a nested ``@triton.jit`` helper.

    triton's interpreter (3.x) re-patches the language modules (``inspect.getmembers`` over ``tl``,
    ``tl.tensor`` and ``tl.math``) at each call of a jitted helper, though the launch around it has already
    patched those same module objects and restores them when it ends. A GDN chunk program makes ~150 such
    calls, and the re-patching was over half the interpreted time of ``chunk_gated_delta_rule``. A helper
    whose language modules the running launch has patched now skips it; any other call (a launch, or a
    helper that sees another module) patches as before. Triton's own helpers (``tl.sum``, ``tl.zeros``,
    ``tl.cumsum``: jitted in ``triton.language.standard``, whose module sees ``tl.core``, not ``tl``) patch
    ``tl.core`` at their first call in a launch, which the interpreter never restores (not even between
    launches), so their later calls in the same launch skip it as well: in a chunked GLA-form test they were
    3,400 re-patches of ``tl.core``, 13% of its time. Without the interpreter internals this relies on,
    nothing changes.
    """
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang", None)
    if original is None or getattr(original, "_once_per_launch", False):
        return
    patched: list[set[int]] = []  # the language modules the running launch patched (one launch at a time)

    def langs(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}

    class _Launch:  # the launch's scope: its restore() also ends the launch
        def __init__(self, scope):
            self.scope = scope

        def restore(self):
            try:
                self.scope.restore()
            finally:
                patched.pop()

    class _Nothing:
        def restore(self):
            pass

    def patch_lang(fn):
        if patched and langs(fn) <= patched[-1]:
            return _Nothing()  # a nested helper: the launch's patches are in place
        scope = original(fn)
        if patched:  # a helper seeing another module: patched as before (and, as before, never restored),
            patched[-1] |= langs(fn)  # so its modules stay patched until the launch ends
            return scope
        patched.append(langs(fn))  # a launch: GridExecutor restores this scope when the grid is done
        return _Launch(scope)

    patch_lang._once_per_launch = True
    interpreter._patch_lang = patch_lang


def _np_dtype_table_once() -> None:
    """Under TRITON_INTERPRET=1, answer each dtype's numpy dtype once, not by a table rebuilt at every lookup.

    triton's interpreter (3.x) maps a language dtype to its numpy storage dtype with ``_get_np_dtype``, which
    builds a 19-entry dict of ``np.dtype`` objects at every call; each cast, splat, load and constant calls
    it (180,000 calls, 8% of a chunked GLA-form test). Each dtype's answer is now kept from its first lookup
    (the original's own answer); a dtype it has no entry for raises as before. Without that function, nothing
    changes. With both patches, test_kernels_channel_gate.py and test_kernels_sinks.py took 198 s instead of 257 s
    (``-n 2``, one after the other on the same 2 cores, 2026-12-07h); the whole interpreted part of CI 14.5
    minutes instead of 18-19 on that machine.
    """
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_get_np_dtype", None)
    if original is None or getattr(original, "_table_once", False):
        return
    table: dict = {}

    def np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return original(tt_dtype)  # uint64, a case the original answers before its table
        got = table.get(tt_dtype)
        if got is None:
            got = table[tt_dtype] = original(tt_dtype)
        return got

    np_dtype._table_once = True
    interpreter._get_np_dtype = np_dtype


def _skip_dropped_overflow_checks() -> None:
    """Under TRITON_INTERPRET=1, skip the integer-overflow check whose assert the interpreter drops anyway.

    For every integer ``+``, ``-`` and ``*`` in a kernel, triton's ``binary_op_sanitize_overflow_impl`` redoes
    the op in int64, compares the result with the type's bounds and hands the condition to ``device_assert``,
    which returns at once unless the kernel runs with ``debug`` (off here, as on the GPU, where the compiler
    then removes the unused check). The interpreter runs each of those ops on numpy first: about 30% of a GDN
    model-level test (``test_gdn_fused_prefill_equals_the_unfused_kernel_path``, cProfile, 2026-12-07i). The check
    now returns before that work when ``debug`` is off; with ``debug`` on it runs as before. Patched only where
    triton's ``device_assert`` has that early return (read from its source), on the interpreter's own instance.
    The whole interpreted part of CI (``-n 2``, 2 cores): 675 s instead of 853 s earlier the same day on the same
    machine (2026-12-07i).
    """
    import inspect

    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    sem = getattr(interpreter, "interpreter_semantic", None)
    original = getattr(sem, "binary_op_sanitize_overflow_impl", None)
    if original is None or getattr(original, "_skips_dropped", False):
        return
    try:
        drops = "if not self.builder.options.debug:" in inspect.getsource(type(sem).device_assert)
    except (AttributeError, OSError, TypeError):
        drops = False
    if not drops:
        return

    def check(lhs, rhs, binary_op):
        if not sem.builder.options.debug:
            return None  # what device_assert would have done with the condition
        return original(lhs, rhs, binary_op)

    check._skips_dropped = True
    sem.binary_op_sanitize_overflow_impl = check


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_triton_once_per_launch()
    _np_dtype_table_once()
    _skip_dropped_overflow_checks()
