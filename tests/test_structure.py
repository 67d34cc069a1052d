"""The shape of course_lib: three rooms, small, one import direction, and back-links that are true.

The core (course_lib/*.py) is what a learner reads; chapters/chNN/ holds what chapter NN teaches
(one home per chapter, named like its notebook, check and probe); tooling/ is for instructors and
authors. See course_lib/README.md for the map.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "course_lib"
CORE = sorted(p for p in PKG.glob("*.py") if not p.name.startswith("_"))  # the core a learner reads
# Plumbing the core needs but a learner need not read (where the raw images come from): private
# modules beside the core, each within a core module's budget, imported by the core alone.
PLUMBING = sorted(p for p in PKG.glob("_*.py") if p.name != "__init__.py")
CHAPTER_HOMES = sorted(p for p in (PKG / "chapters").iterdir() if p.is_dir() and p.name != "__pycache__")
CHAPTER_MODULES = sorted(p for p in (PKG / "chapters").rglob("*.py") if p.name != "__init__.py")
CHAPTER_INITS = sorted((PKG / "chapters").rglob("__init__.py"))
TOOLING = sorted((PKG / "tooling").rglob("*.py"))
CORE_BUDGET, CORE_MODULE_BUDGET, CHAPTER_MODULE_BUDGET = 1500, 400, 450
TAG = re.compile(r"^Chapters? ((?:\d{2}(?:, | and )?)+):")


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room(name: str) -> str:
    if name.startswith("course_lib.tooling"):
        return "tooling"
    if name.startswith("course_lib.chapters"):
        return "chapters"
    return "core"


def test_the_rooms_exist_and_the_core_is_what_the_map_says():
    core = ["device", "data", "loaders", "models", "train", "timing", "tables", "reference"]
    assert [p.stem for p in CORE] == sorted(core)
    assert [p.stem for p in PLUMBING] == ["_provenance", "_sources"]
    assert CHAPTER_MODULES and TOOLING


@pytest.mark.parametrize("path", PLUMBING, ids=rel)
def test_plumbing_is_small_private_and_used_by_the_core_alone(path):
    assert lines(path) <= CORE_MODULE_BUDGET, f"{rel(path)} has {lines(path)} lines > {CORE_MODULE_BUDGET}"
    assert public_names(path) == [], f"{rel(path)} is plumbing: nothing in it is for notebooks (__all__ = [])"
    users = [rel(p) for p in CHAPTER_MODULES + TOOLING if module_name(path) in imported_modules(p)]
    assert not users, f"only the core may import {rel(path)}: {users}"
    assert any(module_name(path) in imported_modules(p) for p in CORE), f"no core module imports {rel(path)}"


# --------------------------------------------------------------------------- budgets


def test_core_fits_its_line_budget():
    sizes = {rel(p): lines(p) for p in CORE}
    too_big = {k: v for k, v in sizes.items() if v > CORE_MODULE_BUDGET}
    assert not too_big, f"core modules over {CORE_MODULE_BUDGET} lines: {too_big}"
    assert sum(sizes.values()) <= CORE_BUDGET, f"the core has {sum(sizes.values())} lines > {CORE_BUDGET}: {sizes}"


@pytest.mark.parametrize("path", CHAPTER_MODULES, ids=rel)
def test_chapter_module_fits_its_line_budget(path):
    assert lines(path) <= CHAPTER_MODULE_BUDGET, f"{rel(path)} has {lines(path)} lines > {CHAPTER_MODULE_BUDGET}"


def formatted_lines(path: Path) -> int:
    """Lines of `path` as `ruff format` writes it: the budgets count readable code, not squeezed code."""
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--stdin-filename", str(path), "-"],
        input=path.read_text(),
        capture_output=True,
        text=True,
        check=True,
    )
    return len(done.stdout.splitlines())


def not_yet_formatted() -> list[str]:
    """[tool.ruff.format] exclude in pyproject.toml: the modules still to be split before they are formatted."""
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"\[tool\.ruff\.format\].*?exclude = \[(.*?)\]", text, re.S)
    return re.findall(r'"([^"]+)"', block.group(1)) if block else []


def test_only_modules_that_would_break_a_budget_once_formatted_are_left_unformatted():
    # `make test` runs `ruff format --check course_lib`: every other module is formatted, so the
    # budgets above count formatted code. A module on the list leaves it once it has been split.
    core_total = sum(lines(p) for p in CORE)
    fits = []
    for name in not_yet_formatted():
        path = ROOT / name
        assert path.exists(), f"{name} is listed in [tool.ruff.format] exclude but does not exist"
        n = formatted_lines(path)
        if path in CORE:
            over = n > CORE_MODULE_BUDGET or core_total - lines(path) + n > CORE_BUDGET
        else:
            over = n > (CHAPTER_MODULE_BUDGET if path in CHAPTER_MODULES else float("inf"))
        if not over:
            fits.append(f"{name} ({n} lines formatted)")
    assert not fits, f"these fit their budget once formatted: run `ruff format` on them and unlist them: {fits}"


# --------------------------------------------------------------------------- imports


def imported_modules(path: Path) -> set[str]:
    """Every course_lib module this file imports, at the top or inside a function."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("course_lib")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("course_lib"):
                # `from ..chapters import formats` imports the module course_lib.chapters.ch01.formats
                subs = [f"{target}.{a.name}" for a in node.names]
                out |= {
                    s
                    for s in subs
                    if (ROOT / (s.replace(".", "/") + ".py")).exists()
                    or (ROOT / s.replace(".", "/") / "__init__.py").exists()
                } or {target}
    return out - {name}


ALL_MODULES = CORE + PLUMBING + CHAPTER_MODULES + CHAPTER_INITS + TOOLING


@pytest.mark.parametrize("path", ALL_MODULES, ids=rel)
def test_imports_run_core_then_chapters_then_tooling(path):
    order = {"core": 0, "chapters": 1, "tooling": 2}
    mine = room(module_name(path))
    upward = sorted(m for m in imported_modules(path) if order[room(m)] > order[mine])
    assert not upward, f"{rel(path)} ({mine}) imports {upward}: imports must run core <- chapters <- tooling"


def test_there_are_no_import_cycles():
    graph = {module_name(p): {m for m in imported_modules(p) if m != "course_lib"} for p in ALL_MODULES}
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                raise AssertionError(
                    "import cycle: " + " -> ".join(stack[stack.index(nxt) :] + [node, nxt])
                    if nxt in stack
                    else f"import cycle through {node} -> {nxt}"
                )
            if nxt not in state:
                visit(nxt, stack + [node])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [])


@pytest.mark.parametrize("path", ALL_MODULES, ids=rel)
def test_every_module_declares_its_public_names(path):
    tree = ast.parse(path.read_text())
    targets = [t for n in tree.body if isinstance(n, ast.Assign) for t in n.targets]
    targets += [n.target for n in tree.body if isinstance(n, ast.AnnAssign)]
    assert any(getattr(t, "id", None) == "__all__" for t in targets), f"{rel(path)} has no __all__"


def chapter_of(name: str) -> int | None:
    """45 for course_lib.chapters.ch45.anything; None outside the chapter homes."""
    m = re.match(r"course_lib\.chapters\.ch(\d{2})\b", name)
    return int(m.group(1)) if m else None


def test_every_chapter_has_one_home_named_like_its_notebook_check_and_probe():
    notebooks = sorted(p.name[:2] for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert [p.name for p in CHAPTER_HOMES] == [f"ch{nn}" for nn in notebooks], "one chapters/chNN/ per notebook"
    loose = [p.name for p in (PKG / "chapters").glob("*.py") if p.name != "__init__.py"]
    assert not loose, f"chapter code outside a chapter home: {loose}"
    for home in CHAPTER_HOMES:
        assert (home / "__init__.py").exists(), f"{rel(home)} is not a package"
        for room_ in ("checks", "probes"):
            assert (PKG / "tooling" / room_ / f"{home.name}.py").exists(), f"no tooling/{room_}/{home.name}.py"


def cross_chapter_imports(path: Path) -> list[tuple[int, str]]:
    """(chapter, module) of every module of another chapter home that this file imports."""
    mine = chapter_of(module_name(path))
    return sorted(
        {(chapter_of(m), m) for m in imported_modules(path) if chapter_of(m) is not None and chapter_of(m) != mine}
    )


@pytest.mark.parametrize("path", CHAPTER_MODULES + CHAPTER_INITS, ids=rel)
def test_a_chapter_home_imports_only_the_core_and_earlier_chapters(path):
    mine = chapter_of(module_name(path))
    forward = [m for nn, m in cross_chapter_imports(path) if nn > mine]
    assert not forward, f"{rel(path)} (chapter {mine:02d}) imports later chapters: {forward}"


def private_names_imported(path: Path) -> list[str]:
    """`module:_name` for each private name this file imports from another module of course_lib."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            if target.startswith("course_lib"):
                out += [f"{target}:{a.name}" for a in node.names if a.name.startswith("_")]
    return out


@pytest.mark.parametrize("path", CORE + CHAPTER_MODULES, ids=rel)
def test_no_private_name_crosses_a_chapter_home_or_leaves_the_core(path):
    # Inside one chapter's home, modules may share private helpers: they are one idea in one place.
    mine = chapter_of(module_name(path))
    plumbing = {f"course_lib:{p.stem}" for p in PLUMBING} if path in CORE else set()  # the core's own plumbing
    crossing = [p for p in private_names_imported(path) if mine is None or chapter_of(p.split(":")[0]) != mine]
    crossing = [p for p in crossing if p not in plumbing]
    assert not crossing, f"{rel(path)} imports private names from elsewhere: {crossing}"


def test_the_direction_check_catches_a_forward_import_and_a_private_name(monkeypatch):
    fake = PKG / "chapters" / "ch01" / "fake_for_test.py"  # never written: the checks read it through read_text
    source = "from course_lib.chapters.ch05.doctor import diagnose\nfrom course_lib.train import _private\n"
    real_read = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: source if self == fake else real_read(self, *a, **k))
    assert [m for _, m in cross_chapter_imports(fake)] == ["course_lib.chapters.ch05.doctor"]
    assert private_names_imported(fake) == ["course_lib.train:_private"]


def test_chapter_homes_form_few_arrows_and_all_point_back():
    arrows = {(chapter_of(module_name(p)), nn) for p in CHAPTER_MODULES for nn, _ in cross_chapter_imports(p)}
    assert all(theirs < mine for mine, theirs in arrows)
    # 11 today: chapter 10 gathers the memory walks of chapters 02 (the MLP) and 04 (SimpleCNN)
    assert len(arrows) <= 12, f"{len(arrows)} arrows between chapter homes: does something shared belong in the core?"


CHAPTER_NOTEBOOKS = sorted(p for d in ("notebooks", "solutions", "exercises") for p in (ROOT / d).glob("[0-9][0-9]_*"))


@pytest.mark.parametrize("path", CHAPTER_NOTEBOOKS, ids=rel)
def test_a_notebook_imports_its_own_chapter_home_or_earlier_ones(path):
    nn = int(path.name[:2])
    later = sorted(i for i in notebook_imports(path) if (chapter_of(i.split(":")[0]) or 0) > nn)
    assert not later, f"{rel(path)} (chapter {nn:02d}) imports code of later chapters: {later}"


# --------------------------------------------------------------------------- chapter back-links


@cache
def chapter_sources(nn: str) -> tuple[str, str] | None:
    """(code, markdown) of chapter nn's notebook, solution and exercise; None if it has none."""
    paths = [p for d in ("notebooks", "solutions", "exercises") for p in (ROOT / d).glob(f"{nn}_*.ipynb")]
    if not paths:
        return None
    cells = [c for p in paths for c in nbformat.read(p, as_version=4).cells]
    return (
        "\n".join(c.source for c in cells if c.cell_type == "code"),
        "\n".join(c.source for c in cells if c.cell_type == "markdown"),
    )


def uses(nn: str, name: str) -> bool:
    code, markdown = chapter_sources(nn)
    return bool(re.search(rf"\b{re.escape(name)}\b", code) or re.search(rf"`[\w.]*\b{re.escape(name)}[`(.]", markdown))


def documented(path: Path):
    """(qualified name, docstring) of every function and class, and every method of a class."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            yield node.name, ast.get_docstring(node) or ""
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, ast.FunctionDef):
                        yield f"{node.name}.{sub.name}", ast.get_docstring(sub) or ""


def public_names(path: Path) -> list[str]:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return []


def false_tags(path: Path) -> list[str]:
    wrong = []
    for qualname, doc in documented(path):
        m = TAG.match(doc)
        if not m:
            continue
        name = qualname.rsplit(".", 1)[-1]
        for nn in re.findall(r"\d{2}", m.group(1)):
            if chapter_sources(nn) is None:
                wrong.append(f"{qualname}: tagged Chapter {nn}, which has no notebook yet")
            elif not uses(nn, name):
                wrong.append(f"{qualname}: tagged Chapter {nn}, whose notebooks never use `{name}`")
    return wrong


@pytest.mark.parametrize("path", CHAPTER_MODULES, ids=rel)
def test_a_chapter_home_holds_what_its_chapter_introduces(path):
    # The first chapter a docstring names is where the name is introduced: its home is that chapter's.
    mine = chapter_of(module_name(path))
    docs = dict(documented(path))
    elsewhere = [
        f"{n} (Chapter {TAG.match(docs[n]).group(1)[:2]})"
        for n in public_names(path)
        if n in docs and TAG.match(docs[n]) and int(TAG.match(docs[n]).group(1)[:2]) != mine
    ]
    assert not elsewhere, f"{rel(path)} is chapter {mine:02d}'s home but holds what others introduce: {elsewhere}"


@pytest.mark.parametrize("path", CORE + CHAPTER_MODULES, ids=rel)
def test_chapter_tags_name_a_chapter_that_uses_the_name(path):
    wrong = false_tags(path)
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("path", CORE + CHAPTER_MODULES, ids=rel)
def test_every_public_function_and_class_names_its_chapter(path):
    docs = dict(documented(path))
    untagged = [n for n in public_names(path) if n in docs and not TAG.match(docs[n])]
    assert not untagged, f"{rel(path)}: public names without a 'Chapter NN:' docstring tag: {untagged}"


@pytest.mark.parametrize("path", TOOLING, ids=rel)
def test_tooling_carries_no_chapter_tags(path):
    tagged = [q for q, doc in documented(path) if TAG.match(doc)]
    assert not tagged, f"{rel(path)} is tooling, not chapter material, but tags {tagged}"


def test_the_back_link_check_catches_false_and_dangling_tags(tmp_path):
    fake = tmp_path / "fake.py"
    fake.write_text(
        '__all__ = ["decompose", "nowhere_used"]\n\n'
        'def decompose():\n    """Chapter 01: really used there."""\n\n\n'
        'def nowhere_used():\n    """Chapters 01, 02: used in neither."""\n\n\n'
        'class Later:\n    def method(self):\n        """Chapter 97: a chapter that does not exist."""\n'
    )
    assert false_tags(fake) == [
        "nowhere_used: tagged Chapter 01, whose notebooks never use `nowhere_used`",
        "nowhere_used: tagged Chapter 02, whose notebooks never use `nowhere_used`",
        "Later.method: tagged Chapter 97, which has no notebook yet",
    ]


# --------------------------------------------------------------------------- learners' view

IMPORT = re.compile(r"^\s*(?:from\s+(course_lib[\w.]*)\s+import\s+([\w, ()]+)|import\s+(course_lib[\w.]*))", re.M)


def notebook_imports(path: Path) -> set[str]:
    """'module' for `import module`, 'module:name' for `from module import name`."""
    out = set()
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type == "code":
            for module, names, plain in IMPORT.findall(cell.source):
                out |= {plain} if plain else {f"{module}:{n.strip()}" for n in names.strip("() ").split(",")}
    return out


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=rel)
def test_teaching_notebooks_never_import_tooling(path):
    assert not [i for i in notebook_imports(path) if i.startswith("course_lib.tooling")]


@pytest.mark.parametrize(
    "path", sorted([*(ROOT / "solutions").glob("*.ipynb"), *(ROOT / "exercises").glob("*.ipynb")]), ids=rel
)
def test_exercises_take_exactly_one_name_from_tooling(path):
    tooling = {i for i in notebook_imports(path) if i.startswith("course_lib.tooling")}
    assert tooling == {"course_lib.tooling:check"}


def test_the_map_lists_every_module_and_only_existing_ones():
    text = (PKG / "README.md").read_text()
    listed = set(re.findall(r"\[`([\w/]+\.py|[\w/]+/)`\]", text))
    modules = {p.relative_to(PKG).as_posix() for p in CORE + PLUMBING + CHAPTER_MODULES}
    modules |= {p.relative_to(PKG).as_posix() for p in (PKG / "tooling").glob("*.py") if p.name != "__init__.py"}
    modules |= {"tooling/checks/", "tooling/probes/", "tooling/grader/"}
    assert listed == modules


def test_no_tracked_file_points_outside_the_repository():
    sibling = "../" + "shared"  # spelled in two pieces so that this file does not match itself
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    outside = [f for f in files if not f.endswith(".npz") and sibling in (ROOT / f).read_text(errors="ignore")]
    assert not outside, f"these files point at {sibling}, which a clone does not have: {outside}"
