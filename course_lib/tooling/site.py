"""`make site`: the course as a book to read without running anything (tooling).

Self-study learners read first and run later. `make site` writes every chapter and every exercise
(never the solutions) into build/site/ as the pages of a book, with their outputs, and the README,
the docs and the library files they link to beside them: a sidebar with every chapter, the page's
contents, search, previous/next, copy buttons, light and dark, a reading width and a phone layout
(Sphinx with myst-nb, pydata-sphinx-theme and sphinx-copybutton; course_lib/tooling/site_template/
holds its configuration, templates and style). Every page is a file: open build/site/index.html
from the disk; nothing is fetched from the network.

Why Sphinx. The edition was first the course's own builder (nbconvert, a page per notebook, a
template); a book needs search, a sidebar, each page's contents, dark mode, copy buttons and a phone
layout, which pydata-sphinx-theme (the PyTorch, NumPy and pandas documentation's theme) and
sphinx-copybutton already do, kept and tested by others, and myst-nb reads executed notebooks
without executing them. What the course's builder did that they do not is kept here: provenance on
every page, the widget notes, no machine path, exercises only as shipped, and the check.

Where the outputs come from. `make test` runs every notebook cell by cell (nbval); conftest.py
hands what each cell printed to `save_executed`, which writes the executed notebook to
build/executed/ with the machine, the versions and the date in its metadata. `build` reads those
copies, so the edition costs no second execution. A chapter with no copy, or whose code changed
since its copy was made, is executed here with nbclient (and says so; --reuse-only refuses to), offline
as `make test` runs it (COURSE_OFFLINE=1: the data loader never downloads).
GPU results are those the CPU cells load from data/reference/; each page lists the recorded runs
it reads, with their provenance, in a folded box under its title: each command as it was recorded,
and, where its module has moved since, the command that runs it now.

What a reader sees, and only that (course_lib/tooling/edition/pages.py makes each page):
- a chapter opens on its title and objectives; the Colab badge and the setup cell follow, folded;
- exercises are published as the course ships them (generated from solutions/, as `make exercises`
  does), with the outputs of `make test` only where the copy it ran has exactly that code: a
  learner's answers are never published;
- no path of the building machine: the repository's folder and the home folder are written as
  `runs/...` and `~/...`;
- every link leads somewhere: to a page of the edition, to a file the repository holds on GitHub,
  or, for what a run writes (runs/), to nothing (plain text);
- a widget keeps its static picture (the state after Run All) with a note that it is live in
  JupyterLab and Colab; formulas are MathML, made here (latex2mathml), which browsers draw
  themselves; each notebook can be downloaded, as the course ships it, without outputs.
`check` (course_lib/tooling/edition/check.py) then fails on a broken link, anchor or image, anything
loaded from the network, a data dump, a machine path, an answered exercise, or a link to GitHub for
a file the repository does not hold.

    python -m course_lib.tooling.site build   [--out build/site] [--reuse-only]
    python -m course_lib.tooling.site check   [build/site]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import hashlib
import io
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import nbformat

__all__ = [
    "EXECUTED",
    "SITE",
    "code_digest",
    "mathml",
    "execution_provenance",
    "save_executed",
    "NotExecuted",
    "executed_notebook",
    "shipped_exercise",
    "build",
    "check",
]

ROOT = Path(__file__).resolve().parents[2]
EXECUTED = ROOT / "build" / "executed"
SITE = ROOT / "build" / "site"
TEMPLATE_DIR = Path(__file__).with_name("site_template")
METADATA_KEY = "amp_course_execution"


# ----------------------------------------------------------------------------- executed notebooks


def code_digest(nb: nbformat.NotebookNode) -> str:
    """The notebook's code, hashed: an executed copy is current while its code cells are unchanged."""
    code = "\n\x00\n".join(c.source for c in nb.cells if c.cell_type == "code")
    return hashlib.sha256(code.encode()).hexdigest()[:16]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def execution_provenance(command: str) -> dict:
    """What executed a notebook: this machine's CPU (and GPU, if one was used), the versions, the
    date and the command."""
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {
        "machine": f"{_cpu_name()}, {os.cpu_count()} CPU cores" + (f", {gpu}" if gpu else ", no GPU used"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
        "command": command,
    }


def save_executed(
    path: str | Path, nb: nbformat.NotebookNode, outputs: dict[int, list], command: str, out_dir: Path = EXECUTED
) -> Path | None:
    """Write `nb` with `outputs` (cell index -> the outputs it printed) to `out_dir`, at the same
    relative path, with its provenance. Only a complete run is kept: with any code cell missing,
    nothing is written and an older copy is removed (it would no longer match what ran)."""
    rel = Path(path).resolve().relative_to(ROOT) if Path(path).is_absolute() else Path(path)
    target = out_dir / rel
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    if any(i not in outputs for i in code):
        target.unlink(missing_ok=True)
        return None
    done = copy.deepcopy(nb)
    for count, i in enumerate(code, start=1):  # numbered as Run All numbers them
        done.cells[i].outputs = [nbformat.from_dict(dict(o)) for o in outputs[i]]
        done.cells[i].execution_count = count
        for out in done.cells[i].outputs:
            if out.get("output_type") == "execute_result":
                out["execution_count"] = count
    done.metadata[METADATA_KEY] = {**execution_provenance(command), "code": code_digest(nb)}
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(nbformat.writes(done), encoding="utf-8")
    return target


class NotExecuted(RuntimeError):
    """A notebook without a current executed copy, where executing it here was refused or failed."""


def executed_notebook(
    rel: str, root: Path = ROOT, executed: Path = EXECUTED, log=print, reuse_only: bool = False
) -> nbformat.NotebookNode:
    """The executed copy of notebook `rel` if it is current, else the notebook executed here now
    (with `reuse_only`, NotExecuted instead)."""
    source = nbformat.read(root / rel, as_version=4)
    copy_path = executed / rel
    if copy_path.exists():
        done = nbformat.read(copy_path, as_version=4)
        if done.metadata.get(METADATA_KEY, {}).get("code") == code_digest(source):
            return done
        why = "its code changed since `make test` ran it"
    else:
        why = "`make test` has not run it to its end"
    if reuse_only:
        raise NotExecuted(f"{rel}: {why}, and --reuse-only forbids executing it here: run `make test` first")
    log(f"{rel}: {why}; executing it now")
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    start = time.perf_counter()
    client = NotebookClient(
        source, timeout=600, kernel_name="python3", resources={"metadata": {"path": str((root / rel).parent)}}
    )
    offline = os.environ.get("COURSE_OFFLINE")
    os.environ.setdefault("COURSE_OFFLINE", "1")  # the kernel inherits it: the data loader never downloads
    try:
        client.execute()
    except CellExecutionError as error:
        last = [line for line in str(error).splitlines() if line.strip()][-1:]
        raise NotExecuted(f"{rel}: a cell failed while executing it for the edition: {' '.join(last)}") from None
    finally:
        if offline is None:
            del os.environ["COURSE_OFFLINE"]
    source.metadata[METADATA_KEY] = {
        **execution_provenance("python -m course_lib.tooling.site build (nbclient)"),
        "code": code_digest(source),
    }
    log(f"{rel}: executed in {time.perf_counter() - start:.0f} s")
    copy_path.parent.mkdir(parents=True, exist_ok=True)
    copy_path.write_text(nbformat.writes(source), encoding="utf-8")
    return source


def _with_outputs(source: nbformat.NotebookNode, done: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """`source` (its text as it is now) with the outputs, counts and provenance of `done`, an executed
    copy with the same code."""
    page = copy.deepcopy(source)
    ran = [c for c in done.cells if c.cell_type == "code"]
    for cell, twin in zip((c for c in page.cells if c.cell_type == "code"), ran):
        cell.outputs, cell.execution_count = copy.deepcopy(twin.get("outputs", [])), twin.get("execution_count")
    page.metadata[METADATA_KEY] = dict(done.metadata.get(METADATA_KEY, {}))
    return page


def exercise_notebook(rel: str, root: Path, executed: Path, cfg: dict) -> nbformat.NotebookNode:
    """The exercise's page: the shipped exercise with the outputs `make test` saved when the copy it ran
    has exactly the shipped code, else the shipped exercise unexecuted (the note says why)."""
    from course_lib.tooling.edition.pages import shipped_exercise

    shipped = shipped_exercise(rel, root, cfg)
    copy_path = executed / rel
    if copy_path.exists():
        done = nbformat.read(copy_path, as_version=4)
        if done.metadata.get(METADATA_KEY, {}).get("code") == code_digest(shipped):
            return _with_outputs(shipped, done)
        why = "the copy `make test` ran holds other code (a learner's answers, which are never published)"
    else:
        why = "`make test` has not run it"
    shipped.metadata[METADATA_KEY] = {"unexecuted": why}
    return shipped


def shipped_exercise(rel: str, root: Path = ROOT, cfg: dict | None = None) -> nbformat.NotebookNode:
    """Exercise notebook `rel` as the course ships it (course_lib.tooling.edition.pages.shipped_exercise)."""
    from course_lib.tooling.edition.pages import shipped_exercise as shipped

    return shipped(rel, root, cfg)


def mathml(markdown: str) -> str:
    """`markdown` with each formula ($inline$, $$display$$) replaced by its MathML, code left as it is."""
    from course_lib.tooling.edition.pages import mathml as convert

    return convert(markdown)


# ----------------------------------------------------------------------------- the book


def _sphinx(src: Path, out: Path, project: str, log) -> list[str]:
    """Run Sphinx (myst-nb, the theme) on the sources in `src`, writing HTML to `out`; its warnings."""
    from sphinx.application import Sphinx
    from sphinx.util.console import nocolor
    from sphinx.util.docutils import docutils_namespace, patch_docutils

    warnings = io.StringIO()
    nocolor()
    with patch_docutils(str(TEMPLATE_DIR)), docutils_namespace():
        app = Sphinx(
            str(src),
            str(TEMPLATE_DIR),
            str(out),
            str(src / "_doctrees"),
            "html",
            confoverrides={"project": project},
            status=None,
            warning=warnings,
            freshenv=True,
            parallel=min(2, os.cpu_count() or 1),
        )
        app.build()
    return [line for line in warnings.getvalue().splitlines() if "WARNING" in line or "ERROR" in line]


def build(out: Path = SITE, root: Path = ROOT, executed: Path = EXECUTED, log=print, reuse_only: bool = False) -> dict:
    """Write the edition into `out` (replaced whole), from the executed copies in `executed`
    (chapters without a current one are executed here, or with `reuse_only` refused: NotExecuted).
    The sources Sphinx reads are left in `out`-src beside it. Returns {"pages": n, "executed_here":
    [notebook paths], "unexecuted": [exercises published without outputs], "warnings": [Sphinx's],
    "seconds": s}."""
    from course_lib.tooling.colab import read_config
    from course_lib.tooling.edition import pages as P

    start = time.perf_counter()
    cfg = read_config(root)
    executed_here: list[str] = []

    def note(message: str) -> None:
        if "executing it now" in message:
            executed_here.append(message.split(":")[0])
        log(message)

    chapters = sorted(str(p.relative_to(root)) for p in (root / "notebooks").glob("*.ipynb"))
    exercises = sorted(str(p.relative_to(root)) for p in (root / "exercises").glob("*.ipynb"))
    notebooks = {}
    for rel in chapters:
        done = executed_notebook(rel, root, executed, note, reuse_only)
        notebooks[rel] = _with_outputs(nbformat.read(root / rel, as_version=4), done)
    for rel in exercises:
        notebooks[rel] = exercise_notebook(rel, root, executed, cfg)
    unexecuted = [rel for rel, nb in notebooks.items() if "unexecuted" in nb.metadata.get(METADATA_KEY, {})]
    for rel in unexecuted:
        why = notebooks[rel].metadata[METADATA_KEY]["unexecuted"]
        log(f"{rel}: published as the course ships it, without outputs: {why}")

    src = out.with_name(out.name + "-src")
    book = P.Book(root, cfg, chapters, exercises, METADATA_KEY)
    for path in (src, out):
        if path.exists():
            shutil.rmtree(path)
    book.write_sources(src, notebooks, TEMPLATE_DIR)
    warnings = _sphinx(src, out, cfg["repo"].split("/")[-1], log)
    book.write_downloads(out, notebooks)
    for line in warnings:
        log(f"sphinx: {line}")
    pages = sum(1 for p in out.rglob("*.html") if "_static" not in p.parts)
    seconds = time.perf_counter() - start
    log(f"the edition: {pages} pages in {out} ({seconds:.0f} s); open {out / 'index.html'}")
    return {
        "pages": pages,
        "executed_here": executed_here,
        "unexecuted": unexecuted,
        "warnings": warnings,
        "seconds": seconds,
    }


def check(site: Path = SITE, root: Path = ROOT) -> list[str]:
    """Every problem of the edition at `site` (course_lib.tooling.edition.check); none: all is well."""
    from course_lib.tooling.edition.check import problems

    return problems(site, root)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the published edition of the course (make site)")
    sub = parser.add_subparsers(dest="what", required=True)
    b = sub.add_parser("build", help="write the edition (executing only chapters `make test` has not run)")
    b.add_argument("--out", type=Path, default=SITE)
    b.add_argument("--reuse-only", action="store_true", help="fail, not execute, where make test left no current copy")
    c = sub.add_parser("check", help="links, anchors, images, network, dumps, machine paths, answered exercises")
    c.add_argument("site", type=Path, nargs="?", default=SITE)
    c.add_argument("--root", type=Path, default=ROOT, help="the course the edition was built from")
    args = parser.parse_args(argv)
    if args.what == "build":
        try:
            build(args.out, reuse_only=args.reuse_only)
        except NotExecuted as error:
            print(f"make site: {error}", file=sys.stderr)
            return 1
        return 0
    problems = check(args.site, args.root)
    for problem in problems:
        print(problem)
    pages = sum(1 for p in args.site.rglob("*.html") if "_static" not in p.parts)
    verdict = f"{len(problems)} problems" if problems else "no problem (links, network, dumps, paths, exercises)"
    print(f"{pages} pages checked: {verdict}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
