"""``CompressedLayer``: the one wrapper every compressed Conv1d/2d/3d, ConvTranspose1d/2d and
Linear becomes, whatever techniques compress it.

Weight path: w -> 2:4 mask -> further masks -> BN scale (if a BN is folded) -> weight quantizer.

BN folding (docs/dev/reference.md, Algorithms). Eval (and a BN in eval mode): the exact fold, op(x, q(w*g/s), (b-mu)*g/s+beta).
Training: torch.ao's approximate fold, y = BN_train(op(x, q(w*c)) / c + b), c = g/sqrt(running_var
+ eps). When the weight quantizer commutes with a per-output-channel scale
(``commutes_with_channel_scale``: symmetric per-channel ARQ, q(w*c) = c*q(w) exactly in real
arithmetic), that expression equals BN_train(op(x, q(w), b)) and the multiply and divide are
skipped; other quantizers take the literal path.
"""

from __future__ import annotations

import logging
import weakref

import torch
from torch import Tensor, nn

from openamct.compressed.ops import WeightOp, as_layer_class, op_kind, public_attrs
from openamct.compressed.parts import LayerParts
from openamct.layer_types import features, layer_type_of
from openamct.quant.bn_fold import bn_bias, bn_scale, check_foldable, scale_out_channels
from openamct.quant.functions import graph_mode, ulq_qparams
from openamct.quant.quantizers import ActULQ, RangeObserver, WeightULQ, host_flag
from openamct.sparsity.nm import NMSparsifier, apply_mask

logger = logging.getLogger(__name__)

__all__ = ["CompressedLayer", "LayerParts"]


def _check_child(name: str, value) -> None:
    if value is not None and not isinstance(value, nn.Module):
        raise TypeError(f"{name}: expected an nn.Module or None, got {type(value).__name__}")


class CompressedLayer(WeightOp):
    """A Conv/ConvTranspose/Linear with optional folded BN, weight masks, input-activation and
    weight quantizers and an output range observer. ``weight``/``bias`` keep the wrapped
    module's names, and each part its own attribute, so state-dict keys are stable."""

    _openamct_leaf = True  # graph capture treats it as one op, like the module it wraps

    def __init__(self, kind: str, spatial: int, weight: nn.Parameter, bias: nn.Parameter | None,
                 hyper: dict) -> None:
        nn.Module.__init__(self)  # not the layer class's: see ops.as_layer_class
        self.kind, self.spatial = kind, spatial
        self.weight = weight
        self.register_parameter("bias", bias)
        for k, v in hyper.items():
            setattr(self, k, v)
        self.bn: nn.Module | None = None
        self.sparsity: nn.Module | None = None
        self.act_quant: nn.Module | None = None
        self.wts_quant: nn.Module | None = None
        self.out_observer: nn.Module | None = None
        self.out_quant: nn.Module | None = None
        self.input_on_grid = False  # LayerParts.input_on_grid
        self.mask_names: tuple[str, ...] = ()  # LayerParts.masks, in order
        self._scales_seen: tuple | None = None  # (weight key, scales) of the last eval/train forward
        # The layer forward's branch point: the model's runtime (``takes``/``forward``/``release``)
        # when build attached one (a CPU model: openamct.large); None keeps the plain path.
        self.large = None

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def wrap(cls, module: nn.Module, **parts) -> CompressedLayer:
        """``from_parts`` with the LayerParts fields as keywords."""
        return cls.from_parts(module, LayerParts(**parts))

    @classmethod
    def from_parts(cls, module: nn.Module, parts: LayerParts) -> CompressedLayer:
        kind, spatial = op_kind(module)
        for name in ("act_quant", "wts_quant", "sparsity", "out_quant"):
            _check_child(name, getattr(parts, name))
        for name, mask in parts.masks.items():
            _check_child(f"masks[{name!r}]", mask)
        if not isinstance(parts.observe_output, bool):
            raise TypeError(f"observe_output: expected a bool, got {type(parts.observe_output).__name__}")
        what = f"{type(module).__name__}"
        row = layer_type_of(module)
        hyper = public_attrs(module)  # what the code around the layer may read stays readable
        if row.matrix:
            hyper["in_features"], hyper["out_features"] = features(module)
            out_ch, axis, groups = hyper["out_features"], row.out_axis, 1
        else:
            hyper["_reversed_padding_repeated_twice"] = list(module._reversed_padding_repeated_twice)
            out_ch, groups = module.out_channels, module.groups
            axis = 1 if module.transposed else 0
        hyper["layer_type"] = type(module).__name__
        hyper["weight_axis"], hyper["weight_groups"] = axis, groups
        bn = parts.bn
        if bn is not None:
            check_foldable(bn, out_ch, what)
        layer = as_layer_class(cls, type(module))(kind, spatial, module.weight, module.bias, hyper)
        layer.bn, layer.sparsity, layer.act_quant = bn, parts.sparsity, parts.act_quant
        for name, mask in parts.masks.items():
            if hasattr(layer, name):
                raise ValueError(f"masks: {name!r} is already an attribute of CompressedLayer")
            layer.add_module(name, mask)
        layer.mask_names = tuple(parts.masks)
        wts_quant = parts.wts_quant
        if wts_quant is not None:
            if hasattr(wts_quant, "bind"):
                wts_quant.bind(axis, groups)
            layer.wts_quant = wts_quant
            if isinstance(wts_quant, WeightULQ) and not wts_quant.is_initialized:
                # Unmasked: calling the sparsity module here would count as its first batch, and
                # 2:4 keeps each group's largest |w|, so max|w| per channel is the same anyway.
                wts_quant.init_from(layer._folded_weight(masked=False).detach())
        if parts.observe_output:
            layer.out_observer = RangeObserver().to(module.weight.device)
        layer.out_quant = parts.out_quant
        layer.input_on_grid = bool(parts.input_on_grid)
        bn_mode = None if bn is None else bn.training
        layer.train(module.training)
        if bn is not None:  # a BN the user froze (eval mode) stays frozen inside the layer
            bn.train(bn_mode)
        return layer

    # -- weight path ---------------------------------------------------------------------------
    def _fold_commutes(self) -> bool:
        q = self.wts_quant
        return q is None or bool(getattr(q, "commutes_with_channel_scale", False))

    def _masked(self, w: Tensor, step: bool = True) -> Tensor:
        """The weight with every mask applied. ``step=False`` applies the installed masks
        without calling the mask modules, whose training-mode call counts a batch (and may
        recompute the mask)."""
        if self.sparsity is not None:
            w = self.sparsity(w) if step else self.sparsity.apply_installed(w)
        for m in (getattr(self, n) for n in self.mask_names):
            w = m(w) if step else apply_mask(w, m.mask if m.mask.dtype == torch.bool else m.mask.to(w.dtype))
        return w

    def effective_weight_bias(self) -> tuple[Tensor, Tensor | None]:
        """Eval-mode weight and bias: BN folded exactly, masked, quantized (what eval forward uses)."""
        w = self._masked(self.weight)
        b = self.bias
        if self.bn is not None:
            c = bn_scale(self.bn)
            w = scale_out_channels(w, c, self.weight_axis, self.weight_groups)
            b = bn_bias(self.bn, b, c)
        if self.wts_quant is not None:
            if b is not None:
                b = self._bias_on_int32_grid(w, b)
            w = self.wts_quant(w)
            seen = getattr(self.wts_quant, "last_scales", None)
            if seen is not None and self.bn is None:
                self._scales_seen = (self._weight_key(), seen)
        return w, b

    def _kept_weight_bias(self) -> tuple[Tensor, Tensor | None]:
        """``effective_weight_bias``, computed once per change of what it reads when no gradient
        is to reach it (an evaluation pass): an eval forward then quantizes no weight. Not kept
        in training mode (the optimizer changes the weights every step), while a graph is
        captured or compiled, or on the large-model path (its weights are not doubled)."""
        if (self.training or self.large is not None or graph_mode() or torch.compiler.is_compiling()
                or (torch.is_grad_enabled() and any(p.requires_grad for p in self._weight_inputs(params=True)))):
            self.__dict__.pop("_eval_kept", None)
            return self.effective_weight_bias()
        tensors = list(self._weight_inputs(params=False))
        kept = self.__dict__.get("_eval_kept")
        if kept is not None and len(kept[0]) == len(tensors) and all(
                r() is t and v == t._version for (r, v), t in zip(kept[0], tensors, strict=True)):
            return kept[1]
        wb = self.effective_weight_bias()
        self.__dict__["_eval_kept"] = ([(weakref.ref(t), t._version) for t in tensors], wb)
        return wb

    def _weight_inputs(self, params: bool):
        """The tensors ``effective_weight_bias`` reads (with ``params``: the parameters among them
        a gradient could reach)."""
        yield self.weight
        if self.bias is not None:
            yield self.bias
        for part in (self.bn, self.wts_quant):
            if part is not None:
                yield from part.parameters()
                if not params:
                    yield from part.buffers()
        if params:
            return
        if self.sparsity is not None:
            yield self.sparsity.mask_bits
        for n in self.mask_names:
            yield getattr(self, n).mask
        if isinstance(self.act_quant, ActULQ):  # the bias's int32 grid
            yield from (self.act_quant.clip_max, self.act_quant.clip_min, self.act_quant.fixed_min)

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.pop("_eval_kept", None)  # derived, and weak references do not copy
        return state

    def _weight_key(self) -> tuple:
        """Changes whenever the masked weight can have: an in-place update of the weight or of
        a mask bumps its ``_version``; a new tensor has another address."""
        masks = [getattr(self, n).mask for n in self.mask_names]
        if self.sparsity is not None:
            masks.append(self.sparsity.mask_bits)
        return (self.weight.data_ptr(), self.weight._version, *((m.data_ptr(), m._version) for m in masks))

    def _bias_on_int32_grid(self, w: Tensor, b: Tensor, scales: Tensor | None = None) -> Tensor:
        """The bias rounded to the int32 grid (input scale x weight scale, float32) on which the
        deploy model's QLinearConv / QGemm adds it (export/deploy.py, ``_bias_to_int32``).
        Left float, this rounding was the deploy model's one departure from fake-quant: on an
        MNIST SE net, 6 of 1000 argmaxes and 0.2 point of accuracy. Straight-through gradient.
        Eval only: in a training step it would cost every layer a second weight reduction and a
        host sync (``scale_offset``) for a change of at most half an int32 step."""
        aq = self.act_quant
        if self.training or aq is None or not isinstance(aq, ActULQ) or not aq.is_initialized or \
                (self.weight_axis == 1 and self.weight_groups > 1):  # grouped ConvTranspose: weight kept float
            return b
        with torch.no_grad():
            sx = ulq_qparams(aq.clip_max, aq.clip_min, host_flag(aq, "fixed_min"), aq.format)[0]  # = scale_offset()[0]
            scale = sx * (self.wts_quant.scales(w.detach()) if scales is None else scales).float().reshape(-1)
            q = torch.round(b.detach().float() / scale)
            # Kept float when a value leaves int32 (no host read: a select, not a branch).
            fits = torch.all(q.abs() < 2**31 - 1)
            rounded = torch.where(fits, q * scale, b.detach().float()).to(b.dtype)
        return b + (rounded - b).detach()

    def _folded_weight(self, masked: bool = True, step: bool = True) -> Tensor:
        """BN-folded weight (see ``_masked`` for ``step``)."""
        w = self._masked(self.weight, step) if masked else self.weight
        if self.bn is not None:
            w = scale_out_channels(w, bn_scale(self.bn), self.weight_axis, self.weight_groups)
        return w

    def weight_scales(self) -> Tensor | None:
        """Weight scales (in ``wts_quant.format``) of the folded, masked weight (Cout order or 1 element), for records.
        They include |gamma/sigma| when a BN is folded."""
        if self.wts_quant is None:
            return None
        seen = self._scales_seen
        if seen is not None and seen[0] == self._weight_key():
            # What the last forward quantized with: a record built in that forward's hook (or
            # after it, weights untouched) needs no second pass over the weight.
            return seen[1]
        return self.wts_quant.scales(self._folded_weight(step=False).detach())

    # -- forward -------------------------------------------------------------------------------
    def _channel_shape(self, y: Tensor) -> list[int]:
        if self.kind.startswith("linear"):
            return [-1]
        shape = [1] * y.dim()
        shape[y.dim() - self.spatial - 1] = -1
        return shape

    def forward(self, x: Tensor) -> Tensor:
        observe = getattr(self.sparsity, "observe", None)
        if observe is not None:  # a data-aware 2:4 mask reads the layer's input (sparsity/nm_aware.py)
            observe(x)
        if self.act_quant is not None and not self.input_on_grid:
            x = self.act_quant(x)
        if self.bn is not None and self.bn.training:
            y = self._forward_fold_train(x)
        elif self.large is not None and self.large.takes(self, x):
            # Branch point: ``large``, set by build on the large-model path (a CPU model),
            # computes a plain-weight-path Linear on CPU tensors with no weight-sized temporaries.
            y = self.large.forward(self, x)
        else:
            y = self._op(x, *self._kept_weight_bias())
        if self.out_observer is not None:
            y = self.out_observer(y)
        if self.out_quant is not None:
            y = self.out_quant(y)
        return y

    def plain_weight_path(self) -> bool:
        """A Linear whose weight path is only a 2:4 mask and/or a quantizer whose scales come
        from the weight alone (ARQ, any weight format): ``large.fused_linear`` builds its
        effective weight in a given buffer (the training step, the save's writer)."""
        sp, q = self.sparsity, self.wts_quant
        return (self.kind.startswith("linear") and self.bn is None and not self.mask_names
                and (sp is None or type(sp) is NMSparsifier)
                and (q is None or bool(getattr(q, "scales_from_weight", False))))

    def _saw_scales(self, scales: Tensor | None) -> None:
        """The ARQ scales a fused forward quantized with, for the record (``weight_scales``)."""
        if self.wts_quant is not None:
            self.wts_quant.last_scales = scales
            self._scales_seen = (self._weight_key(), scales)

    def train(self, mode: bool = True) -> CompressedLayer:
        if not mode and getattr(self, "large", None) is not None:  # eval and export hold no training scratch
            self.large.release()
        if mode:
            self.__dict__.pop("_eval_kept", None)  # training changes the weights: no eval copy kept
        return super().train(mode)

    def _forward_fold_train(self, x: Tensor) -> Tensor:
        if self._fold_commutes():
            w = self._masked(self.weight)
            wq = w if self.wts_quant is None else self.wts_quant(w)
            return self.bn(self._op(x, wq, self.bias))
        y = self._op(x, self.wts_quant(self._folded_weight()), None)
        shape = self._channel_shape(y)
        y = y / bn_scale(self.bn).reshape(shape)
        if self.bias is not None:
            y = y + self.bias.reshape(shape)
        return self.bn(y)

    def extra_repr(self) -> str:
        if self.kind.startswith("linear"):
            s = f"{self.layer_type}: in_features={self.in_features}, out_features={self.out_features}"
        else:
            s = (f"{self.layer_type}: {self.in_channels}, {self.out_channels}, "
                 f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}")
            if self.groups != 1:
                s += f", groups={self.groups}"
        s += f", bias={self.bias is not None}, bn_folded={self.bn is not None}"
        return s
