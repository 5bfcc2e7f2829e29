"""Phase control for existing evaluation sets: re-place the needles of any dataset in kvpress's schema.

:func:`replace_needles` takes rows with kvpress's evaluation columns (``context``, ``question``,
``answer_prefix``, ``answer``, ``task``, ``max_new_tokens``), such as kvpress's RULER set
(``simonjegou/ruler``) or a LongBench set loaded with :func:`load_hub_tasks`, and puts each example at the
requested phases, writing the same columns as :func:`~kvpress_phase.evaluation.tasks.generate`.

For every row

1. the answer-bearing span is the first occurrence in the context of the first reference answer (searched
   case-sensitively, then case-insensitively); rows whose answer does not occur are dropped (one warning
   gives their count);
2. the needle runs from the start of its sentence or line (after the previous ``.``/``!``/``?`` followed by
   whitespace, or the previous newline) to the end of the answer;
3. placed at each phase by :func:`~.placement.place_answer`, which the generators use too: ``"prefix"``
   protocol: single-token filler words are inserted right before the needle until the first
   answer token lands on the phase (every candidate is re-tokenised, as token counts vary with BPE), then the
   context is cut at its end by as many tokens. When filler there would change the needle's tokens (a
   byte-level BPE reads a line-initial "Paragraph" and one after a space as different tokens), the filler
   goes before the whitespace that precedes the needle instead, so every phase sees the same needle tokens;
   ``"offset"`` protocol: the text is kept and ``offset = (answer_token_start - phase) mod stride``.

Length policy (prefix protocol)
-------------------------------
Every row keeps the original prefill length exactly. The cut removes the surplus from the end of the context
(never text before the answer's end), at a word boundary: when a word spans several tokens and the cut
leaves the context a few tokens short, single-token filler words are appended at its end (as the generators
close their trailing zones). The one exception: when fewer tokens follow the answer than the padding adds
(a needle in the last few tokens of its context), the context ends right after the answer and is longer
than the original by fewer tokens than the padding, i.e. by less than ``stride`` tokens for any tokenizer that
keeps the filler words one token each; ``context_length`` always holds the actual prefill length.

The generators' :class:`~.base.Assembler` is not used here: it sizes a trailing zone drawn from a haystack
generator, whereas a hub row has a fixed text after its needle, which is cut using the token offsets.
"""

from __future__ import annotations

import os
import random
import re
import warnings
from typing import Iterable, Optional, Sequence

from ..prompting import check_tokenizer, encode_with_offsets
from .base import Placed, derive_seed, measure, phase_columns, single_token_words
from .placement import check_placement, draw_filler, place_answer
from .vocab import PAD_WORDS

KVPRESS_COLUMNS = ("context", "question", "answer_prefix", "answer", "task", "max_new_tokens")
"""The columns of kvpress's evaluation datasets, all required by :func:`replace_needles`."""

_LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
_SENTENCE_END = re.compile(r"[.!?]\s|\n")


class HubDatasetError(ConnectionError, ValueError):
    """A dataset could not be loaded (no connection, offline mode, unknown id, config or split).

    Both a :class:`ConnectionError` and a :class:`ValueError`, so either ``except`` clause catches it.
    """


# --------------------------------------------------------------------------------------------- loading
def load_hub_tasks(name: str, config: Optional[str] = None, split: Optional[str] = "test", **kwargs):
    """Load an evaluation set from the hub or from a local path.

    Parameters
    ----------
    name : str
        A hub dataset id (``"simonjegou/ruler"``), a folder written by ``Dataset.save_to_disk`` /
        ``DatasetDict.save_to_disk``, a local ``.json``/``.jsonl``/``.parquet``/``.csv`` file, or any other
        path ``datasets.load_dataset`` accepts.
    config : str, optional
        Hub configuration (for RULER, the context length: ``"4096"``); not used for local files.
    split : str, optional
        Split to return (``None``: the whole ``DatasetDict``). A single local data file is read as this split
        (``"test"`` when ``split`` is None).
    **kwargs
        Passed to ``datasets.load_dataset``.

    Raises
    ------
    HubDatasetError
        (a ConnectionError and a ValueError) naming the dataset, when it cannot be loaded: no connection,
        offline mode (``HF_HUB_OFFLINE=1``) without a cached copy, unknown id, config or split.
    """
    import datasets

    path = os.fspath(name)
    saved_markers = ("dataset_info.json", "dataset_dict.json", "state.json")
    if os.path.isdir(path) and any(os.path.exists(os.path.join(path, m)) for m in saved_markers):
        loaded = datasets.load_from_disk(path)
        if isinstance(loaded, datasets.DatasetDict) and split is not None:
            if split not in loaded:
                raise HubDatasetError(f"{path!r} has no split {split!r}; its splits are {sorted(loaded)}")
            return loaded[split]
        return loaded
    extension = os.path.splitext(path)[1].lower()
    if os.path.isfile(path) and extension in _LOCAL_FORMATS:
        data_files = {split or "test": path}
        return datasets.load_dataset(_LOCAL_FORMATS[extension], data_files=data_files, split=split, **kwargs)
    try:
        return datasets.load_dataset(path, config, split=split, **kwargs)
    except Exception as e:  # noqa: BLE001 -- every failure is reported with the dataset's name
        flags = [os.environ.get(v, "").upper() for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")]
        offline = bool(getattr(datasets.config, "HF_HUB_OFFLINE", False)) or any(
            f in ("1", "ON", "YES", "TRUE") for f in flags
        )
        if extension in _LOCAL_FORMATS:
            hint = "no such local file"
        elif offline:
            hint = "offline mode is on (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE) and no cached copy was found"
        else:
            hint = "check the id, config and split, and the hub connection"
        raise HubDatasetError(
            f"could not load dataset {path!r} (config={config!r}, split={split!r}): {hint}; a local copy "
            f"(save_to_disk folder, .json/.jsonl/.parquet/.csv file) can be passed instead. "
            f"Cause: {type(e).__name__}: {e}"
        ) from e


# --------------------------------------------------------------------------------------------- spans
def find_answer(context: str, answer: str) -> Optional[tuple[int, int]]:
    """Character span of the first occurrence of ``answer`` in ``context``: case-sensitive, then not.

    Surrounding whitespace of ``answer`` is ignored; ``None`` when it does not occur (or is empty).
    """
    answer = answer.strip()
    if not answer:
        return None
    i = context.find(answer)
    if i >= 0:
        return i, i + len(answer)
    m = re.search(re.escape(answer), context, flags=re.IGNORECASE)
    return (m.start(), m.end()) if m else None


def needle_start(context: str, answer_start: int) -> int:
    """Start of the sentence or line holding ``context[answer_start]``.

    The sentence starts after the last ``.``/``!``/``?`` followed by whitespace, or the last newline, before
    the answer, leading whitespace skipped (0 when there is none).
    """
    start = 0
    for m in _SENTENCE_END.finditer(context, 0, answer_start):
        start = m.end()
    while start < answer_start and context[start].isspace():
        start += 1
    return start


def _cut_point(text: str, c: int, keep: int) -> int:
    """Where to cut ``text`` so that it ends at or before character ``c``, never before ``keep``.

    The cut splits no run of letters and digits (a word, a number), unless that run reaches back to ``keep``
    (then it is cut at ``c``, a token boundary); whitespace left at the end is dropped.
    """
    p = c
    while keep < p < len(text) and text[p - 1].isalnum() and text[p].isalnum():
        p -= 1
    if p == keep < c:
        p = c
    while p > keep and text[p - 1].isspace():
        p -= 1
    return p


class _Row:
    """One source row being placed: its text, needle and answer spans, and its filler words."""

    def __init__(self, tokenizer, context: str, needle: tuple[int, int], answer: tuple[int, int], words: list[str]):
        self.tokenizer = tokenizer
        self.context = context
        self.needle = needle
        self.answer = answer
        self.words = words
        self.base = measure(tokenizer, context, needle, answer)
        self.space_start = needle[0]
        while self.space_start > 0 and context[self.space_start - 1].isspace():
            self.space_start -= 1
        self.filler_before_space = False
        if self.space_start < needle[0] and words:
            at, pad = self._filler(1)
            one = measure(tokenizer, context[:at] + pad + context[at:], *self._shifted(len(pad)))
            self.filler_before_space = one.tokens(one.needle_span) != self.base.tokens(self.base.needle_span)

    def _filler(self, n_pad: int) -> tuple[int, str]:
        """Where ``n_pad`` filler words go in the source context, and their text.

        Right before the needle (``"...\\nw1 w2 Needle"``), or, when that changes the needle's tokens, before
        the whitespace preceding it (``"... w1 w2\\nNeedle"``).
        """
        words = self.words[:n_pad]
        if self.filler_before_space:
            return self.space_start, ("" if self.space_start == 0 else " ") + " ".join(words)
        return self.needle[0], "".join(w + " " for w in words)

    def _shifted(self, k: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """The needle and answer spans once ``k`` characters are inserted before them."""
        return (self.needle[0] + k, self.needle[1] + k), (self.answer[0] + k, self.answer[1] + k)

    def padded(self, n_pad: int) -> Placed:
        """``n_pad`` filler words before the needle, the end cut back to the original length (module docstring)."""
        if n_pad == 0:
            return self.base
        if n_pad > len(self.words):
            raise RuntimeError("not enough filler words")
        s, pad = self._filler(n_pad)
        text = self.context[:s] + pad + self.context[s:]
        needle, answer = self._shifted(len(pad))
        target = self.base.n_tokens
        keep = needle[1]
        for _ in range(16):
            ids, offsets, start = encode_with_offsets(self.tokenizer, text)
            if len(ids) <= target or len(text) == keep:
                break
            c = max(keep, offsets[target][0] - start)
            text = text[: _cut_point(text, c, keep)]
        placed = measure(self.tokenizer, text, needle, answer)
        n_fill = 0
        for _ in range(8):
            gap = target - placed.n_tokens
            if gap == 0 or (gap < 0 and n_fill == 0):
                break
            n_fill = max(0, min(len(self.words), n_fill + gap))
            filled = text + "".join(" " + w for w in self.words[:n_fill])
            placed = measure(self.tokenizer, filled, needle, answer)
        return placed

    def unpadded(self) -> Placed:
        """The source row as it is (the ``"offset"`` protocol's context)."""
        return self.base

    @property
    def n_filler(self) -> int:
        return len(self.words)


# --------------------------------------------------------------------------------------------- placement
def replace_needles(
    dataset,
    tokenizer,
    *,
    stride: int,
    phases: Iterable[int],
    protocol: str = "prefix",
    offset: int = 0,
    filler_words: Optional[Sequence[str]] = None,
    seed: int = 0,
):
    """Re-place the needles of a kvpress-schema dataset at controlled token phases.

    Parameters
    ----------
    dataset : datasets.Dataset (or a list of row dicts)
        Rows with the columns of :data:`KVPRESS_COLUMNS`; ``answer`` is a list of strings (or one string).
    tokenizer : transformers fast tokenizer
        The model's tokenizer (positions are prefill positions, BOS or chat-template opening included); it
        must be fast and have a BOS token or a chat template (ValueError otherwise, as for ``generate``).
    stride, phases, protocol, offset
        As in :func:`~kvpress_phase.evaluation.tasks.generate`.
    filler_words : sequence of str, optional
        Candidate padding words (default: the generators' filler words); only those that are one known token
        after a space are used.
    seed : int
        Seeds the choice of filler words of each row, in ``[0, 10**6)``; stored in the ``seed`` column.

    Returns
    -------
    datasets.Dataset
        One row per kept source row and phase (source order, then phases in the order given), with the
        columns of ``generate``: ``sample_id`` is the source row's index, ``depth`` the needle's relative
        depth (in tokens) in the source context, ``answer_span_text`` the matched context text. Other source
        columns are copied unchanged. See the module docstring for the length policy.
    """
    import datasets

    phases = check_placement(stride, phases, protocol, offset, seed)
    if hasattr(dataset, "column_names"):
        columns = list(dataset.column_names)
    else:
        columns = list(dict.fromkeys(k for row in dataset for k in row))
    missing = [c for c in KVPRESS_COLUMNS if c not in columns]
    if missing:
        raise ValueError(f"the dataset lacks kvpress's evaluation column(s) {missing}; it has {columns}")
    check_tokenizer(tokenizer)
    unknown = [tokenizer.unk_token_id] if tokenizer.unk_token_id is not None else None
    words = [
        w
        for w in single_token_words(tokenizer, list(PAD_WORDS if filler_words is None else filler_words))
        if tokenizer.encode(" " + w, add_special_tokens=False) != unknown
    ]
    if not words:
        raise ValueError("no filler word is a single token for this tokenizer; prefix padding is impossible")

    rows, dropped, n_source = [], [], 0
    for index, source in enumerate(dataset):
        n_source += 1
        answers = [source["answer"]] if isinstance(source["answer"], str) else list(source["answer"])
        context = source["context"]
        answer = find_answer(context, answers[0]) if answers else None
        if answer is None:
            dropped.append(index)
            continue
        needle = (needle_start(context, answer[0]), answer[1])
        rng = random.Random(derive_seed("hub-pad", str(source["task"]), seed, index))
        row = _Row(tokenizer, context, needle, answer, draw_filler(words, rng, stride))
        base = row.base
        extra = {k: source.get(k) for k in columns if k not in KVPRESS_COLUMNS}
        for p in phases:
            placed, row_offset = place_answer(row, p, stride, protocol, offset)
            rows.append(
                {
                    **extra,
                    "context": placed.context,
                    "question": source["question"],
                    "answer_prefix": source["answer_prefix"],
                    "answer": answers,
                    "task": source["task"],
                    "max_new_tokens": source["max_new_tokens"],
                    "answer_span_text": context[answer[0] : answer[1]],
                    "depth": base.needle_span[0] / base.n_tokens,
                    **phase_columns(placed, p, stride, row_offset, protocol, seed, index),
                }
            )
    if dropped:
        shown = ", ".join(map(str, dropped[:10])) + (", ..." if len(dropped) > 10 else "")
        warnings.warn(
            f"replace_needles dropped {len(dropped)} of {n_source} rows whose first "
            f"reference answer does not occur in the context (row indices {shown})",
            stacklevel=2,
        )
    if not rows:
        raise ValueError("no row of the dataset has its first reference answer in its context")
    return datasets.Dataset.from_list(rows)


__all__ = ["HubDatasetError", "KVPRESS_COLUMNS", "find_answer", "load_hub_tasks", "needle_start", "replace_needles"]
