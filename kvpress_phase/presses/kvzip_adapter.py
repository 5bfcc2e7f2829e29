"""KVzip's scores and masks, computed by kvpress's ``KVzipPress``: the one module that drives its internal state.

kvpress's ``KVzipPress`` (KVzip, Kim et al., 2025, "KVzip: Query-Agnostic KV Cache Compression with Context
Reconstruction") runs only as a context manager around a prefill. It captures the context's ids and cache, replays
the context after a "repeat the previous context" prompt over that cache while its forward hook keeps, per entry,
the largest attention the replay pays it (``score_val``; KVzip+ scales it by the norm of the value's output
projection over the query's hidden-state norm), and then masks the lowest-scored entries across all layers and
heads (``compress_post``, which leaves them in each attention module's ``masked_key_indices``).

This package needs those steps apart, none of which kvpress exposes:

- :func:`kvzip_scores`: the scores of a context already prefilled, over a copy of its cache (the cache is left
  as it was). :class:`~kvpress_phase.presses.scorers.KVzipScorer` (our presses' ``scorer="kvzip"``), the
  evaluation's replay of kvpress's press and ``kvpress-phase train-scorer``'s KVzip+ targets all take them from
  here, so the learned scorer is trained on exactly the numbers ``KVzipScorer`` computes;
- :func:`kvzip_masks`: the entries ``KVzipPress(compression_ratio)`` masks, from scores computed once for every
  ratio (the evaluation's ``kvzip`` and ``kvzip_plus`` presses).

Both set and read the press's internal attributes and call its internal methods; every name relied on is in
:data:`KVZIP_INTERNALS` (and :data:`MASKED_KEYS`), and ``tests/presses/test_kvzip_adapter.py`` fails when kvpress
no longer has one. The tests also check the outcome against kvpress's own run (its context manager around a
prefill): the same scores and the same masks.
"""

from __future__ import annotations

import copy
import logging

import torch

KVZIP_INTERNALS = (
    "prefix_length",   # reconstruction prompt: tokens of the chat template's opening (not scored)
    "_suffix_ids",     # reconstruction prompt: ids after the repeat instruction (the template's closing)
    "_context_ids",    # the prefilled context's ids
    "_cache",          # the cache the replay runs over
    "context_length",  # entries of the prefilled context (the forward hook cuts the replay's entries back to it)
    "start_idx",       # first context position the current replay chunk reconstructs
    "end_idx",         # one past its last
    "score_val",       # (layers, 1, KV heads, context_length): the scores, written by the forward hook
    "prepare",         # prepare(model, tokenizer) -> [(chunk ids, replay ids)]; allocates score_val
    "forward_hook",    # the hook that scores the entries of one attention layer during the replay
    "compress_post",   # compress_post(model): the global eviction rule, masks left in MASKED_KEYS
)
"""The names of kvpress's ``KVzipPress`` (attributes of an instance, methods of the class) this module relies on."""

MASKED_KEYS = "masked_key_indices"
"""The attribute of each attention module where ``KVzipPress.compress_post`` leaves ``(batch, heads, positions)`` of
the entries it masks (kvpress's attention patch reads it while decoding)."""

_LOGGER = "kvpress.presses.kvzip_press"


def quiet_kvzip_press(compression_ratio: float = 0.0, press_class=None, **kwargs):
    """kvpress's ``KVzipPress`` (or ``press_class``), without the warning about its cost that kvpress logs at every
    construction (the evaluation builds one per context; README and docs/benchmarks.md state the cost)."""
    if press_class is None:
        from kvpress import KVzipPress as press_class

    log = logging.getLogger(_LOGGER)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        return press_class(compression_ratio=compression_ratio, **kwargs)
    finally:
        log.setLevel(level)


def check_kvzip_model(model) -> None:
    """ValueError for a model kvpress's ``KVzipPress`` refuses (Gemma3, whose attention it cannot replay)."""
    from transformers import Gemma3PreTrainedModel

    if isinstance(model, Gemma3PreTrainedModel):
        raise ValueError(f"model: kvpress's KVzipPress does not support {type(model).__name__}")


def kvzip_tokenizer(model, tokenizer=None):
    """``tokenizer``, or the one ``KVzipPress`` would load: ``AutoTokenizer`` of ``model.config.name_or_path``."""
    if tokenizer is not None:
        return tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model.config.name_or_path)


def reconstruction_prompt(tokenizer) -> tuple[int, torch.Tensor]:
    """``(prefix_length, suffix_ids)`` of KVzip's reconstruction prompt for ``tokenizer``, as ``KVzipPress``
    derives them: without a chat template nothing precedes the context and ``"\\n"`` follows the repeat
    instruction; with one, the template's text before a user message's content (those tokens are never scored)
    and its text after the content up to the assistant's turn."""
    if tokenizer.chat_template is None:
        prefix_text, suffix_text = "", "\n"
    else:
        marker = "dummy context"
        separator = "\n" + "#" * len(marker)
        text = tokenizer.apply_chat_template([{"role": "user", "content": marker + separator}],
                                             add_generation_prompt=True, tokenize=False, enable_thinking=False)
        before, suffix_text = text.split(separator)
        prefix_text = before.split(marker)[0]
    prefix_length = len(tokenizer.encode(prefix_text, add_special_tokens=False))
    suffix_ids = tokenizer.encode(suffix_text, return_tensors="pt", add_special_tokens=False)
    return prefix_length, suffix_ids


def first_scored_position(tokenizer) -> int:
    """The first context position KVzip scores (the ones before hold 0): the chat template's opening length."""
    return reconstruction_prompt(tokenizer)[0]


@torch.inference_mode()
def kvzip_scores(model, context_ids: torch.Tensor, cache, tokenizer=None, *, plus: bool = False,
                 chunk_size: int = 2048) -> torch.Tensor:
    """KVzip's scores (KVzip+'s with ``plus``) of the prefilled context ``context_ids`` ``(1, T)``, whose full cache
    is ``cache`` (not modified: the replay runs over a copy of its layer list), ``(layers, 1, KV heads, T)`` in the
    model's dtype: ``KVzipPress(kvzip_plus_normalization=plus, chunk_size=chunk_size)``'s ``score_val`` after its
    reconstruction passes, before it lifts the attention sinks. ``tokenizer`` None loads the model's
    (:func:`kvzip_tokenizer`)."""
    check_kvzip_model(model)
    tokenizer = kvzip_tokenizer(model, tokenizer)
    press = quiet_kvzip_press(0.0, chunk_size=chunk_size, kvzip_plus_normalization=plus)
    press.prefix_length, press._suffix_ids = reconstruction_prompt(tokenizer)
    press._context_ids = context_ids
    press._cache = copy.copy(cache)  # the replay appends to (new tensors of) every layer
    press._cache.layers = [copy.copy(layer) for layer in cache.layers]
    press.context_length = context_ids.shape[1]
    for layer in model.model.layers:  # as KVzipPress does: its hook rotates the replay's queries itself
        layer.self_attn.rotary_emb = model.model.rotary_emb
    chunks = press.prepare(model, tokenizer)
    hooks = [layer.self_attn.register_forward_hook(press.forward_hook, with_kwargs=True)
             for layer in model.model.layers]
    try:
        press.start_idx = press.prefix_length
        for chunk_ids, replay_ids in chunks:
            press.end_idx = press.start_idx + chunk_ids.shape[1]
            model.model(input_ids=replay_ids.to(model.device), past_key_values=press._cache)
            press.start_idx = press.end_idx
    finally:
        for hook in hooks:
            hook.remove()
    return press.score_val


def kvzip_masks(model, scores: torch.Tensor, compression_ratio: float) -> dict:
    """The entries ``KVzipPress(compression_ratio)`` masks given its ``scores`` (:func:`kvzip_scores`, not
    modified): per layer index ``(head_indices, seq_indices)``, by kvpress's own eviction rule (the attention sinks
    kept, one budget across layers and heads). No layer is left with masks set."""
    press = quiet_kvzip_press(compression_ratio)
    press.score_val = scores.clone()
    masks = {}
    try:
        press.compress_post(model)
        for layer in model.model.layers:
            found = getattr(layer.self_attn, MASKED_KEYS, None)
            if found is not None:
                _, heads, seqs = found
                masks[int(layer.self_attn.layer_idx)] = (heads.clone(), seqs.clone())
    finally:
        for layer in model.model.layers:
            setattr(layer.self_attn, MASKED_KEYS, None)
    return masks


def missing_internals(press_class=None) -> list:
    """The names of :data:`KVZIP_INTERNALS` that kvpress's ``KVzipPress`` (or ``press_class``) no longer has."""
    press = quiet_kvzip_press(0.0, press_class)
    return [name for name in KVZIP_INTERNALS if not hasattr(press, name)]


__all__ = ["KVZIP_INTERNALS", "MASKED_KEYS", "check_kvzip_model", "first_scored_position", "kvzip_masks",
           "kvzip_scores", "kvzip_tokenizer", "missing_internals", "quiet_kvzip_press", "reconstruction_prompt"]


def kvgrad_scores(model, context_ids: torch.Tensor, tokenizer) -> torch.Tensor:
    """kvpress's ``KVgradPress()`` scores (``score_val``, ``(layers, 1, KV heads, T)``) of the context ``context_ids``
    ``(1, T)``: a prefill outside inference mode (as ``KVgradPress.__call__`` runs it: its backward pass reads the
    cached entries), then the press's own scoring (``_perform_kvzip_compression``, its eviction doing nothing at
    ratio 0), with ``tokenizer`` for the reconstruction prompt where kvpress loads the model's by its
    ``name_or_path``."""
    from kvpress import KVgradPress
    from transformers import DynamicCache

    check_kvzip_model(model)
    log = logging.getLogger("kvpress.presses.kvgrad_press")  # its warning about the cost, at every construction
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        press = KVgradPress(compression_ratio=0.0)
    finally:
        log.setLevel(level)
    press.prefix_length, press._suffix_ids = reconstruction_prompt(tokenizer)
    with torch.inference_mode(False), torch.no_grad():
        cache = DynamicCache()
        model.model(input_ids=context_ids.to(model.device), past_key_values=cache)
    press._context_ids, press._cache = context_ids, cache
    for layer in model.model.layers:  # as KVzipPress.__call__ does before scoring
        layer.self_attn.rotary_emb = model.model.rotary_emb
    press._perform_kvzip_compression(model, tokenizer)
    return press.score_val.detach()
