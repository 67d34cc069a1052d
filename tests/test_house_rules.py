"""The house rules of docs/authoring.md, each written as a check that fails on the next violation.

tests/test_structure.py holds the layout (rooms, budgets, arrows, back-links); this file holds
the rules a reviewer used to keep by reading: one precision -> dtype map, tables through
`course_lib.tables.table`, no verdict computed in a cell about a result the prose can state,
no code cell over 40 lines, and maps (course_lib/README.md, the chapter indexes, tooling's module
list, the README's Layout block) that say what is there. Each rule has a test that plants a violation and shows the
check catches it. tools/ calls the library and writes none of it again: no second AMP step, dtype
map or timer (its GPU studies moved into the chapters' recorders, issue 45).
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import nbformat
import pytest
from test_structure import (
    CHAPTER_HOMES,
    CHAPTER_MODULES,
    CORE,
    PKG,
    ROOT,
    chapter_of,
    cross_chapter_imports,
    module_name,
    rel,
)

LIBRARY = sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)
CHAPTER_NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))


def cell_tree(source: str) -> ast.Module:
    """A code cell's source as Python, its IPython magics and shell lines left out."""
    return ast.parse("\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines()))


def code_cells(path: Path):
    """(index, cell) of every code cell of a notebook."""
    for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
        if cell.cell_type == "code":
            yield i, cell


# --------------------------------------------------------------------------- one precision -> dtype map

# The one map is course_lib.device.AMP_DTYPES ({"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}).
PRECISION_DTYPES = {"fp32": {"float32", "float"}, "bf16": {"bfloat16"}, "fp16": {"float16", "half"}}


def retyped_dtype_maps(tree: ast.AST) -> list[str]:
    """Every dict (a literal or dict(...)) that maps a precision name to its torch dtype: AMP_DTYPES typed again."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            pairs = [(k.value, v) for k, v in zip(node.keys, node.values) if isinstance(k, ast.Constant)]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "dict":
            pairs = [(kw.arg, kw.value) for kw in node.keywords]
        else:
            continue
        if any(
            isinstance(v, ast.Attribute)
            and getattr(v.value, "id", None) == "torch"
            and v.attr in PRECISION_DTYPES.get(k, ())
            for k, v in pairs
        ):
            found.append(f"line {node.lineno}: {ast.unparse(node)[:80]}")
    return found


@pytest.mark.parametrize("path", [p for p in LIBRARY if p != PKG / "device.py"], ids=rel)
def test_the_library_types_the_precision_dtype_map_once(path):
    found = retyped_dtype_maps(ast.parse(path.read_text()))
    assert not found, f"{rel(path)} types the precision -> dtype map again; use course_lib.device.AMP_DTYPES: {found}"


@pytest.mark.parametrize("path", CHAPTER_NOTEBOOKS + SOLUTIONS, ids=rel)
def test_notebooks_use_the_one_precision_dtype_map(path):
    found = [f"cell {i}, {f}" for i, cell in code_cells(path) for f in retyped_dtype_maps(cell_tree(cell.source))]
    assert not found, f"{rel(path)} types the precision -> dtype map again; use AMP_DTYPES: {found}"


def test_the_dtype_map_check_catches_a_retyped_map():
    assert retyped_dtype_maps(ast.parse(open(PKG / "device.py").read())), "the one map itself is found"
    planted = ast.parse(
        'DTYPES = {"fp32": None, "bf16": torch.bfloat16}\n'
        "CAST = dict(fp16=torch.half)\n"
        'NAMES = {torch.bfloat16: "bf16"}\n'  # a dtype's short name: another map, allowed
        'FP8 = {"e4m3": torch.float8_e4m3fn}\n'
    )  # fp8 formats are not precisions of AMP
    assert [f.split(":")[0] for f in retyped_dtype_maps(planted)] == ["line 1", "line 2"]


# --------------------------------------------------------------------------- tools/ holds no second library

TOOLS = sorted((ROOT / "tools").glob("*.py"))
# The core holds each of these once: the AMP step (course_lib.train.amp_step: autocast around forward
# and loss, a GradScaler, backward), the precision -> dtype map (AMP_DTYPES) and the timer
# (course_lib.timing.time_fn: synchronized clocks, CUDA events). A script in tools/ calls them, or a
# chapter's recorder that does; time.monotonic for a whole run's wall time or a deadline is no timer.
AMP_STEP_NAMES = {"autocast", "GradScaler", "backward", "amp_train_step"}
TIMER_NAMES = {"Event", "elapsed_time", "synchronize", "perf_counter", "perf_counter_ns", "process_time"}


def second_library(tree: ast.AST) -> list[str]:
    """What a script writes again that the core holds once: an AMP step, a dtype map, a timer."""
    found = [f"{f.split(':')[0]}: the precision -> dtype map" for f in retyped_dtype_maps(tree)]
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, (ast.ImportFrom, ast.Import)):
            names = [a.name.rsplit(".", 1)[-1] for a in node.names]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = [node.name]
        for name in names:
            if name in AMP_STEP_NAMES:
                found.append(f"line {node.lineno}: an AMP step ({name}); use course_lib.train.amp_step")
            elif name in TIMER_NAMES:
                found.append(f"line {node.lineno}: a timer ({name}); use course_lib.timing.time_fn")
    return sorted(found, key=lambda f: int(f.split()[1].rstrip(":")))


@pytest.mark.parametrize("path", TOOLS, ids=rel)
def test_tools_write_no_second_amp_step_dtype_map_or_timer(path):
    found = second_library(ast.parse(path.read_text()))
    assert not found, f"{rel(path)} writes again what the core holds once: {found}"


def test_the_second_library_check_catches_a_step_a_map_and_a_timer():
    assert second_library(ast.parse((PKG / "train.py").read_text())), "the one AMP step itself is found"
    assert second_library(ast.parse((PKG / "timing.py").read_text())), "the one timer itself is found"
    planted = ast.parse(
        "import time\n"
        'DTYPES = {"fp32": None, "bf16": torch.bfloat16}\n'
        "def step():\n"
        "    with torch.autocast('cuda', dtype=torch.bfloat16):\n"
        "        loss = model(x)\n"
        "    scaler.scale(loss).backward()\n"
        "t0 = time.perf_counter()\n"
        "start = torch.cuda.Event(enable_timing=True)\n"
        "took = time.monotonic() - t0\n"  # a run's wall time: allowed
    )
    assert [f.split(":")[0] for f in second_library(planted)] == ["line 2", "line 4", "line 6", "line 7", "line 8"]


# --------------------------------------------------------------------------- tables through tables.table

FORMAT_WIDTH = re.compile(r"^(?:.?[<>^=])?[+\- ]?z?#?(?P<zero>0?)(?:\d+|\{)")  # a width, not zero padding


def padded_fields(node: ast.AST) -> list[ast.FormattedValue]:
    """The f-string fields under `node` padded to a width (`{x:<10}`, `{y:>9.2f}`, `{z:8}`)."""
    out = []
    for n in ast.walk(node):
        if isinstance(n, ast.FormattedValue) and n.format_spec is not None:
            spec = "".join(v.value if isinstance(v, ast.Constant) else "{" for v in n.format_spec.values)
            m = FORMAT_WIDTH.match(spec)
            if m and not m.group("zero"):
                out.append(n)
    return out


def hand_aligned_tables(tree: ast.AST) -> list[str]:
    """Statements that write a table's header by hand: two or more padded fields, one of them a literal
    heading (`f"{'mode':<22}{'ms/step':>9}"`), or a literal padded with ljust/rjust/center."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.stmt) or isinstance(
            node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.For, ast.While, ast.If, ast.With, ast.Try)
        ):
            continue
        fields = padded_fields(node)
        heading = any(isinstance(f.value, ast.Constant) and isinstance(f.value.value, str) for f in fields)
        justified = any(
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr in ("ljust", "rjust", "center")
            and isinstance(n.func.value, ast.Constant)
            for n in ast.walk(node)
        )
        if (len(fields) >= 2 and heading) or justified:
            found.append(f"line {node.lineno}: {ast.unparse(node)[:80]}")
    return found


TABLE_CODE = [p for p in CORE + CHAPTER_MODULES if p != PKG / "tables.py"]
# Left for now, each with its reason; the number only goes down. widgets.static_text: its table is
# converted once chapter 10 shares chapter 01's widget code (issue 45, item 4, edits that module now).
LIBRARY_TABLES_LEFT = {"course_lib/chapters/ch01/widgets.py": 1}


@pytest.mark.parametrize("path", TABLE_CODE, ids=rel)
def test_the_library_prints_tables_through_tables_table(path):
    found = hand_aligned_tables(ast.parse(path.read_text()))
    allowed = LIBRARY_TABLES_LEFT.get(rel(path), 0)
    assert len(found) <= allowed, f"{rel(path)} aligns a table by hand; use course_lib.tables.table: {found}"
    assert len(found) == allowed, f"{rel(path)} now has {len(found)} hand-aligned tables: lower LIBRARY_TABLES_LEFT"


# Notebook tables written by hand before the rule had a test: each notebook may keep at most this
# many, and the number only goes down (convert one to tables.table, then lower it here).
HAND_TABLES_LEFT = {
    "00_setup": 1,
    "01_formats": 9,
    "02_autocast": 4,
    "05_multiple": 2,
    "07_loading": 2,
    "09_capstone": 5,
}


def notebook_tables(path: Path) -> list[str]:
    return [f"cell {i}, {f}" for i, cell in code_cells(path) for f in hand_aligned_tables(cell_tree(cell.source))]


@pytest.mark.parametrize("path", CHAPTER_NOTEBOOKS + SOLUTIONS, ids=rel)
def test_notebooks_add_no_hand_aligned_table(path):
    found = notebook_tables(path)
    allowed = HAND_TABLES_LEFT.get(path.stem, 0) if path.parent.name == "notebooks" else 0
    assert len(found) <= allowed, (
        f"{rel(path)} aligns {len(found)} tables by hand ({allowed} left from before "
        f"the rule); print rows with course_lib.tables.table: {found}"
    )
    assert len(found) == allowed, f"{rel(path)} now has {len(found)} hand-aligned tables: lower HAND_TABLES_LEFT"


def test_the_table_check_catches_a_hand_aligned_header():
    planted = ast.parse(
        "out = [f\"{'mode':<22}{'ms/step':>9}\"]\n"  # a header by hand
        'out.append(f"{mode:<22}{ms:>9.2f}")\n'  # its rows: found by the header
        'line = "model".ljust(10) + "GiB"\n'  # a heading padded with ljust
        'say(f"step {step:>3}/{total} loss {loss:.3f}")\n'  # one padded number: not a table
        'bits = f"{code:08b} {name}: {value:.2f}"\n'
    )  # zero padding: not a table
    assert [f.split(":")[0] for f in hand_aligned_tables(planted)] == ["line 1", "line 3"]


# --------------------------------------------------------------------------- cells end on numbers

# A verdict is a judgement word chosen in code (`'within' if d <= tol else 'OUTSIDE'`). docs/authoring.md:
# a cell prints the numbers and the markdown after it says what they mean; only a cell whose result
# depends on the machine (a timing, a core count, the CPU's flags), which the prose cannot know, prints
# its reading from the numbers, and it carries the cell tag `machine-reading`.
READING_TAG = "machine-reading"
VERDICT = re.compile(
    r"\b(within|outside|same|different|differs?|identical|equal|present|missing|fits?|fed|nothing|something|"
    r"above|below|faster|slower|fast|slow|pass(?:ed|es)?|fail(?:ed|s)?|ok|good|bad|yes|correct|wrong|"
    r"match(?:es)?|agrees?|better|worse|safe|unsafe|grows?|stale|saturates?|brought back|did not|does not|is not)\b"
    r"|\bNOT\b",
    re.I,
)


def _literal_text(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return " ".join(v.value for v in node.values if isinstance(v, ast.Constant))
    return None


def computed_verdicts(tree: ast.AST) -> list[str]:
    """Conditional expressions that choose between two texts, at least one of them a verdict word."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.IfExp):
            texts = [_literal_text(node.body), _literal_text(node.orelse)]
            if None not in texts and any(VERDICT.search(t) for t in texts):
                found.append(ast.unparse(node)[:90])
    return found


@pytest.mark.parametrize("path", CHAPTER_NOTEBOOKS, ids=rel)
def test_cells_leave_the_verdict_to_the_prose(path):
    found, stale = [], []
    for i, cell in code_cells(path):
        verdicts = computed_verdicts(cell_tree(cell.source))
        if READING_TAG in cell.metadata.get("tags", []):
            stale += [] if verdicts else [f"cell {i}"]
        else:
            found += [f"cell {i}: {v}" for v in verdicts]
    assert not found, (
        f"{rel(path)} computes verdict words in code: print the numbers and say what they mean "
        f"in the markdown (or tag a cell that reads a machine-dependent result {READING_TAG!r}): "
        f"{found}"
    )
    assert not stale, f"{rel(path)}: cells tagged {READING_TAG!r} that choose no words from numbers: {stale}"


def test_the_verdict_check_catches_a_verdict_and_lets_labels_pass():
    planted = ast.parse(
        "print(f\"{d:.1e}: {'within' if d <= TOLERANCE else 'OUTSIDE'} the tolerance\")\n"
        "print('PASS' if ok else 'FAIL')\n"
        "print(f\"{'the same' if a == b else 'different'} bits\")\n"
        "label = 'fp32' if how == 'fp32 acc' else fmt\n"  # a label, not a verdict
        "when = f'step {k}' if stepped else 'never applied'\n"  # a value or its absence
        'doc = text if start >= 0 else "(not in this torch\'s docstring)"\n'
    )
    assert sorted(computed_verdicts(planted)) == [
        "'PASS' if ok else 'FAIL'",
        "'the same' if a == b else 'different'",
        "'within' if d <= TOLERANCE else 'OUTSIDE'",
    ]


# --------------------------------------------------------------------------- cells short enough to read

# docs/style.md: a cell longer than about 25 lines is usually two ideas; past 40 it is always too
# long. The machinery moves into the chapter's home and the lesson stays in the cell (chapter 08's
# launcher: the lesson whole, the instruments outside); a table's cases are rows of data.
CELL_LINES = 40


def long_cells(path: Path) -> list[str]:
    """Every code cell of a notebook whose source has more than CELL_LINES lines, blank ones counted."""
    found = []
    for i, cell in code_cells(path):
        lines = len(cell.source.splitlines())
        if lines > CELL_LINES:
            found.append(f"cell {i} ({cell.get('id', 'no id')}): {lines} lines")
    return found


@pytest.mark.parametrize("path", CHAPTER_NOTEBOOKS, ids=rel)
def test_no_code_cell_is_over_40_lines(path):
    found = long_cells(path)
    assert not found, (
        f"{rel(path)} has code cells over {CELL_LINES} lines: move the machinery into the chapter's "
        f"home and keep the lesson in the cell (docs/style.md): {found}"
    )


def test_the_cell_length_check_catches_a_long_cell(tmp_path):
    planted = nbformat.v4.new_notebook()
    planted.cells = [
        nbformat.v4.new_markdown_cell("\n".join(["prose"] * 60)),  # markdown: not a code cell
        nbformat.v4.new_code_cell("\n".join(f"x{k} = {k}" for k in range(CELL_LINES))),  # at the limit
        nbformat.v4.new_code_cell("\n".join(f"x{k} = {k}" for k in range(CELL_LINES + 1))),  # one over
        nbformat.v4.new_code_cell("\n" * (CELL_LINES + 5) + "x = 1"),  # blank lines count too
    ]
    path = tmp_path / "99_planted.ipynb"
    nbformat.write(planted, path)
    assert [f.split(" (")[0] for f in long_cells(path)] == ["cell 2", "cell 3"]


# --------------------------------------------------------------------------- the maps are true


def chapter_index(init: Path) -> list[str]:
    """The modules a chapter home's __init__ docstring lists (`- name.py: what it holds`)."""
    return re.findall(r"^- (\w+\.py):", ast.get_docstring(ast.parse(init.read_text())) or "", re.M)


@pytest.mark.parametrize("home", CHAPTER_HOMES, ids=rel)
def test_each_chapter_index_lists_the_modules_of_its_home(home):
    modules = sorted(p.name for p in home.glob("*.py") if p.name != "__init__.py")
    assert sorted(chapter_index(home / "__init__.py")) == modules, f"{rel(home)}/__init__.py lists other modules"


def test_the_chapter_index_check_reads_the_list(tmp_path):
    fake = tmp_path / "__init__.py"
    fake.write_text('"""Chapter 97.\n\n- growing.py: a model.\n- ladder.py: the ladder, with\n  two lines.\n"""\n')
    assert chapter_index(fake) == ["growing.py", "ladder.py"]


def tooling_listing(text: str) -> set[str]:
    """The names tooling/__init__'s docstring lists: each line's first word, and `; name:` within a line."""
    doc = ast.get_docstring(ast.parse(text)) or ""
    block = doc.split("(the Makefile wraps each command):", 1)[-1]
    return set(re.findall(r"^  (\w+/?)", block, re.M)) | set(re.findall(r"; (\w+/?):", block))


def test_the_tooling_list_names_every_module_and_package_of_tooling():
    tooling = PKG / "tooling"
    there = {p.stem for p in tooling.glob("*.py") if p.name != "__init__.py"}
    there |= {f"{p.name}/" for p in tooling.iterdir() if (p / "__init__.py").exists()}
    assert tooling_listing((tooling / "__init__.py").read_text()) == there


def test_the_tooling_list_check_reads_first_words_and_inline_names():
    text = (
        '"""Tooling.\n\nEverything else (the Makefile wraps each command):\n  grader/   the judging side\n'
        '  lab       make lab; notebook_filter: the git filter\n"""\n'
    )
    assert tooling_listing(text) == {"grader/", "lab", "notebook_filter"}


NUMBER_WORDS = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen".split()


def map_arrows(text: str) -> tuple[int | None, set[tuple[int, int]]]:
    """The arrows between chapter homes course_lib/README.md states: its count in words and each `NN → MM`."""
    m = re.search(r"\b(\w+) arrows join the homes", text)
    count = NUMBER_WORDS.index(m.group(1).lower()) if m and m.group(1).lower() in NUMBER_WORDS else None
    section = text.split("arrows join the homes", 1)[-1].split("\n\n", 1)[0]
    return count, {(int(a), int(b)) for a, b in re.findall(r"\b(\d\d) → (\d\d)\b", section)}


def test_the_map_counts_and_names_the_arrows_between_chapter_homes():
    arrows = {(chapter_of(module_name(p)), nn) for p in CHAPTER_MODULES for nn, _ in cross_chapter_imports(p)}
    count, named = map_arrows((PKG / "README.md").read_text())
    assert named == arrows, (
        f"course_lib/README.md names {sorted(named - arrows)} not there, misses {sorted(arrows - named)}"
    )
    assert count == len(arrows), (
        f"course_lib/README.md counts {count} arrows between the homes; there are {len(arrows)}"
    )


def test_the_arrow_check_reads_the_count_and_the_pairs():
    text = "Nine arrows join the homes, all pointing back: 01 → 00 and 02 → 00 (tf32), 09 → 01.\n\nNext."
    assert map_arrows(text) == (9, {(1, 0), (2, 0), (9, 1)})


def core_map_names(text: str) -> dict[str, list[str]]:
    """{module file: the names in backticks} of the core table of course_lib/README.md."""
    section = text.split("## The core", 1)[1].split("\n## ", 1)[0]
    out = {}
    for file, said in re.findall(r"^\| \[`(\w+\.py)`\]\(\S+\) \| [^|]* \| (.*) \|$", section, re.M):
        out[file] = [m.group(1) for m in re.finditer(r"`([A-Za-z_]\w*)(?:\(.*?\))?`", said)]
    return out


def test_the_core_map_names_only_what_each_module_holds():
    missing = []
    for file, names in core_map_names((PKG / "README.md").read_text()).items():
        module = importlib.import_module(f"course_lib.{file[:-3]}")
        missing += [f"{file}: {n}" for n in names if not hasattr(module, n)]
    assert not missing, f"course_lib/README.md's core table names what its module does not hold: {missing}"


def test_the_core_map_check_reads_names_in_backticks():
    text = (
        "## The core\n\n| module | introduced in | read it for |\n|---|---|---|\n"
        "| [`device.py`](device.py) | 00 | the policy (`recommend_precision`), the switch (`tf32`) |\n"
        "| [`tables.py`](tables.py) | 00 | `table(rows, columns)`: the one way, `enabled=` |\n\n## Next\n"
    )
    assert core_map_names(text) == {"device.py": ["recommend_precision", "tf32"], "tables.py": ["table"]}


def layout_block(text: str) -> dict[str, str]:
    """The README's Layout block: {top-level entry: what it says, continuation lines included}."""
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    out, key = {}, None
    for line in block.splitlines():
        m = re.match(r"^(\S+/)\s+(.*)", line)
        if m:
            key = m.group(1)
            out[key] = m.group(2)
        elif key:
            out[key] += " " + line.strip()
    return out


def test_the_readme_layout_names_the_core_the_docs_and_the_tools():
    layout = layout_block((ROOT / "README.md").read_text())
    core = re.search(r"\*\.py\s+the core a learner reads first: ((?:\w+, )*\w+)", layout["course_lib/"])
    assert core and sorted(core.group(1).split(", ")) == sorted(p.stem for p in CORE), "the Layout block's core"
    for folder in ("docs/", "tools/"):
        files = sorted(p.name for p in (ROOT / folder).iterdir() if p.is_file())
        unnamed = [f for f in files if not re.search(rf"(?<![\w-]){re.escape(f)}\b", layout[folder])]
        assert not unnamed, f"the README's Layout block does not name {unnamed} in {folder}"
        gone = [f for f in re.findall(r"[\w-]+\.(?:py|sh|md)\b", layout[folder]) if f not in files]
        assert not gone, f"the README's Layout block names {gone} in {folder}, which it does not hold"


def test_the_layout_check_reads_the_block(monkeypatch):
    text = "## Layout\n\n```\ndocs/         gpu.md: the GPU tier,\n              and more\ntools/        a.sh\n```\n"
    assert layout_block(text) == {"docs/": "gpu.md: the GPU tier, and more", "tools/": "a.sh"}
    readme = (ROOT / "README.md").read_text()
    stale = readme.replace("style.md", "styles.md")
    real_read = Path.read_text
    monkeypatch.setattr(
        Path, "read_text", lambda self, *a, **k: stale if self == ROOT / "README.md" else real_read(self, *a, **k)
    )
    with pytest.raises(AssertionError, match="style.md"):  # a file of docs/ the block no longer names
        test_the_readme_layout_names_the_core_the_docs_and_the_tools()
    monkeypatch.setattr(
        Path,
        "read_text",
        lambda self, *a, **k: (
            readme.replace("celltimes.py:", "celltimes.py, gone.py:")
            if self == ROOT / "README.md"
            else real_read(self, *a, **k)
        ),
    )
    with pytest.raises(AssertionError, match="gone.py"):  # a file named that tools/ does not hold
        test_the_readme_layout_names_the_core_the_docs_and_the_tools()
