"""README.md's "Use" snippet runs as written, on the built-in model."""

from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _use_snippet() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        text = fh.read()
    section = text.split("\n## Use\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_use_snippet_loads_its_model_and_data_first():
    snippet = _use_snippet()
    first = snippet.index("pipeline(")
    assert snippet.index("model, tokenizer = load_builtin_model()") < first
    assert 'load_builtin_model(name="smollm2")' in snippet[:first]  # the real model, one line away
    assert re.search(r"^context, question = ", snippet[:first], re.M)


@pytest.mark.slow
def test_the_use_snippet_runs_on_the_built_in_model():
    from kvpress_phase import ChunkedStridePress, PhaseAwarePress
    from kvpress_phase.core.phase import compressed_length

    namespace: dict = {}
    exec(compile(_use_snippet(), "README.md (Use)", "exec"), namespace)  # noqa: S102
    assert isinstance(namespace["answer"], str)
    press = namespace["press"]
    n = namespace["tokenizer"](namespace["context"], return_tensors="pt").input_ids.shape[1]
    # the press recorded the prefill it compressed: the context (and its BOS or chat template), as many entries as
    # compressed_length says for that many tokens
    stats = press.stats[0]
    assert stats.seq_len >= n and stats.compressed_length == compressed_length(stats.seq_len, 8, 0.5)
    assert namespace["pooled"].mode == "pool" and namespace["zipped"].compression_ratio == 0.5
    # the defaults compress nothing (README: a ratio must be given)
    assert ChunkedStridePress().compression_ratio == 0.0 and PhaseAwarePress().compression_ratio == 0.0
