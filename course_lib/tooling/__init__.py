"""Tooling for instructors and course authors; teaching notebooks never import it.

A learner meets exactly one name from here, in the exercise notebooks:

    from course_lib.tooling import check
    check("00.choose_precision", choose_precision)

Everything else runs from the command line (the Makefile wraps each):
  grading    how a check is written (cases / public / host / judge), the inline check()
  checks/    one module of checks per chapter (ch00.py, ch01.py, ...): inputs and right answers
  probes/    the kernel side of each task (probes/ch00.py, ...): all a graded kernel sees of a check
  grader     the batch grader: a folder of submissions in, a gradebook out (make grade)
  runner     one submission's run: its kernel, its cells, then one task at a time
  sandbox    where a kernel runs: namespaces holding only the learner library, or a session
  exercises  exercises/ generated from solutions/ (make exercises)
  colab      stamps the Colab badge and setup cell into every notebook (make stamp)
  nbtools    strips outputs, refreshes the outputs nbval compares
"""

__all__ = ["check"]


def __getattr__(name: str):
    # Imported on first use, so that `python -m course_lib.tooling.grading` does not find the
    # module already imported by its own package.
    if name == "check":
        from .grading import check

        return check
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
