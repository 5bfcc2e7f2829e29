"""Chunked compression during decoding: :class:`WindowedDecodingPress`, which wraps a windowed press.

After the prefill, each row of the cache holds, in order: the raw tokens before its first window, ``k`` entries
per compressed window, then the raw tokens after its last window, up to the end of the cache. Every row has
removed the same number of entries ``D``, so in that raw tail the entry at cache index ``c`` is the token at
position ``c + D`` for every row. Decoding appends tokens to that tail.

The wrapper keeps, per layer, where each row's grid stands (:class:`DecodingState`: the
start of its next stride block, its ``k``, ``D``). After every forward pass that is not the prefill it counts the
tokens seen so far, ``n = cache length + D``, and compresses the next stride blocks of every row as soon as
:func:`~kvpress_phase.core.phase.n_windows` says ``n`` tokens hold that many windows: the same rule as the prefill,
so the block a row compresses has left the ``n_local`` window, and the cache then holds exactly
``compressed_length(n)`` entries. Each block starts where the row's previous one ended, so a generated token's
phase continues the prefill's grid, per row (StaggeredWindowPress's per-head and aligned grids included).

The blocks are compressed by the press's own kernel call (``compress_windows``), handed only the raw tokens the
due windows read, as a sequence of their own: there cache indices are consecutive positions, and un-rotation and
re-rotation happen in the same frame, so only distances between positions matter and re-rotation is exact even
though a token's cache index is no longer its position. Content-adaptive budgets (PhaseAwarePress's row
budget, StaggeredWindowPress's ``budget="window_topk"``) thus choose among the tokens of the blocks being compressed. A step that
completes no block costs a few integer operations.

Length rule: after every forward pass (prefill, question, each generated token) the cache holds exactly
``compressed_length(n, stride, compression_ratio, n_sink, n_local)`` entries for the ``n`` tokens seen so far;
during a step's own attention, before that step's compression, at most ``stride - k`` (so at most ``stride - 1``)
more.

kvpress's pipeline keeps a press active while it generates only if the press is a ``PrefillDecodingPress`` (or a
``DecodingPress``), so the wrapper is one; it then answers one question per context, as every kvpress decoding press
does.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from kvpress import BasePress, PrefillDecodingPress
from kvpress.presses.base_press import is_prefilling
from torch import nn
from transformers import QuantizedCache

from kvpress_phase.core.phase import WindowLayout, n_windows
from kvpress_phase.presses.base import WindowedPress
from kvpress_phase.presses.budget import is_budget
from kvpress_phase.presses.per_layer import PerLayerWindowedPress
from kvpress_phase.presses.scorers import SnapKVScorer, token_scores
from kvpress_phase.presses.stats import LayerStats
from kvpress_phase.presses.storage import decoding_attention


@dataclass
class WindowedDecodingPress(PrefillDecodingPress):
    """``press`` during the prefill, and while generating too: generated tokens are compressed on the prefill's grid.

    As generated tokens leave the ``n_local`` window, every complete stride block of every row is compressed into
    ``k`` entries by ``press``'s own step 3, so after every forward pass the cache holds exactly
    ``compressed_length(n)`` entries for the ``n`` tokens seen so far (module docstring). A kvpress
    ``PrefillDecodingPress``, so ``pipe(context, question=..., press=WindowedDecodingPress(press))`` keeps it active
    while generating (one question per context, as for every kvpress decoding press); it also works as either side of
    kvpress's own ``PrefillDecodingPress``.

    Parameters
    ----------
    press : ChunkedStridePress, PhaseAwarePress, StaggeredWindowPress or PerLayerWindowedPress
        The press that compresses the prefill, and whose windows the generated tokens continue. Its scorer must
        score keys it is handed alone (not KVzip's, which needs the whole context).
    """

    prefilling_press: Optional[BasePress] = field(default=None, init=False, repr=False, compare=False)
    decoding_press: Optional[BasePress] = field(default=None, init=False, repr=False, compare=False)
    press: Union[WindowedPress, PerLayerWindowedPress, None] = None
    decoding_state: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        windowed = self.windowed
        if is_budget(windowed):
            raise ValueError(f"WindowedDecodingPress needs the same budget in every window of every layer and head; "
                             f"{type(windowed).__name__} spreads it by score: wrap the PhaseAwarePress itself "
                             "(WindowedDecodingPress(PhaseAwarePress(...)))")
        if not isinstance(windowed, WindowedPress):
            raise ValueError(
                "press must be a ChunkedStridePress, PhaseAwarePress, StaggeredWindowPress or PerLayerWindowedPress, "
                f"got {type(self.press).__name__}; for a kvpress ScorerPress use kvpress's DecodingPress")
        if getattr(windowed.scorer, "needs_context", False):
            raise ValueError(f"WindowedDecodingPress cannot use {type(windowed.scorer).__name__}: its scores need the "
                             "whole context, which a decoding step does not have")

    @property
    def windowed(self):
        """The windowed press that compresses blocks (inside a :class:`PerLayerWindowedPress`, its press)."""
        return self.press.press if isinstance(self.press, PerLayerWindowedPress) else self.press

    @property
    def stats(self) -> dict:
        return self.press.stats

    @property
    def compression_ratio(self) -> float:
        return self.press.compression_ratio

    @property
    def stride(self) -> int:
        return self.windowed.stride

    @property
    def n_sink(self) -> int:
        return self.windowed.n_sink

    @property
    def n_local(self) -> int:
        return self.windowed.n_local

    def post_init_from_model(self, model):
        self.press.post_init_from_model(model)

    def compress(self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 attentions: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefill's compression by ``press``, then where each row's grid stands (:func:`start`)."""
        keys, values = self.press.compress(module, hidden_states, keys, values, attentions, kwargs)
        layer_idx = getattr(module, "layer_idx", 0)
        start(self, module, self.press.stats[layer_idx].layout, keys.shape[2], kwargs)  # None: not compressed
        return keys, values

    @contextlib.contextmanager
    def __call__(self, model):
        """kvpress's ``PrefillDecodingPress`` context; a cache left with layers of different lengths (a
        ``PerLayerWindowedPress`` inside) is decoded with the package's attention while it is alive
        (:func:`~kvpress_phase.presses.storage.decoding_attention`)."""
        with decoding_attention(self, model), PrefillDecodingPress.__call__(self, model):
            yield

    def forward_hook(self, module: nn.Module, input, kwargs: dict, output):
        if is_prefilling(kwargs["cache_position"], kwargs["hidden_states"].shape[1]):
            return BasePress.forward_hook(self, module, input, kwargs, output)
        return decode_step(self, module, kwargs, output)

    def reset(self) -> None:
        """Kept for kvpress's ``PrefillDecodingPress``, which calls it on its decoding press whenever its context
        exits: the decoding state belongs to the cache the prefill compressed and is replaced by the next prefill."""


@dataclass
class DecodingState:
    """Where one layer's grids stand during decoding."""

    stride: int
    window: int
    k: int
    n_sink: int
    n_local: int
    first: Optional[torch.Tensor]
    """``(batch, heads)`` long: position of each row's first window (``None`` when ``k == stride``)."""
    blocks: int
    """Windows compressed so far in every row (prefill and decoding)."""
    removed: int
    """Entries removed so far in every row, ``blocks * (stride - k)``: cache index + removed = position in the raw
    tail."""
    cache_len: int
    """Cache length after this press last touched the layer."""
    cache_ref: Optional[Any] = None
    """Weak reference to the cache the prefill compressed (``None`` when compress was called without one)."""

    @property
    def seen(self) -> int:
        """Tokens seen so far (positions ``0 .. seen - 1``)."""
        return self.cache_len + self.removed


# ------------------------------------------------------------------------------------------------ state
def start(wrapper: WindowedDecodingPress, module: nn.Module, layout: Optional[WindowLayout], cache_len: int,
          kwargs: dict) -> None:
    """Record, after the prefill compressed a layer, where its grids stand (``layout`` None: not compressed)."""
    layer_idx = getattr(module, "layer_idx", 0)
    cache = kwargs.get("past_key_values") if kwargs else None
    ref = weakref.ref(cache) if cache is not None else None
    if layout is None:  # compression_ratio 0: k == stride, nothing to compress while decoding either
        press = wrapper.windowed
        wrapper.decoding_state[layer_idx] = DecodingState(
            press.stride, press.effective_window, press.stride, press.n_sink, press.n_local, None, 0, 0, cache_len,
            ref)
        return
    wrapper.decoding_state[layer_idx] = DecodingState(
        layout.stride, layout.window, layout.k, layout.n_sink, layout.n_local, layout.first.clone(),
        layout.n_windows, layout.seq_len - layout.compressed_length, cache_len, ref)


def _state_for(wrapper: WindowedDecodingPress, module: nn.Module, cache) -> DecodingState:
    layer_idx = getattr(module, "layer_idx", 0)
    state = wrapper.decoding_state.get(layer_idx)
    name = f"WindowedDecodingPress({type(wrapper.press).__name__})"
    if state is None or (state.cache_ref is not None and state.cache_ref() is not cache):
        raise ValueError(
            f"{name} continues the window grid of the prefill it compressed, but layer {layer_idx}'s "
            "cache was not prefilled by this press. Use the same press for the prefill (pass it as the press, not "
            "only as a PrefillDecodingPress's decoding_press)."
        )
    return state


# ------------------------------------------------------------------------------------------------ cache access
def read_layer(cache, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one cache layer, a quantized layer's residual (unquantized) part included."""
    layer = cache.layers[layer_idx]
    if isinstance(cache, QuantizedCache):
        keys = layer._dequantize(layer._quantized_keys)
        values = layer._dequantize(layer._quantized_values)
        if layer.keys is not None and layer.keys.dim() == 4 and layer.keys.shape[-2] > 0:
            keys = torch.cat((keys, layer.keys.to(keys.dtype)), dim=-2)
            values = torch.cat((values, layer.values.to(values.dtype)), dim=-2)
        return keys, values
    return layer.keys, layer.values


def write_layer(cache, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Replace one cache layer's contents (re-quantized for a quantized cache, as kvpress does)."""
    layer = cache.layers[layer_idx]
    if isinstance(cache, QuantizedCache):
        layer._quantized_keys = layer._quantize(keys.contiguous(), axis=layer.axis_key)
        layer._quantized_values = layer._quantize(values.contiguous(), axis=layer.axis_value)
        layer.keys = torch.zeros(0, dtype=keys.dtype, device=keys.device)
        layer.values = torch.zeros(0, dtype=keys.dtype, device=keys.device)
        layer.cumulative_length = keys.shape[2]
    else:
        layer.keys = keys
        layer.values = values


# ------------------------------------------------------------------------------------------------ decoding
def blocks_due(state: DecodingState, cache_len: int) -> int:
    """Stride blocks every row must compress now that the layer's cache holds ``cache_len`` entries."""
    if state.k >= state.stride:
        return 0
    return n_windows(cache_len + state.removed, state.stride, state.n_sink, state.n_local) - state.blocks


def compress_blocks(
    press,
    module: nn.Module,
    state: DecodingState,
    keys: torch.Tensor,
    values: torch.Tensor,
    n_blocks: int,
    hidden_states: Optional[torch.Tensor] = None,
    kwargs: Optional[dict] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compress the next ``n_blocks`` stride blocks of every row of ``keys``/``values`` and advance ``state``.

    ``keys`` and ``values`` are the whole layer (``(batch, heads, cache_len, head_dim)``). Only the raw tokens the
    due windows read are handed to the press's ``compress_windows``, as a sequence of their own (there cache
    indices are consecutive positions); the entries before and after them are returned untouched.
    """
    S, k = state.stride, state.k
    starts = state.first + state.blocks * S  # (B, H) position of each row's next block
    lo = int(starts.min())
    c0 = lo - state.removed  # cache index of position lo
    rel = (starts - lo).to(torch.long)
    # what the windows read: the due blocks, and the next window - stride tokens (overlapping windows)
    end = c0 + min(keys.shape[2] - c0, int(rel.max()) + n_blocks * S + state.window - S)
    tail_k, tail_v = keys[:, :, c0:end], values[:, :, c0:end]
    layout = WindowLayout(seq_len=end - c0, window=state.window, stride=S, k=k, n_sink=0, n_local=0,
                          offsets=rel, first=rel, n_windows=n_blocks)
    scores = _tail_scores(press, module, hidden_states, tail_k, tail_v, kwargs) if press.needs_scores else None
    out = press.compress_windows(module, tail_k, tail_v, scores, layout)
    new_keys = torch.cat((keys[:, :, :c0], out.keys, keys[:, :, end:]), dim=2)
    new_values = torch.cat((values[:, :, :c0], out.values, values[:, :, end:]), dim=2)
    tail_ends = out.ends if out.ends is not None else press.entry_ends(layout, out.positions)
    _update_stats(press, module, state, layout, out.positions, tail_ends, lo, c0, keys.shape[2], new_keys.shape[2])
    state.blocks += n_blocks
    state.removed += n_blocks * (S - k)
    state.cache_len = new_keys.shape[2]
    return new_keys, new_values


def _tail_scores(press, module, hidden_states, keys, values, kwargs) -> torch.Tensor:
    """The scorer's scores of the raw tail, from the hidden states and kwargs of the current step.

    :class:`SnapKVScorer` has no window of context queries here: it scores the tail by the current step's query
    (:meth:`SnapKVScorer.decoding_scores`). Scorers of keys alone (``KeyDiffPress``, the presses' default, which
    then compares the block's keys with the block's mean key; ``KnormPress``) work as they are."""
    if isinstance(press.scorer, SnapKVScorer) and kwargs and kwargs.get("position_embeddings") is not None:
        return SnapKVScorer.decoding_scores(module, hidden_states, keys, kwargs["position_embeddings"]).float()
    try:
        scores = token_scores(press.scorer, module, hidden_states, keys, values, None, kwargs or {})
    except (AssertionError, IndexError, RuntimeError, ValueError) as exc:
        raise ValueError(
            f"scorer={type(press.scorer).__name__} cannot score a block while decoding ({exc}). While decoding "
            "the scorer sees only the current step's hidden states: use a scorer that scores keys alone (KeyDiffPress, "
            "the default, or KnormPress), SnapKVScorer, or mode='pool' with weighting='mean', which needs no scores."
        ) from exc
    return scores.float()


def _update_stats(press, module, state, layout, tail_positions, tail_ends, lo, c0, old_len, new_len) -> None:
    """Extend ``press.stats[layer]`` (source position and end of every entry) with the blocks just compressed.

    The compressed tail starts at the cache index of the earliest row's block; in rows whose block starts later,
    the entries before it are kept as they were (they may be entries of the row's previous window) and keep their
    recorded stats.
    """
    layer_idx = getattr(module, "layer_idx", 0)
    old = press.stats.get(layer_idx)
    if old is None:
        return
    if old.positions is None:  # the prefill passed through unchanged: every entry so far is a raw token
        empty = torch.zeros(layout.batch, layout.heads, 0, dtype=torch.int32, device=tail_positions.device)
        old = LayerStats(old.seq_len, old.compressed_length, old.achieved_ratio, old.layout, empty, empty,
                         batch=old.batch, heads=old.heads, entry_bytes=old.entry_bytes)
    t = torch.arange(tail_positions.shape[2], device=tail_positions.device)
    before = t < layout.first[..., None]  # (B, H, m): entries before each row's first block, unchanged
    idx = (c0 + t.clamp(max=layout.stride - 1)).expand_as(before)

    def merged(recorded: torch.Tensor, tail: torch.Tensor, shift: int) -> torch.Tensor:
        kept = _prefix(recorded, c0 + layout.stride, shift)
        tail = torch.where(before, kept.gather(2, idx), tail.to(kept))
        return torch.cat((kept[:, :, :c0], tail), dim=2)

    positions = merged(old.positions, tail_positions + lo, state.removed)
    ends = None
    if old.ends is not None:
        ends = merged(old.ends, tail_ends + lo, state.removed + 1)
    seen = old_len + state.removed
    press.stats[layer_idx] = LayerStats(seen, new_len, 1.0 - new_len / seen, old.layout, positions, ends,
                                        batch=old.batch, heads=old.heads, entry_bytes=old.entry_bytes)


def _prefix(recorded: torch.Tensor, c0: int, shift: int) -> torch.Tensor:
    """Per-entry stats of cache indices ``[0, c0)``: those recorded, then ``index + shift`` for the raw tokens
    appended since."""
    have = recorded.shape[2]
    if have >= c0:
        return recorded[:, :, :c0]
    raw = torch.arange(have, c0, device=recorded.device, dtype=recorded.dtype) + shift
    return torch.cat((recorded, raw.expand(recorded.shape[0], recorded.shape[1], -1)), dim=2)


def entry_positions(wrapper: WindowedDecodingPress, layer_idx: int,
                    cache_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions, ends)`` of every entry of a layer whose cache now holds ``cache_len`` entries.

    ``press.stats[layer_idx]`` describes the cache as the last compression left it; the entries appended since are
    raw tokens at consecutive positions, which this adds.
    """
    stats = wrapper.stats[layer_idx]
    state = wrapper.decoding_state.get(layer_idx)
    removed = state.removed if state is not None else stats.seq_len - stats.compressed_length
    positions, ends = stats.positions, stats.ends
    if positions is None:
        positions = ends = torch.zeros(1, 1, 0, dtype=torch.int32)
    return _prefix(positions, cache_len, removed), _prefix(ends, cache_len, removed + 1)


def decode_step(wrapper: WindowedDecodingPress, module: nn.Module, kwargs: dict, output):
    """Forward hook body for a forward pass that is not the prefill: compress the blocks that became due."""
    cache = kwargs["past_key_values"]
    hidden_states = kwargs["hidden_states"]
    layer_idx = module.layer_idx
    state = _state_for(wrapper, module, cache)
    cache_len = cache.layers[layer_idx].get_seq_length()
    q_len = hidden_states.shape[1]
    if cache_len != state.cache_len + q_len:
        raise ValueError(
            f"WindowedDecodingPress({type(wrapper.press).__name__}): layer {layer_idx}'s cache holds {cache_len} "
            f"entries, but this press left {state.cache_len} and this step added {q_len}: something else changed the "
            "cache (a press after this one, or a cache cropped between questions). While decoding the press must be "
            "the last to change the cache, and answers one question per prefill."
        )
    due = blocks_due(state, cache_len)
    if due <= 0:
        state.cache_len = cache_len
        return output
    keys, values = read_layer(cache, layer_idx)
    keys, values = compress_blocks(wrapper.windowed, module, state, keys, values, due, hidden_states, kwargs)
    write_layer(cache, layer_idx, keys, values)
    return output
