"""course_lib.reference: recorded results carry provenance, and one helper shows them or says how to record."""
import json

from course_lib import reference


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
    prov = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.9.0", "cuda": "12.8", "date": "2026-01-01",
            "command": "python -m course_lib.chapters.bench --json bench_h100.json"}
    (tmp_path / "bench_h100.json").write_text(json.dumps({"provenance": prov, "rows": [1, 2]}))
    refs = reference.show_reference("bench_*.json", lambda r: f"{len(r['rows'])} rows", "how")
    text = capsys.readouterr().out
    assert [r["file"] for r in refs] == ["bench_h100.json"]
    assert "NVIDIA H100 80GB HBM3 | torch 2.9.0 | CUDA 12.8 | 2026-01-01" in text and "2 rows" in text
    assert "command: python -m course_lib.chapters.bench" in text


def test_show_reference_without_a_record_says_so_with_the_command_in_short_lines(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(reference, "REFERENCE_DIR", tmp_path)
    assert reference.show_reference("nothing_*.json", str, "python -m x --json y") == []
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "No GPU reference recorded" in lines[0] and lines[1].strip() == "python -m x --json y"
    assert all(len(line) <= 100 for line in lines)
