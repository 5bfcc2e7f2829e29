"""What a new user of kvpress-phase meets first: ``list`` shows each press's settings with their defaults and an
example spec, and what the real models' weights are; the help names every command and says exactly what the
defaults are; a value that is wrong on its own is refused before torch is imported."""

from __future__ import annotations

import pytest

from kvpress_phase import cli
from kvpress_phase.evaluation import cli as evaluation_cli


def _press_blocks(out: str) -> dict:
    """``list``'s lines per press: its name line, then its settings and example lines."""
    from kvpress_phase.evaluation.presses import REGISTRY

    blocks, current = {}, None
    for line in out.splitlines():
        words = line.split()
        if line.startswith("  ") and not line.startswith("   ") and words and words[0] in REGISTRY:
            current = blocks.setdefault(words[0], [])
        elif not line.startswith("   "):
            current = None
        if current is not None:
            current.append(line.strip())
    return blocks


def test_list_shows_every_press_setting_with_its_default_and_an_example_spec(capsys):
    from kvpress_phase.evaluation.listing import shown
    from kvpress_phase.evaluation.presses import (REGISTRY, build_press, parse_press_spec, press_settings,
                                                  setting_defaults)

    assert cli.main(["list"]) == 0
    blocks = _press_blocks(capsys.readouterr().out)
    assert list(blocks) == list(REGISTRY)
    for name, lines in blocks.items():
        (settings,) = [line for line in lines if line.startswith("settings: ")]
        (example,) = [line[len("e.g. "):] for line in lines if line.startswith("e.g. ")]
        own = [key for key in press_settings(name) if not REGISTRY[name].wraps
               or key not in press_settings(REGISTRY[name].wraps)]  # a wrapper lists its own, and names the press's
        assert all(f"{key}=" in settings for key in own) or settings == "settings: none"
        if REGISTRY[name].wraps:
            assert f"and the settings of {REGISTRY[name].wraps}" in settings
        assert example.split(":")[0] == name and parse_press_spec(example).name == name
        # each default, written into a spec, builds the press the bare name builds ("auto" cannot be written); a
        # chunk wrapper's scorer by name may be our subclass of kvpress's (snapkv: the partial-rotary-safe SnapKV)
        bare = build_press(parse_press_spec(name), 0.5, 8, None, 0)
        for key, default in setting_defaults(name).items():
            assert f"{key}={shown(default)}" in settings
            if default is None:
                continue
            built = build_press(parse_press_spec(f"{name}:{key}={shown(default)}"), 0.5, 8, None, 0)
            if REGISTRY[name].settings == "scorer" and hasattr(bare, "press"):
                assert type(built) is type(bare) and isinstance(built.press, type(bare.press)), key
            else:
                assert built == bare, (name, key)
    assert "mode=select" in blocks["chunked_stride"][1] and "scorer=keydiff" in blocks["phase_aware"][1]
    assert "e.g. layer_budget:scorer=kvzap" in blocks["layer_budget"]
    assert "settings: floor=0.0, press=phase_aware and the settings of phase_aware" in blocks["global_budget"]
    assert "settings: scorer=knorm (one of " in blocks["chunk"][1]


def test_list_says_the_real_models_weights_were_quantised(capsys):
    assert cli.main(["list"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
    assert "Q4_1 GGUF" in lines["smollm2"] and "de-quantised" in lines["smollm2"] and "float32" in lines["smollm2"]
    qwen = lines["qwen2.5-coder-0.5b"]
    assert "Q4_K_M GGUF" in qwen and "AWQ" in qwen and "de-quantised" in qwen and "float32" in qwen


def test_the_usage_line_names_every_command():
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    usage = " ".join(parser.format_usage().split())
    assert "{" + ",".join(sub.choices) + "}" in usage and "drop" in sub.choices


def _eval_help(dest: str) -> str:
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    (action,) = [a for a in sub.choices["eval"]._actions if a.dest == dest]
    return " ".join(action.help.split())


def test_eval_help_says_exactly_which_presses_run_by_default():
    from kvpress_phase.evaluation.presses import REGISTRY

    text = _eval_help("presses")
    default = evaluation_cli.QUICK_SETTINGS["presses"]
    assert f"(default: {', '.join(default)};" in text and "all registered presses" not in text
    left_out = [name for name in REGISTRY if name not in default]
    assert left_out and all(name in text.split("(default: ", 1)[1].split(";", 1)[1] for name in left_out)


def test_query_aware_help_uses_the_reports_term():
    from kvpress_phase.evaluation.report import SETTING_LABELS

    text = _eval_help("compress_question")
    assert f"labels these results {SETTING_LABELS['question_compressed']}" in text
    assert "question_compressed" not in text


EARLY = [
    (["eval", "--compression-ratios", "1.5"], "--compression-ratios"),
    (["eval", "--compression-ratios", "0.25,-0.1"], "--compression-ratios"),
    (["eval", "--strides", "0"], "--strides"),
    (["eval", "--context-lengths", "0"], "--context-lengths"),
    (["eval", "--presses", "no_press,zip"], "--presses"),
    (["eval", "--samples", "0"], "--samples"),
    (["audit", "chunkkv", "--compression-ratios", "1"], "--compression-ratios"),
]


@pytest.mark.parametrize("argv,flag", EARLY, ids=[" ".join(a) for a, _ in EARLY])
def test_bad_values_are_refused_before_torch_is_imported(argv, flag):
    """Exit code 2 and one line naming the flag, before torch, kvpress or transformers is imported (in a fresh
    interpreter, so that nothing this test process imported counts)."""
    import subprocess
    import sys

    code = ("import sys; from kvpress_phase.cli import main; rc = main(%r); "
            "print(rc, *('torch' in sys.modules, 'kvpress' in sys.modules, 'transformers' in sys.modules))" % argv)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.stdout.split() == ["2", "False", "False", "False"], run.stdout + run.stderr
    err = run.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"kvpress-phase: error: {flag} ") and "Traceback" not in err


CHECKED_FIRST = [
    (["eval", "--tasks", "niah_single,nosuchtask"], "unknown task 'nosuchtask'; valid task names: niah_single"),
    (["audit", "knorm", "--tasks", "nosuchtask"], "unknown task 'nosuchtask'; valid task names: niah_single"),
    (["eval", "--tasks", "vt,vt"], "--tasks lists 'vt' twice"),
    (["eval", "--strides", "8", "--phases", "8"], "got phase 8 with strides [8]"),
    (["eval", "--windows", "4", "--strides", "8"], "got window 4 with strides [8]"),
    (["eval", "--context-lengths", "16"], "got 16"),
    (["train", "--tasks", "nosuchtask", "--output-dir", "o"], "unknown task 'nosuchtask'"),
    (["train", "--steps", "0", "--output-dir", "o"], "steps must be an integer >= 1, got 0"),
    (["train", "--ratios", "1.5", "--output-dir", "o"], "ratios must be a non-empty list of numbers in [0, 1), got "
                                                        "[1.5]"),
    (["train", "--checkpoint-every", "0", "--output-dir", "o"], "checkpoint_every must be >= 1, got 0"),
    (["train", "--max-minutes", "-1", "--output-dir", "o"], "max_minutes must be > 0, got -1.0"),
]


@pytest.mark.parametrize("argv,message", CHECKED_FIRST, ids=[" ".join(a) for a, _ in CHECKED_FIRST])
def test_bad_settings_checked_after_parsing_are_refused_before_torch_is_imported(argv, message, tmp_path):
    """Settings the parser passes (a task name, a phase against the strides, a training number) are checked before
    the command imports torch, kvpress or transformers: exit code 2 and the error line naming the bad value (in a
    fresh interpreter, so that nothing this test process imported counts; ``audit`` first prints the ``eval``
    command it runs)."""
    import subprocess
    import sys

    code = ("import sys; from kvpress_phase.cli import main; rc = main(%r); "
            "print(rc, *('torch' in sys.modules, 'kvpress' in sys.modules, 'transformers' in sys.modules))" % argv)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.stdout.split() == ["2", "False", "False", "False"], run.stdout + run.stderr
    err = run.stderr.strip()
    last = err.splitlines()[-1]
    assert last.startswith("kvpress-phase: error: ") and message in last, err
    assert "Traceback" not in err and len(err.splitlines()) == (2 if argv[0] == "audit" else 1)
    assert not (tmp_path / "o").exists() and not (tmp_path / "outputs").exists()  # refused before any folder is made
