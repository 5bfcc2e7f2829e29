"""CalibratedDMSPress: kvpress's ``DMSPress`` around the local KVzap scorer, its threshold set from the scorer's
calibration (the evaluation's ``dms_kvzap`` baseline)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from kvpress import DMSPress
from kvpress.presses.kvzap_press import KVzapPress

from kvpress_phase.presses.learned_scorer import LocalKVzapPress, ScoreQuantiles


@dataclass
class CalibratedDMSPress(DMSPress):
    """kvpress's ``DMSPress`` around the KVzap scorer (:class:`LocalKVzapPress`), as kvpress pairs them, with its
    threshold set from the scorer's calibration (:class:`ScoreQuantiles`) for a share of entries to remove:
    a context of ``n`` tokens keeps its last ``sliding_window_size`` tokens and, of the others, the share
    ``((1 - target_ratio) * n - sliding_window_size) / (n - sliding_window_size)`` that scores above the threshold
    on the scorer's calibration text, so about ``(1 - target_ratio) * n`` entries per KV head on such text (what
    each layer and head keeps follows the scores; ``compression_ratio`` is the achieved one after a prefill). The
    evicted entries are masked, as ``DMSPress`` masks them. Prefill only (``decoding=False``).

    :meth:`compress` evicts exactly as ``DMSPress``'s hook does in a prefill, for a caller that compresses a layer
    directly (the evaluation's replay engine)."""

    press: Optional[KVzapPress] = None
    target_ratio: float = 0.0

    def __post_init__(self):
        if self.press is None:
            self.press = LocalKVzapPress()
        if not isinstance(self.press, LocalKVzapPress):
            raise ValueError(f"CalibratedDMSPress reads the KVzap scorer's calibration: press must be a "
                             f"LocalKVzapPress, got {type(self.press).__name__}")
        if isinstance(self.target_ratio, bool) or not isinstance(self.target_ratio, (int, float)) \
                or not 0 <= self.target_ratio < 1:
            raise ValueError(f"target_ratio must be in [0, 1), got {self.target_ratio!r}")
        if isinstance(self.sliding_window_size, bool) or not isinstance(self.sliding_window_size, int) \
                or self.sliding_window_size < 0:
            raise ValueError(f"sliding_window_size must be an int >= 0, got {self.sliding_window_size!r}")
        if self.decoding:
            raise ValueError("CalibratedDMSPress compresses the prefill only (decoding=False)")
        self._quantiles = None

    def post_init_from_model(self, model):
        super().post_init_from_model(model)
        self._quantiles = ScoreQuantiles.load(self.press.kvzap_model_name)

    @property
    def compression_ratio(self) -> float:
        """The share of entries the last prefill masked (every layer and head), or the target before any."""
        return sum(self.compression_ratios.values()) / len(self.compression_ratios) if self.compression_ratios \
            else self.target_ratio

    @compression_ratio.setter
    def compression_ratio(self, value: float) -> None:
        self.target_ratio = value

    def threshold_for(self, n: int) -> float:
        """The threshold for a context of ``n`` tokens (class docstring)."""
        if self._quantiles is None:
            raise ValueError("CalibratedDMSPress reads its scorer's calibration in post_init_from_model(model): use "
                             "the press as a context manager or through kvpress's pipeline")
        w = self.sliding_window_size
        if self.target_ratio == 0 or n <= w:
            return -math.inf
        keep = ((1 - self.target_ratio) * n - w) / (n - w)
        return math.inf if keep <= 0 else self._quantiles.threshold(min(keep, 1.0))

    def forward_hook(self, module, input, kwargs, output):
        if kwargs["hidden_states"].shape[1] > 1:  # a prefill: the context's length sets the threshold
            self.threshold = self.threshold_for(int(kwargs["cache_position"][-1]) + 1)
        return super().forward_hook(module, input, kwargs, output)

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        """Mask what ``DMSPress``'s hook masks in a prefill of ``keys`` (the layer's whole context); keys and values
        are returned as they are."""
        n, w = keys.shape[2], self.sliding_window_size
        layer_idx = module.layer_idx
        if layer_idx == 0:
            self.compression_ratios.clear()
        self.threshold = self.threshold_for(n)
        module.masked_key_indices = None
        if n > w:
            scores = self.press.score(module, hidden_states, keys, values, attentions, kwargs)[..., : n - w]
            found = list(torch.where(scores < self.threshold))
            if len(found[0]):
                module.masked_key_indices = found
        masked = 0 if module.masked_key_indices is None else len(module.masked_key_indices[0])
        self.compression_ratios[layer_idx] = masked / (keys.shape[0] * keys.shape[1] * n)
        return keys, values


__all__ = ["CalibratedDMSPress"]
