"""`make lab` really starts JupyterLab at the repository root, opening chapter 00."""

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

pytestmark = pytest.mark.slow  # a JupyterLab server started: left out by make test-fast

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(p for d in ("notebooks", "exercises", "solutions") for p in (ROOT / d).glob("*.ipynb"))


@pytest.mark.timing
@pytest.mark.skipif(
    not (ROOT / ".venv" / ".installed-stamp").exists() or os.environ.get("COURSE_GPU_TIER") == "1",
    reason="make lab bootstraps .venv; this run has none (GPU tier or a foreign environment)",
)
def test_make_lab_serves_the_whole_course_from_the_repository_root(tmp_path):
    # The clocks here only stop a server that never answers: 180 s to start and 30 s an answer, for a lab that
    # answered in 2-24 s with both cores busy (tools/under_load.py). A lab that does not start, or serves the
    # wrong folder or page, fails however long it is given.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = "course-test"
    # Only what a headless test needs: no root_dir here, so the Makefile's own choice is tested.
    args = f"--no-browser --port={port} --ip=127.0.0.1 --IdentityProvider.token={token}"
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path), "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg")}
    log = tmp_path / "lab.log"
    proc = subprocess.Popen(
        ["make", "-s", "lab", f"LAB_ARGS={args}"],
        cwd=ROOT,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )

    def get(path: str):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}?token={token}", timeout=30) as r:
            return r.status, r.read()

    try:
        deadline, root = time.monotonic() + 180, None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                root = json.loads(get("/api/contents")[1])
                break
            except OSError:
                time.sleep(1)
        assert root is not None, f"JupyterLab did not answer; output:\n{log.read_text()}"
        names = {item["name"] for item in root["content"]}
        assert {"notebooks", "exercises", "solutions", "course_lib", "data", "README.md"} <= names
        listing = json.loads(get("/api/contents/exercises")[1])
        assert "00_setup_exercises.ipynb" in {item["name"] for item in listing["content"]}
        status, page = get("/lab")
        assert status == 200 and b"JupyterLab" in page
        # the course's plugin (a notebook only opened is not modified) is offered and served
        config = json.loads(re.search(rb'id="jupyter-config-data"[^>]*>(.*?)</script>', page, re.S).group(1))
        ours = [e for e in config["federated_extensions"] if e["name"] == "amp-course-lab"]
        assert ours, [e["name"] for e in config["federated_extensions"]]
        status, script = get(f"/lab/extensions/amp-course-lab/{ours[0]['load']}")
        assert status == 200 and b"amp-course-lab:unchanged-is-not-dirty" in script
        # the page it opens on is chapter 00 (LabApp.default_url)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/?token={token}", timeout=30) as r:
            assert r.url.split("?")[0].endswith("/lab/tree/notebooks/00_setup.ipynb")
        # the URL it prints (for --no-browser) opens the lab, not its login page: one `?`, the token
        # joined by `&` (a token given in the configuration is printed as `...`)
        printed = re.findall(rf"http://127\.0\.0\.1:{port}/\S+", log.read_text())
        assert printed and all(url.count("?") == 1 for url in printed), printed
        assert printed[0].endswith("/lab/tree/notebooks/00_setup.ipynb?file-browser-path=/&token=...")
        with urllib.request.urlopen(printed[0].replace("token=...", f"token={token}"), timeout=30) as r:
            assert "/login" not in r.url and b"JupyterLab" in r.read()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def test_the_printed_url_joins_the_token_to_the_default_urls_query():
    from urllib.parse import parse_qs, urlparse

    from course_lib.tooling.lab import one_query

    parts = urlparse("http://host:8888/lab/tree/notebooks/00_setup.ipynb")._replace(
        path="/lab/tree/notebooks/00_setup.ipynb?file-browser-path=/", query="token=abc"
    )  # as jupyter_server builds it: default_url as the path, the token as the query
    assert parts.geturl().count("?") == 2
    url = one_query(parts).geturl()
    assert url == "http://host:8888/lab/tree/notebooks/00_setup.ipynb?file-browser-path=/&token=abc"
    assert parse_qs(urlparse(url).query) == {"file-browser-path": ["/"], "token": ["abc"]}
    plain = urlparse("http://host:8888/lab?token=abc")
    assert one_query(plain) == plain


@pytest.mark.skipif(not (ROOT / ".venv" / ".installed-stamp").exists(), reason="no .venv made by make")
def test_the_lab_neither_asks_for_news_nor_checks_for_updates_offline():
    overrides = json.loads((ROOT / ".venv/share/jupyter/lab/settings/overrides.json").read_text())
    assert overrides["@jupyterlab/apputils-extension:notification"] == {"fetchNews": "false", "checkForUpdates": False}
    assert "--LabApp.news_url=None" in (ROOT / "Makefile").read_text()


LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_in_a_notebook_resolves_to_a_file_in_the_repository(path):
    broken = []
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type != "markdown":
            continue
        for target in LINK.findall(cell.source):
            if re.match(r"^[a-z]+:|^#", target):
                continue  # web links and anchors
            resolved = (path.parent / target.split("#")[0]).resolve()
            if not resolved.exists() or ROOT not in resolved.parents:
                broken.append(target)
    assert not broken, f"{path.name}: links that lead nowhere in the repository: {broken}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_a_notebook_is_stored_as_jupyterlab_saves_it_unchanged(path):
    """Reading a notebook in JupyterLab must not mark it modified, nor autosave rewrite the tracked file:
    the file is what nbformat writes back, with the metadata the kernel reports (less its version)."""
    from course_lib.tooling.colab import KERNELSPEC, LANGUAGE_INFO

    raw = path.read_text(encoding="utf-8")
    nb = nbformat.reads(raw, as_version=4)
    assert nbformat.writes(nb) + "\n" == raw, "re-saving with nbformat changes the file: run make stamp"
    assert (nb.nbformat, nb.nbformat_minor) == (4, 5)
    assert nb.metadata["kernelspec"] == KERNELSPEC and nb.metadata["language_info"] == LANGUAGE_INFO


def test_the_labs_contents_manager_opens_a_notebook_as_the_kernel_describes_itself_and_saves_it_unchanged(tmp_path):
    import asyncio
    import platform
    import shutil

    # The GPU tier's kit (docs/gpu.md) carries the notebook tooling, not JupyterLab's server.
    pytest.importorskip("jupyter_server", reason="JupyterLab is not installed here (make lab installs it)")
    from course_lib.tooling.lab import CourseContentsManager

    shutil.copy(ROOT / "notebooks" / "01_formats.ipynb", tmp_path / "01.ipynb")
    before = (tmp_path / "01.ipynb").read_bytes()
    manager = CourseContentsManager(root_dir=str(tmp_path))

    async def open_and_save() -> str:
        model = await manager.get("01.ipynb")
        opened_as = model["content"]["metadata"]["language_info"]["version"]
        await manager.save({"type": "notebook", "format": "json", "content": model["content"]}, "01.ipynb")
        return opened_as

    assert asyncio.run(open_and_save()) == platform.python_version()
    assert (tmp_path / "01.ipynb").read_bytes() == before


def test_the_labs_file_browser_does_not_list_the_copies_in_build(tmp_path):
    import asyncio

    pytest.importorskip("jupyter_server", reason="JupyterLab is not installed here (make lab installs it)")
    from course_lib.tooling.lab import CourseContentsManager

    (tmp_path / "build" / "executed" / "notebooks").mkdir(parents=True)
    (tmp_path / "notebooks").mkdir()
    manager = CourseContentsManager(root_dir=str(tmp_path))
    listing = asyncio.run(manager.get("", content=True))
    assert [item["name"] for item in listing["content"]] == ["notebooks"]
