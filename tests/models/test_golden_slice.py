"""Committed results replay identically: one sample per task of the real model's pre-registered test split (run 2, question
compressed, 1,024 tokens; committed as it ran, decoded step by step) is computed again with today's code and default
decoding, and every answer and cache length must equal the committed row's. This pins the behaviour of both presses,
every kvpress baseline of the split and the runner while the split is not finished (its frozen defaults must not
move), and checks the fast decoding path against answers it did not produce."""

from __future__ import annotations

import json
import os

import pandas as pd
import pytest

from kvpress_phase import load_builtin_model
from kvpress_phase.evaluation.runner import EvalConfig, read_results, run_evaluation

pytestmark = pytest.mark.real_model

RUN = os.path.join(os.path.dirname(__file__), "..", "..", "outputs", "real-test", "question-1024")


@pytest.mark.parametrize("task", ["niah_multikey", "niah_single"])
def test_a_committed_sample_replays_identically(tmp_path, task):
    if not os.path.exists(os.path.join(RUN, "config.json")):
        pytest.skip("the committed run is not in this checkout")
    with open(os.path.join(RUN, "config.json")) as fh:
        saved = json.load(fh)["config"]
    committed = read_results(RUN)
    golden = committed[(committed.task == task) & (committed.sample_id == 0)]
    config = EvalConfig(**{**saved, "tasks": [task], "samples": 1})
    assert len(golden) == 1120  # every answer of the sample: 3 strides x their phases x 14 presses and ratios
    model, tokenizer = load_builtin_model(name="smollm2")
    replayed = run_evaluation(config, model, tokenizer, str(tmp_path / "replay"), progress=False)
    columns = ["prediction", "cache_length", "score", "offset", "depth"]
    a = golden.set_index("key")[columns].sort_index()
    b = replayed.set_index("key")[columns].sort_index()
    assert list(a.index) == list(b.index)
    pd.testing.assert_frame_equal(a, b, check_dtype=False)
