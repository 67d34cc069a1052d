"""Chapter homes: chNN/ holds the code of notebooks/NN_*.ipynb, built on the core (course_lib/*.py).

A cell of chapter NN that calls the library imports course_lib.chapters.chNN.<module>, or, for
something an earlier chapter taught, that earlier chapter's home. Imports point only down (to the
core) or back (to an earlier chapter), never forward; tests/test_structure.py keeps it so. The
check and probe of chapter NN are course_lib/tooling/checks/chNN.py and tooling/probes/chNN.py.
"""

__all__: list[str] = []
