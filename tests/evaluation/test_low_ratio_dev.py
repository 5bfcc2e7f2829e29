"""The low-ratio dev round's runner (studies/low_ratio_dev.py) runs what docs/preregistration-low-ratio.md fixed."""

from __future__ import annotations

import pytest

from studies import low_ratio_dev as dev
from studies import resumable


@pytest.mark.parametrize("name", list(dev.RUNS))
def test_each_run_is_a_valid_eval_of_the_preregistered_design(name):
    config = resumable.eval_config(dev.eval_command(name))
    config.validate()
    model, stride, seed, lengths, tasks = dev.RUNS[name]
    assert config.model == model and config.dtype == "float32"
    assert (config.strides, config.seed) == ([stride], {8: 10, 12: 15}[stride])  # R9's dev texts
    assert config.compression_ratios == [0.25, 0.5, 0.75] and config.samples == 4 and config.protocol == "offset"
    assert config.tasks == (["niah_single", "niah_multikey"] if model == "smollm2"
                            else ["niah_multiquery", "qa_multi_doc"])
    assert config.context_lengths == ([1024, 2048] if model == "smollm2" else [2048])


def test_every_press_is_named_in_the_preregistration():
    text = open(dev.PREREGISTRATION).read()
    for press in dev.PRESSES:
        short = press.replace("global_budget:scorer=kvzap_keydiff_", "_").replace("global_budget:scorer=kvzap:", "...:")
        assert f"`{press}`" in text or f"`{short}`" in text, press
