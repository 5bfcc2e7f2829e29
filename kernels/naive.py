"""Plain-PyTorch references for the chunked-stride compression ops.

These functions are the specification: the Triton kernels in this package must return the same tensors (within
floating-point tolerance). They are also the path every press takes where Triton is absent or the tensors are
not on a GPU.

Both ops take keys and values of shape ``(batch, heads, seq_len, head_dim)`` and a
:class:`~kvpress_phase.core.phase.WindowLayout`, and return a :class:`Compressed` triple whose tensors have
``layout.compressed_length`` entries: the raw tokens before the first window, ``k`` entries per window, then
the raw tokens after the last window, in that order (so entries stay sorted by position).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from kvpress_phase.core.phase import WindowLayout, group_bounds, group_membership
from kvpress_phase.core.rope import add_rotated_, rotate

WEIGHTINGS = ("mean", "score")
ROPE_MODES = ("none", "start", "center", "centroid")
DENSE_MERGE_ELEMENTS = 1 << 22
"""Window keys (elements) up to which :func:`keep_and_pool` merges RoPE-aware through one rotated copy (16 MiB in
float32, cache-sized); above it, slot by slot without the copy."""


class Compressed(NamedTuple):
    keys: torch.Tensor
    """``(batch, heads, compressed_length, head_dim)``"""
    values: torch.Tensor
    """``(batch, heads, compressed_length, head_dim)``"""
    positions: torch.Tensor
    """``(batch, heads, compressed_length)`` long: the source position of every raw or selected entry, the
    first position of its group for a pooled entry."""
    ends: Optional[torch.Tensor] = None
    """``(batch, heads, compressed_length)`` long, one past the last source position of every entry, where the
    op knows it better than the layout does (:func:`keep_and_pool`); ``None`` otherwise."""
    masked: Optional[torch.Tensor] = None
    """``(batch, heads, compressed_length)`` bool: entries stored only to pad heads that keep fewer entries than
    others in the layer (a budget per KV head), masked while decoding; ``None`` when every entry is attended."""


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


def _weighted_rows(mix: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``(batch, heads, n, dim)`` float32: ``sum_j mix[..., i, j] * x[..., i, j, :]`` for windows ``x`` of shape
    ``(batch, heads, n, W, dim)``. One batched matrix product per (batch, head) row, so that the windows of a row,
    a view into the cache, are read in place instead of being copied to a contiguous batch first."""
    w = mix.unsqueeze(-2)
    if torch.is_grad_enabled() and (mix.requires_grad or x.requires_grad):  # training: one differentiable product
        return (w @ x.float())[..., 0, :]
    out = torch.empty(mix.shape[:-1] + (x.shape[-1],), dtype=torch.float32, device=x.device)
    for b in range(x.shape[0]):
        for h in range(x.shape[1]):
            torch.matmul(w[b, h], x[b, h].float(), out=out[b, h].unsqueeze(-2))
    return out


def _take_rows(x: torch.Tensor, flat_index: torch.Tensor, length: int) -> torch.Tensor:
    """``(batch * heads * length, dim)`` rows of ``x`` (``(batch, heads, seq_len, dim)``) at ``flat_index``
    (``row * seq_len + position``): one contiguous row copy each, much faster on CPU than ``gather`` along dim 2."""
    if x.is_contiguous():
        return x.reshape(-1, x.shape[-1]).index_select(0, flat_index)
    b, h, n, d = x.shape
    pos = (flat_index % n).view(b, h, length)
    return x.gather(2, pos[..., None].expand(-1, -1, -1, d)).reshape(-1, d)


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
    return Compressed(_select_rows(keys, sel, layout), _select_rows(values, sel, layout), _positions_tensor(layout, sel))


def _select_rows(x: torch.Tensor, sel: torch.Tensor, layout: WindowLayout) -> torch.Tensor:
    """``x`` with its windows replaced by the rows at ``sel`` (``(batch, heads, n_windows * k)`` positions). On a
    uniform grid the rows are copied once, straight into the output (not under autograd, which ``out=`` does not
    support); otherwise gathered and assembled."""
    B, H, m = sel.shape
    differentiable = torch.is_grad_enabled() and x.requires_grad
    if differentiable or not (layout.uniform and x.is_contiguous()):
        flat = (sel + torch.arange(B * H, device=sel.device).view(B, H, 1) * layout.seq_len).flatten()
        return _assemble(x, _take_rows(x, flat, m).view(B, H, m, x.shape[-1]), layout)
    f = int(layout.first[0, 0])
    end = f + layout.n_windows * layout.stride
    out = x.new_empty(B, H, layout.compressed_length, x.shape[-1])
    out[:, :, :f] = x[:, :, :f]
    out[:, :, f + m :] = x[:, :, end:]
    for b in range(B):
        for h in range(H):
            torch.index_select(x[b, h], 0, sel[b, h], out=out[b, h, f : f + m])
    return out


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
    :func:`~kvpress_phase.core.phase.group_bounds` (contiguous groups when ``window == stride``; groups twice as
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
    if weighting == "mean" and W == layout.stride and W % k == 0 and rope != "centroid":
        # equal contiguous groups of g slots: slot o of a group is rotated by rep - o, which is the same for
        # every group (rep = 0 at the start, (g - 1) / 2 at the centre), and summed straight into the output
        g = W // k
        angles = None if rope == "none" else [(0.0 if rope == "start" else (g - 1) / 2) - o for o in range(g)]
        return Compressed(_pool_equal_groups(keys, kw, layout, g, angles, inv_freq),
                          _pool_equal_groups(values, vw, layout, g, None, None), _positions_tensor(layout, group_start))
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


def _pool_equal_groups(x: torch.Tensor, xw: torch.Tensor, layout: WindowLayout, g: int, angles, inv_freq) -> torch.Tensor:
    """``x`` with every window (``xw``, ``(B, H, nw, W, D)``) replaced by the means of its ``W // g`` groups of
    ``g`` consecutive slots, slot ``o`` of a group rotated by ``angles[o]`` first (no rotation when ``angles`` is
    None). The means are accumulated in float32, in place of the output where the grid is uniform and ``x`` is
    float32 (no temporary the size of the windows), in a separate buffer otherwise."""
    B, H, nw, W, D = xw.shape
    k = W // g
    direct = layout.uniform and x.dtype == torch.float32
    if direct:
        f = int(layout.first[0, 0])
        out = x.new_empty(B, H, layout.compressed_length, D)
        out[:, :, :f] = x[:, :, :f]
        out[:, :, f + nw * k :] = x[:, :, f + nw * W :]
        acc = out[:, :, f : f + nw * k].unflatten(2, (nw, k))
    else:
        acc = torch.empty(B, H, nw, k, D, dtype=torch.float32, device=x.device)
    slots = xw.unflatten(3, (k, g))
    for o in range(g):
        xo = slots[..., o, :]
        a = 0.0 if angles is None else angles[o]
        if o == 0:
            acc.copy_(xo if a == 0 else rotate(xo, torch.tensor(a), inv_freq))
        elif a == 0:
            acc.add_(xo)
        else:
            add_rotated_(acc, xo, a, inv_freq)
    acc.mul_(1.0 / g)
    return out if direct else _assemble(x, _to_dtype(acc, x.dtype).flatten(2, 3), layout)


# ---------------------------------------------------------------------------------------------- keep and pool
def keep_and_pool_plan(raw: torch.Tensor, layout: WindowLayout) -> dict:
    """Where every window slot goes in :func:`keep_and_pool`'s output (shared by the reference and the kernel).

    Returns a dict of ``(batch, heads, n_windows[, window])`` tensors: ``raw`` (bool, the window slots kept as
    they are), ``count`` (raw slots per window), ``base`` (output index of the window's first entry),
    ``first_member`` / ``last_member`` (slots of the first and last token the window's merged entry pools) and
    ``slot_out`` (output index of every slot; the merged entry's index for pooled slots).
    """
    if layout.window != layout.stride:
        raise ValueError(f"keep_and_pool needs window == stride, got window={layout.window}, stride={layout.stride}")
    if raw.shape != (layout.batch, layout.heads, layout.seq_len):
        raise ValueError(f"raw must have shape {(layout.batch, layout.heads, layout.seq_len)}, got {tuple(raw.shape)}")
    S = layout.stride
    rw = _windows(raw.to(torch.bool), layout)  # (B, H, nw, S)
    member = ~rw
    if not bool(member.any(dim=-1).all()):
        raise ValueError("every window must leave at least one token to pool (raw marks a whole window)")
    count = rw.sum(dim=-1)  # (B, H, nw)
    kept = count.sum(dim=-1)
    if not bool((kept == kept.flatten()[0]).all()):
        raise ValueError("every row must keep the same number of raw window tokens (the cache is one tensor)")
    size = count + 1
    base = layout.first[..., None] + size.cumsum(dim=-1) - size
    slots = torch.arange(S, device=raw.device)
    first_member = member.to(torch.int8).argmax(dim=-1)  # every slot before it is raw
    last_member = S - 1 - member.flip(-1).to(torch.int8).argmax(dim=-1)
    raw_before = rw.cumsum(dim=-1) - rw.to(count.dtype)
    after_merged = (slots > first_member[..., None]).to(count.dtype)
    slot_out = torch.where(rw, base[..., None] + raw_before + after_merged, (base + first_member)[..., None])
    return {"raw": rw, "count": count, "base": base, "first_member": first_member, "last_member": last_member,
            "slot_out": slot_out, "kept": int(kept.flatten()[0]) if kept.numel() else 0}


def keep_and_pool(
    keys: torch.Tensor,
    values: torch.Tensor,
    raw: torch.Tensor,
    layout: WindowLayout,
    *,
    scores: Optional[torch.Tensor] = None,
    weighting: str = "mean",
    rope: str = "none",
    inv_freq: Optional[torch.Tensor] = None,
) -> Compressed:
    """Keep the tokens ``raw`` marks, and merge each window's other tokens into one entry.

    The content-adaptive counterpart of :func:`pool_windows`: which tokens of a window stay as they are, and so
    how many entries the window yields, is given by the mask ``raw`` (``(batch, heads, seq_len)`` bool), chosen
    by the caller across the whole row. Only the mask's values inside the compressed windows matter (tokens
    before the first window and after the last are always kept). Every window must leave at least one token
    unmarked, and every row must mark the same number of window tokens; the output then has
    ``seq_len - n_windows * stride + n_kept + n_windows`` entries.

    Each window's unmarked tokens (its *members*) are merged like a group of :func:`pool_windows`: weighted
    uniformly or by the softmax of their scores over the members, keys un-rotated and re-rotated at the first
    member's position (``rope="start"``), the midpoint of the first and last members (``"center"``), the weighted
    mean member position (``"centroid"``), or averaged as stored (``"none"``). A window with one member yields
    that token exactly (up to rounding) under every RoPE mode but ``"center"``/``"centroid"`` of one token, which
    are the token's own position too.

    Entries stay sorted by position: the merged entry sits where its first member was. ``positions`` holds every
    entry's first source position and ``ends`` one past its last (members need not be contiguous: raw tokens of
    the window can lie between them).
    """
    check_pool_arguments(weighting, rope, scores, inv_freq)
    if layout.n_windows == 0:
        return _passthrough(keys, values, layout)
    plan = keep_and_pool_plan(raw, layout)
    S, nw = layout.stride, layout.n_windows
    device = keys.device
    member = ~plan["raw"]
    if weighting == "mean":
        mix = member.to(torch.float32)
    else:
        s = _windows(scores.float(), layout).masked_fill(~member, float("-inf"))
        mix = torch.exp(s - s.amax(dim=-1, keepdim=True))
    mix = mix / mix.sum(dim=-1, keepdim=True)  # (B, H, nw, S)

    slots = torch.arange(S, device=device)
    kw = _windows(keys, layout)  # (B, H, nw, S, D)
    vw = _windows(values, layout)
    if rope == "none":
        merged_k = _weighted_rows(mix, kw)
    else:
        # every key rotated back to its window start (slot s by -s), weighted and summed
        if kw.numel() <= DENSE_MERGE_ELEMENTS:  # small: one rotated copy and one product (fewest operations)
            merged_k = _weighted_rows(mix, rotate(kw, -slots, inv_freq))
        else:  # large: one slot at a time over blocks of windows whose float32 sums (about 4 MiB) stay in cache
            merged_k = torch.zeros(kw.shape[:3] + kw.shape[4:], dtype=torch.float32, device=device)
            block = max(1, (1 << 20) // (layout.batch * layout.heads * kw.shape[-1]))
            for w in range(0, nw, block):
                for s in range(S):
                    add_rotated_(merged_k[:, :, w : w + block], kw[:, :, w : w + block, s], -s, inv_freq,
                                 weight=mix[:, :, w : w + block, s, None])
        first, last = plan["first_member"].float(), plan["last_member"].float()
        rep = {"start": first, "center": (first + last) / 2, "centroid": (mix * slots).sum(dim=-1)}[rope]
        merged_k = rotate(merged_k, rep, inv_freq)
    merged_v = _weighted_rows(mix, vw)

    C = layout.seq_len - nw * S + plan["kept"] + nw
    starts = layout.window_starts()  # (B, H, nw)
    pos = starts[..., None] + slots  # (B, H, nw, S)
    # source index of every output entry: raw tokens outside the windows, then every window slot scattered to its
    # output index (pooled slots all land on their merged entry, which is overwritten below)
    t = torch.arange(C, device=device)
    f = layout.first[..., None]
    src = torch.where(t < f, t, t + (nw * S - plan["kept"] - nw)).expand(layout.batch, layout.heads, C).clone()
    src.scatter_(2, plan["slot_out"].flatten(2), pos.flatten(2))
    merged_at = (plan["base"] + plan["first_member"])  # (B, H, nw)
    ends = src + 1
    ends.scatter_(2, merged_at, starts + plan["last_member"] + 1)

    rows = torch.arange(layout.batch * layout.heads, device=device).view(layout.batch, layout.heads, 1)
    flat_src = (rows * layout.seq_len + src).flatten()
    flat_merged = (rows * C + merged_at).flatten()

    def assemble(x, merged):
        return _take_rows(x, flat_src, C).index_copy_(
            0, flat_merged, _to_dtype(merged, x.dtype).flatten(0, 2)).view(layout.batch, layout.heads, C, -1)

    positions = src.clone()
    positions.scatter_(2, merged_at, starts + plan["first_member"])
    return Compressed(assemble(keys, merged_k), assemble(values, merged_v), positions, ends)
