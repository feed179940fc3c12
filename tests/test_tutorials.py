"""The tutorials of docs/tutorials/ run: each jupytext percent-format script becomes a notebook executed cell by cell
in a fresh python3 kernel, in its tiny mode (``PROBCAPS_TUTORIAL_TINY=1``: few images, few steps).  A cell that
raises, an assertion of a tutorial's own (the enumerated ELBO against the brute-force sum) included, fails."""

from __future__ import annotations

from pathlib import Path

import jupytext  # the test extra installs it: missing, the suite fails rather than skips
import nbclient
import pytest
from conftest import REAL_DATA_ROOT, real_mnist_available

TUTORIALS = Path(__file__).resolve().parent.parent / "docs" / "tutorials"
NEEDS_MNIST = {"trained_model.py"}  # the shipped MNIST model on real test digits


def test_every_tutorial_is_listed_here_and_has_a_tiny_mode():
    # catches: a tutorial added without a run in this file, or one the suite would run at full size
    names = {p.name for p in TUTORIALS.glob("*.py")}
    assert names == {"generative_model.py", "trained_model.py", "training.py"}, names
    for name in names:
        assert 'os.environ.get("PROBCAPS_TUTORIAL_TINY") == "1"' in (TUTORIALS / name).read_text(), name


@pytest.mark.slow
@pytest.mark.parametrize("name", ["generative_model.py", "trained_model.py", "training.py"])
def test_tutorial_runs_as_a_notebook(name, tmp_path, monkeypatch):
    if name in NEEDS_MNIST and not real_mnist_available():
        pytest.skip(f"real MNIST not present under {REAL_DATA_ROOT}")
    notebook = jupytext.read(TUTORIALS / name)
    assert notebook.metadata["kernelspec"]["name"] == "python3"
    assert sum(cell.cell_type == "code" for cell in notebook.cells) >= 5
    # the kernel inherits the environment: tiny mode, the data, one thread (the machine is shared)
    monkeypatch.setenv("PROBCAPS_TUTORIAL_TINY", "1")
    monkeypatch.setenv("PROBCAPS_DATA", str(REAL_DATA_ROOT))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    client = nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    errors = [out for cell in notebook.cells for out in cell.get("outputs", []) if out.get("output_type") == "error"]
    assert not errors, errors
    assert list(tmp_path.iterdir()) == []  # a tutorial cleans up after itself and writes nowhere else
