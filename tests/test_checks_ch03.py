"""The exercise checks of chapter 03 accept right answers and reject wrong ones.

Each check runs exactly as the grader judges it (course_lib.tooling.grading.run_check: inputs and
references in this process, answers through JSON). Functions that stand for notebook code are
defined in a module named __main__, as a notebook cell defines them, so the shortcut detector
sees their calls.
"""

from __future__ import annotations

import json
import math
import random
import re
import struct
from pathlib import Path

import nbformat
import pytest
import torch
import torch.nn as nn
from checking import fails, judged_cells, passes

from course_lib.tooling.checks import checks_for


def notebook_function(source: str, name: str, **names) -> object:
    """A function defined as a notebook cell defines it: in module __main__."""
    namespace = {"__name__": "__main__", "math": math, "torch": torch, "nn": nn, "struct": struct, **names}
    exec(source, namespace)
    return namespace[name]


def test_chapter_03_registers_its_two_tasks():
    assert [c.name for c in checks_for("03")] == ["03.update_scale", "03.clipped_step"]


# --------------------------------------------------------------------------- hints
# check() prints a task's hint under the message after every failed attempt: it must point at the
# idea, never hand over the answer. The task's text states the update rule; the learner writes it.


def solution_lines(task: str) -> list[str]:
    """The code lines of a task's answer in solutions/03 (between the markers), comments dropped."""
    nb = nbformat.read(Path(__file__).parents[1] / "solutions" / "03_grad_scaler_exercises.ipynb", as_version=4)
    source = next(c.source for c in nb.cells if c.cell_type == "code" and f'check("{task}"' in c.source)
    answer = source.split("### BEGIN SOLUTION")[1].split("### END SOLUTION")[0]
    lines = [line.split("#")[0].strip() for line in answer.splitlines()]
    return [line for line in lines if line]


@pytest.mark.parametrize("task", ["03.update_scale", "03.clipped_step"])
def test_the_hint_gives_the_idea_not_the_answer(task):
    hint = next(c.hint for c in checks_for("03") if c.name == task)
    assert 100 < len(hint) < 600, hint
    code = solution_lines(task)
    assert len(code) >= 5
    for line in code:  # no statement of the answer, nor any call or expression taken from it
        assert line not in hint, line
        for piece in re.findall(r"[\w.]+\([^()]*\)|\w+ [*+] \w+", line):
            assert piece not in hint, piece
    # no arithmetic, comparison, assignment or call at all: the hint is prose
    assert not re.search(r"[*+=<>]|\w\(", hint), hint


def test_the_update_rule_hint_does_not_state_the_arithmetic():
    hint = next(c.hint for c in checks_for("03") if c.name == "03.update_scale")
    # the hint must not state the rule formula by formula: no piece of the arithmetic appears in it
    for given_away in (
        "scale * backoff_factor",
        "scale * growth_factor",
        "tracker + 1",
        "== growth_interval",
        "not >=",
        "tracker = 0",
        "tracker = t",
        "to_float32(",
        "unless that is inf",
    ):
        assert given_away not in hint, given_away
    # still useful: the three cases, the interval, float32 rounding, and where the chapter explains it
    for pointer in ("three cases", "overflow", "growth_interval", "float32", "section 3"):
        assert pointer in hint, pointer


def test_the_clipping_hint_names_the_idea_not_the_calls():
    hint = next(c.hint for c in checks_for("03") if c.name == "03.clipped_step")
    for call in ("unscale_(", "clip_grad_norm_(", "scaler.step(", "scaler.update(", ".backward("):
        assert call not in hint, call
    for pointer in ("multiplied by the scale", "before you clip", "skipped", "section 6"):
        assert pointer in hint, pointer


def test_a_failed_attempt_prints_the_message_then_the_hint(capsys):
    from course_lib.tooling.grading import check

    check("03.update_scale", rule(**{"if t == growth_interval:": "if t >= growth_interval:"}))
    out = capsys.readouterr().out
    assert out.startswith("❌ 03.update_scale") and "with ==" in out  # the message diagnoses the mistake
    assert "hint: Sort the step the message names" in out


# --------------------------------------------------------------------------- task 1: the update rule

TO_F32 = """
def to_float32(x):
    return torch.tensor(x, dtype=torch.float64).to(torch.float32).item()
"""

RIGHT = (
    TO_F32
    + """
def update_scale(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    if found_inf:
        return to_float32(scale * backoff_factor), 0
    t = tracker + 1
    if t == growth_interval:
        grown = to_float32(scale * growth_factor)
        return (grown if math.isfinite(grown) else scale), 0
    return scale, t
"""
)


def rule(**changes: str) -> object:
    """RIGHT with some lines replaced: a plausible mistake."""
    source = RIGHT
    for old, new in changes.items():
        assert old in source, old
        source = source.replace(old, new)
    return notebook_function(source, "update_scale")


def test_update_scale_accepts_the_rule():
    passes("03.update_scale", rule())


def test_update_scale_accepts_other_ways_to_round_to_float32():
    with_struct = notebook_function(
        RIGHT.replace(
            "return torch.tensor(x, dtype=torch.float64).to(torch.float32).item()",
            "try:\n        return struct.unpack('f', struct.pack('f', x))[0]\n"
            "    except OverflowError:\n        return math.copysign(math.inf, x)",
        ),
        "update_scale",
    )
    passes("03.update_scale", with_struct, times=1)


def test_update_scale_accepts_numpy_and_tensor_return_values():
    import numpy as np

    right = rule()
    passes("03.update_scale", lambda *a: (np.float64(right(*a)[0]), np.int32(right(*a)[1])), times=1)
    passes(
        "03.update_scale",
        lambda s, *a: (torch.tensor(right(float(s), *a)[0], dtype=torch.float64), right(float(s), *a)[1]),
        times=1,
    )


def test_update_scale_rejects_a_hard_coded_answer():
    fails("03.update_scale", lambda *a: (65536.0, 0))


MISTAKES = {
    "fp64 arithmetic (never rounded to float32)": (
        dict(
            **{
                "return to_float32(scale * backoff_factor), 0": "return scale * backoff_factor, 0",
                "grown = to_float32(scale * growth_factor)": "grown = scale * growth_factor",
            }
        ),
        ("round the double",),
    ),
    "float32 arithmetic (the factor rounded first)": (
        dict(
            **{
                "return to_float32(scale * backoff_factor), 0": "return (f32t(scale) * f32t(backoff_factor)).item(), 0",
                "grown = to_float32(scale * growth_factor)": "grown = (f32t(scale) * f32t(growth_factor)).item()",
                "def update_scale(": (
                    "def f32t(x):\n    return torch.tensor(x, dtype=torch.float32)\n\n\ndef update_scale("
                ),
            }
        ),
        ("double precision",),
    ),
    "grows after every clean step": (
        dict(**{"if t == growth_interval:": "if True:"}),
        ("clean step", "past growth_interval"),
    ),
    "grows when the tracker is past the interval (>=)": (
        dict(**{"if t == growth_interval:": "if t >= growth_interval:"}),
        ("with ==",),
    ),
    "grows one step late": (
        dict(**{"if t == growth_interval:": "if t == growth_interval + 1:"}),
        ("time to grow", "restarts at 0 when", "past growth_interval"),
    ),
    "keeps the tracker on an overflow": (
        dict(**{"return to_float32(scale * backoff_factor), 0": "return to_float32(scale * backoff_factor), tracker"}),
        ("restarts at 0 after an overflow",),
    ),
    "grows to inf": (
        dict(**{"return (grown if math.isfinite(grown) else scale), 0": "return grown, 0"}),
        ("never grows to inf",),
    ),
    "a floor at 1": (
        dict(
            **{"return to_float32(scale * backoff_factor), 0": "return max(1.0, to_float32(scale * backoff_factor)), 0"}
        ),
        ("backoff_factor",),
    ),
}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_update_scale_rejects_a_plausible_mistake_and_says_why(mistake):
    changes, words = MISTAKES[mistake]
    message = fails("03.update_scale", rule(**changes))
    assert any(w in message for w in words), message
    assert "torch's GradScaler gives" in message and "update_scale returned" in message


def test_update_scale_refuses_gradscaler_and_the_course_library():
    with_gradscaler = notebook_function(
        """
def update_scale(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    s = torch.amp.GradScaler("cpu", init_scale=scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                             growth_interval=growth_interval)
    s.load_state_dict({**s.state_dict(), "_growth_tracker": tracker})
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.0)
    s.scale(p.sum())
    p.grad = torch.full((1,), math.inf if found_inf else 1.0)
    s.step(opt)
    s.update()
    return s.get_scale(), s.state_dict()["_growth_tracker"]
""",
        "update_scale",
    )
    message = fails("03.update_scale", with_gradscaler)  # its update() runs into the switched-off kernel
    assert "GradScaler's own kernels" in message and "yourself" in message

    imports = "from course_lib.chapters.ch03.scaler import DynamicLossScaler"
    status, message = judged_cells(
        "03.update_scale",
        imports,
        """
def update_scale(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    ref = DynamicLossScaler(scale, growth_factor, backoff_factor, growth_interval, tracker)
    ref.update(found_inf)
    return ref.scale, ref.growth_tracker
""",
    )
    assert status == "failed" and "needs course_lib" in message, message  # absent from the task's process


def test_update_scale_refuses_torchs_own_kernel():
    with_kernel = notebook_function(
        """
def update_scale(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    s, t = torch.tensor(scale), torch.tensor(tracker, dtype=torch.int32)
    torch._amp_update_scale_(s, t, torch.tensor(float(found_inf)), growth_factor, backoff_factor, growth_interval)
    return s.item(), t.item()
""",
        "update_scale",
    )
    message = fails("03.update_scale", with_kernel)
    assert "own kernels" in message
    assert torch._amp_update_scale_.__name__ == "_amp_update_scale_"  # restored after the check


def test_update_scale_says_when_a_pair_is_not_returned():
    assert "expected a pair" in fails("03.update_scale", lambda *a: 65536.0)


# --------------------------------------------------------------------------- task 2: clipping under a scaler

RIGHT_STEP = """
def clipped_step(model, optimizer, scaler, loss, max_norm):
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    return norm
"""


def step(**changes: str) -> object:
    source = RIGHT_STEP
    for old, new in changes.items():
        assert old in source, old
        source = source.replace(old, new)
    return notebook_function(source, "clipped_step")


def test_clipped_step_accepts_the_right_order():
    passes("03.clipped_step", step())


def test_clipped_step_accepts_zero_grad_at_the_end_and_a_float():
    passes("03.clipped_step", step(**{"    return norm": "    optimizer.zero_grad()\n    return norm.item()"}), times=1)


def test_clipped_step_rejects_a_hard_coded_answer():
    fails("03.clipped_step", lambda model, optimizer, scaler, loss, max_norm: 1.0)


STEP_MISTAKES = {
    "clips before unscale_": (dict(**{"    scaler.unscale_(optimizer)\n": ""}), "scaler.unscale_(optimizer) before"),
    "clips, then unscale_": (
        dict(
            **{
                (
                    "    scaler.unscale_(optimizer)\n"
                    "    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)\n"
                ): (
                    "    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)\n"
                    "    scaler.unscale_(optimizer)\n"
                )
            }
        ),
        "before clipping",
    ),
    "no update()": (dict(**{"    scaler.update()\n": ""}), "unscale_() is being called after step()"),
    "optimizer.step() instead of scaler.step()": (
        dict(**{"scaler.step(optimizer)": "optimizer.step()"}),
        "scaler.step(optimizer)",
    ),
    "returns the norm after clipping": (
        dict(**{"    return norm": "    return torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])"}),
        "after clipping",
    ),
    "no clipping at all": (
        dict(**{"clip_grad_norm_(model.parameters(), max_norm)": "clip_grad_norm_(model.parameters(), math.inf)"}),
        "wrong size",
    ),
    "clip_grad_value_ instead": (
        dict(
            **{
                "norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)": (
                    "norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])\n"
                    "    torch.nn.utils.clip_grad_value_(model.parameters(), max_norm)"
                )
            }
        ),
        "wrong size",
    ),
    "unscale_ twice": (
        dict(**{"    scaler.step(optimizer)": "    scaler.unscale_(optimizer)\n    scaler.step(optimizer)"}),
        "already been called",
    ),
}


@pytest.mark.parametrize("mistake", STEP_MISTAKES)
def test_clipped_step_rejects_a_plausible_mistake_and_says_why(mistake):
    changes, words = STEP_MISTAKES[mistake]
    message = fails("03.clipped_step", step(**changes))
    assert words in message, message


def test_clipped_step_refuses_the_course_trainer():
    status, message = judged_cells(
        "03.clipped_step",
        "import torch\nfrom course_lib.train import TrainConfig, Trainer",
        RIGHT_STEP.replace("def clipped_step", "def right"),
        """
def clipped_step(model, optimizer, scaler, loss, max_norm):
    Trainer(model, optimizer, TrainConfig(precision="fp32", device="cpu", progress=False))
    return right(model, optimizer, scaler, loss, max_norm)
""",
    )
    assert status == "failed" and "needs course_lib" in message, message


# --------------------------------------------------------------------------- answers of the wrong shape
# The batch grader only sees what the learner's kernel sends back, and the kernel can send anything
# (its probe can be replaced): every answer is checked for its shape before it is compared.


def judged(name: str, results: list, seed: int = 5) -> tuple[str, str]:
    """The grader's verdict on `results` sent back for the cases it drew with `seed`."""
    from course_lib.tooling.checkbase import judge_response
    from course_lib.tooling.checks import get_check

    check = get_check(name)
    cases = check.cases(random.Random(seed))
    return judge_response(check, cases, json.loads(json.dumps({"results": results(cases)})))


def right_results(name: str, fn, seed: int = 5) -> list:
    """What an honest kernel running `fn` sends back for the cases drawn with `seed`."""
    from course_lib.tooling import probes
    from course_lib.tooling.checks import get_check
    from course_lib.tooling.task import respond

    check = get_check(name)
    response = json.loads(json.dumps(respond(probes.find(check.name), [fn], check.cases(random.Random(seed)))))
    return response["results"]


def test_update_scale_rejects_an_empty_list_per_case():
    status, message = judged("03.update_scale", lambda cases: [[] for _ in cases])
    assert status == "failed" and "expected a list of" in message and "got a list of 0" in message, message


def test_update_scale_rejects_a_trajectory_one_step_short():
    honest = right_results("03.update_scale", rule())
    status, message = judged("03.update_scale", lambda cases: [r[:-1] for r in honest])
    assert status == "failed" and "expected a list of" in message, message


def test_update_scale_rejects_triples_and_nan_scales():
    honest = right_results("03.update_scale", rule())
    status, message = judged("03.update_scale", lambda cases: [[[*p, 0] for p in r] for r in honest])
    assert status == "failed" and "expected a list of 2" in message, message
    nan_scale = notebook_function("def update_scale(scale, tracker, *args):\n    return math.nan, 0\n", "update_scale")
    message = fails("03.update_scale", nan_scale)
    assert "expected a finite" in message and "got nan" in message, message
    inf_tracker = notebook_function(
        "def update_scale(scale, tracker, *args):\n    return scale, math.inf\n", "update_scale"
    )
    assert "expected a finite number" in fails("03.update_scale", inf_tracker)


def test_clipped_step_rejects_an_empty_list_per_case():
    status, message = judged("03.clipped_step", lambda cases: [[] for _ in cases])
    assert status == "failed" and "expected a list of" in message and "got a list of 0" in message, message


def test_clipped_step_rejects_records_of_the_wrong_length():
    honest = right_results("03.clipped_step", step())
    short_run = [r[:-1] for r in honest]
    assert judged("03.clipped_step", lambda cases: short_run)[0] == "failed"
    fewer_params = [[{**s, "params": s["params"][:-1]} for s in r] for r in honest]
    status, message = judged("03.clipped_step", lambda cases: fewer_params)
    assert status == "failed" and "parameters" in message and "expected a list of" in message, message
    no_grads = [[{**s, "grads": []} for s in r] for r in honest]
    status, message = judged("03.clipped_step", lambda cases: no_grads)
    assert status == "failed" and "expected a list of 4" in message, message
    assert judged("03.clipped_step", lambda cases: honest)[0] == "passed"


def test_clipped_step_rejects_a_nan_norm_where_the_gradients_were_finite():
    nan_norm = step(**{"    return norm": "    return math.nan"})
    message = fails("03.clipped_step", nan_norm)
    assert "expected a finite number" in message and "norm" in message, message
