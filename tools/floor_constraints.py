"""Print pip constraints pinning torch and torchvision to the floors pyproject.toml declares.

    python3 tools/floor_constraints.py [pyproject.toml]   ->   torch==2.6 / torchvision==0.21

`make test-floor` installs the course against these lines, so the floors are tested, not only
declared: raise `torch>=X` in pyproject.toml and the target follows. `==2.6` is PEP 440's 2.6.0.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

FLOORED = ("torch", "torchvision")


def floors(pyproject: Path) -> dict[str, str]:
    text = pyproject.read_text()
    try:
        import tomllib

        deps = tomllib.loads(text)["project"]["dependencies"]
    except ModuleNotFoundError:  # Python 3.10 has no tomllib: read the quoted strings of the list
        block = re.search(r"^dependencies\s*=\s*\[(.*?)^\]", text, re.S | re.M)
        deps = re.findall(r'"([^"]+)"', block.group(1)) if block else []
    found = {}
    for dep in deps:
        spec = dep.split(";")[0]  # no environment markers
        name = re.match(r"\s*([A-Za-z0-9_.-]+)", spec)
        floor = re.search(r">=\s*([0-9][0-9A-Za-z.]*)", spec)
        if name and floor and name.group(1).lower() in FLOORED:
            found[name.group(1).lower()] = floor.group(1)
    missing = [n for n in FLOORED if n not in found]
    if missing:
        sys.exit(f"{pyproject}: no `>=` floor for {missing} in [project] dependencies")
    return found


if __name__ == "__main__":
    for name, version in floors(Path(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml")).items():
        print(f"{name}=={version}")
