"""Which statements of a notebook a task needs, read from its source in the judge's own process.

A task is judged by running its functions in a fresh process (course_lib/tooling/task.py) that
holds only what they need of the notebook: every top-level statement that defines a name they use,
or changes the object a name they use holds, found by following names, in notebook order. So

    import torch                          runs if the function uses torch
    LIMIT = 3.0                           runs if the function (or a statement it needs) reads LIMIT
    CFG["lr"] = 0.1 / CFG.update(...)     runs if CFG is needed (it changes what CFG holds)
    fill(TABLE)                           runs if TABLE is needed (a call may change its arguments)
    setup()                               runs if setup() binds (`global`) or changes a needed name
    !nvidia-smi, %pip install, plots      do not run: nothing the function uses comes from them

A learner needs to know one thing, and the inline check says it on a failure: a task's function
may use anything the notebook defines, but a file written or a setting changed by a cell whose
names it does not use is not there when it is judged.

Cells are read as IPython runs them (magics and shell lines become `get_ipython()` calls, which do
nothing in a task process; the body of a `%%time` or `%%capture` cell is the cell's code). What the
reading notices and nobody is graded for goes to the instructor's notes: shell lines and magics
(habits), cells that are not Python, and, in what a task runs, code that reaches into the
interpreter (frames, `gc`, `ctypes`, computed imports), which could tamper with an instrumented task.
"""

from __future__ import annotations

import ast
import builtins
import re
from dataclasses import dataclass, field

__all__ = ["Note", "Statement", "Notebook", "Slice", "read", "needed", "stub_tasks", "as_python"]

STUB_MESSAGE = "Exercise"  # the stub raises NotImplementedError("Exercise: write your solution here")
BODY_MAGICS = {"time", "timeit", "capture", "prun"}  # cell magics whose body is the cell's Python
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
# Worth a look in the code a task runs (a note for the instructor, never a grade).
DIGGING_NAMES = {"eval", "exec", "compile", "__import__", "globals", "vars", "locals", "breakpoint"}
DIGGING_ATTRIBUTES = {
    "f_back", "f_locals", "f_globals", "f_builtins", "f_code", "f_trace", "tb_frame", "gi_frame", "cr_frame",
    "__globals__", "__code__", "__closure__", "__builtins__", "__subclasses__", "cell_contents", "currentframe",
    "__self__",
}  # fmt: skip
DIGGING_SYS = {"_getframe", "_current_frames", "settrace", "setprofile", "meta_path", "modules", "path_hooks"}
DIGGING_MODULES = {"gc", "ctypes", "_ctypes", "builtins", "marshal"}
# Calls that only read the names passed to them: they change nothing a task needs.
READ_ONLY_CALLS = {
    "print", "len", "repr", "str", "int", "float", "bool", "list", "tuple", "dict", "set", "frozenset", "sorted",
    "sum", "min", "max", "abs", "round", "isinstance", "issubclass", "type", "id", "hash", "range", "enumerate",
    "zip", "any", "all", "format", "display", "hex", "bin", "oct", "ord", "chr", "divmod", "pow", "callable",
    "hasattr", "dir", "help", "check",
}  # fmt: skip


@dataclass(frozen=True)
class Note:
    """Something the reading noticed, at a 1-based code cell and line."""

    cell: int
    line: int
    what: str

    def __str__(self) -> str:
        return f"cell {self.cell}, line {self.line}: {self.what}"


@dataclass(eq=False)
class Statement:
    """One top-level statement of a code cell and the names it touches."""

    cell: int  # 1-based code cell
    index: int  # its place among the cell's top-level statements
    line: int
    node: ast.stmt
    binds: set[str] = field(default_factory=set)  # global names it (re)binds
    uses: set[str] = field(default_factory=set)  # global names it reads as it runs
    later: set[str] = field(default_factory=set)  # global names the functions it defines read when called
    changes: set[str] = field(default_factory=set)  # global names whose objects it may change in place
    called: set[str] = field(default_factory=set)  # names it calls a method of (`x.append(1)`)
    passed: set[str] = field(default_factory=set)  # names it passes bare to a call (`fill(x)`)
    inline_check: bool = False  # `check("NN.task", fn)`: the learner's own look, never needed
    star: bool = False  # `from m import *`


@dataclass
class Notebook:
    """A notebook's code cells, read as IPython runs them."""

    python: list[str | None]  # each code cell as Python; None where it is not Python
    statements: list[Statement]
    habits: list[Note]  # shell lines, magics, cells that are not Python
    effects: dict[str, set[str]]  # a notebook function or class -> globals it binds or changes when called

    def binders(self, name: str) -> list[Statement]:
        return [s for s in self.statements if name in s.binds]


@dataclass
class Slice:
    """What a task's functions need of a notebook: statements in notebook order, and names no statement defines."""

    statements: list[Statement]
    missing: list[str]

    def request(self, nb: Notebook) -> dict:
        """What the task process is sent: the cells involved as Python, and which statements of them to run."""
        cells = sorted({s.cell for s in self.statements})
        return {
            "cells": {str(n): nb.python[n - 1] for n in cells},
            "statements": [[s.cell, s.index] for s in self.statements],
        }

    def cells(self) -> list[int]:
        return sorted({s.cell for s in self.statements})

    def digging(self) -> list[Note]:
        """Code in these statements that reaches into the interpreter: worth an instructor's look."""
        return [note for s in self.statements for note in _digging(s)]


# --------------------------------------------------------------------------- reading cells


def as_python(cell: int, source: str) -> tuple[str | None, list[Note]]:
    """The cell as Python (IPython's own transformation), and the habits it shows; None if it is not Python."""
    notes = []
    lines = source.splitlines()
    for i, line in enumerate(lines, 1):
        text = line.strip()
        if text.startswith(("!", "%")) or re.match(r"^[\w\s,]*=\s*[!%]", text) or re.search(r"\w\?{1,2}$", text):
            notes.append(Note(cell, i, f"`{text[:60]}`"))
    first = lines[0].strip() if lines else ""
    if first.startswith("%%"):
        magic = first[2:].split()[0] if len(first) > 2 else ""
        if magic not in BODY_MAGICS:
            notes.append(Note(cell, 1, f"a %%{magic} cell, not Python: nothing of it runs when a task is judged"))
            return None, notes
        source = "\n".join(["# " + lines[0], *lines[1:]])  # the body, on its own lines
    source = re.sub(r"(?m)^(\s*)%time\s+(?=\S)", r"\1", source)  # `%time x = f()` binds x
    try:
        from IPython.core.inputtransformer2 import TransformerManager

        python = TransformerManager().transform_cell(source)
    except ImportError:  # no IPython here: its syntax blanked
        python = re.sub(r"(?m)^(\s*)[!%].*$", r"\1pass", source)
    except Exception:  # noqa: BLE001  text IPython's transformer cannot read: Python cannot either
        python = source
    try:
        ast.parse(python)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        notes.append(Note(cell, 1, "a cell that is not Python: nothing of it runs when a task is judged"))
        return None, notes
    return python, notes


def read(cells: list[str]) -> Notebook:
    """Read code cells (as typed) in order: what each top-level statement binds, uses and changes."""
    python, habits, statements = [], [], []
    for n, source in enumerate(cells, 1):
        code, notes = as_python(n, source)
        python.append(code)
        habits += notes
        if code is None:
            continue
        try:
            tree = ast.parse(code)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue
        for index, node in enumerate(tree.body):
            statements.append(_statement(n, index, node))
    imported = {name for s in statements if isinstance(s.node, (ast.Import, ast.ImportFrom)) for name in s.binds}
    defined = {
        s.node.name for s in statements if isinstance(s.node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    }
    for s in statements:  # what a statement may change (_changed_bases says which kinds count)
        s.changes |= (s.called - imported) | (s.passed - defined) | _called_for_its_effect(s.node)
    effects = _effects([s.node for s in statements], imported, defined)
    return Notebook(python, statements, habits, effects)


# --------------------------------------------------------------------------- what a statement touches


def _args(fn: ast.AST) -> set[str]:
    a = fn.args
    return {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if x is not None}


def _own_nodes(scope: ast.AST):
    """The nodes of a scope's body that run in that scope: not inside a nested function, lambda or
    class body (their decorators, defaults and bases do run in it)."""
    todo = list(scope.body) if isinstance(scope.body, list) else [scope.body]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            todo += [*node.decorator_list, *node.args.defaults, *[d for d in node.args.kw_defaults if d]]
        elif isinstance(node, ast.Lambda):
            todo += [*node.args.defaults, *[d for d in node.args.kw_defaults if d]]
        elif isinstance(node, ast.ClassDef):
            todo += [*node.decorator_list, *node.bases, *[k.value for k in node.keywords]]
        else:
            todo += list(ast.iter_child_nodes(node))


def _stored(node: ast.AST) -> set[str]:
    """Names a node binds in its own scope."""
    if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
        return {node.id}
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name.split(".")[0]) for a in node.names if a.name != "*"}
    if isinstance(node, ast.ExceptHandler) and node.name:
        return {node.name}
    if isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
        return {node.name}
    if isinstance(node, ast.MatchMapping) and node.rest:
        return {node.rest}
    if isinstance(node, ast.arg):
        return {node.arg}
    return set()


def _free(scope: ast.AST) -> set[str]:
    """The global names a function, lambda or class body reads when it runs."""
    local = _args(scope) if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) else set()
    declared = set()
    loads = set()
    for node in _own_nodes(scope):
        local |= _stored(node)
        if isinstance(node, ast.Global):
            declared |= set(node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            loads.add(node.id)
        elif isinstance(node, (ast.comprehension,)):
            local |= {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
        if isinstance(node, SCOPES) and node is not scope:
            loads |= _free(node)
    return loads - (local - declared)


def _changed_bases(node: ast.AST) -> tuple[set[str], set[str], set[str]]:
    """Names whose objects `node` may change, in three kinds: the base of an attribute or item it
    assigns or deletes; the base of a method it calls (`lst.append(x)`); names passed bare to a call
    that may change its arguments (`fill(table)`). `read` keeps the second kind for a module only
    where a statement calls it for its effect (`_called_for_its_effect`), and drops the third for
    the notebook's functions and classes (`run(train)` does not change `train`)."""
    out, called, passed = set(), set(), set()
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, (ast.Attribute, ast.Subscript)) and isinstance(t.ctx, (ast.Store, ast.Del)):
                    base = t
                    while isinstance(base, (ast.Attribute, ast.Subscript)):
                        base = base.value
                    if isinstance(base, ast.Name):
                        out.add(base.id)
    elif isinstance(node, ast.Call):
        base = node.func
        while isinstance(base, (ast.Attribute, ast.Subscript)):
            base = base.value
        if isinstance(base, ast.Name) and base is not node.func:
            called.add(base.id)
        if not (isinstance(node.func, ast.Name) and node.func.id in READ_ONLY_CALLS):
            for arg in [*node.args, *[k.value for k in node.keywords]]:
                arg = arg.value if isinstance(arg, ast.Starred) else arg
                if isinstance(arg, ast.Name):
                    passed.add(arg.id)
    return out, called, passed


def _statement(cell: int, index: int, node: ast.stmt) -> Statement:
    s = Statement(cell, index, node.lineno, node)
    wrapper = ast.Module(body=[node], type_ignores=[])
    for n in _own_nodes(wrapper):
        s.binds |= _stored(n)  # a comprehension's own names too: reading more than needed is harmless
        changed, called, passed = _changed_bases(n)
        s.changes |= changed
        s.called |= called
        s.passed |= passed
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
            s.uses.add(n.id)
        if isinstance(n, SCOPES):
            s.later |= _free(n)
        if isinstance(n, ast.ImportFrom) and any(a.name == "*" for a in n.names):
            s.star = True
    call = node.value if isinstance(node, ast.Expr) else None
    if isinstance(call, ast.Call):
        func = call.func
        s.inline_check = (isinstance(func, ast.Name) and func.id == "check") or (
            isinstance(func, ast.Attribute) and func.attr == "check"
        )
    return s


def _called_for_its_effect(node: ast.stmt) -> set[str]:
    """The module whose function a statement calls for its effect alone, its value dropped:
    `torch.manual_seed(0)`, `sys.path.insert(0, p)`, `np.random.seed(1)`. A module function called
    for its value (`opt = torch.optim.SGD(...)`) changes nothing of the module."""
    if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
        return set()
    base = node.value.func
    while isinstance(base, (ast.Attribute, ast.Subscript)):
        base = base.value
    return {base.id} if isinstance(base, ast.Name) and base is not node.value.func else set()


def _effects(nodes: list[ast.stmt], imported: set[str], defined: set[str]) -> dict[str, set[str]]:
    """For each function and class the notebook defines at top level: the globals a call of it binds
    (`global x`) or changes, including through the notebook's other functions it calls."""
    direct: dict[str, set[str]] = {}
    calls: dict[str, set[str]] = {}
    for top in nodes:
        for node in ast.walk(ast.Module(body=[top], type_ignores=[])):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if node is not top and not isinstance(top, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
                continue  # a method or a nested function counts with what defines it
            free = _free(node)
            found = set()
            for n in ast.walk(node):
                if isinstance(n, ast.Global):
                    found |= set(n.names)
                changed, called, passed = _changed_bases(n)
                found |= (changed | (called - imported) | (passed - defined)) & free
            direct.setdefault(node.name, set()).update(found)
            calls.setdefault(node.name, set()).update(free)
    effects = {name: set(found) for name, found in direct.items()}
    changed = True
    while changed:  # through the notebook's own functions, to a fixpoint
        changed = False
        for name, called in calls.items():
            for other in called & effects.keys():
                if not effects[other] <= effects[name]:
                    effects[name] |= effects[other]
                    changed = True
    return effects


# --------------------------------------------------------------------------- the slice


def _affects(s: Statement, nb: Notebook) -> set[str]:
    out = s.binds | s.changes
    for name in s.uses & nb.effects.keys():
        out |= nb.effects[name]
    return out


def needed(nb: Notebook, names: tuple[str, ...] | list[str]) -> Slice:
    """The statements that define or change what `names` need, followed to a fixpoint, in notebook order."""
    need = set(names)
    known = set(dir(builtins))
    chosen: set[int] = set()
    affects = {id(s): _affects(s, nb) for s in nb.statements}
    bound = set().union(*(s.binds for s in nb.statements)) if nb.statements else set()
    stars = [s for s in nb.statements if s.star]
    grew = True
    while grew:
        grew = False
        for s in nb.statements:
            if id(s) in chosen or s.inline_check:
                continue
            if affects[id(s)] & need or (s.star and need - bound - known):
                chosen.add(id(s))
                # what it binds too: an object made beside a needed one may share its state (a
                # client socket and the server's end; a model and its optimizer)
                need |= s.uses | s.later | s.binds
                grew = True
    missing = [n for n in names if n not in bound and not stars]
    return Slice([s for s in nb.statements if id(s) in chosen], missing)


# --------------------------------------------------------------------------- stubs and notes


def _is_stub(node: ast.AST) -> bool:
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]  # a docstring
    body = [s for s in body if not isinstance(s, ast.Pass)]
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is None:
        return False
    exc = body[0].exc
    func = exc.func if isinstance(exc, ast.Call) else exc
    if not (isinstance(func, ast.Name) and func.id == "NotImplementedError"):
        return False
    args = exc.args if isinstance(exc, ast.Call) else []
    return not args or (isinstance(args[0], ast.Constant) and str(args[0].value).startswith(STUB_MESSAGE))


def stub_tasks(nb: Notebook, names: tuple[str, ...] | list[str]) -> list[str]:
    """The names among `names` whose last definition in the notebook is still the exercise's stub."""
    out = []
    for name in names:
        binders = nb.binders(name)
        if binders and _is_stub(binders[-1].node):
            out.append(name)
    return out


def _digging(s: Statement) -> list[Note]:
    notes = []
    for node in ast.walk(s.node):
        what = None
        if isinstance(node, ast.Name) and node.id in DIGGING_NAMES and isinstance(node.ctx, ast.Load):
            what = f"{node.id}()"
        elif isinstance(node, ast.Attribute) and node.attr in DIGGING_ATTRIBUTES:
            what = f".{node.attr}"
        elif isinstance(node, ast.Attribute) and node.attr in DIGGING_SYS and getattr(node.value, "id", "") == "sys":
            what = f"sys.{node.attr}"
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            hit = [n for n in names if n.split(".")[0] in DIGGING_MODULES]
            what = f"import {hit[0]}" if hit else None
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "getattr"):
            if len(node.args) >= 2 and not isinstance(node.args[1], ast.Constant):
                what = f"{node.func.id} with a computed name"
        if what:
            notes.append(Note(s.cell, getattr(node, "lineno", s.line), f"{what}, worth a look"))
    return notes
