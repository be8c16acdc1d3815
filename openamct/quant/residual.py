"""A quantizer on a tensor no layer produces: the output of a module (a residual block's Add, a
ReLU) that a quantized layer and residual Adds both read.

Why: ONNX Runtime runs such an Add as QLinearAdd only when it reads DQ(Q(t)), and the deploy
writer gives it exactly that, with the quantizer of the layer that reads ``t``. Without the same
quantizer in the training model the fake-quant Add reads ``t`` unclipped: on HF MobileViT the
deploy logits drifted from fake-quant at the first such Add (tensor cosine 0.9999 -> 0.989).

The hook applies the reading layer's own input quantizer (one object, trained and initialised
as before, recorded with that layer), and the layer, told its input is already on that grid
(``CompressedLayer.input_on_grid``), does not apply it a second time. A forward hook keeps the
user's module paths and state-dict keys as they were; it is an object, not a closure, so a deep
copy of the model (the export's working copy) points it at the copied quantizer.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

__all__ = ["OutputQuantHook", "output_hooks", "swap_hook_quantizers"]


class OutputQuantHook:
    def __init__(self, quantizer: nn.Module) -> None:
        self.quantizer = quantizer

    def __call__(self, module: nn.Module, args: tuple, output):
        return self.quantizer(output)


def output_hooks(model: nn.Module) -> list[tuple[str, OutputQuantHook]]:
    return [(name, h) for name, m in model.named_modules() for h in m._forward_hooks.values()
            if isinstance(h, OutputQuantHook)]


def swap_hook_quantizers(model: nn.Module, make: Callable[[float, int], nn.Module]) -> int:
    """Export: each hook of ``model`` (a working copy) gets ``make(scale, offset)`` of its
    trained quantizer (FakeQuantAct or QDQAct); returns how many."""
    found = output_hooks(model)
    for _, h in found:
        h.quantizer = make(*h.quantizer.scale_offset()).eval()
    return len(found)
