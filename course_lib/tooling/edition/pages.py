"""The pages of the published edition, as the sources Sphinx reads (course_lib.tooling.site).

A notebook becomes a page here, and only what a reader should see stays on it:
- it opens on its title and objectives: the Colab badge and the setup cell come after them, the
  setup cell folded, and a folded box says what produced the outputs and offers the notebook;
- no path of the building machine: the repository's folder and the home folder, wherever an output
  prints them, are written relative to the course (`runs/06_profiling`) and as `~`;
- a widget keeps its static picture (the state after Run All) under a note that it is live in
  JupyterLab and Colab; a progress bar, whose stored text is how it started, is replaced by a note;
- formulas become MathML (latex2mathml), drawn by the browser with no font or script to fetch;
- every link leads somewhere: a link to a notebook, Markdown or Python file the edition publishes
  points at its page; one to another file the repository holds points at GitHub; one to what a run
  writes (runs/, files git does not track) is left as plain text.
"""

from __future__ import annotations

import copy
import html
import os
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import unquote, urlsplit

import nbformat

from course_lib.tooling.notebook_filter import WIDGET_VIEW

__all__ = [
    "shipped_exercise",
    "mathml",
    "machine_paths",
    "scrub",
    "held",
    "Links",
    "Book",
    "WIDGET_VIEW",
    "DUMP_LINES",
    "DUMP_CHARS",
]

DUMP_LINES, DUMP_CHARS = 200, 20_000  # conftest.py's data dump: an output longer than either is one
BADGE = "https://colab.research.google.com/assets/colab-badge.svg"
LIVE_NOTE = '<p class="amp-live-note">A live widget in JupyterLab and Colab; here, the state it had after Run All.</p>'
PROGRESS_NOTE = (
    '<p class="amp-live-note">A progress bar, live in JupyterLab and Colab. Its end is not stored with '
    "the notebook; the lines the cell printed say how the run went.</p>"
)
# $$display$$ and $inline$ formulas of a Markdown cell, outside code (fenced blocks, `spans`)
MATH = re.compile(r"(```.*?```|`[^`\n]*`)|\$\$(.+?)\$\$|(?<![\\$])\$([^$\n]+?)\$", re.S)
FENCE = re.compile(r"(```.*?```)", re.S)  # a fenced code block: its text is left as it is
# a tqdm progress bar's text form: what it showed when displayed (0%), not how it ended
PROGRESS_BAR = re.compile(r"^[^\n|]*\d+%\|.*\|\s*\d+/\d+", re.S)
REFERENCE_CALL = re.compile(r"""(?:show_reference|load_references)\(\s*["']([^"']+)["']""")
MD_LINK = re.compile(r"(?<!!)\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?([^)\s>]+)>?(\s+\"[^\"]*\")?\s*\)")
A_TAG = re.compile(r"""<a\b([^>]*?)\bhref=(["'])(.*?)\2([^>]*)>(.*?)</a>""", re.S | re.I)
UNTRACKED_DIRS = {"runs", "build", "gradebook", ".venv", ".venv-floor"}  # what runs write, without git to ask


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


# ----------------------------------------------------------------------------- machine paths


def machine_paths(root: Path) -> list[tuple[re.Pattern, str]]:
    """What names this machine's folders, and what a page says instead: the course's folder (as given
    and resolved) becomes a path relative to the course, the home folder `~`."""
    pairs: list[tuple[str, str]] = []
    for folder in {str(root), str(Path(root).resolve())}:
        pairs += [(folder, "")]
    home = str(Path.home())
    if home not in ("", "/", os.sep):
        pairs += [(home, "~")]
    rules = []
    for folder, short in sorted(pairs, key=lambda p: -len(p[0])):
        inside = short + "/" if short else ""
        rules.append((re.compile(re.escape(folder) + r"[/\\]"), inside))
        rules.append((re.compile(re.escape(folder) + r"(?![\w.-])"), short or "."))
    return rules


def scrub(text: str, rules: list[tuple[re.Pattern, str]]) -> str:
    for pattern, short in rules:
        text = pattern.sub(short, text)
    return text


def _scrub_outputs(nb: nbformat.NotebookNode, rules) -> None:
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if "text" in out:
                out["text"] = scrub("".join(out["text"]), rules)
            for mime, value in out.get("data", {}).items():
                if mime.startswith("text/") or mime.endswith("json"):
                    out["data"][mime] = scrub("".join(value), rules) if isinstance(value, (str, list)) else value
            if "traceback" in out:
                out["traceback"] = [scrub(line, rules) for line in out["traceback"]]
            if "evalue" in out:
                out["evalue"] = scrub(out["evalue"], rules)


# ----------------------------------------------------------------------------- links


def _tracked(root: Path) -> set[str] | None:
    """The files git tracks in `root`, if `root` is the top of a git checkout; else None."""
    try:
        top = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--show-toplevel"], capture_output=True, text=True, timeout=30
        )
        if top.returncode or Path(top.stdout.strip()).resolve() != Path(root).resolve():
            return None
        files = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return set(filter(None, files.stdout.split("\0"))) if files.returncode == 0 else None


def held(root: Path, target: str, tracked: set[str] | None) -> bool:
    """Whether the repository holds `target` (a file, or a folder with files), so that GitHub shows it:
    git's files where `root` is a checkout, else what is there and is not written by a run."""
    target = target.rstrip("/")
    if tracked is not None:
        return target in tracked or any(t.startswith(target + "/") for t in tracked)
    return (root / target).exists() and Path(target).parts[0] not in UNTRACKED_DIRS


class Links:
    """Where a link of a page leads: a page of the edition, GitHub, or nowhere (plain text)."""

    def __init__(self, root: Path, cfg: dict, sources: dict[str, str]):
        self.root, self.cfg = root, cfg
        self.sources = sources  # repository path -> the path of its page's source in the edition
        self.tracked = _tracked(root)

    def github(self, target: str, anchor: str = "") -> str:
        kind = "tree" if (self.root / target).is_dir() else "blob"
        return f"https://github.com/{self.cfg['repo']}/{kind}/{self.cfg['ref']}/{target}{anchor}"

    def resolve(self, url: str, page: str) -> tuple[str, str] | None:
        """("page", the target's repository path + anchor), ("github", url), ("none", "") or None for a
        link that is not the repository's (another site, an anchor on the page)."""
        parts = urlsplit(url)
        if parts.scheme or parts.netloc or url.startswith(("#", "data:", "mailto:")) or not parts.path:
            return None
        target = os.path.normpath(Path(page).parent / unquote(parts.path)).replace(os.sep, "/")
        anchor = f"#{parts.fragment}" if parts.fragment else ""
        if target.startswith("../"):
            return "none", ""
        if target in self.sources:
            return "page", target + anchor
        if held(self.root, target, self.tracked):
            return "github", self.github(target, anchor)
        return "none", ""

    def _relative(self, target: str, page: str, html_page: bool) -> str:
        path, _, anchor = target.partition("#")
        dest = self.sources[path]
        if html_page:
            dest = os.path.splitext(dest)[0] + ".html"
        here = os.path.dirname(self.sources.get(page, page))
        return os.path.relpath(dest, here or ".").replace(os.sep, "/") + (f"#{anchor}" if anchor else "")

    def markdown(self, text: str, page: str) -> str:
        """`text` (Markdown of repository path `page`) with its links pointed at sources of the edition
        (Sphinx makes them links between pages), GitHub, or made plain text; then its HTML links."""

        def fix(m: re.Match) -> str:
            label, url, title = m.group(1), m.group(2), m.group(3) or ""
            where = self.resolve(url, page)
            if where is None:
                return m.group(0)
            kind, value = where
            if kind == "none":
                return label
            new = self._relative(value, page, html_page=False) if kind == "page" else value
            return f"[{label}]({new}{title})"

        pieces = FENCE.split(text)
        return "".join(p if i % 2 else self.html(MD_LINK.sub(fix, p), page) for i, p in enumerate(pieces))

    def html(self, text: str, page: str) -> str:
        """`text` (HTML on the page of repository path `page`) with each <a href> pointed at a page of
        the edition or GitHub, or made plain text."""

        def fix(m: re.Match) -> str:
            before, quote, url, after, inner = m.groups()
            where = self.resolve(html.unescape(url), page)
            if where is None:
                return m.group(0)
            kind, value = where
            if kind == "none":
                return f'<span class="amp-unlinked">{inner}</span>'
            new = self._relative(value, page, html_page=True) if kind == "page" else value
            return f'<a{before}href="{html.escape(new)}"{after}>{inner}</a>'

        return A_TAG.sub(fix, text)


# ----------------------------------------------------------------------------- notebooks


def shipped_exercise(rel: str, root: Path, cfg: dict | None = None) -> nbformat.NotebookNode:
    """Exercise notebook `rel` as the course ships it: generated from its solution, as `make exercises`
    writes it (never the copy in exercises/, which holds a learner's answers once they work on it)."""
    from course_lib.tooling.colab import read_config
    from course_lib.tooling.exercises import exercise_text

    solution = root / "solutions" / Path(rel).name
    if not solution.exists():  # an exercise without a solution is not the course's
        raise FileNotFoundError(f"{rel}: no solutions/{Path(rel).name} to generate it from (make exercises)")
    return nbformat.reads(exercise_text(solution, cfg or read_config(root)), as_version=4)


def _widgets_as_pictures(nb: nbformat.NotebookNode) -> None:
    """Each widget's output keeps its static picture (its HTML or text representation, the state after
    Run All) under a note that it is live in JupyterLab and Colab; a progress bar becomes a note."""
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        outputs = []
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if WIDGET_VIEW in data:
                del data[WIDGET_VIEW]
                if PROGRESS_BAR.match("".join(data.get("text/plain", ""))):
                    data.clear()
                    data["text/html"] = PROGRESS_NOTE
                else:  # the note, then the widget's own static picture (HTML, an image, or its text)
                    if "image/png" in data or "text/html" in data:
                        data.pop("text/plain", None)
                    outputs.append(nbformat.v4.new_output("display_data", data={"text/html": LIVE_NOTE}))
            outputs.append(out)
        cell.outputs = outputs
    nb.metadata.pop("widgets", None)


def _recorded_runs(nb: nbformat.NotebookNode, root: Path) -> list[dict]:
    """The data/reference/ files the notebook's cells load, each with its recorded provenance."""
    from course_lib.reference import load_references

    patterns = sorted({m for c in nb.cells if c.cell_type == "code" for m in REFERENCE_CALL.findall(c.source)})
    folder = root / "data" / "reference"
    return [{"file": r["file"], **r.get("provenance", {})} for p in patterns for r in load_references(p, folder)]


def _recorded_with(run: dict) -> str:
    """A recorded run's command as recorded, what runs it now if its module moved since (MOVED, in
    course_lib/_provenance.py), and the code it ran: the course's commit, or else the file's blob id."""
    from course_lib.reference import current_command

    e = html.escape
    if not run.get("command"):
        return ""
    now = current_command(run["command"])
    text = f"<br>recorded with <code>{e(run['command'])}</code>" + (f" (now <code>{e(now)}</code>)" if now else "")
    note = f" ({e(run['commit_note'])})" if run.get("commit_note") else ""
    if run.get("commit"):
        text += f", at commit <code>{e(run['commit'][:12])}</code>{note}"
    elif run.get("source_blob"):
        text += f", <code>{e(run['source'])}</code> as blob <code>{e(run['source_blob'][:12])}</code>{note}"
    return text


def _about_html(prov: dict, runs: list[dict], gpu_cells: int, download: str) -> str:
    """The folded box under a page's title: what produced its outputs, and the notebook to download."""
    e = html.escape
    if "unexecuted" in prov:
        summary = "Published as the course ships it, without outputs"
        items = [
            f"<li>{e(prov['unexecuted'][0].upper() + prov['unexecuted'][1:])}: run it in JupyterLab or Colab.</li>"
        ]
    else:
        summary = f"Outputs: <code>{e(prov.get('command', '?'))}</code>, {e(prov.get('date', '?'))}"
        items = [
            f"<li>Run by <code>{e(prov.get('command', '?'))}</code> on {e(prov.get('date', '?'))}, "
            f"{e(prov.get('machine', '?'))}; torch {e(prov.get('torch', '?'))}, "
            f"Python {e(prov.get('python', '?'))}.</li>"
        ]
        if runs:
            items.append("<li>Recorded GPU results this page reads (<code>data/reference/</code>):<ul>")
            for r in runs:
                what = ", ".join(e(str(r[k])) for k in ("device", "torch", "cuda", "date") if r.get(k) is not None)
                items.append(f"<li><code>{e(r['file'])}</code>: {what}{_recorded_with(r)}</li>")
            items.append("</ul></li>")
        if gpu_cells and "no GPU used" in prov.get("machine", "no GPU used"):
            items.append(
                f"<li>The {gpu_cells} cell(s) tagged <code>gpu</code> took their CPU path here: each says so in one "
                "line and names where its recorded GPU result is shown.</li>"
            )
        elif gpu_cells:
            items.append(f"<li>The {gpu_cells} cell(s) tagged <code>gpu</code> ran on the GPU named above.</li>")
    return (
        '<div class="amp-about">'
        f'<details class="amp-provenance"><summary>{summary}</summary><ul>{"".join(items)}</ul></details>'
        f'<a class="amp-download" href="{e(download)}" download>Download the notebook (.ipynb)</a>'
        "</div>"
    )


def _title_first(nb: nbformat.NotebookNode, about: str) -> None:
    """The title cell (and its objectives) first, the box under it, then what came before the title
    (the Colab badge and its note), the setup cell folded."""
    title = next(
        (i for i, c in enumerate(nb.cells) if c.cell_type == "markdown" and c.source.lstrip().startswith("# ")), None
    )
    box = nbformat.v4.new_markdown_cell(about)
    if title is None:
        nb.cells = [box, *nb.cells]
        return
    before = nb.cells[:title]
    for cell in before:
        if cell.cell_type == "code" and cell.source.lstrip().startswith("# @title"):
            cell.metadata.setdefault("tags", []).append("hide-cell")
    nb.cells = [nb.cells[title], box, *before, *nb.cells[title + 1 :]]


def download_copy(nb: nbformat.NotebookNode, metadata_key: str) -> nbformat.NotebookNode:
    """The notebook to download: its text as the course has it, no outputs, no run metadata."""
    clean = copy.deepcopy(nb)
    for cell in clean.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    for key in (metadata_key, "widgets"):
        clean.metadata.pop(key, None)
    return clean


class Book:
    """The sources of the edition: the index (the README, with the book's table of contents), the
    chapters, the exercises, the docs, and the library files they link to."""

    def __init__(self, root: Path, cfg: dict, chapters: list[str], exercises: list[str], metadata_key: str):
        self.root, self.cfg, self.chapters, self.exercises, self.key = root, cfg, chapters, exercises, metadata_key
        docs = sorted(
            {str(p.relative_to(root)) for pattern in ("docs/*.md", "data/README.md") for p in root.glob(pattern)}
        )
        sources = {rel: rel for rel in chapters + exercises + docs}
        sources["README.md"] = "index.md"
        queue = {"README.md", *docs, *chapters, *exercises}  # what the pages link to, followed until none is new
        texts = {rel: self._markdown_of(rel) for rel in chapters + exercises}
        while queue:
            rel = queue.pop()
            text = texts.get(rel) or (root / rel).read_text(encoding="utf-8")
            for target in self._linked_files(text, rel):
                if target not in sources:
                    sources[target] = target + ".md" if target.endswith(".py") else target
                    if target.endswith(".md"):
                        queue.add(target)
        self.sources = sources
        self.docs = sorted(r for r in sources if r.endswith(".md") and r != "README.md")
        self.links = Links(root, cfg, sources)
        self.rules = machine_paths(root)

    def _markdown_of(self, rel: str) -> str:
        nb = nbformat.read(self.root / rel, as_version=4)
        return "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")

    def _linked_files(self, text: str, page: str) -> set[str]:
        found = set()
        for url in re.findall(r"\]\(([^)\s]+)\)|href=\"([^\"]+)\"", text):
            url = url[0] or url[1]
            parts = urlsplit(url)
            if parts.scheme or parts.netloc or not parts.path:
                continue
            target = os.path.normpath(Path(page).parent / unquote(parts.path)).replace(os.sep, "/")
            if target.endswith((".md", ".py")) and not target.startswith("..") and (self.root / target).is_file():
                found.add(target)
        return found

    def page(self, nb: nbformat.NotebookNode, rel: str) -> nbformat.NotebookNode:
        """Notebook `rel` (with its outputs) as its page shows it."""
        page = copy.deepcopy(nb)
        _scrub_outputs(page, self.rules)
        _widgets_as_pictures(page)
        for cell in page.cells:
            if cell.cell_type == "markdown":
                badge = os.path.relpath("colab-badge.svg", os.path.dirname(rel) or ".").replace(os.sep, "/")
                cell.source = self.links.markdown(mathml(cell.source.replace(BADGE, badge)), rel)
            elif cell.cell_type == "code":
                for out in cell.outputs:
                    if "text/html" in out.get("data", {}):
                        out["data"]["text/html"] = self.links.html("".join(out["data"]["text/html"]), rel)
        prov = nb.metadata.get(self.key, {})
        gpu_cells = sum("gpu" in c.metadata.get("tags", []) for c in nb.cells)
        about = _about_html(prov, _recorded_runs(nb, self.root), gpu_cells, Path(rel).name)
        _title_first(page, about)
        page.metadata.pop(self.key, None)
        return page

    def _toctree(self, caption: str, entries: list[str]) -> str:
        names = "\n".join(os.path.splitext(self.sources[e])[0] for e in entries)
        return f"\n\n```{{toctree}}\n:caption: {caption}\n:hidden:\n:titlesonly:\n\n{names}\n```\n"

    def write_sources(self, src: Path, notebooks: dict[str, nbformat.NotebookNode], template: Path) -> None:
        """Write every page's source into `src`, for Sphinx."""
        src.mkdir(parents=True)
        shutil.copyfile(template / "_static" / "colab-badge.svg", src / "colab-badge.svg")
        for rel, nb in notebooks.items():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            nbformat.write(self.page(nb, rel), src / rel)
        readme = self.links.markdown((self.root / "README.md").read_text(encoding="utf-8"), "README.md")
        readme += self._toctree("Chapters", self.chapters) + self._toctree("Exercises", self.exercises)
        readme += self._toctree("About the course", self.docs)
        (src / "index.md").write_text(readme, encoding="utf-8")
        for rel in self.docs:
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            text = self.links.markdown((self.root / rel).read_text(encoding="utf-8"), rel)
            (src / rel).write_text(text, encoding="utf-8")
        for rel in (r for r in self.sources if r.endswith(".py")):
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.root / rel, src / rel)
            name = Path(rel).name
            include = f"```{{literalinclude}} {name}\n:language: python\n:linenos:\n```\n"
            page = f"---\norphan: true\n---\n\n# `{rel}`\n\n{include}"
            (src / (rel + ".md")).write_text(page, encoding="utf-8")

    def write_downloads(self, out: Path, notebooks: dict[str, nbformat.NotebookNode]) -> None:
        """Beside each notebook's page, the notebook itself to download, as the course has it."""
        for rel, nb in notebooks.items():
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            nbformat.write(download_copy(nb, self.key), out / rel)
