"""Upstream's pruning pages: create_prune_retrain_model.md, restore_prune_retrain_model.md,
save_prune_retrain_model.md, auto_channel_prune_search.md, and docs/README.md's 通道稀疏
(自动通道稀疏, 手工稀疏) and 4选2结构化稀疏 flows."""

import os

import torch

import openamct as amct
from tests.upstream.pages import (
    FILTER_CFG,
    INPUT_SHAPE,
    NM_CFG,
    build_model,
    close,
    onnx_run,
    saved_pair,
    train,
    write,
)

TMP = "TMP"


def _create(cfg_text: str):
    model = build_model()
    model.load_state_dict(build_model().state_dict())  # the page's torch.load(state_dict_path)
    input_data = tuple([torch.randn(INPUT_SHAPE)])
    record_file = os.path.join(TMP, 'scale_offset_record.txt')
    cfg_file = write('./prune_config.cfg', cfg_text)
    prune_retrain_model = amct.create_prune_retrain_model(
        model,
        input_data,
        cfg_file,
        record_file)
    return model, input_data, prune_retrain_model


def test_create_prune_retrain_model_page(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    model, _, pruned = _create(FILTER_CFG)
    assert pruned.conv1.weight.shape[0] == 8 and model.conv1.weight.shape[0] == 16
    assert "prune_record" in (tmp_path / TMP / "scale_offset_record.txt").read_text()


def test_restore_and_save_prune_retrain_model_pages(monkeypatch, tmp_path):
    """restore_prune_retrain_model.md writes ``save_pth_path = /your/path/to/save/tmp.pth`` (not
    Python): a path here. Its record is the one create wrote; the checkpoint is the pruned
    model's, under 'state_dict'."""
    monkeypatch.chdir(tmp_path)
    _, _, pruned = _create(FILTER_CFG)
    train(pruned)
    save_pth_path = "tmp.pth"
    torch.save({'state_dict': pruned.state_dict()}, save_pth_path)

    config_defination = './prune_config.cfg'
    model = build_model()
    input_data = tuple([torch.randn(INPUT_SHAPE)])
    model.load_state_dict(build_model().state_dict())
    record_file = os.path.join(TMP, 'scale_offset_record.txt')
    prune_retrain_model = amct.restore_prune_retrain_model(
        model,
        input_data,
        record_file,
        config_defination,
        save_pth_path,
        'state_dict')
    x = torch.randn(INPUT_SHAPE)
    with torch.no_grad():
        assert torch.equal(prune_retrain_model.eval()(x), pruned(x))

    # save_prune_retrain_model.md
    pruned_retrain_model = prune_retrain_model
    input_data = tuple([torch.randn(INPUT_SHAPE)])
    save_path = os.path.join("OUTPUTS_DIR", 'custom_name')
    amct.save_prune_retrain_model(
        pruned_retrain_model,
        save_path,
        input_data,
        input_names=['input'],
        output_names=['output'],
        dynamic_axes={'input': {0: 'batch_size'}, 'output': {0: 'batch_size'}})
    fake, deploy = saved_pair(save_path)
    x = torch.randn(3, *INPUT_SHAPE[1:])
    with torch.no_grad():
        assert close(onnx_run(deploy, x), pruned(x), 1e-4)
    assert open(fake, "rb").read() == open(deploy, "rb").read()  # prune only: one float model


def test_readme_two_of_four_flow(monkeypatch, tmp_path):
    """docs/README.md, 4选2结构化稀疏 调用示例. The page saves ``model=pruned_retrain_model``
    where it made ``prune_retrain_model``, and reads
    './results/user_model_fake_prune_model.onnx', a name no save writes
    (``<save_path>_fake_quant_model.onnx``)."""
    monkeypatch.chdir(tmp_path)
    ori_model = build_model()
    ori_model_input_data = tuple([torch.randn(INPUT_SHAPE)])
    simple_cfg = write('./retrain.cfg', NM_CFG)
    record_file = './tmp/record.txt'
    prune_retrain_model = amct.create_prune_retrain_model(model=ori_model,
                                                          input_data=ori_model_input_data,
                                                          config_defination=simple_cfg,
                                                          record_file=record_file)
    train(prune_retrain_model)
    save_path = './results/user_model'
    amct.save_prune_retrain_model(
        model=prune_retrain_model,
        save_path=save_path,
        input_data=ori_model_input_data)
    x = ori_model_input_data[0]
    with torch.no_grad():
        assert close(onnx_run('./results/user_model_fake_quant_model.onnx', x), prune_retrain_model(x), 1e-4)
    assert "selective_prune" in (tmp_path / "tmp" / "record.txt").read_text()


def test_readme_filter_prune_resume_flow(monkeypatch, tmp_path):
    """docs/README.md, 手工稀疏, the resume: the page passes ``save_pth_path=/your/path/...`` (no
    such parameter, not Python) and then the positional 'state_dict' after keywords: called
    with ``pth_file=`` and ``state_dict_name=``."""
    monkeypatch.chdir(tmp_path)
    write('./prune_cfg.cfg', FILTER_CFG)
    first = amct.create_prune_retrain_model(model=build_model(), input_data=tuple([torch.randn(INPUT_SHAPE)]),
                                            config_defination='./prune_cfg.cfg', record_file='./tmp/record.txt')
    train(first)
    torch.save({'state_dict': first.state_dict()}, "tmp.pth")
    ori_model = build_model()
    ori_model_input_data = tuple([torch.randn(INPUT_SHAPE)])
    record_file = './tmp/record.txt'
    prune_retrain_model = amct.restore_prune_retrain_model(model=ori_model,
                                                           input_data=ori_model_input_data,
                                                           record_file=record_file,
                                                           config_defination='./prune_cfg.cfg',
                                                           pth_file="tmp.pth",
                                                           state_dict_name='state_dict')
    x = torch.randn(INPUT_SHAPE)
    with torch.no_grad():
        assert torch.equal(prune_retrain_model.eval()(x), first(x))


SEARCH_CFG = "compress_ratio: 1.5\nascend_optimized: false\n"


def test_auto_channel_prune_search_page(monkeypatch, tmp_path):
    """One [data, label] pair, labels shaped like the output (upstream's L1 loss), and the
    config and output in ./tmp, which the page never makes."""
    monkeypatch.chdir(tmp_path)
    model = build_model()
    input_shape = (4, 3, 8, 8)
    write("./tmp/sample.cfg", SEARCH_CFG)
    # 构造输入数据input_data
    input_data = torch.randn(input_shape)
    model.eval()
    output = model.forward(input_data)
    labels = torch.randn(output.size())
    data = [input_data, labels]

    amct.auto_channel_prune_search(
        model=model,
        config='./tmp/sample.cfg',
        input_data=data,
        output_cfg='./tmp/output.cfg',
        sensitivity='TaylorLossSensitivity',
        search_alg='GreedySearch')
    text = (tmp_path / "tmp" / "output.cfg").read_text()
    assert "prune_ratio" in text
    pruned = amct.create_prune_retrain_model(model, input_data, './tmp/output.cfg', './tmp/record.txt')
    assert pruned.conv1.weight.shape[0] < 16 or pruned.conv2.weight.shape[0] < 16


def test_readme_auto_channel_prune_flow(monkeypatch, tmp_path):
    """docs/README.md, 自动通道稀疏: a list of ``test_iteration`` feed dicts (here [data, label]
    pairs with class labels); the page's custom-class imports read ``from amct.common...``,
    which no alias of a package can import: openamct's module path is
    openamct.common.auto_channel_prune (tests/upstream/test_switching.py)."""
    monkeypatch.chdir(tmp_path)
    model = build_model()
    cfg_file = write("search.cfg", SEARCH_CFG + "test_iteration: 2\n")
    test_iteration = 2
    g = torch.Generator().manual_seed(3)
    input_data = []
    for _ in range(test_iteration):
        input_data.append([torch.randn(INPUT_SHAPE, generator=g), torch.randint(0, 4, (INPUT_SHAPE[0],), generator=g)])
    output_prune_cfg = './prune.cfg'
    amct.auto_channel_prune_search(
        model=model,
        config=cfg_file,
        input_data=input_data,
        output_cfg=output_prune_cfg,
        sensitivity='TaylorLossSensitivity',
        search_alg='GreedySearch')
    assert "prune_ratio" in (tmp_path / "prune.cfg").read_text()
