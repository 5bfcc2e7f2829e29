"""Batched decoding of many compressed caches, presses that mask (KVzip) or keep uneven layers (PyramidKV), and
the question compressed with the context."""

from __future__ import annotations

import pytest
import torch
from kvpress import AdaKVPress, KeyDiffPress, KnormPress, KVzipPress, PyramidKVPress
from transformers import DynamicCache, pipeline

from kvpress_phase import (ChunkedStridePress, GlobalBudgetPress, LayerBudgetPress, PhaseAwarePress,
                           WindowedDecodingPress)
from kvpress_phase.evaluation.presses import REGISTRY, build_press, parse_press_spec, reads_question
from kvpress_phase.evaluation.config import EvalConfig, duplicate_k
from kvpress_phase.evaluation.replay import KVzipMasks, ReplayEngine
from kvpress_phase.presses.kvzip_adapter import kvzip_masks, kvzip_scores
from kvpress_phase.evaluation.store import read_results
from kvpress_phase.evaluation.runner import run_evaluation
from kvpress_phase.evaluation.tasks import generate
from tiny_models import tiny_model


@pytest.fixture(scope="module")
def model(word_tokenizer):
    return tiny_model("llama", vocab_size=len(word_tokenizer), seed=7, num_hidden_layers=3)


@pytest.fixture(scope="module")
def row(word_tokenizer):
    return generate("niah_multikey", word_tokenizer, n_samples=1, context_length=240, stride=8, phases=[3],
                    protocol="offset", seed=2)[0]


def _presses():
    return [None, KnormPress(0.5), ChunkedStridePress(0.5, mode="select"), ChunkedStridePress(0.25, offset=3),
            PhaseAwarePress(0.5, offset=5), PyramidKVPress(0.5), KVzipMasks(0.5), KVzipMasks(0.25), KnormPress(0.5)]


def test_batched_answers_equal_one_at_a_time(model, word_tokenizer, row):
    engine = ReplayEngine(model, word_tokenizer)
    encoded = engine.encode(row["context"], [row["question"]], row["answer_prefix"])
    state = engine.prefill(encoded["context_ids"])
    q = encoded["questions_ids"][0]
    needle = (row["needle_token_start"], row["needle_token_end"])
    one = engine.answer_many(state, _presses(), q, 8, needles=[needle], batch_size=1)
    state.memo.clear()
    many = engine.answer_many(state, _presses(), q, 8, needles=[needle], batch_size=16)
    assert [a["prediction"] for a in one] == [a["prediction"] for a in many]
    assert [a["cache_length"] for a in one] == [a["cache_length"] for a in many]
    for a, b in zip(one, many):
        assert a["masses"][0] == pytest.approx(b["masses"][0], rel=1e-4, abs=1e-6)
    # batch_size=1 is the pipeline's own decoding for presses that remove entries
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=word_tokenizer, device="cpu")
    for press, result in zip(_presses()[:5], one[:5]):
        direct = pipe(row["context"], question=row["question"], answer_prefix=row["answer_prefix"], press=press,
                      max_new_tokens=8)["answer"]
        assert result["prediction"] == direct, press
    # KVzip at two ratios and without compression are three different caches, though of one shape
    assert len({a["cache_length"] for a in one[6:8]} | {one[0]["cache_length"]}) == 3


def test_pyramidkv_padded_decoding_equals_per_layer_masks(model, word_tokenizer, row):
    """kvpress's pipeline cannot decode PyramidKV's uneven layers here (transformers masks every layer as long as the
    first, with SDPA and eager attention alike). Our decoding pads the shorter layers with masked entries; a
    reference that gives every layer a causal mask of its own length, without padding, decodes the same tokens."""
    from kvpress_phase.evaluation.decoding import LayerMasks, _copied

    engine = ReplayEngine(model, word_tokenizer)
    encoded = engine.encode(row["context"], [row["question"]], row["answer_prefix"])
    state = engine.prefill(encoded["context_ids"])
    q = encoded["questions_ids"][0]
    ours = engine.answer_many(state, [PyramidKVPress(0.5)], q, 8)[0]
    cache = engine.compressed_cache(state, PyramidKVPress(0.5))
    lengths = [layer.keys.shape[2] for layer in cache.layers]
    assert len(set(lengths)) > 1  # uneven: the case this test is about
    assert ours["cache_length"] == pytest.approx(sum(lengths) / len(lengths))

    reference = _copied(cache)
    tokens = []
    with torch.inference_mode(), LayerMasks(model, reference, [None]):
        positions = torch.arange(state.context_length, state.context_length + q.shape[1])[None]
        ids = q
        for _ in range(8):
            new = model(input_ids=ids, past_key_values=reference, position_ids=positions).logits[0, -1].argmax()
            tokens.append(int(new))
            if tokens[-1] == model.generation_config.eos_token_id:
                break
            ids, positions = new.view(1, 1), positions[:, -1:] + 1
    assert ours["prediction"] == word_tokenizer.decode(tokens, skip_special_tokens=True)


def test_kvzip_replay_masks_what_kvpress_masks(model, word_tokenizer, row, monkeypatch):
    """kvpress's KVzipPress, run as kvpress runs it (a prefill inside its context manager), masks the same entries
    as our replay (its scores computed once over a copy of the recorded cache, then its own eviction rule)."""
    import transformers

    engine = ReplayEngine(model, word_tokenizer)
    ids = engine.encode(row["context"], [row["question"]], row["answer_prefix"])["context_ids"]
    state = engine.prefill(ids)
    before = [layer.keys.clone() for layer in state.cache.layers]
    ours = kvzip_masks(model, kvzip_scores(model, ids, state.cache, word_tokenizer), 0.5)
    assert all(torch.equal(a, layer.keys) for a, layer in zip(before, state.cache.layers))  # cache untouched
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: word_tokenizer)
    press = KVzipPress(0.5)
    with press(model):
        model.model(input_ids=ids, past_key_values=DynamicCache())
    try:
        for layer_idx, layer in enumerate(model.model.layers):
            _, heads, seqs = layer.self_attn.masked_key_indices
            assert torch.equal(heads, ours[layer_idx][0]) and torch.equal(seqs, ours[layer_idx][1])
    finally:
        for layer in model.model.layers:
            layer.self_attn.masked_key_indices = None
    total = sum(h.numel() for h, _ in ours.values())
    assert total == int(len(model.model.layers) * model.config.num_key_value_heads * ids.shape[1] * 0.5)


def test_every_registered_press_runs_at_a_matched_cache(model, word_tokenizer, tmp_path):
    # kvzap, dms_kvzap and threshold_budget need a scorer shipped for the model's shape, which this tiny model has not
    # (their replay with a scorer written for it: tests/presses/test_learned_budgets.py, test_threshold_budget.py;
    # the last two keep what their scores pass, not a matched count)
    presses = [p for p in REGISTRY if p not in ("kvzap", "dms_kvzap", "threshold_budget")] + ["chunk:scorer=keydiff"]
    config = EvalConfig(tasks=["niah_single"], presses=presses, compression_ratios=[0.5], strides=[8],
                        context_lengths=[160], samples=1, seed=4, phases=[0, 5], protocol="offset",
                        matched_cache=True)
    results = run_evaluation(config, model, word_tokenizer, str(tmp_path), progress=False)
    assert set(results["press"]) == set(presses)
    ours = results[results.press == "chunked_stride"]["cache_length"].iloc[0]
    for name, group in results.groupby("press"):
        length = group["cache_length"].iloc[0]
        if name == "no_press":
            assert length == group["prefill_tokens"].iloc[0]
        elif name.startswith(("chunkkv", "chunk")):  # matched to their granularity only: 0-16 entries fewer than ours
            assert ours - 16 <= length <= ours
        else:  # exactly ours; KVzip and PyramidKV over all layers (and heads), to within half an entry per head
            assert length == pytest.approx(ours, abs=0.5), name
    assert (results["achieved_ratio"] - (1 - results["cache_length"] / results["prefill_tokens"])).abs().max() < 1e-5
    chunked = results[results.press == "chunked_stride"]
    assert (chunked["window_ratio"] == 0.5).all() and (chunked["press_ratio"] == 0.5).all()


def test_compress_question_is_the_pipeline_with_the_question_in_the_context(model, word_tokenizer, tmp_path):
    config = EvalConfig(tasks=["niah_single"], presses=["no_press", "chunked_stride:mode=select", "snapkv"],
                        compression_ratios=[0.5], strides=[8], context_lengths=[160], samples=1, seed=4,
                        phases=[2], protocol="offset", compress_question=True, matched_cache=True)
    results = run_evaluation(config, model, word_tokenizer, str(tmp_path), progress=False)
    assert set(results["setting"]) == {"question_compressed"}
    assert all(k.endswith("|question_compressed") for k in results["key"])
    assert (results["prefill_tokens"] > results["context_tokens"]).all()
    row = generate("niah_single", word_tokenizer, n_samples=1, context_length=160, stride=8, phases=[2],
                   protocol="offset", seed=4)[0]
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=word_tokenizer, device="cpu")
    for name in ("no_press", "chunked_stride:mode=select"):
        press = build_press(parse_press_spec(name), 0.5, 8, None, row["offset"])
        direct = pipe(row["context"] + row["question"], question="", answer_prefix=row["answer_prefix"],
                      press=press, max_new_tokens=row["max_new_tokens"])["answer"]
        assert results[results.press == name]["prediction"].iloc[0] == direct
    # the two settings are kept apart when runs are merged
    agnostic = EvalConfig(**{**config.__dict__, "compress_question": False})
    run_evaluation(agnostic, model, word_tokenizer, str(tmp_path / "agnostic"), progress=False)
    merged = read_results(str(tmp_path / "agnostic"))
    assert set(merged["setting"]) == {"query_agnostic"} and not set(merged["key"]) & set(results["key"])


def test_question_readers():
    assert reads_question(parse_press_spec("snapkv")) and reads_question(parse_press_spec("tova"))
    assert not reads_question(parse_press_spec("knorm")) and not reads_question(parse_press_spec("kvzip"))
    assert not reads_question(parse_press_spec("chunked_stride:mode=select"))
    assert reads_question(parse_press_spec("chunked_stride:mode=select:scorer=snapkv"))


def test_chunk_wrappers_take_a_scorer_by_name():
    """kvpress's chunk wrappers with another scorer (the phase audit of kvpress's chunked presses): built from the
    shared scorer table at the matched ratio, chunks of ``stride`` tokens; other settings are refused."""
    from kvpress import ChunkKVPress, ChunkPress, KeyDiffPress, KnormPress, SnapKVPress

    press = build_press(parse_press_spec("chunk:scorer=keydiff"), 0.25, 20, None, 0, matched_context_length=1024)
    assert type(press) is ChunkPress and type(press.press) is KeyDiffPress and press.chunk_length == 20
    assert press.press.compression_ratio == build_press(parse_press_spec("knorm"), 0.25, 20, None, 0,
                                                        matched_context_length=1024).compression_ratio
    default = build_press(parse_press_spec("chunkkv"), 0.25, 8, None, 0)
    assert type(default) is ChunkKVPress and type(default.press) is SnapKVPress
    assert type(build_press(parse_press_spec("chunkkv:scorer=knorm"), 0.25, 8, None, 0).press) is KnormPress
    assert not reads_question(parse_press_spec("chunk:scorer=keydiff"))
    assert reads_question(parse_press_spec("chunk:scorer=tova")) and not reads_question(parse_press_spec("chunk"))
    for bad in ("chunk:scorer=kvzip", "chunk:chunk_length=8", "chunkkv:scorer=nope", "knorm:scorer=keydiff"):
        with pytest.raises(ValueError, match="scorer=NAME|takes no settings"):
            parse_press_spec(bad)


def test_duplicate_k_is_refused_unless_allowed():
    assert duplicate_k([0.375, 0.625], [4]) is None  # k = 2 and 1 under the rounding rule
    message = duplicate_k([0.4, 0.375], [4])
    assert "both keep k=2" in message and "stride 4" in message
    with pytest.raises(ValueError, match="allow-duplicate-k"):
        EvalConfig(compression_ratios=[0.4, 0.375], strides=[8, 4]).validate()
    EvalConfig(compression_ratios=[0.4, 0.375], strides=[4], allow_duplicate_k=True).validate()


def test_kvzip_scorer_press_through_the_pipeline_and_the_replay(model, word_tokenizer, row):
    """PhaseAwarePress with KVzip's scores: compresses after the prefill to the exact length, and the runner's
    replay (scores once per prefill) gives the pipeline's answer."""
    from kvpress_phase.core.phase import compressed_length
    from kvpress_phase.presses.scorers import KVzipScorer

    def press():
        return PhaseAwarePress(0.5, offset=row["offset"], residual="drop", scorer=KVzipScorer(tokenizer=word_tokenizer))

    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=word_tokenizer, device="cpu")
    cache = DynamicCache()
    used = press()
    direct = pipe(row["context"], question=row["question"], answer_prefix=row["answer_prefix"], press=used,
                  max_new_tokens=8, cache=cache)["answer"]
    engine = ReplayEngine(model, word_tokenizer)
    encoded = engine.encode(row["context"], [row["question"]], row["answer_prefix"])
    n = encoded["context_ids"].shape[1]
    assert cache.get_seq_length(0) == compressed_length(n, 8, 0.5, 4, 16)
    state = engine.prefill(encoded["context_ids"])
    replayed = engine.answer_many(state, [press()], encoded["questions_ids"][0], 8, batch_size=1)[0]
    assert replayed["prediction"] == direct
    assert torch.equal(used.scorer.scores, state.memo[("kvzip_scores", False)])
    with pytest.raises(ValueError, match="whole context"):
        WindowedDecodingPress(PhaseAwarePress(0.5, scorer=KVzipScorer()))


@pytest.mark.parametrize("draft", ["none", "own", "wrong_first", "wrong_late", "too_long"])
def test_fast_decoding_equals_step_by_step(model, word_tokenizer, row, draft):
    """decode_tokens with and without a draft (right, wrong at the first or a later token, longer than allowed)
    gives the step-by-step tokens for every row of a batch, masked (KVzip) and padded (PyramidKV) rows included."""
    from kvpress_phase.evaluation.decoding import decode_tokens

    engine = ReplayEngine(model, word_tokenizer)
    encoded = engine.encode(row["context"], [row["question"]], row["answer_prefix"])
    state = engine.prefill(encoded["context_ids"])
    q = encoded["questions_ids"][0]
    presses = [None, KVzipMasks(0.5), KVzipMasks(0.25), KnormPress(0.5), KnormPress(0.75), PyramidKVPress(0.5),
               PyramidKVPress(0.75), LayerBudgetPress(PhaseAwarePress(0.75)),
               GlobalBudgetPress(PhaseAwarePress(0.5)), AdaKVPress(KeyDiffPress(0.5))]
    caches = [engine.compressed_cache(state, p) for p in presses]
    masks = [engine.masks(state, p) for p in presses]
    reference = []
    for cache, mask in zip(caches, masks):  # one row at a time, step by step
        reference += decode_tokens(model, [cache], q, state.context_length, 8, masks=[mask], step_by_step=True)
    own = reference[0]
    drafts = {"none": None, "own": own, "wrong_first": [own[0] + 1] + own[1:], "too_long": own + own + own,
              "wrong_late": own[:2] + [own[2] + 1] + own[3:] if len(own) > 3 else own[:-1] + [own[-1] + 1]}
    # batches of equal shapes (masked, padded, plain), and of layers of different lengths in every row
    assert len({tuple(layer.keys.shape[2] for layer in caches[i].layers) for i in (5, 6, 7, 8)}) == 4
    for rows in ([0, 1, 2], [2, 0, 1, 1], [3], [4, 4], [5], [5, 6, 7, 8], [8, 7]):
        fast = decode_tokens(model, [caches[i] for i in rows], q, state.context_length, 8,
                             masks=[masks[i] for i in rows], draft=drafts[draft])
        assert fast == [reference[i] for i in rows]
    for cache in caches:  # the caches handed in are left as they were
        assert all(layer.keys.shape[2] <= state.context_length for layer in cache.layers)


@pytest.mark.parametrize("draft", ["none", "own", "wrong_first", "wrong_late", "too_long", "one_token"])
def test_ragged_decoding_with_a_draft_equals_step_by_step(model, word_tokenizer, row, draft):
    """decode_ragged with a draft (right, wrong at the first or a later token, longer than allowed, one token)
    gives the tokens it gives without one, on ragged caches of per-head budgets, and leaves the cache cropped to
    the question and the answer it decoded (the draft's rejected tokens are not attended to)."""
    from kvpress_phase.evaluation.decoding import decode_ragged
    from kvpress_phase.evaluation.replay import ragged_cache

    engine = ReplayEngine(model, word_tokenizer)
    encoded = engine.encode(row["context"], [row["question"]], row["answer_prefix"])
    state = engine.prefill(encoded["context_ids"])
    q = encoded["questions_ids"][0]
    presses = [GlobalBudgetPress(PhaseAwarePress(0.5)), GlobalBudgetPress(PhaseAwarePress(0.75)),
               LayerBudgetPress(PhaseAwarePress(0.75))]
    own = engine.answer_many(state, [None], q, 8)  # sets the uncompressed answer's tokens as the draft
    uncompressed = state.memo[("draft", tuple(q[0].tolist()), 8)]
    drafts = {"none": None, "own": uncompressed, "wrong_first": [uncompressed[0] + 1] + uncompressed[1:],
              "too_long": uncompressed * 3, "one_token": uncompressed[:1],
              "wrong_late": uncompressed[:2] + [uncompressed[2] + 1] + uncompressed[3:]}
    assert own[0]["prediction"] and len(uncompressed) > 3
    for press in presses:
        cache, masks = engine.compressed_cache(state, press), engine.masks(state, press)
        reference = decode_ragged(model, ragged_cache(cache, masks), q, state.context_length, 8)
        stored = ragged_cache(cache, masks)
        def live(layer):  # a ragged layer's entries; a dense layer's (every head as long)
            return layer.entries if hasattr(layer, "entries") else layer.keys.shape[1] * layer.keys.shape[2]

        entries = [live(layer) for layer in stored.layers]
        before = [layer.get_seq_length() for layer in stored.layers]
        tokens = decode_ragged(model, stored, q, state.context_length, 8, draft=drafts[draft])
        assert tokens == reference, press
        grown = q.shape[1] + len(tokens) - 1  # the question and every answer token but the last were fed
        heads = model.config.num_key_value_heads
        assert [live(layer) for layer in stored.layers] == [e + grown * heads for e in entries]
        assert [layer.get_seq_length() for layer in stored.layers] == [b + grown for b in before]


def test_every_answer_records_the_bytes_its_cache_stores():
    """cache_bytes: a dense press's keys and values; kvpress's per-head press stores every entry (masked ones
    included); ours stores only the kept entries and two int32 per KV head of a ragged layer's index."""
    from kvpress import AdaKVPress, KeyDiffPress

    from kvpress_phase import GlobalBudgetPress, PhaseAwarePress, load_builtin_model
    from kvpress_phase.evaluation.replay import ReplayEngine
    from kvpress_phase.evaluation.tasks import generate

    model, tokenizer = load_builtin_model()
    model.set_attn_implementation("sdpa")
    row = generate("niah_single", tokenizer, n_samples=1, context_length=256, stride=8, phases=[2], seed=4)[0]
    engine = ReplayEngine(model, tokenizer)
    encoded = engine.encode(row["context"], [row["question"]], row["answer_prefix"])
    state = engine.prefill(encoded["context_ids"])
    presses = [None, AdaKVPress(KeyDiffPress(0.75)), GlobalBudgetPress(PhaseAwarePress(0.75))]
    none, ada, ours = engine.answer_many(state, presses, encoded["questions_ids"][0], 4)
    layers = len(model.model.layers)
    heads, dim = model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads
    per_entry = 2 * dim * 4  # a key and a value, float32
    n = state.context_length
    assert none["cache_bytes"] == layers * heads * n * per_entry
    assert ada["cache_bytes"] == none["cache_bytes"]  # masked: every entry stays stored
    attended = round(ours["cache_length"] * layers * heads)
    assert attended * per_entry <= ours["cache_bytes"] <= attended * per_entry + layers * heads * 8
    assert ours["cache_bytes"] < ada["cache_bytes"] / 2  # ratio 0.75, sink and recent tokens kept besides
