"""The contract matrix, as kvpress's own suite runs every default press through every wrapper: every press of the
registry (ours and kvpress's) under each wrapper of ours, through kvpress's pipeline on the built-in model, either
answers or is refused with a ValueError naming what was wrong, when the wrapper is built."""

from __future__ import annotations

import gc

import pytest
from transformers import DynamicCache, pipeline

from kvpress_phase import (GlobalBudgetPress, HeadBudgetPress, LayerBudgetPress, PerLayerWindowedPress,
                           WindowedDecodingPress, load_builtin_model)
from kvpress_phase.evaluation.press_registry import REGISTRY, build_press
from kvpress_phase.evaluation.presses import parse_press_spec
from kvpress_phase.evaluation.tasks import generate

NEEDS_A_SHIPPED_SCORER = ("kvzap", "dms_kvzap", "threshold_budget")
"""Presses that read the KVzap scorer shipped for SmolLM2 and Qwen, which the built-in model has not (their pipeline
runs: tests/presses/test_learned_budgets.py, test_threshold_budget.py)."""
NAMES = [name for name in REGISTRY if name not in NEEDS_A_SHIPPED_SCORER + ("no_press",)]
WRAPPERS = {
    "HeadBudgetPress": HeadBudgetPress,
    "LayerBudgetPress": LayerBudgetPress,
    "GlobalBudgetPress": GlobalBudgetPress,
    "PerLayerWindowedPress": lambda press: PerLayerWindowedPress(press, compression_ratios={0: 0.25}),
    "WindowedDecodingPress": WindowedDecodingPress,
}


@pytest.fixture(scope="module")
def setting():
    model, tokenizer = load_builtin_model()
    example = generate("niah_single", tokenizer, n_samples=1, context_length=256, stride=8, phases=[1])[0]
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    return model, pipe, example


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
@pytest.mark.parametrize("name", NAMES)
def test_every_registered_press_under_every_wrapper_answers_or_is_refused(setting, name, wrapper):
    model, pipe, example = setting
    press = build_press(parse_press_spec(name), 0.5, 8, None, 0)
    try:
        wrapped = WRAPPERS[wrapper](press)
    except ValueError as refused:
        message = str(refused)
        assert "press" in message.lower() and len(message) > 40, message  # says what it takes
        return
    answer = pipe(example["context"], question=example["question"], answer_prefix=example["answer_prefix"],
                  press=wrapped, max_new_tokens=3, cache=DynamicCache())["answer"]
    assert isinstance(answer, str) and answer.strip()
    gc.collect()
    assert model.config._attn_implementation == "sdpa"  # whatever it switched, back once its cache is gone
