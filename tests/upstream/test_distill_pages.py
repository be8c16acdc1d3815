"""Upstream's distillation pages: create_distill_config.md, create_distill_model.md,
distill.md, save_distill_model.md, docs/README.md's 逐层蒸馏 flow, and the distillation calls
of upstream's tests/amct_pytorch/testcase_python/distill/test_distill_interface.py (a student
built by hand from Conv2dQAT)."""

import json
import logging

import pytest
import torch
import torch.nn as nn

import openamct as amct
from openamct.distill.distill_sample import DistillSampleBase  # upstream's module path
from openamct.nn.module.quantization.conv2d import Conv2dQAT
from tests.upstream.pages import (
    FILTER_CFG,
    INPUT_SHAPE,
    INT8_CFG,
    build_model,
    close,
    onnx_run,
    saved_pair,
    write,
)

DISTILL_CFG = ('distill_data_quant_config { ulq_quantize { } }\n'
               'distill_weight_quant_config { arq_distill { channel_wise: true } }\n')


def test_create_distill_config_page(monkeypatch, tmp_path):
    """The page passes ``model, input_data`` positionally after ``config_file=`` (a
    SyntaxError): called with keywords. Its JSON sample groups ["conv1", "bn", "relu"]."""
    monkeypatch.chdir(tmp_path)
    write("./configs/distill.cfg", DISTILL_CFG)
    model = build_model()
    input_data = tuple([torch.randn(INPUT_SHAPE)])
    amct.create_distill_config(config_file="./configs/config.json",
                               model=model,
                               input_data=input_data,
                               config_defination="./configs/distill.cfg")
    data = json.loads((tmp_path / "configs" / "config.json").read_text())
    assert data["distill_group"] == [["conv1", "bn", "relu"], ["conv2", "bn2", "relu2"], ["fc"]]
    assert data["conv1"]["quant_enable"] is True
    assert data["conv1"]["distill_weight_config"] == {"algo": "arq_distill", "channel_wise": True, "dst_type": "INT8"}


@pytest.mark.parametrize("skip", ['quant_skip_layers: "conv1"\nquant_skip_layer_types: "Linear"\n'])
def test_a_skip_list_wins_over_distill_overrides(monkeypatch, tmp_path, skip):
    """Upstream reads the skip lists first: a skipped layer stays float even where a layer or
    type override also names it (it was written with quant_enable true)."""
    monkeypatch.chdir(tmp_path)
    write("d.cfg", DISTILL_CFG + skip +
          'distill_override_layers { layer_name: "conv1" '
          'distill_weight_quant_config { arq_distill { channel_wise: false } } }\n'
          'distill_override_layer_types { layer_type: "Linear" '
          'distill_weight_quant_config { arq_distill { channel_wise: false } } }\n')
    amct.create_distill_config("c.json", build_model(), (torch.randn(INPUT_SHAPE),), config_defination="d.cfg")
    data = json.loads((tmp_path / "c.json").read_text())
    assert {k: v["quant_enable"] for k, v in data.items() if isinstance(v, dict)} == \
        {"conv1": False, "conv2": True, "fc": False}
    student = amct.create_distill_model("c.json", build_model(), (torch.randn(INPUT_SHAPE),))
    assert type(student.conv1) is nn.Conv2d and type(student.fc) is nn.Linear


def test_a_distill_type_the_model_lacks_is_refused(monkeypatch, tmp_path):
    """Upstream's check: "quant_skip_layer_types[...] not exist or supported"."""
    monkeypatch.chdir(tmp_path)
    write("d.cfg", DISTILL_CFG + 'quant_skip_layer_types: "Conv3d"\n')
    with pytest.raises(ValueError, match="line 3:1: quant_skip_layer_types: the model has no layer of type 'Conv3d'"):
        amct.create_distill_config("c.json", build_model(), (torch.randn(INPUT_SHAPE),), config_defination="d.cfg")


def test_distill_pages_and_readme_flow(monkeypatch, tmp_path):
    """create_distill_model.md, distill.md, save_distill_model.md in a row (the README's
    逐层蒸馏 flow makes the same calls with keywords). distill.md misses the comma after
    ``compress_model`` (a SyntaxError); its ``DataLoader(input_data)`` iterates the tuple, so each
    batch would hold one axis too many: the loader here iterates the batch's samples.
    save_distill_model.md saves ``model``, meaning the distilled model."""
    monkeypatch.chdir(tmp_path)
    model = build_model()
    input_data = tuple([torch.randn(INPUT_SHAPE)])
    amct.create_distill_config(config_file='./tmp/config.json', model=model, input_data=input_data)
    config_json_file = './tmp/config.json'
    compress_model = amct.create_distill_model(
        config_json_file,
        model,
        input_data)
    train_loader = torch.utils.data.DataLoader(input_data[0])
    loss = torch.nn.MSELoss()
    optimizer = torch.optim.AdamW(compress_model.parameters(), lr=0.1)
    distill_model = amct.distill(
        model,
        compress_model,
        config_json_file,
        train_loader,
        epochs=1,
        lr=1e-3,
        sample_instance=None,
        loss=loss,
        optimizer=optimizer)
    assert distill_model is compress_model and not distill_model.training
    amct.save_distill_model(
        distill_model,
        "./model/distilled",
        input_data,
        record_file="./results/records.txt",
        input_names=['input'],
        output_names=['output'],
        dynamic_axes={'input': {0: 'batch_size'},
                      'output': {0: 'batch_size'}})
    fake, deploy = saved_pair("./model/distilled")
    x = torch.randn(3, *INPUT_SHAPE[1:])
    with torch.no_grad():
        want = distill_model(x)
    assert close(onnx_run(fake, x), want, 1e-4) and close(onnx_run(deploy, x), want, 0.1)
    assert "record" in (tmp_path / "results" / "records.txt").read_text()


class DistillNet(nn.Module):
    def __init__(self, qat: bool = False):
        super().__init__()
        self.conv = Conv2dQAT(2, 2, kernel_size=3, bias=False) if qat else nn.Conv2d(2, 2, kernel_size=3, bias=False)

    def forward(self, x):
        return self.conv(x)


class ModelMultiTensorInput(DistillSampleBase):
    @staticmethod
    def get_model_input_data(samples):
        return samples


def test_upstream_test_distills_a_student_built_from_qat_modules(monkeypatch, tmp_path):
    """test_distill_interface.py: DistillQATNet (a Conv2dQAT), its distill_cfg.json, a
    one-sample DataLoader; then save_distill_model on that student."""
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    write("cfgs/distill_cfg.json", json.dumps({
        "version": 1, "batch_num": 1, "group_size": 1, "data_dump": False, "distill_group": [["conv"]],
        "conv": {"quant_enable": True, "distill_data_config": {"algo": "ulq_quantize", "dst_type": "INT8"},
                 "distill_weight_config": {"algo": "arq_distill", "channel_wise": True, "dst_type": "INT8"}}}))
    data = torch.randn(4, 2, 4, 4)
    train_loader = torch.utils.data.DataLoader(data)
    torch_model, qat_model = DistillNet(), DistillNet(qat=True)
    before = qat_model.conv.weight.detach().clone()
    optimizer = torch.optim.AdamW(qat_model.parameters(), lr=0.1)
    amct.distill(torch_model, qat_model, "cfgs/distill_cfg.json", train_loader, epochs=1, loss=None,
                 optimizer=optimizer)
    assert not torch.equal(qat_model.conv.weight, before) and bool(qat_model.conv.act_quant.initialized)
    amct.save_distill_model(qat_model, "out/qat", data[:1])
    with torch.no_grad():
        assert close(onnx_run("out/qat_fake_quant_model.onnx", data[:1]), qat_model(data[:1]), 1e-4)


def _pruned_student(tmp_path):
    teacher = build_model()
    write(str(tmp_path / "f.cfg"), INT8_CFG + FILTER_CFG)
    student = amct.create_compressed_retrain_model(teacher, torch.randn(INPUT_SHAPE), str(tmp_path / "f.cfg"),
                                                   str(tmp_path / "f.record"))
    return teacher, student


def test_a_pruned_students_batchnorm_statistics_do_not_depend_on_batch_order(tmp_path, caplog):
    """A filter-pruned student's BatchNorm trains in distill; its running statistics are
    recomputed over the whole loader after each epoch, every batch alike. They followed the
    last batches (momentum 0.1): a loader sorted by class left them those of the last class.
    lr 1e-12: the weights do not move, so the two orders must end with the same statistics
    (the clips are set beforehand on one batch: distill's calibration reads the first batches)."""
    amct.create_distill_config(str(tmp_path / "c.json"), build_model(), (torch.randn(INPUT_SHAPE),))
    g = torch.Generator().manual_seed(5)
    batches = [torch.randn(INPUT_SHAPE, generator=g) * (1 + i) + i for i in range(4)]
    stats = []
    for loader in (batches, batches[::-1]):
        teacher, student = _pruned_student(tmp_path)
        with torch.no_grad():
            student.eval()(batches[0])
        amct.distill(teacher, student, str(tmp_path / "c.json"), loader, epochs=1, lr=1e-12)
        stats.append([t.clone() for m in student.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
                      for t in (m.running_mean, m.running_var)])
    assert len(stats[0]) == 4  # both (folded) BatchNorms
    for a, b in zip(*stats):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)
    teacher, student = _pruned_student(tmp_path)
    ordered = torch.utils.data.DataLoader(torch.cat(batches), batch_size=2)
    with caplog.at_level(logging.WARNING, logger="openamct.distill"):
        amct.distill(teacher, student, str(tmp_path / "c.json"), ordered, epochs=1, lr=1e-12)
    assert any("reads its dataset in order" in r.getMessage() for r in caplog.records)
