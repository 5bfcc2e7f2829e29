"""bench_ragged_attention's inputs: the drawn per-head lengths and the padded dense layout SDPA is timed on."""

from __future__ import annotations

import pytest
import torch

from benchmark_scripts import load_benchmark


@pytest.mark.parametrize("n", [256, 32768, 131072])
def test_head_lengths_keep_the_ratio_on_average_and_are_ragged(n):
    head_lengths = load_benchmark("bench_ragged_attention").head_lengths
    lengths = head_lengths(n, 8, 0.5, seed=0)
    assert len(lengths) == 8 and sum(lengths) == 4 * n and max(lengths) <= n and min(lengths) >= 1
    assert max(lengths) >= 1.5 * n / 2 and min(lengths) <= 0.25 * n / 2  # some heads much longer than others
    assert lengths == head_lengths(n, 8, 0.5, seed=0)  # deterministic
    assert lengths != head_lengths(n, 8, 0.5, seed=1)


def test_head_lengths_at_the_edges():
    head_lengths = load_benchmark("bench_ragged_attention").head_lengths
    assert head_lengths(10, 8, 0.0) == [10] * 8  # nothing dropped: every head at the cap
    assert head_lengths(10, 8, 0.95) == [1] * 8  # at least one entry per head
    assert head_lengths(10, 4, 0.5, spread=0.0) == [5, 5, 5, 5]  # no spread: equal heads
    assert sorted(head_lengths(9, 3, 0.5, spread=0.0)) == [4, 5, 5]  # 14 entries in all: the remainder spread
    for bad in (dict(ratio=1.0), dict(ratio=-0.1), dict(spread=-1.0), dict(n=0)):
        args = dict(n=10, heads=8, ratio=0.5) | bad
        with pytest.raises(ValueError, match=next(iter(bad))):
            head_lengths(**args)


def test_padded_layout_holds_each_heads_rows_and_masks_the_rest():
    module = load_benchmark("bench_ragged_attention")
    lengths = [5, 1, 70]
    query, keys, values, starts, lens = module.build_case(lengths, 6, 16, 3, torch.float32, "cpu", seed=0)
    assert starts.tolist() == [0, 8, 12] and lens.dtype == torch.int32 and keys.shape == (76 + 9, 16)
    k, v, mask = module.padded(keys, values, starts.tolist(), lengths)
    assert k.shape == (1, 3, 128, 16) and mask.shape == (3, 128)  # the longest head rounded up to 64
    assert mask.sum(dim=1).tolist() == lengths
    assert torch.equal(k[0, 2, :70], keys[12:82]) and torch.equal(v[0, 0, :5], values[:5])
    assert not k[0, 0, 5:].any()


def test_bad_arguments_are_refused_naming_them():
    module = load_benchmark("bench_ragged_attention")
    with pytest.raises(ValueError, match="--q-heads"):
        module.parse_args(["--device", "cpu", "--q-heads", "12", "--kv-heads", "8"])
    with pytest.raises(ValueError, match="--sizes"):
        module.parse_args(["--device", "cpu", "--sizes", "32k"])
    with pytest.raises(ValueError, match="--backends"):
        module.parse_args(["--device", "cpu", "--backends", "cuda"])
