"""The kvpress-phase command: names, a small run end to end, and bad input (exit 2, one line, no traceback)."""

from __future__ import annotations

import json
import os

import pytest

from kvpress_phase.evaluation import cli
from kvpress_phase.evaluation.tokenizer import save_tokenizer, build_tokenizer
from tiny_models import tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    tok = build_tokenizer()
    tiny_model("llama", vocab_size=len(tok)).save_pretrained(path)
    save_tokenizer(tok, str(path))
    return str(path)


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
    assert cli.main(base + ["--samples", "2"]) == 2
    assert "different configuration" in capsys.readouterr().err


def test_slow_tokenizer_exits_2_before_the_model_is_loaded(tmp_path, capsys):
    from transformers import ByT5Tokenizer

    folder = tmp_path / "slow"
    ByT5Tokenizer().save_pretrained(folder)  # a tokenizer without offsets mapping, and no model weights at all
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
    assert cli.main(["eval", "--model", str(folder), "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "neither a BOS token nor a chat template" in err and "cannot be loaded" not in err


def test_report_merges_runs_and_refuses_a_folder_without_results(tmp_path, capsys):
    from kvpress_phase.evaluation import cli
    from kvpress_phase.evaluation.runner import RESULTS_DIR

    run = tmp_path / "run"
    (run / RESULTS_DIR).mkdir(parents=True)
    rows = [dict(task="niah_single", context_length=128, stride=4, window=None, protocol="prefix", sample_id=s,
                 phase=p, press="x", compression_ratio=0.5, score=float(p != 1), cache_length=100)
            for s in range(6) for p in range(4)]
    from kvpress_phase.evaluation.runner import record_key
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
