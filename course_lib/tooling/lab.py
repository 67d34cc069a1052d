"""JupyterLab for the course (`make lab`): reading a notebook must not change it, a saved chapter
reopens as it was left, and git sees a chapter that was only run as unchanged.

A notebook file stores the metadata a kernel describes itself with (`language_info`), but the
Python version in it differs from machine to machine. JupyterLab fills it in when the kernel
starts, which marks a notebook that was only read as modified, and autosave then rewrites the
tracked file (and `git pull` refuses to run). The course stores every notebook without that one
field (`course_lib.tooling.colab.LANGUAGE_INFO`, stamped by `make stamp`); this contents manager
adds it on the way to the browser, so the notebook opens exactly as the kernel will describe
itself, and takes it out again on the way to the disk, so saving an unchanged notebook writes the
same bytes.

Widgets (the Trainer's tqdm progress bars, the chapters' explorers) live in the kernel; the file
keeps only a reference to each. `make lab` turns on JupyterLab's "Save Widget State
Automatically" (overrides.json in the venv), so the file also keeps each widget's last state and
a reopened chapter shows its bars as they ended. JupyterLab saves only the widgets of the kernel
now running, though: saving a reopened chapter would lose the state its outputs still show. So on
saving, this manager takes the state of a widget an output still shows, and that the browser
did not send, from the file being overwritten. Then it drops what would still show "Error
displaying widget: model not found" on reopening: a reference whose state is nowhere (a bar closed
when its loop ended, a kernel restarted before the first save) loses its widget view, and a
progress bar left with nothing but its first text goes. An empty widget state is not written at
all, so the rule above holds.

After each save it asks git to compare the notebook again through the course's clean filter
(course_lib/tooling/notebook_filter.py, which `make lab` configures): a chapter whose only change is its
outputs then shows as unmodified, and `git pull` can update it.

A notebook that was only opened stays unmodified. JupyterLab's widget manager marks a notebook
modified for every saved widget it restores, 1-1.5 s after opening it, with nothing changed. The
course's one JupyterLab plugin (labextension/amp-course-lab, plain JavaScript with no build step,
passed as LabApp.extra_labextensions_path) clears that mark whenever the notebook's contents
equal what was last read from or written to disk; running or editing a cell changes them.

The URL it prints. `make lab` opens chapter 00 with the file browser at the course's top folder
(LabApp.default_url with `?file-browser-path=/`); jupyter_server prints that URL with `?token=...`
appended, so a remote or headless learner (LAB_ARGS=--no-browser) got two `?`, a URL whose token the
server does not read, and a login page. `python -m course_lib.tooling.lab` runs JupyterLab with the
token joined to the query by `&` (`one_query`).

    python -m course_lib.tooling.lab --ServerApp.contents_manager_class=course_lib.tooling.lab.CourseContentsManager
"""

from __future__ import annotations

import json
import platform
import re
import subprocess
import sys
import urllib.parse
from pathlib import Path
from typing import Any

from jupyter_server.services.contents.largefilemanager import AsyncLargeFileManager

from course_lib.tooling.notebook_filter import WIDGET_VIEW

__all__ = [
    "CourseContentsManager",
    "add_version",
    "strip_version",
    "keep_widgets_that_reopen",
    "carry_saved_widgets",
    "drop_unsaved_widgets",
    "refresh_git",
    "one_query",
    "main",
]

WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
NOTEBOOK_FILTER = Path(__file__).resolve().with_name("notebook_filter.py")
EXTENSIONS = Path(__file__).resolve().with_name("labextension")  # amp-course-lab: see "only opened" above
_BAR = re.compile(r"\d+%\|.*\| *\d+/")  # tqdm's text: "train fp32:   0%|          | 0/50 [...]"
_REFERENCE = re.compile(r"IPY_MODEL_([0-9a-f]+)")  # how a widget's state names another widget


def add_version(notebook: Any) -> None:
    """Give a Python notebook's language_info the version this kernel will report."""
    info = notebook.get("metadata", {}).get("language_info")
    if isinstance(info, dict) and info.get("name") == "python" and "version" not in info:
        info["version"] = platform.python_version()


def strip_version(model: dict, **kwargs: Any) -> None:
    """pre_save hook: the file keeps no Python version (it is the reader's, not the course's)."""
    if model.get("type") == "notebook" and isinstance(model.get("content"), dict):
        info = model["content"].get("metadata", {}).get("language_info")
        if isinstance(info, dict):
            info.pop("version", None)


def keep_widgets_that_reopen(model: dict, path: str = "", contents_manager: Any = None, **kwargs: Any) -> None:
    """pre_save hook: every widget an output shows keeps its state (carry_saved_widgets, from the
    file being overwritten), and none is left to reopen as an error (drop_unsaved_widgets)."""
    if model.get("type") != "notebook" or not isinstance(model.get("content"), dict):
        return
    try:
        previous = json.loads(Path(contents_manager._get_os_path(path)).read_text(encoding="utf-8"))
    except Exception:  # a new file, or one that is not a notebook: nothing to carry over
        previous = {}
    carry_saved_widgets(model["content"], previous)
    drop_unsaved_widgets(model["content"])


def _widget_state(notebook: dict) -> dict:
    widgets = notebook.get("metadata", {}).get("widgets")
    return (widgets.get(WIDGET_STATE) or {}).get("state") or {} if isinstance(widgets, dict) else {}


def _shown_widgets(notebook: dict) -> set[str]:
    return {
        out["data"][WIDGET_VIEW].get("model_id")
        for cell in notebook.get("cells", [])
        for out in cell.get("outputs") or []
        if isinstance(out.get("data", {}).get(WIDGET_VIEW), dict)
    }


def carry_saved_widgets(notebook: dict, previous: dict) -> int:
    """Give `notebook` the state, kept in `previous` (the same notebook as last saved), of each widget
    its outputs show and its own state lacks, with the widgets those refer to (a bar's text, layout,
    style); return how many were carried."""
    old, new = _widget_state(previous), dict(_widget_state(notebook))
    todo, carried = [m for m in _shown_widgets(notebook) if m not in new and m in old], 0
    while todo:
        model_id = todo.pop()
        if model_id in new or model_id not in old:
            continue
        new[model_id], carried = old[model_id], carried + 1
        todo += _REFERENCE.findall(json.dumps(old[model_id]))
    if carried:
        versions = previous["metadata"]["widgets"][WIDGET_STATE]
        saved = notebook.setdefault("metadata", {}).setdefault("widgets", {})
        saved[WIDGET_STATE] = {**versions, **(saved.get(WIDGET_STATE) or {}), "state": new}
    return carried


def drop_unsaved_widgets(notebook: dict) -> bool:
    """Leave no widget view that would reopen as "model not found"; True if anything went.

    A view whose model's state is not in the notebook's metadata loses its widget part; an output
    left with only a progress bar's text (the bar as it started, not as it ended) goes entirely.
    Widget metadata with no state in it is dropped."""
    meta = notebook.get("metadata", {})
    state = _widget_state(notebook)
    changed = False
    if "widgets" in meta and not state:
        del meta["widgets"]
        changed = True
    for cell in notebook.get("cells", []):
        outputs = cell.get("outputs") or []
        kept = []
        for out in outputs:
            data = out.get("data", {})
            view = data.get(WIDGET_VIEW)
            if isinstance(view, dict) and view.get("model_id") not in state:
                del data[WIDGET_VIEW]
                changed = True
                text = data.get("text/plain", "")
                if not data or (set(data) == {"text/plain"} and _BAR.search("".join(text))):
                    continue
            kept.append(out)
        if len(kept) != len(outputs):
            cell["outputs"] = kept
    return changed


def refresh_git(model: dict, os_path: str, **kwargs: Any) -> None:
    """post_save hook: let git compare the saved notebook through the course's filter again
    (nothing happens where the filter is not configured, or this is not a git checkout)."""
    if model.get("type") != "notebook" or not NOTEBOOK_FILTER.is_file():
        return
    try:
        subprocess.run(
            [sys.executable, "-I", "-S", str(NOTEBOOK_FILTER), "refresh", os_path], capture_output=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError):
        pass  # git's view of the file is a convenience; the save itself has happened


class CourseContentsManager(AsyncLargeFileManager):
    """JupyterLab's own contents manager, with the Python version added on reading and removed on
    saving, widget views that could not reopen dropped, and git told about the save. The file
    browser does not list build/: it holds copies of the notebooks as `make test` ran them and the
    published edition (`make site`), which a learner would only mistake for the chapters."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hide_globs = [*self.hide_globs, "build"]
        self.register_pre_save_hook(strip_version)
        self.register_pre_save_hook(keep_widgets_that_reopen)
        self.register_post_save_hook(refresh_git)

    async def get(
        self, path: str, content: bool = True, type: str | None = None, format: str | None = None, **kwargs: Any
    ) -> dict:
        model = await super().get(path, content=content, type=type, format=format, **kwargs)
        if model.get("type") == "notebook" and model.get("content"):
            add_version(model["content"])
        return model


def one_query(parts: urllib.parse.ParseResult) -> urllib.parse.ParseResult:
    """A URL whose path still carries a query (LabApp.default_url's `?file-browser-path=/`) with that
    query joined to its own (`token=...`) by `&`, as a browser and the server read it."""
    path, mark, query = parts.path.partition("?")
    if not mark:
        return parts
    return parts._replace(path=path, query="&".join(q for q in (query, parts.query) if q))


def main(argv: list[str] | None = None) -> None:
    """`jupyter lab`, printing URLs that open the lab (`one_query`): JupyterLab itself, on a server
    whose URLs are joined by `one_query` (LabApp.serverapp_class, the server its launch makes)."""
    from jupyter_server.serverapp import ServerApp
    from jupyterlab.labapp import LabApp

    class CourseServerApp(ServerApp):
        def _get_urlparts(self, *args: Any, **kwargs: Any) -> urllib.parse.ParseResult:
            return one_query(super()._get_urlparts(*args, **kwargs))

    LabApp.serverapp_class = CourseServerApp
    argv = sys.argv[1:] if argv is None else argv
    LabApp.launch_instance([f"--LabApp.extra_labextensions_path={EXTENSIONS}", *argv])


if __name__ == "__main__":
    main()
