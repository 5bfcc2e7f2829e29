"""Learned scores and budgets over the model: the shipped KVzap scorer (``scorer="kvzap"``), the baselines that the
comparison needs (``kvzip_plus``, ``adakv``, ``kvzap``), and budget wrappers that follow the scores."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import pytest
import torch
from kvpress import AdaKVPress, KeyDiffPress, ScorerPress
from kvpress.presses.kvzap_press import KVzapConfig
from transformers import DynamicCache, pipeline

from tiny_models import assert_replay_matches_pipeline, tiny_model, tiny_scorer
from kvpress_phase import GlobalBudgetPress, LayerBudgetPress, PhaseAwarePress
from kvpress_phase.evaluation.presses import (HIDDEN_STATES, REGISTRY, build_press, parse_press_spec, prefill_reads,
                                              query_aware_warning)
from kvpress_phase.evaluation.tokenizer import build_tokenizer
from kvpress_phase.core.phase import compressed_length
from kvpress_phase.presses.learned_scorer import SHIPPED, LocalKVzapPress, shipped_scorer_path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONTEXT = " ".join(f"w{(7 * i) % 50}" for i in range(150))


# ------------------------------------------------------------------------------------------------ the shipped scorer
@pytest.mark.parametrize("folder, trained, shape", [
    ("smollm2", "smollm2", (30, 576, 3, None)),
    ("qwen2_5_coder_0_5b", "qwen2.5-coder-0.5b", (24, 896, 2, None)),
])
def test_shipped_scorer_is_the_trained_one_by_hash(folder, trained, shape):
    """Each shipped scorer is the linear map its ``train-scorer`` run wrote (``outputs/scorers/<model>/``), byte for
    byte, with the model's shape."""
    card = json.load(open(os.path.join(ROOT, "outputs", "scorers", trained, "scorer_card.json")))
    recorded = card["archs"]["linear"]["weights_sha256"]
    for name in ("config.json", "model.safetensors"):
        with open(os.path.join(SHIPPED, folder, name), "rb") as fh:
            assert hashlib.sha256(fh.read()).hexdigest() == recorded[name], name
    config = KVzapConfig.from_pretrained(os.path.join(SHIPPED, folder))
    assert (config.n_modules, config.input_dim, config.output_dim, config.hidden_dim) == shape


def test_a_model_without_a_shipped_scorer_is_refused_by_name():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"no shipped KVzap scorer fits .*2 layers, hidden size 64, 2 KV heads.*"
                                         r"smollm2 \(30 layers.*train-scorer"):
        shipped_scorer_path(model)
    with pytest.raises(ValueError, match="train-scorer"):
        PhaseAwarePress(0.5, scorer="kvzap").post_init_from_model(model)


def test_the_refusal_names_what_a_command_line_user_can_do():
    """The models a scorer ships for, by their --model names, and train-scorer with the Python class that loads its
    folder; never a setting no press spec has (a spec loads only a shipped scorer)."""
    from kvpress_phase.evaluation.presses import press_settings

    with pytest.raises(ValueError) as refused:
        shipped_scorer_path(tiny_model("llama"))
    message = str(refused.value)
    assert "--model smollm2" in message and "--model qwen2.5-coder-0.5b" in message
    assert "kvpress-phase train-scorer --model NAME --output-dir DIR" in message
    assert "LocalKVzapPress(scorer_path='DIR/linear')" in message and "loads only a shipped scorer" in message
    assert "pass scorer_path" not in message
    assert all("scorer_path" not in press_settings(name) for name in ("phase_aware", "chunked_stride", "kvzap"))


_scorer_for = tiny_scorer


def test_a_scorer_for_another_model_is_refused_naming_both(tmp_path):
    model = tiny_model("llama")
    path = _scorer_for(model, tmp_path / "s", layers=5)
    with pytest.raises(ValueError, match=r"trained for 'tiny' \(5 layers.*not for .*2 layers"):
        LocalKVzapPress(0.5, scorer_path=path).post_init_from_model(model)


def test_kvzap_scores_need_the_model_first():
    with pytest.raises(ValueError, match="post_init_from_model"):
        LocalKVzapPress(0.5).score(None, torch.zeros(1, 4, 8), None, None, None, {})


# ------------------------------------------------------------------------------------------------ registry
def test_learned_presses_record_the_hidden_states_and_do_not_read_the_question():
    for text in ("kvzap", "phase_aware:scorer=kvzap", "layer_budget:scorer=kvzap", "adakv:scorer=kvzap"):
        assert HIDDEN_STATES in prefill_reads(parse_press_spec(text)), text
    warning = query_aware_warning(["no_press", "kvzap", "adakv", "kvzip_plus"])
    assert "none of the presses reads" in warning
    assert REGISTRY["kvzip_plus"].masks and REGISTRY["adakv"].masks and not REGISTRY["kvzap"].masks


def test_baselines_build_kvpress_presses_at_the_matched_ratio():
    kvzip_plus = build_press(parse_press_spec("kvzip_plus"), 0.5, 8, None, 0, matched_context_length=1024)
    assert kvzip_plus.kvzip_plus_normalization and 0.45 < kvzip_plus.compression_ratio < 0.5
    adakv = build_press(parse_press_spec("adakv"), 0.5, 8, None, 0, matched_context_length=1024)
    assert isinstance(adakv, AdaKVPress) and isinstance(adakv.press, KeyDiffPress)
    assert adakv.compression_ratio == kvzip_plus.compression_ratio
    learned = build_press(parse_press_spec("adakv:scorer=kvzap"), 0.5, 8, None, 0)
    assert isinstance(learned.press, LocalKVzapPress) and learned.compression_ratio == 0.5
    with pytest.raises(ValueError, match="scorer=NAME"):
        parse_press_spec("adakv:scorer=kvzip")


# ------------------------------------------------------------------------------------------------ budgets follow scores
@dataclass
class LayerFavouring(ScorerPress):
    """Scores comparable across layers, made to favour layer ``favour`` (its scores 1 higher than any other's)."""

    favour: int = 1

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        base = torch.rand(keys.shape[:3], generator=torch.Generator().manual_seed(module.layer_idx))
        return base + (1.0 if module.layer_idx == self.favour else 0.0)


@pytest.mark.parametrize("wrapper", [LayerBudgetPress, GlobalBudgetPress])
def test_a_budget_across_layers_follows_scores_made_to_favour_one_layer(tokenizer, wrapper):
    model = tiny_model("llama", num_hidden_layers=3, seed=2)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    inner = PhaseAwarePress(0.75, scorer=LayerFavouring(favour=1))
    cache = DynamicCache()
    pipe(CONTEXT, question="w1 w2", press=wrapper(inner), max_new_tokens=2, cache=cache)
    n = len(tokenizer.encode(tokenizer.bos_token + CONTEXT, add_special_tokens=False))
    even = compressed_length(n, 8, 0.75, 4, 16)
    # entries attended per KV head (a per-head budget stores a layer at its longest head and masks the rest)
    attended = [round(s.seq_len * (1 - s.achieved_ratio), 6) for s in (inner.stats[i] for i in range(3))]
    assert attended[1] > even > max(attended[0], attended[2])  # the favoured layer takes the others' budget
    assert sum(attended) == pytest.approx(3 * even)  # the total stays ChunkedStridePress's


def test_learned_scores_from_a_local_scorer_steer_a_layer_budget(tokenizer, tmp_path):
    model = tiny_model("llama", num_hidden_layers=3, seed=2)
    path = _scorer_for(model, tmp_path / "favour2", favour=2)
    inner = PhaseAwarePress(0.75, scorer=LocalKVzapPress(scorer_path=path))
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    pipe(CONTEXT, question="w1 w2", press=LayerBudgetPress(inner), max_new_tokens=2, cache=DynamicCache())
    lengths = [inner.stats[i].compressed_length for i in range(3)]
    assert lengths[2] == max(lengths) and lengths[2] > lengths[0]


# ------------------------------------------------------------------------------------------------ replay = pipeline
@pytest.mark.parametrize("make", [lambda path: AdaKVPress(KeyDiffPress(0.6)),
                                  lambda path: LocalKVzapPress(0.6, scorer_path=path),
                                  lambda path: GlobalBudgetPress(PhaseAwarePress(0.75,
                                                                                 scorer=LocalKVzapPress(scorer_path=path)))])
def test_replay_gives_the_pipeline_answers_for_masking_and_learned_presses(make, tmp_path):
    word_tokenizer = build_tokenizer()
    model = tiny_model("llama", vocab_size=len(word_tokenizer), seed=3, num_hidden_layers=3)
    path = _scorer_for(model, tmp_path / "s")

    def check(engine, state, replayed, used):
        if isinstance(used, AdaKVPress):  # its masks are kept: fewer attended entries than stored
            press = make(path)
            cache = engine.compressed_cache(state, press)
            masks = engine.masks(state, press)
            assert masks and replayed["cache_length"] < cache.layers[0].keys.shape[2]

    # kvpress's AdaKV masks with fake keys, found by a search that fails on this random model: the pipeline runs
    # with the package's attention opted in, which hides masked entries exactly, as the replay does
    assert_replay_matches_pipeline(model, word_tokenizer, lambda: make(path), check=check, attention="sdpa",
                                   pipeline_attention="kvpress_phase_ragged")
