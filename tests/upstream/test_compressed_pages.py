"""Upstream's combined-compression pages: create_compressed_retrain_model.md,
restore_compressed_retrain_model.md, save_compressed_retrain_model.md, and docs/README.md's
组合压缩 flow (with its resume)."""

import os

import torch

import openamct as amct
from tests.upstream.pages import (
    FILTER_CFG,
    INPUT_SHAPE,
    INT8_CFG,
    build_model,
    close,
    onnx_run,
    saved_pair,
    train,
    write,
)

TMP = "TMP"
COMPRESSED_CFG = INT8_CFG + FILTER_CFG


def test_compressed_pages(monkeypatch, tmp_path):
    """create -> train -> checkpoint -> restore -> save, each call as its page makes it.
    restore_compressed_retrain_model.md builds ``input_data = tuple(torch.randn(input_shape))``
    (a tuple of the batch's rows, not of one batch), writes ``save_pth_path = /your/path/...``
    (not Python) and saves the *original* model's state dict, which holds none of the pruned
    and quantized model's tensors: here one batch, a path, and the compressed model's."""
    monkeypatch.chdir(tmp_path)
    # create_compressed_retrain_model.md
    model = build_model()
    input_data = tuple([torch.randn(INPUT_SHAPE)])
    record_file = os.path.join(TMP, 'compressed_record.txt')
    config_defination = write('./compressed_cfg.cfg', COMPRESSED_CFG)
    compressed_retrain_model = amct.create_compressed_retrain_model(
        model,
        input_data,
        config_defination,
        record_file)
    assert "prune_record" in (tmp_path / TMP / "compressed_record.txt").read_text()
    train(compressed_retrain_model)
    save_pth_path = "tmp.pth"
    torch.save({'state_dict': compressed_retrain_model.state_dict()}, save_pth_path)
    trained = compressed_retrain_model

    # restore_compressed_retrain_model.md
    model = build_model()
    input_data = tuple([torch.randn(INPUT_SHAPE)])
    record_file = os.path.join(TMP, 'compressed_record.txt')
    config_defination = './compressed_cfg.cfg'
    compressed_retrain_model = amct.restore_compressed_retrain_model(
        model,
        input_data,
        config_defination,
        record_file,
        save_pth_path,
        'state_dict')
    x = torch.randn(INPUT_SHAPE)
    with torch.no_grad():
        assert torch.equal(compressed_retrain_model.eval()(x), trained(x))

    # save_compressed_retrain_model.md
    train(compressed_retrain_model)
    input_data = tuple([torch.randn(INPUT_SHAPE)])
    save_path = os.path.join("OUTPUTS_DIR", 'custom_name')
    record_file = os.path.join(TMP, 'compressed_record.txt')
    amct.save_compressed_retrain_model(
        compressed_retrain_model,
        record_file,
        save_path,
        input_data,
        input_names=['input'],
        output_names=['output'],
        dynamic_axes={'input': {0: 'batch_size'}, 'output': {0: 'batch_size'}})
    fake, deploy = saved_pair(save_path)
    x = torch.randn(3, *INPUT_SHAPE[1:])
    with torch.no_grad():
        want = compressed_retrain_model(x)
    assert close(onnx_run(fake, x), want, 1e-4)
    assert close(onnx_run(deploy, x), want, 0.1)


def test_readme_compressed_flow(monkeypatch, tmp_path):
    """docs/README.md, 组合压缩 调用示例: keyword calls, ./tmp made by create."""
    monkeypatch.chdir(tmp_path)
    ori_model = build_model()
    ori_model_input_data = tuple([torch.randn(INPUT_SHAPE)])
    simple_cfg = write('./compressed.cfg', COMPRESSED_CFG)
    record_file = './tmp/record.txt'
    compressed_retrain_model = amct.create_compressed_retrain_model(
        model=ori_model,
        input_data=ori_model_input_data,
        config_defination=simple_cfg,
        record_file=record_file)
    train(compressed_retrain_model)
    compressed_pth_file = "compressed.pth"
    torch.save(compressed_retrain_model.state_dict(), compressed_pth_file)
    save_path = './results/user_model'
    amct.save_compressed_retrain_model(
        model=compressed_retrain_model,
        record_file=record_file,
        save_path=save_path,
        input_data=ori_model_input_data)
    assert os.path.isfile('./results/user_model_deploy_model.onnx')

    ori_model = build_model()  # the resume
    restored = amct.restore_compressed_retrain_model(
        model=ori_model,
        input_data=ori_model_input_data,
        config_defination=simple_cfg,
        record_file=record_file,
        pth_file=compressed_pth_file)
    x = ori_model_input_data[0]
    with torch.no_grad():
        assert torch.equal(restored.eval()(x), compressed_retrain_model(x))
