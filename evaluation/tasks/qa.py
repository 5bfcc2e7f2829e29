"""LongBench-style question answering over templated documents about people.

Each person has a few facts ("Anna lives in Paris.", "Anna works as a baker.", "Anna is 34 years old."), every
statement naming its person. All people of an example share the asked kind of fact, so the name in the
question is what singles out the answer. Facts are told in paragraphs mixed with ordinary sentences of the
essay grammar.

* ``qa_single_doc``: one report; one paragraph per person.
* ``qa_multi_doc``: several documents ("Document 3: ..."), each about ``people_per_doc`` people.

The answer-bearing needle is the asked fact's sentence; its value (city, job, colour, ...) sets the phase.
"""

from __future__ import annotations

from . import vocab
from .base import Block, BuildContext, Draft, check_depth, check_int, essay_hay, fill_sentences

SINGLE_OPTIONS = {"n_people": None, "n_facts": 4, "fact": None, "depth": None}
MULTI_OPTIONS = {"n_docs": None, "people_per_doc": 2, "n_facts": 4, "fact": None, "depth": None}
AUTO_FACT_SHARE = 0.6
"""With automatic sizes, people are dropped until their facts take at most this share of the token budget."""


def _check(o: dict) -> None:
    check_depth(o)
    check_int(o, "n_facts", 1, len(vocab.FACTS))
    if o["fact"] is not None and o["fact"] not in vocab.FACTS:
        raise ValueError(f"fact must be None or one of {sorted(vocab.FACTS)}, got {o['fact']!r}")


def _profiles(ctx: BuildContext, n_people: int) -> tuple[list[list[Block]], str, list[str]]:
    """Fact blocks of ``n_people`` people; the asked fact kind; the people's names."""
    o, rng = ctx.options, ctx.rng
    kinds = sorted(vocab.FACTS)
    asked = o["fact"] or rng.choice(kinds)
    names = rng.sample(vocab.NAMES, n_people)
    people = []
    for name in names:
        others = rng.sample([k for k in kinds if k != asked], o["n_facts"] - 1)
        facts = []
        for kind in [asked] + others:
            choices = [v for v in vocab.fact_values(kind) if v != name]
            value = rng.choice(choices)
            text = vocab.FACTS[kind][0].format(name=name, value=value)
            start = text.rindex(value)
            facts.append((kind, Block(text, answer=(start, start + len(value)))))
        rng.shuffle(facts)
        people.append([b if k == asked else Block(b.text) for k, b in facts])
    return people, asked, names


def _question(asked: str, name: str, block: Block) -> dict:
    value = block.text[block.answer[0] : block.answer[1]]
    _, question, prefix, _ = vocab.FACTS[asked]
    return dict(
        question=question.format(name=name),
        answer_prefix=prefix.format(name=name),
        answers=[value],
        completion=value,
    )


def _fact_tokens(ctx: BuildContext, person: list[Block]) -> int:
    return sum(ctx.block_tokens(b) for b in person) + 1


def _paragraph(ctx: BuildContext, person: list[Block], hay_tokens: int, sep: str) -> list[Block]:
    """A person's facts followed by essay sentences, the first block preceded by ``sep``."""
    blocks = [Block(b.text, " ", b.answer) for b in person]
    blocks += [Block(s) for s in fill_sentences(ctx, essay_hay, hay_tokens)]
    blocks[0].sep = sep
    return blocks


def _target_of(blocks: list[Block]) -> int:
    return next(i for i, b in enumerate(blocks) if b.answer is not None)


def build_single(ctx: BuildContext) -> Draft:
    """One report about ``n_people`` people (default: one per ~100 tokens, at least 2)."""
    o = ctx.options
    _check(o)
    check_int(o, "n_people", 2, len(vocab.NAMES), allow_none=True)
    depth = ctx.depth()
    n_people = o["n_people"] or max(2, min(len(vocab.NAMES), ctx.budget // 100))
    people, asked, names = _profiles(ctx, n_people)
    title = Block(vocab.QA_SINGLE_TITLE)

    def cost(n: int) -> int:
        return ctx.block_tokens(title) + sum(_fact_tokens(ctx, p) for p in people[:n])

    while o["n_people"] is None and n_people > 2 and cost(n_people) > AUTO_FACT_SHARE * ctx.budget:
        n_people -= 1  # automatic size: keep facts to a share of the budget whatever the tokenizer
    people, names = people[:n_people], names[:n_people]
    t = min(n_people - 1, int(depth * n_people))
    facts = cost(n_people)
    if facts > ctx.budget:
        raise ctx.too_short(facts)
    share = (ctx.budget - facts) // n_people
    blocks = [title]
    for person in people:
        blocks += _paragraph(ctx, person, share, "\n")
    # only the target person's asked fact keeps its answer span
    target = None
    seen = 0
    for i, b in enumerate(blocks):
        if b.answer is not None:
            if seen == t:
                target = i
            else:
                b.answer = None
            seen += 1
    return Draft(blocks=blocks, target=target, hay=essay_hay, depth=depth, **_question(asked, names[t], blocks[target]))


def build_multi(ctx: BuildContext) -> Draft:
    """``n_docs`` documents (default: one per ~200 tokens, 2 to 20), ``people_per_doc`` people each."""
    o, rng = ctx.options, ctx.rng
    _check(o)
    check_int(o, "n_docs", 2, 99, allow_none=True)
    check_int(o, "people_per_doc", 1, 4)
    depth = ctx.depth()
    n_docs = o["n_docs"] or max(2, min(20, ctx.budget // 200))
    per_doc = o["people_per_doc"]
    if n_docs * per_doc > len(vocab.NAMES):
        raise ValueError(f"n_docs * people_per_doc must be at most {len(vocab.NAMES)}")
    people, asked, names = _profiles(ctx, n_docs * per_doc)
    headers = [Block(vocab.QA_DOC_HEADER.format(index=i + 1), "\n") for i in range(n_docs)]

    def cost(n: int) -> int:
        people_cost = sum(_fact_tokens(ctx, p) for p in people[: n * per_doc])
        return sum(ctx.block_tokens(h) for h in headers[:n]) + people_cost

    while o["n_docs"] is None and n_docs > 2 and cost(n_docs) > AUTO_FACT_SHARE * ctx.budget:
        n_docs -= 1  # automatic size: keep facts to a share of the budget whatever the tokenizer
    people, names, headers = people[: n_docs * per_doc], names[: n_docs * per_doc], headers[:n_docs]
    t_doc = min(n_docs - 1, int(depth * n_docs))
    t_person = t_doc * per_doc + rng.randrange(per_doc)
    facts = cost(n_docs)
    if facts > ctx.budget:
        raise ctx.too_short(facts)
    share = (ctx.budget - facts) // len(people)
    blocks: list[Block] = []
    target = None
    for d in range(n_docs):
        blocks.append(headers[d])
        for j in range(per_doc):
            p = d * per_doc + j
            para = _paragraph(ctx, people[p], share, " ")
            k = _target_of(para)
            if p == t_person:
                target = len(blocks) + k
            else:
                para[k].answer = None
            blocks += para
    return Draft(
        blocks=blocks, target=target, hay=essay_hay, depth=depth, **_question(asked, names[t_person], blocks[target])
    )

