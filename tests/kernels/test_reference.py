"""The PyTorch reference's fast paths against its general computation (no Triton involved).

Mean pooling of equal contiguous groups (``window == stride``, ``k`` dividing it) and selection on a uniform grid
write straight into the output; the general paths (score weighting, gathered windows) compute the same entries
another way. Constant scores make score weighting a plain mean, so the two paths must agree.
"""

from __future__ import annotations

import pytest
import torch

from kvpress_phase.kernels import naive
from kvpress_phase.core.phase import WindowLayout


def _case(dtype, offsets, seq=83, stride=8, k=4, batch=2, heads=3, n_sink=3, n_local=5):
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(batch, heads, seq, 64, generator=g).to(dtype)
    values = torch.randn(batch, heads, seq, 48, generator=g).to(dtype)
    if offsets == "staggered":
        offsets = torch.arange(batch * heads).reshape(batch, heads) % stride
    layout = WindowLayout.build(seq, window=stride, stride=stride, k=k, offsets=offsets, n_sink=n_sink,
                                n_local=n_local, batch=batch, heads=heads)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 48, 2, dtype=torch.float32) / 48)  # partial rotary (48 of 64)
    return keys, values, layout, inv_freq


@pytest.mark.parametrize("rope", ["none", "start", "center"])
@pytest.mark.parametrize("offsets", [2, "staggered"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [4, 2, 8])
def test_equal_group_means_match_the_general_path(rope, offsets, dtype, k):
    keys, values, layout, inv_freq = _case(dtype, offsets, k=k)
    fast = naive.pool_windows(keys, values, layout, weighting="mean", rope=rope, inv_freq=inv_freq)
    flat_scores = torch.zeros(keys.shape[:3])
    general = naive.pool_windows(keys, values, layout, scores=flat_scores, weighting="score", rope=rope,
                                 inv_freq=inv_freq)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    assert torch.equal(fast.positions, general.positions)
    for got, ref in zip(fast[:2], general[:2]):
        assert got.shape == ref.shape and got.dtype == ref.dtype
        torch.testing.assert_close(got.float(), ref.float(), **tol)


@pytest.mark.parametrize("offsets", [5, "staggered"])
def test_uniform_selection_matches_a_gather(offsets):
    keys, values, layout, _ = _case(torch.float32, offsets)
    scores = torch.randn(keys.shape[:3], generator=torch.Generator().manual_seed(1))
    got = naive.select_windows(keys, values, scores, layout)
    pos = got.positions
    for x, out in ((keys, got.keys), (values, got.values)):
        assert torch.equal(out, x.gather(2, pos[..., None].expand(-1, -1, -1, x.shape[-1])))
    assert bool((pos.diff(dim=-1) > 0).all())  # entries stay sorted by position


def test_keep_and_pool_over_many_blocks_of_windows_matches_head_by_head():
    """Large inputs are merged RoPE-aware slot by slot over blocks of windows (about 4 MiB of sums each); with 32
    heads of 256 dimensions a block is 128 windows, so 150 windows take two. Each head alone is small enough for
    the dense merge (one rotated copy): the two paths must agree."""
    assert 32 * 150 * 8 * 256 > naive.DENSE_MERGE_ELEMENTS >= 150 * 8 * 256
    B, H, D, S, seq = 1, 32, 256, 8, 8 * 150 + 7
    g = torch.Generator().manual_seed(2)
    keys, values = torch.randn(B, H, seq, D, generator=g), torch.randn(B, H, seq, D, generator=g)
    layout = WindowLayout.build(seq, window=S, stride=S, k=4, offsets=3, batch=B, heads=H)
    # three raw slots in every window, chosen at random
    slots = torch.rand(B, H, layout.n_windows, S, generator=g).argsort(dim=-1)[..., :3]
    raw = torch.zeros(B, H, seq, dtype=torch.bool)
    raw.scatter_(2, (layout.window_starts()[..., None] + slots).flatten(2), True)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    whole = naive.keep_and_pool(keys, values, raw, layout, rope="start", inv_freq=inv_freq)
    one = WindowLayout.build(seq, window=S, stride=S, k=4, offsets=3, batch=B, heads=1)
    for h in (0, 17, 31):
        alone = naive.keep_and_pool(keys[:, h : h + 1], values[:, h : h + 1], raw[:, h : h + 1], one, rope="start",
                                    inv_freq=inv_freq)
        for got, ref in zip(whole, alone):
            if got is None or ref is None:  # Compressed.masked: no padding from these kernels
                assert got is None and ref is None
                continue
            torch.testing.assert_close(got[:, h : h + 1], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", ["select", "pool", "keep_and_pool", "keep_and_pool_by_slot"])
def test_fast_paths_under_autograd_give_the_same_entries_and_gradients(op, monkeypatch):
    """Fine-tuning runs the presses with gradients on: each op must stay differentiable, and its entries must be
    those of the no-grad path (``keep_and_pool_by_slot``: its merge for large inputs, forced on a small one)."""
    if op == "keep_and_pool_by_slot":
        monkeypatch.setattr(naive, "DENSE_MERGE_ELEMENTS", 0)
        op = "keep_and_pool"
    keys, values, layout, inv_freq = _case(torch.float32, 2)
    scores = torch.randn(keys.shape[:3], generator=torch.Generator().manual_seed(4))
    raw = torch.zeros(keys.shape[:3], dtype=torch.bool)
    raw.scatter_(2, (layout.window_starts()[..., None] + torch.tensor([1, 4, 6])).flatten(2), True)
    run = {"select": lambda k, v: naive.select_windows(k, v, scores, layout),
           "pool": lambda k, v: naive.pool_windows(k, v, layout, rope="start", inv_freq=inv_freq),
           "keep_and_pool": lambda k, v: naive.keep_and_pool(k, v, raw, layout, rope="start", inv_freq=inv_freq)}[op]
    with torch.no_grad():
        plain = run(keys, values)
    k, v = keys.clone().requires_grad_(True), values.clone().requires_grad_(True)
    out = run(k, v)
    (out.keys.square().sum() + out.values.sum()).backward()
    torch.testing.assert_close(out.keys.detach(), plain.keys)
    torch.testing.assert_close(out.values.detach(), plain.values)
    assert k.grad is not None and v.grad is not None and k.grad.abs().sum() > 0
    # every entry is a weighted mean of values whose weights sum to 1, so the gradient of the sum of all entries
    # sums to the number of entry elements
    torch.testing.assert_close(v.grad.sum(), torch.tensor(float(out.values.numel())))
