"""Every notebook in notebooks/ runs top to bottom (nbclient, from the notebooks folder), so none rots:
a cell that raises fails the test with the cell's error."""

from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_the_notebook_runs(path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
