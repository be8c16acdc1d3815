"""A tensor that a quantized conv and a residual Add read gets that conv's input quantizer in
training too, so the deploy file's QLinearAdd reads what the fake-quant Add reads: also where
the tensor is a wrapped activation's output (a Hardswish stem), or a conv's output through an
``nn.Identity`` activation and a ``Dropout(p=0)`` (timm's ConvNormAct, as in EfficientViT-MIT).
Such a conv gets no output quantizer of its own: two in a row would round twice, and ONNX
Runtime's fused kernels merge the pair. A conv whose own output (after its BN, as in
torchvision's MobileNetV3 and MNASNet) they read has that quantizer as its output quantizer:
one grid, and no requantizing Q/DQ pair between the conv and its readers."""

import numpy as np
import onnx
import pytest
import torch
from torch import nn

import openamct as amct
from openamct.compressed.layer import CompressedLayer
from openamct.quant.activation import QuantizedActivation
from openamct.quant.residual import output_hooks
from openamct.record.file_io import read_record, write_record
from openamct.techniques.activation_quant import ALGORITHM
from openamct.techniques.base import selective_algorithm
from tests.numerics import cosine
from tests.runtimes import ort_run
from tests.training import checkpoint_and_save, sgd_steps

CFG = """retrain_data_quant_config: { ulq_quantize: { } }
retrain_weight_quant_config: { arq_retrain: { channel_wise: true } }
"""


class ConvNormAct(nn.Module):
    """timm's efficientvit_mit ConvNormAct: dropout, conv, BN, an activation or nn.Identity()."""

    def __init__(self, cin: int, cout: int, k: int = 1, groups: int = 1, act: bool = True) -> None:
        super().__init__()
        self.dropout = nn.Dropout(0.0)
        self.conv = nn.Conv2d(cin, cout, k, padding=k // 2, groups=groups, bias=False)
        self.norm = nn.BatchNorm2d(cout)
        self.act = nn.Hardswish() if act else nn.Identity()

    def forward(self, x):
        return self.act(self.norm(self.conv(self.dropout(x))))


class Block(nn.Module):
    """Depthwise then pointwise (no activation after it), with or without the residual Add; the
    pointwise one timm's ConvNormAct or torchvision's plain conv + BN."""

    def __init__(self, cin: int, cout: int, residual: bool, plain: bool = False) -> None:
        super().__init__()
        self.depth = ConvNormAct(cin, cin, 3, groups=cin)
        self.point = (nn.Sequential(nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout)) if plain
                      else ConvNormAct(cin, cout, act=False))
        self.shortcut = nn.Identity() if residual else None

    def forward(self, x):
        res = self.point(self.depth(x))
        return res + self.shortcut(x) if self.shortcut is not None else res


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = ConvNormAct(3, 8, 3)
        self.b0 = Block(8, 8, residual=True)  # reads the stem's Hardswish: conv and Add
        self.b1 = Block(8, 16, residual=False)  # its output (through Identity): b2's conv and Add
        self.b2 = Block(16, 16, residual=True)
        self.b3 = Block(16, 16, residual=False, plain=True)  # its conv's output: b4's conv and Add
        self.b4 = Block(16, 16, residual=True)
        # (a conv reads the last sum: one the pool read would get a range from the Add's inputs in
        # deploy, a rounding step of its own: export/deploy.py)
        self.head = ConvNormAct(16, 32)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        x = self.b2(self.b1(self.b0(self.stem(x))))
        return self.fc(self.pool(self.head(self.b4(self.b3(x)))).flatten(1))


def _model():
    torch.manual_seed(0)
    m = Net()
    with torch.no_grad():
        for bn in m.modules():
            if isinstance(bn, nn.BatchNorm2d):
                bn.weight.uniform_(0.75, 1.25)
                bn.running_var.uniform_(0.5, 1.5)
    return m.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("ar")
    cfg, rec = str(d / "q.cfg"), str(d / "rec.txt")
    with open(cfg, "w") as f:
        f.write(CFG)
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    c = amct.create_compressed_retrain_model(_model(), x, cfg, rec)
    sgd_steps(c, lambda m: m(torch.randn(4, 3, 16, 16)), steps=2, lr=1e-3)
    ref, ckpt = checkpoint_and_save(c, d, x, rec)
    return {"dir": d, "cfg": cfg, "rec": rec, "ckpt": ckpt, "x": x, "ref": ref, "model": c}


def test_residual_tensors_take_the_reading_conv_quantizer(saved):
    c = saved["model"]
    assert isinstance(c.stem.act, QuantizedActivation)
    hooks = dict(output_hooks(c))
    assert hooks["stem.act"].quantizer is c.b0.depth.conv.act_quant  # a wrapped activation's output
    # one hook per tensor: not again on the Identity and Dropout that pass it on
    assert sorted(hooks) == ["stem.act"]
    assert c.b0.depth.conv.input_on_grid
    # a conv's output that the next block's conv and Add read, after its BN (b3) or through an
    # Identity and a Dropout(p=0) (b1): the reader's quantizer is its output quantizer, and the
    # reader does not apply it again
    assert c.b1.point.conv.out_quant is c.b2.depth.conv.act_quant
    assert c.b3.point[0].out_quant is c.b4.depth.conv.act_quant
    assert c.b2.depth.conv.input_on_grid and c.b4.depth.conv.input_on_grid
    # read by b0's Add alone: a trained quantizer of its own
    assert c.b0.point.conv.out_quant is not None
    assert c.b0.point.conv.out_quant is not c.b1.depth.conv.act_quant


def test_deploy_has_no_requantizing_pair(saved):
    """The Q -> DQ -> Q chains of the deploy file, as ORT optimises it: none."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.optimized_model_filepath = str(saved["dir"] / "opt.onnx")
    ort.InferenceSession(str(saved["dir"] / "m_deploy_model.onnx"), so, providers=["CPUExecutionProvider"])
    g = onnx.load(so.optimized_model_filepath).graph
    producer = {o: n for n in g.node for o in n.output}
    chains = [n.name for n in g.node if n.op_type == "QuantizeLinear" and (dq := producer.get(n.input[0])) is not None
              and dq.op_type == "DequantizeLinear"]
    assert chains == []


def test_fake_quant_and_deploy_compute_the_training_function(saved):
    d, x = saved["dir"], saved["x"]
    fake = ort_run(d / "m_fake_quant_model.onnx", x)
    deploy = ort_run(d / "m_deploy_model.onnx", x, optimised=True)  # ORT's fused int8 kernels
    scale = np.abs(saved["ref"]).max()
    assert np.abs(fake - saved["ref"]).max() <= 1e-4 * scale
    assert cosine(deploy, fake) >= 0.9999


def test_restore_replays_the_hooks(saved):
    r = amct.restore_compressed_retrain_model(_model(), saved["x"], saved["cfg"], saved["rec"], saved["ckpt"],
                                              "state_dict")
    r.eval()
    with torch.no_grad():
        assert np.array_equal(r(saved["x"]).numpy(), saved["ref"])
    assert sorted(n for n, _ in output_hooks(r)) == ["stem.act"]
    assert r.b3.point[0].out_quant is r.b4.depth.conv.act_quant
    assert all(isinstance(m, CompressedLayer) for m in (r.stem.conv, r.b2.point.conv))


def test_restore_refuses_a_record_with_its_own_output_quantizer(saved, tmp_path):
    """A record from a version that gave b3's conv an output quantizer of its own (another scale
    than its reader's): its checkpoint holds two sets of clips where this version has one."""
    record = read_record(saved["rec"])
    entry = next(pr.selective_prune for pr in record.prune_record
                 if selective_algorithm(pr) == ALGORITHM and pr.selective_prune.name == "b3.point.0")
    scale = next(a for a in entry.attr if a.name == "scale_d")
    scale.floats[0] *= 1.5
    rec = str(tmp_path / "old.txt")
    with open(saved["rec"]) as f:
        header = "".join(line for line in f if line.startswith("#"))  # the model's fingerprint
    write_record(rec, record, header)
    with pytest.raises(ValueError, match=r"'b3\.point\.0'.*earlier version"):
        amct.restore_compressed_retrain_model(_model(), saved["x"], saved["cfg"], rec, saved["ckpt"], "state_dict")
