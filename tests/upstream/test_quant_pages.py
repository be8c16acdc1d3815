"""Upstream's QAT pages: create_quant_retrain_config.md, create_quant_retrain_model.md,
restore_quant_retrain_model.md, save_quant_retrain_model.md, and docs/README.md's
量化感知训练 flow (with its resume from a checkpoint)."""

import json
import os

import torch

import openamct as amct
from tests.upstream.pages import (
    INPUT_SHAPE,
    INT8_CFG,
    build_model,
    close,
    onnx_run,
    saved_pair,
    train,
    write,
)

TMP = "TMP"  # the pages' TMP folder: they never make it, the call does


def test_create_quant_retrain_config_page(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    model = build_model()
    input_data = tuple([torch.randn(INPUT_SHAPE)])
    amct.create_quant_retrain_config(config_file="./configs/config.json",
                                     model=model,
                                     input_data=input_data)
    data = json.loads((tmp_path / "configs" / "config.json").read_text())
    assert data["version"] == 1 and data["batch_num"] == 1
    assert [k for k in data if k not in ("version", "batch_num")] == ["conv1", "conv2", "fc"]
    assert data["conv1"]["retrain_enable"] is True
    assert data["conv1"]["retrain_weight_config"]["channel_wise"] is True  # the page's sample: convs per channel
    assert data["fc"]["retrain_weight_config"]["channel_wise"] is False  # and Linear per tensor


def _qat(tmp_path):
    model = build_model()
    input_data = tuple([torch.randn(INPUT_SHAPE)])
    amct.create_quant_retrain_config(config_file="./configs/config.json", model=model, input_data=input_data)
    config_json_file = "./configs/config.json"
    scale_offset_record_file = os.path.join(TMP, 'scale_offset_record.txt')
    quant_retrain_model = amct.create_quant_retrain_model(
        config_json_file,
        model,
        scale_offset_record_file,
        input_data)
    return model, input_data, quant_retrain_model


def test_create_quant_retrain_model_page(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    model, input_data, quant_retrain_model = _qat(tmp_path)
    assert quant_retrain_model is not model
    assert (tmp_path / TMP / "scale_offset_record.txt").is_file()
    train(quant_retrain_model)
    assert "record" in (tmp_path / TMP / "scale_offset_record.txt").read_text()


def test_restore_quant_retrain_model_page_with_a_new_record_path(monkeypatch, tmp_path):
    """The page restores into scale_offset_record.txt of a fresh TMP: upstream's restore takes
    the record path as an output."""
    monkeypatch.chdir(tmp_path)
    _, _, trained = _qat(tmp_path)
    train(trained)
    pth_file = "qat.pth"
    torch.save(trained.state_dict(), pth_file)
    x = torch.randn(INPUT_SHAPE)
    with torch.no_grad():
        want = trained(x)

    TMP = "TMP2"  # a session after the interruption: no record there yet
    model = build_model()
    input_data = tuple([torch.randn(INPUT_SHAPE)])
    config_json_file = "./configs/config.json"
    scale_offset_record_file = os.path.join(TMP, 'scale_offset_record.txt')
    quant_retrain_model = amct.restore_quant_retrain_model(
        config_json_file,
        model,
        scale_offset_record_file,
        input_data,
        pth_file)
    with torch.no_grad():
        assert torch.equal(quant_retrain_model.eval()(x), want)
    assert "record" in (tmp_path / TMP / "scale_offset_record.txt").read_text()


def test_save_quant_retrain_model_page(monkeypatch, tmp_path):
    """The page writes ``save_path="./results/model"`` before the positional ``input_data``
    (a SyntaxError) and passes ``model`` where it means the trained QAT model: called here with
    save_path in its place and the QAT model."""
    monkeypatch.chdir(tmp_path)
    _, input_data, quant_retrain_model = _qat(tmp_path)
    train(quant_retrain_model)
    config_json_file = "./configs/config.json"
    record_file = os.path.join(TMP, 'scale_offset_record.txt')
    amct.save_quant_retrain_model(
        config_json_file,
        quant_retrain_model,
        record_file,
        "./results/model",
        input_data,
        input_names=['input'],
        output_names=['output'],
        dynamic_axes={'input': {0: 'batch_size'},
                      'output': {0: 'batch_size'}})
    fake, deploy = saved_pair("./results/model")
    x = torch.randn(5, *INPUT_SHAPE[1:])  # another batch size: the dynamic axis
    with torch.no_grad():
        want = quant_retrain_model(x)
    assert close(onnx_run(fake, x), want, 1e-4)
    assert close(onnx_run(deploy, x), want, 0.1)


def test_readme_qat_flow_and_its_resume(monkeypatch, tmp_path):
    """docs/README.md, 量化感知训练 调用示例. Its resume saves ``model=ori_model``, meaning the
    restored QAT model; and its step 4 reads './results/user_model_fake_quant_model.onnx'
    where the save wrote './result/user_model...' (two folder names): read where it wrote."""
    monkeypatch.chdir(tmp_path)
    ori_model = build_model()
    ori_model_input_data = tuple([torch.randn(INPUT_SHAPE)])
    config_file = './tmp/config.json'
    simple_cfg = write('./retrain.cfg', INT8_CFG)
    amct.create_quant_retrain_config(config_file=config_file,
                                     model=ori_model,
                                     input_data=ori_model_input_data,
                                     config_defination=simple_cfg)
    record_file = './tmp/record.txt'
    quant_retrain_model = amct.create_quant_retrain_model(config_file=config_file,
                                                          model=ori_model,
                                                          record_file=record_file,
                                                          input_data=ori_model_input_data)
    train(quant_retrain_model)
    os.makedirs("ckpt")
    quant_pth_file = './ckpt/user_model_newest.ckpt'
    torch.save(quant_retrain_model.state_dict(), quant_pth_file)
    quant_model_path = './result/user_model'
    amct.save_quant_retrain_model(config_file=config_file,
                                  model=quant_retrain_model,
                                  record_file=record_file,
                                  save_path=quant_model_path,
                                  input_data=ori_model_input_data)
    x = ori_model_input_data[0]
    with torch.no_grad():
        want = quant_retrain_model(x)
    assert close(onnx_run('./result/user_model_fake_quant_model.onnx', x), want, 1e-4)

    ori_model = build_model()  # the resume, in a new session
    quant_retrain_model = amct.restore_quant_retrain_model(config_file=config_file,
                                                           model=ori_model,
                                                           record_file=record_file,
                                                           input_data=ori_model_input_data,
                                                           pth_file=quant_pth_file)
    with torch.no_grad():
        assert torch.equal(quant_retrain_model.eval()(x), want)
    train(quant_retrain_model)
    amct.save_quant_retrain_model(config_file=config_file,
                                  model=quant_retrain_model,
                                  record_file=record_file,
                                  save_path=quant_model_path,
                                  input_data=ori_model_input_data)
    with torch.no_grad():
        want = quant_retrain_model(x)
    assert close(onnx_run('./result/user_model_fake_quant_model.onnx', x), want, 1e-4)
