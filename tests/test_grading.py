"""Tests for course_lib.tooling.grading: inline check(), exercise generation and the batch grader.

Chapter 99 is a fixture chapter (tests/fixtures/checks_ch99.py + 99_fixture.ipynb), so every
grader behaviour is tested whatever state the real chapters are in; the real solutions/ are
graded as well (full marks) together with their generated exercises (zero).
Kernels are slow to start (~2-4 s), so the known-wrong submissions share one grade_folder call.
"""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest

from course_lib.tooling import grading
from course_lib.tooling.grading import (
    CheckFailure,
    check,
    exercise_text,
    generate,
    grade_folder,
    grade_notebook,
    register,
)

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"
SOLUTION99 = FIXTURES / "99_fixture.ipynb"
CHECKS99 = FIXTURES / "checks_ch99.py"
FAST = {"cell_timeout": 5, "total_timeout": 90}
REAL_SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))


def test_the_real_chapters_are_found():
    assert len(REAL_SOLUTIONS) >= 3  # an empty glob would silently skip the real-chapter tests below


# --------------------------------------------------------------------------- helpers

@pytest.fixture(scope="module")
def chapter99():
    """Chapter 99's checks, here and (through the environment) in every grading process."""
    old = os.environ.get("COURSE_EXTRA_CHECKS")
    os.environ["COURSE_EXTRA_CHECKS"] = os.pathsep.join(p for p in (str(CHECKS99), old) if p)
    import course_lib.tooling.checks
    course_lib.tooling.checks.load_file(CHECKS99)
    yield
    if old is None:
        os.environ.pop("COURSE_EXTRA_CHECKS", None)
    else:
        os.environ["COURSE_EXTRA_CHECKS"] = old


def solution99() -> nbformat.NotebookNode:
    return nbformat.read(SOLUTION99, as_version=4)


def cell(nb: nbformat.NotebookNode, cell_id: str) -> nbformat.NotebookNode:
    return next(c for c in nb.cells if c.get("id") == cell_id)


def insert_after(nb: nbformat.NotebookNode, cell_id: str, source: str) -> nbformat.NotebookNode:
    nb.cells.insert(nb.cells.index(cell(nb, cell_id)) + 1, nbformat.v4.new_code_cell(source))
    return nb


def save(nb_or_text: nbformat.NotebookNode | str, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(nb_or_text if isinstance(nb_or_text, str) else nbformat.writes(nb_or_text) + "\n")
    return path


def rows_of(rows: list[dict], student: str) -> dict[str, dict]:
    return {r["exercise"]: r for r in rows if r["student"] == student}


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False


# --------------------------------------------------------------------------- check()

@register("98.double", args=("double",), points=2, hint="multiply by two")
def _check_double(double):
    for x in (3, -7, 11):
        if double(x) != 2 * x:
            raise CheckFailure(f"double({x}) returned {double(x)!r}, expected {2 * x}")


@register("98.bare_assert", args=("value",))
def _check_bare_assert(value):
    if value != 1:
        raise AssertionError  # what a bare `assert` gives outside pytest's assertion rewriting


def _stub(x):
    raise NotImplementedError("Exercise: write your solution here")


def test_check_prints_pass_with_points(capsys):
    assert check("98.double", lambda x: 2 * x) is True
    assert capsys.readouterr().out == "✅ 98.double — passed (2/2 points)\n"


def test_check_prints_failure_message_and_hint(capsys):
    assert check("98.double", lambda x: x + 2) is False
    out = capsys.readouterr().out
    assert out.startswith("❌ 98.double — double(3) returned 5, expected 6\n")
    assert "   hint: multiply by two" in out


def test_check_reports_untouched_stub_as_not_attempted(capsys):
    assert check("98.double", _stub) is False
    assert "not attempted yet" in capsys.readouterr().out


def test_check_catches_learner_exceptions_briefly(capsys):
    def broken(x):
        return {}["missing"] + 1
    assert check("98.double", broken) is False
    out = capsys.readouterr().out
    assert "raised KeyError: 'missing'" in out and "Traceback" not in out
    assert check("98.double", lambda x: sys.exit(3)) is False  # even SystemExit does not escape
    assert "raised SystemExit" in capsys.readouterr().out
    assert check("98.double", lambda x: (_ for _ in ()).throw(NotImplementedError("no CUDA kernel"))) is False
    assert "raised NotImplementedError: no CUDA kernel" in capsys.readouterr().out  # not "not attempted"


def test_check_names_expected_args_on_wrong_count(capsys):
    assert check("98.double") is False
    assert "takes 1 object(s): double; got 0" in capsys.readouterr().out


def test_check_unknown_name_and_bare_assert_never_raise(capsys):
    assert check("98.nope", 1) is False
    assert "there is no check called '98.nope'" in capsys.readouterr().out
    assert check("98.bare_assert", 2) is False
    assert "a check assertion failed" in capsys.readouterr().out


def test_register_rejects_malformed_checks():
    with pytest.raises(ValueError, match="must look like"):
        register("double", args=("x",))
    with pytest.raises(ValueError, match="tuple of global names"):
        register("98.s", args="x")
    with pytest.raises(ValueError, match="cannot be called with 2 args"):
        register("98.two", args=("a", "b"))(lambda a: None)


def test_check_modules_import_cleanly():
    import course_lib.tooling.checks
    assert course_lib.tooling.checks.errors == {}


# --------------------------------------------------------------------------- generate()

SOLUTION_CELLS = [
    ("markdown", "intro", "# Title"),
    ("code", "code1", 'import math\n\ndef f(x):\n    """Doc."""\n    ### BEGIN SOLUTION\n    y = x + 1\n'
                      '    return y\n    ### END SOLUTION\n\nclass A:\n    def g(self):\n'
                      '        ### BEGIN SOLUTION\n        return 1\n        ### END SOLUTION\n\ncheck("99.add", f)'),
    ("code", "code2", "### BEGIN SOLUTION\nLIMIT = 3\n### END SOLUTION"),
    ("markdown", "answer", "Why?\n\n<!-- BEGIN SOLUTION -->Because\nof this.<!-- END SOLUTION -->\n\nMore."),
]
EXPECTED = {
    "code1": 'import math\n\ndef f(x):\n    """Doc."""\n'
             '    raise NotImplementedError("Exercise: write your solution here")\n\n'
             'class A:\n    def g(self):\n        raise NotImplementedError("Exercise: write your solution here")\n\n'
             'check("99.add", f)',
    "code2": 'raise NotImplementedError("Exercise: write your solution here")',
    "answer": "Why?\n\n_Your answer here._\n\nMore.",
    "intro": "# Title",
}


def make_solution(path: Path, cells=SOLUTION_CELLS) -> Path:
    nb = nbformat.v4.new_notebook()
    for kind, cell_id, source in cells:
        c = nbformat.v4.new_code_cell(source) if kind == "code" else nbformat.v4.new_markdown_cell(source)
        c["id"] = cell_id
        if kind == "code":
            c.execution_count = 7
            c.outputs = [nbformat.v4.new_output("stream", name="stdout", text="secret answer 42\n")]
            c.metadata = {"tags": ["keep-me"], "execution": {"iopub.status.busy": "2026-01-01"}}
        nb.cells.append(c)
    return save(nb, path)


def test_generate_replaces_markers_strips_outputs_and_stamps(tmp_path):
    make_solution(tmp_path / "sol" / "99_demo.ipynb")
    written = generate(tmp_path / "sol", tmp_path / "ex")
    assert written == [tmp_path / "ex" / "99_demo.ipynb"]
    nb = nbformat.read(written[0], as_version=4)
    by_id = {c.id: c for c in nb.cells}
    for cell_id, source in EXPECTED.items():
        assert by_id[cell_id].source == source
    for c in nb.cells:
        if c.cell_type == "code":
            assert c.outputs == [] and c.execution_count is None
    assert by_id["code1"].metadata == {"tags": ["keep-me"]}
    assert "secret answer" not in written[0].read_text()
    assert nb.metadata["amp_course"] == {"exercise": "99", "source": "solutions/99_demo.ipynb"}
    assert nb.cells[0].id == "colab-badge" and "exercises/99_demo.ipynb" in nb.cells[0].source
    assert nb.cells[1].id == "colab-setup"


def test_generate_is_deterministic(tmp_path):
    sol = make_solution(tmp_path / "sol" / "99_demo.ipynb")
    ex = generate(tmp_path / "sol", tmp_path / "ex")[0]
    first = ex.read_bytes()
    assert generate(tmp_path / "sol", tmp_path / "ex") == []  # nothing to rewrite
    assert exercise_text(sol).encode() == first and first.endswith(b"}\n")


def test_generate_check_finds_stale_missing_and_orphaned_exercises(tmp_path):
    sol_dir, ex_dir = tmp_path / "sol", tmp_path / "ex"
    sol = make_solution(sol_dir / "99_demo.ipynb")
    ex = generate(sol_dir, ex_dir)[0]
    assert generate(sol_dir, ex_dir, check=True) == []
    cells = [(k, i, s.replace("# Title", "# New title")) for k, i, s in SOLUTION_CELLS]
    make_solution(sol, cells)  # solution edited, exercises not regenerated
    before = ex.read_bytes()
    assert generate(sol_dir, ex_dir, check=True) == [ex]
    assert ex.read_bytes() == before  # check=True writes nothing
    ex.unlink()
    assert generate(sol_dir, ex_dir, check=True) == [ex]  # missing
    orphan = save(nbformat.v4.new_notebook(), ex_dir / "98_gone.ipynb")
    assert generate(sol_dir, ex_dir, check=True) == [orphan, ex]
    assert orphan.exists() and not ex.exists()
    generate(sol_dir, ex_dir)
    assert ex.exists() and not orphan.exists()


@pytest.mark.parametrize("source", [
    "### BEGIN SOLUTION\nx = 1",
    "x = 1\n### END SOLUTION",
    "### BEGIN SOLUTION\n### BEGIN SOLUTION\nx = 1\n### END SOLUTION\n### END SOLUTION",
])
def test_generate_rejects_unbalanced_code_markers(tmp_path, source):
    make_solution(tmp_path / "sol" / "99_bad.ipynb", [("code", "the-cell", source)])
    with pytest.raises(ValueError, match=r"99_bad\.ipynb cell 0 \(id the-cell\)"):
        generate(tmp_path / "sol", tmp_path / "ex")
    assert not (tmp_path / "ex").exists()


@pytest.mark.parametrize("source", ["<!-- BEGIN SOLUTION -->a", "a<!-- END SOLUTION -->",
                                    "<!-- BEGIN SOLUTION --><!-- BEGIN SOLUTION -->a"
                                    "<!-- END SOLUTION --><!-- END SOLUTION -->",
                                    "### BEGIN SOLUTION\nanswer\n### END SOLUTION"])
def test_generate_rejects_bad_markdown_markers(tmp_path, source):
    make_solution(tmp_path / "sol" / "99_bad.ipynb", [("markdown", "md", source)])
    with pytest.raises(ValueError, match=r"99_bad\.ipynb cell 0 \(id md\)"):
        generate(tmp_path / "sol", tmp_path / "ex")


def test_exercises_in_sync_with_solutions():
    stale = generate(check=True)
    assert stale == [], f"exercises/ is stale, run `make exercises`: {[p.name for p in stale]}"


# --------------------------------------------------------------------------- the batch grader

@pytest.fixture(scope="module")
def graded(chapter99, tmp_path_factory):
    """One grade_folder run over the fixture solution, its exercise and known-wrong submissions."""
    sub, out = tmp_path_factory.mktemp("submissions"), tmp_path_factory.mktemp("gradebook")
    name = "99_fixture.ipynb"
    save(solution99(), sub / "alice" / name)
    save("{garbage", sub / "alice" / ".ipynb_checkpoints" / "99_fixture-checkpoint.ipynb")  # skipped
    save(exercise_text(SOLUTION99), sub / "bob.ipynb")  # flat layout; chapter from metadata
    wrong = solution99()
    cell(wrong, "ex-add").source = cell(wrong, "ex-add").source.replace("return a + b", "return a - b")
    save(wrong, sub / "wrong" / name)
    save(insert_after(solution99(), "ex-add", "import os\nos._exit(1)"), sub / "crash" / name)
    save(insert_after(solution99(), "ex-add", "while True:\n    pass"), sub / "hang" / name)
    slow = solution99()
    cell(slow, "ex-add").source = "def add(a, b):\n    while True:\n        pass"
    save(slow, sub / "slow" / name)
    deleted = solution99()
    deleted.cells.remove(cell(deleted, "ex-add"))
    save(deleted, sub / "deleted" / name)
    # Wrong answer, then every way of faking success we can think of without touching files.
    cheat = insert_after(wrong, "ex-clip", "\n".join([
        "import course_lib.tooling.grading as g",
        "def check(*args, **kwargs):",
        "    print('✅ 99.add — passed (2/2 points)')",
        "    return True",
        "g.check = check",
        "g._run_check = lambda c, objects, time_limit=None: (True, 'passed')",
        "for n in ('99.add', '99.clip'):",
        "    print(f'x {{\"name\": \"{n}\", \"passed\": true, \"message\": \"passed\"}}')",
        "check('99.add', add)",
    ]))
    save(cheat, sub / "cheat" / name)
    save("{not json", sub / "broken" / name)
    save('{"hello": 1}', sub / "notebook" / name)
    save(nbformat.v4.new_notebook(), sub / "nochapter.ipynb")
    started = time.monotonic()
    rows = grade_folder(sub, out, jobs=2, **FAST)
    return rows, out, time.monotonic() - started


def test_gradebook_csv_and_json_hold_every_submission(graded):
    rows, out, _ = graded
    with open(out / "gradebook.csv", newline="", encoding="utf-8") as f:
        csv_rows = list(csv.DictReader(f))
    json_rows = json.loads((out / "gradebook.json").read_text(encoding="utf-8"))
    assert json_rows == rows
    assert [{k: str(v) for k, v in r.items()} for r in rows] == csv_rows
    assert list(csv_rows[0]) == list(grading.CSV_FIELDS)
    students = {r["student"] for r in rows}
    assert students == {"alice", "bob", "wrong", "crash", "hang", "slow", "deleted", "cheat", "broken",
                        "notebook", "nochapter"}
    assert not any("checkpoint" in r["notebook"] for r in rows)


def test_solution_scores_full_marks(graded):
    alice = rows_of(graded[0], "alice")
    assert {k: (r["points"], r["max_points"], r["status"]) for k, r in alice.items()} == {
        "99.add": (2, 2, "ok"), "99.clip": (1, 1, "ok")}
    assert alice["99.add"]["notebook"] == "alice/99_fixture.ipynb"


def test_untouched_exercise_scores_zero(graded):
    bob = rows_of(graded[0], "bob")
    assert [r["points"] for r in bob.values()] == [0, 0] and {r["status"] for r in bob.values()} == {"ok"}
    assert "not attempted yet" in bob["99.add"]["message"]
    assert "`clip` is not defined" in bob["99.clip"]["message"]


def test_wrong_answer_gets_zero_for_that_check_only(graded):
    wrong = rows_of(graded[0], "wrong")
    assert (wrong["99.add"]["points"], wrong["99.clip"]["points"]) == (0, 1)
    assert "expected" in wrong["99.add"]["message"]


def test_crashing_kernel_scores_zero_and_grader_goes_on(graded):
    crash = rows_of(graded[0], "crash")
    assert {(r["points"], r["status"]) for r in crash.values()} == {(0, "crashed")}
    assert "kernel crashed" in crash["99.add"]["message"]


def test_hanging_cell_is_interrupted_and_later_cells_still_count(graded):
    hang = rows_of(graded[0], "hang")
    assert {r["status"] for r in hang.values()} == {"timeout"}
    assert (hang["99.add"]["points"], hang["99.clip"]["points"]) == (2, 1)


def test_hanging_learner_function_times_out_inside_its_check(graded):
    slow = rows_of(graded[0], "slow")
    assert slow["99.add"]["points"] == 0 and "took longer than" in slow["99.add"]["message"]
    assert slow["99.clip"]["points"] == 1 and slow["99.add"]["status"] == "ok"


def test_deleted_solution_cell_scores_zero(graded):
    deleted = rows_of(graded[0], "deleted")
    assert deleted["99.add"]["points"] == 0 and deleted["99.clip"]["points"] == 1
    assert "`add` is not defined — did you run/keep the cell?" == deleted["99.add"]["message"]


def test_redefined_check_and_forged_output_do_not_count(graded):
    cheat = rows_of(graded[0], "cheat")
    assert cheat["99.add"]["points"] == 0 and "expected" in cheat["99.add"]["message"]
    assert cheat["99.clip"]["points"] == 1


def test_unreadable_files_score_zero(graded):
    for student in ("broken", "notebook"):
        rows = rows_of(graded[0], student)
        assert set(rows) == {"99.add", "99.clip"}
        assert {(r["points"], r["status"]) for r in rows.values()} == {(0, "unreadable")}
        assert all(r["message"].startswith("could not read notebook") for r in rows.values())
    [row] = rows_of(graded[0], "nochapter").values()
    assert row["status"] == "error" and "cannot tell the chapter" in row["message"]


def test_total_timeout_kills_child_and_kernel(chapter99, tmp_path):
    pidfile = tmp_path / "kernel.pid"
    stubborn = insert_after(solution99(), "imports", "\n".join([
        "import os, signal",
        f"open({str(pidfile)!r}, 'w').write(str(os.getpid()))",
        "signal.signal(signal.SIGINT, signal.SIG_IGN)  # the cell timeout's interrupt does nothing now",
        "while True:",
        "    pass",
    ]))
    started = time.monotonic()
    rows = grade_notebook(save(stubborn, tmp_path / "99_stubborn.ipynb"), cell_timeout=2, total_timeout=12)
    assert time.monotonic() - started < 20
    assert {(r["points"], r["status"]) for r in rows} == {(0, "timeout")}
    assert "total time limit (12 s)" in rows[0]["message"]
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(pid), "the kernel outlived the grader's total timeout"


def test_run_one_caps_output_and_uses_the_graders_python(chapter99, tmp_path):
    # ~50 MB in 100 kB messages (flushed, so each is its own message): kept, this would
    # grow the grader by > 50 MB; dropped past OUTPUT_CAP, its memory stays flat.
    flood = insert_after(solution99(), "ex-add", "for _ in range(500):\n    print('x' * 100_000, flush=True)")
    path, out = save(flood, tmp_path / "99_flood.ipynb"), tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-m", "course_lib.tooling.grading", "run-one", str(path), "--json", str(out),
                           "--cell-timeout", "30"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert res["status"] == "ok" and res["python"] == sys.executable
    assert all(r["passed"] for r in res["results"].values()) and len(res["results"]) == 2
    assert res["output_bytes_dropped"] > 40e6 and res["output_bytes_kept"] <= grading.OUTPUT_CAP
    assert res["rss_growth_mb"] < 30


def test_cli_grade_writes_gradebook(chapter99, tmp_path):
    # The command line runs the module as __main__: the checks must still be found.
    save("{not json", tmp_path / "subs" / "99_broken.ipynb")
    proc = subprocess.run([sys.executable, "-m", "course_lib.tooling.grading", "grade", str(tmp_path / "subs"),
                           "--out", str(tmp_path / "gb"), "--cell-timeout", "5"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((tmp_path / "gb" / "gradebook.json").read_text())
    assert [(r["student"], r["exercise"], r["status"]) for r in rows] == [
        ("99_broken", "99.add", "unreadable"), ("99_broken", "99.clip", "unreadable")]
    assert "99_broken" in proc.stdout and "0/3" in proc.stdout


# --------------------------------------------------------------------------- the real chapters

@pytest.fixture(scope="module")
def real_graded() -> dict[str, list[dict]]:
    """Each solution and its generated exercise, graded in place (same relative paths to data/)."""
    paths = REAL_SOLUTIONS + [ROOT / "exercises" / p.name for p in REAL_SOLUTIONS]
    with ThreadPoolExecutor(2) as pool:
        rows = pool.map(lambda p: grade_notebook(p, cell_timeout=300, total_timeout=900), paths)
    return {f"{p.parent.name}/{p.name}": r for p, r in zip(paths, rows)}


@pytest.mark.parametrize("solution", REAL_SOLUTIONS, ids=lambda p: p.stem)
def test_real_solution_scores_full_marks(real_graded, solution):
    rows = real_graded[f"solutions/{solution.name}"]
    failed = [(r["exercise"], r["status"], r["message"]) for r in rows if not r["passed"]]
    assert not failed and sum(r["max_points"] for r in rows) > 0


@pytest.mark.parametrize("solution", REAL_SOLUTIONS, ids=lambda p: p.stem)
def test_real_exercise_scores_zero_without_grader_failure(real_graded, solution):
    assert (ROOT / "exercises" / solution.name).exists(), "exercise not generated: run `make exercises`"
    rows = real_graded[f"exercises/{solution.name}"]
    assert rows and all(r["exercise"] for r in rows), rows  # graded against the chapter's checks
    assert {(r["points"], r["status"]) for r in rows} == {(0, "ok")}, rows
