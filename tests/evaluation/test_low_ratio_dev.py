"""The low-ratio dev round's runner (studies/low_ratio_dev.py) runs what docs/preregistration-low-ratio.md fixed."""

from __future__ import annotations

import pytest

from kvpress_phase.cli import build_parser
from kvpress_phase.evaluation.config import EvalConfig
from studies import low_ratio_dev as dev


@pytest.mark.parametrize("name", list(dev.RUNS))
def test_each_run_is_a_valid_eval_of_the_preregistered_design(name):
    a = build_parser().parse_args(dev.eval_command(name)[1:])
    config = EvalConfig(model=a.model, tasks=a.tasks, presses=a.presses, compression_ratios=a.compression_ratios,
                        strides=a.strides, protocol=a.protocol, context_lengths=a.context_lengths,
                        samples=a.samples, seed=a.seed, matched_cache=a.matched_cache, diagnostics=not a.no_diagnostics)
    config.validate()
    model, stride, seed, lengths, tasks = dev.RUNS[name]
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
