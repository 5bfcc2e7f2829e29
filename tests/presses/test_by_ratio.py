"""ByRatioPress (one of two presses by the ratio) and recommended_press, through kvpress's pipeline."""

from __future__ import annotations

import pytest
import torch
from kvpress import KnormPress
from transformers import DynamicCache, pipeline

from tiny_models import tiny_model
from kvpress_phase import ByRatioPress, GlobalBudgetPress, PhaseAwarePress, cache_summary, recommended_press
from kvpress_phase.presses.by_ratio import RECOMMENDED_SWITCH

CONTEXT = " ".join(f"w{(7 * i) % 50}" for i in range(150))


def two(ratio: float, switch: float = 0.375) -> ByRatioPress:
    return ByRatioPress(below=PhaseAwarePress(ratio), above=GlobalBudgetPress(PhaseAwarePress(ratio)), switch=switch)


@pytest.mark.parametrize("ratio, expected", [(0.0, "below"), (0.25, "below"), (0.3749, "below"), (0.375, "above"),
                                             (0.5, "above"), (0.9, "above")])
def test_the_ratio_picks_the_press(ratio, expected):
    press = two(ratio)
    assert press.chosen is getattr(press, expected)
    assert press.compression_ratio == ratio


def test_setting_the_ratio_sets_both_and_moves_the_choice():
    press = two(0.25)
    assert press.chosen is press.below
    press.compression_ratio = 0.75
    assert press.below.compression_ratio == press.above.compression_ratio == 0.75
    assert press.chosen is press.above


@pytest.mark.parametrize("make, match", [
    (lambda: ByRatioPress(below=None, above=PhaseAwarePress(0.5)), "below must be a kvpress press"),
    (lambda: ByRatioPress(below=PhaseAwarePress(0.5), above="phase_aware"), "above must be a kvpress press"),
    (lambda: ByRatioPress(below=PhaseAwarePress(0.25), above=PhaseAwarePress(0.5)), "share one compression_ratio"),
    (lambda: two(0.5, switch=0.0), "switch must be in"),
    (lambda: two(0.5, switch=1.5), "switch"),
    (lambda: recommended_press(1.0), "compression_ratio"),
])
def test_bad_input_is_refused_by_name(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("ratio", [0.25, 0.5])
def test_through_the_pipeline_it_is_the_chosen_press(tokenizer, ratio):
    """The wrapper leaves the cache and the answer that its chosen press alone leaves, and reads its stats."""
    model = tiny_model("qwen3", num_key_value_heads=2)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    results = []
    for press in (two(ratio), two(ratio).chosen):
        cache = DynamicCache()
        answer = pipe(CONTEXT, question="w1 w2", press=press, max_new_tokens=4, cache=cache)["answer"]
        results.append((press, cache, answer))
    (wrapped, cache_w, answer_w), (alone, cache_a, answer_a) = results
    assert answer_w == answer_a
    assert cache_summary(wrapped, cache_w) == cache_summary(alone, cache_a)
    assert wrapped.stats is wrapped.chosen.stats and wrapped.stats
    # the below press is dense (PhaseAwarePress); the above one stores each KV head at its own length
    assert (type(cache_w.layers[0]).__name__ == "DynamicLayer") == (ratio < 0.375)


def test_any_kvpress_press_with_a_ratio_can_be_wrapped(tokenizer):
    model = tiny_model("llama")
    press = ByRatioPress(below=KnormPress(0.25), above=PhaseAwarePress(0.25), switch=0.5)
    ids = torch.randint(4, 60, (1, 137), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model.model(input_ids=ids, past_key_values=cache)
    assert cache.layers[0].keys.shape[2] == int(137 * 0.75)  # KnormPress's count, not PhaseAwarePress's
    assert press.stats == {}


def test_recommended_press_is_the_frozen_choice():
    low, high = recommended_press(0.25, stride=12, offset=3), recommended_press(0.5, stride=12, offset=3)
    assert RECOMMENDED_SWITCH == 0.375
    assert isinstance(low.chosen, PhaseAwarePress) and low.chosen.stride == 12 and low.chosen.offset == 3
    assert type(low.chosen.scorer).__name__ == "KeyDiffScorer"
    assert isinstance(high.chosen, GlobalBudgetPress) and high.chosen.press.stride == 12
    assert type(high.chosen.press.scorer).__name__ == "LocalKVzapMLPPress"


def test_the_evaluation_runs_the_same_presses():
    """The registry's ``recommended`` is recommended_press's chosen press, at every ratio, stride and offset."""
    from kvpress_phase.evaluation.presses import build_press, parse_press_spec

    spec = parse_press_spec("recommended")
    for ratio in (0.25, 0.5, 0.75):
        built = build_press(spec, ratio, 12, None, 5)
        assert repr(built) == repr(recommended_press(ratio, stride=12, offset=5).chosen)
    with pytest.raises(ValueError, match="window"):
        build_press(spec, 0.5, 8, 16, 0)


@pytest.mark.real_model
def test_recommended_press_on_smollm2_holds_its_budget():
    """On a model that ships the MLP scorer: at 0.5 the learned global budget, stored ragged, holds
    ``PhaseAwarePress``'s bytes (the same entries, spread over heads) within the ragged index's share."""
    from kvpress_phase import load_builtin_model
    from kvpress_phase.evaluation.tasks import generate

    model, tokenizer = load_builtin_model(name="smollm2")
    example = generate("niah_single", tokenizer, n_samples=1, context_length=400, stride=8, phases=[0])[0]
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    summaries = {}
    for name, press in (("recommended", recommended_press(0.5)), ("phase_aware", PhaseAwarePress(0.5))):
        cache = DynamicCache()
        pipe(example["context"], question=example["question"], press=press, cache=cache, max_new_tokens=1)
        summaries[name] = cache_summary(press, cache)
    assert summaries["recommended"].entries_stored == summaries["phase_aware"].entries_stored
    assert summaries["recommended"].bytes_stored <= 1.05 * summaries["phase_aware"].bytes_stored
