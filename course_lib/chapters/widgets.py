"""Interactive explorers for the notebooks, each with a static fallback.

Chapter 01 introduces the bit explorer: type a number and see how fp32, bf16, fp16 and the
two fp8 formats store it; click the bits of one format and see the value they mean.
Chapter 03 adds the loss-scale simulator: pick GradScaler's factors and an overflow pattern,
watch the scale and the skipped steps.

    bit_explorer(0.1)        # the last expression of a cell: the widget, or its static table
    scale_simulator()        # the same for the simulator: the widget, or its chart and timeline

The logic (parsing, flipping a bit, the table) is in plain functions that the tests call.
The displayed object carries three representations and the frontend picks the richest one it
can show: the live widget (JupyterLab, Notebook 7, VS Code, Colab), an HTML table (nbviewer,
GitHub, nbconvert, an untrusted notebook) or a fixed-width text table (a terminal, nbval).

A saved notebook must not keep the widget view: its model lives in the kernel, so a notebook
opened before running would show "Error displaying widget: model not found" (JupyterLab
picks the view over the table). The stored output of the chapter's explorer cell therefore
holds only the two tables (tests/test_widgets.py checks it); `without_widget_views` removes
the view from outputs after a headless run.
"""
from __future__ import annotations

import ast
import base64
import html
import math
import operator
import random
from dataclasses import dataclass, replace

from .formats import Decomposed, decode, decompose, get_format
from .scaler import Trajectory, simulate

__all__ = ["bit_explorer", "scale_simulator"]

EXPLORER_FORMATS = ("fp32", "bf16", "fp16", "fp8_e4m3fn", "fp8_e5m2")
# Field colours: sign, exponent, mantissa (the colours of the chapter's bit-layout figure).
COLORS = {"sign": "#f4cccc", "exponent": "#cfe2f3", "mantissa": "#d9ead3"}

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}


def parse_number(text: str) -> float:
    """A number typed into the explorer: '0.1', '-inf', 'nan', '1e-8', '2**-24', '65504 + 16'.

    Only numbers and + - * / ** are evaluated (no names, no calls), so this is safe on any input.
    Raises ValueError with a short message for anything else.
    """
    text = text.strip().replace("^", "**")
    try:
        return float(text)  # also 'inf', '-inf', 'nan'
    except ValueError:
        pass

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return float(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("only numbers and + - * / ** are allowed")

    try:
        return float(ev(ast.parse(text, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError) as e:
        raise ValueError(f"cannot read {text!r} as a number ({type(e).__name__}: {e})") from None


def field_of(position: int, fmt: str) -> str:
    """'sign', 'exponent' or 'mantissa' for a bit position counted from the left (0 = sign)."""
    f = get_format(fmt)
    if not 0 <= position < f.bits:
        raise ValueError(f"{f.name} has bit positions 0..{f.bits - 1}, not {position}")
    return "sign" if position == 0 else "exponent" if position <= f.exponent_bits else "mantissa"


def flip_bit(pattern: int, position: int, fmt: str) -> int:
    """The pattern with one bit flipped; positions count from the left as the bits are
    drawn (0 is the sign bit, 1 the exponent's most significant bit, bits-1 the last mantissa bit)."""
    f = get_format(fmt)
    field_of(position, fmt)  # validates the position
    return pattern ^ (1 << (f.bits - 1 - position))


@dataclass(frozen=True)
class ExplorerState:
    """What the bit explorer shows: a number, and the pattern being edited in one format.

    Typing a number sets `value` and re-derives `pattern` (the number rounded to `edit_format`);
    flipping a bit changes `pattern`, and `value` becomes what the new pattern means, so every
    other format then shows that value rounded its own way.
    """
    value: float
    edit_format: str
    pattern: int

    @classmethod
    def start(cls, value: float = 0.1, edit_format: str = "bf16") -> "ExplorerState":
        name = get_format(edit_format).name
        return cls(float(value), name, decompose(value, name).pattern)

    def with_value(self, value: float) -> "ExplorerState":
        return ExplorerState.start(value, self.edit_format)

    def with_format(self, fmt: str) -> "ExplorerState":
        return ExplorerState.start(self.value, fmt)

    def flipped(self, position: int) -> "ExplorerState":
        pattern = flip_bit(self.pattern, position, self.edit_format)
        return replace(self, pattern=pattern, value=decode(pattern, self.edit_format).value)

    @property
    def edited(self) -> Decomposed:
        return decode(self.pattern, self.edit_format)


def explorer_rows(value: float, formats: tuple[str, ...] = EXPLORER_FORMATS) -> list[Decomposed]:
    """The number decomposed in each format (torch's rounding)."""
    return [decompose(value, f) for f in formats]


def _err(d: Decomposed, short: bool = False) -> str:
    if math.isnan(d.error):
        return "nan"
    if d.error == 0:
        return "exact"
    if math.isinf(d.error):
        return "overflow" if short else "inf (overflow)"
    return f"{d.error:+.2e}" if short else f"{d.error:+.3e} ({d.rel_error:.1e} rel)"


def _exp(d: Decomposed) -> str:
    return f"{d.exponent_field} → 2^{d.exponent}" if d.exponent is not None else f"{d.exponent_field} (special)"


_KIND_WORDS = {"normal": "a normal number", "subnormal": "a subnormal number", "zero": "zero", "inf": "inf",
               "nan": "NaN"}


def static_text(value: float, formats: tuple[str, ...] = EXPLORER_FORMATS) -> str:
    """The explorer's table as fixed-width text (what a terminal or a test sees), lines of at
    most 100 characters: the exponent column is the power of two, the error is absolute."""
    rows = explorer_rows(value, formats)
    bits_w = max(len(d.pretty_bits) for d in rows)
    value_w = max(len("stored value"), *(len(repr(d.value)) for d in rows))
    out = [f"{value!r} stored in each format (bits: sign | exponent | mantissa):",
           f"{'format':<10} {'bits':<{bits_w}}  {'kind':<9} {'exponent':<8} {'stored value':<{value_w}} error"]
    for d in rows:
        power = f"2^{d.exponent}" if d.exponent is not None else "special"
        out.append(f"{d.format:<10} {d.pretty_bits:<{bits_w}}  {d.kind:<9} {power:<8} {d.value!r:<{value_w}} "
                   f"{_err(d, short=True)}")
    return "\n".join(out)


def bits_html(d: Decomposed) -> str:
    """The bits of one value as coloured HTML spans (sign, exponent, mantissa)."""
    f = get_format(d.format)
    spans = []
    for i, b in enumerate(d.bits):
        spans.append(f'<span style="background:{COLORS[field_of(i, f.name)]};padding:0 1px">{b}</span>')
        if i in (0, f.exponent_bits):
            spans.append("&thinsp;")
    return f'<code style="font-size:1.05em">{"".join(spans)}</code>'


def static_html(value: float, formats: tuple[str, ...] = EXPLORER_FORMATS) -> str:
    """The explorer's table as HTML (what a static render of the notebook shows)."""
    head = "".join(f"<th style='text-align:left'>{h}</th>" for h in
                   ("format", "bits (sign | exponent | mantissa)", "kind", "exponent", "stored value", "error"))
    body = []
    for d in explorer_rows(value, formats):
        cells = (d.format, bits_html(d), d.kind, _exp(d), html.escape(repr(d.value)), html.escape(_err(d)))
        body.append("<tr>" + "".join(f"<td style='text-align:left'>{c}</td>" for c in cells) + "</tr>")
    return (f"<div><b>{html.escape(repr(value))}</b> stored in each format"
            f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table></div>")


class BitExplorer:
    """The live explorer. Display it (last line of a cell) or call .widget() for the ipywidget.

    Its display carries the widget, the HTML table and the text table; a frontend without a
    widget manager falls back to the table, so the output means something everywhere.
    """

    def __init__(self, value: float = 0.1, edit_format: str = "bf16", formats: tuple[str, ...] = EXPLORER_FORMATS):
        self.state = ExplorerState.start(value, edit_format)
        self.formats = formats
        self._box = None  # built on first display: importing ipywidgets is not needed for the fallbacks

    # ------------------------------------------------------------ representations
    def __repr__(self) -> str:
        return static_text(self.state.value, self.formats)

    def _repr_html_(self) -> str:
        return static_html(self.state.value, self.formats)

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        data = {"text/plain": repr(self), "text/html": self._repr_html_()}
        try:
            box = self.widget()
        except Exception:  # no ipywidgets, or no kernel to talk to: the tables are all there is
            return data
        # The same view reference ipywidgets 7 (Colab's) and 8 emit; a frontend without widget
        # support falls back to the HTML table above.
        data[WIDGET_VIEW] = {"version_major": 2, "version_minor": 0, "model_id": box.model_id}
        return data

    # ------------------------------------------------------------ the widget
    def widget(self):
        """The ipywidgets VBox (built once). Raises ImportError without ipywidgets."""
        if self._box is None:
            self._box = self._build()
        return self._box

    def _build(self):
        import ipywidgets as W

        self._number = W.Text(value=repr(self.state.value), description="number",
                              continuous_update=False, layout=W.Layout(width="320px"))
        self._message = W.HTML()
        self._table = W.HTML()
        self._fmt = W.Dropdown(options=list(self.formats), value=self.state.edit_format, description="edit bits of",
                               layout=W.Layout(width="240px"))
        self._bits = W.HBox(layout=W.Layout(flex_flow="row wrap"))
        self._meaning = W.HTML()
        self._number.observe(self._on_number, names="value")
        self._fmt.observe(self._on_format, names="value")
        self._render(rebuild_bits=True)
        return W.VBox([W.HBox([self._number, self._message]), self._table, self._fmt, self._bits, self._meaning])

    def _on_number(self, change) -> None:
        try:
            self.state = self.state.with_value(parse_number(change["new"]))
            self._message.value = ""
        except ValueError as e:
            self._message.value = f"<span style='color:#b00'>{html.escape(str(e))}</span>"
            return
        self._render()

    def _on_format(self, change) -> None:
        self.state = self.state.with_format(change["new"])
        self._render(rebuild_bits=True)

    def _on_bit(self, position: int) -> None:
        self.state = self.state.flipped(position)
        self._number.unobserve(self._on_number, names="value")  # show the value without re-rounding the pattern
        self._number.value = repr(self.state.value)
        self._number.observe(self._on_number, names="value")
        self._render()

    def _render(self, rebuild_bits: bool = False) -> None:
        import ipywidgets as W

        self._table.value = static_html(self.state.value, self.formats)
        d = self.state.edited
        if rebuild_bits:
            buttons = []
            for i in range(len(d.bits)):
                b = W.Button(layout=W.Layout(width="26px", height="30px", padding="0px", margin="1px"),
                             tooltip=f"{field_of(i, d.format)} bit {i}: click to flip")
                b.style.button_color = COLORS[field_of(i, d.format)]
                b.on_click(lambda _b, i=i: self._on_bit(i))
                buttons.append(b)
            self._bits.children = buttons
        for b, bit in zip(self._bits.children, d.bits):
            b.description = bit
        self._meaning.value = (f"<code>{d.format}</code> pattern <code>{d.pattern:#x}</code> is "
                               f"<b>{_KIND_WORDS[d.kind]}</b>: <code>{html.escape(d.formula)}</code>")


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def bit_explorer(value: float = 0.1, edit_format: str = "bf16",
                 formats: tuple[str, ...] = EXPLORER_FORMATS) -> BitExplorer:
    """Chapter 01: the bit explorer for `value`; make it the last expression of a cell to show it."""
    return BitExplorer(value, edit_format, formats)


# --------------------------------------------------------------------------- the loss-scale simulator

# overflow patterns: name -> what the one parameter means (None: no parameter)
PATTERNS = {"headroom": "c: a step overflows when the scale is above 2^c",
            "every k-th step": "k: every k-th step overflows, whatever the scale",
            "random": "p: each step overflows with probability p % (seeded)",
            "every step": None, "never": None}


@dataclass(frozen=True)
class SimulatorSettings:
    """What the loss-scale simulator runs: GradScaler's four settings and an overflow pattern."""
    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 20
    pattern: str = "headroom"
    parameter: int = 20
    steps: int = 200

    def pattern_text(self) -> str:
        p = self.parameter
        return {"headroom": f"a step overflows when the scale is above 2^{p}",
                "every k-th step": f"every {p}-th step overflows, whatever the scale",
                "random": f"each step overflows with probability {p}% (seed 0)",
                "every step": "every step overflows (the forward pass itself makes inf)",
                "never": "no step ever overflows"}[self.pattern]

    def run(self) -> Trajectory:
        p = self.parameter
        draws = random.Random(0)
        rand = [draws.random() < p / 100 for _ in range(self.steps)]
        rules = {"headroom": lambda i, s: s > 2.0 ** p, "every k-th step": lambda i, s: (i + 1) % max(1, p) == 0,
                 "random": lambda i, s: rand[i], "every step": lambda i, s: True, "never": lambda i, s: False}
        return simulate(rules[self.pattern], self.steps, init_scale=self.init_scale,
                        growth_factor=self.growth_factor, backoff_factor=self.backoff_factor,
                        growth_interval=self.growth_interval)


def simulator_text(st: SimulatorSettings, per_row: int = 50) -> str:
    """The simulator's static view as text: settings, summary, and a timeline of the steps."""
    t = st.run()
    marks = ["x" if k else "+" if e == "growth" else "." for k, e in zip(t.skipped, t.event)]
    out = [f"GradScaler(init_scale={st.init_scale:g}, growth_factor={st.growth_factor:g}, "
           f"backoff_factor={st.backoff_factor:g}, growth_interval={st.growth_interval})",
           f"pattern: {st.pattern_text()}", t.summary(),
           "timeline: . step taken   x skipped (scale backs off)   + step taken, then the scale grew"]
    out += [f"{i + 1:>6} {''.join(marks[i:i + per_row])}" for i in range(0, len(marks), per_row)]
    return "\n".join(out)


def _svg_chart(t: Trajectory, width: int = 640, height: int = 250) -> str:
    """The scale each step used on a log2 axis, skipped steps as red crosses: inline SVG, deterministic."""
    logs = [math.log2(s) if s > 0 else -150.0 for s in t.scale]
    lo, hi = math.floor(min(logs)) - 1, math.ceil(max(logs)) + 1
    left, right, top, bottom, n = 58, width - 10, 30, height - 38, len(logs)

    def px(i: float) -> float:
        return left + (right - left) * i / max(1, n)

    def py(v: float) -> float:
        return bottom - (bottom - top) * (v - lo) / (hi - lo)

    path = " ".join(f"{px(i):.1f},{py(v):.1f} {px(i + 1):.1f},{py(v):.1f}" for i, v in enumerate(logs))
    cross = '<path d="M{:.1f},{:.1f}l6,6m0,-6l-6,6" stroke="#c0392b"/>'
    crosses = "".join(cross.format(px(i + .5) - 3, py(v) - 3) for i, (v, k) in enumerate(zip(logs, t.skipped)) if k)
    yt = "".join(f'<text x="{left - 6}" y="{py(v) + 4:.1f}" text-anchor="end">2^{v}</text>'
                 f'<line x1="{left}" x2="{right}" y1="{py(v):.1f}" y2="{py(v):.1f}" stroke="#eee"/>'
                 for v in range(lo, hi + 1, max(1, math.ceil((hi - lo) / 6))))
    xstep = max(1, 10 ** math.floor(math.log10(max(1, n))) // 2)
    xt = "".join(f'<text x="{px(i):.1f}" y="{bottom + 16}" text-anchor="middle">{i}</text>'
                 for i in range(0, n + 1, xstep))
    mid = (top + bottom) / 2
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-size="11" '
            f'font-family="sans-serif">{yt}{xt}<rect x="{left}" y="{top}" width="{right - left}" '
            f'height="{bottom - top}" fill="none" stroke="#999"/><polyline points="{path}" fill="none" '
            f'stroke="#1f77b4" stroke-width="1.6"/>{crosses}<text x="{(left + right) / 2:.0f}" y="{height - 6}" '
            f'text-anchor="middle">optimizer step</text><text x="12" y="{mid:.0f}" '
            f'transform="rotate(-90 12 {mid:.0f})" text-anchor="middle">loss scale (log2 axis)</text>'
            f'<line x1="{left}" x2="{left + 20}" y1="14" y2="14" stroke="#1f77b4" stroke-width="1.6"/>'
            f'<text x="{left + 25}" y="18">scale used by the step</text>{cross.format(left + 170, 11)}'
            f'<text x="{left + 182}" y="18">skipped step ({sum(t.skipped)} of {n})</text></svg>')


def simulator_html(st: SimulatorSettings) -> str:
    """The simulator's static view as HTML: the chart, then the text view. The chart is an <img> of
    SVG: an untrusted notebook's HTML is sanitized, and inline <svg> would not survive it."""
    chart = base64.b64encode(_svg_chart(st.run()).encode()).decode()
    return (f'<div><img alt="loss scale at each step" src="data:image/svg+xml;base64,{chart}"/>'
            f"<pre>{html.escape(simulator_text(st))}</pre></div>")


class ScaleSimulator:
    """The live simulator; displayed, it carries the widget and both static views (see BitExplorer)."""

    def __init__(self, settings: SimulatorSettings):
        self.settings = settings
        self._box = None

    def __repr__(self) -> str:
        return simulator_text(self.settings)

    def _repr_html_(self) -> str:
        return simulator_html(self.settings)

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        data = {"text/plain": repr(self), "text/html": self._repr_html_()}
        try:
            box = self.widget()
        except Exception:  # no ipywidgets, or no kernel: the static views are all there is
            return data
        data[WIDGET_VIEW] = {"version_major": 2, "version_minor": 0, "model_id": box.model_id}
        return data

    def widget(self):
        """The ipywidgets VBox (built once). Raises ImportError without ipywidgets."""
        if self._box is None:
            import ipywidgets as W

            st, wide = self.settings, {"style": {"description_width": "120px"}, "layout": W.Layout(width="420px")}
            self._controls = {
                "init_scale": W.FloatLogSlider(st.init_scale, base=2, min=-20, max=40, step=1,
                                               description="init_scale", **wide),
                "growth_factor": W.FloatSlider(st.growth_factor, min=1.05, max=4, step=0.05,
                                               description="growth_factor", **wide),
                "backoff_factor": W.FloatSlider(st.backoff_factor, min=0.05, max=0.95, step=0.05,
                                                description="backoff_factor", **wide),
                "growth_interval": W.IntSlider(st.growth_interval, min=1, max=500, description="growth_interval",
                                               **wide),
                "pattern": W.Dropdown(options=list(PATTERNS), value=st.pattern, description="overflows", **wide),
                "parameter": W.IntSlider(st.parameter, min=0, max=200, description="c", **wide),
                "steps": W.IntSlider(st.steps, min=20, max=2000, step=10, description="steps", **wide)}
            self._help, self._view = W.HTML(), W.HTML()
            for c in self._controls.values():
                c.observe(self._on_change, names="value")
            self._render()
            self._box = W.VBox([*self._controls.values(), self._help, self._view])
        return self._box

    def _on_change(self, change) -> None:
        self.settings = SimulatorSettings(**{k: c.value for k, c in self._controls.items()})
        self._render()

    def _render(self) -> None:
        meaning = PATTERNS[self.settings.pattern]
        self._controls["parameter"].description = meaning.split(":")[0] if meaning else "(unused)"
        self._help.value = f"<i>{html.escape(meaning or 'this pattern has no parameter')}</i>"
        self._view.value = simulator_html(self.settings)


def scale_simulator(init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                    growth_interval: int = 20, pattern: str = "headroom", parameter: int = 20,
                    steps: int = 200) -> ScaleSimulator:
    """Chapter 03: the loss-scale simulator; make it the last expression of a cell to show it."""
    if pattern not in PATTERNS:
        raise ValueError(f"pattern must be one of {list(PATTERNS)}, not {pattern!r}")
    return ScaleSimulator(SimulatorSettings(float(init_scale), growth_factor, backoff_factor, growth_interval,
                                            pattern, parameter, steps))
