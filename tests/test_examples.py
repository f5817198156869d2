"""Notebooks under examples/ are executed, so they cannot rot."""

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

from tests.xla_env import optimized_env

EXAMPLES = pathlib.Path(__file__).parent.parent / "examples"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.ipynb")), ids=lambda p: p.name)
def test_notebook_runs(path):
    nb = nbformat.read(path, as_version=4)
    # The kernel gets XLA's default CPU optimizations, as a user's would: the quickstart runs
    # ~160 decode steps of the embedded 30-layer model, ~3x slower each without them, and
    # compiles its five programs in about the same time either way (81 -> ~60 s).
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(EXAMPLES)}}).execute(env=optimized_env())
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.output_type == "error"]
    assert not errors
