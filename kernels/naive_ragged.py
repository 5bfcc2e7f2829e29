"""Plain-PyTorch reference for attention over a ragged, head-flattened KV cache (the specification).

Layout (that of :class:`kvpress_phase.ragged.RaggedLayer`, and of AdaKV's head-flattened cache): the keys of every
KV head of one layer live in one ``(capacity, head_dim)`` buffer, the values in another ``(capacity, value_dim)``
buffer; KV head ``h`` owns the rows ``starts[h] .. starts[h] + lengths[h] - 1`` of both, in position order. Rows
between one head's end and the next head's start are unused slack (``starts`` need not be cumulative lengths, so a
head can grow in place); heads may be empty.

The ``n_new`` queries of one step are the newest tokens: they were appended to every head before attention, so they
are the last ``n_new`` entries of each head. Query ``i`` (``0 <= i < n_new``) of a head attends to that head's
entries ``0 .. lengths[h] - n_new + i`` (causal within the new tokens, every older entry visible). A query that
sees no entry at all (a head shorter than its causal limit) gets a zero output.

Grouped-query attention: query head ``q`` reads KV head ``q // (q_heads // kv_heads)``.

The reference never pads to the longest head: it runs one ``scaled_dot_product_attention`` per KV head, over that
head's own entries, with the query heads of its group together. The Triton kernel
(:mod:`.triton_varlen_decode`) must return the same tensor within floating-point tolerance.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["ragged_attention", "check_ragged_arguments"]


def check_ragged_arguments(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, starts: torch.Tensor,
                           lengths: torch.Tensor, *, check_index: bool = True) -> None:
    """ValueError naming the parameter for inputs no implementation accepts. ``check_index=False`` skips the checks
    that read the index's values (three device reads), for a caller that keeps the index valid by construction
    (:class:`kvpress_phase.ragged.RaggedLayer`); shapes and dtypes are always checked."""
    if query.dim() != 3:
        raise ValueError(f"query must be (q_heads, n_new, head_dim), got shape {tuple(query.shape)}")
    if keys.dim() != 2 or values.dim() != 2:
        raise ValueError(f"keys and values must be (capacity, dim) buffers, got {tuple(keys.shape)} and "
                         f"{tuple(values.shape)}")
    if keys.shape[0] != values.shape[0]:
        raise ValueError(f"keys and values must have the same rows, got {keys.shape[0]} and {values.shape[0]}")
    if keys.shape[1] != query.shape[-1]:
        raise ValueError(f"keys' head_dim {keys.shape[1]} differs from query's {query.shape[-1]}")
    if starts.dim() != 1 or lengths.dim() != 1 or starts.shape != lengths.shape:
        raise ValueError(f"starts and lengths must be (kv_heads,) tensors, got {tuple(starts.shape)} and "
                         f"{tuple(lengths.shape)}")
    if starts.dtype.is_floating_point or lengths.dtype.is_floating_point:
        raise ValueError("starts and lengths must be integer tensors")
    kv_heads = starts.shape[0]
    if kv_heads == 0 or query.shape[0] % kv_heads:
        raise ValueError(f"query's {query.shape[0]} heads must be a multiple of the {kv_heads} KV heads (lengths)")
    if query.dtype != keys.dtype or keys.dtype != values.dtype:
        raise ValueError(f"query, keys and values must share one dtype, got {query.dtype}, {keys.dtype}, "
                         f"{values.dtype}")
    if check_index and kv_heads and (bool((lengths < 0).any()) or bool((starts < 0).any())
                     or int((starts + lengths).max()) > keys.shape[0]):
        raise ValueError(f"starts and lengths must describe rows inside the {keys.shape[0]}-row buffers")


def ragged_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, starts: torch.Tensor,
                     lengths: torch.Tensor, scaling: Optional[float] = None, *, check_index: bool = True) -> torch.Tensor:
    """Attention of ``query`` (``(q_heads, n_new, head_dim)``) over each KV head's own entries (module docstring).

    Returns ``(q_heads, n_new, value_dim)`` in the query's dtype. ``scaling`` defaults to ``head_dim ** -0.5``.
    One SDPA call per non-empty KV head, on views of the buffers (nothing is copied or padded); with one new token
    (a decoding step) the group's query heads are the call's query rows and no mask is built.
    """
    check_ragged_arguments(query, keys, values, starts, lengths, check_index=check_index)
    q_heads, n_new, head_dim = query.shape
    kv_heads = starts.shape[0]
    group = q_heads // kv_heads
    scale = head_dim ** -0.5 if scaling is None else float(scaling)
    out = query.new_empty(q_heads, n_new, values.shape[1])
    for h, (start, length) in enumerate(zip(starts.tolist(), lengths.tolist())):
        rows = slice(h * group, (h + 1) * group)
        first_seen = length - n_new + 1  # entries query 0 sees; query i sees i more
        if length == 0 or first_seen + n_new - 1 <= 0:
            out[rows] = 0
            continue
        k = keys[start:start + length][None, None]  # (1, 1, length, head_dim): a view
        v = values[start:start + length][None, None]
        if n_new == 1:  # every entry visible: the group's heads are the query rows
            q = query[rows].reshape(1, 1, group, head_dim)
            out[rows] = F.scaled_dot_product_attention(q, k, v, scale=scale).reshape(group, 1, -1)
            continue
        visible = torch.arange(n_new, device=query.device) + first_seen  # (n_new,) entries each query sees
        mask = torch.arange(length, device=query.device)[None, :] < visible[:, None]  # (n_new, length)
        o = F.scaled_dot_product_attention(query[rows][None], k, v, attn_mask=mask, scale=scale)[0]
        out[rows] = torch.where((visible > 0)[None, :, None], o, torch.zeros((), dtype=o.dtype, device=o.device))
    return out
