"""Chapter 04 (04_accumulation.ipynb): the library code its cells call, one module per topic.

- accumulation.py: Gradient accumulation: one optimizer step over several micro-batches, its
  equivalence and its memory.
- accumulation_pitfalls.py: What breaks gradient accumulation: update() in the wrong place,
  BatchNorm, no_sync, a popular article's loop.
- accumulation_tokens.py: Gradient accumulation with a token-level loss: divide by the real tokens
  of the whole effective batch.
- cnn_memory.py: SimpleCNN's step memory, walked through backward and measured.

Its exercises are checked by course_lib/tooling/checks/ch04.py; the half of each check that runs
in the task process is course_lib/tooling/probes/ch04.py. Imports: the core, and earlier
chapters only (tests/test_structure.py keeps it so).
"""

__all__: list[str] = []
