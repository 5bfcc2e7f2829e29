"""Machinery shared by all task generators: drafts, exact-length assembly, phase placement and seeds.

A task builder turns a seeded random generator into a :class:`Draft`: the blocks of text of one example in
order (haystack sentences, needles, document headers, paragraphs), which of them is the answer-bearing needle,
where the phase-defining answer value sits inside it, and the question. The code here then

1. appends a *trailing zone* of haystack words after the last block and sizes it so that the prefill sequence
   (as kvpress's pipeline builds it, BOS included) has exactly the requested number of tokens;
2. gives :func:`.placement.place_answer` what it needs to place the example at each requested phase: under
   the ``"prefix"`` protocol contexts with filler words right before the answer-bearing block (and the trailing
   zone trimmed by as many tokens; the trailing zone is cut word by word, punctuation apart), under the
   ``"offset"`` protocol the text as written (the window offset then puts the answer at the phase);
3. checks every position by re-tokenising the prefill text, so it works with any fast tokenizer.

Where the filler goes
---------------------
The answer-bearing block must be the same tokens at every phase, or one phase would see a different answer
token than the others. Filler words go right after the block's separator (``"...end.\nw1 w2 Paragraph 3:"``)
when that leaves the block's tokens unchanged, as with a word-level tokenizer. A byte-level BPE folds the
space before a word into the word's token (``"ĠParagraph"`` after a space, ``"Paragraph"`` after a newline),
so when the filler would change the block's tokens it goes before the separator instead
(``"...end. w1 w2\nParagraph 3:"``) and the block is always written after its own separator, even when it
opens the context. The choice is made once per example from its unpadded text, so every phase of an example
uses the same layout, and :func:`.placement.place_answer` checks that the answer's tokens are those of the
unpadded text.

Seeds
-----
Every random draw comes from a generator seeded by :func:`derive_seed` ``(domain, task, seed, index)``, a hash,
so examples do not depend on the order in which they are generated. Evaluation sets use the domain
``"eval"`` and require ``0 <= seed < EVAL_SEED_LIMIT``; training examples use the domain ``"train"``. The two
domains are disjoint hash streams, so no training example is drawn from an evaluation seed whatever integers
are chosen on either side.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..prompting import encode_with_offsets, offsets_to_token_span
from . import vocab

EVAL_SEED_LIMIT = 10**6
"""Evaluation seeds are integers in ``[0, EVAL_SEED_LIMIT)``."""

TAIL_RESERVE = 24
"""Minimum tokens of the trailing zone when strides are at most 16 (``max(TAIL_RESERVE, stride + 8)``)."""

MIN_TEXT_TOKENS = 32
"""Tokens a context needs besides its trailing zone: the prompt's opening (BOS or chat template) and the task's text."""


def tail_reserve(stride: int) -> int:
    """Tokens kept for the trailing zone at ``stride`` (the padding that moves the answer to a phase)."""
    return max(TAIL_RESERVE, stride + 8)


def check_context_length(context_length: int, stride: int) -> None:
    """ValueError unless ``context_length`` leaves room for the trailing zone at ``stride`` and
    :data:`MIN_TEXT_TOKENS` more: the shortest context any task is generated at (56 tokens up to stride 16). A task
    with more text needs more (its generator says how much)."""
    least = tail_reserve(stride) + MIN_TEXT_TOKENS
    if context_length < least:
        raise ValueError(f"context_length must be >= {least} tokens at stride {stride} (the trailing zone takes "
                         f"{tail_reserve(stride)}, the prompt and the task's text at least {MIN_TEXT_TOKENS}), "
                         f"got {context_length}")


def derive_seed(domain: str, task: str, seed: int, index: int) -> int:
    """A 64-bit seed for one example, from its domain (``"eval"`` or ``"train"`` and a purpose), task, seed, index."""
    digest = hashlib.sha256(f"kvpress-phase|{domain}|{task}|{seed}|{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


# --------------------------------------------------------------------------------------------- drafts
@dataclass
class Block:
    """One piece of context text.

    ``sep`` is written before the block (and dropped for the very first piece of the context). ``answer`` is,
    for the answer-bearing block only, the character span inside ``text`` of the value whose first token
    defines the phase.
    """

    text: str
    sep: str = " "
    answer: Optional[tuple[int, int]] = None


@dataclass
class Draft:
    """A base example, before its length is fixed and before it is placed at a phase."""

    blocks: list[Block]
    target: int
    """Index in ``blocks`` of the answer-bearing block."""
    hay: Callable[[random.Random], str]
    """Draws one haystack sentence for the trailing zone."""
    question: str
    answer_prefix: str
    answers: list[str]
    completion: str
    """What a model should generate after the answer prefix (the training target)."""
    depth: float
    tail_sep: str = " "

    @property
    def answer_span_text(self) -> str:
        block = self.blocks[self.target]
        s, e = block.answer
        return block.text[s:e]


@dataclass
class BuildContext:
    """What a builder gets: the tokenizer, its random generator, its token budget and its options."""

    tokenizer: object
    rng: random.Random
    budget: int
    options: dict
    _counts: dict = field(default_factory=dict)

    def count(self, text: str) -> int:
        """Tokens of ``text`` when it follows other text (an estimate for non word-level tokenizers)."""
        n = self._counts.get(text)
        if n is None:
            n = len(self.tokenizer.encode(text, add_special_tokens=False))
            self._counts[text] = n
        return n

    def block_tokens(self, block: Block) -> int:
        return self.count(block.sep + block.text)

    def depth(self) -> float:
        """The requested needle depth, or a uniform draw in [0, 1] when the ``depth`` option is None."""
        d = self.options.get("depth")
        return self.rng.random() if d is None else float(d)

    def too_short(self, needed: int) -> ValueError:
        return ValueError(
            f"context_length is too small for this task and these options: the blocks need about {needed} "
            f"tokens, {self.budget} are available"
        )


# --------------------------------------------------------------------------------------------- haystacks
class NoiseHay:
    """The "noise" haystack: :data:`vocab.NOISE_SENTENCES` repeated in order from a random first sentence."""

    def __init__(self, rng: random.Random):
        self.i = rng.randrange(len(vocab.NOISE_SENTENCES))

    def __call__(self, rng: random.Random) -> str:
        s = vocab.NOISE_SENTENCES[self.i % len(vocab.NOISE_SENTENCES)]
        self.i += 1
        return s


def essay_hay(rng: random.Random) -> str:
    return vocab.essay_sentence(rng)


class NeedleHay:
    """A haystack of distractor needles whose keys are not among ``exclude``."""

    def __init__(self, exclude, groups: int):
        self.keys = [k for k in vocab.KEYS if k not in set(exclude)]
        self.groups = groups

    def __call__(self, rng: random.Random) -> str:
        return vocab.NEEDLE.format(key=rng.choice(self.keys), value=vocab.random_value(rng, self.groups))


HAYSTACKS = ("noise", "essay", "needle")


def make_hay(kind: str, rng: random.Random, exclude=(), groups: int = 2) -> Callable[[random.Random], str]:
    if kind == "noise":
        return NoiseHay(rng)
    if kind == "essay":
        return essay_hay
    if kind == "needle":
        return NeedleHay(exclude, groups)
    raise ValueError(f"haystack must be one of {HAYSTACKS}, got {kind!r}")


def fill_sentences(ctx: BuildContext, hay: Callable[[random.Random], str], n_tokens: int) -> list[str]:
    """Haystack sentences totalling at most ``n_tokens`` (estimated), stopping at the first that would overflow."""
    out: list[str] = []
    total = 0
    while True:
        s = hay(ctx.rng)
        c = ctx.count(" " + s)
        if total + c > n_tokens:
            return out
        out.append(s)
        total += c


def place_in_hay(
    ctx: BuildContext, hay: Callable[[random.Random], str], needles: list[tuple[Block, float]], budget: int
) -> tuple[list[Block], list[int]]:
    """Insert ``needles`` (block, relative depth) between haystack sentences filling ``budget`` tokens.

    A needle goes to the sentence boundary nearest to its depth (a fraction of the haystack tokens). Needles
    at the same boundary keep the order of ``needles``. Returns the blocks and the index of each needle in them.
    """
    needed = sum(ctx.block_tokens(b) for b, _ in needles)
    if needed > budget:
        raise ctx.too_short(needed)
    sentences = fill_sentences(ctx, hay, budget - needed)
    cum = [0]
    for s in sentences:
        cum.append(cum[-1] + ctx.count(" " + s))
    total = cum[-1]
    slots = []
    for order, (block, d) in enumerate(needles):
        goal = d * total
        j = min(range(len(cum)), key=lambda i: (abs(cum[i] - goal), i))
        slots.append((j, order))
    slots.sort()
    blocks: list[Block] = []
    where = [0] * len(needles)
    k = 0
    for j in range(len(sentences) + 1):
        while k < len(slots) and slots[k][0] == j:
            where[slots[k][1]] = len(blocks)
            blocks.append(needles[slots[k][1]][0])
            k += 1
        if j < len(sentences):
            blocks.append(Block(sentences[j]))
    return blocks, where


def check_depth(options: dict) -> None:
    d = options.get("depth")
    if d is not None and not (isinstance(d, (int, float)) and 0.0 <= d <= 1.0):
        raise ValueError(f"depth must be None or a number in [0, 1], got {d!r}")


def check_int(options: dict, name: str, low: int, high: Optional[int] = None, allow_none: bool = False) -> None:
    v = options.get(name)
    if v is None and allow_none:
        return
    if not isinstance(v, int) or isinstance(v, bool) or v < low or (high is not None and v > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an integer {bound}{' or None' if allow_none else ''}, got {v!r}")


# --------------------------------------------------------------------------------------------- assembly
@dataclass
class Placed:
    """A concrete context and the positions of its answer-bearing needle in the prefill sequence."""

    context: str
    n_tokens: int
    needle_span: tuple[int, int]
    answer_span: tuple[int, int]
    token_ids: tuple = field(default=(), repr=False, compare=False)
    """The prefill token ids (filled in by :func:`measure`)."""

    def tokens(self, span: tuple[int, int]) -> tuple:
        """The token ids of a ``(start, end)`` span of the prefill sequence."""
        return tuple(self.token_ids[span[0] : span[1]])


def measure(tokenizer, context: str, needle: tuple[int, int], answer: tuple[int, int]) -> Placed:
    """``context`` tokenised as the prefill, with the token spans of the needle's and the answer's character spans
    ``(start, end)``. Used by the generators' :class:`Assembler` and by :mod:`.hub`'s re-placement."""
    ids, offsets, start = encode_with_offsets(tokenizer, context)
    return Placed(
        context=context,
        n_tokens=len(ids),
        needle_span=offsets_to_token_span(offsets, start + needle[0], start + needle[1]),
        answer_span=offsets_to_token_span(offsets, start + answer[0], start + answer[1]),
        token_ids=tuple(ids),
    )


class Assembler:
    """Turns a draft into contexts of exactly ``length`` prefill tokens, with or without prefix padding."""

    def __init__(self, draft: Draft, tokenizer, length: int, tail_rng: random.Random, pad_words: list[str]):
        self.draft = draft
        self.tokenizer = tokenizer
        self.length = length
        self.tail_rng = tail_rng
        self.tail: list[tuple[str, str]] = []
        self.pad_words = pad_words
        self._counts: dict[str, int] = {}
        self._base: Optional[Placed] = None
        self._unpadded: Optional[Placed] = None
        self.filler_before_separator = False
        """Where prefix filler goes: after the target block's separator (False) or before it (True)."""

    # ---- text
    def _tail_units(self, n: int) -> list[tuple[str, str]]:
        """The first ``n`` pieces of the trailing zone as (separator, piece): words and punctuation apart."""
        while len(self.tail) < n:
            for piece in vocab.split_words(self.draft.hay(self.tail_rng)):
                self.tail.append(("" if piece in vocab.PUNCTUATION else " ", piece))
        return self.tail[:n]

    def render(self, n_pad: int, n_tail: int, n_fill: int = 0) -> tuple[str, tuple[int, int], tuple[int, int]]:
        """Context text, the needle's character span and the answer's character span."""
        parts: list[str] = []
        pos = 0

        def put(sep: str, text: str, keep_sep: bool = False) -> int:
            nonlocal pos
            if parts or keep_sep:
                parts.append(sep)
                pos += len(sep)
            start = pos
            parts.append(text)
            pos += len(text)
            return start

        needle = answer = None
        for i, block in enumerate(self.draft.blocks):
            if i == self.draft.target:
                if self.filler_before_separator:
                    # filler ends the previous text; the block keeps its separator (also at the context start)
                    for w in self.pad_words[:n_pad]:
                        put(" ", w)
                    start = put(block.sep, block.text, keep_sep=True)
                else:
                    sep = block.sep
                    for w in self.pad_words[:n_pad]:
                        put(sep, w)
                        sep = " "
                    start = put(sep, block.text)
                needle = (start, start + len(block.text))
                answer = (start + block.answer[0], start + block.answer[1])
            else:
                put(block.sep, block.text)
        units = self._tail_units(n_tail) + [(" ", w) for w in self.pad_words[:n_fill]]
        for j, (sep, w) in enumerate(units):
            put(self.draft.tail_sep if j == 0 else sep, w)
        return "".join(parts), needle, answer

    def measure(self, n_pad: int, n_tail: int, n_fill: int = 0) -> Placed:
        """The rendered context (see :meth:`render`) tokenised: :func:`measure`."""
        return measure(self.tokenizer, *self.render(n_pad, n_tail, n_fill))

    def _count(self, text: str) -> int:
        n = self._counts.get(text)
        if n is None:
            n = len(self.tokenizer.encode(text, add_special_tokens=False))
            self._counts[text] = n
        return n

    # ---- exact length
    def fit(self, n_pad: int) -> Placed:
        """Size the trailing zone so that the prefill has exactly ``length`` tokens (or as close as possible).

        Tail words are taken while their estimated counts fit; a remaining gap left by a multi-token word is
        closed with single-token filler words. Every candidate is verified by re-tokenising.
        """
        placed = self.measure(n_pad, 0)
        if placed.n_tokens > self.length:
            raise ValueError(
                f"context_length={self.length} is too small: the example needs {placed.n_tokens} tokens "
                f"before its trailing haystack"
            )
        n_tail, total, gap = 0, placed.n_tokens, self.length - placed.n_tokens
        while True:
            sep, piece = self._tail_units(n_tail + 1)[n_tail]
            c = self._count(sep + piece)
            if total + c > self.length:
                break
            total += c
            n_tail += 1
        n_fill = 0
        best = None
        for _ in range(4 * gap + 8):
            placed = self.measure(n_pad, n_tail, n_fill)
            diff = placed.n_tokens - self.length
            if best is None or abs(diff) < abs(best.n_tokens - self.length):
                best = placed
            if diff == 0:
                return placed
            if diff > 0:
                if n_fill:
                    n_fill -= 1
                elif n_tail:
                    n_tail -= 1
                else:
                    break
            else:
                if n_fill + 1 > len(self.pad_words):
                    break
                n_fill += 1
        return best

    def choose_filler_layout(self) -> None:
        """Decide where prefix filler goes for this example (see "Where the filler goes" in the module docstring).

        Filler goes after the target block's separator unless one filler word there changes the block's tokens;
        then it goes before the separator. Called once, before any padded placement.
        """
        self.filler_before_separator = False
        bare, padded = self.measure(0, 0), self.measure(1, 0)
        self.filler_before_separator = bare.tokens(bare.needle_span) != padded.tokens(padded.needle_span)

    # ---- what the placement moves (:func:`.placement.place_answer`)
    @property
    def n_filler(self) -> int:
        return len(self.pad_words)

    def unpadded(self) -> Placed:
        """The draft at the requested length without filler, the target block written as any other (the
        ``"offset"`` protocol's context: the filler layout plays no part)."""
        if self._unpadded is None:
            chosen, self.filler_before_separator = self.filler_before_separator, False
            try:
                self._unpadded = self.fit(0)
            finally:
                self.filler_before_separator = chosen
        return self._unpadded

    def padded(self, n_pad: int) -> Placed:
        """``n_pad`` filler words before the target block in the example's filler layout (chosen at the first
        call), the trailing zone sized to keep the length: the ``"prefix"`` protocol's contexts."""
        if self._base is None:
            self.choose_filler_layout()
            self._base = self.fit(0)
        return self._base if n_pad == 0 else self.fit(n_pad)


def phase_columns(placed: "Placed", phase: int, stride: int, offset: int, protocol: str, seed: int,
                  sample_id: int) -> dict:
    """The columns that say where a placed example's needle and answer sit, shared by every generator."""
    return {
        "needle_token_start": placed.needle_span[0],
        "needle_token_end": placed.needle_span[1],
        "answer_token_start": placed.answer_span[0],
        "answer_token_end": placed.answer_span[1],
        "phase": phase,
        "stride": stride,
        "offset": offset,
        "protocol": protocol,
        "context_length": placed.n_tokens,
        "seed": seed,
        "sample_id": sample_id,
    }


def single_token_words(tokenizer, words: list[str]) -> list[str]:
    """Those ``words`` that are exactly one token when they follow a space."""
    return [w for w in words if len(tokenizer.encode(" " + w, add_special_tokens=False)) == 1]
