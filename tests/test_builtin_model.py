"""The shipped model loads offline and retrieves a fact through the kvpress pipeline."""

from __future__ import annotations

import os

import kvpress  # noqa: F401  (registers the kv-press-text-generation pipeline)
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

from kvpress_phase import builtin_model_path, load_builtin_model
from kvpress_phase.evaluation.tasks import generate, score


def test_files_and_size():
    path = builtin_model_path()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert os.path.isfile(os.path.join(path, name)), name
    assert os.path.getsize(os.path.join(path, "model.safetensors")) <= 20 * 1024 * 1024


def test_loads_with_auto_classes_offline():
    path = builtin_model_path()
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert model.config.model_type in ("qwen3", "llama")
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped-query attention


def test_answers_held_out_needles_through_the_pipeline():
    model, tokenizer = load_builtin_model()
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    # evaluation seeds are disjoint from the training data's
    rows = generate("niah_single", tokenizer, n_samples=4, context_length=512, stride=8, phases=[0, 5], seed=424242)
    correct = []
    for row in rows:
        answer = pipe(row["context"], question=row["question"], answer_prefix=row["answer_prefix"],
                      max_new_tokens=row["max_new_tokens"])["answer"]
        correct.append(score(answer, row["answer"], "niah_single"))
    assert sum(correct) == len(correct), correct


def test_pipeline_by_path():
    pipe = pipeline("kv-press-text-generation", model=builtin_model_path(), device="cpu")
    row = generate("niah_single", pipe.tokenizer, n_samples=1, context_length=256, stride=8, phases=[2], seed=7)[0]
    answer = pipe(row["context"], question=row["question"], answer_prefix=row["answer_prefix"],
                  max_new_tokens=row["max_new_tokens"])["answer"]
    assert isinstance(answer, str) and answer
