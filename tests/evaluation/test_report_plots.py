"""The phase plots stay readable when a run holds every baseline: they draw the control, our presses and the few
other presses of highest mean accuracy, and leave the rest to report.md's table (named there and in the legend)."""

from __future__ import annotations

import pandas as pd

from kvpress_phase.evaluation.report import BASELINES_DRAWN, drawn_presses, plot_group, write_reports

OURS = ["chunked_stride", "chunked_stride:mode=pool", "phase_aware", "phase_aware:scorer=kvzap:allocate=layers",
        "staggered_window"]
# kvpress's presses with their accuracy at every phase: three at 1.00 (as on the built-in model's default job),
# then lower ones
BASELINES = {"snapkv": 0.5, "knorm": 0.0, "keydiff": 1.0, "kvzip": 1.0, "tova": 0.25, "streaming_llm": 0.75,
             "chunk": 0.125, "adakv": 1.0, "kvzip_plus": 0.875, "pyramidkv": 0.625}
STRIDE = 4


def _frame() -> pd.DataFrame:
    """Per-example results of one cell: 8 samples at every phase; a press's accuracy is the share of samples it
    answers (the same at every phase)."""
    rows = []
    scores = {"no_press": 1.0, **{p: 1.0 for p in OURS}, **BASELINES}
    for press, accuracy in scores.items():
        for sample in range(8):
            for phase in range(STRIDE):
                rows.append(dict(task="niah_single", context_length=128, stride=STRIDE, window=None, protocol="prefix",
                                 sample_id=sample, phase=phase, press=press,
                                 compression_ratio=0.0 if press == "no_press" else 0.5,
                                 score=float(sample < round(accuracy * 8)), cache_length=100,
                                 setting="query_agnostic"))
    return pd.DataFrame(rows)


def _record(press: str, mean) -> dict:
    ci = (None, None) if mean is None else (max(0.0, mean - 0.1), min(1.0, mean + 0.1))
    return dict(press=press, mean=mean, stride=STRIDE, per_phase=[mean] * STRIDE,
                per_phase_ci=[ci] * STRIDE, p_value=1.0, gap_xfit=0.0,
                gap_xfit_ci_low=-0.1, gap_xfit_ci_high=0.1, n_samples=8, detectable_gap=0.5)


def test_the_control_ours_and_the_best_baselines_are_drawn_the_rest_left_to_the_table():
    records = [_record("no_press", 1.0)] + [_record(p, 1.0) for p in OURS] + [_record(p, m) for p, m in
                                                                               BASELINES.items()]
    drawn, left = drawn_presses(records)
    assert [r["press"] for r in drawn] == ["no_press", *OURS, "keydiff", "kvzip", "adakv"]
    assert {r["press"] for r in left} == set(BASELINES) - {"keydiff", "kvzip", "adakv"}
    assert [r["press"] for r in left] == [p for p in BASELINES if p not in ("keydiff", "kvzip", "adakv")]  # order kept
    # ties go to the earlier record; a record without a mean ranks last
    tied = [_record("knorm", 0.5), _record("tova", 0.5), _record("snapkv", None), _record("keydiff", 0.5)]
    assert [r["press"] for r in drawn_presses(tied, baselines=2)[0]] == ["knorm", "tova"]
    # a former or unknown press name counts as a baseline, never as ours
    assert drawn_presses([_record("gone_press", 0.1)], baselines=0) == ([], [_record("gone_press", 0.1)])


def test_plot_group_draws_the_chosen_presses(tmp_path):
    records = [_record("no_press", 1.0), _record("phase_aware", 1.0)] + [_record(p, m) for p, m in BASELINES.items()]
    drawn = plot_group(records, str(tmp_path / "plot.png"), "title")
    assert drawn == ["no_press", "phase_aware", "keydiff", "kvzip", "adakv"]
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_a_run_of_every_baseline_reports_what_its_plot_leaves_out(tmp_path):
    records = write_reports(_frame(), str(tmp_path), n_resamples=100)
    assert {r["press"] for r in records} == {"no_press", *OURS, *BASELINES}  # every press in the summary
    report = (tmp_path / "report.md").read_text()
    (line,) = [line for line in report.splitlines() if line.startswith("Drawn:")]
    left = sorted(BASELINES, key=lambda p: -BASELINES[p])[BASELINES_DRAWN:]
    assert all(f"`{p}`" in line for p in left)
    assert not any(f"`{p}`" in line for p in ["no_press", *OURS, "keydiff", "kvzip", "adakv"])
    table = report.split("## ")[0]
    assert all(f"| {p} " in table for p in left)  # the table keeps every press
