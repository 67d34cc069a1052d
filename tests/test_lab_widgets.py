"""A saved chapter reopens with its progress bars as they ended, never "model not found" (issue 33).

`make lab` turns on JupyterLab's widget-state saving; course_lib/tooling/lab.py's contents manager
keeps that state across saves of a reopened chapter and drops any widget view whose state is
nowhere. tests/test_lab_session.py checks the same in a real browser.
"""

from __future__ import annotations

import asyncio
import copy
import json

import nbformat
import pytest

pytest.importorskip("jupyter_server", reason="JupyterLab is not installed here (make lab installs it)")
from course_lib.tooling.lab import (  # noqa: E402
    WIDGET_STATE,
    WIDGET_VIEW,
    CourseContentsManager,
    carry_saved_widgets,
    drop_unsaved_widgets,
)


def bar(model_id: str, text: str = "train fp32:   0%|          | 0/50 [00:00<?, ?step/s]") -> dict:
    """A tqdm bar's output as ipywidgets displays it: a reference to the HBox, and its first text."""
    view = {"model_id": model_id, "version_major": 2, "version_minor": 0}
    return nbformat.v4.new_output("display_data", {WIDGET_VIEW: view, "text/plain": text})


def bar_state(model_id: str, value: str = "train fp32: 100%") -> dict:
    """The HBox and the HTML text it refers to, as JupyterLab saves them."""
    return {
        model_id: {"model_name": "HBoxModel", "state": {"children": [f"IPY_MODEL_{model_id}0"]}},
        f"{model_id}0": {"model_name": "HTMLModel", "state": {"value": value, "layout": f"IPY_MODEL_{model_id}1"}},
        f"{model_id}1": {"model_name": "LayoutModel", "state": {}},
    }


def chapter(*outputs: dict, state: dict | None = None) -> dict:
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("trainer.fit(loader)", execution_count=3, id="fit")
    cell.outputs = list(outputs)
    nb.cells = [cell]
    if state is not None:
        nb.metadata["widgets"] = {WIDGET_STATE: {"state": state, "version_major": 2, "version_minor": 0}}
    return json.loads(nbformat.writes(nb))


def test_a_bar_whose_state_is_nowhere_goes_and_leaves_no_error():
    printed = nbformat.v4.new_output("stream", name="stdout", text="fp32 on cpu: 50 steps\n")
    explorer = nbformat.v4.new_output("display_data", {WIDGET_VIEW: {"model_id": "e"}, "text/html": "<table/>"})
    nb = chapter(bar("a"), printed, bar(""), explorer, bar("b"), state=bar_state("b"))
    assert drop_unsaved_widgets(nb)
    outputs = nb["cells"][0]["outputs"]
    assert outputs[0]["output_type"] == "stream"  # bars "a" (not saved) and "" (closed by its loop) went
    assert outputs[1]["data"] == {"text/html": ["<table/>"]}  # an explorer keeps its static picture
    assert outputs[2]["data"][WIDGET_VIEW]["model_id"] == "b"  # a saved bar stays
    assert len(outputs) == 3


def test_an_empty_widget_state_is_not_written():
    nb = chapter(state={})
    assert drop_unsaved_widgets(nb) and "widgets" not in nb["metadata"]
    plain = chapter()
    assert not drop_unsaved_widgets(plain)


def test_saving_a_reopened_chapter_keeps_the_state_of_the_bars_it_shows():
    last_saved = chapter(bar("a"), bar("b"), state={**bar_state("a"), **bar_state("b"), **bar_state("old")})
    reopened = copy.deepcopy(last_saved)
    reopened["metadata"]["widgets"][WIDGET_STATE]["state"] = {}  # JupyterLab saves only the live kernel's widgets
    assert carry_saved_widgets(reopened, last_saved) == 6
    state = reopened["metadata"]["widgets"][WIDGET_STATE]
    assert set(state["state"]) == set(bar_state("a")) | set(bar_state("b"))  # not "old": no output shows it
    assert state["version_major"] == 2
    assert not drop_unsaved_widgets(reopened)


def test_a_rerun_cell_saves_its_new_bars_not_the_old_ones():
    last_saved = chapter(bar("a"), state=bar_state("a", "train fp32: 100%"))
    rerun = chapter(bar("c"), state=bar_state("c", "train fp32:  40%"))
    assert carry_saved_widgets(rerun, last_saved) == 0
    assert set(rerun["metadata"]["widgets"][WIDGET_STATE]["state"]) == set(bar_state("c"))


def test_the_contents_manager_keeps_bars_across_saves_and_drops_lost_ones(tmp_path):
    manager = CourseContentsManager(root_dir=str(tmp_path))

    def save(nb: dict) -> dict:
        asyncio.run(manager.save({"type": "notebook", "format": "json", "content": copy.deepcopy(nb)}, "00.ipynb"))
        return json.loads((tmp_path / "00.ipynb").read_text())

    ran = chapter(bar("a"), state=bar_state("a"))
    first = save(ran)
    assert first["metadata"]["widgets"][WIDGET_STATE]["state"] == bar_state("a")
    reopened_and_saved = save(chapter(bar("a"), state={}))  # autosave of the reopened chapter
    assert reopened_and_saved == first
    plain = save(chapter(nbformat.v4.new_output("stream", name="stdout", text="1\n")))
    assert "widgets" not in plain["metadata"]
    (tmp_path / "00.ipynb").unlink()
    lost = save(chapter(bar("a"), state={}))  # nowhere to take it from
    assert lost["cells"][0]["outputs"] == [] and "widgets" not in lost["metadata"]
