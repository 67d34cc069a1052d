"""pytest configuration for the whole course (library tests and nbval notebook runs).

Notebooks run here the way a learner's front end runs them: every cell in order, in a real
kernel, with nothing skipped by the harness. Cells tagged `gpu` guard themselves
(`if gpu_cell(...)`, course_lib.device), so they must pass on a machine without CUDA too.
- CPU tier (`make test`): CUDA is hidden (CUDA_VISIBLE_DEVICES=""), so the gpu cells take
  their CPU path, exactly as on a learner's laptop or Colab without a GPU.
- GPU tier (`make test-gpu`, COURSE_GPU_TIER=1): CUDA stays visible and the guard raises
  where it is missing, so the tier cannot pass by skipping.
Each notebook's execution time and its kernel's peak memory are reported at the end; a
notebook whose kernel needs more than NOTEBOOK_MEMORY_BUDGET fails the session.
Nothing silent: in the CPU tier, a code cell that tests/printing_cells.json lists as printing
and that printed nothing (or only whitespace) fails the session, judged only in notebooks whose
code cells all ran to their end here (course_lib/tooling/nbtools.py; refresh the manifest with
`python -m course_lib.tooling.nbtools printing-cells`, i.e. `--update-printing-cells`).
Git after Run All: in the CPU tier, a notebook that ran to its end must read as unchanged through
the git filter `make lab` configures (course_lib/tooling/notebook_filter.py): the outputs its
compared cells printed here, stored as the filter stores them, must be its committed bytes.
The published edition: each notebook that ran to its end is saved with its outputs to
build/executed/ (course_lib/tooling/site.py), so `make site` publishes this run without a second one.
No data dumps: a cell whose result or display has a text/plain of more than DATA_DUMP_LINES lines or
DATA_DUMP_CHARS characters (a returned list of records, say) fails the session, named by notebook and
cell, and its notebook is not saved to build/executed/. A trailing `;` does not hide a result here:
IPython reads it from the input history, and nbval runs cells with store_history=False.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict

import pytest

GPU_TIER = os.environ.get("COURSE_GPU_TIER") == "1"
NOTEBOOK_TIME_BUDGET_S = 120  # per notebook on a 2-core CPU: reported, not asserted (timings flake)
NOTEBOOK_MEMORY_BUDGET = 4 * 2**30  # peak resident memory of a notebook's kernel: asserted
_durations: dict[str, float] = defaultdict(float)
_peak_rss: dict[str, int] = defaultdict(int)
_gpu_cells: dict[str, list[str]] = defaultdict(list)  # outcome -> node ids
_cell_runs: dict = {}  # notebook path -> nbtools.NotebookRun: which code cells ran and printed (CPU tier)
_silence: dict = {}  # what the printing check found, for the terminal summary
_checked_outputs: dict = {}  # notebook path -> {cell index: what an nbval-check-output cell printed here}
_modified_after_run: list[str] = []  # notebooks that git would list as changed after a learner's Run All
_executed: dict = {}  # notebook path -> (the notebook, {cell index: its outputs here}), for `make site`
DATA_DUMP_LINES, DATA_DUMP_CHARS = 200, 20_000  # a displayed text/plain beyond either is a data dump
_data_dumps: list[str] = []  # one line per dumping cell: fails the session


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # a broken torch install must not hide the real error in the tests
        return False


def _is_gpu_cell(item: pytest.Item) -> bool:
    cell = getattr(item, "cell", None)
    return cell is not None and "gpu" in cell.get("metadata", {}).get("tags", [])


def _refuse_remote_connections() -> None:
    """Tests run offline: a connection to anything but this machine fails loudly, at once."""
    import ipaddress
    import socket

    real_connect = socket.socket.connect

    def connect(self, address):
        host = address[0] if isinstance(address, tuple) else None
        if host is not None:
            try:
                local = ipaddress.ip_address(host).is_loopback
            except ValueError:
                local = host == "localhost"
            if not local:
                raise ConnectionRefusedError(f"tests are offline: refused a connection to {address!r}")
        return real_connect(self, address)

    socket.socket.connect = connect


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-printing-cells",
        action="store_true",
        help="rewrite the printing-cells manifest for the notebooks whose code cells all ran (CPU tier)",
    )
    parser.addoption(
        "--printing-cells-manifest",
        default="tests/printing_cells.json",
        metavar="PATH",
        help="the manifest of code cells that print, from the repository root (default: %(default)s)",
    )
    parser.addoption(
        "--chapter",
        default=None,
        metavar="NN",
        help="make test-chapter N=NN: also grade chapter NN's solution and exercise (marked per_chapter)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked per_chapter run only for the chapter --chapter names (make test-chapter): `make test`
    grades every chapter at once elsewhere (tests/test_grader.py)."""
    chapter = config.getoption("--chapter")
    keep, drop = [], []
    for item in items:
        marker = item.get_closest_marker("per_chapter")
        params = getattr(item, "callspec", None)
        if marker is None or (chapter and params is not None and params.params.get("chapter") == chapter):
            keep.append(item)
        else:
            drop.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_configure(config: pytest.Config) -> None:
    # Kernels inherit it: the inline backend a learner's JupyterLab uses, no windows, no GUI. Each
    # plt.show() renders its figure into the cell's outputs, as Run All does: a figure that fails to
    # draw fails its cell, and the published edition (build/executed/) gets the plots.
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    os.environ.setdefault("COURSE_OFFLINE", "1")  # notebooks' kernels: the data loader never downloads
    if hasattr(config, "workerinput"):  # an xdist worker (make test: -n 2), its kernels and subprocesses
        # Two workers share the cores: torch's OpenMP threads that spin while they wait (the default)
        # then take turns with the other worker's and run 2.5 times slower; waiting asleep, 2 times.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if not GPU_TIER:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU tier runs what a learner without a GPU runs
    elif config.getoption("--update-printing-cells"):
        raise pytest.UsageError("--update-printing-cells records the CPU tier's outputs; unset COURSE_GPU_TIER")
    if config.getoption("--update-printing-cells") and getattr(config.option, "numprocesses", None):
        raise pytest.UsageError("--update-printing-cells rewrites one manifest: run it without -n (one process)")
    _refuse_remote_connections()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # Before a notebook's kernel starts (it inherits this environment): the solutions' inline checks
    # stay silent, since the batch grader judges every solution's tasks (tests/test_grader.py).
    path = item.nodeid.split("::")[0]
    if path.endswith(".ipynb"):
        if path.startswith("solutions/"):
            os.environ["AMP_COURSE_SILENT_CHECKS"] = "1"
        else:
            os.environ.pop("AMP_COURSE_SILENT_CHECKS", None)
    if GPU_TIER and _is_gpu_cell(item) and not _cuda_available():
        pytest.fail("GPU tier (COURSE_GPU_TIER=1) but torch.cuda.is_available() is False", pytrace=False)


def _kernel_peak_rss(item: pytest.Item) -> int:
    """VmHWM of the nbval kernel running this notebook (Linux), 0 where it cannot be read."""
    try:
        km = item.parent.kernel.km
        pid = km.provisioner.pid if getattr(km, "provisioner", None) else km.kernel.pid
        with open(f"/proc/{pid}/status") as f:
            line = next(line for line in f if line.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    except Exception:
        return 0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    yield
    if getattr(item, "cell", None) is not None:
        path = item.nodeid.split("::")[0]
        _peak_rss[path] = max(_peak_rss[path], _kernel_peak_rss(item))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::")[0]
    if path.endswith(".ipynb"):
        _durations[path] += report.duration


def _record_cell_run(item: pytest.Item, report: pytest.TestReport) -> None:
    """Note a notebook cell that ran to its end (or that nbval skipped as tagged), and whether it printed."""
    from course_lib.tooling.nbtools import CellRun, NotebookRun, printed

    nb = item.parent.nb
    path = item.nodeid.split("::")[0]
    run = _cell_runs.setdefault(path, NotebookRun(code_cells=sum(c.cell_type == "code" for c in nb.cells)))
    index = next(i for i, c in enumerate(nb.cells) if c is item.cell)
    first_line = next((line for line in item.cell.source.splitlines() if line.strip()), "")[:80]
    shown = None if report.skipped else printed(item.test_outputs or [])
    run.cells[item.cell.get("id", f"index-{index}")] = CellRun(index, shown, first_line, item.cell_num)
    if "nbval-check-output" in item.cell.get("metadata", {}).get("tags", []) and not report.skipped:
        _checked_outputs.setdefault(path, {})[index] = list(item.test_outputs or [])


def _git_sees_a_change_after_run_all(path: str) -> bool:
    from pathlib import Path

    from course_lib.tooling.nbtools import reads_as_modified_after_run

    committed = Path(path).read_text(encoding="utf-8")
    return reads_as_modified_after_run(committed, _checked_outputs.get(path, {}))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if _is_gpu_cell(item) and (report.when == "call" or report.skipped):
        _gpu_cells[report.outcome].append(item.nodeid)
    # A failed, timed-out (xfail) or interrupted cell is not recorded: its notebook is not judged.
    tagged_skip = report.skipped and getattr(item, "options", {}).get("skip")
    if (
        not GPU_TIER
        and report.when == "call"
        and (report.passed or tagged_skip)
        and getattr(item, "cell", None) is not None
        and hasattr(item.parent, "nb")
    ):
        _record_cell_run(item, report)
    if (
        report.when == "call"
        and (report.passed or tagged_skip)
        and getattr(item, "cell", None) is not None
        and hasattr(item.parent, "nb")
    ):
        nb = item.parent.nb
        index = next(i for i, c in enumerate(nb.cells) if c is item.cell)
        outputs = [] if report.skipped else list(item.test_outputs or [])
        _executed.setdefault(item.nodeid.split("::")[0], (nb, {}))[1][index] = outputs


def _judge_printing_cells(config: pytest.Config) -> bool:
    """Compare this session's printing cells with the manifest (or rewrite it); True if one went silent."""
    from course_lib.tooling import nbtools

    manifest_path = config.rootpath / config.getoption("--printing-cells-manifest")
    manifest = nbtools.read_manifest(manifest_path)
    complete = sorted(p for p, run in _cell_runs.items() if run.complete)
    if config.getoption("--update-printing-cells"):
        nbtools.write_manifest(nbtools.updated_manifest(manifest, _cell_runs), manifest_path)
        _silence.update(updated=complete, partial=sorted(set(_cell_runs) - set(complete)))
        return False
    silent = nbtools.silent_cells(manifest, _cell_runs)
    _silence.update(
        silent=silent,
        judged=[p for p in complete if p in manifest],
        unlisted=nbtools.unlisted_printing_cells(manifest, _cell_runs),
    )
    return bool(silent)


def _data_dumps_in(path: str, nb, outputs: dict[int, list]) -> list[str]:
    """The cells of `nb` whose result or display shows a data dump as text/plain, one line each."""
    found = []
    for index, outs in sorted(outputs.items()):
        for out in outs:
            text = (
                out.get("data", {}).get("text/plain", "")
                if out.get("output_type") in ("execute_result", "display_data")
                else ""
            )
            text = "".join(text) if isinstance(text, list) else text
            lines = text.count("\n") + 1
            if lines > DATA_DUMP_LINES or len(text) > DATA_DUMP_CHARS:
                cell = nb.cells[index]
                first = next((line for line in cell.source.splitlines() if line.strip()), "")[:80]
                found.append(
                    f"{path}, cell {index} (id {cell.get('id')}): its {out['output_type']} shows "
                    f"{lines:,} lines, {len(text):,} characters (over {DATA_DUMP_LINES} lines or "
                    f"{DATA_DUMP_CHARS:,} characters); the cell's first line: {first!r}"
                )
    return found


def _save_executed_notebooks() -> None:
    """Hand each notebook that ran to its end to the published edition (build/executed/), unless a
    cell of it shows a data dump: that fails the session, and the notebook's copy is removed."""
    import sys
    from pathlib import Path

    from course_lib.tooling.site import EXECUTED, ROOT, save_executed

    target = "make test-gpu" if GPU_TIER else "make test-floor" if ".venv-floor" in sys.prefix else "make test"
    command = f"{target} (nbval)"
    for path, (nb, outputs) in sorted(_executed.items()):
        dumps = _data_dumps_in(path, nb, outputs)
        _data_dumps.extend(dumps)
        if Path(path).parts[0] not in ("notebooks", "exercises", "solutions"):
            continue  # a test's own small notebook (tests/test_printing_cells.py): no page of the edition
        if not dumps:
            save_executed(path, nb, outputs, command)
        else:  # an older copy would no longer match what ran (the path as save_executed reads it)
            rel = Path(path).resolve().relative_to(ROOT) if Path(path).is_absolute() else Path(path)
            (EXECUTED / rel).unlink(missing_ok=True)


def _report(config: pytest.Config) -> dict:
    """What this process saw of the notebooks, as plain data: printed by the terminal summary, and
    sent to the controller by each xdist worker (`make test` runs with `-n 2`)."""
    from course_lib.tooling.nbtools import silence_report

    where = config.getoption("--printing-cells-manifest")
    silence = dict(_silence)
    if silence.get("silent"):
        silence["silent"] = silence_report(silence["silent"], where)
    over = [p for p, rss in _peak_rss.items() if rss > NOTEBOOK_MEMORY_BUDGET]
    return {
        "durations": dict(_durations),
        "peak_rss": dict(_peak_rss),
        "gpu": {k: len(v) for k, v in _gpu_cells.items()},
        "dumps": list(_data_dumps),
        "modified": list(_modified_after_run),
        "complete": sum(run.complete for run in _cell_runs.values()),
        "silence": silence,
        "failed": bool(
            over
            or silence.get("silent")
            or _modified_after_run
            or _data_dumps
            or (GPU_TIER and _gpu_cells.get("skipped"))
        ),
    }


_reports: list[dict] = []  # the xdist controller's: one report per worker


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _executed:
        _save_executed_notebooks()
    if _cell_runs:
        _judge_printing_cells(session.config)
    _modified_after_run.extend(
        p for p, run in sorted(_cell_runs.items()) if run.complete and _git_sees_a_change_after_run_all(p)
    )
    report = _report(session.config)
    if hasattr(session.config, "workeroutput"):  # an xdist worker: the controller sums up and decides
        session.config.workeroutput["amp_course"] = json.dumps(report)
    reports = _reports or [report]
    if any(r["failed"] for r in reports):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """xdist's controller: a worker's report of the notebooks it ran."""
    data = getattr(node, "workeroutput", {}).get("amp_course")
    if data:
        _reports.append(json.loads(data))


def _merged() -> dict:
    """The reports of every process that ran tests (one without xdist), as one."""
    reports = _reports or []
    if not reports:
        return {}
    out = {
        "durations": {},
        "peak_rss": {},
        "gpu": defaultdict(int),
        "dumps": [],
        "modified": [],
        "complete": 0,
        "silence": {"silent": [], "judged": [], "unlisted": {}, "updated": [], "partial": []},
    }
    for r in reports:
        out["durations"].update(r["durations"])
        out["peak_rss"].update(r["peak_rss"])
        for k, v in r["gpu"].items():
            out["gpu"][k] += v
        out["dumps"] += r["dumps"]
        out["modified"] += r["modified"]
        out["complete"] += r["complete"]
        for k in ("silent", "judged", "updated", "partial"):
            out["silence"][k] += r["silence"].get(k, [])
        out["silence"]["unlisted"].update(r["silence"].get("unlisted", {}))
    if not any("updated" in r["silence"] for r in reports):
        del out["silence"]["updated"]
    return out


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    tr = terminalreporter
    r = _merged() or _report(config)
    if r["durations"]:
        tr.section("notebooks: execution time and kernel peak memory")
        for path, seconds in sorted(r["durations"].items()):
            rss = r["peak_rss"].get(path, 0)
            flags = (" OVER THE 2-MINUTE BUDGET" if seconds > NOTEBOOK_TIME_BUDGET_S else "") + (
                " OVER THE 4 GB BUDGET (fails the run)" if rss > NOTEBOOK_MEMORY_BUDGET else ""
            )
            tr.write_line(f"{seconds:7.1f} s {rss / 2**30:6.2f} GiB  {path}{flags}")
    ran = r["gpu"].get("passed", 0) + r["gpu"].get("failed", 0)
    skipped = r["gpu"].get("skipped", 0)
    if ran or skipped:
        tr.section("gpu-tagged cells")
        where = "with CUDA" if GPU_TIER else "with CUDA hidden: each took its CPU path"
        why = " (GPU tier: skipped gpu cells fail the run)" if GPU_TIER and skipped else ""
        tr.write_line(f"ran {ran} ({where}), skipped {skipped}{why}")
    if r["dumps"]:
        tr.section("cells that show a data dump as their result (fails the run)", red=True)
        for line in r["dumps"]:
            tr.write_line(line, red=True)
        tr.write_line(
            "End such a cell with a statement, or have the function it calls return None: a trailing "
            "`;` hides a result only where IPython keeps the input history, and nbval does not. "
            "The notebook was not saved to build/executed/.",
            red=True,
        )
    if r["modified"]:
        tr.section("notebooks that git would list as modified after Run All (fails the run)", red=True)
        for path in r["modified"]:
            tr.write_line(
                f"{path}: a compared cell's output differs, byte for byte, from the stored one; "
                f"refresh it: python -m course_lib.tooling.nbtools refresh {path}",
                red=True,
            )
    elif r["complete"] and not GPU_TIER:
        tr.section("git after Run All")
        tr.write_line(
            f"{r['complete']} notebook(s) ran to their end; through make lab's git filter none reads as modified"
        )
    silence = r["silence"]
    if "updated" in silence:
        tr.section("printing cells: manifest rewritten")
        where = terminalreporter.config.getoption("--printing-cells-manifest")
        tr.write_line(f"{where}: {len(silence['updated'])} notebook(s) rewritten")
        if silence["partial"]:
            tr.write_line(f"kept as they were (not every code cell ran to its end): {', '.join(silence['partial'])}")
    elif silence.get("silent"):
        tr.section("code cells that stopped printing (fails the run)", red=True)
        for line in silence["silent"]:
            tr.write_line(line, red=True)
    elif silence.get("judged"):
        tr.section("printing cells")
        tr.write_line(f"every cell listed as printing printed, in {len(silence['judged'])} notebook(s)")
        for path, ids in silence["unlisted"].items():
            tr.write_line(f"not in the manifest yet, so not judged: {path} {', '.join(ids)}")
