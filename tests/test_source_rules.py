"""What the batch grader reads in a notebook's source before trusting its kernel (issue 27, class 4).

Each rule is tried against the honest notebooks (every exercise template and every solution must
pass untouched) and against the cunning ways around it: renamed imports, helpers in another cell,
default arguments, decorators, `global`, star imports; frames, `gc`, IPython's history, the channel's
file descriptor, patched modules, dynamic imports.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from course_lib.tooling import source_rules as sr
from course_lib.tooling.grading import checks_for, get_check
from course_lib.tooling.runner import code_cells

ROOT = Path(__file__).resolve().parents[1]
HONEST = sorted([*(ROOT / "exercises").glob("*.ipynb"), *(ROOT / "solutions").glob("*.ipynb")])
BY_HAND = ("torch", "numpy", "struct", "array", "course_lib")
STUB = 'def decode(bits):\n    """Decode."""\n    raise NotImplementedError("Exercise: write your solution here")'


def forbidden(*cells: str, name: str = "decode", prefixes: tuple[str, ...] = BY_HAND) -> str | None:
    found = sr.forbidden_use(sr.read(list(cells)), (name,), prefixes)
    return None if found is None else found.what


def reaching(*cells: str) -> list[str]:
    return [f.what for f in sr.reaching_code(sr.read(list(cells)))]


@pytest.mark.parametrize("path", HONEST, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_the_courses_own_notebooks_read_clean(path):
    nb = sr.read(code_cells(path))
    assert sr.reaching_code(nb) == []
    for check in checks_for(path.stem[:2]):
        assert sr.forbidden_use(nb, check.args, tuple(check.forbidden)) is None, check.name


def test_every_exercise_template_is_read_as_not_attempted_and_every_solution_as_attempted():
    for path in HONEST:
        nb = sr.read(code_cells(path))
        for check in checks_for(path.stem[:2]):
            stubbed = sr.stub_tasks(nb, check.args[:1])
            assert bool(stubbed) == (path.parent.name == "exercises"), f"{path.name} {check.name}"


def test_the_last_definition_decides_whether_a_task_is_a_stub():
    assert sr.stub_tasks(sr.read([STUB]), ["decode"]) == ["decode"]
    assert sr.stub_tasks(sr.read([STUB, "def decode(bits):\n    return 0.0"]), ["decode"]) == []
    assert sr.stub_tasks(sr.read(["def decode(bits):\n    return 0.0", STUB]), ["decode"]) == ["decode"]
    other = 'def decode(bits):\n    raise NotImplementedError("subnormals are not done yet")'
    assert sr.stub_tasks(sr.read([other]), ["decode"]) == []  # the learner's own message: attempted


@pytest.mark.parametrize("cells", [
    ("import struct\ndef decode(bits):\n    return struct.unpack('<e', bits.to_bytes(2, 'little'))[0]",),
    ("import struct as s", "def decode(bits):\n    return s.unpack('<e', bits.to_bytes(2, 'little'))[0]"),
    ("from struct import unpack as u", "def decode(bits):\n    return u('<e', bits.to_bytes(2, 'little'))[0]"),
    ("def decode(bits):\n    import struct\n    return struct.unpack('<e', bits.to_bytes(2, 'little'))[0]",),
    ("import struct", "def helper(b):\n    return struct.unpack('<e', b)[0]",
     "def decode(bits):\n    return helper(bits.to_bytes(2, 'little'))"),
    ("import struct", "UNPACK = struct.unpack",
     "def decode(bits):\n    return UNPACK('<e', bits.to_bytes(2, 'little'))[0]"),
    ("import struct", "def decode(bits, u=struct.unpack):\n    return u('<e', bits.to_bytes(2, 'little'))[0]"),
    ("import torch", "def decode(bits):\n    return torch.tensor([bits]).view(torch.float16).item()"),
    ("import numpy as np",
     "def decode(bits):\n    return float(np.frombuffer(bits.to_bytes(2, 'little'), np.float16)[0])"),
    ("from struct import *", "def decode(bits):\n    return unpack('<e', bits.to_bytes(2, 'little'))[0]"),
    ("import struct", "H = None", "def setup():\n    global H\n    H = struct.unpack", "setup()",
     "def decode(bits):\n    return H('<e', bits.to_bytes(2, 'little'))[0]"),
    ("import struct", "class Tool:\n    u = staticmethod(struct.unpack)",
     "def decode(bits):\n    return Tool.u('<e', bits.to_bytes(2, 'little'))[0]"),
    ("import struct", "def deco(f):\n    return lambda b: struct.unpack('<e', b.to_bytes(2, 'little'))[0]",
     "@deco\ndef decode(bits):\n    return 0.0"),
    ("import struct", "decode = lambda bits: struct.unpack('<e', bits.to_bytes(2, 'little'))[0]"),
    ("with open('runs/log.txt', 'w') as log:\n    import struct",  # bound inside a top-level block
     "def decode(bits):\n    return struct.unpack('<e', bits.to_bytes(2, 'little'))[0]"),
    ("import course_lib.chapters.ch01.formats",
     "def decode(bits):\n    return course_lib.chapters.ch01.formats.decode(bits)"),
    ("import torch", "def decode(bits):\n    return getattr(torch, 'tensor')([bits]).item()"),
    ("from array import array", "def decode(bits):\n    return array('e', bits.to_bytes(2, 'little'))[0]"),
], ids=lambda c: c[-1].splitlines()[-1].strip()[:50] if isinstance(c, tuple) else str(c))
def test_a_forbidden_module_is_found_however_the_call_is_hidden(cells):
    assert forbidden(*cells) is not None


@pytest.mark.parametrize("cells", [
    ("import torch", "x = torch.ones(3)",  # torch elsewhere in the notebook, not in the task
     "def decode(bits):\n    s = -1.0 if bits >> 15 else 1.0\n    return s * bits"),
    ("import math", "def decode(bits: int) -> float:\n    return math.ldexp(bits & 0x3FF, -24)"),
    ("import torch", "def decode(bits: 'torch.Tensor') -> float:\n    return float(bits)"),  # a type hint calls nothing
    ("import struct\ndef decode(bits):\n    raise NotImplementedError('Exercise: write your solution here')",
     "def decode(bits):\n    return float(bits)"),  # the old version, rebound later, is not the task
])
def test_a_fair_answer_is_not_accused(cells):
    assert forbidden(*cells) is None


def test_only_the_forbidden_submodule_counts():
    cells = ("import course_lib.models\nimport torch", "def step(m):\n    return course_lib.models.SimpleCNN(m)")
    assert forbidden(*cells, name="step", prefixes=("course_lib.chapters", "course_lib.train")) is None
    cells = ("from course_lib import train", "def step(m):\n    return train.Trainer(m)")
    chapters_and_train = ("course_lib.chapters", "course_lib.train")
    assert forbidden(*cells, name="step", prefixes=chapters_and_train) == "course_lib.train.Trainer"
    cells = ("import torch", "def step(s):\n    return torch.amp.GradScaler('cpu')")
    assert forbidden(*cells, name="step", prefixes=("torch.amp", "torch.cuda.amp")) == "torch.amp.GradScaler"
    # the C++ op that GradScaler.update() runs is the rule itself (chapter 03's task forbids it)
    scaler = get_check("03.update_scale")
    cells = ("import torch", "def update_scale(*a):\n    return torch._amp_update_scale_(*a)")
    assert forbidden(*cells, name="update_scale", prefixes=tuple(scaler.forbidden)) == "torch._amp_update_scale_"


@pytest.mark.parametrize("cell, what", [
    ("import sys\nf = sys._getframe(1)", "sys._getframe"),
    ("import inspect\nf = inspect.currentframe()", "inspect.currentframe"),
    ("from inspect import stack", "stack"),
    ("try:\n    1 / 0\nexcept Exception as e:\n    f = e.__traceback__.tb_frame", ".tb_frame"),
    ("import gc\nobjs = gc.get_objects()", "import gc"),
    ("import ctypes", "import ctypes"),
    ("nonce = In[-1]", "In"),
    ("x = _ih[-1]", "_ih"),
    ("get_ipython().events.register('pre_run_cell', print)", "get_ipython"),
    ("import os\nos.write(5, b'{}')", "os.write"),
    ("import os\nfd = int(os.environ['AMP_ANSWER_FD'])", "os.environ"),
    ("from os import write", "write"),
    ("open(5, 'w').write('{}')", "open()"),
    ("p = open('/proc/self/fd/5', 'w')", "/proc/self/fd"),
    ("import socket\ns = socket.socket(fileno=5)", "socket.socket(fileno"),
    ("import json\njson.dumps = lambda *a, **k: '{}'", "assigning to json"),
    ("import json as j\nsetattr(j, 'dumps', print)", "setattr"),
    ("import course_lib.tooling.grading as g\ng.serve = print", "assigning to course_lib.tooling.grading"),
    ("from course_lib.tooling import grading\ngrading.serve.__code__ = print.__code__", "__code__"),
    ("import sys\nsys.modules['json'] = None", "sys.modules"),
    ("import sys\nsys.meta_path.insert(0, None)", "sys.meta_path"),
    ("import importlib\nm = importlib.import_module('stru' + 'ct')", "import importlib"),
    ("m = __import__('stru' + 'ct')", "__import__"),
    ("exec('import struct')", "exec"),
    ("eval('1')", "eval"),
    ("import builtins\nbuiltins.abs = print", "import builtins"),
    ("g = check.__globals__", "__globals__"),
    ("!cat /etc/passwd", "shell command"),
    ("files = !ls", "shell command"),
    ("%run other.py", "magic %run"),
    ("%%writefile course_lib.py\nx = 1", "%%writefile"),
    ("import sys\nsys.setprofile(None)", "sys.setprofile"),
    ("open('helper.py', 'w').write('import sys')\nimport helper", "not installed"),
    ("from helper import f", "not installed"),
    ("import pickle\npickle.loads(b'')", "import pickle"),
])
def test_code_that_could_reach_into_the_grader_is_named_with_its_place(cell, what):
    found = sr.reaching_code(sr.read(["import math", cell]))
    assert found and any(what in f.what for f in found), [f.what for f in found]
    assert found[0].cell == 2 and found[0].line >= 1


@pytest.mark.parametrize("cell", [
    "import os, subprocess, sys\nif 'google.colab' in sys.modules:\n    pass\nsys.path.insert(0, '/content/x')",
    "%matplotlib inline",
    "%%time\nx = sum(range(10))",
    "for _i in range(3):\n    print(_i)",  # a variable of the learner's own, not IPython's history
    "import inspect\nprint(inspect.getsource(print.__class__))",
    "with open('runs/out.txt', 'w') as f:\n    f.write('ok')",
    "import os\nos.makedirs('runs', exist_ok=True)",
    "import socket\ns = socket.socket()",
])
def test_ordinary_notebook_code_is_not_accused(cell):
    assert reaching(cell) == []


def test_a_cell_that_does_not_parse_is_inert():
    nb = sr.read(["def decode(bits)\n    return struct", STUB])
    assert sr.stub_tasks(nb, ["decode"]) == ["decode"] and sr.reaching_code(nb) == []
