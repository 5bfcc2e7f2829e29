"""The studies' ablations: presses kept so that the comparisons of the results can be run again, not presses to
reach for (the package recommends :class:`~kvpress_phase.PhaseAwarePress`, alone or in a budget wrapper).

- :class:`StaggeredWindowPress` (staggered_window_press.py): ``ChunkedStridePress``'s fixed budget per window, on
  grids staggered per head or layer, aligned to the scores or overlapping (``staggered_window`` in press specs;
  ``docs/results/builtin-models.md`` sections 3-4, ``docs/results/r1-real-test.md``).

- :class:`ThresholdBudgetPress` (threshold_budget_press.py): a budget over layers and KV heads decided layer by layer
  by a calibrated score threshold, retired once the global budget was spent during the prefill
  (``threshold_budget`` in press specs; ``docs/results/threshold-budget.md``).

``StaggeredWindowPress`` is exported as ``kvpress_phase.StaggeredWindowPress`` as well.
"""

from kvpress_phase.presses.ablations.staggered_window_press import StaggeredWindowPress
from kvpress_phase.presses.ablations.threshold_budget_press import ThresholdBudgetPress

__all__ = ["StaggeredWindowPress", "ThresholdBudgetPress"]
