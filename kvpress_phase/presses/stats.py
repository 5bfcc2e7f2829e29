"""What a press records about each layer it compressed (``press.stats``).

Its own module so that both the compress step (:mod:`.base`) and the decoding step (:mod:`.decoding`) can build
records without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kvpress_phase.core.phase import WindowLayout


@dataclass
class LayerStats:
    """What a press did to one layer's cache during the last prefill."""

    seq_len: int
    compressed_length: int
    achieved_ratio: float
    layout: Optional[WindowLayout]
    positions: Optional[torch.Tensor]
    """``(batch, heads, compressed_length)`` int32: source position of each kept entry (first position of its
    group for a pooled entry); ``None`` when the layer passed through unchanged."""
    ends: Optional[torch.Tensor] = None
    """``(batch, heads, compressed_length)`` int32: one past the last source position each entry covers (the
    group end for a pooled entry, ``position + 1`` for a raw or selected token)."""
    requested_ratio: Optional[float] = None
    """The press's ``compression_ratio``."""
    window_ratio: Optional[float] = None
    """The per-window ratio achieved, ``1 - k / stride`` (see :func:`kvpress_phase.core.phase.kept_per_window`);
    ``achieved_ratio`` is over the whole cache, protected tokens included."""
    masked: Optional[tuple] = None
    """``(head_indices, seq_indices)`` of the stored entries that only pad a head with a smaller budget than the
    layer's longest (``PhaseAwarePress(allocate="heads")``), masked while decoding; ``None`` when there are none.
    ``compressed_length`` counts them (they are stored); ``achieved_ratio`` does not (they are not attended)."""

    @property
    def phases(self) -> Optional[torch.Tensor]:
        """Phase of every kept entry under its row's grid (``None`` when the layer was not compressed)."""
        if self.layout is None or self.positions is None:
            return None
        return self.layout.phases(self.positions.long())
