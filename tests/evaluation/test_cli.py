"""The kvpress-phase command: names, a small run end to end, and bad input (exit 2, one line, no traceback)."""

from __future__ import annotations

import json
import os

import pytest

from kvpress_phase import cli
from kvpress_phase.evaluation import cli as evaluation_cli
from kvpress_phase.evaluation.config import EvalConfig
from kvpress_phase.evaluation.tokenizer import save_tokenizer, build_tokenizer



def test_list_names_every_task_and_press(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ["no_press", "chunked_stride", "phase_aware", "snapkv", "knorm", "streaming_llm", "chunkkv", "chunk",
                 "expected_attention", "tova", "keydiff", "pyramidkv", "kvzip",
                 "niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "qa_single_doc",
                 "qa_multi_doc", "passage_retrieval", "passage_count", "builtin", "chunked", "smollm2"]:
        assert f"  {name} " in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert " Q " in lines["snapkv"] and " Q " in lines["tova"] and " Q " not in lines["knorm"]
    assert "135M parameters, Apache-2.0" in lines["smollm2"]


def test_eval_refuses_ratios_with_the_same_k(capsys):
    code = cli.main(["eval", "--strides", "4", "--compression-ratios", "0.375,0.4", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "both keep k=2 of 4" in err and "--allow-duplicate-k" in err
    assert len(err.strip().splitlines()) == 1


def test_eval_writes_summary_plots_and_report(model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["eval", "--model", model_dir, "--tasks", "niah_single", "--presses", "no_press,chunked_stride,knorm",
            "--strides", "4", "--context-lengths", "128", "--samples", "2", "--output-dir", str(out),
            "--no-progress", "--bootstrap", "200"]
    assert cli.main(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert {r["press"] for r in summary} == {"no_press", "chunked_stride", "knorm"}
    for record in summary:
        for key in ("task", "press", "compression_ratio", "stride", "protocol", "mean", "per_phase", "per_phase_ci",
                    "gap", "gap_xfit", "gap_xfit_ci_low", "gap_xfit_ci_high", "boundary", "p_value", "cochran_p",
                    "detectable_gap", "n_samples"):
            assert key in record
        assert len(record["per_phase"]) == 4 and record["n_samples"] == 2
    assert (out / "report.md").exists() and (out / "results.csv").exists()
    assert any(name.endswith(".png") for name in os.listdir(out))
    assert "chunked_stride" in capsys.readouterr().out
    # the same command again resumes: nothing to do, same summary
    assert cli.main(args) == 0
    assert json.loads((out / "summary.json").read_text()) == summary


BAD = [
    (["eval", "--tasks", "haystack"], "unknown task"),
    (["eval", "--presses", "zip"], "unknown press"),
    (["eval", "--compression-ratios", "1.2"], "compression ratio"),
    (["eval", "--strides", "0"], "stride"),
    (["eval", "--strides", "8", "--phases", "8"], "phase"),
    (["eval", "--samples", "-3"], "samples"),
    (["eval", "--strides", "four"], "--strides"),
    (["eval", "--model", "/no/such/model"], "cannot be loaded"),
    (["eval", "--output-dir", "/proc/no/such"], "output-dir"),
    (["eval", "--windows", "4", "--strides", "8"], "window"),
    (["eval", "--protocol", "suffix"], "protocol"),
    (["evaluate"], "invalid choice"),
    ([], "required"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[" ".join(a) or "nothing" for a, _ in BAD])
def test_bad_input_exits_2_with_one_line(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and "Traceback" not in err


def _refused(argv, capsys) -> str:
    """The one stderr line of a command refused with exit code 2 (given ``unloadable_model``: nothing would run)."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and err.startswith("kvpress-phase: error: "), err
    return err


def test_eval_refuses_stride_1_with_a_positive_ratio(unloadable_model, tmp_path, capsys):
    err = _refused(["eval", "--model", unloadable_model, "--strides", "1", "--compression-ratios", "0.25",
                    "--output-dir", str(tmp_path)], capsys)
    assert "stride 1" in err and "nothing would be compressed" in err and "strides of 2 or more" in err
    EvalConfig(presses=["no_press"], strides=[1], compression_ratios=[0.25]).validate()  # nothing to compress
    EvalConfig(strides=[1], compression_ratios=[0.0]).validate()


def test_context_length_minimum_is_one_rule_in_eval_and_the_task_generators(unloadable_model, tmp_path, capsys):
    from kvpress_phase.evaluation.tasks import generate

    err = _refused(["eval", "--model", unloadable_model, "--context-lengths", "40", "--strides", "8",
                    "--output-dir", str(tmp_path)], capsys)
    with pytest.raises(ValueError) as refused:
        generate("niah_single", build_tokenizer(), n_samples=1, context_length=40, stride=8, phases=[0])
    assert err == f"kvpress-phase: error: {refused.value}" and "context_length must be >= 56 tokens at stride 8" in err
    EvalConfig(context_lengths=[56], strides=[8]).validate()
    assert len(generate("niah_single", build_tokenizer(), n_samples=1, context_length=56, stride=8, phases=[0])) == 1
    with pytest.raises(ValueError, match="context_length must be >= 72 tokens at stride 32"):
        EvalConfig(context_lengths=[64], strides=[8, 32]).validate()


def test_bootstrap_minimum_is_the_same_for_eval_and_report(unloadable_model, tmp_path, capsys):
    eval_err = _refused(["eval", "--bootstrap", "0", "--model", unloadable_model, "--output-dir", str(tmp_path)],
                        capsys)
    report_err = _refused(["report", str(tmp_path), "--bootstrap", "0", "--output-dir", str(tmp_path / "r")], capsys)
    assert eval_err == report_err and "--bootstrap must be >= 100, got 0" in eval_err
    assert cli.build_parser().parse_args(["report", "run", "--output-dir", "o", "--bootstrap", "100"]).bootstrap == 100


@pytest.mark.parametrize("presses,label", [("no_press,no_press", "no_press"),
                                           ("phase_aware,knorm, phase_aware", "phase_aware"),
                                           ("chunked_stride:mode=pool,chunked_stride:mode=pool", "chunked_stride:mode=pool")])
def test_eval_refuses_a_press_listed_twice(presses, label, unloadable_model, tmp_path, capsys):
    err = _refused(["eval", "--model", unloadable_model, "--presses", presses, "--output-dir", str(tmp_path)], capsys)
    assert f"presses lists {label!r} twice" in err


def test_presses_with_different_settings_are_distinct():
    EvalConfig(presses=["chunked_stride", "chunked_stride:mode=pool", "phase_aware", "phase_aware:scorer=knorm"]
               ).validate()


HELP = [["--help"], ["eval", "--help"], ["audit", "--help"], ["report", "--help"], ["list", "--help"],
        ["train", "--help"], ["train-scorer", "--help"]]


@pytest.mark.parametrize("argv", HELP, ids=[" ".join(a) for a in HELP])
def test_help_is_plain_words_and_no_example_writes_into_the_package(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kvpress-phase")
    for markup in ("``", ":func:", ":class:", ":mod:", ":meth:"):
        assert markup not in out
    assert "kvpress_phase/" not in out  # examples write to a user folder (outputs/...), not the installed package


def test_the_command_is_evaluation_commands_and_train():
    """kvpress-phase (kvpress_phase.cli) composes evaluation's commands and training's train, train-scorer and
    calibrate-scorer; the
    evaluation commands also run alone (python -m kvpress_phase.evaluation.cli), with the same flags."""
    def commands(parser):
        (sub,) = [a for a in parser._actions if a.dest == "command"]
        return list(sub.choices)

    assert commands(cli.build_parser()) == list(evaluation_cli.COMMANDS) + ["train", "train-scorer",
                                                                                    "calibrate-scorer"]
    assert commands(evaluation_cli.build_parser()) == list(evaluation_cli.COMMANDS)
    argv = ["eval", "--strides", "4,8", "--query-aware", "--output-dir", "o"]
    assert vars(cli.build_parser().parse_args(argv)) == vars(evaluation_cli.build_parser().parse_args(argv))


def test_evaluation_commands_alone_refuse_bad_input_in_one_line(capsys):
    assert evaluation_cli.main(["eval", "--strides", "x"]) == 2
    assert evaluation_cli.main(["train", "--output-dir", "o"]) == 2  # train is not an evaluation command
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("kvpress-phase: error: ") for line in err)


def test_query_aware_is_kvpress_name_for_compress_question():
    parser = cli.build_parser()
    new, old = parser.parse_args(["eval", "--query-aware"]), parser.parse_args(["eval", "--compress-question"])
    assert new.compress_question is True and vars(new) == vars(old)
    assert parser.parse_args(["eval"]).compress_question is False


def test_report_describes_the_question_setting_as_query_aware(tmp_path, capsys):
    from kvpress_phase.evaluation.store import RESULTS_DIR, record_key

    run = tmp_path / "run"
    (run / RESULTS_DIR).mkdir(parents=True)
    rows = [dict(task="niah_single", context_length=128, stride=4, window=None, protocol="prefix", sample_id=s,
                 phase=p, press=press, compression_ratio=ratio, score=1.0, cache_length=100,
                 setting="question_compressed")
            for s in range(3) for p in range(4) for press, ratio in [("no_press", 0.0), ("knorm", 0.5)]]
    with open(run / RESULTS_DIR / "results-rank0.jsonl", "w") as fh:
        for r in rows:
            fh.write(json.dumps({**r, "key": record_key(r)}) + "\n")
    assert cli.main(["report", str(run), "--output-dir", str(tmp_path / "out"), "--bootstrap", "100"]) == 0
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| query-aware |" in report and "`query-aware` = the question is compressed" in report
    assert "query-aware" in report.split("## ")[1].splitlines()[0]  # the plot's heading
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert {r["setting"] for r in summary} == {"question_compressed"}  # the stored value is unchanged


def test_unwritable_output_dir(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    if os.access(locked, os.W_OK):  # root ignores permission bits
        pytest.skip("running as a user who can write anywhere")
    assert cli.main(["eval", "--output-dir", str(locked)]) == 2


def test_other_configuration_in_the_same_output_dir(model_dir, tmp_path, capsys):
    base = ["eval", "--model", model_dir, "--tasks", "niah_single", "--presses", "no_press", "--strides", "4",
            "--context-lengths", "128", "--output-dir", str(tmp_path), "--no-progress", "--bootstrap", "100"]
    assert cli.main(base + ["--samples", "1"]) == 0
    capsys.readouterr()
    # each differing argument named as its flag, with the run's value and this command's
    err = _refused(base + ["--samples", "2", "--seed", "3", "--query-aware"], capsys)
    assert err == (f"kvpress-phase: error: --output-dir {str(tmp_path)!r} holds a run with --samples 1, --seed 0, no "
                   "--query-aware; this command has --samples 2, --seed 3, --query-aware (use another --output-dir, "
                   "or the same arguments to resume)")


def _unreadable_weights(folder) -> None:
    """A config and a weights file that cannot be loaded: a folder with every file a model needs, whose tokenizer
    must be refused before the weights are read."""
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "model.safetensors").write_bytes(b"")


def test_slow_tokenizer_exits_2_before_the_model_is_loaded(tmp_path, capsys):
    from transformers import ByT5Tokenizer

    folder = tmp_path / "slow"
    ByT5Tokenizer().save_pretrained(folder)  # a tokenizer without offsets mapping
    _unreadable_weights(folder)
    assert cli.main(["eval", "--model", str(folder), "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("kvpress-phase: error:") and "a fast tokenizer is required" in err


def test_tokenizer_without_bos_or_chat_template_exits_2(tmp_path, capsys):
    from transformers import PreTrainedTokenizerFast

    word = build_tokenizer()
    no_bos = PreTrainedTokenizerFast(tokenizer_object=word.backend_tokenizer, eos_token=word.eos_token,
                                     pad_token=word.pad_token, unk_token=word.unk_token)
    folder = tmp_path / "no-bos"
    save_tokenizer(no_bos, str(folder))
    _unreadable_weights(folder)
    assert cli.main(["eval", "--model", str(folder), "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "neither a BOS token nor a chat template" in err and "cannot be loaded" not in err


def test_report_merges_runs_and_refuses_a_folder_without_results(tmp_path, capsys):
    from kvpress_phase.evaluation.store import RESULTS_DIR

    run = tmp_path / "run"
    (run / RESULTS_DIR).mkdir(parents=True)
    rows = [dict(task="niah_single", context_length=128, stride=4, window=None, protocol="prefix", sample_id=s,
                 phase=p, press="x", compression_ratio=0.5, score=float(p != 1), cache_length=100)
            for s in range(6) for p in range(4)]
    from kvpress_phase.evaluation.store import record_key
    with open(run / RESULTS_DIR / "results-rank0.jsonl", "w") as fh:
        for r in rows:
            fh.write(json.dumps({**r, "key": record_key(r)}) + "\n")
    out = tmp_path / "merged"
    assert cli.main(["report", str(run), str(run), "--output-dir", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary) == 1 and summary[0]["n_samples"] == 6 and summary[0]["context_length"] == 128
    assert summary[0]["per_phase"] == [1.0, 0.0, 1.0, 1.0] and summary[0]["p_value"] < 0.05
    assert cli.main(["report", str(tmp_path / "nothing"), "--output-dir", str(out)]) == 2
    assert "no results" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ refused up front
def _model_folder(path, model, tokenizer) -> str:
    model.save_pretrained(path)
    save_tokenizer(tokenizer, str(path))
    return str(path)


@pytest.fixture(scope="module")
def short_model_dir(tmp_path_factory):
    """A tiny random-weight Llama whose tokenizer keeps 256 tokens (model_max_length), where kvpress's pipeline
    cuts a longer prefill."""
    from tiny_models import tiny_model

    tok = build_tokenizer()
    tok.model_max_length = 256
    return _model_folder(tmp_path_factory.mktemp("short"), tiny_model("llama", vocab_size=len(tok)), tok)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """A tiny random-weight GPT-2 (learned absolute positions, no rotary embedding, layers at transformer.h[i])."""
    import transformers

    tok = build_tokenizer()
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=1024,
                                                                 vocab_size=len(tok)))
    return _model_folder(tmp_path_factory.mktemp("gpt2"), model, tok)


def test_context_longer_than_the_tokenizer_keeps_is_refused_before_anything_is_written(short_model_dir, tmp_path,
                                                                                         capsys):
    out = tmp_path / "run"
    err = _refused(["eval", "--model", short_model_dir, "--tasks", "niah_single", "--presses", "no_press",
                    "--strides", "4", "--context-lengths", "128,512,300", "--samples", "1", "--no-progress",
                    "--output-dir", str(out)], capsys)
    assert err == (f"kvpress-phase: error: context length 300, 512 exceeds the 256 tokens --model {short_model_dir!r} "
                   "takes (its tokenizer's model_max_length): kvpress's pipeline would cut the prefill there, and the "
                   "needle with it; use context lengths up to 256")
    assert not out.exists()


def test_a_prefill_over_the_tokenizer_limit_is_refused_not_cut(short_model_dir, tmp_path, capsys):
    """The question compressed with a context of the full 256 tokens makes a longer prefill: the runner refuses it
    where kvpress's pipeline would cut it."""
    out = tmp_path / "run"
    err = _refused(["eval", "--model", short_model_dir, "--tasks", "niah_single", "--presses", "no_press",
                    "--strides", "4", "--context-lengths", "256", "--samples", "1", "--no-progress", "--query-aware",
                    "--no-diagnostics", "--output-dir", str(out)], capsys)
    assert "tokens exceeds the tokenizer's model_max_length (256), where kvpress's pipeline would cut it" in err
    assert not (out / "results").exists() or not any((out / "results").iterdir())


@pytest.mark.parametrize("command", ["eval", "audit"])
def test_a_model_without_rotary_embeddings_is_refused_with_the_presses_message(command, gpt2_dir, tmp_path, capsys):
    import transformers

    from kvpress_phase import ChunkedStridePress

    out = tmp_path / "run"
    argv = ["eval", "--tasks", "niah_single", "--presses", "no_press,chunked_stride"] if command == "eval" else \
        ["audit", "knorm"]
    assert cli.main(argv + ["--model", gpt2_dir, "--context-lengths", "128", "--samples", "1", "--no-progress",
                            "--output-dir", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    if command == "audit":  # the eval command it stands for, then the refusal
        assert lines.pop(0).startswith("kvpress-phase eval ")
    assert len(lines) == 1 and "Traceback" not in lines[0]
    err = lines[0]
    assert err.startswith("kvpress-phase: error: the phase evaluation needs a model with rotary position embeddings")
    gpt2 = transformers.AutoModelForCausalLM.from_pretrained(gpt2_dir)
    with pytest.raises(ValueError) as attached:
        with ChunkedStridePress(0.5)(gpt2):
            pass
    message = str(attached.value)
    assert message.startswith("ChunkedStridePress needs")  # the same words, with the press as the subject
    assert err.partition(" needs ")[2] == message.partition(" needs ")[2]
    assert "GPT2LMHeadModel has no model.model.rotary_emb and no model.model.layers[i].self_attn" in err
    assert not out.exists()


@pytest.mark.parametrize("spec,message", [
    ("chunked_stride:strid=4", "press 'chunked_stride' has no setting 'strid' (did you mean stride? it is set by "
                               "--strides); chunked_stride's settings: n_sink, n_local, scorer, backend, mode, "
                               "weighting, rope"),
    ("chunked_stride:mod=pool", "press 'chunked_stride' has no setting 'mod' (did you mean mode?); chunked_stride's "
                                "settings: "),
    ("chunked_stride:stride=4", "press setting 'stride' in 'chunked_stride:stride=4' is set by --strides, not in the "
                                "press spec; chunked_stride's settings: "),
    ("staggered_window:stager=head", "has no setting 'stager' (did you mean stagger?)"),
    ("staggered_window:widow=16", "has no setting 'widow' (did you mean window?)"),
    ("phase_aware:budget=window:scorer=knorm", "is a former spelling: write 'staggered_window:scorer=knorm'"),
    ("phase_aware:stagger=none", "is a former spelling: write 'phase_aware'"),
    ("phase_aware:budget=row:scorer=snapkv", "is a former spelling: write 'phase_aware:scorer=snapkv'"),
])
def test_an_unknown_press_setting_names_the_press_settings_before_the_model_loads(spec, message, unloadable_model,
                                                                                  tmp_path, capsys):
    err = _refused(["eval", "--model", unloadable_model, "--presses", f"no_press,{spec}",
                    "--output-dir", str(tmp_path / "run")], capsys)
    assert message in err and "unexpected keyword" not in err


def test_every_listed_press_setting_is_accepted():
    from kvpress_phase.evaluation.presses import REGISTRY, parse_press_spec, press_settings

    for name in REGISTRY:
        for key in press_settings(name):
            try:  # a value no setting takes: refused by the press, if at all, never for its key
                parse_press_spec(f"{name}:{key}=<nonsense>")
            except ValueError as refused:
                assert "has no setting" not in str(refused) and "is set by" not in str(refused), refused


@pytest.mark.parametrize("flag,values,message", [
    ("--context-lengths", "256,256", "--context-lengths lists 256 twice: give each context length once"),
    ("--strides", "4,8,4", "--strides lists 4 twice: give each stride once"),
    ("--compression-ratios", "0.25,0.250", "--compression-ratios lists 0.25 twice: give each compression ratio once"),
    ("--tasks", "niah_single,niah_single", "--tasks lists 'niah_single' twice: give each task once"),
    ("--phases", "1,1", "--phases lists 1 twice: give each phase once"),
    ("--windows", "8,8", "--windows lists 8 twice: give each window once"),
])
def test_a_value_listed_twice_is_refused_like_a_press_listed_twice(flag, values, message, unloadable_model, tmp_path,
                                                                   capsys):
    err = _refused(["eval", "--model", unloadable_model, flag, values, "--output-dir", str(tmp_path)], capsys)
    assert err == f"kvpress-phase: error: {message}"


@pytest.mark.parametrize("presses,warning", [
    ("no_press,knorm,snapkv,chunked_stride", "--query-aware: knorm, chunked_stride do not read the question"),
    ("knorm,chunkkv", "--query-aware: knorm does not read the question"),
    ("no_press,knorm,chunk", "--query-aware: none of the presses reads the question"),
    ("snapkv,chunked_stride:scorer=snapkv,chunk:scorer=tova", None),
])
def test_query_aware_names_the_presses_that_never_read_the_question(presses, warning, unloadable_model, tmp_path,
                                                                    capsys):
    assert cli.main(["eval", "--query-aware", "--presses", presses, "--model", unloadable_model,
                     "--output-dir", str(tmp_path / "run")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    warnings = [line for line in lines if line.startswith("kvpress-phase: warning: ")]
    assert lines[-1].startswith("kvpress-phase: error: ") and "Traceback" not in "".join(lines)
    if warning is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and warnings[0].startswith(f"kvpress-phase: warning: {warning} (Q in `kvpress-phase "
                                                             "list`)")
    assert cli.main(["eval", "--presses", presses, "--model", unloadable_model,
                     "--output-dir", str(tmp_path / "run")]) == 2  # query-agnostic: nothing to say
    assert "warning" not in capsys.readouterr().err


def test_differences_from_a_saved_run_are_written_as_flags():
    import dataclasses

    from kvpress_phase.evaluation.config import config_differences

    saved = dataclasses.asdict(EvalConfig(windows=[8], diagnostics=False, compression_ratios=[0.25, 0.5]))
    del saved["step_by_step"]  # a run saved before the field existed: at its default
    assert config_differences(saved, EvalConfig(compression_ratios=[0.25, 0.5], windows=[8], diagnostics=False)) == []
    assert config_differences(saved, EvalConfig(compression_ratios=[0.25])) == [
        ("compression_ratios", "--compression-ratios 0.25,0.5", "--compression-ratios 0.25"),
        ("windows", "--windows 8", "no --windows"),
        ("diagnostics", "--no-diagnostics", "no --no-diagnostics"),
    ]


def test_context_past_the_builtin_model_training_is_one_warning_line(tmp_path, capsys):
    """Past the 2048 tokens the built-in model was trained on, within its 4096 positions: a run, with one warning
    (the CLI's check and the runner's say it once)."""
    args = ["eval", "--tasks", "niah_single", "--presses", "no_press", "--strides", "2", "--phases", "0",
            "--context-lengths", "2100", "--samples", "1", "--no-diagnostics", "--device", "cpu", "--no-progress",
            "--bootstrap", "100", "--output-dir", str(tmp_path / "run")]
    assert cli.main(args) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == ["kvpress-phase: warning: context length 2100 exceeds the 2048 tokens the built-in model "
                        "'builtin' was trained on: its rotary positions extrapolate there, but accuracy at such "
                        "lengths says little about compression"]
