"""The one module that drives kvpress's KVzipPress (kvpress_phase/presses/kvzip_adapter.py): kvpress still has every
internal it relies on, no other source file reaches into the press, and its scores and masks are the ones kvpress
computes inside its own context manager."""

from __future__ import annotations

import inspect
import pathlib
import re

import pytest
import torch
import transformers
from kvpress import KVzipPress
from transformers import DynamicCache

from kvpress_phase.evaluation.prompting import context_token_ids
from kvpress_phase.evaluation.tokenizer import build_tokenizer
from kvpress_phase.presses import kvzip_adapter
from kvpress_phase.presses.kvzip_adapter import (KVZIP_INTERNALS, MASKED_KEYS, kvzip_masks, kvzip_scores,
                                                 missing_internals)
from kvpress_phase.presses.scorers import KVzipScorer
from tiny_models import tiny_model

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCE_FOLDERS = ("kvpress_phase", "evaluation", "training", "cli", "kernels", "benchmarks", "studies")
SHARED_NAMES = {"context_length", "prepare", "forward_hook"}
"""Names of :data:`KVZIP_INTERNALS` that other code also gives its own attributes and methods."""


def test_kvzip_press_still_has_every_internal_the_adapter_uses():
    """Fails when kvpress renames or drops a KVzipPress internal the adapter sets, reads or calls."""
    assert missing_internals() == []
    for name in ("prepare", "forward_hook", "compress_post"):
        assert callable(getattr(KVzipPress, name))
    assert list(inspect.signature(KVzipPress.prepare).parameters)[:3] == ["self", "model", "tokenizer"]
    assert list(inspect.signature(KVzipPress.forward_hook).parameters) == ["self", "module", "input", "kwargs",
                                                                           "output"]
    assert list(inspect.signature(KVzipPress.compress_post).parameters) == ["self", "model"]
    assert MASKED_KEYS in inspect.getsource(KVzipPress.compress_post)


def test_missing_internals_names_what_a_press_lacks():
    class Older:
        prefix_length = 0
        score_val = None

        def __init__(self, compression_ratio):
            self.compression_ratio = compression_ratio

    assert missing_internals(Older) == [n for n in KVZIP_INTERNALS if n not in ("prefix_length", "score_val")]


def test_no_other_source_file_reaches_into_kvzip_press():
    names = [n for n in KVZIP_INTERNALS if n not in SHARED_NAMES]
    pattern = re.compile(r"\.(" + "|".join(map(re.escape, names)) + r")\b")
    adapter = pathlib.Path(kvzip_adapter.__file__).resolve()
    found = []
    for folder in SOURCE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.resolve() == adapter:
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert found == []


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_model("llama", vocab_size=len(tok)).eval()


def _ids(tok, n: int = 40) -> torch.Tensor:
    text = " ".join(["the special magic number for apple is 48 21 and the rest follows"] * 8)
    return torch.tensor([context_token_ids(tok, text)[:n]])


@pytest.mark.parametrize("plus", [False, True])
def test_scores_and_masks_are_those_of_kvpress_own_run(model, tok, monkeypatch, plus):
    """kvzip_scores over a copy of a prefilled cache (left unchanged) equals the score_val kvpress's KVzipPress
    computes around a prefill, and kvzip_masks masks what it masks."""
    ids = _ids(tok)
    cache = DynamicCache()
    with torch.no_grad():
        model.model(input_ids=ids, past_key_values=cache)
    before = [layer.keys.clone() for layer in cache.layers]
    ours = kvzip_scores(model, ids, cache, tok, plus=plus)
    assert all(torch.equal(a, layer.keys) for a, layer in zip(before, cache.layers))
    assert ours.shape == (model.config.num_hidden_layers, 1, model.config.num_key_value_heads, ids.shape[1])
    masks = kvzip_masks(model, ours, 0.5)
    assert all(getattr(layer.self_attn, MASKED_KEYS, None) is None for layer in model.model.layers)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tok)
    press = kvzip_adapter.quiet_kvzip_press(0.5, kvzip_plus_normalization=plus)
    seen = []
    ranked = press.compress_post
    press.compress_post = lambda m: (seen.append(press.score_val.clone()), ranked(m))
    try:
        with torch.no_grad(), press(model):
            model.model(input_ids=ids, past_key_values=DynamicCache())
        assert torch.equal(ours, seen[0])
        for i, layer in enumerate(model.model.layers):
            _, heads, seqs = layer.self_attn.masked_key_indices
            assert torch.equal(heads, masks[i][0]) and torch.equal(seqs, masks[i][1])
    finally:
        for layer in model.model.layers:
            layer.self_attn.masked_key_indices = None
    assert torch.equal(KVzipScorer(kvzip_plus_normalization=plus, tokenizer=tok).compute(model, ids, cache), ours)


def test_gemma3_is_refused_by_name():
    gemma = tiny_model("gemma3", vocab_size=64)
    with pytest.raises(ValueError, match="model: kvpress's KVzipPress does not support Gemma3"):
        kvzip_scores(gemma, torch.zeros(1, 4, dtype=torch.long), DynamicCache())
