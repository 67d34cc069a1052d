"""Checks for exercise 07 (data loading). The learner's function returns DataLoader settings as plain
data (the probe, course_lib/tooling/probes/ch07.py, only calls it). For every machine the check
describes, the grader validates them and requires the worker count the chapter teaches: the model
takes one batch per step_ms, each worker makes one per load_ms, so load_ms / step_ms workers (plus
headroom), at most the cores there are. For the machine it measured itself it also builds the
loader in its own process on its own dataset and augmentation, and measures how long a training
loop with a fixed simulated step waits for data. Nothing the learner's code measures or prints is
used: only the settings.

Inline (check() in the learner's notebook) the machine measured is the learner's own: the messages
say "this machine", and the judge prints a line per phase and per measured run as it goes, the
numbers its verdict is made of. In the batch grader they say "the grader's machine" and print nothing
(course_lib/tooling/checks/measured.py, shared with 09.speed_up)."""

from __future__ import annotations

import functools
import json
import math
import random
import sys
import threading
from typing import Callable

from torch.utils.data import DataLoader

from ...chapters.ch07 import data_wait, loading
from ...data import load_dataset
from ..checkbase import Check, CheckFailure, register
from ..probes.ch07 import KEYS
from .measured import in_fresh_process_reporting, machine, reporting, say

__all__: list[str] = []  # the checks register themselves; nothing here is imported by name

THRESHOLD = 0.15  # at most this fraction of the loop's time may be spent waiting for data
NOISE = 0.08  # the best of two runs of the same settings differ by about this much on 2 cores
CHANCES = 3  # runs of the learner's settings at most, when the first one waits too long
STEPS = 20
MEASURE_LIMIT = 120.0  # seconds for one submission's measurements, torch's import included
# Machines the check describes besides its own: (cores to draw from, workers needed = load_ms / step_ms).
# Many cores and a fast model need many workers (no constant such as 4 or 8 fits); many cores and a
# slow model need few (num_workers = cpus is far too many); few cores and a fast model need all the
# cores and no more (the rates alone are not the answer).
DESCRIBED = (((32, 48, 64), (9.5, 12.0)), ((16, 24, 32), (1.2, 1.8)), ((3, 5, 6), (7.0, 10.0)))
ALLOWED = {
    "batch_size": "the case's batch size",
    "num_workers": "an int from 0 to {max_workers}",
    "prefetch_factor": "None or an int from 1 to 16",
    "persistent_workers": "True or False",
    "pin_memory": "True or False",
    "shuffle": "True or False",
    "drop_last": "True or False",
}
# Judges of several submissions run in threads of one grader: measuring one at a time keeps one
# measurement's workers from taking the cores another measurement needs.
_MEASURING = threading.Lock()


@functools.cache
def _dataset() -> loading.AugmentedImages:
    images, labels = loading.raw_images(load_dataset(train_size=1000, verbose=False))
    return loading.AugmentedImages(images, labels)


def _max_workers(n_cpus: int) -> int:
    return min(4 * n_cpus, 32)


def validate(settings: object, case: dict) -> dict:
    """The settings as DataLoader keyword arguments, or CheckFailure saying what is wrong with them."""
    example = "{'batch_size': %d, 'num_workers': 2}" % case["batch_size"]
    if not isinstance(settings, dict):
        raise CheckFailure(
            f"loader_settings returned {settings!r}; expected a dict of DataLoader keyword arguments, e.g. {example}"
        )
    unknown = sorted(set(settings) - set(ALLOWED))
    if unknown:
        raise CheckFailure(
            f"loader_settings returned settings this task does not take: {unknown}; allowed: {sorted(ALLOWED)}"
        )
    limit = _max_workers(case["cpus"])
    for key, value in settings.items():
        if key == "batch_size":
            ok = value == case["batch_size"] and type(value) is int
        elif key == "num_workers":
            ok = type(value) is int and 0 <= value <= limit
        elif key == "prefetch_factor":
            ok = value is None or (type(value) is int and 1 <= value <= 16)
        else:
            ok = type(value) is bool
        if not ok:
            want = ALLOWED[key].format(max_workers=limit)
            raise CheckFailure(
                f"loader_settings returned {key}={value!r}; expected {want}"
                + (" (the model's batch size is fixed)" if key == "batch_size" else "")
            )
    if "batch_size" not in settings:
        raise CheckFailure(
            f"loader_settings returned no batch_size; the model takes batches of {case['batch_size']}, e.g. {example}"
        )
    return dict(settings)


def worker_range(case: dict) -> tuple[int, int]:
    """The worker counts that follow the chapter's rule on the machine `case` describes: at least
    load_ms / step_ms rounded up (fewer cannot keep up), at most twice that or two more (headroom
    for the spread), and never more than the cores (more cannot run at once: they oversubscribe)."""
    need = case["load_ms"] / case["step_ms"]
    low = math.ceil(need)
    return min(case["cpus"], low), min(case["cpus"], max(math.ceil(2 * need), low + 2))


def check_workers(case: dict, settings: dict, call: str) -> None:
    """CheckFailure unless the settings' num_workers is within worker_range(case), saying why."""
    workers, (low, high) = settings.get("num_workers", 0), worker_range(case)
    if low <= workers <= high:
        return
    need, cpus = case["load_ms"] / case["step_ms"], case["cpus"]
    rates = (
        f"each worker makes one batch per load_ms={case['load_ms']:g} ms and the model takes one per "
        f"step_ms={case['step_ms']:g} ms, so load_ms / step_ms = {need:.2f} workers keep up"
    )
    if low == high:
        want = (
            f"{low} (all its cpus={cpus} cores: more cannot run at once)" if low == cpus < math.ceil(need) else str(low)
        )
    else:
        want = f"{low} to {high} (a little headroom{', within its ' + str(cpus) + ' cores' if high == cpus else ''})"
    default = " (the default: loading in the training process)" if "num_workers" not in settings else ""
    raise CheckFailure(
        f"{call} returned num_workers={workers}{default}: there {rates}; expected {want}. "
        "The worker count follows from these numbers, not from a constant"
    )


def reference_settings(case: dict) -> dict:
    """The grader's own answer: enough workers to keep up, within the cores there are."""
    return {
        "batch_size": case["batch_size"],
        "num_workers": min(max(case["cpus"], 1), data_wait.workers_needed(case["load_ms"], case["step_ms"])),
    }


def measurements(case: dict, settings: dict, report: Callable[[dict], None] = lambda run: None) -> dict:
    """The learner's wait fraction, and only when that is over THRESHOLD: the grader's own settings measured
    just after it, and the learner's again, up to CHANCES runs in all until one is within allowed_wait (the
    best run counts: a 2-core machine's runs of the same settings differ by 10 points now and then).
    report() gets each run as it ends: {"who": "mine" or "theirs", "wait": fraction}.
    Returns {"mine": [each run's fraction], "theirs": fraction or None}."""

    def run(who: str, chosen: dict) -> float:
        wait = wait_fraction(chosen, case["step_ms"])
        report({"who": who, "wait": wait})
        return wait

    mine = [run("mine", settings)]
    if mine[0] <= THRESHOLD:
        return {"mine": mine, "theirs": None}
    theirs = run("theirs", reference_settings(case))  # for the message, and the rule
    if settings.get("num_workers", 0) == 0:
        return {"mine": mine, "theirs": theirs}  # loading in the training process fails however it measures
    while len(mine) < CHANCES and min(mine) > allowed_wait(theirs):
        mine.append(run("mine", settings))
    return {"mine": mine, "theirs": theirs}


def measure_all(pairs: list, report: Callable[[dict], None] = lambda run: None) -> list[dict]:
    """measurements() for each [case, settings] in turn; report() also gets the pair's index as "at"."""
    return [
        measurements(case, settings, lambda r, i=i: report({**r, "at": i})) for i, (case, settings) in enumerate(pairs)
    ]


def measure_in_fresh_process(pairs: list, report: Callable[[dict], None] = lambda run: None) -> list[dict]:
    """measure_all() in a new Python process, each run reported as it ends; one process for every case,
    so that torch's import and the dataset are paid once."""
    return in_fresh_process_reporting(
        __name__, pairs, MEASURE_LIMIT, f"measuring a loader with {pairs[0][1]!r}", report
    )


def wait_fraction(settings: dict, step_ms: float) -> float:
    """Build the loader in this process and measure the fraction of the loop's time spent in next()."""
    with data_wait.quiet_loader_warnings():
        loader = DataLoader(_dataset(), **settings)
        return data_wait.measure_loader(loader, data_wait.simulated_step(step_ms), steps=STEPS).wait_fraction


@register
class LoaderSettings(Check):
    name, args, points = "07.loader_settings", ("loader_settings",), 4
    hint = (
        "Each worker makes one batch every load_ms; the model takes one every step_ms. So you need at least "
        "load_ms / step_ms workers (round up, and leave some headroom: the chapter's workers_needed adds 25%), "
        "but never more than `cpus`: more cannot run at once. Compute it from the four arguments, as the "
        "check calls your function for several machines (a few cores to 64): no constant count fits them all. "
        "num_workers=0 loads in the training process itself, between steps."
    )
    time_limit = 30.0

    def cases(self, rng: random.Random) -> list:
        n = data_wait.cpus()
        say(f"{self.name}: timing one core's augmentation on {machine()} ...", end="")
        with _MEASURING:  # one core's cost per image of the grader's augmentation, on this machine, now
            probe = DataLoader(_dataset(), batch_size=32)
            run = data_wait.measure_loader(probe, data_wait.simulated_step(0), steps=8, warmup=1)
        say(f" {run.step.median_ms:.0f} ms per batch of 32")
        per_image_ms = run.step.median_ms / 32
        out = []
        for batch_size in (rng.choice([24, 32, 40]), rng.choice([48, 56, 64])):
            load_ms = per_image_ms * batch_size
            # a model faster than one core's augmentation, but one that the cores here can keep fed
            ratio = rng.uniform(0.65, 0.75) if n >= 2 else rng.uniform(1.3, 1.5)
            out.append(
                {
                    "batch_size": batch_size,
                    "load_ms": round(load_ms, 1),
                    "step_ms": round(ratio * load_ms, 1),
                    "cpus": n,
                    "measured": True,
                }
            )
        for cores, (low, high) in DESCRIBED:  # other machines: the same rule, not measured here
            batch_size, need = rng.choice([64, 128, 256]), rng.uniform(low, high)
            load_ms = round(batch_size * rng.uniform(0.3, 2.0), 1)  # one core's cost of a batch there
            out.append(
                {
                    "batch_size": batch_size,
                    "load_ms": load_ms,
                    "step_ms": round(load_ms / need, 1),
                    "cpus": rng.choice(cores),
                    "measured": False,
                }
            )
        rng.shuffle(out)
        return out

    def public(self, case: dict) -> dict:
        return {k: case[k] for k in KEYS}  # which machine was measured is the grader's business

    def describe(self, case: dict) -> str:
        where = machine() if case.get("measured") else "a machine the check describes"
        return "loader_settings(" + ", ".join(f"{k}={case[k]!r}" for k in KEYS) + f") for {where}"

    def judge(self, cases: list, results: list) -> None:
        checked = []
        for case, got in zip(cases, results, strict=True):  # respond() gives one result per case
            settings = validate(got, case)
            try:
                with data_wait.quiet_loader_warnings():
                    DataLoader(_dataset(), **settings)
            except (ValueError, TypeError) as e:
                raise CheckFailure(f"DataLoader refused the settings {settings!r}: {e}") from None
            check_workers(case, settings, self.describe(case))
            checked.append((case, settings))
        say(f"   worker counts: within the chapter's rule on all {len(checked)} machines")
        # Only then the measurements, which take seconds: a wrong worker count fails at once.
        self._measure_all([(case, settings) for case, settings in checked if case["measured"]])

    def _measure(self, case: dict, settings: dict) -> None:
        self._measure_all([(case, settings)])

    def _measure_all(self, pairs: list) -> None:
        """Measure every (case, settings) in one fresh process, saying each run as it ends, then judge each."""
        first = set()

        def report(run: dict) -> None:
            case, settings = pairs[run["at"]]
            wait, workers = run["wait"], reference_settings(case)["num_workers"]
            if run["who"] == "theirs":
                allowed = "" if settings.get("num_workers", 0) == 0 else f"; up to {allowed_wait(wait):.0%} passes here"
                say(f"      over {THRESHOLD:.0%}, so the check's own num_workers={workers} ran: {wait:.0%}{allowed}")
            elif run["at"] in first:
                say(f"      your settings again: {wait:.0%}")
            else:
                first.add(run["at"])
                say(
                    f"   batch {case['batch_size']}, {case['step_ms']:g} ms of compute per step: "
                    f"your loader waited for data {wait:.0%} of the time"
                )

        if not pairs:
            return
        say(f"   measuring your settings on {machine()}, in a fresh Python process (torch's import first):")
        with _MEASURING:
            results = measure_in_fresh_process([[case, settings] for case, settings in pairs], report)
        for (case, settings), measured in zip(pairs, results, strict=True):
            self._verdict(case, settings, min(measured["mine"]), len(measured["mine"]), measured["theirs"])

    def _verdict(self, case: dict, settings: dict, mine: float, runs: int, theirs: float | None) -> None:
        if mine <= THRESHOLD:
            return
        assert theirs is not None  # measured whenever the learner's first run is over the threshold
        call, step, ours = self.describe(case), case["step_ms"], reference_settings(case)
        best = f"the best of {runs} runs, " if runs > 1 else ""
        in_process = settings.get("num_workers", 0) == 0
        if in_process or mine > allowed_wait(theirs):
            rule = (
                "num_workers=0 loads between steps and never passes"
                if in_process
                else f"or not much more than the check's own settings: {allowed_wait(theirs):.0%} here"
            )
            raise CheckFailure(
                f"{call} returned {settings!r}: a loop with {step:g} ms of compute per step waited for data "
                f"{mine:.0%} of the time ({best}at most {THRESHOLD:.0%} passes, {rule}); with {ours!r} it waited "
                f"{theirs:.0%} on {machine()} just now"
            )
        # Within noise of the grader's own settings on this machine, now, passes: a machine where
        # those barely hide the loading (or cannot: a busy one) must not fail an answer as good.
        # Loading in the training process itself never passes.
        allowed = allowed_wait(theirs)
        say(f"      passes: {best}{mine:.0%}, is within {allowed:.0%} (the check's own settings plus noise)")


def allowed_wait(theirs: float) -> float:
    """The most a learner's loader may wait, given what the grader's own settings waited just now.

    The threshold, or the grader's wait plus the noise between two runs; on a busy machine (the
    grader's settings above the threshold) the margin grows by as much as the machine is over,
    because a busy machine's runs differ more. Continuous in `theirs`: no cliff at the threshold.
    """
    return max(THRESHOLD, theirs + NOISE + max(0.0, theirs - THRESHOLD))


# measure_in_fresh_process runs `python -m course_lib.tooling.checks.ch07 '[[case, settings], ...]'`
if __name__ == "__main__":
    print(json.dumps(measure_all(json.loads(sys.argv[1]), reporting)), flush=True)
