"""How a compressed layer is stored, in one place: dense, or ragged when its KV heads keep different numbers of entries.

Every press of this package that gives KV heads their own entries (:class:`~kvpress_phase.HeadBudgetPress`,
:class:`~kvpress_phase.GlobalBudgetPress`, :class:`~kvpress_phase.ThresholdBudgetPress`) writes its compressed layers
through :func:`store_layer`, while the prefill runs:

- every KV head keeps the same number of entries: a dense layer (transformers' ``DynamicLayer``, keys and values
  ``(1, heads, n, dim)``, each head its own entries);
- otherwise a :class:`~kvpress_phase.ragged.RaggedLayer`: each KV head only its own entries, head-flattened, so the
  entries a head does not keep take no memory (no padding, no mask).

Used as a context manager (``with press(model)``, which kvpress's pipeline does), every press of this package runs
the prefill inside :func:`decoding_attention`: when the prefill has left a cache that plain SDPA cannot decode (a
ragged layer, dense layers of different lengths: :func:`needs_own_attention`), the model is switched to the attention
registered as ``"kvpress_phase_ragged"`` (:mod:`kvpress_phase.ragged.attention`; exactly SDPA for every layer SDPA
can read) so that decoding reads it, and switched back to the attention it had as soon as no such cache is alive any
more (kvpress's pipeline drops its cache when it returns). A prefill that leaves an ordinary cache changes nothing,
and nothing is patched when the package is imported: kvpress's own presses run as kvpress ships them.

Left as kvpress leaves them: batches of more than one sequence and quantized caches (refused with a ``ValueError`` by
the presses that store ragged), and kvpress's own per-head presses (``AdaKVPress``, ``KVzipPress``, ``DMSPress``),
which mask evicted entries in dense layers.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Optional

import torch
from transformers.cache_utils import DynamicLayer

from kvpress_phase.ragged import ATTENTION_NAME, RaggedCache, RaggedLayer

__all__ = ["store_layer", "decoding_attention", "stored_masked", "kept_positions", "is_ragged", "needs_own_attention",
           "decode_ragged", "DENSE_ATTENTIONS"]

DENSE_ATTENTIONS = ("sdpa", ATTENTION_NAME)
"""The model attentions the package's one stands in for exactly (it is SDPA wherever SDPA can read the cache)."""

_LIVE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
"""model -> ``{"previous": the attention it had, "caches": ids of the caches still alive that it decodes with the
package's attention}``."""


def store_layer(cache, layer_idx: int, keys: torch.Tensor, values: torch.Tensor,
                keep: Optional[torch.Tensor] = None, *, seq_length: Optional[int] = None) -> bool:
    """Write a compressed layer into ``cache.layers[layer_idx]`` and return whether it is stored ragged.

    ``keys``/``values`` are ``(1, heads, n, dim)``; ``keep`` (``(heads, n)`` bool, None for every entry) marks the
    entries each KV head keeps, in position order. Heads that keep equal numbers give a dense layer of exactly those
    entries; heads that keep different numbers a :class:`RaggedLayer`. ``seq_length`` is the length a ragged layer
    stands for (:meth:`RaggedLayer.get_seq_length`, the position from which kvpress's pipeline removes answers; by
    default the longest head)."""
    layer = cache.layers[layer_idx]
    if keep is None:
        layer.keys, layer.values = keys, values
        return False
    counts = keep.sum(dim=-1)
    longest = int(counts.max()) if counts.numel() else 0
    if bool((counts == longest).all()):
        idx = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)[..., :longest]  # kept, in order
        take = idx[None, :, :, None]
        new_keys = keys.gather(2, take.expand(-1, -1, -1, keys.shape[-1]))
        new_values = values.gather(2, take.expand(-1, -1, -1, values.shape[-1]))
        if type(layer) is DynamicLayer:
            layer.keys, layer.values = new_keys, new_values
        else:
            cache.layers[layer_idx] = _dense_layer(new_keys, new_values)
        return False
    ragged = RaggedLayer.from_dense(keys, values, masked=~keep)
    ragged.base_length = longest if seq_length is None else int(seq_length)
    cache.layers[layer_idx] = ragged
    return True


def _dense_layer(keys: torch.Tensor, values: torch.Tensor) -> DynamicLayer:
    layer = DynamicLayer()
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values
    return layer


def kept_positions(keep: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``keep`` (``(heads, n)`` bool) as the records of :class:`~kvpress_phase.presses.stats.LayerStats`: each head's
    kept positions in order, ``(1, heads, longest)``, a shorter head padded with its first positions not kept (as
    :func:`~kvpress_phase.presses.choice.keep_only` lays a layer out), and the padding slots as
    ``(head_indices, slot_indices)`` (None when every head keeps the same number)."""
    counts = keep.sum(dim=-1)
    longest = int(counts.max()) if counts.numel() else 0
    idx = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)[..., :longest]
    padding = torch.arange(longest, device=keep.device) >= counts[:, None]
    masked = None
    if bool(padding.any()):
        heads, slots = torch.nonzero(padding, as_tuple=True)
        masked = (heads, slots)
    return idx[None], masked


def is_ragged(cache) -> bool:
    """Whether ``cache`` holds a :class:`RaggedLayer`."""
    return isinstance(cache, RaggedCache) or any(isinstance(layer, RaggedLayer) for layer in getattr(cache, "layers", []))


def needs_own_attention(cache, model) -> bool:
    """Whether plain SDPA cannot decode ``cache`` as it is: it holds a ragged layer, or dense layers of different
    lengths (transformers builds one mask for every layer)."""
    if is_ragged(cache):
        return True
    lengths = {layer.keys.shape[-2] for layer in getattr(cache, "layers", [])
               if isinstance(getattr(layer, "keys", None), torch.Tensor) and layer.keys.numel()}
    return len(lengths) > 1


@contextlib.contextmanager
def decoding_attention(press, model, *, stores_ragged: bool = False):
    """Run the body (the prefill that ``press`` compresses, storing layers with :func:`store_layer`); if it leaves a
    cache that plain SDPA cannot decode (:func:`needs_own_attention`), have ``model`` decode with the package's
    attention for as long as that cache is alive (module docstring). With ``stores_ragged`` (a press that gives KV
    heads their own entries) a model whose attention is not SDPA is refused before the prefill, and so is a cache
    that is ragged already; otherwise only when its cache turns out to need the switch."""
    name = type(press).__name__
    if getattr(model, "model", None) is None or not hasattr(_language_model(model), "layers"):
        yield  # not a model kvpress can hook: the press refuses it when attached
        return
    if stores_ragged:
        _check_attention(name, model)
    seen: dict = {}

    def record_cache(module, args, kwargs):
        cache = kwargs.get("past_key_values")
        if cache is None or "cache" in seen:
            return
        if stores_ragged and is_ragged(cache):
            raise ValueError(f"{name} compresses dense keys and stores them ragged itself: pass cache=None or a "
                             "DynamicCache, not a cache with ragged layers")
        seen["cache"] = weakref.ref(cache)

    hook = _language_model(model).register_forward_pre_hook(record_cache, with_kwargs=True)
    try:
        yield
    finally:
        hook.remove()
    cache = seen["cache"]() if "cache" in seen else None
    if cache is not None and needs_own_attention(cache, model):
        _check_attention(name, model)
        decode_ragged(model, cache)


def _check_attention(name: str, model) -> None:
    current = getattr(model.config, "_attn_implementation", None)
    if current not in DENSE_ATTENTIONS:
        raise ValueError(
            f"{name} leaves a cache that plain attention cannot read (KV heads or layers of different lengths) and "
            f"decodes it with attn_implementation={ATTENTION_NAME!r}, which stands in for 'sdpa' only; the model "
            f"uses {current!r}: load it with attn_implementation='sdpa'"
        )


def decode_ragged(model, cache) -> None:
    """Switch ``model`` to the ragged attention while ``cache`` (which holds ragged layers) is alive; the attention
    it had comes back when the last such cache of the model is freed."""
    state = _LIVE.get(model)
    if state is None:
        previous = getattr(model.config, "_attn_implementation", None)
        state = _LIVE[model] = {"previous": "sdpa" if previous == ATTENTION_NAME else previous, "caches": set()}
    if id(cache) not in state["caches"]:
        state["caches"].add(id(cache))
        weakref.finalize(cache, _release, weakref.ref(model), id(cache))
    if getattr(model.config, "_attn_implementation", None) != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)


def _release(model_ref, cache_id: int) -> None:
    model = model_ref()
    state = _LIVE.get(model) if model is not None else None
    if state is None:
        return
    state["caches"].discard(cache_id)
    if not state["caches"]:
        del _LIVE[model]
        if getattr(model.config, "_attn_implementation", None) == ATTENTION_NAME:
            model.set_attn_implementation(state["previous"])


def _language_model(model):
    inner = model.model
    return inner.language_model if hasattr(inner, "language_model") else inner


@contextlib.contextmanager
def stored_masked(press, model):
    """The compression ``press`` (a budget wrapper, or any press of this package) makes, stored as kvpress's own
    per-head presses store theirs: dense layers padded to the longest KV head, the padding left in kvpress's
    ``module.masked_key_indices`` (masked while decoding). Every layer's prefill inputs are recorded and compressed
    when the prefill has finished (a budget across layers planned over all of them first, :meth:`BudgetPress.plan`),
    as the evaluation's replay does: the reference the ragged storage is compared with, at the memory cost of
    holding every layer's inputs."""
    language_model = _language_model(model)
    press.post_init_from_model(model)
    records: dict = {}
    seen: dict = {}

    def record_layer(module, args, kwargs, output):
        records[module.layer_idx] = (module, kwargs["hidden_states"], output[1], kwargs)

    def record_cache(module, args, kwargs):
        seen.setdefault("cache", kwargs.get("past_key_values"))

    hooks = [language_model.register_forward_pre_hook(record_cache, with_kwargs=True)]
    for layer in language_model.layers:
        layer.self_attn.rotary_emb = language_model.rotary_emb
        hooks.append(layer.self_attn.register_forward_hook(record_layer, with_kwargs=True))
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
    cache = seen.get("cache")
    if cache is None or not records:
        return
    inputs = [(m, h, cache.layers[i].keys, cache.layers[i].values, a, kw)
              for i, (m, h, a, kw) in sorted(records.items())]
    if getattr(press, "plans_across_layers", False):
        press.plan(inputs)
    for module, hidden, keys, values, attentions, kwargs in inputs:
        layer = cache.layers[module.layer_idx]
        layer.keys, layer.values = press.compress(module, hidden, keys, values, attentions, kwargs)
    masked = any(getattr(layer.self_attn, "masked_key_indices", None) is not None for layer in language_model.layers)
    if masked or needs_own_attention(cache, model):  # the padding hidden exactly, not by kvpress's fake keys
        _check_attention(type(press).__name__, model)
        decode_ragged(model, cache)
