"""Seconds per code cell of every notebook, from the JUnit XML of an nbval run, with provenance.

    python tools/celltimes.py --json data/reference/celltimes_<gpu>.json --note "..." junit-a.xml junit-b.xml

nbval names a notebook's code cells "Cell 0", "Cell 1", ... counting code cells only; this maps each to
its index among all the notebook's cells (the number JupyterLab's and nbclient's cell lists use) and
its first line, so a chapter's cost can be read cell by cell (issue 26: sizing for a T4).
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from course_lib.reference import provenance  # noqa: E402


def cell_times(junit_files: list[str], root: Path) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for f in junit_files:
        if not Path(f).exists():  # a lane stopped before pytest wrote its report
            print(f"missing: {f}")
            continue
        for tc in ET.parse(f).iter("testcase"):
            cls, name = tc.get("classname", ""), tc.get("name", "")
            if not cls.endswith(".ipynb") or not name.startswith("Cell "):
                continue
            path = cls[: -len(".ipynb")].replace(".", "/") + ".ipynb"
            entry = out.setdefault(path, {"cells": []})
            failed = tc.find("failure") is not None or tc.find("error") is not None
            skipped = tc.find("skipped") is not None
            entry["cells"].append(
                {
                    "code_cell": int(name.split()[1]),
                    "seconds": float(tc.get("time", 0)),
                    "failed": failed,
                    "skipped": skipped,
                }
            )
    for path, entry in out.items():
        nb = nbformat.read(root / path, as_version=4)
        code = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
        for c in entry["cells"]:
            if c["code_cell"] < len(code):
                i, cell = code[c["code_cell"]]
                c["cell"] = i
                c["first_line"] = (cell.source.splitlines() or [""])[0][:80]
                c["gpu_tag"] = "gpu" in cell.metadata.get("tags", [])
        entry["cells"].sort(key=lambda c: c["code_cell"])
        entry["total_s"] = sum(c["seconds"] for c in entry["cells"])
    return dict(sorted(out.items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("junit", nargs="+")
    p.add_argument("--json")
    p.add_argument("--note", default="", help="how the notebooks ran (workers side by side, threads)")
    p.add_argument(
        "--device-of",
        help="a reference JSON recorded on the machine that ran the notebooks: its device, torch, CUDA and date "
        "are this file's (when the JUnit files are combined elsewhere)",
    )
    args = p.parse_args(argv)
    times = cell_times(args.junit, Path(__file__).resolve().parents[1])
    lines = []
    for path, e in times.items():
        slow = sorted(e["cells"], key=lambda c: -c["seconds"])[:3]
        lines.append(
            f"{e['total_s']:7.1f} s  {path}   slowest: "
            + ", ".join(f"cell {c.get('cell', '?')} {c['seconds']:.1f} s" for c in slow)
        )
    # quoted, as the --note is a sentence: the recorded command runs as printed
    command = shlex.join(["python", "tools/celltimes.py", *(argv if argv is not None else sys.argv[1:])])
    prov = provenance(command)
    if args.device_of:
        ran = json.loads(Path(args.device_of).read_text())["provenance"]
        prov = {**prov, **{k: ran[k] for k in ("device", "torch", "cuda", "cudnn", "python", "date")}}
        prov["combined_on"] = platform.node() or "another machine"
    print(f"{prov['device']} | torch {prov['torch']} | CUDA {prov['cuda']} | {prov['date']}")
    print("\n".join(lines))
    if args.json:
        payload = {"provenance": prov, "note": args.note, "notebooks": times}
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
