"""kvpress 0.5.5's presses registered as baselines besides the first fourteen: each entry builds the kvpress class
its description names, with kvpress's defaults, answers through kvpress's pipeline on the built-in model and gives
the pipeline's answer in the replay; KVgrad's replay masks what kvpress's own ``KVgradPress`` masks; the sketches
of ``leverage`` and ``compactor`` repeat; and every press class of kvpress is either registered or named, with its
reason, in docs/evaluation.md."""

from __future__ import annotations

import os
import re

import kvpress
import pytest
import torch
from kvpress.utils import compute_n_kept
from transformers import DynamicCache, pipeline

from kvpress_phase import load_builtin_model
from kvpress_phase.evaluation.presses import REGISTRY, build_press, parse_press_spec
from kvpress_phase.evaluation.replay import KVgradMasks, ReplayEngine, cache_fingerprint
from kvpress_phase.evaluation.tasks import generate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NEW = {
    "cur": "CURPress",
    "lagkv": "LagKVPress",
    "leverage": "LeverageScorePress",
    "non_causal_attn": "NonCausalAttnPress",
    "compactor": "CompactorPress",
    "cap": "CapPress",
    "entropy_chunkkv": "EntropyGatedChunkKVPress",
    "block": "BlockPress",
    "merging": "MergingPress",
}
"""The entries that remove entries, and the kvpress class each builds."""
INNER = {"entropy_chunkkv": "SnapKVPress", "block": "KeyDiffPress", "merging": "KnormPress"}
"""The scorer a wrapper wraps by default, as kvpress's evaluation pairs them."""
RATIO = 0.5


@pytest.fixture(scope="module")
def setting():
    model, tokenizer = load_builtin_model()
    example = generate("niah_single", tokenizer, n_samples=1, context_length=300, stride=8, phases=[3])[0]
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    return model, tokenizer, pipe, example


def _ask(example) -> dict:
    return {"question": example["question"], "answer_prefix": example["answer_prefix"], "max_new_tokens": 6}


def test_the_new_entries_are_kvpress_baselines_outside_the_default_job():
    for name in (*NEW, "kvgrad"):
        entry = REGISTRY[name]
        cls = NEW.get(name, "KVgradPress")
        assert entry.description.startswith(f"kvpress {cls}"), name
        assert entry.matched and not entry.in_default_job and not entry.grid_offset, name
    assert REGISTRY["kvgrad"].masks and not any(REGISTRY[name].masks for name in NEW)
    # the random sketches and the ratio-weighted blend must not share scores across ratios; the others may
    assert not REGISTRY["leverage"].shared_scores and not REGISTRY["compactor"].shared_scores
    assert all(REGISTRY[name].shared_scores for name in ("cur", "lagkv", "non_causal_attn", "cap"))


@pytest.mark.parametrize("name", list(NEW))
def test_each_new_entry_builds_its_kvpress_class_with_kvpress_defaults(name):
    press = build_press(parse_press_spec(name), RATIO, 8, None, 0)
    cls = getattr(kvpress, NEW[name])
    assert type(press) is cls
    assert press.compression_ratio == RATIO
    if name in INNER:
        assert type(press.press) is getattr(kvpress, INNER[name])
        defaults = cls(press=getattr(kvpress, INNER[name])(RATIO), **({"block_size": 128} if name == "block" else {}))
    else:
        defaults = cls(RATIO)
    assert press == defaults  # kvpress's defaults, but for the ratio (and block_keydiff's blocks of 128)


@pytest.mark.parametrize("name", list(NEW))
def test_each_new_entry_answers_through_the_pipeline_and_the_replay(setting, name):
    """Through kvpress's pipeline the press keeps kvpress's count of entries in every layer and answers; the
    evaluation's replay of the same press gives the same answer (decoded step by step, one press at a time)."""
    model, tokenizer, pipe, example = setting
    cache = DynamicCache()
    press = build_press(parse_press_spec(name), RATIO, 8, None, 0)
    direct = pipe(example["context"], press=press, cache=cache, **_ask(example))["answer"]
    assert isinstance(direct, str) and direct.strip()
    engine = ReplayEngine(model, tokenizer, step_by_step=True)
    encoded = engine.encode(example["context"], [example["question"]], example["answer_prefix"])
    n = encoded["context_ids"].shape[1]
    kept = compute_n_kept(n, RATIO)
    # the pipeline's cache also holds the question and the answer; the replay's compressed cache holds the context
    state = engine.prefill(encoded["context_ids"])
    compressed = engine.compressed_cache(state, build_press(parse_press_spec(name), RATIO, 8, None, 0))
    assert {layer.keys.shape[2] for layer in compressed.layers} == {kept}, name
    replayed = engine.answer_many(state, [build_press(parse_press_spec(name), RATIO, 8, None, 0)],
                                  encoded["questions_ids"][0], 6, batch_size=1)[0]
    assert replayed["prediction"] == direct
    assert replayed["cache_length"] == kept


def test_the_sketches_repeat_and_leave_the_random_state_alone(setting):
    """``leverage`` and ``compactor`` draw their Gaussian sketch from a seed per layer: two presses built apart give
    one cache, and torch's random state is where it was; kvpress's own press, unseeded, gives another cache."""
    model, tokenizer, _, example = setting
    engine = ReplayEngine(model, tokenizer)
    state = engine.prefill(engine.encode(example["context"], [example["question"]], example["answer_prefix"])
                           ["context_ids"])
    for name in ("leverage", "compactor"):
        torch.manual_seed(123)
        before = torch.get_rng_state()
        first, second = [cache_fingerprint(state, engine.compressed_cache(
            state, build_press(parse_press_spec(name), RATIO, 8, None, 0))) for _ in range(2)]
        assert first == second, name
        assert torch.equal(torch.get_rng_state(), before)
        unseeded = getattr(kvpress, NEW[name])(RATIO)
        assert cache_fingerprint(state, engine.compressed_cache(state, unseeded)) != first, name


def test_kvgrad_replays_kvpress_own_masks(setting):
    """The replay's KVgrad masks, from scores computed once per prefill, are the entries kvpress's ``KVgradPress``
    masks around a prefill of the same context, at two ratios; the answer is the pipeline's."""
    model, tokenizer, pipe, example = setting
    engine = ReplayEngine(model, tokenizer, step_by_step=True)
    encoded = engine.encode(example["context"], [example["question"]], example["answer_prefix"])
    ids = encoded["context_ids"]
    state = engine.prefill(ids)
    assert type(build_press(parse_press_spec("kvgrad"), RATIO, 8, None, 0)) is KVgradMasks
    for ratio in (0.25, RATIO):
        ours = engine.masks(state, KVgradMasks(ratio))
        with kvpress.KVgradPress(ratio)(model):
            model.model(input_ids=ids, past_key_values=DynamicCache())
        try:
            for layer_idx, layer in enumerate(model.model.layers):
                _, heads, seqs = layer.self_attn.masked_key_indices
                assert torch.equal(heads, ours[layer_idx][0]) and torch.equal(seqs, ours[layer_idx][1])
        finally:
            for layer in model.model.layers:
                layer.self_attn.masked_key_indices = None
        total = sum(h.numel() for h, _ in ours.values())
        assert total == int(len(model.model.layers) * model.config.num_key_value_heads * ids.shape[1] * ratio)
    assert "kvgrad_scores" in state.memo  # once per prefill, for both ratios
    direct = pipe(example["context"], press=kvpress.KVgradPress(RATIO), **_ask(example))["answer"]
    replayed = engine.answer_many(state, [build_press(parse_press_spec("kvgrad"), RATIO, 8, None, 0)],
                                  encoded["questions_ids"][0], 6, batch_size=1)[0]
    assert replayed["prediction"] == direct


def test_list_shows_the_new_baselines(capsys):
    from kvpress_phase import cli

    assert cli.main(["list"]) == 0
    names = {line.split()[0] for line in capsys.readouterr().out.splitlines()
             if line.startswith("  ") and not line.startswith("   ") and line.split()}
    assert {*NEW, "kvgrad"} <= names


def test_every_kvpress_press_is_registered_or_its_reason_is_in_the_docs():
    """A press class of kvpress that no registry description names has a line of its own in docs/evaluation.md's
    list of presses not registered, saying why; a class named there is not registered."""
    classes = {name for name in dir(kvpress) if name.endswith("Press") and isinstance(getattr(kvpress, name), type)}
    named = {cls for entry in REGISTRY.values() for cls in re.findall(r"\b(\w+Press)\b", entry.description)}
    with open(os.path.join(ROOT, "docs", "evaluation.md"), encoding="utf-8") as fh:
        text = fh.read()
    section = text.split("kvpress 0.5.5's other presses are not registered", 1)[1].split("\n- **", 1)[0]
    reasons = {}
    for line in re.findall(r"^  - (.+?):", section, flags=re.M):
        for cls in re.findall(r"`(\w+Press)`", line):
            reasons[cls] = line
    assert not set(reasons) & named, set(reasons) & named
    assert classes - named <= set(reasons), sorted(classes - named - set(reasons))
    assert {"FastKVzipPress", "QFilterPress", "ThinKPress"} <= set(reasons)
    assert {"CriticalKVPress", "CriticalAdaKVPress", "CURPress", "CompactorPress", "LagKVPress", "LeverageScorePress", "KVgradPress"} <= named


CRITICAL = {"critical_kv": "CriticalKVPress", "critical_adakv": "CriticalAdaKVPress"}


@pytest.mark.parametrize("name", list(CRITICAL))
def test_critical_presses_wrap_expected_attention_as_kvpress_pairs_them(setting, name):
    """CriticalKV and CriticalAdaKV around ExpectedAttentionPress(use_vnorm=False) (kvpress's evaluation's pairing),
    answering through the pipeline and, identically, through the replay (CriticalAdaKV's per-head masks)."""
    press = build_press(parse_press_spec(name), RATIO, 8, None, 0)
    assert type(press) is getattr(kvpress, CRITICAL[name])
    assert type(press.press) is kvpress.ExpectedAttentionPress and press.press.use_vnorm is False
    assert press.compression_ratio == RATIO and REGISTRY[name].masks == (name == "critical_adakv")
    model, tokenizer, pipe, example = setting
    direct = pipe(example["context"], press=press, cache=DynamicCache(), **_ask(example))["answer"]
    engine = ReplayEngine(model, tokenizer, step_by_step=True)
    encoded = engine.encode(example["context"], [example["question"]], example["answer_prefix"])
    state = engine.prefill(encoded["context_ids"])
    replayed = engine.answer_many(state, [build_press(parse_press_spec(name), RATIO, 8, None, 0)],
                                  encoded["questions_ids"][0], 6, batch_size=1)[0]
    assert replayed["prediction"] == direct


def test_the_loaders_give_qwen2_the_head_dim_critical_kv_reads():
    """Qwen2's configuration leaves head_dim implicit; CriticalKV reads config.head_dim. The loaders set it to the
    size Qwen2's attention uses, and CriticalKV then compresses a Qwen2 model through the pipeline."""
    import transformers as tf

    from kvpress_phase.builtin import with_head_dim

    config = tf.Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = tf.Qwen2ForCausalLM(config).eval()
    assert getattr(model.config, "head_dim", None) is None
    ids = torch.randint(0, 64, (1, 120))
    press = build_press(parse_press_spec("critical_kv"), RATIO, 8, None, 0)
    with pytest.raises(AttributeError, match="head_dim"), press(model), torch.no_grad():
        model(ids, past_key_values=DynamicCache())
    with_head_dim(model)
    assert model.config.head_dim == model.model.layers[0].self_attn.head_dim == 16
    cache = DynamicCache()
    with press(model), torch.no_grad():
        model(ids, past_key_values=cache)
    assert cache.layers[0].keys.shape[2] == compute_n_kept(120, RATIO)
