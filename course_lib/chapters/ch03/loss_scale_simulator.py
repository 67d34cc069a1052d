"""The loss-scale simulator, an interactive explorer with a static fallback.

Chapter 03 introduces it: pick GradScaler's factors and an overflow pattern, watch the scale
and the skipped steps.

    scale_simulator()        # the last expression of a cell: the widget, or its chart and timeline

It is displayed like chapter 01's bit explorer (course_lib.chapters.ch01.widgets): the displayed
object carries the live widget, an HTML view (the chart and the timeline) and a text view, and
the frontend picks the richest one it can show. The run and its static views are plain
functions and a dataclass that the tests call; the steps themselves are
course_lib.chapters.ch03.scaler's `simulate`.
"""

from __future__ import annotations

import base64
import html
import math
import random
from dataclasses import dataclass

from course_lib.chapters.ch01.widgets import Explorer
from course_lib.chapters.ch03.scaler import Trajectory, simulate

__all__ = ["scale_simulator"]

# overflow patterns: name -> what the one parameter means (None: no parameter)
PATTERNS = {
    "headroom": "c: a step overflows when the scale is above 2^c",
    "every k-th step": "k: every k-th step overflows, whatever the scale",
    "random": "p: each step overflows with probability p % (seeded)",
    "every step": None,
    "never": None,
}


@dataclass(frozen=True)
class SimulatorSettings:
    """What the loss-scale simulator runs: GradScaler's four settings and an overflow pattern."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 20
    pattern: str = "headroom"
    parameter: int = 20
    steps: int = 200

    def pattern_text(self) -> str:
        p = self.parameter
        return {
            "headroom": f"a step overflows when the scale is above 2^{p}",
            "every k-th step": f"every {p}-th step overflows, whatever the scale",
            "random": f"each step overflows with probability {p}% (seed 0)",
            "every step": "every step overflows (the forward pass itself makes inf)",
            "never": "no step ever overflows",
        }[self.pattern]

    def run(self) -> Trajectory:
        p = self.parameter
        draws = random.Random(0)
        rand = [draws.random() < p / 100 for _ in range(self.steps)]
        rules = {
            "headroom": lambda i, s: s > 2.0**p,
            "every k-th step": lambda i, s: (i + 1) % max(1, p) == 0,
            "random": lambda i, s: rand[i],
            "every step": lambda i, s: True,
            "never": lambda i, s: False,
        }
        return simulate(
            rules[self.pattern],
            self.steps,
            init_scale=self.init_scale,
            growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor,
            growth_interval=self.growth_interval,
        )


def _mark(skipped: bool, event: str) -> str:
    """One step of the timeline: x skipped, + the scale grew, . a plain step."""
    if skipped:
        return "x"
    return "+" if event == "growth" else "."


def simulator_text(st: SimulatorSettings, per_row: int = 50) -> str:
    """The simulator's static view as text: settings, summary, and a timeline of the steps."""
    t = st.run()
    marks = [_mark(skipped, event) for skipped, event in zip(t.skipped, t.event)]
    out = [
        f"GradScaler(init_scale={st.init_scale:g}, growth_factor={st.growth_factor:g}, "
        f"backoff_factor={st.backoff_factor:g}, growth_interval={st.growth_interval})",
        f"pattern: {st.pattern_text()}",
        t.summary(),
        "timeline: . step taken   x skipped (scale backs off)   + step taken, then the scale grew",
    ]
    out += [f"{i + 1:>6} {''.join(marks[i : i + per_row])}" for i in range(0, len(marks), per_row)]
    return "\n".join(out)


def _svg_chart(t: Trajectory, width: int = 640, height: int = 250) -> str:
    """The scale each step used on a log2 axis, skipped steps as red crosses: inline SVG, deterministic."""
    logs = [math.log2(s) if s > 0 else -150.0 for s in t.scale]
    lo, hi = math.floor(min(logs)) - 1, math.ceil(max(logs)) + 1
    left, right = 58, width - 10  # the plot area inside the picture, in pixels
    top, bottom = 30, height - 38
    n = len(logs)

    def px(i: float) -> float:
        return left + (right - left) * i / max(1, n)

    def py(v: float) -> float:
        return bottom - (bottom - top) * (v - lo) / (hi - lo)

    path = " ".join(f"{px(i):.1f},{py(v):.1f} {px(i + 1):.1f},{py(v):.1f}" for i, v in enumerate(logs))
    cross = '<path d="M{:.1f},{:.1f}l6,6m0,-6l-6,6" stroke="#c0392b"/>'
    crosses = "".join(cross.format(px(i + 0.5) - 3, py(v) - 3) for i, (v, k) in enumerate(zip(logs, t.skipped)) if k)
    yt = "".join(
        f'<text x="{left - 6}" y="{py(v) + 4:.1f}" text-anchor="end">2^{v}</text>'
        f'<line x1="{left}" x2="{right}" y1="{py(v):.1f}" y2="{py(v):.1f}" stroke="#eee"/>'
        for v in range(lo, hi + 1, max(1, math.ceil((hi - lo) / 6)))
    )
    xstep = max(1, 10 ** math.floor(math.log10(max(1, n))) // 2)
    xt = "".join(
        f'<text x="{px(i):.1f}" y="{bottom + 16}" text-anchor="middle">{i}</text>' for i in range(0, n + 1, xstep)
    )
    mid = (top + bottom) / 2
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-size="11" '
        f'font-family="sans-serif">{yt}{xt}<rect x="{left}" y="{top}" width="{right - left}" '
        f'height="{bottom - top}" fill="none" stroke="#999"/><polyline points="{path}" fill="none" '
        f'stroke="#1f77b4" stroke-width="1.6"/>{crosses}<text x="{(left + right) / 2:.0f}" y="{height - 6}" '
        f'text-anchor="middle">optimizer step</text><text x="12" y="{mid:.0f}" '
        f'transform="rotate(-90 12 {mid:.0f})" text-anchor="middle">loss scale (log2 axis)</text>'
        f'<line x1="{left}" x2="{left + 20}" y1="14" y2="14" stroke="#1f77b4" stroke-width="1.6"/>'
        f'<text x="{left + 25}" y="18">scale used by the step</text>{cross.format(left + 170, 11)}'
        f'<text x="{left + 182}" y="18">skipped step ({sum(t.skipped)} of {n})</text></svg>'
    )


def simulator_html(st: SimulatorSettings) -> str:
    """The simulator's static view as HTML: the chart, then the text view. The chart is an <img> of
    SVG: an untrusted notebook's HTML is sanitized, and inline <svg> would not survive it."""
    chart = base64.b64encode(_svg_chart(st.run()).encode()).decode()
    return (
        f'<div><img alt="loss scale at each step" src="data:image/svg+xml;base64,{chart}"/>'
        f"<pre>{html.escape(simulator_text(st))}</pre></div>"
    )


class ScaleSimulator(Explorer):
    """The live simulator; displayed, it carries the widget and both static views (chapter 01's `Explorer`)."""

    def __init__(self, settings: SimulatorSettings):
        self.settings = settings

    def __repr__(self) -> str:
        return simulator_text(self.settings)

    def _repr_html_(self) -> str:
        return simulator_html(self.settings)

    def build_widget(self):
        import ipywidgets as W

        st = self.settings
        wide = {"style": {"description_width": "120px"}, "layout": W.Layout(width="420px")}
        self._controls = {
            "init_scale": W.FloatLogSlider(
                st.init_scale, base=2, min=-20, max=40, step=1, description="init_scale", **wide
            ),
            "growth_factor": W.FloatSlider(
                st.growth_factor, min=1.05, max=4, step=0.05, description="growth_factor", **wide
            ),
            "backoff_factor": W.FloatSlider(
                st.backoff_factor, min=0.05, max=0.95, step=0.05, description="backoff_factor", **wide
            ),
            "growth_interval": W.IntSlider(st.growth_interval, min=1, max=500, description="growth_interval", **wide),
            "pattern": W.Dropdown(options=list(PATTERNS), value=st.pattern, description="overflows", **wide),
            "parameter": W.IntSlider(st.parameter, min=0, max=200, description="c", **wide),
            "steps": W.IntSlider(st.steps, min=20, max=2000, step=10, description="steps", **wide),
        }
        self._help, self._view = W.HTML(), W.HTML()
        for c in self._controls.values():
            c.observe(self._on_change, names="value")
        self._render()
        return W.VBox([*self._controls.values(), self._help, self._view])

    def _on_change(self, change) -> None:
        self.settings = SimulatorSettings(**{k: c.value for k, c in self._controls.items()})
        self._render()

    def _render(self) -> None:
        meaning = PATTERNS[self.settings.pattern]
        self._controls["parameter"].description = meaning.split(":")[0] if meaning else "(unused)"
        self._help.value = f"<i>{html.escape(meaning or 'this pattern has no parameter')}</i>"
        self._view.value = simulator_html(self.settings)


def scale_simulator(
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 20,
    pattern: str = "headroom",
    parameter: int = 20,
    steps: int = 200,
) -> ScaleSimulator:
    """Chapter 03: the loss-scale simulator; make it the last expression of a cell to show it."""
    if pattern not in PATTERNS:
        raise ValueError(f"pattern must be one of {list(PATTERNS)}, not {pattern!r}")
    return ScaleSimulator(
        SimulatorSettings(float(init_scale), growth_factor, backoff_factor, growth_interval, pattern, parameter, steps)
    )
