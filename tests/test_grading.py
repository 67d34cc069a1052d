"""How a check is written (course_lib.tooling.checkbase), what the task process sends back
(course_lib.tooling.task) and what the learner sees inline (course_lib.tooling.grading).

The same three steps run inline and in the batch grader: cases (the judge's process), run (the task
process), judge (the judge's process); between run and judge every answer becomes plain data and
crosses JSON. Inline, check() reads the notebook's code from IPython's history and judges it exactly
as the batch grader does (tests/test_grader.py compares the two on a whole class).
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from course_lib.tooling import grading, probes, task
from course_lib.tooling.checkbase import Check, CheckFailure, judge_response, register, registered
from course_lib.tooling.checks import get_check
from course_lib.tooling.grading import check
from course_lib.tooling.task import respond, to_plain

ROOT = Path(__file__).resolve().parents[1]


@register
class Double(Check):
    name, args, points, hint = "98.double", ("double",), 2, "multiply by two"
    time_limit = 3.0

    def cases(self, rng: random.Random) -> list:
        return [rng.randint(-1000, 1000) for _ in range(5)]

    def run(self, case, double):
        return double(case)

    def judge(self, cases, results):
        for x, got in zip(cases, results):
            if got != 2 * x:
                raise CheckFailure(f"double({x!r}) returned {got!r}, expected {2 * x!r}")


@register
class NoMath(Check):
    name, args, points = "98.no_torch", ("f",), 1
    forbidden, forbidden_why = ("torch",), "use plain Python"

    def cases(self, rng: random.Random) -> list:
        return [1.5]

    def run(self, case, f):
        return f(case)

    def judge(self, cases, results):
        if results != [3.0]:
            raise CheckFailure("wrong")


def _stub(x):
    raise NotImplementedError("Exercise: write your solution here")


class LiesAboutEquality:
    def __eq__(self, other):
        return True

    def __lt__(self, other):
        return True


class FloatThatLies(float):
    def __eq__(self, other):
        return True


# --------------------------------------------------------------------------- plain data


def test_numpy_and_torch_scalars_become_python_numbers():
    assert to_plain(np.float32(1.5)) == 1.5 and type(to_plain(np.float32(1.5))) is float
    assert type(to_plain(np.int64(7))) is int and type(to_plain(np.bool_(True))) is bool
    assert to_plain(torch.tensor(2.5)) == 2.5 and to_plain(torch.float16) == {"dtype": "float16"}
    assert to_plain(torch.ones(2, dtype=torch.bfloat16)) == {"array": [1.0, 1.0], "dtype": "bfloat16"}
    assert to_plain(np.arange(3)) == {"array": [0, 1, 2], "dtype": "int64"}
    assert to_plain(("bf16", False, {"k": [1, None]})) == ["bf16", False, {"k": [1, None]}]


def test_objects_that_lie_are_refused_and_subclasses_lose_their_overrides():
    with pytest.raises(task.NotPlain, match="LiesAboutEquality"):
        to_plain(LiesAboutEquality())
    plain = to_plain(FloatThatLies(2.0))
    assert type(plain) is float and plain != 3.0
    with pytest.raises(task.NotPlain):
        to_plain({1: "non-string key"})


def test_an_integer_too_long_to_send_is_said_to_be_so():
    """JSON cannot carry an integer of more than 4,300 digits: the answer says what it was, not that the
    grading helpers went missing."""
    assert to_plain(10**3000) == 10**3000
    with pytest.raises(task.NotPlain, match="10,0.. digits, too large to send back"):
        to_plain(10**10_000)
    response = respond(None, [lambda x: 10**10_000], [1])
    status, message = judge_response(get_check("98.double"), [1], json.loads(json.dumps(response)))
    assert status == "failed" and "too large to send back" in message


# --------------------------------------------------------------------------- kernel side, grader side


def test_respond_reports_what_happened_and_judge_words_it_for_a_student():
    c = get_check("98.double")
    cases = [4, 5]
    assert respond(None, [_stub], cases) == {"not_attempted": True}
    assert judge_response(c, cases, {"missing": "double"})[0] == "not attempted"
    raised = respond(None, [lambda x: 1 / 0 if x == 5 else 2 * x], cases)
    assert raised == {"raised": "ZeroDivisionError: division by zero", "at": 1, "results": [8]}
    assert judge_response(c, cases, raised) == (
        "failed",
        "double raised ZeroDivisionError: division by zero on double(5)",
    )
    lying = respond(None, [lambda x: LiesAboutEquality()], cases)
    status, message = judge_response(c, cases, json.loads(json.dumps(lying)))
    assert status == "failed" and "LiesAboutEquality object" in message
    assert judge_response(c, cases, {"results": [8, 10]}) == ("passed", "passed")
    assert judge_response(c, cases, {"results": [8]})[0] == "failed"  # answers must match the questions
    assert judge_response(c, cases, "passed")[0] == "failed"  # a claim is not an answer


def test_a_torch_error_that_is_a_not_implemented_error_is_not_mistaken_for_the_stub():
    def uses_missing_kernel(x):
        raise NotImplementedError("Could not run 'aten::foo' with arguments from the 'Meta' backend")

    response = respond(None, [uses_missing_kernel], [1])
    assert "raised" in response and "aten::foo" in response["raised"]


def test_a_forbidden_module_is_absent_from_the_task_process_and_named():
    """What a task forbids cannot be imported where it is judged, however the import is spelled; the
    check's own modules (the probe's torch) are imported before the learner's code and stay usable."""
    for source in (
        "import torch\ndef f(x):\n    return torch.tensor(x).mul(2).item()",
        "def f(x):\n    return __import__('to' + 'rch').tensor(x).mul(2).item()",
    ):
        status, message, _, _ = grading.judge_cells("98.no_torch", [source])
        assert status == "failed" and "torch" in message and "use plain Python" in message, message
    assert grading.judge_cells("98.no_torch", ["def f(x):\n    return 2 * x"])[:2] == ("passed", "passed")


# --------------------------------------------------------------------------- inline check()


class Shell:
    """Enough of IPython's shell for check(): the history of the cells a kernel ran, as typed."""

    def __init__(self, cells: list[str]) -> None:
        self.history_manager = type("History", (), {"input_hist_raw": ["", *cells]})()


@pytest.fixture
def notebook(monkeypatch):
    """Run check() as in a notebook whose cells (as typed) are the given ones; the fixture chapter 99's
    checks are the ones a fresh judging process finds."""
    import builtins

    fixtures = ROOT / "tests" / "fixtures"
    monkeypatch.setenv("COURSE_EXTRA_CHECKS", str(fixtures / "checks_ch99.py"))
    monkeypatch.setenv("COURSE_EXTRA_PROBES", str(fixtures / "probes_ch99.py"))

    def ran(*cells: str) -> None:
        monkeypatch.setattr(builtins, "get_ipython", lambda: Shell(list(cells)), raising=False)

    return ran


def test_check_prints_one_line_on_a_pass_and_echoes_nothing(capsys, notebook):
    notebook("!nvidia-smi\nimport os", "def add(a, b):\n    return a + b", 'check("99.add", add)')
    assert check("99.add", lambda a, b: a + b) is None  # no True/False echoed under the line in a notebook
    assert capsys.readouterr().out == "✅ 99.add — passed (2/2 points)\n"


def test_inline_the_notebooks_code_is_judged_not_the_object_passed(capsys, notebook):
    """As the grader judges it: the statements `add` needs, in a process of its own, judged by a fresh
    process; a cell that patches the judging code, in the notebook or in this kernel, changes nothing."""
    notebook(
        "def add(a, b):\n    return a + b + 1",
        "import course_lib.tooling.grading as g\ng.judge_cells = lambda *a, **k: ('passed', 'passed', [], None)",
    )
    grading.judge_cells, real = (lambda *a, **k: ("passed", "passed", [], None)), grading.judge_cells
    try:
        check("99.add", lambda a, b: a + b)
    finally:
        grading.judge_cells = real
    out = capsys.readouterr().out
    assert out.startswith("❌ 99.add — add(") and "the grader ran only what add needs: cell 1 of" in out, out


def test_outside_a_notebook_check_judges_the_object_here_and_says_so(capsys):
    check("98.double", lambda x: 2 * x)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "✅ 98.double — passed (2/2 points)" and "judged in this process" in out[1]


def test_check_prints_the_hint_after_a_failed_attempt_only(capsys):  # judged here: no notebook
    check("98.double", lambda x: x + x + 1)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("❌ 98.double — double(") and "returned" in out[0] and "expected" in out[0]
    assert out[-1] == "   hint: multiply by two" and len(out) == 2


def test_a_long_message_wraps_within_100_characters_between_words(capsys):
    words = " ".join(f"word{i:03d}" for i in range(60))

    def raises(x):
        raise ValueError(words)

    check("98.double", raises)
    out = capsys.readouterr().out.splitlines()
    assert len(out) > 2 and all(len(line) <= 100 for line in out)
    tokens = re.findall(r"\bword\w*", " ".join(out[:-1]))
    assert len(tokens) > 20 and all(re.fullmatch(r"word\d{3}", t) for t in tokens)  # no word cut in two
    assert out[1].startswith("   ") and out[-1] == "   hint: multiply by two"
    check("98.double", _stub)
    assert capsys.readouterr().out == "❌ 98.double — not attempted yet: the cell still raises NotImplementedError\n"


def test_check_shows_expected_and_got_with_repr(capsys):
    check("98.double", lambda x: str(2 * x))
    line = capsys.readouterr().out.splitlines()[0]
    assert "returned '" in line  # a string answer is shown as a string, not as the number it spells


def test_check_never_raises_and_says_what_is_wrong(capsys):
    check("98.nope", lambda x: x)
    assert "there is no check called '98.nope'" in capsys.readouterr().out
    check("98.double")
    assert "takes 1 object(s): double" in capsys.readouterr().out
    check("98.double", lambda x: (_ for _ in ()).throw(SystemExit(3)))
    assert "raised SystemExit: 3" in capsys.readouterr().out


def test_check_stops_an_endless_loop_at_the_time_limit(capsys):
    def spin(x):
        while True:
            pass

    check("98.double", spin)
    assert "took longer than 3 s" in capsys.readouterr().out


def test_inside_the_batch_grader_check_is_silent(capsys, monkeypatch):
    monkeypatch.setenv("AMP_COURSE_GRADING", "1")
    check("98.double", lambda x: 2 * x)
    assert capsys.readouterr().out == ""


def test_register_rejects_malformed_checks():
    with pytest.raises(ValueError, match="must look like"):
        register(type("Bad", (Check,), {"name": "no-dot", "args": ("f",)}))
    with pytest.raises(ValueError, match="global names"):
        register(type("Bad", (Check,), {"name": "98.bad", "args": ("not an identifier",)}))
    with pytest.raises(ValueError, match="registered twice"):
        register(type("Other", (Check,), {"name": "98.double", "args": ("f",)}))


def test_check_modules_import_cleanly():
    import course_lib.tooling.checks as checks

    checks.load()  # every chapter
    assert checks.errors == {}
    assert {c.name.split(".")[0] for c in registered().values()} >= {"00", "01", "02"}


def test_no_course_check_runs_code_of_its_own_in_the_task_process():
    """No sandbox holds a check module: a course check's task side is its probe alone."""
    from course_lib.tooling import checks

    checks.load()
    own = [
        c.name
        for c in registered().values()
        if type(c).__module__.startswith("course_lib.tooling.checks") and type(c).run is not Check.run
    ]
    assert not own, f"these checks override run(); move it to course_lib/tooling/probes/chNN.py: {own}"


class Secret(Check):
    """A check whose probe asks the grader: the kernel sees `public`, the host sees the whole case."""

    name, args, points = "98.secret", ("f",), 1

    def cases(self, rng: random.Random) -> list:
        return [{"shown": 3, "hidden": 7}]

    def public(self, case: dict) -> dict:
        return {"shown": case["shown"]}

    def run(self, case, f):  # stands for a probe in probes/ch98.py
        return [case, f(probes.ask({"want": "hidden"}))]

    def host(self, case: dict, request: dict) -> int:
        case.setdefault("asked", []).append(request)
        return case["hidden"]

    def judge(self, cases, results):
        (case,), ((seen, got),) = cases, results
        if seen != {"shown": 3} or got != 14 or case["asked"] != [{"want": "hidden"}]:
            raise CheckFailure(f"saw {seen}, returned {got}")


def test_the_kernel_sees_the_public_case_and_the_host_answers_with_the_full_one():
    status, message, _ = grading.run_check("98.secret", lambda x: 2 * x) if register(Secret) else (None, None, None)
    assert (status, message) == ("passed", "passed")


def test_asking_the_host_outside_a_task_is_an_error():
    with pytest.raises(RuntimeError, match="only while a check runs"):
        probes.ask({"anything": 1})


@pytest.mark.slow
def test_in_a_real_kernel_check_reads_the_cells_run_so_far_and_judges_them_as_the_grader_does(tmp_path):
    """As a learner runs it: cells executed in a Jupyter kernel, history kept. The habit cell (a shell
    line) does not matter; the cell that patches the judging code does not run where add is judged."""
    import nbformat
    from grading_class import IMPORT
    from grading_class import notebook as make_notebook
    from nbclient import NotebookClient

    fixtures = ROOT / "tests" / "fixtures"
    cells = [
        IMPORT,
        "!echo habit",
        "def add(a, b):\n    return a - b",
        "import course_lib.tooling.grading as g\ng.judge_cells = lambda *a, **k: ('passed', 'passed', [], None)",
        'check("99.add", add)',
        "def add(a, b):\n    return a + b",
        'check("99.add", add)',
    ]
    nb = nbformat.reads(make_notebook(cells), as_version=4)
    env = {
        **os.environ,
        "COURSE_EXTRA_CHECKS": str(fixtures / "checks_ch99.py"),
        "COURSE_EXTRA_PROBES": str(fixtures / "probes_ch99.py"),
        "PYTHONPATH": str(ROOT),
    }
    env.pop("AMP_COURSE_GRADING", None)
    client = NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.km = client.create_kernel_manager()
    client.start_new_kernel(env=env)
    client.start_new_kernel_client()
    try:
        for i, cell in enumerate(nb.cells):
            client.execute_cell(cell, i)
    finally:
        client._cleanup_kernel() if hasattr(client, "_cleanup_kernel") else client.km.shutdown_kernel(now=True)
    out = ["".join(o.get("text", "") for o in c.outputs) for c in nb.cells]
    assert out[4].startswith("❌ 99.add — add(") and "returned" in out[4], out[4]  # the patch did not help
    assert out[6] == "✅ 99.add — passed (2/2 points)\n", out[6]
