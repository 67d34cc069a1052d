"""The published edition's check (`make site`, `python -m course_lib.tooling.site check`).

It reads the built pages as files, as a browser opened from the disk would, and names each problem:
- a link, anchor, image, script or style sheet of the edition that is not there;
- anything loaded from the network (an image, a script, a style sheet, or a font or image a style
  sheet asks for);
- a link to GitHub for a file the repository does not hold (what a run writes, in runs/);
- a notebook page that shows no output (a chapter: exercises may be published unexecuted);
- a data dump: an output of more than DUMP_LINES lines or DUMP_CHARS characters;
- a path of the building machine: the course's folder or the home folder, on a page, in the search
  index or in a notebook to download;
- an answered exercise: an exercise page (or its download) whose code is not the code the course
  ships, or that shows a passed check (✅).
"""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

from course_lib.tooling.edition.pages import DUMP_CHARS, DUMP_LINES, _tracked, held, shipped_exercise

__all__ = ["problems"]

GITHUB = re.compile(r"^https://github\.com/([^/]+/[^/]+)/(?:blob|tree)/([^/]+)/([^#?]+)")
# what a style sheet loads: url(...) and @import "..."
CSS_LOAD = re.compile(r"""url\(\s*['"]?(https?:)?//[^)]*\)|@import\s+['"](https?:)?//[^'"]*['"]""", re.I)
DATA_URI = re.compile(r"data:[\w/+.-]+;base64,[A-Za-z0-9+/=\s]+")
# where other machines keep their users' files; the building machine's own folders are added to these
USER_FOLDERS = re.compile(r"(?<![\w.~-])(/home/[\w.-]+/|/Users/[\w.-]+/|[A-Za-z]:\\Users\\[\w.-]+)")


class _Page(HTMLParser):
    """What a page links to, its element ids, its outputs' text and its code cells' code."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.links: list[tuple[str, str]] = []
        self.ids: set[str] = set()
        self.outputs: list[str] = []  # the text of each output of a code cell
        self.code: list[str] = []  # the code of each code cell
        self._open: list[tuple[str, str | None]] = []  # (tag, what it collects) for each open element
        self._text: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for key in ("id", "name"):
            if a.get(key):
                self.ids.add(a[key])
        if tag == "a" and a.get("href"):
            self.links.append(("href", a["href"]))
        if tag in ("img", "script", "source", "iframe") and a.get("src"):
            self.links.append(("src", a["src"]))
        if tag == "link" and a.get("href"):  # a style sheet, an icon or a font is loaded; next/prev are links
            loads = {"stylesheet", "icon", "preload", "modulepreload", "manifest"} & set((a.get("rel") or "").split())
            self.links.append(("load" if loads else "href", a["href"]))
        if tag in ("br", "img", "link", "meta", "input", "hr", "source", "wbr"):
            return
        classes = (a.get("class") or "").split()
        collects = None
        if self._text is None and tag == "div" and "output" in classes:
            collects = "output"
        elif self._text is None and tag == "div" and "cell_input" in classes:
            collects = "code"
        if collects:
            self._text = []
        self._open.append((tag, collects))

    def handle_endtag(self, tag):
        while self._open:
            open_tag, collects = self._open.pop()
            if collects and self._text is not None:
                (self.outputs if collects == "output" else self.code).append("".join(self._text))
                self._text = None
            if open_tag == tag:
                break

    def handle_data(self, data):
        if self._text is not None:
            self._text.append(data)


def _machine(root: Path) -> re.Pattern:
    """The building machine's own folders, as a page could show them."""
    folders = {str(root), str(Path(root).resolve()), str(Path.home())} - {"", "/"}
    names = "|".join(re.escape(f) for f in sorted(folders, key=len, reverse=True))
    return re.compile(rf"(?:{names})(?![\w.-])|{USER_FOLDERS.pattern}")


def _shipped_code(root: Path) -> dict[str, list[str]]:
    """exercises/NN_x.html -> the code cells of the exercise as the course ships it."""
    from course_lib.tooling.colab import read_config

    cfg = read_config(root)
    shipped = {}
    for solution in sorted((root / "solutions").glob("*.ipynb")):
        nb = shipped_exercise(f"exercises/{solution.name}", root, cfg)
        shipped[f"exercises/{solution.stem}"] = [c.source for c in nb.cells if c.cell_type == "code"]
    return shipped


def _same_code(shown: list[str], shipped: list[str]) -> int | None:
    """The first code cell (0-based) that differs between a page and the shipped exercise; None if none."""
    norm = [[line.rstrip() for line in s.strip("\n").splitlines()] for s in shown]
    want = [[line.rstrip() for line in s.strip("\n").splitlines()] for s in shipped]
    for i in range(max(len(norm), len(want))):
        if i >= len(norm) or i >= len(want) or norm[i] != want[i]:
            return i
    return None


def problems(site: Path, root: Path) -> list[str]:
    """Every problem of the edition at `site`, built from the course at `root`; none: all is well."""
    from course_lib.tooling.colab import read_config

    cfg = read_config(root)
    tracked = _tracked(root)
    machine = _machine(root)
    shipped = _shipped_code(root) if (root / "solutions").is_dir() else {}
    found: list[str] = []
    parsed: dict[Path, _Page] = {}
    for page in sorted(site.rglob("*.html")):
        if "_static" in page.parts:
            continue
        p = _Page()
        p.feed(page.read_text(encoding="utf-8"))
        parsed[page.resolve()] = p
    if not (site / "index.html").exists():
        found.append("index.html: missing")
    for page, p in parsed.items():
        rel = page.relative_to(site.resolve()).as_posix()
        for attr, url in p.links:
            found += _link_problems(rel, page, attr, url, parsed, tracked, cfg, root)
        if rel.startswith("notebooks/") and not p.outputs:
            found.append(f"{rel}: a chapter without outputs")
        for i, text in enumerate(p.outputs):
            lines = text.count("\n") + 1
            if lines > DUMP_LINES or len(text) > DUMP_CHARS:
                first = next((line for line in text.splitlines() if line.strip()), "")[:80]
                found.append(
                    f"{rel}: output {i + 1} is a data dump ({lines:,} lines, {len(text):,} characters): {first!r}"
                )
        stem = rel[: -len(".html")]
        if stem in shipped:
            differs = _same_code(p.code, shipped[stem])
            if differs is not None:
                found.append(f"{rel}: code cell {differs + 1} is not the exercise as the course ships it (an answer?)")
            if any("✅" in text for text in p.outputs):
                found.append(f"{rel}: shows a passed check (✅): an answered exercise")
    for path in sorted(site.rglob("*.css")):
        for m in CSS_LOAD.finditer(path.read_text(encoding="utf-8", errors="replace")):
            found.append(f"{path.relative_to(site).as_posix()}: loads {m.group(0)[:100]} from the network")
    for path in sorted(site.rglob("*")):
        if (
            path.is_file()
            and path.suffix in (".html", ".ipynb", ".js", ".json", ".txt")
            and "_static" not in path.parts
        ):
            text = DATA_URI.sub("", path.read_text(encoding="utf-8", errors="replace"))
            for m in list(machine.finditer(text))[:3]:
                context = text[max(0, m.start() - 40) : m.end() + 40].replace("\n", " ")
                found.append(f"{path.relative_to(site).as_posix()}: a path of the building machine: ...{context}...")
        if path.suffix == ".ipynb" and path.relative_to(site).with_suffix("").as_posix() in shipped:
            nb = json.loads(path.read_text(encoding="utf-8"))
            code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
            if _same_code(code, shipped[path.relative_to(site).with_suffix("").as_posix()]) is not None:
                found.append(
                    f"{path.relative_to(site).as_posix()}: not the exercise as the course ships it (an answer?)"
                )
    return found


def _link_problems(rel, page, attr, url, parsed, tracked, cfg, root) -> list[str]:
    parts = urlsplit(url)
    if parts.scheme in ("http", "https"):
        if attr in ("src", "load"):
            return [f"{rel}: loads {url} from the network"]
        m = GITHUB.match(url)
        if m and m.group(1) == cfg["repo"]:
            if not held(root, unquote(m.group(3)), tracked):
                return [f"{rel}: {url}: links GitHub to a file the repository does not hold"]
        return []
    if parts.scheme or url.startswith(("data:", "mailto:", "javascript:")):
        return []
    target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
    if not target.exists():
        return [f"{rel}: {attr} {url}: no such file"]
    if parts.fragment and target.suffix == ".html":
        ids = parsed[target].ids if target in parsed else set()
        if parts.fragment not in ids and unquote(parts.fragment) not in ids:  # as a browser looks
            return [f"{rel}: {url}: no such anchor"]
    return []
