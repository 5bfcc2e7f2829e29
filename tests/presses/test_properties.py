"""Property tests of the window layout and of both presses on raw key/value tensors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from kvpress import KnormPress

from tiny_models import HEAD_DIM, INV_FREQ, FakeAttention
from kvpress_phase import ChunkedStridePress, HeadBudgetPress, PhaseAwarePress, StaggeredWindowPress
from kvpress_phase.core.phase import compressed_length, group_bounds, kept_per_window, merge_period, phase_of
from kvpress_phase.core.rope import rotate


settings.register_profile("kvpress_phase", max_examples=60, deadline=None)
settings.load_profile("kvpress_phase")

layouts = st.fixed_dictionaries(
    {
        "stride": st.integers(2, 16),  # stride 1 with a positive ratio is refused (tests/presses/test_validation.py)
        "extra_window": st.integers(0, 16),
        "offset": st.integers(0, 40),
        "n_sink": st.integers(0, 6),
        "n_local": st.integers(0, 20),
        "compression_ratio": st.floats(0.01, 0.95),
        "seq_len": st.integers(1, 160),
        "heads": st.integers(1, 4),
        "batch": st.integers(1, 2),
    }
)


def _press(cls, p, mode, **kw):
    window = p["stride"] + p["extra_window"] if mode == "pool" else p["stride"]
    if cls is StaggeredWindowPress:  # the window budgets (their grids are what these properties are about)
        kw.setdefault("overlap", window > p["stride"])
        kw.setdefault("scorer", KnormPress())
    return cls(
        p["compression_ratio"], window=window, stride=p["stride"], offset=p["offset"], n_sink=p["n_sink"],
        n_local=p["n_local"], mode=mode, **kw,
    )


def _kv(p, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (p["batch"], p["heads"], p["seq_len"], HEAD_DIM)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


@given(p=layouts, mode=st.sampled_from(["select", "pool"]))
def test_compressed_length_formula(p, mode):
    keys, values = _kv(p)
    S, r = p["stride"], p["compression_ratio"]
    k = kept_per_window(S, r)
    span = max(0, p["seq_len"] - p["n_sink"] - p["n_local"])
    n_windows = max(0, (span - S + 1) // S)
    expected = p["seq_len"] - n_windows * (S - k)
    assert expected == compressed_length(p["seq_len"], S, r, p["n_sink"], p["n_local"])
    lengths = set()
    row = PhaseAwarePress(p["compression_ratio"], stride=p["stride"], offset=p["offset"], n_sink=p["n_sink"],
                          n_local=p["n_local"], scorer=KnormPress())
    for press in (_press(ChunkedStridePress, p, mode, rope="start"), _press(StaggeredWindowPress, p, mode, rope="start"),
                  row):
        out_k, out_v = press.compress(FakeAttention(), None, keys, values, None, {})
        assert out_k.shape == out_v.shape == (p["batch"], p["heads"], expected, HEAD_DIM)
        lengths.add(out_k.shape[2])
        stats = press.stats[0]
        assert stats.compressed_length == expected
        assert stats.achieved_ratio == pytest.approx(1 - expected / p["seq_len"])
    assert len(lengths) == 1  # the others keep exactly as many entries as ChunkedStridePress


@given(p=layouts, mode=st.sampled_from(["select", "pool"]), align=st.booleans(),
       stagger=st.sampled_from(["none", "head", "layer", "head_layer"]))
def test_staggered_grids_keep_as_many_entries_as_chunked(p, mode, align, stagger):
    keys, values = _kv(p)
    chunked = _press(ChunkedStridePress, p, mode, rope="none")
    aware = _press(StaggeredWindowPress, p, mode, rope="none", align=align, stagger=stagger)
    layer = FakeAttention(layer_idx=3)
    assert (chunked.compress(layer, None, keys, values, None, {})[0].shape
            == aware.compress(layer, None, keys, values, None, {})[0].shape)


@given(p=layouts, mode=st.sampled_from(["select", "pool"]))
def test_zero_ratio_returns_the_cache_unchanged(p, mode):
    keys, values = _kv(p)
    p = dict(p, compression_ratio=0.0)
    for press in (_press(ChunkedStridePress, p, mode), _press(StaggeredWindowPress, p, mode),
                  PhaseAwarePress(0.0, stride=p["stride"], offset=p["offset"])):
        out_k, out_v = press.compress(FakeAttention(), None, keys, values, None, {})
        assert out_k is keys and out_v is values


@given(p=layouts, weighting=st.sampled_from(["mean", "score"]), rope=st.sampled_from(["none", "start", "center", "centroid"]))
def test_pooling_identical_tokens_returns_that_token(p, weighting, rope):
    """A window of one repeated token pools to that token (rotated at the representative position)."""
    g = torch.Generator().manual_seed(1)
    base_k = torch.randn(p["batch"], p["heads"], 1, HEAD_DIM, generator=g)
    base_v = torch.randn(p["batch"], p["heads"], 1, HEAD_DIM, generator=g)
    n = p["seq_len"]
    positions = torch.arange(n)
    # the same content at every position: rotated keys when RoPE is modelled, identical keys otherwise
    keys = rotate(base_k.expand(-1, -1, n, -1), positions, INV_FREQ) if rope != "none" else base_k.expand(-1, -1, n, -1)
    values = base_v.expand(-1, -1, n, -1).contiguous()
    press = _press(ChunkedStridePress, p, "pool", weighting=weighting, rope=rope)
    out_k, out_v = press.compress(FakeAttention(), None, keys.contiguous(), values, None, {})
    torch.testing.assert_close(out_v, base_v.expand_as(out_v), rtol=1e-5, atol=1e-5)
    if rope == "none":
        torch.testing.assert_close(out_k, base_k.expand_as(out_k), rtol=1e-5, atol=1e-5)
    elif rope in ("start",) or press.stats[0].positions is None:
        # raw entries and start-rotated entries sit exactly at their recorded positions
        pos = press.stats[0].positions.long() if press.stats[0].positions is not None else positions.expand(
            p["batch"], p["heads"], n)
        torch.testing.assert_close(out_k, rotate(base_k, pos, INV_FREQ), rtol=1e-4, atol=1e-4)
    else:
        # a merged key is the base key rotated somewhere: un-rotating any entry keeps its norm
        torch.testing.assert_close(out_k.norm(dim=-1), base_k.norm(dim=-1).expand(-1, -1, out_k.shape[2]),
                                   rtol=1e-4, atol=1e-4)


@given(positions=st.lists(st.floats(-5000, 5000, allow_nan=False), min_size=1, max_size=20),
       half=st.integers(1, HEAD_DIM // 2))
def test_unrotate_then_rotate_is_identity(positions, half):
    x = torch.randn(len(positions), HEAD_DIM, generator=torch.Generator().manual_seed(2))
    pos = torch.tensor(positions)
    inv = INV_FREQ[:half]  # partial rotary
    back = rotate(rotate(x, pos, inv), -pos, inv)
    torch.testing.assert_close(back, x, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rotate(x, pos, inv)[:, 2 * half:], x[:, 2 * half:])


@given(p=layouts, stagger=st.sampled_from(["none", "head"]))
def test_phase_of_every_kept_entry(p, stagger):
    """Selected entries are real tokens: their recorded positions find them, and their phases are right."""
    keys, values = _kv(p, seed=3)
    for press in (_press(ChunkedStridePress, p, "select"), _press(StaggeredWindowPress, p, "select", stagger=stagger)):
        out_k, out_v = press.compress(FakeAttention(), None, keys, values, None, {})
        stats = press.stats[0]
        if stats.positions is None:
            continue
        pos = stats.positions.long()
        assert (pos.diff(dim=-1) > 0).all()  # sorted, no duplicates
        torch.testing.assert_close(out_k, keys.gather(2, pos[..., None].expand(-1, -1, -1, HEAD_DIM)))
        torch.testing.assert_close(out_v, values.gather(2, pos[..., None].expand(-1, -1, -1, HEAD_DIM)))
        offsets = stats.layout.offsets
        assert torch.equal(stats.phases, phase_of(pos, p["stride"], offsets[..., None]))


@given(stride=st.integers(2, 16), heads=st.integers(2, 16), offset=st.integers(0, 30), token=st.integers(0, 500))
def test_staggered_offsets_give_each_head_a_different_phase(stride, heads, offset, token):
    press = StaggeredWindowPress(0.5, stride=stride, offset=offset, stagger="head", spread="stride", align=False)
    offsets = press.grid_offsets(FakeAttention(), None, 1, heads, 1000)[0]
    phases = phase_of(torch.tensor(token), stride, offsets)
    assert len(set(phases.tolist())) == min(heads, stride)


@given(stride=st.sampled_from([2, 4, 8, 16]), ratio=st.floats(0.0, 0.95), heads=st.integers(1, 8),
       token=st.integers(0, 500))
def test_period_spread_gives_each_head_a_different_phase_within_the_merge_period(stride, ratio, heads, token):
    """Offsets one merge period apart merge the same phases, so the spread covers one period, evenly."""
    press = StaggeredWindowPress(ratio, stride=stride, stagger="head", align=False)
    period = merge_period(stride, kept_per_window(stride, ratio))
    offsets = press.grid_offsets(FakeAttention(), None, 1, heads, 1000)[0]
    phases = phase_of(torch.tensor(token), stride, offsets) % period
    assert len(set(phases.tolist())) == min(heads, period)


@given(stride=st.integers(1, 32), data=st.data())
def test_merge_period_is_the_smallest_shift_that_preserves_the_groups(stride, data):
    k = data.draw(st.integers(1, stride))
    period = merge_period(stride, k)
    starts = set(group_bounds(stride, stride, k)[0])
    shifted = lambda p: {(b + p) % stride for b in starts}  # noqa: E731
    assert stride % period == 0 and shifted(period) == starts
    assert all(shifted(p) != starts for p in range(1, period) if stride % p == 0)


def test_layer_stagger_differs_across_layers():
    press = StaggeredWindowPress(0.125, stride=8, stagger="layer", align=False)  # k = 7: the merge pattern's period is the stride
    press.n_layers = 8
    first = {int(press.grid_offsets(FakeAttention(layer), None, 1, 2, 100)[0, 0]) for layer in range(8)}
    assert first == set(range(8))


def test_alignment_avoids_cutting_a_high_scoring_span():
    """A boundary-aware grid does not split the one important span of the sequence."""
    press = StaggeredWindowPress(0.5, stride=8, stagger="none", align=True, n_sink=0, n_local=0,
                            scorer=KnormPress())
    scores = torch.zeros(1, 2, 64)
    scores[..., 21:27] = 1.0  # important span: positions 21..26
    offset = int(press.aligned_offsets(scores)[0])
    boundaries = {b for b in range(1, 64) if phase_of(b, 8, offset) == 0}
    assert not boundaries & set(range(22, 27))


# ---------------------------------------------------------------------------------------------- content budget
row_layouts = st.fixed_dictionaries(
    {
        "stride": st.integers(2, 16),
        "pool_windows": st.integers(1, 5),
        "offset": st.integers(0, 40),
        "n_sink": st.integers(0, 6),
        "n_local": st.integers(0, 20),
        "compression_ratio": st.floats(0.01, 0.95),
        "seq_len": st.integers(1, 200),
        "heads": st.integers(1, 4),
        "batch": st.integers(1, 2),
    }
)


def _row_press(p, **kw):
    kw.setdefault("pool_window", p["stride"] * p["pool_windows"])
    kw.setdefault("scorer", KnormPress())  # the fake layer has no projections for SnapKV
    return PhaseAwarePress(p["compression_ratio"], stride=p["stride"], offset=p["offset"], n_sink=p["n_sink"],
                           n_local=p["n_local"], **kw)


@given(p=row_layouts, residual=st.sampled_from(["pool", "drop"]), share=st.booleans(),
       rope=st.sampled_from(["none", "start", "centroid"]))
def test_row_budget_keeps_exactly_chunked_strides_cache_length(p, residual, share, rope):
    keys, values = _kv(p)
    assume(share or residual == "drop")  # each KV head its own tokens: HeadBudgetPress, raw tokens only
    press = _row_press(p, residual=residual, rope=rope)
    press = press if share else HeadBudgetPress(press, floor=1.0)
    out_k, out_v = press.compress(FakeAttention(), None, keys, values, None, {})
    expected = compressed_length(p["seq_len"], p["stride"], p["compression_ratio"], p["n_sink"], p["n_local"])
    assert out_k.shape == out_v.shape == (p["batch"], p["heads"], expected, HEAD_DIM)
    stats = press.stats[0]
    if stats.positions is not None:
        starts, ends = stats.positions.long(), stats.ends.long()
        assert bool((starts[..., 1:] > starts[..., :-1]).all())  # entries stay in position order
        assert bool((ends > starts).all()) and int(ends.max()) <= p["seq_len"]


@given(p=row_layouts, share=st.booleans())
def test_row_budget_keeps_the_best_tokens_untouched(p, share):
    """Entries that cover one token are that token (bit for bit when kept raw; a pooled window left with a single
    member is un-rotated and re-rotated, so up to rounding); with share_heads every head keeps the same ones; the
    protected first and last tokens are always among them."""
    keys, values = _kv(p)
    press = _row_press(p, rope="start")
    press = press if share else HeadBudgetPress(press, floor=1.0)
    out_k, out_v = press.compress(FakeAttention(), None, keys, values, None, {})
    stats = press.stats[0]
    if stats.positions is None:
        return
    starts, ends = stats.positions.long(), stats.ends.long()
    single = ends == starts + 1
    idx = starts.clamp(max=p["seq_len"] - 1)[..., None].expand(-1, -1, -1, HEAD_DIM)
    torch.testing.assert_close(out_k[single], keys.gather(2, idx)[single], rtol=1e-5, atol=1e-5)
    assert torch.equal(out_v[single], values.gather(2, idx)[single])
    kept = {int(t) for t in starts[0, 0][single[0, 0]]}
    protected = set(range(p["n_sink"])) | set(range(p["seq_len"] - p["n_local"], p["seq_len"]))
    assert protected <= kept
    if share:
        assert bool((starts == starts[:, :1]).all())


def test_row_budget_follows_the_scores_not_the_grid():
    """A high-scoring span is kept raw wherever it falls relative to the windows: moving the grid moves only the
    pooled leftovers."""
    seq, stride = 160, 8
    keys = torch.randn(1, 2, seq, HEAD_DIM, generator=torch.Generator().manual_seed(0))
    values = torch.randn_like(keys)
    scores = torch.rand(1, 2, seq, generator=torch.Generator().manual_seed(1))
    scores[..., 70:75] += 10.0  # the "needle"

    class Scorer(KnormPress):
        def score(self, *args, **kwargs):
            return scores

    kept = []
    for offset in range(stride):
        press = PhaseAwarePress(0.75, stride=stride, offset=offset, scorer=Scorer(), rope="none")
        press.compress(FakeAttention(), None, keys, values, None, {})
        stats = press.stats[0]
        single = (stats.ends == stats.positions + 1)[0, 0]
        kept.append({int(t) for t in stats.positions[0, 0][single]})
    for k in kept:
        assert set(range(70, 75)) <= k


def test_window_topk_keeps_as_many_raw_tokens_in_every_window():
    seq, stride, ratio = 120, 8, 0.5
    keys = torch.randn(1, 1, seq, HEAD_DIM, generator=torch.Generator().manual_seed(2))
    press = StaggeredWindowPress(ratio, stride=stride, budget="window_topk", align=False, stagger="none", rope="none",
                            scorer=KnormPress(), residual="pool")
    press.compress(FakeAttention(), None, keys, keys.clone(), None, {})
    stats = press.stats[0]
    layout = stats.layout
    single = (stats.ends == stats.positions + 1)[0, 0]
    raw = stats.positions[0, 0][single].long()
    inside = raw[(raw >= int(layout.first[0, 0])) & (raw < int(layout.first[0, 0]) + layout.n_windows * stride)]
    per_window = torch.bincount((inside - int(layout.first[0, 0])) // stride, minlength=layout.n_windows)
    assert bool((per_window == layout.k - 1).all())
