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
