"""Grading round 3, class 4 (issue 27): nothing the kernel runs can forge a grade.

Anything in the student's kernel can be rewritten by the student's code, so the grader judges from
the notebook's source (read in its own process, course_lib/tooling/source_rules.py) and from the
values the functions return. Each notebook below forged a grade, or hid a forbidden call, against
the previous grader; here the real grader (`python -m course_lib.tooling.grader`, as `make grade`
runs it) grades them all in one batch next to honest work, and each gets its fair grade.
"""

from __future__ import annotations

import os
import time

import pytest
from test_grader import (
    GOOD_ADD,
    GOOD_CLIP,
    IMPORT,
    NAMESPACES,
    STUB_ADD,
    by_student,
    course_copy,
    fixture_checks,
    grade,
    notebook,
)

STUB_NEGATE = 'def negate(x):\n    raise NotImplementedError("Exercise: write your solution here")'
GOOD_NEGATE = "def negate(x):\n    return -x"
WRONG_NEGATE = "def negate(x):\n    return x"

# A replacement for the kernel-side task runner that answers every task correctly without calling
# the notebook's functions: it passed with stubs before.
FAKE_SERVE = '''
def fake_serve(request, namespace):
    import json, os
    answers = {"99.add": lambda c: c[0] + c[1], "99.clip": lambda c: [3.0, max(-3.0, min(3.0, c))],
               "97.negate": lambda c: -c}
    results = [answers[request["name"]](c) for c in request["cases"]]
    line = json.dumps({"nonce": request["nonce"], "response": {"results": results}}) + "\\n"
    os.write(int(os.environ["AMP_ANSWER_FD"]), line.encode())
'''

CLASS_99 = {
    "honest": [IMPORT, GOOD_ADD, GOOD_CLIP],
    # the runner replaced, in every way there is to say it
    "replaces_serve": [IMPORT, STUB_ADD, GOOD_CLIP, FAKE_SERVE + "import course_lib.tooling.grading as g\n"
                                                                 "g.serve = fake_serve"],
    "replaces_serve_via_setattr": [IMPORT, STUB_ADD, FAKE_SERVE + "from course_lib.tooling import grading\n"
                                                                  "setattr(grading, 'serve', fake_serve)"],
    "replaces_serve_via_vars": [IMPORT, STUB_ADD, FAKE_SERVE + "from course_lib.tooling import grading\n"
                                                               "vars(grading)['serve'] = fake_serve"],
    "replaces_serve_via_exec": [IMPORT, STUB_ADD, FAKE_SERVE + "exec('import course_lib.tooling.grading as g; "
                                                               "g.serve = fake_serve')"],
    "patches_the_probes": [IMPORT, STUB_ADD, "import course_lib.tooling.probes as p\n"
                                             "p.find = lambda name: (lambda case, f: case[0] + case[1])"],
    # the nonce read from where the grader's code keeps it, then an answer of its own
    "nonce_from_the_frame": [IMPORT, """
import json, os, sys
def add(a, b):
    frame = sys._getframe(1)
    while frame is not None and "nonce" not in frame.f_locals:
        frame = frame.f_back
    if frame is not None:
        results = [x + y for x, y in frame.f_locals["request"]["cases"]]
        line = json.dumps({"nonce": frame.f_locals["nonce"], "response": {"results": results}}) + "\\n"
        os.write(int(os.environ["AMP_ANSWER_FD"]), line.encode())
        os._exit(0)
    return 0""", GOOD_CLIP],
    "nonce_from_the_history": [IMPORT, """
import ast, re
def add(a, b):
    request = ast.literal_eval(re.search(r"serve\\((\\{.*\\}), globals", In[-1], re.S).group(1))
    return 0""", GOOD_CLIP],
    "nonce_from_a_traceback": [IMPORT, """
def add(a, b):
    try:
        raise ValueError
    except ValueError as e:
        frame = e.__traceback__.tb_frame.f_back
    return 0""", GOOD_CLIP],
    "stub_with_a_hook": [IMPORT, STUB_ADD, GOOD_CLIP,
                         "get_ipython().events.register('pre_run_cell', lambda info: None)"],
    # one notebook of each other class of issue 27, in the same batch
    "answers_100000_deep": [IMPORT, "def add(a, b):\n    x = []\n    for _ in range(100_000):\n        x = [x]\n"
                                    "    return x", GOOD_CLIP],  # class 1, through the function's own answer
    # classes 1 and 2, from a module the notebook writes, where the reading cannot see
    "floods_from_a_written_module": [IMPORT, GOOD_ADD, GOOD_CLIP, "open('flood.py', 'w').write("
                                     "'import os\\nwhile True: os.write(3, b\"[\" * 65536)')\nimport flood"],
    "builds_a_2_gib_tensor": [IMPORT, "import torch\nBIG = torch.ones(2**29)  # 2 GiB, resident\nBIG += 1",
                              "def add(a, b):\n    return a + b + int(BIG[0].item()) - 2", GOOD_CLIP],  # class 3
}

CLASS_97 = {
    "by_hand": [IMPORT, GOOD_NEGATE],
    "wrong_by_hand": [IMPORT, WRONG_NEGATE],
    "untouched": [IMPORT, STUB_NEGATE],
    # the forbidden module, hidden from a profiler in the kernel (a C function calling a C function)
    "through_map": [IMPORT, "import operator\ndef negate(x):\n    return list(map(operator.neg, [x]))[0]"],
    "renamed_in_another_cell": [IMPORT, "from operator import neg as minus", "N = minus",
                                "def negate(x):\n    return N(x)"],
    "in_a_default_argument": [IMPORT, "import operator", "def negate(x, f=operator.neg):\n    return f(x)"],
    "imported_by_name": [IMPORT, "def negate(x):\n    return __import__('oper' + 'ator').neg(x)"],
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory) -> dict:
    if not NAMESPACES:
        pytest.skip("this machine cannot create user namespaces")
    tmp = tmp_path_factory.mktemp("round3")
    course = course_copy(tmp / "course")
    home = tmp / "home"
    home.mkdir()
    subs = tmp / "submissions"
    for chapter, roster in (("99_fixture", CLASS_99), ("97_negate", CLASS_97)):
        for student, cells in roster.items():
            (subs / student).mkdir(parents=True, exist_ok=True)
            (subs / student / f"{chapter}.ipynb").write_text(notebook(cells))
    checks = fixture_checks(course)
    env = {**checks, "COURSE_EXTRA_CHECKS": os.pathsep.join(
        [checks["COURSE_EXTRA_CHECKS"], str(course / "tests" / "fixtures" / "checks_ch97.py")])}
    started = time.monotonic()
    proc = grade(course, subs, tmp / "out", home, env_extra=env)
    return {"proc": proc, "table": by_student(tmp / "out"), "seconds": time.monotonic() - started}


def row(graded: dict, student: str, task: str) -> tuple[int, str, str]:
    r = graded["table"][student][task]
    return r["points"], r["status"], r["message"]


@pytest.mark.skipif(not NAMESPACES, reason="this machine cannot create user namespaces")
def test_the_batch_finishes_and_honest_work_keeps_its_grade(graded):
    assert graded["proc"].returncode == 0, graded["proc"].stdout + graded["proc"].stderr
    assert row(graded, "honest", "99.add")[:2] == (2, "passed")
    assert row(graded, "honest", "99.clip")[:2] == (1, "passed")
    assert row(graded, "by_hand", "97.negate")[:2] == (1, "passed")
    assert row(graded, "wrong_by_hand", "97.negate")[:2] == (0, "failed")
    assert row(graded, "untouched", "97.negate")[:2] == (0, "not attempted")


@pytest.mark.skipif(not NAMESPACES, reason="this machine cannot create user namespaces")
@pytest.mark.parametrize("student, where", [
    ("replaces_serve", "assigning to course_lib.tooling.grading"),
    ("replaces_serve_via_setattr", "setattr"),
    ("replaces_serve_via_vars", "vars"),
    ("replaces_serve_via_exec", "exec"),
    ("patches_the_probes", "assigning to course_lib.tooling.probes"),
    ("nonce_from_the_frame", "sys._getframe"),
    ("nonce_from_the_history", "In"),
    ("nonce_from_a_traceback", ".f_back"),
    ("stub_with_a_hook", "get_ipython"),
])
def test_code_that_reaches_into_the_grader_earns_nothing_and_is_named(graded, student, where):
    for task in graded["table"][student]:
        points, status, message = row(graded, student, task)
        assert (points, status) == (0, "not graded"), (task, message)
        assert where in message and "code cell" in message and "not graded automatically" in message


@pytest.mark.skipif(not NAMESPACES, reason="this machine cannot create user namespaces")
def test_one_notebook_of_each_class_gets_its_fair_grade_in_one_batch(graded):
    """Class 1: an answer nested 100,000 deep fails with a reason; classes 1 and 2 through a module the
    notebook wrote (which the reading cannot see): not graded, named; class 3: a correct answer next to a
    2 GiB tensor passes under the default 6 GiB cap (resident memory, not address space)."""
    points, status, message = row(graded, "answers_100000_deep", "99.add")
    assert (points, status) == (0, "failed") and "add returned" in message, message
    assert row(graded, "answers_100000_deep", "99.clip")[:2] == (1, "passed")
    for task in ("99.add", "99.clip"):
        points, status, message = row(graded, "floods_from_a_written_module", task)
        assert (points, status) == (0, "not graded") and "import flood" in message
    assert row(graded, "builds_a_2_gib_tensor", "99.add")[:2] == (2, "passed")
    assert row(graded, "builds_a_2_gib_tensor", "99.clip")[:2] == (1, "passed")
    assert graded["seconds"] < 180, f"the batch took {graded['seconds']:.0f} s"


@pytest.mark.skipif(not NAMESPACES, reason="this machine cannot create user namespaces")
@pytest.mark.parametrize("student, what", [
    ("through_map", "operator.neg"),
    ("renamed_in_another_cell", "operator.neg"),
    ("in_a_default_argument", "operator.neg"),
])
def test_a_forbidden_call_hidden_from_the_kernel_is_read_in_the_source(graded, student, what):
    points, status, message = row(graded, student, "97.negate")
    assert (points, status) == (0, "failed")
    assert what in message and "which this task asks you not to use: write the minus sign yourself" in message


@pytest.mark.skipif(not NAMESPACES, reason="this machine cannot create user namespaces")
def test_a_dynamic_import_is_not_graded_rather_than_trusted(graded):
    points, status, message = row(graded, "imported_by_name", "97.negate")
    assert (points, status) == (0, "not graded") and "__import__" in message
