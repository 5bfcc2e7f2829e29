"""Budgets over the model for :class:`~kvpress_phase.PhaseAwarePress`, as wrappers (as kvpress's ``AdaKVPress(press)``).

``PhaseAwarePress`` alone keeps the same number of raw tokens in every layer and KV head (``n_windows * k``), the
KV heads of a layer sharing one choice. A wrapper keeps the same total but spends it by score:

- :class:`HeadBudgetPress`: across the KV heads of each layer (each head its own tokens: used as a context manager,
  as kvpress's pipeline uses it, each layer is stored ragged as soon as it is compressed, each head only its own
  entries, and decoded with the ragged attention (:mod:`.storage`); called directly (``press.compress``, the replay
  engine) the press returns a layer padded to its longest head, the padding masked, as kvpress's ``AdaKVPress``
  masks);
- :class:`LayerBudgetPress`: across the layers (each layer dense at its own length, the heads sharing their
  tokens: the entries saved free memory);
- :class:`GlobalBudgetPress`: across layers and KV heads together (KVzip's shape; stored ragged like the per-head
  one);

(``ThresholdBudgetPress``, the same budget decided layer by layer by a calibrated score threshold, is retired to the
studies' ablations, :mod:`kvpress_phase.presses.ablations`: once the global budget is spent during the prefill it
has no measured advantage left, and it keeps more than its budget.)

A wrapper pulls what it needs from the press it wraps, as ``AdaKVPress`` pulls ``press.score``, and chooses the
entries itself (:class:`~kvpress_phase.presses.choice.RunningTopB`): from a ``PhaseAwarePress``, its scores and
window layout (its window tokens compete, its sink, local and leftover tokens are kept); from any kvpress
``ScorerPress`` (``GlobalBudgetPress(KnormPress(0.5))``), its scores (every token competes for kvpress's own
``int(n * (1 - ratio))`` entries per row). Nothing is pushed back into the wrapped press, and the scorer runs once
per layer and prefill.

A budget across layers is spent while the prefill runs, layer by layer, exactly: each layer is scored inside its own
forward (its attention input and keys are there), and only its scores are kept. The layer's entries that are in the
running top-``B`` over every layer scored so far (``B`` the model's budget; floors and the protected sink and local
tokens outside the competition, :class:`~kvpress_phase.presses.choice.RunningTopB`) are stored at once, and entries of
earlier layers that drop out of it are evicted; the layers holding most evicted rows are compacted whenever those
pass :data:`EVICTED_SHARE` of what is stored, and every layer when the last one has been scored. Because the top-``B`` of
all layers is a subset of every running top-``B``, the final cache is exactly the choice the budget makes over all
layers at once (:func:`~kvpress_phase.presses.choice.spread_budget`); the prefill never holds a layer's hidden
states or more than its budget and one layer's keys and values. A scorer that needs the whole context (KVzip's
reconstruction, ``scorer.needs_context``) cannot score during the prefill: the press then lets the prefill finish
uncompressed (the whole cache in memory, as kvpress's ``KVzipPress``) and spends the budget layer by layer after it,
the same way. Scores must compare between layers: KeyDiff's cosine similarities are scale-free but rank layers
poorly; the learned KVzip+ surrogate (``scorer="kvzap"``, :mod:`kvpress_phase.presses.learned_scorer`) predicts one
log score on one scale for every layer. Results: ``docs/results/r7-learned-budgets.md``; memory:
``docs/benchmarks.md``.

How a compressed layer is stored (dense, or ragged when its KV heads keep different numbers of entries) is decided
in one place, :mod:`kvpress_phase.presses.storage`.

    press = GlobalBudgetPress(PhaseAwarePress(0.5, scorer="kvzap"))
    pipe(context, question=question, press=press)
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import ClassVar, Optional, Union

import torch
from kvpress import BasePress, ScorerPress
from kvpress.presses.base_press import is_prefilling
from torch import nn
from transformers import QuantizedCache

from kvpress_phase.core.phase import WindowLayout, check_number
from kvpress_phase.presses.base import WindowedPress, _check_positions, compressing
from kvpress_phase.presses.choice import RunningTopB, floor_keyed, raw_tokens, spread_budget
from kvpress_phase.presses.phase_aware_press import PhaseAwarePress
from kvpress_phase.presses.stats import LayerStats
from kvpress_phase.presses.storage import kept_positions, store_layer
from kvpress_phase.ragged import RaggedLayer

EVICTED_SHARE = 0.05
"""During the prefill of a budget across layers, the entries evicted (dropped out of the running top-``B``) but not yet
freed are held below this share of the entries stored: past it, the layers holding most of them are compacted."""


@dataclass
class Candidates:
    """Where a wrapper spends a layer's budget: the tokens that compete and what each row keeps on average.

    ``positions`` (``(heads, n)`` long) are the competing tokens of each KV head, in position order: the window tokens
    of a ``PhaseAwarePress`` (its sink, local and leftover tokens are kept outside the competition), or every token
    for a kvpress ``ScorerPress``; ``budget`` is what each row keeps of them when every row keeps the same
    (``n_windows * k``, or kvpress's ``int(n * (1 - compression_ratio))``); ``layout`` the press's window layout
    (None for a press without windows)."""

    positions: torch.Tensor
    budget: int
    layout: Optional[WindowLayout]


@dataclass
class BudgetPress(BasePress):
    """Common frame of the budget wrappers (see the module docstring); not used directly.

    Parameters
    ----------
    press : PhaseAwarePress or kvpress.ScorerPress
        The press whose budget is spread: a ``PhaseAwarePress`` (``residual="drop"``; its ratio, stride, scorer and
        protected tokens are used as they are: its window tokens compete) or any kvpress ``ScorerPress``
        (``KnormPress(0.5)``, ``SnapKVPress(0.5)``, ...: every token competes for ``int(n * (1 - ratio))`` entries
        per row). The wrapper pulls the press's scores (``press.score``) and chooses the entries itself.
    floor : float, default 0.0
        Every unit (a layer, or a KV head) first keeps its ``floor`` share of the even budget, its best tokens; the
        rest goes by score. In ``[0, 1]``; ``HeadBudgetPress(press, floor=1.0)`` is each head's own even budget.
    """

    press: Union[PhaseAwarePress, ScorerPress] = None
    floor: float = 0.0
    _plan: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _stream: object = field(default=None, init=False, repr=False, compare=False)
    _storing: bool = field(default=False, init=False, repr=False, compare=False)
    _stats: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    across_layers: ClassVar[bool] = False
    """Whether the budget is spread across layers (one budget for the whole model)."""
    per_head: ClassVar[bool] = False
    """Whether each KV head chooses its own tokens (stored ragged through the pipeline, masked when called directly)."""

    def __post_init__(self):
        name = type(self).__name__
        if isinstance(self.press, WindowedPress):
            if not isinstance(self.press, PhaseAwarePress):
                raise ValueError(f"{name} spreads a budget by score over a row: press must be a PhaseAwarePress or a "
                                 f"kvpress ScorerPress, got {type(self.press).__name__}, whose budget is fixed per "
                                 "window")
            if self.press.residual != "drop":
                raise ValueError(f"{name} spreads a raw-token budget by score, which needs the press's "
                                 f"residual='drop' (got residual={self.press.residual!r})")
        elif not isinstance(self.press, ScorerPress):
            raise ValueError(f"{name} pulls scores from the press it wraps: press must be a PhaseAwarePress or a kvpress "
                             f"ScorerPress (KnormPress, SnapKVPress, ...), got {type(self.press).__name__}")
        check_number("floor", self.floor, 0, 1, integer=False)

    # ------------------------------------------------------------------ what the press's users read
    @property
    def windowed(self) -> bool:
        """Whether the wrapped press has windows (a ``PhaseAwarePress``), rather than being a kvpress scorer."""
        return isinstance(self.press, WindowedPress)

    @property
    def compression_ratio(self) -> float:
        return self.press.compression_ratio

    @compression_ratio.setter
    def compression_ratio(self, value: float) -> None:
        self.press.compression_ratio = value

    @property
    def scorer(self):
        return self.press.scorer if self.windowed else self.press

    @property
    def stats(self) -> dict:
        """What the wrapper did to each layer (:class:`~kvpress_phase.presses.stats.LayerStats`), in the wrapped
        press's ``stats`` when it keeps one (a ``PhaseAwarePress``)."""
        return self.press.stats if self.windowed else self._stats

    @property
    def plans_across_layers(self) -> bool:
        """Whether every layer's scores are needed before any layer is compressed."""
        return self.across_layers and self.press.compression_ratio > 0

    def post_init_from_model(self, model):
        self.press.post_init_from_model(model)

    # ------------------------------------------------------------------ pulled from the press
    def candidates(self, module: nn.Module, keys: torch.Tensor) -> Candidates:
        """The tokens of this layer that compete for its budget (:class:`Candidates`)."""
        heads, n = keys.shape[1], keys.shape[2]
        if self.windowed:
            layout = self.press.layout_for(module, keys)
            return Candidates(layout.window_positions()[0].flatten(1), layout.n_windows * layout.k, layout)
        positions = torch.arange(n, device=keys.device).expand(heads, n)
        return Candidates(positions, int(n * (1 - self.press.compression_ratio)), None)

    def scores(self, module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        """The press's scores of the layer, ``(batch, kv_heads, n)`` float32 (``press.score``, as kvpress's
        ``AdaKVPress`` pulls them)."""
        return self.press.score(module, hidden_states, keys, values, attentions, kwargs).float()

    def units(self, scores: torch.Tensor, cand: Candidates) -> torch.Tensor:
        """One batch row's competing tokens' scores: ``(rows, T)``, a row per KV head (per-head budgets) or one for
        the layer (the heads' mean)."""
        win = scores.gather(1, cand.positions)
        return win if self.per_head else win.mean(dim=0, keepdim=True)

    def keyed(self, scores: torch.Tensor, cand: Candidates) -> torch.Tensor:
        """:meth:`units` as ranked, each row's floor raised to ``+inf`` (:func:`floor_keyed`)."""
        return floor_keyed(self.units(scores, cand), cand.budget, self.floor)

    def _active(self, cand: Candidates) -> bool:
        return self.press.compression_ratio > 0 and cand.positions.shape[1] > 0 and \
            (cand.layout is None or cand.layout.n_windows > 0)

    # ------------------------------------------------------------------ the budget within a layer
    def row_counts(self, scores: torch.Tensor, cand: Candidates) -> torch.Tensor:
        """One batch row's counts within the layer: ``(rows,)`` entries each row keeps of its competing tokens, the
        layer's ``rows * budget`` spread by score (:func:`spread_budget`)."""
        return spread_budget([self.units(scores, cand)], [cand.budget], self.floor)[0]

    def keep_of(self, scores: torch.Tensor, cand: Candidates, counts: torch.Tensor) -> torch.Tensor:
        """``(batch, heads, n)`` bool: the entries each batch row keeps given its rows' counts (``(batch, rows)``):
        every token that does not compete, and each row's best ``counts`` competing tokens (a ``PhaseAwarePress``'s
        own choice, :func:`~kvpress_phase.presses.choice.raw_tokens`, with its ``recent`` block)."""
        batch, heads, n = scores.shape
        if self.windowed:
            n_raw = counts if self.per_head else int(counts.flatten()[0])
            return raw_tokens(scores, cand.layout, n_raw, share_heads=not self.per_head, recent=self.press.recent)
        out = []
        for row_scores, row_counts in zip(scores, counts):
            keyed = self.keyed(row_scores, cand)
            order = keyed.argsort(dim=-1, descending=True, stable=True)
            rank = torch.empty_like(order).scatter_(
                -1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order).contiguous())
            chosen = (rank < row_counts[:, None]).expand(heads, -1)
            out.append(torch.ones(heads, n, dtype=torch.bool, device=scores.device).scatter(1, cand.positions, chosen))
        return torch.stack(out)

    # ------------------------------------------------------------------ kvpress's context manager
    @contextlib.contextmanager
    def __call__(self, model):
        """kvpress's context manager. Every layer is compressed inside its own forward (:meth:`forward_hook`), a
        budget across layers by the running top-``B`` (module docstring); with a scorer that needs the whole context
        every layer is compressed, the same way, when the prefill has finished. The layers are written by
        :func:`~kvpress_phase.presses.storage.store_layer` (ragged where KV heads keep different numbers of entries),
        and a prefill that leaves ragged layers has the model decode them with the ragged attention
        (:func:`~kvpress_phase.presses.storage.decoding_attention`)."""
        self._stream = None
        if self.across_layers and self.press.compression_ratio > 0 and getattr(self.press, "recent", 0) > 0:
            raise ValueError(f"{type(self).__name__} spends its budget while the prefill runs, layer by layer, and "
                             f"evicts what drops out of it, so it cannot keep a recent block sized by each row's final "
                             f"count: use PhaseAwarePress(recent=0) (got recent={self.press.recent:g}), or "
                             "HeadBudgetPress for a budget within each layer")
        self._storing = True
        try:
            with compressing(self, model, stores_ragged=self.per_head):
                yield
            self._finish_stream()
        finally:
            self._storing, self._stream = False, None

    def forward_hook(self, module, input, kwargs, output):
        """kvpress's hook, after each attention layer's forward: during the prefill, compress the layer's cache
        (:meth:`compress_cached`). Called by another press's context (kvpress's ``ComposedPress``), a budget within
        the layer leaves its padding masked, as kvpress's per-head presses do, and a budget across layers refuses
        (:meth:`planned`): it needs to see every layer."""
        if not self._storing:
            return BasePress.forward_hook(self, module, input, kwargs, output)
        if is_prefilling(kwargs["cache_position"], kwargs["hidden_states"].shape[1]):
            self.compress_cached(module, kwargs["hidden_states"], kwargs["past_key_values"], output[1], kwargs)
        return output

    def compress_cached(self, module, hidden_states, cache, attentions, kwargs) -> None:
        """Compress layer ``module.layer_idx`` of ``cache`` in place, and store it (module docstring): a budget
        within the layer, or the layer's share of the running budget across layers."""
        layer_idx = module.layer_idx
        if isinstance(cache, QuantizedCache):
            raise ValueError(f"{type(self).__name__} stores its layers itself (each KV head at its own length), which "
                             "a QuantizedCache does not support: use a DynamicCache")
        keys, values = cache.layers[layer_idx].keys, cache.layers[layer_idx].values
        if keys.shape[0] != 1 and (self.per_head or self.across_layers):
            raise ValueError(f"{type(self).__name__} stores each KV head at its own length and spends one budget per "
                             f"context, one context at a time (batch 1), got batch {keys.shape[0]}")
        self._validate(hidden_states, keys)
        cand = self.candidates(module, keys)
        if not self._active(cand):
            self._record(module, keys, values, None, cand)
            return
        if self.across_layers:
            self._stream_layer(module, hidden_states, cache, keys, values, attentions, kwargs, cand)
            return
        if keys.shape[0] != 1:  # a budget within the layer over a batch: every head keeps the same count
            cache.layers[layer_idx].keys, cache.layers[layer_idx].values = self.compress(
                module, hidden_states, keys, values, attentions, kwargs)
            return
        scores = self.scores(module, hidden_states, keys, values, attentions, kwargs)
        keep = self.keep_of(scores, cand, self.row_counts(scores[0], cand)[None])[0]
        ragged = store_layer(cache, layer_idx, keys, values, keep, seq_length=int(keep.sum(dim=-1).max()))
        self._record(module, keys, values, keep[None], cand, ragged=ragged)

    def _validate(self, hidden_states, keys) -> None:
        if self.windowed:
            self.press.validate()
            _check_positions(self.press, hidden_states, keys.shape[2])

    def _record(self, module, keys, values, keep, cand: Candidates, *, ragged: bool = False) -> None:
        """``stats[layer]`` for a layer that keeps ``keep`` (``(batch, heads, n)`` bool; None: every entry)."""
        self._record_shape(module, tuple(keys.shape[:3]),
                           keys.shape[-1] * keys.element_size() + values.shape[-1] * values.element_size(),
                           keep, cand, ragged=ragged)

    def _record_shape(self, module, shape: tuple, entry_bytes: int, keep, cand: Candidates, *,
                      ragged: bool = False) -> None:
        batch, heads, n = shape
        ratio = self.press.compression_ratio
        window_ratio = self.press.window_ratio if self.windowed and ratio > 0 else (0.0 if self.windowed else None)
        layer_idx = getattr(module, "layer_idx", 0)
        if keep is None:
            self.stats[layer_idx] = LayerStats(n, n, 0.0, cand.layout if ratio > 0 else None, None,
                                               requested_ratio=ratio, window_ratio=window_ratio, batch=batch,
                                               heads=heads, entry_bytes=entry_bytes)
            return
        positions, masked = kept_positions(keep.flatten(0, 1))
        positions = positions.view(batch, heads, -1)
        attended = keep.sum().item() / (batch * heads)
        self.stats[layer_idx] = LayerStats(
            n, positions.shape[-1], 1.0 - attended / n, cand.layout, positions.to(torch.int32),
            (positions + 1).to(torch.int32), requested_ratio=ratio, window_ratio=window_ratio, masked=masked,
            batch=batch, heads=heads, entry_bytes=entry_bytes, ragged=ragged and masked is not None,
        )

    # ------------------------------------------------------------------ the running budget across layers
    def _stream_layer(self, module, hidden_states, cache, keys, values, attentions, kwargs, cand) -> None:
        layer_idx = module.layer_idx
        stream = self._stream
        rows = keys.shape[1] if self.per_head else 1
        if stream is None or layer_idx in stream.layers:  # a new prefill
            self._finish_stream()
            n_layers = _n_layers(module, cache)
            stream = self._stream = _Stream(RunningTopB(n_layers * rows * cand.budget), cache, n_layers)
        scores = self.scores(module, hidden_states, keys, values, attentions, kwargs)[0]
        lost = stream.top.add(layer_idx, self.keyed(scores, cand))
        record = stream.layers[layer_idx] = _StreamedLayer(module, cand, keys.shape, rows,
                                                           keys.shape[-1] * keys.element_size()
                                                           + values.shape[-1] * values.element_size())
        record.keep = record.keep_of(stream.top.alive(layer_idx))
        store_layer(cache, layer_idx, keys, values, record.keep, seq_length=keys.shape[2])
        record.stored, record.n_stored = record.keep, int(record.keep.sum())
        for other in lost:
            stream.evict(other, compact=False)
        stream.bound_evicted()
        if len(stream.layers) == stream.n_layers:
            self._finish_stream()

    def _finish_stream(self) -> None:
        """Trim to the budget of the layers that came (all of them, normally), compact every layer to exactly its
        kept entries and record each layer's :class:`LayerStats`."""
        stream, self._stream = self._stream, None
        if stream is None or stream.finished:
            return
        stream.finished = True
        stream.top.finish(sum(r.rows * r.cand.budget for r in stream.layers.values()))
        cache = stream.cache()
        for layer_idx, record in sorted(stream.layers.items()):
            stream.evict(layer_idx, compact=True)
            layer = cache.layers[layer_idx] if cache is not None else None
            longest = int(record.stored.sum(dim=-1).max())
            if layer is not None and hasattr(layer, "base_length"):
                layer.base_length, layer.appended = longest, 0  # the masked cache's length, as the replay keeps it
            self._record_shape(record.module, record.shape[:3], record.entry_bytes, record.stored[None], record.cand,
                               ragged=isinstance(layer, RaggedLayer))

    # ------------------------------------------------------------------ called directly (the evaluation's replay)
    def plan(self, layers) -> None:
        """Decide every layer's counts from every layer's scores (budgets across layers) before any layer is
        compressed: for a caller that holds every layer's prefill inputs and calls :meth:`compress` per layer after
        it (the evaluation's replay). Through kvpress's pipeline the same choice is made while the prefill runs,
        without holding them (:meth:`compress_cached`). ``layers`` yields ``(module, hidden_states, keys, values,
        attentions, kwargs)`` per layer, what :meth:`compress` receives.

        Each layer's scores (``(kv_heads, seq_len)`` float32, small next to the layer's keys and values) are held with
        its counts until the next :meth:`compress` of that layer, which releases them; whatever a previous prefill
        left unused is released when the next plan starts."""
        self._plan = {}
        if not self.plans_across_layers:
            return
        units, budgets, owners = [], [], []
        for module, hidden_states, keys, values, attentions, kwargs in layers:
            if keys.shape[0] != 1:
                raise ValueError(f"{type(self).__name__} plans one context at a time (batch 1), got batch "
                                 f"{keys.shape[0]}")
            cand = self.candidates(module, keys)
            if not self._active(cand):
                continue
            scores = self.scores(module, hidden_states, keys, values, attentions, kwargs)[0]
            units.append(self.units(scores, cand))
            budgets.append(cand.budget)
            owners.append(((getattr(module, "layer_idx", 0), keys.shape[2]), scores))
        # every layer at once, as the pipeline's running top-B ends (tests/presses/test_running_budget.py)
        for (owner, scores), counts in zip(owners, spread_budget(units, budgets, self.floor)):
            self._plan[owner] = (scores, counts)

    def planned(self, module: nn.Module, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The scores and counts :meth:`plan` held for this layer (released from the plan)."""
        owner = (getattr(module, "layer_idx", 0), keys.shape[2])
        if owner not in self._plan:
            raise ValueError(
                f"{type(self).__name__} spends its budget across layers, so it needs every layer's scores before "
                "compressing any: use it on its own (pipeline(..., press=...) spends it while the prefill runs), or "
                "call press.plan(...) with every layer's inputs first; inside ComposedPress, PerLayerWindowedPress "
                "or WindowedDecodingPress it cannot see the other layers"
            )
        scores, counts = self._plan.pop(owner)
        return scores.to(keys.device), counts.to(keys.device)

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        """kvpress's compress step, for callers that call it directly (the evaluation's replay, ``ComposedPress``):
        the layer's entries as a dense ``(batch, heads, longest, dim)`` pair, each KV head its own entries, a shorter
        head padded, the padding in kvpress's ``module.masked_key_indices`` (as kvpress's ``AdaKVPress`` masks)."""
        self._validate(hidden_states, keys)
        cand = self.candidates(module, keys)
        if not self._active(cand):
            self._record(module, keys, values, None, cand)
            return keys, values
        if self.across_layers:
            scores, counts = self.planned(module, keys)
            keep = self.keep_of(scores[None], cand, counts[None])
        else:
            scores = self.scores(module, hidden_states, keys, values, attentions, kwargs)
            keep = self.keep_of(scores, cand, torch.stack([self.row_counts(s, cand) for s in scores]))
        counts = keep.sum(dim=-1)
        longest = int(counts.max())
        if keys.shape[0] > 1 and bool((counts != longest).any()):
            raise ValueError(f"{type(self).__name__} gives KV heads their own numbers of entries, which a batch of "
                             f"{keys.shape[0]} sequences cannot hold in one dense layer here: use batch 1")
        idx = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)[..., :longest]
        new_keys = keys.gather(2, idx[..., None].expand(-1, -1, -1, keys.shape[-1]))
        new_values = values.gather(2, idx[..., None].expand(-1, -1, -1, values.shape[-1]))
        self._record(module, keys, values, keep, cand)
        masked = self.stats[getattr(module, "layer_idx", 0)].masked
        if masked is not None:
            heads, slots = masked
            module.masked_key_indices = (torch.zeros_like(heads), heads, slots)
        return new_keys, new_values


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


class _StreamedLayer:
    """What the running budget keeps of one layer while the prefill runs: where its window tokens are, and which of
    its entries are kept (``keep``) and stored (``stored``, kept plus those evicted but not yet compacted), each a
    ``(heads, seq_len)`` bool."""

    def __init__(self, module, cand: Candidates, shape, rows: int, entry_bytes: int):
        self.module, self.cand, self.shape, self.rows = module, cand, tuple(shape), rows
        self.entry_bytes = entry_bytes
        self.keep = self.stored = None
        self.n_stored = self.evicted = 0  # entries stored; of them, evicted and not yet freed

    def keep_of(self, alive: torch.Tensor) -> torch.Tensor:
        """``(heads, seq_len)``: every token that does not compete (a ``PhaseAwarePress``'s protected ones), and the
        competing tokens ``alive`` (``(rows, T)``, one row shared by every head when the heads share their tokens)."""
        heads, seq_len = self.shape[1], self.shape[2]
        keep = torch.ones(heads, seq_len, dtype=torch.bool, device=alive.device)
        return keep.scatter(1, self.cand.positions, alive.expand(heads, -1))


class _Stream:
    """One prefill's running budget: the running top-``B`` and every layer scored so far."""

    def __init__(self, top: RunningTopB, cache, n_layers: int):
        self.top, self.n_layers, self.finished = top, n_layers, False
        self.cache = weakref.ref(cache)
        self.layers: dict = {}

    def bound_evicted(self) -> None:
        """Compact the layers holding most evicted entries until those are at most :data:`EVICTED_SHARE` of the
        entries stored."""
        pending = {i: r.evicted for i, r in self.layers.items() if r.evicted}
        stored = sum(r.n_stored for r in self.layers.values())
        total = sum(pending.values())
        while pending and total > EVICTED_SHARE * stored:
            layer_idx = max(pending, key=pending.get)
            total -= pending.pop(layer_idx)
            stored -= self.layers[layer_idx].evicted
            self.evict(layer_idx, compact=True)

    def evict(self, layer_idx: int, *, compact: bool) -> None:
        """Bring ``layer_idx``'s kept entries up to date, and with ``compact`` free its evicted ones."""
        record = self.layers[layer_idx]
        record.keep = record.keep_of(self.top.alive(layer_idx))
        record.evicted = int((record.stored & ~record.keep).sum())
        if record.evicted == 0 or not compact:
            return
        cache = self.cache()
        if cache is None:
            return
        layer = cache.layers[layer_idx]
        kept = record.keep[record.stored]  # over the stored entries, head after head, each in position order
        if isinstance(layer, RaggedLayer):
            layer.retain(kept)
        else:  # a dense layer: every head stores the same number
            heads = record.shape[1]
            keep_rows = kept.view(heads, -1)
            counts = keep_rows.sum(dim=-1)
            if bool((counts == counts[0]).all()):
                idx = torch.argsort((~keep_rows).to(torch.int8), dim=-1, stable=True)[:, :int(counts[0])]
                take = idx[None, :, :, None]
                layer.keys = layer.keys.gather(2, take.expand(-1, -1, -1, layer.keys.shape[-1]))
                layer.values = layer.values.gather(2, take.expand(-1, -1, -1, layer.values.shape[-1]))
            else:
                store_layer(cache, layer_idx, layer.keys, layer.values, keep_rows)
        record.stored, record.evicted = record.keep, 0
        record.n_stored = int(record.stored.sum())


def _n_layers(module, cache) -> int:
    """How many attention layers the prefill runs through (the model's, else the cache's)."""
    return getattr(getattr(module, "config", None), "num_hidden_layers", None) or len(cache.layers)


def is_budget(press) -> bool:
    """Whether ``press`` is one of the budget wrappers (:class:`BudgetPress`)."""
    return isinstance(press, BudgetPress)


__all__ = ["BudgetPress", "HeadBudgetPress", "LayerBudgetPress", "GlobalBudgetPress",
           "is_budget"]
