"""Notebook maintenance for course authors: stripped outputs, and the outputs nbval compares.

Outputs are stripped in git except in cells tagged `nbval-check-output`, whose stored output
is the expected answer that `make test` compares against (deterministic tables, bit patterns).

    python -m course_lib.tooling.nbtools refresh notebooks/01_formats.ipynb   # re-run, keep checked outputs
    python -m course_lib.tooling.nbtools strip notebooks/*.ipynb              # drop every other output
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

__all__ = ["keeps_output", "strip", "refresh", "without_widget_views"]

CHECK_TAG = "nbval-check-output"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def keeps_output(cell: nbformat.NotebookNode) -> bool:
    """Does this cell keep its output in git (nbval compares it)?"""
    return cell.cell_type == "code" and CHECK_TAG in cell.get("metadata", {}).get("tags", [])


def without_widget_views(nb: nbformat.NotebookNode) -> bool:
    """Drop, from every output, the widget views whose model is not saved in the notebook's metadata
    (opened before running, JupyterLab would show "model not found" instead of the output's other
    representations, which stay). True if any went."""
    state = nb.get("metadata", {}).get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {})
    saved = state.get("state", {})
    changed = False
    for cell in nb.get("cells", []):
        for out in cell.get("outputs", []):
            view = out.get("data", {}).get(WIDGET_VIEW)
            if view is not None and view.get("model_id") not in saved:
                del out["data"][WIDGET_VIEW]
                changed = True
    return changed


def strip(nb: nbformat.NotebookNode) -> bool:
    """Remove outputs and counts from every cell that nbval does not compare, and widget views
    whose model is not saved."""
    changed = without_widget_views(nb)
    for cell in nb.cells:
        if cell.get("metadata", {}).pop("execution", None) is not None:
            changed = True  # nbclient's per-cell timestamps: noise in every diff
        if cell.cell_type == "code" and not keeps_output(cell) and (cell.outputs or cell.execution_count):
            cell.outputs, cell.execution_count, changed = [], None, True
        if keeps_output(cell) and cell.outputs and cell.execution_count != 1:
            # nbval treats a cell without an execution count as never run and refuses to compare;
            # a fixed count keeps diffs quiet when the notebook is re-run.
            cell.execution_count, changed = 1, True
    return changed


def refresh(path: Path, timeout: int = 600) -> None:
    """Execute a notebook in its folder and store only the compared outputs."""
    import torch

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    with client.setup_kernel():
        for index, cell in enumerate(nb.cells):
            if "gpu" in cell.get("metadata", {}).get("tags", []) and not torch.cuda.is_available():
                continue  # gpu cells are leaves: nothing after them needs their results
            client.execute_cell(cell, index)
    strip(nb)
    for cell in nb.cells:
        if keeps_output(cell):
            for out in cell.outputs:
                if out.get("output_type") == "execute_result":
                    out["execution_count"] = 1  # same fixed count as the cell; the schema requires one
    nbformat.write(nb, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m course_lib.tooling.nbtools", description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["strip", "refresh"])
    p.add_argument("paths", nargs="+", type=Path)
    args = p.parse_args(argv)
    for path in args.paths:
        if args.command == "refresh":
            refresh(path)
            print("refreshed", path)
        else:
            nb = nbformat.read(path, as_version=4)
            if strip(nb):
                nbformat.write(nb, path)
                print("stripped", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
