"""A diagnostic that needs no generation: how much attention the needle keeps after compression.

For one prefilled context and one press, the question is run once over the compressed cache with eager
attention, and the attention of the question's last token (the one that predicts the first answer token) is
summed over the cache entries whose source tokens overlap the needle's token span. The same sum over the full
cache is the reference; their ratio, averaged over layers and heads, is ``needle_attention_ratio``: 1 means the
needle draws as much attention as without compression, 0 means none.

Which source tokens an entry covers comes from ``press.stats`` for this package's presses (a pooled entry covers
its group), from the identity for an uncompressed layer, and, for presses that keep a subset of the original
entries (the kvpress scorer presses), from matching every kept key against the original keys.
"""

from __future__ import annotations

import torch


def _match_kept(original: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Source index of every kept key (``-1`` if it is no original key), by exact match of a random projection."""
    r = torch.randn(original.shape[-1], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    h_orig = original.double() @ r.to(original.device)
    h_kept = kept.double() @ r.to(kept.device)
    order = h_orig.argsort(dim=-1)
    sorted_h = h_orig.gather(-1, order)
    pos = torch.searchsorted(sorted_h, h_kept.contiguous()).clamp(max=sorted_h.shape[-1] - 1)
    idx = order.gather(-1, pos)
    found = sorted_h.gather(-1, pos) == h_kept
    return torch.where(found, idx, torch.full_like(idx, -1))


def entry_spans(press, layer_idx: int, original_keys: torch.Tensor, kept_keys: torch.Tensor):
    """``(start, end)`` tensors ``(batch, heads, entries)``: the source tokens each cache entry covers."""
    stats = getattr(press, "stats", {}).get(layer_idx) if press is not None else None
    if stats is not None and stats.positions is not None:
        return stats.positions.long(), stats.ends.long()
    n = kept_keys.shape[2]
    if n == original_keys.shape[2] and (press is None or torch.equal(kept_keys, original_keys)):
        start = torch.arange(n, device=kept_keys.device).expand(kept_keys.shape[:3])
        return start, start + 1
    start = _match_kept(original_keys, kept_keys)
    return start, torch.where(start >= 0, start + 1, start)


@torch.no_grad()
def needle_attention(engine, state, press, question_ids: torch.Tensor, needle: tuple[int, int],
                     cache=None) -> float:
    """Mean over layers and heads of the last question token's attention mass on the needle's entries."""
    model = engine.model
    cache = cache if cache is not None else engine.compressed_cache(state, press)
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        positions = torch.arange(state.context_length, state.context_length + question_ids.shape[1],
                                 device=model.device)[None]
        out = model.model(input_ids=question_ids.to(model.device), past_key_values=cache, position_ids=positions,
                          output_attentions=True)
    finally:
        model.set_attn_implementation(previous)
    masses = []
    lo, hi = needle
    for layer_idx, attn in enumerate(out.attentions):
        if attn is None or layer_idx not in state.inputs:
            continue
        _, _, keys, _, _, _ = state.inputs[layer_idx]
        n_entries = attn.shape[-1] - question_ids.shape[1]
        kept = cache.layers[layer_idx].keys[:, :, :n_entries]
        start, end = entry_spans(press, layer_idx, keys, kept)
        covers = (start < hi) & (end > lo) & (start >= 0)  # (batch, kv_heads, entries)
        groups = attn.shape[1] // covers.shape[1]
        covers = covers.repeat_interleave(groups, dim=1)
        last = attn[:, :, -1, :n_entries]
        masses.append(float((last * covers).sum(-1).mean()))
    return sum(masses) / max(1, len(masses))
