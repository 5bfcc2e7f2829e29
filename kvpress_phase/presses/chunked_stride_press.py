"""ChunkedStridePress: chunked fixed-stride KV-cache compression."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from kvpress_phase.kernels import Compressed
from kvpress_phase.core.phase import WindowLayout, check_number
from kvpress_phase.presses.base import WindowedPress, check_window_options, fixed_windows, pooled_entry_ends


@dataclass
class ChunkedStridePress(WindowedPress):
    """Compress the cache window by window on a fixed grid.

    Windows of ``window`` (W) consecutive tokens are placed every ``stride`` (S) tokens, starting at ``offset``;
    each window becomes ``k`` cache entries. This is the chunked compression whose periodic weak spots are
    described in "Periodic Weak Spots: Phase Sensitivity from Chunked KV-Cache Compression" (arXiv:2609.36322):
    every token has a phase, ``(position - offset) mod stride``, and how well it survives depends on it.

    Layout and length (exact). For a sequence of ``n`` tokens:

    - the first ``n_sink`` and the last ``n_local`` tokens are kept raw; the ``L = n - n_sink - n_local``
      tokens between them are compressible;
    - ``k`` entries per window: the integer nearest ``S * (1 - compression_ratio)``, ties to more compression,
      at most ``S - 1`` for a positive ratio and at least 1 (:func:`~kvpress_phase.core.phase.kept_per_window`); the
      per-window ratio achieved, ``1 - k / S``, is in ``press.stats[layer_idx].window_ratio``, and a press whose
      achieved ratio is more than ``1 / (2S)`` from the requested one warns once;
    - ``n_windows = max(0, (L - S + 1) // S)``: the number of windows that fit in the compressible span for every
      offset, so the length never depends on the offset;
    - the first window starts at ``first = n_sink + ((offset - n_sink) mod S)``; window ``j`` owns the stride
      block ``[first + j*S, first + (j+1)*S)`` and reads ``[first + j*S, first + j*S + W)``;
    - tokens before ``first`` and after the last block are kept raw;
    - compressed length ``n - n_windows * (S - k)``; the achieved ratio over the whole cache is recorded in
      ``press.stats[layer_idx]`` with the source position (and so the phase) of every kept entry.

    A sequence too short for one window passes through unchanged.

    Defaults: **selection** (``mode="select"``: each window keeps its ``k`` best tokens, which keep their original
    rotation) scored by KeyDiff (``KeyDiffScorer``, kvpress's ``KeyDiffPress`` scores: keys least similar to the mean key; query-agnostic, keys only),
    chosen on the real pretrained model's pre-registered dev split (``docs/preregistration-real-model.md``): pooled
    entries hurt a model never trained with them, and KeyDiff was the best cheap per-window scorer. Pooling
    (``mode="pool"``) is for models trained with a pooled cache, such as the built-in ``chunked`` model. How the
    defaults score, and where their weak phases are: ``docs/results/r1-real-test.md`` and
    ``docs/results/builtin-models.md`` (section 5).

    Positions. A key's index in the cache is taken as its position, which holds only when no other press has
    shortened the cache before: on a shortened cache (fewer keys than the layer's tokens) the press raises
    ``ValueError``; in a ``kvpress.ComposedPress`` put it first. A ratio per layer: :class:`PerLayerWindowedPress`;
    generated tokens compressed too: :class:`~kvpress_phase.WindowedDecodingPress`.

    Parameters
    ----------
    compression_ratio : float, default 0.0
        Fraction of each window's entries removed, in [0, 1). 0 returns the cache unchanged.
    window : int or None, default None
        W, tokens read by each window, ``>= stride``; None means ``stride`` (non-overlapping windows).
        ``window > stride`` (overlapping windows) needs ``mode="pool"``.
    stride : int, default 8
        S, distance between window starts, ``>= 1``; ``>= 2`` for a positive ``compression_ratio`` (a window of
        one token keeps it: ValueError rather than a press that compresses nothing).
    offset : int, default 0
        Where the grid starts: phase 0 is at positions ``offset + j * stride``. ``>= 0``.
    n_sink : int, default 4
        Initial tokens always kept raw (attention sinks).
    n_local : int, default 16
        Most recent tokens always kept raw.
    mode : {"select", "pool"}, default "select"
        ``"select"`` keeps the ``k`` highest-scoring tokens of each window (ties to the earlier token), which keep
        their original rotation; ``"pool"`` merges each window into ``k`` entries (slot ``i`` of the window feeds
        entry ``floor(i * k / W)``).
    scorer : kvpress.ScorerPress or str, default ``KeyDiffScorer()`` (kvpress's KeyDiff)
        Per-token scores (higher = more important) for ``mode="select"`` and ``weighting="score"``. Its own
        ``compression_ratio`` is ignored. Any kvpress ``ScorerPress``, or
        :class:`~kvpress_phase.presses.scorers.KVzipScorer` (KVzip's reconstruction scores; the press then
        compresses after the prefill), or a name of :data:`~kvpress_phase.presses.scorers.SCORERS` (``"knorm"``,
        ``"snapkv"``, ``"keydiff"``, ...), which the press replaces with that scorer built with its defaults. While
        decoding (:class:`~kvpress_phase.WindowedDecodingPress`) a scorer sees only the block being compressed:
        KeyDiff's mean key is then the block's.
    weighting : {"mean", "score"}, default "mean"
        Pool weights inside each merged group: uniform, or softmax of the scorer's scores.
    rope : {"start", "center", "centroid", "none"}, default "start"
        Pool mode only. ``"none"`` averages the keys as stored (each rotated at its own position). The others
        un-rotate the keys with the layer's rotary embedding, pool, and rotate the merged key at the group's
        start (as in the reproduction of the paper), its centre, or its weight-averaged position.
    backend : {"auto", "triton", "torch"} or None, default None
        Kernel backend (None reads ``KVPRESS_PHASE_BACKEND``, default auto: Triton on CUDA tensors).
    Every parameter is validated at construction; invalid values raise ``ValueError`` naming the parameter.
    """

    window: Optional[int] = None
    mode: str = "select"
    weighting: str = "mean"
    rope: str = "start"

    def validate(self) -> None:
        super().validate()
        check_window_options(self.mode, self.weighting, self.rope)
        if self.window is not None:
            check_number("window", self.window, self.stride)
        if self.mode == "select" and self.effective_window != self.stride:
            raise ValueError(
                f"window must equal stride ({self.stride}) in mode='select' (got {self.effective_window}): "
                "overlapping windows would keep a token twice; use mode='pool' for overlapping windows"
            )

    @property
    def effective_window(self) -> int:
        return self.stride if self.window is None else self.window

    @property
    def needs_scores(self) -> bool:
        return self.mode == "select" or self.weighting == "score"

    @property
    def needs_rope(self) -> bool:
        return self.mode == "pool" and self.rope != "none"

    def compress_windows(self, module: nn.Module, keys: torch.Tensor, values: torch.Tensor,
                         scores: Optional[torch.Tensor], layout: WindowLayout) -> Compressed:
        """Every window yields its ``k`` best tokens, or ``k`` entries pooled from its slots."""
        return fixed_windows(self, module, keys, values, scores, layout)

    def entry_ends(self, layout: WindowLayout, positions: torch.Tensor) -> torch.Tensor:
        return pooled_entry_ends(layout, positions) if self.mode == "pool" else positions + 1
