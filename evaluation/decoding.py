"""Decoding many compressed caches of one context at once, and the presses that mask instead of removing.

Greedy decoding of a small model on a CPU is bound by reading the weights: one answer token of SmolLM2-135M reads
all 540 MB of them, whatever the batch. The phase evaluation decodes dozens of compressed caches of every context
(every press, ratio and grid offset), and with matched cache lengths most of them have the same shape, so
:func:`decode_tokens` decodes them as one batch: the caches are stacked along the batch dimension, every row gets
the same question tokens and positions (the original context's, as kvpress's pipeline uses), and each row stops at
its own end-of-sequence token. Step by step with one cache it makes exactly the model calls of kvpress's
``KVPressTextGenerationPipeline.generate_answer``; in a batch, or checking a draft, each row's logits can differ
from that by float rounding (matrix products of other shapes add in another order), which changes a greedy answer
only at a near-tie (docs/benchmarks.md has the measured agreement).

kvpress's ``KVzipPress`` scores entries while the model repeats the context, then masks the evicted entries during
decoding rather than removing them (kvpress replaces their keys by a "fake key" whose attention weight underflows
to zero, found by a search that fails when a step's queries span every direction). It cannot be replayed from the
recorded compress inputs like the other presses: :mod:`kvpress_phase.presses.kvzip_adapter` runs its
reconstruction on a copy of the full cache once per context (the scores do not depend on the ratio) and applies
kvpress's own eviction rule for one ratio. Here masked entries are excluded exactly, by a boolean attention mask per
layer and head (:class:`LayerMasks`), which also serves the padding of caches whose layers differ in length.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from transformers.cache_utils import DynamicLayer

Masks = Optional[dict]
"""Per recorded layer, ``(head_indices, seq_indices)`` of the masked entries of one cache, or None."""


def batched_cache(caches: list, masks: Optional[list] = None):
    """One cache whose batch rows are ``caches`` (each of batch 1, with the same layers and heads), in new tensors,
    and the rows' masks.

    Every layer is as long as the longest layer of any row: shorter ones (presses with budgets per layer, e.g.
    kvpress's PyramidKVPress or ``LayerBudgetPress(PhaseAwarePress(...))``) are padded with masked entries. transformers
    builds one attention mask for all layers from the first layer's length, so a cache whose layers differ in length
    fails with SDPA attention unless it is padded; masked padding changes no attention weight, and rows of different
    lengths can share a batch (:func:`cache_signature`).
    """
    masks = list(masks) if masks is not None else [None] * len(caches)
    longest = max(layer.keys.shape[2] for c in caches for layer in c.layers)
    out = copy.copy(caches[0])
    out.layers = []
    for i, layer in enumerate(caches[0].layers):
        new = copy.copy(layer)
        batch, heads, _, dim = layer.keys.shape
        new.keys = layer.keys.new_zeros(len(caches), heads, longest, dim)
        new.values = layer.values.new_zeros(len(caches), heads, longest, layer.values.shape[-1])
        _fill_rows(new.keys, new.values, caches, i, masks, longest)
        out.layers.append(new)
    return out, masks


def _fill_rows(keys: torch.Tensor, values: torch.Tensor, caches: list, layer: int, masks: list, longest: int) -> None:
    """Copy every row's ``layer`` into ``keys``/``values[:, :, :longest]``, zero the padding past a shorter row's
    entries (finite, so that a zero weight gives a zero contribution) and add it to that row's masks."""
    lengths = [c.layers[layer].keys.shape[2] for c in caches]
    if len(set(lengths)) == 1:  # one copy for the whole batch
        n = lengths[0]
        torch.cat([c.layers[layer].keys for c in caches], out=keys[:, :, :n])
        torch.cat([c.layers[layer].values for c in caches], out=values[:, :, :n])
    else:
        for row, c in enumerate(caches):
            keys[row, :, :lengths[row]] = c.layers[layer].keys[0]
            values[row, :, :lengths[row]] = c.layers[layer].values[0]
    heads = keys.shape[1]
    for row, n in enumerate(lengths):
        if n < longest:
            keys[row, :, n:longest] = 0
            values[row, :, n:longest] = 0
            _mask_padding(masks, row, layer, heads, n, longest)


def _mask_padding(masks: list, row: int, layer: int, heads: int, n: int, longest: int) -> None:
    """Add the padding entries ``n..longest`` of ``layer`` (every KV head) to ``row``'s masks, in place."""
    h = torch.arange(heads).repeat_interleave(longest - n)
    p = torch.arange(n, longest).repeat(heads)
    own = dict(masks[row] or {})
    own[layer] = (torch.cat([own[layer][0], h]), torch.cat([own[layer][1], p])) if layer in own else (h, p)
    masks[row] = own


def uneven(cache) -> bool:
    """Whether the layers of ``cache`` differ in length (see :func:`batched_cache`)."""
    return len({layer.keys.shape[2] for layer in cache.layers}) > 1


def cache_signature(cache) -> tuple:
    """Caches with equal signatures can share a batch: the shape of every layer's keys and values, except that
    caches whose layers differ in length are padded anyway (:func:`batched_cache`), so they share one signature
    per layer count, heads and head sizes whatever their lengths."""
    if uneven(cache):
        return ("uneven",) + tuple((layer.keys.shape[1], layer.keys.shape[3], layer.values.shape[3])
                                   for layer in cache.layers)
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
        self._blocked: dict = {}  # layer -> (batch, kv_heads, n) bool: the masked entries, built once per layer

    def select(self, rows: list, cache) -> None:
        """Keep only the batch ``rows`` (after :func:`_select` made ``cache`` of them)."""
        self.cache = cache
        self.masks = [self.masks[i] for i in rows]
        index = torch.tensor(rows)
        self._blocked = {layer: b[index.to(b.device)] for layer, b in self._blocked.items()}

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
        blocked = self._blocked.get(layer_idx)
        if blocked is None or blocked.shape[-1] > past:  # masked entries are all before the first step's end
            blocked = torch.zeros(batch, kv_heads, past, dtype=torch.bool, device=hidden.device)
            for row, own in enumerate(self.masks):
                if own is not None and layer_idx in own:
                    heads, positions = own[layer_idx]
                    blocked[row, heads.to(blocked.device), positions.to(blocked.device)] = True
            self._blocked[layer_idx] = blocked
        allowed = torch.ones(batch, kv_heads, past + q, dtype=torch.bool, device=hidden.device)
        allowed[..., : blocked.shape[-1]] = ~blocked
        groups = module.config.num_attention_heads // kv_heads
        mask = allowed.repeat_interleave(groups, dim=1)[:, :, None, :].expand(-1, -1, q, -1).clone()
        causal = torch.ones(q, q, dtype=torch.bool, device=hidden.device).tril()
        mask[..., past:] &= causal
        kwargs["attention_mask"] = mask
        return args, kwargs


def answer_text(tokenizer, tokens: list) -> str:
    """The answer string of generated ``tokens`` (special tokens, the end of the answer included, dropped)."""
    return str(tokenizer.decode(torch.tensor(tokens, dtype=torch.long), skip_special_tokens=True))


def stop_tokens(model) -> set:
    stop = model.generation_config.eos_token_id
    return set(stop if isinstance(stop, list) else [stop])


@torch.inference_mode()
def decode_tokens(model, caches: list, question_ids: torch.Tensor, context_length: int, max_new_tokens: int,
                  masks: Optional[list] = None, probe=None, draft: Optional[list] = None,
                  step_by_step: bool = False) -> list[list[int]]:
    """The greedy answer tokens (up to and including the end-of-answer token) over each cache of ``caches``.

    ``step_by_step=True`` is the reference: one forward for the question, then one per token over a
    ``DynamicCache`` that grows by concatenation (every step copies every layer of every row). The default writes
    the batch into buffers allocated once with room for the question and the answer (:class:`FilledLayer`), attends
    with the KV heads shared inside the kernel (:data:`GQA_ATTENTION`), drops finished rows from the batch, and,
    given a ``draft`` (the tokens of another answer to the same question, e.g.
    the uncompressed cache's), checks the draft instead of generating it: one forward of the question followed by
    the draft gives the greedy token after every prefix of the draft; a row keeps the draft up to its first token
    that differs from its own greedy choice, takes its own token there, and decodes on step by step from that point.
    Greedy decoding is deterministic, so the tokens are those of step-by-step decoding up to float rounding: the
    longer forward adds the question's products in another order, which can change an argmax only at a near-tie
    (``benchmarks/bench_eval.py`` counts identical answers; docs/benchmarks.md has the figures).
    """
    if step_by_step:
        return _step_by_step(model, caches, question_ids, context_length, max_new_tokens, masks, probe)
    with gqa_attention(model):
        return _fast(model, caches, question_ids, context_length, max_new_tokens, masks, probe, draft)


def _fast(model, caches, question_ids, context_length, max_new_tokens, masks, probe, draft) -> list[list[int]]:
    stop = stop_tokens(model)
    device = model.device
    n = len(caches)
    draft = list(draft[:max_new_tokens]) if draft else []
    question = question_ids.to(device)
    q = question.shape[1]
    cache, masks = filled_cache(caches, masks, room=q + max(len(draft), 1) + max_new_tokens)
    base = cache.layers[0].filled
    fed = torch.cat([question, torch.tensor([draft[:-1]], dtype=torch.long, device=device)], dim=1) \
        if len(draft) > 1 else question
    positions = torch.arange(context_length, context_length + fed.shape[1], device=device)[None]
    if probe is not None:  # the diagnostic reads the question's last token, not the draft's
        probe.trailing = fed.shape[1] - q
    with _masked(model, cache, masks):
        with probe if probe is not None else _null():
            logits = model(input_ids=fed.expand(n, -1), past_key_values=cache, position_ids=positions,
                           logits_to_keep=max(len(draft), 1)).logits
    choices = logits.argmax(dim=-1).tolist()  # row r's greedy token after the question and draft[:j]: choices[r][j]
    out: list = [None] * n
    resume: dict[int, list] = {}  # accepted draft length -> rows that go on decoding from there
    for r in range(n):
        accepted = 0
        while accepted < len(draft) - 1 and choices[r][accepted] == draft[accepted] and draft[accepted] not in stop:
            accepted += 1
        tokens = draft[:accepted] + [choices[r][accepted]]
        out[r] = tokens
        if tokens[-1] not in stop and len(tokens) < max_new_tokens:
            resume.setdefault(accepted, []).append(r)
    for accepted, rows in resume.items():
        group = cache if len(resume) == 1 and len(rows) == n else _select(cache, rows)
        for layer in group.layers:
            layer.crop(base + q + accepted)
        group_masks = [masks[r] for r in rows]
        first = torch.tensor([out[r][-1] for r in rows], device=device)
        _continue(model, group, group_masks, rows, first, context_length + q + accepted, out, max_new_tokens, stop)
    return out


def _continue(model, cache, masks, rows, new, position, out, max_new_tokens, stop) -> None:
    """Decode on from the last token of each row (``new``) at ``position``, one token per forward, appending to
    ``out[rows[i]]``; finished rows leave the batch."""
    rows = list(rows)
    masker = _masked(model, cache, masks)  # one mask per layer for the whole answer, cut as rows leave
    while rows:
        with masker:
            logits = model(input_ids=new[:, None], past_key_values=cache,
                           position_ids=torch.tensor([[position]], device=new.device)).logits
        position += 1
        new = logits[:, -1].argmax(dim=-1)
        going = []
        for i, (r, t) in enumerate(zip(rows, new.tolist())):
            out[r].append(t)
            if t not in stop and len(out[r]) < max_new_tokens:
                going.append(i)
        if len(going) < len(rows):
            if not going:
                return
            cache = _select(cache, going)
            masks = [masks[i] for i in going]
            if isinstance(masker, LayerMasks):
                masker.select(going, cache)
            rows = [rows[i] for i in going]
            new = new[going]


def _step_by_step(model, caches, question_ids, context_length, max_new_tokens, masks, probe) -> list[list[int]]:
    """The reference decoding: a question forward, then one forward per token for the whole batch over a
    ``DynamicCache`` that grows by concatenation, until every row has ended (the pipeline's ``generate_answer`` for
    a batch of one)."""
    device = model.device
    n = len(caches)
    if n > 1 or uneven(caches[0]):
        cache, masks = batched_cache(caches, masks)
    else:
        cache = _copied(caches[0])
    stop = stop_tokens(model)
    with _masked(model, cache, masks):
        ids = question_ids.to(device)
        position_ids = torch.arange(context_length, context_length + ids.shape[1], device=device).unsqueeze(0)
        with probe if probe is not None else _null():
            outputs = model(input_ids=ids.expand(n, -1), past_key_values=cache, position_ids=position_ids,
                            logits_to_keep=1)
        position_ids = position_ids[:, -1:] + 1
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
    out = []
    for row in torch.stack(generated, dim=1).tolist():
        for j, t in enumerate(row):
            if t in stop:
                row = row[: j + 1]
                break
        out.append(row)
    return out


class FilledLayer(DynamicLayer):
    """A cache layer held in buffers allocated once, with room to grow: :meth:`update` writes the new tokens in place
    and ``keys``/``values`` are views of the filled part. (transformers' ``DynamicLayer`` concatenates, copying the
    whole layer at every decoding step.)"""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, filled: int):
        super().__init__()
        self.buffers = (keys, values)
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self._set(filled)

    def _set(self, filled: int) -> None:
        self.filled = filled
        self.keys = self.buffers[0][:, :, :filled]
        self.values = self.buffers[1][:, :, :filled]

    def update(self, key_states, value_states, cache_kwargs=None):
        end = self.filled + key_states.shape[-2]
        if end > self.buffers[0].shape[2]:
            raise ValueError(f"FilledLayer: {end} entries exceed the room allocated ({self.buffers[0].shape[2]})")
        self.buffers[0][:, :, self.filled:end] = key_states
        self.buffers[1][:, :, self.filled:end] = value_states
        self._set(end)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.filled

    def crop(self, max_length: int) -> None:
        if max_length < 0:
            max_length = self.filled + max_length
        self._set(min(self.filled, max_length))

    def batch_select_indices(self, indices) -> None:
        self.buffers = tuple(b[indices] for b in self.buffers)
        self._set(self.filled)


def filled_cache(caches: list, masks: Optional[list], room: int):
    """One cache of :class:`FilledLayer` whose batch rows are ``caches`` (batch 1 each, the same layers and heads),
    with ``room`` free entries per layer, and the rows' masks. Layers shorter than the longest of any row are padded
    with masked entries, as in :func:`batched_cache`."""
    masks = list(masks) if masks is not None else [None] * len(caches)
    longest = max(layer.keys.shape[2] for c in caches for layer in c.layers)
    out = copy.copy(caches[0])
    out.layers = []
    for i, layer in enumerate(caches[0].layers):
        batch, heads, n, dim = layer.keys.shape
        keys = layer.keys.new_empty(len(caches), heads, longest + room, dim)
        values = layer.values.new_empty(len(caches), heads, longest + room, layer.values.shape[-1])
        _fill_rows(keys, values, caches, i, masks, longest)  # (the room past it is written before it is read)
        out.layers.append(FilledLayer(keys, values, longest))
    return out, masks


def _select(cache, rows: list):
    """A cache holding only the batch ``rows`` of ``cache`` (new buffers)."""
    out = copy.copy(cache)
    index = torch.tensor(rows, device=cache.layers[0].keys.device)
    out.layers = []
    for layer in cache.layers:
        new = FilledLayer(*layer.buffers, layer.filled)
        new.batch_select_indices(index)
        out.layers.append(new)
    return out


GQA_ATTENTION = "kvpress_phase_sdpa_gqa"
"""An attention implementation registered with transformers: its SDPA, with the KV heads shared by their query
heads inside the kernel (``enable_gqa``) also when there is a mask. transformers' own SDPA function repeats every
layer's keys and values once per query head whenever a mask is given (a question's forward over a cache, every step
under :class:`LayerMasks`): on SmolLM2 (3 KV heads, 9 query heads) that copy was more than half of a question's
forward. The arithmetic per head is the same."""


def _sdpa_gqa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is None or query.device.type != "cpu":  # transformers' path (GQA in the kernel without a mask)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def _register_gqa() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GQA_ATTENTION, _sdpa_gqa)
    AttentionMaskInterface.register(GQA_ATTENTION, sdpa_mask)


class gqa_attention:
    """Context manager: a model that attends with transformers' SDPA attends with :data:`GQA_ATTENTION` meanwhile
    (through ``set_attn_implementation``, transformers' way of choosing an attention function); other
    implementations are left as they are."""

    def __init__(self, model):
        self.model = model
        self.active = getattr(model.config, "_attn_implementation", None) == "sdpa"

    def __enter__(self):
        if self.active:
            _register_gqa()
            self.model.set_attn_implementation(GQA_ATTENTION)
        return self

    def __exit__(self, *exc):
        if self.active:
            self.model.set_attn_implementation("sdpa")
        return False


def _masked(model, cache, masks):
    return LayerMasks(model, cache, masks) if masks and any(m is not None for m in masks) else _null()


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


@torch.inference_mode()
def decode_ragged(model, cache, question_ids: torch.Tensor, context_length: int, max_new_tokens: int,
                  draft: Optional[list] = None) -> list[int]:
    """The greedy answer tokens over one cache with ragged layers (a per-head budget of ours, stored as kvpress's
    pipeline stores it: :func:`kvpress_phase.presses.storage.store_layer`), decoded as the pipeline decodes it: one
    forward of the question, then one per token, with the model on the package's attention for the call (its own
    attention restored after). The cache grows in place and is left as it ends; the caller discards it.

    Given a ``draft`` (another answer's tokens to the same question, e.g. the uncompressed cache's), the draft is
    checked as :func:`decode_tokens` checks one: one forward of the question followed by the draft gives the greedy
    token after every prefix of the draft; the answer keeps the draft up to its first token that differs from its
    own greedy choice, the cache is cropped back to that point, and decoding goes on one token per forward. The
    answer is the greedy one either way; the draft saves forwards (most compressed caches answer as the uncompressed
    one does)."""
    from kvpress_phase.ragged import ATTENTION_NAME

    stop = stop_tokens(model)
    device = model.device
    draft = list(draft[:max_new_tokens]) if draft else []
    question = question_ids.to(device)
    q = question.shape[1]
    fed = torch.cat([question, torch.tensor([draft[:-1]], dtype=torch.long, device=device)], dim=1) \
        if len(draft) > 1 else question
    starts = [layer.get_seq_length() for layer in cache.layers]  # per layer: ragged layers stand for their own
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    try:
        positions = torch.arange(context_length, context_length + fed.shape[1], device=device)[None]
        logits = model(input_ids=fed, past_key_values=cache, position_ids=positions,
                       logits_to_keep=max(len(draft), 1)).logits
        choices = logits[0].argmax(dim=-1).tolist()  # the greedy token after the question and draft[:j]: choices[j]
        accepted = 0
        while accepted < len(draft) - 1 and choices[accepted] == draft[accepted] and draft[accepted] not in stop:
            accepted += 1
        tokens = draft[:accepted] + [choices[accepted]]
        if fed.shape[1] > q + accepted:  # the draft's tokens past the accepted ones leave the cache
            for layer, start in zip(cache.layers, starts):
                layer.crop(start + q + accepted)
        position = context_length + q + accepted
        while tokens[-1] not in stop and len(tokens) < max_new_tokens:
            logits = model(input_ids=torch.tensor([[tokens[-1]]], device=device), past_key_values=cache,
                           position_ids=torch.tensor([[position]], device=device)).logits
            tokens.append(int(logits[0, -1].argmax()))
            position += 1
        return tokens
    finally:
        model.set_attn_implementation(previous)
