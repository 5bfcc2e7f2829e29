"""LongBench-style synthetic passage tasks: retrieval and counting.

Both contexts are numbered paragraphs ("Paragraph 3: ..."), one per line, made of essay-grammar sentences.

* ``passage_retrieval``: the question quotes one sentence of one paragraph; the answer is "Paragraph N". The
  answer-bearing needle is that paragraph and its label "Paragraph N" sets the phase.
* ``passage_count``: some paragraphs are repeated word for word; the answer is the number of different
  paragraphs. The answer-bearing needle is one repeated occurrence, and the first token of its content sets
  the phase. The last paragraph is always a new one (the trailing haystack words extend it).
"""

from __future__ import annotations

from . import vocab
from .base import Block, BuildContext, Draft, check_depth, check_int, essay_hay, fill_sentences

RETRIEVAL_OPTIONS = {"n_paragraphs": None, "depth": None}
COUNT_OPTIONS = {"n_paragraphs": None, "n_unique": None, "depth": None}


def _n_paragraphs(ctx: BuildContext, low: int) -> int:
    check_int(ctx.options, "n_paragraphs", low, 99, allow_none=True)
    return ctx.options["n_paragraphs"] or max(low, min(30, ctx.budget // 60))


def _contents(ctx: BuildContext, n: int, tokens_each: int, avoid: set[str]) -> list[list[str]]:
    """``n`` different paragraph contents (lists of sentences) of about ``tokens_each`` tokens."""
    out: list[list[str]] = []
    seen = set(avoid)
    while len(out) < n:
        sentences = fill_sentences(ctx, essay_hay, tokens_each) or [essay_hay(ctx.rng)]
        key = " ".join(sentences)
        if key not in seen:
            seen.add(key)
            out.append(sentences)
    return out


def _paragraph(index: int, sentences: list[str]) -> Block:
    return Block(vocab.PARAGRAPH_HEADER.format(index=index) + " " + " ".join(sentences), "\n")


def _budget_check(ctx: BuildContext, blocks: list[Block]) -> None:
    used = sum(ctx.block_tokens(b) for b in blocks)
    if used > ctx.budget:
        raise ctx.too_short(used)


def _per_paragraph(ctx: BuildContext, n: int) -> int:
    header = ctx.count("\n" + vocab.PARAGRAPH_HEADER.format(index=n))
    return max(1, ctx.budget // n - header)


def build_retrieval(ctx: BuildContext) -> Draft:
    o, rng = ctx.options, ctx.rng
    check_depth(o)
    n = _n_paragraphs(ctx, 2)
    depth = ctx.depth()
    contents = _contents(ctx, n, _per_paragraph(ctx, n), set())
    t = min(n - 1, int(depth * n))
    counts: dict[str, int] = {}
    for sentences in contents:
        for s in sentences:
            counts[s] = counts.get(s, 0) + 1
    unique = [s for s in contents[t] if counts[s] == 1]
    if not unique:  # practically never: draw a new sentence for the target paragraph
        s = essay_hay(rng)
        while s in counts:
            s = essay_hay(rng)
        contents[t].append(s)
        unique = [s]
    quoted = rng.choice(unique)
    blocks = [_paragraph(i + 1, c) for i, c in enumerate(contents)]
    _budget_check(ctx, blocks)
    label = vocab.RETRIEVAL_ANSWER.format(index=t + 1)
    blocks[t].answer = (0, len(label))
    return Draft(
        blocks=blocks,
        target=t,
        hay=essay_hay,
        question=vocab.RETRIEVAL_QUESTION.format(sentence=quoted),
        answer_prefix=vocab.RETRIEVAL_PREFIX,
        answers=[label],
        completion=label,
        depth=depth,
    )


def build_count(ctx: BuildContext) -> Draft:
    o, rng = ctx.options, ctx.rng
    check_depth(o)
    n = _n_paragraphs(ctx, 3)
    check_int(o, "n_unique", 2, n - 1, allow_none=True)
    depth = ctx.depth()
    n_unique = o["n_unique"] or rng.randint(max(2, (n + 1) // 2), n - 1)
    contents = _contents(ctx, n_unique, _per_paragraph(ctx, n), set())
    order = list(range(n_unique - 1)) + [rng.randrange(n_unique - 1) for _ in range(n - n_unique)]
    rng.shuffle(order)
    order.append(n_unique - 1)  # the last paragraph is new and never repeated
    repeats = [i for i, c in enumerate(order) if c in order[:i]]
    goal = depth * (n - 1)
    t = min(repeats, key=lambda i: (abs(i - goal), i))
    blocks = [_paragraph(i + 1, contents[c]) for i, c in enumerate(order)]
    _budget_check(ctx, blocks)
    start = len(vocab.PARAGRAPH_HEADER.format(index=t + 1)) + 1
    blocks[t].answer = (start, len(blocks[t].text))
    answer = str(n_unique)
    return Draft(
        blocks=blocks,
        target=t,
        hay=essay_hay,
        question=vocab.COUNT_QUESTION,
        answer_prefix=vocab.COUNT_PREFIX,
        answers=[answer],
        completion=answer,
        depth=depth,
    )
