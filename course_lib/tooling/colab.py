"""Colab badge and setup cell, stamped into every notebook from one configuration place.

The repository and ref live in pyproject.toml under [tool.amp-course];
`python -m course_lib.tooling.colab stamp` (make stamp) writes them into cell 0 (badge) and
cell 1 (setup) of every notebook, so a fork or a workshop tag changes one line, not forty
notebooks.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat

__all__ = ["read_config", "stamp_notebook", "stamp_all", "notebook_paths"]

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK_DIRS = ("notebooks", "solutions", "exercises")
BADGE_ID, SETUP_ID = "colab-badge", "colab-setup"
CLONE_DIR = "/content/amp-course"

# Cell 1. Colab shows "# @title" cells collapsed, as a form; the why is in cell 0's markdown.
SETUP_TEMPLATE = """\
# @title Setup: fetch the course on Colab, then print this machine's hardware
import os, subprocess, sys
if "google.colab" in sys.modules and not os.path.isdir("{clone_dir}"):
    subprocess.run("git clone -q --depth 1 --branch {ref} https://github.com/{repo}"
                   f" {clone_dir} && {{sys.executable}} -m pip install -q -e {clone_dir}",
                   shell=True, check=True)
sys.path.insert(0, "{clone_dir}")  # import it without a restart; off Colab: no such folder
from course_lib.device import hardware_report
print(hardware_report())"""

# Cell 0: the badge, and what the setup cell does (and does not do) in words.
BADGE_TEMPLATE = """\
[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({url}) [Open this notebook in Colab]({url})

*Setup:* on Colab the next cell fetches this course at the notebook's version ({ref}) and
installs it without touching Colab's own torch (the course only sets minimum versions);
running it again does nothing new. Anywhere else it only prints what your hardware can do."""


def read_config(root: Path = ROOT) -> dict[str, str]:
    """The course's GitHub repo and ref, from pyproject.toml [tool.amp-course]."""
    text = (root / "pyproject.toml").read_text()
    try:
        import tomllib  # Python >= 3.11

        cfg = tomllib.loads(text)["tool"]["amp-course"]
    except ModuleNotFoundError:  # Python 3.10: the table is two plain `key = "value"` lines
        block = text.split("[tool.amp-course]", 1)[1].split("\n[", 1)[0]
        cfg = dict(re.findall(r'^(\w+)\s*=\s*"([^"]*)"', block, flags=re.M))
    return {"repo": cfg["repo"], "ref": cfg["ref"]}


def badge_source(relpath: str, cfg: dict[str, str]) -> str:
    url = f"https://colab.research.google.com/github/{cfg['repo']}/blob/{cfg['ref']}/{relpath}"
    return BADGE_TEMPLATE.format(url=url, ref=cfg["ref"])


def setup_source(cfg: dict[str, str]) -> str:
    return SETUP_TEMPLATE.format(clone_dir=CLONE_DIR, **cfg)


# The metadata a Python kernel describes itself with, as JupyterLab would save it, less the Python
# version (it is the reader's machine's, not the course's: course_lib.tooling.lab adds it on opening
# and removes it on saving, so reading a notebook in `make lab` never changes the file).
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
LANGUAGE_INFO = {
    "codemirror_mode": {"name": "ipython", "version": 3},
    "file_extension": ".py",
    "mimetype": "text/x-python",
    "name": "python",
    "nbconvert_exporter": "python",
    "pygments_lexer": "ipython3",
}


def stamp_notebook(nb: nbformat.NotebookNode, relpath: str, cfg: dict[str, str] | None = None) -> bool:
    """Make cell 0 the badge and cell 1 the setup cell; set Colab metadata.

    Idempotent: returns True only if something changed. Cells are found by their ids, so
    re-stamping replaces them instead of adding more.
    """
    cfg = cfg or read_config()
    before = nbformat.writes(nb)
    nb.cells = [c for c in nb.cells if c.get("id") not in (BADGE_ID, SETUP_ID)]
    badge = nbformat.v4.new_markdown_cell(badge_source(relpath, cfg))
    badge["id"] = BADGE_ID
    setup = nbformat.v4.new_code_cell(setup_source(cfg))
    setup["id"] = SETUP_ID
    nb.cells[:0] = [badge, setup]
    nb.metadata["accelerator"] = "GPU"
    nb.metadata.setdefault("colab", {})["gpuType"] = "T4"
    nb.metadata.setdefault("colab", {}).setdefault("provenance", [])
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nb.metadata["language_info"] = {k: (dict(v) if isinstance(v, dict) else v) for k, v in LANGUAGE_INFO.items()}
    return nbformat.writes(nb) != before


def notebook_paths(root: Path = ROOT) -> list[Path]:
    return sorted(p for d in NOTEBOOK_DIRS for p in (root / d).glob("*.ipynb"))


def stamp_all(root: Path = ROOT, check: bool = False) -> list[Path]:
    """Stamp every notebook; with check=True only report the ones that need it."""
    cfg, changed = read_config(root), []
    for path in notebook_paths(root):
        nb = nbformat.read(path, as_version=4)
        if stamp_notebook(nb, path.relative_to(root).as_posix(), cfg):
            changed.append(path)
            if not check:
                nbformat.write(nb, path)
    return changed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m course_lib.tooling.colab", description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["stamp"])
    p.add_argument("--check", action="store_true", help="only list notebooks that are not stamped; exit 1 if any")
    args = p.parse_args(argv)
    changed = stamp_all(check=args.check)
    for path in changed:
        print(("needs stamping: " if args.check else "stamped: ") + str(path.relative_to(ROOT)))
    return 1 if (args.check and changed) else 0


if __name__ == "__main__":
    sys.exit(main())
