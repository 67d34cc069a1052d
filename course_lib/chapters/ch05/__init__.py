"""Chapter 05 (05_multiple.ipynb): the library code its cells call, one module per topic.

- article_two_models.py: The article's two models, two losses and two optimizers under one
  GradScaler: chapter 05's first loops.
- doctor.py: The AMP doctor: run your training loop under instrumentation and name the classic
  mistakes.
- doctor_catalog.py: The AMP doctor's words: every mistake it names, with what it saw, the fix and
  the chapter that teaches it.
- doctor_recorder.py: The AMP doctor's recorder: a training loop's calls, each an Event with the
  autocast state.
- multi.py: Several models, losses and optimizers under one GradScaler: the loops of chapter 05.

Its exercises are checked by course_lib/tooling/checks/ch05.py; the half of each check that runs
in the task process is course_lib/tooling/probes/ch05.py. Imports: the core, and earlier
chapters only (tests/test_structure.py keeps it so).
"""

__all__: list[str] = []
