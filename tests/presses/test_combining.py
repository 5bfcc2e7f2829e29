"""Our presses with kvpress's other ways of combining presses: composition, quantized caches, per-layer ratios."""

from __future__ import annotations

import os

import pytest
import torch
from kvpress import ComposedPress, DecodingPress, KnormPress, PrefillDecodingPress, StreamingLLMPress
from transformers import DynamicCache, QuantizedCache, pipeline

from tiny_models import tiny_model
from kvpress_phase.presses.scorers import SnapKVScorer
from kvpress_phase import (ChunkedStridePress, PerLayerWindowedPress, PhaseAwarePress, StaggeredWindowPress,
                           WindowedDecodingPress)
from kvpress_phase.core.phase import compressed_length

PRESSES = {
    "chunked_select": lambda r, **kw: ChunkedStridePress(r, mode="select", **kw),
    "chunked_pool": lambda r, **kw: ChunkedStridePress(r, mode="pool", **kw),
    "staggered_select": lambda r, **kw: StaggeredWindowPress(r, mode="select", **kw),
    "phase_aware_pool": lambda r, **kw: PhaseAwarePress(r, residual="pool", scorer=SnapKVScorer(), **kw),
    "phase_aware": lambda r, **kw: PhaseAwarePress(r, **kw),  # the default: KeyDiff scores, drop
}
PRUNING = {"knorm": lambda: KnormPress(0.5), "streaming_llm": lambda: StreamingLLMPress(0.5, n_sink=4)}
CONTEXT = " ".join(f"w{(7 * i) % 50}" for i in range(150))


def _context_len(tokenizer) -> int:
    return len(tokenizer.encode(tokenizer.bos_token + CONTEXT, add_special_tokens=False))


def _pipe(model, tokenizer):
    return pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")


# ------------------------------------------------------------------------------------------------ composition
@pytest.mark.parametrize("pruning", sorted(PRUNING))
@pytest.mark.parametrize("name", sorted(PRESSES))
def test_composed_after_a_pruning_press_refuses_and_names_the_order(name, pruning, tokenizer):
    ours = PRESSES[name](0.5)
    cls = type(ours).__name__
    pipe = _pipe(tiny_model("llama"), tokenizer)
    with pytest.raises(ValueError, match=rf"Put {cls} first: ComposedPress\(\[{cls}\(\.\.\.\), other_press\]\)"):
        pipe(CONTEXT, question="w1", press=ComposedPress([PRUNING[pruning](), ours]), max_new_tokens=2)


@pytest.mark.parametrize("pruning", sorted(PRUNING))
@pytest.mark.parametrize("name", sorted(PRESSES))
def test_composed_before_a_pruning_press_works(name, pruning, tokenizer):
    ours = PRESSES[name](0.5)
    cache = DynamicCache()
    out = _pipe(tiny_model("llama"), tokenizer)(CONTEXT, question="w1", press=ComposedPress([ours, PRUNING[pruning]()]),
                                                max_new_tokens=2, cache=cache)
    assert isinstance(out["answer"], str)
    ours_len = compressed_length(_context_len(tokenizer), 8, 0.5)
    assert ours.stats[0].compressed_length == ours_len
    assert cache.layers[0].keys.shape[2] == int(ours_len * 0.5)


def test_a_composed_press_has_its_stats_on_ours_inside_it(tokenizer):
    """kvpress's ComposedPress records nothing itself; README.md sends its users to ``composed.presses[0].stats``,
    which describe our press's compression, before the next press prunes the cache further."""
    composed = ComposedPress([ChunkedStridePress(0.5), KnormPress(0.5)])
    cache = DynamicCache()
    _pipe(tiny_model("llama"), tokenizer)(CONTEXT, question="w1", press=composed, max_new_tokens=2, cache=cache)
    stats = composed.presses[0].stats
    assert sorted(stats) == list(range(len(cache.layers)))
    assert stats[0].compressed_length == compressed_length(_context_len(tokenizer), 8, 0.5)
    assert stats[0].positions.shape[-1] == stats[0].compressed_length
    assert cache.layers[0].keys.shape[2] == int(stats[0].compressed_length * 0.5)
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md"), encoding="utf-8") as fh:
        assert "`composed.presses[0].stats` for `composed = ComposedPress([ours, other])`" in " ".join(fh.read().split())

def test_shortened_keys_are_refused_by_compress_itself():
    press = ChunkedStridePress(0.5, rope="none")
    keys = torch.randn(1, 2, 60, 8)
    with pytest.raises(ValueError, match="60 keys for 100 tokens"):
        press.compress(None, torch.randn(1, 100, 16), keys, keys, None, {})
    out, _ = press.compress(None, torch.randn(1, 60, 16), keys, keys, None, {})  # a full cache is fine
    assert out.shape[2] == compressed_length(60, 8, 0.5)


@pytest.mark.parametrize("name", ["chunked_pool", "staggered_select"])
def test_ours_for_the_prefill_and_kvpress_decoding_press(name, tokenizer):
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    press = PrefillDecodingPress(PRESSES[name](0.5), DecodingPress(KnormPress(), compression_interval=16,
                                                                   target_size=64))
    sizes = []
    hook = model.model.layers[0].self_attn.register_forward_hook(
        lambda m, a, kw, out: sizes.append(kw["past_key_values"].get_seq_length(0)), with_kwargs=True)
    try:
        _pipe(model, tokenizer)(CONTEXT, question="w1", press=press, max_new_tokens=60)
    finally:
        hook.remove()
    assert sizes[1] == compressed_length(_context_len(tokenizer), 8, 0.5) + 1  # ours compressed the prefill
    assert min(sizes[2:]) <= 64 + 1  # kvpress's decoding press pruned to its target size


# ------------------------------------------------------------------------------------------------ quantized cache
def _quantized_cache(model):
    pytest.importorskip("optimum.quanto")
    return QuantizedCache(backend="quanto", config=model.config, nbits=4, q_group_size=16, residual_length=32)


@pytest.mark.parametrize("name", sorted(PRESSES))
def test_quantized_cache_through_the_pipeline(name, tokenizer):
    model = tiny_model("llama")
    cache = _quantized_cache(model)
    press = PRESSES[name](0.5)
    out = _pipe(model, tokenizer)(CONTEXT, question="w1 w2", press=press, max_new_tokens=8, cache=cache)
    assert isinstance(out["answer"], str) and out["answer"].strip()
    expected = compressed_length(_context_len(tokenizer), 8, 0.5)
    for layer_idx, layer in enumerate(cache.layers):
        assert press.stats[layer_idx].compressed_length == expected
        assert layer._quantized_keys.shape[2] == expected


@pytest.mark.parametrize("name", sorted(PRESSES))
def test_quantized_cache_holds_the_compressed_cache(name):
    model = tiny_model("llama")
    ids = torch.randint(4, 60, (2, 140), generator=torch.Generator().manual_seed(0))
    # a grid that does not follow the content, so that quantization noise cannot move it
    make = (lambda: PRESSES[name](0.5, align=False)) if name.startswith("staggered") else lambda: PRESSES[name](0.5)
    caches = {"dynamic": DynamicCache(), "quantized": _quantized_cache(model)}
    for cache in caches.values():
        with torch.no_grad(), make()(model):
            model.model(input_ids=ids, past_key_values=cache)
    expected = compressed_length(140, 8, 0.5)
    for dyn, quant in zip(caches["dynamic"].layers, caches["quantized"].layers):
        q = quant._dequantize(quant._quantized_keys)
        assert q.shape == dyn.keys.shape == (2, 2, expected, 16)
        assert quant.get_seq_length() == expected
        if name.endswith("pool"):  # select may keep other tokens where quantization reorders close scores
            assert (q - dyn.keys).norm() < 0.15 * dyn.keys.norm()  # 4-bit quantization error only (about 0.08)


@pytest.mark.parametrize("name", ["chunked_pool", "staggered_select"])
def test_quantized_cache_while_decoding(name, tokenizer, monkeypatch):
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    cache = _quantized_cache(model)
    press = WindowedDecodingPress(PRESSES[name](0.5))
    lengths = []
    from kvpress_phase.presses import decoding

    original = decoding.decode_step

    def wrapped(p, module, kwargs, output):
        out = original(p, module, kwargs, output)
        layer_idx = module.layer_idx
        lengths.append((p.decoding_state[layer_idx].seen, kwargs["past_key_values"].get_seq_length(layer_idx)))
        return out

    monkeypatch.setattr(decoding, "decode_step", wrapped)
    _pipe(model, tokenizer)(CONTEXT, question="w1 w2", press=press, max_new_tokens=120, cache=cache)
    assert len(lengths) == 2 * 120
    for n, cache_len in lengths:
        assert cache_len == compressed_length(n, 8, 0.5)


# ------------------------------------------------------------------------------------------------ per-layer ratios
RATIOS = {"list": [0.0, 0.5, 0.75], "mapping": {1: 0.75}}


@pytest.mark.parametrize("kind", sorted(RATIOS))
@pytest.mark.parametrize("name", sorted(PRESSES))
def test_per_layer_ratios_through_the_pipeline(name, kind, tokenizer):
    model = tiny_model("llama", num_hidden_layers=3)
    press = PerLayerWindowedPress(PRESSES[name](0.25), RATIOS[kind])
    cache = DynamicCache()
    pipe = _pipe(model, tokenizer)
    assert isinstance(pipe(CONTEXT, question="w1", press=press, max_new_tokens=2, cache=cache)["answer"], str)
    n = _context_len(tokenizer)
    ratios = [press.ratio_for(i) for i in range(3)]
    assert ratios == ([0.0, 0.5, 0.75] if kind == "list" else [0.25, 0.75, 0.25])
    for layer_idx, ratio in enumerate(ratios):
        assert cache.layers[layer_idx].keys.shape[2] == compressed_length(n, 8, ratio)
        assert press.stats[layer_idx].compressed_length == compressed_length(n, 8, ratio)
    assert press.press.compression_ratio == 0.25  # restored after every layer
    assert press.compression_ratio == pytest.approx(sum(ratios) / 3)


@pytest.mark.parametrize("name", ["chunked_pool", "phase_aware_pool"])
def test_per_layer_ratios_while_decoding(name, tokenizer):
    model = tiny_model("llama", num_hidden_layers=3)
    model.generation_config.eos_token_id = None
    press = WindowedDecodingPress(PerLayerWindowedPress(PRESSES[name](0.5), [0.25, 0.0, 0.75]))
    assert isinstance(press, PrefillDecodingPress)
    _pipe(model, tokenizer)(CONTEXT, question="w1", press=press, max_new_tokens=100)
    for layer_idx, ratio in enumerate([0.25, 0.0, 0.75]):
        state = press.decoding_state[layer_idx]
        assert state.cache_len == compressed_length(state.seen, 8, ratio)
    n_question = len(tokenizer.encode("w1\n", add_special_tokens=False))
    assert press.decoding_state[2].seen == _context_len(tokenizer) + n_question + 99


def test_per_layer_validation():
    with pytest.raises(ValueError, match="press must be a ChunkedStridePress, PhaseAwarePress or StaggeredWindowPress"):
        PerLayerWindowedPress(KnormPress(0.5), [0.5])
    with pytest.raises(ValueError, match=r"compression_ratios\[1\]"):
        PerLayerWindowedPress(ChunkedStridePress(), [0.5, 1.0])
    with pytest.raises(ValueError, match="compression_ratios keys"):
        PerLayerWindowedPress(ChunkedStridePress(), {-1: 0.5})
    with pytest.raises(ValueError, match="compression_ratios must be a non-empty list"):
        PerLayerWindowedPress(ChunkedStridePress(), 0.5)
    model = tiny_model("llama")  # 2 layers
    for ratios, match in (([0.5, 0.5, 0.5], "3 entries, but the model has 2 layers"),
                          ({5: 0.5}, r"names layers \[5\], but the model has 2 layers")):
        with pytest.raises(ValueError, match=match):
            with PerLayerWindowedPress(ChunkedStridePress(), ratios)(model):
                pass
