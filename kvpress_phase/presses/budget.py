"""Budgets over the model for :class:`~kvpress_phase.PhaseAwarePress`, as wrappers (as kvpress's ``AdaKVPress(press)``).

``PhaseAwarePress`` alone keeps the same number of raw tokens in every layer and KV head (``n_windows * k``), the
KV heads of a layer sharing one choice. A wrapper keeps the same total but spends it by score:

- :class:`HeadBudgetPress`: across the KV heads of each layer (each head its own tokens: the press returns a layer
  padded to its longest head, and used as a context manager, as kvpress's pipeline uses it, it then stores the layer
  ragged, each head only its own entries, and decodes with the ragged attention (:mod:`.ragged_store`); called
  directly (``press.compress``, the replay engine) the padding stays masked, as kvpress's ``AdaKVPress`` masks);
- :class:`LayerBudgetPress`: across the layers (each layer dense at its own length, the heads sharing their
  tokens: the entries saved free memory);
- :class:`GlobalBudgetPress`: across layers and KV heads together (KVzip's shape; stored ragged like the per-head
  one);
- :class:`ThresholdBudgetPress`: the same budget over layers and KV heads decided layer by layer, by a score
  threshold calibrated once per scorer (as kvpress's ``DMSPress`` uses KVzap's scores), so that every layer is
  compressed during the prefill (stored ragged).

A wrapper pulls what it needs from the press it wraps, as ``AdaKVPress`` pulls ``press.score``: the scores
(:meth:`~kvpress_phase.presses.base.WindowedPress.score`) and the layout, from which it decides how many window tokens
each row keeps raw; it then hands the press the scores and those counts (``press.compress(..., scores=...,
counts=...)``), whose choice (:meth:`~kvpress_phase.PhaseAwarePress.compress_windows`) is a function of them alone.
The press holds no state of the wrapper's and calls nothing back; the scorer runs once per layer and prefill.

A budget across layers needs every layer's scores before any layer is compressed, so such a wrapper compresses when
the prefill has finished (:attr:`plans_across_layers`), scoring every layer in :meth:`BudgetPress.plan` and keeping
those scores until the layer is compressed, and it needs scores that compare between layers: KeyDiff's
cosine similarities are scale-free but rank layers poorly; the learned KVzip+ surrogate (``scorer="kvzap"``,
:mod:`kvpress_phase.presses.learned_scorer`) predicts one log score on one scale for every layer. Results:
``docs/results/r7-learned-budgets.md``.

    press = LayerBudgetPress(PhaseAwarePress(0.5, scorer="kvzap"))
    pipe(context, question=question, press=press)
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import ClassVar, Optional, Union

import torch
from kvpress import BasePress
from torch import nn

from kvpress_phase.core.phase import WindowLayout, check_number
from kvpress_phase.presses.base import _check_positions, _compress_after_prefill
from kvpress_phase.presses.choice import spread_budget
from kvpress_phase.presses.learned_scorer import LocalKVzapPress, ScoreQuantiles
from kvpress_phase.presses.phase_aware_press import PhaseAwarePress
from kvpress_phase.presses.ragged_store import stored_ragged


@dataclass
class BudgetPress(BasePress):
    """Common frame of the budget wrappers (see the module docstring); not used directly.

    Parameters
    ----------
    press : PhaseAwarePress
        The press whose raw-token budget is spread (``residual="drop"``); its ratio, stride, scorer and protection
        are used as they are.
    floor : float, default 0.0
        Every unit (a layer, or a KV head) first keeps its ``floor`` share of the even budget, its best tokens; the
        rest goes by score. In ``[0, 1]``; ``HeadBudgetPress(press, floor=1.0)`` is each head's own even budget.
    """

    press: PhaseAwarePress = None
    floor: float = 0.0
    _plan: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    across_layers: ClassVar[bool] = False
    """Whether the budget is spread across layers (compressing after the prefill)."""
    per_head: ClassVar[bool] = False
    """Whether each KV head chooses its own tokens (the shorter heads' padding is stored ragged, or masked)."""

    def __post_init__(self):
        name = type(self).__name__
        if not isinstance(self.press, PhaseAwarePress):
            raise ValueError(f"{name} spreads a PhaseAwarePress's budget: press must be a PhaseAwarePress, got "
                             f"{type(self.press).__name__}")
        if self.press.residual != "drop":
            raise ValueError(f"{name} spreads a raw-token budget by score, which needs the press's residual='drop' "
                             f"(got residual={self.press.residual!r})")
        check_number("floor", self.floor, 0, 1, integer=False)

    # ------------------------------------------------------------------ what the press's users read
    @property
    def compression_ratio(self) -> float:
        return self.press.compression_ratio

    @compression_ratio.setter
    def compression_ratio(self, value: float) -> None:
        self.press.compression_ratio = value

    @property
    def scorer(self):
        return self.press.scorer

    @property
    def stats(self) -> dict:
        """The wrapped press's per-layer record (:class:`~kvpress_phase.presses.stats.LayerStats`)."""
        return self.press.stats

    @property
    def needs_scores(self) -> bool:
        return self.press.needs_scores

    @property
    def plans_across_layers(self) -> bool:
        """Whether every layer's scores are needed before any layer is compressed."""
        return self.across_layers and self.press.compression_ratio > 0

    def post_init_from_model(self, model):
        self.press.post_init_from_model(model)

    @contextlib.contextmanager
    def __call__(self, model):
        """kvpress's context manager; a budget across layers compresses when the prefill has finished. A per-head
        budget then stores the padded layers ragged and switches the model to the ragged attention
        (:func:`~kvpress_phase.presses.ragged_store.stored_ragged`)."""
        with stored_ragged(self, model) if self.per_head else contextlib.nullcontext():
            if not self.plans_across_layers and not getattr(self.press.scorer, "needs_context", False):
                with BasePress.__call__(self, model):
                    yield
            else:
                with _compress_after_prefill(self, model):
                    yield

    # ------------------------------------------------------------------ the budget
    def plan(self, layers) -> None:
        """Score every layer once and decide its raw-token counts from every layer's scores (budgets across layers),
        before any layer is compressed. ``layers`` yields ``(module, hidden_states, keys, values, attentions,
        kwargs)`` per layer, what :meth:`compress` receives.

        Each layer's scores (``(1, kv_heads, seq_len)`` float32, small next to the layer's keys and values) are held
        with its counts until the next :meth:`compress` of that layer, which compresses with them instead of
        scoring again and releases them; whatever a previous prefill left unused is released when the next plan
        starts."""
        self._plan = {}
        if not self.plans_across_layers:
            return
        units, budgets, owners = [], [], []
        for module, hidden_states, keys, values, attentions, kwargs in layers:
            if keys.shape[0] != 1:
                raise ValueError(f"{type(self).__name__} plans one context at a time (batch 1), got batch "
                                 f"{keys.shape[0]}")
            layout = self.press.layout_for(module, keys)
            if layout.n_windows == 0:
                continue
            scores = self.press.score(module, hidden_states, keys, values, attentions, kwargs)
            win = scores.float()[0].gather(1, layout.window_positions()[0].flatten(1))  # (heads, window tokens)
            units.append(win if self.per_head else win.mean(dim=0, keepdim=True))
            budgets.append(layout.n_windows * layout.k)
            owners.append(((getattr(module, "layer_idx", 0), keys.shape[2]), scores))
        for (owner, scores), counts in zip(owners, spread_budget(units, budgets, self.floor)):
            self._plan[owner] = (scores, counts)

    def head_counts(self, scores: torch.Tensor, layout: WindowLayout) -> torch.Tensor:
        """A layer's raw-token budget spread by score across its KV heads: the ``(batch, heads)`` counts."""
        even = layout.n_windows * layout.k
        win = scores.float().gather(2, layout.window_positions().flatten(2))  # (batch, heads, window tokens)
        return torch.stack([spread_budget([row], [even], self.floor)[0] for row in win])

    def planned(self, module: nn.Module, keys: torch.Tensor) -> tuple[torch.Tensor, Union[int, torch.Tensor]]:
        """The scores and counts :meth:`plan` held for this layer (released from the plan)."""
        owner = (getattr(module, "layer_idx", 0), keys.shape[2])
        if owner not in self._plan:
            raise ValueError(
                f"{type(self).__name__} spends its budget across layers, so it needs every layer's scores before "
                "compressing any: use it on its own (pipeline(..., press=...) compresses when the prefill has "
                "finished); inside ComposedPress, PerLayerWindowedPress or WindowedDecodingPress it cannot see the "
                "other layers"
            )
        scores, counts = self._plan.pop(owner)
        counts = counts.to(keys.device)
        return scores.to(keys.device), (counts[None] if self.per_head else int(counts[0]))

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        """Pull the press's scores (planned, or scored here), spend the budget on them, and have the press keep
        the counts it is given (:meth:`PhaseAwarePress.compress_windows`)."""
        press = self.press
        press.validate()
        _check_positions(press, hidden_states, keys.shape[2])
        layout = press.layout_for(module, keys)
        if press.compression_ratio == 0 or layout.n_windows == 0:  # nothing to spend: the press keeps the layer
            return press.compress(module, hidden_states, keys, values, attentions, kwargs)
        if self.across_layers:
            scores, counts = self.planned(module, keys)
        else:
            scores = press.score(module, hidden_states, keys, values, attentions, kwargs)
            counts = self.head_counts(scores, layout)
        return press.compress(module, hidden_states, keys, values, attentions, kwargs, scores=scores, counts=counts)


@dataclass
class HeadBudgetPress(BudgetPress):
    """Each layer's raw-token budget spread by score across its KV heads (each head its own tokens; the padding of
    shorter heads is not stored: the layer is stored ragged, see the module docstring). ``floor=1.0``: every head its
    own best ``n_windows * k`` tokens."""

    per_head: ClassVar[bool] = True


@dataclass
class LayerBudgetPress(BudgetPress):
    """One raw-token budget for the whole model, spread by score across layers (the KV heads of a layer share their
    tokens; every layer is dense at its own length, so the entries saved free memory)."""

    across_layers: ClassVar[bool] = True


@dataclass
class GlobalBudgetPress(BudgetPress):
    """One raw-token budget for the whole model, spread by score across layers and KV heads together (KVzip's shape;
    each layer stored ragged, every KV head at its own length, see the module docstring)."""

    across_layers: ClassVar[bool] = True
    per_head: ClassVar[bool] = True


@dataclass
class ThresholdBudgetPress(BudgetPress):
    """The budget over the model decided layer by layer: every KV head of every layer keeps the window tokens whose
    score exceeds one threshold, compressed as soon as its layer is computed (the prefill never holds the whole
    uncompressed cache, as a budget across layers does), each head at its own length (stored ragged, as
    :class:`GlobalBudgetPress`).

    The threshold is the score that the press's share of window tokens kept (``k / window``) exceeds on the
    scorer's calibration text (:class:`~kvpress_phase.presses.learned_scorer.ScoreQuantiles`, the
    ``thresholds.json`` that ``kvpress-phase calibrate-scorer`` writes beside the scorer): on text like it, the
    model keeps about the budget that :class:`GlobalBudgetPress` spends exactly, and the same entries where the
    scores rank alike; on other text the share kept follows the scores (the press's ``stats`` record it). This is
    how kvpress's ``DMSPress`` uses KVzap's scores, applied to :class:`~kvpress_phase.PhaseAwarePress`'s windows.
    It needs scores on one scale for every layer: the learned ``scorer="kvzap"``.

    Parameters
    ----------
    threshold : float, optional
        The score threshold itself; by default it is read from the scorer's calibration (``scorer="kvzap"``).
    floor : float, default 0.0
        Every KV head keeps at least its ``floor`` share of the even budget (its best tokens).
    """

    threshold: Optional[float] = None
    _quantiles: object = field(default=None, init=False, repr=False, compare=False)

    per_head: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        if self.threshold is not None:
            if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) \
                    or not math.isfinite(self.threshold):
                raise ValueError(f"threshold must be a finite number or None, got {self.threshold!r}")
        elif not isinstance(self.press.scorer, LocalKVzapPress):
            raise ValueError("ThresholdBudgetPress without threshold= reads the learned scorer's calibration: the "
                             "press needs scorer='kvzap' (PhaseAwarePress(ratio, scorer='kvzap')), got "
                             f"{type(self.press.scorer).__name__}; or give threshold=")

    def post_init_from_model(self, model):
        super().post_init_from_model(model)
        if self.threshold is None:
            self._quantiles = ScoreQuantiles.load(self.press.scorer.kvzap_model_name)

    def layer_threshold(self, layout: WindowLayout) -> float:
        """The threshold for a layer laid out as ``layout``: :attr:`threshold`, or the calibrated score that the
        share ``k / window`` of the calibration scores exceeds."""
        if self.threshold is not None:
            return float(self.threshold)
        if self._quantiles is None:
            raise ValueError("ThresholdBudgetPress reads its scorer's calibration in post_init_from_model(model): use "
                             "the press as a context manager (`with press(model): ...`) or through kvpress's pipeline")
        return self._quantiles.threshold(layout.k / layout.window)

    def head_counts(self, scores: torch.Tensor, layout: WindowLayout) -> torch.Tensor:
        """Each KV head's window tokens scoring above the threshold (at least its floor): ``(batch, heads)``."""
        win = scores.float().gather(2, layout.window_positions().flatten(2))  # (batch, heads, window tokens)
        counts = (win > self.layer_threshold(layout)).sum(dim=-1)
        return counts.clamp(min=min(int(self.floor * layout.n_windows * layout.k), win.shape[-1]))


def budget_of(press) -> str:
    """The name of the budget wrapper ``press`` is (for error messages), or ``""``."""
    return type(press).__name__ if isinstance(press, BudgetPress) else ""


__all__ = ["BudgetPress", "HeadBudgetPress", "LayerBudgetPress", "GlobalBudgetPress", "ThresholdBudgetPress",
           "budget_of"]
