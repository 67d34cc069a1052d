"""Provenance that still runs: a new recording names the code that made it (the course's commit, and
the recording file's git blob id), and every recorded command runs as shown, or is shown beside the
command that replaced it (course_lib._provenance.MOVED), the recorded one kept as the fact it is."""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import runpy
import shlex
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from course_lib import _provenance, reference
from course_lib.tooling.edition import pages

ROOT = Path(__file__).resolve().parents[1]
GIT = shutil.which("git")


def blob_id(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def git(cwd: Path, *args: str) -> str:
    run = [GIT, "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main", *args]
    return subprocess.run(run, cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


# ------------------------------------------------------------------ new recordings name their code


def test_a_new_recording_names_the_commit_and_the_recording_file(tmp_path, capsys):
    out = tmp_path / "bench.json"
    reference.record("python -m course_lib.chapters.ch00.bench --json bench.json", "TABLE", out, rows=[])
    prov = json.loads(out.read_text())["provenance"]
    assert prov["source"] == "course_lib/chapters/ch00/bench.py"
    assert prov["source_blob"] == blob_id(ROOT / prov["source"])  # what `git hash-object` prints
    if GIT and (ROOT / ".git").exists():
        assert prov["commit"] == git(ROOT, "rev-parse", "HEAD")
        assert prov.get("commit_note") in (None, "uncommitted changes")
    else:  # a copied tree, as on the offline GPU machine: it says so
        assert prov["commit_note"].startswith("not a git checkout")


def test_a_script_s_command_names_the_script():
    prov = reference.provenance("python tools/celltimes.py a.xml --json x.json")
    assert prov["source"] == "tools/celltimes.py" and prov["source_blob"] == blob_id(ROOT / "tools/celltimes.py")
    assert "source" not in reference.provenance("python -m no_such_module.anywhere --json x.json")


def test_a_copied_tree_says_it_is_not_a_git_checkout_or_takes_the_commit_it_is_given(tmp_path, monkeypatch):
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "study.py").write_text("print('measured')\n")
    monkeypatch.setattr(_provenance, "ROOT", tmp_path)
    monkeypatch.delenv("COURSE_COMMIT", raising=False)
    prov = reference.provenance("python tools/study.py --json x.json")
    assert prov["commit"] is None and prov["commit_note"] == "not a git checkout"
    assert prov["source"] == "tools/study.py" and prov["source_blob"] == blob_id(tmp_path / "tools" / "study.py")
    monkeypatch.setenv("COURSE_COMMIT", "62b086b6c01acbeb68f83d21b455ffa1ec7ecad6")
    prov = reference.provenance("python tools/study.py --json x.json")
    assert prov["commit"] == "62b086b6c01acbeb68f83d21b455ffa1ec7ecad6" and "unchecked" in prov["commit_note"]


@pytest.mark.skipif(GIT is None, reason="needs git")
def test_a_checkout_names_its_commit_and_says_when_the_code_differs_from_it(tmp_path, monkeypatch):
    (tmp_path / "tools").mkdir()
    study = tmp_path / "tools" / "study.py"
    study.write_text("print('measured')\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-q", "-m", "a study")
    monkeypatch.setattr(_provenance, "ROOT", tmp_path)
    prov = reference.provenance("python tools/study.py")
    assert prov["commit"] == git(tmp_path, "rev-parse", "HEAD") and "commit_note" not in prov
    assert prov["source_blob"] == git(tmp_path, "hash-object", "tools/study.py")
    assert git(tmp_path, "log", "--all", "--format=%H", f"--find-object={prov['source_blob']}") == prov["commit"]
    study.write_text("print('measured twice')\n")
    changed = reference.provenance("python tools/study.py")
    assert changed["commit"] == prov["commit"] and changed["commit_note"] == "uncommitted changes"
    assert changed["source_blob"] != prov["source_blob"]
    # a tree copied inside some other repository is not that repository's commit
    monkeypatch.setattr(_provenance, "ROOT", tmp_path / "tools")
    assert reference.provenance("python study.py")["commit_note"].startswith("not a git checkout")


def test_a_recorded_sentence_is_quoted_so_the_command_runs_as_printed(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("celltimes", ROOT / "tools" / "celltimes.py")
    celltimes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(celltimes)
    (tmp_path / "junit.xml").write_text('<testsuites><testsuite name="pytest" tests="0"/></testsuites>')
    argv = [str(tmp_path / "junit.xml"), "--json", str(tmp_path / "ct.json"), "--note", "the exercises' times"]
    assert celltimes.main(argv) == 0
    command = json.loads((tmp_path / "ct.json").read_text())["provenance"]["command"]
    assert shlex.split(command) == ["python", "tools/celltimes.py", *argv]


# ------------------------------------------------------------------ old commands, shown with what runs them now


def test_a_moved_command_maps_to_its_current_module_and_nothing_else_does():
    now = reference.current_command
    assert (
        now("python -m course_lib.chapters.bench --json b.json")
        == "python -m course_lib.chapters.ch00.bench --json b.json"
    )
    assert now("python -m course_lib.chapters.matmul speed --json m.json") == (
        "python -m course_lib.chapters.ch02.matmul_speed --json m.json"
    )
    assert now("python -m course_lib.chapters.matmul error") == "python -m course_lib.chapters.ch01.matmul error"
    assert now("python -m course_lib.chapters.ladder gpt") == "python -m course_lib.chapters.ch09.ladder gpt"
    for current in (
        "python -m course_lib.chapters.ch00.bench --json b.json",
        "python -m course_lib.chapters.benchmark",
        "python tools/gpu_study.py",
        "python tools/celltimes.py a.xml",
        "python -m course_lib.chapters.matmul",
    ):
        assert now(current) is None, current


def test_a_script_that_moved_into_a_module_maps_too(monkeypatch):
    assert reference.current_command("python tools/gpu_study.py roofline --json r.json --deadline 36") == (
        "python -m course_lib.chapters.ch11.record_roofline --json r.json --deadline 36"
    )
    monkeypatch.setitem(_provenance.MOVED, "tools/study.py a", "course_lib.chapters.ch11.record_roofline")
    assert reference.current_command("python tools/study.py a --json a.json") == (
        "python -m course_lib.chapters.ch11.record_roofline --json a.json"
    )
    assert reference.current_command("python tools/study.py b --json b.json") is None  # its other subcommand stays


def exists(name: str) -> bool:
    return (ROOT / name).is_file() if name.endswith(".py") else importlib.util.find_spec(name) is not None


def test_the_map_holds_only_modules_that_are_gone_each_with_one_that_exists_and_a_file_that_needs_it():
    commands = [r["provenance"]["command"] for r in reference.load_references()]
    for old, new in _provenance.MOVED.items():
        if not old.split()[0].endswith(".py"):  # a script may keep its other subcommands
            assert importlib.util.find_spec(old.split()[0]) is None, f"{old} still exists: it did not move"
        assert exists(new.split()[0]), f"{new} does not exist"
        assert any(f"{c} ".startswith(f"python {_provenance.invocation(old)} ") for c in commands), (
            f"no file in data/reference/ was recorded with {old}: remove it from MOVED"
        )


def test_show_reference_prints_the_recorded_command_and_what_runs_it_now(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(reference, "REFERENCE_DIR", tmp_path)
    old = "python -m course_lib.chapters.bench --json data/reference/bench_h100.json"
    prov = {"device": "NVIDIA H100", "torch": "2.9.0", "cuda": "12.8", "date": "2026-01-01", "command": old}
    (tmp_path / "bench_h100.json").write_text(json.dumps({"provenance": prov}))
    (tmp_path / "bench_h200.json").write_text(
        json.dumps({"provenance": {**prov, "command": reference.current_command(old)}})
    )
    reference.show_reference("bench_*.json", lambda r: "TABLE")
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:4] == [
        f"  command: {old}",
        "  now:     python -m course_lib.chapters.ch00.bench --json data/reference/bench_h100.json",
        "TABLE",
    ]
    assert lines[5:] == [
        "  command: python -m course_lib.chapters.ch00.bench --json data/reference/bench_h100.json",
        "TABLE",
    ]  # a current command: no second line


def test_the_edition_shows_the_recorded_command_what_replaced_it_and_the_code_it_ran():
    old = {"command": "python -m course_lib.chapters.scaler --json s.json"}
    assert pages._recorded_with(old) == (
        "<br>recorded with <code>python -m course_lib.chapters.scaler --json s.json</code>"
        " (now <code>python -m course_lib.chapters.ch03.scaler --json s.json</code>)"
    )
    new = {"command": "python -m course_lib.chapters.ch03.scaler", "commit": "62b086b6c01acbeb68f83d21b455ffa1ec7ecad6"}
    assert pages._recorded_with(new).endswith("ch03.scaler</code>, at commit <code>62b086b6c01a</code>")
    copied = {
        **new,
        "commit": None,
        "commit_note": "not a git checkout",
        "source": "course_lib/chapters/ch03/scaler.py",
        "source_blob": "0bee4f46c0cc50751f76086ed3610e5de79fab77",
    }
    assert pages._recorded_with(copied).endswith(
        "<code>course_lib/chapters/ch03/scaler.py</code> as blob <code>0bee4f46c0cc</code> (not a git checkout)"
    )
    assert pages._recorded_with({}) == ""


# ------------------------------------------------------------------ every recorded command runs as shown

# recorded before tools/celltimes.py quoted its command: the words of its --note come back loose
UNQUOTED = {"celltimes_h100-80gb-hbm3.json"}


class Parsed(Exception):
    """Raised where a recorder's argparse has parsed its arguments: nothing is measured."""


def parse_only(self, args=None, namespace=None):
    raise Parsed(self.parse_known_args(args, namespace)[1])


def split(command: str) -> list[str]:
    try:
        return shlex.split(command)
    except ValueError:  # an unquoted apostrophe in a --note recorded before commands were quoted
        return command.split()


def test_every_recorded_command_runs_as_shown_or_as_its_replacement_shown_beside_it(monkeypatch):
    """Each command (after MOVED) runs its module or script as `python` would, here, until its argparse
    has parsed the arguments: what a reader who copies it gets, in well under a second."""
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    monkeypatch.chdir(ROOT)
    files = reference.load_references()
    assert len(files) >= 21
    for ref in files:
        recorded = ref["provenance"]["command"]
        argv = split(reference.current_command(recorded) or recorded)
        assert argv[0] == "python", f"{ref['file']}: {recorded}"
        module = argv[1] == "-m"
        if module:
            assert importlib.util.find_spec(argv[2]) is not None, f"{ref['file']}: no module {argv[2]}"
        else:
            assert (ROOT / argv[1]).is_file(), f"{ref['file']}: no file {argv[1]}"
        monkeypatch.setattr(sys, "argv", argv[2:] if module else argv[1:])
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # runpy: a module its package has imported
                if module:
                    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
                else:
                    runpy.run_path(str(ROOT / argv[1]), run_name="__main__")
            pytest.fail(f"{ref['file']}: {argv} ran without parsing its arguments with argparse")
        except SystemExit as refused:
            pytest.fail(f"{ref['file']}: {argv}: argparse refused the arguments (exit {refused.code})")
        except Parsed as parsed:
            extra = parsed.args[0]
        loose = [w for w in extra if w.startswith("-")] if ref["file"] in UNQUOTED else extra
        assert not loose, f"{ref['file']}: {argv} has arguments its parser does not know: {loose}"
