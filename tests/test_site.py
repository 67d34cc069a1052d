"""The published edition (course_lib/tooling/site.py, `make site`) built from a small course of its
own: the executed copies `make test` saves, pages that keep their outputs and say what produced
them, links that stay inside the edition or go to GitHub, formulas as MathML, widgets as their
static picture, and a link check that finds what is broken. The browser reads the real edition in
tests/test_site_browser.py."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest

from course_lib.tooling import site

PNG = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)


def notebook(*cells) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(s) if kind == "md" else nbformat.v4.new_code_cell(s) for kind, s in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


@pytest.fixture
def course(tmp_path: Path) -> Path:
    """A course of one chapter, one exercise, one solution, a README, a doc and one library file."""
    root = tmp_path / "course"
    for d in ("notebooks", "exercises", "solutions", "docs", "course_lib", "data/reference"):
        (root / d).mkdir(parents=True)
    (root / "pyproject.toml").write_text('[tool.amp-course]\nrepo = "someone/amp-course"\nref = "v1"\n')
    (root / "README.md").write_text(
        "# The course\n\nStart with [chapter 00](notebooks/00_a.ipynb); the GPU notes are in "
        "[docs/gpu.md](docs/gpu.md); solutions: [solutions/](solutions/).\n"
    )
    (root / "docs" / "gpu.md").write_text("# GPU\n\nBack to the [README](../README.md).\n")
    (root / "course_lib" / "train.py").write_text('def step():\n    """Chapter 00."""\n')
    (root / "data" / "reference" / "bench_h100.json").write_text(
        json.dumps({"provenance": {"device": "NVIDIA H100", "torch": "2.11", "date": "2026-11-26", "command": "bench"}})
    )
    chapter = notebook(
        ("md", "[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/x)"),
        ("md", "# 00 · A chapter\n\nThe loss is $L = \\frac{1}{B}\\sum_j \\ell_j$; in code, `$HOME` stays.\n\n"
               "Read [the loop](../course_lib/train.py), [the exercise](../exercises/00_a_exercises.ipynb), "
               "[its solution](../solutions/00_a_exercises.ipynb) and [section 2](#2.-Two)."),
        ("code", "print(1 + 1)"),
        ("md", "## 2. Two"),
        ("code", 'show_reference("bench_*.json", str)'),
        ("code", "explorer"),
        ("code", "bar"),
    )
    nbformat.write(chapter, root / "notebooks" / "00_a.ipynb")
    exercise = notebook(("md", "# Exercise 00\n\n[Back](../notebooks/00_a.ipynb)"), ("code", "print('answer here')"))
    nbformat.write(exercise, root / "exercises" / "00_a_exercises.ipynb")
    nbformat.write(exercise, root / "solutions" / "00_a_exercises.ipynb")
    return root


def chapter_outputs() -> dict[int, list]:
    out = nbformat.v4.new_output
    widget = {"application/vnd.jupyter.widget-view+json": {"model_id": "abc", "version_major": 2, "version_minor": 0}}
    return {
        2: [out("stream", name="stdout", text="2\n")],
        4: [out("display_data", data={"image/png": PNG, "text/plain": "<Figure>"})],
        5: [  # chapter 01's explorer (an HTML table) and chapter 10's (a picture) beside their widgets
            out("display_data", data={**widget, "text/html": "<table><tr><td>0.1</td></tr></table>"}),
            out("display_data", data={**widget, "image/png": PNG, "text/plain": "MemoryExplorer({})"}),
        ],
        6: [out("display_data", data={**widget, "text/plain": "train fp32:   0%|          | 0/50 [00:00<?, ?step/s]"})],
    }


def ran_by_make_test(course: Path, tmp_path: Path, *notebooks: str) -> tuple[Path, Path]:
    """Save `notebooks` as make test's run would (the chapter with chapter_outputs); returns
    (the executed folder, where the edition goes)."""
    executed = tmp_path / "executed"
    for rel in notebooks:
        nb = nbformat.read(course / rel, as_version=4)
        outputs = chapter_outputs() if rel.startswith("notebooks") else {1: []}
        site.save_executed(rel, nb, outputs, "make test (nbval)", executed)
    return executed, tmp_path / "site"


def test_a_complete_run_is_saved_with_its_provenance_and_an_incomplete_one_is_not(course, tmp_path):
    executed = tmp_path / "executed"
    nb = nbformat.read(course / "notebooks" / "00_a.ipynb", as_version=4)
    outputs = chapter_outputs()
    saved = site.save_executed("notebooks/00_a.ipynb", nb, outputs, "make test (nbval)", executed)
    done = nbformat.read(saved, as_version=4)
    prov = done.metadata[site.METADATA_KEY]
    assert prov["command"] == "make test (nbval)" and prov["torch"] and prov["date"] and "CPU cores" in prov["machine"]
    assert prov["code"] == site.code_digest(nb)
    assert done.cells[2].outputs[0]["text"] == "2\n"
    assert [c.execution_count for c in done.cells if c.cell_type == "code"] == [1, 2, 3, 4]  # as Run All numbers
    del outputs[6]  # one code cell did not run (a failure, or pytest -k): the old copy goes too
    assert site.save_executed("notebooks/00_a.ipynb", nb, outputs, "make test (nbval)", executed) is None
    assert not saved.exists()


def test_the_edition_keeps_outputs_links_formulas_and_says_what_made_each_page(course, tmp_path):
    executed, out = ran_by_make_test(course, tmp_path, "notebooks/00_a.ipynb", "exercises/00_a_exercises.ipynb")
    result = site.build(out, root=course, executed=executed, log=lambda m: None, reuse_only=True)
    assert result["executed_here"] == []
    assert site.check(out) == []
    page = (out / "notebooks" / "00_a.html").read_text()
    assert 'src="data:image/png;base64,' in page and ">2\n<" in page.replace("</pre>", "<")  # outputs kept
    assert "<math " in page and "<mfrac>" in page and "$HOME" in page and "\\frac" not in page
    assert 'href="../course_lib/train.py.html"' in page and 'href="../exercises/00_a_exercises.html"' in page
    assert 'href="https://github.com/someone/amp-course/blob/v1/solutions/00_a_exercises.ipynb"' in page
    assert "_static/colab-badge.svg" in page and "colab.research.google.com/assets" not in page
    assert "make test (nbval)" in page and "bench_h100.json" in page and "NVIDIA H100" in page  # provenance
    assert page.count("A live widget in JupyterLab and Colab") == 2 and "<td>0.1</td>" in page
    assert page.count("<img") == 3 and "MemoryExplorer({})" not in page  # badge, plot, picture (not its text)
    assert "A progress bar" in page and "0/50" not in page  # not the bar's first, misleading state
    assert "widget-view+json" not in page and "<script src" not in page  # nothing to fetch, no script
    assert not (out / "solutions").exists()
    readme = (out / "index.html").read_text()
    assert 'href="notebooks/00_a.html"' in readme and 'href="docs/gpu.html"' in readme
    assert 'href="https://github.com/someone/amp-course/tree/v1/solutions"' in readme
    assert 'href="../README.html"' in (out / "docs" / "gpu.html").read_text()


def test_the_link_check_names_a_missing_page_anchor_and_image(course, tmp_path):
    executed, out = ran_by_make_test(course, tmp_path, "notebooks/00_a.ipynb", "exercises/00_a_exercises.ipynb")
    site.build(out, root=course, executed=executed, log=lambda m: None)
    (out / "exercises" / "00_a_exercises.html").unlink()
    (out / "_static" / "colab-badge.svg").unlink()
    page = out / "notebooks" / "00_a.html"
    page.write_text(page.read_text().replace('href="#2.-Two"', 'href="#3.-Three"'))
    problems = "\n".join(site.check(out))
    assert "notebooks/00_a.html: href ../exercises/00_a_exercises.html: no such file" in problems
    assert "colab-badge.svg: no such file" in problems and "#3.-Three: no such anchor" in problems


def test_a_notebook_make_test_did_not_run_is_executed_here_or_refused(course, tmp_path):
    executed, out = ran_by_make_test(course, tmp_path, "notebooks/00_a.ipynb")
    with pytest.raises(site.NotExecuted, match="exercises/00_a_exercises.ipynb: `make test` has not run it"):
        site.build(out, root=course, executed=executed, log=lambda m: None, reuse_only=True)
    result = site.build(out, root=course, executed=executed, log=lambda m: None)
    assert result["executed_here"] == ["exercises/00_a_exercises.ipynb"]
    assert "answer here" in (out / "exercises" / "00_a_exercises.html").read_text()
    # a changed cell makes the saved copy stale: it is not published as if it were current
    changed = nbformat.read(course / "notebooks" / "00_a.ipynb", as_version=4)
    changed.cells[2].source = "print(2 + 2)"
    nbformat.write(changed, course / "notebooks" / "00_a.ipynb")
    with pytest.raises(site.NotExecuted, match="its code changed"):
        site.build(out, root=course, executed=executed, log=lambda m: None, reuse_only=True)


def test_formulas_become_mathml_and_code_and_dollars_stay():
    text = "cost $2mkn$, `echo $HOME`, a price of \\$5 and\n```\n$x$\n```\n$$a\n+ b$$"
    out = site.mathml(text)
    assert out.count("<math") == 2 and 'display="block"' in out
    assert "`echo $HOME`" in out and "\\$5" in out and "```\n$x$\n```" in out


def test_a_notebook_that_fails_while_executed_for_the_edition_says_which_and_why(course, tmp_path):
    broken = notebook(("md", "# Broken"), ("code", "raise ValueError('the data folder is missing')"))
    nbformat.write(broken, course / "exercises" / "00_a_exercises.ipynb")
    executed, out = ran_by_make_test(course, tmp_path, "notebooks/00_a.ipynb")
    with pytest.raises(site.NotExecuted, match="00_a_exercises.ipynb: a cell failed.*the data folder is missing"):
        site.build(out, root=course, executed=executed, log=lambda m: None)
