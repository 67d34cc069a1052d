"""course_lib.chapters.ch09.speedup: the exercise's slow script learns the same model however it is computed."""

import pytest

from course_lib.chapters.ch09.speedup import RECIPE, SLOW, format_result, format_speedup, run_script, validate_settings

TINY = {"train_size": 96, "test_size": 40, "epochs": 2, "eval_every": 2, "detect_anomaly": False}


def test_every_way_of_computing_gives_the_same_model():
    runs = [
        run_script({**TINY, **change})
        for change in (
            {"num_workers": 0},  # per-sample transform, no workers
            {"data": "tensors", "num_workers": 2, "persistent_workers": True},
            {"data": "device", "num_workers": 0, "eval_every": None, "log_every": 3, "optimizer": "foreach"},
            {"num_workers": 0, "detect_anomaly": True, "optimizer": "fused"},
        )
    ]
    assert len({r["accuracy"] for r in runs}) == 1  # the same batches in the same order
    assert all(r["samples"] == 192 and r["steps"] == 6 for r in runs)
    assert [r["evaluations"] for r in runs] == [4, 4, 1, 4] and runs[2]["losses_read"] == 2
    assert all(len(format_result("a label that is far too long", r)) <= 100 for r in runs)


def test_max_steps_trains_on_fewer_samples():
    r = run_script({**TINY, "num_workers": 0, "max_steps": 2})
    assert r["steps"] == 2 and r["samples"] == 64


@pytest.mark.parametrize(
    "settings, message",
    [
        ([], "must be a dict"),
        ({"workers": 2}, "unknown settings ['workers']"),
        ({"data": "disk"}, "data='disk'"),
        ({"persistent_workers": 1}, "persistent_workers=1"),
        ({"eval_every": 0}, "eval_every=0: expected an int from 1"),
        ({"lr": 1}, "lr=1: expected a float"),
        ({"data": "device", "num_workers": 2, "persistent_workers": True}, "needs a DataLoader"),
    ],
)
def test_settings_are_validated(settings, message):
    with pytest.raises(ValueError) as e:
        validate_settings(settings)
    assert message in str(e.value)


def test_the_recipe_is_part_of_the_settings():
    assert set(RECIPE) < set(SLOW) and validate_settings({}) == SLOW


def test_a_ratio_below_one_reads_as_slower():
    """Exercise 09 printed "0.99x faster" for a change that made the script slower."""
    assert format_speedup(2.345) == "2.35x faster" and format_speedup(1.0) == "1.00x faster"
    assert format_speedup(0.99) == "1.01x slower" and format_speedup(0.5) == "2.00x slower"
