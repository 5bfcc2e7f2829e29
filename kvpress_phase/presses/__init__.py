"""The presses of kvpress-phase: each in its own file, all subclasses of :class:`kvpress.BasePress`."""

from kvpress_phase.presses.base import LayerStats, WindowedPress
from kvpress_phase.presses.chunked_stride_press import ChunkedStridePress
from kvpress_phase.presses.per_layer import PerLayerWindowedPress
from kvpress_phase.presses.phase_aware_press import PhaseAwarePress

__all__ = ["ChunkedStridePress", "PhaseAwarePress", "PerLayerWindowedPress", "WindowedPress", "LayerStats"]
