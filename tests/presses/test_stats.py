"""What a press records (``press.stats``: :class:`LayerStats`) and the whole cache's summary (:func:`cache_summary`)
equal what the cache holds after a prefill on the built-in model: entries and bytes read from its tensors (a ragged
layer's buffers and index, where a per-head budget stored its layers ragged), masked padding read from the attention
modules."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache

from kvpress_phase import (CacheSummary, ChunkedStridePress, GlobalBudgetPress, HeadBudgetPress, LayerBudgetPress,
                           LayerStats, PhaseAwarePress, cache_summary, load_builtin_model)
from kvpress_phase.evaluation.tasks import generate
from kvpress_phase.ragged import RaggedLayer, cache_nbytes


@pytest.fixture(scope="module")
def built_in():
    return load_builtin_model()


@pytest.fixture(scope="module")
def input_ids(built_in):
    _, tokenizer = built_in
    example = generate("niah_single", tokenizer, n_samples=1, context_length=512, stride=8, phases=[3])[0]
    return tokenizer(tokenizer.bos_token + example["context"], return_tensors="pt",
                     add_special_tokens=False).input_ids


def _prefill(model, press, input_ids):
    """The cache after one prefill of ``input_ids`` under ``press``, and the entries masked per layer (kvpress's
    ``masked_key_indices`` on each attention module)."""
    for layer in model.model.layers:
        layer.self_attn.masked_key_indices = None  # a previous press's, on this shared model
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model.model(input_ids, past_key_values=cache)
    masked = []
    for layer in model.model.layers:
        found = getattr(layer.self_attn, "masked_key_indices", None)
        masked.append(0 if found is None else int(found[0].numel()))
    return cache, masked


PRESSES = {
    "chunked_stride": lambda: ChunkedStridePress(0.5, stride=8),
    "chunked_stride_pool": lambda: ChunkedStridePress(0.5, stride=8, mode="pool"),
    "phase_aware": lambda: PhaseAwarePress(0.25, stride=8),
    "no_compression": lambda: PhaseAwarePress(0.0),
    "head_budget": lambda: HeadBudgetPress(PhaseAwarePress(0.75)),  # masked padding
    "global_budget": lambda: GlobalBudgetPress(PhaseAwarePress(0.75)),  # masked, layers of different lengths
    "layer_budget": lambda: LayerBudgetPress(PhaseAwarePress(0.75)),  # layers of different lengths
}


CASES = [(name, torch.float32) for name in PRESSES] + [(name, torch.bfloat16) for name in ("chunked_stride",
                                                                                          "head_budget")]


@pytest.mark.parametrize("name,dtype", CASES, ids=[f"{n}-{str(d)[6:]}" for n, d in CASES])
def test_the_summary_is_what_the_cache_holds(built_in, input_ids, name, dtype):
    model, _ = built_in
    model = model.to(dtype)
    try:
        press = PRESSES[name]()
        cache, masked = _prefill(model, press, input_ids)
    finally:
        model.to(torch.float32)
    n = input_ids.shape[1]
    ragged = [isinstance(layer, RaggedLayer) for layer in cache.layers]
    # a ragged layer (the per-head budgets' padding not stored) holds its entries; a dense one, its tensors' slots
    stored_per_layer = [layer.entries if r else layer.keys.shape[0] * layer.keys.shape[1] * layer.keys.shape[2]
                        for layer, r in zip(cache.layers, ragged)]
    stored = sum(stored_per_layer)
    stored_bytes = cache_nbytes(cache)
    index_bytes = sum(layer.starts.nbytes + layer.lengths.nbytes for layer, r in zip(cache.layers, ragged) if r)
    buffers = [(layer.key_buffer, layer.value_buffer) if r else (layer.keys, layer.values)
               for layer, r in zip(cache.layers, ragged)]
    entry_bytes = {k.shape[-1] * k.element_size() + v.shape[-1] * v.element_size() for k, v in buffers}
    (entry,) = entry_bytes
    before = sum(layer.keys.shape[0] * layer.keys.shape[1] * n for layer in cache.layers)

    summary = cache_summary(press)
    assert isinstance(summary, CacheSummary) and summary.layers == len(cache.layers) == len(press.stats)
    assert summary.entries_before == before
    assert summary.entries_stored == stored
    assert summary.entries_masked == sum(masked)
    assert summary.entries_attended == stored - sum(masked)
    assert summary.bytes_stored == stored_bytes
    assert summary.bytes_attended == stored_bytes - index_bytes - sum(masked) * entry
    assert summary.bytes_before == before * entry
    assert summary.achieved_ratio == pytest.approx(1 - (stored - sum(masked)) / before)
    assert summary.stored_ratio == pytest.approx(1 - stored_bytes / (before * entry))
    if name in ("head_budget", "global_budget"):  # the padding of shorter heads is not stored: nothing masked
        assert any(ragged) and sum(masked) == 0 and summary.bytes_attended == summary.bytes_stored - index_bytes
        padded = sum(layer.keys.shape[1] * layer.keys.shape[2] for layer in cache.layers) * entry
        assert summary.bytes_stored < padded
    else:
        assert not any(ragged)
    if name == "no_compression":
        assert summary.achieved_ratio == 0.0 and summary.bytes_stored == summary.bytes_before
    # per layer: the record's counts are the layer's tensors
    for i, layer in enumerate(cache.layers):
        record = press.stats[i]
        assert record.ragged == ragged[i]
        assert record.entries_stored == stored_per_layer[i]
        assert record.entries_attended == stored_per_layer[i] - masked[i]
        assert record.achieved_ratio == pytest.approx(1 - record.entries_attended / (record.rows * record.seq_len))
    assert cache_summary(press.stats) == summary  # the stats dict alone gives the same figures


def test_a_batch_counts_every_sequence(built_in, input_ids):
    model, _ = built_in
    press = ChunkedStridePress(0.5, stride=8)
    batch = torch.cat([input_ids, input_ids.flip(1)])
    cache, _ = _prefill(model, press, batch)
    single = ChunkedStridePress(0.5, stride=8)
    _prefill(model, single, input_ids)
    assert press.stats[0].batch == 2 and cache.layers[0].keys.shape[0] == 2
    assert cache_summary(press).bytes_stored == 2 * cache_summary(single).bytes_stored == sum(
        layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)


def test_layer_stats_read_as_a_dict_and_print_short(built_in, input_ids):
    model, _ = built_in
    press = HeadBudgetPress(PhaseAwarePress(0.75))
    _prefill(model, press, input_ids)
    record = press.stats[1]
    as_dict = record.as_dict()
    json.dumps(as_dict)  # plain values only: no tensors
    assert as_dict["compressed_length"] == record.compressed_length and as_dict["heads"] == 2
    assert as_dict["masked_entries"] == record.masked_entries
    assert as_dict["positions"] == record.positions.tolist()
    text = repr(record)
    assert text.startswith("LayerStats(seq_len=") and "tensor(" not in text and len(text) < 300
    assert f"compressed_length={record.compressed_length}" in text
    assert "<int32 tensor (1, 2, " in text  # the positions' shape, not their values
    json.dumps(cache_summary(press).as_dict())


def test_a_summary_needs_a_prefill_and_recorded_shapes():
    with pytest.raises(ValueError, match="run a prefill"):
        cache_summary(PhaseAwarePress(0.5))
    with pytest.raises(ValueError, match="records nothing.*context_length"):
        cache_summary(object())
    with pytest.raises(ValueError, match=r"press.stats\[0\] does not record its shape"):
        cache_summary({0: LayerStats(10, 5, 0.5, None, None)})


def test_cache_summary_reads_any_press_from_its_cache():
    """kvpress's own presses and no press record nothing: the summary is read from the cache the pipeline used."""
    from kvpress import KnormPress
    from transformers import DynamicCache, pipeline

    from kvpress_phase import cache_bytes, load_builtin_model
    from kvpress_phase.evaluation.tasks import generate

    model, tokenizer = load_builtin_model()
    example = generate("niah_single", tokenizer, n_samples=1, context_length=256, stride=8, phases=[1])[0]
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    n = len(tokenizer.encode(tokenizer.bos_token + example["context"], add_special_tokens=False))
    for press in (None, KnormPress(0.5)):
        cache = DynamicCache()
        pipe(example["context"], question=example["question"], press=press, max_new_tokens=2, cache=cache)
        summary = cache_summary(press, cache, context_length=n)
        assert summary.bytes_stored == cache_bytes(cache)
        assert summary.entries_before == len(cache.layers) * model.config.num_key_value_heads * n
        expected = 0.0 if press is None else 0.5
        assert summary.achieved_ratio == pytest.approx(expected, abs=0.01)
    with pytest.raises(ValueError, match="context_length"):
        cache_summary(KnormPress(0.5))
