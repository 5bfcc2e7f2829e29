"""The examples of a fine-tuning run: generated task examples and rows of a user dataset in kvpress's schema.

Every example is one context, one question and its answer, laid out as kvpress's pipeline lays them out
(:func:`~kvpress_phase.evaluation.tasks.training_sequence`). The examples of a micro-batch are drawn from
generators seeded by (seed, step, micro-batch, example), so a step's data are a pure function of the configuration
and the step.
"""

from __future__ import annotations

import os
import random

from kvpress_phase.evaluation.arguments import first_line

from .config import FinetuneConfig


class ExampleSource:
    """Training examples of a configuration: generated task examples and rows of a user dataset."""

    def __init__(self, config: FinetuneConfig, tokenizer):
        self.config = config
        self.tokenizer = tokenizer
        self.names = [t for t, w in config.tasks.items() if w > 0]
        self.weights = [config.tasks[t] for t in self.names]
        self.rows = None
        self._encoded: dict[int, dict] = {}
        if config.dataset is not None:
            self.rows = load_dataset_rows(config.dataset, config.dataset_split)
            if config.dataset_weight > 0:
                self.names.append("dataset")
                self.weights.append(config.dataset_weight)
        if not self.names:
            raise ValueError("no training data: every weight is 0")

    def check(self) -> None:
        """ValueError when a task cannot produce an example at one of the context lengths."""
        from kvpress_phase.evaluation.tasks import training_example

        for task in self.names:
            if task == "dataset":
                self.dataset_example(0)
                continue
            for length in self.config.context_lengths:
                try:
                    training_example(task, self.tokenizer, 0, context_length=length)
                except ValueError as exc:
                    raise ValueError(f"task {task!r} does not fit a context of {length} tokens: {exc}") from None

    def dataset_example(self, index: int) -> dict:
        from kvpress_phase.evaluation.tasks import training_sequence

        if index not in self._encoded:
            row = self.rows[index]
            completion = row.get("completion") or ", ".join(_as_list(row["answer"]))
            self._encoded[index] = training_sequence(self.tokenizer, row["context"], row["question"],
                                                     row.get("answer_prefix") or "", completion)
        return self._encoded[index]

    def micro_batch(self, step: int, micro: int) -> tuple[list[dict], list[str], int]:
        """Examples, their kinds (task names or ``"dataset"``) and the generated examples' context length."""
        from kvpress_phase.evaluation.tasks import training_example

        config = self.config
        lengths = config.context_lengths or [0]
        length = random.Random(f"{config.seed}/length/{step}/{micro}").choice(lengths)
        examples, kinds = [], []
        for i in range(config.batch_size):
            rng = random.Random(f"{config.seed}/data/{step}/{micro}/{i}")
            kind = rng.choices(self.names, self.weights)[0]
            if kind == "dataset":
                examples.append(self.dataset_example(rng.randrange(len(self.rows))))
            else:
                examples.append(training_example(kind, self.tokenizer, rng, context_length=length))
            kinds.append(kind)
        return examples, kinds, length


def _as_list(answer) -> list[str]:
    return [answer] if isinstance(answer, str) else [str(a) for a in answer]


def load_dataset_rows(path: str, split: str):
    """Rows of a user dataset in kvpress's schema; ValueError when it cannot be read or lacks a column."""
    from kvpress_phase.evaluation.tasks import load_hub_tasks

    if not os.path.exists(path):
        raise ValueError(f"dataset {path!r} does not exist")
    try:
        ds = load_hub_tasks(path, split=split)
    except (ValueError, OSError) as exc:
        raise ValueError(f"dataset {path!r} cannot be read: {first_line(exc)}") from None
    missing = [c for c in ("context", "question", "answer") if c not in ds.column_names]
    if missing:
        raise ValueError(f"dataset {path!r} lacks the column(s) {', '.join(missing)} of kvpress's schema")
    if len(ds) == 0:
        raise ValueError(f"dataset {path!r} has no rows")
    return ds
