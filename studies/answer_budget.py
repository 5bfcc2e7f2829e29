"""How often a run's answers end at their task's answer budget (``max_new_tokens``), per task and length.

    python -m studies.answer_budget outputs/qwen-replication/uncompressed --output answer-budget.md

For each run the evaluation's examples are planned again from its ``config.json`` (:func:`~.config.plan_units`:
deterministic, no model needed, only its tokenizer), which gives every answer its budget; each answer's prediction
is encoded with the same tokenizer and counted as cut when it is at least that long. Per task, context length and
press: accuracy, the share of answers cut, accuracy among the cut ones, the share of answers that are both cut and
wrong (``cut_wrong``: the most a longer budget could change; a cut answer that already holds its references loses
nothing), for the list tasks (``vt``, multi-value and multi-query needles) the share cut while still right so far
(``cut_open``, :func:`still_open`). A cut answer is scored on what it holds, so more tokens could have made any
cut wrong answer right (``cut_wrong`` bounds what a longer budget changes from above); ``cut_open`` counts those
that were right so far, the ones a longer budget most plausibly completes. The mean share of the reference answers
the prediction contains closes the table.
"""

from __future__ import annotations

import argparse
import re
import sys

import pandas as pd
from transformers import AutoTokenizer

from kvpress_phase.evaluation.cli import resolve_model_path
from kvpress_phase.evaluation.config import from_saved, plan_units
from kvpress_phase.evaluation.store import saved_config
from studies.common import emit
from studies.common import load as load_answers

KEYS = ["task", "context_length", "stride", "sample_id", "phase"]


def budgets(run: str) -> tuple[pd.DataFrame, object]:
    """Every planned example of ``run`` with its ``max_new_tokens``, and the run's tokenizer."""
    saved = saved_config(run)
    if saved is None:
        raise ValueError(f"{run} has no config.json: its examples cannot be planned again")
    config = from_saved(saved)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(config.model, progress=False))
    rows = [{**{k: row[k] for k in KEYS}, "max_new_tokens": row["max_new_tokens"]}
            for unit in plan_units(config, tokenizer) for row in unit.rows]
    return pd.DataFrame(rows), tokenizer


ITEMS = {
    "vt": lambda p: [m.group(1) for m in (re.search(r"VAR (\w+)", line) for line in p.split("\n")) if m],
    "niah_multivalue": lambda p: re.findall(r"\d+(?: \d+)?", p),
    "niah_multiquery": lambda p: re.findall(r"\d+(?: \d+)?", p),
}
"""The items a list task's answer names, in order: for ``vt`` the variable named first on each line, for the
multi-value and multi-query needles each value ("48 21", or a lone number where the answer was cut inside one)."""


def still_open(task: str, prediction: str, references) -> bool:
    """Whether a list task's answer is right so far: every item it names is a reference (the last one may be cut
    inside it), none twice, and fewer than the references, so that more tokens could still make it right. False for
    the other tasks (one short answer: cut and wrong is the most a budget could change, ``cut_wrong``)."""
    if task not in ITEMS:
        return False
    named = ITEMS[task](prediction)
    if not named or len(set(named)) != len(named) or len(named) > len(references):
        return False
    *whole, last = named
    return set(whole) <= set(references) and any(r.startswith(last) for r in references)


def table(run: str) -> pd.DataFrame:
    planned, tokenizer = budgets(run)
    answers = load_answers([run]).merge(planned, on=KEYS, how="left", validate="many_to_one")
    if answers.max_new_tokens.isna().any():
        raise ValueError(f"{run}: {int(answers.max_new_tokens.isna().sum())} answers match no planned example")
    answers["cut"] = [len(tokenizer.encode(p, add_special_tokens=False)) >= b
                      for p, b in zip(answers.prediction, answers.max_new_tokens)]
    answers["found"] = [sum(a in p for a in ans) / len(ans) for ans, p in zip(answers.answer, answers.prediction)]
    answers["cut_wrong"] = answers.cut & (answers.score < 1)
    answers["cut_open"] = [w and still_open(t, p, a) for w, t, p, a in
                           zip(answers.cut_wrong, answers.task, answers.prediction, answers.answer)]
    grouped = answers.groupby(["task", "context_length", "press"])
    out = grouped.agg(answers=("score", "size"), budget=("max_new_tokens", "median"), accuracy=("score", "mean"),
                      cut=("cut", "mean"), cut_wrong=("cut_wrong", "mean"), cut_open=("cut_open", "mean"),
                      found=("found", "mean"))
    out["accuracy_of_cut"] = grouped.apply(lambda g: g.score[g.cut].mean() if g.cut.any() else float("nan"),
                                           include_groups=False)
    return out.reset_index()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run folders of `kvpress-phase eval`")
    parser.add_argument("--output", help="also write the Markdown here")
    args = parser.parse_args(argv)
    parts = []
    for run in args.runs:
        try:
            t = table(run)
        except ValueError as exc:
            print(f"answer_budget: {exc}", file=sys.stderr)
            return 2
        parts.append(f"## `{run}`\n\n" + t.to_markdown(index=False, floatfmt=".2f") + "\n")
    emit("\n".join(parts), args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
