"""Training corpora from Debian bookworm documentation packages, and one out-of-domain corpus.

Run here (a machine that reaches the Debian archive), from the checkout's root:

    .venv/bin/python scripts/device/corpus.py                 # all sources, token counts, archives
    .venv/bin/python scripts/device/corpus.py --only git-doc  # some sources

It downloads each source's packages (``apt-get download``, nothing installed), extracts one plain-text
document per file (or per dictionary chunk, info node, Bible chapters) into ``WORK/text/<source>/``,
drops documents shorter than ``MIN_CHARS`` and exact duplicates (after whitespace normalisation, across
all sources), and writes ``.data/<source>.tar.xz`` (split into ``<source>-N.tar.xz`` above
``--max-mib``; each unpacks to ``<source>/``). The out-of-domain corpus (``ood-kjv``: the King James
Bible, from ``bible-kjv-text`` through the ``bible`` program of ``bible-kjv``) is written the same way,
for evaluation only. It prints a table of documents, SmolLM2 tokens (from a sample of a large source) and archive
sizes per source.
The GPU machine unpacks the archives with ``scripts/device/prepare.sh`` (python's tarfile and lzma).
"""

from __future__ import annotations

import argparse
import base64
import gzip
import hashlib
import html.parser
import os
import re
import shutil
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

MIN_CHARS = 400  # shorter documents are stubs (an API entry's title, a redirect page)
DICT_CHUNK_CHARS = 12_000  # dictionary entries grouped into documents of ~3K tokens
BOILERPLATE_SHARE = 0.1  # an HTML source's line in more than this share of its pages is navigation

# source: (packages, extractor, paths under the extracted packages (globs), notes)
SOURCES = {
    "python-doc": (["python3.11-doc"], "text", ["usr/share/doc/python3.11/html/_sources/**/*.txt"]),
    "sphinx-sources": (["python-pandas-doc", "python-sklearn-doc", "python-astropy-doc", "python-sympy-doc",
                        "python-pytest-doc", "sphinx-doc", "python-flask-doc", "python-werkzeug-doc", "cmake-doc",
                        "debian-policy", "developers-reference"], "text", ["**/_sources/**/*.txt"]),
    "django-doc": (["python-django-doc"], "html", ["usr/share/doc/python-django-doc/html/**/*.html"]),
    "scipy-doc": (["python-scipy-doc"], "html", ["usr/share/doc/python-scipy-doc/html/**/*.html"]),
    "sqlalchemy-doc": (["python-sqlalchemy-doc"], "text", ["**/*.rst"]),
    "rust-books": (["rust-doc"], "html", [f"usr/share/doc/rust-doc/html/{b}/**/*.html" for b in
                   ("book", "reference", "rust-by-example", "nomicon", "edition-guide", "rustc", "cargo",
                    "embedded-book", "rustdoc", "style-guide", "unstable-book", "error_codes")]),
    "erlang-doc": (["erlang-doc"], "html", ["**/*.html"]),
    "ghc-doc": (["ghc-doc"], "text", ["**/_sources/**/*.txt"]),
    "postgresql-doc": (["postgresql-doc-15"], "html", ["**/*.html"]),
    "apache-doc": (["apache2-doc"], "html", ["usr/share/doc/apache2-doc/manual/en/**/*.html"]),
    "sqlite-doc": (["sqlite3-doc"], "html", ["**/*.html"]),
    "octave-doc": (["octave-doc"], "html", ["**/*.html"]),
    "gimp-help": (["gimp-help-en"], "html", ["**/*.html"]),
    "debian-handbook": (["debian-handbook"], "html", ["usr/share/doc/debian-handbook/html/en-US/**/*.html"]),
    "debian-reference": (["debian-reference-en", "maint-guide", "debian-faq"], "html", ["**/*.en.html", "**/index.html"]),
    "gnome-help": (["gnome-user-docs"], "html", ["usr/share/help/C/**/*.page"]),
    "nodejs-doc": (["nodejs-doc"], "text", ["**/api/*.md.gz"]),
    "zsh-doc": (["zsh-doc"], "html", ["**/*.html"]),
    "lilypond-info": (["lilypond-doc"], "info", ["usr/share/info/lilypond-*.info*.gz"]),
    "perl-doc": (["perl-doc"], "text", ["**/*.pod"]),
    "git-doc": (["git-doc"], "text", ["usr/share/doc/git-doc/**/*.txt"]),
    "vim-help": (["vim-runtime"], "text", ["usr/share/vim/vim*/doc/*.txt"]),
    "man-pages": (["manpages", "manpages-dev"], "man", ["usr/share/man/man*/*.gz"]),
    "man-pages-more": ("systemd util-linux coreutils openssh-client bash tar findutils grep sed gawk iproute2 procps "
                       "apt dpkg lvm2 openssl curl rsync tmux nftables git-man gnupg sudo mutt postfix nmap ffmpeg "
                       "imagemagick-6.q16 lsof strace e2fsprogs mdadm cryptsetup-bin rsyslog cron less vim-common "
                       "zsh-common sqlite3 wget iptables btrfs-progs xfsprogs parted bind9-dnsutils isc-dhcp-client "
                       "ntpsec fetchmail exim4-config samba-common-bin cups-client".split(), "man",
                       ["usr/share/man/man*/*.gz"]),
    "app-manuals": (["gnucash-docs", "kicad-doc-en"], "html", ["usr/share/doc/gnucash-docs/gnucash-*-en/*.html",
                                                              "usr/share/doc/kicad-doc-en/**/*.html"]),
    "gcide": (["dict-gcide"], "dict", ["usr/share/dictd/gcide.dict.dz"]),
    "foldoc": (["dict-foldoc", "dict-jargon"], "dict", ["usr/share/dictd/*.dict.dz"]),
    "wordnet": (["dict-wn"], "dict", ["usr/share/dictd/wn.dict.dz"]),
    "sage-doc": (["sagemath-doc"], "html", ["usr/share/doc/sagemath/html/en/**/*.html"]),
    "llvm-doc": (["llvm-15-doc", "clang-15-doc"], "text", ["**/_sources/**/*.txt"]),
    "qt5-doc": (["qtbase5-doc-html"], "html", ["**/*.html"]),
    "math-doc": (["gap-doc", "maxima-doc", "gnuplot-doc"], "html", ["**/*.html"]),
    "binutils-info": (["binutils-doc"], "info", ["usr/share/info/*.info*.gz"]),
    "perl-modules": (["perl-modules-5.36"], "pod", ["**/*.pm"]),
    "fortunes": (["fortunes", "dict-devil"], "fortune", ["usr/share/games/fortunes/*", "usr/share/dictd/*.dict.dz"]),
    "crawl-text": (["crawl-common"], "text", ["usr/share/crawl/dat/descript/*.txt", "usr/share/doc/crawl-common/*.txt"]),
}
# built only when named in --only: Jane Austen's six novels, one document per chapter, a narrative source in no
# preset's mix (2026-11-30e: it closed its own held-out gap, not the Bible's); its R data needs Rscript
# (apt-get install r-base-core)
OPTIONAL = {"austen": (["r-cran-janeaustenr"], "rdata", ["usr/lib/R/site-library/janeaustenr/data/Rdata.rdb"])}
OOD = {"ood-kjv": (["bible-kjv-text", "bible-kjv"], "bible", [])}


def read(path: Path) -> str:
    raw = path.read_bytes()
    if path.name.endswith((".gz", ".dz")):
        raw = gzip.decompress(raw)
    return raw.decode("utf-8", errors="replace")


class _Text(html.parser.HTMLParser):
    """The visible text of an HTML (or Mallard XML) page, a line per block element."""
    SKIP = {"script", "style", "head", "nav", "footer", "title"}
    BLOCK = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "section", "dt", "dd",
             "table", "ul", "ol", "blockquote", "title", "page", "listing", "item", "note", "example"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts, self.skip, self.pre = [], 0, 0

    def handle_starttag(self, tag, attrs):
        self.skip += tag in self.SKIP
        self.pre += tag == "pre"
        if tag in self.BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        self.skip -= tag in self.SKIP and self.skip > 0
        self.pre -= tag == "pre" and self.pre > 0
        if tag in self.BLOCK:
            self.parts.append("\n")

    def handle_data(self, data):
        if not self.skip:
            self.parts.append(data if self.pre else re.sub(r"\s+", " ", data))


def html_text(src: str) -> str:
    p = _Text()
    p.feed(src)
    lines = [l.rstrip() for l in "".join(p.parts).splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def drop_boilerplate(docs: list[str]) -> list[str]:
    """Remove the lines (navigation, headers, footers) that recur in many pages of one source."""
    counts = Counter(l for d in docs for l in {l.strip() for l in d.splitlines() if l.strip()})
    limit = max(5, BOILERPLATE_SHARE * len(docs))
    return [re.sub(r"\n{3,}", "\n\n", "\n".join(l for l in d.splitlines() if counts[l.strip()] <= limit)).strip()
            for d in docs]


def man_text(path: Path) -> str:
    env = {**os.environ, "MANWIDTH": "80", "LC_ALL": "C.UTF-8"}
    out = subprocess.run(["man", "-l", "-P", "cat", "-E", "UTF-8", str(path)], capture_output=True, env=env)
    return re.sub(r".\x08", "", out.stdout.decode("utf-8", errors="replace"))


def dict_entries(path: Path) -> list[str]:
    """dictd entries in index order (one per offset), grouped into documents of DICT_CHUNK_CHARS."""
    data = gzip.decompress(path.read_bytes())  # dictzip is gzip
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    num = lambda s: sum(alphabet.index(c) * 64 ** i for i, c in enumerate(reversed(s)))
    spans = set()
    for line in path.with_name(path.name.removesuffix(".dict.dz") + ".index").read_text(errors="replace").splitlines():
        parts = line.split("\t")
        if len(parts) >= 3 and not parts[0].startswith("00-database"):
            spans.add((num(parts[1]), num(parts[2])))
    return chunks(data[off:off + n].decode("utf-8", errors="replace").strip() for off, n in sorted(spans))


def chunks(entries) -> list[str]:
    """Consecutive short entries (dictionary entries, fortunes) joined into documents of DICT_CHUNK_CHARS."""
    docs, cur = [], []
    for e in entries:
        cur.append(e)
        if sum(map(len, cur)) >= DICT_CHUNK_CHARS:
            docs.append("\n\n".join(cur))
            cur = []
    return docs + (["\n\n".join(cur)] if cur else [])


def pod_text(src: str) -> str:
    """The POD blocks of a Perl module (``=head1`` ... ``=cut``)."""
    return "\n".join(m[0] for m in re.finditer(r"(?ms)^=[a-z].*?(?:^=cut\b|\Z)", src)).replace("\n=cut", "")


def info_nodes(paths: list[Path]) -> list[str]:
    """GNU info manuals, one document per node (nodes are separated by ``\\x1f``)."""
    docs = []
    for p in paths:
        for node in read(p).split("\x1f"):
            body = node.split("\n", 2)[-1] if node.startswith("\nFile:") else ""
            if "\x00\x08[index" not in body:  # an index node: a list of entries
                docs.append(body.strip())
    return docs


def bible_chapters(root: Path) -> list[str]:
    """The King James Bible from ``bible``: consecutive chapters of a book, ~3K tokens a document."""
    prog = next(root.rglob("usr/bin/bible"))
    data_dir = next(root.rglob("bible.data")).parent
    out = subprocess.run([str(prog), "-p", str(data_dir), "-f", "-l10000", "Gen1:1-Rev22:21"], capture_output=True, check=True)
    chapters: dict[tuple[str, str], list[str]] = {}
    for line in out.stdout.decode("utf-8", errors="replace").splitlines():
        m = re.match(r"(\S+?)(\d+):(\d+) (.*)", line)
        if m:
            chapters.setdefault((m[1], m[2]), []).append(m[4])
    docs, cur, book = [], [], None
    for (b, ch), verses in chapters.items():
        if cur and (b != book or sum(map(len, cur)) >= DICT_CHUNK_CHARS):
            docs.append("\n\n".join(cur))
            cur = []
        book = b
        cur.append(f"{b} {ch}\n" + " ".join(verses))
    return docs + ["\n\n".join(cur)]


def rdata_chapters(path: Path) -> list[str]:
    """The character vectors of an R package's lazy-load data (one line of text each), read by Rscript,
    cut into chapters at lines that start with CHAPTER or Chapter, each chapter's hard-wrapped paragraphs
    joined into lines."""
    if shutil.which("Rscript") is None:
        raise SystemExit(f"{path}: reading R data needs Rscript; install it (apt-get install r-base-core) or leave the source out")
    script = ("e <- new.env(); lazyLoad(commandArgs(TRUE)[1], envir = e); "
              "for (n in sort(ls(e))) { v <- get(n, e); if (is.character(v)) writeLines(c(v, '\\f')) }")
    out = subprocess.run(["Rscript", "-e", script, str(path.with_suffix(""))], capture_output=True, check=True)
    docs = []
    for book in out.stdout.decode("utf-8", errors="replace").split("\f\n"):
        for chapter in re.split(r"\n(?=(?:CHAPTER|Chapter) [0-9IVXLC]+\b)", book):
            paragraphs = (" ".join(p.split()) for p in re.split(r"\n\s*\n", chapter))
            docs.append("\n\n".join(p for p in paragraphs if p))
    return [d for d in docs if d]


def download(packages: list[str], work: Path) -> Path:
    """Extract the packages into WORK/pkg/<package>/ (downloaded once into WORK/debs)."""
    debs = work / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    for pkg in packages:
        dest = work / "pkg" / pkg
        if dest.exists():
            continue
        if not list(debs.glob(f"{pkg}_*.deb")):
            subprocess.run(["apt-get", "download", "-q", pkg], cwd=debs, check=True, stdout=subprocess.DEVNULL)
        dest.mkdir(parents=True)
        subprocess.run(["dpkg-deb", "-x", str(next(debs.glob(f"{pkg}_*.deb"))), str(dest)], check=True)
    return work / "pkg"


def extract(name: str, packages: list[str], kind: str, globs: list[str], work: Path) -> list[str]:
    pkg_root = download(packages, work)
    if kind == "bible":
        return bible_chapters(pkg_root)
    files = sorted({f for pkg in packages for g in globs for f in (pkg_root / pkg).glob(g) if f.is_file()})
    if kind == "text":
        return [read(f) for f in files]
    if kind == "html":  # index pages are lists of names
        files = [f for f in files if not f.name.startswith(("genindex", "search", "py-modindex", "modindex"))]
        return drop_boilerplate([html_text(read(f)) for f in files])
    if kind == "man":
        return [man_text(f) for f in files]
    if kind == "dict":
        return [d for f in files for d in dict_entries(f)]
    if kind == "info":
        return info_nodes(files)
    if kind == "rdata":
        return [d for f in files for d in rdata_chapters(f)]
    if kind == "pod":
        return [pod_text(read(f)) for f in files]
    if kind == "fortune":  # fortune files (entries between lines of '%') and dictd files
        plain = [f for f in files if not f.suffix]
        return chunks(e.strip() for f in plain for e in re.split(r"\n%\n", read(f))) + \
            [d for f in files if f.name.endswith(".dict.dz") for d in dict_entries(f)]
    raise ValueError(f"{name}: unknown extractor {kind!r}")


def write_archives(name: str, docs: list[str], text_dir: Path, out: Path, max_mib: float) -> list[Path]:
    """``text_dir/<name>/NNNNNN.txt`` and ``out/<name>.tar.xz`` (or ``-1``, ``-2``... parts below max_mib)."""
    folder = text_dir / name
    folder.mkdir(parents=True, exist_ok=True)
    for f in folder.glob("*.txt"):
        f.unlink()
    for i, d in enumerate(docs):
        (folder / f"{i:06d}.txt").write_text(d + "\n")
    for old in out.glob(f"{name}.tar.xz"):
        old.unlink()
    for old in out.glob(f"{name}-*.tar.xz"):
        old.unlink()
    # xz takes text to ~1/5: parts of raw text up to 4.5x the limit, checked after writing
    budget = int(4.5 * max_mib * 2**20)
    parts, cur, size = [], [], 0
    for i, d in enumerate(docs):
        if cur and size + len(d) > budget:
            parts.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += len(d.encode())
    parts.append(cur)
    paths = []
    for k, idx in enumerate(parts, 1):
        path = out / (f"{name}.tar.xz" if len(parts) == 1 else f"{name}-{k}.tar.xz")
        with tarfile.open(path, "w:xz", preset=3) as tar:
            for i in idx:
                tar.add(folder / f"{i:06d}.txt", arcname=f"{name}/{i:06d}.txt")
        if path.stat().st_size > max_mib * 2**20:
            raise SystemExit(f"{path}: {path.stat().st_size / 2**20:.1f} MiB exceeds --max-mib {max_mib}; lower the split")
        paths.append(path)
    return paths


def count_tokens(docs: list[str], tokenizer, sample_chars: int = 4_000_000) -> int:
    """SmolLM2 tokens of ``docs``: exact up to ``sample_chars`` characters, else from an evenly spread
    sample of documents scaled by characters (a 2-core machine tokenizes ~0.2M tokens/s)."""
    from linearize.recipes.data import tokenize

    chars = sum(map(len, docs))
    step = max(1, round(chars / sample_chars))
    sample = docs[::step]
    return round(sum(map(len, tokenize(sample, tokenizer))) * chars / sum(map(len, sample)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache/linearize-corpus",
                    help="downloads, extracted packages and the text folders (outside the checkout)")
    ap.add_argument("--out", type=Path, default=Path(".data"), help="where the archives go (git-ignored)")
    ap.add_argument("--only", default="", help="comma-separated source names (default: all, and the OOD corpus)")
    ap.add_argument("--max-mib", type=float, default=60.0, help="largest archive (a GPU call carries 64 MiB)")
    ap.add_argument("--no-count", action="store_true", help="skip the token count (loads the SmolLM2 tokenizer)")
    a = ap.parse_args()
    names = a.only.split(",") if a.only else [*SOURCES, *OOD]
    table = {**SOURCES, **OOD, **OPTIONAL}
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"unknown source(s) {unknown}; known: {', '.join(table)}")
    tokenizer = None
    if not a.no_count:
        from linearize.loading import load_model_and_tokenizer

        _, tokenizer = load_model_and_tokenizer()  # the embedded SmolLM2's
    a.out.mkdir(parents=True, exist_ok=True)
    seen, rows = set(), []
    for name in names:
        packages, kind, globs = table[name]
        docs, kept = extract(name, packages, kind, globs, a.work), []
        for d in docs:
            key = hashlib.sha256(" ".join(d.split()).encode()).digest()
            if len(d) >= MIN_CHARS and key not in seen:
                seen.add(key)
                kept.append(d)
        if not kept:
            print(f"{name}: no documents", file=sys.stderr)
            continue
        paths = write_archives(name, kept, a.work / "text", a.out, a.max_mib)
        tokens = count_tokens(kept, tokenizer) if tokenizer is not None else 0
        rows.append((name, ",".join(packages), len(kept), tokens, sum(p.stat().st_size for p in paths) / 2**20,
                     " ".join(p.name for p in paths)))
        print(f"{name}: {len(kept)} documents, {tokens / 1e6:.2f}M tokens, {rows[-1][4]:.1f} MiB", flush=True)
    print(f"\n| source | packages | documents | tokens (M) | archive MiB | archives |\n|---|---|---:|---:|---:|---|")
    for name, pk, n, t, mib, files in rows:
        print(f"| {name} | {pk} | {n} | {t / 1e6:.2f} | {mib:.1f} | {files} |")
    train = [r for r in rows if r[0] not in OOD]
    print(f"| training total | | {sum(r[2] for r in train)} | {sum(r[3] for r in train) / 1e6:.2f} | "
          f"{sum(r[4] for r in train):.1f} | |")


if __name__ == "__main__":
    main()
