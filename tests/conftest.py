"""pytest configuration for tests/: the fixture notebooks are data, not tests for nbval."""

collect_ignore_glob = ["fixtures/*"]
