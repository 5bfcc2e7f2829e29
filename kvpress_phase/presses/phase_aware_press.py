"""PhaseAwarePress: the cache budget of ChunkedStridePress without its periodic weak spots."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from kvpress_phase.kernels import Compressed, keep_and_pool
from kvpress_phase.phase import WindowLayout, kept_per_window, merge_period
from kvpress_phase.presses.base import WindowedPress, _check_choice, _check_int
from kvpress_phase.rope import rotary_inv_freq

STAGGERS = ("none", "head", "layer", "head_layer")
SPREADS = ("period", "stride")
BUDGETS = ("window", "window_topk", "row")
ROW_POOL_WINDOWS = 4
"""Under ``budget="row"`` the leftover tokens are pooled over ``ROW_POOL_WINDOWS`` consecutive windows by default
(chosen on the dev split, see ``docs/preregistration-phase-aware.md``)."""


@dataclass
class PhaseAwarePress(WindowedPress):
    """Chunked-stride compression whose grid does not favour any phase.

    Keeps exactly as many entries as :class:`~kvpress_phase.ChunkedStridePress` with the same ``stride``,
    ``compression_ratio``, ``n_sink`` and ``n_local`` (the number of windows never depends on the offset, see
    its docstring), and removes the dependence on phase with four mechanisms, each switchable for ablations:

    - **staggered offsets** (``stagger``): every KV head (``"head"``), layer (``"layer"``) or (layer, head) pair
      (``"head_layer"``) uses its own grid offset, so a token whose neighbours one head merges is kept apart by
      another. The offsets are spread evenly over one period of the merge pattern (``spread="period"``, see
      :func:`~kvpress_phase.phase.merge_period`): with ``k = 4`` of 8 the pattern repeats every 2 slots, and
      grids 4 apart would merge exactly the same phases. ``spread="stride"`` spreads them over ``[0, stride)``.
    - **overlapping windows** (``overlap``, pool mode): windows of ``2 * stride`` tokens every ``stride`` tokens,
      as in DeepSeek-V4's compressed attention, so every token is merged into entries of two windows at two
      different in-window offsets.
    - **RoPE-aware merging** (``rope="centroid"``): keys are un-rotated, merged, and re-rotated at the
      score-weighted centroid of their group (with ``weighting="score"``), so a merged key points where its
      content came from.
    - **boundary-aware alignment** (``align``): per sequence and layer, the base offset is the one whose window
      boundaries cut the highest-scoring spans least (for each offset, the sum over its boundaries of the lower
      of the two neighbouring tokens' min-max-normalised scores; the lowest wins). Staggered shifts are added
      on top.

    Parameters
    ----------
    All those of :class:`~kvpress_phase.ChunkedStridePress`, with these differences:

    window : int or None, default None
        None means ``2 * stride`` when overlapping and ``stride`` otherwise. An explicit window must be
        ``> stride`` with ``overlap=True`` and ``== stride`` with ``overlap=False``.
    stagger : {"head", "layer", "head_layer", "none"}, default "head"
    spread : {"period", "stride"}, default "period"
        Range the staggered offsets are spread over: one period of the pool-mode merge pattern, or the whole
        stride. Select mode has no fixed pattern and always spreads over the stride.
    overlap : bool or None, default False
        None means True in pool mode and False in select mode (select mode cannot overlap).
    align : bool, default True
        With alignment the grid follows the content, so ``offset`` is not used.

    Defaults (per-head grids staggered over the merge period, boundary-aware alignment, ChunkedStridePress's
    pooling and RoPE handling otherwise) are the combination that measured best on the built-in model
    (``RESULTS.md``): alignment gave the flattest phase profile and the best worst phase at ratios 0.125 and
    0.25 with about the same mean; overlapping windows made every merged entry twice as coarse and recall
    collapsed at every phase; score weighting with centroid merging did not beat mean pooling at the group start.
    """

    window: Optional[int] = None
    stagger: str = "head"
    spread: str = "period"
    overlap: Optional[bool] = False
    align: bool = True
    budget: str = "window"
    span: int = 0
    span_pool: str = "max"
    share_heads: bool = False
    residual: str = "pool"
    pool_window: Optional[int] = None
    n_layers: Optional[int] = field(default=None, init=False, repr=False, compare=False)  # from the model

    @property
    def overlapping(self) -> bool:
        return self.mode == "pool" if self.overlap is None else bool(self.overlap)

    @property
    def effective_window(self) -> int:
        if self.window is not None:
            return self.window
        return 2 * self.stride if self.overlapping else self.stride

    def validate(self) -> None:
        _check_choice("budget", self.budget, BUDGETS)
        _check_int("span", self.span, 0)
        _check_choice("span_pool", self.span_pool, ("max", "mean"))
        _check_choice("residual", self.residual, ("pool", "drop"))
        if self.pool_window is not None:
            _check_int("pool_window", self.pool_window, self.stride)
        if not isinstance(self.share_heads, bool):
            raise ValueError(f"share_heads must be True or False, got {self.share_heads!r}")
        if self.budget != "window" and (self.mode != "pool" or self.overlap):
            raise ValueError(f"budget={self.budget!r} needs mode='pool' and overlap=False: it keeps the best tokens "
                             "raw and pools the others")
        _check_choice("stagger", self.stagger, STAGGERS)
        _check_choice("spread", self.spread, SPREADS)
        if self.overlap is not None and not isinstance(self.overlap, bool):
            raise ValueError(f"overlap must be True, False or None, got {self.overlap!r}")
        if not isinstance(self.align, bool):
            raise ValueError(f"align must be True or False, got {self.align!r}")
        if self.overlap and self.mode == "select":
            raise ValueError("overlap=True needs mode='pool': overlapping windows would select a token twice")
        super().validate()
        if self.window is not None and self.overlapping and self.window == self.stride:
            raise ValueError(
                f"window ({self.window}) must be > stride ({self.stride}) with overlap=True; "
                "leave window=None for 2 * stride or set overlap=False"
            )
        if self.window is not None and not self.overlapping and self.window != self.stride:
            raise ValueError(f"window ({self.window}) must equal stride ({self.stride}) with overlap=False")

    @property
    def needs_scores_for_grid(self) -> bool:
        return self.align and self.budget != "row"

    @property
    def needs_scores(self) -> bool:
        return super().needs_scores or self.budget != "window"

    # ------------------------------------------------------------------ content-adaptive budget
    def raw_tokens(self, scores: torch.Tensor, layout: WindowLayout, n_raw: int, cap: bool) -> torch.Tensor:
        """``(batch, heads, seq_len)`` bool: the ``n_raw`` window tokens of ``layout`` that stay raw, chosen across
        the whole row by score (``budget="row"``); tokens outside the windows are always raw.

        Scores are first averaged over the KV heads (``share_heads``: every head keeps the same tokens) and
        dilated by a running maximum (or mean, ``span_pool``) over ``2 * span + 1`` tokens (``span``), so that the
        neighbours of a high-scoring token stay with it; ties left by the dilation go to the higher original score.
        With ``cap``, each window's lowest-scoring token is never chosen, so every window keeps a token to pool.
        """
        s = scores.float()
        if self.share_heads:
            s = s.mean(dim=1, keepdim=True).expand_as(s)
        B, H, n = s.shape
        win_pos = layout.window_positions().clamp(max=n - 1)  # (B, H, nw, W)
        original = s.gather(2, win_pos.flatten(2)).view(win_pos.shape)
        if self.span > 0:
            pool = F.max_pool1d if self.span_pool == "max" else F.avg_pool1d
            dilated = pool(s.reshape(B * H, 1, n), 2 * self.span + 1, stride=1, padding=self.span)
            key = dilated.view(B, H, n).gather(2, win_pos.flatten(2)).view(win_pos.shape)
        else:
            key = original
        if cap:
            key = key.scatter(-1, original.argmin(dim=-1, keepdim=True), float("-inf"))
        if self.budget == "window_topk":  # the same number of raw tokens in every window
            top = key.argsort(dim=-1, descending=True, stable=True)[..., : n_raw // max(layout.n_windows, 1)]
            keep = torch.zeros_like(key, dtype=torch.bool).scatter_(-1, top, True)
            raw = torch.ones(B, H, n, dtype=torch.bool, device=s.device)
            return raw.scatter_(2, win_pos.flatten(2), keep.flatten(2))
        flat_key, flat_orig = key.flatten(2), original.flatten(2)
        if self.span > 0:  # by dilated score, ties to the higher original score
            order = flat_orig.argsort(dim=-1, descending=True, stable=True)
            order = order.gather(-1, flat_key.gather(-1, order).argsort(dim=-1, descending=True, stable=True))
        else:
            order = flat_key.argsort(dim=-1, descending=True, stable=True)
        keep = torch.zeros_like(flat_key, dtype=torch.bool).scatter_(-1, order[..., :n_raw], True)
        raw = torch.ones(B, H, n, dtype=torch.bool, device=s.device)
        return raw.scatter_(2, win_pos.flatten(2), keep)

    def pool_layout(self, layout: WindowLayout) -> tuple[WindowLayout, int]:
        """The windows whose leftover tokens are pooled under ``budget="row"``, and how many raw tokens they keep.

        The pooling windows are ``pool_window`` tokens long (``stride`` by default) on the press's grid; the raw
        budget is what is left of ``layout.compressed_length`` (``ChunkedStridePress``'s cache length) after the
        tokens outside the pooling windows and one pooled entry per pooling window.
        """
        size = self.pool_window or ROW_POOL_WINDOWS * self.stride
        if size == layout.stride or self.budget == "window_topk":
            return layout, layout.n_windows * (layout.k - 1)
        coarse = WindowLayout.build(layout.seq_len, window=size, stride=size, k=1, offsets=layout.offsets,
                                    n_sink=layout.n_sink, n_local=layout.n_local, batch=layout.batch,
                                    heads=layout.heads, device=layout.first.device)
        n_raw = layout.compressed_length - (layout.seq_len - coarse.n_windows * size) - coarse.n_windows
        if coarse.n_windows == 0 or not 0 <= n_raw <= coarse.n_windows * (size - 1):
            return layout, layout.n_windows * (layout.k - 1)  # too short for the coarse windows
        return coarse, n_raw

    def compress_windows(self, module: nn.Module, keys: torch.Tensor, values: torch.Tensor,
                         scores: Optional[torch.Tensor], layout: WindowLayout) -> Compressed:
        if self.budget == "window":
            return super().compress_windows(module, keys, values, scores, layout)
        if self.residual == "drop":
            raw = self.raw_tokens(scores, layout, layout.n_windows * layout.k, cap=False)
            return _keep_only(keys, values, raw, layout)
        pool_layout, n_raw = self.pool_layout(layout)
        raw = self.raw_tokens(scores, pool_layout, n_raw, cap=True)
        inv_freq = rotary_inv_freq(module) if self.needs_rope else None
        return keep_and_pool(keys, values, raw, pool_layout, scores=scores, weighting=self.weighting, rope=self.rope,
                             inv_freq=inv_freq, backend=self.backend)

    def post_init_from_model(self, model):
        super().post_init_from_model(model)
        self.n_layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)

    # ------------------------------------------------------------------ grids
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
        if self.budget == "row":  # the content picks the raw tokens; the pooling windows stay on the plain grid
            return self.offset
        layer_idx = getattr(module, "layer_idx", 0)
        n_layers = self.n_layers or getattr(getattr(module, "config", None), "num_hidden_layers", None) or self.stride
        device = scores.device if scores is not None else None
        shifts = self.stagger_shifts(layer_idx, heads, n_layers).to(device)
        base = torch.full((batch, 1), self.offset, dtype=torch.long, device=device)
        if self.align:
            base = self.aligned_offsets(scores)[:, None]
        return base + shifts[None, :]


def _keep_only(keys: torch.Tensor, values: torch.Tensor, raw: torch.Tensor, layout: WindowLayout) -> Compressed:
    """The tokens ``raw`` marks, in order (``residual="drop"``: no pooled entries, the budget goes to raw tokens)."""
    idx = torch.argsort((~raw).to(torch.int8), dim=-1, stable=True)[..., : layout.compressed_length]
    d = keys.shape[-1]
    take = idx[..., None].expand(-1, -1, -1, d)
    return Compressed(keys.gather(2, take), values.gather(2, take), idx, idx + 1)
