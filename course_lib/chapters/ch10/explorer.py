"""Chapter 10's memory explorer: every option of a GPT step moved (batch, sequence, precision recipe,
optimizer and its implementation, checkpointing, attention, device, what the loop holds), its
predicted peak redrawn by kind, with the moment it falls at, and the peak measured in the notebook
where there is one.

Like chapter 01's bit explorer, it is an `Explorer` (course_lib.chapters.ch01.widgets): its display
carries the live widget and a static picture (PNG) of its current state, so that a notebook read
without a kernel still shows the default chart.
"""

from __future__ import annotations

import base64
import io

from course_lib.chapters.ch01.widgets import Explorer
from course_lib.chapters.ch10.predict import OPTIMIZERS, PRECISIONS, Step, predict_step
from course_lib.models import GPTConfig

__all__ = ["draw_step", "MemoryExplorer"]

GIB = 2**30


def draw_step(step: Step, measured: float | None = None):
    """Chapter 10: one horizontal bar, `step`'s predicted peak stacked by kind (GiB), titled with the
    moment it falls at, with a dot at `measured` (GiB) where given. Returns the matplotlib figure."""
    import matplotlib.pyplot as plt

    p = predict_step(step)
    fig, ax = plt.subplots(figsize=(8, 2.6), layout="constrained")
    left = 0.0
    for kind, nbytes in p.by_category.items():
        gib = nbytes / GIB
        ax.barh([0], [gib], left=left, label=f"{kind} {gib:.2f}")
        left += gib
    if measured is not None:
        ax.plot([measured], [0], "ko", label=f"measured peak {measured:.2f}")
    attention = "SDPA" if step.gpt.sdpa else "materialized"
    what = f"b={step.batch}, T={step.seq}, {step.precision}, {step.optimizer_kind}, {attention}"
    what += (", checkpointing" if step.checkpointing else "") + f", {step.device}"
    ax.set(yticks=[], xlabel="GiB at the peak", title=f"{what}\npeak {p.peak / GIB:.2f} GiB at {p.moment[:60]}")
    fig.legend(loc="outside lower center", ncol=4, fontsize=8)  # below the axis label, never over it
    return fig


# Shown above the chart only where the widget has no kernel behind it: a notebook reopened with its
# saved widget state, or a kernel restarted. ipywidgets marks such a view `jupyter-widgets-disconnected`
# (its red icon); the controls still move, the chart does not, and this says why.
SAVED_NOTE = (
    "<style>.amp-saved{display:none}.jupyter-widgets-disconnected .amp-saved{display:block}</style>"
    '<div class="amp-saved">&#9888; The picture saved with the notebook: the controls move, the chart does '
    "not. Run this cell again to explore.</div>"
)


class MemoryExplorer(Explorer):
    """Chapter 10: the live explorer of a GPT's step (GPT-2 small by default). Display it (the last
    line of a cell); `measured` maps (batch, seq, precision, optimizer, checkpointing, attention) to a
    measured peak in GiB, on the notebook's loop (a CPU's rules, the logits held). An option the
    predictor does not model leaves the picture and says why (`message`)."""

    def __init__(self, config: GPTConfig | None = None, measured: dict | None = None, **start) -> None:
        self.config = config or GPTConfig()
        self.measured = measured or {}
        self.state = {
            "batch": 8,
            "seq": min(1024, self.config.block_size),
            "precision": "bf16",
            "optimizer": "adamw-fused",
            "checkpointing": False,
            "attention": "sdpa" if self.config.sdpa else "materialized",
            "device": "cpu",
            "logits_held": True,
            **start,
        }
        self.message = ""
        self._drawn: tuple[str, str] = ("", "")  # (the state, its PNG): drawn once per state

    def step(self) -> Step:
        """The step the controls describe (raises ValueError for one the predictor does not model)."""
        return Step("gpt", config=self.config, **self.state)

    def _figure(self):
        s = self.state
        key = (s["batch"], s["seq"], s["precision"], s["optimizer"], s["checkpointing"], s["attention"])
        here = s["device"] == "cpu" and s["logits_held"]  # the notebook's loop: what it measured
        return draw_step(self.step(), measured=self.measured.get(key) if here else None)

    def _png(self) -> str:
        import matplotlib.pyplot as plt

        if self._drawn[0] != repr(self.state):
            fig = self._figure()
            buffer = io.BytesIO()
            fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
            plt.close(fig)
            self._drawn = (repr(self.state), base64.b64encode(buffer.getvalue()).decode())
        return self._drawn[1]

    def static_views(self) -> dict:
        """What a frontend without widgets shows: the picture of the current state (chapter 01's `Explorer`)."""
        return {"text/plain": f"MemoryExplorer({self.state})", "image/png": self._png()}

    def build_widget(self):
        import ipywidgets as W
        import matplotlib.pyplot as plt
        from IPython.display import display

        s, top = self.state, self.config.block_size
        controls = {
            "batch": W.IntSlider(s["batch"], 1, 32, description="batch"),
            "seq": W.IntSlider(s["seq"], min(128, top), top, step=min(128, top), description="sequence"),
            "precision": W.Dropdown(options=PRECISIONS, value=s["precision"], description="precision"),
            "optimizer": W.Dropdown(options=OPTIMIZERS, value=s["optimizer"], description="optimizer"),
            "attention": W.Dropdown(options=("sdpa", "materialized"), value=s["attention"], description="attention"),
            "device": W.Dropdown(options=("cpu", "cuda"), value=s["device"], description="device's rules"),
            "checkpointing": W.Checkbox(s["checkpointing"], description="checkpoint every block"),
            "logits_held": W.Checkbox(s["logits_held"], description="the loop holds the logits"),
        }
        out = W.Output()

        def redraw(_change=None) -> None:
            self.state.update({name: c.value for name, c in controls.items()})
            with out:
                out.clear_output(wait=True)
                try:
                    self.step()
                except ValueError as e:  # a recipe the predictor does not model: say so
                    self.message = str(e)
                    print(f"not modelled: {e}")
                    return
                self.message = ""
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
        c = list(controls.values())
        return W.VBox([W.HBox(c[:2]), W.HBox(c[2:4]), W.HBox(c[4:6]), W.HBox(c[6:]), W.HTML(SAVED_NOTE), out])
