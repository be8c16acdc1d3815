"""Upstream's distillation family: the AMCTDistillConfig proto, the JSON, group-wise distill on a
quantized (and a filter-pruned) student, the teacher dump, save and exact restore, and the
errors raised before any work."""

from __future__ import annotations

import json

import pytest
import torch
from google.protobuf import text_format
from torch import nn

import openamct as amct
from openamct.distill.distill_config_pb2 import AMCTDistillConfig
from openamct.distill.distill_sample import DistillSampleBase
from openamct.distill.groups import chunk, find_blocks
from tests.models import ResBlockNet, TinyTransformerBlock, example_input


class _Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))) + x)


class SmallResNet(nn.Module):
    """stem -> two residual blocks -> pool -> fc: the automatic blocks are stem, blocks.0,
    blocks.1, fc."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.blocks = nn.Sequential(_Block(8), _Block(8))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))


class TwoBlockTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([TinyTransformerBlock(), TinyTransformerBlock()])
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _teacher() -> SmallResNet:
    torch.manual_seed(0)
    m = SmallResNet()
    with torch.no_grad():  # BN statistics that are not the identity
        m.train()(torch.randn(16, 3, 8, 8))
    return m.eval()


def _loader(n: int = 6, seed: int = 1) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 3, 8, 8, generator=g), torch.zeros(4)) for _ in range(n)]


def _cfg(tmp_path, text: str) -> str:
    p = tmp_path / "distill.cfg"
    p.write_text(text)
    return str(p)


def test_proto_field_numbers_are_upstreams():
    f = AMCTDistillConfig.DESCRIPTOR.fields_by_name
    numbers = {n: f[n].number for n in f}
    assert numbers == {"batch_num": 1, "group_size": 2, "data_dump": 3, "distill_group": 10,
                       "distill_data_quant_config": 11, "distill_weight_quant_config": 12,
                       "distill_override_layers": 110, "distill_override_layer_types": 111,
                       "quant_skip_layers": 120, "quant_skip_layer_types": 121}
    msg = text_format.Parse(
        "batch_num: 2 group_size: 2 data_dump: true distill_group { start_layer_name: 'a' end_layer_name: 'b' }"
        " distill_data_quant_config { ulq_quantize { clip_max_min { clip_max: 6 clip_min: -6 } fixed_min: true } }"
        " distill_weight_quant_config { ulq_distill { dst_type: INT4 channel_wise: true } }", AMCTDistillConfig())
    assert msg.SerializeToString().hex().startswith("0802" + "1002" + "1801")
    assert msg.distill_data_quant_config.ulq_quantize.clip_max_min.clip_min == -6


def test_blocks_found_between_residual_joins():
    assert find_blocks(_teacher()) == ["stem", "blocks.0", "blocks.1", "fc"]
    assert find_blocks(TwoBlockTransformer()) == ["layers.0", "layers.1", "head"]
    assert chunk(["a", "b", "c"], 2) == [["a", "b"], ["c"]]


def test_config_json_is_upstreams_layout(tmp_path):
    m, x = _teacher(), torch.randn(2, 3, 8, 8)
    cfg = _cfg(tmp_path, "batch_num: 2\ngroup_size: 2\nquant_skip_layers: 'fc'\n"
                         "distill_weight_quant_config { arq_distill { channel_wise: false } }\n")
    out = str(tmp_path / "c.json")
    amct.create_distill_config(out, m, x, cfg)
    data = json.loads(open(out).read())
    assert (data["version"], data["batch_num"], data["group_size"], data["data_dump"]) == (1, 2, 2, False)
    assert data["distill_group"] == [["stem", "blocks.0"], ["blocks.1", "fc"]]
    assert data["fc"] == {"quant_enable": False}
    assert data["stem.0"]["distill_weight_config"] == {"algo": "arq_distill", "channel_wise": False, "dst_type": "INT8"}
    assert data["stem.0"]["distill_data_config"]["algo"] == "ulq_quantize"
    cfg = _cfg(tmp_path, "distill_group { start_layer_name: 'blocks.0' end_layer_name: 'blocks.1' }\n"
                         "distill_override_layer_types { layer_type: 'Linear' distill_weight_quant_config"
                         " { arq_distill { dst_type: INT4 channel_wise: true } } }\n")
    amct.create_distill_config(out, m, x, cfg)
    data = json.loads(open(out).read())
    assert data["distill_group"] == [["blocks.0", "blocks.1"]]
    assert data["fc"]["distill_weight_config"]["dst_type"] == "INT4"
    student = amct.create_distill_model(out, m, x)
    assert student.fc.wts_quant.format.name == "INT4" and student.stem[0].wts_quant.format.name == "INT8"


def _group_errors(student, teacher, xs) -> list[float]:
    """Normalised MSE of each block's output with the teacher's input fed, as distill trains it."""
    from openamct.distill.groups import Taps, normalised_mse, run_model

    groups = [["stem", "stem.2"], ["blocks.0"], ["blocks.1"]]
    t, s = Taps(teacher, groups), Taps(student, groups, feed=True)
    errs = [0.0] * len(groups)
    with torch.no_grad():
        for x in xs:
            t.clear()
            s.clear()
            run_model(teacher, x)
            s.feed.update(t.inputs)
            run_model(student, x)
            for g in range(len(groups)):
                errs[g] += float(normalised_mse(s.outputs[g], t.outputs[g]))
    t.remove()
    s.remove()
    return errs


def test_distill_int8_trains_each_group_and_leaves_the_teacher(tmp_path):
    m, x = _teacher(), torch.randn(2, 3, 8, 8)
    out = str(tmp_path / "c.json")
    amct.create_distill_config(out, m, x)
    s = amct.create_distill_model(out, m, x)
    before_state = {k: v.clone() for k, v in m.state_dict().items()}
    xs = [b[0] for b in _loader(2, seed=7)]
    loader = _loader(5)
    s.eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        s(loader[0][0])  # clips from real inputs
        for layer in (s.stem[0], s.blocks[0].conv1, s.blocks[1].conv2):  # a damaged student
            layer.weight.add_(0.5 * layer.weight.std() * torch.randn(layer.weight.shape, generator=g))
    e0 = _group_errors(s, m, xs)
    ret = amct.distill(m, s, out, loader, epochs=3, lr=3e-3)
    assert ret is s and not s.training and not m.training
    e1 = _group_errors(s, m, xs)
    assert all(a < 0.7 * b for a, b in zip(e1, e0)), (e0, e1)
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before_state.items())
    assert not m._forward_hooks and not m.stem._forward_pre_hooks and not s.blocks[0]._forward_pre_hooks


def test_data_dump_gives_the_same_training(tmp_path):
    m, x = _teacher(), torch.randn(2, 3, 8, 8)
    results = []
    for dump in (False, True):
        out = str(tmp_path / f"c{int(dump)}.json")
        amct.create_distill_config(out, m, x, _cfg(tmp_path, f"data_dump: {str(dump).lower()}\n"))
        torch.manual_seed(3)
        s = amct.create_distill_model(out, m, x)
        amct.distill(m, s, out, _loader(3), epochs=2, lr=1e-3)
        results.append(s.state_dict())
    for k, v in results[0].items():
        torch.testing.assert_close(results[1][k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # end to end: create, distill, restore, save
def test_filter_pruned_int8_student_distills_saves_and_restores_exactly(tmp_path):
    m = ResBlockNet().eval()
    x = example_input("ResBlockNet")
    cfg = tmp_path / "p.cfg"
    cfg.write_text("retrain_data_quant_config { ulq_quantize { } }\n"
                   "retrain_weight_quant_config { arq_retrain { channel_wise: true } }\n"
                   "prune_config { filter_pruner { balanced_l2_norm_filter_prune { prune_ratio: 0.5 "
                   "ascend_optimized: false } } }\n")
    rec, js, pth = str(tmp_path / "r.record"), str(tmp_path / "d.json"), str(tmp_path / "s.pth")
    s = amct.create_compressed_retrain_model(m, x, str(cfg), rec)
    assert any(p.shape != q.shape for p, q in zip(s.state_dict().values(), m.state_dict().values()))
    amct.create_distill_config(js, m, x)
    g = torch.Generator().manual_seed(2)
    loader = [torch.randn(4, *x.shape[1:], generator=g) for _ in range(4)]
    amct.distill(m, s, js, loader, epochs=2)
    torch.save(s.state_dict(), pth)
    with torch.no_grad():
        want = s(x)
    r = amct.restore_compressed_retrain_model(m, x, str(cfg), rec, pth)
    with torch.no_grad():
        got = r.eval()(x)
    assert torch.equal(got, want)
    amct.save_distill_model(s, str(tmp_path / "onnx" / "m"), x, record_file=rec)
    assert (tmp_path / "onnx" / "m_deploy_model.onnx").stat().st_size > 0


def test_keyword_inputs_and_custom_sample(tmp_path):
    m = TwoBlockTransformer().eval()
    x = torch.randn(2, 5, 32)
    out = str(tmp_path / "c.json")
    amct.create_distill_config(out, m, x)
    s = amct.create_distill_model(out, m, x)

    class Sample(DistillSampleBase):
        def get_model_input_data(self, samples):
            return samples["x"]

    loader = [{"x": torch.randn(2, 5, 32), "y": 0} for _ in range(3)]
    amct.distill(m, s, out, loader, sample_instance=Sample(), loss=nn.MSELoss())
    with pytest.raises(ValueError, match="sample_instance"):
        amct.distill(m, s, out, loader)


def test_bad_input_refused_before_any_work(tmp_path):
    m, x = _teacher(), torch.randn(2, 3, 8, 8)
    out = str(tmp_path / "c.json")
    amct.create_distill_config(out, m, x)
    s = amct.create_distill_model(out, m, x)
    state = {k: v.clone() for k, v in s.state_dict().items()}
    with pytest.raises(ValueError, match="train_loader is empty"):
        amct.distill(m, s, out, [])
    with pytest.raises(ValueError, match="epochs must be >= 1"):
        amct.distill(m, s, out, _loader(), epochs=0)
    with pytest.raises(ValueError, match="not returned by an openamct create"):
        amct.distill(m, SmallResNet(), out, _loader())
    with pytest.raises(ValueError, match="not derived from model"):
        amct.distill(TwoBlockTransformer(), s, out, _loader())
    data = json.loads(open(out).read())
    data["distill_group"] = [["stem", "blocks.7"]]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"distill_group\[0\].*'blocks.7'"):
        amct.distill(m, s, str(bad), _loader())
    cfg = _cfg(tmp_path, "distill_group { start_layer_name: 'stem' end_layer_name: 'nope' }\n")
    with pytest.raises(ValueError, match=r"distill_group\[0\].*'nope'"):
        amct.create_distill_config(str(tmp_path / "c2.json"), m, x, cfg)
    cfg = _cfg(tmp_path, "distill_weight_quant_config { arq_distill { dst_type: INT4 channel_wise: true } }\n")
    with pytest.raises(ValueError, match=r"'stem.0' \(Conv2d\): dst_type INT4 cannot be deployed"):
        amct.create_distill_config(str(tmp_path / "c3.json"), m, x, cfg)
    assert all(torch.equal(v, s.state_dict()[k]) for k, v in state.items())


def test_int4_linear_deploys_as_4bit_weights_ort_runs(tmp_path):
    import numpy as np
    import onnx
    import onnxruntime as ort

    from openamct.distill.int4_deploy import pack_int4_weights

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 16)).eval()
    x = torch.randn(3, 48)
    out = str(tmp_path / "c.json")
    amct.create_distill_config(out, m, x, _cfg(tmp_path, "distill_weight_quant_config { arq_distill "
                                                         "{ dst_type: INT4 channel_wise: true } }\n"))
    s = amct.create_distill_model(out, m, x)
    with torch.no_grad():
        want = s.eval()(x).numpy()
    fake, deploy = amct.save_distill_model(s, str(tmp_path / "m"), x)
    proto = onnx.load(deploy)
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count("MatMulNBits") == 2 and "Gemm" not in ops
    q4 = [i for i in proto.graph.initializer if i.name.endswith("_q4")]
    assert len(q4) == 2 and all(i.data_type == onnx.TensorProto.UINT8 for i in q4)
    assert sum(int(np.prod(i.dims)) for i in q4) == (48 * 64 + 64 * 16) // 2
    got = ort.InferenceSession(deploy, providers=["CPUExecutionProvider"]).run(None, {"input": x.numpy()})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # the fake-quant ONNX already holds the INT4 weights as INT4 initializers (opset 21), which
    # ORT reads to the same numbers; nothing is left for the packer
    proto = onnx.load(fake)
    assert pack_int4_weights(proto, "dq_int4") == 0
    assert sum(i.data_type == onnx.TensorProto.INT4 for i in proto.graph.initializer) >= 2
    sess = ort.InferenceSession(fake, providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"input": x.numpy()})[0], want, rtol=1e-4, atol=1e-4)
