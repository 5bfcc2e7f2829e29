"""Budget wrappers around PhaseAwarePress: one raw-token budget spread by score across layers, KV heads, or both
(``HeadBudgetPress``, ``LayerBudgetPress``, ``GlobalBudgetPress``; specs ``head_budget``, ``layer_budget``,
``global_budget``)."""

from __future__ import annotations

import pytest
import torch
from kvpress import ComposedPress, KnormPress
from transformers import DynamicCache, pipeline

from tiny_models import tiny_model
from kvpress_phase import (ChunkedStridePress, GlobalBudgetPress, HeadBudgetPress, LayerBudgetPress, PerLayerWindowedPress,
                           PhaseAwarePress, WindowedDecodingPress)
from kvpress_phase.evaluation.presses import build_press, parse_press_spec
from kvpress_phase.ragged import ATTENTION_NAME, RaggedLayer
from kvpress_phase.evaluation.replay import ReplayEngine
from kvpress_phase.evaluation.tasks import generate
from kvpress_phase.evaluation.tokenizer import build_tokenizer
from kvpress_phase.core.phase import compressed_length
from kvpress_phase.presses.choice import spread_budget

CONTEXT = " ".join(f"w{(7 * i) % 50}" for i in range(150))


# ------------------------------------------------------------------------------------------------ spread_budget
def test_spread_budget_spends_the_total_where_the_scores_are_highest():
    g = torch.Generator().manual_seed(0)
    low, high = torch.rand(2, 40, generator=g), torch.rand(1, 40, generator=g) + 1.0
    counts = spread_budget([low, high], [10, 10], floor=0.0)
    assert int(sum(c.sum() for c in counts)) == 3 * 10
    assert counts[1].tolist() == [30]  # every token of the high unit outranks the low ones: it takes the budget
    assert counts[0].tolist() == [0, 0]


@pytest.mark.parametrize("floor", [0.0, 0.25, 0.5, 1.0])
def test_spread_budget_keeps_the_floor_and_the_total(floor):
    g = torch.Generator().manual_seed(1)
    scores = [torch.rand(2, 32, generator=g) * (i + 1) for i in range(3)]
    counts = spread_budget(scores, [8, 8, 8], floor)
    assert int(sum(c.sum() for c in counts)) == 3 * 2 * 8
    for c in counts:
        assert (c >= int(floor * 8)).all() and (c <= 32).all()
    if floor == 1.0:
        assert all(c.tolist() == [8, 8] for c in counts)


def test_spread_budget_rejects_a_floor_outside_0_1():
    with pytest.raises(ValueError, match="floor"):
        spread_budget([torch.rand(1, 4)], [2], 1.5)


# ------------------------------------------------------------------------------------------------ validation
def test_phase_aware_press_has_at_most_12_init_fields():
    import dataclasses

    fields = [f.name for f in dataclasses.fields(PhaseAwarePress) if f.init]
    assert len(fields) <= 12, fields
    assert not {"allocate", "floor", "share_heads"} & set(fields)


@pytest.mark.parametrize("make, match", [
    (lambda: LayerBudgetPress(PhaseAwarePress(0.5, residual="pool")), "residual='drop'"),
    (lambda: HeadBudgetPress(PhaseAwarePress(0.5), floor=-0.1), "floor"),
    (lambda: GlobalBudgetPress(ChunkedStridePress(0.5)), "fixed per window"),
    (lambda: GlobalBudgetPress(ComposedPress([KnormPress(0.5)])), "must be a PhaseAwarePress or a kvpress ScorerPress"),
])
def test_invalid_budgets_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("spec, match", [
    ("phase_aware:allocate=model", "allocate"),
    ("phase_aware:allocate=heads:share_heads=true", "head_budget"),
    ("head_budget:share_heads=false", "no setting 'share_heads'"),
    ("phase_aware:allocate=layers:share_heads=false", "global_budget"),
    ("phase_aware:floor=0.5", "floor"),
    ("layer_budget:residual=pool", "residual='drop'"),
    ("global_budget:floor=1.5", "floor"),
])
def test_invalid_budget_specs_are_refused(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_press_spec(spec)


@pytest.mark.parametrize("spec, wrapper, floor", [
    ("phase_aware", None, None), ("head_budget:floor=1.0", HeadBudgetPress, 1.0),
    ("head_budget", HeadBudgetPress, 0.0),
    ("layer_budget:floor=0.25", LayerBudgetPress, 0.25),
    ("global_budget:floor=0.5", GlobalBudgetPress, 0.5),
])
def test_budget_specs_build_their_wrappers(spec, wrapper, floor):
    press = build_press(parse_press_spec(spec), 0.5, 8, None, 0)
    if wrapper is None:
        assert type(press) is PhaseAwarePress
        return
    assert type(press) is wrapper and press.floor == floor and type(press.press) is PhaseAwarePress


def test_wrappers_that_cannot_see_every_layer_refuse():
    for wrapper in (LayerBudgetPress, HeadBudgetPress, GlobalBudgetPress):
        with pytest.raises(ValueError, match=wrapper.__name__):
            WindowedDecodingPress(wrapper(PhaseAwarePress(0.5)))
        with pytest.raises(ValueError, match=wrapper.__name__):
            PerLayerWindowedPress(wrapper(PhaseAwarePress(0.5)), compression_ratios=[0.5, 0.5])


def test_composed_press_refuses_a_budget_across_layers(tokenizer):
    model = tiny_model("llama")
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    press = ComposedPress([LayerBudgetPress(PhaseAwarePress(0.5)), KnormPress(0.1)])
    with pytest.raises(ValueError, match="every layer's scores"):
        pipe(CONTEXT, question="w1 w2", press=press, max_new_tokens=2)


# ------------------------------------------------------------------------------------------------ in the pipeline
def _run(press, tokenizer, layers=4, kv_heads=2):
    model = tiny_model("llama", num_hidden_layers=layers, num_key_value_heads=kv_heads, seed=2)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    cache = DynamicCache()
    answer = pipe(CONTEXT, question="w1 w2", press=press, max_new_tokens=4, cache=cache)["answer"]
    n = len(tokenizer.encode(tokenizer.bos_token + CONTEXT, add_special_tokens=False))
    inner = getattr(press, "press", press)
    even = compressed_length(n, inner.stride, inner.compression_ratio, inner.n_sink, inner.n_local)
    return model, cache, answer, n, even


def test_layers_spend_the_same_total_in_uneven_layers(tokenizer):
    press = LayerBudgetPress(PhaseAwarePress(0.75))
    model, cache, answer, n, even = _run(press, tokenizer)
    lengths = [cache.layers[i].keys.shape[2] for i in range(4)]
    assert isinstance(answer, str)
    assert sum(lengths) == 4 * even  # the same number of entries over the model
    assert len(set(lengths)) > 1  # spread unevenly on this model (a model with equal scores would not be)
    assert all(press.stats[i].compressed_length == lengths[i] for i in range(4))
    assert all(getattr(layer.self_attn, "masked_key_indices", None) is None for layer in model.model.layers)


def test_a_full_floor_is_the_even_budget(tokenizer):
    _, spread, answer_spread, _, _ = _run(LayerBudgetPress(PhaseAwarePress(0.75), floor=1.0), tokenizer)
    _, even, answer_even, _, _ = _run(PhaseAwarePress(0.75), tokenizer)
    assert answer_spread == answer_even
    for a, b in zip(spread.layers, even.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize("wrapper", [HeadBudgetPress, GlobalBudgetPress])
def test_head_budgets_store_each_head_without_the_padding_of_shorter_heads(tokenizer, wrapper):
    press = wrapper(PhaseAwarePress(0.75))
    model, cache, answer, n, even = _run(press, tokenizer)
    attended = 0
    assert model.config._attn_implementation == ATTENTION_NAME
    for i, layer in enumerate(model.model.layers):
        stored = cache.layers[i].keys.shape[2]  # the dense length the press returned (its longest head)
        masked = press.stats[i].masked
        assert getattr(layer.self_attn, "masked_key_indices", None) is None
        n_masked = 0 if masked is None else masked[0].numel()
        if masked is not None:
            assert isinstance(cache.layers[i], RaggedLayer) and press.stats[i].ragged
            for h in range(2):
                seqs = masked[1][masked[0] == h]
                # a head's padding is at the end of its entries, and not stored
                assert seqs.tolist() == list(range(stored - seqs.numel(), stored))
                assert cache.layers[i].head_lengths[h] == stored - seqs.numel()
            assert press.stats[i].entries_stored == cache.layers[i].entries
        attended += 2 * stored - n_masked
    assert attended == 4 * 2 * even  # the same number of attended entries over the model and heads
    if wrapper is HeadBudgetPress:
        assert all(cache.layers[i].keys.shape[2] >= even for i in range(4))


def test_head_budgets_without_a_floor_can_starve_a_head_but_keep_its_protected_tokens(tokenizer):
    press = HeadBudgetPress(PhaseAwarePress(0.75, n_sink=4, n_local=16))
    model, cache, _, n, _ = _run(press, tokenizer)
    for i in range(4):
        stored = cache.layers[i].keys.shape[2]
        masked = press.stats[i].masked
        for h in range(2):
            n_masked = 0 if masked is None else int((masked[0] == h).sum())
            assert stored - n_masked >= 4 + 16


# ------------------------------------------------------------------------------------------------ one score per layer
def _counting(scorer, calls):
    """``scorer`` whose ``score`` appends the layer it scores to ``calls``."""
    original = scorer.score

    def score(module, *args):
        calls.append(module.layer_idx)
        return original(module, *args)

    scorer.score = score
    return scorer


@pytest.mark.parametrize("wrapper", [None, HeadBudgetPress, LayerBudgetPress, GlobalBudgetPress])
def test_the_scorer_runs_once_per_layer_per_prefill(tokenizer, wrapper):
    # a budget across layers plans from every layer's scores and compresses with the same scores, not new ones
    calls = []
    inner = PhaseAwarePress(0.75, scorer=_counting(KnormPress(), calls))
    press = inner if wrapper is None else wrapper(inner)
    _run(press, tokenizer)
    assert sorted(calls) == [0, 1, 2, 3]
    calls.clear()
    word_tokenizer = build_tokenizer()
    model = tiny_model("llama", vocab_size=len(word_tokenizer), seed=3, num_hidden_layers=3)
    engine = ReplayEngine(model, word_tokenizer)
    state = engine.prefill(engine.encode(CONTEXT, ["w1"], "")["context_ids"])
    engine.compressed_cache(state, press)
    assert sorted(calls) == [0, 1, 2]


# ------------------------------------------------------------------------------------------------ replay
@pytest.mark.parametrize("spec", ["layer_budget:floor=0.25", "head_budget", "global_budget:floor=0.25"])
def test_replay_gives_the_pipeline_answers(spec):
    word_tokenizer = build_tokenizer()
    model = tiny_model("llama", vocab_size=len(word_tokenizer), seed=3, num_hidden_layers=3)  # kvpress finds
    # fake keys for its masks on this one (its hyperplane search can fail on random qk-normed models)
    rows = generate("niah_single", word_tokenizer, n_samples=2, context_length=200, stride=8, phases=[1, 6],
                    protocol="offset", seed=5)
    engine = ReplayEngine(model, word_tokenizer, step_by_step=True)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=word_tokenizer, device="cpu")
    parsed = parse_press_spec(spec)
    for row in rows:
        encoded = engine.encode(row["context"], [row["question"]], row["answer_prefix"])
        state = engine.prefill(encoded["context_ids"])
        press_a, press_b = (build_press(parsed, 0.75, 8, None, 0) for _ in range(2))
        replayed = engine.answer_many(state, [press_a], encoded["questions_ids"][0], 6, batch_size=1)[0]
        cache = DynamicCache()
        direct = pipe(row["context"], question=row["question"], answer_prefix=row["answer_prefix"], press=press_b,
                      max_new_tokens=6, cache=cache)["answer"]
        assert replayed["prediction"] == direct
        replay_cache = engine.compressed_cache(state, press_a)
        assert [layer.keys.shape for layer in replay_cache.layers] == [layer.keys.shape for layer in cache.layers]
        total = sum(2 * layer.keys.shape[2] for layer in replay_cache.layers)
        masks = engine.masks(state, press_a) or {}
        attended = total - sum(h.numel() for h, _ in masks.values())
        assert replayed["cache_length"] == pytest.approx(attended / (2 * len(replay_cache.layers)))


# ------------------------------------------------------------------------------------------------ the mask patch
def test_align_mask_cuts_or_extends_visible_columns_only():
    from kvpress_phase.ragged.attention import align_mask

    causal = torch.tensor([[0.0, 0.0, float("-inf")], [0.0, 0.0, 0.0]])[None, None]  # 1 context entry, 2 queries
    wider = torch.cat([torch.zeros(1, 1, 2, 3), causal], dim=-1)
    assert torch.equal(align_mask(wider, 3), causal)
    assert torch.equal(align_mask(causal, 6), wider)
    boolean = causal == 0
    assert torch.equal(align_mask(boolean, 5), torch.cat([torch.ones(1, 1, 2, 2, dtype=torch.bool), boolean], -1))
    padded = wider.clone()
    padded[..., 0] = float("-inf")
    with pytest.raises(ValueError, match="padded"):
        align_mask(padded, 3)


def test_per_layer_ratios_answer_questions_of_several_tokens(tokenizer):
    # transformers sizes the question's mask by the first layer's cache; the patch aligns it in the others
    model = tiny_model("llama", num_hidden_layers=3)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    press = PerLayerWindowedPress(PhaseAwarePress(0.25), [0.0, 0.5, 0.75])
    assert isinstance(pipe(CONTEXT, question="w1 w2 w3", press=press, max_new_tokens=2)["answer"], str)
