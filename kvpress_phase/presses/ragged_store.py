"""Per-head budgets stored ragged: the padding of shorter KV heads is freed, not masked.

A press that gives each KV head of a layer its own budget (:class:`~kvpress_phase.HeadBudgetPress`,
:class:`~kvpress_phase.GlobalBudgetPress`) compresses into a dense ``(1, heads, longest, dim)`` layer whose shorter
heads are padded, the padding marked in kvpress's ``module.masked_key_indices``. Used as a context manager
(``with press(model)``, which kvpress's pipeline does), such a press then hands the cache over to
:func:`stored_ragged`: when the prefill and its compression have finished, every layer with padding is replaced in
the same cache object by a :class:`~kvpress_phase.ragged.RaggedLayer` holding only each head's kept entries, the
module's mask is cleared, its :class:`~kvpress_phase.presses.stats.LayerStats` records ``ragged=True``, and the
model is switched to the attention registered as ``"kvpress_phase_ragged"`` (SDPA exactly for every layer that is
not ragged), so decoding attends over each head's own entries.

Left as kvpress leaves them (masked): layers that are not transformers' plain ``DynamicLayer`` (a quantized cache),
batches of more than one sequence, and every use that calls ``press.compress`` directly (the evaluation's replay
engine, ``PerLayerWindowedPress``, ``WindowedDecodingPress``). A cache that is already ragged is refused: the press
reads and writes dense keys, so the pipeline's ``cache`` must be None or a ``DynamicCache``.
"""

from __future__ import annotations

import contextlib

import torch
from transformers.cache_utils import DynamicLayer

from kvpress_phase.ragged import ATTENTION_NAME, RaggedCache, RaggedLayer

__all__ = ["stored_ragged", "ragged_layers"]

DENSE_ATTENTIONS = ("sdpa", ATTENTION_NAME)
"""The model attentions the ragged one stands in for exactly (it is SDPA for layers that are not ragged)."""


def _language_model(model):
    inner = model.model
    return inner.language_model if hasattr(inner, "language_model") else inner


@contextlib.contextmanager
def stored_ragged(press, model):
    """Run the body (the prefill, compressed by ``press``), then store the padded layers of the cache it used ragged
    and switch ``model`` to the ragged attention (module docstring)."""
    name = type(press).__name__
    current = getattr(model.config, "_attn_implementation", None)
    if current not in DENSE_ATTENTIONS:
        raise ValueError(
            f"{name} stores each KV head at its own length and decodes with attn_implementation={ATTENTION_NAME!r}, "
            f"which stands in for 'sdpa' only; the model uses {current!r}: load it with attn_implementation='sdpa'"
        )
    seen: dict = {}

    def record_cache(module, args, kwargs):
        cache = kwargs.get("past_key_values")
        if cache is None or "cache" in seen:
            return
        layers = getattr(cache, "layers", [])
        if isinstance(cache, RaggedCache) or any(isinstance(layer, RaggedLayer) for layer in layers):
            raise ValueError(f"{name} compresses dense keys and stores them ragged itself: pass cache=None or a "
                             "DynamicCache, not a cache with ragged layers")
        seen["cache"] = cache

    hook = _language_model(model).register_forward_pre_hook(record_cache, with_kwargs=True)
    try:
        yield
    finally:
        hook.remove()
    cache = seen.get("cache")
    if cache is not None and ragged_layers(cache, model, press.stats):
        model.set_attn_implementation(ATTENTION_NAME)


def ragged_layers(cache, model, stats: dict) -> list[int]:
    """Replace, in ``cache``, every plain dense layer whose attention module holds kvpress's
    ``masked_key_indices`` (batch 1) by a :class:`RaggedLayer` of its unmasked entries; clear those masks and mark
    the layers' records in ``stats`` (``ragged=True``). Returns the indices of the layers replaced."""
    replaced = []
    for idx, decoder_layer in enumerate(_language_model(model).layers):
        module = decoder_layer.self_attn
        found = getattr(module, "masked_key_indices", None)
        if found is None or idx >= len(cache.layers) or type(cache.layers[idx]) is not DynamicLayer:
            continue
        layer = cache.layers[idx]
        batch, heads, length, _ = layer.keys.shape
        if batch != 1:
            continue
        masked = torch.zeros(heads, length, dtype=torch.bool, device=layer.keys.device)
        masked[found[1].to(masked.device), found[2].to(masked.device)] = True
        cache.layers[idx] = RaggedLayer.from_dense(layer.keys, layer.values, masked=masked)
        module.masked_key_indices = None
        if idx in stats:
            stats[idx].ragged = True
        replaced.append(idx)
    return replaced
