"""Notebook hygiene: Colab stamping, stripped outputs, chapter structure, gpu cells as leaves, links to follow."""

import ast
import json
import re
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
    url = (
        f"https://colab.research.google.com/github/{cfg['repo']}/blob/{cfg['ref']}/{path.relative_to(ROOT).as_posix()}"
    )
    assert f"]({url})" in nb.cells[0].source
    assert f"[Open this notebook in Colab]({url})" in nb.cells[0].source  # offline the badge image is broken
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
        assert isinstance(guard, ast.Call) and getattr(guard.func, "id", None) == "gpu_cell" and not body[0].orelse, (
            f"gpu cell {cell.id} must be `if gpu_cell(...):` around all of its code:\n{cell.source}"
        )


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


# --------------------------------------------------------------------------- finding your way

LINK = re.compile(r"\]\(([^)\s]+)\)")  # the target of every markdown link and image


def _markdown(path: Path) -> list[str]:
    return [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "markdown"]


def _relative_targets(source: str) -> list[str]:
    return [t.split("#")[0] for t in LINK.findall(source) if not re.match(r"^[a-z]+:|^#", t)]


@pytest.mark.parametrize("path", CHAPTERS, ids=ids(CHAPTERS))
def test_a_chapter_ends_with_links_to_the_previous_and_next_chapter_and_its_exercises(path):
    i = CHAPTERS.index(path)
    last = nbformat.read(path, as_version=4).cells[-1]
    assert last.cell_type == "markdown", f"{path.name} does not end with its navigation links"
    targets = set(_relative_targets(last.source))
    wanted = {f"../exercises/{path.stem}_exercises.ipynb"}
    wanted |= {CHAPTERS[i - 1].name} if i > 0 else {"../README.md"}
    wanted |= {CHAPTERS[i + 1].name} if i + 1 < len(CHAPTERS) else {"../README.md"}
    assert wanted <= targets, f"{path.name}'s last cell lacks links to {sorted(wanted - targets)}"


@pytest.mark.parametrize("path", CHAPTERS, ids=ids(CHAPTERS))
def test_every_notebook_and_markdown_link_of_a_chapter_leads_to_a_file(path):
    targets = [t for source in _markdown(path) for t in _relative_targets(source)]
    assert any(t.endswith(".ipynb") for t in targets)
    broken = [t for t in targets if t.endswith((".ipynb", ".md")) and not (path.parent / t).is_file()]
    assert not broken, f"{path.name} links to files that do not exist: {broken}"


def test_the_links_that_the_test_reads_are_the_ones_a_markdown_renderer_follows():
    source = "see [`exercises/00_x.ipynb`](../exercises/00_x.ipynb), [web](https://a.b/c.md), [top](#top)"
    assert _relative_targets(source) == ["../exercises/00_x.ipynb"]


@pytest.mark.parametrize("path", CHAPTERS, ids=ids(CHAPTERS))
def test_notebook_and_readme_paths_are_links_not_code_spans(path):
    """A path to a notebook or a markdown file shown as `code` cannot be clicked; it must be a link."""
    spans = [
        m.group(0) for source in _markdown(path) for m in re.finditer(r"(?<!\[)`[^`\s]*\.(?:ipynb|md)`(?!\]\()", source)
    ]
    assert not spans, f"{path.name}: make these links: {spans}"


def test_chapter_00_links_every_chapter_its_exercises_and_the_readme():
    targets = {t for source in _markdown(CHAPTERS[0]) for t in _relative_targets(source)}
    wanted = {p.name for p in CHAPTERS[1:]} | {f"../exercises/{p.stem}_exercises.ipynb" for p in CHAPTERS}
    assert wanted | {"../README.md"} <= targets, sorted(wanted - targets)


# --------------------------------------------------------------------------- printed tables


def test_the_targets_table_of_chapter_09_is_aligned_within_100_columns():
    from course_lib.chapters.ch09.targets import format_targets, targets

    rows = targets([], None)
    rows[0].update(value=3123.4, met=True, stretch_met=False)  # the widest numbers a recorded run gives
    rows[3].update(value=0.7012, met=False, stretch_met=False)
    lines = format_targets(rows).splitlines()
    assert all(len(line) <= 100 for line in lines) and len({len(line) for line in lines}) == 1  # columns align
    for line in lines[1:]:  # goal, value, target, met, stretch goal, met: at least two spaces apart
        fields = re.split(r"\s{2,}", line.strip())
        assert len(fields) == 6 and fields[2][:2] in (">=", "<=") and fields[3] in ("yes", "NO", "n/a"), line
        assert fields[5] in ("yes", "NO", "n/a", "-") and (fields[4] == "-") == (fields[5] == "-"), line
    assert "3,123" in lines[1] and ">= 2,470  yes  >= 3,200   NO" in lines[1] and "<= 0.65   NO" in lines[4]


EXERCISE_NOTEBOOKS = sorted((ROOT / "solutions").glob("*.ipynb")) + sorted((ROOT / "exercises").glob("*.ipynb"))


@pytest.mark.parametrize("path", EXERCISE_NOTEBOOKS, ids=ids(EXERCISE_NOTEBOOKS))
def test_an_exercise_links_back_to_its_chapter_from_its_title(path):
    chapter = next((ROOT / "notebooks").glob(f"{path.name[:2]}_*.ipynb"))
    title = nbformat.read(path, as_version=4).cells[2].source
    assert title.startswith("# Exercise") and f"](../notebooks/{chapter.name})" in title
