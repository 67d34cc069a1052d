"""course_lib.data: shipped subset, fallbacks, error messages, samplers, loaders. All offline."""

from __future__ import annotations

import hashlib
import importlib.abc
import socket
import subprocess
import sys
import types
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import SequentialSampler, TensorDataset

from course_lib import _sources as sources
from course_lib import data, loaders

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "data" / "fashion_mnist_20k.npz"
SHIPPED_FILE_SHA256 = "9fb9d572aea2a69492f49787c9df5a0229588bebf6ebcf89302b2a8ac00d3c76"
DEBIAN_PRESENT = sources.debian_files(sources.DEBIAN_DIR) is not None


@pytest.fixture(autouse=True)
def repo_data_dir(monkeypatch):
    """Every test starts from the repo's data/ whatever the caller's environment says."""
    monkeypatch.delenv("COURSE_DATA_DIR", raising=False)
    monkeypatch.setattr(data, "DATA_DIR", REPO / "data")


@pytest.fixture
def no_full_set(monkeypatch, tmp_path):
    """Pretend the Debian package is not installed."""
    monkeypatch.setattr(sources, "DEBIAN_DIR", tmp_path / "no-debian")


@pytest.fixture
def no_downloads(monkeypatch):
    """Any attempt to reach torchvision's download code or the network fails the test loudly."""

    def boom(*args, **kwargs):
        raise AssertionError("a download was attempted under pytest")

    monkeypatch.setattr(sources, "torchvision_arrays", boom)
    monkeypatch.setattr("urllib.request.urlopen", boom)
    monkeypatch.setattr(socket.socket, "connect", boom)


# ----------------------------------------------------------------------------- shipped data


def test_shipped_file_is_the_committed_one():
    assert SHIPPED.stat().st_size < 20e6
    assert hashlib.sha256(SHIPPED.read_bytes()).hexdigest() == SHIPPED_FILE_SHA256


def test_shipped_load_shapes_dtypes_normalisation_balance_and_source_line(capsys):
    b = data.load_dataset()
    out = capsys.readouterr().out
    assert ("data: Fashion-MNIST, shipped subset (10,000 train / 10,000 test) from data/fashion_mnist_20k.npz") in out
    assert (b.name, b.source) == ("fashion_mnist", "shipped")
    assert b.description in out
    x, y = b.train.tensors
    assert x.shape == (10000, 1, 28, 28) and x.dtype == torch.float32
    assert y.shape == (10000,) and y.dtype == torch.int64
    assert b.test.tensors[0].shape == (10000, 1, 28, 28)
    assert b.input_shape == (1, 28, 28) and b.num_classes == 10
    assert b.classes[0] == "T-shirt/top" and b.classes[-1] == "Ankle boot"
    # normalised with the full set's statistics: ~zero mean, ~unit std on the subset too
    assert abs(x.mean().item()) < 0.02 and abs(x.std().item() - 1) < 0.02
    assert x.min().item() == pytest.approx(-0.2860 / 0.3530, abs=1e-5)  # a black pixel
    assert torch.bincount(y).tolist() == [1000] * 10
    assert torch.bincount(b.test.tensors[1]).tolist() == [1000] * 10


def test_verbose_false_prints_nothing(capsys):
    data.load_dataset(verbose=False, train_size=10, test_size=10)
    assert capsys.readouterr().out == ""


@pytest.mark.skipif(not DEBIAN_PRESENT, reason="needs the full set: apt-get install dataset-fashion-mnist")
def test_build_script_reproduces_committed_npz_byte_for_byte(tmp_path):
    out = tmp_path / "rebuilt.npz"
    run = subprocess.run(
        [sys.executable, str(REPO / "data" / "build_subset.py"), str(sources.DEBIAN_DIR), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.read_bytes() == SHIPPED.read_bytes()
    assert SHIPPED_FILE_SHA256 in run.stdout
    assert sources.SHIPPED_ARRAY_SHA256 in run.stdout  # the module checks the same array hash


def _broken_copies(tmp_path: Path) -> dict[str, bytes]:
    good = SHIPPED.read_bytes()
    with np.load(SHIPPED) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["x_train"][0, 0, 0] ^= 1  # one pixel changed: right layout, wrong contents
    altered, renamed, reshaped = (tmp_path / n for n in ("altered.npz", "renamed.npz", "reshaped.npz"))
    np.savez(altered, **arrays)
    np.savez(renamed, **{("images" if k == "x_train" else k): v for k, v in arrays.items()})
    np.savez(reshaped, **{**arrays, "x_test": arrays["x_test"][:5000]})
    return {
        "truncated": good[: len(good) // 2],
        "not a zip": b"version https://git-lfs.github.com/spec/v1\noid sha256:0\n",
        "checksum": altered.read_bytes(),
        "keys": renamed.read_bytes(),
        "shape": reshaped.read_bytes(),
    }


def test_corrupt_shipped_file_gives_clear_error_naming_file_and_fix(tmp_path, monkeypatch):
    for what, content in _broken_copies(tmp_path).items():
        folder = tmp_path / what.replace(" ", "_")
        folder.mkdir()
        (folder / sources.SHIPPED_FILE).write_bytes(content)
        monkeypatch.setenv("COURSE_DATA_DIR", str(folder))
        with pytest.raises(RuntimeError) as err:
            data.load_dataset(verbose=False)
        msg = str(err.value)
        assert str(folder / sources.SHIPPED_FILE) in msg, what
        assert "python data/build_subset.py" in msg and "git checkout" in msg, what


def test_missing_shipped_file_and_nothing_else_says_how_to_get_it(tmp_path, monkeypatch, no_full_set, no_downloads):
    monkeypatch.setenv("COURSE_DATA_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="missing") as err:
        data.load_dataset(verbose=False)
    assert "apt-get install dataset-fashion-mnist" in str(err.value)
    assert "git checkout" in str(err.value)


def test_unknown_name_raises_valueerror_listing_valid_names():
    with pytest.raises(ValueError, match="fashion_mnist, cifar10, synthetic"):
        data.load_dataset("mnist")


def test_bad_sizes_raise_valueerror():
    with pytest.raises(ValueError, match="train_size"):
        data.load_dataset(train_size=0, verbose=False)


# ----------------------------------------------------------------------------- fallbacks


def test_downloads_off_in_ci_offline_mode_and_pytest_says_which(monkeypatch):
    # one condition at a time (the repo's conftest.py also sets COURSE_OFFLINE=1)
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("COURSE_OFFLINE", raising=False)
    assert data.downloads_off() == "this is a pytest run"  # PYTEST_CURRENT_TEST is set right now
    monkeypatch.delenv("PYTEST_CURRENT_TEST")
    assert data.downloads_off() == ""
    monkeypatch.setenv("CI", "true")
    assert data.downloads_off() == "CI=true is set"
    monkeypatch.delenv("CI")
    monkeypatch.setenv("COURSE_OFFLINE", "1")
    assert data.downloads_off() == "COURSE_OFFLINE=1 is set"
    monkeypatch.setenv("COURSE_OFFLINE", "0")
    assert data.downloads_off() == ""
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "x")
    monkeypatch.setenv("COURSE_OFFLINE", "yes")
    assert data.downloads_off() == "COURSE_OFFLINE=yes is set; this is a pytest run"  # each reason that holds


# Issue 33: the CIFAR-10 message listed "CI, COURSE_OFFLINE=1 or pytest" whatever switched downloads
# off (chapter 00 passes allow_download=False: none of the three). It names only what applies.
OFF_CASES = {  # environment, allow_download -> the one reason the message gives
    "allow_download=False": ({"COURSE_OFFLINE": "1"}, False, "allow_download=False was passed"),
    "COURSE_OFFLINE": ({"COURSE_OFFLINE": "1"}, None, "COURSE_OFFLINE=1 is set"),
    "CI": ({"CI": "true"}, None, "CI=true is set"),
    "pytest": ({"PYTEST_CURRENT_TEST": "x"}, None, "this is a pytest run"),
}
REASONS = {
    "allow_download=False": "allow_download=False",
    "COURSE_OFFLINE": "COURSE_OFFLINE",
    "CI": "CI=",
    "pytest": "pytest",
    "failed": "failed",
}


@pytest.mark.parametrize("case", OFF_CASES)
@pytest.mark.parametrize("kwargs", [{"name": "cifar10"}, {"full": True}], ids=["cifar10", "full"])
def test_the_unavailable_message_names_only_the_reason_that_applies(
    case, kwargs, tmp_path, monkeypatch, no_full_set, no_downloads
):
    env, allow, reason = OFF_CASES[case]
    for var in ("CI", "COURSE_OFFLINE", "PYTEST_CURRENT_TEST"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(data.DatasetUnavailable) as e:
        data.load_dataset(root=tmp_path, allow_download=allow, train_size=10, test_size=10, **kwargs)
    msg = str(e.value)
    assert f"it is not in {tmp_path}, and downloads are off ({reason})." in msg, msg
    assert [k for k, w in REASONS.items() if w in msg.replace(str(tmp_path), "<root>")] == [case], msg
    if kwargs.get("name") == "cifar10":
        assert "Online, load_dataset('cifar10', allow_download=True) fetches it (170 MB)" in msg


def test_chapter_00s_cifar_message_says_allow_download_false(tmp_path, no_downloads):
    # the cell in chapter 00, as a learner runs it (COURSE_OFFLINE is not set in JupyterLab)
    with pytest.raises(data.DatasetUnavailable) as e:
        data.load_dataset("cifar10", allow_download=False, root=tmp_path)
    assert str(e.value) == (
        "CIFAR-10 is not shipped with the course (its licence is unknown); it is not in "
        f"{tmp_path}, and downloads are off (allow_download=False was passed). Online, "
        "load_dataset('cifar10', allow_download=True) fetches it (170 MB); offline, use "
        "load_dataset('fashion_mnist') or 'synthetic'."
    )


def test_no_download_attempted_under_pytest(tmp_path, monkeypatch, no_full_set, no_downloads):
    monkeypatch.delenv("CI", raising=False)  # pytest alone must keep the loader offline
    monkeypatch.delenv("COURSE_OFFLINE", raising=False)
    for kwargs in ({"full": True}, {"name": "cifar10"}):
        with pytest.raises(data.DatasetUnavailable, match="downloads are off"):
            data.load_dataset(root=tmp_path, train_size=100, test_size=100, **kwargs)
    assert list(tmp_path.iterdir()) == []  # nothing was even created in the cache folder


def test_full_set_unavailable_is_an_error_that_says_what_to_do(tmp_path, no_full_set, no_downloads):
    with pytest.raises(data.DatasetUnavailable) as e:
        data.load_dataset(full=True, root=tmp_path, train_size=20, test_size=20)
    msg = str(e.value)
    assert "apt-get install dataset-fashion-mnist" in msg and "allow_download=True" in msg
    assert "load_dataset() without full=True" in msg


@pytest.mark.skipif(not DEBIAN_PRESENT, reason="needs the full set: apt-get install dataset-fashion-mnist")
def test_full_uses_debian_package_when_installed(capsys, no_downloads):
    b = data.load_dataset(full=True, test_size=100)
    assert b.source == "debian"
    assert b.train.tensors[0].shape == (60000, 1, 28, 28)
    assert "full set (60,000 train / 100 test" in capsys.readouterr().out


def test_cifar10_offline_is_an_error_never_a_substitute(tmp_path, capsys, no_downloads):
    with pytest.raises(data.DatasetUnavailable) as e:
        data.load_dataset("cifar10", root=tmp_path, train_size=200, test_size=100)
    msg = str(e.value)
    assert "CIFAR-10 is not shipped" in msg and "allow_download=True" in msg and "'fashion_mnist'" in msg
    assert "data: Fashion-MNIST" not in capsys.readouterr().out  # nothing else was loaded in its place


class _FakeCIFAR10:
    """Stands in for torchvision.datasets.CIFAR10 on a network that is down."""

    seen_timeouts: list = []

    def __init__(self, root, train, download):
        self.seen_timeouts.append(socket.getdefaulttimeout())
        raise urllib.error.URLError("[Errno -2] Name or service not known")


def test_failed_download_is_an_error_and_restores_socket_timeout(tmp_path, monkeypatch, capsys):
    fake = types.ModuleType("torchvision")
    fake.datasets = types.SimpleNamespace(CIFAR10=_FakeCIFAR10, FashionMNIST=_FakeCIFAR10)
    monkeypatch.setitem(sys.modules, "torchvision", fake)
    previous = socket.getdefaulttimeout()
    with pytest.raises(data.DatasetUnavailable) as e:
        data.load_dataset("cifar10", allow_download=True, root=tmp_path, train_size=10, test_size=10)
    assert _FakeCIFAR10.seen_timeouts[-1] == sources.DOWNLOAD_TIMEOUT_S
    assert socket.getdefaulttimeout() == previous
    assert "torchvision _FakeCIFAR10 failed (URLError" in capsys.readouterr().out
    # no network: the message says the download failed and why, and names no switch that was not set
    msg = str(e.value)
    assert (
        "downloading it failed (torchvision _FakeCIFAR10 failed (URLError: <urlopen error [Errno -2] Name or "
        "service not known>)). Fix that; offline, use load_dataset('fashion_mnist')" in msg
    ), msg
    msg = msg.replace(str(tmp_path), "<root>")
    assert not any(w in msg for w in ("downloads are off", "COURSE_OFFLINE", "CI=", "pytest")), msg


def test_a_cached_copy_that_does_not_load_is_named_as_such(tmp_path, monkeypatch, capsys):
    fake = types.ModuleType("torchvision")
    fake.datasets = types.SimpleNamespace(CIFAR10=_FakeCIFAR10, FashionMNIST=_FakeCIFAR10)
    monkeypatch.setitem(sys.modules, "torchvision", fake)
    (tmp_path / "cifar-10-batches-py").mkdir()
    (tmp_path / "cifar-10-batches-py" / "data_batch_1").write_bytes(b"truncated")
    with pytest.raises(data.DatasetUnavailable) as e:
        data.load_dataset("cifar10", allow_download=False, root=tmp_path, verbose=False)
    msg = str(e.value)
    assert f"the copy in {tmp_path} did not load (torchvision _FakeCIFAR10 failed (URLError" in msg, msg
    assert "and downloads are off (allow_download=False was passed)" in msg and "is not in" not in msg
    assert capsys.readouterr().out == ""  # verbose=False: the reason is in the message, nothing printed


class _BrokenTorchvision(importlib.abc.MetaPathFinder):
    """A CPU torch next to a CUDA torchvision wheel fails at import like this."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            raise RuntimeError("operator torchvision::nms does not exist")
        return None


@pytest.mark.parametrize("how", ["ModuleNotFoundError", "RuntimeError"])
def test_broken_torchvision_never_stops_the_learner(how, tmp_path, monkeypatch, capsys, no_full_set):
    if how == "ModuleNotFoundError":  # not installed
        monkeypatch.setitem(sys.modules, "torchvision", None)
    else:
        monkeypatch.delitem(sys.modules, "torchvision", raising=False)  # installed but broken
        monkeypatch.setattr(sys, "meta_path", [_BrokenTorchvision(), *sys.meta_path])
    with pytest.raises(data.DatasetUnavailable):
        data.load_dataset(full=True, allow_download=True, root=tmp_path, train_size=10, test_size=10)
    assert f"torchvision is not usable ({how}" in capsys.readouterr().out
    assert data.load_dataset(train_size=10, test_size=10).source == "shipped"  # the default still works


def test_import_needs_no_torchvision():
    code = (
        "import sys; sys.modules['torchvision'] = None\n"
        "import course_lib.data as d\n"
        "b = d.load_dataset(verbose=False, train_size=10, test_size=10)\n"
        "assert b.source == 'shipped'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


def test_synthetic_dataset_is_cifar_shaped_and_labelled(capsys):
    b = data.load_dataset("synthetic", train_size=64, test_size=32)
    assert (b.name, b.source, b.input_shape) == ("synthetic", "synthetic", (3, 32, 32))
    assert len(b.train) == 64 and len(b.test) == 32
    assert "synthetic" in capsys.readouterr().out


# ----------------------------------------------------------------------------- subsets


def test_train_size_takes_a_balanced_deterministic_prefix():
    b = data.load_dataset(train_size=2005, test_size=500, verbose=False)
    y = b.train.tensors[1]
    assert torch.bincount(y).tolist() == [201] * 5 + [200] * 5
    assert torch.bincount(b.test.tensors[1]).tolist() == [50] * 10
    full = data.load_dataset(verbose=False)
    fy = full.train.tensors[1]
    for c in range(10):  # the first images of each class, in the file's order
        want = full.train.tensors[0][fy == c][: (y == c).sum()]
        assert torch.equal(b.train.tensors[0][y == c], want)


# ----------------------------------------------------------------------------- loaders


def test_seeded_sampler_same_seed_and_epoch_same_order():
    a, b = loaders.SeededSampler(100, seed=3), loaders.SeededSampler(100, seed=3)
    a.set_epoch(5)
    b.set_epoch(5)
    order = list(a)
    assert order == list(b) and sorted(order) == list(range(100))


def test_seeded_sampler_different_epoch_or_seed_different_order():
    s = loaders.SeededSampler(100, seed=0)
    s.set_epoch(0)
    e0 = list(s)
    s.set_epoch(1)
    e1 = list(s)
    assert e0 != e1
    assert list(loaders.SeededSampler(100, seed=1)) != e0


def test_seeded_sampler_resume_reproduces_any_epoch():
    run = loaders.SeededSampler(50, seed=7)
    epochs = [list(run) for _ in range(3)]  # iterating advances the epoch by itself
    resumed = loaders.SeededSampler(50, seed=7)
    resumed.set_epoch(2)
    assert list(resumed) == epochs[2]
    assert len(set(map(tuple, epochs))) == 3


def test_make_loader_passes_the_knobs_through():
    ds = TensorDataset(torch.arange(10.0), torch.arange(10))
    dl = loaders.make_loader(
        ds, 4, num_workers=2, pin_memory=True, persistent_workers=True, prefetch_factor=3, drop_last=True, seed=1
    )
    assert (dl.batch_size, dl.num_workers, dl.pin_memory, dl.persistent_workers, dl.prefetch_factor, dl.drop_last) == (
        4,
        2,
        True,
        True,
        3,
        True,
    )
    assert isinstance(dl.sampler, loaders.SeededSampler) and dl.sampler.seed == 1
    assert len(dl) == 2  # drop_last
    plain = loaders.make_loader(ds, 4, shuffle=False)
    assert isinstance(plain.sampler, SequentialSampler)
    assert next(iter(plain))[1].tolist() == [0, 1, 2, 3]


def test_make_loader_order_is_reproducible():
    ds = TensorDataset(torch.arange(64))
    first = [b[0].tolist() for b in loaders.make_loader(ds, 16, seed=3)]
    again = [b[0].tolist() for b in loaders.make_loader(ds, 16, seed=3)]
    assert first == again and first[0] != list(range(16))


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_synthetic_batches_deterministic_on_requested_device_and_dtype(device, dtype):
    a = data.synthetic_batches(3, 8, shape=(3, 16, 16), num_classes=5, device=device, dtype=dtype)
    b = data.synthetic_batches(3, 8, shape=(3, 16, 16), num_classes=5, device=device, dtype=dtype)
    assert len(a) == 3
    for (xa, ya), (xb, yb) in zip(a, b):
        assert xa.shape == (8, 3, 16, 16) and xa.dtype == dtype and xa.device.type == device
        assert ya.dtype == torch.int64 and ya.device.type == device
        assert 0 <= ya.min() and ya.max() < 5
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(a[0][0], a[1][0])  # batches differ from each other
    other = data.synthetic_batches(1, 8, shape=(3, 16, 16), device=device, dtype=dtype, seed=1)
    assert not torch.equal(other[0][0], a[0][0])


def test_loader_and_build_script_agree_on_idx_parsing_and_checksum(tmp_path):
    """data/build_subset.py stays numpy-only and standalone, so it repeats two helpers of
    course_lib.data; this keeps the copies from drifting (a drift would reject the shipped file)."""
    import gzip
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_subset", REPO / "data" / "build_subset.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (5, 3, 4), dtype=np.uint8)
    path = tmp_path / "x-idx3-ubyte.gz"
    header = bytes([0, 0, 8, 3]) + np.array(images.shape, dtype=">u4").tobytes()
    path.write_bytes(gzip.compress(header + images.tobytes()))
    assert np.array_equal(build.read_idx(path), images) and np.array_equal(sources.read_idx(path), images)
    arrays = {"b": images, "a": rng.integers(0, 10, 7, dtype=np.uint8)}
    assert build.array_sha256(arrays) == sources.array_sha256(arrays)
    with np.load(SHIPPED, allow_pickle=False) as z:
        assert build.array_sha256({k: z[k] for k in z.files}) == sources.SHIPPED_ARRAY_SHA256
