"""Notebook hygiene: Colab stamping, stripped outputs, chapter structure, gpu cells as leaves."""
import ast
import json
from pathlib import Path

import nbformat
import pytest

from course_lib.tooling import colab
from course_lib.tooling.nbtools import keeps_output

ROOT = Path(__file__).resolve().parents[1]
ALL = colab.notebook_paths(ROOT)
CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def ids(paths):
    return [p.relative_to(ROOT).as_posix() for p in paths]


def test_there_are_notebooks_to_check():
    assert CHAPTERS and any((ROOT / "solutions").glob("*.ipynb"))


def test_every_notebook_is_stamped_with_the_configured_badge_and_setup_cell():
    assert colab.stamp_all(ROOT, check=True) == [], "run `make stamp`"


@pytest.mark.parametrize("path", ALL, ids=ids(ALL))
def test_badge_links_to_this_notebook_on_colab(path):
    nb = nbformat.read(path, as_version=4)
    cfg = colab.read_config(ROOT)
    assert f"github/{cfg['repo']}/blob/{cfg['ref']}/{path.relative_to(ROOT).as_posix()})" in nb.cells[0].source
    assert nb.metadata["colab"]["gpuType"] == "T4" and nb.metadata["accelerator"] == "GPU"


def test_colab_setup_cell_is_short_collapsed_and_explained_in_markdown():
    cfg = colab.read_config(ROOT)
    src = colab.setup_source(cfg)
    assert src.startswith("# @title")  # Colab shows it collapsed, as a form
    statements = [n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.stmt)]
    assert len(statements) <= 6, f"{len(statements)} statements of logic; keep the setup cell to 6"
    badge = colab.badge_source("notebooks/00_setup.ipynb", cfg)
    assert "without touching Colab's own torch" in badge and "running it again does nothing new" in badge


def test_stamping_twice_changes_nothing():
    nb = nbformat.read(CHAPTERS[0], as_version=4)
    colab.stamp_notebook(nb, "notebooks/00_setup.ipynb")
    assert colab.stamp_notebook(nb, "notebooks/00_setup.ipynb") is False


def test_colab_setup_cell_never_installs_or_pins_torch():
    src = colab.setup_source(colab.read_config(ROOT))
    pip_lines = [line for line in src.splitlines() if "pip" in line]
    assert pip_lines and all("torch" not in line for line in pip_lines)
    assert '"google.colab" in sys.modules' in src


@pytest.mark.parametrize("path", ALL, ids=ids(ALL))
def test_outputs_are_stripped_except_in_cells_nbval_compares(path):
    nb = json.loads(path.read_text())
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        if keeps_output(nbformat.from_dict(cell)):
            assert cell["outputs"], f"cell {i} is tagged nbval-check-output but has no stored output"
        else:
            assert not cell["outputs"] and cell["execution_count"] is None, f"cell {i} has stray output"


@pytest.mark.parametrize("path", CHAPTERS, ids=ids(CHAPTERS))
def test_chapter_has_objectives_questions_summary_exercises_and_reading(path):
    text = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "markdown")
    for heading in ("Learning objectives", "Check your understanding", "Summary", "Exercises", "Further reading"):
        assert heading in text, f"{path.name} lacks a '{heading}' section"


def _names(source: str, ctx) -> set[str]:
    try:
        tree = ast.parse("\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))))
    except SyntaxError:
        return set()
    out = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ctx)}
    if ctx is ast.Store:
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.ClassDef)):
                out.add(n.name)
            elif isinstance(n, ast.arg):  # parameters of functions and lambdas
                out.add(n.arg)
            elif isinstance(n, (ast.Import, ast.ImportFrom)):
                out |= {(a.asname or a.name).split(".")[0] for a in n.names}
    return out


@pytest.mark.parametrize("path", ALL, ids=ids(ALL))
def test_gpu_cells_guard_themselves(path):
    """Only imports, then one `if gpu_cell(...):` holding everything else: off CUDA the cell prints one line."""
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type != "code" or "gpu" not in cell.metadata.get("tags", []):
            continue
        body = [s for s in ast.parse(cell.source).body if not isinstance(s, (ast.Import, ast.ImportFrom))]
        guard = body[0].test if len(body) == 1 and isinstance(body[0], ast.If) else None
        assert isinstance(guard, ast.Call) and getattr(guard.func, "id", None) == "gpu_cell" and not body[0].orelse, \
            f"gpu cell {cell.id} must be `if gpu_cell(...):` around all of its code:\n{cell.source}"


@pytest.mark.parametrize("path", ALL, ids=ids(ALL))
def test_a_gpu_cells_one_line_off_cuda_fits_in_100_characters(path):
    import inspect

    from course_lib.device import gpu_cell
    default = inspect.signature(gpu_cell).parameters["instead"].default
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type == "code" and "gpu" in cell.metadata.get("tags", []):
            guard = next(s for s in ast.parse(cell.source).body if isinstance(s, ast.If)).test
            what, instead = ([ast.literal_eval(a) for a in guard.args] + [default])[:2]
            line = f"[needs a CUDA GPU, none here] {what}; {instead}."
            assert len(line) <= 100, f"gpu cell {cell.id} prints {len(line)} characters off CUDA: {line}"


@pytest.mark.parametrize("path", ALL, ids=ids(ALL))
def test_gpu_cells_are_leaves(path):
    """A name defined only in a `gpu` cell must not be used later: without a GPU it would not exist."""
    cells = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    gpu_only: set[str] = set()
    for cell in cells:
        if "gpu" in cell.metadata.get("tags", []):
            gpu_only |= _names(cell.source, ast.Store)
        else:
            stored = _names(cell.source, ast.Store)  # a cell that assigns a name defines it itself
            used = (_names(cell.source, ast.Load) - stored) & gpu_only
            assert not used, f"{sorted(used)} come from a gpu cell but are used by a later cell"
            gpu_only -= stored
