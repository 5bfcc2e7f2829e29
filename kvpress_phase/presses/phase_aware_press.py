"""PhaseAwarePress: the cache budget of ChunkedStridePress without its periodic weak spots."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from kvpress_phase.kernels import ROPE_MODES, WEIGHTINGS, Compressed, keep_and_pool
from kvpress_phase.phase import WindowLayout, check_number
from kvpress_phase.presses.base import RESIDUALS, WindowedPress, check_bool, check_choice
from kvpress_phase.presses.choice import keep_only, raw_tokens, spread_budget
from kvpress_phase.presses.scorers import token_scores
from kvpress_phase.rope import rotary_inv_freq

ALLOCATIONS = ("even", "layers", "heads", "layers_heads")
"""Where ``PhaseAwarePress`` spends its raw-token budget: the same count in every layer and head, or by score
across layers, across the KV heads of each layer, or across both."""

ROW_POOL_WINDOWS = 4
"""With ``residual="pool"`` the leftover tokens are pooled over ``ROW_POOL_WINDOWS`` consecutive windows by default
(chosen on the dev split, see ``docs/preregistration-phase-aware.md``)."""


@dataclass
class PhaseAwarePress(WindowedPress):
    """The row's best tokens, at :class:`~kvpress_phase.ChunkedStridePress`'s cache length: no weak phase.

    Keeps exactly as many entries as ``ChunkedStridePress`` with the same ``compression_ratio``, ``stride``,
    ``n_sink`` and ``n_local`` (every window yields ``k`` entries on average), but gives no window fixed slots:
    whatever is fixed per window (which slots merge, how many tokens a window may keep) favours facts at some
    offsets over others, and a budget that follows the content across the whole row does not.

    1. **Score** every token with ``scorer`` (default kvpress's ``KeyDiffPress``, keys least similar to the mean
       key: query-agnostic and cheap, so the press is the same whether or not the question is in the cache), and
       average the scores over the KV heads (``share_heads``: every head keeps the same tokens, so a fact is kept
       whole in every head).
    2. **Protect** the ``n_sink`` first and ``n_local`` last tokens (kept raw, as in ``ChunkedStridePress``), and
       optionally a ``recent`` share of the budget as one block just before them.
    3. **Choose** the best tokens of the whole row, as many as all the windows together may keep
       (``n_windows * k``), wherever they are.
    4. **The rest** is dropped (``residual="drop"``, the default) or merged, every ``pool_window`` positions, into
       one RoPE-aware entry (``residual="pool"``, for models trained with pooled caches; the raw budget then
       shrinks by one entry per pooling window).

    The defaults were chosen on the real pretrained model's pre-registered dev split
    (``docs/preregistration-real-model.md``) and tested on its held-out test split; the figures, and where the press
    still trails KVzip, are in ``RESULTS.md`` (section R1). Fixed per-window budgets on staggered, aligned or
    overlapping grids, which the studies compared against, are :class:`~kvpress_phase.StaggeredWindowPress`.

    Parameters
    ----------
    compression_ratio, stride, offset, n_sink, n_local, backend
        As in :class:`~kvpress_phase.ChunkedStridePress`: the cache length is that press's. ``offset`` places the
        pooling windows of ``residual="pool"`` (the choice of raw tokens has no grid).
    scorer : kvpress.ScorerPress or str, default ``KeyDiffPress()``
        Scores that choose the raw tokens: any kvpress ``ScorerPress``,
        :class:`~kvpress_phase.presses.scorers.KVzipScorer` (KVzip's reconstruction scores; the press then compresses
        after the prefill), :class:`~kvpress_phase.presses.scorers.SnapKVScorer`, or a name of
        :data:`~kvpress_phase.presses.scorers.SCORERS`.
    share_heads : bool, default True
        Average the scores over the KV heads before choosing (every head keeps the same tokens).
    recent : float, default 0.0
        The share of the raw-token budget spent on the most recent compressible tokens, kept as one contiguous
        block before the ``n_local`` protected ones (StreamingLLM's recency, sized to the budget). In ``[0, 1]``.
    residual : {"drop", "pool"}, default "drop"
        What happens to the tokens not chosen.
    pool_window : int or None, default None
        ``residual="pool"``: length of the stretches whose leftovers form one pooled entry, ``>= stride``; None means
        ``ROW_POOL_WINDOWS * stride``.
    weighting : {"mean", "score"}, default "mean"
        ``residual="pool"``: pool weights, uniform or the softmax of the scores.
    rope : {"start", "center", "centroid", "none"}, default "start"
        ``residual="pool"``: where a pooled key is re-rotated (as in ``ChunkedStridePress``).
    allocate : {"even", "layers", "heads", "layers_heads"}, default "even"
        Where the raw-token budget goes (``residual="drop"`` only). ``"even"``: every layer and head keeps
        ``n_windows * k``. The others keep the same total but spend it by score (:func:`spread_budget`): across the
        layers (``"layers"``: each layer's tensor has its own length, so the entries saved free memory; every
        layer's scores are needed first, so the press compresses when the prefill has finished, as with a scorer
        that needs the whole context), across the KV heads of each layer (``"heads"``, needs
        ``share_heads=False``: a layer is stored at its longest head and the padding of shorter heads is masked
        while decoding, as kvpress's ``AdaKVPress`` masks, so it frees no memory beyond the layer's longest head),
        or across both (``"layers_heads"``). On SmolLM2-135M (``RESULTS.md``, section R5: a dev round and a fresh
        test split) ``allocate="heads", share_heads=False`` answers better than ``"even"`` at ratios 0.5-0.75,
        stays flat and costs about 0.03 prefills, but is still well below KVzip there and stores about twice
        the bytes; ``"layers"`` answers worse. ``"even"`` stays the default.
    floor : float, default 0.0
        With ``allocate`` other than ``"even"``: every layer (or head) first keeps its ``floor`` share of the even
        budget, its best tokens; the rest goes by score. In ``[0, 1]``.

    Every parameter is validated at construction; invalid values raise ``ValueError`` naming the parameter.
    """

    share_heads: bool = True
    recent: float = 0.0
    residual: str = "drop"
    pool_window: Optional[int] = None
    weighting: str = "mean"
    rope: str = "start"
    allocate: str = "even"
    floor: float = 0.0
    _plan: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def validate(self) -> None:
        check_choice("residual", self.residual, RESIDUALS)
        if self.pool_window is not None:
            check_number("pool_window", self.pool_window, self.stride)
        check_number("recent", self.recent, 0, 1, integer=False)
        check_bool("share_heads", self.share_heads)
        check_choice("weighting", self.weighting, WEIGHTINGS)
        check_choice("rope", self.rope, ROPE_MODES)
        check_choice("allocate", self.allocate, ALLOCATIONS)
        check_number("floor", self.floor, 0, 1, integer=False)
        if self.allocate != "even" and self.residual != "drop":
            raise ValueError(f"allocate={self.allocate!r} spends a raw-token budget by score, which needs "
                             f"residual='drop' (got residual={self.residual!r})")
        if self.allocate in ("heads", "layers_heads") and self.share_heads:
            raise ValueError(f"allocate={self.allocate!r} gives each KV head its own tokens: set share_heads=False")
        super().validate()

    @property
    def needs_rope(self) -> bool:
        """RoPE handling matters only where entries are pooled (``residual="pool"``)."""
        return self.residual == "pool" and self.rope != "none"

    @property
    def plans_across_layers(self) -> bool:
        """Whether every layer's scores are needed before any layer is compressed (a budget across layers)."""
        return self.allocate in ("layers", "layers_heads") and self.compression_ratio > 0

    def plan(self, layers) -> None:
        """Decide each layer's raw-token counts from every layer's scores (``allocate="layers"`` or
        ``"layers_heads"``), before any layer is compressed. ``layers`` yields ``(module, hidden_states, keys,
        values, attentions, kwargs)`` per layer, what :meth:`compress` receives; the counts are used by the next
        :meth:`compress` of each layer, once."""
        self._plan = {}
        if not self.plans_across_layers:
            return
        units, budgets, owners = [], [], []
        for module, hidden_states, keys, values, attentions, kwargs in layers:
            if keys.shape[0] != 1:
                raise ValueError(f"allocate={self.allocate!r} plans one context at a time (batch 1), got batch "
                                 f"{keys.shape[0]}")
            layout = self.layout_for(module, keys)
            if layout.n_windows == 0:
                continue
            scores = token_scores(self.scorer, module, hidden_states, keys, values, attentions, kwargs)
            win = scores.float()[0].gather(1, layout.window_positions()[0].flatten(1))  # (heads, window tokens)
            units.append(win.mean(dim=0, keepdim=True) if self.allocate == "layers" else win)
            budgets.append(layout.n_windows * layout.k)
            owners.append((getattr(module, "layer_idx", 0), keys.shape[2]))
        for owner, counts in zip(owners, spread_budget(units, budgets, self.floor)):
            self._plan[owner] = counts

    def raw_budget(self, module: nn.Module, scores: torch.Tensor, layout: WindowLayout):
        """How many window tokens each row of this layer keeps raw: one count, or a ``(batch, heads)`` tensor."""
        even = layout.n_windows * layout.k
        if self.allocate == "even":
            return even
        if self.allocate == "heads":
            win = scores.float().gather(2, layout.window_positions().flatten(2))  # (batch, heads, window tokens)
            return torch.stack([spread_budget([row], [even], self.floor)[0] for row in win])
        owner = (getattr(module, "layer_idx", 0), layout.seq_len)
        if owner not in self._plan:
            raise ValueError(
                f"PhaseAwarePress(allocate={self.allocate!r}) spends its budget across layers, so it needs every "
                "layer's scores before compressing any: use it on its own (pipeline(..., press=PhaseAwarePress(...)) "
                "compresses when the prefill has finished); inside ComposedPress, PerLayerWindowedPress or "
                "WindowedDecodingPress it cannot see the other layers"
            )
        counts = self._plan.pop(owner).to(scores.device)
        if self.allocate == "layers":
            return int(counts[0])
        return counts[None]

    def compress_windows(self, module: nn.Module, keys: torch.Tensor, values: torch.Tensor,
                         scores: Optional[torch.Tensor], layout: WindowLayout) -> Compressed:
        """The row's ``n_windows * k`` best window tokens stay raw (or the counts ``allocate`` spreads); the others
        are dropped or pooled."""
        if self.residual == "drop":
            raw = raw_tokens(scores, layout, self.raw_budget(module, scores, layout), share_heads=self.share_heads,
                             recent=self.recent)
            return keep_only(keys, values, raw, layout)
        pool_layout, n_raw = self.pool_layout(layout)
        raw = raw_tokens(scores, pool_layout, n_raw, share_heads=self.share_heads, recent=self.recent, cap=True)
        inv_freq = rotary_inv_freq(module) if self.needs_rope else None
        return keep_and_pool(keys, values, raw, pool_layout, scores=scores, weighting=self.weighting, rope=self.rope,
                             inv_freq=inv_freq, backend=self.backend)

    def pool_layout(self, layout: WindowLayout) -> tuple[WindowLayout, int]:
        """``residual="pool"``: the windows whose leftover tokens are pooled, and how many raw tokens they keep.

        The pooling windows are ``pool_window`` tokens long on the press's grid; the raw budget is what is left of
        ``layout.compressed_length`` (``ChunkedStridePress``'s cache length) after the tokens outside the pooling
        windows and one pooled entry per pooling window.
        """
        size = self.pool_window or ROW_POOL_WINDOWS * self.stride
        if size == layout.stride:
            return layout, layout.n_windows * (layout.k - 1)
        coarse = WindowLayout.build(layout.seq_len, window=size, stride=size, k=1, offsets=layout.offsets,
                                    n_sink=layout.n_sink, n_local=layout.n_local, batch=layout.batch,
                                    heads=layout.heads, device=layout.first.device)
        n_raw = layout.compressed_length - (layout.seq_len - coarse.n_windows * size) - coarse.n_windows
        if coarse.n_windows == 0 or not 0 <= n_raw <= coarse.n_windows * (size - 1):
            return layout, layout.n_windows * (layout.k - 1)  # too short for the coarse windows
        return coarse, n_raw
