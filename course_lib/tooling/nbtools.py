"""Notebook maintenance for course authors: stripped outputs, the outputs nbval compares, and
the cells that must keep printing.

Outputs are stripped in git except in cells tagged `nbval-check-output`, whose stored output
is the expected answer that `make test` compares against (deterministic tables, bit patterns).

Every other cell's output is only run, not compared, so a cell that silently stops printing
(a source search that finds nothing, a print that became an empty line) would still pass.
`tests/printing_cells.json` lists, per notebook, the code cells that printed something on the
CPU tier; conftest.py fails `make test` when one of them prints nothing (only whitespace counts
as nothing) in a notebook whose cells all ran.

    python -m course_lib.tooling.nbtools refresh notebooks/01_formats.ipynb   # re-run, keep checked outputs
    python -m course_lib.tooling.nbtools strip notebooks/*.ipynb              # drop every other output
    python -m course_lib.tooling.nbtools printing-cells [notebooks exercises] # re-run, rewrite the manifest
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from course_lib.tooling import notebook_filter
from course_lib.tooling.notebook_filter import WIDGET_VIEW

__all__ = [
    "keeps_output",
    "strip",
    "refresh",
    "write_committed",
    "reads_as_modified_after_run",
    "without_widget_views",
    "printed",
    "CellRun",
    "NotebookRun",
    "silent_cells",
    "unlisted_printing_cells",
    "updated_manifest",
    "read_manifest",
    "write_manifest",
    "silence_report",
    "refresh_printing_cells",
]

CHECK_TAG = "nbval-check-output"
ROOT = Path(__file__).resolve().parents[2]
PRINTING_MANIFEST = ROOT / "tests" / "printing_cells.json"
PRINTING_FOLDERS = ("notebooks", "exercises", "solutions")  # what `make test` runs under nbval
REFRESH_PRINTING = "python -m course_lib.tooling.nbtools printing-cells"


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
    write_committed(nb, path)


def write_committed(nb: nbformat.NotebookNode, path: Path) -> bool:
    """Store a notebook exactly as git's clean filter reads it (course_lib/tooling/notebook_filter.py:
    compared outputs only, one stream per run of prints, count 1), so that a learner's run of it
    reads as unchanged; True if the file changed."""
    text = notebook_filter.clean(nbformat.writes(nb).encode("utf-8")).decode("utf-8")
    if path.exists() and path.read_text(encoding="utf-8") == text:
        return False
    path.write_text(text, encoding="utf-8")
    return True


def reads_as_modified_after_run(committed: str, checked_outputs: dict[int, list]) -> bool:
    """Would git list this notebook as modified after a learner ran all of it, with the filter
    `make lab` configures? `committed` is the notebook's file; `checked_outputs` maps the index of
    each nbval-check-output cell to what it printed in this run. nbval compares those outputs after
    its sanitizer, which can let a difference pass (448 or NaN); git compares bytes."""
    nb = nbformat.reads(committed, as_version=4)
    for index, outputs in checked_outputs.items():
        nb.cells[index].outputs, nb.cells[index].execution_count = outputs, 7  # any count: the filter stores 1
    return notebook_filter.clean(nbformat.writes(nb).encode("utf-8")).decode("utf-8") != committed


# --------------------------------------------------------------------------- cells that print


def printed(outputs: list) -> bool:
    """Did a cell show anything: text on stdout, or a displayed value (a result, a plot, a widget)?
    Only whitespace is nothing: `print("\\n".join([]))` prints an empty line and shows nothing.
    stderr and tqdm's progress bars do not count: they come and go with library versions, and
    a cell whose prints went silent still draws its bars."""
    for out in outputs:
        kind = out.get("output_type")
        if kind == "stream":
            text = out.get("text", "")
            if out.get("name") == "stdout" and ("".join(text) if isinstance(text, list) else text).strip():
                return True
        elif kind in ("display_data", "execute_result"):
            if _progress_bar(out.get("data", {})):
                continue
            for value in out.get("data", {}).values():
                if isinstance(value, list):
                    value = "".join(value)
                if value.strip() if isinstance(value, str) else value:
                    return True
    return False


def _progress_bar(data: dict) -> bool:
    """tqdm in a notebook draws a widget whose text is the bar ("train fp32: 100%|...| 50/50"):
    like stderr, it says that something ran, not what came out of it."""
    text = data.get("text/plain", "")
    text = "".join(text) if isinstance(text, list) else text
    return WIDGET_VIEW in data and set(data) <= {WIDGET_VIEW, "text/plain"} and bool(_BAR.search(text))


_BAR = re.compile(r"\d+%\|.*\| *\d+/")


@dataclass
class CellRun:
    """One code cell that ran to its end in this session: where it is and whether it printed
    (None: not judged, e.g. nbval skipped it as tagged)."""

    index: int  # in the notebook's list of cells (markdown included)
    printed: bool | None
    first_line: str = ""
    nbval_cell: int | None = None  # nbval counts code cells only: the test is `notebook.ipynb::Cell N`


@dataclass
class NotebookRun:
    """What one session saw of one notebook: how many code cells it has, and those that ran."""

    code_cells: int
    cells: dict[str, CellRun] = field(default_factory=dict)  # cell id -> its run

    @property
    def complete(self) -> bool:
        """Every code cell ran to its end: no selection (-k), no failure, no stop midway."""
        return len(self.cells) == self.code_cells


def silent_cells(manifest: dict[str, list[str]], runs: dict[str, NotebookRun]) -> list[tuple[str, str, CellRun]]:
    """(notebook, cell id, its run) for each cell the manifest lists as printing that printed
    nothing now, in notebooks that ran completely. New cells and notebooks are not judged."""
    found = []
    for path, run in sorted(runs.items()):
        if not run.complete:
            continue
        for cell_id in manifest.get(path, []):
            cell = run.cells.get(cell_id)
            if cell is not None and cell.printed is False:
                found.append((path, cell_id, cell))
    return found


def unlisted_printing_cells(manifest: dict[str, list[str]], runs: dict[str, NotebookRun]) -> dict[str, list[str]]:
    """Cells that printed in completely run notebooks but that the manifest does not list (new
    cells, or a manifest not refreshed): not judged until it is."""
    out = {}
    for path, run in sorted(runs.items()):
        listed = set(manifest.get(path, []))
        new = [i for i, c in run.cells.items() if c.printed and i not in listed] if run.complete else []
        if new:
            out[path] = new
    return out


def updated_manifest(manifest: dict[str, list[str]], runs: dict[str, NotebookRun]) -> dict[str, list[str]]:
    """The manifest with each completely run notebook's entry replaced by the cells that printed
    now, in notebook order; other notebooks keep their entries."""
    out = dict(manifest)
    for path, run in runs.items():
        if run.complete:
            out[path] = [i for i, c in sorted(run.cells.items(), key=lambda kv: kv[1].index) if c.printed]
    return dict(sorted(out.items()))


def read_manifest(path: Path = PRINTING_MANIFEST) -> dict[str, list[str]]:
    """notebook path (from the repository root) -> ids of its code cells that print on the CPU tier."""
    if not path.exists():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def write_manifest(manifest: dict[str, list[str]], path: Path = PRINTING_MANIFEST) -> None:
    about = (
        "Code cells that printed something (stdout or a displayed value; not only whitespace) on the "
        "CPU tier, per notebook. conftest.py fails the run when one of them prints nothing. "
        f"Written by `{REFRESH_PRINTING}`; do not edit by hand, except to drop a deleted cell."
    )
    text = json.dumps({"about": about, "cells": dict(sorted(manifest.items()))}, indent=1, ensure_ascii=False)
    path.write_text(text + "\n", encoding="utf-8")


def silence_report(silent: list[tuple[str, str, CellRun]], manifest: str = "tests/printing_cells.json") -> list[str]:
    """Lines for the terminal summary: which cells went silent, and what to do about it."""
    lines = []
    for path, cell_id, cell in silent:
        nbval = f", nbval's Cell {cell.nbval_cell}" if cell.nbval_cell is not None else ""
        lines += [
            f"{path}, cell {cell.index} (id {cell_id}{nbval}) printed nothing; {manifest} lists it as printing",
            f"    its first line: {cell.first_line!r}",
        ]
    return lines + [
        "A cell that shows library source by searching it prints nothing once the code moves: fix the cell.",
        f"If the silence is intended, refresh the manifest: {REFRESH_PRINTING} "
        + " ".join(sorted({path for path, _, _ in silent})),
    ]


def _nbval_args() -> list[str]:
    """The nbval options `make test` uses (the Makefile's NBVAL line), so the manifest is made the same way."""
    make = (ROOT / "Makefile").read_text(encoding="utf-8")
    return re.search(r"^NBVAL\s*:=\s*(.+)$", make, re.M).group(1).split()


def refresh_printing_cells(paths: list[Path]) -> int:
    """Run these notebooks (default: notebooks/ and exercises/) under nbval on the CPU tier and
    rewrite their entries in the manifest."""
    targets = [str(p.resolve()) for p in paths] or list(PRINTING_FOLDERS)  # pytest runs from the root
    cmd = [sys.executable, "-m", "pytest", *targets, *_nbval_args(), "--update-printing-cells", "-q"]
    print(" ".join(cmd))
    return subprocess.run(cmd, cwd=ROOT).returncode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m course_lib.tooling.nbtools", description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["strip", "refresh", "printing-cells"])
    p.add_argument("paths", nargs="*", type=Path)
    args = p.parse_args(argv)
    if args.command == "printing-cells":
        return refresh_printing_cells(args.paths)
    if not args.paths:
        p.error(f"{args.command} needs one or more notebooks")
    for path in args.paths:
        if args.command == "refresh":
            refresh(path)
            print("refreshed", path)
        else:
            nb = nbformat.read(path, as_version=4)
            strip(nb)
            if write_committed(nb, path):
                print("stripped", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
