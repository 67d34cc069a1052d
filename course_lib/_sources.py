"""Where the raw images come from: plumbing for course_lib.data, not part of the core a learner reads.

Each function returns numpy uint8 images ((N, H, W) or (N, C, H, W)) and integer labels, or None
with a printed reason, or raises saying what to do. Only numpy is needed here: torchvision is
optional (a CPU torch wheel next to a CUDA torchvision wheel fails at import), so it is imported
lazily and only to download.
"""

from __future__ import annotations

import gzip
import hashlib
import socket
from pathlib import Path

import numpy as np

__all__: list[str] = []  # used by course_lib.data only

DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
SHIPPED_FILE = "fashion_mnist_20k.npz"
# sha256 over (key name + raw bytes) of every array, keys sorted; see data/build_subset.py.
# Checked on every load (~16 MB of hashing, a few tens of ms) so a truncated clone or a Git LFS
# pointer gives a clear message instead of a strange accuracy.
SHIPPED_ARRAY_SHA256 = "8456a991df7dd56bd38a39b858d21362ba959ea268b385aac262d59327f587fc"
SHIPPED_LAYOUT = {  # key -> (shape, dtype)
    "x_train": ((10000, 28, 28), np.uint8),
    "y_train": ((10000,), np.uint8),
    "train_index": ((10000,), np.int32),
    "x_test": ((10000, 28, 28), np.uint8),
    "y_test": ((10000,), np.uint8),
    "classes": ((10,), np.dtype("<U11")),
}
DOWNLOAD_TIMEOUT_S = 20  # torchvision's urlopen has no timeout: a black-hole network would hang


def array_sha256(arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for key in sorted(arrays):
        h.update(key.encode())
        h.update(np.ascontiguousarray(arrays[key]).tobytes())
    return h.hexdigest()


def load_shipped(path: Path) -> dict[str, np.ndarray]:
    fix = (
        f"Rebuild it with `python data/build_subset.py` (needs `apt-get install "
        f"dataset-fashion-mnist`) or restore it with `git checkout -- data/{SHIPPED_FILE}` "
        f"(or re-clone the course)."
    )
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except Exception as e:  # BadZipFile, zlib.error, ValueError (not a zip), EOFError, ...
        raise RuntimeError(f"The shipped dataset {path} is unreadable ({type(e).__name__}: {e}). {fix}") from e
    if set(arrays) != set(SHIPPED_LAYOUT):
        raise RuntimeError(
            f"The shipped dataset {path} has keys {sorted(arrays)}, expected {sorted(SHIPPED_LAYOUT)}. {fix}"
        )
    for key, (shape, dtype) in SHIPPED_LAYOUT.items():
        if arrays[key].shape != shape or arrays[key].dtype != dtype:
            raise RuntimeError(
                f"The shipped dataset {path}: {key} is {arrays[key].shape} "
                f"{arrays[key].dtype}, expected {shape} {np.dtype(dtype)}. {fix}"
            )
    if array_sha256(arrays) != SHIPPED_ARRAY_SHA256:
        raise RuntimeError(
            f"The shipped dataset {path} has the right layout but different contents (array sha256 mismatch). {fix}"
        )
    return arrays


def read_idx(path: Path) -> np.ndarray:
    """IDX: 2 zero bytes, type byte (8 = uint8), ndim, ndim big-endian uint32 sizes, data."""
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    ndim = raw[3]
    shape = tuple(int(s) for s in np.frombuffer(raw, ">u4", count=ndim, offset=4))
    # .copy(): frombuffer over bytes is read-only, and torch.from_numpy warns on that.
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(shape).copy()


def debian_files(folder: Path) -> list[Path] | None:
    names = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
    for suffix in (".gz", ""):
        files = [folder / (n + suffix) for n in names]
        if all(f.is_file() for f in files):
            return files
    return None


def oneline(e: BaseException) -> str:
    # torchvision's download errors span several lines; the cause is on the last one.
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def torchvision_arrays(name: str, root: Path, download: bool, say) -> tuple | None:
    """torchvision FashionMNIST / CIFAR10 -> numpy; None (with a printed reason) on failure."""
    try:
        import torchvision  # lazy: a broken torchvision must not stop the shipped-data path
    except (ImportError, RuntimeError, OSError) as e:
        say(f"torchvision is not usable ({oneline(e)})")
        return None
    cls = torchvision.datasets.CIFAR10 if name == "cifar10" else torchvision.datasets.FashionMNIST
    old_timeout = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)
    try:
        train = cls(str(root), train=True, download=download)
        test = cls(str(root), train=False, download=download)
    except (RuntimeError, OSError) as e:  # FashionMNIST wraps network errors; CIFAR10 raises URLError
        say(f"torchvision {cls.__name__} failed ({oneline(e)})")
        return None
    finally:
        socket.setdefaulttimeout(old_timeout)

    def arrays(ds):
        x = np.asarray(ds.data)
        if x.ndim == 4:  # CIFAR stores (N, H, W, C)
            x = x.transpose(0, 3, 1, 2)
        return np.ascontiguousarray(x), np.asarray(ds.targets)

    return (*arrays(train), *arrays(test))


def torchvision_cached(name: str, root: Path) -> bool:
    folder = "cifar-10-batches-py" if name == "cifar10" else "FashionMNIST/raw"
    return (root / folder).is_dir() and any((root / folder).iterdir())
