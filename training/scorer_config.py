"""The settings of ``kvpress-phase train-scorer`` (:mod:`.scorer`), importable without torch (the command's
parser reads its defaults)."""

from __future__ import annotations

from dataclasses import dataclass

TARGET_EPSILON = 1e-8
"""KVzip+ scores are clamped at this value before the log (a score of exactly 0 carries no ranking information)."""

EVAL_TASKS = ("niah_single", "niah_multikey")
"""The evaluation generators whose contexts the Spearman correlation is measured on, alternately."""

ARCHS = ("linear", "mlp")


@dataclass
class ScorerSettings:
    """What a scorer run does. Defaults are sized for SmolLM2-135M on 2 CPU cores (see the command's help)."""

    model: str
    arch: str = "both"
    train_passages: int = 64
    validation_passages: int = 10
    test_passages: int = 10
    passage_tokens: int = 700
    positions: int = 512
    eval_prompts: int = 4
    eval_length: int = 1024
    eval_seed: int = 0
    epochs: int = 30
    patience: int = 3
    lr: float = 1e-3
    batch_size: int = 256
    seed: int = 0

    @property
    def archs(self) -> tuple:
        return ARCHS if self.arch == "both" else (self.arch,)

    def check(self) -> None:
        if self.arch not in ARCHS + ("both",):
            raise ValueError(f"arch must be linear, mlp or both, got {self.arch!r}")
        for name in ("train_passages", "validation_passages", "test_passages", "positions", "epochs", "patience",
                     "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.passage_tokens < 16 or self.eval_length < 16:
            raise ValueError("passage-tokens and eval-length must be >= 16")
        if self.eval_prompts < 0:
            raise ValueError(f"eval-prompts must be >= 0, got {self.eval_prompts}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
