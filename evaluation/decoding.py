"""Decoding many compressed caches of one context at once, and the presses that mask instead of removing.

Greedy decoding of a small model on a CPU is bound by reading the weights: one answer token of SmolLM2-135M reads
all 540 MB of them, whatever the batch. The phase evaluation decodes dozens of compressed caches of every context
(every press, ratio and grid offset), and with matched cache lengths most of them have the same shape, so
:func:`greedy_decode` decodes them as one batch: the caches are stacked along the batch dimension, every row gets
the same question tokens and positions (the original context's, as kvpress's pipeline uses), and each row stops at
its own end-of-sequence token. With one cache it makes exactly the model calls of kvpress's
``KVPressTextGenerationPipeline.generate_answer``; with several, each row's logits can differ from its own
single-row decoding by float rounding (matrix products of other shapes add in another order), which changes a
greedy answer only at a near-tie (BENCHMARKS.md has the measured agreement).

kvpress's ``KVzipPress`` scores entries while the model repeats the context, then masks the evicted entries during
decoding rather than removing them (kvpress replaces their keys by a "fake key" whose attention weight underflows
to zero, found by a search that fails when a step's queries span every direction). It cannot be replayed from the
recorded compress inputs like the other presses: :func:`kvzip_scores` runs its reconstruction on a copy of the full
cache once per context (the scores do not depend on the ratio), and :func:`kvzip_masks` applies kvpress's own
eviction rule for one ratio. Here masked entries are excluded exactly, by a boolean attention mask per layer and
head (:class:`LayerMasks`), which also serves the padding of caches whose layers differ in length.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch

Masks = Optional[dict]
"""Per recorded layer, ``(head_indices, seq_indices)`` of the masked entries of one cache, or None."""


def batched_cache(caches: list, masks: Optional[list] = None):
    """One cache whose batch rows are ``caches`` (each of batch 1, with equal shapes per layer), in new tensors, and
    the rows' masks.

    Layers shorter than the longest (presses with budgets per layer, e.g. kvpress's PyramidKVPress) are padded to its
    length with masked entries: transformers builds one attention mask for all layers from the first layer's
    length, so a cache whose layers differ in length fails with SDPA attention (kvpress's own pipeline fails on it
    here); masked padding makes every layer as long as the longest and changes no attention weight.
    """
    masks = list(masks) if masks is not None else [None] * len(caches)
    longest = max(layer.keys.shape[2] for layer in caches[0].layers)
    out = copy.copy(caches[0])
    out.layers = []
    for i, layer in enumerate(caches[0].layers):
        new = copy.copy(layer)
        keys = torch.cat([c.layers[i].keys for c in caches], dim=0)
        values = torch.cat([c.layers[i].values for c in caches], dim=0)
        batch, heads, n, dim = keys.shape
        if n < longest:
            pad = keys.new_zeros(batch, heads, longest - n, dim)
            keys, values = torch.cat([keys, pad], dim=2), torch.cat([values, pad], dim=2)
            h = torch.arange(heads).repeat_interleave(longest - n)
            q = torch.arange(n, longest).repeat(heads)
            for row in range(len(caches)):
                own = dict(masks[row] or {})
                if i in own:
                    own[i] = (torch.cat([own[i][0], h]), torch.cat([own[i][1], q]))
                else:
                    own[i] = (h, q)
                masks[row] = own
        new.keys, new.values = keys, values
        out.layers.append(new)
    return out, masks


def uneven(cache) -> bool:
    """Whether the layers of ``cache`` differ in length (see :func:`batched_cache`)."""
    return len({layer.keys.shape[2] for layer in cache.layers}) > 1


def cache_signature(cache) -> tuple:
    """Caches with equal signatures can share a batch: the shape of every layer's keys and values."""
    return tuple((tuple(layer.keys.shape), tuple(layer.values.shape)) for layer in cache.layers)


class LayerMasks:
    """Context manager: while it is entered, every attention layer of ``model`` attends through a boolean mask that
    excludes the masked cache entries of each batch row and KV head (``masks[row][layer] = (heads, positions)``),
    causal among the tokens of the current forward.

    A forward pre-hook replaces the layer's ``attention_mask`` (transformers' mask, one for all layers) with the
    layer's own ``(batch, query heads, query length, key length)`` mask, built from the layer's cache length at that
    step; the masked entries get no attention weight at all.
    """

    def __init__(self, model, cache, masks: list):
        self.model = model
        self.cache = cache
        self.masks = masks
        self._hooks = []

    def __enter__(self):
        for layer in self.model.model.layers:
            self._hooks.append(layer.self_attn.register_forward_pre_hook(self._hook, with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        return False

    def _hook(self, module, args, kwargs):
        layer_idx = module.layer_idx
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        q = hidden.shape[1]
        past = self.cache.layers[layer_idx].keys.shape[2]
        batch, kv_heads = self.cache.layers[layer_idx].keys.shape[:2]
        allowed = torch.ones(batch, kv_heads, past + q, dtype=torch.bool, device=hidden.device)
        for row, own in enumerate(self.masks):
            if own is not None and layer_idx in own:
                heads, positions = own[layer_idx]
                allowed[row, heads.to(allowed.device), positions.to(allowed.device)] = False
        groups = module.config.num_attention_heads // kv_heads
        mask = allowed.repeat_interleave(groups, dim=1)[:, :, None, :].expand(-1, -1, q, -1).clone()
        causal = torch.ones(q, q, dtype=torch.bool, device=hidden.device).tril()
        mask[..., past:] &= causal
        kwargs["attention_mask"] = mask
        return args, kwargs


@torch.inference_mode()
def greedy_decode(model, tokenizer, caches: list, question_ids: torch.Tensor, context_length: int,
                  max_new_tokens: int, masks: Optional[list] = None, probe=None) -> list[str]:
    """Greedy answers to ``question_ids`` (``(1, q)``) over each cache of ``caches`` (batch 1 each, equal shapes).

    ``masks`` gives each cache's masked entries (:data:`Masks`), ``probe`` a context manager entered around the
    question's forward (the diagnostic's :class:`~.diagnostics.AttentionProbe`). The caches themselves are not
    modified.
    """
    device = model.device
    n = len(caches)
    if n > 1 or uneven(caches[0]):
        cache, masks = batched_cache(caches, masks)
    else:
        cache = _copied(caches[0])
    masked = LayerMasks(model, cache, masks) if masks and any(m is not None for m in masks) else _null()
    with masked:
        ids = question_ids.to(device)
        position_ids = torch.arange(context_length, context_length + ids.shape[1], device=device).unsqueeze(0)
        with probe if probe is not None else _null():
            outputs = model(input_ids=ids.expand(n, -1), past_key_values=cache, position_ids=position_ids,
                            logits_to_keep=1)
        position_ids = position_ids[:, -1:] + 1
        stop = model.generation_config.eos_token_id
        stop = set(stop if isinstance(stop, list) else [stop])
        new = outputs.logits[:, -1].argmax(dim=-1)
        generated = [new]
        done = torch.tensor([int(t) in stop for t in new.tolist()])
        for i in range(max_new_tokens - 1):
            if bool(done.all()):
                break
            outputs = model(input_ids=new[:, None], past_key_values=cache, position_ids=position_ids + i)
            new = outputs.logits[:, -1].argmax(dim=-1)
            generated.append(new)
            done |= torch.tensor([int(t) in stop for t in new.tolist()])
    tokens = torch.stack(generated, dim=1).tolist()
    answers = []
    for row in tokens:
        for j, t in enumerate(row):
            if t in stop:
                row = row[: j + 1]
                break
        answers.append(str(tokenizer.decode(torch.tensor(row), skip_special_tokens=True)))
    return answers


def _copied(cache):
    """A shallow copy whose layers can grow without touching ``cache`` (the update concatenates new tensors)."""
    out = copy.copy(cache)
    out.layers = [copy.copy(layer) for layer in cache.layers]
    return out


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# ------------------------------------------------------------------------------------------------ KVzip
def kvzip_scores(model, tokenizer, context_ids: torch.Tensor, cache) -> torch.Tensor:
    """KVzip's importance scores ``(layers, 1, kv_heads, context_length)`` of a prefilled context, computed by
    kvpress's ``KVzipPress`` over a copy of ``cache`` (:meth:`~kvpress_phase.presses.scorers.KVzipScorer.compute`)."""
    from kvpress_phase.presses.scorers import KVzipScorer

    return KVzipScorer().compute(model, context_ids, cache, tokenizer=tokenizer)


def kvzip_masks(model, scores: torch.Tensor, compression_ratio: float) -> dict:
    """The entries ``KVzipPress(compression_ratio)`` masks, per layer ``(head_indices, seq_indices)``, by kvpress's
    own ``compress_post`` (sinks kept; a global budget across layers and heads) on a copy of ``scores``."""
    from kvpress_phase.presses.scorers import quiet_kvzip_press

    press = quiet_kvzip_press(compression_ratio)
    press.score_val = scores.clone()
    masks = {}
    try:
        press.compress_post(model)
        for layer in model.model.layers:
            module = layer.self_attn
            found = getattr(module, "masked_key_indices", None)
            if found is not None:
                _, heads, seqs = found
                masks[int(module.layer_idx)] = (heads.clone(), seqs.clone())
    finally:
        for layer in model.model.layers:
            layer.self_attn.masked_key_indices = None
    return masks
