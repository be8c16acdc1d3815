"""BatchNorm folding arithmetic shared by training (approximate fold) and eval (exact fold).

Exact fold (eval, export): y = op(x, w * g/sigma, (b - mu) * g/sigma + beta), sigma = sqrt(var + eps).
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["check_foldable", "bn_scale", "bn_bias", "scale_out_channels"]


def check_foldable(bn: nn.Module, out_channels: int, what: str) -> None:
    if not isinstance(bn, _BatchNorm):
        raise TypeError(f"bn: expected a BatchNorm module for {what}, got {type(bn).__name__}")
    if not bn.track_running_stats or bn.running_var is None or bn.running_mean is None:
        raise ValueError(f"bn: {what}: a BatchNorm without running statistics cannot be folded")
    if bn.num_features != out_channels:
        raise ValueError(f"bn: {what} has {out_channels} output channels but the BatchNorm has "
                         f"{bn.num_features} features")


def bn_scale(bn: _BatchNorm) -> Tensor:
    """gamma / sqrt(running_var + eps), per channel (differentiable in gamma)."""
    inv_std = (bn.running_var + bn.eps).rsqrt()
    return bn.weight * inv_std if bn.affine else inv_std


def bn_bias(bn: _BatchNorm, bias: Tensor | None, scale: Tensor) -> Tensor:
    """(b - mu) * scale + beta, per channel."""
    shifted = -bn.running_mean if bias is None else bias - bn.running_mean
    folded = shifted * scale
    return folded + bn.bias if bn.affine else folded


def scale_out_channels(w: Tensor, c: Tensor, axis: int, groups: int = 1) -> Tensor:
    """w * c per output channel. axis 0: [Cout, ...]; axis 1: ConvTranspose [Cin, Cout/g, ...]
    whose output channel gi*Cout/g + j is column j of row block gi."""
    if axis == 0:
        return w * c.reshape([-1] + [1] * (w.dim() - 1))
    cin, cout_g = w.shape[0], w.shape[1]
    k = [1] * (w.dim() - 2)
    w4 = w.reshape(groups, cin // groups, cout_g, *w.shape[2:])
    return (w4 * c.reshape(groups, 1, cout_g, *k)).reshape(w.shape)
