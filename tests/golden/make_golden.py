"""Write the golden files that pin the presses' behaviour before they are reshaped (tests/test_golden.py reads them).

- ``press_specs.json``: every press spec written in RESULTS.md, README.md, docs/ and the notebooks, with the fields of
  the press it builds (at ratio 0.5, stride 8, offset 0): a later version must build the same configuration from
  the same text (aliases where names change).
- ``builtin_answers.jsonl``: the built-in model's answers and cache lengths under every one of those specs (and the
  plain press names), offset protocol, both NIAH tasks, two ratios, one sample per phase.

    python tests/golden/make_golden.py        # only when a change is meant to change behaviour: say so in its commit
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SPEC = re.compile(r"(?:phase_aware|chunked_stride|staggered_window|head_budget|layer_budget|global_budget|threshold_budget)"
                  r"(?::[a-z_]+=[A-Za-z0-9_.]+)+")
DOCS = ["RESULTS.md", "README.md", "MODEL_CARD.md", "docs", "notebooks"]


def documented_specs() -> list[str]:
    """Every spec of our presses with settings (``phase_aware:...``, ``chunked_stride:...``, ``staggered_window:...``,
    the budget wrappers') written in the docs and notebooks, in today's spelling and label (results of earlier
    studies keep the labels they were run under; the budget wrappers' former spellings read through the alias
    table), sorted."""
    from kvpress_phase.evaluation.presses import canonical_label, current_spelling

    found = set()
    for entry in DOCS:
        path = os.path.join(ROOT, entry)
        files = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs
                                                     if f.endswith((".md", ".ipynb"))]
        for name in files:
            with open(name, encoding="utf-8") as fh:
                found.update(canonical_label(current_spelling(spec)) for spec in SPEC.findall(fh.read()))
    return sorted(found)


def press_fields(press) -> dict:
    """The configuration fields of ``press`` (and of its scorer), as text: its constructor's fields, less private
    ones and the per-prefill state (``stats``, ``decoding_state``)."""
    import dataclasses

    out = {}
    for f in dataclasses.fields(press):
        if not f.init or f.name.startswith("_") or f.name in ("stats", "decoding_state"):
            continue
        value = getattr(press, f.name)
        out[f.name] = press_fields(value) if dataclasses.is_dataclass(value) and not isinstance(value, type) else \
            repr(value)
    return {"class": type(press).__name__, **out}


NOT_ON_BUILTIN = ("scorer=kvzap", "threshold_budget")
"""Spec parts the built-in model cannot answer (no KVzap scorer is shipped for it; ``threshold_budget`` uses it by
default): such specs are pinned by their configuration only (``press_specs.json``), not by built-in answers."""


def golden_config(specs: list[str]):
    from kvpress_phase.evaluation.presses import parse_press_spec
    from kvpress_phase.evaluation.config import EvalConfig

    labels, presses = set(), []
    for text in ["no_press", "chunked_stride", "phase_aware"] + specs:  # one spelling per configuration
        if any(part in text for part in NOT_ON_BUILTIN):
            continue
        label = parse_press_spec(text).label
        if label not in labels:
            labels.add(label)
            presses.append(text)
    return EvalConfig(tasks=["niah_single", "niah_multikey"], presses=presses, compression_ratios=[0.25, 0.5],
                      strides=[8], protocol="offset", context_lengths=[256], samples=1, seed=21,
                      diagnostics=False, step_by_step=True)


def main() -> int:
    sys.path.insert(0, ROOT)
    from kvpress_phase import load_builtin_model
    from kvpress_phase.evaluation.presses import build_press, parse_press_spec
    from kvpress_phase.evaluation.runner import run_evaluation

    specs = documented_specs()
    fields = {text: press_fields(build_press(parse_press_spec(text), 0.5, 8, None, 0)) for text in specs}
    with open(os.path.join(HERE, "press_specs.json"), "w") as fh:
        json.dump(fields, fh, indent=1, sort_keys=True)
        fh.write("\n")
    model, tokenizer = load_builtin_model()
    with tempfile.TemporaryDirectory() as out:
        df = run_evaluation(golden_config(specs), model, tokenizer, out)
    with open(os.path.join(HERE, "builtin_answers.jsonl"), "w") as fh:
        for row in df.sort_values("key").itertuples():
            fh.write(json.dumps({"key": row.key, "prediction": row.prediction, "cache_length": row.cache_length})
                     + "\n")
    print(f"{len(fields)} specs, {len(df)} answers")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
