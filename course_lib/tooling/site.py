"""`make site`: the course as a static HTML edition, read without running anything (tooling).

Self-study learners read first and run later. `make site` writes every chapter and every exercise
notebook (never the solutions) into build/site/ as HTML pages with their outputs, and the
README, the docs and the library files they link to beside them, so that every link works offline.

Where the outputs come from. `make test` runs every notebook cell by cell (nbval); conftest.py
hands what each cell printed to `save_executed`, which writes the executed notebook to
build/executed/ with the machine, the versions and the date in its metadata. `build` reads those
copies, so the edition costs no second execution. A notebook with no copy, or whose code changed
since its copy was made, is executed here with nbclient (and says so). GPU results are those the
CPU cells load from data/reference/; each page lists the recorded runs it reads, with their
provenance.

What a page changes from the notebook: links to notebooks, Markdown and Python files point at their
pages; links to what the edition does not hold (the solutions, other files) point at the
repository on GitHub; a widget's output keeps its static picture (the state after Run All) with a
note that it is live in JupyterLab and Colab; formulas are turned into MathML when the page is
built (latex2mathml), which browsers draw themselves, and the Colab badge is a local image, so a
page loads no script and fetches nothing from the network, even opened from the disk. `check`
then verifies every internal link, anchor and image of the edition.

    python -m course_lib.tooling.site build   [--out build/site]
    python -m course_lib.tooling.site check   [build/site]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import hashlib
import html
import os
import platform
import re
import shutil
import sys
import time
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

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
    "page_notebook",
    "build",
    "check",
]

ROOT = Path(__file__).resolve().parents[2]
EXECUTED = ROOT / "build" / "executed"
SITE = ROOT / "build" / "site"
TEMPLATE_DIR = Path(__file__).with_name("site_template")
PAGE_DIRS = ("notebooks", "exercises")  # the solutions are never published
DOCS = ("README.md", "docs/*.md", "data/README.md")
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
METADATA_KEY = "amp_course_execution"
LIVE_NOTE = '<p class="amp-live-note">A live widget in JupyterLab and Colab; here, the state it had after Run All.</p>'
# $$display$$ and $inline$ formulas of a Markdown cell, outside code (fenced blocks, `spans`)
MATH = re.compile(r"(```.*?```|`[^`\n]*`)|\$\$(.+?)\$\$|(?<![\\$])\$([^$\n]+?)\$", re.S)
# a tqdm progress bar's text form: what it showed when displayed (0%), not how it ended
PROGRESS_BAR = re.compile(r"^[^\n|]*\d+%\|.*\|\s*\d+/\d+", re.S)
PROGRESS_NOTE = (
    '<p class="amp-live-note">A progress bar, live in JupyterLab and Colab. Its end is not stored with '
    "the notebook; the lines the cell printed say how the run went.</p>"
)
REFERENCE_CALL = re.compile(r"""(?:show_reference|load_references)\(\s*["']([^"']+)["']""")
LINK = re.compile(r"""(href|src)="([^"]*)\"""")


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
    try:
        client.execute()
    except CellExecutionError as error:
        last = [line for line in str(error).splitlines() if line.strip()][-1:]
        raise NotExecuted(f"{rel}: a cell failed while executing it for the edition: {' '.join(last)}") from None
    source.metadata[METADATA_KEY] = {
        **execution_provenance("python -m course_lib.tooling.site build (nbclient)"),
        "code": code_digest(source),
    }
    log(f"{rel}: executed in {time.perf_counter() - start:.0f} s")
    copy_path.parent.mkdir(parents=True, exist_ok=True)
    copy_path.write_text(nbformat.writes(source), encoding="utf-8")
    return source


# ----------------------------------------------------------------------------- pages


def _recorded_runs(nb: nbformat.NotebookNode, root: Path) -> list[dict]:
    """The data/reference/ files the notebook's cells load, each with its recorded provenance."""
    from course_lib.reference import load_references

    patterns = sorted({m for c in nb.cells if c.cell_type == "code" for m in REFERENCE_CALL.findall(c.source)})
    folder = root / "data" / "reference"
    return [{"file": r["file"], **r.get("provenance", {})} for p in patterns for r in load_references(p, folder)]


def mathml(markdown: str) -> str:
    """`markdown` with each formula ($inline$, $$display$$) replaced by its MathML, code left as it is."""
    from latex2mathml.converter import convert

    def one(m: re.Match) -> str:
        if m.group(1):
            return m.group(1)
        if m.group(2) is not None:
            return convert(" ".join(m.group(2).split()), display="block")
        return convert(m.group(3))

    return MATH.sub(one, markdown)


def page_notebook(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The notebook as a page shows it: formulas in MathML; each widget's output keeps its static
    picture (its HTML or text representation, the state after Run All) under a note that it is
    live in JupyterLab and Colab."""
    page = copy.deepcopy(nb)
    for cell in page.cells:
        if cell.cell_type == "markdown":
            cell.source = mathml(cell.source)
        outputs = []
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if WIDGET_VIEW in data:
                del data[WIDGET_VIEW]
                if PROGRESS_BAR.match(data.get("text/plain", "")):
                    data.clear()
                    data["text/html"] = PROGRESS_NOTE
                else:  # the note, then the widget's own static picture (HTML, an image, or its text)
                    outputs.append(nbformat.v4.new_output("display_data", data={"text/html": LIVE_NOTE}))
            outputs.append(out)
        if cell.cell_type == "code":
            cell.outputs = outputs
    page.metadata.pop("widgets", None)
    return page


class _Pages:
    """Where each repository file lands in the edition, and how a link from one page reaches it."""

    def __init__(self, root: Path, repo: str, ref: str):
        self.root, self.repo, self.ref = root, repo, ref
        self.published: set[str] = set()  # repository paths that get a page

    @staticmethod
    def page_of(rel: str) -> str:
        if rel.endswith(".ipynb"):
            return rel[: -len(".ipynb")] + ".html"
        if rel.endswith(".md"):
            return rel[: -len(".md")] + ".html"
        return rel + ".html"  # a Python file: its highlighted source

    def rewrite(self, text: str, page_rel: str) -> str:
        """Every relative link of `text` (on the page of repository path `page_rel`) pointed at a page
        of the edition, or at GitHub where the edition holds no page."""
        here = Path(page_rel).parent

        def fix(m: re.Match) -> str:
            attr, url = m.group(1), m.group(2)
            parts = urlsplit(url)
            if parts.scheme or parts.netloc or url.startswith(("#", "data:", "mailto:")) or not parts.path:
                return m.group(0)
            target = os.path.normpath(here / unquote(parts.path)).replace(os.sep, "/")
            if target.startswith("_static/") or target in {"index.html"}:
                return m.group(0)
            anchor = f"#{parts.fragment}" if parts.fragment else ""
            if target in self.published:
                new = os.path.relpath(self.page_of(target), here).replace(os.sep, "/") + anchor
            else:
                kind = "tree" if (self.root / target).is_dir() else "blob"
                new = f"https://github.com/{self.repo}/{kind}/{self.ref}/{target}{anchor}"
            return f'{attr}="{html.escape(new)}"'

        return LINK.sub(fix, text)


def _static_rel(page_rel: str) -> str:
    depth = len(Path(page_rel).parent.parts)
    return "../" * depth + "_static/"


def _provenance_html(prov: dict, runs: list[dict], gpu_cells: int) -> str:
    lines = [
        "<details class='amp-provenance' open><summary>What produced this page</summary><ul>",
        f"<li>Outputs: run by <code>{html.escape(prov.get('command', '?'))}</code> "
        f"on {html.escape(prov.get('date', '?'))}, "
        f"{html.escape(prov.get('machine', '?'))}; torch {html.escape(prov.get('torch', '?'))}, "
        f"Python {html.escape(prov.get('python', '?'))}.</li>",
    ]
    if runs:
        lines.append("<li>Recorded GPU results this page reads (<code>data/reference/</code>):<ul>")
        for r in runs:
            what = ", ".join(
                html.escape(str(r[k])) for k in ("device", "torch", "cuda", "date") if r.get(k) is not None
            )
            command = f"<br><code>{html.escape(r['command'])}</code>" if r.get("command") else ""
            lines.append(f"<li><code>{html.escape(r['file'])}</code>: {what}{command}</li>")
        lines.append("</ul></li>")
    if gpu_cells and "no GPU used" in prov.get("machine", "no GPU used"):
        lines.append(
            f"<li>The {gpu_cells} cell(s) tagged <code>gpu</code> took their CPU path here: each says so in one "
            "line and names where its recorded GPU result is shown.</li>"
        )
    elif gpu_cells:
        lines.append(f"<li>The {gpu_cells} cell(s) tagged <code>gpu</code> ran on the GPU named above.</li>")
    lines.append("</ul></details>")
    return "\n".join(lines)


def _nav_html(page_rel: str, title: str) -> str:
    home = os.path.relpath("index.html", Path(page_rel).parent).replace(os.sep, "/")
    return (
        f"<nav class='amp-nav'><a href='{home}'>amp-course</a> · <span>{html.escape(title)}</span>"
        " · <span class='amp-edition'>the published edition: read here, run in JupyterLab or Colab</span></nav>"
    )


def _notebook_page(nb: nbformat.NotebookNode, rel: str, pages: _Pages, root: Path) -> str:
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(template_name="amp_site", extra_template_basedirs=[str(TEMPLATE_DIR)])
    static = _static_rel(rel)
    prov = nb.metadata.get(METADATA_KEY, {})
    title = next(
        (
            c.source.splitlines()[0].lstrip("# ")
            for c in nb.cells
            if c.cell_type == "markdown" and c.source.startswith("# ")
        ),
        rel,
    )
    resources = {
        "metadata": {"name": title},
        "amp_header": _nav_html(rel, title)
        + _provenance_html(prov, _recorded_runs(nb, root), sum("gpu" in c.metadata.get("tags", []) for c in nb.cells)),
        "amp_css": f"{static}site.css",
    }
    body, _ = exporter.from_notebook_node(page_notebook(nb), resources=resources)
    body = body.replace("https://colab.research.google.com/assets/colab-badge.svg", f"{static}colab-badge.svg")
    return pages.rewrite(body, rel)


def _markdown_page(rel: str, pages: _Pages, root: Path) -> str:
    from nbconvert.filters.markdown_mistune import markdown2html_mistune

    text = (root / rel).read_text(encoding="utf-8")
    static = _static_rel(rel)
    title = next((line.lstrip("# ") for line in text.splitlines() if line.startswith("# ")), rel)
    body = markdown2html_mistune(text)
    return pages.rewrite(_plain_page(title, _nav_html(rel, title) + body, static), rel)


def _source_page(rel: str, root: Path) -> str:
    from pygments import highlight
    from pygments.formatters import HtmlFormatter
    from pygments.lexers import PythonLexer

    code = highlight((root / rel).read_text(encoding="utf-8"), PythonLexer(), HtmlFormatter(linenos="inline"))
    css = HtmlFormatter().get_style_defs(".highlight")
    return _plain_page(
        rel,
        _nav_html(rel, rel) + f"<style>{css}</style><h1><code>{html.escape(rel)}</code></h1>{code}",
        _static_rel(rel),
    )


def _plain_page(title: str, body: str, static: str) -> str:
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f'<meta name="viewport" content="width=device-width, initial-scale=1.0">'
        f'<link rel="stylesheet" href="{static}site.css"></head>'
        f'<body class="amp-plain"><main>{body}</main></body></html>\n'
    )


def _linked_files(text: str, page_rel: str, root: Path) -> set[str]:
    """Repository .md and .py files that `text` (Markdown or HTML) links to from `page_rel`."""
    found = set()
    for url in re.findall(r"\]\(([^)\s]+)\)|href=\"([^\"]+)\"", text):
        url = url[0] or url[1]
        parts = urlsplit(url)
        if parts.scheme or parts.netloc or not parts.path:
            continue
        target = os.path.normpath(Path(page_rel).parent / unquote(parts.path)).replace(os.sep, "/")
        if target.endswith((".md", ".py")) and (root / target).is_file() and not target.startswith(".."):
            found.add(target)
    return found


def _colab_badge() -> str:
    return (
        '<svg xmlns="http://www.w3.org/2000/svg" width="117" height="20" role="img" aria-label="Open in Colab">'
        '<rect width="117" height="20" rx="3" fill="#555"/><rect x="0" width="20" height="20" rx="3" fill="#f9ab00"/>'
        '<text x="68" y="14" fill="#fff" font-family="Verdana,sans-serif" font-size="11" text-anchor="middle">'
        "Open in Colab</text></svg>\n"
    )


def build(out: Path = SITE, root: Path = ROOT, executed: Path = EXECUTED, log=print, reuse_only: bool = False) -> dict:
    """Write the edition into `out` (replaced whole), from the executed copies in `executed`
    (notebooks without a current one are executed here, or with `reuse_only` refused: NotExecuted).
    Returns {"pages": n, "executed_here": [notebook paths], "seconds": s}."""
    from course_lib.tooling.colab import read_config

    start = time.perf_counter()
    cfg = read_config(root)
    pages = _Pages(root, cfg["repo"], cfg["ref"])
    notebooks = sorted(str(p.relative_to(root)) for d in PAGE_DIRS for p in (root / d).glob("*.ipynb"))
    docs = sorted({str(p.relative_to(root)) for pattern in DOCS for p in root.glob(pattern)})
    pages.published.update(notebooks, docs)
    executed_here: list[str] = []

    def note(message: str) -> None:
        if "executing it now" in message:
            executed_here.append(message.split(":")[0])
        log(message)

    executed_nbs = {rel: executed_notebook(rel, root, executed, note, reuse_only) for rel in notebooks}
    # the library files and further docs the pages link to, followed until none is new
    queue = set()
    for rel, nb in executed_nbs.items():
        queue |= _linked_files("\n".join(c.source for c in nb.cells if c.cell_type == "markdown"), rel, root)
    for rel in docs:
        queue |= _linked_files((root / rel).read_text(encoding="utf-8"), rel, root)
    while queue - pages.published:
        new = queue - pages.published
        pages.published |= new
        queue = set()
        for rel in new:
            if rel.endswith(".md"):
                queue |= _linked_files((root / rel).read_text(encoding="utf-8"), rel, root)
    if out.exists():
        shutil.rmtree(out)
    (out / "_static").mkdir(parents=True)
    for rel in sorted(pages.published):
        if rel in executed_nbs:
            text = _notebook_page(executed_nbs[rel], rel, pages, root)
        elif rel.endswith(".md"):
            text = _markdown_page(rel, pages, root)
        else:
            text = _source_page(rel, root)
        target = out / pages.page_of(rel)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
    shutil.copyfile(out / pages.page_of("README.md"), out / "index.html")
    shutil.copyfile(TEMPLATE_DIR / "site.css", out / "_static" / "site.css")
    (out / "_static" / "colab-badge.svg").write_text(_colab_badge(), encoding="utf-8")
    seconds = time.perf_counter() - start
    log(f"the edition: {len(pages.published)} pages in {out} ({seconds:.0f} s); open {out / 'index.html'}")
    return {"pages": len(pages.published), "executed_here": executed_here, "seconds": seconds}


# ----------------------------------------------------------------------------- check


class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for key in ("id", "name"):
            if a.get(key):
                self.ids.add(a[key])
        if tag == "a" and a.get("href"):
            self.links.append(("href", a["href"]))
        if tag in ("img", "script") and a.get("src"):
            self.links.append(("src", a["src"]))
        if tag == "link" and a.get("href"):
            self.links.append(("href", a["href"]))


def check(site: Path = SITE) -> list[str]:
    """Every problem of the edition at `site`: an internal link to a missing page or anchor, an image
    or script that is not there, a notebook page with no output. An empty list: all is well."""
    parsed: dict[Path, _Links] = {}
    for page in sorted(site.rglob("*.html")):
        if "_static" in page.parts:
            continue
        p = _Links()
        p.feed(page.read_text(encoding="utf-8"))
        parsed[page] = p
    problems = []
    if not (site / "index.html").exists():
        problems.append("index.html: missing")
    for page, p in parsed.items():
        rel = page.relative_to(site)
        for attr, url in p.links:
            parts = urlsplit(url)
            if parts.scheme in ("http", "https", "mailto") or url.startswith("data:"):
                if attr == "src" and parts.scheme in ("http", "https"):
                    problems.append(f"{rel}: loads {url} from the network")
                continue
            target = (page.parent / unquote(parts.path)).resolve() if parts.path else page.resolve()
            if not target.exists():
                problems.append(f"{rel}: {attr} {url}: no such file")
                continue
            if parts.fragment and target.suffix == ".html":
                ids = parsed[target].ids if target in parsed else set()
                if parts.fragment not in ids and unquote(parts.fragment) not in ids:  # as a browser looks
                    problems.append(f"{rel}: {url}: no such anchor")
        text = page.read_text(encoding="utf-8")
        if str(rel).startswith(PAGE_DIRS) and "jp-OutputArea-output" not in text:
            problems.append(f"{rel}: a notebook page without outputs")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the published edition of the course (make site)")
    sub = parser.add_subparsers(dest="what", required=True)
    b = sub.add_parser("build", help="write the edition (executing only notebooks `make test` has not)")
    b.add_argument("--out", type=Path, default=SITE)
    b.add_argument("--reuse-only", action="store_true", help="fail, not execute, where make test left no current copy")
    c = sub.add_parser("check", help="every internal link, anchor and image of a built edition")
    c.add_argument("site", type=Path, nargs="?", default=SITE)
    args = parser.parse_args(argv)
    if args.what == "build":
        try:
            build(args.out, reuse_only=args.reuse_only)
        except NotExecuted as error:
            print(f"make site: {error}", file=sys.stderr)
            return 1
        return 0
    problems = check(args.site)
    for problem in problems:
        print(problem)
    pages = sum(1 for p in args.site.rglob("*.html") if "_static" not in p.parts)
    print(f"{pages} pages checked: " + (f"{len(problems)} problems" if problems else "no broken link, anchor or image"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
