"""bench_compress_cost's ragged bytes: a masked layer counted as stored ragged, the others as they are."""

from __future__ import annotations

import os
import sys

import torch
from transformers import DynamicCache

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_compress_cost  # noqa: E402


def test_ragged_bytes_frees_the_masked_entries_and_counts_the_index():
    cache = DynamicCache()
    for layer in range(2):
        cache.update(torch.zeros(1, 2, 10, 8), torch.zeros(1, 2, 10, 4), layer)
    masks = {1: (torch.tensor([0, 0, 1]), torch.tensor([7, 8, 9]))}
    dense_layer = 2 * 10 * (8 + 4) * 4
    ragged_layer = (20 - 3) * (8 + 4) * 4 + 2 * 2 * 4  # 17 entries, starts and lengths of 2 heads in int32
    assert bench_compress_cost.ragged_bytes(cache, masks) == dense_layer + ragged_layer
    assert bench_compress_cost.ragged_bytes(cache, None) == 2 * dense_layer
