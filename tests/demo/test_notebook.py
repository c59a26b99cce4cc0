"""The quickstart notebook is executed headlessly, so it cannot rot."""

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).parents[2] / "examples" / "quickstart.ipynb"


def test_quickstart_notebook_runs(tmp_path):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)
    assert (tmp_path / "runs" / "quickstart" / "dynamics.png").stat().st_size > 10_000
    text = "".join(o.get("text", "") + str(o.get("data", {}).get("text/plain", "")) for o in outputs)
    assert "buffer: 128 examples" in text and "poise/variance_reduction" in text
