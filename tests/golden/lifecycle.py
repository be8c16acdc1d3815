"""The demo config's whole lifecycle on MnistNet, written to files that must not change when
the code is reorganised: create -> eval forward -> save, then restore from the record and the
checkpoint -> save again.

Every number in the files is made independent of the CPU, the thread count and the hash seed:
the pruning decisions and 2:4 masks come from the seeded initial weights (comparisons and
float64 norms of the same values), and the data-dependent state (activation clips and output
ranges, which a forward computes with CPU-specific accumulation order) is overwritten with
fixed values before the checkpoint is taken. So the golden files written once on one machine
are a valid reference on every other.

Regenerate only on purpose (the point is that they stay as they were):
``python -m tests.golden.lifecycle tests/fixtures/golden``.
"""

from __future__ import annotations

import os
import sys

import torch

import openamct as amct
from openamct.demo.models import MnistNet

DEMO_CFG = os.path.join(os.path.dirname(amct.__file__), "demo", "demo.cfg")
FILES = ("create_record.txt", "create_fake_quant_model.onnx", "create_deploy_model.onnx",
         "restore_record.txt", "restore_fake_quant_model.onnx", "restore_deploy_model.onnx")


def _model() -> MnistNet:
    torch.manual_seed(0)
    model = MnistNet()
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):  # a non-trivial fold
            m.weight.data = 0.5 + torch.rand(m.num_features, generator=g)
            m.bias.data = torch.randn(m.num_features, generator=g) * 0.1
            m.running_mean = torch.randn(m.num_features, generator=g) * 0.1
            # Powers of 4 and eps 0: gamma * rsqrt(var) is then exact in every kernel (the
            # scalar rsqrt and the vectorised ones round other values differently).
            m.eps = 0.0
            m.running_var = 4.0 ** torch.randint(-1, 2, (m.num_features,), generator=g).float()
    return model.eval()


def _pin_data_dependent_state(model: torch.nn.Module) -> None:
    """Fixed clips and output ranges in place of the ones the calibration forward found."""
    with torch.no_grad():
        for i, (_, m) in enumerate(sorted(model.named_modules(), key=lambda kv: kv[0])):
            kind = type(m).__name__
            if kind == "ActULQ":
                m.clip_max.fill_(2.0 + 0.25 * i)
                m.clip_min.fill_(0.0 if bool(m.fixed_min) else -0.5 - 0.125 * i)
                m.initialized.fill_(True)
            elif kind == "RangeObserver":
                m.min_val.fill_(-1.0 - 0.0625 * i)
                m.max_val.fill_(3.0 + 0.125 * i)
                m.initialized.fill_(True)


def write_lifecycle_files(out: str) -> list[str]:
    """Run the lifecycle; return the paths of FILES written under ``out``."""
    os.makedirs(out, exist_ok=True)
    x = torch.randn(4, 1, 28, 28, generator=torch.Generator().manual_seed(2))
    rec = os.path.join(out, "create_record.txt")
    model = amct.create_compressed_retrain_model(_model(), x, DEMO_CFG, rec)
    model.eval()
    model(x)  # 2:4 masks from the weights; clips from data (replaced next)
    _pin_data_dependent_state(model)
    ckpt = os.path.join(out, "ckpt.pth")
    torch.save({"state_dict": model.state_dict()}, ckpt)
    amct.save_compressed_retrain_model(model, rec, os.path.join(out, "create"), x)

    rec2 = os.path.join(out, "restore_record.txt")
    with open(rec, "rb") as src, open(rec2, "wb") as dst:
        dst.write(src.read())
    restored = amct.restore_compressed_retrain_model(_model(), x, DEMO_CFG, rec2, ckpt, "state_dict")
    amct.save_compressed_retrain_model(restored, rec2, os.path.join(out, "restore"), x)
    os.remove(ckpt)
    return [os.path.join(out, f) for f in FILES]


if __name__ == "__main__":
    for path in write_lifecycle_files(sys.argv[1]):
        print(path, os.path.getsize(path))
