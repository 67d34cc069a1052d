"""Exercise notebooks are generated from the solutions: `make exercises`.

    python -m course_lib.tooling.exercises [--check]

Each solution in solutions/NN_x.ipynb keeps its answers between `### BEGIN SOLUTION` and
`### END SOLUTION` (code) or `<!-- BEGIN SOLUTION -->` and `<!-- END SOLUTION -->` (markdown);
the exercise is the same notebook with each answer replaced by a stub. A test fails while
exercises/ is stale, so the two cannot drift.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from pathlib import Path

__all__ = ["exercise_text", "generate", "main"]

ROOT = Path(__file__).resolve().parents[2]
STUB = 'raise NotImplementedError("Exercise: write your solution here")'
MD_STUB = "_Your answer here._"
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
MD_BEGIN, MD_END = "<!-- BEGIN SOLUTION -->", "<!-- END SOLUTION -->"


def _strip_code(src: str, where: str) -> str:
    out: list[str] = []
    inside = False
    for n, line in enumerate(src.split("\n"), 1):
        if BEGIN in line:
            if inside:
                raise ValueError(f"{where}: nested {BEGIN!r} at line {n}")
            inside = True
            out.append(line[: len(line) - len(line.lstrip())] + STUB)
        elif END in line:
            if not inside:
                raise ValueError(f"{where}: {END!r} without a BEGIN at line {n}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{where}: {BEGIN!r} without an END")
    return "\n".join(out)


def _strip_markdown(src: str, where: str) -> str:
    if BEGIN in src or END in src:  # would leak the answer as a heading
        raise ValueError(f"{where}: code markers in a markdown cell; use {MD_BEGIN} ... {MD_END}")
    new = re.sub(re.escape(MD_BEGIN) + ".*?" + re.escape(MD_END), MD_STUB, src, flags=re.S)
    if MD_BEGIN in new or MD_END in new:
        raise ValueError(f"{where}: unbalanced or nested {MD_BEGIN} / {MD_END}")
    return new


def exercise_text(solution: Path, cfg: dict[str, str] | None = None) -> str:
    """The exact bytes (as text) of the exercise generated from one solution notebook."""
    import nbformat

    from course_lib.tooling.colab import stamp_notebook

    nb = nbformat.read(solution, as_version=4)
    nb.nbformat_minor = max(nb.nbformat_minor, 5)  # cell ids
    for i, cell in enumerate(nb.cells):
        if not cell.get("id"):  # deterministic, so that `generate --check` is stable
            cell["id"] = hashlib.sha1(f"{solution.name}:{i}".encode()).hexdigest()[:8]
        where = f"{solution.name} cell {i} (id {cell['id']})"
        if cell.cell_type == "code":
            cell.source = _strip_code(cell.source, where)
            cell.outputs, cell.execution_count = [], None
        elif cell.cell_type == "markdown":
            cell.source = _strip_markdown(cell.source, where)
        for key in ("execution", "ExecuteTime"):  # run timings: noise in diffs
            cell.metadata.pop(key, None)
    nb.metadata.pop("widgets", None)
    nb.metadata["amp_course"] = {"source": f"solutions/{solution.name}"}  # informational: the file name is the slot
    stamp_notebook(nb, f"exercises/{solution.name}", cfg)
    return nbformat.writes(nb) + "\n"


def generate(
    solutions_dir: Path = ROOT / "solutions", exercises_dir: Path = ROOT / "exercises", check: bool = False
) -> list[Path]:
    """Write exercises/NN_x.ipynb from every solutions/NN_x.ipynb (make exercises).

    Returns the exercise paths that were (check=True: would be) written or deleted. A stale
    exercise is one that differs from what its solution generates, or has no solution.
    """
    from course_lib.tooling.colab import read_config

    cfg = read_config()
    solutions = sorted(p for p in Path(solutions_dir).glob("*.ipynb") if re.match(r"\d{2}_", p.name))
    texts = {Path(exercises_dir) / p.name: exercise_text(p, cfg) for p in solutions}  # all errors before any write
    stale = [p for p, text in texts.items() if not p.exists() or p.read_bytes() != text.encode("utf-8")]
    orphans = [p for p in sorted(Path(exercises_dir).glob("*.ipynb")) if p not in texts]
    if not check:
        Path(exercises_dir).mkdir(parents=True, exist_ok=True)
        for p in stale:
            p.write_bytes(texts[p].encode("utf-8"))
        for p in orphans:
            p.unlink()
    return sorted(stale + orphans)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m course_lib.tooling.exercises", description="write exercises/ from solutions/"
    )
    p.add_argument("--check", action="store_true", help="write nothing; list stale exercises, exit 1 if any")
    args = p.parse_args(argv)
    paths = generate(check=args.check)
    for path in paths:
        state = "stale" if args.check else ("written" if path.exists() else "deleted")
        print(f"{state}: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return 1 if (args.check and paths) else 0


if __name__ == "__main__":
    sys.exit(main())
