"""Upstream's decomposition pages: auto_decomposition.md, decompose_network.md, and
docs/README.md's 张量分解 flows (online and offline)."""

import pytest
import torch
from torch import nn

from openamct.tensor_decompose import auto_decomposition, decompose_network


class Net(nn.Module):
    """One conv upstream's rule decomposes (64 channels, 3x3) between two it leaves alone."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 64, 1)
        self.body = nn.Conv2d(64, 64, 3, padding=1)
        self.head = nn.Conv2d(64, 4, 1)

    def forward(self, x):
        return self.head(torch.relu(self.body(torch.relu(self.stem(x)))))


def test_auto_decomposition_and_decompose_network_pages_offline_flow(monkeypatch, tmp_path):
    """auto_decomposition.md / decompose_network.md and the README's 离线张量分解: both change
    ``net`` in place (the pages' note 2) and return it."""
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    (tmp_path / "src_path").mkdir()
    torch.save(Net().state_dict(), "src_path/weights.pth")
    net = Net()                                                    # 构建用户模型对象
    net.load_state_dict(torch.load("src_path/weights.pth"))        # 加载模型权重
    original = net
    net, changes = auto_decomposition(                             # 执行张量分解
        model=net,
        decompose_info_path="decomposed_path/decompose_info.json"
    )
    assert net is original and isinstance(original.body, nn.Sequential)
    assert changes == {"body": ["body.0", "body.1"]}
    torch.save(net.state_dict(), "decomposed_path/decomposed_weights.pth")

    net = Net()
    original = net
    net, changes2 = decompose_network(
        model=net,
        decompose_info_path="decomposed_path/decompose_info.json"
    )
    assert net is original and changes2 == changes
    net.load_state_dict(torch.load("decomposed_path/decomposed_weights.pth"))
    x = torch.randn(2, 3, 8, 8)
    decomposed = Net()
    decomposed.load_state_dict(torch.load("src_path/weights.pth"))
    auto_decomposition(model=decomposed)  # the README's 在线张量分解: the return value not needed
    assert torch.equal(net(x), decomposed(x))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_decomposition_takes_other_float_dtypes(dtype):
    """Upstream decomposes a half or double model; openamct asked for model.float()."""
    torch.manual_seed(0)
    net = Net().to(dtype)
    want = net.body.weight.detach().clone()
    out, changes = auto_decomposition(net)
    assert changes and out.body[0].weight.dtype == dtype and out.body[1].weight.dtype == dtype
    rebuilt = torch.einsum("rihx,oryw->oihw", out.body[0].weight.double(), out.body[1].weight.double())
    assert float((rebuilt - want.double()).norm() / want.double().norm()) < 1.0


def test_a_conv_model_is_left_as_it_is():
    """The pages' exception: a torch.nn.Conv2d given as the model is not changed; the pair is returned."""
    conv = nn.Conv2d(64, 64, 3, padding=1)
    out, changes = auto_decomposition(conv)
    assert isinstance(out, nn.Sequential) and isinstance(conv, nn.Conv2d) and changes == {"": ["0", "1"]}
