"""The built-in model's training script runs end to end on a tiny configuration, and resumes."""

from __future__ import annotations

import json

import pytest

from transformers import AutoModelForCausalLM, AutoTokenizer

from kvpress_phase.training.train_builtin_model import TrainConfig, lr_at, main, make_batch, step_plan, train
from kvpress_phase.evaluation.tokenizer import build_tokenizer


def tiny_config(steps):
    return TrainConfig(steps=steps, batch_tokens=512, lengths=[128, 160], copy_fraction=[0.5, 0.3],
                       max_stage_steps=[2, 100], window=2,
                       advance_at=0.0, warmup=2,
                       hidden_size=32, layers=1, heads=2, kv_heads=1, head_dim=16, intermediate_size=64)


def test_batches_are_a_function_of_seed_and_step():
    tok = build_tokenizer()
    a = make_batch(tok, tiny_config(1), 7, 128)
    b = make_batch(tok, tiny_config(1), 7, 128)
    c = make_batch(tok, tiny_config(1), 8, 128)
    assert a[0].equal(b[0]) and a[2].equal(b[2]) and not a[0].equal(c[0])
    assert (a[2] != -100).any()  # some tokens carry the loss


def test_short_training_run_exports_a_loadable_model(tmp_path):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "model")
    train(tiny_config(3), out, ckpt, checkpoint_every=2, progress=False)
    log = json.loads((tmp_path / "model" / "training_log.json").read_text())
    assert [h["step"] for h in log["history"]] == [0, 1, 2]
    assert log["history"][-1]["stage"] == 1  # the curriculum advanced
    assert (tmp_path / "model" / "loss_curve.png").exists()
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert model.config.vocab_size == len(tok)


def test_interrupted_training_resumes_where_it_stopped(tmp_path, monkeypatch):
    train(tiny_config(4), str(tmp_path / "ref"), str(tmp_path / "ref_ckpt"), checkpoint_every=2, progress=False)
    reference = json.loads((tmp_path / "ref" / "training_log.json").read_text())["history"]

    import kvpress_phase.training.train_builtin_model as trainer

    real = trainer.make_batch

    def crash_at_step_3(tokenizer, config, step, *args):
        if step == 3:
            raise KeyboardInterrupt
        return real(tokenizer, config, step, *args)

    monkeypatch.setattr(trainer, "make_batch", crash_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_config(4), str(tmp_path / "out"), str(tmp_path / "ckpt"), checkpoint_every=2, progress=False)
    monkeypatch.setattr(trainer, "make_batch", real)
    train(tiny_config(4), str(tmp_path / "out"), str(tmp_path / "ckpt"), checkpoint_every=2, progress=False)
    resumed = json.loads((tmp_path / "out" / "training_log.json").read_text())["history"]
    assert [h["step"] for h in resumed] == [0, 1, 2, 3]
    for a, b in zip(resumed, reference):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)


def test_export_only_writes_the_checkpoint_as_it_is(tmp_path):
    train(tiny_config(2), str(tmp_path / "a"), str(tmp_path / "ckpt"), checkpoint_every=1, progress=False)
    train(tiny_config(2), str(tmp_path / "b"), str(tmp_path / "ckpt"), progress=False, export_only=True)
    log = json.loads((tmp_path / "b" / "training_log.json").read_text())
    assert log["steps_done"] == 2
    with pytest.raises(FileNotFoundError):
        train(tiny_config(2), str(tmp_path / "c"), str(tmp_path / "none"), progress=False, export_only=True)


def test_extension_switches_lengths_mix_and_restarts_the_schedule(tmp_path):
    config = TrainConfig(**{**tiny_config(5).__dict__, "extend_from": 3, "extend_lengths": [96], "extend_warmup": 2,
                            "extend_copy_fraction": 0.0,
                            "extend_task_weights": {"niah_single": 1.0, "niah_multikey": 0.0}})
    assert step_plan(config, 0, 2)[:2] == (128, 0.5) and step_plan(config, 1, 3) == (96, 0.0, config.extend_task_weights)
    # warm restart: the extension's first step is back at the start of its own warm-up
    assert lr_at(3, config) == pytest.approx(config.extend_lr / 2)
    assert lr_at(4, config) == pytest.approx(config.extend_lr)
    train(config, str(tmp_path / "model"), str(tmp_path / "ckpt"), progress=False)
    history = json.loads((tmp_path / "model" / "training_log.json").read_text())["history"]
    assert [h["length"] for h in history[3:]] == [96, 96]
    assert [h["stage"] for h in history[3:]] == [2, 2]  # the extension is logged as a stage of its own
    _, _, _, kinds = make_batch(build_tokenizer(), config, 3, 96, 0.0, config.extend_task_weights)
    assert set(kinds) == {"niah_single"}


@pytest.mark.parametrize("change, word", [
    ({"copy_fraction": [0.5]}, "copy_fraction"),
    ({"extend_lengths": []}, "extend_lengths"),
    ({"extend_task_weights": {"niah_single": -1.0}}, "extend_task_weights"),
    ({"task_weights": {"niah_single": 0.0}}, "task_weights"),
    ({"extend_from": 0}, "extend_from"),
])
def test_bad_training_configuration_is_a_value_error(change, word):
    with pytest.raises(ValueError, match=word):
        TrainConfig(**{**tiny_config(2).__dict__, **change})


def test_command_line_rejects_a_bad_configuration_with_exit_code_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--lengths", "128,256", "--steps", "1"])
    assert info.value.code == 2
    assert "one value per stage" in capsys.readouterr().err
