"""README.md: the performance table is the recorded reference results, not numbers typed in."""
import re
from pathlib import Path

from course_lib.chapters.targets import targets
from course_lib.reference import load_references

ROOT = Path(__file__).resolve().parents[1]


def _cell(value: float) -> str:  # as format_targets writes it
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"


def test_the_readmes_performance_table_is_recomputed_from_the_recorded_files():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Performance targets"):text.index("## Hardware notes")]
    files = {kind: load_references(f"{kind}_h100-80gb-hbm3.json") for kind in ("bench", "ladder_gpt", "ladder_course")}
    assert all(len(refs) == 1 for refs in files.values()), "the files the README names are in data/reference/"
    assert all(f"{kind}_h100-80gb-hbm3.json" in section for kind in files)
    prov = files["bench"][0]["provenance"]
    assert prov["device"] in section and prov["torch"] in section and prov["date"] in section
    rows = targets(files["bench"][0]["rows"], files["ladder_gpt"][0]["gpt"], files["ladder_course"][0]["course"])
    table = {m.group(1).strip(): [c.strip() for c in m.group(2).split("|")]
             for m in re.finditer(r"^\| ([^|]+) \|(.*)\|$", section, flags=re.M)}
    for r in rows:
        target, stretch, measured, met, stretch_met = table[r["goal"]]
        assert measured == _cell(r["value"]), r["goal"]
        assert met == ("yes" if r["met"] else "NO"), r["goal"]
        word = "-" if r["stretch"] is None else ("yes" if r["stretch_met"] else "NO")
        assert stretch_met == word, r["goal"]
        assert target.endswith(_cell(r["target"])) and target[0] == {">=": "≥", "<=": "≤"}[r["sense"]], r["goal"]
