"""The small pieces many unit tests share: the INT8 QAT config text, a conv -> ReLU -> mean ->
Linear model (and its two-conv variant) whose widths each test picks, writing a config into a
test's folder, and snapshotting / comparing a model's state. Module names (``conv``, ``conv1``,
``conv2``, ``fc``) are part of the contract: tests' configs and error messages name them."""

from __future__ import annotations

import torch
from torch import nn

import openamct as amct

INT8 = "retrain_data_quant_config { ulq_quantize { } }\nretrain_weight_quant_config { arq_retrain { } }\n"
NM = "prune_config { n_out_of_m_pruner { l1_selective_prune { } } }\n"
HALF_FILTERS = ("prune_config { filter_pruner { balanced_l2_norm_filter_prune { prune_ratio: 0.5 "
                "ascend_optimized: false } } }\n")


class ConvFc(nn.Module):
    """``conv`` (c_in -> width, 3x3, same padding) -> ReLU -> spatial mean -> ``fc`` (width -> outputs)."""

    def __init__(self, c_in: int = 3, width: int = 8, outputs: int = 4):
        super().__init__()
        self.conv = nn.Conv2d(c_in, width, 3, padding=1)
        self.fc = nn.Linear(width, outputs)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean(dim=(2, 3)))


class TwoConvFc(nn.Module):
    """``conv1`` (c_in -> width) -> ReLU -> ``conv2`` (width -> width) -> ReLU -> mean -> ``fc``:
    conv1's filters can be pruned (conv2 reads them), and its record entry has a consumer."""

    def __init__(self, c_in: int = 3, width: int = 8, outputs: int = 4):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)
        self.fc = nn.Linear(width, outputs)

    def forward(self, x):
        return self.fc(torch.relu(self.conv2(torch.relu(self.conv1(x)))).mean(dim=(2, 3)))


def write_cfg(tmp_path, text: str = INT8, name: str = "q.cfg") -> str:
    """Writes ``text`` to ``tmp_path / name``; returns the path as a string."""
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def one_step(tmp_path, model, x, text: str = INT8, cfg_name: str = "q.cfg", record: str = "r.txt"):
    """create_compressed_retrain_model under ``text`` (written to ``cfg_name``), one training
    forward (calibrates the quantizers), then eval mode. ``x``: a tensor or a tuple of positional
    tensors."""
    m = amct.create_compressed_retrain_model(model, x, write_cfg(tmp_path, text, cfg_name), str(tmp_path / record))
    m.train()
    m(*x) if isinstance(x, tuple) else m(x)
    m.eval()
    return m


def snapshot(model) -> dict:
    """A copy of every state-dict entry (parameters and buffers), to compare against later."""
    return {k: v.clone() for k, v in model.state_dict().items()}


def changed_keys(before: dict, model) -> list[str]:
    """The state-dict keys of ``model`` whose value differs from ``before`` (a ``snapshot``)."""
    after = model.state_dict()
    return [k for k in before if not torch.equal(before[k], after[k])]


def restores_the_same(model, restore, x, ckpt):
    """Saves ``model``'s state dict to ``ckpt``, restores it through ``restore(ckpt)`` and asserts
    that the restored model computes exactly what ``model`` computes on ``x`` in eval mode."""
    model.eval()
    with torch.no_grad():
        want = model(x)
    torch.save(model.state_dict(), ckpt)
    r = restore(str(ckpt))
    r.eval()
    with torch.no_grad():
        got = r(x)
    assert torch.equal(got, want), (got - want).abs().max()
    return r
