"""course_lib.chapters.ch07 (loading, data_wait): the pipeline, the wait measured, seeding, on-device loading, CLI."""

from __future__ import annotations

import json
import time

import matplotlib
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from course_lib.chapters.ch07 import data_wait as W
from course_lib.chapters.ch07 import loading as L
from course_lib.data import DATA_DIR, load_dataset
from course_lib.device import torch_at_least

matplotlib.use("Agg")


@pytest.fixture(scope="module")
def raw():
    return L.raw_images(load_dataset(train_size=400, verbose=False))


def test_raw_images_gives_back_the_stored_bytes_exactly():
    images, labels = L.raw_images(load_dataset(verbose=False))
    with np.load(DATA_DIR / "fashion_mnist_20k.npz") as z:
        stored, stored_labels = z["x_train"], z["y_train"]
    assert images.dtype == torch.uint8 and images.shape == (10_000, 1, 28, 28)
    assert torch.equal(images[:, 0], torch.from_numpy(stored))
    assert torch.equal(labels, torch.from_numpy(stored_labels).long())


def test_augmentation_makes_normalised_float_images_that_differ_between_calls(raw):
    images, labels = raw
    ds = L.AugmentedImages(images, labels)
    assert len(ds) == len(images)
    a, y = ds[3]
    b, _ = ds[3]
    assert a.shape == (1, 28, 28) and a.dtype == torch.float32 and int(y) == int(labels[3])
    assert not torch.equal(a, b)  # random: two draws of one image differ
    assert -1.5 < a.min() and a.max() < 3.0  # (x/255 - 0.286) / 0.353 lies in about [-0.81, 2.02]


class _TimedLoader:
    """An iterable of `n` batches, each taking `ms` to make: a loader without workers."""

    def __init__(self, n: int, ms: float, batch: int = 4):
        self.n, self.ms, self.batch_size = n, ms, batch

    def __iter__(self):
        for _ in range(self.n):
            time.sleep(self.ms / 1000)
            yield torch.zeros(self.batch_size), torch.zeros(self.batch_size)


@pytest.mark.timing
def test_measure_loader_times_the_wait_and_restarts_epochs():
    # Loading and compute take turns, 20 ms of sleep each: the wait is about half of each step. A sleep never
    # ends early, so the floors hold on any machine; a busy one wakes a sleeper late, now one side and now the
    # other, so a run whose fraction strays is measured afresh, at most three runs. A wait timed outside
    # next(), or a step timed without its wait, reads about 0 or 1 in every run.
    runs = []
    while not (runs and 0.35 < runs[-1].wait_fraction < 0.7) and len(runs) < 3:
        run = W.measure_loader(_TimedLoader(3, ms=20), W.simulated_step(20), steps=7, warmup=1, label="x")
        assert len(run.wait_ms) == len(run.step_ms) == 7
        assert all(w >= 15 for w in run.wait_ms) and all(s >= 35 for s in run.step_ms)
        runs.append(run)
    assert 0.35 < run.wait_fraction < 0.7, [f"{r.wait_fraction:.2f}" for r in runs]  # about a half
    assert 4 * 7 * 1000 / sum(run.step_ms) == pytest.approx(run.images_per_s)
    assert "x:" in str(run) and "waiting for data" in str(run)


def test_measure_loader_warms_up_one_step_per_worker_by_default(raw):
    images, labels = raw
    loader = DataLoader(TensorDataset(images[:64], labels[:64]), batch_size=4, num_workers=2)
    calls = []
    W.measure_loader(loader, calls.append, steps=3)
    assert len(calls) == 2 + 2 + 3


def test_loader_run_windows_and_table():
    run = W.LoaderRun("a label", 10, wait_ms=[1, 1, 3, 3], step_ms=[10, 10, 10, 10], first_batch_ms=5)
    rates, fractions = run.windows(2)
    assert rates == [1000.0, 1000.0] and fractions == [0.1, 0.3]
    assert run.wait_fraction == pytest.approx(0.2)
    table = W.format_runs([run, run])
    assert len(table.splitlines()) == 3 and all(len(line) <= 100 for line in table.splitlines())


def test_workers_needed_and_cpus():
    assert W.workers_needed(100, 100) == 2  # 1.25 rounded up: headroom over exactly one
    assert W.workers_needed(100, 200) == 1
    assert W.workers_needed(300, 100) == 4
    assert W.cpus() >= 1


def test_sweep_plot_has_both_panels_and_a_legend_in_each(raw):
    images, labels = raw
    ds = TensorDataset(images[:128], labels[:128])
    runs = W.sweep(lambda w: DataLoader(ds, batch_size=8, num_workers=w), [0, 1], W.simulated_step(1), steps=4)
    assert [r.label for r in runs] == ["0", "1"]
    fig = W.plot_sweep({"s": runs}, [0, 1], "num_workers", demand={"s": 500.0}, supply=300.0, cores=2)
    ax1, ax2 = fig.axes
    assert ax1.get_legend() is not None and ax2.get_legend() is not None
    assert "images/s" in ax1.get_ylabel() and "%" in ax2.get_ylabel()


def test_slow_storage_waits_and_hiccups(raw):
    images, labels = raw
    store = L.SlowStorage(TensorDataset(images, labels), ms=2, slow_every=3, slow_factor=10)
    t0 = time.perf_counter()
    store[1]
    fast = time.perf_counter() - t0
    t0 = time.perf_counter()
    x, y = store[3]
    slow = time.perf_counter() - t0
    assert fast >= 0.002 and slow >= 0.02 and torch.equal(x, images[3])


def test_a_dataset_that_swallows_loader_arguments_leaves_the_loader_at_its_defaults(raw):
    images, labels = raw
    ds = L.ArgsSwallowingDataset(images, labels, num_workers=16, pin_memory=True, persistent_workers=True)
    loader = DataLoader(ds, batch_size=8)
    assert (loader.num_workers, loader.pin_memory, loader.persistent_workers) == (0, False, False)


def test_workers_copy_a_numpy_generator_and_reseed_numpy_fixes_it():
    def batches(init):
        loader = DataLoader(
            L.NumpyRngDataset(8),
            batch_size=4,
            num_workers=2,
            worker_init_fn=init,
            generator=torch.Generator().manual_seed(0),
        )
        return [b.tolist() for b in loader]

    same = batches(None)
    assert same[0] == same[1]  # both workers drew the same numbers
    fixed = batches(L.reseed_numpy)
    assert fixed[0] != fixed[1]
    assert fixed == batches(L.reseed_numpy)  # and the loader's generator makes them repeat


def _matches_a_shifted_flipped_crop(out: torch.Tensor, img: torch.Tensor, pad: int) -> float:
    """Best correlation between `out` and any shift/flip of `img` (brightness and contrast aside)."""
    padded = torch.nn.functional.pad(img.float(), (pad,) * 4)
    h, w = img.shape[-2:]
    best = -1.0
    for dy in range(2 * pad + 1):
        for dx in range(2 * pad + 1):
            crop = padded[..., dy : dy + h, dx : dx + w]
            for cand in (crop, crop.flip(-1)):
                best = max(best, float(torch.corrcoef(torch.stack([cand.flatten(), out.flatten()]))[0, 1]))
    return best


def test_augment_batch_shifts_and_flips_each_image_on_its_own(raw):
    images, _ = raw
    x = images[:16]
    g = torch.Generator().manual_seed(0)
    out = L.augment_batch(x, g, pad=2)
    assert out.shape == x.shape and out.dtype == torch.float32
    assert all(_matches_a_shifted_flipped_crop(o, i, 2) > 0.98 for o, i in zip(out, x))
    again = L.augment_batch(x, torch.Generator().manual_seed(0), pad=2)
    assert torch.equal(out, again)
    assert not torch.equal(out, L.augment_batch(x, torch.Generator().manual_seed(1), pad=2))


def test_device_loader_covers_the_data_once_per_epoch_in_a_seeded_order(raw):
    images, labels = raw
    loader = L.DeviceLoader(images[:100], labels[:100], batch_size=32, seed=3)
    batches = list(loader)
    assert len(loader) == len(batches) == 3 and all(len(x) == 32 for x, _ in batches)
    seen = torch.cat([y for _, y in batches])
    assert len(seen) == 96 and set(seen.tolist()) <= set(labels[:100].tolist())
    plain = L.DeviceLoader(images[:100], labels[:100], batch_size=100, augment=False, seed=0)
    x, y = next(iter(plain))
    order = torch.randperm(100, generator=torch.Generator().manual_seed(0))
    assert torch.equal(x, images[:100][order].float()) and torch.equal(y, labels[:100][order])
    first = [y for _, y in L.DeviceLoader(images[:100], labels[:100], batch_size=32, seed=3)]
    assert all(torch.equal(a, b) for a, b in zip(first, [y for _, y in batches]))


def test_format_loading_reference_shows_copies_and_the_sweep():
    run = W.LoaderRun("num_workers=2", 64, [0.1, 0.2], [10.0, 11.0], 50.0)
    copies = [
        {
            "copy": name,
            "mib": 64,
            "copy_ms": 3.0,
            "copy_lo": 2.9,
            "copy_hi": 3.1,
            "gb_per_s": 22.4,
            "busy_ms": 20.0,
            "host_ms": h,
            "both_ms": 21.0,
        }
        for name, h in (("pageable .to()", 23.0), ("pinned, non_blocking", 0.02))
    ]
    text = L.format_loading_reference(
        {
            "copies": copies,
            "sweep": {"cpus": 16, "per_core": 900.0, "demand": 5400.0, "batch_size": 64, "runs": [run.__dict__]},
        }
    )
    assert "pinned, non_blocking" in text and "16 cores" in text and "num_workers=2" in text
    assert all(len(line) <= 100 for line in text.splitlines())


def test_cli_records_the_sweep_with_provenance_on_a_cpu(tmp_path, capsys):
    out = tmp_path / "loading_cpu.json"
    assert L.main(["--device", "cpu", "--workers", "0", "1", "--steps", "3", "--json", str(out)]) == 0
    ref = json.loads(out.read_text())
    assert ref["copies"] == [] and ref["provenance"]["command"].startswith("python -m course_lib.chapters.ch07.loading")
    assert [r["label"] for r in ref["sweep"]["runs"]] == ["num_workers=0", "num_workers=1"]
    assert "loader sweep" in capsys.readouterr().out


def test_the_recorded_sweep_tries_no_more_workers_than_the_cores(monkeypatch):
    assert L._sweep_workers(2) == [0, 1, 2]  # a Colab VM
    assert L._sweep_workers(6) == [0, 1, 2, 4, 6] and L._sweep_workers(16) == [0, 1, 2, 4, 8, 12, 16]
    seen = {}
    monkeypatch.setattr(L, "cpus", lambda: 2)
    monkeypatch.setattr(L, "_sweep_record", lambda batch, workers, demand, steps: seen.setdefault("w", workers) and {})
    monkeypatch.setattr(L, "record", lambda *a, **k: None)
    monkeypatch.setattr(L, "format_loading_reference", lambda payload: "")
    assert L.main(["--device", "cpu"]) == 0 and seen["w"] == [0, 1, 2]


@pytest.mark.timing
@pytest.mark.skipif(not torch.cuda.is_available(), reason="times host-to-device copies: needs a CUDA GPU")
def test_copy_timings_on_a_gpu():
    # The pageable copy holds the Python thread for the 5 ms of queued GPU work and its copy; the pinned one
    # returns at once. Each host_ms is a median of three, and a busy host can still stall one call: a fresh
    # measurement then, at most three. A pinned copy that waits for the GPU fails every one.
    tried = []
    while not (tried and tried[-1][1]["host_ms"] < tried[-1][0]["host_ms"]) and len(tried) < 3:
        rows = L.copy_timings("cuda", mib=16, busy_ms=5, iters=3)
        assert [r["copy"] for r in rows] == ["pageable .to()", "pinned, non_blocking", "pin_memory() each time"]
        assert all(r["copy_ms"] > 0 and r["gb_per_s"] > 0 for r in rows)
        tried.append(rows)
    pageable, pinned = rows[0], rows[1]
    assert pinned["host_ms"] < pageable["host_ms"], [(p["host_ms"], q["host_ms"]) for p, q, _ in tried]
    print(L.format_copy_rows(rows))


def test_chapter_07_sets_one_cores_supply_from_the_median_step():
    """Everything chapter 07 sizes comes from one core's supply. A fresh Run All's first measurement
    has a slow step or two: as a mean over 8 steps it came out ~4x low (36.9 ms per batch, median
    9.7 ms), and the chapter's verdict and plot contradicted its own prose."""
    from pathlib import Path

    import nbformat

    from course_lib.chapters.ch07.data_wait import LoaderRun

    cells = nbformat.read(Path(__file__).parents[1] / "notebooks" / "07_loading.ipynb", as_version=4).cells
    source = next(c.source for c in cells if c.cell_type == "code" and "load_only = measure_loader" in c.source)
    assert "load_ms = load_only.step.median_ms" in source and "supply = 1000 * B / load_ms" in source
    assert "images_per_s" not in source.split("supply =")[1].split("\n")[0]
    run = LoaderRun("one core", 32, wait_ms=[10.0] * 8, step_ms=[10.0] * 7 + [300.0], first_batch_ms=50.0)
    assert 1000 * 32 / run.step.median_ms == pytest.approx(3200)  # what the chapter now reads
    assert run.images_per_s < 800  # what it used to read: a quarter, from one slow step


def test_loader_warnings_are_caught_and_said_without_paths():
    """Exercise 07's try-it cell printed DataLoader's UserWarning with a site-packages path; caught, each
    warning is one line, once, that says what it means."""
    data = TensorDataset(torch.randn(32, 3))
    with W.caught_loader_warnings() as said:
        for _ in range(2):
            W.measure_loader(
                DataLoader(data, batch_size=8, num_workers=W.cpus() + 2, pin_memory=True), W.simulated_step(0), steps=2
            )
    assert len(said) == len(set(said)) and all(len(line) <= 97 and "site-packages" not in line for line in said)
    assert f"num_workers={W.cpus() + 2}: more workers than the {W.cpus()} cores here" in said[0]
    if not torch.cuda.is_available() and torch_at_least("2.7"):  # torch 2.6 pins nothing without a word
        assert said[1].startswith("pin_memory=True: there is no GPU here, so DataLoader pins nothing")
    with W.caught_loader_warnings() as said:
        import warnings

        warnings.warn("something else\nsecond line", DeprecationWarning)
    assert said == ["DataLoader warned (DeprecationWarning): something else"]
