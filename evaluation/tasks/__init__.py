"""Seeded, phase-controlled task generators (RULER- and LongBench-style) and their scoring.

Usage::

    from kvpress_phase.evaluation.tasks import generate
    ds = generate("niah_single", tokenizer, n_samples=20, context_length=512, stride=8, phases=range(8))

Every row follows kvpress's evaluation schema (``context``, ``question``, ``answer_prefix``, ``answer``,
``task``, ``max_new_tokens``) and adds:

* ``needle_token_start``/``needle_token_end``: prefill-token span (BOS counted, end exclusive) of the
  answer-bearing needle (a sentence, a chain statement, a fact, a paragraph);
* ``answer_token_start``/``answer_token_end``: span of the phase-defining answer value inside it, whose text
  is ``answer_span_text`` (one of ``answer``, except for ``passage_count``, where it is the repeated
  paragraph's content);
* ``phase``: phase of ``answer_token_start`` for windows every ``stride`` tokens starting at ``offset``;
* ``protocol``, ``context_length`` (actual prefill tokens), ``seed``, ``sample_id`` and ``depth`` (the
  requested relative depth of the needle; the realised one is ``needle_token_start / context_length``).

Two protocols put a base example at each requested phase:

* ``"prefix"``: the window offset stays ``offset``; filler words are inserted right before the answer-bearing
  needle until its first answer token lands on the phase, and the trailing haystack is shortened by as many
  tokens, so the context length is the same at every phase.
* ``"offset"``: the text is the same at every phase; the row's ``offset`` is set to
  ``(answer_token_start - phase) mod stride``, the grid offset under which the answer sits at the phase.

Existing evaluation sets (kvpress's RULER ``simonjegou/ruler``, LongBench, or any local set in kvpress's
schema) get the same phase control from :func:`replace_needles`, which finds each row's answer in its context
and re-places the sentence holding it at every requested phase, writing the columns above; with a hub
connection::

    from kvpress_phase.evaluation.tasks import load_hub_tasks, replace_needles
    ds = replace_needles(load_hub_tasks("simonjegou/ruler", "4096"), tokenizer, stride=8, phases=range(8))

:func:`load_hub_tasks` also reads a ``save_to_disk`` folder or a ``.json``/``.jsonl``/``.parquet``/``.csv``
file (see :mod:`.hub` for the length policy and dropped rows).

Seeds: evaluation examples come from ``derive_seed("eval", task, seed, sample index)`` with
``0 <= seed < 10**6``; :func:`training_example` draws from the separate ``"train"`` domain (see
:mod:`.base`), so training and evaluation data never share a random stream.
"""

from __future__ import annotations

import dataclasses
import random
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from ..prompting import (
    check_tokenizer,
    context_prefix_length,
    context_token_ids,
    question_token_ids,
    require_fast_tokenizer,
)
from . import niah, passages, qa, vt
from .base import (
    EVAL_SEED_LIMIT,
    Assembler,
    BuildContext,
    Draft,
    check_context_length,
    derive_seed,
    phase_columns,
    single_token_words,
    tail_reserve,
)
from .hub import HubDatasetError, load_hub_tasks, replace_needles
from .placement import PROTOCOLS, check_placement, draw_filler, is_int, place_answer
from .vocab import PAD_WORDS


@dataclass(frozen=True)
class TaskSpec:
    """One registered task.

    Attributes
    ----------
    name : str
        Registry name.
    family : str
        ``"ruler"`` or ``"longbench"``.
    build : callable
        ``build(BuildContext) -> Draft``, the seeded base-example builder.
    options : dict
        Task options and their defaults (``generate(..., **options)`` overrides them).
    max_new_tokens : int
        Generation budget with the word-level tokenizer (raised per row when an answer needs more tokens).
    require_all : bool
        Scoring rule: every reference must appear (True), or any one of them (False).
    description : str
        One line.
    revision : int
        The task's definition today; raised whenever a change would change its answers (a prompt, a budget), so
        that a run records which definition it used (``EvalConfig.task_revisions``) and is planned again with it.
    earlier : dict
        ``{revision: {"max_new_tokens": ..., "options": {...}}}``: what each earlier revision had instead of
        today's (:meth:`at`).
    """

    name: str
    family: str
    build: Callable[[BuildContext], Draft]
    options: dict
    max_new_tokens: int
    require_all: bool
    description: str
    revision: int = 1
    earlier: dict = field(default_factory=dict)

    def at(self, revision: Optional[int]) -> "TaskSpec":
        """The task as it was defined at ``revision`` (today's when None); ValueError for one it never had."""
        if revision is None or revision == self.revision:
            return self
        if revision not in self.earlier:
            known = ", ".join(map(str, sorted([*self.earlier, self.revision])))
            raise ValueError(f"task {self.name!r} has no revision {revision!r}; its revisions: {known}")
        change = self.earlier[revision]
        return dataclasses.replace(self, revision=revision, earlier={},
                                   max_new_tokens=change.get("max_new_tokens", self.max_new_tokens),
                                   options={**self.options, **change.get("options", {})})


TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in [
        TaskSpec("niah_single", "ruler", niah.build_single, niah.SINGLE_OPTIONS, 8, True,
                 "one needle; return its value"),
        TaskSpec("niah_multikey", "ruler", niah.build_multikey, niah.MULTIKEY_OPTIONS, 8, True,
                 "one needle among needles with other keys"),
        # revision 2 (2026-12-04) of the two list needles: RULER's budget for its needle tasks (tokens_to_generate 128)
        # instead of 24 (raised to the completion + 2), which ended SmolLM2's "- key: value" lists (studies.answer_budget)
        TaskSpec("niah_multivalue", "ruler", niah.build_multivalue, niah.MULTIVALUE_OPTIONS, 128, True,
                 "several values for one key; return all", revision=2, earlier={1: {"max_new_tokens": 24}}),
        TaskSpec("niah_multiquery", "ruler", niah.build_multiquery, niah.MULTIQUERY_OPTIONS, 128, True,
                 "several keys asked at once; return all values", revision=2, earlier={1: {"max_new_tokens": 24}}),
        # revision 2 (2026-12-04): RULER's budget (tokens_to_generate 30) and an answer prefix that, like RULER's,
        # gives the count and ends with a colon; revision 1 gave 16 tokens after "... are", which cut most answers
        TaskSpec("vt", "ruler", vt.build, vt.OPTIONS, 30, True,
                 "variable tracking: every variable that holds a value", revision=2,
                 earlier={1: {"max_new_tokens": 16, "options": {"prefix": "plain"}}}),
        TaskSpec("qa_single_doc", "longbench", qa.build_single, qa.SINGLE_OPTIONS, 6, False,
                 "one fact about one person in a report about many"),
        TaskSpec("qa_multi_doc", "longbench", qa.build_multi, qa.MULTI_OPTIONS, 6, False,
                 "one fact about one person across several documents"),
        TaskSpec("passage_retrieval", "longbench", passages.build_retrieval, passages.RETRIEVAL_OPTIONS, 6, False,
                 "which paragraph holds a quoted sentence"),
        TaskSpec("passage_count", "longbench", passages.build_count, passages.COUNT_OPTIONS, 4, False,
                 "number of different paragraphs when some are repeated"),
    ]
}


def get_task(name: str) -> TaskSpec:
    """The :class:`TaskSpec` registered as ``name``; ValueError listing the valid names otherwise."""
    try:
        return TASKS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown task {name!r}; valid task names: {', '.join(TASKS)}") from None


def list_tasks() -> list[str]:
    return list(TASKS)


# --------------------------------------------------------------------------------------------- scoring
def _found(reference: str, prediction: str, whole_words: bool) -> bool:
    ref, pred = reference.strip().lower(), prediction.lower()
    if not whole_words:
        return ref in pred
    return re.search(r"(?<![0-9a-z])" + re.escape(ref) + r"(?![0-9a-z])", pred) is not None


def references(answers: Iterable[str] | str) -> list[str]:
    """``answers`` as a list of references (a string is one); ValueError when there is none."""
    refs = [answers] if isinstance(answers, str) else list(answers)
    if not refs:
        raise ValueError("answers must hold at least one reference")
    return refs


def score(prediction: str, answers: Iterable[str] | str, task: str, whole_words: bool = True) -> float:
    """1.0 when ``prediction`` holds the answers, else 0.0 (case-insensitive substring match).

    All references must appear for the RULER-style tasks (multi-value, multi-query, variable tracking), any
    one for the LongBench-style tasks. With ``whole_words`` (default) a reference must not be glued to a
    letter or digit on either side, so "Paragraph 1" does not match "Paragraph 12" and "7" does not match
    "17"; ``whole_words=False`` is kvpress's plain substring rule.
    """
    refs = references(answers)
    hits = [_found(r, prediction, whole_words) for r in refs]
    return float(all(hits) if get_task(task).require_all else any(hits))


def partial_score(prediction: str, answers: Iterable[str] | str, task: str, whole_words: bool = True) -> float:
    """RULER's credit for one answer: the share of the references ``prediction`` holds, for the tasks that need all
    of them (RULER's ``string_match_all``, computed per answer); :func:`score` for the others. It is 1.0 exactly
    when :func:`score` is, and tells "three of four values" from "none" where :func:`score` reads 0 for both. Reports
    show it beside the accuracy (``partial_mean``); every statistic is computed on :func:`score`."""
    refs = references(answers)
    if not get_task(task).require_all:
        return score(prediction, refs, task, whole_words)
    return sum(_found(r, prediction, whole_words) for r in refs) / len(refs)


# --------------------------------------------------------------------------------------------- generation
def _resolve_options(spec: TaskSpec, task_options: dict) -> dict:
    unknown = sorted(set(task_options) - set(spec.options))
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)} for task {spec.name!r}; valid options: "
            f"{', '.join(sorted(spec.options)) or 'none'}"
        )
    return {**spec.options, **task_options}


def _draft(spec: TaskSpec, tokenizer, rng: random.Random, context_length: int, stride: int, options: dict):
    check_context_length(context_length, stride)
    budget = max(0, context_length - context_prefix_length(tokenizer) - tail_reserve(stride))
    ctx = BuildContext(tokenizer=tokenizer, rng=rng, budget=budget, options=options)  # the task says if it fits
    return ctx, spec.build(ctx)


def _pad_words(tokenizer, rng: random.Random, stride: int) -> list[str]:
    words = single_token_words(tokenizer, PAD_WORDS)
    if not words:
        raise ValueError("the tokenizer has no single-token filler word; prefix padding is impossible")
    return draw_filler(words, rng, stride)


def _max_new_tokens(spec: TaskSpec, tokenizer, completion: str) -> int:
    return max(spec.max_new_tokens, len(tokenizer.encode(" " + completion, add_special_tokens=False)) + 2)


def generate(
    task_name: str,
    tokenizer,
    *,
    n_samples: int,
    context_length: int,
    stride: int,
    phases: Iterable[int],
    protocol: str = "prefix",
    offset: int = 0,
    seed: int = 0,
    revision: Optional[int] = None,
    **task_options,
):
    """Generate a phase-controlled evaluation set as a ``datasets.Dataset``.

    Parameters
    ----------
    task_name : str
        A name of :data:`TASKS`.
    tokenizer : transformers fast tokenizer
        The tokenizer the model uses (positions and lengths are counted with it). It must be fast (positions
        come from its offsets mapping) and have a BOS token or a chat template (kvpress's pipeline needs one);
        ValueError otherwise, before anything is generated.
    n_samples : int
        Base examples; each is placed at every phase, so the set has ``n_samples * len(phases)`` rows.
    context_length : int
        Prefill length in tokens (BOS included), hit exactly unless the tokenizer makes that impossible.
    stride : int
        Window stride S; phases are in ``[0, S)``.
    phases : iterable of int
        Phases to place the first answer token at.
    protocol : {"prefix", "offset"}
        How examples are placed at a phase (see the module docstring).
    offset : int
        Window grid offset in ``[0, stride)`` used by the ``"prefix"`` protocol (ignored by ``"offset"``).
    seed : int
        Evaluation seed in ``[0, 10**6)``.
    revision : int, optional
        The task's definition to generate (:attr:`TaskSpec.revision`, today's when None): how a run made with an
        earlier one is planned again.
    **task_options
        Task-specific options (see ``TASKS[task_name].options``).

    Rows are ordered by sample, then by phase in the order given.
    """
    import datasets

    spec = get_task(task_name).at(revision)
    options = _resolve_options(spec, task_options)
    if not is_int(n_samples) or n_samples < 1:
        raise ValueError(f"n_samples must be a positive integer, got {n_samples!r}")
    if not is_int(context_length) or context_length < 1:
        raise ValueError(f"context_length must be a positive integer, got {context_length!r}")
    phases = check_placement(stride, phases, protocol, offset, seed, seed_what=" for evaluation sets")
    check_tokenizer(tokenizer)

    rows = []
    for index in range(n_samples):
        rng = random.Random(derive_seed("eval", spec.name, seed, index))
        ctx, draft = _draft(spec, tokenizer, rng, context_length, stride, options)
        assembler = Assembler(
            draft,
            tokenizer,
            context_length,
            tail_rng=random.Random(derive_seed("eval-tail", spec.name, seed, index)),
            pad_words=_pad_words(tokenizer, random.Random(derive_seed("eval-pad", spec.name, seed, index)), stride),
        )
        for p in phases:
            placed, row_offset = place_answer(assembler, p, stride, protocol, offset)
            rows.append(
                {
                    "context": placed.context,
                    "question": draft.question,
                    "answer_prefix": draft.answer_prefix,
                    "answer": list(draft.answers),
                    "task": spec.name,
                    "max_new_tokens": _max_new_tokens(spec, tokenizer, draft.completion),
                    "answer_span_text": draft.answer_span_text,
                    "depth": float(draft.depth),
                    **phase_columns(placed, p, stride, row_offset, protocol, seed, index),
                }
            )
    return datasets.Dataset.from_list(rows)


def training_example(
    task_name: str,
    tokenizer,
    rng_or_seed,
    context_length: int,
    **task_options,
) -> dict:
    """One training sequence: ``input_ids``, a ``loss_mask`` that marks the answer tokens and EOS, and the
    ``context_length`` (prefill tokens) the question follows (see :func:`training_sequence`).

    ``input_ids`` = prefill context ids (as the pipeline builds them) + question ids (``question``, the
    pipeline's suffix, ``answer_prefix``) + answer ids + EOS. ``rng_or_seed`` is a ``random.Random`` (drawn
    from), a ``numpy.random.Generator`` (drawn from), or an int seed of the ``"train"`` domain, disjoint from
    every evaluation seed. The answer sits at whatever phase the draw gives. ``tokenizer`` must be a fast
    tokenizer (ValueError otherwise).
    """
    spec = get_task(task_name)
    options = _resolve_options(spec, task_options)
    require_fast_tokenizer(tokenizer)
    if not is_int(context_length) or context_length < 1:
        raise ValueError(f"context_length must be a positive integer, got {context_length!r}")
    if isinstance(rng_or_seed, random.Random):
        sample_seed = rng_or_seed.getrandbits(63)
    elif is_int(rng_or_seed):
        sample_seed = derive_seed("train", spec.name, rng_or_seed, 0)
    elif hasattr(rng_or_seed, "integers"):
        sample_seed = int(rng_or_seed.integers(0, 2**63 - 1))
    else:
        raise ValueError(f"rng_or_seed must be a random.Random, a numpy Generator or an int, got {rng_or_seed!r}")
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token")
    rng = random.Random(derive_seed("train", spec.name, sample_seed, 1))
    _, draft = _draft(spec, tokenizer, rng, context_length, 1, options)
    assembler = Assembler(
        draft,
        tokenizer,
        context_length,
        tail_rng=random.Random(derive_seed("train-tail", spec.name, sample_seed, 1)),
        pad_words=_pad_words(tokenizer, random.Random(derive_seed("train-pad", spec.name, sample_seed, 1)), 1),
    )
    placed = assembler.unpadded()
    return training_sequence(tokenizer, placed.context, draft.question, draft.answer_prefix, draft.completion)


def training_sequence(tokenizer, context: str, question: str, answer_prefix: str, completion: str) -> dict:
    """Token ids of one supervised example, laid out as kvpress's pipeline prefills and decodes it.

    Returns ``input_ids`` = prefill context ids + question ids (``question``, the pipeline's suffix,
    ``answer_prefix``) + ``completion`` ids + EOS, a ``loss_mask`` marking the completion and EOS, and
    ``context_length``, the number of prefill (context) tokens, where a compressed cache would end.
    """
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token")
    context_ids = context_token_ids(tokenizer, context)
    question_ids = question_token_ids(tokenizer, question, answer_prefix)
    glue = "" if not answer_prefix or answer_prefix[-1].isspace() else " "
    answer_ids = list(tokenizer.encode(glue + completion, add_special_tokens=False))
    input_ids = context_ids + question_ids + answer_ids + [tokenizer.eos_token_id]
    loss_mask = [0] * (len(context_ids) + len(question_ids)) + [1] * (len(answer_ids) + 1)
    return {"input_ids": input_ids, "loss_mask": loss_mask, "context_length": len(context_ids)}


__all__ = [
    "TASKS",
    "TaskSpec",
    "generate",
    "get_task",
    "HubDatasetError",
    "load_hub_tasks",
    "replace_needles",
    "list_tasks",
    "score",
    "partial_score",
    "references",
    "training_example",
    "training_sequence",
    "EVAL_SEED_LIMIT",
    "PROTOCOLS",
    "check_context_length",
    "derive_seed",
]
