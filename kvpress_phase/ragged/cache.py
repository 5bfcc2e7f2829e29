"""A transformers cache that stores every KV head of a layer at its own length, so evicted entries free memory.

Layout of one :class:`RaggedLayer` (one sequence, batch 1), as AdaKV's head-flattened cache:

- ``key_buffer``: ``(capacity, head_dim)``, ``value_buffer``: ``(capacity, value_dim)``: the entries of every KV
  head of the layer, head after head, each head's in position order;
- ``starts``, ``lengths``: ``(kv_heads,)`` int32 on the buffers' device: KV head ``h`` owns rows
  ``starts[h] .. starts[h] + lengths[h] - 1``. Rows from ``starts[h] + lengths[h]`` to ``starts[h + 1]`` are the
  head's slack, room to grow in place (``starts`` is the cumulative capacity, not the cumulative length).

Built from a compressed result (:meth:`RaggedLayer.from_dense`: a dense ``(1, heads, length, dim)`` pair and which
slots only pad a shorter head), a layer stores exactly the kept entries, with no slack. Each decoding step appends
its new tokens to every head (:meth:`RaggedLayer.update`); when a head has no room left the layer is repacked once
with slack proportional to each head's length (``slack``, at least ``growth`` rows), so a step copies only the new
tokens most of the time and the capacity stays within a few percent of the live entries. A crop (kvpress's pipeline
removes every answer this way) releases the slack: the layer holds its live entries exactly again.

What :meth:`RaggedLayer.get_seq_length` returns: the length of the dense cache the layer was built from (the longest
head, padding included: the masked cache's length) plus the tokens appended since. It is what transformers and
kvpress's pipeline use for cache positions and for removing an answer; each head's own length is ``lengths[h]``.

:attr:`RaggedLayer.nbytes` counts every byte the layer holds: both buffers, slack included, and the two index
tensors. The keys and values reach attention as a :class:`RaggedView`, which only the attention registered in
:mod:`kvpress_phase.ragged.attention` reads.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

__all__ = ["RaggedLayer", "RaggedCache", "RaggedView", "cache_bytes", "cache_nbytes", "ATTENTION_NAME"]

ATTENTION_NAME = "kvpress_phase_ragged"
"""The ``attn_implementation`` that attends over ragged layers (:mod:`kvpress_phase.ragged.attention`)."""
INDEX_DTYPE = torch.int32
DEFAULT_GROWTH = 2
"""Rows of slack a head gets at least when its layer is repacked while decoding."""
DEFAULT_SLACK = 0.03
"""Slack a head gets when its layer is repacked while decoding, as a share of its length (the capacity stays within
about 1.03x of the live entries, plus ``growth`` rows per head)."""
RELEASE_AT = 0.02
"""A crop repacks the layer exactly when its capacity exceeds its live entries by more than this share."""


def _not_dense(what: str) -> ValueError:
    return ValueError(
        f"{what}: the keys and values of a RaggedLayer (KV heads of different lengths, head-flattened) are read only "
        f"by the ragged attention: run the model with attn_implementation={ATTENTION_NAME!r} "
        f"(model.set_attn_implementation({ATTENTION_NAME!r}) after importing kvpress_phase.ragged)"
    )


class RaggedView:
    """The keys (or values) of a :class:`RaggedLayer` as the model's attention receives them.

    ``buffer`` is the layer's ``(capacity, dim)`` buffer, ``starts`` and ``lengths`` its ``(kv_heads,)`` index.
    :attr:`shape` is the dense shape the layer stands for, ``(1, kv_heads, get_seq_length(), dim)``. Slicing the
    sequence axis from the start (``view[:, :, :n]``, what kvpress's pipeline does to remove an answer) gives a
    view that, assigned back to the layer's ``keys``/``values``, drops the newest entries of every head; any other
    use as a tensor raises ``ValueError`` naming the attention to use.
    """

    def __init__(self, layer: "RaggedLayer", buffer: torch.Tensor, seq_length: int):
        self.layer, self.buffer, self.seq_length = layer, buffer, seq_length

    @property
    def starts(self) -> torch.Tensor:
        return self.layer.starts

    @property
    def lengths(self) -> torch.Tensor:
        return self.layer.lengths

    @property
    def shape(self) -> torch.Size:
        return torch.Size((1, self.layer.num_heads, self.seq_length, self.buffer.shape[-1]))

    @property
    def dtype(self) -> torch.dtype:
        return self.buffer.dtype

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    def __getitem__(self, index):
        whole = slice(None)
        if (isinstance(index, tuple) and len(index) == 3 and index[0] == whole and index[1] == whole
                and isinstance(index[2], slice) and index[2].start in (None, 0) and index[2].step in (None, 1)):
            stop = self.seq_length if index[2].stop is None else index[2].stop
            return RaggedView(self.layer, self.buffer, max(0, min(int(stop), self.seq_length)))
        raise _not_dense(f"indexing ragged keys or values with {index!r}")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise _not_dense(f"{getattr(func, '__name__', func)} on ragged keys or values")

    def __repr__(self) -> str:
        return f"RaggedView(shape={tuple(self.shape)}, dtype={self.dtype}, entries={self.layer.entries})"


class RaggedLayer(CacheLayerMixin):
    """One layer of a :class:`RaggedCache`: every KV head at its own length (layout in the module docstring).

    Decoding writes new entries into the buffers in place (into a head's slack), so a shallow copy of the layer
    shares what later steps write; ``copy.deepcopy`` gives an independent one.

    Parameters
    ----------
    growth : int, default 2
        Rows of slack each head gets at least when the layer is repacked because a head has no room for a step's
        tokens.
    slack : float, default 0.03
        Slack each head gets at such a repack as a share of its length (the larger of the two is given). A crop
        releases it (:meth:`crop`).
    """

    is_sliding = False
    is_compileable = False

    def __init__(self, growth: int = DEFAULT_GROWTH, slack: float = DEFAULT_SLACK):
        if not isinstance(growth, int) or isinstance(growth, bool) or growth < 0:
            raise ValueError(f"growth must be an int >= 0, got {growth!r}")
        if isinstance(slack, bool) or not isinstance(slack, (int, float)) or not 0 <= slack <= 1:
            raise ValueError(f"slack must be a number in [0, 1], got {slack!r}")
        self.growth, self.slack = growth, float(slack)
        self.key_buffer: Optional[torch.Tensor] = None
        self.value_buffer: Optional[torch.Tensor] = None
        self.starts: Optional[torch.Tensor] = None
        self.lengths: Optional[torch.Tensor] = None
        self._starts: list[int] = []  # host copies: growth decisions without reading the device
        self._lengths: list[int] = []
        self._capacity: list[int] = []
        self.base_length = 0
        self.appended = 0
        self.is_initialized = False
        super().__init__()  # sets keys and values to None: an empty layer

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dense(cls, keys: torch.Tensor, values: torch.Tensor, *, lengths=None, masked=None,
                   growth: int = DEFAULT_GROWTH, slack: float = DEFAULT_SLACK) -> "RaggedLayer":
        """A layer holding the kept entries of a dense ``(1, kv_heads, length, dim)`` pair, exactly (no slack).

        Give at most one of ``lengths`` (``(kv_heads,)``: head ``h`` keeps its first ``lengths[h]`` slots, the rest
        pad it, as :func:`kvpress_phase.presses.choice.keep_only` lays them out) or ``masked`` (``(1, kv_heads,
        length)`` or ``(kv_heads, length)`` bool, True for a slot that only pads its head, anywhere, as kvpress's
        ``masked_key_indices`` mark them); with neither, every slot is kept. Kept entries keep their order."""
        _check_dense(keys, values)
        heads, length = keys.shape[1], keys.shape[2]
        if lengths is not None and masked is not None:
            raise ValueError("give lengths or masked, not both")
        keep = torch.ones(heads, length, dtype=torch.bool, device=keys.device)
        if lengths is not None:
            lengths = torch.as_tensor(lengths, device=keys.device)
            if lengths.shape != (heads,) or lengths.dtype.is_floating_point:
                raise ValueError(f"lengths must be {heads} integers (one per KV head), got {tuple(lengths.shape)}")
            if bool((lengths < 0).any()) or bool((lengths > length).any()):
                raise ValueError(f"lengths must be in [0, {length}], got {lengths.tolist()}")
            keep = torch.arange(length, device=keys.device)[None, :] < lengths[:, None]
        elif masked is not None:
            masked = torch.as_tensor(masked, device=keys.device)
            if masked.dim() == 3:
                masked = masked[0] if masked.shape[0] == 1 else masked
            if masked.shape != (heads, length) or masked.dtype != torch.bool:
                raise ValueError(f"masked must be a bool ({heads}, {length}) tensor (one row per KV head), got "
                                 f"{masked.dtype} {tuple(masked.shape)}")
            keep = ~masked
        layer = cls(growth=growth, slack=slack)
        counts = keep.sum(dim=-1).tolist()
        layer._pack(keys[0][keep], values[0][keep], [0] + _cumsum(counts)[:-1], counts, counts)
        layer.base_length, layer.appended = length, 0
        return layer

    def _pack(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor, starts: list[int], lengths: list[int],
              capacity: list[int]) -> None:
        self.key_buffer, self.value_buffer = key_buffer, value_buffer
        self._starts, self._lengths, self._capacity = list(starts), list(lengths), list(capacity)
        device = key_buffer.device
        self.starts = torch.tensor(self._starts, dtype=INDEX_DTYPE, device=device)
        self.lengths = torch.tensor(self._lengths, dtype=INDEX_DTYPE, device=device)
        self.dtype, self.device = key_buffer.dtype, device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """An empty layer shaped for ``key_states``/``value_states`` (``(1, kv_heads, n, dim)``)."""
        _check_dense(key_states, value_states)
        heads = key_states.shape[1]
        self._pack(key_states.new_empty(0, key_states.shape[-1]), value_states.new_empty(0, value_states.shape[-1]),
                   [0] * heads, [0] * heads, [0] * heads)

    # ------------------------------------------------------------------ what transformers calls
    @property
    def num_heads(self) -> int:
        return len(self._lengths)

    @property
    def entries(self) -> int:
        """Entries stored over every KV head (slack not counted)."""
        return sum(self._lengths)

    @property
    def head_lengths(self) -> list[int]:
        """Each KV head's length, from the host copy (no device read)."""
        return list(self._lengths)

    @property
    def capacity(self) -> int:
        """Rows the buffers hold over every KV head, slack included (:attr:`entries` of them are live)."""
        return sum(self._capacity)

    @property
    def nbytes(self) -> int:
        """Bytes the layer holds: both buffers (slack included) and its two index tensors."""
        if not self.is_initialized:
            return 0
        tensors = (self.key_buffer, self.value_buffer, self.starts, self.lengths)
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def keys(self):
        return None if not self.is_initialized else RaggedView(self, self.key_buffer, self.get_seq_length())

    @keys.setter
    def keys(self, value) -> None:
        self._assign(value, "keys")

    @property
    def values(self):
        return None if not self.is_initialized else RaggedView(self, self.value_buffer, self.get_seq_length())

    @values.setter
    def values(self, value) -> None:
        self._assign(value, "values")

    def _assign(self, value, name: str) -> None:
        if value is None and not self.is_initialized:  # CacheLayerMixin.__init__
            return
        if isinstance(value, RaggedView) and value.layer is self:
            self.crop(value.seq_length)
            return
        raise ValueError(
            f"RaggedLayer.{name} takes only a slice of its own {name} along the sequence axis (layer.{name}[:, :, :n]"
            f", which drops the newest entries of every head); got {type(value).__name__}. A press that writes dense "
            "keys and values (kvpress's presses) needs a DynamicCache"
        )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor,
               cache_kwargs: Optional[dict[str, Any]] = None) -> tuple[RaggedView, RaggedView]:
        """Append ``key_states``/``value_states`` (``(1, kv_heads, n, dim)``) to every head; returns the layer's
        keys and values as :class:`RaggedView` objects (for the ragged attention)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        _check_dense(key_states, value_states, heads=self.num_heads)
        n = key_states.shape[2]
        if any(length + n > cap for length, cap in zip(self._lengths, self._capacity)):
            self._repack([length + n + max(self.growth, math.ceil(self.slack * (length + n)))
                          for length in self._lengths])
        # rows and lengths from the host copies: one small host-to-device copy each, no device read
        rows = torch.tensor([start + length + i for start, length in zip(self._starts, self._lengths) for i in range(n)],
                            device=self.device)
        self.key_buffer.index_copy_(0, rows, key_states[0].reshape(-1, key_states.shape[-1]).to(self.dtype))
        self.value_buffer.index_copy_(0, rows, value_states[0].reshape(-1, value_states.shape[-1]).to(self.dtype))
        self._lengths = [length + n for length in self._lengths]
        # a new tensor: the index of a view taken before stays as it was
        self.lengths = torch.tensor(self._lengths, dtype=INDEX_DTYPE, device=self.device)
        self.appended += n
        return self.keys, self.values

    def _repack(self, capacity: list[int]) -> None:
        """Move every head into a new buffer with ``capacity[h]`` rows for head ``h``."""
        starts = [0] + _cumsum(capacity)[:-1]
        src = _rows(self._starts, self._lengths, self.device)
        dst = _rows(starts, self._lengths, self.device)
        keys = self.key_buffer.new_empty(sum(capacity), self.key_buffer.shape[-1])
        values = self.value_buffer.new_empty(sum(capacity), self.value_buffer.shape[-1])
        keys[dst] = self.key_buffer[src]
        values[dst] = self.value_buffer[src]
        self._pack(keys, values, starts, self._lengths, capacity)

    def crop(self, max_length: int) -> None:
        """Keep the layer as it was when :meth:`get_seq_length` was ``max_length``: drop the newest
        ``get_seq_length() - max_length`` entries of every head (only appended entries can be dropped; a negative
        ``max_length`` counts from the end, as transformers' ``crop``)."""
        if not self.is_initialized:
            return
        current = self.get_seq_length()
        if max_length < 0:
            max_length = current + max_length
        drop = current - max_length
        if drop <= 0:
            return
        if drop > self.appended:
            raise ValueError(f"max_length must be >= {self.base_length} (the compressed length this layer was built "
                             f"from): only appended entries can be dropped from a ragged layer, got {max_length}")
        self.lengths = self.lengths - drop
        self._lengths = [length - drop for length in self._lengths]
        self.appended -= drop
        if self.capacity > (1 + RELEASE_AT) * self.entries:  # release the slack the dropped tokens grew
            self._repack(list(self._lengths))

    def retain(self, keep: torch.Tensor, seq_length: Optional[int] = None) -> None:
        """Keep only the live entries ``keep`` marks and free the others: ``keep`` is a bool tensor over the live
        entries, head after head, each head's in order (``sum(head_lengths)`` long). The layer is repacked exactly
        (no slack). ``seq_length``: the dense length the layer stands for afterwards (:meth:`get_seq_length`;
        unchanged by default)."""
        keep = torch.as_tensor(keep, device=self.device)
        if keep.dtype != torch.bool or keep.shape != (self.entries,):
            raise ValueError(f"keep must be a bool tensor of the layer's {self.entries} live entries, got "
                             f"{keep.dtype} {tuple(keep.shape)}")
        if self.capacity == self.entries:  # no slack (a prefill's layer): the live rows are the buffer's rows
            kept = torch.nonzero(keep).flatten()
        else:
            kept = _rows(self._starts, self._lengths, self.device)[keep]
        counts = [int(part.sum()) for part in keep.split(self._lengths)]
        self._pack(self.key_buffer[kept], self.value_buffer[kept], [0] + _cumsum(counts)[:-1], counts, counts)
        if seq_length is not None:
            self.base_length, self.appended = int(seq_length), 0

    def get_seq_length(self) -> int:
        """The dense length this layer stands for (module docstring): the length it was built from plus every token
        appended since."""
        return self.base_length + self.appended

    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[int, int]:
        return self.get_seq_length() + cache_position.shape[0], 0

    def get_max_cache_shape(self) -> int:
        return -1

    def reset(self) -> None:
        if self.is_initialized:
            heads = self.num_heads
            self._pack(self.key_buffer[:0], self.value_buffer[:0], [0] * heads, [0] * heads, [0] * heads)
        self.base_length = self.appended = 0

    def offload(self):
        if self.is_initialized:
            self.key_buffer, self.value_buffer = self.key_buffer.to("cpu"), self.value_buffer.to("cpu")

    def prefetch(self):
        if self.is_initialized and self.key_buffer.device != self.device:
            self.key_buffer = self.key_buffer.to(self.device, non_blocking=True)
            self.value_buffer = self.value_buffer.to(self.device, non_blocking=True)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise ValueError("beam_idx: a RaggedLayer holds one sequence; beam search is not supported")

    def dense(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys, values (``(1, kv_heads, longest, dim)``, zeros where a head is shorter) and each head's length: for
        tests and inspection; decoding never builds it."""
        longest = max(self._lengths, default=0)
        heads = self.num_heads
        keys = self.key_buffer.new_zeros(1, heads, longest, self.key_buffer.shape[-1])
        values = self.value_buffer.new_zeros(1, heads, longest, self.value_buffer.shape[-1])
        for h, (start, length) in enumerate(zip(self._starts, self._lengths)):
            keys[0, h, :length] = self.key_buffer[start:start + length]
            values[0, h, :length] = self.value_buffer[start:start + length]
        return keys, values, torch.tensor(self._lengths)

    def __repr__(self) -> str:
        return f"RaggedLayer(heads={self.num_heads}, lengths={self._lengths}, seq_length={self.get_seq_length()})"


class RaggedCache(Cache):
    """A transformers ``Cache`` of :class:`RaggedLayer` objects (layers may also be any other cache layer, e.g. a
    ``DynamicLayer`` for a layer whose heads all keep the same entries). Without ``layers``, ragged layers are
    created as the model first writes them (all heads of a layer then grow together). Batch 1 only."""

    def __init__(self, layers: Optional[list] = None, growth: int = DEFAULT_GROWTH, slack: float = DEFAULT_SLACK):
        if layers is None:
            RaggedLayer(growth, slack)  # validates growth and slack
            super().__init__(layer_class_to_replicate=lambda: RaggedLayer(growth, slack))
        else:
            super().__init__(layers=list(layers))

    @property
    def nbytes(self) -> int:
        """Bytes every layer holds (:func:`cache_bytes`)."""
        return cache_bytes(self)


def cache_bytes(cache) -> int:
    """Bytes a transformers cache holds, whatever its layers: every tensor a layer keeps (a dense layer's keys and
    values, a quantized layer's packed data and scales, a :class:`RaggedLayer`'s buffers, slack included, and its
    index), each storage counted once and whole. A dense layer that kvpress's pipeline cropped after an answer
    (``keys[:, :, :n]``, a view) still holds the storage it was cut from, and is counted with it: the bytes are
    what the process keeps, not what attention reads. Exported as ``kvpress_phase.cache_bytes``."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise ValueError(f"cache_bytes takes a transformers Cache (DynamicCache, QuantizedCache, RaggedCache, ...), "
                         f"got {type(cache).__name__}")
    seen: set = set()
    total = 0
    for layer in layers:
        for tensor in _layer_tensors(layer):
            storage = tensor.untyped_storage()
            key = (tensor.device, storage.data_ptr(), storage.nbytes())
            if tensor.device.type == "meta" or key in seen:
                continue
            seen.add(key)
            total += storage.nbytes()
    return total


cache_nbytes = cache_bytes
"""The former name of :func:`cache_bytes`."""


def _layer_tensors(layer):
    """Every plain tensor a cache layer holds (tensor subclasses, such as quanto's packed tensors, opened up)."""
    if isinstance(layer, RaggedLayer):
        found = [layer.key_buffer, layer.value_buffer, layer.starts, layer.lengths] if layer.is_initialized else []
    else:
        found = [v for v in vars(layer).values() if isinstance(v, torch.Tensor)]
    stack = list(found)
    while stack:
        tensor = stack.pop()
        if type(tensor) is not torch.Tensor and hasattr(tensor, "__tensor_flatten__"):
            names, _ = tensor.__tensor_flatten__()
            stack.extend(getattr(tensor, name) for name in names)
        elif tensor is not None:
            yield tensor


def _check_dense(keys: torch.Tensor, values: torch.Tensor, heads: Optional[int] = None) -> None:
    if not isinstance(keys, torch.Tensor) or keys.dim() != 4 or not isinstance(values, torch.Tensor) \
            or values.dim() != 4:
        raise ValueError("keys and values must be (batch, kv_heads, length, dim) tensors")
    if keys.shape[0] != 1:
        raise ValueError(f"keys: a RaggedLayer holds one sequence (batch 1), got batch {keys.shape[0]}")
    if keys.shape[:3] != values.shape[:3]:
        raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} differ in batch, heads or length")
    if heads is not None and keys.shape[1] != heads:
        raise ValueError(f"keys: {keys.shape[1]} KV heads for a layer of {heads}")


def _cumsum(xs: list[int]) -> list[int]:
    out, total = [], 0
    for x in xs:
        total += x
        out.append(total)
    return out


def _rows(starts: list[int], lengths: list[int], device) -> torch.Tensor:
    """Every stored row, head after head: ``starts[h] + 0 .. lengths[h] - 1``."""
    if not lengths or sum(lengths) == 0:
        return torch.zeros(0, dtype=torch.long, device=device)
    return torch.cat([torch.arange(start, start + length, device=device) for start, length in zip(starts, lengths)])
