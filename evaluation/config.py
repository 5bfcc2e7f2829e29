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
from .tasks import PROTOCOLS, TASKS, check_context_length, generate, get_task

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
    task_revisions: dict = field(default_factory=dict)
    """Task -> the revision of its definition the run uses (:attr:`~.tasks.TaskSpec.revision`); a task left out is at
    today's. Filled in for every task on creation, so that ``config.json`` records it; a run saved before tasks had
    revisions used revision 1 of each (:func:`from_saved`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.task_revisions, dict):
            raise ValueError(f"task_revisions must be a dict of task name -> revision, got {self.task_revisions!r}")
        known = {t: get_task(t).revision for t in self.tasks if isinstance(t, str) and t in TASKS}
        self.task_revisions = {t: self.task_revisions.get(t, today) for t, today in known.items()}

    def validate(self) -> None:
        """ValueError naming the first setting that is wrong. The checks that need neither torch nor kvpress come
        first (the task names, the lists and numbers and how they fit together), so that ``eval`` refuses those
        before it imports either; then the press specs are parsed (each press is built once, which imports
        kvpress) and checked with the strides and ratios."""
        for name in self.tasks:
            get_task(name).at(self.task_revisions.get(name))
        if not self.tasks or not self.presses:
            raise ValueError("tasks and presses must not be empty")
        self._check_listed_once([(flag, item, getattr(self, field) or []) for flag, item, field in LISTED_ONCE])
        for r in self.compression_ratios:
            if not 0 <= r < 1:
                raise ValueError(f"compression ratio must be in [0, 1), got {r}")
        for s in self.strides:
            if s < 1:
                raise ValueError(f"stride must be >= 1, got {s}")
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
        labels = [parse_press_spec(spec).label for spec in self.presses]
        self._check_listed_once([("--presses", "press", labels)])
        positive = [r for r in self.compression_ratios if r > 0]
        if 1 in self.strides and positive and labels != ["no_press"]:
            raise ValueError(f"stride 1 cannot run compression ratio {positive[0]:g}: a stride of 1 makes "
                             "one-token windows and each keeps its token, so nothing would be compressed; use "
                             "strides of 2 or more")
        if not self.allow_duplicate_k:
            duplicate = duplicate_k(self.compression_ratios, self.strides)
            if duplicate:
                raise ValueError(duplicate + "; drop one, or allow it explicitly (--allow-duplicate-k)")
        from .presses import build_press

        for stride in self.strides:  # every press as the run builds it (its stride and window), not mid-run
            for spec, ratio, window in variants(self, stride):
                try:
                    build_press(spec, ratio, stride, window, 0)
                except ValueError as exc:
                    at = f"stride {stride}" + (f", window {window}" if window is not None else "")
                    raise ValueError(f"press {spec.label!r} at {at}: {exc}") from None

    @staticmethod
    def _check_listed_once(listed: list) -> None:
        """ValueError when one of the lists ``(flag, what one item is, values)`` holds an item twice."""
        for flag, item, values in listed:
            for i, value in enumerate(values):
                if value in values[:i]:
                    raise ValueError(f"{flag} lists {value!r} twice: give each {item} once")

    def fingerprint(self) -> str:
        values = dataclasses.asdict(self)
        for name, default in _LATER_FIELDS.items():  # fields added later: at their defaults, old runs resume
            if values.get(name) == default:
                values.pop(name)
        revised = revised_tasks(values.pop("task_revisions"))  # revision 1 of every task: runs made before revisions
        if revised:
            values["task_revisions"] = revised
        return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]

    def resumes(self, fingerprint: Optional[str]) -> bool:
        """Whether results saved under ``fingerprint`` are this configuration's: its own fingerprint, or, on the
        default model, that of a run saved before the command recorded the default model's name (model null)."""
        from kvpress_phase.builtin import DEFAULT_MODEL

        if fingerprint == self.fingerprint():
            return True
        return self.model == DEFAULT_MODEL and fingerprint == dataclasses.replace(self, model=None).fingerprint()


LISTED_ONCE = [("--tasks", "task", "tasks"), ("--compression-ratios", "compression ratio", "compression_ratios"),
               ("--strides", "stride", "strides"), ("--windows", "window", "windows"),
               ("--phases", "phase", "phases"), ("--context-lengths", "context length", "context_lengths")]
"""The list flags (flag, what one item is, the :class:`EvalConfig` field) whose items must differ: an item listed
twice would run the same cells twice under one name."""

_LATER_FIELDS = {"compress_question": False, "allow_duplicate_k": False, "decode_batch": 16, "step_by_step": False}


FLAGS = {"model": "--model", "tasks": "--tasks", "presses": "--presses", "compression_ratios": "--compression-ratios",
         "strides": "--strides", "windows": "--windows", "phases": "--phases", "protocol": "--protocol",
         "context_lengths": "--context-lengths", "samples": "--samples", "seed": "--seed", "dtype": "--dtype",
         "diagnostics": "--no-diagnostics", "matched_cache": "--matched-cache", "compress_question": "--query-aware",
         "allow_duplicate_k": "--allow-duplicate-k", "decode_batch": "--decode-batch",
         "step_by_step": "--step-by-step"}
"""The ``kvpress-phase eval`` flag of each :class:`EvalConfig` field (``diagnostics`` is off with its flag)."""


def as_flags(name: str, value) -> str:
    """The field ``name`` at ``value`` as the ``eval`` flags that give it: ``--seed 1``, ``--strides 4,8``,
    ``--query-aware``, ``no --query-aware``, ``no --windows``."""
    flag = FLAGS.get(name, name)
    if name == "task_revisions":  # no flag: a run takes today's definitions
        return "tasks as first defined" if not value else ", ".join(f"{t} at revision {r}" for t, r in value.items())
    if isinstance(value, bool):
        return flag if value != (name == "diagnostics") else f"no {flag}"
    if value is None:
        return f"no {flag}"
    if isinstance(value, (list, tuple)):
        return f"{flag} {','.join(f'{v:g}' if isinstance(v, float) else str(v) for v in value)}"
    return f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}"


def from_saved(saved: dict) -> EvalConfig:
    """The :class:`EvalConfig` of a configuration a run saved (``config.json``'s ``"config"``), keys that are not
    fields (written by other versions) left out; TypeError or ValueError when it is not one."""
    names = {f.name for f in dataclasses.fields(EvalConfig)}
    fields = {k: v for k, v in saved.items() if k in names}
    if "task_revisions" not in fields:  # saved before tasks had revisions: every task as first defined
        fields["task_revisions"] = {t: 1 for t in fields.get("tasks", [])}
    return EvalConfig(**fields)


def revised_tasks(revisions: Optional[dict]) -> dict:
    """The tasks of ``revisions`` (task -> revision) past their first revision, sorted: what a run's fingerprint and
    its comparison with another configuration look at (a task at revision 1 is as every run before revisions had
    it)."""
    return {t: r for t, r in sorted((revisions or {}).items()) if r != 1}


def config_differences(saved: dict, config: EvalConfig) -> list[tuple[str, str, str]]:
    """``(field, saved, current)`` for each field where the configuration ``saved`` with a run (``config.json``'s
    ``"config"``) differs from ``config``, both values written as flags (:func:`as_flags`). A field the saved run
    predates is at its default there; the default model's name matches a run saved without one
    (:meth:`EvalConfig.resumes`)."""
    from kvpress_phase.builtin import DEFAULT_MODEL

    out = []
    for name, value in dataclasses.asdict(config).items():
        old = saved.get(name, _LATER_FIELDS.get(name))
        if name == "model" and old is None and value == DEFAULT_MODEL:
            continue
        if name == "task_revisions":
            old, value = revised_tasks(old), revised_tasks(value)
        if old != value:
            out.append((name, as_flags(name, old), as_flags(name, value)))
    return out


def duplicate_k(ratios, strides) -> Optional[str]:
    """A message when two of ``ratios`` keep the same number of entries per window at one of ``strides`` (the sweep
    would run one configuration twice under two names), else None."""
    from kvpress_phase.core.phase import kept_per_window

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
                              stride=stride, phases=phases, protocol=config.protocol, seed=config.seed,
                              revision=config.task_revisions.get(task))
                by_sample: dict[int, list] = {}
                for row in ds:
                    by_sample.setdefault(row["sample_id"], []).append(row)
                units += [WorkUnit(task, context_length, stride, sid, rows) for sid, rows in sorted(by_sample.items())]
    return units


def planned_answers(config: EvalConfig) -> int:
    """How many answers a complete run of ``config`` holds (all ranks together): every task x context length x
    stride, ``samples`` x phases rows (:func:`plan_units`), each answered by every variant of its stride
    (:func:`variants`). Counted without a tokenizer, and from the registry's entries without building a press (so
    without importing kvpress); KeyError for a press the registry does not hold."""
    from .presses import REGISTRY, _parse_value

    total = 0
    for stride in config.strides:
        phases = config.phases if config.phases is not None else range(stride)
        n_variants = 0
        for text in config.presses:  # as variants() counts them
            name, *settings = text.strip().split(":")
            if name == "no_press":
                n_variants += 1
                continue
            options = {k: _parse_value(v) for k, _, v in (item.partition("=") for item in settings)}
            n_variants += len(config.compression_ratios) * len(windows_at(config, REGISTRY[name], options, stride))
        total += config.samples * len(phases) * n_variants
    return total * len(config.tasks) * len(config.context_lengths)


def windows_at(config: EvalConfig, entry, options: dict, stride: int) -> list[Optional[int]]:
    """The windows a press of registry ``entry`` with ``options`` runs at on ``stride``: None (its own) for a press
    without a grid or a run without ``--windows``; else each ``--windows`` W >= ``stride``, where a press that takes
    no windows longer than its stride (:attr:`~.press_registry.PressEntry.overlapping_windows`) runs at W = S in
    place of every W > S (once). ``--strides 4,8 --windows 8`` thus runs pooled windows of 8 every 4 tokens beside
    ``PhaseAwarePress`` and ``ChunkedStridePress``'s selection at S = 4, and every press at W = S = 8."""
    if not (config.windows and entry.grid_offset):
        return [None]
    takes_longer = entry.overlapping_windows is not None and entry.overlapping_windows(options)
    out = []
    for window in config.windows:
        if window < stride:
            continue
        window = window if (window == stride or takes_longer) else stride
        if window not in out:
            out.append(window)
    return out


def variants(config: EvalConfig, stride: int) -> list[tuple[PressSpec, float, Optional[int]]]:
    out = []
    for text in config.presses:
        spec = parse_press_spec(text)
        if spec.name == "no_press":
            out.append((spec, 0.0, None))
            continue
        windows = windows_at(config, spec.entry, dict(spec.options), stride)
        for ratio in config.compression_ratios:
            for window in windows:
                out.append((spec, float(ratio), window))
    return out


class ContextLengthWarning(UserWarning):
    """A context length past the positions the model was trained on: it runs (rotary positions extrapolate), but
    its accuracy says little about compression."""


def check_model(config: EvalConfig, model, tokenizer) -> Optional[str]:
    """Refuse (ValueError, one line) what the phase evaluation cannot run on ``model``, before anything runs: a model
    whose attention layers kvpress cannot hook (:func:`kvpress_phase.presses.base.unsupported_model`, the message
    the presses give), and a context length over the tokenizer's ``model_max_length``, where kvpress's pipeline
    would cut the prefill (:func:`.prompting.context_limit`). Then warn as :func:`check_context_lengths` does (and
    return its message)."""
    from kvpress_phase.presses.base import unsupported_model

    from .prompting import context_limit

    problem = unsupported_model(model, "the phase evaluation")
    if problem:
        raise ValueError(problem)
    limit = context_limit(tokenizer)
    too_long = sorted({n for n in config.context_lengths if limit is not None and n > limit})
    if too_long:
        name = f"--model {config.model!r}" if config.model else "the model"
        raise ValueError(
            f"context length {', '.join(map(str, too_long))} exceeds the {limit} tokens {name} takes (its tokenizer's "
            f"model_max_length): kvpress's pipeline would cut the prefill there, and the needle with it; use "
            f"context lengths up to {limit}"
        )
    return check_context_lengths(config, model)


def check_context_lengths(config: EvalConfig, model) -> Optional[str]:
    """Warn (:class:`ContextLengthWarning`, and return the message) when a context length exceeds the positions the
    model knows: its ``max_position_embeddings``, or for a built-in model the longest sequence it was trained on
    (:func:`~kvpress_phase.builtin.builtin_training_length`) when that is shorter.

    Such a run is not refused (rotary positions extrapolate; the hard limit, the tokenizer's ``model_max_length``, is
    :func:`check_model`'s), but its answers say little about compression, and past ``max_position_embeddings`` every
    answer is far slower than at the lengths the model knows.
    """
    model_config = getattr(model, "config", None)
    if model_config is not None and hasattr(model_config, "get_text_config"):
        model_config = model_config.get_text_config()
    limit = getattr(model_config, "max_position_embeddings", None)
    from kvpress_phase.builtin import builtin_model_name, builtin_training_length

    name = builtin_model_name(model)
    trained = builtin_training_length(name) if name else None
    known = min((n for n in (limit, trained) if n is not None), default=None)
    too_long = sorted({n for n in config.context_lengths if known is not None and n > known})
    if not too_long:
        return None
    lengths = ", ".join(str(n) for n in too_long)
    past_positions = limit is not None and too_long[-1] > limit
    if trained is None:
        message = (f"context length {lengths} exceeds the model's max_position_embeddings ({limit}), and the model "
                   "was not trained on positions past it: accuracy at such lengths says nothing about compression, "
                   "and each answer takes much longer")
    else:
        message = (f"context length {lengths} exceeds the {trained} tokens the built-in model {name!r} was trained on"
                   + (f" and its max_position_embeddings ({limit})" if past_positions else "")
                   + ": its rotary positions extrapolate there, but accuracy at such lengths says little about "
                   "compression" + (", and each answer takes much longer" if past_positions else ""))
    warnings.warn(message, ContextLengthWarning, stacklevel=2)
    return message
