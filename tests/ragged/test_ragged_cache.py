"""RaggedLayer and RaggedCache: what they store, how they grow and crop, their exact bytes, and what they refuse."""

from __future__ import annotations

import pytest
import torch

from kvpress_phase.ragged import RaggedCache, RaggedLayer, RaggedView, cache_nbytes

INDEX_BYTES = 2 * 4  # starts and lengths, int32, per KV head


def _dense(heads=3, length=10, dim=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, heads, length, dim, generator=g).to(dtype),
            torch.randn(1, heads, length, dim, generator=g).to(dtype))


def _head(layer, h):
    start, length = int(layer.starts[h]), int(layer.lengths[h])
    return layer.key_buffer[start:start + length], layer.value_buffer[start:start + length]


def test_from_lengths_stores_each_heads_first_entries_only():
    keys, values = _dense()
    layer = RaggedLayer.from_dense(keys, values, lengths=[10, 0, 4])
    assert layer.head_lengths == [10, 0, 4] and layer.lengths.tolist() == [10, 0, 4]
    assert layer.key_buffer.shape == (14, 8) and layer.entries == 14
    for h, n in enumerate([10, 0, 4]):
        k, v = _head(layer, h)
        assert torch.equal(k, keys[0, h, :n]) and torch.equal(v, values[0, h, :n])
    assert layer.get_seq_length() == 10  # the dense length it was built from


def test_from_mask_keeps_the_unmasked_entries_in_order():
    keys, values = _dense(heads=2, length=6)
    masked = torch.tensor([[False, True, False, True, True, False], [True] * 6])
    layer = RaggedLayer.from_dense(keys, values, masked=masked[None])
    assert layer.head_lengths == [3, 0]
    k, v = _head(layer, 0)
    assert torch.equal(k, keys[0, 0, [0, 2, 5]]) and torch.equal(v, values[0, 0, [0, 2, 5]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nbytes_counts_buffers_slack_and_index_exactly(dtype):
    keys, values = _dense(heads=3, length=10, dim=8, dtype=dtype)
    size = torch.finfo(dtype).bits // 8
    layer = RaggedLayer.from_dense(keys, values, lengths=[10, 1, 4], growth=5)
    assert layer.nbytes == 15 * 8 * size * 2 + 3 * INDEX_BYTES
    layer.update(*_dense(heads=3, length=1, dim=8, dtype=dtype, seed=1))  # no slack yet: repacked, +1 and +5 each
    assert layer.key_buffer.shape[0] == (10 + 6) + (1 + 6) + (4 + 6)
    assert layer.nbytes == 33 * 8 * size * 2 + 3 * INDEX_BYTES
    assert layer.entries == 18
    cache = RaggedCache([layer, RaggedLayer.from_dense(keys, values, lengths=[1, 1, 1])])
    assert cache.nbytes == cache_nbytes(cache) == layer.nbytes + 3 * 8 * size * 2 + 3 * INDEX_BYTES


def test_every_head_grows_in_place_until_its_slack_runs_out():
    keys, values = _dense(heads=2, length=5)
    layer = RaggedLayer.from_dense(keys, values, lengths=[5, 2], growth=2)
    steps = [_dense(heads=2, length=1, seed=s) for s in range(1, 5)]
    layer.update(*steps[0])
    buffer = layer.key_buffer
    layer.update(*steps[1])
    layer.update(*steps[2])
    assert layer.key_buffer is buffer  # two appends fit the slack of 2
    layer.update(*steps[3])
    assert layer.key_buffer is not buffer  # the fourth needed a repack
    assert layer.head_lengths == [9, 6] and layer.get_seq_length() == 9
    k0, v0 = _head(layer, 0)
    k1, _ = _head(layer, 1)
    new_k = torch.cat([s[0][0, :, 0] for s in steps], dim=0).view(4, 2, -1)  # (step, head, dim)
    assert torch.equal(k0, torch.cat([keys[0, 0], new_k[:, 0]]))
    assert torch.equal(k1, torch.cat([keys[0, 1, :2], new_k[:, 1]]))
    assert torch.equal(v0[-1], steps[3][1][0, 0, 0])


def test_a_multi_token_step_appends_in_order():
    keys, values = _dense(heads=2, length=4)
    layer = RaggedLayer.from_dense(keys, values, lengths=[1, 3], growth=0)
    new_k, new_v = _dense(heads=2, length=3, seed=7)
    returned_k, returned_v = layer.update(new_k, new_v)
    assert isinstance(returned_k, RaggedView) and returned_k.shape == (1, 2, 7, 8)
    assert torch.equal(_head(layer, 0)[0], torch.cat([keys[0, 0, :1], new_k[0, 0]]))
    assert torch.equal(_head(layer, 1)[1], torch.cat([values[0, 1, :3], new_v[0, 1]]))


def test_kvpress_answer_removal_drops_the_appended_entries_of_every_head():
    keys, values = _dense(heads=2, length=5)
    layer = RaggedLayer.from_dense(keys, values, lengths=[5, 2])
    before = layer.get_seq_length()
    layer.update(*_dense(heads=2, length=3, seed=2))
    layer.update(*_dense(heads=2, length=1, seed=3))
    layer.keys = layer.keys[:, :, :before]  # what kvpress's pipeline does after an answer
    layer.values = layer.values[:, :, :before]
    assert layer.head_lengths == [5, 2] and layer.get_seq_length() == 5
    assert torch.equal(_head(layer, 1)[0], keys[0, 1, :2])
    with pytest.raises(ValueError, match="max_length"):
        layer.crop(3)


def test_lazy_layers_take_dense_prefills():
    cache = RaggedCache()
    keys, values = _dense(heads=2, length=6)
    cache.update(keys, values, 0)
    assert cache.get_seq_length() == 6 and cache.layers[0].head_lengths == [6, 6]
    dense_k, dense_v, lengths = cache.layers[0].dense()
    assert torch.equal(dense_k, keys) and torch.equal(dense_v, values) and lengths.tolist() == [6, 6]


@pytest.mark.parametrize("call,match", [
    (lambda k, v: RaggedLayer.from_dense(torch.cat([k, k]), torch.cat([v, v])), "batch 1"),
    (lambda k, v: RaggedLayer.from_dense(k, v, lengths=[1, 2]), "lengths"),
    (lambda k, v: RaggedLayer.from_dense(k, v, lengths=[1, 2, 11]), "lengths"),
    (lambda k, v: RaggedLayer.from_dense(k, v, masked=torch.zeros(3, 4, dtype=torch.bool)), "masked"),
    (lambda k, v: RaggedLayer.from_dense(k, v, lengths=[1, 2, 3], masked=torch.zeros(3, 10, dtype=torch.bool)),
     "not both"),
    (lambda k, v: RaggedLayer(growth=-1), "growth"),
    (lambda k, v: RaggedLayer.from_dense(k, v).update(k[:, :2], v[:, :2]), "KV heads"),
    (lambda k, v: RaggedLayer.from_dense(k, v).update(torch.cat([k, k]), torch.cat([v, v])), "batch 1"),
])
def test_bad_input_is_refused_naming_it(call, match):
    keys, values = _dense()
    with pytest.raises(ValueError, match=match):
        call(keys, values)


def test_ragged_keys_are_not_dense_tensors():
    keys, values = _dense()
    layer = RaggedLayer.from_dense(keys, values, lengths=[3, 2, 1])
    with pytest.raises(ValueError, match="kvpress_phase_ragged"):
        torch.matmul(layer.keys, layer.keys)
    with pytest.raises(ValueError, match="kvpress_phase_ragged"):
        layer.keys[:, :, None]
    with pytest.raises(ValueError, match="DynamicCache"):
        layer.keys = keys
