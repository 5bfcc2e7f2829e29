"""Choosing which tokens stay raw by score: across the whole row, or the same number in every window.

Step 3 of :class:`~kvpress_phase.PhaseAwarePress` (the row's best tokens) and of
:class:`~kvpress_phase.StaggeredWindowPress`'s ``budget="window_topk"`` (each window's best tokens); the chosen
tokens are then kept alone (:func:`keep_only`) or beside pooled leftovers (:func:`kvpress_phase.kernels.keep_and_pool`).
"""

from __future__ import annotations

import torch

from kvpress_phase.kernels import Compressed
from kvpress_phase.phase import WindowLayout


def raw_tokens(scores: torch.Tensor, layout: WindowLayout, n_raw: int, *, share_heads: bool, cap: bool = False,
               per_window: bool = False, recent: float = 0.0) -> torch.Tensor:
    """``(batch, heads, seq_len)`` bool: the ``n_raw`` window tokens of ``layout`` that stay raw; tokens outside the
    windows are always raw.

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
    win_pos = layout.window_positions().clamp(max=s.shape[2] - 1)  # (B, H, nw, W)
    options = dict(n_windows=layout.n_windows, n_raw=n_raw, cap=cap, per_window=per_window, recent=recent)
    if share_heads:
        s = s.mean(dim=1, keepdim=True)
        if bool((layout.first == layout.first[:, :1]).all()):  # one grid for every head: choose once
            return _choose(s, win_pos[:, :1], **options).expand(-1, heads, -1).contiguous()
        s = s.expand(-1, heads, -1)
    return _choose(s, win_pos, **options)


def _choose(s: torch.Tensor, win_pos: torch.Tensor, *, n_windows: int, n_raw: int, cap: bool, per_window: bool,
            recent: float) -> torch.Tensor:
    B, H, n = s.shape
    key = s.gather(2, win_pos.flatten(2)).view(win_pos.shape)  # (B, H, nw, W): the window tokens' scores
    original = key
    if recent > 0:  # the last window positions, one contiguous block
        n_recent = min(int(round(recent * n_raw)), n_raw)
        if n_recent:
            flat = key.flatten(2).clone()
            flat[..., flat.shape[-1] - n_recent:] = float("inf")
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
    keep = torch.zeros_like(flat_key, dtype=torch.bool).scatter_(-1, order[..., :n_raw], True)
    return raw.scatter_(2, win_pos.flatten(2), keep)


def keep_only(keys: torch.Tensor, values: torch.Tensor, raw: torch.Tensor, layout: WindowLayout) -> Compressed:
    """The tokens ``raw`` marks, in order: no pooled entries, the whole budget goes to raw tokens."""
    idx = torch.argsort((~raw).to(torch.int8), dim=-1, stable=True)[..., : layout.compressed_length]
    d = keys.shape[-1]
    take = idx[..., None].expand(-1, -1, -1, d)
    return Compressed(keys.gather(2, take), values.gather(2, take), idx, idx + 1)
