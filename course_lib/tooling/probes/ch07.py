"""Task side of exercise 07's check (see course_lib.tooling.probes).

The learner's loader_settings gets a machine's description (batch size, one core's load time per
batch, the model's step time, the cores) and returns DataLoader settings as plain data. The grader
validates them, checks that the worker count follows from that description, and, for the machine it
measured itself, builds the loader and measures the data wait in its own process."""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["loader_settings"]

KEYS = ("batch_size", "load_ms", "step_ms", "cpus")  # the arguments of loader_settings, nothing else


def loader_settings(case: dict, loader_settings_fn: Callable) -> Any:
    return loader_settings_fn(**{k: case[k] for k in KEYS})
