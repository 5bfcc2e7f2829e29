"""The presses of kvpress-phase: each in its own file, all kvpress presses (:class:`kvpress.BasePress`).

- :class:`ChunkedStridePress` (chunked_stride_press.py): fixed windows every ``stride`` tokens, ``k`` entries each;
- :class:`PhaseAwarePress` (phase_aware_press.py): the same cache length, the row's best tokens;
- :class:`HeadBudgetPress`, :class:`LayerBudgetPress`, :class:`GlobalBudgetPress` (budget.py): wrappers that spread the
  budget of a ``PhaseAwarePress`` or of any kvpress ``ScorerPress`` by score across KV heads, layers, or both;  how a compressed layer
  is stored (dense, or ragged when its KV heads keep different numbers) in storage.py;
- :class:`PerLayerWindowedPress` (per_layer.py): a ratio per layer for any of them;
- :class:`WindowedDecodingPress` (decoding.py): any of them while generating too.

The studies' ablations are in ``ablations/``: :class:`StaggeredWindowPress` (fixed per-window budgets on moving
grids), exported here and as ``kvpress_phase.StaggeredWindowPress``, and :class:`ThresholdBudgetPress` (retired: a
budget decided layer by layer by a calibrated threshold).

What they share (parameters, the compress step's frame) is in base.py; token choice by score in choice.py; scorers
beyond kvpress's in scorers.py; what a press records (``press.stats``, :func:`cache_summary`) in stats.py; the
per-head budgets' layers stored ragged (:mod:`kvpress_phase.ragged`) or dense, and the attention a cache that plain
SDPA cannot read is decoded with, in storage.py. Nothing is patched when the package is imported.
"""

from kvpress_phase.presses.ablations import StaggeredWindowPress
from kvpress_phase.presses.base import WindowedPress
from kvpress_phase.presses.budget import GlobalBudgetPress, HeadBudgetPress, LayerBudgetPress
from kvpress_phase.presses.chunked_stride_press import ChunkedStridePress
from kvpress_phase.presses.decoding import WindowedDecodingPress
from kvpress_phase.presses.per_layer import PerLayerWindowedPress
from kvpress_phase.presses.phase_aware_press import PhaseAwarePress
from kvpress_phase.presses.stats import CacheSummary, LayerStats, cache_summary

__all__ = ["ChunkedStridePress", "PhaseAwarePress", "PerLayerWindowedPress", "WindowedDecodingPress", "WindowedPress",
           "LayerStats", "CacheSummary", "cache_summary", "HeadBudgetPress", "LayerBudgetPress", "GlobalBudgetPress",
           "StaggeredWindowPress"]
