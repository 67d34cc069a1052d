"""Chapter 00 (00_setup.ipynb): the library code its cells call, one module per topic.

- bench.py: The FP32 / TF32 / AMP training-step table, measured with the course's own loop.

Its exercises are checked by course_lib/tooling/checks/ch00.py; the half of each check that runs
in the task process is course_lib/tooling/probes/ch00.py. Imports: the core, and earlier
chapters only (tests/test_structure.py keeps it so).
"""

__all__: list[str] = []
