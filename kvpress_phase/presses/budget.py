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

A wrapper pulls what it needs from the press it wraps, as ``AdaKVPress`` pulls ``press.score``: the scores
(:meth:`~kvpress_phase.presses.base.WindowedPress.score`) and the layout, from which it decides how many window tokens
each row keeps raw; it then hands the press the scores and those counts (``press.compress(..., scores=...,
counts=...)``), whose choice (:meth:`~kvpress_phase.PhaseAwarePress.compress_windows`) is a function of them alone.
The press holds no state of the wrapper's and calls nothing back; the scorer runs once per layer and prefill.

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
import math
import weakref
from dataclasses import dataclass, field
from typing import ClassVar, Optional, Union

import torch
from kvpress import BasePress
from torch import nn

from kvpress_phase.core.phase import WindowLayout, check_number
from kvpress.presses.base_press import is_prefilling
from transformers import QuantizedCache

from kvpress_phase.presses.base import _check_positions, _compress_after_prefill
from kvpress_phase.presses.choice import RunningTopB, floor_keyed, spread_budget
from kvpress_phase.presses.phase_aware_press import PhaseAwarePress
from kvpress_phase.presses.stats import LayerStats
from kvpress_phase.presses.storage import decoding_attention, kept_positions, store_layer
from kvpress_phase.ragged import RaggedLayer

EVICTED_SHARE = 0.05
"""During the prefill of a budget across layers, the entries evicted (dropped out of the running top-``B``) but not yet
freed are held below this share of the entries stored: past it, the layers holding most of them are compacted."""


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
    _stream: object = field(default=None, init=False, repr=False, compare=False)
    _storing: bool = field(default=False, init=False, repr=False, compare=False)

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
        """kvpress's context manager. Every layer is compressed inside its own forward (:meth:`forward_hook`), a
        budget across layers by the running top-``B`` (module docstring); with a scorer that needs the whole context
        every layer is compressed, the same way, when the prefill has finished. The layers are written by
        :func:`~kvpress_phase.presses.storage.store_layer` (ragged where KV heads keep different numbers of entries),
        and a prefill that leaves ragged layers has the model decode them with the ragged attention
        (:func:`~kvpress_phase.presses.storage.decoding_attention`)."""
        self._stream = None
        if self.across_layers and self.press.compression_ratio > 0 and self.press.recent > 0:
            raise ValueError(f"{type(self).__name__} spends its budget while the prefill runs, layer by layer, and "
                             f"evicts what drops out of it, so it cannot keep a recent block sized by each row's final "
                             f"count: use PhaseAwarePress(recent=0) (got recent={self.press.recent:g}), or "
                             "HeadBudgetPress for a budget within each layer")
        self._storing = True
        try:
            with decoding_attention(self, model, stores_ragged=self.per_head):
                if not getattr(self.press.scorer, "needs_context", False):
                    with BasePress.__call__(self, model):
                        yield
                else:
                    with _compress_after_prefill(self, model):
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
        within the layer (:meth:`compress`), or the layer's share of the running budget across layers."""
        layer_idx = module.layer_idx
        if isinstance(cache, QuantizedCache):
            raise ValueError(f"{type(self).__name__} stores its layers itself (each KV head at its own length), which "
                             "a QuantizedCache does not support: use a DynamicCache")
        keys, values = cache.layers[layer_idx].keys, cache.layers[layer_idx].values
        if self.per_head and keys.shape[0] != 1:
            raise ValueError(f"{type(self).__name__} stores each KV head at its own length, one context at a time "
                             f"(batch 1), got batch {keys.shape[0]}")
        layout = self.press.layout_for(module, keys)
        if self.across_layers and self.press.compression_ratio > 0 and layout.n_windows > 0:
            self._stream_layer(module, hidden_states, cache, keys, values, attentions, kwargs, layout)
            return
        keys, values = self.compress(module, hidden_states, keys, values, attentions, kwargs)
        masked = getattr(module, "masked_key_indices", None)
        if masked is None:
            store_layer(cache, layer_idx, keys, values)
            return
        keep = torch.ones(keys.shape[1], keys.shape[2], dtype=torch.bool, device=keys.device)
        keep[masked[1], masked[2]] = False
        module.masked_key_indices = None
        if store_layer(cache, layer_idx, keys, values, keep, seq_length=keys.shape[2]) and layer_idx in self.stats:
            self.stats[layer_idx].ragged = True

    # ------------------------------------------------------------------ the running budget across layers
    def _stream_layer(self, module, hidden_states, cache, keys, values, attentions, kwargs, layout) -> None:
        press, layer_idx = self.press, module.layer_idx
        press.validate()
        _check_positions(press, hidden_states, keys.shape[2])
        if keys.shape[0] != 1:
            raise ValueError(f"{type(self).__name__} spends one budget over the layers of one context at a time "
                             f"(batch 1), got batch {keys.shape[0]}")
        stream = self._stream
        if stream is None or layer_idx in stream.layers:  # a new prefill
            self._finish_stream()
            n_layers = len(_attention_layers(module, cache))
            rows = keys.shape[1] if self.per_head else 1
            stream = self._stream = _Stream(RunningTopB(n_layers * rows * layout.n_windows * layout.k), cache,
                                            n_layers)
        scores = press.score(module, hidden_states, keys, values, attentions, kwargs)
        win_pos = layout.window_positions()[0].flatten(1)  # (heads, window tokens)
        win = scores.float()[0].gather(1, win_pos)
        unit = win if self.per_head else win.mean(dim=0, keepdim=True)
        budget = layout.n_windows * layout.k
        lost = stream.top.add(layer_idx, floor_keyed(unit, budget, self.floor))
        stream.layers[layer_idx] = _StreamedLayer(module, layout, win_pos, keys.shape, budget,
                                                  keys.shape[-1] * keys.element_size()
                                                  + values.shape[-1] * values.element_size())
        record = stream.layers[layer_idx]
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
        total = sum(r.rows(self.per_head) * r.budget for r in stream.layers.values())
        for other in stream.top.finish(total):
            stream.layers[other].keep = stream.layers[other].keep_of(stream.top.alive(other))
        press = self.press
        for layer_idx, record in sorted(stream.layers.items()):
            stream.evict(layer_idx, compact=True)
            positions, masked = kept_positions(record.stored)
            longest = positions.shape[-1]
            layer = stream.cache().layers[layer_idx] if stream.cache() is not None else None
            if layer is not None and hasattr(layer, "base_length"):
                layer.base_length, layer.appended = longest, 0  # the masked cache's length, as the replay keeps it
            batch, heads, seq_len, _ = record.shape
            attended = record.stored.sum().item() / heads
            press.stats[layer_idx] = LayerStats(
                seq_len, longest, 1.0 - attended / seq_len, record.layout, positions.to(torch.int32),
                (positions + 1).to(torch.int32), requested_ratio=press.compression_ratio,
                window_ratio=press.window_ratio, masked=masked, batch=batch, heads=heads,
                entry_bytes=record.entry_bytes, ragged=masked is not None,
            )

    # ------------------------------------------------------------------ the budget
    def plan(self, layers) -> None:
        """Score every layer once and decide its raw-token counts from every layer's scores (budgets across layers),
        before any layer is compressed: for a caller that holds every layer's prefill inputs and calls
        :meth:`compress` per layer after it (the evaluation's replay). Through kvpress's pipeline the same choice is
        made while the prefill runs, without holding them (:meth:`compress_cached`). ``layers`` yields ``(module, hidden_states, keys, values, attentions,
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
                "compressing any: use it on its own (pipeline(..., press=...) spends it while the prefill runs), or "
                "call press.plan(...) with every layer's inputs first; inside ComposedPress, PerLayerWindowedPress or WindowedDecodingPress it cannot see the "
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


class _StreamedLayer:
    """What the running budget keeps of one layer while the prefill runs: where its window tokens are, and which of
    its entries are kept (``keep``) and stored (``stored``, kept plus those evicted but not yet compacted), each a
    ``(heads, seq_len)`` bool."""

    def __init__(self, module, layout, win_pos, shape, budget, entry_bytes):
        self.module, self.layout, self.win_pos, self.shape = module, layout, win_pos, tuple(shape)
        self.budget, self.entry_bytes = budget, entry_bytes
        self.keep = self.stored = None
        self.n_stored = self.evicted = 0  # entries stored; of them, evicted and not yet freed

    def rows(self, per_head: bool) -> int:
        return self.shape[1] if per_head else 1

    def keep_of(self, alive: torch.Tensor) -> torch.Tensor:
        """``(heads, seq_len)``: every token outside the windows (protected), and the window tokens ``alive``
        (``(rows, window tokens)``, one row shared by every head when the heads share their tokens)."""
        heads, seq_len = self.shape[1], self.shape[2]
        keep = torch.ones(heads, seq_len, dtype=torch.bool, device=alive.device)
        return keep.scatter(1, self.win_pos, alive.expand(heads, -1))


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


def _attention_layers(module, cache) -> list:
    """The attention layers the prefill runs through (one per cache layer the model has)."""
    config = getattr(module, "config", None)
    n = getattr(config, "num_hidden_layers", None)
    return list(range(n)) if n else list(range(len(cache.layers)))


def budget_of(press) -> str:
    """The name of the budget wrapper ``press`` is (for error messages), or ``""``."""
    return type(press).__name__ if isinstance(press, BudgetPress) else ""


__all__ = ["BudgetPress", "HeadBudgetPress", "LayerBudgetPress", "GlobalBudgetPress",
           "budget_of"]
