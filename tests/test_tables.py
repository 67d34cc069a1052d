"""course_lib.tables.table: rows of dicts or dataclasses as aligned text, the course's one table printer."""

from dataclasses import dataclass

from course_lib.tables import table

ROWS = [
    {"mode": "FP32 (strict)", "ms": 12.345, "gib": None},
    {"mode": "AMP bf16", "ms": 8.1, "gib": 1.234},
]
COLUMNS = [("mode", "mode", ""), ("ms/step", "ms", ".1f"), ("peak GiB", "gib", ".2f")]


def test_columns_are_as_wide_as_their_widest_cell_first_left_others_right():
    lines = table(ROWS, COLUMNS).splitlines()
    assert lines == [
        "mode           ms/step  peak GiB",
        "FP32 (strict)     12.3       n/a",
        "AMP bf16           8.1      1.23",
    ]


def test_a_function_column_a_dataclass_row_and_a_left_aligned_text_column():
    @dataclass
    class Run:
        label: str
        seconds: float

    runs = [Run("a", 1.5), Run("longer label", 12.25)]
    columns = [("run", "label", ""), ("ms", lambda r: 1000 * r.seconds, ",.0f"), ("note", lambda r: "ok", "<")]
    text = table(runs, columns)
    assert text.splitlines() == ["run               ms  note", "a              1,500  ok", "longer label  12,250  ok"]


def test_a_skipped_row_shows_its_first_cell_and_why_across_the_other_columns():
    rows = [*ROWS, {"mode": "TF32", "note": "needs sm_80+"}]
    text = table(rows, COLUMNS, skipped=lambda r: None if "ms" in r else f"skipped: {r['note']}")
    assert text.splitlines()[-1] == "TF32           skipped: needs sm_80+"


def test_missing_values_print_what_the_caller_asks_and_no_line_ends_in_spaces():
    text = table([{"a": "x", "b": None}], [("a", "a", ""), ("b", "b", ".1f"), ("", lambda r: "", "<")], missing="-")
    assert text.splitlines() == ["a  b", "x  -"]
