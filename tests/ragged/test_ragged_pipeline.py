"""Per-head budgets through kvpress's pipeline store their layers ragged and answer as masked decoding does.

The masked answers come from the evaluation's replay engine, which calls ``press.compress`` directly and decodes with
the padding masked; the pipeline uses the press as a context manager, which stores the padded layers ragged
(:mod:`kvpress_phase.presses.storage`)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, pipeline

from kvpress_phase import GlobalBudgetPress, HeadBudgetPress, PhaseAwarePress, cache_summary, load_builtin_model
from kvpress_phase.evaluation.replay import ReplayEngine
from kvpress_phase.evaluation.tasks import generate
from kvpress_phase.ragged import ATTENTION_NAME, RaggedCache, RaggedLayer, cache_nbytes

WRAPPERS = {"global": GlobalBudgetPress, "heads": HeadBudgetPress}


@pytest.fixture(scope="module")
def built_in():
    model, tokenizer = load_builtin_model()
    rows = generate("niah_single", tokenizer, n_samples=3, context_length=512, stride=8, phases=[1, 3, 6], seed=7)
    return model, tokenizer, rows


@pytest.mark.slow
@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_pipeline_answers_equal_masked_answers_with_less_memory(built_in, wrapper):
    model, tokenizer, rows = built_in
    model.set_attn_implementation("sdpa")
    engine = ReplayEngine(model, tokenizer, step_by_step=True)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    for row in rows:
        encoded = engine.encode(row["context"], [row["question"]], row["answer_prefix"])
        state = engine.prefill(encoded["context_ids"])
        masked_press = WRAPPERS[wrapper](PhaseAwarePress(0.75))
        masked = engine.answer_many(state, [masked_press], encoded["questions_ids"][0], 8, batch_size=1)[0]
        dense = engine.compressed_cache(state, WRAPPERS[wrapper](PhaseAwarePress(0.75)))
        press, cache = WRAPPERS[wrapper](PhaseAwarePress(0.75)), DynamicCache()
        answer = pipe(row["context"], question=row["question"], answer_prefix=row["answer_prefix"], press=press,
                      max_new_tokens=8, cache=cache)["answer"]
        assert answer == masked["prediction"]
        assert model.config._attn_implementation == ATTENTION_NAME
        assert any(isinstance(layer, RaggedLayer) for layer in cache.layers)
        dense_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in dense.layers)
        assert cache_summary(press).bytes_stored < dense_bytes
        # the replay stores and decodes the press as the pipeline does, and measures the same bytes
        assert masked["cache_bytes"] == cache_summary(press).bytes_stored
        assert cache_nbytes(cache) >= cache_summary(press).bytes_stored  # a dense layer keeps what it grew into
    model.set_attn_implementation("sdpa")


def test_a_ragged_cache_given_to_the_pipeline_is_refused(built_in):
    model, tokenizer, rows = built_in
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    with pytest.raises(ValueError, match="DynamicCache"):
        pipe(rows[0]["context"], question=rows[0]["question"], press=HeadBudgetPress(PhaseAwarePress(0.5)),
             max_new_tokens=2, cache=RaggedCache())
    model.set_attn_implementation("sdpa")


def test_attention_other_than_sdpa_is_refused(built_in):
    model, tokenizer, _ = built_in
    model.set_attn_implementation("eager")
    try:
        with pytest.raises(ValueError, match="sdpa"):
            with GlobalBudgetPress(PhaseAwarePress(0.5))(model):
                pass
    finally:
        model.set_attn_implementation("sdpa")


def test_kvpress_own_per_head_press_stays_masked(built_in):
    from kvpress import AdaKVPress, KeyDiffPress

    model, tokenizer, rows = built_in
    model.set_attn_implementation("sdpa")
    cache = DynamicCache()
    with torch.no_grad(), AdaKVPress(KeyDiffPress(0.5))(model):
        model.model(tokenizer(rows[0]["context"], return_tensors="pt").input_ids, past_key_values=cache)
    assert not any(isinstance(layer, RaggedLayer) for layer in cache.layers)
    assert model.config._attn_implementation == "sdpa"
    for layer in model.model.layers:
        layer.self_attn.masked_key_indices = None


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_logits_of_ragged_decoding_equal_masked_decoding(built_in, wrapper):
    """The same prefill under the press, left masked (kvpress's context manager alone) and stored ragged (the
    press's own): the logits of a 3-token question and 4 greedy steps agree."""
    model, tokenizer, rows = built_in
    ids = tokenizer(tokenizer.bos_token + rows[0]["context"], return_tensors="pt", add_special_tokens=False).input_ids
    question = tokenizer(" " + rows[0]["question"], return_tensors="pt", add_special_tokens=False).input_ids[:, :3]
    n = ids.shape[1]
    logits = {}
    for how in ("masked", "ragged"):
        model.set_attn_implementation("sdpa")
        press, cache = WRAPPERS[wrapper](PhaseAwarePress(0.75)), DynamicCache()
        context = press(model) if how == "ragged" else _stored_masked(press, model)
        with torch.no_grad():
            with context:
                model.model(ids, past_key_values=cache)
            assert any(isinstance(layer, RaggedLayer) for layer in cache.layers) == (how == "ragged")
            out = model(question, past_key_values=cache, position_ids=torch.arange(n, n + 3)[None])
            steps = [out.logits[0]]
            for i in range(4):
                out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache,
                            position_ids=torch.tensor([[n + 3 + i]]))
                steps.append(out.logits[0])
        logits[how] = torch.cat(steps)
        for layer in model.model.layers:
            layer.self_attn.masked_key_indices = None
    model.set_attn_implementation("sdpa")
    torch.testing.assert_close(logits["ragged"], logits["masked"], rtol=1e-4, atol=1e-4)


def _stored_masked(press, model):
    """The press's compression as its context manager runs it, minus the ragged store: the padding stays masked."""
    from kvpress_phase.presses.storage import stored_masked

    return stored_masked(press, model)


def test_the_pipeline_leaves_the_compressed_context_after_its_answers(built_in):
    """kvpress's pipeline removes each answer from the cache before the next question (``layer.keys[:, :, :n]``):
    on ragged layers every head drops its appended entries and keeps exactly what compression kept."""
    model, tokenizer, rows = built_in
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    press, cache = GlobalBudgetPress(PhaseAwarePress(0.75)), DynamicCache()
    answers = pipe(rows[0]["context"], questions=[rows[0]["question"]] * 2, answer_prefix=rows[0]["answer_prefix"],
                   press=press, max_new_tokens=6, cache=cache)["answers"]
    assert answers[0] == answers[1]
    for idx, layer in enumerate(cache.layers):
        record = press.stats[idx]
        assert layer.get_seq_length() == record.compressed_length
        if isinstance(layer, RaggedLayer):
            heads, positions = record.masked
            padding = torch.bincount(heads, minlength=layer.num_heads)
            assert layer.head_lengths == (record.compressed_length - padding).tolist()
    model.set_attn_implementation("sdpa")


# ------------------------------------------------------------------------------------------------ bytes and attention
def _capacity(cache) -> tuple[int, int]:
    """(rows the ragged layers' buffers hold, live entries in them)."""
    layers = [layer for layer in cache.layers if isinstance(layer, RaggedLayer)]
    return sum(layer.capacity for layer in layers), sum(layer.entries for layer in layers)


def test_capacity_is_exact_after_the_prefill_bounded_while_decoding_and_released_after_the_answer(built_in):
    """After the prefill the ragged layers hold their entries exactly; while the pipeline answers (64 tokens, the end
    of sequence ignored) their capacity stays within 1.05x of the live entries; when it removes the answer the
    slack is released (within 1.02x)."""
    model, tokenizer, rows = built_in
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    press, cache = GlobalBudgetPress(PhaseAwarePress(0.75)), DynamicCache()
    seen = []
    generate_answer = pipe.generate_answer

    def watched(question_ids, cache, context_length, max_new_tokens):
        seen.append(("prefill", *_capacity(cache)))
        original = model.forward

        def forward(*args, **kwargs):
            out = original(*args, **kwargs)
            seen.append(("decoding", *_capacity(cache)))
            return out

        model.forward = forward
        try:
            return generate_answer(question_ids, cache, context_length, max_new_tokens)
        finally:
            del model.forward

    pipe.generate_answer = watched
    eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [-1]
    try:
        pipe(rows[0]["context"], question=rows[0]["question"], press=press, max_new_tokens=64, cache=cache)
    finally:
        model.generation_config.eos_token_id = eos
    assert seen[0][0] == "prefill" and seen[0][1] == seen[0][2] > 0
    decoding = [(cap, live) for what, cap, live in seen if what == "decoding"]
    assert len(decoding) == 64
    assert max(cap / live for cap, live in decoding) <= 1.05
    assert any(cap > live for cap, live in decoding)  # it did grow in place
    capacity, live = _capacity(cache)
    assert capacity <= 1.02 * live and live == seen[0][2]


def test_the_attention_is_restored_when_the_ragged_cache_is_freed(built_in):
    """The model decodes ragged layers with the ragged attention while the pipeline's cache is alive; once the
    pipeline returns (its own cache freed) the model has the attention it had. A cache the caller keeps keeps it
    switched until it is dropped."""
    import gc

    model, tokenizer, rows = built_in
    model.set_attn_implementation("sdpa")
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    pipe(rows[0]["context"], question=rows[0]["question"], press=GlobalBudgetPress(PhaseAwarePress(0.75)),
         max_new_tokens=3)
    gc.collect()
    assert model.config._attn_implementation == "sdpa"
    cache = DynamicCache()
    pipe(rows[0]["context"], question=rows[0]["question"], press=GlobalBudgetPress(PhaseAwarePress(0.75)),
         max_new_tokens=3, cache=cache)
    assert model.config._attn_implementation == ATTENTION_NAME
    del cache
    gc.collect()
    assert model.config._attn_implementation == "sdpa"


def test_cache_bytes_counts_every_storage_once_whatever_the_cache():
    from kvpress_phase import cache_bytes

    keys = torch.zeros(1, 2, 10, 4)
    cache = DynamicCache()
    cache.update(keys, keys.clone(), 0)
    cache.update(keys, keys.clone(), 1)
    assert cache_bytes(cache) == 4 * keys.numel() * 4
    cache.layers[1].values = cache.layers[1].keys  # one tensor as both keys and values: counted once
    assert cache_bytes(cache) == 3 * keys.numel() * 4
    cache.layers[0].keys = cache.layers[0].keys[:, :, :3]  # a crop keeps its storage
    assert cache_bytes(cache) == 3 * keys.numel() * 4
    with pytest.raises(ValueError, match="transformers Cache"):
        cache_bytes(object())
