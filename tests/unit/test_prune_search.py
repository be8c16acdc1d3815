"""auto_channel_prune_search on small random models: the MACs model, coupled groups, the
config's constraints, the written config, and bad input (each error names the field)."""

import os

import pytest
import torch
from google.protobuf import text_format

import openamct as amct
from openamct.config.retrain_config_pb2 import AMCTRetrainConfig
from openamct.demo.models import MnistNet
from openamct.search import GreedySearch, SearchAlgorithm, Sensitivity, TaylorLossSensitivity
from openamct.stats import count_macs
from tests.models import ConcatNet, MobileNetV2Tiny, ResBlockNet

PRUNE = "prune_config {{ filter_pruner {{ balanced_l2_norm_filter_prune {{ prune_ratio: {r} ascend_optimized: {a} }} }} }}"


def _batches(shape, n=1, classes=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(shape, generator=g), torch.randint(0, classes, (shape[0],), generator=g)] for _ in range(n)]


def _cfg(tmp_path, text, name="search.cfg"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _ratios(path):
    cfg = AMCTRetrainConfig()
    text_format.Merge(open(path).read(), cfg)
    return {o.layer_name: o.prune_config.filter_pruner.balanced_l2_norm_filter_prune for o in cfg.override_layer_configs}


class L2Sensitivity(Sensitivity):
    """A user's own sensitivity: weight L2 norm per output channel (no loss, any output)."""

    def __init__(self, boost=None):
        self.boost, self.calls = boost or {}, 0

    def channel_scores(self, model, batches, groups):
        self.calls += 1
        mods = dict(model.named_modules())
        return [sum(mods[p].weight.detach().flatten(1).norm(dim=1) * self.boost.get(p, 1.0) for p in g.producer_names)
                for g in groups]


@pytest.mark.parametrize("factory,shape,sens", [
    (MnistNet, (4, 1, 28, 28), "TaylorLossSensitivity"),
    (lambda: ResBlockNet(c=32), (4, 3, 16, 16), "TaylorLossSensitivity"),
    (MobileNetV2Tiny, (4, 3, 32, 32), "TaylorLossSensitivity"),
    (ConcatNet, (2, 3, 16, 16), L2Sensitivity()),
])
def test_the_found_config_prunes_to_the_macs_the_search_counted(tmp_path, factory, shape, sens):
    model = factory().eval()
    cfg = _cfg(tmp_path, "compress_ratio: 1.6\nascend_optimized: false\n")
    out = str(tmp_path / "found.cfg")
    report = amct.auto_channel_prune_search(model, cfg, _batches(shape), out, sens)
    x = torch.randn(1, *shape[1:])
    pruned = amct.create_prune_retrain_model(model, x, out, str(tmp_path / "rec.txt"))
    before, after = count_macs(model, x), count_macs(pruned, x)
    # the search's MACs model (graph shapes, consumers' shrinking inputs, depthwise followers)
    # is exactly what count_macs measures on the pruned model
    assert report.model_macs_before == before
    assert report.model_macs_after == after
    assert report.macs_ratio >= 1.6
    assert report.macs_ratio < 1.6 * 1.35  # not grossly over-pruned


def test_a_residual_group_gets_one_ratio_on_all_its_producers(tmp_path):
    model = ResBlockNet(c=32).eval()
    out = str(tmp_path / "found.cfg")
    sens = L2Sensitivity(boost={"conv1": 1e6, "head": 1e6})  # only the residual group is cheap to prune
    report = amct.auto_channel_prune_search(model, _cfg(tmp_path, "compress_ratio: 1.5\nascend_optimized: false\n"),
                                            _batches((4, 3, 16, 16)), out, sens)
    residual = next(r for r in report.rows if len(r.producers) > 1)
    assert set(residual.producers) == {"stem.0", "conv2"}
    found = _ratios(out)
    assert residual.kept < residual.channels
    assert found["stem.0"].prune_ratio == found["conv2"].prune_ratio == pytest.approx(residual.ratio, abs=1e-6)


def test_max_prune_ratio_bounds_every_group_and_alignment_holds(tmp_path):
    out = str(tmp_path / "found.cfg")
    report = amct.auto_channel_prune_search(MnistNet(), _cfg(tmp_path, "compress_ratio: 1.3\nmax_prune_ratio: 0.4\n"),
                                            _batches((4, 1, 28, 28)), out)
    for r in report.rows:
        assert r.ratio <= 0.4 + 1e-9
        assert r.kept == r.channels or r.kept % 16 == 0
    assert all(b.prune_ratio <= 0.4 + 1e-6 and b.ascend_optimized for b in _ratios(out).values())


def test_override_prune_cfg_layers_keep_their_settings_and_are_not_searched(tmp_path):
    _cfg(tmp_path, 'skip_layers: "layer3.0"\noverride_layer_configs { layer_name: "layer4.0" '
                    + PRUNE.format(r=0.75, a="false") + " }\n", "override.cfg")
    cfg = _cfg(tmp_path, 'compress_ratio: 1.5\noverride_prune_cfg: "override.cfg"\n')  # found next to cfg
    out = str(tmp_path / "found.cfg")
    report = amct.auto_channel_prune_search(MnistNet(), cfg, _batches((4, 1, 28, 28)), out)
    found = _ratios(out)
    assert found["layer4.0"].prune_ratio == pytest.approx(0.75) and not found["layer4.0"].ascend_optimized
    assert "layer3.0" not in found  # skipped: not pruned (its input channels may still follow layer2)
    rows = {r.producers[0]: r for r in report.rows}
    assert rows["layer4.0"].fixed and rows["layer4.0"].kept == 32
    cfg_text = open(out).read()
    assert 'skip_layers: "layer3.0"' in cfg_text
    amct.create_prune_retrain_model(MnistNet(), torch.randn(1, 1, 28, 28), out, str(tmp_path / "r.txt"))


def test_the_callers_model_is_untouched_and_the_config_works_in_the_compressed_api(tmp_path):
    model = MnistNet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {n: p.requires_grad for n, p in model.named_parameters()}
    model.train()
    out = str(tmp_path / "found.cfg")
    amct.auto_channel_prune_search(model, _cfg(tmp_path, "compress_ratio: 2\n"), _batches((8, 1, 28, 28), 2), out)
    assert model.training and all(p.grad is None for p in model.parameters())
    assert {n: p.requires_grad for n, p in model.named_parameters()} == grads
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    m = amct.create_compressed_retrain_model(model, torch.randn(1, 1, 28, 28), out, str(tmp_path / "r.txt"))
    assert count_macs(m, torch.randn(1, 1, 28, 28)) < count_macs(model, torch.randn(1, 1, 28, 28)) / 1.9


def test_a_user_sensitivity_and_search_alg_are_used(tmp_path):
    out = str(tmp_path / "found.cfg")
    sens = L2Sensitivity(boost={"layer4.0": 1e6})  # layer4 matters enormously: it must stay whole
    report = amct.auto_channel_prune_search(MnistNet(), _cfg(tmp_path, "compress_ratio: 1.5\n"),
                                            _batches((4, 1, 28, 28)), out, sens, GreedySearch())
    assert sens.calls == 1
    assert {r.producers[0]: r.kept for r in report.rows}["layer4.0"] == 128

    class Nothing(SearchAlgorithm):
        def search(self, space, cost, target):
            return [g.options[0] for g in space.groups]

    with pytest.raises(ValueError, match="Nothing"):  # a result that misses the budget is refused
        amct.auto_channel_prune_search(MnistNet(), _cfg(tmp_path, "compress_ratio: 1.5\n"),
                                       _batches((4, 1, 28, 28)), out, sens, Nothing())


def _groups(model, x):
    from openamct.graph.capture import capture_graph
    from openamct.graph.layers import find_layers
    from openamct.search.space import search_plan
    from openamct.sparsity.dependency import analyse

    graph = capture_graph(model, x)
    layers = find_layers(model, graph)
    groups, _ = analyse(graph, layers, search_plan(layers, AMCTRetrainConfig(), False, {}, "test"))
    return {g.producer_names[0]: g for g in groups}


def test_taylor_sensitivity_is_g_dot_w_of_the_consumer_weights_per_sample():
    model = MnistNet().eval()
    with torch.no_grad():  # channel 5 of layer4 outputs exactly 0: removing it changes nothing
        model.layer4[1].weight[5] = 0
        model.layer4[1].bias[5] = 0
    group = _groups(model, torch.randn(1, 1, 28, 28))["layer4.0"]
    batches = _batches((3, 1, 28, 28), 2)
    one = TaylorLossSensitivity().channel_scores(model, batches[:1], [group])[0]
    two = TaylorLossSensitivity().channel_scores(model, batches, [group])[0]
    assert one.shape == (128,) and one[5] == 0 and (one > 0).sum() > 100
    assert torch.all(two >= one) and float(two.sum()) > float(one.sum())
    # by hand: |g_W[:, c] . W[:, c]| of the consumer fc, one sample at a time, summed
    x, y = batches[0]
    want = torch.zeros(128, dtype=torch.float64)
    for i in range(3):
        loss = torch.nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1]) / 3  # the batch mean's share
        (g,) = torch.autograd.grad(loss, [model.fc.weight])
        want += (g * model.fc.weight).sum(0).abs().double()
    assert torch.allclose(one, want, rtol=1e-4, atol=1e-12)


@pytest.mark.parametrize("text,match", [
    ("max_prune_ratio: 0.5\n", "compress_ratio is missing"),
    ("compress_ratio: 1\n", "compress_ratio must be > 1"),
    ("compress_ratio: 0.5\n", "compress_ratio must be > 1"),
    ("compress_ratio: 50\n", "compress_ratio 50 cannot be met"),
    ("compress_ratio: 2\nmax_prune_ratio: 0.1\n", "compress_ratio 2 cannot be met"),
    ("compress_ratio: 2\nmax_prune_ratio: 1.5\n", "max_prune_ratio must be in"),
    ("compress_ratio: 2\ntest_iteration: 0\n", "test_iteration must be >= 1"),
    ("compress_ratio: 2\ntest_iteration: 3\n", "test_iteration 3 needs"),
    ("compress_ratio: 2\nbatch_num: 3\n", "AutoChannelPruneConfig"),
    ('compress_ratio: 2\noverride_prune_cfg: "nope.cfg"\n', "override_prune_cfg"),
])
def test_bad_configs_name_the_field(tmp_path, text, match):
    with pytest.raises(ValueError, match=match):
        amct.auto_channel_prune_search(MnistNet(), _cfg(tmp_path, text), _batches((2, 1, 28, 28)),
                                       str(tmp_path / "o.cfg"))
    assert not os.path.exists(tmp_path / "o.cfg")


@pytest.mark.parametrize("data,exc,match", [
    (torch.randn(2, 1, 28, 28), TypeError, "input_data must be a non-empty list"),
    ([], TypeError, "input_data must be a non-empty list"),
    ([torch.randn(2, 1, 28, 28)], TypeError, r"input_data\[0\] must be a \[data, label\] pair"),
    ([[torch.randn(2, 1, 28, 28), [1, 2]]], TypeError, r"input_data\[0\]\[1\] \(label\)"),
    ([["x", torch.zeros(2)]], TypeError, r"input_data\[0\]\[0\] \(data\)"),
])
def test_input_data_must_be_a_list_of_data_label_pairs(tmp_path, data, exc, match):
    with pytest.raises(exc, match=match):
        amct.auto_channel_prune_search(MnistNet(), _cfg(tmp_path, "compress_ratio: 2\n"), data, str(tmp_path / "o.cfg"))


def test_arguments_and_output_path_are_checked_before_work(tmp_path):
    cfg, data = _cfg(tmp_path, "compress_ratio: 2\n"), _batches((2, 1, 28, 28))
    with pytest.raises(TypeError, match="model"):
        amct.auto_channel_prune_search("net", cfg, data, str(tmp_path / "o.cfg"))
    with pytest.raises(TypeError, match="output_cfg"):
        amct.auto_channel_prune_search(MnistNet(), cfg, data, None)
    with pytest.raises(ValueError, match="same file as config"):
        amct.auto_channel_prune_search(MnistNet(), cfg, data, cfg)
    with pytest.raises(ValueError, match="budget must be one of"):
        amct.auto_channel_prune_search(MnistNet(), cfg, data, str(tmp_path / "o.cfg"), budget="flops")
    with pytest.raises(ValueError, match="sensitivity 'Magic'"):
        amct.auto_channel_prune_search(MnistNet(), cfg, data, str(tmp_path / "o.cfg"), "Magic")
    with pytest.raises(TypeError, match="search_alg must be"):
        amct.auto_channel_prune_search(MnistNet(), cfg, data, str(tmp_path / "o.cfg"), search_alg=3)
    with pytest.raises(ValueError, match="cross-entropy"):  # 4-D output: the user must give a loss
        amct.auto_channel_prune_search(ConcatNet(), _cfg(tmp_path, "compress_ratio: 1.2\nascend_optimized: false\n", "c.cfg"),
                                       _batches((2, 3, 16, 16)), str(tmp_path / "o.cfg"))
    assert open(cfg).read() == "compress_ratio: 2\n" and not os.path.exists(tmp_path / "o.cfg")


def test_the_latency_budgets_onnx_folder_is_removed_when_scoring_raises(tmp_path, monkeypatch):
    import tempfile

    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # the search's temporary folders go here

    class Broken(Sensitivity):
        def __init__(self):
            self.seen = []

        def channel_scores(self, model, batches, groups):
            self.seen.extend(p for p in temp.iterdir() if p.name.startswith("openamct-latency-"))
            assert self.seen and (self.seen[0] / "fp32.onnx").exists()  # the budget wrote its model there
            raise RuntimeError("scoring failed")

    sens = Broken()
    cfg = _cfg(tmp_path, "compress_ratio: 1.2\nascend_optimized: false\n")
    with pytest.raises(RuntimeError, match="scoring failed"):
        amct.auto_channel_prune_search(MnistNet(), cfg, _batches((2, 1, 28, 28)), str(tmp_path / "o.cfg"), sens,
                                       budget="latency")
    assert len(sens.seen) == 1 and not sens.seen[0].exists()
    assert not list(temp.iterdir())
