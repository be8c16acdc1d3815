"""Prune search acceptance on the demo's trained MnistNet: compress_ratio 2 cuts MACs 1.9-2.2x
and, after the demo's retraining schedule, the pruned model is within 0.5 point of FP32. And
the latency budget runs end to end (its speed-up figures are measured in
benchmarks/prune_search.py)."""

import os

import pytest
import torch

import openamct as amct
from benchmarks.prune_search_accuracy import UNIFORM, bn_adapted
from openamct.demo.data import load_mnist_5k
from openamct.demo.models import MnistNet
from openamct.demo.run import BATCH, RETRAIN_EPOCHS, RETRAIN_LR, retrain
from openamct.demo.train import evaluate, train_mnist
from openamct.stats import count_macs

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """The demo's FP32 MnistNet, trained once per session (~35 s on 2 idle cores)."""
    torch.set_num_threads(1)
    data = load_mnist_5k(seed=0)
    path = tmp_path_factory.mktemp("mnist") / "fp32.pt"
    torch.manual_seed(0)
    model = MnistNet()
    train_mnist(model, data[0], data[1], seed=0, progress=False)
    torch.save(model.state_dict(), path)
    return path, data


def _trained_model(path) -> MnistNet:
    torch.set_num_threads(1)
    model = MnistNet()
    model.load_state_dict(torch.load(path, weights_only=True))
    return model.eval()


def test_compress_ratio_2_halves_macs_and_retrains_to_fp32_accuracy(trained, tmp_path):
    path, (x_tr, y_tr, x_te, y_te) = trained
    model = _trained_model(path)
    acc_fp32 = evaluate(model, x_te, y_te)
    cfg, out = tmp_path / "search.cfg", str(tmp_path / "found.cfg")
    cfg.write_text("compress_ratio: 2\ntest_iteration: 4\n")
    data = [[x_tr[i * 64:(i + 1) * 64], y_tr[i * 64:(i + 1) * 64]] for i in range(4)]
    amct.auto_channel_prune_search(model, str(cfg), data, out)
    pruned = amct.create_prune_retrain_model(model, x_tr[:1], out, str(tmp_path / "rec.txt"))
    ratio = count_macs(model, x_tr[:1]) / count_macs(pruned, x_tr[:1])
    assert 1.9 <= ratio <= 2.2
    opt = torch.optim.Adam(pruned.parameters(), lr=RETRAIN_LR)
    total = RETRAIN_EPOCHS * -(-len(x_tr) // BATCH)
    retrain(pruned, opt, x_tr, y_tr, 0, total, total)
    acc = evaluate(pruned, x_te, y_te)
    assert acc >= acc_fp32 - 0.005, (acc, acc_fp32)


def test_latency_budget_end_to_end(tmp_path):
    cfg, out = tmp_path / "search.cfg", str(tmp_path / "found.cfg")
    cfg.write_text("compress_ratio: 1.5\nascend_optimized: false\n")
    g = torch.Generator().manual_seed(0)
    data = [[torch.randn(8, 1, 28, 28, generator=g), torch.randint(0, 10, (8,), generator=g)]]
    report = amct.auto_channel_prune_search(MnistNet(), str(cfg), data, out, budget="latency")
    lat = report.latency
    assert lat["points"] > 0 and lat["fp32_ms"] > 0 and lat["pruned_ms"] > 0
    assert lat["speedup"] == pytest.approx(lat["fp32_ms"] / lat["pruned_ms"])
    assert all(r.kept % 8 == 0 or r.kept == r.channels for r in report.rows)  # snapped for ORT's kernels
    # a noisy measurement must not talk the search out of pruning (CI once wrote an empty config)
    assert any(r.kept < r.channels for r in report.rows) and 1 <= lat["tried"] <= 3
    amct.create_prune_retrain_model(MnistNet(), data[0][0][:1], out, str(tmp_path / "rec.txt"))
    assert os.path.getsize(out) > 0


def test_searched_ratios_beat_the_uniform_ratio_right_after_pruning(trained, tmp_path):
    path, (x_tr, y_tr, x_te, y_te) = trained
    model = _trained_model(path)
    x = x_tr[:1]
    base = count_macs(model, x)

    def pruned(cfg_text: str, name: str):
        cfg = tmp_path / f"{name}.cfg"
        cfg.write_text(cfg_text)
        return amct.create_prune_retrain_model(model, x, str(cfg), str(tmp_path / f"{name}.txt"))

    search_cfg, out = tmp_path / "search.cfg", tmp_path / "found.cfg"
    search_cfg.write_text("compress_ratio: 2\ntest_iteration: 4\n")
    amct.auto_channel_prune_search(model, str(search_cfg), [[x_tr[i * 64:(i + 1) * 64], y_tr[i * 64:(i + 1) * 64]]
                                                            for i in range(4)], str(out))
    searched = pruned(out.read_text(), "searched")
    searched_macs = base / count_macs(searched, x)
    uniform = {}
    for r in (0.28, 0.30, 0.32):
        m = pruned(UNIFORM % r, f"uniform{r}")
        uniform[r] = (abs(base / count_macs(m, x) - searched_macs), m)
    nearest = min(uniform.values(), key=lambda t: t[0])[1]
    # raw accuracy right after pruning is near chance for every allocation (stale BN statistics
    # of the consumers); with them re-estimated (no weight update) allocations can be told apart
    acc_searched = evaluate(bn_adapted(searched, x_tr), x_te, y_te)
    acc_uniform = evaluate(bn_adapted(nearest, x_tr), x_te, y_te)
    # measured on two trained seeds: 59.6 vs 50.7 % and 48.0 vs 44.4 % (AMD EPYC)
    assert acc_searched >= acc_uniform, (acc_searched, acc_uniform)
