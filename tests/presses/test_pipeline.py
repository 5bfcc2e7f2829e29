"""Both presses, both modes, every supported family, through kvpress's own entry points."""

from __future__ import annotations

import pytest
import torch
from kvpress import ComposedPress, KnormPress, PerLayerCompressionPress, SnapKVPress
from transformers import DynamicCache, pipeline

from tiny_models import FAMILIES, tiny_model
from kvpress_phase import ChunkedStridePress, PhaseAwarePress, StaggeredWindowPress
from kvpress_phase.core.phase import compressed_length
from kvpress_phase.presses.scorers import SnapKVScorer

PRESSES = {
    "chunked_select": lambda r: ChunkedStridePress(r, mode="select"),
    "chunked_pool": lambda r: ChunkedStridePress(r, mode="pool"),
    "staggered_select": lambda r: StaggeredWindowPress(r, mode="select", scorer=KnormPress()),
    "staggered_pool": lambda r: StaggeredWindowPress(r, scorer=KnormPress()),
    "phase_aware": lambda r: PhaseAwarePress(r),  # the default: KeyDiff scores, residual="drop"
    "phase_aware_row_pool_snapkv": lambda r: PhaseAwarePress(r, residual="pool", scorer=SnapKVScorer()),
    "phase_aware_row_short_window": lambda r: PhaseAwarePress(r, residual="pool",
                                                              scorer=SnapKVScorer(window_size=16)),
}
CONTEXT = " ".join(f"w{(7 * i) % 50}" for i in range(150))


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request):
    return request.param, tiny_model(request.param)


@pytest.mark.parametrize("press_name", sorted(PRESSES))
def test_pipeline_answers_and_cache_length(family_model, tokenizer, press_name):
    family, model = family_model
    press = PRESSES[press_name](0.5)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    cache = DynamicCache()
    out = pipe(CONTEXT, question="w1 w2", press=press, max_new_tokens=4, cache=cache)
    assert isinstance(out["answer"], str) and out["answer"].strip()
    n = len(tokenizer.encode(tokenizer.bos_token + CONTEXT, add_special_tokens=False))
    expected = compressed_length(n, press.stride, press.compression_ratio, press.n_sink, press.n_local)
    assert expected < n
    for layer_idx in range(model.config.num_hidden_layers):
        assert cache.layers[layer_idx].keys.shape[2] == expected, family
        assert press.stats[layer_idx].compressed_length == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_heads", [1, 2], ids=["mqa", "gqa"])
@pytest.mark.parametrize("press_name", sorted(PRESSES))
def test_context_manager_batch_dtypes(press_name, kv_heads, dtype):
    model = tiny_model("qwen3", num_key_value_heads=kv_heads, dtype=dtype)
    press = PRESSES[press_name](0.75)
    ids = torch.randint(4, 60, (3, 137), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model.model(input_ids=ids, past_key_values=cache)
    expected = compressed_length(137, 8, 0.75, 4, 16)
    for layer in cache.layers:
        assert layer.keys.shape == (3, kv_heads, expected, 16)
        assert layer.keys.dtype == dtype
        assert torch.isfinite(layer.keys).all() and torch.isfinite(layer.values).all()
    # decoding on the compressed cache works
    with torch.no_grad():
        out = model(input_ids=ids[:, :2], past_key_values=cache, position_ids=torch.arange(137, 139).expand(3, 2))
    assert torch.isfinite(out.logits).all()


def test_composed_press_runs_ours_then_a_kvpress_press(tokenizer):
    model = tiny_model("llama")
    press = ComposedPress([ChunkedStridePress(0.5), KnormPress(0.5)])
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    cache = DynamicCache()
    pipe(CONTEXT, question="w1", press=press, max_new_tokens=2, cache=cache)
    n = len(tokenizer.encode(tokenizer.bos_token + CONTEXT, add_special_tokens=False))
    assert cache.layers[0].keys.shape[2] == int(compressed_length(n, 8, 0.5) * 0.5)


@pytest.mark.parametrize("press", [ChunkedStridePress(0.5), PhaseAwarePress(0.5)], ids=["chunked", "phase_aware"])
def test_per_layer_wrapper_refuses_with_a_clear_error(press):
    # PerLayerCompressionPress only accepts global ScorerPresses; it must refuse ours, not silently ignore windows
    # (PerLayerWindowedPress is ours, tests/presses/test_combining.py)
    with pytest.raises(AssertionError, match="ScorerPress"):
        PerLayerCompressionPress(press=press, compression_ratios=[0.5, 0.5])


def test_wrappers_can_set_compression_ratio():
    press = ChunkedStridePress(0.5)
    press.compression_ratio = 0.75
    assert press.k == 2
    press.compression_ratio = 1.5
    with pytest.raises(ValueError, match="compression_ratio"):
        press.compress(None, None, torch.zeros(1, 1, 64, 8), torch.zeros(1, 1, 64, 8), None, {})


def test_other_scorer(tokenizer):
    model = tiny_model("llama")
    press = ChunkedStridePress(0.5, mode="select", scorer=SnapKVPress(window_size=4))
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    assert isinstance(pipe(CONTEXT, question="w1", press=press, max_new_tokens=2)["answer"], str)


class _NoRopeAttention(torch.nn.Module):
    layer_idx = 0
    head_dim = 8


POOLING = {  # presses that pool entries (so RoPE handling is exercised), scored by key norm: the fake layer has no
    # projections for SnapKV
    "ChunkedStridePress": lambda **kw: ChunkedStridePress(0.5, mode="pool", **kw),
    "StaggeredWindowPress": lambda **kw: StaggeredWindowPress(0.5, scorer=KnormPress(), **kw),
    "PhaseAwarePress": lambda **kw: PhaseAwarePress(0.5, scorer=KnormPress(), residual="pool", **kw),
}
SELECTING = {
    "ChunkedStridePress": lambda **kw: ChunkedStridePress(0.5, mode="select", **kw),
    "StaggeredWindowPress": lambda **kw: StaggeredWindowPress(0.5, mode="select", scorer=KnormPress(), **kw),
    "PhaseAwarePress": lambda **kw: PhaseAwarePress(0.5, scorer=KnormPress(), **kw),
}


@pytest.mark.parametrize("name", sorted(POOLING))
def test_rope_modes_need_a_rotary_embedding(name):
    keys = torch.randn(1, 2, 80, 8)
    with pytest.raises(ValueError, match="_NoRopeAttention"):
        POOLING[name](rope="centroid").compress(_NoRopeAttention(), None, keys, keys, None, {})
    out, _ = POOLING[name](rope="none", weighting="mean").compress(_NoRopeAttention(), None, keys, keys, None, {})
    assert out.shape[2] < 80


def test_model_without_rotary_embedding_is_refused_at_setup():
    model = tiny_model("llama")
    model.model.rotary_emb = None
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        with ChunkedStridePress(0.5, mode="pool", rope="start")(model):
            pass
    with ChunkedStridePress(0.5)(model):  # selection (the default) needs no rotary embedding
        pass


@pytest.mark.parametrize("press", [ChunkedStridePress(), PhaseAwarePress(), ChunkedStridePress(0.5, mode="pool"),
                                   ChunkedStridePress(0.5, mode="pool", rope="none")],
                         ids=["chunked_select", "phase_aware", "chunked_pool", "chunked_pool_rope_none"])
def test_model_without_kvpress_layout_is_refused_when_attached(press):
    """GPT-2 (learned absolute positions, layers at ``transformer.h[i].attn``) has neither the rotary embedding nor
    the layers that kvpress's hooks need, in any mode: a ValueError naming both, before any forward pass."""
    import transformers

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64,
                                                                 n_positions=64)).eval()
    with pytest.raises(ValueError, match=rf"{type(press).__name__} needs a model with rotary position embeddings"
                                         r".*GPT2LMHeadModel has no model\.model\.rotary_emb"):
        with press(model):
            pytest.fail("the press was attached")


@pytest.mark.parametrize("name", sorted(POOLING))
@pytest.mark.parametrize("mode", ["select", "pool"])
def test_short_sequences_pass_through(name, mode):
    press = (POOLING if mode == "pool" else SELECTING)[name](rope="none")
    keys = torch.randn(2, 2, 4 + 16 + 8, 8)
    out_k, out_v = press.compress(_NoRopeAttention(), None, keys, keys.clone(), None, {})
    assert out_k is keys


@pytest.mark.parametrize("mode", ["select", "pool"])
@pytest.mark.parametrize("rope", ["none", "start", "centroid"])
def test_float16_large_magnitudes_stay_finite(mode, rope):
    model = tiny_model("llama")
    attn = model.model.layers[0].self_attn
    attn.rotary_emb = model.model.rotary_emb
    keys = (torch.randn(1, 2, 200, 16) * 6e4).clamp(-65000, 65000).half()
    values = (torch.randn(1, 2, 200, 16) * 6e4).clamp(-65000, 65000).half()
    for press in (ChunkedStridePress(0.5, mode=mode, rope=rope),
                  StaggeredWindowPress(0.75, mode=mode, rope=rope, weighting="score", scorer=KnormPress()),
                  PhaseAwarePress(0.75, rope=rope, weighting="score", scorer=KnormPress())):
        k, v = press.compress(attn, None, keys, values, None, {})
        assert torch.isfinite(k).all() and torch.isfinite(v).all()
