"""What the batch grader reads in a notebook's source, in its own process, before it asks the kernel anything.

Everything that runs in a student's kernel can be rewritten by the student's code: the task's probe,
the code that answers the grader, even `json` or `os.write`. So no judgement may depend on it. The
grader trusts only two things: the values a notebook's exercise functions return for inputs drawn
after the notebook has run (judged against answers it computes itself, grading.py), and what it reads
here, in the notebook's source, with Python's `ast`:

stub_tasks         a task whose function's last definition is still the exercise's stub is "not
                   attempted", whatever the kernel answers;
forbidden_use      a task that forbids modules (chapter 01's "by hand" tasks: torch, numpy, struct)
                   fails if its function, or anything of the notebook's it reaches (helpers, globals,
                   default arguments, decorators, class bodies), refers to one of them, however it
                   was imported or renamed;
reaching_code      code anywhere in the notebook that could read or rewrite the grading code in the
                   kernel (frames, `gc`, `ctypes`, `eval`/`exec`/`__import__`/`importlib`, IPython's
                   history and hooks, the answer channel's file descriptor, assigning to another
                   module's attributes, shell commands and magics other than timing and plotting):
                   a notebook with any of it is not graded automatically; the message names the cell
                   and the line, and the instructor decides.

The reading is of Python source, so it has limits that the README states: a notebook can still run
code the grader does not read (a C extension it builds, a file it writes and then imports); the
grader's sandbox, not this reading, is what keeps such code away from the machine, the other
submissions and the right answers.
"""

from __future__ import annotations

import ast
import builtins
import importlib.util
import re
import sys
from dataclasses import dataclass, field
from functools import lru_cache

__all__ = ["SourceFinding", "Notebook", "read", "stub_tasks", "forbidden_use", "reaching_code"]

STUB_MESSAGE = "Exercise"  # the stub raises NotImplementedError("Exercise: write your solution here")
SAFE_MAGICS = {"matplotlib", "time", "timeit", "autoreload"}
# Modules whose only use in an exercise would be to reach into the kernel's own machinery.
REACHING_MODULES = {
    "builtins", "importlib", "gc", "ctypes", "types", "marshal", "runpy", "code", "codeop", "_thread",
    "IPython", "ipykernel", "jupyter_client", "zmq", "traitlets", "tornado", "_ctypes", "pydoc", "mmap",
    "pickle", "_pickle", "shelve", "dill", "cloudpickle", "copyreg",
}  # fmt: skip
# inspect only to read source or signatures (chapter 09's exercise prints a function's source)
SAFE_INSPECT = {"getsource", "getsourcelines", "signature", "getdoc", "cleandoc", "isfunction", "isclass", "getfile"}
REACHING_NAMES = {
    "eval", "exec", "compile", "__import__", "globals", "vars", "locals", "breakpoint",
    "get_ipython", "__builtins__", "__loader__", "__spec__",
}  # fmt: skip
IPYTHON_HISTORY = {"In", "Out", "_ih", "_oh", "_dh", "_i", "_ii", "_iii"}  # unless the notebook binds the name itself
REACHING_ATTRIBUTES = {
    "f_back", "f_locals", "f_globals", "f_builtins", "f_code", "f_trace", "tb_frame", "gi_frame", "cr_frame",
    "ag_frame", "gi_code", "__globals__", "__code__", "__closure__", "__builtins__", "__subclasses__",
    "__defaults__", "__kwdefaults__", "cell_contents", "__dict__", "__getattribute__",
}  # fmt: skip
REACHING_SYS = {
    "_getframe", "_current_frames", "setprofile", "settrace", "getprofile", "gettrace", "meta_path",
    "path_hooks", "path_importer_cache", "modules", "displayhook", "excepthook", "addaudithook",
}  # fmt: skip
REACHING_OS = {"write", "read", "dup", "dup2", "fdopen", "open", "environ", "environb", "getenv", "putenv", "pipe"}
FD_PATHS = re.compile(r"/proc/(self|\d+)/fd|/dev/fd")


@dataclass
class SourceFinding:
    """Where the reading found something: 1-based code cell and line, and what it is."""

    cell: int
    line: int
    what: str

    def where(self) -> str:
        return f"code cell {self.cell}, line {self.line}"


@dataclass
class _Binding:
    cell: int
    node: ast.AST  # an import alias, a def/class, an assignment's value, or a function with `global`
    module: str | None = None  # for imports: the dotted path the name stands for


@dataclass
class Notebook:
    """A notebook's code cells, parsed as IPython would run them."""

    trees: list[ast.Module | None]
    magics: list[SourceFinding] = field(default_factory=list)
    bindings: dict[str, list[_Binding]] = field(default_factory=dict)  # global name -> its bindings, in order
    star_imports: list[tuple[int, str]] = field(default_factory=list)


# --------------------------------------------------------------------------- reading


def _python(cell: int, source: str, magics: list[SourceFinding]) -> str:
    """The cell as Python: IPython's own transformation where IPython is installed (magics become
    get_ipython() calls, noted here and then blanked), else magic and shell lines blanked."""
    lines = source.splitlines()
    out = []
    if lines and lines[0].lstrip().startswith("%%"):
        name = lines[0].lstrip()[2:].split()[0] if lines[0].strip() != "%%" else ""
        if name not in SAFE_MAGICS:
            magics.append(SourceFinding(cell, 1, f"the cell magic %%{name}"))
            return ""
        lines = [""] + lines[1:]
    for i, line in enumerate(lines, 1):
        text = line.strip()
        shell = re.match(r"^[\w\s,]*=\s*!", text)
        if text.startswith(("%", "!")) or shell:
            name = text.lstrip("%").split()[0] if text.startswith("%") and len(text) > 1 else ""
            if shell or text.startswith("!") or name not in SAFE_MAGICS:
                magics.append(
                    SourceFinding(cell, i, f"the {'magic %' + name if name else 'shell command'} `{text[:40]}`")
                )
            out.append(line[: len(line) - len(line.lstrip())] + "pass")
        else:
            out.append(line)
    return "\n".join(out)


def read(cells: list[str]) -> Notebook:
    """Parse the code cells in order (a cell that does not parse is skipped: the kernel cannot run it
    either) and record which global names each binds."""
    magics: list[SourceFinding] = []
    trees: list[ast.Module | None] = []
    for n, source in enumerate(cells, 1):
        try:
            trees.append(ast.parse(_python(n, source, magics)))
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            trees.append(None)
    nb = Notebook(trees, magics)
    for n, tree in enumerate(trees, 1):
        if tree is not None:
            _bind_scope(nb, n, tree.body)
            for node in ast.walk(tree):  # a function that assigns a name it declares global binds it too
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    for name in {g for s in ast.walk(node) if isinstance(s, ast.Global) for g in s.names}:
                        nb.bindings.setdefault(name, []).append(_Binding(n, node))
    return nb


def _bind(nb: Notebook, name: str, binding: _Binding) -> None:
    nb.bindings.setdefault(name, []).append(binding)


def _targets(node: ast.AST) -> list[str]:
    return [t.id for t in ast.walk(node) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)]


def _bind_scope(nb: Notebook, cell: int, body: list[ast.stmt]) -> None:
    """Bindings made at module level, including inside top-level if/for/while/try/with blocks."""
    for stmt in body:
        if isinstance(stmt, ast.Import):
            for alias in stmt.names:
                path = alias.name if alias.asname else alias.name.split(".")[0]
                _bind(nb, alias.asname or path, _Binding(cell, stmt, path))
        elif isinstance(stmt, ast.ImportFrom):
            base = "." * stmt.level + (stmt.module or "")
            for alias in stmt.names:
                if alias.name == "*":
                    nb.star_imports.append((cell, base))
                else:
                    _bind(nb, alias.asname or alias.name, _Binding(cell, stmt, f"{base}.{alias.name}"))
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            _bind(nb, stmt.name, _Binding(cell, stmt))
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for target in targets:
                for name in _targets(target):
                    _bind(nb, name, _Binding(cell, stmt))
        elif isinstance(stmt, (ast.For, ast.AsyncFor)):
            for name in _targets(stmt.target):
                _bind(nb, name, _Binding(cell, stmt))
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):  # `with open(...) as f`: f; the body is bound below
            for item in stmt.items:
                for name in _targets(item.optional_vars) if item.optional_vars is not None else []:
                    _bind(nb, name, _Binding(cell, stmt))
        if isinstance(stmt, (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try)):
            for block in ("body", "orelse", "finalbody"):
                _bind_scope(nb, cell, getattr(stmt, block, []) or [])
            for handler in getattr(stmt, "handlers", []) or []:
                _bind_scope(nb, cell, handler.body)
        for node in ast.walk(stmt):  # walrus anywhere at module level
            if isinstance(node, ast.NamedExpr) and isinstance(node.target, ast.Name):
                _bind(nb, node.target.id, _Binding(cell, stmt))


# --------------------------------------------------------------------------- stubs


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
    """The names among `names` whose last binding in the notebook is the exercise's stub."""
    return [name for name in names if nb.bindings.get(name) and _is_stub(nb.bindings[name][-1].node)]


# --------------------------------------------------------------------------- forbidden modules


def _dotted(node: ast.AST) -> tuple[str, list[str]] | None:
    """`a.b.c` (or getattr(a, "b") with a literal name) as (root name, [attributes])."""
    attrs: list[str] = []
    while True:
        if isinstance(node, ast.Attribute):
            attrs.append(node.attr)
            node = node.value
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            attrs.append(node.args[1].value)
            node = node.args[0]
        elif isinstance(node, ast.Name):
            return node.id, attrs[::-1]
        else:
            return None


def _matches(path: str, prefixes: tuple[str, ...]) -> str | None:
    """The forbidden prefix `path` falls under (a parent package alone, `course_lib` for
    `course_lib.train`, is not the forbidden module)."""
    return next((p for p in prefixes if path == p or path.startswith(p + ".")), None)


def _local_names(fn: ast.AST) -> set[str]:
    names = set()
    if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        a = fn.args
        names |= {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if x is not None}
    declared_global = {g for s in ast.walk(fn) if isinstance(s, ast.Global) for g in s.names}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node is not fn:
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name.split(".")[0]) for a in node.names}
    return names - declared_global


def _without_annotations(node: ast.AST) -> list[ast.AST]:
    """The nodes of a definition that run: not its annotations (type hints name types, they call nothing)."""
    skip: set[int] = set()
    for n in ast.walk(node):
        for ann in (getattr(n, "returns", None), getattr(n, "annotation", None)):
            if ann is not None:
                skip |= {id(x) for x in ast.walk(ann)}
    return [n for n in ast.walk(node) if id(n) not in skip]


def forbidden_use(nb: Notebook, names: tuple[str, ...], prefixes: tuple[str, ...]) -> SourceFinding | None:
    """The first reference to a module in `prefixes` made by the functions `names` or anything of
    the notebook they reach; None when there is none."""
    if not prefixes:
        return None
    seen: set[int] = set()
    todo: list[_Binding] = [nb.bindings[n][-1] for n in names if nb.bindings.get(n)]
    while todo:
        b = todo.pop()
        if id(b.node) in seen:
            continue
        seen.add(id(b.node))
        if b.module is not None:  # an import the reached code uses by name
            hit = _matches(b.module, prefixes)
            if hit:
                return SourceFinding(b.cell, b.node.lineno, f"{b.module} (imported in that line)")
            continue
        local = _local_names(b.node) if isinstance(b.node, (ast.FunctionDef, ast.AsyncFunctionDef)) else set()
        nodes = _without_annotations(b.node)
        for node in nodes:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if _matches(alias.name, prefixes):
                        return SourceFinding(b.cell, node.lineno, f"import {alias.name}")
            elif isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    if _matches(f"{node.module}.{alias.name}", prefixes) or _matches(node.module, prefixes):
                        return SourceFinding(b.cell, node.lineno, f"from {node.module} import {alias.name}")
            chain = _dotted(node) if isinstance(node, (ast.Attribute, ast.Call)) else None
            if chain and chain[0] not in local:
                for binding in nb.bindings.get(chain[0], []):
                    if binding.module is not None:
                        path = ".".join([binding.module, *chain[1]])
                        if _matches(path, prefixes):
                            return SourceFinding(b.cell, node.lineno, path)
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in local:
                bound = nb.bindings.get(node.id)
                if bound:
                    todo.append(bound[-1])
                    todo.extend(
                        x
                        for x in bound
                        if x.module is None and isinstance(x.node, ast.FunctionDef) and x.node.name != node.id
                    )  # functions that set it via `global`
                elif not hasattr(builtins, node.id):
                    for cell, module in nb.star_imports:
                        if _matches(module, prefixes):
                            return SourceFinding(cell, node.lineno, f"{node.id}, from `from {module} import *`")
    return None


# --------------------------------------------------------------------------- code that reaches the grader


def reaching_code(nb: Notebook) -> list[SourceFinding]:
    """Code that could read or rewrite the grading code inside the kernel (module docstring)."""
    found = list(nb.magics)
    modules = {name: path for name, bs in nb.bindings.items() for b in bs if (path := b.module) is not None}
    stored = {
        n.id for t in nb.trees if t for n in ast.walk(t) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }
    for cell, tree in enumerate(nb.trees, 1):
        if tree is None:
            continue
        # `"google.colab" in sys.modules` only asks: the setup cell's test is allowed
        asked = {
            id(c)
            for n in ast.walk(tree)
            if isinstance(n, ast.Compare) and all(isinstance(op, (ast.In, ast.NotIn)) for op in n.ops)
            for c in n.comparators
        }
        for node in ast.walk(tree):
            if id(node) in asked:
                continue
            if isinstance(node, ast.Name) and node.id in IPYTHON_HISTORY and node.id not in stored:
                found.append(SourceFinding(cell, node.lineno, f"IPython's history {node.id}"))
                continue
            what = _reaching(node, modules)
            if what:
                found.append(SourceFinding(cell, getattr(node, "lineno", 0), what))
    return sorted(found, key=lambda f: (f.cell, f.line))


def _module_path(node: ast.AST, modules: dict[str, str]) -> str | None:
    chain = _dotted(node)
    if chain and chain[0] in modules:
        return ".".join([modules[chain[0]], *chain[1]])
    return None


@lru_cache(maxsize=None)
def _installed(top: str) -> bool:
    """Is `top` a module of this Python (stdlib, site-packages, the course's library)? The grader's
    environment is the sandbox's, so a module that is not found here is one the notebook wrote into
    its own folder, where the reading cannot see it."""
    if top in sys.builtin_module_names or top in sys.stdlib_module_names:
        return True
    try:
        return importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return False


def _reaching(node: ast.AST, modules: dict[str, str]) -> str | None:
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name.split(".")[0] in REACHING_MODULES:
                return f"import {alias.name}"
            if not _installed(alias.name.split(".")[0]):
                return f"import {alias.name}, a module that is not installed (one the notebook wrote?)"
    if isinstance(node, ast.ImportFrom) and (node.level or not _installed((node.module or "").split(".")[0])):
        return f"from {'.' * node.level}{node.module or ''} import ..., a module that is not installed"
    if isinstance(node, ast.ImportFrom) and node.module:
        top = node.module.split(".")[0]
        if top in REACHING_MODULES:
            return f"from {node.module} import ..."
        names = {a.name for a in node.names}
        if top == "sys" and names & REACHING_SYS or top == "os" and names & REACHING_OS:
            return f"from {node.module} import {', '.join(sorted(names))}"
        if top == "inspect" and names - SAFE_INSPECT:
            return f"from inspect import {', '.join(sorted(names - SAFE_INSPECT))}"
    if isinstance(node, ast.Name) and node.id in REACHING_NAMES and not isinstance(node.ctx, ast.Store):
        return f"{node.id}"
    if isinstance(node, ast.Attribute) and node.attr in REACHING_ATTRIBUTES:
        return f".{node.attr}"
    if isinstance(node, ast.Attribute):
        path = _module_path(node, modules) or ""
        root, _, rest = path.partition(".")
        attr = rest.split(".")[0]
        if root == "sys" and attr in REACHING_SYS or root == "os" and attr in REACHING_OS:
            return path
        if root == "inspect" and attr and attr not in SAFE_INSPECT:
            return path
        if root == "socket" and attr == "fromfd":
            return path
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
        for target in targets:
            base = target
            while isinstance(base, (ast.Attribute, ast.Subscript)):
                base = base.value
            if target is not base and isinstance(base, ast.Name) and base.id in modules:
                return f"assigning to {modules[base.id]}'s attributes"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        if node.func.id in ("setattr", "delattr") and node.args and _module_path(node.args[0], modules):
            return f"{node.func.id} on a module"
        if node.func.id == "getattr" and len(node.args) >= 2 and not isinstance(node.args[1], ast.Constant):
            if _module_path(node.args[0], modules):
                return "getattr on a module with a computed name"
        if node.func.id == "open" and node.args and not _is_text(node.args[0]):
            return "open() of something that is not a file name"
    if isinstance(node, ast.Call) and (_module_path(node.func, modules) or "").startswith("socket."):
        if any(k.arg == "fileno" for k in node.keywords) or len(node.args) >= 4:
            return "socket.socket(fileno=...)"
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and FD_PATHS.search(node.value):
        return f"the path {node.value[:40]!r}"
    return None


def _is_text(node: ast.AST) -> bool:
    """A file name as a learner writes one: a string, an f-string, a path expression, a variable."""
    return not (isinstance(node, ast.Constant) and isinstance(node.value, int))
