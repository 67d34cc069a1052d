"""course_lib.reference: recorded results carry provenance; show_reference prints them in full, or one line
without, and returns None: under nbval and nbclient a trailing `;` does not hide a cell's result."""

import builtins
import json
from pathlib import Path

import nbformat

from course_lib import reference

ROOT = Path(__file__).resolve().parents[1]


def test_record_prints_the_table_under_its_provenance_and_writes_json(tmp_path, capsys):
    out = tmp_path / "x.json"
    prov = reference.record("python -m something --json x.json", "TABLE", out, rows=[{"a": 1}])
    text = capsys.readouterr().out
    assert text.splitlines()[1] == "TABLE" and f"torch {prov['torch']}" in text.splitlines()[0]
    data = json.loads(out.read_text())
    assert data["rows"] == [{"a": 1}]
    assert {"device", "torch", "cuda", "cudnn", "python", "date", "command"} <= set(data["provenance"])


def test_show_reference_prints_each_record_with_where_it_was_measured(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(reference, "REFERENCE_DIR", tmp_path)
    prov = {
        "device": "NVIDIA H100 80GB HBM3",
        "torch": "2.9.0",
        "cuda": "12.8",
        "date": "2026-01-01",
        "command": "python -m course_lib.chapters.ch00.bench --json bench_h100.json",
    }
    (tmp_path / "bench_h100.json").write_text(json.dumps({"provenance": prov, "rows": [1, 2]}))
    shown = reference.show_reference("bench_*.json", lambda r: f"{len(r['rows'])} rows")
    text = capsys.readouterr().out
    assert shown is None, "a cell ending in show_reference(...) must show what it printed, not the records"
    assert "(bench_h100.json)" in text and [r["file"] for r in reference.load_references("bench_*.json")] == [
        "bench_h100.json"
    ]
    assert "NVIDIA H100 80GB HBM3 | torch 2.9.0 | CUDA 12.8 | 2026-01-01" in text and "2 rows" in text
    assert "command: python -m course_lib.chapters.ch00.bench" in text


def test_a_withdrawn_measurement_is_shown_with_its_erratum_before_the_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(reference, "REFERENCE_DIR", tmp_path)
    prov = {"device": "GPU", "torch": "2.9.0", "cuda": "12.8", "date": "2026-01-01", "command": "python -m x"}
    why = "The peak column is withdrawn: measured with a graph left alive. " * 3
    (tmp_path / "acc_gpu.json").write_text(json.dumps({"provenance": prov, "erratum": why, "rows": [None]}))
    reference.show_reference("acc_*.json", lambda r: "TABLE")
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].startswith("  erratum: The peak column is withdrawn") and lines[-1] == "TABLE"
    assert len(lines) > 4 and all(len(line) <= 100 for line in lines)  # wrapped, not one long line


def test_every_erratum_in_data_reference_goes_with_values_set_to_null():
    # an erratum withdraws values; it never replaces them with typed-in ones
    for ref in reference.load_references():
        if "erratum" in ref:
            assert "withdrawn" in ref["erratum"] and "null" in json.dumps(
                {k: v for k, v in ref.items() if k not in ("provenance", "erratum")}
            )


def test_show_reference_without_a_record_prints_at_most_one_short_line(tmp_path, monkeypatch, capsys):
    """Without a GPU the chapter says once how to record a reference; each cell adds one line at most."""
    monkeypatch.setattr(reference, "REFERENCE_DIR", tmp_path)
    assert reference.show_reference("ladder_optimizer_*.json", str) is None
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) <= 1 and all(len(line) <= 100 for line in lines)
    assert not lines or "No GPU reference recorded yet" in lines[0]


class _EarlierCells(dict):
    """A cell's namespace in which every name an earlier cell defined exists, as a stand-in that is never
    called (without a record, show_reference never calls its `describe`). Builtins stay themselves, and so do
    the two reference helpers, which cells call with names an earlier cell imported."""

    def __missing__(self, name):
        if hasattr(builtins, name):
            raise KeyError(name)
        return object()


def test_every_chapter_cell_that_shows_a_reference_prints_one_line_per_call_without_a_record(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(reference, "REFERENCE_DIR", tmp_path)
    calls = []
    show = reference.show_reference
    monkeypatch.setattr(reference, "show_reference", lambda *a, **k: calls.append(a) or show(*a, **k))
    cells = [
        (p.name, c)
        for p in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
        for c in nbformat.read(p, as_version=4).cells
        if c.cell_type == "code" and "show_reference(" in c.source
    ]
    assert len(cells) >= 10
    for name, cell in cells:
        calls.clear()
        exec(
            compile(cell.source, f"{name}:{cell.id}", "exec"),
            {"show_reference": reference.show_reference},
            _EarlierCells(show_reference=reference.show_reference, load_references=reference.load_references),
        )
        lines = capsys.readouterr().out.splitlines()
        assert calls and len(lines) <= len(calls), f"{name}, cell {cell.id} prints {len(lines)} lines: {lines}"
        assert all(len(line) <= 100 and line.startswith("No GPU reference recorded yet") for line in lines), lines
