"""The notebook harness itself: a guarded gpu cell passes without CUDA, fails the GPU tier,
and an unguarded one fails the CPU tier too (the harness skips nothing for it)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

pytestmark = pytest.mark.slow  # notebooks run in kernels of their own: left out by make test-fast

ROOT = Path(__file__).resolve().parents[1]
GUARDED = (
    "from course_lib.device import gpu_cell\n\n"
    'if gpu_cell("a probe"):\n    import torch\n    torch.zeros(1, device="cuda")'
)
UNGUARDED = 'import torch\ntorch.zeros(1, device="cuda")'


def run_suite(tmp_path: Path, gpu_cell_source: str, gpu_tier: bool) -> subprocess.CompletedProcess:
    shutil.copy(ROOT / "conftest.py", tmp_path / "conftest.py")
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("x = 1"),
        nbformat.v4.new_code_cell(gpu_cell_source, metadata={"tags": ["gpu"]}),
        nbformat.v4.new_code_cell("print(x + 1)", metadata={"tags": ["nbval-check-output"]}),
    ]
    nb.cells[2].outputs = [nbformat.v4.new_output("stream", name="stdout", text="2\n")]
    nb.cells[2].execution_count = 1
    nbformat.write(nb, tmp_path / "probe.ipynb")
    env = {**os.environ, "COURSE_GPU_TIER": "1" if gpu_tier else "0"}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "probe.ipynb",
            "--nbval-lax",
            "--nbval-current-env",
            "-p",
            "no:cacheprovider",
            "-q",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def no_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("simulates a machine without CUDA")


@pytest.mark.skipif(os.environ.get("COURSE_GPU_TIER") == "1", reason="this test simulates the CPU tier")
def test_guarded_gpu_cell_runs_its_cpu_path_and_the_report_shows_time_and_memory(tmp_path, no_cuda):
    cpu = run_suite(tmp_path, GUARDED, gpu_tier=False)
    assert cpu.returncode == 0, cpu.stdout
    assert "3 passed" in cpu.stdout and "skipped" not in cpu.stdout.split("passed")[-1].split("\n")[0]
    assert "execution time and kernel peak memory" in cpu.stdout and "GiB  probe.ipynb" in cpu.stdout
    assert "ran 1 (with CUDA hidden" in cpu.stdout


@pytest.mark.skipif(os.environ.get("COURSE_GPU_TIER") == "1", reason="this test simulates the CPU tier")
def test_guarded_gpu_cell_fails_the_gpu_tier_without_cuda(tmp_path, no_cuda):
    gpu = run_suite(tmp_path, GUARDED, gpu_tier=True)
    assert gpu.returncode != 0 and "GPU tier (COURSE_GPU_TIER=1) but torch.cuda.is_available() is False" in gpu.stdout


@pytest.mark.skipif(os.environ.get("COURSE_GPU_TIER") == "1", reason="this test simulates the CPU tier")
def test_unguarded_gpu_cell_fails_the_cpu_tier_because_nothing_is_skipped_for_it(tmp_path, no_cuda):
    cpu = run_suite(tmp_path, UNGUARDED, gpu_tier=False)
    assert cpu.returncode != 0 and "1 failed" in cpu.stdout


def test_gpu_cell_guard_prints_one_line_off_cuda_and_raises_in_the_gpu_tier(monkeypatch, capsys, no_cuda):
    from course_lib.device import gpu_cell

    monkeypatch.delenv("COURSE_GPU_TIER", raising=False)
    assert gpu_cell("the big table", "see below") is False
    out = capsys.readouterr().out.splitlines()
    assert out == ["[needs a CUDA GPU, none here] the big table; see below."]
    monkeypatch.setenv("COURSE_GPU_TIER", "1")
    with pytest.raises(RuntimeError, match="GPU tier"):
        gpu_cell("the big table")
