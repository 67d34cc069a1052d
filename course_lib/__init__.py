"""course_lib: the small, real training library behind the amp-course notebooks.

The map (which module belongs to which chapter, and what to read first) is
course_lib/README.md. In short: the core is device, data, models, train, timing and
reference, in that order; chapters/ holds what one chapter teaches; tooling/ is for
instructors and authors.
"""

__version__ = "0.1.0"
