"""The course's performance targets (COURSE_SPEC section 8), computed from the ladders' rows.

Chapter 09 records the ladders on a GPU (`python -m course_lib.chapters.ch09.ladder ...`); `targets`
turns their rows into ratios measured in one run, each beside its target and a stretch goal, and
`format_targets` prints them. Nothing here is typed in: a goal nobody measured is "n/a".
"""

from __future__ import annotations

from course_lib.tables import table

__all__ = ["TARGETS", "targets", "format_targets"]

# What the course's own loop must reach on an H100/H200, as ratios measured in one run:
# (target, stretch goal or None). Targets: NVIDIA's single-A100 ResNet-50 AMP figure, nanoGPT's MFU;
# stretch: 3,200 images/s, 0.60x memory, and llm.c's 40% MFU.
TARGETS = {
    "resnet50_img_s": (2470.0, 3200.0),
    "amp_vs_strict_fp32": (3.0, None),
    "amp_vs_tf32": (1.8, None),
    "amp_memory_vs_fp32": (0.65, 0.60),
    "gpt_mfu": (0.33, 0.40),
    "data_wait": (0.05, None),
}


def _amp_precision(rows: list[dict]) -> str:
    """The AMP rows' 16-bit type: bf16 where those rows were timed (Ampere and newer), else fp16."""
    timed = [r["mode"] for r in rows if r["mode"].startswith("AMP") and "ms_per_step" in r]
    return "fp16" if timed and not any("bf16" in mode for mode in timed) else "bf16"


def targets(
    resnet_rows: list[dict], gpt_rows: list[dict] | None = None, course_rows: list[dict] | None = None
) -> list[dict]:
    """Chapter 09: the course's performance targets computed from ladder rows: value, target, stretch, met.

    The ResNet-50 goals read the rung the target names, in the device's mixed precision (bf16 where
    it was timed, else fp16) and compare like with like: a speed ratio puts AMP and its baseline in
    the same memory layout (channels_last where both have it, else NCHW: channels_last alone speeds
    up TF32 too), and memory compares the same batch in NCHW. MFU is the GPT's full recipe (its last
    rung) against the one peak its rows name; the data wait is the least share of step time the
    course's model spent in next() on a DataLoader-fed rung."""
    amp_name = _amp_precision(resnet_rows)

    def row(prefix: str, channels_last: bool) -> dict | None:
        return next(
            (
                r
                for r in resnet_rows
                if r["mode"].startswith(prefix) and "ms_per_step" in r and bool(r.get("channels_last")) == channels_last
            ),
            None,
        )

    def ratio(a: dict | None, b: dict | None, key: str) -> float | None:
        return a[key] / b[key] if a and b and a.get(key) and b.get(key) else None

    def same_layout(base: str) -> tuple[float | None, str]:
        for cl in (True, False):  # channels_last first: the layout both run fastest in
            value = ratio(row(f"AMP {amp_name}", cl), row(base, cl), "samples_per_s")
            if value is not None:
                return value, "channels_last" if cl else "NCHW"
        return None, "same layout"

    amp_cl = row(f"AMP {amp_name}", True)
    vs_fp32, layout_fp32 = same_layout("FP32")
    vs_tf32, layout_tf32 = same_layout("TF32")
    timed_gpt = [r for r in gpt_rows or [] if "ms_per_step" in r]
    full_recipe_mfu = timed_gpt[-1].get("mfu") if timed_gpt else None
    fed = [r["data_wait"] for r in course_rows or [] if r.get("feed") in ("loader", "workers") and "data_wait" in r]
    out = [
        (
            f"ResNet-50 AMP {amp_name} + channels_last, images/s",
            amp_cl and amp_cl["samples_per_s"],
            "resnet50_img_s",
            ">=",
        ),
        (f"ResNet-50 AMP {amp_name} / strict FP32, {layout_fp32}", vs_fp32, "amp_vs_strict_fp32", ">="),
        (f"ResNet-50 AMP {amp_name} / TF32, {layout_tf32}", vs_tf32, "amp_vs_tf32", ">="),
        (
            f"ResNet-50 peak memory, AMP {amp_name} / FP32, NCHW",
            ratio(row(f"AMP {amp_name}", False), row("FP32", False), "peak_memory_gib"),
            "amp_memory_vs_fp32",
            "<=",
        ),
        ("GPT MFU, full recipe, against one named peak", full_recipe_mfu, "gpt_mfu", ">="),
        ("data wait, course model, best-fed DataLoader rung", min(fed, default=None), "data_wait", "<="),
    ]

    def meets(value: float | None, goal: float | None, sense: str) -> bool | None:
        if value is None or goal is None:
            return None  # nothing measured it, or no goal set
        return value >= goal if sense == ">=" else value <= goal

    return [
        {
            "goal": goal,
            "value": value,
            "target": TARGETS[key][0],
            "stretch": TARGETS[key][1],
            "sense": sense,
            "met": meets(value, TARGETS[key][0], sense),
            "stretch_met": meets(value, TARGETS[key][1], sense),
        }
        for goal, value, key, sense in out
    ]


def format_targets(rows: list[dict]) -> str:
    """Chapter 09: targets() as an aligned table within 100 columns; 'n/a' where nothing measured the goal."""

    def num(v: float) -> str:  # images/s as a whole number, ratios and MFU with two decimals
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.2f}"

    def word(met: bool | None) -> str:
        if met is None:
            return "n/a"
        return "yes" if met else "NO"

    def stretch(r: dict) -> str:
        return "-" if r.get("stretch") is None else f"{r['sense']} {num(r['stretch'])}"

    def stretch_met(r: dict) -> str:
        return "-" if r.get("stretch") is None else word(r.get("stretch_met"))

    columns = [
        ("goal", lambda r: r["goal"][:53], ""),
        ("value", lambda r: None if r["value"] is None else num(r["value"]), ""),
        ("target", lambda r: f"{r['sense']} {num(r['target'])}", ""),
        ("met", lambda r: word(r["met"]), ""),
        ("stretch", stretch, ""),
        ("met", stretch_met, ""),
    ]
    return table(rows, columns)
