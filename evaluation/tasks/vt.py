"""RULER-style variable tracking.

A chain starts with "VAR apple = 48 21." and continues with ``n_hops`` copies "VAR pear = VAR apple.",
"VAR plum = VAR pear.", ... spread through the haystack in order. ``n_chains - 1`` distractor chains carry other
values. The question gives the value of the target chain and asks for every variable that holds it; all of
them must be returned. The answer-bearing needle is the chain's first statement, and the phase is that of the
first variable name in it.

The answer prefix follows RULER's (the count of variables, then a colon: option ``prefix="ruler"``, the default
since revision 2 of the task); ``prefix="plain"`` is revision 1's "The variables assigned the value ... are".
"""

from __future__ import annotations

from . import vocab
from .base import Block, BuildContext, Draft, check_depth, check_int, make_hay, place_in_hay

OPTIONS = {"n_hops": 4, "n_chains": 1, "haystack": "noise", "value_groups": 2, "depth": None, "prefix": "ruler"}
PREFIXES = {"ruler": vocab.VT_PREFIX, "plain": vocab.VT_PREFIX_PLAIN}


def _chain(names: list[str], value: str) -> list[Block]:
    first = vocab.VT_ASSIGN_VALUE.format(name=names[0], value=value)
    start = first.index(names[0])
    blocks = [Block(first, answer=(start, start + len(names[0])))]
    for prev, name in zip(names, names[1:]):
        blocks.append(Block(vocab.VT_ASSIGN_VAR.format(name=name, source=prev)))
    return blocks


def build(ctx: BuildContext) -> Draft:
    o, rng = ctx.options, ctx.rng
    check_depth(o)
    check_int(o, "n_hops", 1, 16)
    check_int(o, "n_chains", 1, 8)
    check_int(o, "value_groups", 1, 4)
    if o["haystack"] not in ("noise", "essay"):
        raise ValueError(f"haystack must be 'noise' or 'essay' for vt, got {o['haystack']!r}")
    if o["prefix"] not in PREFIXES:
        raise ValueError(f"prefix must be one of {', '.join(map(repr, PREFIXES))} for vt, got {o['prefix']!r}")
    depth = ctx.depth()
    length = o["n_hops"] + 1
    names = rng.sample(vocab.KEYS, length * o["n_chains"])
    values = vocab.distinct_values(rng, o["n_chains"], o["value_groups"])
    needles = []
    for c in range(o["n_chains"]):
        chain = _chain(names[c * length : (c + 1) * length], values[c])
        if c == 0:
            later = sorted(depth + (1.0 - depth) * rng.random() for _ in chain[1:])
            depths = [depth] + later
        else:
            depths = sorted(rng.random() for _ in chain)
        needles += list(zip(chain, depths))
    hay = make_hay(o["haystack"], rng)
    blocks, where = place_in_hay(ctx, hay, needles, ctx.budget)
    target_names = names[:length]
    return Draft(
        blocks=blocks,
        target=where[0],
        hay=hay,
        question=vocab.VT_QUESTION.format(value=values[0]),
        answer_prefix=PREFIXES[o["prefix"]].format(count=length, value=values[0]),
        answers=target_names,
        completion=", ".join(target_names),
        depth=depth,
    )
