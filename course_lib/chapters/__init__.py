"""Chapter modules: the code one chapter teaches, built on the core (course_lib/*.py).

Each module is introduced by one chapter and imports the core; the map of which module
belongs to which chapter is course_lib/README.md.
"""
