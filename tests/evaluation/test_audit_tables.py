"""The audit's tables: Holm's adjustment holds the family-wise error under a flat truth, and the committed screen's
folder formats into the audit's cells."""

from __future__ import annotations

import os

import numpy as np
import pytest

from studies.audit_tables import AUDIT_CELLS, cells_markdown, depth_markdown, load, main
from kvpress_phase.evaluation.metrics import holm

SCREEN = os.path.join(os.path.dirname(__file__), "..", "..", "outputs", "chunk-audit", "screen")


def test_holm_adjusts_as_defined():
    np.testing.assert_allclose(holm([0.01, 0.04, 0.03, 0.5]), [0.04, 0.09, 0.09, 0.5])
    assert holm([0.9, 0.9]).max() <= 1.0


def test_holm_holds_the_family_wise_error_under_the_null():
    rng = np.random.default_rng(0)
    ps = rng.random((4000, 30))  # 30 cells with no effect, as the audit has
    fwer = float((np.stack([holm(p) for p in ps]) < 0.05).any(axis=1).mean())
    raw = float((ps < 0.05).any(axis=1).mean())
    assert fwer <= 0.06 and raw > 0.7  # unadjusted, some cell would fire in most null audits


def test_the_screen_formats_into_the_audit_cells(tmp_path):
    if not os.path.exists(os.path.join(SCREEN, "summary.json")):
        pytest.skip("the committed screen is not in this checkout")
    cells, _ = load([SCREEN])
    expected = {(press, ratio) for press, ratios in AUDIT_CELLS.items() for ratio in ratios}
    assert set(zip(cells.press, cells.compression_ratio)) == expected
    assert len(cells) == 2 * len(expected)  # both tasks
    assert (cells.holm_p >= cells.p_value).all() and cells.control.between(0, 1).all()
    assert cells.boundary_p.between(0, 1).all()
    text = cells_markdown(cells) + depth_markdown(cells)
    assert "| chunk:scorer=keydiff | 8 | 0.125 | niah_single |" in text
    assert set(cells.model) == {"smollm2"}  # read from the runs, not assumed: the title and header name it
    assert "smollm2, prefix protocol, query-agnostic, 1024 tokens." in text
    figure = tmp_path / "audit.png"
    assert main([SCREEN, "--figure", str(figure), "--output", str(tmp_path / "t.md")]) == 0
    assert figure.stat().st_size > 10_000
    assert (tmp_path / "t.md").read_text() == cells_markdown(cells) + "\n" + depth_markdown(cells)
    assert main([str(tmp_path)]) == 2  # no summary.json: a clear error, exit 2
    every, _ = load([SCREEN], None)  # every press and ratio of the run but the control
    assert len(every) == 2 * 5 * 4 and "no_press" not in set(every.press)
