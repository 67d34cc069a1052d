"""Nothing silent: the check that fails `make test` when a code cell that printed stops printing.

conftest.py records, during the nbval run, which code cells printed; course_lib.tooling.nbtools
compares them with tests/printing_cells.json. These tests run the comparison on made-up runs:
no notebook is executed here.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from course_lib.tooling import nbtools
from course_lib.tooling.nbtools import CellRun, NotebookRun

pytestmark = pytest.mark.slow  # pytest runs of small notebooks: left out by make test-fast

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "tests" / "printing_cells.json"


def out(text, name="stdout"):
    return {"output_type": "stream", "name": name, "text": text}


def shown(data, kind="display_data"):
    return {"output_type": kind, "data": data, "metadata": {}}


@pytest.mark.parametrize(
    "outputs, expected",
    [
        ([out("hello\n")], True),
        ([out(["line one\n", "line two\n"])], True),  # nbformat may keep text as a list
        ([], False),
        ([out("\n")], False),  # print("\n".join([])): a search that found nothing
        ([out("\n\n  \t\n")], False),  # only whitespace, however much
        ([out("UserWarning: something\n", name="stderr")], False),  # warnings and progress bars do not count
        ([out("\n"), out("a warning\n", name="stderr")], False),
        ([shown({"image/png": "iVBORw0KGgo=", "text/plain": "<Figure size 900x400 with 1 Axes>"})], True),
        ([shown({"text/plain": "''"}, kind="execute_result")], True),  # a cell ending in an empty string
        ([shown({"text/plain": "   "})], False),
        ([shown({"text/plain": "VBox(...)", nbtools.WIDGET_VIEW: {"model_id": "1"}})], True),
        ([shown({"text/plain": "<b>0.1</b> in bits", "text/html": "<b>0.1</b>", nbtools.WIDGET_VIEW: {}})], True),
        # tqdm's bar in a notebook is a widget: it shows that the loop ran, not that the cell printed
        (
            [shown({"text/plain": "train fp32:   0%|          | 0/50 [00:00<?, ?step/s]", nbtools.WIDGET_VIEW: {}})],
            False,
        ),
        (
            [shown({"text/plain": "epochs: 100%|##########| 2/2 [00:01<00:00]", nbtools.WIDGET_VIEW: {}}), out("\n")],
            False,
        ),
        ([shown({"text/plain": "epochs: 100%|##########| 2/2", nbtools.WIDGET_VIEW: {}}), out("loss 0.31\n")], True),
        ([{"output_type": "error", "ename": "AssertionError", "evalue": "", "traceback": []}], False),
    ],
)
def test_printed_means_visible_output_and_only_whitespace_is_nothing(outputs, expected):
    assert nbtools.printed(outputs) is expected


def run_of(cells: dict[str, bool | None], code_cells: int | None = None) -> NotebookRun:
    """A notebook run: cell id -> printed, in notebook order (every other cell markdown)."""
    runs = {c: CellRun(2 * i + 1, p, f"# first line of {c}") for i, (c, p) in enumerate(cells.items())}
    return NotebookRun(code_cells=len(cells) if code_cells is None else code_cells, cells=runs)


MANIFEST_OF_FAKES = {"notebooks/08_x.ipynb": ["a", "b", "gone-silent"], "exercises/08_x_ex.ipynb": ["e1"]}


def test_a_listed_cell_that_printed_nothing_is_reported_with_where_and_how_to_refresh():
    runs = {"notebooks/08_x.ipynb": run_of({"a": True, "b": True, "gone-silent": False})}
    silent = nbtools.silent_cells(MANIFEST_OF_FAKES, runs)
    assert [(path, cell_id, cell.index) for path, cell_id, cell in silent] == [
        ("notebooks/08_x.ipynb", "gone-silent", 5)
    ]
    report = "\n".join(nbtools.silence_report(silent))
    assert "notebooks/08_x.ipynb, cell 5 (id gone-silent) printed nothing" in report
    assert "its first line: '# first line of gone-silent'" in report
    assert "python -m course_lib.tooling.nbtools printing-cells notebooks/08_x.ipynb" in report


def test_new_cells_cells_that_stay_silent_and_still_printing_cells_are_not_reported():
    runs = {
        "notebooks/08_x.ipynb": run_of(
            {"a": True, "new": False, "new-printing": True, "quiet": False, "b": True, "gone-silent": True}
        )
    }
    assert nbtools.silent_cells(MANIFEST_OF_FAKES, runs) == []
    assert nbtools.unlisted_printing_cells(MANIFEST_OF_FAKES, runs) == {"notebooks/08_x.ipynb": ["new-printing"]}


def test_a_notebook_not_in_the_manifest_is_not_judged():
    assert nbtools.silent_cells(MANIFEST_OF_FAKES, {"notebooks/10_new.ipynb": run_of({"a": False})}) == []


@pytest.mark.parametrize(
    "why, run",
    [
        ("a -k selection or a stop midway: a cell never ran", run_of({"a": True, "gone-silent": False}, code_cells=3)),
        ("a cell failed, so it was not recorded", run_of({"a": True, "b": True, "gone-silent": False}, code_cells=4)),
    ],
)
def test_a_notebook_whose_cells_did_not_all_run_is_not_judged(why, run):
    assert not run.complete, why
    assert nbtools.silent_cells(MANIFEST_OF_FAKES, {"notebooks/08_x.ipynb": run}) == [], why
    assert nbtools.updated_manifest(MANIFEST_OF_FAKES, {"notebooks/08_x.ipynb": run}) == dict(
        sorted(MANIFEST_OF_FAKES.items())
    ), "a partial run must not rewrite its notebook's entry"


def test_a_cell_nbval_skipped_as_tagged_is_not_judged_and_does_not_stop_the_others_being_judged():
    runs = {"notebooks/08_x.ipynb": run_of({"a": None, "b": True, "gone-silent": False})}
    assert [cell_id for _, cell_id, _ in nbtools.silent_cells(MANIFEST_OF_FAKES, runs)] == ["gone-silent"]


def test_only_the_notebooks_that_ran_are_judged():
    runs = {"exercises/08_x_ex.ipynb": run_of({"e0": False, "e1": False})}
    assert [(p, c) for p, c, _ in nbtools.silent_cells(MANIFEST_OF_FAKES, runs)] == [("exercises/08_x_ex.ipynb", "e1")]


def test_the_cunning_case_a_print_that_became_an_empty_line_is_silence():
    """Chapter 08's cell once searched Trainer.train_step for `no_sync` after the code had moved
    to amp_step: print("\\n".join([])) printed one empty line, and nobody noticed."""
    outputs = [out("\n".join([]) + "\n")]
    runs = {"notebooks/08_x.ipynb": run_of({"a": True, "b": nbtools.printed(outputs), "gone-silent": True})}
    assert [c for _, c, _ in nbtools.silent_cells(MANIFEST_OF_FAKES, runs)] == ["b"]


def test_updating_rewrites_complete_notebooks_in_notebook_order_and_keeps_the_rest(tmp_path):
    runs = {
        "notebooks/08_x.ipynb": run_of({"z-first": True, "a": False, "new": True}),
        "notebooks/09_y.ipynb": run_of({"y": True}, code_cells=2),
    }
    updated = nbtools.updated_manifest(MANIFEST_OF_FAKES, runs)
    assert updated == {"exercises/08_x_ex.ipynb": ["e1"], "notebooks/08_x.ipynb": ["z-first", "new"]}
    path = tmp_path / "printing_cells.json"
    nbtools.write_manifest(updated, path)
    assert nbtools.read_manifest(path) == updated
    assert nbtools.read_manifest(tmp_path / "none.json") == {}


def test_the_refresh_command_runs_nbval_as_make_test_does():
    make = (ROOT / "Makefile").read_text()
    args = nbtools._nbval_args()
    assert "--nbval-lax" in args and " ".join(args) in make
    assert nbtools.REFRESH_PRINTING.split()[-1] == "printing-cells"


# --------------------------------------------------------------------------- the committed manifest


def test_the_manifest_lists_existing_code_cells_of_the_notebooks_nbval_runs():
    """A listed cell that was deleted or given a new id would never be judged again."""
    data = json.loads(MANIFEST.read_text(encoding="utf-8"))
    assert set(data) == {"about", "cells"} and data["cells"]
    wrong = []
    for path, ids in data["cells"].items():
        assert path.split("/")[0] in nbtools.PRINTING_FOLDERS, path
        nb = nbformat.read(ROOT / path, as_version=4)
        code = {c.get("id") for c in nb.cells if c.cell_type == "code"}
        assert len(ids) == len(set(ids)), f"{path}: a cell listed twice"
        wrong += [f"{path}: {i}" for i in ids if i not in code]
    assert not wrong, (
        f"the manifest lists cells these notebooks no longer have: {wrong}; drop them from "
        f"tests/printing_cells.json or run `{nbtools.REFRESH_PRINTING} NOTEBOOK`"
    )


def test_chapter_08s_no_sync_cell_is_listed_as_printing():
    assert "c26-08_distributed" in nbtools.read_manifest(MANIFEST)["notebooks/08_distributed.ipynb"]


# --------------------------------------------------------------------------- the wiring in conftest.py


@pytest.mark.skipif(os.environ.get("COURSE_GPU_TIER") == "1", reason="the check runs in the CPU tier only")
def test_conftest_records_a_small_notebook_then_fails_the_run_when_a_listed_cell_prints_only_an_empty_line(tmp_path):
    """Two short nbval runs of a 4-cell notebook (not a course notebook) with the repository's conftest.py."""
    shutil.copy(ROOT / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "tests").mkdir()
    nb = nbformat.v4.new_notebook()
    sources = [
        'lines = ["def step():", "    with model.no_sync():"]',
        'print("\\n".join(line for line in lines if "no_sync" in line))',
        'print("done")',
        "x = 1",
    ]
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    for i, cell in enumerate(nb.cells):
        cell.id = f"cell-{i}"
    nbformat.write(nb, tmp_path / "probe.ipynb")

    def pytest_run(*extra):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "probe.ipynb",
                "--nbval-lax",
                "--nbval-current-env",
                "-p",
                "no:cacheprovider",
                "-q",
                *extra,
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            env={**os.environ, "COURSE_GPU_TIER": "0"},
            timeout=300,
        )

    made = pytest_run("--update-printing-cells")
    assert made.returncode == 0, made.stdout
    assert nbtools.read_manifest(tmp_path / "tests" / "printing_cells.json") == {"probe.ipynb": ["cell-1", "cell-2"]}

    nb.cells[0].source = 'lines = ["def step():", "    return amp_step()"]'  # the code moved elsewhere
    nbformat.write(nb, tmp_path / "probe.ipynb")
    moved = pytest_run()
    assert moved.returncode == pytest.ExitCode.TESTS_FAILED and "4 passed" in moved.stdout, moved.stdout
    assert "code cells that stopped printing (fails the run)" in moved.stdout
    assert "probe.ipynb, cell 1 (id cell-1, nbval's Cell 1) printed nothing" in moved.stdout
    assert "cell-2" not in moved.stdout.split("stopped printing")[1]


# --------------------------------------------------------------------------- no data dumps


@pytest.mark.skipif(os.environ.get("COURSE_GPU_TIER") == "1", reason="run in the CPU tier only")
def test_conftest_fails_the_run_on_a_cell_whose_result_is_a_data_dump_even_with_a_trailing_semicolon(tmp_path):
    """One nbval run of a 4-cell notebook with the repository's conftest.py. The dump ends in `;`, which
    hides a result only where IPython keeps the input history: nbval runs cells with store_history=False,
    so the whole list is the cell's result, as the records of 28 `show_reference(...);` cells once were in
    build/executed/."""
    shutil.copy(ROOT / "conftest.py", tmp_path / "conftest.py")
    nb = nbformat.v4.new_notebook()
    sources = [
        'records = [{"row": i, "ms": i / 7} for i in range(300)]',
        "records;",  # 300 lines of pretty-printed dicts
        'print("\\n".join(str(r) for r in records))',  # printed on purpose: a stream, not a result
        "len(records)",
    ]  # a short result is fine
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    for i, cell in enumerate(nb.cells):
        cell.id = f"cell-{i}"
    nbformat.write(nb, tmp_path / "dump_probe.ipynb")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "dump_probe.ipynb",
            "--nbval-lax",
            "--nbval-current-env",
            "-p",
            "no:cacheprovider",
            "-q",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "COURSE_GPU_TIER": "0"},
        timeout=300,
    )
    assert run.returncode == pytest.ExitCode.TESTS_FAILED and "4 passed" in run.stdout, run.stdout
    report = run.stdout.split("cells that show a data dump as their result (fails the run)")[1]
    assert "dump_probe.ipynb, cell 1 (id cell-1): its execute_result shows 300 lines" in report, report
    assert "the cell's first line: 'records;'" in report and "cell-2" not in report and "cell-3" not in report
    assert not (ROOT / "build" / "executed" / "dump_probe.ipynb").exists(), "a dumping notebook is not published"
