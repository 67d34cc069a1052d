"""Chapter 09 (09_capstone.ipynb): the library code its cells call, one module per topic.

- growing.py: A model whose activations grow past fp16's range: chapter 09's NaN/inf walkthrough.
- ladder.py: The optimisation ladder of chapter 09: one change per rung, each measured, in one run.
- parity.py: Does mixed precision learn the same model? Chapter 09's answer, measured against seed
  noise.
- record_questions.py: Records chapter 09's open performance questions on a GPU: one profiled step
  of each workload (the trace readers and timer chapter 11's recorders share).
- recorded_profiles.py: What the recorded GPU profiles say, chapter 09: each function reads a
  recorded file and returns sentences computed from its numbers.
- rungs.py: The ladder's rungs, chapter 09: what a rung is, the first ladder (the course's own
  model), how rows are read.
- speedup.py: A deliberately slow training script, and the settings that make it fast: exercise 09.
- targets.py: The course's performance targets (COURSE_SPEC section 8), computed from the ladders'
  rows.

Its exercises are checked by course_lib/tooling/checks/ch09.py; the half of each check that runs
in the task process is course_lib/tooling/probes/ch09.py. Imports: the core, and earlier
chapters only (tests/test_structure.py keeps it so).
"""

__all__: list[str] = []
