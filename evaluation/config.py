"""What a phase evaluation runs: its configuration (:class:`EvalConfig`, saved with the results and fingerprinted so
that a run resumes only into its own results), the ``setting`` column's values, and the plan of the run: work units
(one base sample of a task x context length x stride, every phase) and the press variants of each stride.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings
from dataclasses import dataclass, field
from typing import Optional

from .presses import PressSpec, parse_press_spec
from .tasks import PROTOCOLS, check_context_length, generate, get_task

SETTINGS = {False: "query_agnostic", True: "question_compressed"}
"""The ``setting`` column: the question appended after compression (kvpress's pipeline, query-agnostic) or
compressed with the context (query-aware: ``--query-aware``, formerly ``--compress-question``). The stored values
stay as they are; reports label them query-agnostic and query-aware."""


@dataclass
class EvalConfig:
    """Everything that determines a phase evaluation's results (saved with them)."""

    model: Optional[str] = None
    tasks: list = field(default_factory=lambda: ["niah_single"])
    presses: list = field(default_factory=lambda: ["no_press", "chunked_stride", "phase_aware"])
    compression_ratios: list = field(default_factory=lambda: [0.5])
    strides: list = field(default_factory=lambda: [8])
    windows: Optional[list] = None
    phases: Optional[list] = None
    protocol: str = "prefix"
    context_lengths: list = field(default_factory=lambda: [512])
    samples: int = 10
    seed: int = 0
    dtype: str = "float32"
    diagnostics: bool = True
    matched_cache: bool = False
    compress_question: bool = False
    allow_duplicate_k: bool = False
    decode_batch: int = 16
    step_by_step: bool = False

    def validate(self) -> None:
        for name in self.tasks:
            get_task(name)
        labels = [parse_press_spec(spec).label for spec in self.presses]
        if not self.tasks or not self.presses:
            raise ValueError("tasks and presses must not be empty")
        for i, label in enumerate(labels):
            if label in labels[:i]:
                raise ValueError(f"presses lists {label!r} twice: give each press once")
        for r in self.compression_ratios:
            if not 0 <= r < 1:
                raise ValueError(f"compression ratio must be in [0, 1), got {r}")
        positive = [r for r in self.compression_ratios if r > 0]
        for s in self.strides:
            if s < 1:
                raise ValueError(f"stride must be >= 1, got {s}")
            if s == 1 and positive and labels != ["no_press"]:
                raise ValueError(f"stride 1 cannot run compression ratio {positive[0]:g}: a stride of 1 makes "
                                 "one-token windows and each keeps its token, so nothing would be compressed; use "
                                 "strides of 2 or more")
        for w in self.windows or []:
            if w < min(self.strides):
                raise ValueError(f"window must be >= stride, got window {w} with strides {self.strides}")
        for p in self.phases or []:
            if not 0 <= p < min(self.strides):
                raise ValueError(f"phase must be in [0, stride), got phase {p} with strides {self.strides}")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {self.protocol!r}")
        for n in self.context_lengths:
            check_context_length(n, max(self.strides, default=1))
        if self.samples < 1:
            raise ValueError(f"samples must be >= 1, got {self.samples}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.decode_batch < 1:
            raise ValueError(f"decode batch must be >= 1, got {self.decode_batch}")
        if not self.allow_duplicate_k:
            duplicate = duplicate_k(self.compression_ratios, self.strides)
            if duplicate:
                raise ValueError(duplicate + "; drop one, or allow it explicitly (--allow-duplicate-k)")

    def fingerprint(self) -> str:
        values = dataclasses.asdict(self)
        for name, default in _LATER_FIELDS.items():  # fields added later: at their defaults, old runs resume
            if values.get(name) == default:
                values.pop(name)
        return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]

    def resumes(self, fingerprint: Optional[str]) -> bool:
        """Whether results saved under ``fingerprint`` are this configuration's: its own fingerprint, or, on the
        default model, that of a run saved before the command recorded the default model's name (model null)."""
        from kvpress_phase.builtin import DEFAULT_MODEL

        if fingerprint == self.fingerprint():
            return True
        return self.model == DEFAULT_MODEL and fingerprint == dataclasses.replace(self, model=None).fingerprint()


_LATER_FIELDS = {"compress_question": False, "allow_duplicate_k": False, "decode_batch": 16, "step_by_step": False}


def duplicate_k(ratios, strides) -> Optional[str]:
    """A message when two of ``ratios`` keep the same number of entries per window at one of ``strides`` (the sweep
    would run one configuration twice under two names), else None."""
    from kvpress_phase.phase import kept_per_window

    for stride in strides:
        seen: dict = {}
        for ratio in ratios:
            if ratio == 0:
                continue
            k = kept_per_window(stride, ratio)
            if k in seen and seen[k] != ratio:
                return (f"compression ratios {seen[k]:g} and {ratio:g} both keep k={k} of {stride} tokens per window "
                        f"at stride {stride} (per-window ratio {1 - k / stride:g}): the same configuration twice")
            seen[k] = ratio
    return None


# ------------------------------------------------------------------------------------------------ the plan
@dataclass
class WorkUnit:
    """All phases of one base sample of one task x context length x stride: one prefill per distinct text."""

    task: str
    context_length: int
    stride: int
    sample_id: int
    rows: list


def plan_units(config: EvalConfig, tokenizer) -> list[WorkUnit]:
    units = []
    for task in config.tasks:
        for context_length in config.context_lengths:
            for stride in config.strides:
                phases = config.phases if config.phases is not None else list(range(stride))
                ds = generate(task, tokenizer, n_samples=config.samples, context_length=context_length,
                              stride=stride, phases=phases, protocol=config.protocol, seed=config.seed)
                by_sample: dict[int, list] = {}
                for row in ds:
                    by_sample.setdefault(row["sample_id"], []).append(row)
                units += [WorkUnit(task, context_length, stride, sid, rows) for sid, rows in sorted(by_sample.items())]
    return units


def variants(config: EvalConfig, stride: int) -> list[tuple[PressSpec, float, Optional[int]]]:
    out = []
    for text in config.presses:
        spec = parse_press_spec(text)
        if spec.name == "no_press":
            out.append((spec, 0.0, None))
            continue
        windows = config.windows if (config.windows and spec.entry.grid_offset) else [None]
        for ratio in config.compression_ratios:
            for window in windows:
                if window is not None and window < stride:
                    continue
                out.append((spec, float(ratio), window))
    return out


def check_context_lengths(config: EvalConfig, model) -> Optional[str]:
    """Warn (and return the message) when a context length exceeds the model's ``max_position_embeddings``.

    Such a run is not refused, but its answers say nothing about compression (the model never saw those positions)
    and every answer is far slower than at the lengths the model knows.
    """
    model_config = getattr(model, "config", None)
    if model_config is not None and hasattr(model_config, "get_text_config"):
        model_config = model_config.get_text_config()
    limit = getattr(model_config, "max_position_embeddings", None)
    too_long = sorted(n for n in config.context_lengths if limit is not None and n > limit)
    if not too_long:
        return None
    from kvpress_phase.builtin import builtin_model_name, builtin_training_length

    name = builtin_model_name(model)
    length = builtin_training_length(name) if name else None
    trained = (f"the built-in model {name!r} was trained on sequences of up to {length} tokens"
               if length else "the model was not trained on positions past it")
    lengths = ", ".join(str(n) for n in too_long)
    message = (
        f"context length {lengths} exceeds the model's max_position_embeddings ({limit}), and {trained}: "
        "accuracy at such lengths says nothing about compression, and each answer takes much longer"
    )
    warnings.warn(message, UserWarning, stacklevel=2)
    return message
