"""R10's runner (studies/low_ratio_split.py) runs what docs/preregistration-low-ratio.md fixed, and only once the
dev round's choice is frozen there."""

from __future__ import annotations

import pytest

from studies import low_ratio_split as split
from studies import resumable
from studies.common import kvpress_baselines

G = "global_budget:scorer=kvzap"


@pytest.mark.parametrize("name", list(split.RUNS))
def test_each_run_is_a_valid_eval_of_the_preregistered_design(name):
    config = resumable.eval_config(split.eval_command(name, "global_budget:scorer=kvzap_mlp"))
    config.validate()
    model, length, tasks, setting = split.RUNS[name]
    assert config.model == model and config.dtype == "float32" and config.seed == 71
    assert config.strides == [6, 12] and config.samples == 8 and config.protocol == "offset" and config.matched_cache
    assert config.compression_ratios == [0.25, 0.5, 0.75]
    assert config.compress_question == (setting == "aware")
    assert config.tasks == (["niah_single", "niah_multikey"] if model == "smollm2"
                            else ["niah_multiquery", "qa_multi_doc"])
    assert config.context_lengths == [int(length)] and (model != "qwen2.5-coder-0.5b" or length == "2048")
    labels = set(config.presses)
    assert {"global_budget:scorer=kvzap_mlp", G, "phase_aware", "no_press", "chunked_stride"} <= labels
    assert set(kvpress_baselines()) <= labels


def test_four_smollm2_runs_and_two_qwen_runs():
    models = [model for model, *_ in split.RUNS.values()]
    assert models.count("smollm2") == 4 and models.count("qwen2.5-coder-0.5b") == 2


def test_the_recommendation_is_read_from_the_frozen_section_only():
    text = ("# x\n\n## Candidates\n\n- recommendation: `phase_aware`\n\n## Frozen configuration\n\n(later)\n\n"
            "## Deviations\n")
    with pytest.raises(ValueError, match="freezes no recommendation"):
        split.frozen_recommendation(text)
    frozen = text.replace("(later)", "- recommendation: `global_budget:scorer=kvzap:n_local=64`")
    assert split.frozen_recommendation(frozen) == "global_budget:n_local=64:scorer=kvzap"
    with pytest.raises(ValueError):
        split.frozen_recommendation(text.replace("(later)", "- recommendation: `no_such_press`"))
    assert split.presses(G)[0] == G and len(split.presses(G)) == len(set(split.presses(G)))


def test_run_refuses_to_start_before_the_choice_is_frozen(monkeypatch, capsys):
    original = split.frozen_recommendation
    monkeypatch.setattr(split, "frozen_recommendation",
                        lambda: original("## Frozen configuration\n\n(later)\n"))
    with pytest.raises(SystemExit) as exc:
        split.main(["run", "--no-commit"])
    assert exc.value.code == 2 and "freezes no recommendation" in capsys.readouterr().err
