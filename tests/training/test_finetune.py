"""Compression-aware fine-tuning (``kvpress-phase train``) on tiny config-built models, in seconds."""

from __future__ import annotations

import json
from contextlib import nullcontext

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from kvpress_phase import cli
from kvpress_phase.training.cli import config_from_args
from kvpress_phase.training.config import FinetuneConfig
from kvpress_phase.training.data import ExampleSource
from kvpress_phase.training.finetune import finetune
from kvpress_phase.training.step import forward_group
from kvpress_phase.evaluation.tasks import generate, training_example
from kvpress_phase.evaluation.tokenizer import build_tokenizer, save_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def tiny_lm(tok, seed=0):
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         tie_word_embeddings=True)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok):
    path = tmp_path_factory.mktemp("tiny")
    tiny_lm(tok).save_pretrained(path)
    save_tokenizer(tok, str(path))
    return str(path)


def tiny_config(**change):
    base = dict(tasks={"niah_single": 1.0}, context_lengths=[128], strides=[4], ratios=[0.5], steps=4,
                batch_size=2, lr=3e-3, warmup=1)
    return FinetuneConfig(**{**base, **change})


# ---------------------------------------------------------------------------------------------- gradients
def test_gradients_flow_through_the_pooled_cache(tok):
    model = tiny_lm(tok)
    config = tiny_config()
    press = config.build_press(0.5, 4, 1)
    pooled = {}
    compress = press.compress

    def recording(module, *args):
        keys, values = compress(module, *args)
        keys.retain_grad()
        values.retain_grad()
        pooled[module.layer_idx] = (args[1].shape[2], keys, values)
        return keys, values

    press.compress = recording
    examples = [training_example("niah_single", tok, seed, context_length=128) for seed in range(2)]
    loss, em, cache_length = forward_group(model, examples, press, tok.pad_token_id, nullcontext)
    loss.backward()
    assert cache_length < 128 and em.shape == (2,)
    for layer, (seq_len, keys, values) in pooled.items():
        assert seq_len == 128 and keys.shape[2] == cache_length  # the cache holds the pooled entries
        assert keys.grad is not None and keys.grad.abs().sum() > 0, layer  # the loss reaches them
        assert values.grad is not None and values.grad.abs().sum() > 0, layer
    for layer in model.model.layers:  # and, through the pooling, the projections that made them
        assert layer.self_attn.k_proj.weight.grad.abs().sum() > 0
        assert layer.self_attn.v_proj.weight.grad.abs().sum() > 0


def test_the_press_changes_the_loss_and_the_gradient(tok):
    examples = [training_example("niah_single", tok, seed, context_length=128) for seed in range(2)]
    config = tiny_config()
    out = {}
    for name, press in [("none", None), ("pooled", config.build_press(0.75, 4, 0))]:
        model = tiny_lm(tok)
        loss, _, cache_length = forward_group(model, examples, press, tok.pad_token_id,
                                              nullcontext)
        loss.backward()
        out[name] = (float(loss.detach()), cache_length, model.model.layers[1].self_attn.k_proj.weight.grad.clone())
    assert out["none"][1] == 128 and out["pooled"][1] < 128
    assert out["none"][0] != pytest.approx(out["pooled"][0], rel=1e-6)
    assert not torch.allclose(out["none"][2], out["pooled"][2])


def test_loss_is_only_on_answer_tokens_and_positions_continue_from_the_context(tok, monkeypatch):
    model = tiny_lm(tok)
    examples = [training_example("niah_single", tok, 3, context_length=128)]
    seen = {}
    forward = LlamaForCausalLM.forward

    def spy(self, *args, **kwargs):
        seen.setdefault("position_ids", kwargs.get("position_ids"))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "forward", spy)
    loss, _, _ = forward_group(model, examples, None, tok.pad_token_id, nullcontext)
    tail = len(examples[0]["input_ids"]) - 128
    assert seen["position_ids"][0].tolist() == list(range(128, 128 + tail))
    # the summed loss equals a plain forward's loss summed over the answer tokens and EOS
    ids = torch.tensor([examples[0]["input_ids"]])
    labels = torch.where(torch.tensor([examples[0]["loss_mask"]]).bool(), ids, -100)
    monkeypatch.setattr(LlamaForCausalLM, "forward", forward)
    full = model(input_ids=ids, labels=labels).loss * sum(examples[0]["loss_mask"])
    assert float(loss.detach()) == pytest.approx(float(full.detach()), rel=1e-4)


# ---------------------------------------------------------------------------------------------- training
def test_a_few_steps_with_the_press_reduce_the_loss(tok, tmp_path):
    config = tiny_config(steps=24, batch_size=4, ratios=[0.5, 0.75], offset_mode="random")
    log = finetune(config, str(tmp_path / "out"), str(tmp_path / "ckpt"), model=tiny_lm(tok), tokenizer=tok,
                   progress=False)
    losses = [h["loss"] for h in log["history"]]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.3
    assert all(c < 128 for h in log["history"] for c in h["cache_lengths"])  # every step was compressed
    assert {o for h in log["history"] for o in h["offsets"]} == {0, 1, 2, 3}  # random offsets cover the stride
    saved = json.loads((tmp_path / "out" / "training_log.json").read_text())
    assert saved["steps_done"] == 24 and saved["config"]["ratios"] == [0.5, 0.75]
    assert (tmp_path / "out" / "loss_curve.png").exists()


def test_resume_gives_the_uninterrupted_run(tok, tmp_path, monkeypatch):
    config = tiny_config(steps=5, grad_accum=2, context_lengths=[128, 160], strides=[4, 8])
    reference = finetune(config, str(tmp_path / "ref"), str(tmp_path / "ref_ckpt"), model=tiny_lm(tok),
                         tokenizer=tok, progress=False, checkpoint_every=2)

    real = ExampleSource.micro_batch

    def crash_at_step_3(self, step, micro):
        if step == 3:
            raise KeyboardInterrupt
        return real(self, step, micro)

    monkeypatch.setattr(ExampleSource, "micro_batch", crash_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        finetune(config, str(tmp_path / "out"), str(tmp_path / "ckpt"), model=tiny_lm(tok), tokenizer=tok,
                 progress=False, checkpoint_every=2)
    monkeypatch.setattr(ExampleSource, "micro_batch", real)
    resumed = finetune(config, str(tmp_path / "out"), str(tmp_path / "ckpt"), model=tiny_lm(tok), tokenizer=tok,
                       progress=False, checkpoint_every=2)
    assert [h["step"] for h in resumed["history"]] == [0, 1, 2, 3, 4]
    for a, b in zip(resumed["history"], reference["history"]):
        assert (a["ratios"], a["strides"], a["offsets"], a["lengths"]) == (b["ratios"], b["strides"], b["offsets"],
                                                                           b["lengths"])
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    ref_model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ref"))
    out_model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    for (name, a), b in zip(ref_model.state_dict().items(), out_model.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), name


def test_a_time_limited_call_pauses_and_the_next_one_finishes_the_same_run(model_dir, tmp_path, capsys):
    common = ["train", "--model", model_dir, "--tasks", "niah_single", "--context-lengths", "128", "--strides", "4",
              "--steps", "3", "--batch-size", "2", "--no-progress", "--checkpoint-every", "100"]
    args = common + ["--output-dir", str(tmp_path / "out"), "--checkpoint-dir", str(tmp_path / "ckpt")]
    assert cli.main(args + ["--max-minutes", "1e-6"]) == 3  # one step, a checkpoint, then a pause
    assert "paused at step 1 of 3" in capsys.readouterr().out
    assert not (tmp_path / "out" / "training_log.json").exists()
    assert cli.main(args) == 0
    paused = json.loads((tmp_path / "out" / "training_log.json").read_text())["history"]
    assert cli.main(common + ["--output-dir", str(tmp_path / "ref"), "--checkpoint-dir", str(tmp_path / "ref_ckpt")]) == 0
    reference = json.loads((tmp_path / "ref" / "training_log.json").read_text())["history"]
    assert [h["loss"] for h in paused] == pytest.approx([h["loss"] for h in reference], rel=1e-5)


def test_a_checkpoint_of_another_configuration_is_refused(tok, tmp_path):
    finetune(tiny_config(steps=1), str(tmp_path / "a"), str(tmp_path / "ckpt"), model=tiny_lm(tok), tokenizer=tok,
             progress=False)
    with pytest.raises(ValueError, match="another training configuration"):
        finetune(tiny_config(steps=1, lr=1e-3), str(tmp_path / "b"), str(tmp_path / "ckpt"), model=tiny_lm(tok),
                 tokenizer=tok, progress=False)


def test_fine_tuning_from_a_path_exports_a_model_the_evaluation_loads(model_dir, tmp_path):
    out = tmp_path / "ft"
    finetune(tiny_config(steps=2, model=model_dir, press="phase_aware"), str(out), str(tmp_path / "ckpt"),
             progress=False)
    model = AutoModelForCausalLM.from_pretrained(str(out))
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert model.config.vocab_size == len(tokenizer)
    assert set(model.state_dict()) == set(AutoModelForCausalLM.from_pretrained(model_dir).state_dict())
    assert cli.main(["eval", "--model", str(out), "--tasks", "niah_single", "--presses", "no_press,chunked_stride",
                     "--strides", "4", "--context-lengths", "128", "--samples", "1", "--output-dir",
                     str(tmp_path / "eval"), "--no-progress", "--bootstrap", "100"]) == 0
    # its card: recipe and training log from training_log.json, accuracy from the evaluation's summary
    from kvpress_phase.training.model_card import render_finetuned

    card = render_finetuned(str(out), [str(tmp_path / "eval")], "tiny")
    assert "2 steps of" in card and "`phase_aware` in the loop" in card
    assert "| niah_single" in card and "chunked_stride" in card.split("## Accuracy under compression")[1]


def test_lora_trains_only_the_adapters_and_exports_a_merged_model(model_dir, tmp_path):
    pytest.importorskip("peft")
    config = tiny_config(steps=3, model=model_dir, lora=True, lora_r=2, lora_targets=["q_proj", "v_proj"], lr=1e-2)
    log = finetune(config, str(tmp_path / "out"), str(tmp_path / "ckpt"), progress=False)
    base = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).state_dict()
    assert 0 < log["n_trainable"] < log["n_parameters"]
    changed = {k for k in base if not torch.allclose(base[k], merged[k])}
    assert changed and all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in changed)
    assert (tmp_path / "out" / "adapter" / "adapter_config.json").exists()
    # the checkpoint holds the adapters, not the frozen base model
    ckpt = torch.load(tmp_path / "ckpt" / "checkpoint.pt", weights_only=False)
    assert ckpt["model"] and all("lora_" in k for k in ckpt["model"])


def test_bfloat16_autocast_path_runs_on_the_cpu(model_dir, tmp_path):
    """The CUDA recipe (bfloat16 autocast; a LoRA run's frozen base in bfloat16) exercised on the CPU."""
    pytest.importorskip("peft")
    full = finetune(tiny_config(steps=2, model=model_dir, dtype="bfloat16"), str(tmp_path / "full"),
                    str(tmp_path / "c1"), progress=False, device="cpu")
    lora = finetune(tiny_config(steps=2, model=model_dir, dtype="bfloat16", lora=True, lora_r=2),
                    str(tmp_path / "lora"), str(tmp_path / "c2"), progress=False, device="cpu")
    assert full["dtype"] == lora["dtype"] == "bfloat16"
    for log in (full, lora):
        assert all(0 < h["loss"] < 100 for h in log["history"])
    weights = AutoModelForCausalLM.from_pretrained(str(tmp_path / "full")).model.layers[0].self_attn.k_proj.weight
    assert weights.dtype == torch.float32  # float32 master weights under autocast


def test_a_user_dataset_in_kvpress_schema_trains_with_mixed_context_lengths(tok, tmp_path):
    rows = []
    for length in (128, 144):
        ds = generate("niah_single", tok, n_samples=2, context_length=length, stride=4, phases=[0], seed=5)
        rows += [{k: r[k] for k in ("context", "question", "answer_prefix", "answer", "task", "max_new_tokens")}
                 for r in ds]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    config = tiny_config(steps=2, batch_size=4, tasks={}, dataset=str(path))
    log = finetune(config, str(tmp_path / "out"), str(tmp_path / "ckpt"), model=tiny_lm(tok), tokenizer=tok,
                   progress=False)
    assert len(log["history"]) == 2 and all(h["loss"] > 0 for h in log["history"])
    source = ExampleSource(config, tok)
    lengths = {source.dataset_example(i)["context_length"] for i in range(len(rows))}
    assert lengths == {128, 144}


# ---------------------------------------------------------------------------------------------- draws
def test_press_draws_follow_the_configuration():
    fixed = tiny_config(strides=[4, 8], offset_mode="fixed", offset=3, steps=40)
    assert {fixed.draw_press(s, 0)["offset"] for s in range(40)} == {3}
    random_ = tiny_config(strides=[8], offset_mode="random", steps=200)
    assert {random_.draw_press(s, 0)["offset"] for s in range(200)} == set(range(8))
    assert random_.draw_press(7, 1) == random_.draw_press(7, 1)  # a pure function of (seed, step, micro-batch)
    # a fixed-grid control differs from the random-offset run in the offset alone
    control = tiny_config(strides=[4, 8, 16], ratios=[0.25, 0.5, 0.75], uncompressed_fraction=0.2, steps=100,
                          offset_mode="fixed")
    treated = tiny_config(strides=[4, 8, 16], ratios=[0.25, 0.5, 0.75], uncompressed_fraction=0.2, steps=100)
    for s in range(100):
        a, b = control.draw_press(s, 0), treated.draw_press(s, 0)
        assert (a["ratio"], a["stride"], a["offset"]) == (b["ratio"], b["stride"], 0)
    curriculum = tiny_config(ratios=[0.25, 0.5, 0.75], curriculum_steps=100, steps=200)
    early = {curriculum.draw_press(s, 0)["ratio"] for s in range(10)}
    late = {curriculum.draw_press(s, 0)["ratio"] for s in range(100, 200)}
    assert early == {0.25} and late == {0.25, 0.5, 0.75}
    ranged = tiny_config(ratio_range=[0.25, 0.875], steps=100)
    assert all(0.25 <= ranged.draw_press(s, 0)["ratio"] <= 0.875 for s in range(100))
    plain = tiny_config(uncompressed_fraction=1.0)
    assert plain.draw_press(0, 0)["ratio"] == 0.0


def test_recipes_fill_what_the_command_line_leaves_out():
    parser = cli.build_parser()
    args = parser.parse_args(["train", "--recipe", "chunked-fixed", "--steps", "5", "--output-dir", "x"])
    config = config_from_args(args)
    assert config.steps == 5 and config.offset_mode == "fixed" and config.strides == [4, 8, 16]
    assert config_from_args(parser.parse_args(["train", "--recipe", "chunked", "--output-dir", "x"])).offset_mode \
        == "random"
    default = config_from_args(parser.parse_args(["train", "--output-dir", "x"]))
    assert default == FinetuneConfig()


# ---------------------------------------------------------------------------------------------- bad input
BAD = [
    (["--ratios", "1.5"], "ratios"),
    (["--ratios", "0.5,x"], "--ratios"),
    (["--ratio-range", "0.8:0.2"], "ratio_range"),
    (["--strides", "0"], "strides"),
    (["--press", "snapkv"], "press must be one of"),
    (["--press", "zip"], "press must be one of chunked_stride, phase_aware"),
    (["--press", "chunked_stride:stride=4"], "set by the trainer"),
    (["--press", "chunked_stride:backend=triton"], "backward"),
    (["--offset-mode", "sometimes"], "offset-mode"),
    (["--tasks", "haystack"], "unknown task"),
    (["--tasks", ""], "no training data"),
    (["--steps", "0"], "steps"),
    (["--curriculum-steps", "50", "--steps", "10"], "curriculum_steps"),
    (["--uncompressed-fraction", "2"], "uncompressed_fraction"),
    (["--context-lengths", "32"], "context_lengths"),
    (["--lr", "0"], "lr"),
    (["--dataset", "/nonexistent/data.jsonl"], "does not exist"),
    (["--model", "/nonexistent/model"], "cannot be loaded"),
    (["--tasks", "niah_multivalue", "--context-lengths", "64"], "does not fit"),
]


@pytest.mark.parametrize("flags, word", BAD)
def test_bad_configuration_exits_2_with_one_line(flags, word, capsys, tmp_path, model_dir):
    model = [] if "--model" in flags else ["--model", model_dir]
    code = cli.main(["train", *model, *flags, "--output-dir", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("kvpress-phase: error:") and err.count("\n") == 1, err
    assert word in err


def test_unknown_press_lists_only_the_presses_train_accepts(capsys, tmp_path):
    code = cli.main(["train", "--press", "nope", "--output-dir", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "chunked_stride" in err and "phase_aware" in err and "'nope'" in err
    assert not any(name in err for name in ("no_press", "snapkv", "knorm", "kvzip"))  # eval's presses, not train's


def test_dataset_without_kvpress_columns_is_refused(tmp_path, capsys, model_dir):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "hello"}) + "\n")
    code = cli.main(["train", "--model", model_dir, "--tasks", "", "--dataset", str(path), "--output-dir",
                     str(tmp_path / "out")])
    assert code == 2 and "lacks the column" in capsys.readouterr().err


def test_train_command_runs_end_to_end(model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["train", "--model", model_dir, "--tasks", "niah_single", "--context-lengths", "128", "--strides", "4",
            "--ratios", "0.5", "--steps", "2", "--batch-size", "2", "--output-dir", str(out), "--checkpoint-dir",
            str(tmp_path / "ckpt"), "--no-progress"]
    assert cli.main(args) == 0
    log = json.loads((out / "training_log.json").read_text())
    assert log["steps_done"] == 2 and log["command"].startswith("kvpress-phase train")
    assert cli.main(args) == 0  # rerun: the checkpoint is complete, nothing to train, the same export
    assert json.loads((out / "training_log.json").read_text())["history"] == log["history"]
