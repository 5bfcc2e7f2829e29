"""Press labels are canonical (settings sorted, booleans lowercase), the budget wrappers are named like their classes
(``head_budget``, ``layer_budget``, ``global_budget``), and the former spellings are read through one alias table
(:mod:`kvpress_phase.evaluation.spellings`): on the command line, and when answers are loaded, so that every committed
run and the golden answers read as they did, under today's labels."""

from __future__ import annotations

import glob
import json
import os
import shutil

import pandas as pd
import pytest

from kvpress_phase import GlobalBudgetPress, HeadBudgetPress, LayerBudgetPress, PhaseAwarePress, cli
from kvpress_phase.evaluation.presses import REGISTRY, build_press, parse_press_spec
from kvpress_phase.evaluation.spellings import (BUDGET_ALIASES, canonical_key, canonical_label, canonical_records,
                                                former_spelling_note)
from kvpress_phase.evaluation.store import RESULTS_DIR, _read_packed, read_results, read_shard, record_key, today_key

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
GOLDEN = os.path.join(ROOT, "tests", "golden")

FORMER = {
    "phase_aware:scorer=kvzap:allocate=layers_heads:share_heads=False": "global_budget:scorer=kvzap",
    "phase_aware:scorer=kvzap:allocate=heads:share_heads=false": "head_budget:scorer=kvzap",
    "phase_aware:scorer=kvzap:allocate=layers": "layer_budget:scorer=kvzap",
    "phase_aware:allocate=layers:floor=0": "layer_budget:floor=0",
    "phase_aware:allocate=heads:share_heads=False:floor=0.25": "head_budget:floor=0.25",
    "phase_aware:allocate=heads": "head_budget",
    "phase_aware:share_heads=False:n_sink=0:n_local=0": "head_budget:floor=1.0:n_local=0:n_sink=0",
    "phase_aware:allocate=even:share_heads=true:scorer=snapkv": "phase_aware:scorer=snapkv",
    "staggered_window:scorer=knorm:overlap=True:align=False": "staggered_window:align=false:overlap=true:scorer=knorm",
    "head_budget:press=phase_aware:scorer=kvzap": "head_budget:scorer=kvzap",
    "chunked_stride:mode=select:scorer=snapkv": "chunked_stride:mode=select:scorer=snapkv",
}


@pytest.mark.parametrize("former,today", FORMER.items())
def test_a_former_spelling_parses_to_todays_label_and_builds_the_same_press(former, today):
    assert canonical_label(former) == today
    assert parse_press_spec(former).label == today
    assert parse_press_spec(today).label == today  # today's labels are fixed points
    built = build_press(parse_press_spec(former), 0.5, 8, None, 0)
    assert built == build_press(parse_press_spec(today), 0.5, 8, None, 0)


def test_the_wrappers_build_their_classes_around_phase_aware_press():
    for name, cls in (("head_budget", HeadBudgetPress), ("layer_budget", LayerBudgetPress),
                      ("global_budget", GlobalBudgetPress)):
        press = build_press(parse_press_spec(f"{name}:floor=0.25:scorer=kvzap:recent=0.1"), 0.5, 8, None, 0)
        assert type(press) is cls and press.floor == 0.25
        assert type(press.press) is PhaseAwarePress and press.press.recent == 0.1
        assert REGISTRY[name].wraps == "phase_aware"
    assert build_press(parse_press_spec("head_budget"), 0.5, 8, None, 0).floor == 0.0  # the class's default


def test_every_alias_names_a_registered_press():
    for (allocate, _), (name, added) in BUDGET_ALIASES.items():
        assert name in REGISTRY, allocate
        assert parse_press_spec(":".join([name] + [f"{k}={v}" for k, v in added])).name == name


BAD = [
    ("phase_aware:allocate=layers:share_heads=false", "write global_budget"),
    ("phase_aware:allocate=heads:share_heads=true", "write head_budget"),
    ("phase_aware:floor=0.25", "floor is a setting of a budget spread by score"),
    ("phase_aware:share_heads=false:floor=0.5", "floor is a setting of a budget spread by score"),
    ("phase_aware:allocate=model", "allocate must be one of"),
    ("phase_aware:share_heads=maybe", "share_heads must be true or false"),
    ("head_budget:press=chunked_stride", "press='chunked_stride'"),
    ("head_budget:allocate=heads", "press 'head_budget' has no setting 'allocate'"),
    ("head_budget:floor=2", "floor"),
    ("layer_budget:scorer=knorm:scorer=snapkv", "sets scorer twice"),
    ("phase_aware:budget=window:scorer=knorm", "is a former spelling: write 'staggered_window:scorer=knorm'"),
]


@pytest.mark.parametrize("text,message", BAD)
def test_a_spec_that_names_no_press_is_refused_with_the_reason(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        parse_press_spec(text)


def test_the_command_line_notes_a_former_spelling():
    assert "'layer_budget:scorer=kvzap' today" in former_spelling_note("phase_aware:scorer=kvzap:allocate=layers")
    assert former_spelling_note("layer_budget:scorer=kvzap") is None
    assert former_spelling_note("phase_aware:scorer=kvzap") is None


def test_list_shows_the_wrappers_by_name(capsys):
    assert cli.main(["list"]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("  ")
             and not line.startswith("   ")]
    assert {"head_budget", "layer_budget", "global_budget"} <= set(names)


def test_a_key_holds_its_label_or_is_refused():
    record = {"task": "niah_single", "context_length": 64, "stride": 4, "window": None, "protocol": "prefix",
              "sample_id": 0, "phase": 1, "press": "phase_aware:allocate=layers:floor=0", "compression_ratio": 0.5}
    record["key"] = record_key(record)
    assert today_key(record) == record_key({**record, "press": "layer_budget:floor=0"})
    with pytest.raises(ValueError, match="does not hold its press label"):
        canonical_key(record["key"], "phase_aware")


# ------------------------------------------------------------------------------------------------ committed runs
def _committed_runs() -> list[str]:
    return sorted(os.path.dirname(d) for d in glob.glob(os.path.join(ROOT, "outputs", "**", RESULTS_DIR),
                                                         recursive=True))


def _as_written(run: str) -> pd.DataFrame:
    """A run's answers with the labels and keys they were written under (packed file, then shards; first copy of a
    key kept, as :func:`read_results` keeps it)."""
    folder = os.path.join(run, RESULTS_DIR)
    records = _read_packed(os.path.join(folder, "answers.parquet"))
    for name in sorted(os.listdir(folder)):
        if name.endswith(".jsonl"):
            records += read_shard(os.path.join(folder, name))
    return pd.DataFrame(records).drop_duplicates("key", keep="first")


CELL = ["task", "context_length", "stride", "protocol", "compression_ratio", "phase"]


def _table(df: pd.DataFrame) -> pd.DataFrame:
    """Accuracy, answer count and cache length per press and cell: what every report and study reads."""
    return (df.groupby(["press"] + CELL, dropna=False)
            .agg(score=("score", "mean"), answers=("score", "size"), cache=("cache_length", "mean"))
            .sort_index())


def _labels_as_written(run: str) -> set[str]:
    """The press labels a run was written under, read from the packed file's one column and the shards."""
    import pyarrow.parquet as pq

    folder = os.path.join(run, RESULTS_DIR)
    packed = os.path.join(folder, "answers.parquet")
    labels = set(pq.read_table(packed, columns=["press"]).column("press").to_pylist()) if os.path.exists(packed) \
        else set()
    for name in sorted(os.listdir(folder)):
        if name.endswith(".jsonl"):
            labels |= {record["press"] for record in read_shard(os.path.join(folder, name))}
    return labels


def test_every_committed_run_reads_its_tables_identically_under_todays_labels():
    """Runs written under a former spelling are read in full, before and after; a run written under today's labels
    only needs its labels checked (nothing is renamed on reading it), which keeps the test's time from growing with
    every run committed from now on."""
    runs = _committed_runs()
    if not runs:
        pytest.skip("no committed runs in this checkout")
    renamed = set()
    for run in runs:
        labels = _labels_as_written(run)
        if all(canonical_label(label) == label for label in labels):
            for label in labels:
                assert parse_press_spec(label).label == label, (run, label)
            continue
        written = _as_written(run)
        loaded = read_results(run)
        today = {label: canonical_label(label) for label in written["press"].unique()}
        renamed |= {label for label, new in today.items() if new != label}
        # no two labels of a run fall together, every answer is kept, and each label is one a spec parses to
        assert len(set(today.values())) == len(today), run
        assert len(loaded) == len(written), run
        assert set(loaded["press"]) == set(today.values()), run
        for label in set(today.values()):
            assert parse_press_spec(label).label == label, (run, label)
        # before (the labels as written, mapped) and after (loaded): the same answers, keys and tables
        mapped = written.assign(press=written["press"].map(today),
                                key=[canonical_key(k, p) for k, p in zip(written["key"], written["press"])])
        assert sorted(loaded["key"]) == sorted(mapped["key"]), run
        pd.testing.assert_frame_equal(_table(loaded), _table(mapped), check_dtype=False, obj=run)
        by_key = mapped.set_index("key").loc[loaded["key"], ["press", "prediction", "score"]]
        assert (by_key["prediction"].to_numpy() == loaded["prediction"].to_numpy()).all(), run
    assert {"phase_aware:scorer=kvzap:allocate=layers", "phase_aware:share_heads=False"} <= renamed


# ------------------------------------------------------------------------------------------------ golden files
def test_the_golden_specs_fall_together_only_where_they_build_the_same_press():
    """Golden specs that differ only in spelling (``share_heads=False`` and ``false``, written when the wrappers were
    settings and after they were classes) share today's label, and their golden configurations, as
    :func:`test_golden.reshaped` reads them today, are one."""
    from test_golden import reshaped

    with open(os.path.join(GOLDEN, "press_specs.json")) as fh:
        golden = json.load(fh)
    by_label = {}
    for text, fields in golden.items():
        by_label.setdefault(canonical_label(text), []).append(reshaped(fields))
    assert len(by_label) < len(golden)
    for label, configurations in by_label.items():
        assert all(c == configurations[0] for c in configurations), label


def test_the_golden_answers_read_under_todays_labels_one_answer_per_key():
    with open(os.path.join(GOLDEN, "builtin_answers.jsonl")) as fh:
        rows = pd.DataFrame([json.loads(line) for line in fh])
    rows["press"] = rows["key"].str.split("|").str[7]
    today = canonical_records(rows.copy())
    assert today["key"].is_unique and len(today) == len(rows)
    assert not today["press"].str.contains("allocate=|share_heads=|False|True").any()
    assert {"head_budget", "layer_budget:floor=0", "global_budget:floor=0.5"} <= set(today["press"])


# ------------------------------------------------------------------------------------------------ a run written before
TINY = ["--tasks", "niah_single", "--strides", "4", "--phases", "0,1", "--context-lengths", "64", "--samples", "1",
        "--no-diagnostics", "--device", "cpu", "--no-progress", "--bootstrap", "100"]
OLD = "phase_aware:allocate=heads:share_heads=false"


def test_a_run_written_under_a_former_spelling_resumes_reads_and_drops_under_todays(tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["eval", *TINY, "--presses", f"no_press,{OLD}", "--output-dir", str(run)]
    assert cli.main(argv) == 0
    assert "is spelled 'head_budget' today" in capsys.readouterr().err
    today = read_results(str(run))
    assert set(today.press) == {"no_press", "head_budget"}
    # the shard as the code before today's labels wrote it: the typed order, booleans as Python prints them
    shard = run / RESULTS_DIR / "results-rank0.jsonl"
    lines = []
    for record in map(json.loads, shard.read_text().splitlines()):
        if record["press"] == "head_budget":
            record["press"] = "phase_aware:allocate=heads:share_heads=False"
            record["key"] = record_key(record)
        lines.append(json.dumps(record) + "\n")
    shard.write_text("".join(lines))
    pd.testing.assert_frame_equal(read_results(str(run)), today)
    assert cli.main(argv) == 0  # the same command resumes the run: nothing is answered again
    assert shard.read_text() == "".join(lines)
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    assert cli.main(["drop", str(copy), "--presses", OLD]) == 0
    assert "of head_budget" in capsys.readouterr().out
    assert set(read_results(str(copy)).press) == {"no_press"}
