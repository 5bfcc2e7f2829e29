"""SnapKVScorer: kvpress's SnapKV scores where kvpress handles the model, and scores at all where it does not."""

import pytest
import torch
from kvpress import SnapKVPress
from transformers import DynamicCache

from tiny_models import tiny_model
from kvpress_phase import PhaseAwarePress
from kvpress_phase.presses.scorers import SnapKVScorer


def _scores(model, scorer, n=90):
    """Scores of ``scorer`` on every layer, computed inside a real prefill (kvpress's hook arguments)."""
    got = {}

    class Spy(PhaseAwarePress):
        def compress(self, module, hidden_states, keys, values, attentions, kwargs):
            got[module.layer_idx] = scorer.score(module, hidden_states, keys, values, attentions, kwargs)
            return keys, values

    ids = torch.randint(4, 60, (2, n), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), Spy(0.5)(model):
        model.model(input_ids=ids, past_key_values=DynamicCache())
    return got


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_same_scores_as_kvpress_snapkv_with_full_rotary(family):
    model = tiny_model(family)
    ours = _scores(model, SnapKVScorer(window_size=16))
    theirs = _scores(model, SnapKVPress(window_size=16))
    assert ours.keys() == theirs.keys()
    for layer in ours:
        torch.testing.assert_close(ours[layer], theirs[layer])


def test_partial_rotary_models_are_scored():
    model = tiny_model("phi3")  # partial_rotary_factor 0.5
    with pytest.raises(RuntimeError):
        _scores(model, SnapKVPress(window_size=16))
    scores = _scores(model, SnapKVScorer(window_size=16))
    assert all(torch.isfinite(s).all() and s.shape == (2, model.config.num_key_value_heads, 90)
               for s in scores.values())


def test_contexts_shorter_than_the_window_are_scored_and_compressed():
    """kvpress's SnapKV refuses a context of at most window_size tokens; the default press still compresses it."""
    model = tiny_model("llama")
    scores = _scores(model, SnapKVScorer(), n=50)  # window_size 64 > 50 tokens
    assert all(s.shape == (2, 2, 50) and torch.isfinite(s).all() for s in scores.values())
    press = PhaseAwarePress(0.5)
    ids = torch.randint(4, 60, (1, 50), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model.model(input_ids=ids, past_key_values=cache)
    assert cache.layers[0].keys.shape[2] == press.stats[0].compressed_length < 50


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_decoding_scores_are_the_newest_query_attention_over_the_block(family):
    """While decoding, SnapKVScorer scores a block by the current step's query: its attention restricted to the
    block's keys (renormalised), averaged over each KV head's query heads."""
    model = tiny_model(family)
    seen = {}

    class Spy(PhaseAwarePress):
        def compress(self, module, hidden_states, keys, values, attentions, kwargs):
            if module.layer_idx == 0:
                seen.update(module=module, hidden=hidden_states, keys=keys, pe=kwargs["position_embeddings"])
            return keys, values

    ids = torch.randint(4, 60, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), Spy(0.5)(model):
        model.model(input_ids=ids, past_key_values=DynamicCache())
    module, keys = seen["module"], seen["keys"]
    block = keys[:, :, 10:26]
    with torch.no_grad():
        got = SnapKVScorer.decoding_scores(module, seen["hidden"], block, seen["pe"])
        # reference: kvpress-style window attention of the last query over (block + its own key), renormalised
        full = SnapKVScorer.compute_window_attention(module, seen["hidden"], torch.cat((block, keys[:, :, -1:]), 2),
                                                     1, seen["pe"])
    full = full / full.sum(-1, keepdim=True)
    heads = model.config.num_key_value_heads
    expected = full.view(2, heads, -1, 16).mean(2)
    assert got.shape == (2, heads, 16)
    torch.testing.assert_close(got, expected)
    assert not torch.allclose(got, got.mean(-1, keepdim=True))  # an informative score, not a constant


def test_scores_under_autograd_are_differentiable_and_the_same():
    """Fine-tuning runs the press with gradients on: the scores then come from kvpress's differentiable computation
    and equal the in-place one's."""
    model = tiny_model("llama")
    seen = {}

    class Spy(PhaseAwarePress):
        def compress(self, module, hidden_states, keys, values, attentions, kwargs):
            if module.layer_idx == 0:
                seen.update(module=module, hidden=hidden_states, keys=keys, values=values, kwargs=kwargs)
            return keys, values

    ids = torch.randint(4, 60, (2, 90), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), Spy(0.5)(model):
        model.model(input_ids=ids, past_key_values=DynamicCache())
    scorer = SnapKVScorer(window_size=16)
    args = (seen["module"], seen["hidden"], seen["keys"], seen["values"], None, seen["kwargs"])
    with torch.no_grad():
        plain = scorer.score(*args)
    keys = seen["keys"].clone().requires_grad_(True)
    scored = scorer.score(seen["module"], seen["hidden"], keys, seen["values"], None, seen["kwargs"])
    assert scored.requires_grad
    scored.sum().backward()
    assert keys.grad is not None and torch.isfinite(keys.grad).all()
    torch.testing.assert_close(scored.detach(), plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_keydiff_scorer_equals_kvpress_keydiff(dtype):
    from kvpress import KeyDiffPress

    from kvpress_phase.presses.scorers import KeyDiffScorer, token_scores

    g = torch.Generator().manual_seed(3)
    keys = (torch.randn(2, 3, 257, 16, generator=g) * torch.rand(2, 3, 257, 1, generator=g) * 4).to(dtype)
    keys[0, 1, 5] = 0  # a zero key: both clamp its norm
    expected = KeyDiffPress().score(None, None, keys.float(), keys.float(), None, {})
    lean = token_scores(KeyDiffScorer(), None, None, keys, keys, None, {})
    assert lean.dtype == torch.float32 and lean.shape == (2, 3, 257)
    torch.testing.assert_close(lean, expected, rtol=0, atol=1e-5)
    assert not torch.equal(lean, token_scores(KeyDiffScorer(), None, None, keys.flip(2), keys, None, {}))


def test_kvpress_keydiff_is_asked_through_its_own_score(monkeypatch):
    """No special case: kvpress's KeyDiffPress passed as a scorer is asked through its own score, so a change to
    it in kvpress takes effect here."""
    from kvpress import KeyDiffPress

    from kvpress_phase.presses.scorers import token_scores

    keys = torch.randn(1, 2, 40, 8)
    monkeypatch.setattr(KeyDiffPress, "score", lambda self, m, h, k, v, a, kw: k[..., 0] * 7)
    assert torch.equal(token_scores(KeyDiffPress(), None, None, keys, keys, None, {}), keys[..., 0] * 7)


def test_keydiff_is_the_default_scorer_and_the_name():
    from kvpress import KeyDiffPress

    from kvpress_phase import PhaseAwarePress
    from kvpress_phase.presses.scorers import KeyDiffScorer, scorer_from_name

    assert type(PhaseAwarePress().scorer) is KeyDiffScorer and type(scorer_from_name("keydiff")) is KeyDiffScorer
    assert isinstance(KeyDiffScorer(), KeyDiffPress)


def test_other_scorers_go_through_their_own_score():
    from kvpress import KnormPress

    from kvpress_phase.presses.scorers import token_scores

    keys = torch.randn(1, 2, 40, 8)
    assert torch.equal(token_scores(KnormPress(), None, None, keys, keys, None, {}),
                       KnormPress().score(None, None, keys, keys, None, {}).float())


def test_rank_mix_keeps_the_first_scale_and_mixes_the_order():
    """RankMixScorer: the layer's scores are the first scorer's values, in the mixed order; weight 0 is the first
    scorer's scores exactly, weight 1 the second's order; bad settings are refused by name."""
    from kvpress import KnormPress, RandomPress

    from kvpress_phase.presses.scorers import KeyDiffScorer, RankMixScorer, token_scores

    g = torch.Generator().manual_seed(5)
    keys = torch.randn(2, 3, 50, 8, generator=g) * torch.rand(2, 3, 50, 1, generator=g)
    knorm = KnormPress().score(None, None, keys, keys, None, {}).float()
    keydiff = token_scores(KeyDiffScorer(), None, None, keys, keys, None, {})
    for weight in (0.0, 0.3, 1.0):
        mixed = RankMixScorer(first=KnormPress(), second=KeyDiffScorer(), weight=weight).score(
            None, None, keys, keys, None, {})
        assert torch.equal(mixed.reshape(2, -1).sort(dim=1).values, knorm.reshape(2, -1).sort(dim=1).values)
        if weight == 0.0:
            assert torch.equal(mixed, knorm)
        if weight == 1.0:  # KeyDiff's order on Knorm's values
            assert torch.equal(mixed.reshape(2, -1).argsort(1), keydiff.reshape(2, -1).argsort(1))
    middle = RankMixScorer(first=KnormPress(), second=KeyDiffScorer(), weight=0.3).score(None, None, keys, keys,
                                                                                         None, {})
    assert not torch.equal(middle, knorm)
    with pytest.raises(ValueError, match="weight must be in"):
        RankMixScorer(first=KnormPress(), second=RandomPress(), weight=1.5)
    with pytest.raises(ValueError, match="second must be a kvpress ScorerPress"):
        RankMixScorer(first=KnormPress(), second=None)


@pytest.mark.real_model
@pytest.mark.parametrize("name", ["kvzap_mlp", "kvzap_keydiff_50"])
def test_the_low_ratio_candidates_run_through_the_pipeline(name):
    """The pre-registered candidates (docs/preregistration-low-ratio.md) as scorers of GlobalBudgetPress on SmolLM2:
    the MLP scorer shipped for the model is loaded, and the budget is spent exactly."""
    from transformers import DynamicCache, pipeline

    from kvpress_phase import GlobalBudgetPress, PhaseAwarePress, cache_summary, load_builtin_model
    from kvpress_phase.evaluation.tasks import generate

    model, tokenizer = load_builtin_model(name="smollm2")
    example = generate("niah_single", tokenizer, n_samples=1, context_length=400, stride=8, phases=[0])[0]
    press = GlobalBudgetPress(PhaseAwarePress(0.5, scorer=name))
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    answer = pipe(example["context"], question=example["question"], press=press, cache=DynamicCache(),
                  max_new_tokens=4)["answer"]
    assert isinstance(answer, str)
    if name == "kvzap_mlp":
        assert press.press.scorer.model_type == "mlp" and press.press.scorer.kvzap_model_name.endswith("mlp")
