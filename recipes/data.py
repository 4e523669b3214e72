"""Training and evaluation text: sources, a fixed held-out split, tokenization and packing.

A source is one of
- ``stdlib-docs``: the docstrings of Python's standard library (always on disk: the default for
  the demo and the tests, since no machine here reaches a dataset hub);
- a local file: ``.txt`` (documents separated by blank lines), ``.jsonl`` / ``.json`` / ``.parquet``
  (a ``text`` field, or ``messages`` / ``prompt``+``response`` rendered with the chat template);
- a local folder: every ``.txt``, ``.rst``, ``.md`` file in it (``.gz`` too), one document each; a folder
  without those but with ``.jsonl`` files (e.g. the shards of ``linearize generate-data --shard``): their
  records, file after file in name order, as one ``.jsonl`` file's;
- anything else: a ``datasets`` hub name (``name`` or ``name:config``), split ``train``.

``data`` may also be a mix: sources separated by commas, each optionally followed by ``@WEIGHT``, e.g.
``/data/linux-doc@1,/data/python-doc@2,chat.jsonl@0.5`` (``@`` since ``:`` already separates a hub
name's config). Without weights the sources are concatenated (each contributes its size; one source
is exactly the single-source case). With weights, each source's share of the training rows is its
weight over the sum of weights (a source without one counts 1) and the total stays the sum of the
sources' rows: a source whose share exceeds its size is repeated (whole copies, then a seeded subset
of its rows), a larger one is subsampled (a seeded subset). The held-out split stays per document
within every source; evaluation takes the held-out documents of all sources together.

The held-out split is chosen per document by a hash of its text, so it never depends on order,
on the token budget or on the seed: the recipes train on ``split="train"`` and every reported
figure uses ``split="held_out"``.
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class DataConfig:
    """Args:
    data: the source (a file, a folder, stdlib-docs or a hub name), or a mix SOURCE[@WEIGHT],SOURCE[@WEIGHT],...
        whose weights are the sources' shares of the training rows, e.g. docs@3,chat.jsonl@1 (a source
        without one counts 1; no weights at all: concatenation).
    seq_len: tokens per packed training row.
    held_out_percent: share of documents (by text hash) kept out of training for evaluation.
    max_documents: read at most this many documents (0 = all).
    token_cache: where tokenized documents are kept for the next run on the same text and tokenizer
        ("auto": $LINEARIZE_CACHE or ~/.cache/linearize/tokens; "none": tokenize every time). Runs that
        start together on one machine tokenize once: the others wait for the first and read its file.
    long_seq_len: tokens per row of distill's long-row stage (``DistillConfig.long_share``): the same
        training documents packed again into rows this long, positions running over the whole row
        across document boundaries, for retrieval at long contexts (0 = no such stage; unset: the
        preset's, 8192 for gdn-hybrid, else 0).
    long_min_doc_tokens: with a long-row stage, make its rows of the training documents at least this many
        tokens long alone (e.g. 8192: a row then holds one document, or the end of one and the start of
        the next, so the keys older than the window are the same text's, not other short documents';
        a source with too few such tokens for one long row is left out of them). 0 = every document.
    """

    data: str = "stdlib-docs"
    seq_len: int = 512
    held_out_percent: float = 5.0
    max_documents: int = 0
    token_cache: str = "auto"
    long_seq_len: int | None = None
    long_min_doc_tokens: int = 0

    def __post_init__(self):
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {self.seq_len}")
        if self.long_seq_len is not None and self.long_seq_len < 0:
            raise ValueError(f"long_seq_len must be >= 0 (0 = no long-row stage), got {self.long_seq_len}")
        if self.long_seq_len and (self.long_seq_len <= self.seq_len or self.long_seq_len % self.seq_len):
            raise ValueError(f"long_seq_len must be a multiple of seq_len ({self.seq_len}) above it, so that a step "
                             f"of long rows holds the same tokens; got {self.long_seq_len} (0 = no long-row stage)")
        if self.long_min_doc_tokens < 0:
            raise ValueError(f"long_min_doc_tokens must be >= 0 (0 = every document), got {self.long_min_doc_tokens}")
        if self.long_min_doc_tokens and self.long_seq_len == 0:
            raise ValueError("long_min_doc_tokens picks the long-row stage's documents, and long_seq_len is 0 (no such "
                             "stage): give a long_seq_len or leave long_min_doc_tokens at 0")
        if not 0 < self.held_out_percent < 100:
            raise ValueError(f"held_out_percent must be in (0, 100), got {self.held_out_percent}")
        parse_sources(self.data)  # a bad weight fails here, before anything loads


def parse_sources(spec: str) -> list[tuple[str, float | None]]:
    """``"a@2,b,c@0.5"`` -> ``[("a", 2.0), ("b", None), ("c", 0.5)]``: the sources of ``--data`` and
    their weights (None: not given). An item that is an existing path keeps any ``@`` it contains."""
    items = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            raise ValueError(f"data {spec!r}: an empty item; separate sources by single commas")
        source, at, weight = item.rpartition("@")
        if not at or Path(item).exists():
            source, w = item, None
        else:
            try:
                w = float(weight)
            except ValueError:
                w = math.nan
            if not (math.isfinite(w) and w > 0) or not source:
                raise ValueError(f"data item {item!r}: bad weight {weight!r}; write SOURCE@WEIGHT with a positive number")
        if source in (s for s, _ in items):
            raise ValueError(f"data item {item!r}: source {source!r} is named twice")
        items.append((source, w))
    return items


def stdlib_documents() -> list[str]:
    """Module, class and function docstrings of the Python standard library, one document per module."""
    import importlib
    import importlib.util
    import inspect
    import pkgutil
    import sys
    import warnings

    skip = ("test", "idlelib", "tkinter", "turtle", "antigravity", "this", "lib2to3", "ensurepip", "venv", "__", "pydoc_data")
    names = set()
    for name in sys.stdlib_module_names:
        if name.startswith(skip):
            continue
        names.add(name)
        spec = importlib.util.find_spec(name) if name.isidentifier() else None
        if spec is not None and spec.submodule_search_locations:  # a package: its submodules too
            for info in pkgutil.walk_packages(spec.submodule_search_locations, prefix=name + "."):
                if not any(part.startswith(skip) for part in info.name.split(".")[1:]):
                    names.add(info.name)
    docs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in sorted(names):
            try:
                mod = importlib.import_module(name)
            except BaseException:
                continue
            parts = [inspect.getdoc(mod) or ""]
            for attr, obj in sorted(vars(mod).items()):
                if attr.startswith("_") or getattr(obj, "__module__", None) != name:
                    continue
                if inspect.isclass(obj) or inspect.isfunction(obj):
                    doc = inspect.getdoc(obj)
                    if doc and len(doc) > 80:
                        parts.append(f"{attr}\n{doc}")
                if inspect.isclass(obj):
                    for meth, fn in sorted(vars(obj).items()):
                        doc = inspect.getdoc(fn) if inspect.isfunction(fn) and not meth.startswith("_") else None
                        if doc and len(doc) > 80:
                            parts.append(f"{attr}.{meth}\n{doc}")
            text = "\n\n".join(p for p in parts if p).strip()
            if len(text) > 200:
                docs.append(text)
    return docs


def _read_text(path: Path) -> str:
    """The file's text; invalid UTF-8 is an error naming the file and line (not silently replaced)."""
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise ValueError(f"{path} line {line}: invalid UTF-8 ({err.reason} at byte {err.start}); "
                         "convert the file to UTF-8") from None


def _json_records(path: Path, text: str) -> list:
    if path.suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} line {err.lineno}: invalid JSON ({err.msg})") from None
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path} line {n}: invalid JSON ({err.msg}); each line must be one JSON object") from None
    return records


def _record_text(rec: dict, tokenizer) -> str:
    if not isinstance(rec, dict):
        raise ValueError(f"a record must be a JSON object with 'text', 'messages' or 'prompt'+'response'; got {rec!r:.60}")
    if "text" in rec:
        return rec["text"]
    if "messages" in rec:
        return tokenizer.apply_chat_template(rec["messages"], tokenize=False)
    if "prompt" in rec and ("response" in rec or "completion" in rec):
        msgs = [{"role": "user", "content": rec["prompt"]},
                {"role": "assistant", "content": rec.get("response", rec.get("completion"))}]
        if getattr(tokenizer, "chat_template", None):
            return tokenizer.apply_chat_template(msgs, tokenize=False)
        return msgs[0]["content"] + "\n" + msgs[1]["content"]
    raise ValueError(f"a record needs 'text', 'messages' or 'prompt'+'response'; got keys {sorted(rec)}")


def load_documents(source: str, tokenizer=None, max_documents: int = 0) -> list[str]:
    """The documents of ``source``; of a mix (see module doc), every source's in turn (weights are
    ignored: for evaluation and calibration), ``max_documents`` per source."""
    return [d for s, _ in parse_sources(source) for d in _source_documents(s, tokenizer, max_documents)]


def _source_documents(source: str, tokenizer=None, max_documents: int = 0) -> list[str]:
    path = Path(source)
    looks_local = path.suffix in (".txt", ".gz", ".jsonl", ".json", ".parquet") or source.startswith((".", "/", "~"))
    if looks_local and not path.exists():
        raise ValueError(f"data not found: {source} (pass a file, a folder, 'stdlib-docs' or a datasets hub name)")
    if source == "stdlib-docs":
        docs = stdlib_documents()
    elif path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.is_file())
        files = [p for p in found if p.name.removesuffix(".gz").endswith((".txt", ".rst", ".md"))]
        records = [p for p in found if p.suffix == ".jsonl"]
        if files:
            docs = [_read_text(p) for p in files[: max_documents or None]]
        elif records:
            docs = [_record_text(r, tokenizer) for p in records for r in _json_records(p, _read_text(p))]
        else:
            raise ValueError(f"no .txt/.rst/.md or .jsonl files under {path}")
    elif path.suffix in (".txt", ".gz"):
        docs = [d.strip() for d in _read_text(path).split("\n\n\n")]
        if len(docs) < 2:
            docs = [d.strip() for d in _read_text(path).split("\n\n")]
    elif path.suffix in (".jsonl", ".json"):
        docs = [_record_text(r, tokenizer) for r in _json_records(path, _read_text(path))]
    elif path.suffix == ".parquet":
        import datasets

        docs = [_record_text(r, tokenizer) for r in datasets.Dataset.from_parquet(str(path))]
    elif path.exists():
        raise ValueError(f"unsupported data file {path}: use .txt, .jsonl, .json, .parquet or a folder")
    else:
        import datasets

        name, _, config = source.partition(":")
        try:
            ds = datasets.load_dataset(name, config or None, split="train")
        except Exception as err:  # offline, or no such dataset: one line naming the source
            reason = (str(err).strip().splitlines() or [""])[0][:200]
            raise ValueError(f"data source {source!r}: not a local file or folder, and the datasets hub "
                             f"could not load it ({type(err).__name__}: {reason})") from None
        docs = [_record_text(r, tokenizer) for r in ds.select(range(min(len(ds), max_documents or len(ds))))]
    docs = [d for d in docs if d and d.strip()]
    if not docs:
        raise ValueError(f"no documents found in {source!r}")
    return docs[: max_documents or None]


def is_held_out(text: str, percent: float) -> bool:
    h = int.from_bytes(hashlib.sha256(text.encode("utf-8", errors="replace")).digest()[:8], "big")
    return (h % 10_000) < percent * 100


def split_documents(docs: list[str], percent: float, need_both: bool = True) -> tuple[list[str], list[str]]:
    """(train, held out) by text hash; ``need_both``: an empty side is an error."""
    flags = [is_held_out(d, percent) for d in docs]
    train = [d for d, h in zip(docs, flags) if not h]
    held = [d for d, h in zip(docs, flags) if h]
    if need_both and (not train or not held):
        raise ValueError(f"{len(docs)} documents give an empty train or held-out split at {percent}%: add data")
    return train, held


def pack(token_docs: list[list[int]], seq_len: int, eos_id: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate documents (each followed by EOS) into rows of ``seq_len`` tokens.

    Returns ``input_ids (N, seq_len)`` and ``position_ids (N, seq_len)`` that restart at 0 at every
    document start, so attention never crosses a document boundary (softmax layers get a
    block-diagonal mask from transformers, converted layers restart their state). The tail that
    does not fill a row is dropped; a document longer than a row continues in the next row.
    """
    tail = [eos_id] if eos_id is not None else []
    # one tensor per document, then one concatenation: ~100M tokens pack in seconds, not minutes
    docs = [torch.tensor(list(doc) + tail, dtype=torch.long) for doc in token_docs]
    ids = torch.cat(docs) if docs else torch.zeros(0, dtype=torch.long)
    lens = torch.tensor([len(d) for d in docs], dtype=torch.long)
    starts = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
    n = len(ids) // seq_len
    if n == 0:
        raise ValueError(f"only {len(ids)} tokens: not enough for one row of {seq_len}")
    ids_t = ids[: n * seq_len].view(n, seq_len)
    pos_t = (torch.arange(len(ids)) - starts)[: n * seq_len].view(n, seq_len)
    # a row that starts mid-document restarts its positions at the row start
    pos_t = pos_t - _row_offset(pos_t)
    return ids_t, pos_t


def _row_offset(pos: torch.Tensor) -> torch.Tensor:
    """Subtract the first document's starting position in each row (only up to its first restart)."""
    first = pos[:, :1]
    restarted = torch.cumsum((pos == 0).long(), dim=1) > 0
    return torch.where(restarted, torch.zeros_like(pos), first.expand_as(pos))


def token_cache_dir(setting: str) -> Path | None:
    if setting in ("", "none"):
        return None
    if setting != "auto":
        return Path(setting).expanduser()
    return Path(os.environ.get("LINEARIZE_CACHE") or Path.home() / ".cache" / "linearize") / "tokens"


def _fingerprint(docs: list[str], tokenizer) -> str | None:
    """sha256 of the documents' texts and the tokenizer's definition (None: a tokenizer without a
    serialisable fast backend is not cached)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    h = hashlib.sha256(b"linearize-tokens-v1\0")
    h.update(hashlib.sha256(backend.to_str().encode()).digest())
    for d in docs:
        b = d.encode("utf-8", errors="surrogatepass")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def cached_tokenize(docs: list[str], tokenizer, cache: str = "auto") -> list[list[int]]:
    """``tokenize``, kept in the token cache (``DataConfig.token_cache``) under the fingerprint of the
    texts and the tokenizer: a later run on the same documents reads the ids instead of tokenizing
    (~100M tokens: minutes of CPU). A file lock makes concurrent runs tokenize once; the file is
    written whole (a temporary name, then a rename) as safetensors."""
    folder = token_cache_dir(cache)
    key = _fingerprint(docs, tokenizer) if folder is not None else None
    if key is None:
        return tokenize(docs, tokenizer)
    import fcntl

    from safetensors.torch import load_file, save_file

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{key}.safetensors"
    with open(folder / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not path.exists():
            ids = tokenize(docs, tokenizer)
            lens = torch.tensor([len(x) for x in ids], dtype=torch.int64)
            flat = torch.cat([torch.tensor(x, dtype=torch.int32) for x in ids]) if ids else torch.zeros(0, dtype=torch.int32)
            tmp = path.with_name(path.name + ".tmp")
            save_file({"ids": flat, "lengths": lens}, str(tmp))
            os.replace(tmp, path)
            return ids
    t = load_file(str(path))
    return [x.tolist() for x in torch.split(t["ids"], t["lengths"].tolist())]


def tokenize(docs: list[str], tokenizer, batch: int = 256) -> list[list[int]]:
    """Token ids per document, ``batch`` documents per tokenizer call (a fast tokenizer encodes a
    list on all cores; one call per document would use one)."""
    out = []
    for i in range(0, len(docs), batch):
        out += tokenizer(docs[i:i + batch], add_special_tokens=False).input_ids
    return out


def mix_rows(counts: list[int], weights: list[float | None], seed: int = 0) -> list[torch.Tensor]:
    """Which rows of each source the training takes: per source, indices into its ``counts[i]``
    packed rows. Without weights, all rows once. With weights, ``sum(counts)`` rows in all, source
    ``i`` taking the share ``weights[i] / sum(weights)`` (None counts 1): whole copies of its rows,
    then a subset drawn with ``seed`` (a function of ``seed`` and ``i`` alone, so deterministic)."""
    if all(w is None for w in weights):
        return [torch.arange(n) for n in counts]
    w = [1.0 if x is None else x for x in weights]
    total = sum(counts)
    picks = []
    for i, (n, wi) in enumerate(zip(counts, w)):
        target = round(total * wi / sum(w))
        g = torch.Generator().manual_seed(seed * 1000 + i)
        rest = torch.randperm(n, generator=g)[: target % n].sort().values
        picks.append(torch.cat([torch.arange(n).repeat(target // n), rest]))
    return picks


def prepare_mix(data_cfg: DataConfig, tokenizer, seed: int = 0) -> tuple[dict, list[str], list[dict]]:
    """Training rows, held-out documents and a record per source for ``data_cfg.data`` (one source or
    a mix, see module doc).

    Returns ``{"input_ids": (N, seq_len), "position_ids": (N, seq_len)}`` (with ``long_seq_len``, also
    ``"long"``: the same documents as rows of that length, positions unbroken, mixed alike), the held-out documents of
    all sources (one of each source in turn: the evaluation's first rows span the mix), and per source:
    documents, held-out documents, its distinct
    training tokens (whole packed rows), the rows it contributes and their share of ``N``.
    """
    sources = parse_sources(data_cfg.data)
    ids, pos, helds, records, longs = [], [], [], [], []
    for source, weight in sources:
        docs = _source_documents(source, tokenizer, data_cfg.max_documents)
        # in a mix a small source may have no held-out document; the mix needs one somewhere (below)
        train, held = split_documents(docs, data_cfg.held_out_percent, need_both=len(sources) == 1)
        if not train:
            raise ValueError(f"data source {source!r}: all {len(docs)} documents are held out; add documents")
        try:
            tokens = cached_tokenize(train, tokenizer, data_cfg.token_cache)
            i, p = pack(tokens, data_cfg.seq_len, tokenizer.eos_token_id)
        except ValueError as err:
            raise ValueError(f"data source {source!r}: {err}") from None
        if data_cfg.long_seq_len:
            longs.append(_long_rows(tokens, i, data_cfg, tokenizer.eos_token_id))
        ids.append(i)
        pos.append(p)
        helds.append(held)
        records.append({"source": source, "weight": weight, "documents": len(docs), "held_out_documents": len(held),
                        "tokens": i.numel()})
    # one document of each source in turn: the evaluation's first rows span every source, not the first
    held_all = [d for group in itertools.zip_longest(*helds) for d in group if d is not None]
    if not held_all:
        raise ValueError(f"no held-out document in any source of {data_cfg.data!r} at {data_cfg.held_out_percent}%: add data")
    picks = mix_rows([i.shape[0] for i in ids], [w for _, w in sources], seed)
    total = sum(len(k) for k in picks)
    for rec, k, i in zip(records, picks, ids):
        rec.update(rows=len(k), share=round(len(k) / total, 4), repeats=round(len(k) / i.shape[0], 3))
    rows = {"input_ids": torch.cat([i[k] for i, k in zip(ids, picks)]),
            "position_ids": torch.cat([p[k] for p, k in zip(pos, picks)])}
    if data_cfg.long_seq_len:
        kept = [(rec, i, w) for rec, i, (_, w) in zip(records, longs, sources) if i is not None]
        if not kept:
            if data_cfg.long_min_doc_tokens:
                raise ValueError(f"data {data_cfg.data!r}: no source holds {data_cfg.long_seq_len} training tokens in "
                                 f"documents of at least {data_cfg.long_min_doc_tokens} tokens for one long row; lower "
                                 "--long-min-doc-tokens or add long documents")
            raise ValueError(f"data {data_cfg.data!r}: no source holds {data_cfg.long_seq_len} training tokens for one "
                             "long row; lower --long-seq-len or add data")
        picks = mix_rows([i.shape[0] for _, i, _ in kept], [w for *_, w in kept], seed)
        long_ids = torch.cat([i[k] for (_, i, _), k in zip(kept, picks)])
        for rec in records:  # each source's distinct long-row tokens and the long rows it gives (0: too few for one)
            rec.update(long_tokens=0, long_rows=0)
        for (rec, i, _), k in zip(kept, picks):
            rec.update(long_tokens=i.numel(), long_rows=len(k))
        rows["long"] = {"input_ids": long_ids,
                        "position_ids": torch.arange(data_cfg.long_seq_len).expand_as(long_ids).clone()}
    return rows, held_all, records


def _long_rows(tokens: list[list[int]], short: torch.Tensor, data_cfg: DataConfig, eos_id: int | None):
    """One source's long rows (None where it holds too few tokens for one): its packed stream cut into rows
    r times longer (long_seq_len = r * seq_len: r consecutive short rows), or with long_min_doc_tokens its
    documents that long alone, packed into rows of long_seq_len."""
    n = data_cfg.long_seq_len
    if data_cfg.long_min_doc_tokens:
        try:
            return pack([t for t in tokens if len(t) >= data_cfg.long_min_doc_tokens], n, eos_id)[0]
        except ValueError:  # not enough tokens in such documents for one row
            return None
    r = n // data_cfg.seq_len
    return short[: short.shape[0] // r * r].reshape(-1, n) if short.shape[0] >= r else None


def synthetic_rows(n_rows: int, seq_len: int, vocab: int, seed: int = 0, packed: bool = True) -> dict[str, torch.Tensor]:
    """Random token rows for speed measurements (speed does not depend on the tokens): with
    ``packed``, documents of log-normal lengths like the Linux docs' (median ~560 tokens) with
    position ids restarting at each, a row may start mid-document; else one document per row."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n_rows, seq_len), generator=g)
    if not packed:
        return {"input_ids": ids, "position_ids": torch.arange(seq_len).expand(n_rows, seq_len).clone()}
    pos = torch.empty(n_rows, seq_len, dtype=torch.long)
    for r in range(n_rows):
        t = 0
        while t < seq_len:
            n = int(torch.empty(1).log_normal_(6.3, 1.2, generator=g).clamp(16, 4096))  # doc length
            n = min(n, seq_len - t) if t else n % seq_len or seq_len  # a row may start mid-document
            pos[r, t:t + n] = torch.arange(n)
            t += n
    return {"input_ids": ids, "position_ids": pos}
