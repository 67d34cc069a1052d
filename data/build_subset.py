"""Rebuild data/fashion_mnist_20k.npz from the full Fashion-MNIST (numpy only).

The full set comes from the Debian package `dataset-fashion-mnist`
(apt-get install dataset-fashion-mnist), which installs Zalando's unmodified IDX files,
gzip'd, under /usr/share/datasets/fashion-mnist/.

    python data/build_subset.py [SOURCE_DIR] [--out data/fashion_mnist_20k.npz]

Selection: 1000 training images per class, picked with np.random.default_rng(0)
(for class 0..9 in order: the first 1000 of a permutation of that class's indices),
all 10,000 indices sorted so the images keep their original order; the full 10k test split.
The output is byte-reproducible: numpy writes zip entries with a fixed 1980 timestamp.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
from pathlib import Path

import numpy as np

CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
           "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
PER_CLASS = 1000


def read_idx(path: Path) -> np.ndarray:
    """IDX format: 2 zero bytes, a type byte (8 = uint8), ndim, ndim big-endian uint32 sizes, data."""
    raw = gzip.decompress(path.read_bytes())
    assert raw[:3] == b"\x00\x00\x08", f"{path}: not a uint8 IDX file"
    ndim = raw[3]
    shape = tuple(int(s) for s in np.frombuffer(raw, ">u4", count=ndim, offset=4))
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(shape).copy()


def array_sha256(arrays: dict[str, np.ndarray]) -> str:
    """sha256 over key name + raw bytes, keys sorted: independent of zip/compression details."""
    h = hashlib.sha256()
    for key in sorted(arrays):
        h.update(key.encode())
        h.update(np.ascontiguousarray(arrays[key]).tobytes())
    return h.hexdigest()


def build(src: Path) -> dict[str, np.ndarray]:
    x_train = read_idx(src / "train-images-idx3-ubyte.gz")
    y_train = read_idx(src / "train-labels-idx1-ubyte.gz")
    rng = np.random.default_rng(0)
    picks = [rng.permutation(np.flatnonzero(y_train == c))[:PER_CLASS] for c in range(len(CLASSES))]
    train_index = np.sort(np.concatenate(picks)).astype(np.int32)
    return {
        "x_train": x_train[train_index],
        "y_train": y_train[train_index],
        "train_index": train_index,  # positions in the original 60k train split
        "x_test": read_idx(src / "t10k-images-idx3-ubyte.gz"),
        "y_test": read_idx(src / "t10k-labels-idx1-ubyte.gz"),
        "classes": np.array(CLASSES),  # <U11, so the file loads with allow_pickle=False
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", nargs="?", default="/usr/share/datasets/fashion-mnist/",
                    help="folder with the four *-ubyte.gz files")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "fashion_mnist_20k.npz"))
    args = ap.parse_args()
    arrays = build(Path(args.src))
    np.savez_compressed(args.out, **arrays)
    data = Path(args.out).read_bytes()
    print(f"wrote {args.out}: {len(data):,} bytes")
    for key in sorted(arrays):
        print(f"  {key:12s} {str(arrays[key].shape):16s} {arrays[key].dtype}")
    print("file sha256: ", hashlib.sha256(data).hexdigest())
    print("array sha256:", array_sha256(arrays))


if __name__ == "__main__":
    main()
