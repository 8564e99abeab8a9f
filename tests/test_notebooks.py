"""Notebooks are documentation: each one runs top to bottom on the tiny config."""

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
# What each notebook's outputs must show.
EXPECTED = {"quickstart.ipynb": "eval/loss", "real_model.ipynb": "effective length"}


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
    monkeypatch.setenv("LHC_QUICKSTART_STEPS", "20")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    # real_model.ipynb on a tiny random GGUF (a chat template, a byte-level BPE) instead
    # of the download.
    from .lm import _gguf_files

    gguf_path = _gguf_files.write_gguf(
        tmp_path / "tiny.gguf", "llama", _gguf_files.byte_level_vocab(), context=1024
    )
    monkeypatch.setenv("LHC_NOTEBOOK_CHECKPOINT", str(gguf_path))
    monkeypatch.setenv("LHC_NOTEBOOK_SMOKE", "1")
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    ).execute()
    outputs = [
        o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])
    ]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    shown = " ".join(str(o.get("data", {})) + str(o.get("text", "")) for o in outputs)
    assert EXPECTED[path.name] in shown
