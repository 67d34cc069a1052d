"""Interactive explorers for the notebooks, each with a static fallback.

Chapter 01 introduces the bit explorer: type a number and see how fp32, bf16, fp16 and the
two fp8 formats store it; click the bits of one format and see the value they mean.
Chapter 03's loss-scale simulator (course_lib.chapters.ch03.loss_scale_simulator) and chapter 10's
memory explorer (course_lib.chapters.ch10.explorer) are displayed the same way (`Explorer`).

    bit_explorer(0.1)        # the last expression of a cell: the widget, or its static table

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
import html
import math
import operator
from dataclasses import dataclass, replace

from course_lib.chapters.ch01.formats import Decomposed, decode, decompose, get_format

__all__ = ["bit_explorer"]

EXPLORER_FORMATS = ("fp32", "bf16", "fp16", "fp8_e4m3fn", "fp8_e5m2")
# Field colours: sign, exponent, mantissa (the colours of the chapter's bit-layout figure).
COLORS = {"sign": "#f4cccc", "exponent": "#cfe2f3", "mantissa": "#d9ead3"}

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


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
    if position == 0:
        return "sign"
    if position <= f.exponent_bits:
        return "exponent"
    return "mantissa"


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
    if math.isinf(d.input) and math.isfinite(d.value):  # a format without inf (e4m3fn): what torch stored
        return "saturated" if short else f"saturated: {d.input!r} stored as {d.value!r} ({d.format} has no inf)"
    if math.isinf(d.error):
        return "overflow" if short else "inf (overflow)"
    return f"{d.error:+.2e}" if short else f"{d.error:+.3e} ({d.rel_error:.1e} rel)"


def _exp(d: Decomposed) -> str:
    return f"{d.exponent_field} → 2^{d.exponent}" if d.exponent is not None else f"{d.exponent_field} (special)"


_KIND_WORDS = {
    "normal": "a normal number",
    "subnormal": "a subnormal number",
    "zero": "zero",
    "inf": "inf",
    "nan": "NaN",
}


def static_text(value: float, formats: tuple[str, ...] = EXPLORER_FORMATS) -> str:
    """The explorer's table as fixed-width text (what a terminal or a test sees), lines of at
    most 100 characters: the exponent column is the power of two, the error is absolute."""
    rows = explorer_rows(value, formats)
    bits_w = max(len(d.pretty_bits) for d in rows)
    value_w = max(len("stored value"), *(len(repr(d.value)) for d in rows))
    out = [
        f"{value!r} stored in each format (bits: sign | exponent | mantissa):",
        f"{'format':<10} {'bits':<{bits_w}}  {'kind':<9} {'exponent':<8} {'stored value':<{value_w}} error",
    ]
    for d in rows:
        power = f"2^{d.exponent}" if d.exponent is not None else "special"
        out.append(
            f"{d.format:<10} {d.pretty_bits:<{bits_w}}  {d.kind:<9} {power:<8} {d.value!r:<{value_w}} "
            f"{_err(d, short=True)}"
        )
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
    head = "".join(
        f"<th style='text-align:left'>{h}</th>"
        for h in ("format", "bits (sign | exponent | mantissa)", "kind", "exponent", "stored value", "error")
    )
    body = []
    for d in explorer_rows(value, formats):
        cells = (d.format, bits_html(d), d.kind, _exp(d), html.escape(repr(d.value)), html.escape(_err(d)))
        body.append("<tr>" + "".join(f"<td style='text-align:left'>{c}</td>" for c in cells) + "</tr>")
    return (
        f"<div><b>{html.escape(repr(value))}</b> stored in each format"
        f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table></div>"
    )


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"  # the MIME type of a live widget's view


class Explorer:
    """What every explorer of the course is on display: the live widget, and static views of its state.

    The frontend picks the richest representation it can show: the widget where a kernel is behind
    it, else the static views (`static_views`: text and HTML by default, or a picture), so the output
    means something everywhere. A subclass gives `build_widget()` (the ipywidgets box, built on first
    use) and its static views. Chapter 01's bit explorer, chapter 03's loss-scale simulator
    (course_lib.chapters.ch03.loss_scale_simulator) and chapter 10's memory explorer
    (course_lib.chapters.ch10.explorer) are displayed this way.
    """

    _box = None  # built on first display: the static views need no ipywidgets

    def static_views(self) -> dict:
        """The representations a frontend without widgets shows: the text and HTML views."""
        return {"text/plain": repr(self), "text/html": self._repr_html_()}

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        data = self.static_views()
        try:
            box = self.widget()
        except Exception:  # no ipywidgets, or no kernel to talk to: the static views are all there is
            return data
        # The same view reference ipywidgets 7 (Colab's) and 8 emit; a frontend without widget
        # support falls back to the static views above.
        data[WIDGET_VIEW] = {"version_major": 2, "version_minor": 0, "model_id": box.model_id}
        return data

    def widget(self):
        """The ipywidgets box (built once). Raises ImportError without ipywidgets."""
        if self._box is None:
            self._box = self.build_widget()
        return self._box

    def build_widget(self):
        """The ipywidgets box, which each explorer builds its own way."""
        raise NotImplementedError


class BitExplorer(Explorer):
    """The live explorer. Display it (last line of a cell) or call .widget() for the ipywidget; its
    static views are the HTML table and the text table."""

    def __init__(self, value: float = 0.1, edit_format: str = "bf16", formats: tuple[str, ...] = EXPLORER_FORMATS):
        self.state = ExplorerState.start(value, edit_format)
        self.formats = formats

    # ------------------------------------------------------------ representations
    def __repr__(self) -> str:
        return static_text(self.state.value, self.formats)

    def _repr_html_(self) -> str:
        return static_html(self.state.value, self.formats)

    # ------------------------------------------------------------ the widget
    def build_widget(self):
        import ipywidgets as W

        self._number = W.Text(
            value=repr(self.state.value), description="number", continuous_update=False, layout=W.Layout(width="320px")
        )
        self._message = W.HTML()
        self._table = W.HTML()
        self._fmt = W.Dropdown(
            options=list(self.formats),
            value=self.state.edit_format,
            description="edit bits of",
            layout=W.Layout(width="240px"),
        )
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
                b = W.Button(
                    layout=W.Layout(width="26px", height="30px", padding="0px", margin="1px"),
                    tooltip=f"{field_of(i, d.format)} bit {i}: click to flip",
                )
                b.style.button_color = COLORS[field_of(i, d.format)]
                b.on_click(lambda _b, i=i: self._on_bit(i))
                buttons.append(b)
            self._bits.children = buttons
        for b, bit in zip(self._bits.children, d.bits):
            b.description = bit
        self._meaning.value = (
            f"<code>{d.format}</code> pattern <code>{d.pattern:#x}</code> is "
            f"<b>{_KIND_WORDS[d.kind]}</b>: <code>{html.escape(d.formula)}</code>"
        )


def bit_explorer(
    value: float = 0.1, edit_format: str = "bf16", formats: tuple[str, ...] = EXPLORER_FORMATS
) -> BitExplorer:
    """Chapter 01: the bit explorer for `value`; make it the last expression of a cell to show it."""
    return BitExplorer(value, edit_format, formats)
