"""The published edition (course_lib/tooling/site.py, `make site`) built from a small course of its
own: the executed copies `make test` saves, pages that keep their outputs, open on their title and
say what produced them, links that stay inside the edition or go to GitHub, formulas as MathML,
widgets as their static picture, no machine path, exercises only as the course ships them, and a
check that names each defect planted in a built edition (a dead link, a data dump, a machine path,
an answered exercise, a GitHub link to a file the repository does not hold). The browser reads the
real edition in tests/test_site_browser.py."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import nbformat
import pytest

from course_lib.tooling import site
from course_lib.tooling.exercises import exercise_text

# `make test` installs it (pyproject.toml's `site` extra, with the venv); another environment, such as
# make test-gpu's python3, may not have it
for _module in ("sphinx", "myst_nb", "pydata_sphinx_theme", "sphinx_copybutton", "latex2mathml"):
    pytest.importorskip(_module, reason=f"{_module} is not installed: the edition needs pyproject.toml's `site` extra")

PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
ANSWER = "    return 2 * x  # the learner's answer"
# Sphinx and MyST warn each other about APIs their next releases drop: not the course's to fix
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::PendingDeprecationWarning")


def notebook(*cells) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(s) if kind == "md" else nbformat.v4.new_code_cell(s) for kind, s in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


@pytest.fixture
def course(tmp_path: Path) -> Path:
    """A course of one chapter, one exercise generated from its solution, a README, a doc and one
    library file."""
    root = tmp_path / "course"
    for d in ("notebooks", "exercises", "solutions", "docs", "course_lib", "data/reference", "runs/00_a"):
        (root / d).mkdir(parents=True)
    (root / "pyproject.toml").write_text('[tool.amp-course]\nrepo = "someone/amp-course"\nref = "v1"\n')
    (root / "README.md").write_text(
        "# The course\n\nStart with [chapter 00](notebooks/00_a.ipynb); the GPU notes are in "
        "[docs/gpu.md](docs/gpu.md); solutions: [solutions/](solutions/).\n\n## Reading\n\nA section.\n"
    )
    (root / "docs" / "gpu.md").write_text("# GPU\n\nBack to the [README](../README.md).\n")
    (root / "course_lib" / "train.py").write_text('def step():\n    """Chapter 00."""\n')
    (root / "runs" / "00_a" / "trace.json").write_text("{}")
    (root / "data" / "reference" / "bench_h100.json").write_text(
        json.dumps({"provenance": {"device": "NVIDIA H100", "torch": "2.11", "date": "2026-11-26", "command": "bench"}})
    )
    chapter = notebook(
        (
            "md",
            "[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/x)",
        ),
        ("code", "# @title Setup: fetch the course on Colab\nprint('hardware')"),
        (
            "md",
            "# 00 · A chapter\n\n**Learning objectives.** The loss is $L = \\frac{1}{B}\\sum_j \\ell_j$; in code, "
            "`$HOME` stays.\n\nRead [the loop](../course_lib/train.py), "
            "[the exercise](../exercises/00_a_exercises.ipynb), "
            "[its solution](../solutions/00_a_exercises.ipynb) and [section 2](#2-two).",
        ),
        ("code", "print(1 + 1)"),
        ("md", "## 2. Two"),
        ("code", 'show_reference("bench_*.json", str)'),
        ("code", "explorer"),
        ("code", "bar"),
        ("code", "show_traces(trace_dir)"),
    )
    nbformat.write(chapter, root / "notebooks" / "00_a.ipynb")
    solution = notebook(
        ("md", "# Exercise 00\n\n[Back](../notebooks/00_a.ipynb)"),
        (
            "code",
            "def double(x):\n    ### BEGIN SOLUTION\n    return x + x\n    ### END SOLUTION\n\n\n"
            "check('00.double', double)",
        ),
    )
    nbformat.write(solution, root / "solutions" / "00_a_exercises.ipynb")
    from course_lib.tooling.colab import read_config

    text = exercise_text(root / "solutions" / "00_a_exercises.ipynb", read_config(root))  # as `make exercises`
    (root / "exercises" / "00_a_exercises.ipynb").write_text(text)
    return root


def chapter_outputs(course: Path) -> dict[int, list]:
    out = nbformat.v4.new_output
    widget = {"application/vnd.jupyter.widget-view+json": {"model_id": "abc", "version_major": 2, "version_minor": 0}}
    traces = (
        '<p>In <code>runs/00_a/</code>:</p><ul><li><a href="../runs/00_a/trace.json" download>trace.json</a></li></ul>'
        f"<p>On this computer: <code>{course}/runs/00_a</code></p>"
    )
    return {
        1: [out("stream", name="stdout", text=f"python 3.11 {course}/.venv/bin/python\ncache {Path.home()}/.cache/x")],
        3: [out("stream", name="stdout", text="2\n")],
        5: [out("display_data", data={"image/png": PNG, "text/plain": "<Figure>"})],
        6: [  # chapter 01's explorer (an HTML table) and chapter 10's (a picture) beside their widgets
            out("display_data", data={**widget, "text/html": "<table><tr><td>0.1</td></tr></table>"}),
            out("display_data", data={**widget, "image/png": PNG, "text/plain": "MemoryExplorer({})"}),
        ],
        7: [out("display_data", data={**widget, "text/plain": "train fp32:   0%|          | 0/50 [00:00<?, ?step/s]"})],
        8: [out("display_data", data={"text/html": traces, "text/plain": f"{course}/runs/00_a/trace.json"})],
    }


def exercise_outputs(passed: bool) -> dict[int, list]:
    line = "✅ 00.double — passed\n" if passed else "❌ 00.double — not attempted yet\n"
    return {1: [], 3: [nbformat.v4.new_output("stream", name="stdout", text=line)]}


def ran_by_make_test(course: Path, tmp_path: Path, *notebooks: str) -> tuple[Path, Path]:
    """Save `notebooks` as make test's run would; returns (the executed folder, where the edition goes)."""
    executed = tmp_path / "executed"
    for rel in notebooks:
        nb = nbformat.read(course / rel, as_version=4)
        answered = ANSWER in nb.cells[3].source if rel.startswith("exercises") else False
        outputs = chapter_outputs(course) if rel.startswith("notebooks") else exercise_outputs(answered)
        site.save_executed(rel, nb, outputs, "make test (nbval)", executed)
    return executed, tmp_path / "site"


@pytest.fixture
def edition(course, tmp_path) -> Path:
    executed, out = ran_by_make_test(course, tmp_path, "notebooks/00_a.ipynb", "exercises/00_a_exercises.ipynb")
    result = site.build(out, root=course, executed=executed, log=lambda m: None, reuse_only=True)
    assert result["executed_here"] == [] and result["unexecuted"] == [] and result["warnings"] == []
    return out


def test_a_complete_run_is_saved_with_its_provenance_and_an_incomplete_one_is_not(course, tmp_path):
    executed = tmp_path / "executed"
    nb = nbformat.read(course / "notebooks" / "00_a.ipynb", as_version=4)
    outputs = chapter_outputs(course)
    saved = site.save_executed("notebooks/00_a.ipynb", nb, outputs, "make test (nbval)", executed)
    done = nbformat.read(saved, as_version=4)
    prov = done.metadata[site.METADATA_KEY]
    assert prov["command"] == "make test (nbval)" and prov["torch"] and prov["date"] and "CPU cores" in prov["machine"]
    assert prov["code"] == site.code_digest(nb)
    assert done.cells[3].outputs[0]["text"] == "2\n"
    assert [c.execution_count for c in done.cells if c.cell_type == "code"] == [1, 2, 3, 4, 5, 6]  # as Run All numbers
    del outputs[7]  # one code cell did not run (a failure, or pytest -k): the old copy goes too
    assert site.save_executed("notebooks/00_a.ipynb", nb, outputs, "make test (nbval)", executed) is None
    assert not saved.exists()


def test_the_edition_keeps_outputs_links_formulas_and_says_what_made_each_page(course, edition):
    assert site.check(edition, course) == []
    page = (edition / "notebooks" / "00_a.html").read_text()
    assert re.search(r'<img [^>]*src="\.\./_images/[0-9a-f]+\.png"', page)  # outputs: the plot
    assert "<pre><span></span>2\n</pre>" in page  # and what a cell printed
    assert "<math " in page and "<mfrac>" in page and "$HOME" in page and "\\frac" not in page
    assert 'href="../course_lib/train.py.html"' in page and 'href="../exercises/00_a_exercises.html"' in page
    assert 'href="https://github.com/someone/amp-course/blob/v1/solutions/00_a_exercises.ipynb"' in page
    assert 'href="#two"' in page and 'id="two"' in page  # the notebook's own anchor, resolved by MyST
    assert "_images/colab-badge.svg" in page and "colab.research.google.com/assets" not in page
    assert "make test (nbval)" in page and "bench_h100.json" in page and "NVIDIA H100" in page  # provenance
    assert page.count("A live widget in JupyterLab and Colab") == 2 and "<td>0.1</td>" in page
    assert "MemoryExplorer({})" not in page  # the picture, not its text
    assert "A progress bar" in page and "0/50" not in page  # not the bar's first, misleading state
    assert "widget-view+json" not in page and not re.search(r'<script[^>]+src="https?:', page)  # nothing fetched
    assert not (edition / "solutions").exists()
    readme = (edition / "index.html").read_text()
    assert 'href="notebooks/00_a.html"' in readme and 'href="docs/gpu.html"' in readme
    assert 'href="https://github.com/someone/amp-course/tree/v1/solutions"' in readme
    assert 'href="../index.html"' in (edition / "docs" / "gpu.html").read_text()


def test_a_page_reads_like_a_book(course, edition):
    page = (edition / "notebooks" / "00_a.html").read_text()
    nav = page.split('class="bd-sidebar-primary', 1)[1].split("</nav>", 1)[0]
    assert "00 · A chapter" in nav and "Exercise 00" in nav and "GPU" in nav  # the whole book in the sidebar
    assert 'id="pst-page-toc-nav"' in page and "2. Two" in page.split('id="pst-page-toc-nav"', 1)[1]  # contents
    assert 'class="amp-prev-next-top"' in page and 'class="prev-next-area"' in page  # previous/next, top and end
    assert "copybutton.js" in page and "theme-switch-button" in page  # copy buttons, light and dark
    assert (edition / "searchindex.js").exists() and "search_as_you_type = true" in page
    assert 'href="00_a.ipynb" download' in page
    download = nbformat.read(edition / "notebooks" / "00_a.ipynb", as_version=4)  # the notebook, without outputs
    source = nbformat.read(course / "notebooks" / "00_a.ipynb", as_version=4)
    assert [c.source for c in download.cells] == [c.source for c in source.cells]
    assert all(not c.get("outputs") for c in download.cells) and site.METADATA_KEY not in download.metadata
    # it opens on its title and objectives; the badge and the setup cell come after, the setup folded
    article = page.split('<article class="bd-article">', 1)[1]
    assert article.index("<h1>00 · A chapter") < article.index("Learning objectives") < article.index("colab-badge")
    assert article.index("Outputs:") < article.index("colab-badge") < article.index("hardware")
    assert re.search(r'<details class="[^"]*hide above-input">\s*<summary', article)


def test_no_page_holds_a_path_of_the_building_machine(course, edition):
    page = (edition / "notebooks" / "00_a.html").read_text()
    assert str(course) not in page and str(Path.home()) not in page
    assert "python 3.11 .venv/bin/python" in page and "cache ~/.cache/x" in page
    assert "On this computer: <code>runs/00_a</code>" in page
    # what a run writes is not on GitHub: the trace is named, not linked
    assert '<span class="amp-unlinked">trace.json</span>' in page and 'runs/00_a/trace.json"' not in page
    planted = edition / "docs" / "gpu.html"
    planted.write_text(planted.read_text().replace("Back to the", f"Back from {course}/notebooks to the"))
    (edition / "notebooks" / "extra.txt").write_text(f"{Path.home()}/secret")
    problems = "\n".join(site.check(edition, course))
    assert re.search(rf"docs/gpu.html: a path of the building machine: .*Back from {re.escape(str(course))}", problems)
    assert "notebooks/extra.txt: a path of the building machine" in problems


def test_exercises_are_published_as_the_course_ships_them_never_with_answers(course, tmp_path):
    exercise = course / "exercises" / "00_a_exercises.ipynb"
    nb = nbformat.read(exercise, as_version=4)
    stub = '    raise NotImplementedError("Exercise: write your solution here")'
    nb.cells[3].source = nb.cells[3].source.replace(stub, ANSWER)
    nb.cells[2].source += "\n\nMy notes: the answer is 2x."
    nbformat.write(nb, exercise)  # a learner answered it, then ran make test
    executed, out = ran_by_make_test(course, tmp_path, "notebooks/00_a.ipynb", "exercises/00_a_exercises.ipynb")
    result = site.build(out, root=course, executed=executed, log=lambda m: None, reuse_only=True)
    assert result["unexecuted"] == ["exercises/00_a_exercises.ipynb"]
    page = (out / "exercises" / "00_a_exercises.html").read_text()
    assert "raise" in page and "NotImplementedError" in page and "return 2 * x" not in page and "My notes" not in page
    assert "✅" not in page and "Published as the course ships it, without outputs" in page
    download = (out / "exercises" / "00_a_exercises.ipynb").read_text()
    assert "NotImplementedError" in download and "return 2 * x" not in download
    assert site.check(out, course) == []
    # an answer that reached a page anyway, or a passed check, is named
    planted = out / "exercises" / "00_a_exercises.html"
    text = planted.read_text()
    planted.write_text(text.replace("NotImplementedError", "ValueError", 1))
    problems = "\n".join(site.check(out, course))
    assert "exercises/00_a_exercises.html: code cell 2 is not the exercise as the course ships it" in problems
    passed = '<div class="output stream"><pre>✅ 00.double — passed</pre></div></article>'
    planted.write_text(text.replace("</article>", passed))
    (out / "exercises" / "00_a_exercises.ipynb").write_text(download.replace("NotImplementedError", "ValueError"))
    problems = "\n".join(site.check(out, course))
    assert "shows a passed check (✅): an answered exercise" in problems
    assert "exercises/00_a_exercises.ipynb: not the exercise as the course ships it" in problems


def test_an_unanswered_exercise_keeps_the_outputs_make_test_saved(edition):
    page = (edition / "exercises" / "00_a_exercises.html").read_text()
    assert "❌ 00.double — not attempted yet" in page and "NotImplementedError" in page


def test_the_check_names_a_dead_link_a_data_dump_and_a_github_link_to_what_a_run_wrote(course, edition):
    (edition / "exercises" / "00_a_exercises.html").unlink()
    (edition / "_images" / "colab-badge.svg").unlink()
    page = edition / "notebooks" / "00_a.html"
    dump = "\n".join(f"record {i}" for i in range(300))
    text = page.read_text().replace('href="#two"', 'href="#three"').replace("<span></span>2\n</pre>", f"{dump}</pre>")
    gone = "https://github.com/someone/amp-course/blob/v1/runs/00_a/trace.json"
    page.write_text(text.replace("https://github.com/someone/amp-course/blob/v1/solutions/00_a_exercises.ipynb", gone))
    css = edition / "_static" / "amp.css"  # a font from the network, asked for by a style sheet
    css.write_text('@import url("https://fonts.example.com/css?family=Serif");\n' + css.read_text())
    problems = "\n".join(site.check(edition, course))
    assert "notebooks/00_a.html: href ../exercises/00_a_exercises.html: no such file" in problems
    assert "colab-badge.svg: no such file" in problems and "#three: no such anchor" in problems
    assert "notebooks/00_a.html: output 2 is a data dump (301 lines" in problems
    assert f"{gone}: links GitHub to a file the repository does not hold" in problems
    assert '_static/amp.css: loads url("https://fonts.example.com/css?family=Serif") from the network' in problems


def test_a_chapter_make_test_did_not_run_is_executed_here_or_refused(course, tmp_path, monkeypatch):
    monkeypatch.delenv("COURSE_OFFLINE", raising=False)  # conftest.py sets it; `make site` does not
    second = nbformat.read(course / "notebooks" / "00_a.ipynb", as_version=4)
    code = "import os\nprint('two chapters, offline:', os.environ.get('COURSE_OFFLINE'))"
    second.cells = [second.cells[2], nbformat.v4.new_code_cell(code)]
    nbformat.write(second, course / "notebooks" / "01_b.ipynb")
    executed, out = ran_by_make_test(course, tmp_path, "notebooks/00_a.ipynb", "exercises/00_a_exercises.ipynb")
    with pytest.raises(site.NotExecuted, match="notebooks/01_b.ipynb: `make test` has not run it"):
        site.build(out, root=course, executed=executed, log=lambda m: None, reuse_only=True)
    result = site.build(out, root=course, executed=executed, log=lambda m: None)
    assert result["executed_here"] == ["notebooks/01_b.ipynb"]
    assert "two chapters, offline: 1" in (out / "notebooks" / "01_b.html").read_text()  # as make test runs it
    assert "COURSE_OFFLINE" not in os.environ
    # a changed cell makes the saved copy stale: it is not published as if it were current
    changed = nbformat.read(course / "notebooks" / "00_a.ipynb", as_version=4)
    changed.cells[3].source = "print(2 + 2)"
    nbformat.write(changed, course / "notebooks" / "00_a.ipynb")
    with pytest.raises(site.NotExecuted, match="its code changed"):
        site.build(out, root=course, executed=executed, log=lambda m: None, reuse_only=True)


def test_formulas_become_mathml_and_code_and_dollars_stay():
    text = "cost $2mkn$, `echo $HOME`, a price of \\$5 and\n```\n$x$\n```\n$$a\n+ b$$"
    out = site.mathml(text)
    assert out.count("<math") == 2 and 'display="block"' in out
    assert "`echo $HOME`" in out and "\\$5" in out and "```\n$x$\n```" in out


def test_a_chapter_that_fails_while_executed_for_the_edition_says_which_and_why(course, tmp_path):
    broken = notebook(("md", "# Broken"), ("code", "raise ValueError('the data folder is missing')"))
    nbformat.write(broken, course / "notebooks" / "01_b.ipynb")
    executed, out = ran_by_make_test(course, tmp_path, "notebooks/00_a.ipynb")
    with pytest.raises(site.NotExecuted, match="01_b.ipynb: a cell failed.*the data folder is missing"):
        site.build(out, root=course, executed=executed, log=lambda m: None)


def test_the_cli_check_fails_on_a_problem(course, edition, capsys):
    assert site.main(["check", str(edition), "--root", str(course)]) == 0
    shutil.rmtree(edition / "docs")
    assert site.main(["check", str(edition), "--root", str(course)]) == 1
    assert "no such file" in capsys.readouterr().out
