"""course_lib.tooling.exercises: exercise notebooks generated from the solutions, and kept in sync."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from course_lib.tooling.exercises import exercise_text, generate


def save(nb_or_text: nbformat.NotebookNode | str, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(nb_or_text if isinstance(nb_or_text, str) else nbformat.writes(nb_or_text) + "\n")
    return path


# --------------------------------------------------------------------------- generate()

SOLUTION_CELLS = [
    ("markdown", "intro", "# Title"),
    (
        "code",
        "code1",
        'import math\n\ndef f(x):\n    """Doc."""\n    ### BEGIN SOLUTION\n    y = x + 1\n'
        "    return y\n    ### END SOLUTION\n\nclass A:\n    def g(self):\n"
        '        ### BEGIN SOLUTION\n        return 1\n        ### END SOLUTION\n\ncheck("99.add", f)',
    ),
    ("code", "code2", "### BEGIN SOLUTION\nLIMIT = 3\n### END SOLUTION"),
    ("markdown", "answer", "Why?\n\n<!-- BEGIN SOLUTION -->Because\nof this.<!-- END SOLUTION -->\n\nMore."),
]
EXPECTED = {
    "code1": 'import math\n\ndef f(x):\n    """Doc."""\n'
    '    raise NotImplementedError("Exercise: write your solution here")\n\n'
    'class A:\n    def g(self):\n        raise NotImplementedError("Exercise: write your solution here")\n\n'
    'check("99.add", f)',
    "code2": 'raise NotImplementedError("Exercise: write your solution here")',
    "answer": "Why?\n\n_Your answer here._\n\nMore.",
    "intro": "# Title",
}


def make_solution(path: Path, cells=SOLUTION_CELLS) -> Path:
    nb = nbformat.v4.new_notebook()
    for kind, cell_id, source in cells:
        c = nbformat.v4.new_code_cell(source) if kind == "code" else nbformat.v4.new_markdown_cell(source)
        c["id"] = cell_id
        if kind == "code":
            c.execution_count = 7
            c.outputs = [nbformat.v4.new_output("stream", name="stdout", text="secret answer 42\n")]
            c.metadata = {"tags": ["keep-me"], "execution": {"iopub.status.busy": "2026-01-01"}}
        nb.cells.append(c)
    return save(nb, path)


def test_generate_replaces_markers_strips_outputs_and_stamps(tmp_path):
    make_solution(tmp_path / "sol" / "99_demo.ipynb")
    written = generate(tmp_path / "sol", tmp_path / "ex")
    assert written == [tmp_path / "ex" / "99_demo.ipynb"]
    nb = nbformat.read(written[0], as_version=4)
    by_id = {c.id: c for c in nb.cells}
    for cell_id, source in EXPECTED.items():
        assert by_id[cell_id].source == source
    for c in nb.cells:
        if c.cell_type == "code":
            assert c.outputs == [] and c.execution_count is None
    assert by_id["code1"].metadata == {"tags": ["keep-me"]}
    assert "secret answer" not in written[0].read_text()
    assert nb.metadata["amp_course"] == {"source": "solutions/99_demo.ipynb"}
    assert nb.cells[0].id == "colab-badge" and "exercises/99_demo.ipynb" in nb.cells[0].source
    assert nb.cells[1].id == "colab-setup"


def test_generate_is_deterministic(tmp_path):
    sol = make_solution(tmp_path / "sol" / "99_demo.ipynb")
    ex = generate(tmp_path / "sol", tmp_path / "ex")[0]
    first = ex.read_bytes()
    assert generate(tmp_path / "sol", tmp_path / "ex") == []  # nothing to rewrite
    assert exercise_text(sol).encode() == first and first.endswith(b"}\n")


def test_generate_check_finds_stale_missing_and_orphaned_exercises(tmp_path):
    sol_dir, ex_dir = tmp_path / "sol", tmp_path / "ex"
    sol = make_solution(sol_dir / "99_demo.ipynb")
    ex = generate(sol_dir, ex_dir)[0]
    assert generate(sol_dir, ex_dir, check=True) == []
    cells = [(k, i, s.replace("# Title", "# New title")) for k, i, s in SOLUTION_CELLS]
    make_solution(sol, cells)  # solution edited, exercises not regenerated
    before = ex.read_bytes()
    assert generate(sol_dir, ex_dir, check=True) == [ex]
    assert ex.read_bytes() == before  # check=True writes nothing
    ex.unlink()
    assert generate(sol_dir, ex_dir, check=True) == [ex]  # missing
    orphan = save(nbformat.v4.new_notebook(), ex_dir / "98_gone.ipynb")
    assert generate(sol_dir, ex_dir, check=True) == [orphan, ex]
    assert orphan.exists() and not ex.exists()
    generate(sol_dir, ex_dir)
    assert ex.exists() and not orphan.exists()


@pytest.mark.parametrize(
    "source",
    [
        "### BEGIN SOLUTION\nx = 1",
        "x = 1\n### END SOLUTION",
        "### BEGIN SOLUTION\n### BEGIN SOLUTION\nx = 1\n### END SOLUTION\n### END SOLUTION",
    ],
)
def test_generate_rejects_unbalanced_code_markers(tmp_path, source):
    make_solution(tmp_path / "sol" / "99_bad.ipynb", [("code", "the-cell", source)])
    with pytest.raises(ValueError, match=r"99_bad\.ipynb cell 0 \(id the-cell\)"):
        generate(tmp_path / "sol", tmp_path / "ex")
    assert not (tmp_path / "ex").exists()


@pytest.mark.parametrize(
    "source",
    [
        "<!-- BEGIN SOLUTION -->a",
        "a<!-- END SOLUTION -->",
        "<!-- BEGIN SOLUTION --><!-- BEGIN SOLUTION -->a<!-- END SOLUTION --><!-- END SOLUTION -->",
        "### BEGIN SOLUTION\nanswer\n### END SOLUTION",
    ],
)
def test_generate_rejects_bad_markdown_markers(tmp_path, source):
    make_solution(tmp_path / "sol" / "99_bad.ipynb", [("markdown", "md", source)])
    with pytest.raises(ValueError, match=r"99_bad\.ipynb cell 0 \(id md\)"):
        generate(tmp_path / "sol", tmp_path / "ex")


def test_exercises_in_sync_with_solutions():
    stale = generate(check=True)
    assert stale == [], f"exercises/ is stale, run `make exercises`: {[p.name for p in stale]}"
