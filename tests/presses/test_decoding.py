"""WindowedDecodingPress: generated tokens are compressed on the prefill's grid, and the cache follows
compressed_length."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from kvpress import ComposedPress, KnormPress, PrefillDecodingPress, SnapKVPress
from transformers import DynamicCache, pipeline

from tiny_models import HEAD_DIM, FakeAttention, tiny_model
from kvpress_phase import ChunkedStridePress, PhaseAwarePress, StaggeredWindowPress, WindowedDecodingPress
from kvpress_phase.presses.scorers import SnapKVScorer
from kvpress_phase.core.phase import compressed_length, group_bounds
from kvpress_phase.presses import decoding

CONTEXT = " ".join(f"w{(7 * i) % 50}" for i in range(150))


def _window(ratio, **kw):
    """Per-window budgets on staggered grids (PhaseAwarePress's earlier default), scored by key norm."""
    return WindowedDecodingPress(StaggeredWindowPress(ratio, scorer=KnormPress(), **kw))


# presses whose grid does not depend on the content, so decoding must reproduce a prefill of the whole sequence
FIXED_GRID = {
    "chunked_pool": lambda: WindowedDecodingPress(ChunkedStridePress(0.5, mode="pool")),
    "chunked_select": lambda: WindowedDecodingPress(ChunkedStridePress(0.5, mode="select", scorer=KnormPress())),
    "chunked_pool_offset_score": lambda: WindowedDecodingPress(ChunkedStridePress(
        0.75, offset=5, mode="pool", weighting="score", rope="centroid", scorer=KnormPress())),
    "staggered_pool": lambda: _window(0.5, align=False),
    "staggered_select": lambda: _window(0.5, mode="select", align=False),
    "staggered_overlap": lambda: _window(0.75, overlap=True, align=False, offset=3),
    "staggered_head_layer": lambda: _window(0.625, stagger="head_layer", align=False),
}
TRITON = {  # the Triton kernels on the decoding layouts (on the CPU through TRITON_INTERPRET=1, see conftest.py)
    "chunked_pool_triton": lambda: WindowedDecodingPress(ChunkedStridePress(0.5, mode="pool", backend="triton")),
    "staggered_select_triton": lambda: _window(0.5, mode="select", align=False, backend="triton"),
}
PIPELINE_PRESSES = {
    "chunked_pool": lambda: WindowedDecodingPress(ChunkedStridePress(0.5, mode="pool")),
    "chunked_select": lambda: WindowedDecodingPress(ChunkedStridePress(0.75, mode="select")),
    "chunked_default": lambda: WindowedDecodingPress(ChunkedStridePress(0.5)),
    "phase_aware_pool": lambda: WindowedDecodingPress(PhaseAwarePress(0.5, residual="pool", scorer=SnapKVScorer())),
    "phase_aware_default": lambda: WindowedDecodingPress(PhaseAwarePress(0.5)),
    "staggered_select": lambda: WindowedDecodingPress(StaggeredWindowPress(0.5, mode="select")),
    "phase_aware_recent": lambda: WindowedDecodingPress(PhaseAwarePress(0.5, recent=0.25)),
    "staggered_window_topk": lambda: WindowedDecodingPress(StaggeredWindowPress(0.75, budget="window_topk")),
}


def _decode_by_hand(press, keys, values, n0, step_sizes, module):
    """Prefill ``n0`` tokens with ``press``, then append the rest ``step_sizes`` tokens at a time as decoding does."""
    k, v = press.compress(module, None, keys[:, :, :n0], values[:, :, :n0], None, {})
    state = press.decoding_state[module.layer_idx]
    t, i = n0, 0
    lengths = []
    while t < keys.shape[2]:
        q = min(step_sizes[i % len(step_sizes)], keys.shape[2] - t)
        k = torch.cat((k, keys[:, :, t : t + q]), dim=2)
        v = torch.cat((v, values[:, :, t : t + q]), dim=2)
        due = decoding.blocks_due(state, k.shape[2])
        if due > 0:
            k, v = decoding.compress_blocks(press.windowed, module, state, k, v, due)
        else:
            state.cache_len = k.shape[2]
        t, i = t + q, i + 1
        lengths.append((t, k.shape[2]))
    return k, v, lengths


def _check_equals_whole_prefill(make, steps, n=260):
    module = FakeAttention(layer_idx=1)
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 4, n, HEAD_DIM, generator=g), torch.randn(2, 4, n, HEAD_DIM, generator=g)
    press = make()
    k, v, lengths = _decode_by_hand(press, keys, values, 90, steps, module)
    full = make()
    fk, fv = full.compress(module, None, keys, values, None, {})
    assert torch.allclose(k, fk, atol=1e-6) and torch.allclose(v, fv, atol=1e-6)
    positions, ends = decoding.entry_positions(press, 1, k.shape[2])
    assert torch.equal(positions, full.stats[1].positions) and torch.equal(ends, full.stats[1].ends)
    for n, cache_len in lengths:  # the length rule after every step
        assert cache_len == compressed_length(n, press.stride, press.compression_ratio, press.n_sink, press.n_local)


@pytest.mark.parametrize("steps", [[1], [5, 1, 13]], ids=["one_token", "mixed"])
@pytest.mark.parametrize("name", sorted(FIXED_GRID))
def test_decoding_equals_a_prefill_of_the_whole_sequence(name, steps):
    _check_equals_whole_prefill(FIXED_GRID[name], steps)


@pytest.mark.triton
@pytest.mark.parametrize("name", sorted(TRITON))
def test_decoding_with_the_triton_kernels(name):
    pytest.importorskip("triton")
    from kvpress_phase.kernels import triton_available

    if not triton_available():
        pytest.skip("Triton kernels cannot be imported here")
    _check_equals_whole_prefill(TRITON[name], [16, 1], n=140)


def test_aligned_per_head_grids_continue_each_row_own_grid():
    module = FakeAttention()
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(3, 4, 300, HEAD_DIM, generator=g)
    press = _window(0.5)  # aligned, staggered per head: rows differ
    k, _, _ = _decode_by_hand(press, keys, keys.clone(), 100, [1], module)
    state = press.decoding_state[0]
    assert len(set(state.first.flatten().tolist())) > 1
    positions, ends = decoding.entry_positions(press, 0, k.shape[2])
    lo, _ = group_bounds(press.stride, press.stride, press.windowed.k)
    pooled = ends - positions > 1  # merged entries
    rel = (positions.long() - state.first[..., None]) % press.stride
    assert pooled.any() and bool(torch.isin(rel[pooled], torch.tensor(lo)).all())
    # every entry from the prefill's raw tail on was compressed during decoding, on the row's own grid
    starts = positions.long()[pooled & (positions >= 100)]
    assert starts.numel() > 0


def _record_decoding(monkeypatch):
    """Wrap decoding.decode_step: record every step's lengths and check the local window is left untouched."""
    records = []
    raw = {}

    def wrapped(press, module, kwargs, output):
        cache, layer_idx = kwargs["past_key_values"], module.layer_idx
        q = kwargs["hidden_states"].shape[1]
        keys, _ = decoding.read_layer(cache, layer_idx)
        raw[layer_idx] = torch.cat((raw.get(layer_idx, keys[:, :, :0]), keys[:, :, -q:].clone()), dim=2)
        out = original(press, module, kwargs, output)
        keys, _ = decoding.read_layer(cache, layer_idx)
        state = press.decoding_state[layer_idx]
        w = min(press.n_local, raw[layer_idx].shape[2])
        local_untouched = torch.equal(keys[:, :, keys.shape[2] - w :], raw[layer_idx][:, :, -w:])
        records.append((layer_idx, state.seen, cache.layers[layer_idx].get_seq_length(), local_untouched))
        return out

    original = decoding.decode_step
    monkeypatch.setattr(decoding, "decode_step", wrapped)
    return records


def _pipe(model, tokenizer):
    model.generation_config.eos_token_id = None  # generate max_new_tokens tokens
    return pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")


@pytest.mark.parametrize("name", sorted(PIPELINE_PRESSES))
def test_pipeline_length_rule_over_hundreds_of_generated_tokens(name, tokenizer, monkeypatch):
    records = _record_decoding(monkeypatch)
    model = tiny_model("llama")
    press = PIPELINE_PRESSES[name]()
    question = " ".join(f"w{i}" for i in range(1, 20))
    out = _pipe(model, tokenizer)(CONTEXT, question=question, press=press, max_new_tokens=300)
    assert isinstance(out["answer"], str)
    n_context = len(tokenizer.encode(tokenizer.bos_token + CONTEXT, add_special_tokens=False))
    n_question = len(tokenizer.encode(question + "\n", add_special_tokens=False))
    S = press.stride
    for layer_idx in range(model.config.num_hidden_layers):
        steps = [r for r in records if r[0] == layer_idx]
        assert len(steps) == 300  # the question's forward pass, then 299 generated tokens
        assert steps[0][1] == n_context + n_question and steps[-1][1] == n_context + n_question + 299
        for _, n, cache_len, local_untouched in steps:
            expected = compressed_length(n, S, press.compression_ratio, press.n_sink, press.n_local)
            assert expected <= cache_len <= expected + S - 1
            assert cache_len == expected  # the exact rule
            assert local_untouched
        assert press.decoding_state[layer_idx].blocks > 30  # blocks of generated tokens were compressed
    assert steps[-1][2] < n_context + n_question + 299 - 100


def test_without_decoding_generated_tokens_stay_raw(tokenizer, monkeypatch):
    model = tiny_model("llama")
    press = ChunkedStridePress(0.5)
    assert not isinstance(press, PrefillDecodingPress)
    cache = DynamicCache()
    seen = []
    hook = model.model.layers[0].self_attn.register_forward_hook(
        lambda m, a, kw, out: seen.append(kw["past_key_values"].get_seq_length(0)), with_kwargs=True)
    try:
        _pipe(model, tokenizer)(CONTEXT, question="w1", press=press, max_new_tokens=40, cache=cache)
    finally:
        hook.remove()
    assert seen[-1] == seen[1] + len(seen) - 2  # grows by one per generated token


def test_the_decoding_wrapper_is_a_pipeline_decoding_press():
    press = WindowedDecodingPress(ChunkedStridePress(0.5))
    assert isinstance(press, PrefillDecodingPress) and not isinstance(ChunkedStridePress(0.5), PrefillDecodingPress)
    assert repr(press).startswith("WindowedDecodingPress(press=ChunkedStridePress(")
    assert pickle.loads(pickle.dumps(press)) == press and copy.deepcopy(press) == press
    assert (press.stride, press.compression_ratio, press.n_sink, press.n_local) == (8, 0.5, 4, 16)
    assert type(press.press) is ChunkedStridePress  # no class is changed or generated
    with pytest.raises(ValueError, match="press must be a ChunkedStridePress"):
        WindowedDecodingPress(KnormPress(0.5))
    with pytest.raises(ValueError, match="whole context"):
        WindowedDecodingPress(PhaseAwarePress(0.5, scorer="kvzip"))
    with pytest.raises(TypeError, match="decoding"):
        ChunkedStridePress(0.5, decoding=True)


def test_pipeline_refuses_several_questions_with_decoding(tokenizer):
    pipe = _pipe(tiny_model("llama"), tokenizer)
    with pytest.raises(ValueError, match="multiple questions"):
        pipe(CONTEXT, questions=["w1", "w2"], press=WindowedDecodingPress(ChunkedStridePress(0.5)), max_new_tokens=2)


def test_decoding_without_this_press_prefill_is_refused(tokenizer):
    press = PrefillDecodingPress(prefilling_press=KnormPress(0.5),
                                 decoding_press=WindowedDecodingPress(ChunkedStridePress(0.5)))
    with pytest.raises(ValueError, match="not prefilled by this press"):
        _pipe(tiny_model("llama"), tokenizer)(CONTEXT, question="w1", press=press, max_new_tokens=20)


def test_decoding_refuses_a_press_that_changed_the_cache_after_it():
    model = tiny_model("llama")
    press = ComposedPress([WindowedDecodingPress(ChunkedStridePress(0.5)), KnormPress(0.5)])
    ids = torch.randint(4, 60, (1, 120), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), press(model), pytest.raises(ValueError, match="last to change the cache"):
        model.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=0)


def test_scorer_that_cannot_score_while_decoding_names_itself(tokenizer):
    press = WindowedDecodingPress(ChunkedStridePress(0.5, mode="select", scorer=SnapKVPress(window_size=4)))
    with pytest.raises(ValueError, match="scorer=SnapKVPress"):
        _pipe(tiny_model("llama"), tokenizer)(CONTEXT, question="w1", press=press, max_new_tokens=40)


def test_kvpress_prefill_decoding_press_with_ours_on_both_sides(tokenizer):
    ours = WindowedDecodingPress(PhaseAwarePress(0.5))
    press = PrefillDecodingPress(prefilling_press=ours, decoding_press=ours)
    _pipe(tiny_model("llama"), tokenizer)(CONTEXT, question="w1", press=press, max_new_tokens=80)
    state = ours.decoding_state[0]
    assert state.seen > _context_len(tokenizer) + 78
    assert state.cache_len == compressed_length(state.seen, 8, 0.5)


def _context_len(tokenizer) -> int:
    return len(tokenizer.encode(tokenizer.bos_token + CONTEXT, add_special_tokens=False))
