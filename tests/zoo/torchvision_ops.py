"""Import torchvision and timm for the vision zoos.

Both live in their own folder, ``<venv>/zoo-site`` (the Makefile installs them there with
``--no-deps``), not in the virtualenv's site-packages: PyPI's torchvision wheel is a CUDA build
whose C ops do not load against the CPU torch this project pins, and its import then fails
("operator torchvision::nms does not exist") when it registers fake kernels for them.
Transformers imports torchvision whenever it is installed (every model class), so a torchvision
in site-packages would break every Hugging Face model in the examples and their subprocesses.

Only the zoo tests put the folder on ``sys.path``, after declaring the schemas of the ops
torchvision registers fake kernels for without checking that its C ops loaded. The
classification models are pure Python and never call these ops.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import os
import sys

import torch

ZOO_SITE = os.path.join(sys.prefix, "zoo-site")
# torchvision/_meta_registrations.py: register_fake("torchvision::nms"), ("torchvision::qnms")
SCHEMAS = {
    "nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}


def _c_ops_load(package_dir: str) -> bool:
    """Whether torchvision's own C ops load here (a CUDA torch, or a CPU torchvision build)."""
    libs = glob.glob(os.path.join(package_dir, "_C*.so")) + glob.glob(os.path.join(package_dir, "_C*.pyd"))
    if not libs:
        return False
    try:
        torch.ops.load_library(libs[0])
    except OSError:
        return False
    return True


def _declare_missing_ops(package_dir: str) -> None:
    if _c_ops_load(package_dir):
        return
    for op, schema in SCHEMAS.items():
        if not hasattr(torch.ops.torchvision, op):
            torch.library.define(f"torchvision::{op}", schema)


def vision_modules():
    """(torchvision, timm), importable after this call; pytest skips the caller where either
    is not installed (``make test`` installs both)."""
    import pytest

    if os.path.isdir(ZOO_SITE) and ZOO_SITE not in sys.path:
        sys.path.append(ZOO_SITE)
    spec = importlib.util.find_spec("torchvision")
    if spec is None or importlib.util.find_spec("timm") is None:
        pytest.skip(f"torchvision and timm are not installed (make installs them into {ZOO_SITE})",
                    allow_module_level=True)
    if "torchvision" not in sys.modules:
        _declare_missing_ops(spec.submodule_search_locations[0])
    return importlib.import_module("torchvision"), importlib.import_module("timm")
