"""Budgets across layers spent while the prefill runs (the running top-B): exactly the choice made over every layer at
once, a cache of exactly the budget, and the prefill holding no layer's hidden states."""

from __future__ import annotations

import pytest
import torch
from kvpress import ExpectedAttentionPress, KeyDiffPress, KnormPress, SnapKVPress
from transformers import DynamicCache, QuantizedCache, pipeline

from kvpress_phase import (GlobalBudgetPress, HeadBudgetPress, LayerBudgetPress, PhaseAwarePress, cache_summary,
                           load_builtin_model)
from kvpress_phase.evaluation.tasks import generate
from kvpress_phase.presses.choice import RunningTopB, floor_keyed, spread_budget
from kvpress_phase.ragged import RaggedLayer


# ------------------------------------------------------------------------------------------------ the selector
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("floor", [0.0, 0.5])
def test_running_top_b_equals_the_choice_over_every_unit(seed, floor):
    """Units added one at a time keep exactly spread_budget's counts, ties included (scores drawn from few values)."""
    g = torch.Generator().manual_seed(seed)
    units = [torch.randint(0, 5, (3, 40), generator=g).float() for _ in range(7)]
    budgets = [12] * 7
    expected = spread_budget(units, budgets, floor)
    top = RunningTopB(sum(u.shape[0] * b for u, b in zip(units, budgets)))
    for i, (u, b) in enumerate(zip(units, budgets)):
        top.add(i, floor_keyed(u, b, floor))
    for i, counts in enumerate(expected):
        assert torch.equal(top.alive(i).sum(dim=-1), counts)
    # and the very entries: each row's best by (score, earlier token), as the press keeps them
    for i, u in enumerate(units):
        keyed = floor_keyed(u, budgets[i], floor)
        for row in range(u.shape[0]):
            n = int(expected[i][row])
            best = keyed[row].argsort(descending=True, stable=True)[:n]
            assert set(best.tolist()) == set(torch.nonzero(top.alive(i)[row]).flatten().tolist())


def test_running_top_b_shrinks_to_the_units_that_came():
    units = [torch.arange(10.0).view(1, 10), torch.arange(10.0).flip(0).view(1, 10)]
    top = RunningTopB(30)  # planned for three units
    for i, u in enumerate(units):
        top.add(i, u)
    top.finish(10)
    expected = spread_budget(units, [5, 5], 0.0)
    assert [int(top.alive(i).sum()) for i in range(2)] == [int(c) for c in expected]


def test_running_top_b_refuses_bad_input():
    with pytest.raises(ValueError, match="total"):
        RunningTopB(-1)
    top = RunningTopB(3)
    top.add(0, torch.zeros(1, 4))
    with pytest.raises(ValueError, match="added already"):
        top.add(0, torch.zeros(1, 4))
    with pytest.raises(ValueError, match="shrink"):
        top.finish(4)


# ------------------------------------------------------------------------------------------------ through a model
def _reference(model, make, ids):
    """Today's choice: every layer's prefill inputs recorded, then the budget planned over all of them at once
    (:meth:`BudgetPress.plan`, :func:`spread_budget`) and each layer compressed (the evaluation's replay)."""
    records = {}

    def record(module, args, kwargs, output):
        records[module.layer_idx] = (module, kwargs["hidden_states"], kwargs)

    layers = model.model.layers
    hooks = [layer.self_attn.register_forward_hook(record, with_kwargs=True) for layer in layers]
    cache = DynamicCache()
    with torch.inference_mode():
        model.model(input_ids=ids, past_key_values=cache)
    for hook in hooks:
        hook.remove()
    press = make()
    press.post_init_from_model(model)
    inputs = [(m, h, cache.layers[i].keys, cache.layers[i].values, None, kw) for i, (m, h, kw) in sorted(records.items())]
    with torch.inference_mode():
        press.plan(inputs)
        for module, hidden, keys, values, att, kwargs in inputs:
            press.compress(module, hidden, keys, values, att, kwargs)
            module.masked_key_indices = None
    return press.stats


def _kept(stats) -> dict:
    """layer -> per KV head, the set of kept positions (padding slots left out)."""
    out = {}
    for layer, s in stats.items():
        masked = set()
        if s.masked is not None:
            masked = set(zip(s.masked[0].tolist(), s.masked[1].tolist()))
        out[layer] = [sorted(p for j, p in enumerate(s.positions[0, h].tolist()) if (h, j) not in masked)
                      for h in range(s.positions.shape[1])]
    return out


def _streamed(model, make, ids):
    press = make()
    cache = DynamicCache()
    with torch.inference_mode(), press(model):
        model.model(input_ids=ids, past_key_values=cache)
    return press, cache


def assert_same_choice(model, make, ids):
    press, cache = _streamed(model, make, ids)
    reference = _reference(model, make, ids)
    assert _kept(press.stats) == _kept(reference)
    # the cache holds exactly the kept entries: each head its own, no padding, no slack
    for layer, s in press.stats.items():
        stored = cache.layers[layer]
        kept = [len(p) for p in _kept(press.stats)[layer]]
        if isinstance(stored, RaggedLayer):
            assert stored.head_lengths == kept and stored.capacity == sum(kept)
        else:
            assert list(stored.keys.shape[1:3]) == [len(kept), max(kept)] and len(set(kept)) == 1
    return press, cache


CASES = [
    (GlobalBudgetPress, dict(compression_ratio=0.5), 0.0),
    (GlobalBudgetPress, dict(compression_ratio=0.75), 0.0),
    (GlobalBudgetPress, dict(compression_ratio=0.25, stride=6), 0.5),
    (LayerBudgetPress, dict(compression_ratio=0.75), 0.0),
    (LayerBudgetPress, dict(compression_ratio=0.5, stride=12), 0.25),
]


@pytest.fixture(scope="module")
def builtin():
    return load_builtin_model()


@pytest.mark.parametrize("wrapper, settings, floor", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_the_streamed_budget_is_exactly_todays_choice_on_the_builtin_model(builtin, wrapper, settings, floor, seed):
    model, tokenizer = builtin
    example = generate("niah_multikey", tokenizer, n_samples=1, context_length=768, stride=8, phases=[seed + 2],
                       seed=seed)[0]
    ids = tokenizer(example["context"], return_tensors="pt").input_ids
    assert_same_choice(model, lambda: wrapper(PhaseAwarePress(**settings), floor=floor), ids)


def test_the_budget_is_exact_in_entries(builtin):
    model, tokenizer = builtin
    ids = tokenizer(generate("niah_single", tokenizer, n_samples=1, context_length=1024, stride=8, phases=[1])[0]
                    ["context"], return_tensors="pt").input_ids
    press, cache = _streamed(model, lambda: GlobalBudgetPress(PhaseAwarePress(0.75)), ids)
    even = PhaseAwarePress(0.75)
    layout = even.layout_for(model.model.layers[0].self_attn, torch.zeros(1, 2, ids.shape[1], 1))
    protected = ids.shape[1] - layout.n_windows * layout.stride
    heads = model.config.num_key_value_heads
    budget = len(model.model.layers) * heads * (layout.n_windows * layout.k + protected)
    stored = sum(layer.entries if isinstance(layer, RaggedLayer) else layer.keys.shape[1] * layer.keys.shape[2]
                 for layer in cache.layers)
    assert stored == budget


def test_recent_is_refused_by_a_budget_across_layers(builtin):
    model, tokenizer = builtin
    press = GlobalBudgetPress(PhaseAwarePress(0.5, recent=0.1))
    with pytest.raises(ValueError, match="recent"):
        with press(model):
            pass
    HeadBudgetPress(PhaseAwarePress(0.5, recent=0.1))  # within a layer it is fine


@pytest.mark.parametrize("wrapper", [GlobalBudgetPress, HeadBudgetPress])
def test_what_the_ragged_storage_cannot_do_is_refused(builtin, wrapper):
    model, tokenizer = builtin
    ids = tokenizer("a b c d " * 40, return_tensors="pt").input_ids
    with pytest.raises(ValueError, match="batch 1"):
        with torch.inference_mode(), wrapper(PhaseAwarePress(0.5))(model):
            model.model(input_ids=torch.cat([ids, ids]), past_key_values=DynamicCache())
    pytest.importorskip("optimum.quanto")
    cache = QuantizedCache(backend="quanto", config=model.config, nbits=4)
    with pytest.raises(ValueError, match="QuantizedCache"):
        with torch.inference_mode(), wrapper(PhaseAwarePress(0.5))(model):
            model.model(input_ids=ids, past_key_values=cache)


@pytest.mark.real_model
@pytest.mark.parametrize("ratio", [0.5, 0.75])
def test_the_streamed_budget_is_exactly_todays_choice_on_smollm2(ratio):
    model, tokenizer = load_builtin_model(name="smollm2")
    for seed in (0, 1):
        example = generate("niah_single", tokenizer, n_samples=1, context_length=1024, stride=8, phases=[3],
                           seed=seed)[0]
        ids = tokenizer(example["context"], return_tensors="pt").input_ids
        assert_same_choice(model, lambda: GlobalBudgetPress(PhaseAwarePress(ratio, scorer="kvzap")), ids)
    assert_same_choice(model, lambda: LayerBudgetPress(PhaseAwarePress(ratio, scorer="kvzap")), ids)


@pytest.mark.real_model
@pytest.mark.second_model
def test_the_streamed_budget_is_exactly_todays_choice_on_qwen():
    model, tokenizer = load_builtin_model(name="qwen2.5-coder-0.5b")
    for seed, ratio in ((0, 0.5), (1, 0.75)):
        example = generate("niah_multikey", tokenizer, n_samples=1, context_length=1024, stride=8, phases=[5],
                           seed=seed)[0]
        ids = tokenizer(example["context"], return_tensors="pt").input_ids
        assert_same_choice(model, lambda: GlobalBudgetPress(PhaseAwarePress(ratio, scorer="kvzap")), ids)


# ------------------------------------------------------------------------------------------------ any kvpress scorer
KVPRESS_CASES = [
    (GlobalBudgetPress, lambda: KnormPress(0.5)),
    (GlobalBudgetPress, lambda: KeyDiffPress(0.75)),
    (LayerBudgetPress, lambda: SnapKVPress(0.5)),
    (HeadBudgetPress, lambda: KnormPress(0.75)),
    (HeadBudgetPress, lambda: ExpectedAttentionPress(0.5)),
]


@pytest.mark.parametrize("wrapper, inner", KVPRESS_CASES)
def test_wrappers_take_any_kvpress_scorer(builtin, wrapper, inner):
    """A wrapper pulls a kvpress ScorerPress's scores and spends kvpress's own budget, int(n * (1 - ratio)) entries
    per row, over its heads or layers: exactly the entries, the same choice streamed through the pipeline as planned
    over every layer at once, and an answer."""
    model, tokenizer = builtin
    example = generate("niah_single", tokenizer, n_samples=1, context_length=512, stride=8, phases=[2])[0]
    ids = tokenizer(example["context"], return_tensors="pt").input_ids
    press, cache = assert_same_choice(model, lambda: wrapper(inner()), ids)
    n = ids.shape[1]
    heads, layers = model.config.num_key_value_heads, len(model.model.layers)
    stored = sum(layer.entries if isinstance(layer, RaggedLayer) else layer.keys.shape[1] * layer.keys.shape[2]
                 for layer in cache.layers)
    assert stored == layers * heads * int(n * (1 - press.compression_ratio))
    assert press.stats[0].layout is None and cache_summary(press).entries_stored == stored
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    answer = pipe(example["context"], question=example["question"], answer_prefix=example["answer_prefix"],
                  press=wrapper(inner()), max_new_tokens=4)["answer"]
    assert isinstance(answer, str) and answer
