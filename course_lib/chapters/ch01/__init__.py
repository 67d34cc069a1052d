"""Chapter 01 (01_formats.ipynb): the library code its cells call, one module per topic.

- format_limits.py: What a format's range and precision do to numbers: fp32, tf32, fp16, bf16 and
  fp8 side by side.
- formats.py: Floating-point formats bit by bit: fp32, fp16, bf16, fp8 (e4m3fn, e5m2), and tf32
  described.
- matmul.py: Matrix multiplies in each precision: how accurate they are, against float64; the
  datasheet peaks per GPU (chapter 02 measures the speed, in ch02/matmul_speed.py).
- widgets.py: Interactive explorers for the notebooks, each with a static fallback.

Its exercises are checked by course_lib/tooling/checks/ch01.py; the half of each check that runs
in the task process is course_lib/tooling/probes/ch01.py. Imports: the core, and earlier
chapters only (tests/test_structure.py keeps it so).
"""

__all__: list[str] = []
