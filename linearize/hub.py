"""Push a converted checkpoint to the Hugging Face Hub in one commit, with a generated model card.

Only what a user needs to load the model travels: safetensors weights, config, generation config,
tokenizer files, the flat modeling files (remote code) and README.md (the card). Nothing local is
written or changed; every failure raises ``PushError`` with what to do.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
ALL_MINILM = "sentence-transformers/all-MiniLM-L6-v2"  # the embedded encoder (Apache-2.0)

# files of a checkpoint folder that are pushed (besides *.safetensors and the modeling *.py files)
CONFIG_FILES = (
    "config.json", "generation_config.json", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
    # encoders: WordPiece / SentencePiece vocabularies and the sentence-transformers modules
    "vocab.txt", "sentencepiece.bpe.model", "modules.json", "sentence_bert_config.json",
    "config_sentence_transformers.json",
)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def stage_records(summary: dict) -> list[dict]:
    """The per-stage records of a run's ``distill.json``, in order; a stage that did not run is absent."""
    return [summary[s] for s in ("stage1", "stage2", "stage3") if s in summary]


class PushError(RuntimeError):
    pass


def files_to_push(folder: Path) -> list[Path]:
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise PushError(f"{folder} is not a checkpoint folder (no config.json)")
    config = json.loads((folder / "config.json").read_text())
    if not config.get("linearize"):
        raise PushError(f"{folder} is not a converted checkpoint (its config has no `linearize` entry)")
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        pickles = [p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES]
        hint = f" (found {pickles}: pickled weights are never pushed)" if pickles else ""
        raise PushError(f"{folder} holds no .safetensors weights{hint}; save with save_pretrained(..., safe_serialization=True)")
    code = sorted(folder.glob("*.py"))
    if not any(p.name == "modeling_linearize.py" for p in code):
        raise PushError(f"{folder} has no modeling_linearize.py: re-save it with this version of linearize so it carries its code")
    modules = []  # sentence-transformers module folders (pooling, normalisation): their json files
    if (folder / "modules.json").is_file():
        for m in json.loads((folder / "modules.json").read_text()):
            if m.get("path"):
                modules += sorted((folder / m["path"]).glob("*.json"))
    return weights + [folder / n for n in CONFIG_FILES if (folder / n).is_file()] + code + modules


def _front_matter_license(readme: Path) -> str | None:
    if not readme.is_file():
        return None
    m = re.search(r"^---\n(.*?)\n---", readme.read_text(encoding="utf-8", errors="replace"), re.S)
    lic = re.search(r"^license:\s*(\S+)", m.group(1), re.M) if m else None
    return lic.group(1) if lic else None


def model_card(folder: Path, repo_id: str, license: str | None = None) -> str:
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    conv = config["linearize"]
    base = conv.get("base_model") or "unknown"
    n_layers = config.get("num_hidden_layers")
    layers = conv["layers"]
    license = license or conv.get("base_license") or ("apache-2.0" if base in (SMOLLM2, ALL_MINILM) else "other")
    encoder = conv["method"] in ("linformer", "encoder_linear_attention")
    if encoder:
        return _encoder_card(folder, repo_id, config, conv, base, license)
    lines = [
        "---",
        f"base_model: {base}" if base != "unknown" else "",
        f"license: {license}",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags:\n- linearize\n- linear-attention\n- distillation",
        "---",
        "",
        f"# {repo_id.split('/')[-1]}",
        "",
        f"`{base}` with its softmax attention replaced by **{conv['feature_map']} feature-map linear attention**"
        + (f" plus a {conv['window']}-token softmax window (LoLCATs-style hybrid)" if conv.get("window") else "")
        + (f" with a {conv['decay']} decay gate" if conv.get("decay") else "")
        + (f" of rank {conv['gate_rank']}" if conv.get("decay") and conv.get("gate_rank") else "")
        + (f" and an output gate of rank {conv['output_gate']}" if conv.get("output_gate") else "")
        + (f" and a {conv['conv_size']}-tap short convolution on q/k/v" if conv.get("conv_size") else "")
        + f" in {len(layers)} of {n_layers} layers"
        + ("" if len(layers) == n_layers else f" (converted: {layers}; the others keep softmax attention)")
        + ". Converted layers keep a constant-size recurrent state instead of a growing KV cache. "
        "Made with [linearize](https://pypi.org/project/linearize/).",
        "",
        f"License: the base model's license (`{license}`) applies.",
        "",
    ]
    distill = folder / "distill.json"
    if distill.is_file():
        d = json.loads(distill.read_text())
        tokens = sum(s.get("tokens", 0) for s in stage_records(d))
        c = d.get("config", {})
        lines += [
            "## Training",
            "",
            f"- recipe: `{c.get('preset')}`; stage 1 attention transfer: {c.get('stage1_steps')} steps; "
            f"stage 2 distillation ({c.get('finetune')}): {c.get('stage2_steps')} steps",
            f"- training tokens: {tokens:,}; data: `{d.get('data', {}).get('data')}`",
            "",
        ]
    eval_file = folder / "eval.json"
    if eval_file.is_file():
        lines += ["## Evaluation (held-out data, beside the teacher)", "", format_table(json.loads(eval_file.read_text())), ""]
    lines += [
        "## Usage",
        "",
        "```python",
        "# with the toolkit installed (pip install linearize): no remote code runs",
        "import linearize",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f'model = AutoModelForCausalLM.from_pretrained("{repo_id}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")',
        "",
        "# without it: the modeling files in this repository are loaded",
        f'model = AutoModelForCausalLM.from_pretrained("{repo_id}", trust_remote_code=True)',
        "```",
        "",
        "> **Warning:** `trust_remote_code=True` runs the Python files of this repository on your machine. "
        "Read them first (they are the small, flat `modeling_linearize.py` and the files it imports), "
        "or install `linearize` and load without it.",
        "",
    ]
    return "\n".join(l for l in lines if l is not None)


def _encoder_card(folder: Path, repo_id: str, config: dict, conv: dict, base: str, license: str) -> str:
    layers, n_layers = conv["layers"], config.get("num_hidden_layers")
    what = (f"**Linformer** attention (keys and values projected along the sequence to k={conv['k']} positions, "
            f"sharing `{conv['sharing']}`; inputs of at most {conv.get('max_length') or config.get('max_position_embeddings')} tokens)"
            if conv["method"] == "linformer" else f"**non-causal {conv['feature_map']} feature-map linear attention**")
    st = (folder / "modules.json").is_file()
    lines = ["---", f"base_model: {base}" if base != "unknown" else "", f"license: {license}",
             f"library_name: {'sentence-transformers' if st else 'transformers'}", "pipeline_tag: feature-extraction",
             "tags:\n- linearize\n- linear-attention\n- encoder", "---", "",
             f"# {repo_id.split('/')[-1]}", "",
             f"`{base}` with its softmax self-attention replaced by {what} in {len(layers)} of {n_layers} layers. "
             "Made with [linearize](https://pypi.org/project/linearize/).", "",
             f"License: the base model's license (`{license}`) applies.", ""]
    eval_file = folder / "eval.json"
    if eval_file.is_file():
        e = json.loads(eval_file.read_text())
        lines += ["## Agreement with the original (held-out passages)", "",
                  f"- mean cosine of sentence embeddings: {e['cosine']:.4f}",
                  f"- top-10 neighbour overlap: {100 * e.get('top10_overlap', 0):.1f}%", ""]
    lines += ["## Usage", "", "```python", "import linearize  # or pass trust_remote_code=True without it",
              "from transformers import AutoModel", f'model = AutoModel.from_pretrained("{repo_id}")']
    if st:
        lines += ["from sentence_transformers import SentenceTransformer",
                  f'embeddings = SentenceTransformer("{repo_id}", trust_remote_code=True).encode(["a sentence"])']
    lines += ["```", "", "> **Warning:** `trust_remote_code=True` runs the Python files of this repository on your machine. "
              "Read them first, or install `linearize` and load without it.", ""]
    return "\n".join(l for l in lines if l is not None)


def push_to_hub(folder, repo_id: str, *, private: bool = False, revision: str | None = None, token: str | None = None,
                endpoint: str | None = None, license: str | None = None, commit_message: str | None = None) -> str:
    """Upload a converted checkpoint folder in one commit; returns the commit URL."""
    import huggingface_hub
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError

    folder = Path(folder)
    files = files_to_push(folder)
    card = model_card(folder, repo_id, license)
    token = token or huggingface_hub.get_token()
    if not token:
        raise PushError("no Hugging Face token: run `hf auth login` or set HF_TOKEN (nothing was uploaded)")
    api = HfApi(endpoint=endpoint, token=token)
    ops = [CommitOperationAdd(path_in_repo=f.relative_to(folder).as_posix(), path_or_fileobj=str(f)) for f in files]
    ops.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=card.encode()))
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = api.create_commit(
            repo_id, operations=ops, revision=revision,
            commit_message=commit_message or f"Upload linearized model ({len(files)} files and model card)",
        )
    except HfHubHTTPError as err:
        status = getattr(err.response, "status_code", None)
        what = {401: "the token was refused", 403: f"no write access to {repo_id}",
                409: f"{repo_id} changed or conflicts with this upload (another commit or a repo of another type)"}
        raise PushError(f"push failed: {what.get(status, f'HTTP {status}')}: {err}. Nothing local was changed.") from err
    except (OSError, ConnectionError) as err:
        raise PushError(f"push failed: could not reach {api.endpoint} ({err}). Nothing local was changed; try again.") from err
    except Exception as err:  # httpx transport errors
        if type(err).__module__.startswith(("httpx", "requests", "urllib3")):
            raise PushError(f"push failed: could not reach {api.endpoint} ({err}). Nothing local was changed; try again.") from err
        raise
    return info.commit_url


def _se(se) -> str:
    """' ± x.xxx' (three decimals) after a figure with a standard error; nothing where none was recorded."""
    return "" if se is None else f" ± {se:.3f}"


def passkey_disagreements(student_hits: str, teacher_hits: str) -> tuple[int, int]:
    """Over the trials both ran (the same prompts, ``passkey_accuracy``'s ``hits``): how many the student
    retrieved and the teacher did not, and how many the teacher retrieved and the student did not. Only
    these trials tell the two apart: the student is behind when the second count clearly exceeds the first."""
    pairs = list(zip(student_hits, teacher_hits))
    return sum(s == "1" and t == "0" for s, t in pairs), sum(s == "0" and t == "1" for s, t in pairs)


def format_table(result: dict) -> str:
    """Markdown table: each metric beside the teacher's."""
    lines = ["| metric | student | teacher |", "|---|---|---|"]
    lines.append(f"| perplexity | {result['perplexity']:.3f} | {result.get('teacher_perplexity', float('nan')):.3f} |")
    if "top1_agreement" in result:
        lines.append(f"| next-token top-1 agreement | {result['top1_agreement']:.3f} | 1.000 |")
    lines += _token_classes("", result)
    if "generation_prefix_agreement" in result:
        lines.append(f"| greedy generation agreement (prefix share) | {result['generation_prefix_agreement']:.3f}"
                     f"{_se(result.get('generation_prefix_agreement_se'))} | 1.000 |")
        lines.append(f"| greedy generation exact match | {result['generation_exact_match']:.3f} | 1.000 |")
    if result.get("fluency_teacher_ppl_of_student") is not None:
        lines.append(f"| teacher's perplexity of the greedy continuations (fluency) | "
                     f"{result['fluency_teacher_ppl_of_student']:.3f} | {_num(result.get('fluency_teacher_ppl_of_teacher'))} |")
    if "chat_prefix_agreement" in result:
        lines.append(f"| chat answers: greedy agreement (prefix share) | {result['chat_prefix_agreement']:.3f}"
                     f"{_se(result.get('chat_prefix_agreement_se'))} | 1.000 |")
        lines.append(f"| chat answers: exact match | {result['chat_exact_match']:.3f} | 1.000 |")
        lines.append(f"| chat answers: teacher's perplexity | {_num(result.get('chat_teacher_ppl_of_student'))} | "
                     f"{_num(result.get('chat_teacher_ppl_of_teacher'))} |")
    if "window_only" in result:  # window hybrids with the branch beside the window (linear or GDN) zeroed
        w = result["window_only"]
        lines.append(f"| window only (the branch beside it zeroed): perplexity | {w['perplexity']:.3f} | "
                     f"{_num(result.get('teacher_perplexity'))} |")
        if "top1_agreement" in w:
            lines.append(f"| window only: next-token top-1 agreement | {w['top1_agreement']:.3f} | 1.000 |")
    for name, c in result.get("corpora", {}).items():
        ratio = f" (ratio {c['perplexity_ratio']:.3f})" if "perplexity_ratio" in c else ""
        lines.append(f"| {name}: perplexity{ratio} | {c['perplexity']:.3f} | {_num(c.get('teacher_perplexity'))} |")
        if "top1_agreement" in c:
            lines.append(f"| {name}: next-token top-1 agreement | {c['top1_agreement']:.3f} | 1.000 |")
        lines += _token_classes(f"{name}: ", c)
    for prefix, figures in (("", result), ("window only: ", result.get("window_only", {}))):
        for L, acc in figures.get("passkey", {}).items():
            t = result.get("teacher_passkey", {}).get(L, float("nan"))
            n = figures.get("passkey_trials", {}).get(L)
            lines.append(f"| {prefix}passkey @ {L} tokens{f' ({n} trials)' if n else ''} | {acc:.2f} | {t:.2f} |")
            mine, theirs = figures.get("passkey_hits", {}).get(L), result.get("teacher_passkey_hits", {}).get(L)
            if mine is not None and theirs is not None:
                s_only, t_only = passkey_disagreements(mine, theirs)
                lines.append(f"| {prefix}passkey @ {L} tokens: retrieved where the other did not | {s_only} | {t_only} |")
    lines.append(f"| evaluated tokens | {result['tokens']} | |")
    return "\n".join(lines)


def _token_classes(prefix: str, r: dict) -> list[str]:
    """Perplexity on the recall tokens (a bigram seen earlier in the document) and on the others, then
    by band of document positions in one row (each band's perplexity, student and teacher)."""
    names = {"recall": "recall tokens (bigram seen earlier in the document)", "other": "other tokens"}
    lines = [f"| {prefix}perplexity on {names[k]}, {r[k]['share']:.0%} of tokens | {r[k]['perplexity']:.3f} | "
             f"{_num(r[k].get('teacher_perplexity'))} |" for k in names if k in r]
    bands = r.get("by_position") or {}
    if bands:
        def each(key):
            return " / ".join("n/a" if b.get(key) is None else f"{b[key]:.2f}" for b in bands.values())
        lines.append(f"| {prefix}perplexity at document positions {' / '.join(bands)} | {each('perplexity')} | "
                     f"{each('teacher_perplexity')} |")
    return lines


def _num(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"
