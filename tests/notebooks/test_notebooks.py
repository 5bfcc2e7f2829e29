"""Every notebook runs top to bottom from a fresh kernel without a cell error."""

from __future__ import annotations

import os
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((pathlib.Path(__file__).parents[2] / "notebooks").glob("*.ipynb"))


def test_notebooks_are_stored_without_outputs():
    assert NOTEBOOKS, "no notebooks found"
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{path.name} is stored with outputs"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    env_backup = dict(os.environ)
    os.environ.setdefault("MPLBACKEND", "Agg")
    try:
        client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                         resources={"metadata": {"path": str(tmp_path)}})
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(env_backup)


def test_quickstart_text_names_the_scorer_its_select_press_uses():
    """Notebook 01 says by which score `select` mode keeps a window's tokens: the score of the scorer its
    ChunkedStridePress uses, the default one (the notebook's code sets no scorer=)."""
    from kvpress_phase import ChunkedStridePress
    from kvpress_phase.presses.scorers import SCORERS

    nb = nbformat.read(NOTEBOOKS[0].parent / "01_quickstart.ipynb", as_version=4)
    assert not any("scorer=" in cell.source for cell in nb.cells if cell.cell_type == "code")
    default = type(ChunkedStridePress(0.5).scorer).__name__
    text = " ".join(" ".join(cell.source.split()) for cell in nb.cells if cell.cell_type == "markdown")
    sentence = text[text.index("In `select` mode"):].split(". ")[0]
    assert default in sentence
    assert not [cls.__name__ for cls in SCORERS.values() if cls.__name__ != default and cls.__name__ in sentence]
    assert "key norm" not in sentence or default == "KnormPress"
