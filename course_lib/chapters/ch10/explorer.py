"""Chapter 10's memory explorer: batch, sequence, precision and checkpointing moved, GPT-2 small's
predicted step redrawn by kind, with the peak measured in the notebook where there is one.

Like chapter 01's bit explorer, its display carries the live widget and a static picture (PNG) of
its current state, so that a notebook read without a kernel still shows the default chart.
"""

from __future__ import annotations

import base64
import io

from course_lib.chapters.ch10.memory_model import gpt_step_tensors, totals_by_category
from course_lib.models import GPTConfig

__all__ = ["draw_step", "MemoryExplorer"]

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
GIB = 2**30


def draw_step(
    config: GPTConfig,
    batch: int,
    seq: int,
    precision: str,
    checkpointing: bool = False,
    measured: float | None = None,
):
    """Chapter 10: one horizontal bar, the predicted step at its peak moment stacked by kind (GiB),
    with a dot at `measured` (GiB) where given. Returns the matplotlib figure."""
    import matplotlib.pyplot as plt

    moments = gpt_step_tensors(config, batch, seq, precision, checkpointing)
    moment = max(moments, key=lambda k: sum(t.nbytes for t in moments[k]))
    fig, ax = plt.subplots(figsize=(8, 2.4))
    left = 0.0
    for kind, nbytes in totals_by_category(moments[moment]).items():
        gib = nbytes / GIB
        ax.barh([0], [gib], left=left, label=f"{kind} {gib:.2f}")
        left += gib
    if measured is not None:
        ax.plot([measured], [0], "ko", label=f"measured peak {measured:.2f}")
    where = "the start of backward" if moment == "backward" else "AdamW's step"
    title = f"b={batch}, T={seq}, {precision}{', checkpointing' if checkpointing else ''}: peak at {where}"
    ax.set(yticks=[], title=title + " (GiB)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.7), ncol=4, fontsize=8)
    fig.tight_layout()
    return fig


class MemoryExplorer:
    """Chapter 10: the live explorer. Display it (the last line of a cell); `measured` maps
    (batch, seq, precision, checkpointing) to a measured peak in GiB."""

    def __init__(self, config: GPTConfig | None = None, measured: dict | None = None, **start) -> None:
        self.config = config or GPTConfig()
        self.measured = measured or {}
        self.state = {"batch": 8, "seq": 1024, "precision": "bf16", "checkpointing": False, **start}
        self._box = None  # built on first display: the static picture needs no ipywidgets

    def _figure(self):
        key = (self.state["batch"], self.state["seq"], self.state["precision"], self.state["checkpointing"])
        return draw_step(self.config, **self.state, measured=self.measured.get(key))

    def _png(self) -> str:
        import matplotlib.pyplot as plt

        fig = self._figure()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
        plt.close(fig)
        return base64.b64encode(buffer.getvalue()).decode()

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        data = {"text/plain": f"MemoryExplorer({self.state})", "image/png": self._png()}
        try:
            box = self.widget()
        except Exception:  # no ipywidgets, or no kernel: the picture is all there is
            return data
        data[WIDGET_VIEW] = {"version_major": 2, "version_minor": 0, "model_id": box.model_id}
        return data

    def widget(self):
        """The ipywidgets VBox (built once). Raises ImportError without ipywidgets."""
        if self._box is None:
            self._box = self._build()
        return self._box

    def _build(self):
        import ipywidgets as W
        import matplotlib.pyplot as plt
        from IPython.display import display

        controls = {
            "batch": W.IntSlider(self.state["batch"], 1, 32, description="batch"),
            "seq": W.IntSlider(self.state["seq"], 128, 1024, step=128, description="sequence"),
            "precision": W.Dropdown(options=["fp32", "bf16"], value=self.state["precision"], description="precision"),
            "checkpointing": W.Checkbox(self.state["checkpointing"], description="checkpoint every block"),
        }
        out = W.Output()

        def redraw(_change=None) -> None:
            self.state.update({name: c.value for name, c in controls.items()})
            with out:
                out.clear_output(wait=True)
                fig = self._figure()
                display(fig)
                plt.close(fig)  # shown once, in the output area: not again when the cell ends

        for c in controls.values():
            c.observe(redraw, names="value")
        # The first picture goes into the widget's state directly. Drawn with display() here, before
        # any front end shows the widget, it would also land in the cell's own outputs wherever no
        # widget manager routes it (nbval, nbconvert, a static viewer): the same chart twice.
        first = {"image/png": self._png(), "text/plain": f"MemoryExplorer({self.state})"}
        out.outputs = ({"output_type": "display_data", "data": first, "metadata": {}},)
        return W.VBox([W.HBox(list(controls.values())[:2]), W.HBox(list(controls.values())[2:]), out])
