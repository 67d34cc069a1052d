"""A class of notebooks as 100 students on Colab write them, each with the grade it deserves.

Used by tests/test_grader.py, which grades the whole class in one run of the batch grader (as
`make grade` runs it) and checks every row, and that the inline check() says the same thing. Each
entry is one student's notebook: its code cells, what every task must get (points and status), and
words the message and the instructor's notes must hold.

- HONEST: right and wrong answers, untouched exercises, odd files.
- HABITS: a right answer plus one everyday habit (shell lines, magics, configuration, ordinary
  modules, imports that fail where a top-to-bottom run survives them): never a point lost.
- FORGERIES: a stub (or a forbidden shortcut) plus code that tries to answer for it or to reach
  what judges it, by every spelling the grader's old reading of the source did not name: the fair
  grade, 0 for a stub.
- HOSTILE: code that crashes, hangs, floods, kills, writes, connects: it costs its own task only.
Chapter 99 and 97 are fixture chapters (tests/fixtures/): fast tasks, so the class can be large;
some entries are real chapters' solutions with one cell added, as the issue's class was.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from course_lib.device import torch_at_least
from course_lib.tooling.checks import get_check

ROOT = Path(__file__).resolve().parents[1]
IMPORT = "from course_lib.tooling import check"
GOOD_ADD = "def add(a, b):\n    return a + b"
GOOD_CLIP = "LIMIT = 3.0\n\ndef clip(x):\n    return max(-LIMIT, min(LIMIT, x))"
WRONG_ADD = "def add(a, b):\n    return a - b"
STUB_ADD = 'def add(a, b):\n    raise NotImplementedError("Exercise: write your solution here")'
GOOD_MEAN = "def mean(xs):\n    return sum(xs) / len(xs)"
FULL = {"99.add": (2, "passed"), "99.clip": (1, "passed")}
STUBBED = {"99.add": (0, "not attempted"), "99.clip": (1, "passed")}


@dataclass
class Entry:
    """One student's notebook and its fair grade."""

    cells: list[str] | str  # code cells as typed, or the raw text of a file that is no notebook
    expect: dict[str, tuple[int, str]]  # task -> (points, status)
    notebook: str = "99_fixture.ipynb"
    says: dict[str, str] = field(default_factory=dict)  # task -> words its message holds
    noted: dict[str, str] = field(default_factory=dict)  # task -> words the instructor's notes hold
    inline: bool = True  # the inline check() must agree (False: what it cannot see, e.g. the grader's files)


def notebook(cells: list[str], metadata: dict | None = None) -> str:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    nb.metadata.update(metadata or {})
    return nbformat.writes(nb)


def solution_cells(name: str) -> list[str]:
    """The code cells of solutions/`name` (a real chapter's reference solution)."""
    cells = json.loads((ROOT / "solutions" / name).read_text())["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]


def with_habit(*habit: str) -> list[str]:
    """The fixture chapter's right answers, with a habit's cells between the setup and the answers."""
    return [IMPORT, *habit, GOOD_ADD, GOOD_CLIP]


# --------------------------------------------------------------------------- honest work

MX_SOLUTION = solution_cells("11_speed_exercises.ipynb")[3]  # def mx_quantize(x, fmt, rule): ...
assert 'if rule == "floor":' in MX_SOLUTION

HONEST = {
    "good": Entry([IMPORT, GOOD_ADD, GOOD_CLIP], FULL),
    "wrong": Entry(
        [IMPORT, WRONG_ADD, GOOD_CLIP], {"99.add": (0, "failed"), "99.clip": (1, "passed")}, says={"99.add": "returned"}
    ),
    "numpy_scalar": Entry(
        [IMPORT, "import numpy as np\n\ndef add(a, b):\n    return np.int64(a + b)", GOOD_CLIP], FULL
    ),
    "helper_defined_later": Entry(
        [IMPORT, "def add(a, b):\n    return plus(a, b)", GOOD_CLIP, "def plus(a, b):\n    return a + b"], FULL
    ),
    "deleted_cells": Entry(
        [IMPORT],
        {"99.add": (0, "not attempted"), "99.clip": (0, "not attempted")},
        says={"99.add": "`add` is not defined"},
    ),
    "by_hand": Entry([IMPORT, GOOD_MEAN], {"97.mean": (1, "passed")}, notebook="97_mean.ipynb"),
    "wrong_by_hand": Entry(
        [IMPORT, "def mean(xs):\n    return sum(xs) / (len(xs) + 1)"],
        {"97.mean": (0, "failed")},
        notebook="97_mean.ipynb",
    ),
    # chapter 11's MX quantizer as written in its solution, and with the two rules swapped
    "real_11_mx_by_hand": Entry(
        [*solution_cells("11_speed_exercises.ipynb")[:2], MX_SOLUTION],
        {"11.mx_quantize": (3, "passed")},
        notebook="11_speed_exercises.ipynb",
    ),
    "real_11_mx_rules_swapped": Entry(
        [*solution_cells("11_speed_exercises.ipynb")[:2], MX_SOLUTION.replace('rule == "floor"', 'rule != "floor"')],
        {"11.mx_quantize": (0, "failed")},
        notebook="11_speed_exercises.ipynb",
        says={"11.mx_quantize": "was asked"},
    ),
    "untouched_by_hand": Entry(
        [IMPORT, 'def mean(xs):\n    raise NotImplementedError("Exercise: write your solution here")'],
        {"97.mean": (0, "not attempted")},
        notebook="97_mean.ipynb",
        says={"97.mean": "still the exercise's stub"},
    ),
}

# --------------------------------------------------------------------------- habits: never a point lost

HABITS = {
    "shell_nvidia_smi": Entry(with_habit("!nvidia-smi"), FULL, noted={"99.add": "!nvidia-smi"}),
    "shell_pip_list": Entry(with_habit("!pip list"), FULL, noted={"99.add": "!pip list"}),
    "magic_pip_install": Entry(with_habit("%pip install -q tqdm"), FULL, noted={"99.add": "%pip install"}),
    "magic_autoreload": Entry(with_habit("%load_ext autoreload\n%autoreload 2"), FULL),
    "magic_config": Entry(with_habit('%config InlineBackend.figure_format = "retina"'), FULL),
    "magic_matplotlib": Entry(with_habit("%matplotlib inline"), FULL),
    "cell_magic_capture": Entry(with_habit('%%capture captured\nprint("quiet")'), FULL),
    "cell_magic_bash": Entry(with_habit("%%bash\necho hello"), FULL),
    "time_magic_defines_add": Entry([IMPORT, "%%time\ndef add(a, b):\n    return a + b", GOOD_CLIP], FULL),
    "time_line_magic_binds": Entry(
        [IMPORT, GOOD_ADD, "%time LIMIT = 3.0", "def clip(x):\n    return max(-LIMIT, min(LIMIT, x))"], FULL
    ),
    "timeit_a_call": Entry([IMPORT, GOOD_ADD, GOOD_CLIP, "%timeit add(1, 2)"], FULL),
    "help_line": Entry([IMPORT, GOOD_ADD, "add?", GOOD_CLIP, "clip??"], FULL),
    "shell_in_the_answers_cell": Entry(
        [
            IMPORT,
            "!nvidia-smi\nimport torch\ntorch.backends.cudnn.benchmark = True\n\n"
            "def add(a, b):\n    !echo adding\n    return a + b",
            GOOD_CLIP,
        ],
        FULL,
    ),
    "cudnn_benchmark": Entry(with_habit("import torch\ntorch.backends.cudnn.benchmark = True"), FULL),
    "allow_tf32": Entry(
        [
            IMPORT,
            "import torch\ntorch.backends.cuda.matmul.allow_tf32 = True",
            "def add(a, b):\n    return int(torch.tensor(a) + b)",
            GOOD_CLIP,
        ],
        FULL,
    ),
    "dynamo_config": Entry(with_habit("import torch._dynamo\ntorch._dynamo.config.suppress_errors = True"), FULL),
    "rcparams": Entry(with_habit('import matplotlib.pyplot as plt\nplt.rcParams["figure.figsize"] = (8, 3)'), FULL),
    "omp_threads": Entry(with_habit('import os\nos.environ["OMP_NUM_THREADS"] = "2"'), FULL),
    "pickle_results": Entry(
        with_habit('import pickle\nwith open("results.pkl", "wb") as f:\n    pickle.dump({"lr": 0.1}, f)'), FULL
    ),
    "importlib_reload": Entry(with_habit("import importlib, math\nimportlib.reload(math)"), FULL),
    "gc_collect": Entry(with_habit("import gc\ngc.collect()"), FULL),
    "ipython_display": Entry(
        with_habit('from IPython.display import display, Markdown\ndisplay(Markdown("**hi**"))'), FULL
    ),
    "simple_namespace_config": Entry(
        [
            IMPORT,
            "from types import SimpleNamespace\ncfg = SimpleNamespace(offset=0)",
            "cfg.offset = 0\nprint(vars(cfg))",
            "def add(a, b):\n    return a + b + cfg.offset",
            GOOD_CLIP,
        ],
        FULL,
    ),
    "eval_in_a_helper": Entry(
        [IMPORT, "def calc(expr):\n    return eval(expr)", "def add(a, b):\n    return calc(f'{a} + {b}')", GOOD_CLIP],
        FULL,
        noted={"99.add": "eval()"},
    ),
    "format_locals": Entry(with_habit('name = "Ada"\nprint("hello {name}".format(**locals()))'), FULL),
    "parameter_called_compile": Entry([IMPORT, "def add(a, b, compile=False):\n    return a + b", GOOD_CLIP], FULL),
    "colab_files_import": Entry(
        with_habit("try:\n    from google.colab import files\nexcept ImportError:\n    files = None"), FULL
    ),
    "pandas_not_installed": Entry(with_habit("import pandas as pd"), FULL),
    "forgotten_helper_module": Entry(with_habit("import my_helpers"), FULL),
    "tqdm_loop": Entry(with_habit("from tqdm.auto import tqdm\nfor _ in tqdm(range(3)):\n    pass"), FULL),
    "sys_path_insert": Entry(with_habit('import sys\nsys.path.insert(0, "..")'), FULL),
    "print_options_and_warnings": Entry(
        with_habit('import torch, warnings\ntorch.set_printoptions(precision=3)\nwarnings.filterwarnings("ignore")'),
        FULL,
    ),
    "logging_config": Entry(with_habit("import logging\nlogging.basicConfig(level=logging.INFO)"), FULL),
    "a_cell_that_raises": Entry(with_habit("1 / 0"), FULL),
    "config_dict_filled_later": Entry(
        [
            IMPORT,
            "CFG = {}",
            "CFG['offset'] = 0\nCFG.update(scale=1)",
            "def add(a, b):\n    return (a + b) * CFG['scale'] + CFG['offset']",
            GOOD_CLIP,
        ],
        FULL,
    ),
    "table_filled_by_a_function": Entry(
        [
            IMPORT,
            "TABLE = []",
            "def fill(t):\n    t.extend([0, 0])",
            "fill(TABLE)",
            "def add(a, b):\n    return a + b + sum(TABLE)",
            GOOD_CLIP,
        ],
        FULL,
    ),
    "global_set_by_setup": Entry(
        [
            IMPORT,
            "OFFSET = None\n\ndef setup():\n    global OFFSET\n    OFFSET = 0",
            "setup()",
            "def add(a, b):\n    return a + b + OFFSET",
            GOOD_CLIP,
        ],
        FULL,
    ),
    "future_annotations_and_hints": Entry(
        [
            IMPORT,
            "from __future__ import annotations\nimport numpy as np",
            "def add(a: np.ndarray, b: int) -> int:\n    return a + b",
            GOOD_CLIP,
        ],
        FULL,
    ),
    "checks_everything_twice": Entry(
        [IMPORT, GOOD_ADD, 'check("99.add", add)', GOOD_CLIP, 'check("99.clip", clip, LIMIT)', "assert add(1, 2) == 3"],
        FULL,
    ),
    "by_hand_importing_statistics_unused": Entry(
        [IMPORT, "import statistics, math", GOOD_MEAN], {"97.mean": (1, "passed")}, notebook="97_mean.ipynb"
    ),
    "by_hand_with_math_on_the_same_line": Entry(
        [IMPORT, "import statistics, math", "def mean(xs):\n    return math.fsum(xs) / len(xs)"],
        {"97.mean": (1, "passed")},
        notebook="97_mean.ipynb",
    ),
    # a real chapter's solution, with the habits a Colab student brings along
    "real_01_with_colab_habits": Entry(
        [
            *solution_cells("01_formats_exercises.ipynb")[:1],
            "!nvidia-smi\n%load_ext autoreload\n%autoreload 2",
            "import torch, gc\ntorch.backends.cudnn.benchmark = True\ngc.collect()",
            *solution_cells("01_formats_exercises.ipynb")[1:],
        ],
        {
            "01.decode_fp16": (3, "passed"),
            "01.round_to_bf16": (2, "passed"),
            "01.fp_fate": (2, "passed"),
            "01.bf16_dot_errors": (2, "passed"),
        },
        notebook="01_formats_exercises.ipynb",
    ),
    "real_04_with_settings": Entry(
        [
            *solution_cells("04_accumulation_exercises.ipynb")[:2],
            "torch.backends.cudnn.benchmark = True\ntorch.set_float32_matmul_precision('high')\n%matplotlib inline",
            *solution_cells("04_accumulation_exercises.ipynb")[2:],
        ],
        {"04.accumulate": (4, "passed")},
        notebook="04_accumulation_exercises.ipynb",
    ),
}

# --------------------------------------------------------------------------- forgeries: the fair grade

FORGED_ANSWER = "lambda *a, **k: {'results': [0] * 20}"
# chapter 11's check needs a newer torch than the course's floor: an older one grades its task "not graded"
FP8_SHORTCUT = (0, "failed") if torch_at_least(get_check("11.fp8_matmul").needs_torch) else (0, "not graded")
EXEC_PAYLOAD = base64.b64encode(b"import course_lib.tooling.task as t\nt.respond = " + FORGED_ANSWER.encode()).decode()
WRONG_LOOP = """
def accumulate(model, optimizer, scaler, micro_batches, loss_fn, dtype):
    device_type = next(model.parameters()).device.type
    total = sum(len(y) for _, y in micro_batches)
    optimizer.zero_grad(set_to_none=True)
    for x, y in micro_batches:
        with T.autocast(device_type, dtype=dtype, enabled=dtype is not None):
            loss = loss_fn(model(x), y) * (len(y) / total)
            scaler.scale(loss).backward()  # backward inside autocast: the mistake
    scaler.step(optimizer)
    scaler.update()
"""

FORGERIES = {
    "alias_of_the_grading_module": Entry(
        [
            IMPORT,
            STUB_ADD,
            GOOD_CLIP,
            "import course_lib.tooling.grading\nG = course_lib.tooling.grading\n"
            f"G.run_check = lambda *a, **k: ('passed', 'passed', None)\nG.judge_cells = {FORGED_ANSWER}",
        ],
        STUBBED,
    ),
    "alias_of_the_task_module": Entry(
        [
            IMPORT,
            STUB_ADD,
            GOOD_CLIP,
            f"import course_lib.tooling.task as T\nT.respond = {FORGED_ANSWER}\nT.run_probe = lambda *a: 0",
        ],
        STUBBED,
    ),
    "torch_aliased_and_patched_with_a_wrong_loop": Entry(
        [
            *solution_cells("04_accumulation_exercises.ipynb")[:2],
            "T = torch\nT.is_autocast_enabled = lambda *a, **k: False",
            WRONG_LOOP,
        ],
        {"04.accumulate": (0, "failed")},
        notebook="04_accumulation_exercises.ipynb",
        says={"04.accumulate": "backward"},
    ),
    "builtins_as_an_attribute_exec": Entry(
        [IMPORT, STUB_ADD, GOOD_CLIP, f"import base64\nprint.__self__.exec(base64.b64decode('{EXEC_PAYLOAD}'))"],
        STUBBED,
    ),
    "builtins_import_inside_a_by_hand_task": Entry(
        [IMPORT, "def mean(xs):\n    return print.__self__.__import__('statis' + 'tics').fmean(xs)"],
        {"97.mean": (0, "failed")},
        notebook="97_mean.ipynb",
        says={"97.mean": "which this task asks you not to use"},
    ),
    "struct_by_builtins_in_real_01": Entry(
        [
            *solution_cells("01_formats_exercises.ipynb")[:2],
            "def decode_fp16(bits):\n    s = print.__self__.__import__('str' + 'uct')\n"
            "    return s.unpack('<e', bits.to_bytes(2, 'little'))[0]",
        ],
        {
            "01.decode_fp16": (0, "failed"),
            "01.round_to_bf16": (0, "not attempted"),
            "01.fp_fate": (0, "not attempted"),
            "01.bf16_dot_errors": (0, "not attempted"),
        },
        notebook="01_formats_exercises.ipynb",
        says={"01.decode_fp16": "struct"},
    ),
    "sys_modules_by_a_computed_name": Entry(
        [
            IMPORT,
            STUB_ADD,
            GOOD_CLIP,
            "import os\nm = os.sys.modules['course_lib.tooling.' + 'task']\n"
            f"setattr(m, 'res' + 'pond', {FORGED_ANSWER})",
        ],
        STUBBED,
    ),
    "frames_from_a_traceback": Entry(
        [
            IMPORT,
            STUB_ADD,
            GOOD_CLIP,
            """
import json, os
def forge():
    try:
        raise ValueError
    except ValueError as exc:
        frame = getattr(exc.__traceback__, "tb_" + "frame")
    while frame is not None:
        if "nonce" in frame.f_locals:
            os.write(int(os.environ["AMP_ANSWER_FD"]), json.dumps({"nonce": frame.f_locals["nonce"],
                     "response": {"results": [0] * 20}}).encode() + b"\\n")
        frame = frame.f_back
import sys
sys.setprofile(lambda *a: forge())""",
        ],
        STUBBED,
    ),
    "subclasses_to_reach_the_channel": Entry(
        [
            IMPORT,
            STUB_ADD,
            GOOD_CLIP,
            """
for cls in getattr(object, "__subcl" + "asses__")():
    if cls.__name__ in ("_Channel", "Channel"):
        cls.send = lambda self, message: None""",
        ],
        STUBBED,
    ),
    "unparsable_help_line": Entry(
        [IMPORT, STUB_ADD, GOOD_CLIP, f"import course_lib.tooling.task as t\nt.respond = {FORGED_ANSWER}\nprint?"],
        STUBBED,
    ),
    "autocall_exec": Entry(
        [IMPORT, STUB_ADD, GOOD_CLIP, f"/exec 'import course_lib.tooling.task as t; t.respond = {FORGED_ANSWER}'"],
        STUBBED,
    ),
    "startup_file_then_a_crash": Entry(
        [
            IMPORT,
            """
import os
def add(a, b):
    for folder in (os.path.expanduser("~/.ipython/profile_default/startup"), os.path.expanduser("~")):
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "00-evil.py"), "w") as f:
            f.write("import course_lib.tooling.task as t; t.respond = lambda *a, **k: {'results': [0] * 20}")
        with open(os.path.join(os.getcwd(), "sitecustomize.py"), "w") as f:
            f.write("import course_lib.tooling.task as t; t.respond = lambda *a, **k: {'results': [0] * 20}")
    os._exit(1)""",
            GOOD_CLIP,
        ],
        {"99.add": (0, "crashed"), "99.clip": (1, "passed")},
    ),
    "thread_that_answers": Entry(
        [
            IMPORT,
            STUB_ADD,
            GOOD_CLIP,
            """
import json, os, threading, time
def spam():
    while True:
        os.write(int(os.environ["AMP_ANSWER_FD"]), b'{"nonce": "x", "response": {"results": []}}\\n')
        time.sleep(0.01)
threading.Thread(target=spam, daemon=True).start()""",
        ],
        STUBBED,
    ),
    "patched_builtins_import": Entry(
        [
            IMPORT,
            STUB_ADD,
            GOOD_CLIP,
            "import builtins\nreal = builtins.__import__\n"
            "builtins.__import__ = lambda name, *a, **k: real(name, *a, **k)\nbuiltins.abs = lambda x: 0",
        ],
        STUBBED,
    ),
    "atexit_answer": Entry(
        [IMPORT, STUB_ADD, GOOD_CLIP, "import atexit, os\natexit.register(lambda: os.write(3, b'{}\\n'))"], STUBBED
    ),
    "by_hand_via_importlib": Entry(
        [IMPORT, "import importlib\n\ndef mean(xs):\n    return importlib.import_module('statis' + 'tics').fmean(xs)"],
        {"97.mean": (0, "failed")},
        notebook="97_mean.ipynb",
    ),
    "by_hand_via_meta_path_removed": Entry(
        [
            IMPORT,
            "import sys\n\ndef mean(xs):\n    sys.meta_path[:] = [f for f in sys.meta_path "
            "if 'Absent' not in type(f).__name__]\n    import statistics\n    return statistics.fmean(xs)",
        ],
        {"97.mean": (0, "failed")},
        notebook="97_mean.ipynb",
    ),
    "by_hand_via_another_pythons_copy": Entry(
        [
            IMPORT,
            "import sys\n\ndef mean(xs):\n    sys.path.insert(0, '/usr/lib/python3.11')\n"
            "    sys.modules.pop('statistics', None)\n    import statistics\n    return statistics.fmean(xs)",
        ],
        {"97.mean": (0, "failed")},
        notebook="97_mean.ipynb",
    ),
    "by_hand_via_the_file": Entry(
        [
            IMPORT,
            "import sysconfig, os\n\ndef mean(xs):\n    path = os.path.join(sysconfig.get_paths()['stdlib'], "
            "'statistics.py')\n    ns = {}\n    exec(open(path).read(), ns)\n    return ns['fmean'](xs)",
        ],
        {"97.mean": (0, "failed")},
        notebook="97_mean.ipynb",
    ),
    "by_hand_via_a_subprocess": Entry(
        [
            IMPORT,
            "import json, subprocess, sys\n\ndef mean(xs):\n    code = 'import json, statistics, sys; "
            "print(statistics.fmean(json.loads(sys.argv[1])))'\n    out = subprocess.run([sys.executable, '-c', code, "
            "json.dumps(xs)], capture_output=True, text=True)\n    return float(out.stdout)",
        ],
        {"97.mean": (0, "failed")},
        notebook="97_mean.ipynb",
    ),
    "by_hand_via_a_default_argument": Entry(
        [IMPORT, "import statistics", "def mean(xs, f=statistics.fmean):\n    return f(xs)"],
        {"97.mean": (0, "failed")},
        notebook="97_mean.ipynb",
        says={"97.mean": "needs statistics"},
    ),
    "real_10_the_courses_model": Entry(
        [
            *solution_cells("10_memory_exercises.ipynb")[:2],
            "def block_saved_bytes(batch, seq, n_embd, n_head, precision):\n"
            "    m = __import__('course_lib.chapters.ch10.memory_' + 'model', fromlist=['x'])\n"
            "    return m.block_saved_bytes(batch, seq, n_embd, n_head, precision)",
        ],
        {"10.block_saved_bytes": (0, "failed")},
        notebook="10_memory_exercises.ipynb",
        says={"10.block_saved_bytes": "course_lib"},
    ),
    "real_11_the_courses_mx": Entry(
        [
            *solution_cells("11_speed_exercises.ipynb")[:2],
            "import importlib\nmx = importlib.import_module('course_lib.chapters.ch11.' + 'microscaling')",
            "def mx_quantize(x, fmt, rule):\n    q = mx.mx_quantize(x, fmt, rule)\n    return q.scales, q.data",
        ],
        {"11.mx_quantize": (0, "failed")},
        notebook="11_speed_exercises.ipynb",
        says={"11.mx_quantize": "course_lib"},
    ),
    "real_11_the_courses_fp8": Entry(
        [
            *solution_cells("11_speed_exercises.ipynb")[:2],
            "import importlib\nfp8 = importlib.import_module('course_lib.chapters.ch11.' + 'fp8')",
            "def fp8_matmul(a, b, granularity):\n    return fp8.scaled_matmul(a, b, granularity)",
        ],
        {"11.fp8_matmul": FP8_SHORTCUT},
        notebook="11_speed_exercises.ipynb",
        says={"11.fp8_matmul": "course_lib" if FP8_SHORTCUT[1] == "failed" else "needs torch"},
    ),
}

# --------------------------------------------------------------------------- hostile code: it costs its own task


def hostile(marker: Path, port: int, course: Path, subs: Path, out: Path) -> dict[str, Entry]:
    """Code that attacks the machine, the grader or the other tasks, placed where it runs: in what a
    task's function needs (code elsewhere in the notebook never runs when a task is judged)."""
    checks = course / "course_lib" / "tooling" / "checks" / "ch00.py"
    return {
        "kills_everything": Entry(
            [
                IMPORT,
                GOOD_ADD,
                """
import os, signal
LIMIT = 3.0
def clip(x):
    for pid in [int(p) for p in os.listdir("/proc") if p.isdigit()]:
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    return max(-LIMIT, min(LIMIT, x))""",
            ],
            FULL,
            inline=False,
        ),
        "writes_the_checkout": Entry(
            [
                IMPORT,
                f"""
import course_lib.tooling.task
def add(a, b):
    for path in [{str(checks)!r}, course_lib.tooling.task.__file__]:
        try:
            with open(path, "a") as f:
                f.write("\\nBACKDOOR = True\\n")
        except OSError:
            pass
    return a + b""",
                GOOD_CLIP,
            ],
            FULL,
            inline=False,
        ),
        "writes_home_for_the_next_task": Entry(
            [
                IMPORT,
                """
import os
def add(a, b):
    with open(os.path.expanduser("~/left-behind"), "w") as f:
        f.write("x")
    return a + b""",
                "import os\nLIMIT = 3.0\n\ndef clip(x):\n"
                "    if os.path.exists(os.path.expanduser('~/left-behind')):\n"
                "        return 0.0\n    return max(-LIMIT, min(LIMIT, x))",
            ],
            FULL,
        ),
        "leaves_a_daemon": Entry(
            [
                IMPORT,
                f"""
import os, time
def add(a, b):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(4)
            try:
                open({str(marker)!r}, "w").write("the daemon outlived its grading")
            finally:
                while True:
                    time.sleep(1)
        os._exit(0)
    return a + b""",
                GOOD_CLIP,
            ],
            FULL,
            inline=False,
        ),
        "reaches_the_network": Entry(
            [
                IMPORT,
                f"""
import socket
def add(a, b):
    for host in ("127.0.0.1", "localhost"):
        try:
            socket.create_connection((host, {port}), timeout=2).close()
        except OSError:
            pass
    return a + b""",
                GOOD_CLIP,
            ],
            FULL,
            inline=False,
        ),
        "talks_to_itself": Entry(
            [
                IMPORT,
                """
import socket
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen()
client = socket.create_connection(server.getsockname(), timeout=5)  # e.g. two DDP ranks of one submission
conn, _ = server.accept()
client.sendall(b"ok")
WORKS = conn.recv(2) == b"ok"
def add(a, b):
    return a + b if WORKS else 0""",
                GOOD_CLIP,
            ],
            FULL,
        ),
        "steals_answers_from_files": Entry(
            [
                IMPORT,
                f"""
import glob, json
def add(a, b):
    for pattern in [{str(course / "solutions" / "*.ipynb")!r}, {str(subs / "*" / "*.ipynb")!r},
                    {str(out / "gradebook.jsonl")!r}, "/tmp/**/*.ipynb"]:
        for path in glob.glob(pattern, recursive=True):
            return 0  # found something it could read: had it been there, it would copy the answers
    return None""",
                GOOD_CLIP,
            ],
            {"99.add": (0, "failed"), "99.clip": (1, "passed")},
            inline=False,
        ),
        "crashes_after_a_pass": Entry(
            [IMPORT, GOOD_ADD, "import os\nLIMIT = 3.0\n\ndef clip(x):\n    os._exit(1)"],
            {"99.add": (2, "passed"), "99.clip": (0, "crashed")},
            says={"99.clip": "stopped while this task was being checked"},
        ),
        "segfaults_after_a_pass": Entry(
            [IMPORT, GOOD_ADD, "import ctypes\nLIMIT = 3.0\n\ndef clip(x):\n    return ctypes.string_at(0)"],
            {"99.add": (2, "passed"), "99.clip": (0, "crashed")},
        ),
        "hangs_after_a_pass": Entry(
            [IMPORT, GOOD_ADD, "LIMIT = 3.0\n\ndef clip(x):\n    while True:\n        pass"],
            {"99.add": (2, "passed"), "99.clip": (0, "timed out")},
            says={"99.clip": "longer than 5 s"},
        ),
        "ignores_interrupts_and_hangs": Entry(
            [
                IMPORT,
                "import signal\n\ndef add(a, b):\n"
                "    signal.signal(signal.SIGINT, lambda *a: None)\n    while True:\n"
                "        pass",
                GOOD_CLIP,
            ],
            {"99.add": (0, "timed out"), "99.clip": (1, "passed")},
        ),
        "interrupts_after_a_pass": Entry(
            [IMPORT, GOOD_ADD, "LIMIT = 3.0\n\ndef clip(x):\n    raise KeyboardInterrupt"],
            {"99.add": (2, "passed"), "99.clip": (0, "failed")},
            says={"99.clip": "KeyboardInterrupt"},
        ),
        "hangs_while_its_code_loads": Entry(
            [
                IMPORT,
                GOOD_ADD,
                "def slow():\n    while True:\n        pass",
                "LIMIT = slow()",
                "def clip(x):\n    return max(-LIMIT, min(LIMIT, x))",
            ],
            {"99.add": (2, "passed"), "99.clip": (0, "timed out")},
            says={"99.clip": "cell 4"},
        ),
        "hangs_in_a_cell_no_task_needs": Entry(with_habit("while True:\n    pass"), FULL),
        "floods_stdout": Entry(
            [
                IMPORT,
                "NOISE = print('x' * 40_000_000)\n\ndef add(a, b):\n    print('y' * 1000)\n"
                "    return a + b if NOISE is None else 0",
                GOOD_CLIP,
            ],
            FULL,
        ),
        "dishonest_eq": Entry(
            [
                IMPORT,
                """
class Anything:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
def add(a, b):
    return Anything()""",
                GOOD_CLIP,
            ],
            {"99.add": (0, "failed"), "99.clip": (1, "passed")},
            says={"99.add": "Anything object"},
        ),
        "builds_a_2_gib_tensor": Entry(
            [
                IMPORT,
                "import torch\nBIG = torch.ones(2**29)  # 2 GiB, resident\nBIG += 1",
                "def add(a, b):\n    return a + b + int(BIG[0].item()) - 2",
                GOOD_CLIP,
            ],
            FULL,
        ),
        # what travels back: answers too large, too deep or too long, floods on the channel
        "answers_a_10001_digit_integer": Entry(
            [IMPORT, "def add(a, b):\n    return 10 ** 10_000", GOOD_CLIP],
            {"99.add": (0, "failed"), "99.clip": (1, "passed")},
            says={"99.add": "too large to send back"},
        ),
        "answers_100000_deep": Entry(
            [
                IMPORT,
                "def add(a, b):\n    x = []\n    for _ in range(100_000):\n        x = [x]\n    return x",
                GOOD_CLIP,
            ],
            {"99.add": (0, "failed"), "99.clip": (1, "passed")},
            says={"99.add": "add returned"},
        ),
        "writes_a_66_mib_line": Entry(
            [
                IMPORT,
                """
import os
SENT = []
def add(a, b):
    if not SENT:  # once: 66 MiB without a line break, then the answer behind it
        fd = int(os.environ["AMP_ANSWER_FD"])
        for _ in range(66):
            os.write(fd, b"1" * (1 << 20))
        SENT.append(True)
    return a + b""",
                GOOD_CLIP,
            ],
            {"99.add": (0, "failed"), "99.clip": (1, "passed")},
            says={"99.add": "longer than 64 MiB"},
        ),
        "floods_the_channel_at_full_speed": Entry(
            [
                IMPORT,
                """
import os
def add(a, b):
    fd, chunk = int(os.environ["AMP_ANSWER_FD"]), b"w" * (1 << 20)
    while True:
        os.write(fd, chunk)""",
                GOOD_CLIP,
            ],
            {"99.add": (0, "failed"), "99.clip": (1, "passed")},
            says={"99.add": "more than 256 MiB"},
        ),
        "floods_the_channel_slowly_past_its_time": Entry(
            [
                IMPORT,
                GOOD_ADD,
                """
import os, signal, time
LIMIT = 3.0
def clip(x):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    end = time.monotonic() + 60
    while time.monotonic() < end:
        os.write(int(os.environ["AMP_ANSWER_FD"]), b"z" * 65536)
        time.sleep(0.005)""",
            ],
            {"99.add": (2, "passed"), "99.clip": (0, "timed out")},
        ),
        "millions_of_lines_while_loading": Entry(
            [
                IMPORT,
                """
import os
def flood():
    fd = int(os.environ["AMP_ANSWER_FD"])
    os.write(fd, b"1\\n" * 3_000_000)  # millions of tiny lines
    os.write(fd, b"[" * 100_000 + b"\\n")  # deep, but no message of the task's: never parsed
FLOODED = flood()
def add(a, b):
    return a + b if FLOODED is None else 0""",
                GOOD_CLIP,
            ],
            FULL,
            noted={"99.add": "ignored"},
            inline=False,
        ),
    }


def expected_rows(entries: dict[str, Entry]) -> dict[tuple[str, str], tuple[int, str]]:
    """(student, task) -> (points, status), for every task of every entry."""
    return {(student, task): grade for student, e in entries.items() for task, grade in e.expect.items()}


def write_class(entries: dict[str, Entry], subs: Path) -> None:
    """Each entry as subs/<student>/<notebook>."""
    for student, e in entries.items():
        (subs / student).mkdir(parents=True, exist_ok=True)
        text = e.cells if isinstance(e.cells, str) else notebook(e.cells)
        (subs / student / e.notebook).write_text(text)
