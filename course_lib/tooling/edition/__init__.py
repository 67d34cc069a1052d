"""The published edition's parts (tooling): `pages` makes the sources Sphinx reads from the executed
notebooks, `check` judges the built edition. course_lib.tooling.site drives both (`make site`)."""

__all__: list[str] = []
