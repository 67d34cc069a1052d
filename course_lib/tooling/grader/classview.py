"""The instructor's view of a graded class: per task, how many passed, failed or did not try, and why.

Written by the batch grader after every run, beside the gradebook: class.csv (one row per task)
and class.html (the same, and the most common failure messages). Messages are grouped with their
numbers blanked, so "add(3, 4) returned -1, expected 7" and "add(9, 2) returned 7, expected 11" are
one mistake, counted twice.
"""

from __future__ import annotations

import csv
import html
import re
from collections import Counter
from pathlib import Path

from ...tables import table

__all__ = ["summarise", "write"]

FIELDS = ("exercise", "notebooks", "passed", "failed", "not_attempted", "other", "top_failures")


def _shape(message: str) -> str:
    """A failure message with its numbers blanked: the mistake, not the case it was found on."""
    return re.sub(r"-?\b\d+(\.\d+)?(e[-+]?\d+)?\b|0x[0-9a-f]+", "#", message.split(" (note:")[0])[:160]


def summarise(rows: list[dict]) -> list[dict]:
    """One summary per task, in the order the tasks first appear in `rows`."""
    tasks: dict[str, dict] = {}
    for r in rows:
        if not r.get("exercise") or r.get("status") == "duplicate":
            continue
        t = tasks.setdefault(r["exercise"], {"exercise": r["exercise"], "notebooks": 0, "passed": 0, "failed": 0,
                                             "not_attempted": 0, "other": 0, "messages": Counter()})  # fmt: skip
        t["notebooks"] += 1
        key = {"passed": "passed", "failed": "failed", "not attempted": "not_attempted"}.get(r["status"], "other")
        t[key] += 1
        if key in ("failed", "other"):
            t["messages"][_shape(r.get("message", ""))] += 1
    out = []
    for t in tasks.values():
        top = t.pop("messages").most_common(3)
        out.append({**t, "top_failures": [(m, n) for m, n in top]})
    return out


def write(rows: list[dict], out_dir: Path) -> str:
    """Write class.csv and class.html into `out_dir`; return the summary as printable lines."""
    summary = summarise(rows)
    with open(Path(out_dir) / "class.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for t in summary:
            tops = " | ".join(f"{n}× {m}" for m, n in t["top_failures"])
            writer.writerow({**t, "top_failures": tops})
    body = "".join(
        f"<tr><td>{html.escape(t['exercise'])}</td><td>{t['notebooks']}</td><td>{t['passed']}</td>"
        f"<td>{t['failed']}</td><td>{t['not_attempted']}</td><td>{t['other']}</td><td><ol>"
        + "".join(f"<li>{n}× {html.escape(m)}</li>" for m, n in t["top_failures"])
        + "</ol></td></tr>\n"
        for t in summary
    )
    page = (
        "<!doctype html><meta charset='utf-8'><title>Class view</title>"
        "<style>body{font-family:sans-serif;max-width:70em;margin:2em auto}td,th{border-bottom:1px solid #ccc;"
        "padding:.3em .6em;vertical-align:top;text-align:left}table{border-collapse:collapse}</style>"
        "<h1>Class view</h1><p>Per task: notebooks graded, passed, failed, not attempted, other (crashed, timed "
        "out, not graded), and the most common failure messages, numbers blanked.</p><table><tr><th>task</th>"
        "<th>notebooks</th><th>passed</th><th>failed</th><th>not attempted</th><th>other</th>"
        f"<th>most common failures</th></tr>\n{body}</table>\n"
    )
    (Path(out_dir) / "class.html").write_text(page, encoding="utf-8")
    columns = [("task", "exercise", ""), ("notebooks", "notebooks", "d"), ("passed", "passed", "d"),
               ("failed", "failed", "d"), ("not attempted", "not_attempted", "d"), ("other", "other", "d")]  # fmt: skip
    failures = [f"  {t['exercise']}: {n}× {m[:90]}" for t in summary for m, n in t["top_failures"]]
    lines = [table(summary, columns), "most common failures:" if failures else "no failures", *failures]
    lines.append(f"class view -> {Path(out_dir) / 'class.html'}")
    return "\n".join(lines)
