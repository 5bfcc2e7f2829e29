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


# ---------------------------------------------------------------------------------------------- the registry
def _missing(monkeypatch, name="chunked"):
    """Make the registry entry ``name`` point at a folder that does not exist (as in a clean clone)."""
    import dataclasses

    from kvpress_phase import builtin

    entry = dataclasses.replace(builtin.BUILTIN_MODELS[name], folder="no_such_model_folder")
    monkeypatch.setitem(builtin.BUILTIN_MODELS, name, entry)
    return entry


def test_registry_names_both_models_and_the_default_is_the_post_hoc_one():
    from kvpress_phase.builtin import BUILTIN_MODELS, DEFAULT_MODEL

    assert DEFAULT_MODEL == "builtin" and set(BUILTIN_MODELS) >= {"builtin", "chunked"}
    assert builtin_model_path() == builtin_model_path("builtin")
    with pytest.raises(ValueError, match="built-in models: builtin, chunked"):
        builtin_model_path("nope")


def test_a_model_not_built_yet_names_the_command_that_builds_it(monkeypatch, capsys):
    from kvpress_phase import cli

    _missing(monkeypatch)
    with pytest.raises(FileNotFoundError, match="kvpress-phase train --recipe chunked"):
        builtin_model_path("chunked")
    assert cli.main(["eval", "--model", "chunked", "--samples", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "kvpress-phase train --recipe chunked" in err
    assert cli.main(["list"]) == 0
    assert "not available yet: kvpress-phase train --recipe chunked" in capsys.readouterr().out


@pytest.mark.skipif(not os.path.isfile(os.path.join(os.path.dirname(builtin_model_path()), "builtin_model_chunked",
                                                    "config.json")),
                    reason="the trained-in model is not built in this checkout (kvpress-phase train --recipe chunked)")
def test_trained_in_model_files_size_and_loading():
    path = builtin_model_path("chunked")
    assert os.path.getsize(os.path.join(path, "model.safetensors")) <= 20 * 1024 * 1024
    model, tokenizer = load_builtin_model(name="chunked")
    reference, ref_tokenizer = load_builtin_model()
    assert tokenizer.get_vocab() == ref_tokenizer.get_vocab()
    assert model.config.num_hidden_layers == reference.config.num_hidden_layers
