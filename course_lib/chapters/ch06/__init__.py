"""Chapter 06 (06_profiling.ipynb): the library code its cells call, one module per topic.

- measured_steps.py: The training steps chapter 06 measures, and what it measures of them besides
  the profile: time and memory.
- profiling.py: Profiling a training step: torch.profiler with a schedule, its tables, and what
  chapter 06 measures with it.
- traces.py: Reading a Chrome trace of torch.profiler with nothing but `json`: one step's numbers, a
  diagnosis, a picture.

Its exercises are checked by course_lib/tooling/checks/ch06.py; the half of each check that runs
in the task process is course_lib/tooling/probes/ch06.py. Imports: the core, and earlier
chapters only (tests/test_structure.py keeps it so).
"""

__all__: list[str] = []
