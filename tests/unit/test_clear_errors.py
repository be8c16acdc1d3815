"""Clear one-line errors, raised before the work, instead of deep tracebacks (export names,
a record written from a hook, bad inputs)."""

from __future__ import annotations

import logging
import os
import shutil
import threading

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import openamct as amct

# Some cases build TorchScript modules on purpose (openamct must refuse them): torch.jit's own
# deprecation notices are expected there and nothing else is silenced.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")


QUANT = "retrain_data_quant_config { ulq_quantize { } }\nretrain_weight_quant_config { arq_retrain { } }\n"
X = torch.randn(2, 8, 6, 6)


class Net(nn.Module):
    def __init__(self, extra: nn.Module | None = None):
        super().__init__()
        self.conv = nn.Conv2d(8, 16, 3, padding=1)
        self.extra = extra if extra is not None else nn.Identity()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(self.extra(torch.relu(self.conv(x))).mean(dim=(2, 3)))


def _cfg(tmp_path):
    (tmp_path / "q.cfg").write_text(QUANT)
    return str(tmp_path / "q.cfg")


def _create(tmp_path, model, x=X, folder=None):
    rec = str((folder or tmp_path) / "r.txt")
    return amct.create_quant_retrain_model(_cfg(tmp_path), model, rec, x)


def _trained(tmp_path):
    m = _create(tmp_path, Net())
    m.train()
    m(X)
    m.eval()
    return m


# -- point 9: export names -------------------------------------------------------------------

@pytest.mark.parametrize("kw,msg", [
    ({"dynamic_axes": {"inptu": [0]}}, r"dynamic_axes names 'inptu', which is no input or output of the export "
                                       r"\(inputs \['x'\], outputs \['output'\]\)"),
    ({"input_names": ["a", "b"]}, r"input_names has 2 names but the model takes 1 input tensor\(s\): \['b'\] name nothing"),
    ({"input_names": ["a"], "output_names": ["a", "a"]}, r"output_names names 'a' twice"),
    ({"output_names": ["y", "z"]}, r"output_names has 2 names but the model returns 1 tensor\(s\)"),
    ({"dynamic_axes": {"x": [0, 4]}}, r"dynamic_axes\['x'\] has axis 4, but 'x' has only 4 dimension\(s\)"),
])
def test_export_names_are_checked_before_export(tmp_path, kw, msg):
    m = _trained(tmp_path)
    with pytest.raises(ValueError, match=msg):
        amct.save_quant_retrain_model(_cfg(tmp_path), m, str(tmp_path / "r.txt"), str(tmp_path / "m"), X, **kw)
    assert not os.path.exists(tmp_path / "m_fake_quant_model.onnx")


def test_good_dynamic_axes_still_export(tmp_path):
    m = _trained(tmp_path)
    amct.save_quant_retrain_model(_cfg(tmp_path), m, str(tmp_path / "r.txt"), str(tmp_path / "m"), X,
                                  dynamic_axes={"x": {0: "batch"}, "output": [0]})
    x5 = torch.randn(5, 8, 6, 6)
    with torch.no_grad():
        want = m(x5).numpy()
    for kind in ("fake_quant", "deploy"):
        path = str(tmp_path / f"m_{kind}_model.onnx")
        graph = onnx.load(path).graph
        (inp,), (out,) = graph.input, graph.output
        assert inp.name == "x" and out.name == "output"
        assert inp.type.tensor_type.shape.dim[0].dim_param == "batch"
        assert [d.dim_value for d in inp.type.tensor_type.shape.dim[1:]] == [8, 6, 6]
        assert out.type.tensor_type.shape.dim[0].dim_param  # symbolic, named by the exporter
        got = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x5.numpy()})[0]
        assert got.shape == (5, 4)  # a batch other than input_data's runs
        if kind == "fake_quant":
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


# -- point 11: a record folder that vanishes during training ---------------------------------

def test_a_vanished_record_folder_does_not_crash_the_forward(tmp_path, caplog):
    folder = tmp_path / "gone"
    folder.mkdir()
    m = _create(tmp_path, Net(), folder=folder)
    m.train()
    m(X)
    shutil.rmtree(folder)
    m.eval()
    with caplog.at_level(logging.ERROR, logger="openamct.training.keeper"):
        m(X)
        m.train()
        m(X)
        m.eval()
        m(X)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "cannot be written" in errors[0].getMessage()
    folder.mkdir()
    m.train()
    m(X)
    m.eval()
    m(X)  # written as soon as it can be
    assert "record {" in (folder / "r.txt").read_text()


# -- point 12: dtypes ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_non_float32_models_are_refused_at_create_naming_the_dtype(tmp_path, dtype):
    with pytest.raises(ValueError, match=rf"model has {dtype} tensors \('conv.weight'\): openamct trains and exports "
                                         r"float32 models"):
        _create(tmp_path, Net().to(dtype), X.to(dtype))
    assert not os.path.exists(tmp_path / "r.txt")


# -- point 13: modules the exporter cannot write ---------------------------------------------

def test_channel_shuffle_is_found_at_create(tmp_path):
    with pytest.raises(ValueError, match=r"module 'extra' \(ChannelShuffle\) cannot be exported to ONNX "
                                         r"\(aten::channel_shuffle has no ONNX export at opset 17\)"):
        _create(tmp_path, Net(nn.ChannelShuffle(2)))


def test_an_export_failure_is_one_line_naming_the_op(tmp_path):
    class RunningMax(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return torch.cummax(self.fc(x), dim=1)[0]  # aten::cummax has no ONNX export

    x = torch.randn(2, 5, 8)
    m = amct.create_quant_retrain_model(_cfg(tmp_path), RunningMax(), str(tmp_path / "r.txt"), x)
    m.train()
    m(x)
    with pytest.raises(ValueError) as info:
        amct.save_quant_retrain_model(_cfg(tmp_path), m, str(tmp_path / "r.txt"), str(tmp_path / "m"), x)
    msg = str(info.value)
    assert msg.startswith("save_*: ONNX export failed: Exporting the operator 'aten::cummax' to ONNX opset "
                          "version 17 is not supported")
    assert "\n" not in msg and info.value.__cause__ is None
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".onnx")]


# -- point 14: models and data openamct cannot use -------------------------------------------

class Locked(Net):
    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()


@pytest.mark.parametrize("make,msg", [
    (lambda: torch.jit.script(Net()), r"model: '\(the model\)' is a TorchScript module"),
    (lambda: torch.jit.trace(Net(), X), r"model: '\(the model\)' is a TorchScript module"),
    (lambda: Net(torch.jit.script(nn.ReLU())), r"model: 'extra' is a TorchScript module"),
    (Locked, r"model cannot be deep-copied \(TypeError: cannot pickle '_thread.lock' object\)"),
    (lambda: torch.compile(Net()), r"model was compiled with torch.compile: pass the module before compiling"),
])
def test_models_openamct_cannot_use_get_one_clear_line(tmp_path, make, msg):
    with pytest.raises(ValueError, match=msg):
        _create(tmp_path, make())


def test_nan_weights_and_data_are_named(tmp_path):
    net = Net()
    with torch.no_grad():
        net.fc.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"model: 'fc.weight' holds NaN/inf values"):
        _create(tmp_path, net)
    bad = X.clone()
    bad[0, 0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"input_data holds NaN/inf values"):
        _create(tmp_path, Net(), bad)
    m = _create(tmp_path, Net())
    m.train()
    with pytest.raises(ValueError, match=r"layer 'conv': its input batch holds NaN/inf values, so its activation "
                                         r"clips cannot be initialised"):
        m(bad)


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), float("-inf")])
def test_the_finite_check_sees_every_nan_and_inf_and_only_those(bad):
    from openamct._checks import all_finite

    t = torch.full((3, 1 << 20), 3e38)  # finite values whose sum overflows: checked value by value
    assert all_finite(t)
    assert all_finite(torch.randn(5, 7)) and all_finite(torch.empty(0))
    if bad is not None:
        t[2, 12345] = bad
        assert not all_finite(t)
        small = torch.randn(4, 4)
        small[1, 2] = bad
        assert not all_finite(small)
