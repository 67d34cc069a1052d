"""course_lib.tooling.grading: how a check is written, and what the learner sees inline.

The same three steps run inline and in the batch grader: cases (grader), run (kernel), judge
(grader); between run and judge every answer becomes plain data and crosses JSON.
"""
from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch

from course_lib.tooling import grading
from course_lib.tooling.grading import Check, CheckFailure, check, judge_response, register, respond, to_plain


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
    with pytest.raises(grading.NotPlain, match="LiesAboutEquality"):
        to_plain(LiesAboutEquality())
    plain = to_plain(FloatThatLies(2.0))
    assert type(plain) is float and plain != 3.0
    with pytest.raises(grading.NotPlain):
        to_plain({1: "non-string key"})


# --------------------------------------------------------------------------- kernel side, grader side

def test_respond_reports_what_happened_and_judge_words_it_for_a_student():
    c = grading.get_check("98.double")
    cases = [4, 5]
    assert respond(c, cases, {}) == {"missing": "double"}
    assert respond(c, cases, {"double": _stub}) == {"not_attempted": True}
    assert judge_response(c, cases, {"missing": "double"})[0] == "not attempted"
    raised = respond(c, cases, {"double": lambda x: 1 / 0 if x == 5 else 2 * x})
    assert raised == {"raised": "ZeroDivisionError: division by zero", "at": 1, "results": [8]}
    assert judge_response(c, cases, raised) == ("failed", "double raised ZeroDivisionError: division by zero "
                                                          "on double(5)")
    lying = respond(c, cases, {"double": lambda x: LiesAboutEquality()})
    status, message = judge_response(c, cases, json.loads(json.dumps(lying)))
    assert status == "failed" and "LiesAboutEquality object" in message
    assert judge_response(c, cases, {"results": [8, 10]}) == ("passed", "passed")
    assert judge_response(c, cases, {"results": [8]})[0] == "failed"  # answers must match the questions
    assert judge_response(c, cases, "passed")[0] == "failed"  # a claim is not an answer


def test_a_torch_error_that_is_a_not_implemented_error_is_not_mistaken_for_the_stub():
    def uses_missing_kernel(x):
        raise NotImplementedError("Could not run 'aten::foo' with arguments from the 'Meta' backend")
    response = respond(grading.get_check("98.double"), [1], {"double": uses_missing_kernel})
    assert "raised" in response and "aten::foo" in response["raised"]


def notebook_function(source: str) -> object:
    """A function defined the way a notebook cell defines it: in module __main__."""
    namespace = {"__name__": "__main__", "torch": torch}
    exec(source, namespace)
    return namespace["f"]


def test_a_forbidden_call_made_by_the_learner_is_named_but_the_checks_own_calls_are_not():
    c = grading.get_check("98.no_torch")
    learner = notebook_function("def f(x):\n    return torch.tensor(x).mul(2).item()")
    response = respond(c, c.cases(random.Random(0)), {"f": learner})
    status, message = judge_response(c, [1.5], response)
    assert status == "failed" and "called torch." in message and "use plain Python" in message
    assert judge_response(c, [1.5], respond(c, [1.5], {"f": lambda x: 2 * x})) == ("passed", "passed")


# --------------------------------------------------------------------------- inline check()

def test_check_prints_one_line_on_a_pass_and_echoes_nothing(capsys):
    assert check("98.double", lambda x: 2 * x) is None  # no True/False echoed under the line in a notebook
    assert capsys.readouterr().out == "✅ 98.double — passed (2/2 points)\n"


def test_check_prints_the_hint_after_a_failed_attempt_only(capsys):
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
    grading._load()  # every chapter
    assert checks.errors == {}
    assert {c.name.split(".")[0] for c in grading._REGISTRY.values()} >= {"00", "01", "02"}


def test_no_course_check_runs_code_of_its_own_in_the_kernel():
    """The grader's sandbox holds no check module: a course check's kernel side is its probe alone."""
    from course_lib.tooling import checks
    checks.load()
    own = [c.name for c in grading._REGISTRY.values()
           if type(c).__module__.startswith("course_lib.tooling.checks") and type(c).run is not Check.run]
    assert not own, f"these checks override run(); move it to course_lib/tooling/probes/chNN.py: {own}"


class Secret(Check):
    """A check whose probe asks the grader: the kernel sees `public`, the host sees the whole case."""
    name, args, points = "98.secret", ("f",), 1

    def cases(self, rng: random.Random) -> list:
        return [{"shown": 3, "hidden": 7}]

    def public(self, case: dict) -> dict:
        return {"shown": case["shown"]}

    def run(self, case, f):  # stands for a probe in probes/ch98.py
        from course_lib.tooling import probes
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
    from course_lib.tooling import probes
    with pytest.raises(RuntimeError, match="only while a check runs"):
        probes.ask({"anything": 1})
