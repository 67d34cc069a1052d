"""course_lib.chapters.ch01.widgets: the bit explorer's pure logic, its static fallbacks, the live widget."""

import copy
import math
import sys
from pathlib import Path

import nbformat
import pytest

from course_lib.chapters.ch01 import widgets as W
from course_lib.chapters.ch01.formats import decompose
from course_lib.tooling.nbtools import without_widget_views


@pytest.mark.parametrize(
    "text, want",
    [
        ("0.1", 0.1),
        (" 1e-8 ", 1e-8),
        ("2**-24", 2.0**-24),
        ("2^-24", 2.0**-24),
        ("-inf", -math.inf),
        ("65504 + 16", 65520.0),
        ("-(1/3)", -1 / 3),
    ],
)
def test_parse_number_reads_numbers_and_simple_arithmetic(text, want):
    assert W.parse_number(text) == want


def test_parse_number_reads_nan():
    assert math.isnan(W.parse_number("nan"))


@pytest.mark.parametrize("text", ["abc", "__import__('os').getcwd()", "1/0", "(1).real", "2**", "True + 1", ""])
def test_parse_number_refuses_anything_but_arithmetic(text):
    with pytest.raises(ValueError):
        W.parse_number(text)


def test_bit_positions_count_from_the_sign_bit():
    fields = [W.field_of(i, "fp16") for i in range(16)]
    assert fields == ["sign"] + ["exponent"] * 5 + ["mantissa"] * 10
    assert W.field_of(8, "bf16") == "exponent" and W.field_of(9, "bf16") == "mantissa"
    with pytest.raises(ValueError):
        W.field_of(16, "fp16")


@pytest.mark.parametrize(
    "fmt, pattern, position, want",
    [
        ("fp16", 0x3C00, 0, 0xBC00),  # sign: 1.0 -> -1.0
        ("fp16", 0x3C00, 15, 0x3C01),  # last mantissa bit: 1 + 2^-10
        ("fp16", 0x3C00, 1, 0x7C00),  # top exponent bit of 1.0: 01111 -> 11111, inf
        ("bf16", 0x3F80, 1, 0x7F80),  # the same in bf16
        ("fp8_e4m3fn", 0x7E, 7, 0x7F),  # 448 -> the NaN pattern
    ],
)
def test_flip_bit_flips_the_drawn_bit(fmt, pattern, position, want):
    assert W.flip_bit(pattern, position, fmt) == want
    assert W.flip_bit(want, position, fmt) == pattern  # flipping twice is the identity


def test_explorer_state_follows_typed_numbers_flipped_bits_and_format_changes():
    s = W.ExplorerState.start(0.1, "bf16")
    assert s.pattern == 0x3DCD and s.edited.value == 0.10009765625
    s = s.flipped(0)  # the sign bit
    assert s.value == -0.10009765625 and s.pattern == 0xBDCD
    s = s.with_format("fp16")  # the value is re-rounded in the new format
    assert s.pattern == decompose(-0.10009765625, "fp16").pattern and s.edit_format == "fp16"
    s = s.with_value(65520.0)
    assert s.edited.kind == "inf"
    s = W.ExplorerState.start(1.0, "fp16").flipped(15)
    assert s.value == 1 + 2.0**-10


def test_static_text_shows_every_format_with_bits_values_and_errors():
    text = W.static_text(65520.0)
    lines = text.splitlines()
    assert len(lines) == 2 + len(W.EXPLORER_FORMATS)
    fp16 = next(line for line in lines if line.startswith("fp16"))
    assert "0 11111 0000000000" in fp16 and "inf" in fp16 and "overflow" in fp16
    bf16 = next(line for line in lines if line.startswith("bf16"))
    assert "65536.0" in bf16 and "+1.60e+01" in bf16
    assert "exact" in next(line for line in lines if line.startswith("fp32"))
    assert W.static_text(65520.0) == text  # deterministic: the notebook test compares it


@pytest.mark.parametrize("value", [65519.99999, 65519.99, 2.0**-25 * (1 + 2.0**-40), 464.00001, 1e-8, 1e5])
def test_the_explorer_shows_what_fate_says_and_torch_stores(value):
    # 65519.99999 is inf in fp16 for torch (float64 -> float32 65520.0 -> tie -> inf): the explorer showed
    # inf while fate() said it rounds to 65504. Each row's kind must be the one fate() names.
    from course_lib.chapters.ch01.format_limits import fate

    words = {
        "overflow": {"inf", "nan", "normal"},
        "underflow": {"zero"},
        "subnormal": {"subnormal"},
        "normal": {"normal"},
    }
    for d in W.explorer_rows(value):
        kind = fate(value, d.format)
        assert d.kind in words[kind], (d.format, d.kind, kind)
        if kind == "overflow" and d.format != "fp8_e4m3fn":  # e4m3fn saturates (normal 448) or gives NaN
            assert d.kind == "inf"
    fp16 = next(line for line in W.static_text(value).splitlines() if line.startswith("fp16"))
    assert ("inf" in fp16) == (fate(value, "fp16") == "overflow")


@pytest.mark.parametrize("x", [math.inf, -math.inf])
def test_e4m3fn_row_for_inf_says_what_this_torch_stores(x):
    # e4m3fn has no inf: its row read "448.0 / inf (overflow)", an inf that is not there.
    import torch

    stored = torch.tensor([x]).to(torch.float8_e4m3fn).float().item()  # 448 with x's sign, or NaN (older torch)
    row = next(line for line in W.static_text(x).splitlines() if line.startswith("fp8_e4m3fn"))
    table = W.static_html(x)
    assert "inf (overflow)" not in table and not row.endswith("overflow")
    if math.isnan(stored):
        assert row.split()[-2:] == ["nan", "nan"]
    else:
        assert row.split()[-2:] == [repr(stored), "saturated"]
        assert f"saturated: {x!r} stored as {stored!r} (fp8_e4m3fn has no inf)" in table
    fp16 = next(line for line in W.static_text(x).splitlines() if line.startswith("fp16"))
    assert fp16.split()[-2:] == [repr(x), "exact"]  # a format with inf keeps it


@pytest.mark.parametrize("value", [0.1, 65520.0, 1e-8, -5.960464477539063e-08, 1e-40, -3e-42, math.nan, -math.inf])
def test_static_text_lines_fit_100_characters_and_header_matches_the_columns(value):
    lines = W.static_text(value).splitlines()
    assert max(map(len, lines)) <= 100
    header, first = lines[1], lines[2]
    for name in ("bits", "kind", "exponent", "stored value", "error"):
        col = header.index(name)
        assert first[col - 1] == " " and first[col] != " ", (name, header, first)  # a column starts there


def test_static_html_colours_every_bit_and_escapes_values():
    html = W.static_html(0.1)
    assert html.count("<tr>") == 1 + len(W.EXPLORER_FORMATS)
    assert html.count(W.COLORS["sign"]) == len(W.EXPLORER_FORMATS)
    assert html.count(W.COLORS["exponent"]) == 8 + 8 + 5 + 4 + 5
    assert html.count(W.COLORS["mantissa"]) == 23 + 7 + 10 + 3 + 2
    assert "<script" not in html


def test_explorer_display_carries_the_widget_and_both_static_tables():
    e = W.bit_explorer(0.1)
    bundle = e._repr_mimebundle_()
    assert bundle["text/plain"] == W.static_text(0.1) == repr(e)
    assert bundle["text/html"] == W.static_html(0.1) == e._repr_html_()
    assert "model_id" in bundle[W.WIDGET_VIEW]


def test_explorer_falls_back_to_the_tables_without_ipywidgets(monkeypatch):
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # makes `import ipywidgets` raise ImportError
    bundle = W.bit_explorer(1e-8)._repr_mimebundle_()
    assert set(bundle) == {"text/plain", "text/html"}
    assert "0 00000 0000000000" in bundle["text/plain"]  # 1e-8 underflows fp16


def test_live_widget_clicks_typing_and_format_changes_update_the_view():
    e = W.bit_explorer(1.0, edit_format="fp16")
    box = e.widget()
    number, table, fmt, bits, meaning = (
        box.children[0].children[0],
        box.children[1],
        box.children[2],
        box.children[3],
        box.children[4],
    )
    assert [b.description for b in bits.children] == list("0011110000000000")
    bits.children[0].click()  # the sign bit
    assert number.value == "-1.0" and e.state.value == -1.0 and "-1.0" in table.value
    assert bits.children[0].description == "1" and "normal" in meaning.value
    number.value = "2**-24"
    assert e.state.pattern == 0x0001 and "a subnormal number" in meaning.value
    number.value = "inf"
    assert "is <b>inf</b>" in meaning.value and " is a " not in meaning.value
    number.value = "2**-24"
    number.value = "not a number"
    assert "cannot read" in box.children[0].children[1].value and e.state.pattern == 0x0001  # unchanged
    fmt.value = "fp32"
    assert len(bits.children) == 32 and e.state.edit_format == "fp32"
    assert e.widget() is box  # built once


ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(p for d in ("notebooks", "solutions", "exercises") for p in (ROOT / d).glob("*.ipynb"))


def _saved_models(nb) -> dict:
    return nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_stored_output_holds_a_widget_view_whose_model_is_gone(path):
    """Opened before running, JupyterLab would pick the view and show 'model not found'."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            view = out.get("data", {}).get(W.WIDGET_VIEW)
            why = f"cell {cell.get('id')} stores a widget view without its model: run nbtools strip"
            assert view is None or view["model_id"] in _saved_models(nb), why


def test_the_explorer_cell_stores_both_static_tables():
    nb = nbformat.read(ROOT / "notebooks" / "01_formats.ipynb", as_version=4)
    cells = [c for c in nb.cells if c.cell_type == "code" and "bit_explorer(" in c.source]
    assert cells, "chapter 01 shows the bit explorer"
    for cell in cells:
        assert "nbval-check-output" in cell.metadata.get("tags", [])
        (out,) = [o for o in cell.outputs if "data" in o]
        assert set(out["data"]) == {"text/plain", "text/html"}
        assert out["data"]["text/plain"] == W.static_text(0.1) and out["data"]["text/html"] == W.static_html(0.1)


def test_without_widget_views_drops_only_views_whose_model_is_not_saved():
    bundle = W.bit_explorer(0.1)._repr_mimebundle_()
    nb = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(outputs=[nbformat.v4.new_output("display_data", data=copy.deepcopy(bundle))])]
    )
    kept = copy.deepcopy(nb)
    kept.metadata["widgets"] = {
        "application/vnd.jupyter.widget-state+json": {"state": {bundle[W.WIDGET_VIEW]["model_id"]: {}}}
    }
    assert without_widget_views(nb) is True and without_widget_views(nb) is False
    assert set(nb.cells[0].outputs[0]["data"]) == {"text/plain", "text/html"}
    assert without_widget_views(kept) is False and W.WIDGET_VIEW in kept.cells[0].outputs[0]["data"]


def test_every_explorer_is_displayed_one_way_and_names_the_view_as_the_git_filter_does():
    from course_lib.chapters.ch03.loss_scale_simulator import ScaleSimulator
    from course_lib.chapters.ch10.explorer import MemoryExplorer
    from course_lib.tooling import notebook_filter

    assert all(issubclass(c, W.Explorer) for c in (W.BitExplorer, ScaleSimulator, MemoryExplorer))
    assert W.WIDGET_VIEW == notebook_filter.WIDGET_VIEW  # the filter runs as a script, outside the package
