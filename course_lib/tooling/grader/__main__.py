"""`python -m course_lib.tooling.grader SUBMISSIONS --out GRADEBOOK` (make grade): see cli.py."""

import sys

from .cli import main

__all__: list[str] = []

sys.exit(main())
