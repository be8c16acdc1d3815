"""``DistillSampleBase``: how ``distill`` turns one batch of the train loader into the model's
input. The module path is upstream's (``amct_pytorch.distill.distill_sample``)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

__all__ = ["DistillSampleBase"]


class DistillSampleBase:
    """Subclass it and override ``get_model_input_data`` for your batch format; it returns a
    tensor (``model(x)``), a tuple/list of tensors (``model(*x)``) or a dict of tensors
    (``model(**x)``, openamct's addition for keyword inputs). The default takes the batch
    itself when it is a tensor or a dict of tensors, else the first element of a tuple/list
    batch (``(images, labels)`` -> images)."""

    def get_model_input_data(self, samples: Any) -> Any:
        if isinstance(samples, Tensor) or (isinstance(samples, dict) and samples
                                           and all(isinstance(v, Tensor) for v in samples.values())):
            return samples
        if isinstance(samples, (tuple, list)):
            if not samples:
                raise ValueError("train_loader gave an empty batch: the default sample_instance takes its first "
                                 "element; give a sample_instance for this batch format")
            first = samples[0]
            if isinstance(first, Tensor):
                return first
        raise ValueError(f"train_loader gave a batch of type {type(samples).__name__} the default sample_instance "
                         "cannot read (a tensor, a dict of tensors, or a tuple/list whose first element is a "
                         "tensor): give a DistillSampleBase subclass as sample_instance")


def model_input(sample: DistillSampleBase, samples: Any) -> Any:
    x = sample.get_model_input_data(samples)
    ok = isinstance(x, Tensor) or (isinstance(x, (tuple, list)) and x and all(isinstance(v, Tensor) for v in x)) \
        or (isinstance(x, dict) and x and all(isinstance(v, Tensor) for v in x.values()))
    if not ok:
        raise ValueError(f"sample_instance.get_model_input_data returned {type(x).__name__}: expected a tensor, "
                         "a tuple/list of tensors or a dict of tensors")
    return x
