"""Chapter 07 (07_loading.ipynb): the library code its cells call, one module per topic.

- data_wait.py: The data wait measured: a training step timed around `next()`, a sweep over a loader
  knob, its table and plot.
- loading.py: Data loading measured against the model's consumption rate: workers, pinning,
  prefetching, seeds.

Its exercises are checked by course_lib/tooling/checks/ch07.py; the half of each check that runs
in the task process is course_lib/tooling/probes/ch07.py. Imports: the core, and earlier
chapters only (tests/test_structure.py keeps it so).
"""

__all__: list[str] = []
