"""Layers whose caches have different lengths, in transformers' attention: the one patch this package applies.

A press that keeps more entries in some layers than in others (:class:`~kvpress_phase.PerLayerWindowedPress`,
``LayerBudgetPress(PhaseAwarePress(...))``) leaves a cache whose layers differ in length. transformers builds one
attention mask per forward pass, sized by the first layer's cache, so a question of more than one token fails in
every other layer (kvpress's own ``PerLayerCompressionPress`` asks for flash attention for this reason).

:func:`patch_attention_functions` wraps transformers' registered attention functions (``ALL_ATTENTION_FUNCTIONS``,
as kvpress's own ``attention_patch`` does) so that a mask of the wrong key length is aligned to the layer's keys:
the query's own columns (causal) are the last ones in every layer, and every earlier column is a compressed context
entry that every query sees. The mask is cut or extended on the left accordingly, only where the columns it cuts
are all visible (a padded batch's mask is never cut; it raises ``ValueError`` instead). Masks of the right length,
and functions that get no tensor mask (flex attention's block masks), pass through untouched. Eager attention is
not a registered function in transformers and is not patched: use ``sdpa`` (the default) or flash attention.

Entries masked per KV head (kvpress's ``module.masked_key_indices``, set by the per-head budgets of
``HeadBudgetPress`` and ``GlobalBudgetPress`` and by kvpress's own masking presses) are hidden from
scaled-dot-product attention with the attention mask, exactly; kvpress's patch replaces their keys by fake keys
found by a search that fails when the queries do not lie in one half-space (random test models). Flash attention, which takes no mask, keeps kvpress's fake keys.
"""

from __future__ import annotations

import functools

import torch

_PATCHED = "_kvpress_phase_aligned"


def align_mask(attention_mask: torch.Tensor, n_keys: int) -> torch.Tensor:
    """``attention_mask`` (``(..., queries, keys')``, boolean with True where attended, or additive with 0 where
    attended) with ``n_keys`` key columns: the last columns kept, visible columns added or removed on the left."""
    visible = True if attention_mask.dtype == torch.bool else 0.0
    have = attention_mask.shape[-1]
    if have > n_keys:
        cut = attention_mask[..., : have - n_keys]
        if not bool((cut == visible).all()):
            raise ValueError(
                f"the attention mask has {have} key columns and this layer's cache {n_keys} entries, and the columns "
                "that would be cut are not all visible (a padded batch?): caches whose layers differ in length "
                "support unpadded inputs only"
            )
        return attention_mask[..., have - n_keys:]
    pad = attention_mask.new_full((*attention_mask.shape[:-1], n_keys - have), visible)
    return torch.cat([pad, attention_mask], dim=-1)


def mask_entries(attention_mask, query: torch.Tensor, key: torch.Tensor, masked: tuple) -> torch.Tensor:
    """An additive ``(batch, query_heads, queries, keys)`` mask: ``attention_mask`` (or none) with the entries
    ``masked`` (kvpress's ``module.masked_key_indices``: batch, KV head and entry indices) hidden from every query
    head of their KV head."""
    batch, heads, n_queries, _ = query.shape
    n_keys, groups = key.shape[-2], heads // key.shape[1]
    mask = torch.zeros(batch, heads, n_queries, n_keys, dtype=query.dtype, device=query.device)
    if attention_mask is not None:
        extra = attention_mask if attention_mask.dtype != torch.bool else \
            torch.zeros((), dtype=query.dtype, device=query.device).masked_fill(~attention_mask, float("-inf"))
        mask = mask + extra
    b, h, s = (t.to(query.device) for t in masked)
    for g in range(groups):  # query heads h * groups + g read KV head h
        mask[b, h * groups + g, :, s] = float("-inf")
    return mask


def _aligned(func, exact_masks: bool):
    @functools.wraps(func)
    def wrapper(module, query, key, value, attention_mask, *args, **kwargs):
        if isinstance(attention_mask, torch.Tensor) and attention_mask.shape[-1] != key.shape[-2]:
            attention_mask = align_mask(attention_mask, key.shape[-2])
        masked = getattr(module, "masked_key_indices", None)
        if exact_masks and masked is not None and query.shape[2] != key.shape[2] and \
                (attention_mask is None or isinstance(attention_mask, torch.Tensor)):
            # decoding over a cache with masked entries: hide them with the mask, exactly, instead of kvpress's
            # fake keys (found by a search that can fail), and keep kvpress's patch from adding its own
            attention_mask = mask_entries(attention_mask, query, key, masked)
            module.masked_key_indices = None
            try:
                return func(module, query, key, value, attention_mask, *args, **kwargs)
            finally:
                module.masked_key_indices = masked
        return func(module, query, key, value, attention_mask, *args, **kwargs)

    setattr(wrapper, _PATCHED, True)
    return wrapper


def patch_attention_functions() -> None:
    """Wrap every registered attention function once (idempotent)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for name, func in list(ALL_ATTENTION_FUNCTIONS.items()):
        if not getattr(func, _PATCHED, False):
            ALL_ATTENTION_FUNCTIONS[name] = _aligned(func, exact_masks=name.endswith("sdpa"))
