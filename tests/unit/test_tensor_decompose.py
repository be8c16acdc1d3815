"""Tensor decomposition (upstream's auto_decomposition / decompose_network) on small convs:
the pair's math at full rank, the rank rule, eligibility logging, the info file, the checks of
decompose_network, the caller's model left alone, and composition with create/restore/save."""

import json
import logging
import os

import numpy as np
import pytest
import torch
from torch import nn

import openamct as amct
from openamct.tensor_decompose import auto_decomposition, decompose_network
from openamct.tensor_decompose.factor import decompose_conv, singular_values
from openamct.tensor_decompose.rank import choose_rank, evbmf_rank
from tests.small import HALF_FILTERS, INT8, snapshot, write_cfg
from tests.training import sgd_steps


class Net(nn.Module):
    """conv1 (too narrow for a 3x3 split), conv2 (7x7, eligible), conv3 (grouped), fc."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 7, padding=3)
        self.conv3 = nn.Conv2d(32, 32, 7, padding=3, groups=4)
        self.fc = nn.Linear(32, 5)

    def forward(self, x):
        x = torch.relu(self.conv3(torch.relu(self.conv2(torch.relu(self.conv1(x))))))
        return self.fc(x.mean(dim=(2, 3)))


def net(seed=0):
    torch.manual_seed(seed)
    return Net().eval()


def run(model, x):
    model.eval()
    with torch.no_grad():
        return model(x)


FULL_RANK_CASES = [
    dict(in_channels=8, out_channels=16, kernel_size=(3, 5), stride=2, padding=(1, 2)),  # SCFK
    dict(in_channels=8, out_channels=16, kernel_size=(5, 3), padding="same"),  # SCSK
    dict(in_channels=16, out_channels=8, kernel_size=(3, 5), stride=(2, 1), padding=1, bias=False),  # FCFK
    dict(in_channels=16, out_channels=8, kernel_size=(5, 3), stride=(1, 2), padding=2),  # FCSK
    dict(in_channels=6, out_channels=6, kernel_size=3, padding=1, padding_mode="circular"),
    dict(in_channels=6, out_channels=6, kernel_size=3, padding=1, padding_mode="reflect"),
]


@pytest.mark.parametrize("kw", FULL_RANK_CASES)
def test_full_rank_pair_computes_the_original_conv(kw):
    torch.manual_seed(0)
    conv = nn.Conv2d(**kw).double()
    full = singular_values(conv).numel()
    seq, err = decompose_conv(conv, full)
    x = torch.randn(2, conv.in_channels, 13, 11, dtype=torch.float64)
    assert err < 1e-12
    assert torch.allclose(seq(x), conv(x), rtol=0, atol=1e-10)
    # one conv runs along each kernel axis; float32 weights stay float32 and close
    kh, kw_ = conv.kernel_size
    assert {tuple(seq[0].weight.shape[2:]), tuple(seq[1].weight.shape[2:])} == {(kh, 1), (1, kw_)}
    c32 = conv.float()
    s32, _ = decompose_conv(c32, full)
    assert s32[0].weight.dtype == torch.float32
    y = c32(x.float())
    assert (s32(x.float()) - y).abs().max() < 1e-5 * (1 + y.abs().max())
    # a lower rank is lossy but reports its error
    _, err_low = decompose_conv(conv, 2)
    assert 0 < err_low < 1


def test_rank_rule_follows_upstream():
    # EVBMF finds the rank of a low-rank signal under noise
    g = np.random.default_rng(0)
    signal = g.normal(size=(120, 7)) @ g.normal(size=(7, 240)) * 3
    s = np.linalg.svd(signal + g.normal(size=(120, 240)) * 0.1, compute_uv=False)
    assert evbmf_rank(s, 120, 240) == 7
    # 64 -> 128, 3x3: L = 192, held to [192 // 7, 192 // 6] = [27, 32], rounded to 16s: 32
    torch.manual_seed(0)
    conv = nn.Conv2d(64, 128, 3)
    assert choose_rank(singular_values(conv).numpy(), conv) == 32
    # 256 channels: divisor 4; L = 768 -> [153, 192] -> a multiple of 16 in that band
    wide = nn.Conv2d(256, 256, 3)
    r = choose_rank(singular_values(wide).numpy(), wide)
    assert r % 16 == 0 and 144 <= r <= 192
    # at least 16, at most L: a 7x7 stem with 3 input channels (L = 21) gets 16
    stem = nn.Conv2d(3, 64, 7, stride=2, padding=3)
    assert choose_rank(singular_values(stem).numpy(), stem) == 16


def test_auto_decomposition_changes_the_model_in_place_and_logs_one_line_per_reason(tmp_path, caplog):
    """As upstream's: the model passed is decomposed and returned."""
    model = net()
    x = torch.randn(2, 3, 12, 12)
    want = run(model, x)
    with caplog.at_level(logging.DEBUG, logger="openamct.tensor_decompose"):
        out, changes = auto_decomposition(model, str(tmp_path / "sub" / "info.json"))
    assert changes == {"conv2": ["conv2.0", "conv2.1"]}
    assert out is model and isinstance(model.conv2, nn.Sequential)
    assert out.conv2[0].weight.shape == (16, 16, 7, 1) and out.conv2[1].weight.shape == (32, 16, 1, 7)
    assert out.conv2[1].bias is not None and out.conv2[0].bias is None
    got = run(out, x)
    rel = float((got - want).norm() / want.norm())
    print(f"decomposed output vs original before fine-tuning: relative L2 {rel:.3f}")
    assert 0 < rel < 1
    infos = [r for r in caplog.records if r.levelno == logging.INFO and "left as they are" in r.getMessage()]
    assert len(infos) == 2, [r.getMessage() for r in infos]
    text = "\n".join(r.getMessage() for r in infos)
    assert "'conv1'" in text and "'conv3'" in text and "grouped" in text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_ineligible_convs_share_one_line_per_reason(caplog):
    convs = nn.Sequential(*[nn.Conv2d(64, 64, 3, groups=2) for _ in range(3)], nn.Conv2d(64, 64, 1),
                          nn.Conv2d(64, 64, 3, dilation=2), nn.Conv2d(64, 64, 3, stride=3))
    with caplog.at_level(logging.INFO, logger="openamct.tensor_decompose"):
        out, changes = auto_decomposition(convs)
    assert changes == {}
    lines = [r.getMessage() for r in caplog.records if "left as they are" in r.getMessage()]
    assert len(lines) == 4, lines
    assert any(line.startswith("auto_decomposition: 3 ") and "'0', '1', '2'" in line for line in lines)


def test_info_file_is_versioned_atomic_and_refuses_foreign_files(tmp_path):
    path = tmp_path / "info.json"
    auto_decomposition(net(), str(path))
    data = json.loads(path.read_text())
    assert [e["version"] for e in data] == [1]
    assert data[0]["ori_layer_info"]["name"] == "conv2" and data[0]["mode"] == "SCFK"
    assert data[0]["decom_nodes"]["first"]["weight_shape"] == [16, 16, 7, 1]
    assert [f for f in os.listdir(tmp_path) if f != "info.json"] == []  # no temporary file left
    auto_decomposition(net(1), str(path))  # a previous info file may be overwritten
    other = tmp_path / "notes.json"
    other.write_text('{"mine": true}')
    with pytest.raises(ValueError, match="decompose_info_path .*not a decomposition info JSON"):
        auto_decomposition(net(), str(other))
    assert other.read_text() == '{"mine": true}'
    with pytest.raises(TypeError, match="decompose_info_path must be str"):
        auto_decomposition(net(), 3)
    # a newer format is refused, not misread
    data[0]["version"] = 2
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="entry 0 has version 2, written by a newer openamct"):
        decompose_network(net(), str(path))


def test_decompose_network_reads_upstreams_format(tmp_path):
    # upstream writes no version, padding, bias or padding_mode
    upstream = [{"ori_layer_info": {"name": "conv2", "in_channels": 16, "out_channels": 32, "kernel_size": [7, 7],
                                    "stride": [1, 1], "dilation": [1, 1], "groups": 1},
                 "mode": "SCFK", "decom_nodes": {"first": {"weight_shape": [16, 16, 7, 1]},
                                                 "last": {"weight_shape": [32, 16, 1, 7]}}}]
    path = tmp_path / "upstream.json"
    path.write_text(json.dumps(upstream, indent="\t"))
    out, changes = decompose_network(net(), str(path))
    assert changes == {"conv2": ["conv2.0", "conv2.1"]}
    assert out.conv2[0].kernel_size == (7, 1) and out.conv2[1].padding == (0, 3)


def test_decompose_network_plus_state_dict_reproduces_the_model(tmp_path):
    path = str(tmp_path / "info.json")
    dec, changes = auto_decomposition(net(), path)
    sgd_steps(dec, torch.randn(4, 3, 12, 12), steps=2)  # fine-tuned weights, not the SVD's
    fresh = net(7)
    rebuilt, changes2 = decompose_network(fresh, path)
    assert changes2 == changes and rebuilt is fresh and isinstance(fresh.conv2, nn.Sequential)
    rebuilt.load_state_dict(dec.state_dict())
    x = torch.randn(3, 3, 12, 12)
    assert torch.equal(run(rebuilt, x), run(dec, x))


def _entry(tmp_path, **edits):
    path = tmp_path / "info.json"
    auto_decomposition(net(), str(path))
    data = json.loads(path.read_text())
    for key, value in edits.items():
        where, _, field = key.rpartition("__")
        target = data[0]
        for part in where.split("__") if where else []:
            target = target[part]
        target[field] = value
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("edits, message", [
    (dict(ori_layer_info__name="conv9"), "layer 'conv9' is not in the model"),
    (dict(ori_layer_info__in_channels=8), "layer 'conv2': in_channels is 8 in the file but 16 in the model"),
    (dict(ori_layer_info__kernel_size=[5, 5]), "layer 'conv2': kernel_size is \\[5, 5\\] in the file"),
    (dict(ori_layer_info__padding=[0, 0]), "layer 'conv2': padding is"),
    (dict(decom_nodes__first__weight_shape=[200, 16, 7, 1], decom_nodes__last__weight_shape=[32, 200, 1, 7]),
     "layer 'conv2': rank 200 is larger than the layer allows \\(1..112"),
    (dict(decom_nodes__first__weight_shape=[16, 16, 1, 7]), "layer 'conv2': weight shapes .* do not fit mode SCFK"),
    (dict(mode="XYZ"), "'mode' must be one of"),
])
def test_decompose_network_refuses_a_file_of_another_model(tmp_path, edits, message):
    path = _entry(tmp_path, **edits)
    model = net()
    before = snapshot(model)
    with pytest.raises(ValueError, match=message):
        decompose_network(model, path)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_decompose_network_refuses_bad_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[{")
    with pytest.raises(ValueError, match="is not valid JSON \\(line 1"):
        decompose_network(net(), str(bad))
    bad.write_text('{"a": 1}')
    with pytest.raises(ValueError, match="holds a JSON dict, not the list"):
        decompose_network(net(), str(bad))
    with pytest.raises(ValueError, match="does not exist"):
        decompose_network(net(), str(tmp_path / "missing.json"))
    path = str(tmp_path / "info.json")
    dec, _ = auto_decomposition(net(), path)
    with pytest.raises(ValueError, match="layer 'conv2': the model's layer is Sequential.*decomposed already"):
        decompose_network(dec, path)


def test_a_conv_model_and_a_shared_conv(tmp_path):
    torch.manual_seed(0)
    conv = nn.Conv2d(64, 64, 3, padding=1)
    out, changes = auto_decomposition(conv, str(tmp_path / "c.json"))
    assert isinstance(out, nn.Sequential) and changes == {"": ["0", "1"]}
    assert isinstance(conv, nn.Conv2d)
    rebuilt, _ = decompose_network(nn.Conv2d(64, 64, 3, padding=1), str(tmp_path / "c.json"))
    assert isinstance(rebuilt, nn.Sequential)
    shared = nn.Sequential(conv, nn.ReLU(), conv)  # one module at two places: one pair at both
    out, changes = auto_decomposition(shared, str(tmp_path / "s.json"))
    assert set(changes) == {"0", "2"} and out[0] is out[2] and out is shared
    again = nn.Conv2d(64, 64, 3, padding=1)
    rebuilt, _ = decompose_network(nn.Sequential(again, nn.ReLU(), again), str(tmp_path / "s.json"))
    assert rebuilt[0] is rebuilt[2]


NM_ON = 'override_layer_configs { layer_name: "conv2.1" prune_config { n_out_of_m_pruner { ' \
        'l1_selective_prune { update_freq: 0 } } } }\n'


def test_decomposed_model_goes_through_create_restore_and_save(tmp_path):
    """INT8 + filter pruning + 2:4 on the new convs; the info file and the record restore the
    fine-tuned model exactly; save writes both ONNX files."""
    info, rec, ck = str(tmp_path / "info.json"), str(tmp_path / "rec.txt"), str(tmp_path / "ck.pth")
    cfg = write_cfg(tmp_path, INT8 + HALF_FILTERS + NM_ON)
    x = torch.randn(8, 3, 12, 12)
    dec, _ = auto_decomposition(net(), info)
    model = amct.create_compressed_retrain_model(dec, x[:1], cfg, rec)
    sgd_steps(model, x, steps=3)
    names = dict(model.named_modules())
    assert names["conv2.0"].weight.shape[0] == 8  # the new first conv lost half its 16 filters
    assert names["conv2.1"].weight.shape[1] == 8
    want = run(model, x)
    torch.save(model.state_dict(), ck)
    structure, _ = decompose_network(net(3), info)
    restored = amct.restore_compressed_retrain_model(structure, x[:1], cfg, rec, ck)
    assert torch.equal(run(restored, x), want)
    # an undecomposed model is refused: the config and the record name the new convs
    with pytest.raises(ValueError, match="layer 'conv2.1' does not exist in the model"):
        amct.restore_compressed_retrain_model(net(3), x[:1], cfg, rec, ck)
    with pytest.raises(ValueError, match="record_file .* describes another model"):
        amct.restore_compressed_retrain_model(net(3), x[:1], write_cfg(tmp_path, INT8, "plain.cfg"), rec, ck)
    amct.save_compressed_retrain_model(restored, rec, str(tmp_path / "out" / "m"), x[:1])
    assert os.path.isfile(tmp_path / "out" / "m_deploy_model.onnx")
