"""What a press records about each layer it compressed (``press.stats``), and the whole cache in one figure.

``press.stats[layer_idx]`` is a :class:`LayerStats`; :func:`cache_summary` adds them up over every layer into a
:class:`CacheSummary` (entries kept, achieved ratio, bytes stored and bytes attended)::

    summary = cache_summary(press)        # after a prefill: the press, or its ``stats`` dict
    summary.achieved_ratio, summary.bytes_stored, summary.as_dict()

Its own module so that both the compress step (:mod:`.base`) and the decoding step (:mod:`.decoding`) can build
records without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from kvpress_phase.core.phase import WindowLayout


@dataclass
class LayerStats:
    """What a press did to one layer's cache during the last prefill.

    Its scalar fields and entry counts as a plain dict: :meth:`as_dict`; the whole cache: :func:`cache_summary`.
    """

    seq_len: int
    """Tokens the layer's cache held before compression (the prefill)."""
    compressed_length: int
    """Entries per row (one sequence's KV head) stored after compression: the cache's length for this layer."""
    achieved_ratio: float
    """``1 - attended / seq_len`` per row: the fraction of the layer's cache removed, masked entries counted as
    removed (they are not attended)."""
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
    """``(head_indices, seq_indices)`` of the slots that only pad a KV head with a smaller budget than the layer's
    longest (the per-head budgets of ``HeadBudgetPress`` and ``GlobalBudgetPress``), in the dense layout the press
    returned; ``None`` when there are none. Masked while decoding, or not stored at all where the layer is stored
    ragged (:attr:`ragged`). ``compressed_length`` counts them (the dense length); ``achieved_ratio`` does not
    (they are not attended)."""
    batch: Optional[int] = None
    """Sequences in the batch compressed (``None``: not recorded)."""
    heads: Optional[int] = None
    """KV heads of the layer (``None``: not recorded)."""
    entry_bytes: Optional[int] = None
    """Bytes one entry of one KV head takes in the cache, its key and its value (``None``: not recorded)."""
    ragged: bool = False
    """Whether the layer's cache was stored ragged (:class:`~kvpress_phase.ragged.RaggedLayer`: each KV head its own
    entries, the padding in :attr:`masked` not stored), as the per-head budget wrappers store it when used as a
    context manager (:mod:`kvpress_phase.presses.storage`)."""

    @property
    def phases(self) -> Optional[torch.Tensor]:
        """Phase of every kept entry under its row's grid (``None`` when the layer was not compressed)."""
        if self.layout is None or self.positions is None:
            return None
        return self.layout.phases(self.positions.long())

    @property
    def rows(self) -> Optional[int]:
        """``batch * heads``: the rows (one sequence's KV head) of the layer's cache (``None``: not recorded)."""
        if self.batch is None or self.heads is None:
            return None
        return self.batch * self.heads

    @property
    def masked_entries(self) -> int:
        """Stored entries masked while decoding, over every row of the layer (padding of per-head budgets)."""
        return 0 if self.masked is None else int(len(self.masked[0]))

    @property
    def entries_stored(self) -> Optional[int]:
        """Entries the layer's cache stores, over every row: masked padding included, unless the layer is stored
        ragged (then the padding is not stored)."""
        if self.rows is None:
            return None
        return self.rows * self.compressed_length - (self.masked_entries if self.ragged else 0)

    @property
    def index_bytes(self) -> int:
        """Bytes of the index a ragged layer keeps (two int32 per KV head: each head's start and length); 0 for a
        dense layer."""
        return 8 * (self.rows or 0) if self.ragged else 0

    @property
    def entries_attended(self) -> Optional[int]:
        """Entries decoding attends to, over every row: those stored but the masked padding."""
        if self.rows is None:
            return None
        return self.rows * self.compressed_length - self.masked_entries

    def as_dict(self) -> dict:
        """The record as a plain dict: its numbers and entry counts (``None`` where not recorded), the kept
        entries' positions as a nested list (``None`` when the layer was not compressed); no tensors."""
        return {
            "seq_len": self.seq_len, "compressed_length": self.compressed_length,
            "achieved_ratio": self.achieved_ratio, "requested_ratio": self.requested_ratio,
            "window_ratio": self.window_ratio, "batch": self.batch, "heads": self.heads,
            "entry_bytes": self.entry_bytes, "entries_stored": self.entries_stored,
            "entries_attended": self.entries_attended, "masked_entries": self.masked_entries, "ragged": self.ragged,
            "positions": None if self.positions is None else self.positions.tolist(),
        }

    def __repr__(self) -> str:
        def shown(value) -> str:
            if isinstance(value, torch.Tensor):
                return f"<{str(value.dtype).replace('torch.', '')} tensor {tuple(value.shape)}>"
            return f"{value:.4g}" if isinstance(value, float) else repr(value)

        items = {"seq_len": self.seq_len, "compressed_length": self.compressed_length,
                 "achieved_ratio": self.achieved_ratio, "requested_ratio": self.requested_ratio,
                 "window_ratio": self.window_ratio, "batch": self.batch, "heads": self.heads,
                 "entry_bytes": self.entry_bytes, "masked_entries": self.masked_entries,
                 "positions": self.positions}
        return f"LayerStats({', '.join(f'{k}={shown(v)}' for k, v in items.items() if v is not None)})"


@dataclass(frozen=True)
class CacheSummary:
    """The whole cache after a press's last prefill, every layer and row added up (:func:`cache_summary`)."""

    layers: int
    """Layers the press recorded."""
    entries_before: int
    """Entries the cache held before compression (``seq_len`` of every row of every layer)."""
    entries_stored: int
    """Entries stored, masked padding included."""
    entries_attended: int
    """Entries decoding attends to (stored, less the masked padding)."""
    bytes_stored: int
    """Bytes the cache's tensors hold after the prefill: keys and values stored (masked padding included where it is
    masked, not where a layer is stored ragged) and the index of every ragged layer (two int32 per KV head)."""
    bytes_attended: int
    """Bytes of the keys and values decoding attends to (masked padding not counted)."""
    bytes_before: int
    """Bytes the uncompressed cache would hold."""

    @property
    def entries_masked(self) -> int:
        """Stored entries masked while decoding."""
        return self.entries_stored - self.entries_attended

    @property
    def achieved_ratio(self) -> float:
        """Fraction of the cache's entries removed, masked padding counted as removed: ``1 - attended / before``."""
        return 1.0 - self.entries_attended / self.entries_before if self.entries_before else 0.0

    @property
    def stored_ratio(self) -> float:
        """Fraction of the cache's bytes freed: ``1 - stored / before`` (lower than :attr:`achieved_ratio` when
        entries are masked rather than removed)."""
        return 1.0 - self.bytes_stored / self.bytes_before if self.bytes_before else 0.0

    def as_dict(self) -> dict:
        """Every field and figure as a plain dict."""
        return {"layers": self.layers, "entries_before": self.entries_before, "entries_stored": self.entries_stored,
                "entries_attended": self.entries_attended, "entries_masked": self.entries_masked,
                "achieved_ratio": self.achieved_ratio, "bytes_before": self.bytes_before,
                "bytes_stored": self.bytes_stored, "bytes_attended": self.bytes_attended,
                "stored_ratio": self.stored_ratio}


def cache_summary(press=None, cache=None, *, context_length: Optional[int] = None) -> CacheSummary:
    """The :class:`CacheSummary` of the last prefill that ``press`` compressed: a press of this package (any whose
    ``stats`` holds :class:`LayerStats`) or its ``stats`` dict. ValueError when nothing was recorded yet, or a record
    lacks its shape (one built by hand without ``batch``, ``heads`` and ``entry_bytes``).

    Any other press (kvpress's own, or None for no press) records nothing: give the ``cache`` its prefill wrote and
    the ``context_length`` it prefilled, and the summary is read from the cache alone (:func:`summary_of_cache`;
    the entries kvpress's per-head presses mask are stored, and counted as attended: the cache does not say which).

    It describes the cache as the prefill left it: under ``WindowedDecodingPress`` the records cover the compressed
    part, not the raw tokens appended since. With ``cache`` (the cache the prefill wrote, e.g. the one given to
    kvpress's pipeline), ``bytes_stored`` is measured from it (:func:`kvpress_phase.cache_bytes`: every tensor it
    holds, whatever it held since) instead of counted from the records."""
    stats = press if isinstance(press, Mapping) else getattr(press, "stats", None)
    if not isinstance(stats, Mapping) or (not stats and cache is not None and context_length is not None):
        if cache is None or context_length is None:
            raise ValueError(f"{type(press).__name__} records nothing of the cache it compressed: pass the cache the "
                             "prefill wrote and the tokens it prefilled, cache_summary(press, cache, "
                             "context_length=n)")
        return summary_of_cache(cache, context_length)
    if not stats:
        raise ValueError("the press has recorded no layer yet: run a prefill with it first")
    totals = dict(before=0, stored=0, attended=0, bytes_stored=0, bytes_attended=0, bytes_before=0)
    for layer, s in sorted(stats.items()):
        if s.rows is None or s.entry_bytes is None:
            raise ValueError(f"press.stats[{layer}] does not record its shape (batch, heads, entry_bytes)")
        totals["before"] += s.rows * s.seq_len
        totals["stored"] += s.entries_stored
        totals["attended"] += s.entries_attended
        totals["bytes_stored"] += s.entries_stored * s.entry_bytes + s.index_bytes
        totals["bytes_attended"] += s.entries_attended * s.entry_bytes
        totals["bytes_before"] += s.rows * s.seq_len * s.entry_bytes
    if cache is not None:
        from kvpress_phase.ragged import cache_bytes

        totals["bytes_stored"] = cache_bytes(cache)
    return CacheSummary(len(stats), totals["before"], totals["stored"], totals["attended"], totals["bytes_stored"],
                        totals["bytes_attended"], totals["bytes_before"])


def summary_of_cache(cache, context_length: int) -> CacheSummary:
    """The :class:`CacheSummary` of ``cache`` after a prefill of ``context_length`` tokens, whatever compressed it:
    the entries each layer stores (a ragged layer's live ones, a dense layer's ``batch * heads * length``), the bytes
    it holds (:func:`kvpress_phase.cache_bytes`), and what the uncompressed cache of ``context_length`` tokens would
    have held, at the same bytes per entry. Every stored entry counts as attended."""
    from kvpress_phase.ragged import RaggedLayer, cache_bytes

    if isinstance(context_length, bool) or not isinstance(context_length, int) or context_length < 1:
        raise ValueError(f"context_length must be an int >= 1, got {context_length!r}")
    layers = getattr(cache, "layers", None)
    if not layers:
        raise ValueError(f"cache_summary reads a transformers Cache with layers, got {type(cache).__name__}")
    before = stored = bytes_attended = bytes_before = 0
    for layer in layers:
        if isinstance(layer, RaggedLayer):
            rows, entries = layer.num_heads, layer.entries
            entry_bytes = layer.key_buffer.shape[-1] * layer.key_buffer.element_size() \
                + layer.value_buffer.shape[-1] * layer.value_buffer.element_size()
        else:
            keys, values = layer.keys, layer.values
            if not isinstance(keys, torch.Tensor) or keys.dim() != 4:
                raise ValueError(f"cache_summary reads dense or ragged layers, got {type(layer).__name__}")
            rows, entries = keys.shape[0] * keys.shape[1], keys.shape[0] * keys.shape[1] * keys.shape[2]
            entry_bytes = keys.shape[-1] * keys.element_size() + values.shape[-1] * values.element_size()
        before += rows * context_length
        stored += entries
        bytes_attended += entries * entry_bytes
        bytes_before += rows * context_length * entry_bytes
    return CacheSummary(len(layers), before, stored, stored, cache_bytes(cache), bytes_attended, bytes_before)
