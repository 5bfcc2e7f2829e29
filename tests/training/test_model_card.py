"""The model card is rendered from measurements: every bar is judged from the figures, and notes survive."""

from __future__ import annotations

from kvpress_phase import builtin_model_path
from kvpress_phase.training.model_card import NOTES_MARKER, existing_notes, render
from kvpress_phase.evaluation.tasks import TASKS


def fake_measurements(value: float, gap_ci=(0.0, 0.0), n_gap=200):
    table = {(t, n): {"mean": value} for t in TASKS for n in (1024, 2048)}
    gap = {"n_samples": n_gap, "per_phase": [value] * 8, "gap": 0.0, "gap_xfit": sum(gap_ci) / 2,
           "gap_xfit_ci_low": gap_ci[0], "gap_xfit_ci_high": gap_ci[1], "boundary": value,
           "p_value": 1.0 if gap_ci[0] <= 0 else 0.001, "detectable_gap": 0.15}
    return table, gap


def bar_rows(text: str) -> list[str]:
    section = text.split("## Status against the capability bars", 1)[1]
    return [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| bar")]


def test_bars_are_judged_from_the_figures(tmp_path):
    card = str(tmp_path / "card.md")
    text = render(builtin_model_path(), *fake_measurements(0.97), [1024, 2048], 5, card)
    rows = bar_rows(text)
    assert len(rows) == 5 and all("| met" in r for r in rows), rows

    table, gap = fake_measurements(0.97, gap_ci=(0.02, 0.10))
    table[("niah_multivalue", 2048)]["mean"] = 0.5
    rows = bar_rows(render(builtin_model_path(), table, gap, [1024, 2048], 5, card))
    assert "not met" in rows[1] and "niah_multivalue 0.500" in rows[1]
    assert "| met" in rows[0] and "not met" in rows[3]


def test_notes_after_the_marker_are_kept(tmp_path):
    card = tmp_path / "card.md"
    card.write_text("# old card\n" + NOTES_MARKER + "\nWhat the runs showed.\n")
    notes = existing_notes(str(card))
    text = render(builtin_model_path(), *fake_measurements(1.0), [1024, 2048], 5, str(card), notes)
    assert text.endswith(NOTES_MARKER + "\nWhat the runs showed.\n")
    assert existing_notes(str(tmp_path / "missing.md")) == ""
