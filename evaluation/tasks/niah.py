"""RULER-style needle-in-a-haystack tasks: single, multi-key, multi-value and multi-query.

A needle reads "The special magic number for <key> is <value>." and the question asks for the value of a key.
The haystack is one of

* ``"noise"``: five plain sentences repeated ("The grass is green. The sky is blue. ...");
* ``"essay"``: sentences of a small grammar over a few hundred common words;
* ``"needle"``: distractor needles with other keys.

The answer-bearing needle sits at the requested relative ``depth`` (uniform in [0, 1] when None); the other
needles at uniform random depths.
"""

from __future__ import annotations

from . import vocab
from .base import Block, BuildContext, Draft, check_depth, check_int, make_hay, place_in_hay

COMMON_OPTIONS = {"haystack": "essay", "value_groups": 2, "depth": None}


def needle_block(key: str, value: str) -> Block:
    text = vocab.NEEDLE.format(key=key, value=value)
    start = text.rindex(value)
    return Block(text, answer=(start, start + len(value)))


def _check(options: dict) -> None:
    check_depth(options)
    check_int(options, "value_groups", 1, 4)
    if options["haystack"] not in ("noise", "essay", "needle"):
        raise ValueError(f"haystack must be one of ('noise', 'essay', 'needle'), got {options['haystack']!r}")


def _draft(ctx, needles, depth, target, hay, question, prefix, answers, completion) -> Draft:
    blocks, where = place_in_hay(ctx, hay, needles, ctx.budget)
    return Draft(
        blocks=blocks,
        target=where[target],
        hay=hay,
        question=question,
        answer_prefix=prefix,
        answers=answers,
        completion=completion,
        depth=depth,
    )


def build_single(ctx: BuildContext) -> Draft:
    """One needle; the question asks for its value."""
    o, rng = ctx.options, ctx.rng
    _check(o)
    depth = ctx.depth()
    key = rng.choice(vocab.KEYS)
    value = vocab.random_value(rng, o["value_groups"])
    hay = make_hay(o["haystack"], rng, exclude={key}, groups=o["value_groups"])
    return _draft(
        ctx,
        [(needle_block(key, value), depth)],
        depth,
        0,
        hay,
        vocab.NEEDLE_QUESTION.format(key=key),
        vocab.NEEDLE_PREFIX.format(key=key),
        [value],
        value,
    )


def build_multikey(ctx: BuildContext) -> Draft:
    """The target needle among ``n_distractors`` needles with other keys."""
    o, rng = ctx.options, ctx.rng
    _check(o)
    check_int(o, "n_distractors", 1, 64)
    depth = ctx.depth()
    keys = rng.sample(vocab.KEYS, 1 + o["n_distractors"])
    values = vocab.distinct_values(rng, len(keys), o["value_groups"])
    needles = [(needle_block(keys[0], values[0]), depth)]
    needles += [(needle_block(k, v), rng.random()) for k, v in zip(keys[1:], values[1:])]
    hay = make_hay(o["haystack"], rng, exclude=set(keys), groups=o["value_groups"])
    return _draft(
        ctx,
        needles,
        depth,
        0,
        hay,
        vocab.NEEDLE_QUESTION.format(key=keys[0]),
        vocab.NEEDLE_PREFIX.format(key=keys[0]),
        [values[0]],
        values[0],
    )


def build_multivalue(ctx: BuildContext) -> Draft:
    """``n_values`` needles share one key; every value must be returned. The first value sets the phase."""
    o, rng = ctx.options, ctx.rng
    _check(o)
    check_int(o, "n_values", 2, 16)
    depth = ctx.depth()
    key = rng.choice(vocab.KEYS)
    values = vocab.distinct_values(rng, o["n_values"], o["value_groups"])
    depths = [depth] + [rng.random() for _ in values[1:]]
    needles = [(needle_block(key, v), d) for v, d in zip(values, depths)]
    hay = make_hay(o["haystack"], rng, exclude={key}, groups=o["value_groups"])
    draft = _draft(
        ctx,
        needles,
        depth,
        0,
        hay,
        vocab.MULTIVALUE_QUESTION.format(key=key),
        vocab.MULTIVALUE_PREFIX.format(key=key),
        values,
        "",
    )
    in_order = [b.text[b.answer[0] : b.answer[1]] for b in draft.blocks if b.answer is not None]
    draft.completion = ", ".join(in_order)
    return draft


def build_multiquery(ctx: BuildContext) -> Draft:
    """``n_queries`` needles with different keys, all asked at once. The first key asked sets the phase."""
    o, rng = ctx.options, ctx.rng
    _check(o)
    check_int(o, "n_queries", 2, 16)
    depth = ctx.depth()
    keys = rng.sample(vocab.KEYS, o["n_queries"])
    values = vocab.distinct_values(rng, len(keys), o["value_groups"])
    depths = [depth] + [rng.random() for _ in keys[1:]]
    needles = [(needle_block(k, v), d) for k, v, d in zip(keys, values, depths)]
    hay = make_hay(o["haystack"], rng, exclude=set(keys), groups=o["value_groups"])
    named = vocab.join_list(keys)
    return _draft(
        ctx,
        needles,
        depth,
        0,
        hay,
        vocab.MULTIQUERY_QUESTION.format(keys=named),
        vocab.MULTIQUERY_PREFIX.format(keys=named),
        values,
        ", ".join(values),
    )


SINGLE_OPTIONS = dict(COMMON_OPTIONS)
MULTIKEY_OPTIONS = dict(COMMON_OPTIONS, n_distractors=3)
MULTIVALUE_OPTIONS = dict(COMMON_OPTIONS, n_values=4)
MULTIQUERY_OPTIONS = dict(COMMON_OPTIONS, n_queries=4)
