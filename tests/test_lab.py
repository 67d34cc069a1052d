"""`make lab` really starts JupyterLab: start it headless and ask its REST API."""
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not (ROOT / ".venv" / ".installed-stamp").exists() or os.environ.get("COURSE_GPU_TIER") == "1",
                    reason="make lab bootstraps .venv; this run has none (GPU tier or a foreign environment)")
def test_make_lab_starts_jupyterlab_and_serves_the_course(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = "course-test"
    args = (f"--no-browser --port={port} --ip=127.0.0.1 --IdentityProvider.token={token} "
            f"--ServerApp.root_dir={ROOT}")
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path), "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg")}
    proc = subprocess.Popen(["make", "-s", "lab", f"LAB_ARGS={args}"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline, status = time.monotonic() + 90, None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                url = f"http://127.0.0.1:{port}/api/contents/notebooks?token={token}"
                with urllib.request.urlopen(url, timeout=5) as r:
                    status = json.load(r)
                break
            except OSError:
                time.sleep(1)
        output = proc.stdout.read1().decode() if proc.poll() is not None else ""
        assert status is not None, f"JupyterLab did not answer; output:\n{output}"
        names = {item["name"] for item in status["content"]}
        assert "00_setup.ipynb" in names
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/lab?token={token}", timeout=10) as r:
            assert r.status == 200 and b"JupyterLab" in r.read()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
