"""The timing tasks (00.median_step_ms, 06.time_it) under load: a correct timer passes, a wrong one fails.

A learner's timer measures each call of `fn` (and `sync`) as the grader's sleep plus the round trip to
the grader; under load both grow. The judge accepts what a correct timer can have measured, bounded
from the grader's side (course_lib/tooling/checks/timed.py), with at most timed.TRANSIT_MS of round
trip credited to a call, so that a kernel that dawdles between calls gains nothing.

- On a virtual clock (no real sleeping, many draws): correct timers pass with slow and uneven round
  trips and late wake-ups; every familiar mistake fails, named, with and without a slow round trip,
  and so does a timer that dawdles between calls to widen the allowance, and any constant.
- In real time: correct timers (the solutions' own code) pass with both CPU cores busy, inline and
  through the batch grader; with the grader answering each ask 12 ms late both ways, the solutions
  pass and the mistakes fail; a dawdler fails.
"""

from __future__ import annotations

import contextlib
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from grading_class import IMPORT, notebook
from test_grader import course_copy, grade

from course_lib.tooling import probes
from course_lib.tooling.checkbase import judge_response
from course_lib.tooling.checks import ch00, ch06, get_check, timed
from course_lib.tooling.grading import run_check
from course_lib.tooling.task import respond

ROOT = Path(__file__).resolve().parents[1]
MEDIAN, TIME_IT = "00.median_step_ms", "06.time_it"


# --------------------------------------------------------------------------- timers, right and wrong


def median_step_ms_timer(now, pick=None, dawdle=None):
    """A timer of fn's calls on the clock `now`: every call timed (warm-ups too); returns what `pick`
    picks from (warmup, times), the median of the timed calls by default. `dawdle()` runs between calls."""

    def median_step_ms(fn, warmup, iters):
        times = []
        for _ in range(warmup + iters):
            if dawdle:
                dawdle()
            t0 = now()
            fn()
            times.append(1000 * (now() - t0))
        return (pick or (lambda w, t: statistics.median(t[w:])))(warmup, times)

    return median_step_ms


def time_it_timer(now, pick=None, dawdle=None, sync_each_warmup=False, numpy=False):
    """The solution's time_it on the clock `now` (one sync after the warm-ups, or one after each, all
    timed); `pick(warmup, times)` gives median_ms instead of the median of the timed calls. numpy: a
    harmless extra sync() before each clock starts and numpy's quartiles, as a learner may write it."""

    def time_it(fn, sync, warmup=3, iters=10):
        times = []
        for i in range(warmup + iters):
            if dawdle:
                dawdle()
            if numpy and i >= warmup:
                sync()
            t0 = now()
            fn()
            if i >= warmup or sync_each_warmup or i == warmup - 1:
                sync()
            times.append(1000 * (now() - t0))
        q1, median, q3 = statistics.quantiles(times[warmup:], n=4, method="inclusive" if numpy else "exclusive")
        return {"median_ms": pick(warmup, times) if pick else median, "q1_ms": q1, "q3_ms": q3}

    return time_it


def mean(w, t):
    return statistics.mean(t[w:])


def with_warmups(w, t):
    return statistics.median(t)


def fastest(w, t):
    return min(t[w:])


def seconds(w, t):
    return statistics.median(t[w:]) / 1000


# the answers each check must reject, and a word of the message that names the mistake
MISTAKES = {
    "00.median_step_ms": {"mean": mean, "warm-up": with_warmups, "fastest call": fastest, "seconds": seconds},
    "06.time_it": {"mean": mean, "warm-up": with_warmups, "seconds": seconds},
}


def wrong_timer(name, now, pick, dawdle=None):
    """A timer that gets the calls right and returns `pick(warmup, times)`: every call timed on its own
    (for time_it, each warm-up call synced, as a timer that counts the warm-ups among its calls does)."""
    if name == "00.median_step_ms":
        return median_step_ms_timer(now, pick, dawdle)
    return time_it_timer(now, pick, dawdle, sync_each_warmup=True)


# --------------------------------------------------------------------------- a virtual clock


class Clock:
    """Time for the check's host (its perf_counter and sleep) and for the learner's timer alike."""

    def __init__(self, late=lambda: 0.0) -> None:
        self.t, self.late = 1000.0, late

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += max(0.0, seconds)

    def sleep(self, seconds: float) -> None:  # a sleep wakes up late on a busy machine, never early
        self.advance(seconds + self.late())


@pytest.fixture
def clock(monkeypatch):
    """A virtual clock in place of the checks' perf_counter and sleep: no test here really sleeps."""
    c = Clock()
    for module in (ch00, ch06):
        monkeypatch.setattr(module, "perf_counter", c.now)
        monkeypatch.setattr(module, "sleep", c.sleep)
    return c


def virtual_run(clock, name, timer, seed, way_out=lambda: 0.0, way_back=lambda: 0.0):
    """Run `timer` through the task's probe on the cases of `name` drawn with `seed`, each ask taking
    way_out() to reach the grader and way_back() to come back (seconds): (status, message)."""
    check = get_check(name)
    cases = check.cases(random.Random(seed))
    answers = []
    for case in cases:

        def host(request, case=case):
            clock.advance(way_out())
            reply = check.host(case, request)
            clock.advance(way_back())
            return reply

        with probes.answering(host):
            answers.append(check.run(check.public(case), timer))
    return judge_response(check, cases, json.loads(json.dumps({"results": answers})))


SLOW = {"no delay": (lambda: 0.00005, lambda: 0.00005), "12 ms each way": (lambda: 0.012, lambda: 0.012)}


@pytest.mark.parametrize("name", [MEDIAN, TIME_IT])
def test_virtual_correct_timers_pass_with_slow_uneven_round_trips_and_late_wake_ups(clock, name):
    """Any trip up to 12 ms each way, or 24 ms all on the way out, however uneven, and sleeps that wake up
    to 20 ms late: a correct timer passes, whichever way it is written."""
    for seed in range(40):
        rng = random.Random(seed)
        clock.late = lambda: rng.uniform(0, 0.020)
        trips = [
            (lambda: 0.012, lambda: 0.012),  # a grader thread that answers 12 ms late, both ways
            (lambda: rng.uniform(0, 0.012), lambda: rng.uniform(0, 0.012)),  # uneven
            (lambda: rng.uniform(0, 0.024), lambda: 0.0),  # all of it on the way out
        ]
        for out, back in trips:
            timers = (
                [median_step_ms_timer(clock.now)]
                if name == MEDIAN
                else [
                    time_it_timer(clock.now),
                    time_it_timer(clock.now, sync_each_warmup=True),
                    time_it_timer(clock.now, numpy=True),
                ]
            )
            for timer in timers:
                status, message = virtual_run(clock, name, timer, seed, out, back)
                assert status == "passed", (seed, message)


@pytest.mark.parametrize("name", [MEDIAN, TIME_IT])
def test_virtual_one_long_pause_on_any_call_fails_no_correct_timer(clock, name):
    """The kernel stalls 150 ms once (a garbage collection, a process scheduled late), on any one trip
    out or back: far past the allowance, yet a correct timer passes, whichever call it hits."""

    def paused_once(at):
        trips = [0]

        def trip():
            trips[0] += 1
            return 0.150 if trips[0] == at else 0.0002

        return trip

    timer = median_step_ms_timer(clock.now) if name == MEDIAN else time_it_timer(clock.now)
    for seed in range(2):
        for at in range(1, 130):
            trip = paused_once(at)
            status, message = virtual_run(clock, name, timer, seed, trip, trip)
            assert status == "passed", (seed, at, message)


@pytest.mark.parametrize("slow", SLOW, ids=list(SLOW))
@pytest.mark.parametrize("name", [MEDIAN, TIME_IT])
def test_virtual_every_familiar_mistake_fails_and_is_named(clock, name, slow):
    out, back = SLOW[slow]
    for seed in range(25):
        for word, pick in MISTAKES[name].items():
            status, message = virtual_run(clock, name, wrong_timer(name, clock.now, pick), seed, out, back)
            assert status == "failed" and word in message, (seed, word, message)


@pytest.mark.parametrize("name", [MEDIAN, TIME_IT])
def test_virtual_dawdling_between_calls_widens_nothing_a_wrong_answer_can_use(clock, name):
    """The kernel waits 200 ms before each call, outside its clock: each call's window grows by 400 ms,
    but only timed.TRANSIT_MS of it is credited, too little to reach the mean or the warm-up median."""

    def dawdle():
        clock.advance(0.2)

    for seed in range(25):
        for word, pick in MISTAKES[name].items():
            status, message = virtual_run(clock, name, wrong_timer(name, clock.now, pick, dawdle), seed)
            assert status == "failed" and word in message, (seed, word, message)
        right = (
            median_step_ms_timer(clock.now, dawdle=dawdle)
            if name == MEDIAN
            else time_it_timer(clock.now, dawdle=dawdle)
        )
        assert virtual_run(clock, name, right, seed)[0] == "passed"  # dawdling costs a correct timer nothing either


@pytest.mark.parametrize("slow", SLOW, ids=list(SLOW))
def test_virtual_time_it_without_sync_or_with_sync_only_at_the_end_fails(clock, slow):
    out, back = SLOW[slow]

    def no_sync(fn, sync, warmup=3, iters=10):
        return time_it_timer(clock.now)(fn, lambda: None, warmup, iters)

    def sync_only_at_the_end(fn, sync, warmup=3, iters=10):
        times = []
        for _ in range(warmup + iters):
            t0 = clock.now()
            fn()
            times.append(1000 * (clock.now() - t0))
        sync()
        q1, median, q3 = statistics.quantiles(times[warmup:], n=4)
        return {"median_ms": median, "q1_ms": q1, "q3_ms": q3}

    for seed in range(5):
        assert "never called sync()" in virtual_run(clock, TIME_IT, no_sync, seed, out, back)[1]
        status, message = virtual_run(clock, TIME_IT, sync_only_at_the_end, seed, out, back)
        assert status == "failed" and "sync()" in message, message


def test_virtual_no_constant_passes_both_cases(clock):
    """The two cases of each check are far enough apart that one hard-coded number never passes both,
    even with every call's window widened by a dawdling kernel."""
    for name in (MEDIAN, TIME_IT):
        for seed in range(10):
            for c in range(1, 400, 3):
                answer = float(c)
                timer = wrong_timer(name, clock.now, lambda w, t, a=answer: a, dawdle=lambda: clock.advance(0.1))
                status, message = virtual_run(clock, name, timer, seed)
                if name == TIME_IT and status == "passed":  # quartiles from the real times: only the median is fixed
                    raise AssertionError(f"{name} passed the constant median {answer}")
                assert status == "failed", (name, seed, answer)


def test_the_cases_keep_each_task_short_and_inside_its_time_limit():
    for name in (MEDIAN, TIME_IT):
        check = get_check(name)
        for seed in range(50):
            total = sum(sum(case["seconds"]) for case in check.cases(random.Random(seed)))
            assert total < 3.7 and total * 5 < check.time_limit, (name, total)


# --------------------------------------------------------------------------- in real time


def solution_source(name: str) -> str:
    """The solutions notebook's own cell for the task (it ends with its inline check)."""
    notebook_file = "00_setup_exercises.ipynb" if name == MEDIAN else "06_profiling_exercises.ipynb"
    task = get_check(name).args[0]
    for cell in json.loads((ROOT / "solutions" / notebook_file).read_text())["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "code" and f"def {task}(" in source:
            return source
    raise LookupError(f"no cell defines {task} in solutions/{notebook_file}")


def solution(name: str):
    namespace = {"__name__": "__main__", "check": lambda *args: None}  # defined as its notebook cell defines it
    exec(solution_source(name), namespace)
    return namespace[get_check(name).args[0]]


@contextlib.contextmanager
def both_cores_busy():
    """Two processes that keep both CPU cores of the test machine busy while the block runs."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        yield
    finally:
        for p in busy:
            p.kill()
            p.wait()


@pytest.mark.slow
@pytest.mark.timing
def test_the_solutions_pass_inline_with_both_cores_busy():
    with both_cores_busy():
        for _ in range(3):
            for name in (MEDIAN, TIME_IT):
                status, message, _ = run_check(name, solution(name))
                assert status == "passed", message


def late_run(name: str, timer, late: float = 0.012):
    """run_check's path (respond, then judge_response), with the grader answering every ask `late`
    seconds late both ways, as a grader thread busy with another notebook does: (check, cases, answers)."""
    check = get_check(name)
    cases = check.cases(random.Random())

    def host(i, request):
        time.sleep(late)  # the ask waits for the busy thread
        reply = json.loads(json.dumps(check.host(cases[i], json.loads(json.dumps(request)))))
        time.sleep(late)  # and so does the reply
        return reply

    response = respond(probes.find(name), [timer], [check.public(c) for c in cases], host)
    return check, cases, json.loads(json.dumps(response))


@pytest.mark.timing
@pytest.mark.parametrize("name", [MEDIAN, TIME_IT])
def test_a_grader_that_answers_12_ms_late_both_ways_passes_a_correct_timer_and_no_mistake(name):
    """One run of a correct timer that times every call (warm-ups too) with the grader 12 ms late each
    way; its right answer passes, and each familiar mistake computed from the same times fails, named."""
    runs = []

    def keep(w, times):
        runs.append((w, times))
        return statistics.median(times[w:])

    check, cases, response = late_run(name, wrong_timer(name, time.perf_counter, keep))
    assert judge_response(check, cases, response) == ("passed", "passed")
    for word, pick in MISTAKES[name].items():
        if name == MEDIAN:
            results = [{"ms": pick(w, t)} for w, t in runs]
        else:
            results = [
                {"result": {**r["result"], "median_ms": pick(w, t)}} for r, (w, t) in zip(response["results"], runs)
            ]
        status, message = judge_response(check, cases, {"results": results})
        assert status == "failed" and word in message, (word, message)


@pytest.mark.timing
def test_the_time_it_solution_passes_with_the_grader_12_ms_late_both_ways():
    """Its fn() calls of the warm-up run back to back, then one sync(): the pattern the test above lacks."""
    assert judge_response(*late_run(TIME_IT, solution(TIME_IT))) == ("passed", "passed")


@pytest.mark.timing
@pytest.mark.parametrize("name", [MEDIAN, TIME_IT])
def test_a_timer_that_dawdles_between_calls_and_returns_the_mean_fails(name):
    """Each call's window grows by the dawdling on either side, more than timed.TRANSIT_MS: still the mean."""
    timer = wrong_timer(name, time.perf_counter, mean, dawdle=lambda: time.sleep(0.6 * timed.TRANSIT_MS / 1000))
    status, message, _ = run_check(name, timer)
    assert status == "failed" and "mean" in message, message


@pytest.mark.slow
@pytest.mark.timing
def test_the_solutions_pass_through_the_batch_grader_with_both_cores_busy(tmp_path):
    """Two notebooks graded at once (the grader's threads answer each other's asks late) on a machine
    whose cores are both busy: the solutions' timers pass, each in its own kernel, over the grader's channel."""
    course, home, subs = course_copy(tmp_path / "course"), tmp_path / "home", tmp_path / "subs"
    home.mkdir()
    for name, file in ((MEDIAN, "00_setup_exercises.ipynb"), (TIME_IT, "06_profiling_exercises.ipynb")):
        (subs / "learner").mkdir(parents=True, exist_ok=True)
        (subs / "learner" / file).write_text(notebook([IMPORT, solution_source(name)]))
    with both_cores_busy():
        proc = grade(course, subs, tmp_path / "out", home, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["exercise"]: r for r in json.loads((tmp_path / "out" / "gradebook.json").read_text())}
    for name in (MEDIAN, TIME_IT):
        assert rows[name]["status"] == "passed", rows[name]["message"]
