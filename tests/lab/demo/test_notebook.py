"""The quickstart notebook is executed headlessly, so it cannot rot: it must learn and reuse the demo's model."""

import json
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).parents[3] / "examples" / "quickstart.ipynb"


def test_quickstart_notebook_learns_with_the_demo_model(demo_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(demo_cache))  # the kernel inherits it: `make demo`'s cache
    cache = demo_cache / "poise-trl"
    (model_dir,) = cache.iterdir()
    built = {path.name: path.stat().st_mtime_ns for path in model_dir.iterdir()}

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # A cell's limit catches a hung kernel, not a slow one: the training cell takes about 20 s alone on 2 cores, and
    # passed 600 s while other jobs shared them.
    NotebookClient(
        notebook, timeout=1800, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)
    assert (tmp_path / "runs" / "quickstart" / "dynamics.png").stat().st_size > 10_000
    text = "".join(o.get("text", "") + str(o.get("data", {}).get("text/plain", "")) for o in outputs)
    assert "poise/variance_reduction" in text and "buffer: 2048 examples" in text

    # The demo's cached model was used as it was: no new warm start, nothing rewritten, no second cache.
    assert f"model: {model_dir}\n" in text
    assert list(cache.iterdir()) == [model_dir]
    assert {path.name: path.stat().st_mtime_ns for path in model_dir.iterdir()} == built

    # The policy learns instead of collapsing (at lr 1e-3 the reward fell from 0.5 to 0 within 4 steps).
    history = json.loads((tmp_path / "runs" / "quickstart" / "trainer_state.json").read_text())["log_history"]
    rewards = [entry["reward"] for entry in history if "reward" in entry]
    quarter = len(rewards) // 4
    first, last = sum(rewards[:quarter]) / quarter, sum(rewards[-quarter:]) / quarter
    assert len(rewards) == 64 and min(rewards[-quarter:]) > 0
    assert last >= first, f"mean reward fell from {first:.3f} (first quarter) to {last:.3f} (last quarter)"
    assert f"first quarter {first:.3f}, last quarter {last:.3f}" in text
