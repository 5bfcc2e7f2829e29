"""PhaseAwarePress: the cache budget of ChunkedStridePress without its periodic weak spots."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from kvpress_phase.kernels import Compressed, keep_and_pool
from kvpress_phase.phase import WindowLayout, check_number, kept_per_window, merge_period
from kvpress import KeyDiffPress, ScorerPress

from kvpress_phase.presses.base import WindowedPress, _check_choice
from kvpress_phase.rope import rotary_inv_freq

STAGGERS = ("none", "head", "layer", "head_layer")
SPREADS = ("period", "stride")
BUDGETS = ("window", "window_topk", "row")
ROW_POOL_WINDOWS = 4
"""Under ``budget="row"`` the leftover tokens are pooled over ``ROW_POOL_WINDOWS`` consecutive windows by default
(chosen on the dev split, see ``docs/preregistration-phase-aware.md``)."""


@dataclass
class PhaseAwarePress(WindowedPress):
    """Chunked compression at ``ChunkedStridePress``'s cache length, with no weak phase.

    Keeps exactly as many entries as :class:`~kvpress_phase.ChunkedStridePress` with the same ``stride``,
    ``compression_ratio``, ``n_sink`` and ``n_local`` (every window yields ``k`` entries on average), but does not
    give every window the same fixed slots. Whatever is fixed per window (which slots merge, how many tokens a
    window may keep) favours facts at some offsets over others; a budget that follows the content across the
    whole row does not. So by default (``budget="row"``):

    - the ``n_sink`` first and ``n_local`` last tokens stay raw, as in ``ChunkedStridePress``;
    - the **best tokens of the whole row** stay raw, wherever they are, as many as all the windows together may
      keep (``n_windows * k``). "Best" is the scorer's score averaged over the KV heads (``share_heads``: every
      head keeps the same tokens, so a fact is kept whole in every head);
    - the others are **dropped** (``residual="drop"``); ``residual="pool"`` instead merges the leftovers of every
      ``pool_window`` positions into one RoPE-aware entry (the earlier default, for models trained with pooled
      caches);
    - the default scorer is kvpress's ``KeyDiffPress`` (keys least similar to the mean key): query-agnostic and
      cheap, so the press is the same whether or not the question is in the cache.

    These defaults were chosen on the real pretrained model SmolLM2-135M-Instruct under a pre-registered dev split
    (``docs/preregistration-real-model.md``), in both settings (the question appended after compression, and
    compressed with the context): mean accuracy 0.64 over the eight dev cells with no detectable phase effect
    (KVzip 0.69, KeyDiff 0.58, StreamingLLM 0.47, the earlier default with pooled leftovers and SnapKV scores
    0.07). On the held-out test split (``RESULTS.md``, section R1: strides 6/10/12, ratios 0.125-0.5, query-agnostic,
    1k tokens) it showed no phase effect in any of 18 cells and averaged 0.87 (no compression 0.91,
    ``ChunkedStridePress()`` 0.48), but stayed 0.06-0.24 below KVzip on ``niah_multikey``. :class:`~kvpress_phase.presses.scorers.KVzipScorer` (KVzip's reconstruction scores) and SnapKV's
    (:class:`~kvpress_phase.presses.scorers.SnapKVScorer`) are options.

    The earlier mechanisms remain for ablations and for budgets fixed per window (``budget="window"``, the
    previous default, scores from ``scorer`` used only for alignment):

    - **staggered offsets** (``stagger``): every KV head (``"head"``), layer (``"layer"``) or (layer, head) pair
      (``"head_layer"``) uses its own grid offset, spread over one period of the merge pattern
      (``spread="period"``, see :func:`~kvpress_phase.phase.merge_period`) or over the stride;
    - **overlapping windows** (``overlap``, pool mode): windows of ``2 * stride`` tokens every ``stride`` tokens;
    - **RoPE-aware merging** (``rope="centroid"`` with ``weighting="score"``);
    - **boundary-aware alignment** (``align``): per sequence and layer, the offset whose window boundaries cut
      the highest-scoring spans least.

    ``budget="window_topk"`` keeps the ``k - 1`` best tokens of every window raw and pools the rest: content
    picks the tokens but each window has the same budget, and an answer in mid-window loses out to one that
    straddles two windows (measured in ``RESULTS.md``).

    Parameters
    ----------
    All those of :class:`~kvpress_phase.ChunkedStridePress`, with these differences:

    mode : {"pool", "select"}, default "pool"
        The per-window mechanism of ``budget="window"`` and the pooling of ``residual="pool"``.

    scorer : kvpress.ScorerPress or str, default ``KeyDiffPress()``
        A scorer or a name of :data:`~kvpress_phase.presses.scorers.SCORERS`, as in ``ChunkedStridePress``. Scores
        that choose the raw tokens (``budget="row"``/``"window_topk"``), align the grid
        (``budget="window"``, ``align``) and weight pooling (``weighting="score"``).
    budget : {"row", "window", "window_topk"}, default "row"
        How the entries are shared out: across the row by score, by fixed slots per window, or by score within
        each window. With ``residual="pool"``, ``"row"`` and ``"window_topk"`` need ``mode="pool"`` without
        overlap.
    share_heads : bool, default True
        Average the scores over the KV heads before choosing raw tokens (every head keeps the same tokens).
    pool_window : int or None, default None
        Length of the stretches whose leftovers form one pooled entry under ``budget="row"``: ``>= stride``;
        None means ``4 * stride``.
    residual : {"drop", "pool"}, default "drop"
        ``"drop"`` spends the whole budget on raw tokens; ``"pool"`` keeps one pooled entry of the leftovers per
        ``pool_window`` (``budget="row"``) or per window (``"window_topk"``) and the rest of the budget raw.
    recent : float, default 0.0
        ``budget="row"`` only: the share of the raw-token budget spent on the most recent compressible tokens, kept
        as one contiguous block before the ``n_local`` protected ones (StreamingLLM's recency, sized to the
        budget); the rest of the budget is chosen by score. In ``[0, 1]``.
    span, span_pool : int, {"max", "mean"}, defaults 0 and "max"
        Dilate the scores by a running maximum (or mean) over ``2 * span + 1`` tokens before choosing, so the
        neighbours of a high-scoring token stay with it (lowered accuracy on the dev split; off by default).
    window : int or None, default None
        None means ``2 * stride`` when overlapping and ``stride`` otherwise.
    stagger : {"head", "layer", "head_layer", "none"}, default "head"
    spread : {"period", "stride"}, default "period"
    overlap : bool or None, default False
        None means True in pool mode and False in select mode (select mode cannot overlap).
    align : bool, default True
        ``budget="window"`` only: the grid follows the scores, so ``offset`` is not used.

    Under ``budget="row"`` the pooling stretches sit on the plain grid (``offset``); staggering and alignment
    apply to the window budgets only.
    """

    window: Optional[int] = None
    mode: str = "pool"
    stagger: str = "head"
    spread: str = "period"
    overlap: Optional[bool] = False
    align: bool = True
    scorer: ScorerPress = field(default_factory=KeyDiffPress)
    budget: str = "row"
    span: int = 0
    span_pool: str = "max"
    share_heads: bool = True
    residual: str = "drop"
    pool_window: Optional[int] = None
    recent: float = 0.0
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
        check_number("span", self.span, 0)
        _check_choice("span_pool", self.span_pool, ("max", "mean"))
        _check_choice("residual", self.residual, ("pool", "drop"))
        if self.pool_window is not None:
            check_number("pool_window", self.pool_window, self.stride)
        r = self.recent
        check_number("recent", r, 0, 1, integer=False)
        if r > 0 and self.budget != "row":
            raise ValueError(f"recent={r} needs budget='row' (a share of the row's raw-token budget)")
        if not isinstance(self.share_heads, bool):
            raise ValueError(f"share_heads must be True or False, got {self.share_heads!r}")
        if self.budget != "window" and (self.mode != "pool" or self.overlap) and self.residual == "pool":
            raise ValueError(f"budget={self.budget!r} with residual='pool' needs mode='pool' and overlap=False: it "
                             "keeps the best tokens raw and pools the others; use residual='drop', or budget='window' "
                             "for select mode or overlapping windows")
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
    def needs_rope(self) -> bool:
        """RoPE handling matters only where entries are pooled (not with ``residual="drop"`` under a content
        budget, the default)."""
        return super().needs_rope and (self.budget == "window" or self.residual == "pool")

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
        heads = s.shape[1]
        win_pos = layout.window_positions().clamp(max=s.shape[2] - 1)  # (B, H, nw, W)
        if self.share_heads:
            s = s.mean(dim=1, keepdim=True)
            if bool((layout.first == layout.first[:, :1]).all()):  # one grid for every head: choose once
                raw = self._raw_tokens(s, win_pos[:, :1], layout.n_windows, n_raw, cap)
                return raw.expand(-1, heads, -1).contiguous()
            s = s.expand(-1, heads, -1)
        return self._raw_tokens(s, win_pos, layout.n_windows, n_raw, cap)

    def _raw_tokens(self, s: torch.Tensor, win_pos: torch.Tensor, n_windows: int, n_raw: int,
                    cap: bool) -> torch.Tensor:
        B, H, n = s.shape
        original = s.gather(2, win_pos.flatten(2)).view(win_pos.shape)
        if self.span > 0:
            pool = F.max_pool1d if self.span_pool == "max" else F.avg_pool1d
            dilated = pool(s.reshape(B * H, 1, n), 2 * self.span + 1, stride=1, padding=self.span)
            key = dilated.view(B, H, n).gather(2, win_pos.flatten(2)).view(win_pos.shape)
        else:
            key = original
        if self.recent > 0 and self.budget == "row":  # the last window positions, one contiguous block
            n_recent = min(int(round(self.recent * n_raw)), n_raw)
            if n_recent:
                flat = key.flatten(2).clone()
                flat[..., flat.shape[-1] - n_recent:] = float("inf")
                key = flat.view(key.shape)
        if cap:
            key = key.scatter(-1, original.argmin(dim=-1, keepdim=True), float("-inf"))
        if self.budget == "window_topk":  # the same number of raw tokens in every window
            top = key.argsort(dim=-1, descending=True, stable=True)[..., : n_raw // max(n_windows, 1)]
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
