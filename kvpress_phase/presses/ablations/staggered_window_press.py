"""StaggeredWindowPress: a fixed budget per window, on grids that move with the head, the layer or the content."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import torch
from torch import nn

from kvpress_phase.kernels import Compressed, keep_and_pool
from kvpress_phase.core.phase import WindowLayout, check_number, kept_per_window, merge_period
from kvpress_phase.presses.base import (RESIDUALS, WindowedPress, check_bool, check_choice, check_window_options,
                                        fixed_windows, pooled_entry_ends)
from kvpress_phase.presses.choice import keep_only, raw_tokens
from kvpress_phase.core.rope import rotary_inv_freq

STAGGERS = ("none", "head", "layer", "head_layer")
SPREADS = ("period", "stride")
BUDGETS = ("window", "window_topk")


@dataclass
class StaggeredWindowPress(WindowedPress):
    """Chunked compression with the same budget in every window, on grids that differ between heads and layers.

    The attempts to remove :class:`~kvpress_phase.ChunkedStridePress`'s weak phases while keeping a fixed budget
    per window, kept as the baselines and ablations the studies compared against (``docs/results/builtin-models.md``
    sections 3-4 and ``docs/results/r1-real-test.md``; the press the package recommends is :class:`~kvpress_phase.PhaseAwarePress`, which has no per-window budget).
    ``staggered_window`` in the evaluation's press specs (``staggered_window:budget=window_topk``); results written
    when these were options of ``PhaseAwarePress`` carry the labels ``phase_aware:budget=window`` and ``window_topk``.

    Steps: score (``scorer``), place each row's grid (below), then per window either the ``k`` slots of
    ``ChunkedStridePress`` (``budget="window"``: select or pool, ``mode``) or its ``k`` best tokens
    (``budget="window_topk"``: chosen by score inside each window, the rest dropped or pooled into one entry,
    ``residual``).

    Grids:

    - **staggered offsets** (``stagger``): every KV head (``"head"``), layer (``"layer"``) or (layer, head) pair
      (``"head_layer"``) uses its own grid offset, spread over one period of the merge pattern
      (``spread="period"``, see :func:`~kvpress_phase.core.phase.merge_period`) or over the stride;
    - **overlapping windows** (``overlap``, pool mode): windows of ``2 * stride`` tokens every ``stride`` tokens;
    - **boundary-aware alignment** (``align``): per sequence and layer, the base offset whose window boundaries cut
      the highest-scoring spans least (``offset`` is then not used).

    Parameters
    ----------
    compression_ratio, stride, offset, n_sink, n_local, scorer, backend, weighting, rope
        As in :class:`~kvpress_phase.ChunkedStridePress`.
    mode : {"pool", "select"}, default "pool"
        ``budget="window"``: merge each window into ``k`` entries, or keep its ``k`` best tokens.
    window : int or None, default None
        Tokens read by each window; None means ``2 * stride`` when overlapping and ``stride`` otherwise.
    stagger : {"head", "layer", "head_layer", "none"}, default "head"
    spread : {"period", "stride"}, default "period"
    overlap : bool or None, default False
        None means True in pool mode and False in select mode (select mode cannot overlap).
    align : bool, default True
    budget : {"window", "window_topk"}, default "window"
    share_heads : bool, default True
        ``budget="window_topk"``: average the scores over the KV heads before choosing.
    residual : {"drop", "pool"}, default "drop"
        ``budget="window_topk"``: drop the tokens not chosen, or keep ``k - 1`` raw and pool the rest of the window
        into one entry (needs ``mode="pool"`` without overlap).
    """

    window: Optional[int] = None
    mode: str = "pool"
    weighting: str = "mean"
    rope: str = "start"
    stagger: str = "head"
    spread: str = "period"
    overlap: Optional[bool] = False
    align: bool = True
    budget: str = "window"
    share_heads: bool = True
    residual: str = "drop"
    n_layers: Optional[int] = field(default=None, init=False, repr=False, compare=False)  # from the model

    def validate(self) -> None:
        check_choice("budget", self.budget, BUDGETS)
        check_choice("residual", self.residual, RESIDUALS)
        check_bool("share_heads", self.share_heads)
        check_window_options(self.mode, self.weighting, self.rope)
        if self.budget == "window_topk" and (self.mode != "pool" or self.overlap) and self.residual == "pool":
            raise ValueError("budget='window_topk' with residual='pool' needs mode='pool' and overlap=False: it keeps "
                             "the best tokens raw and pools the others; use residual='drop', or budget='window' for "
                             "select mode or overlapping windows")
        check_choice("stagger", self.stagger, STAGGERS)
        check_choice("spread", self.spread, SPREADS)
        if self.overlap is not None and not isinstance(self.overlap, bool):
            raise ValueError(f"overlap must be True, False or None, got {self.overlap!r}")
        check_bool("align", self.align)
        if self.overlap and self.mode == "select":
            raise ValueError("overlap=True needs mode='pool': overlapping windows would select a token twice")
        super().validate()
        if self.window is not None:
            check_number("window", self.window, self.stride)
            if self.overlapping and self.window == self.stride:
                raise ValueError(f"window ({self.window}) must be > stride ({self.stride}) with overlap=True; "
                                 "leave window=None for 2 * stride or set overlap=False")
            if not self.overlapping and self.window != self.stride:
                raise ValueError(f"window ({self.window}) must equal stride ({self.stride}) with overlap=False")

    @property
    def overlapping(self) -> bool:
        return self.mode == "pool" if self.overlap is None else bool(self.overlap)

    @property
    def effective_window(self) -> int:
        if self.window is not None:
            return self.window
        return 2 * self.stride if self.overlapping else self.stride

    @property
    def needs_rope(self) -> bool:
        return self.mode == "pool" and self.rope != "none" and (self.budget == "window" or self.residual == "pool")

    @property
    def needs_scores(self) -> bool:
        return self.mode == "select" or self.weighting == "score" or self.budget == "window_topk"

    @property
    def needs_scores_for_grid(self) -> bool:
        return self.align

    def post_init_from_model(self, model):
        super().post_init_from_model(model)
        self.n_layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)

    # ------------------------------------------------------------------ step 3
    def compress_windows(self, module: nn.Module, keys: torch.Tensor, values: torch.Tensor,
                         scores: Optional[torch.Tensor], layout: WindowLayout) -> Compressed:
        if self.budget == "window":
            return fixed_windows(self, module, keys, values, scores, layout)
        if self.residual == "drop":
            raw = raw_tokens(scores, layout, layout.n_windows * layout.k, share_heads=self.share_heads,
                             per_window=True)
            return keep_only(keys, values, raw, layout)
        raw = raw_tokens(scores, layout, layout.n_windows * (layout.k - 1), share_heads=self.share_heads,
                         per_window=True, cap=True)
        inv_freq = rotary_inv_freq(module) if self.needs_rope else None
        return keep_and_pool(keys, values, raw, layout, scores=scores, weighting=self.weighting, rope=self.rope,
                             inv_freq=inv_freq, backend=self.backend)

    def entry_ends(self, layout: WindowLayout, positions: torch.Tensor) -> torch.Tensor:
        return pooled_entry_ends(layout, positions) if self.mode == "pool" else positions + 1

    # ------------------------------------------------------------------ step 2: the grids
    def stagger_shifts(self, layer_idx: int, heads: int, n_layers: int) -> torch.Tensor:
        """``(heads,)`` shift added to the base offset of each head in layer ``layer_idx``.

        The grids being staggered (heads, layers or both) get shifts ``floor(g * P / G)`` for ``g = 0 .. G-1``,
        where ``P`` is the merge pattern's period (``spread="period"``, pool mode) or the stride.
        """
        S = self.stride
        P = S
        if self.spread == "period" and self.mode == "pool":
            P = merge_period(S, kept_per_window(S, self.compression_ratio))
        h = torch.arange(heads)
        if self.stagger == "none":
            g, G = torch.zeros_like(h), 1
        elif self.stagger == "head":
            g, G = h, heads
        elif self.stagger == "layer":
            g, G = torch.full_like(h, layer_idx), n_layers
        else:
            g, G = layer_idx * heads + h, n_layers * heads
        return torch.div(g * P, max(G, 1), rounding_mode="floor") % S

    def aligned_offsets(self, scores: torch.Tensor) -> torch.Tensor:
        """``(batch,)`` base offset per row whose boundaries cut the highest-scoring spans least."""
        B, _, n = scores.shape
        S = self.stride
        u = scores.float().mean(dim=1)  # (B, n)
        lo, hi = u.amin(dim=-1, keepdim=True), u.amax(dim=-1, keepdim=True)
        u = (u - lo) / (hi - lo).clamp_min(1e-12)
        cut = torch.minimum(u[:, :-1], u[:, 1:])  # cost of a boundary just before position b = 1 .. n-1
        b = torch.arange(1, n, device=u.device)
        inside = (b > self.n_sink) & (b < n - self.n_local)
        cost = torch.zeros(B, S, device=u.device).index_add_(1, b[inside] % S, cut[:, inside])
        return cost.argmin(dim=-1)

    def grid_offsets(
        self, module: nn.Module, scores: Optional[torch.Tensor], batch: int, heads: int, seq_len: int
    ) -> Union[int, torch.Tensor]:
        layer_idx = getattr(module, "layer_idx", 0)
        n_layers = self.n_layers or getattr(getattr(module, "config", None), "num_hidden_layers", None) or self.stride
        device = scores.device if scores is not None else None
        shifts = self.stagger_shifts(layer_idx, heads, n_layers).to(device)
        base = torch.full((batch, 1), self.offset, dtype=torch.long, device=device)
        if self.align:
            base = self.aligned_offsets(scores)[:, None]
        return base + shifts[None, :]
