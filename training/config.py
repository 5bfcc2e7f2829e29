"""The configuration of a compression-aware fine-tuning run (``kvpress-phase train``): :class:`FinetuneConfig`,
its validation, the named recipes, and the per-micro-batch press draws.

Every draw comes from a generator seeded by (seed, step, micro-batch), so the presses of a step are a pure function
of the configuration and the step (see :mod:`.finetune`).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Optional

DEFAULT_TASKS = {"niah_single": 1.0, "niah_multikey": 1.0, "niah_multiquery": 1.0, "niah_multivalue": 1.0}
"""Task mix of the fine-tuning data by default (the retrieval tasks of the phase study and their siblings)."""

RECIPES: dict[str, dict] = {
    "chunked": dict(
        model="builtin", press="chunked_stride:mode=pool", ratios=[0.25, 0.5, 0.625, 0.75, 0.875], strides=[4, 8, 16],
        offset_mode="random", uncompressed_fraction=0.1, tasks=dict(DEFAULT_TASKS),
        context_lengths=[512, 1024, 2048], steps=2400, batch_size=8, grad_accum=1, lr=3e-4, min_lr=3e-5,
        warmup=50, weight_decay=0.0, seed=0,
    ),
}
"""Named configurations (``--recipe``). ``chunked`` builds the trained-in built-in model; ``chunked-fixed`` is
its control, the same recipe on a fixed grid (offset 0). ``docs/preregistration-training.md`` fixes both."""
RECIPES["chunked-fixed"] = {**RECIPES["chunked"], "offset_mode": "fixed", "offset": 0}

OFFSET_MODES = ("fixed", "random")
DTYPES = ("auto", "float32", "bfloat16")


@dataclass
class FinetuneConfig:
    """Everything that determines a fine-tuning run (stored with its checkpoints and in its training log).

    Attributes
    ----------
    model : str or None
        A built-in model name (``"builtin"``, ``"chunked"``), a local directory or a hub id; None is the
        default built-in model.
    press : str
        Our press with optional settings, as ``kvpress-phase eval --presses`` takes them:
        ``chunked_stride`` or ``phase_aware``, e.g. ``chunked_stride:rope=center``. Its ratio, stride and
        offset are drawn per micro-batch; ``window`` is the stride.
    ratios : list of float
        Compression ratios drawn from (uniformly), each in [0, 1). Ignored when ``ratio_range`` is set.
    ratio_range : [low, high] or None
        Draw the ratio uniformly in ``[low, high]`` instead.
    strides : list of int
        Strides drawn from (uniformly).
    offset_mode : {"fixed", "random"}
        The grid offset: ``offset`` every time, or uniform in ``[0, stride)`` per micro-batch.
    offset : int
        The offset of ``offset_mode="fixed"``.
    curriculum_steps : int
        Over the first that many steps the largest ratio that may be drawn grows linearly from the smallest to
        the largest (0: no curriculum).
    uncompressed_fraction : float
        Share of micro-batches trained without compression.
    tasks : dict
        Task name -> weight of the generated data (names of ``kvpress-phase list``).
    dataset : str or None
        A dataset in kvpress's evaluation schema (``context``, ``question``, ``answer_prefix``, ``answer``;
        a ``save_to_disk`` folder or a ``.json``/``.jsonl``/``.parquet``/``.csv`` file). The training target
        is its ``completion`` column when there is one, else every reference of ``answer`` joined by ", ",
        which is correct under both of kvpress's scoring rules (all references, or any one).
    dataset_split : str
        Split of ``dataset`` to read.
    dataset_weight : float
        Weight of the dataset's rows in the example mix, beside the task weights.
    context_lengths : list of int
        Context lengths of the generated examples (one drawn per micro-batch).
    steps, batch_size, grad_accum : int
        Optimizer steps; examples per micro-batch; micro-batches per step.
    lr, min_lr, warmup, weight_decay, clip
        AdamW with linear warm-up to ``lr`` and cosine decay to ``min_lr``; weight decay on matrices only;
        gradient-norm clipping (0: none).
    seed : int
        Seeds the data, the press draws and the LoRA initialisation.
    dtype : {"auto", "float32", "bfloat16"}
        ``auto``: bfloat16 autocast on CUDA, float32 on the CPU.
    lora, lora_r, lora_alpha, lora_dropout, lora_targets
        Train LoRA adapters (``peft``) on the ``lora_targets`` linear layers instead of every weight.
    """

    model: Optional[str] = None
    press: str = "chunked_stride"
    ratios: list = field(default_factory=lambda: [0.5])
    ratio_range: Optional[list] = None
    strides: list = field(default_factory=lambda: [8])
    offset_mode: str = "random"
    offset: int = 0
    curriculum_steps: int = 0
    uncompressed_fraction: float = 0.0
    tasks: dict = field(default_factory=lambda: dict(DEFAULT_TASKS))
    dataset: Optional[str] = None
    dataset_split: str = "test"
    dataset_weight: float = 1.0
    context_lengths: list = field(default_factory=lambda: [512, 1024])
    steps: int = 1000
    batch_size: int = 8
    grad_accum: int = 1
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup: int = 50
    weight_decay: float = 0.0
    clip: float = 1.0
    seed: int = 0
    dtype: str = "auto"
    lora: bool = False
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_targets: list = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])

    def __post_init__(self):
        self.validate()

    # -------------------------------------------------------------------------------- validation
    def validate(self) -> None:
        """ValueError naming the first invalid setting (checks that need no model or tokenizer). The checks that
        need neither torch nor kvpress come first, so that ``train`` refuses those before it imports either; the
        press spec is parsed, and the press built at every stride and both ends of the ratios, last."""
        from kvpress_phase.evaluation.presses import TRAINABLE_PRESSES, parse_press_spec
        from kvpress_phase.evaluation.tasks import get_task

        keys = {item.partition("=")[0].strip() for item in str(self.press).split(":")[1:]}
        for key in ("compression_ratio", "stride", "offset", "window"):
            if key in keys:
                raise ValueError(f"press setting {key!r} is set by the trainer (ratios, strides, offset-mode), "
                                 f"not in --press")
        if str(self.press).strip().split(":")[0] not in TRAINABLE_PRESSES:  # before parsing, which lists every press
            raise ValueError(f"press must be one of {', '.join(TRAINABLE_PRESSES)} (optionally with :key=value "
                             f"settings), got {self.press!r}")
        if self.ratio_range is not None:
            if len(self.ratio_range) != 2 or not 0 <= self.ratio_range[0] <= self.ratio_range[1] < 1:
                raise ValueError(f"ratio_range must be [low, high] with 0 <= low <= high < 1, got {self.ratio_range}")
        elif not self.ratios or any(isinstance(r, bool) or not 0 <= r < 1 for r in self.ratios):
            raise ValueError(f"ratios must be a non-empty list of numbers in [0, 1), got {self.ratios}")
        if not self.strides or any(not _is_int(s) or s < 1 for s in self.strides):
            raise ValueError(f"strides must be a non-empty list of integers >= 1, got {self.strides}")
        if self.offset_mode not in OFFSET_MODES:
            raise ValueError(f"offset_mode must be one of {OFFSET_MODES}, got {self.offset_mode!r}")
        if not _is_int(self.offset) or self.offset < 0:
            raise ValueError(f"offset must be an integer >= 0, got {self.offset!r}")
        for name in ("steps", "batch_size", "grad_accum"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not _is_int(self.curriculum_steps) or not 0 <= self.curriculum_steps <= self.steps:
            raise ValueError(f"curriculum_steps must be an integer in [0, steps={self.steps}], "
                             f"got {self.curriculum_steps!r}")
        if not 0 <= self.uncompressed_fraction <= 1:
            raise ValueError(f"uncompressed_fraction must be in [0, 1], got {self.uncompressed_fraction}")
        for task, weight in self.tasks.items():
            get_task(task)
            if not weight >= 0:
                raise ValueError(f"task weights must be >= 0, got {task}={weight}")
        if self.dataset is None and not sum(self.tasks.values()) > 0:
            raise ValueError("no training data: give tasks with a positive weight or a dataset")
        if self.dataset is not None and not self.dataset_weight >= 0:
            raise ValueError(f"dataset_weight must be >= 0, got {self.dataset_weight}")
        if self.dataset is not None and not (sum(self.tasks.values()) + self.dataset_weight) > 0:
            raise ValueError("no training data: the task weights and dataset_weight are all 0")
        if sum(self.tasks.values()) > 0 and (not self.context_lengths or
                                            any(not _is_int(n) or n < 64 for n in self.context_lengths)):
            raise ValueError(f"context_lengths must be a non-empty list of integers >= 64, got {self.context_lengths}")
        if not self.lr > 0 or not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"need lr > 0 and 0 <= min_lr <= lr, got lr={self.lr}, min_lr={self.min_lr}")
        if not _is_int(self.warmup) or self.warmup < 0:
            raise ValueError(f"warmup must be an integer >= 0, got {self.warmup!r}")
        if self.weight_decay < 0 or self.clip < 0:
            raise ValueError(f"weight_decay and clip must be >= 0, got {self.weight_decay} and {self.clip}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.lora and (not _is_int(self.lora_r) or self.lora_r < 1 or not self.lora_alpha > 0
                          or not 0 <= self.lora_dropout < 1 or not self.lora_targets):
            raise ValueError(f"LoRA needs lora_r >= 1, lora_alpha > 0, 0 <= lora_dropout < 1 and target modules; got "
                             f"r={self.lora_r}, alpha={self.lora_alpha}, dropout={self.lora_dropout}, "
                             f"targets={self.lora_targets}")
        spec = parse_press_spec(self.press)
        if dict(spec.options).get("backend") == "triton":
            raise ValueError("press backend 'triton' has no backward pass; training uses backend=torch")
        for stride in self.strides:  # the press accepts every stride and both ends of the ratio range
            for ratio in self._ratio_bounds():
                self.build_press(ratio, stride, self.offset % stride)

    def _ratio_bounds(self) -> list[float]:
        return list(self.ratio_range) if self.ratio_range is not None else [min(self.ratios), max(self.ratios)]

    # -------------------------------------------------------------------------------- draws
    def build_press(self, ratio: float, stride: int, offset: int):
        """The press of one micro-batch (its kernels forced to the differentiable PyTorch backend)."""
        from kvpress_phase.evaluation.presses import PressSpec, build_press, parse_press_spec

        spec = parse_press_spec(self.press)
        options = dict(spec.options)
        options.setdefault("backend", "torch")
        return build_press(PressSpec(spec.name, tuple(options.items())), ratio, stride, None, offset)

    def ratio_cap(self, step: int) -> float:
        """The largest ratio that may be drawn at ``step`` (the curriculum's; the largest ratio without one)."""
        low, high = self._ratio_bounds()
        if self.curriculum_steps == 0:
            return high
        return low + (high - low) * min(1.0, (step + 1) / self.curriculum_steps)

    def draw_press(self, step: int, micro: int) -> dict:
        """``{"ratio", "stride", "offset"}`` of a micro-batch (ratio 0.0 when it trains uncompressed)."""
        rng = random.Random(f"{self.seed}/press/{step}/{micro}")
        stride = rng.choice(self.strides)
        # drawn in both modes, so that a fixed-grid run and a random-offset run with the same seed see the same
        # data, ratios, strides and uncompressed batches and differ in the offset alone
        random_offset = rng.randrange(stride)
        offset = random_offset if self.offset_mode == "random" else self.offset
        cap = self.ratio_cap(step)
        if self.ratio_range is not None:
            ratio = rng.uniform(self.ratio_range[0], cap)
        else:
            ratio = rng.choice([r for r in self.ratios if r <= cap + 1e-12])
        if rng.random() < self.uncompressed_fraction:
            ratio = 0.0
        return {"ratio": float(ratio), "stride": stride, "offset": offset}

    def checkpoint_record(self) -> dict:
        return asdict(self)


def check_run_settings(checkpoint_every: int, max_minutes: Optional[float]) -> None:
    """ValueError unless ``checkpoint_every`` (steps between checkpoints) is >= 1 and ``max_minutes`` is None or
    > 0: the settings of a training call that are not part of its configuration."""
    if checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
    if max_minutes is not None and not max_minutes > 0:
        raise ValueError(f"max_minutes must be > 0, got {max_minutes}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


__all__ = ["FinetuneConfig", "RECIPES", "DEFAULT_TASKS", "OFFSET_MODES", "DTYPES", "check_run_settings"]
