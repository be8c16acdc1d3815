"""What a page leaves to its reader: a model of theirs, a trained pair of ONNX files, a
package of factories for the command line. A block names what it needs in its
``<!-- setup: ... -->`` line; each fixture runs once per page, into the page's folder and
namespace."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from tests.docs.pages import ROOT


@dataclass
class Session:
    folder: str
    namespace: dict = field(default_factory=lambda: {"__name__": "__main__"})
    python_path: list[str] = field(default_factory=list)   # for bash blocks, after the checkout
    done: set = field(default_factory=set)


_SITECUSTOMIZE = """\
import importlib.util
import sys

from tests.zoo.torchvision_ops import ZOO_SITE, _declare_missing_ops

sys.path.append(ZOO_SITE)
_declare_missing_ops(importlib.util.find_spec("torchvision").submodule_search_locations[0])
"""


def torchvision(session: Session) -> None:
    """torchvision importable in the page's Python blocks and shell commands. It lives in
    <venv>/zoo-site, and two op schemas are declared before its import
    (tests/zoo/torchvision_ops.py); a shell command's Python gets both from a sitecustomize."""
    from tests.zoo.torchvision_ops import vision_modules

    vision_modules()
    site = os.path.join(session.folder, ".docs-site")
    os.makedirs(site, exist_ok=True)
    with open(os.path.join(site, "sitecustomize.py"), "w", encoding="utf-8") as f:
        f.write(_SITECUSTOMIZE)
    session.python_path.append(site)


_MYPKG = """\
\"\"\"A reader's own package of model factories, as the command-line examples name it.\"\"\"
import torch
import torchvision


def resnet18():
    return torchvision.models.resnet18()


def resnet18_with_inputs():
    return torchvision.models.resnet18(), torch.randn(1, 3, 224, 224)
"""


def mypkg(session: Session) -> None:
    """``mypkg.models`` in the page's folder: factories of a torchvision ResNet-18 (torchvision
    from the ``torchvision`` fixture)."""
    if "torchvision" not in session.done:
        torchvision(session)
        session.done.add("torchvision")
    os.makedirs(os.path.join(session.folder, "mypkg"), exist_ok=True)
    with open(os.path.join(session.folder, "mypkg", "__init__.py"), "w", encoding="utf-8") as f:
        f.write("")
    with open(os.path.join(session.folder, "mypkg", "models.py"), "w", encoding="utf-8") as f:
        f.write(_MYPKG)


def examples(session: Session) -> None:
    """The repository's ``examples/`` folder in the page's folder, as a page run from the
    repository root sees it (a link: nothing is written into the checkout)."""
    os.symlink(os.path.join(ROOT, "examples"), os.path.join(session.folder, "examples"))


_QUANT_CFG = ("retrain_data_quant_config { ulq_quantize { } }\n"
              "retrain_weight_quant_config { arq_retrain { channel_wise: true } }\n")


def mnist_qat(session: Session) -> None:
    """``model``: the demo's MnistNet compressed with INT8 QAT (``record.txt`` its record),
    its clips set by one eval forward; ``images``: 64 random 1x28x28 images (numpy)."""
    import numpy as np
    import torch

    import openamct as amct
    from openamct.demo.models import MnistNet

    torch.manual_seed(0)
    with open(os.path.join(session.folder, "int8.cfg"), "w", encoding="utf-8") as f:
        f.write(_QUANT_CFG)
    x = torch.randn(8, 1, 28, 28)
    model = amct.create_compressed_retrain_model(MnistNet().eval(), x, os.path.join(session.folder, "int8.cfg"),
                                                 os.path.join(session.folder, "record.txt"))
    model.eval()
    model(x)
    session.namespace.update(model=model, images=np.random.default_rng(0).standard_normal((64, 1, 28, 28)))


FIXTURES = {"torchvision": torchvision, "mypkg": mypkg, "examples": examples, "mnist-qat": mnist_qat}
