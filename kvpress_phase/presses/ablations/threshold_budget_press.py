"""ThresholdBudgetPress: a budget over layers and KV heads decided layer by layer by one calibrated score threshold.

Retired to the studies' ablations: it was kept for a prefill that never holds every layer (the exact global budget
then held every layer's hidden states and cache until the end); since :class:`~kvpress_phase.GlobalBudgetPress` spends
its budget while the prefill runs, the threshold has no measured advantage left and keeps more than its budget
(1.27x ``ChunkedStridePress``'s bytes at 4,096 tokens on SmolLM2, ratio 0.5: ``docs/benchmarks.md``, "The presses'
memory as users run them"). Its study: ``docs/results/threshold-budget.md`` and the ratio-regimes round (RESULTS.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Optional

import torch

from kvpress_phase.core.phase import WindowLayout
from kvpress_phase.presses.budget import BudgetPress
from kvpress_phase.presses.learned_scorer import LocalKVzapPress, ScoreQuantiles


@dataclass
class ThresholdBudgetPress(BudgetPress):
    """The budget over the model decided layer by layer: every KV head of every layer keeps the window tokens whose
    score exceeds one threshold, compressed as soon as its layer is computed, each head at its own length (stored
    ragged, as :class:`~kvpress_phase.GlobalBudgetPress`). Retired (module docstring).

    The threshold is the score that the press's share of window tokens kept (``k / window``) exceeds on the
    scorer's calibration text (:class:`~kvpress_phase.presses.learned_scorer.ScoreQuantiles`, the
    ``thresholds.json`` that ``kvpress-phase calibrate-scorer`` writes beside the scorer): on text like it, the
    model keeps about the budget that :class:`GlobalBudgetPress` spends exactly, and the same entries where the
    scores rank alike; on other text the share kept follows the scores (the press's ``stats`` record it). This is
    how kvpress's ``DMSPress`` uses KVzap's scores, applied to :class:`~kvpress_phase.PhaseAwarePress`'s windows.
    It needs scores on one scale for every layer: the learned ``scorer="kvzap"``.

    Parameters
    ----------
    threshold : float, optional
        The score threshold itself; by default it is read from the scorer's calibration (``scorer="kvzap"``).
    floor : float, default 0.0
        Every KV head keeps at least its ``floor`` share of the even budget (its best tokens).
    """

    threshold: Optional[float] = None
    _quantiles: object = field(default=None, init=False, repr=False, compare=False)

    per_head: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        if self.threshold is not None:
            if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) \
                    or not math.isfinite(self.threshold):
                raise ValueError(f"threshold must be a finite number or None, got {self.threshold!r}")
        elif not isinstance(self.press.scorer, LocalKVzapPress):
            raise ValueError("ThresholdBudgetPress without threshold= reads the learned scorer's calibration: the "
                             "press needs scorer='kvzap' (PhaseAwarePress(ratio, scorer='kvzap')), got "
                             f"{type(self.press.scorer).__name__}; or give threshold=")

    def post_init_from_model(self, model):
        super().post_init_from_model(model)
        if self.threshold is None:
            self._quantiles = ScoreQuantiles.load(self.press.scorer.kvzap_model_name)

    def layer_threshold(self, layout: WindowLayout) -> float:
        """The threshold for a layer laid out as ``layout``: :attr:`threshold`, or the calibrated score that the
        share ``k / window`` of the calibration scores exceeds."""
        if self.threshold is not None:
            return float(self.threshold)
        if self._quantiles is None:
            raise ValueError("ThresholdBudgetPress reads its scorer's calibration in post_init_from_model(model): use "
                             "the press as a context manager (`with press(model): ...`) or through kvpress's pipeline")
        return self._quantiles.threshold(layout.k / layout.window)

    def row_counts(self, scores: torch.Tensor, cand) -> torch.Tensor:
        """Each KV head's window tokens scoring above the threshold (at least its floor): ``(heads,)`` for one batch
        row's ``(heads, n)`` scores."""
        win = scores.float().gather(1, cand.positions)  # (heads, window tokens)
        counts = (win > self.layer_threshold(cand.layout)).sum(dim=-1)
        return counts.clamp(min=min(int(self.floor * cand.budget), win.shape[-1]))
