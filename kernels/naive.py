"""Plain-PyTorch references for the chunked-stride compression ops.

These functions are the specification: the Triton kernels in this package must return the same tensors (within
floating-point tolerance). They are also the path every press takes where Triton is absent or the tensors are
not on a GPU.

Both ops take keys and values of shape ``(batch, heads, seq_len, head_dim)`` and a
:class:`~kvpress_phase.phase.WindowLayout`, and return a :class:`Compressed` triple whose tensors have
``layout.compressed_length`` entries: the raw tokens before the first window, ``k`` entries per window, then
the raw tokens after the last window, in that order (so entries stay sorted by position).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from kvpress_phase.phase import WindowLayout, group_bounds, group_membership
from kvpress_phase.rope import rotate

WEIGHTINGS = ("mean", "score")
ROPE_MODES = ("none", "start", "center", "centroid")


class Compressed(NamedTuple):
    keys: torch.Tensor
    """``(batch, heads, compressed_length, head_dim)``"""
    values: torch.Tensor
    """``(batch, heads, compressed_length, head_dim)``"""
    positions: torch.Tensor
    """``(batch, heads, compressed_length)`` long: the source position of every raw or selected entry, the
    first position of its group for a pooled entry."""


# ---------------------------------------------------------------------------------------------- helpers
def check_pool_arguments(weighting: str, rope: str, scores, inv_freq) -> None:
    """ValueError for pool arguments that no implementation accepts."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    if rope not in ROPE_MODES:
        raise ValueError(f"rope must be one of {ROPE_MODES}, got {rope!r}")
    if weighting == "score" and scores is None:
        raise ValueError("weighting='score' needs scores")
    if rope != "none" and inv_freq is None:
        raise ValueError(f"rope={rope!r} needs inv_freq")


def _windows(x: torch.Tensor, layout: WindowLayout) -> torch.Tensor:
    """``(batch, heads, n_windows, window, ...)`` view (or gathered copy) of ``x`` laid out in windows.

    ``x`` is ``(batch, heads, seq_len)`` or ``(batch, heads, seq_len, dim)``. Slots past the end of the sequence
    repeat the last token. A uniform grid is a view; staggered grids gather each row's span once (so that
    overlapping windows do not copy a token twice) and view that.
    """
    n, nw, W, S = layout.seq_len, layout.n_windows, layout.window, layout.stride
    span = (nw - 1) * S + W
    if layout.uniform and int(layout.first[0, 0]) + span <= n:
        f = int(layout.first[0, 0])
        seg = x[:, :, f : f + span]
    else:
        idx = (layout.first[..., None] + torch.arange(span, device=x.device)).clamp(max=n - 1)
        seg = x.gather(2, idx if x.dim() == 3 else idx[..., None].expand(-1, -1, -1, x.shape[-1]))
    if W == S:  # non-overlapping windows: a plain reshape
        return seg.unflatten(2, (nw, S))
    win = seg.unfold(2, W, S)  # (..., nw, [dim,] W): a view
    return win if x.dim() == 3 else win.transpose(-1, -2)


def _assemble(x: torch.Tensor, entries: torch.Tensor, layout: WindowLayout) -> torch.Tensor:
    """Put window ``entries`` (``(batch, heads, n_windows * k[, dim])``) between the raw tokens of ``x``."""
    nw, S = layout.n_windows, layout.stride
    if layout.uniform:
        f = int(layout.first[0, 0])
        return torch.cat((x[:, :, :f], entries.to(x.dtype), x[:, :, f + nw * S :]), dim=2)
    src = layout.raw_source_index()
    mask = layout.window_slot_mask()
    ent_idx = (torch.arange(layout.compressed_length, device=x.device) - layout.first[..., None]).clamp(
        0, max(nw * layout.k - 1, 0)
    )
    if x.dim() == 4:
        d = x.shape[-1]
        src, ent_idx, mask = src[..., None].expand(-1, -1, -1, d), ent_idx[..., None].expand(-1, -1, -1, d), mask[..., None]
    return torch.where(mask, entries.to(x.dtype).gather(2, ent_idx), x.gather(2, src))


def _to_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast a float32 result back to ``dtype`` without overflowing to inf."""
    if dtype in (torch.float16, torch.bfloat16):
        fmax = torch.finfo(dtype).max
        x = x.clamp(-fmax, fmax)
    return x.to(dtype)


def _positions_tensor(layout: WindowLayout, entry_positions: torch.Tensor) -> torch.Tensor:
    n = layout.seq_len
    raw = torch.arange(n, device=entry_positions.device).expand(layout.batch, layout.heads, n)
    return _assemble(raw, entry_positions.flatten(2), layout)


def _passthrough(keys: torch.Tensor, values: torch.Tensor, layout: WindowLayout) -> Compressed:
    n = keys.shape[2]
    pos = torch.arange(n, device=keys.device).expand(keys.shape[0], keys.shape[1], n)
    return Compressed(keys, values, pos)


# ---------------------------------------------------------------------------------------------- select
def select_windows(
    keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor, layout: WindowLayout
) -> Compressed:
    """Keep the ``k`` highest-scoring tokens of every window (``window == stride``).

    Ties go to the earlier token. Kept tokens keep their order and their rotation.

    Parameters
    ----------
    scores : torch.Tensor
        ``(batch, heads, seq_len)``, higher = keep.
    """
    if layout.window != layout.stride:
        raise ValueError(f"select needs window == stride, got window={layout.window}, stride={layout.stride}")
    if layout.n_windows == 0:
        return _passthrough(keys, values, layout)
    k = layout.k
    s = _windows(scores.float(), layout)  # (B, H, nw, S)
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :k]
    order = order.sort(dim=-1).values
    sel = (layout.window_starts()[..., None] + order).flatten(2)  # (B, H, nw * k)
    def take(x):
        return x.gather(2, sel[..., None].expand(-1, -1, -1, x.shape[-1]))

    new_keys = _assemble(keys, take(keys), layout)
    new_values = _assemble(values, take(values), layout)
    return Compressed(new_keys, new_values, _positions_tensor(layout, sel))


# ---------------------------------------------------------------------------------------------- pool
def pool_windows(
    keys: torch.Tensor,
    values: torch.Tensor,
    layout: WindowLayout,
    *,
    scores: Optional[torch.Tensor] = None,
    weighting: str = "mean",
    rope: str = "none",
    inv_freq: Optional[torch.Tensor] = None,
) -> Compressed:
    """Merge every window into ``k`` entries.

    Entry ``g`` of a window pools the slots ``[lo[g], hi[g])`` given by
    :func:`~kvpress_phase.phase.group_bounds` (contiguous groups when ``window == stride``; groups twice as
    long, every token in two entries, when ``window == 2 * stride``). Inside a group, tokens are weighted
    uniformly (``weighting="mean"``) or by the softmax of their scores over the group (``"score"``). Values are
    the weighted mean of the group's values. Keys:

    - ``rope="none"``: weighted mean of the keys as stored (each rotated at its own position);
    - ``"start"`` / ``"center"`` / ``"centroid"``: every key is un-rotated, the weighted mean is taken, and the
      merged key is rotated at the group's first position, the midpoint of its first and last positions, or
      its weight-averaged position. Needs ``inv_freq``.

    Accumulation is in float32; the result is cast back to the input dtype (clamped to its finite range).
    Window slots past the end of the sequence (only when ``window > stride`` and fewer than
    ``window - stride`` local tokens follow) repeat the last token.
    """
    check_pool_arguments(weighting, rope, scores, inv_freq)
    if layout.n_windows == 0:
        return _passthrough(keys, values, layout)

    W, k = layout.window, layout.k
    device = keys.device
    member = group_membership(W, layout.stride, k, device=device)  # (W, k)
    lo, hi = group_bounds(W, layout.stride, k)

    # mix[..., i, g]: weight of slot i in entry g; each entry's weights sum to 1
    if weighting == "mean":
        mix = member.expand(layout.batch, layout.heads, layout.n_windows, W, k)
    else:
        s = _windows(scores.float(), layout)[..., None]  # (B, H, nw, W, 1)
        s = s.masked_fill(member == 0, float("-inf"))  # (B, H, nw, W, k): only the group's own slots
        mix = torch.exp(s - s.amax(dim=-2, keepdim=True))
    mix = mix / mix.sum(dim=-2, keepdim=True)

    pos = layout.window_positions().clamp(max=layout.seq_len - 1)  # (B, H, nw, W)
    group_start = pos[..., lo]  # (B, H, nw, k)

    def merge(x: torch.Tensor) -> torch.Tensor:  # (B, H, nw, W, D) -> (B, H, nw, k, D), weighted group means
        if weighting == "mean" and W == layout.stride and W % k == 0:  # equal contiguous groups: a strided mean
            return x.unflatten(3, (k, W // k)).float().mean(dim=-2)
        return mix.transpose(-1, -2) @ x.float()

    kw = _windows(keys, layout)  # (B, H, nw, W, D)
    vw = _windows(values, layout)
    if rope == "none":
        merged_k = merge(kw)
    else:
        # Un-rotating at p_i and re-rotating at rep is one rotation by rep - p_i. Split it at the window start
        # ws: rotate every slot by ws - p_i (a (W,) table unless slots were clamped at the end), pool, then
        # rotate each merged entry by rep - ws.
        ws = layout.window_starts()[..., None]  # (B, H, nw, 1)
        rel = pos - ws
        slots = torch.arange(W, device=device)
        if bool((rel == slots).all()):
            rel = slots
        merged_k = merge(rotate(kw, -rel, inv_freq))
        # representative position of every entry, relative to its window start (exact at any length); start
        # and centre are the same for every window unless slots were clamped, so a (k,) table then suffices
        if rope == "centroid":
            rep = (mix * rel[..., None].float()).sum(dim=-2)
        else:
            last = torch.tensor([h - 1 for h in hi], device=device)
            first = torch.tensor(lo, device=device)
            rep = (first if rope == "start" else (first + last) / 2) if rel is slots else (
                (group_start - ws).float() if rope == "start" else (group_start + pos[..., last] - 2 * ws).float() / 2)
        merged_k = rotate(merged_k, rep, inv_freq)
    merged_v = merge(vw)

    new_keys = _assemble(keys, _to_dtype(merged_k, keys.dtype).flatten(2, 3), layout)
    new_values = _assemble(values, _to_dtype(merged_v, values.dtype).flatten(2, 3), layout)
    return Compressed(new_keys, new_values, _positions_tensor(layout, group_start))
