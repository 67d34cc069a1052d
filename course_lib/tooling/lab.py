"""JupyterLab for the course (`make lab`): reading a notebook must not change it.

A notebook file stores the metadata a kernel describes itself with (`language_info`), but the
Python version in it differs from machine to machine. JupyterLab fills it in when the kernel
starts, which marks a notebook that was only read as modified, and autosave then rewrites the
tracked file (and `git pull` refuses to run). The course stores every notebook without that one
field (`course_lib.tooling.colab.LANGUAGE_INFO`, stamped by `make stamp`); this contents manager
adds it on the way to the browser, so the notebook opens exactly as the kernel will describe
itself, and takes it out again on the way to the disk, so saving an unchanged notebook writes the
same bytes.

    jupyter lab --ServerApp.contents_manager_class=course_lib.tooling.lab.CourseContentsManager
"""

from __future__ import annotations

import platform
from typing import Any

from jupyter_server.services.contents.largefilemanager import AsyncLargeFileManager

__all__ = ["CourseContentsManager", "add_version", "strip_version"]


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


class CourseContentsManager(AsyncLargeFileManager):
    """JupyterLab's own contents manager, with the Python version added on reading and removed on saving."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.register_pre_save_hook(strip_version)

    async def get(
        self, path: str, content: bool = True, type: str | None = None, format: str | None = None, **kwargs: Any
    ) -> dict:
        model = await super().get(path, content=content, type=type, format=format, **kwargs)
        if model.get("type") == "notebook" and model.get("content"):
            add_version(model["content"])
        return model
