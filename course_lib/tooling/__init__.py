"""Tooling for instructors and course authors; teaching notebooks never import it.

A learner meets exactly one name from here, in the exercise notebooks:

    from course_lib.tooling import check
    check("00.choose_precision", choose_precision)

Everything else is for the grader and the course's authors (the Makefile wraps each command):
  checkbase        what a check is (cases / public / host / judge), the registry, judge_response
  checks/          one module of checks per chapter (ch00.py, ch01.py, ...): inputs and right answers
  slicing          which statements of a notebook a task's functions need, read from its source
  task             the task process: runs those statements, then the probe on each case
  probes/          the task side of each task (probes/ch00.py, ...): all a task process sees of a check
  grader/          the judging side: wire (one task judged), sandbox, cli (make grade), classview
  grading          the inline check(): judged as the grader judges
  exercises        exercises/ generated from solutions/ (make exercises)
  colab            stamps the Colab badge and setup cell into every notebook (make stamp)
  lab              make lab's contents manager; notebook_filter: the git filter make lab installs
  nbtools          strips outputs, refreshes the outputs nbval compares; site: make site
  edition/         the published edition's parts: pages (what a page shows), check (the built edition judged)
"""

__all__ = ["check"]


def __getattr__(name: str):
    # Imported on first use, so that `python -m course_lib.tooling.grading` does not find the
    # module already imported by its own package.
    if name == "check":
        from .grading import check

        return check
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
