"""The package's attention, registered with transformers as ``"kvpress_phase_ragged"``: SDPA for caches that plain SDPA
cannot read as they are.

:func:`ragged_attention_forward` is an attention function of transformers' ``AttentionInterface``; a model run with
``attn_implementation="kvpress_phase_ragged"`` calls it in every attention layer. It is SDPA (transformers'
registered ``"sdpa"`` function, called with the same arguments), except for three kinds of cache layer:

- a :class:`~kvpress_phase.ragged.cache.RaggedLayer` (its keys arrive as a
  :class:`~kvpress_phase.ragged.cache.RaggedView`): attention over each KV head's own entries through
  :func:`kvpress_phase.kernels.ragged_attention` (the package's one dispatch point: the Triton varlen decoding kernel
  on a GPU, the PyTorch reference elsewhere), causal within the step's new tokens and every cached entry visible
  (batch 1, unpadded: the model's mask is not read);
- a dense layer shorter or longer than the model's mask (a cache whose layers differ in length: ``LayerBudgetPress``,
  ``PerLayerWindowedPress``; transformers builds one mask for every layer from the first layer's length): the mask
  is aligned to the layer (:func:`align_mask`: the query's own columns are the last ones in every layer, and every
  earlier column is a compressed context entry that every query sees);
- a layer whose module holds kvpress's ``masked_key_indices`` (the per-head budgets' padding left masked,
  :func:`kvpress_phase.presses.storage.stored_masked`): those entries are hidden with the mask, exactly
  (:func:`mask_entries`), instead of kvpress's fake keys.

The presses of this package switch a model to it for as long as a cache that needs it is alive
(:mod:`kvpress_phase.presses.storage`); a model without such a cache behaves exactly as with ``"sdpa"``. Registration
(:func:`register`) runs when :mod:`kvpress_phase.ragged` is imported; no model method and no registered attention
function is patched.
"""

from __future__ import annotations

import torch

from kvpress_phase.ragged.cache import ATTENTION_NAME, RaggedView

__all__ = ["ragged_attention_forward", "register", "align_mask", "mask_entries", "ATTENTION_NAME"]


def ragged_attention_forward(module, query: torch.Tensor, key, value, attention_mask, *args, **kwargs):
    """transformers' attention-function signature: ``query`` is ``(batch, q_heads, n_new, head_dim)``; returns
    ``(attn_output (batch, n_new, q_heads, value_dim), None)`` as SDPA's function does."""
    if not isinstance(key, RaggedView):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
        if isinstance(attention_mask, torch.Tensor) and attention_mask.shape[-1] != key.shape[-2]:
            attention_mask = align_mask(attention_mask, key.shape[-2])
        masked = getattr(module, "masked_key_indices", None)
        if masked is not None and query.shape[2] != key.shape[2] and \
                (attention_mask is None or isinstance(attention_mask, torch.Tensor)):
            # decoding over a cache with masked entries: hidden with the mask, exactly; kvpress's attention patch
            # (which wraps "sdpa") must not add its fake keys as well
            attention_mask = mask_entries(attention_mask, query, key, masked)
            module.masked_key_indices = None
            try:
                return sdpa(module, query, key, value, attention_mask, *args, **kwargs)
            finally:
                module.masked_key_indices = masked
        return sdpa(module, query, key, value, attention_mask, *args, **kwargs)
    from kvpress_phase.kernels import ragged_attention

    if query.shape[0] != 1:
        raise ValueError(f"query: attention over a ragged cache takes batch 1, got batch {query.shape[0]}")
    scaling = kwargs.get("scaling")
    if scaling is None:
        scaling = getattr(module, "scaling", None)
    out = ragged_attention(query[0].to(key.dtype), key.buffer, value.buffer, key.starts, key.lengths,
                           scaling=scaling, check_index=False)  # RaggedLayer keeps its index inside its buffers
    return out.transpose(0, 1).unsqueeze(0).to(query.dtype), None


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


def register() -> None:
    """Register :func:`ragged_attention_forward` and transformers' SDPA mask under ``"kvpress_phase_ragged"``
    (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, ragged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
