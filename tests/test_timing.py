"""course_lib.timing: warm-up + median timing with its spread, and peak memory."""

import pytest

from course_lib import timing


def test_time_fn_runs_warmup_plus_iters_and_reports_median():
    calls = []
    t = timing.time_fn(lambda: calls.append(1), warmup=2, iters=5, device="cpu")
    assert len(calls) == 7 and len(t.times_ms) == 5 and t.median_ms >= 0


def test_timing_reports_the_median_and_the_middle_half_not_the_outlier():
    t = timing.Timing([10.0, 11.0, 10.5, 10.2, 95.0])
    assert t.median_ms == 10.5
    lo, hi = t.quartiles_ms
    assert 10.0 <= lo <= 10.5 <= hi <= 11.0  # the 95 ms outlier moves neither
    assert t.rel_spread == pytest.approx((hi - lo) / 10.5)
    assert "median 10.500 ms" in str(t) and "n=5" in str(t)


def test_compare_names_the_faster_by_its_factor_and_admits_when_the_spread_hides_it():
    base = timing.Timing([10.0, 10.5, 11.0, 11.5, 12.0])
    text = timing.compare(
        {
            "fp32": base,
            "fast": timing.Timing([4.0, 4.5, 5.0, 5.5, 6.0]),
            "same": timing.Timing([10.2, 10.8, 11.2, 11.6, 12.4]),
        },
        "fp32",
    )
    fast, same = text.split("\nsame")
    assert "2.20x faster" in fast and "larger than the spread" in fast
    assert "slower" in same and "cannot tell them apart" in same
    assert all(len(line) <= 100 for line in text.splitlines())


def test_peak_memory_is_none_off_cuda_but_the_function_still_runs():
    calls = []
    assert timing.peak_memory_bytes(lambda: calls.append(1), "cpu") is None and calls == [1]
