"""The battery every architecture row passes, one parametrised table (ARCH_CONFIGS in conftest).

Per row, with the feature-map method (Hedgehog with a LoLCATs window and a decay gate) and Gated
DeltaNet (one in the CLI test, the other in the generation test, alternating over the rows):
``linearize convert`` of a saved checkpoint equals the Python API; generation with the
cache equals recomputing without it (greedy and beam search), a left-padded batch equals each prompt
alone (dynamic and static cache), a generation continues from its returned cache, chunked prefill
equals one prefill; a converted layer whose window covers the prompt reproduces the original
exactly (this is where each row's quirks show: scale, q/k norms, NoPE layers, partial or per-type
RoPE, fused qkv layouts, softcapping); the checkpoints load as remote code where linearize is
absent. Elsewhere, over the same table: step-by-step cache == full forward and save/load for every
layer type (test_convert.py), static cache == dynamic for every layer type (test_static_cache.py).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

import linearize
import linearize.hybrid_sdpa as hybrid_sdpa
from linearize.arch import ARCHITECTURES
from linearize.cli import main
from linearize.layers import LinearAttention
from linearize.loading import UserError, load_model_and_tokenizer

from conftest import ARCH_CONFIGS, attention, converted, default_converted_layers, tiny_model

ARCHS = sorted(ARCH_CONFIGS)
METHODS = {
    "linear": (linearize.LinearAttentionConfig(feature_map="hedgehog", window=4, decay="scalar"),
               ["--feature-map", "hedgehog", "--window", "4", "--decay", "scalar"]),
    "gdn": (linearize.GatedDeltaNetConfig(conv_size=3), ["--method", "gdn", "--conv-size", "3"]),
}
# CI time: each row runs the CLI test with one method and the generation battery with the other,
# alternating over the rows, so every row goes through both methods (and test_convert / test_static_cache
# run every layer type on every row)
CLI_RUNS = [(arch, sorted(METHODS)[i % 2]) for i, arch in enumerate(ARCHS)]
GENERATION_RUNS = [(arch, sorted(METHODS)[(i + 1) % 2]) for i, arch in enumerate(ARCHS)]
GEN = dict(max_new_tokens=8, pad_token_id=0, do_sample=False)


def prompt(n=9, b=1, seed=0):
    return torch.randint(2, 97, (b, n), generator=torch.Generator().manual_seed(seed))


def tokenizer():
    vocab = {"<pad>": 0, "<s>": 1, **{f"w{i}": i for i in range(2, 97)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>")


def save_original(arch, folder):
    tiny_model(arch).save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return folder


def test_table_covers_every_row():
    assert set(ARCH_CONFIGS) == set(ARCHITECTURES) and len(ARCHITECTURES) >= 13


@pytest.mark.parametrize("arch,method", CLI_RUNS)
def test_cli_convert_of_a_saved_checkpoint_equals_the_python_api(arch, method, tmp_path, capsys):
    """What a user does first: save (or download) a checkpoint, `linearize convert` it, generate."""
    cfg, flags = METHODS[method]
    src, out = save_original(arch, tmp_path / "original"), tmp_path / "converted"
    assert main(["convert", str(src), "--out", str(out), *flags]) == 0, capsys.readouterr().err
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(loaded).__name__ == f"Linearized{ARCHITECTURES[arch].classes[1]}"
    # the loader ran the original with the attention implementation its row names (sdpa: a hybrid's
    # softmax layers on hybrid_sdpa.DECODE_NAME, transformers' sdpa with the decode kernel)
    expected = ARCHITECTURES[arch].attn_implementation
    if expected == "sdpa" and loaded.config.linearize.get("softmax_layers"):
        expected = hybrid_sdpa.DECODE_NAME
    assert loaded.config._attn_implementation == expected
    api = linearize.linearize(tiny_model(arch), cfg)
    assert loaded.config.linearize["layers"] == api.config.linearize["layers"] == default_converted_layers(arch)
    ids = prompt(b=2)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, api(ids).logits, atol=2e-5, rtol=1e-4)
    capsys.readouterr()
    rc = main(["generate", str(out), "--prompt", "w5 w6 w7", "--max-new-tokens", "4", "--no-chat-template"])
    if AutoTokenizer.from_pretrained(out)("w5 w6 w7").input_ids:
        assert rc == 0 and capsys.readouterr().out.split()
    else:  # qwen2's folder loads Qwen2Tokenizer, which cannot encode the tiny vocabulary's words
        assert rc == 2 and "is 0 tokens for this tokenizer" in capsys.readouterr().err


@pytest.mark.parametrize("arch,method", GENERATION_RUNS)
def test_generation(arch, method):
    cfg = METHODS[method][0]
    model = converted(arch, cfg)
    ids = prompt(b=2)
    # non-vacuous: the tiny converted model does not emit the original's tokens
    original = tiny_model(arch).generate(prompt(n=16), **GEN)
    assert not torch.equal(model.generate(prompt(n=16), **GEN), original)

    # the cache gives the tokens of a full recompute: greedy and beam search
    torch.testing.assert_close(model.generate(ids, **GEN), model.generate(ids, use_cache=False, **GEN))
    torch.testing.assert_close(model.generate(ids, num_beams=3, **GEN),
                               model.generate(ids, num_beams=3, use_cache=False, **GEN))

    # a left-padded batch equals each prompt alone, with the dynamic and the static cache
    long, short = prompt(n=10, seed=1)[0], prompt(n=6, seed=2)[0]
    batch, mask = torch.zeros(2, 10, dtype=torch.long), torch.zeros(2, 10, dtype=torch.long)
    batch[0], mask[0] = long, 1
    batch[1, 4:], mask[1, 4:] = short, 1
    alone_long, alone_short = model.generate(long[None], **GEN), model.generate(short[None], **GEN)
    for impl in (None, "static"):
        out = model.generate(batch, attention_mask=mask, cache_implementation=impl, **GEN)
        torch.testing.assert_close(out[0, 10:], alone_long[0, 10:])
        torch.testing.assert_close(out[1, 10:], alone_short[0, 6:])

    # continuation from the returned cache; chunked prefill
    first = model.generate(ids[:1], return_dict_in_generate=True, **{**GEN, "max_new_tokens": 5})
    assert isinstance(first.past_key_values, linearize.LinearizeCache)
    more = model.generate(first.sequences, attention_mask=torch.ones_like(first.sequences),
                          past_key_values=first.past_key_values, **{**GEN, "max_new_tokens": 3})
    whole = model.generate(ids[:1], **GEN)
    torch.testing.assert_close(more, whole)
    # the same through transformers' chunked prefill, and with only the token the cache lacks (the
    # mask covers everything): transformers >= 5.24 cuts no held tokens for an all-linear cache, we do
    for chunk, start in ((4, 0), (None, first.sequences.shape[1] - 1)):
        first = model.generate(ids[:1], return_dict_in_generate=True, **{**GEN, "max_new_tokens": 5})
        more = model.generate(first.sequences[:, start:], attention_mask=torch.ones_like(first.sequences),
                              past_key_values=first.past_key_values, prefill_chunk_size=chunk,
                              **{**GEN, "max_new_tokens": 3})
        torch.testing.assert_close(more, whole[:, start:])
    long_prompt = prompt(n=17)
    torch.testing.assert_close(model.generate(long_prompt, prefill_chunk_size=5, **GEN),
                               model.generate(long_prompt, use_cache=False, **GEN))


@pytest.mark.parametrize("arch", ARCHS)
def test_window_covering_the_prompt_reproduces_the_original(arch):
    """A LoLCATs layer whose softmax window covers every key is the original softmax attention: with
    all layers converted the logits must be the original's. Getting the scale (query_pre_attn_scalar,
    attention_multiplier), q/k norms, RoPE (NoPE layers, partial rotary, local/global bases), the
    fused qkv layout or the softcap wrong breaks this."""
    attn = ARCHITECTURES[arch].attn_implementation
    T = 8  # <= the tiny gemmas' sliding window, so local layers see every key too
    ids = prompt(n=T, b=2)
    original = tiny_model(arch, attn_implementation=attn)
    with torch.no_grad():
        expected = original(ids).logits
    model = linearize.linearize(original, linearize.LinearAttentionConfig(feature_map="elu", window=T, layers=[0, 1, 2]))
    assert all(isinstance(attention(model, i), LinearAttention) for i in range(3))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, use_cache=False).logits, expected, atol=2e-5, rtol=1e-4)
        # and the layers really are linear beyond the window: a longer prompt departs from the original
        longer = prompt(n=3 * T, b=1)
        assert not torch.allclose(model(longer, use_cache=False).logits, tiny_model(arch, attn_implementation=attn)(longer).logits,
                                  atol=1e-3)


REMOTE = textwrap.dedent(
    """
    import json, sys
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name == "linearize" or name.startswith("linearize."):
                raise ImportError("linearize is not installed here")
    sys.meta_path.insert(0, Block())
    import torch
    from transformers import AutoModelForCausalLM
    refs = torch.load(sys.argv[1])
    failed = []
    for folder, ref in refs.items():
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
        assert "transformers_modules" in type(model).__module__, type(model).__module__
        with torch.no_grad():
            # not bitwise: mmap-aligned weights can move CPU matmuls by an ulp (see test_save_load_round_trip)
            ok = torch.allclose(model(ref["ids"]).logits, ref["logits"], atol=1e-5, rtol=1e-4)
            gen = model.generate(ref["ids"], max_new_tokens=6, do_sample=False, pad_token_id=0)
        if not ok or not torch.equal(gen, ref["generated"]):
            failed.append(folder)
    print("REMOTE-FAILED", failed) if failed else print("REMOTE-OK", len(refs))
    """
)


def test_remote_code_of_every_row_without_linearize_installed(tmp_path):
    """Each row's checkpoint (both methods, alternating) loads with trust_remote_code where the package
    is absent, and gives the same logits and greedy tokens (one subprocess for all rows)."""
    refs = {}
    for n, arch in enumerate(ARCHS):
        method = sorted(METHODS)[n % 2]
        model = converted(arch, METHODS[method][0])
        folder = tmp_path / f"{arch}-{method}"
        model.save_pretrained(folder)
        assert (folder / "modeling_linearize.py").is_file() and (folder / "arch.py").is_file()
        ids = prompt(b=2)
        with torch.no_grad():
            refs[str(folder)] = {"ids": ids, "logits": model(ids).logits,
                                 "generated": model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)}
    torch.save(refs, tmp_path / "refs.pt")
    script = tmp_path / "remote.py"
    script.write_text(REMOTE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_HOME"] = str(tmp_path / "hf_home")  # a fresh modules cache
    res = subprocess.run([sys.executable, str(script), str(tmp_path / "refs.pt")], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=600)
    assert f"REMOTE-OK {len(ARCHS)}" in res.stdout, res.stdout[-2000:] + res.stderr[-4000:]


# -- the original's own sliding-window layers ---------------------------------------------------------


@pytest.mark.parametrize("arch", ["gemma2", "gemma3_text"])
def test_mixed_local_global_model_keeps_its_local_layers_softmax(arch):
    """Local layers stay the original sliding-window attention (their cache is bounded by the window);
    the global layer is converted, so the cache stops growing past the window."""
    model = converted(arch)
    assert model.config.linearize["layers"] == [1] and model.config.linearize["softmax_layers"] == [0, 2]
    sizes = []
    for n in (16, 64):
        cache = linearize.LinearizeCache(model.config)
        with torch.no_grad():
            model(prompt(n=n), past_key_values=cache, use_cache=True)
        sizes.append(cache.nbytes())
        assert type(cache.layers[0]).__name__ == "DynamicSlidingWindowLayer"
    assert sizes[0] == sizes[1] > 0  # everything bounded: window KV + linear state
    # named explicitly, local layers are converted
    explicit = converted(arch, linearize.LinearAttentionConfig(layers=[0, 1, 2]))
    assert explicit.config.linearize["layers"] == [0, 1, 2] and "softmax_layers" not in explicit.config.linearize


def test_all_local_model_converts_every_layer_and_bounds_the_window():
    """Mistral v0.1-style: every layer slides over 8 keys, so every layer is converted; a LoLCATs window
    wider than the original's would read keys the original never saw."""
    model = converted("mistral", linearize.LinearAttentionConfig(window=4), sliding_window=8)
    assert model.config.linearize["layers"] == [0, 1, 2]
    ids = prompt(n=20, b=2)
    torch.testing.assert_close(model.generate(ids, **GEN), model.generate(ids, use_cache=False, **GEN))
    with pytest.raises(ValueError, match="wider than layer 0's own sliding window \\(8\\).*window <= 8"):
        converted("mistral", linearize.LinearAttentionConfig(window=16), sliding_window=8)


# -- what is not supported, and loading errors ---------------------------------------------------------


def test_unsupported_variants_are_refused_clearly():
    model = tiny_model("gemma3_text", use_bidirectional_attention=True)
    with pytest.raises(ValueError, match="use_bidirectional_attention=True is not supported: bidirectional Gemma 3"):
        linearize.linearize(model, linearize.LinearAttentionConfig())
    with pytest.raises(ValueError, match="multimodal Gemma 3.*model_type gemma3_text"):
        linearize.arch.get_arch("gemma3")


def test_loader_picks_the_rows_attention_implementation_and_the_flag_overrides_it(tmp_path):
    gemma2, llama = save_original("gemma2", tmp_path / "g"), save_original("llama", tmp_path / "l")
    assert load_model_and_tokenizer(gemma2)[0].config._attn_implementation == "eager"
    assert load_model_and_tokenizer(llama)[0].config._attn_implementation == "sdpa"
    assert load_model_and_tokenizer(llama, attn_implementation="eager")[0].config._attn_implementation == "eager"
    with pytest.raises(UserError, match="could not load .*To fix: pass another attention implementation"):
        load_model_and_tokenizer(llama, attn_implementation="no_such_attention")


def test_loading_errors_are_one_line_through_the_cli(tmp_path, capsys):
    llama = save_original("llama", tmp_path / "l")
    out = tmp_path / "o"
    assert main(["convert", str(llama), "--out", str(out), "--attn-implementation", "eager"]) == 0
    assert json.loads((out / "config.json").read_text())["linearize"]["layers"] == [0, 1, 2]
    capsys.readouterr()
    assert main(["generate", str(out), "--prompt", "w5", "--max-new-tokens", "2", "--attn-implementation", "eager",
                 "--no-chat-template"]) == 0

    broken = tmp_path / "broken"  # a config but no weights
    broken.mkdir()
    (broken / "config.json").write_text((llama / "config.json").read_text())
    capsys.readouterr()
    assert main(["convert", str(broken), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    (line,) = [l for l in err.splitlines() if "error:" in l]  # one line (beside the progress bar)
    assert "Traceback" not in err and line.startswith(f"linearize convert: error: could not load {broken}"), err
    assert "To fix: pass a folder written by save_pretrained" in line

    (broken / "config.json").write_text("{not json")
    assert main(["eval", str(broken), "--data", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    (line,) = [l for l in err.splitlines() if "error:" in l]
    assert "Traceback" not in err and "could not load" in line and "To fix:" in line, err

    assert main(["convert", str(llama), "--out", str(tmp_path / "y"), "--attn-implementation", "no_such_attention"]) == 2
    err = capsys.readouterr().err
    (line,) = [l for l in err.splitlines() if "error:" in l]
    assert "Traceback" not in err and "--attn-implementation eager" in line, err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
