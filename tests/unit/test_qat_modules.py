"""Single-op QAT modules: upstream's names and paths, from_float, and the graph flow's numerics
(one layer trained through create_quant_retrain_model or as a QAT module: the same bits)."""

import json

import pytest
import torch
from torch import nn

import openamct as amct
from openamct.nn.module.quantization.conv1d import Conv1dQAT
from openamct.nn.module.quantization.conv2d import Conv2dQAT
from openamct.nn.module.quantization.conv3d import Conv3dQAT
from openamct.nn.module.quantization.conv_transpose_1d import ConvTranspose1dQAT
from openamct.nn.module.quantization.conv_transpose_2d import ConvTranspose2dQAT
from openamct.nn.module.quantization.linear import LinearQAT


def _train(model, steps=3, shape=(8, 3, 8, 8)):
    opt = torch.optim.SGD(model.parameters(), 0.05)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        loss = model(torch.randn(*shape, generator=gen)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.mark.parametrize("algo", ["arq_retrain", "ulq_quantize"])
def test_same_bits_as_the_graph_flow(tmp_path, algo):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    x = torch.randn(8, 3, 8, 8)
    entry = {"retrain_enable": True, "retrain_data_config": {"fixed_min": False},
             "retrain_weight_config": {"algo": algo.replace("quantize", "retrain")}}
    (tmp_path / "c.json").write_text(json.dumps({"batch_num": 1, "0": entry, "3": entry}))
    graph = amct.create_quant_retrain_model(str(tmp_path / "c.json"), base, str(tmp_path / "r.txt"), (x,))
    cfg = {"retrain_weight_config": {"weights_retrain_algo": algo}}
    single = nn.Sequential(Conv2dQAT.from_float(base[0], cfg), nn.ReLU(), nn.Flatten(),
                           LinearQAT.from_float(base[3], cfg))
    assert torch.equal(single[0].weight, base[0].weight) and single[0].weight is not base[0].weight
    _train(graph)
    _train(single)
    gs, ss = graph.state_dict(), single.state_dict()
    assert gs.keys() == ss.keys()
    for k in gs:
        if k.endswith(("out_observer.min_val", "out_observer.max_val")):
            # the modules observe their output range per channel (RangeObserver with channels), the graph flow per tensor
            assert ss[k].shape == (single[0].out_channels if k.startswith("0.") else single[3].out_features,)
            continue
        assert torch.equal(gs[k], ss[k]), k
    assert not torch.equal(ss["0.weight"], base[0].weight)  # trained, and the float layer left as it was
    assert torch.equal(graph(x), single(x))


@pytest.mark.parametrize("cls, float_mod, shape", [
    (Conv1dQAT, nn.Conv1d(3, 4, 3, padding=1), (2, 3, 9)),
    (Conv2dQAT, nn.Conv2d(3, 4, 3, stride=2, groups=1), (2, 3, 9, 9)),
    (Conv3dQAT, nn.Conv3d(3, 4, (1, 3, 3), padding=(0, 1, 1)), (2, 3, 4, 6, 6)),
    (ConvTranspose1dQAT, nn.ConvTranspose1d(3, 4, 3, stride=2, output_padding=1), (2, 3, 5)),
    (ConvTranspose2dQAT, nn.ConvTranspose2d(3, 4, 2, stride=2), (2, 3, 4, 4)),
    (LinearQAT, nn.Linear(6, 4), (5, 6)),
])
def test_from_float_quantizes_and_trains(cls, float_mod, shape):
    torch.manual_seed(0)
    qat = cls.from_float(float_mod, None)
    assert isinstance(qat, type(float_mod)) and type(qat).__name__ == cls.__name__
    x = torch.randn(*shape)
    y = qat(x)
    assert y.shape == float_mod(x).shape
    assert not torch.equal(y, float_mod(x))  # quantized
    assert (y - float_mod(x)).abs().max() < 0.1 * float_mod(x).abs().max()
    _train(qat, 2, shape)
    assert bool(qat.act_quant.initialized) and bool(qat.out_observer.initialized)
    off = cls.from_float(float_mod, {"retrain_enable": False})
    assert off.act_quant is None and torch.equal(off(x), float_mod(x))


def test_direct_constructors_take_the_torch_arguments():
    conv = Conv2dQAT(in_channels=1, out_channels=2, kernel_size=1, stride=1, padding=0, dilation=1, groups=1,
                     bias=True, padding_mode="zeros", device=None, dtype=None, config=None)
    assert conv.weight.shape == (2, 1, 1, 1) and conv.act_quant is not None
    lin = LinearQAT(in_features=3, out_features=2, bias=False, config={"retrain_weight_config": {
        "weights_retrain_algo": "ulq_quantize", "channel_wise": True}})
    assert lin.bias is None and lin.wts_quant.scale.shape == (2,)
    assert Conv3dQAT(2, 2, 3).kind == "conv3d"
    assert ConvTranspose2dQAT(2, 3, 2).weight_axis == 1


def test_refusals():
    with pytest.raises(TypeError, match="mod: Conv2dQAT.from_float expects a torch.nn.Conv2d, got Conv1d"):
        Conv2dQAT.from_float(nn.Conv1d(1, 1, 1), None)
    with pytest.raises(TypeError, match="already a quantized layer"):
        LinearQAT.from_float(LinearQAT.from_float(nn.Linear(2, 2)), None)
    with pytest.raises(TypeError, match="not a module"):
        LinearQAT.from_float("fc", None)
    with pytest.raises(ValueError, match="unknown key 'retrain_data'"):
        Conv2dQAT(1, 1, 1, config={"retrain_data": {}})
    with pytest.raises(ValueError, match="padding_mode"):
        Conv2dQAT(1, 1, 3, padding_mode="reflect")
    with pytest.raises(ValueError, match="groups"):
        ConvTranspose2dQAT(4, 4, 2, groups=2)
    with pytest.raises(ValueError, match="dtype"):
        LinearQAT(2, 2, dtype=torch.float64)


def test_checkpoint_round_trip():
    """A trained QAT model's state dict loads into freshly converted modules: the same outputs."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    cfg = {"retrain_weight_config": {"weights_retrain_algo": "ulq_quantize"}}

    def convert():
        return nn.Sequential(Conv2dQAT.from_float(base[0], cfg), nn.ReLU(), nn.Flatten(),
                             LinearQAT.from_float(base[3], cfg))
    trained = _train(convert())
    fresh = convert()
    fresh.load_state_dict(trained.state_dict())
    fresh.eval()
    x = torch.randn(4, 3, 8, 8)
    assert bool(fresh[0].act_quant.initialized)
    assert torch.equal(fresh(x), trained(x))
