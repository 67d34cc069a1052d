"""pytest configuration for the whole course (library tests and nbval notebook runs).

- Notebook cells tagged `gpu` are skipped when CUDA is absent (the CPU tier), and must run
  in the GPU tier (`make test-gpu`, COURSE_GPU_TIER=1): there a skipped or CUDA-less `gpu`
  cell fails the session, so the GPU tier cannot pass by silently doing nothing.
- Each notebook's execution time is summed and printed at the end.
"""
from __future__ import annotations

import os
from collections import defaultdict

import pytest

GPU_TIER = os.environ.get("COURSE_GPU_TIER") == "1"
_durations: dict[str, float] = defaultdict(float)
_gpu_cells: dict[str, list[str]] = defaultdict(list)  # outcome -> node ids


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


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("MPLBACKEND", "Agg")  # kernels inherit it: no windows, no GUI backends
    os.environ.setdefault("COURSE_OFFLINE", "1")  # notebooks' kernels: the data loader never downloads
    _refuse_remote_connections()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda = _cuda_available()
    for item in items:
        if not _is_gpu_cell(item):
            continue
        if GPU_TIER and not cuda:
            item.user_properties.append(("gpu_tier_without_cuda", True))
        elif not cuda:
            item.add_marker(pytest.mark.skip(reason="cell tagged `gpu` and no CUDA device here"))


def pytest_runtest_setup(item: pytest.Item) -> None:
    if ("gpu_tier_without_cuda", True) in item.user_properties:
        pytest.fail("GPU tier (COURSE_GPU_TIER=1) but torch.cuda.is_available() is False", pytrace=False)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::")[0]
    if path.endswith(".ipynb"):
        _durations[path] += report.duration


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if _is_gpu_cell(item) and (report.when == "call" or report.skipped):
        _gpu_cells[report.outcome].append(item.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if GPU_TIER and _gpu_cells.get("skipped"):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    tr = terminalreporter
    if _durations:
        tr.section("notebook execution time")
        for path, seconds in sorted(_durations.items()):
            tr.write_line(f"{seconds:7.1f} s  {path}")
    ran = len(_gpu_cells.get("passed", [])) + len(_gpu_cells.get("failed", []))
    skipped = len(_gpu_cells.get("skipped", []))
    if ran or skipped:
        tr.section("gpu-tagged cells")
        why = " (GPU tier: skipped gpu cells fail the run)" if GPU_TIER and skipped else ""
        tr.write_line(f"ran {ran}, skipped {skipped}{why}")
