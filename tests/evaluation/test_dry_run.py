"""``kvpress-phase eval --dry-run`` (:func:`kvpress_phase.evaluation.runner.plan_table`): the plan of a run counted
without a model: the answers a run holds and plans, and a bound on the caches it decodes."""

from __future__ import annotations

import os

import pytest

from kvpress_phase import cli
from kvpress_phase.evaluation import decoding
from kvpress_phase.evaluation.config import EvalConfig, planned_answers
from kvpress_phase.evaluation.runner import plan_table, run_evaluation
from kvpress_phase.evaluation.store import pack_run, read_results
from tiny_models import tiny_model


@pytest.fixture(scope="module")
def model(word_tokenizer):
    return tiny_model("qwen3", vocab_size=len(word_tokenizer), seed=3)


def _config(**kw):
    base = dict(tasks=["niah_single", "niah_multikey"], presses=["no_press", "chunked_stride", "knorm"],
                compression_ratios=[0.5], strides=[4], context_lengths=[128], samples=3, seed=1, protocol="offset",
                diagnostics=False)
    base.update(kw)
    return EvalConfig(**base)


def test_a_fresh_plan_counts_prompts_answers_and_distinct_compressions(word_tokenizer, tmp_path):
    table = plan_table(_config(), word_tokenizer, str(tmp_path / "nothing-yet"))
    assert list(table.task) == ["niah_single", "niah_multikey"]
    assert table.answers.sum() == planned_answers(_config()) == 2 * 3 * 4 * 3  # tasks x samples x phases x presses
    assert (table.held == 0).all() and (table.left == table.answers).all()
    # the offset protocol: one prompt per sample, whose phases are grid offsets; a press with a grid offset
    # compresses it once per phase, knorm and the uncompressed control once for all phases
    assert list(table.prompts) == list(table.prompts_left) == [3, 3]
    assert list(table.decodes_left) == [3 * (4 + 1 + 1)] * 2
    assert table.attrs["prefills_left"] == 2 * 3
    # a sample's strides share its text under the offset protocol: prefilled once for both
    two = plan_table(_config(strides=[4, 8]), word_tokenizer)
    assert two.prompts.sum() == 2 * 2 * 3 and two.attrs["prefills_left"] == 2 * 3
    # the prefix protocol moves the needle instead: a prompt per phase, every answer its own compression
    prefix = plan_table(_config(protocol="prefix"), word_tokenizer)
    assert list(prefix.prompts) == [12, 12] and list(prefix.decodes_left) == list(prefix.answers) == [36, 36]
    assert not os.path.exists(tmp_path / "nothing-yet")


def test_the_plan_follows_a_run_and_bounds_its_decodes(model, word_tokenizer, tmp_path, monkeypatch):
    config, out = _config(), str(tmp_path / "run")
    run_evaluation(config, model, word_tokenizer, out, progress=False, max_units=1)
    partial = plan_table(config, word_tokenizer, out)
    held = len(read_results(out))
    assert partial.held.sum() == held > 0 and partial.left.sum() == partial.answers.sum() - held > 0
    assert partial.prompts_left.sum() == partial.prompts.sum() - 1  # the one unit run was one prompt
    assert partial.attrs["prefills_left"] == partial.prompts_left.sum()

    decoded = []
    real = decoding.decode_tokens

    def counting(model, caches, *args, **kw):
        decoded.append(len(caches))
        return real(model, caches, *args, **kw)

    monkeypatch.setattr(decoding, "decode_tokens", counting)
    run_evaluation(config, model, word_tokenizer, out, progress=False)
    assert 0 < sum(decoded) <= partial.decodes_left.sum()
    done = plan_table(config, word_tokenizer, out)
    assert (done.left == 0).all() and (done.decodes_left == 0).all() and (done.held == done.answers).all()
    pack_run(out)  # a packed run's answers are read from its Parquet file
    packed = plan_table(config, word_tokenizer, out)
    assert packed[["answers", "held", "left", "decodes_left"]].equals(done[["answers", "held", "left", "decodes_left"]])


def test_a_folder_of_another_configuration_is_named(model, word_tokenizer, tmp_path):
    out = str(tmp_path / "run")
    run_evaluation(_config(tasks=["niah_single"]), model, word_tokenizer, out, progress=False, max_units=1)
    with pytest.raises(ValueError, match="holds a run with"):
        plan_table(_config(), word_tokenizer, out)


def test_the_command_prints_the_plan_and_writes_nothing(model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["eval", "--model", model_dir, "--tasks", "niah_single", "--presses", "no_press,chunked_stride",
            "--compression-ratios", "0.5", "--strides", "4", "--context-lengths", "128", "--samples", "2",
            "--protocol", "offset", "--output-dir", str(out), "--dry-run"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "decodes_left" in printed and "16 answers planned" in printed and "0 held" in printed
    assert "2 prefills" in printed
    assert not out.exists()
    os.makedirs(out)
    with open(out / "config.json", "w") as fh:
        fh.write('{"config": {"samples": 9}, "fingerprint": "0"}')
    assert cli.main(argv) == 2
    assert "holds a run with" in capsys.readouterr().err
