"""README.md: the performance table is the recorded reference results, not numbers typed in."""

import re
from pathlib import Path

from course_lib.chapters.ch09.targets import targets
from course_lib.reference import load_references

ROOT = Path(__file__).resolve().parents[1]


def _cell(value: float) -> str:  # as format_targets writes it
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"


def test_the_readmes_performance_table_is_recomputed_from_the_recorded_files():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Performance targets") : text.index("## Hardware notes")]
    kinds = ("ladder_resnet50", "ladder_gpt", "ladder_course")
    files = {kind: load_references(f"{kind}_h100-80gb-hbm3.json") for kind in kinds}
    assert all(len(refs) == 1 for refs in files.values()), "the files the README names are in data/reference/"
    assert all(f"{kind}_h100-80gb-hbm3.json" in section for kind in files)
    prov = files["ladder_resnet50"][0]["provenance"]
    assert prov["device"] in section and prov["torch"] in section and prov["date"] in section
    rows = targets(
        files["ladder_resnet50"][0]["resnet50"], files["ladder_gpt"][0]["gpt"], files["ladder_course"][0]["course"]
    )
    table = {
        m.group(1).strip(): [c.strip() for c in m.group(2).split("|")]
        for m in re.finditer(r"^\| ([^|]+) \|(.*)\|$", section, flags=re.M)
    }
    for r in rows:
        target, stretch, measured, met, stretch_met = table[r["goal"]]
        assert measured == _cell(r["value"]), r["goal"]
        assert met == ("yes" if r["met"] else "NO"), r["goal"]
        word = "-" if r["stretch"] is None else ("yes" if r["stretch_met"] else "NO")
        assert stretch_met == word, r["goal"]
        assert target.endswith(_cell(r["target"])) and target[0] == {">=": "≥", "<=": "≤"}[r["sense"]], r["goal"]


def test_the_readmes_readings_of_the_targets_are_the_recorded_numbers():
    text = " ".join((ROOT / "README.md").read_text().split())
    section = text[text.index("## Performance targets") : text.index("## Hardware notes")]
    rows = {r["mode"]: r for r in load_references("ladder_resnet50_h100-80gb-hbm3.json")[0]["resnet50"]}
    fp16_vs_tf32 = rows["AMP fp16 + channels_last"]["samples_per_s"] / rows["TF32 + channels_last"]["samples_per_s"]
    bf16_vs_tf32 = rows["AMP bf16 + channels_last"]["samples_per_s"] / rows["TF32 + channels_last"]["samples_per_s"]
    assert f"(channels_last: {bf16_vs_tf32:.2f}×)" in section and f"reaches {fp16_vs_tf32:.2f}× TF32" in section
    questions = load_references("questions_h100-80gb-hbm3.json")[0]
    bn = {p: questions["resnet50"][p]["kernels"]["by_class_us"]["batch_norm"] / 1e3 for p in ("bf16", "fp16")}
    assert f"{bn['bf16']:.1f} against {bn['fp16']:.1f} ms of batch-norm kernels" in section
    b32 = next(r for r in questions["gpt"]["rows"] if r.get("batch") == 32)
    assert f"reaches {b32['mfu']:.1%}" in section and f"about {b32['gemm_tflops']:.0f} TFLOP/s" in section
    fused = b32["kernels"]["by_class_us"]["triton (fused)"] / (b32["ms_per_step"] * 1e3)
    assert 0.28 < fused < 0.38 and "about a third of each step goes to memory-bound fused kernels" in section
