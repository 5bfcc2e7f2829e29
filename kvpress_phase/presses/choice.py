"""Choosing which tokens stay raw by score: across the whole row, or the same number in every window.

Step 3 of :class:`~kvpress_phase.PhaseAwarePress` (the row's best tokens) and of
:class:`~kvpress_phase.StaggeredWindowPress`'s ``budget="window_topk"`` (each window's best tokens); the chosen
tokens are then kept alone (:func:`keep_only`) or beside pooled leftovers (:func:`kvpress_phase.kernels.keep_and_pool`).
"""

from __future__ import annotations

from typing import Union

import torch

from kvpress_phase.kernels import Compressed
from kvpress_phase.core.phase import WindowLayout


def raw_tokens(scores: torch.Tensor, layout: WindowLayout, n_raw: Union[int, torch.Tensor], *, share_heads: bool,
               cap: bool = False, per_window: bool = False, recent: float = 0.0) -> torch.Tensor:
    """``(batch, heads, seq_len)`` bool: the ``n_raw`` window tokens of ``layout`` that stay raw; tokens outside the
    windows are always raw. ``n_raw`` is one count, or a ``(batch, heads)`` tensor of counts (a budget per KV head,
    :func:`spread_budget`; not with ``share_heads``, ``cap`` or ``per_window``).

    - ``share_heads``: the scores are averaged over the KV heads first, so every head keeps the same tokens (a fact
      is kept whole in every head);
    - ``per_window``: ``n_raw // n_windows`` tokens in every window (a budget fixed per window) instead of the
      ``n_raw`` best of the row;
    - ``recent``: the share of ``n_raw`` spent on the last window tokens, one contiguous block (recency sized to
      the budget), the rest by score;
    - ``cap``: each window's lowest-scoring token is never chosen, so every window keeps a token to pool.

    Ties go to the earlier token (stable sorts).
    """
    s = scores.float()
    heads = s.shape[1]
    if isinstance(n_raw, torch.Tensor) and (share_heads or cap or per_window):
        raise ValueError("a budget per KV head needs share_heads=False, and neither cap nor per_window")
    win_pos = layout.window_positions().clamp(max=s.shape[2] - 1)  # (B, H, nw, W)
    options = dict(n_windows=layout.n_windows, n_raw=n_raw, cap=cap, per_window=per_window, recent=recent)
    if share_heads:
        s = s.mean(dim=1, keepdim=True)
        if bool((layout.first == layout.first[:, :1]).all()):  # one grid for every head: choose once
            return _choose(s, win_pos[:, :1], **options).expand(-1, heads, -1).contiguous()
        s = s.expand(-1, heads, -1)
    return _choose(s, win_pos, **options)


def _choose(s: torch.Tensor, win_pos: torch.Tensor, *, n_windows: int, n_raw: Union[int, torch.Tensor], cap: bool,
            per_window: bool, recent: float) -> torch.Tensor:
    B, H, n = s.shape
    key = s.gather(2, win_pos.flatten(2)).view(win_pos.shape)  # (B, H, nw, W): the window tokens' scores
    original = key
    if recent > 0:  # the last window positions, one contiguous block
        counts = torch.as_tensor(n_raw, device=s.device).expand(B, H)
        n_recent = torch.minimum(torch.round(recent * counts.double()).long(), counts)  # per row
        if bool((n_recent > 0).any()):
            flat = key.flatten(2).clone()
            last = torch.arange(flat.shape[-1], device=s.device) >= flat.shape[-1] - n_recent[..., None]
            flat[last] = float("inf")
            key = flat.view(key.shape)
    if cap:
        key = key.scatter(-1, original.argmin(dim=-1, keepdim=True), float("-inf"))
    raw = torch.ones(B, H, n, dtype=torch.bool, device=s.device)
    if per_window:  # the same number of raw tokens in every window
        top = key.argsort(dim=-1, descending=True, stable=True)[..., : n_raw // max(n_windows, 1)]
        keep = torch.zeros_like(key, dtype=torch.bool).scatter_(-1, top, True)
        return raw.scatter_(2, win_pos.flatten(2), keep.flatten(2))
    flat_key = key.flatten(2)
    order = flat_key.argsort(dim=-1, descending=True, stable=True)
    if isinstance(n_raw, torch.Tensor):  # a count per row: the row's n_raw best
        rank = torch.arange(order.shape[-1], device=s.device).expand_as(order)
        keep = torch.zeros_like(flat_key, dtype=torch.bool).scatter_(-1, order, rank < n_raw[..., None])
    else:
        keep = torch.zeros_like(flat_key, dtype=torch.bool).scatter_(-1, order[..., :n_raw], True)
    return raw.scatter_(2, win_pos.flatten(2), keep)


def keep_only(keys: torch.Tensor, values: torch.Tensor, raw: torch.Tensor, layout: WindowLayout) -> Compressed:
    """The tokens ``raw`` marks, in order: no pooled entries, the whole budget goes to raw tokens.

    Rows that mark different numbers of tokens (a budget per layer or per KV head) are stored at the layer's longest
    row: a shorter row is padded with its first unmarked tokens, flagged in ``Compressed.masked`` (decoding must
    not attend to them)."""
    counts = raw.sum(dim=-1)
    longest = int(counts.max())
    idx = torch.argsort((~raw).to(torch.int8), dim=-1, stable=True)[..., :longest]
    d = keys.shape[-1]
    take = idx[..., None].expand(-1, -1, -1, d)
    masked = None
    if bool((counts != longest).any()):
        masked = torch.arange(longest, device=raw.device) >= counts[..., None]
    return Compressed(keys.gather(2, take), values.gather(2, take), idx, idx + 1, masked)


def spread_budget(scores: list[torch.Tensor], budgets: list[int], floor: float) -> list[torch.Tensor]:
    """Spend the budgets of several units (layers, or the KV heads of layers) together, by score.

    ``scores[i]`` is ``(rows_i, n_i)``: unit ``i``'s rows (one per KV head, or one for a layer whose heads share
    their tokens) and the scores of its ``n_i`` candidate tokens, comparable between units (KeyDiff's cosine
    similarities are scale-free); ``budgets[i]`` is what each of its rows would keep if every row kept the same.
    All ``sum(rows_i * budgets[i])`` entries go to the best-scoring tokens over every row, except that every row
    first keeps its ``floor * budgets[i]`` best (rounded down; ``floor`` in ``[0, 1]``). Returns each unit's
    ``(rows_i,)`` long tensor of counts (they add up to the total; ties go to the earlier unit and token).
    """
    if not 0 <= floor <= 1:
        raise ValueError(f"floor must be in [0, 1], got {floor!r}")
    keyed = [floor_keyed(s, budget, floor) for s, budget in zip(scores, budgets)]
    total = sum(s.shape[0] * budget for s, budget in zip(keyed, budgets))
    flat = torch.cat([s.flatten() for s in keyed])
    chosen = torch.zeros_like(flat, dtype=torch.bool)
    chosen[flat.argsort(descending=True, stable=True)[:total]] = True
    counts, start = [], 0
    for s in keyed:
        counts.append(chosen[start:start + s.numel()].view(s.shape).sum(dim=-1))
        start += s.numel()
    return counts


def floor_keyed(scores: torch.Tensor, budget: int, floor: float) -> torch.Tensor:
    """``scores`` (``(rows, n)``) in float32 with each row's ``floor * budget`` best (rounded down, ties to the
    earlier token) raised to ``+inf``: the keys by which :func:`spread_budget` and :class:`RunningTopB` rank."""
    s = scores.float()
    n_floor = min(int(floor * budget), s.shape[-1])
    if n_floor:
        top = s.argsort(dim=-1, descending=True, stable=True)[..., :n_floor]
        s = s.scatter(-1, top, float("inf"))
    return s


class RunningTopB:
    """The ``total`` best entries over units (layers) that arrive one at a time, as :func:`spread_budget` would
    choose them from all of them at once, without holding what dropped out.

    Each :meth:`add` ranks the new unit's keys (:func:`floor_keyed`) together with the entries of earlier units that
    are still in the running top-``total`` and keeps the best ``total``; an entry that drops out never comes back.
    The order is total (higher key first, ties to the earlier unit, then the earlier row and token, as
    :func:`spread_budget`'s stable sort), so the top-``total`` of all units is a subset of every running
    top-``total``: after the last unit (and :meth:`finish` with the total of the units that came, if fewer did),
    the entries alive are exactly :func:`spread_budget`'s choice. Memory: the keys of the alive entries (at most
    ``total``) plus one unit's; each step sorts them once.
    """

    def __init__(self, total: int):
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise ValueError(f"total must be an int >= 0, got {total!r}")
        self.total = total
        self._keys: dict = {}   # unit -> (rows, n) float32 keys
        self._alive: dict = {}  # unit -> (rows, n) bool: in the running top-total

    @property
    def units(self) -> list:
        return list(self._keys)

    def alive(self, unit) -> torch.Tensor:
        """``(rows, n)`` bool: the entries of ``unit`` still in the running top-``total``."""
        return self._alive[unit]

    def add(self, unit, keys: torch.Tensor) -> list:
        """Rank ``keys`` (``(rows, n)``, from :func:`floor_keyed`) with the alive entries of the earlier units;
        returns the earlier units that lost entries (the new unit's own are :meth:`alive`)."""
        if unit in self._keys:
            raise ValueError(f"unit {unit!r} was added already")
        self._keys[unit] = keys
        self._alive[unit] = torch.ones_like(keys, dtype=torch.bool)
        return [u for u in self._rank(self.total) if u != unit]

    def finish(self, total: int) -> list:
        """Keep the best ``total`` (``<= self.total``: the units that came were fewer than planned); returns the
        units that lost entries."""
        if total > self.total:
            raise ValueError(f"total can only shrink once entries are dropped: {total} > {self.total}")
        self.total = total
        return self._rank(total)

    def _rank(self, total: int) -> list:
        units = list(self._keys)
        alive_keys = [self._keys[u][self._alive[u]] for u in units]  # row-major: rows, then tokens, in order
        flat = torch.cat(alive_keys) if alive_keys else torch.zeros(0)
        if flat.numel() <= total:
            return []
        chosen = torch.zeros_like(flat, dtype=torch.bool)
        chosen[flat.argsort(descending=True, stable=True)[:total]] = True
        lost, start = [], 0
        for u, k in zip(units, alive_keys):
            part = chosen[start:start + k.numel()]
            start += k.numel()
            if not bool(part.all()):
                alive = self._alive[u].clone()
                alive[alive.clone()] = part
                self._alive[u] = alive
                lost.append(u)
        return lost
