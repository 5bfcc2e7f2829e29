"""The registered ragged attention in tiny models: SDPA exactly where no layer is ragged, and the logits of masked
decoding (padding hidden per KV head, as the per-head presses leave a cache) where the padding is not stored."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvpress_phase.presses  # noqa: F401  (the exact per-head masks of the masked path)
from kvpress_phase.ragged import ATTENTION_NAME, RaggedCache, RaggedLayer
from tiny_models import tiny_model


@pytest.fixture
def model():
    model = tiny_model("llama", num_key_value_heads=2, num_attention_heads=6, num_hidden_layers=2)
    yield model
    model.set_attn_implementation("sdpa")
    for layer in model.model.layers:
        layer.self_attn.masked_key_indices = None


def _decode(model, cache, ids, start, steps=3):
    """Logits of a multi-token question at ``start``, then ``steps`` greedy tokens one at a time."""
    out = model(ids, past_key_values=cache, position_ids=torch.arange(start, start + ids.shape[1])[None])
    logits = [out.logits[0]]
    pos = start + ids.shape[1]
    for _ in range(steps):
        token = out.logits[:, -1:].argmax(-1)
        out = model(token, past_key_values=cache, position_ids=torch.tensor([[pos]]))
        logits.append(out.logits[0])
        pos += 1
    return torch.cat(logits)


@torch.no_grad()
def test_without_ragged_layers_it_is_sdpa_exactly(model):
    ids = torch.randint(4, 60, (1, 24), generator=torch.Generator().manual_seed(0))
    question = ids[:, -3:]
    results = []
    for name in ("sdpa", ATTENTION_NAME):
        model.set_attn_implementation(name)
        cache = DynamicCache()
        prefill = model(ids[:, :-3], past_key_values=cache).logits[0]
        results.append(torch.cat([prefill, _decode(model, cache, question, 21)]))
    assert torch.equal(results[0], results[1])


@torch.no_grad()
@pytest.mark.parametrize("how", ["lengths", "mask"])
def test_ragged_decoding_matches_masked_decoding(model, how):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 60, (1, 30), generator=g)
    question = torch.randint(4, 60, (1, 3), generator=g)
    masked_cache = DynamicCache()
    model(ids, past_key_values=masked_cache)
    if how == "lengths":  # keep_only's layout: each head its first entries, padding at the end (one head empty)
        kept = [torch.tensor([30, 0]), torch.tensor([1, 17])]
        masks = [torch.arange(30)[None, :] >= n[:, None] for n in kept]
    else:  # padding anywhere, as kvpress's masking presses leave it
        masks = [torch.rand(2, 30, generator=g) < 0.6 for _ in range(2)]
    ragged = RaggedCache([RaggedLayer.from_dense(layer.keys, layer.values, masked=m)
                          for layer, m in zip(masked_cache.layers, masks)])
    assert ragged.get_seq_length() == masked_cache.get_seq_length()
    kept = sum(int((~m).sum()) for m in masks)
    assert ragged.nbytes == kept * 16 * 4 * 2 + 2 * 2 * 2 * 4  # float32 keys and values, int32 starts and lengths
    for layer, m in zip(model.model.layers, masks):
        layer.self_attn.masked_key_indices = torch.nonzero(m[None], as_tuple=True)
    masked = _decode(model, masked_cache, question, 30)
    for layer in model.model.layers:
        layer.self_attn.masked_key_indices = None
    model.set_attn_implementation(ATTENTION_NAME)
    got = _decode(model, ragged, question, 30)
    torch.testing.assert_close(got, masked, rtol=1e-4, atol=1e-4)
    assert [layer.get_seq_length() for layer in ragged.layers] == [30 + 3 + 3] * 2
    assert [layer.entries for layer in ragged.layers] == [int((~m).sum()) + 2 * 6 for m in masks]


@torch.no_grad()
def test_a_ragged_cache_prefilled_directly_decodes_like_a_dense_one(model):
    ids = torch.randint(4, 60, (1, 12), generator=torch.Generator().manual_seed(2))
    dense = DynamicCache()
    model(ids[:, :-2], past_key_values=dense)
    expected = _decode(model, dense, ids[:, -2:], 10)
    model.set_attn_implementation(ATTENTION_NAME)
    ragged = RaggedCache()
    model(ids[:, :-2], past_key_values=ragged)
    torch.testing.assert_close(_decode(model, ragged, ids[:, -2:], 10), expected, rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_sdpa_over_a_ragged_cache_names_the_attention_to_use(model):
    ids = torch.randint(4, 60, (1, 8))
    dense = DynamicCache()
    model(ids, past_key_values=dense)
    ragged = RaggedCache([RaggedLayer.from_dense(layer.keys, layer.values) for layer in dense.layers])
    with pytest.raises(ValueError, match=ATTENTION_NAME):
        model(ids[:, :1], past_key_values=ragged, position_ids=torch.tensor([[8]]))
