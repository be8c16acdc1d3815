"""benchmarks/distill_mnist.py reads the demo's training images shuffled.

``load_mnist_5k``'s training rows are sorted by digit. Read in that order, every batch of the
unlabelled distillation loader held one digit, and a filter-pruned student (whose BatchNorm
statistics ``distill`` re-estimates) ended with statistics of the last digits: 75 % test
accuracy after 5 or 10 epochs instead of 97 %.
"""

from __future__ import annotations

import torch

from benchmarks.distill_mnist import unlabelled_loader
from openamct.demo.data import load_mnist_5k


def _passes(loader, n):
    return [torch.cat([batch[0] for batch in loader]).reshape(-1) for _ in range(n)]


def test_training_rows_are_sorted_by_digit():
    """The reason the loader shuffles: read in file order, a batch of 64 holds one digit."""
    _, y, _, _ = load_mnist_5k()
    assert bool((y[:-1] <= y[1:]).all())
    assert len(y[:64].unique()) == 1


def test_every_batch_mixes_digits_and_each_pass_reshuffles():
    _, y, _, _ = load_mnist_5k()
    # The labels stand in for the images, so each batch shows which digits it holds.
    loader = unlabelled_loader(y.float().reshape(-1, 1), seed=1)
    batches = [batch[0].reshape(-1) for batch in loader]
    assert [len(b) for b in batches] == [64] * (len(y) // 64) + ([len(y) % 64] if len(y) % 64 else [])
    assert min(len(b.unique()) for b in batches) >= 5, [b.unique().tolist() for b in batches]
    first, second = _passes(loader, 2)
    assert torch.equal(first.sort().values, y.float().sort().values)  # every image once per pass
    assert not torch.equal(first, second)  # another order in the next epoch
    again, = _passes(unlabelled_loader(y.float().reshape(-1, 1), seed=1), 1)
    assert torch.equal(again, torch.cat(batches))  # same seed, same batches
