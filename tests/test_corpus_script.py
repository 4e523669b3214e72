"""scripts/device/corpus.py: the R-data extractor behind the optional `austen` source (the rest of the script
downloads Debian packages, which a test cannot)."""

import subprocess
from pathlib import Path

import pytest

from conftest import load_script


def _corpus():
    return load_script("device/corpus")


def test_rdata_chapters_cut_books_into_chapters_and_join_wrapped_lines(monkeypatch):
    corpus = _corpus()
    # what the Rscript call prints: each character vector's lines, then a form feed line
    printed = ("EMMA\n\nCHAPTER I\n\nEmma Woodhouse, handsome,\nclever, and rich.\n\nShe was the youngest.\n"
               "Chapter II\nMr. Weston was a native\nof Highbury.\n\f\n"
               "PERSUASION\n\nCHAPTER 1\n\nSir Walter Elliot,\nof Kellynch Hall.\n\f\n")
    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout=printed.encode(), stderr=b"")

    monkeypatch.setattr(corpus.shutil, "which", lambda name: "/usr/bin/Rscript")
    monkeypatch.setattr(corpus.subprocess, "run", run)
    docs = corpus.rdata_chapters(Path("pkg/janeaustenr/data/Rdata.rdb"))
    assert calls[0][0] == "Rscript" and calls[0][-1] == "pkg/janeaustenr/data/Rdata"  # lazyLoad's file base
    assert docs == ["EMMA",
                    "CHAPTER I\n\nEmma Woodhouse, handsome, clever, and rich.\n\nShe was the youngest.",
                    "Chapter II Mr. Weston was a native of Highbury.",
                    "PERSUASION",
                    "CHAPTER 1\n\nSir Walter Elliot, of Kellynch Hall."]
    assert "austen" in corpus.OPTIONAL and "austen" not in corpus.SOURCES  # built only when named


def test_rdata_without_rscript_says_what_to_install(monkeypatch):
    corpus = _corpus()
    monkeypatch.setattr(corpus.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit, match="apt-get install r-base-core"):
        corpus.rdata_chapters(Path("x/Rdata.rdb"))
