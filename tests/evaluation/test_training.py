"""The built-in model's training script runs end to end on a tiny configuration, and resumes."""

from __future__ import annotations

import json

import pytest

from transformers import AutoModelForCausalLM, AutoTokenizer

from kvpress_phase.evaluation.train_builtin_model import TrainConfig, make_batch, train
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

    import kvpress_phase.evaluation.train_builtin_model as trainer

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
