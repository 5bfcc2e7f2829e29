"""Putting an example's answer at a phase: the one routine of the generators and of the hub re-placement.

Both :func:`~kvpress_phase.evaluation.tasks.generate` (an :class:`~.base.Assembler` per example) and
:func:`~kvpress_phase.evaluation.tasks.replace_needles` (one source row at a time) hand :func:`place_answer` an
example that can be written with filler words before its answer-bearing needle (:class:`Paddable`). The protocol
decides what moves:

* ``"prefix"``: the window grid keeps the requested ``offset``; filler words are inserted before the needle until
  the first answer token lands on the phase (every candidate is re-tokenised by the example, since a word can take
  several tokens), and the answer's tokens must be those of the unpadded text, or the phases would not see the
  same answer token;
* ``"offset"``: the text stays as written and the row's offset is ``(answer_token_start - phase) mod stride``, the
  grid under which the answer sits at the phase.
"""

from __future__ import annotations

import random
from typing import Protocol

from .base import EVAL_SEED_LIMIT, Placed

PROTOCOLS = ("prefix", "offset")
"""How an example is put at a phase (see the module docstring)."""


class Paddable(Protocol):
    """An example whose answer filler words can move."""

    n_filler: int
    """How many filler words :meth:`padded` can insert."""

    def unpadded(self) -> Placed:
        """The example as written (the ``"offset"`` protocol's context)."""

    def padded(self, n_pad: int) -> Placed:
        """``n_pad`` filler words before the needle, the context kept at its length (``padded(0)``: the
        ``"prefix"`` protocol's starting point, whose answer tokens every phase must keep)."""


def is_int(x) -> bool:
    """A plain integer (``True`` and ``False`` are not counts)."""
    return isinstance(x, int) and not isinstance(x, bool)


def check_placement(stride, phases, protocol: str, offset, seed, *, seed_what: str = "") -> list:
    """Check where answers are to be placed, one ``ValueError`` naming the first argument that is wrong; return
    ``phases`` as a list."""
    if not is_int(stride) or stride < 1:
        raise ValueError(f"stride must be a positive integer, got {stride!r}")
    phases = list(phases)
    if not phases or any(not is_int(p) or not 0 <= p < stride for p in phases):
        raise ValueError(f"phases must be a non-empty list of integers in [0, stride={stride}), got {phases!r}")
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    if not is_int(offset) or not 0 <= offset < stride:
        raise ValueError(f"offset must be an integer in [0, stride={stride}), got {offset!r}")
    if not is_int(seed) or not 0 <= seed < EVAL_SEED_LIMIT:
        raise ValueError(f"seed must be an integer in [0, {EVAL_SEED_LIMIT}){seed_what}, got {seed!r}")
    return phases


def filler_count(stride: int) -> int:
    """Filler words drawn per example: enough for the ``4 * stride`` tries of :func:`place_answer`."""
    return max(64, 4 * stride)


def draw_filler(words: list, rng: random.Random, stride: int) -> list:
    """The filler words of one example: :func:`filler_count` draws from ``words``."""
    return [rng.choice(words) for _ in range(filler_count(stride))]


def place_answer(example: Paddable, phase: int, stride: int, protocol: str, offset: int) -> tuple[Placed, int]:
    """``(placed, row_offset)``: ``example`` with its first answer token at ``phase`` of the windows every
    ``stride`` tokens from ``row_offset``, by ``protocol`` (``offset`` is the grid of the ``"prefix"`` protocol).

    ValueError for an unknown ``protocol``; RuntimeError when no padding lands on the phase, or when the padding
    changes the answer's tokens (a tokenizer for which the example's filler layout does not keep them).
    """
    # imported here: kvpress_phase.core.phase imports torch, and the task registry (the task names that the command
    # line checks before anything heavy is imported) must not
    from kvpress_phase.core.phase import phase_of

    if protocol == "offset":
        placed = example.unpadded()
        row_offset = (placed.answer_span[0] - phase) % stride
    elif protocol == "prefix":
        base, row_offset = example.padded(0), offset
        n_pad = (phase - phase_of(base.answer_span[0], stride, offset)) % stride
        placed = None
        for _ in range(4 * stride):
            if n_pad > example.n_filler:
                break
            candidate = example.padded(n_pad)
            shift = (phase - phase_of(candidate.answer_span[0], stride, offset)) % stride
            if shift == 0:
                placed = candidate
                break
            n_pad += shift
        if placed is None:
            raise RuntimeError(
                f"could not place the answer at phase {phase} (stride {stride}) with single-token filler words"
            )
        if placed.tokens(placed.answer_span) != base.tokens(base.answer_span):
            raise RuntimeError(
                f"filler before the needle changes the answer's tokens with this tokenizer (phase {phase}, "
                f"{n_pad} filler words), so the phases would not see the same answer token; use the "
                f"'offset' protocol, which keeps the text fixed"
            )
    else:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    assert phase_of(placed.answer_span[0], stride, row_offset) == phase
    return placed, row_offset


__all__ = ["PROTOCOLS", "Paddable", "draw_filler", "filler_count", "place_answer"]
