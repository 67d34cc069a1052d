"""Exercise 05's check accepts a fixed loop and rejects each planted mistake on its own.

The check is run exactly as the grader judges it (run_check: cases and reference in this process,
the learner's side through JSON). Loops are defined in a module named __main__, as a notebook
cell defines them, so the shortcut detector sees their calls.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from checking import judged_cells, passes, verdict

from course_lib.chapters.ch05 import multi
from course_lib.tooling.checks import checks_for

NAME = "05.fix_two_models"

FIXED = """
def train_two_models(model0, model1, opt0, opt1, scaler, batches, max_norm, dtype):
    for x, y in batches:
        opt0.zero_grad()
        opt1.zero_grad()
        with torch.autocast(x.device.type, dtype=dtype):
            out0, out1 = model0(x), model1(x)
            loss0 = F.mse_loss(2 * out0 + 3 * out1, y)
            loss1 = F.mse_loss(3 * out0 - 5 * out1, y)
        scaler.scale(loss0).backward(retain_graph=True)
        scaler.scale(loss1).backward()
        scaler.unscale_(opt0)
        torch.nn.utils.clip_grad_norm_(model0.parameters(), max_norm)
        scaler.step(opt0)
        scaler.step(opt1)
        scaler.update()
"""

# The broken loop of the exercise notebook: all five mistakes at once.
BROKEN = """
def train_two_models(model0, model1, opt0, opt1, scaler, batches, max_norm, dtype):
    for x, y in batches:
        opt0.zero_grad()
        with torch.autocast(x.device.type, dtype=dtype):
            out0, out1 = model0(x), model1(x)
            loss0 = F.mse_loss(2 * out0 + 3 * out1, y)
            loss1 = F.mse_loss(3 * out0 - 5 * out1, y)
        scaler.scale(loss0).backward()
        opt1.zero_grad()
        scaler.scale(loss1).backward()
        torch.nn.utils.clip_grad_norm_(model0.parameters(), max_norm)
        scaler.unscale_(opt0)
        scaler.step(opt0)
        scaler.update()
        opt1.step()
"""

CLIP = "scaler.unscale_(opt0)\n        torch.nn.utils.clip_grad_norm_(model0.parameters(), max_norm)"
# One planted mistake each: (what to replace in FIXED, with what, a phrase the message must contain)
MISTAKES = {
    "missing retain_graph": ("backward(retain_graph=True)", "backward()", "retain_graph"),
    "zero_grad between the backwards": (
        "scaler.scale(loss1).backward()",
        "opt1.zero_grad()\n        scaler.scale(loss1).backward()",
        "between the two backward() calls",
    ),
    "zero_grad after backward": (
        "scaler.unscale_(opt0)",
        "opt1.zero_grad(set_to_none=False)\n        scaler.unscale_(opt0)",
        "differ from a correct loop",
    ),
    "unscale_ after clipping": (
        CLIP,
        "torch.nn.utils.clip_grad_norm_(model0.parameters(), max_norm)\n        scaler.unscale_(opt0)",
        "before scaler.unscale_(opt0)",
    ),
    "no clipping": (CLIP, "scaler.unscale_(opt0)", "not clipped"),
    "clipping both models": (
        CLIP,
        CLIP + "\n        scaler.unscale_(opt1)\n        torch.nn.utils.clip_grad_norm_(model1.parameters(), max_norm)",
        "clipped too",
    ),
    "update() once per optimizer": (
        "scaler.step(opt0)\n",
        "scaler.step(opt0)\n        scaler.update()\n",
        "scaler.update() ran",
    ),
    "update() between the steps": (
        "scaler.step(opt1)\n        scaler.update()",
        "scaler.update()\n        scaler.step(opt1)",
        "before scaler.step(opt1)",
    ),
    "no update()": ("        scaler.update()\n", "", "unscale_() is being called after step()"),
    "scaler.step skipped for opt1": ("scaler.step(opt1)", "opt1.step()", "opt1.step() was called directly"),
    "opt1 never stepped": ("scaler.step(opt1)", "pass", "scaler.step(opt1) ran 0 times"),
}


def notebook_function(source: str, **names) -> object:
    namespace = {"__name__": "__main__", "torch": torch, "F": F, "nn": nn, **names}
    exec(source, namespace)
    return namespace["train_two_models"]


pytestmark = pytest.mark.skipif(not multi.cpu_fp16_scaler_works(), reason="needs CPU fp16 autocast + GradScaler")


def test_the_fixed_loop_passes_on_fresh_cases():
    passes(NAME, notebook_function(FIXED), times=2)


def test_one_backward_of_the_summed_losses_is_also_right():
    summed = FIXED.replace(
        "scaler.scale(loss0).backward(retain_graph=True)\n        scaler.scale(loss1).backward()",
        "scaler.scale(loss0 + loss1).backward()",
    )
    status, message = verdict(NAME, notebook_function(summed))
    assert status == "passed", message


@pytest.mark.parametrize("mistake", MISTAKES)
def test_each_planted_mistake_alone_fails_with_a_message_that_names_it(mistake):
    old, new, phrase = MISTAKES[mistake]
    assert old in FIXED
    status, message = verdict(NAME, notebook_function(FIXED.replace(old, new, 1)), seed=1)
    assert status == "failed", f"{mistake} was accepted"
    assert phrase in message, message


def test_the_exercises_broken_loop_fails():
    status, message = verdict(NAME, notebook_function(BROKEN))
    assert status == "failed" and "retain_graph" in message


def test_a_hard_coded_answer_fails():
    def nothing(model0, model1, opt0, opt1, scaler, batches, max_norm, dtype):
        return None

    def constant(model0, model1, opt0, opt1, scaler, batches, max_norm, dtype):
        with torch.no_grad():
            for p in [*model0.parameters(), *model1.parameters()]:
                p.fill_(0.01)

    assert "ran 0 times" in verdict(NAME, nothing)[1]
    replayed = FIXED.replace(
        "        scaler.update()\n",
        "        scaler.update()\n    "
        + "\n".join(
            [
                "with torch.no_grad():",
                "        for p in [*model0.parameters(), *model1.parameters()]:",
                "            p.fill_(0.01)",
            ]
        ).replace("\n", "\n    ")
        + "\n",
    )
    status, message = verdict(NAME, notebook_function(replayed))
    assert status == "failed" and "differ from a correct loop" in message
    assert verdict(NAME, constant)[0] == "failed"


def test_calling_the_chapters_loop_is_refused():
    # The learner builds the autocast mode themselves, so the one call into the library is the
    # chapter's loop: the refusal must come from two_model_step, not from constructing AmpMode.
    status, message = judged_cells(
        NAME,
        "import torch\nfrom course_lib.chapters.ch05 import article_two_models",
        """
class Mode:
    def __init__(self, dtype):
        self.dtype = dtype
    def autocast(self):
        return torch.autocast("cpu", dtype=self.dtype)

def train_two_models(model0, model1, opt0, opt1, scaler, batches, max_norm, dtype):
    for x, y in batches:
        article_two_models.two_model_step(model0, model1, opt0, opt1, scaler, x, y, Mode(dtype), max_norm)
""",
    )
    assert status == "failed", message
    assert "needs course_lib.chapters.ch05.article_two_models" in message  # absent from the task's process
    assert "fix the loop yourself" in message


def test_building_the_chapters_amp_mode_is_refused_too():
    status, message = judged_cells(
        NAME,
        "from course_lib.chapters.ch05 import multi",
        """
def train_two_models(model0, model1, opt0, opt1, scaler, batches, max_norm, dtype):
    mode = multi.AmpMode("cpu", dtype, True, "")
    for x, y in batches:
        with mode.autocast():
            pass
""",
    )
    assert status == "failed" and "course_lib.chapters.ch05.multi" in message, message


def test_the_check_has_points_and_a_hint():
    (check,) = checks_for("05")
    assert check.points > 0 and "retain_graph=True" in check.hint


def test_judging_in_threads_is_safe():
    """The batch grader judges submissions in threads: the judge must not touch global state."""
    import json
    import threading

    from course_lib.tooling import probes
    from course_lib.tooling.checks import get_check
    from course_lib.tooling.task import respond

    check = get_check(NAME)
    cases = check.cases(random.Random(3))
    response = json.loads(json.dumps(respond(probes.find(check.name), [notebook_function(FIXED)], cases)))
    errors: list[BaseException] = []

    def judge() -> None:
        try:
            for _ in range(2):
                torch.manual_seed(random.randrange(1000))  # another thread's use of the global RNG
                check.judge(cases, response["results"])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=judge) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


# --------------------------------------------------------------------------- autocast and skipped steps

ALL_INSIDE = """
def train_two_models(model0, model1, opt0, opt1, scaler, batches, max_norm, dtype):
    for x, y in batches:
        opt0.zero_grad()
        opt1.zero_grad()
        with torch.autocast(x.device.type, dtype=dtype):
            out0, out1 = model0(x), model1(x)
            loss0 = F.mse_loss(2 * out0 + 3 * out1, y)
            loss1 = F.mse_loss(3 * out0 - 5 * out1, y)
            scaler.scale(loss0).backward(retain_graph=True)
            scaler.scale(loss1).backward()
            scaler.unscale_(opt0)
            torch.nn.utils.clip_grad_norm_(model0.parameters(), max_norm)
            scaler.step(opt0)
            scaler.step(opt1)
            scaler.update()
"""


def test_a_loop_that_runs_everything_inside_autocast_fails():
    # the same calls in the same order as FIXED, and (nearly) the same parameters: only the autocast
    # state of each call tells them apart
    message = verdict(NAME, notebook_function(ALL_INSIDE), seed=2)[1]
    assert "ran with autocast on" in message, message
    for name in ("backward()", "scaler.unscale_()", "clip_grad_norm_()", "scaler.step()", "scaler.update()"):
        assert name in message, message


@pytest.mark.parametrize("what", ["backward", "update"])
def test_one_call_inside_autocast_is_enough_to_fail(what):
    if what == "backward":  # the two backward calls moved into the with block
        wrong = FIXED.replace(
            "        scaler.scale(loss0).backward(retain_graph=True)\n        scaler.scale(loss1)",
            "            scaler.scale(loss0).backward(retain_graph=True)\n            scaler.scale(loss1)",
        )
        name = "backward()"
    else:  # update() under a second autocast region of its own
        wrong = FIXED.replace(
            "        scaler.update()",
            "        with torch.autocast(x.device.type, dtype=dtype):\n            scaler.update()",
        )
        name = "scaler.update()"
    assert wrong != FIXED
    status, message = verdict(NAME, notebook_function(wrong), seed=4)
    assert status == "failed" and "ran with autocast on" in message and name in message, message


def test_the_last_case_makes_both_optimizers_skip_a_step():
    from course_lib.tooling.checks.ch05 import _reference
    from course_lib.tooling.probes.ch05 import record_loop

    check = checks_for("05")[0]
    for seed in range(3):
        case = check.cases(random.Random(seed))[-1]
        done = record_loop(case, notebook_function(FIXED), torch.float16)
        assert max(done["steps"]) < case["iterations"], done["steps"]  # a skipped step for each optimizer
        assert sum(c[0] == "scaler.step" for c in done["calls"]) == 2 * case["iterations"]  # yet called each time
        want = _reference(case, torch.float16)  # the grader's own count, without the Recorder
        assert done["steps"] == want["steps"] and done["scale"] == want["scale"]


def respond_json(fn, seed: int) -> tuple:
    import json

    from course_lib.tooling import probes
    from course_lib.tooling.checks import get_check
    from course_lib.tooling.task import respond

    check = get_check(NAME)
    cases = check.cases(random.Random(seed))
    return check, cases, json.loads(json.dumps(respond(probes.find(check.name), [fn], cases)))["results"]


def test_steps_that_were_not_skipped_on_an_overflow_fail():
    # a kernel that reports every step as taken (as a loop stepping on infs would): the grader counts the
    # steps a correct loop skips on the same case and compares them per optimizer
    from course_lib.tooling.checkbase import judge_response

    check, cases, honest = respond_json(notebook_function(FIXED), seed=6)
    assert judge_response(check, cases, {"results": honest})[0] == "passed"
    never_skipped = [{**r, "steps": [c["iterations"]] * 2} for r, c in zip(honest, cases)]
    status, message = judge_response(check, cases, {"results": never_skipped})
    assert status == "failed" and "skips the step exactly when" in message, message


def test_answers_of_the_wrong_shape_fail():
    from course_lib.tooling.checkbase import judge_response

    check, cases, honest = respond_json(notebook_function(FIXED), seed=7)
    wrong = {
        "an empty list per case": ([[] for _ in cases], "expected a dict"),
        "no calls": ([{**r, "calls": []} for r in honest], "scaler.update() ran 0 times"),
        "calls without their autocast state": (
            [{**r, "calls": [c[:3] for c in r["calls"]]} for r in honest],
            "expected a list of 4",
        ),
        "a parameter short": (
            [{**r, "params0": {**r["params0"], "array": r["params0"]["array"][:-1]}} for r in honest],
            "expected a list of",
        ),
        "NaN for the scale": ([{**r, "scale": float("nan")} for r in honest], "expected a finite number"),
        "one step count": ([{**r, "steps": r["steps"][:1]} for r in honest], "expected a list of 2"),
    }
    for what, (results, says) in wrong.items():
        status, message = judge_response(check, cases, {"results": results})
        assert status == "failed" and says in message, f"{what}: {message}"
