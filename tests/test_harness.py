"""The notebook harness itself: gpu cells skip on CPU and fail the GPU tier instead of passing."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_suite(tmp_path: Path, gpu_tier: bool) -> subprocess.CompletedProcess:
    shutil.copy(ROOT / "conftest.py", tmp_path / "conftest.py")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x = 1"),
                nbformat.v4.new_code_cell("import torch; torch.zeros(1, device='cuda')", metadata={"tags": ["gpu"]}),
                nbformat.v4.new_code_cell("print(x + 1)", metadata={"tags": ["nbval-check-output"]})]
    nb.cells[2].outputs = [nbformat.v4.new_output("stream", name="stdout", text="2\n")]
    nb.cells[2].execution_count = 1
    nbformat.write(nb, tmp_path / "probe.ipynb")
    env = {**os.environ, "COURSE_GPU_TIER": "1" if gpu_tier else "0"}
    return subprocess.run([sys.executable, "-m", "pytest", "probe.ipynb", "--nbval-lax", "--nbval-current-env",
                           "-p", "no:cacheprovider", "-q"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.skipif(os.environ.get("COURSE_GPU_TIER") == "1", reason="this test simulates a machine without CUDA")
def test_gpu_cell_is_skipped_on_cpu_and_fails_the_gpu_tier(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    cpu = run_suite(tmp_path, gpu_tier=False)
    assert cpu.returncode == 0, cpu.stdout
    assert "2 passed, 1 skipped" in cpu.stdout and "notebook execution time" in cpu.stdout
    gpu = run_suite(tmp_path, gpu_tier=True)
    assert gpu.returncode != 0 and "GPU tier (COURSE_GPU_TIER=1) but torch.cuda.is_available() is False" in gpu.stdout
