"""Exercise 04's check accepts a right accumulation loop and rejects the usual wrong ones.

The check runs exactly as the grader judges it (course_lib.tooling.grading.run_check): cases
and the large-batch reference in this process, the learner's results through JSON. Loops that
stand for notebook code are defined in a module named __main__, as a notebook cell defines them,
so that the shortcut detector sees them. Wrong loops are judged on the cases of seed 0, so that
each one meets the same cases (the overflowing one among them) on every run.
"""

from __future__ import annotations

import random

import pytest
from checking import fails, judged_cells, passes, verdict

from course_lib.chapters.ch04.accumulation import accumulation_step
from course_lib.tooling.checks import checks_for

NAME = "04.accumulate"
HEADER = """
import torch
import torch.nn.functional as F

def accumulate(model, optimizer, scaler, micro_batches, loss_fn, dtype):
    device_type = next(model.parameters()).device.type
    total = sum(len(y) for _, y in micro_batches)
"""
RIGHT = (
    HEADER
    + """
    optimizer.zero_grad()
    for x, y in micro_batches:
        with torch.autocast(device_type, dtype=dtype, enabled=dtype is not None):
            loss = loss_fn(model(x), y) * (len(y) / total)
        scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
"""
)


def notebook_function(source: str, **names) -> object:
    namespace = {"__name__": "__main__", **names}
    exec(source, namespace)
    return namespace["accumulate"]


def test_the_right_loop_passes_on_fresh_cases():
    passes(NAME, notebook_function(RIGHT), times=3)


def test_other_right_loops_pass_too():
    # zero_grad at the end of the previous step is not enough here: the check fills .grad first
    summed = (
        HEADER
        + """
    optimizer.zero_grad(set_to_none=False)
    for x, y in micro_batches:
        with torch.autocast(device_type, dtype=dtype, enabled=dtype is not None):
            out = model(x)
            loss = loss_fn(out, y) * len(y)
        scaler.scale(loss / total).backward()
    if scaler.is_enabled():
        scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
"""
    )
    status, message = verdict(NAME, notebook_function(summed), seed=1)
    assert status == "passed", message


WRONG = {
    "loss not divided": (
        "loss = loss_fn(model(x), y) * (len(y) / total)",
        "loss = loss_fn(model(x), y)",
        "was not divided",
    ),
    "mean of means on ragged micro-batches": ("* (len(y) / total)", "/ len(micro_batches)", "len(y) / total"),
    "zero_grad inside the micro-batch loop": (
        "    optimizer.zero_grad()\n    for x, y in micro_batches:\n",
        "    for x, y in micro_batches:\n        optimizer.zero_grad()\n",
        "zero_grad() inside",
    ),
    "no zero_grad at all": ("    optimizer.zero_grad()\n", "", "zero the gradients first"),
    "step every micro-batch": (
        "        scaler.scale(loss).backward()\n    scaler.step(optimizer)\n    scaler.update()",
        "        scaler.scale(loss).backward()\n        scaler.step(optimizer)\n        scaler.update()",
        "optimizer.step() ran",
    ),
    "update every micro-batch, after unscale_": (
        "        scaler.scale(loss).backward()\n    scaler.step(optimizer)\n    scaler.update()",
        "        scaler.scale(loss).backward()\n"
        "        scaler.unscale_(optimizer)\n"
        "        if y is micro_batches[-1][1]:\n"
        "            scaler.step(optimizer)\n"
        "        scaler.update()",
        "scaler.update() ran",
    ),
    "update every micro-batch, step at the end": (
        "        scaler.scale(loss).backward()\n",
        "        scaler.scale(loss).backward()\n        scaler.update()\n",
        "No inf checks",
    ),
    "optimizer.step instead of scaler.step": (
        "    scaler.step(optimizer)",
        "    optimizer.step()",
        "No inf checks",
    ),  # torch's own message, from update()
    "backward without the scaler": ("scaler.scale(loss).backward()", "loss.backward()", ""),
    "no autocast": ("enabled=dtype is not None", "enabled=False", "torch.autocast(device_type"),
    "autocast always on": ("dtype=dtype, enabled=dtype is not None", "dtype=dtype or torch.bfloat16", "expected"),
}


@pytest.mark.parametrize("mistake", WRONG)
def test_plausible_mistakes_fail_with_a_message_that_names_them(mistake):
    old, new, says = WRONG[mistake]
    assert old in RIGHT
    message = fails(NAME, notebook_function(RIGHT.replace(old, new)), seed=0)
    assert says in message, message


def test_a_hard_coded_answer_fails():
    # the right loop on fixed data of the right shapes instead of the micro-batches it is given
    fixed = RIGHT.replace(
        "    for x, y in micro_batches:\n",
        """    torch.manual_seed(0)
    fixed = [(torch.randn_like(x), y) for x, y in micro_batches]
    for x, y in fixed:
""",
    )
    assert fixed != RIGHT
    assert "differ from the large batch's" in fails(NAME, notebook_function(fixed), seed=0)


def test_the_ragged_cases_alone_catch_the_mean_of_means():
    # even a bf16 case, where the tolerance is widest, tells the mean of means apart
    old, new, _ = WRONG["mean of means on ragged micro-batches"]
    wrong = notebook_function(RIGHT.replace(old, new))
    rejected = sum(verdict(NAME, wrong, seed=seed)[0] == "failed" for seed in range(5))
    assert rejected == 5


def test_calling_the_chapters_loop_is_refused():
    """The chapter's loop is absent from the process that judges the task, however it is imported."""
    for how in (
        "from course_lib.chapters.ch04.accumulation import accumulation_step",
        "accumulation_step = __import__('course_lib.chapters.ch04.accu' + 'mulation', "
        "fromlist=['x']).accumulation_step",
    ):
        status, message = judged_cells(
            NAME,
            how,
            "def accumulate(model, optimizer, scaler, micro_batches, loss_fn, "
            "dtype):\n    accumulation_step(model, optimizer, scaler, micro_batches, "
            "loss_fn, dtype)\n",
            seed=0,
        )
        assert status == "failed", message
        assert "which this task asks you not to use" in message and "write the loop yourself" in message


def test_the_library_loop_itself_is_right():
    # what the chapter teaches passes, when it is not called from the learner's own code
    status, message = verdict(NAME, lambda m, o, s, mb, fn, dt: accumulation_step(m, o, s, mb, fn, dt), seed=2)
    assert status == "passed", message


def test_the_check_has_points_and_a_hint():
    (check,) = checks_for("04")
    assert check.points >= 2 and "len(y)" in check.hint


# --------------------------------------------------------------------------- what the gradients alone cannot show

CONCATENATED = (
    HEADER
    + """
    optimizer.zero_grad()
    x = torch.cat([x for x, _ in micro_batches])
    y = torch.cat([y for _, y in micro_batches])
    with torch.autocast(device_type, dtype=dtype, enabled=dtype is not None):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
"""
)


def test_one_pass_over_the_concatenated_micro_batches_fails():
    # its gradient is the large batch's, exactly: only the forwards it runs tell it from accumulation
    message = fails(NAME, notebook_function(CONCATENATED), seed=0)
    assert "one forward per micro-batch" in message and "concatenated" in message, message


def test_one_backward_of_the_summed_losses_fails():
    # a forward per micro-batch, but every graph kept alive until one backward at the end
    summed = (
        HEADER
        + """
    optimizer.zero_grad()
    losses = []
    for x, y in micro_batches:
        with torch.autocast(device_type, dtype=dtype, enabled=dtype is not None):
            losses.append(loss_fn(model(x), y) * (len(y) / total))
    scaler.scale(sum(losses)).backward()
    scaler.step(optimizer)
    scaler.update()
"""
    )
    message = fails(NAME, notebook_function(summed), seed=0)
    assert "backward ran 1 time(s)" in message, message


UNSCALE_THEN_STEP = RIGHT.replace(
    "    scaler.step(optimizer)\n", "    scaler.unscale_(optimizer)\n    optimizer.step()\n"
)


def test_unscale_then_optimizer_step_fails_on_the_overflowing_case():
    # right on every case whose gradients are finite; on the overflowing one it applies infs
    assert UNSCALE_THEN_STEP != RIGHT
    message = fails(NAME, notebook_function(UNSCALE_THEN_STEP), seed=0)
    assert "overflowed" in message and "scaler.step(optimizer)" in message, message


def test_the_overflowing_case_makes_the_right_loop_skip_its_step_and_back_off():
    from course_lib.tooling.probes.ch04 import run_loop

    (check,) = checks_for("04")
    for seed in range(3):
        (case,) = [c for c in check.cases(random.Random(seed)) if c["overflow"]]
        assert case["precision"] == "fp16"
        done = run_loop(case, notebook_function(RIGHT))
        assert done["steps"] == 0 and done["updates"] == 1 and done["grads"] is None
        assert done["scale"] == case["init_scale"] / 2


def test_backward_inside_autocast_fails():
    inside = RIGHT.replace("        scaler.scale(loss).backward()\n", "            scaler.scale(loss).backward()\n")
    assert inside != RIGHT
    message = fails(NAME, notebook_function(inside), seed=0)
    assert "backward passes ran with autocast on" in message, message


def test_step_and_update_inside_autocast_fail():
    inside = (
        HEADER
        + """
    optimizer.zero_grad()
    with torch.autocast(device_type, dtype=dtype, enabled=dtype is not None):
        for x, y in micro_batches:
            loss = loss_fn(model(x), y) * (len(y) / total)
            with torch.autocast(device_type, enabled=False):
                scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
"""
    )
    message = fails(NAME, notebook_function(inside), seed=0)
    assert "the optimizer step ran with autocast on" in message, message


def test_answers_of_the_wrong_shape_fail():
    import json

    from course_lib.tooling.checkbase import judge_response
    from course_lib.tooling.checks import get_check

    check = get_check(NAME)
    cases = check.cases(random.Random(4))
    for results, says in (
        ([{} for _ in cases], "lacks"),
        ([[] for _ in cases], "expected a dict"),
        (None, "do not match"),
    ):
        status, message = judge_response(check, cases, json.loads(json.dumps({"results": results})))
        assert status == "failed" and says in message, message
