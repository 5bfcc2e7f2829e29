"""One of two presses, picked by the compression ratio: :class:`ByRatioPress`, and :func:`recommended_press`, the
package's recommendation for a model that ships a learned scorer.

A wrapper (as kvpress's ``AdaKVPress(press)``): ``ByRatioPress(below, above, switch)`` is ``below`` at ratios under
``switch`` and ``above`` from it on. Setting its ``compression_ratio`` sets both presses' ratios, so it can be built
once and swept over ratios as kvpress's evaluation sweeps a press; whatever it is used as (kvpress's pipeline, a
``with press(model)`` block) it is the chosen press, which records the stats (``press.stats``,
:func:`~kvpress_phase.cache_summary`).

:func:`recommended_press` is the choice that the low-ratio round's pre-registered rule made on its dev split
(docs/preregistration-low-ratio.md, docs/results/low-ratio/): KeyDiff-scored :class:`PhaseAwarePress` below ratio
0.375, and from 0.375 on a budget over every layer and KV head spent by the two-layer MLP KVzip+ scorer
(``GlobalBudgetPress(PhaseAwarePress(ratio, scorer="kvzap_mlp"))``). The evaluation runs it as ``recommended``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from kvpress import BasePress

from kvpress_phase.core.phase import check_number
from kvpress_phase.presses.budget import GlobalBudgetPress
from kvpress_phase.presses.phase_aware_press import PhaseAwarePress

RECOMMENDED_SWITCH = 0.375
"""The ratio from which :func:`recommended_press` is its ``above`` press: the midpoint of the two dev ratios (0.25,
0.5) between which the dev round's pick changed (docs/preregistration-low-ratio.md, rule (d))."""


@dataclass
class ByRatioPress(BasePress):
    """``below`` at compression ratios under ``switch``, ``above`` from ``switch`` on.

    Parameters
    ----------
    below, above : kvpress.BasePress
        The two presses, at the same ``compression_ratio`` (any kvpress press that has one: ours, kvpress's scorer
        presses, a budget wrapper). The wrapper's ``compression_ratio`` is theirs, and setting it sets both.
    switch : float, default 0.375
        The ratio from which ``above`` is used, in ``(0, 1)``.
    """

    below: BasePress = None
    above: BasePress = None
    switch: float = RECOMMENDED_SWITCH

    def __post_init__(self):
        for name in ("below", "above"):
            press = getattr(self, name)
            if not isinstance(press, BasePress):
                raise ValueError(f"ByRatioPress: {name} must be a kvpress press, got {type(press).__name__}")
            if not hasattr(press, "compression_ratio"):
                raise ValueError(f"ByRatioPress: {name} ({type(press).__name__}) has no compression_ratio to pick by")
        check_number("switch", self.switch, 0, 1, integer=False)
        if not 0 < self.switch < 1:
            raise ValueError(f"switch must be in (0, 1), got {self.switch}")
        if self.below.compression_ratio != self.above.compression_ratio:
            raise ValueError(f"ByRatioPress: below and above must share one compression_ratio, got "
                             f"{self.below.compression_ratio} and {self.above.compression_ratio}; set the wrapper's "
                             "compression_ratio to set both")

    @property
    def compression_ratio(self) -> float:
        return self.below.compression_ratio

    @compression_ratio.setter
    def compression_ratio(self, value: float) -> None:
        self.below.compression_ratio = value
        self.above.compression_ratio = value

    @property
    def chosen(self) -> BasePress:
        """The press used at the current ratio."""
        return self.below if self.compression_ratio < self.switch else self.above

    @property
    def stats(self) -> dict:
        """The chosen press's records of the last prefill (``{}`` for a press that keeps none)."""
        return getattr(self.chosen, "stats", {})

    def post_init_from_model(self, model):
        self.chosen.post_init_from_model(model)

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        return self.chosen.compress(module, hidden_states, keys, values, attentions, kwargs)

    @contextlib.contextmanager
    def __call__(self, model):
        """kvpress's context manager: the chosen press's, so that a press that stores its own cache (the budget
        wrappers, ragged per KV head) does so through the pipeline."""
        with self.chosen(model):
            yield


def recommended_press(compression_ratio: float = 0.0, *, stride: int = 8, offset: int = 0) -> ByRatioPress:
    """The press the package recommends for a model that ships a learned scorer (SmolLM2-135M-Instruct and
    Qwen2.5-Coder-0.5B-Instruct: ``kvpress_phase/scorers/``; for another, ``kvpress-phase train-scorer``):
    ``PhaseAwarePress(ratio, stride)`` below ratio :data:`RECOMMENDED_SWITCH`, and
    ``GlobalBudgetPress(PhaseAwarePress(ratio, stride, scorer="kvzap_mlp"))`` from it on. ``stride`` and ``offset``
    are the windows' (every design here keeps ``ChunkedStridePress(ratio, stride)``'s number of entries)."""
    check_number("compression_ratio", compression_ratio, 0, 1, integer=False, open_high=True)
    return ByRatioPress(
        below=PhaseAwarePress(compression_ratio, stride=stride, offset=offset),
        above=GlobalBudgetPress(PhaseAwarePress(compression_ratio, stride=stride, offset=offset, scorer="kvzap_mlp")),
        switch=RECOMMENDED_SWITCH)
