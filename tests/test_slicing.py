"""Which statements of a notebook a task needs (course_lib/tooling/slicing.py).

The grader and the inline check run only these in a task's process: everything a task's functions
use (definitions, imports, what changes a needed object) must be there, and nothing else of the
notebook may run (shell lines, magics, plots, a cell that patches the grader).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from course_lib.tooling import slicing as S
from course_lib.tooling.checks import checks_for
from course_lib.tooling.grader.cli import code_cells

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
EXERCISES = sorted((ROOT / "exercises").glob("*.ipynb"))
STUB = 'def decode(bits):\n    """Decode."""\n    raise NotImplementedError("Exercise: write your solution here")'


def ran(cells: list[str], *names: str) -> list[tuple[int, int]]:
    """(cell, line) of each statement the names need."""
    return [(s.cell, s.line) for s in S.needed(S.read(cells), names).statements]


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_every_solution_defines_what_each_task_needs_and_no_stub(path):
    nb = S.read(code_cells(path))
    for check in checks_for(path.stem[:2]):
        sl = S.needed(nb, check.args)
        assert sl.statements and not sl.missing and not S.stub_tasks(nb, check.args), check.name


@pytest.mark.parametrize("path", EXERCISES, ids=lambda p: p.stem)
def test_every_exercise_template_is_read_as_not_attempted(path):
    nb = S.read(code_cells(path))
    for check in checks_for(path.stem[:2]):
        assert S.stub_tasks(nb, check.args[:1]) == [check.args[0]], check.name


def test_the_last_definition_decides_whether_a_task_is_a_stub():
    assert S.stub_tasks(S.read([STUB]), ["decode"]) == ["decode"]
    assert S.stub_tasks(S.read([STUB, "def decode(bits):\n    return 0.0"]), ["decode"]) == []
    assert S.stub_tasks(S.read(["def decode(bits):\n    return 0.0", STUB]), ["decode"]) == ["decode"]
    other = 'def decode(bits):\n    raise NotImplementedError("subnormals are not done yet")'
    assert S.stub_tasks(S.read([other]), ["decode"]) == []  # the learner's own message: attempted


def test_what_a_function_uses_runs_and_nothing_else():
    cells = [
        "import math, os\n!nvidia-smi\nimport matplotlib.pyplot as plt",
        "BIAS = 15\nplt.plot([1, 2])\nprint(BIAS)",
        "def helper(e):\n    return e - BIAS",
        "def decode(bits):\n    return math.ldexp(1.0, helper(bits >> 10))",
        "import course_lib.tooling.task as t\nt.respond = None",
        "check('01.decode', decode)\nprint(decode(0x3C00))",
    ]
    assert ran(cells, "decode") == [(1, 1), (2, 1), (3, 1), (4, 1)]


def test_what_changes_a_needed_object_runs_too():
    cells = [
        "CFG = {}",
        "CFG['lr'] = 0.1",
        "CFG.update(momentum=0.9)",
        "TABLE = []",
        "def fill(t):\n    t.append(1)",
        "fill(TABLE)",
        "import torch\ntorch.manual_seed(0)\ntorch.backends.cudnn.benchmark = True\nW = torch.zeros(2)",
        "def f(x):\n    return x * CFG['lr'] + len(TABLE) + torch.ones(1)",
    ]
    assert ran(cells, "f") == [(1, 1), (2, 1), (3, 1), (4, 1), (5, 1), (6, 1), (7, 1), (7, 2), (7, 3), (8, 1)]


def test_a_global_set_by_a_function_call_runs_the_call():
    cells = [
        "H = None",
        "def setup():\n    global H\n    H = 5",
        "def init():\n    setup()",
        "init()",
        "def f():\n    return H",
    ]
    assert ran(cells, "f") == [(1, 1), (2, 1), (3, 1), (4, 1), (5, 1)]


def test_a_function_defined_later_and_a_star_import_are_found():
    assert ran(["def f():\n    return g()", "x = 1", "def g():\n    return 2"], "f") == [(1, 1), (3, 1)]
    assert ran(["from math import *", "def f():\n    return floor(2.5)"], "f") == [(1, 1), (2, 1)]
    assert S.needed(S.read(["x = 1"]), ["f"]).missing == ["f"]


def test_calling_a_notebook_function_or_a_module_for_its_value_changes_nothing():
    cells = [
        "import math\nimport torch",
        "def f(x):\n    return math.floor(x)",
        "print(f(1.5))\nresult = f(2.5)\nopt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)",
        "def run(fn):\n    return fn(3.5)",
        "run(f)",
    ]
    assert ran(cells, "f") == [(1, 1), (2, 1)]


def test_objects_made_beside_a_needed_one_come_with_it():
    cells = [
        "import socket\nserver = socket.socket()\nserver.bind(('127.0.0.1', 0))\nserver.listen()",
        "client = socket.create_connection(server.getsockname())\nconn, _ = server.accept()\n"
        "client.sendall(b'ok')\nWORKS = conn.recv(2) == b'ok'",
        "def f():\n    return WORKS",
    ]
    assert (2, 3) in ran(cells, "f")  # client.sendall: what conn.recv waits for


def test_cells_are_read_as_ipython_runs_them_and_habits_are_noted():
    cells = [
        "%pip install -q tqdm\n!nvidia-smi",
        "%%time\ndef f():\n    return 1",
        "%time X = 2",
        "%%bash\necho hi",
        "f?",
        "/print 'hello'",
        "x = !ls",
        "def g():\n    !echo inside\n    return X",
    ]
    nb = S.read(cells)
    assert ran(cells, "f") == [(2, 2)] and ran(cells, "g") == [(3, 1), (8, 1)]
    noted = " ".join(str(n) for n in nb.habits)
    for habit in ("%pip install", "!nvidia-smi", "%%bash", "f?", "x = !ls", "!echo inside"):
        assert habit in noted, habit
    assert nb.python[3] is None  # %%bash: not Python, nothing of it runs


def test_code_that_digs_into_the_interpreter_is_noted_only_where_a_task_runs_it():
    cells = [
        "import gc, sys",
        "def f():\n    return sys._getframe(0).f_back, gc.get_objects()",
        "exec('1')\nprint.__self__",
    ]
    notes = " ".join(str(n) for n in S.needed(S.read(cells), ["f"]).digging())
    assert "sys._getframe" in notes and ".f_back" in notes and "import gc" in notes
    assert "exec" not in notes and "__self__" not in notes  # cell 3 never runs for f
