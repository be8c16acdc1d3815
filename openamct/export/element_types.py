"""What a number format (``openamct.formats.QuantFormat``) is in an ONNX file.

``onnx_element_type`` is the format's own ONNX element type (INT8 -> INT8, INT4 -> INT4).
``storage_dtype`` is what the deploy model stores its integer weights as: ONNX Runtime's CPU
integer kernels (QLinearConv, QGemm via DequantizeLinear) read int8 weights, so every signed
weight format of at most 8 bits is stored as int8 holding its grid values (an INT4 weight's
values lie in -8..7). ``STORAGE_ONNX_TYPES`` maps those torch storage dtypes to ONNX types for
writers that build initializers themselves (``large/staging.py``).
"""

from __future__ import annotations

from types import MappingProxyType

import numpy as np
import onnx
import torch

from openamct.formats import QuantFormat

__all__ = ["onnx_element_type", "storage_dtype", "numpy_dtype", "STORAGE_ONNX_TYPES"]

_ELEMENT_TYPES = MappingProxyType({
    (8, True): onnx.TensorProto.INT8, (8, False): onnx.TensorProto.UINT8,
    (4, True): onnx.TensorProto.INT4, (4, False): onnx.TensorProto.UINT4,
})

STORAGE_ONNX_TYPES = MappingProxyType({torch.float32: onnx.TensorProto.FLOAT, torch.int8: onnx.TensorProto.INT8,
                                       torch.uint8: onnx.TensorProto.UINT8})


def onnx_element_type(fmt: QuantFormat) -> int:
    """The ``onnx.TensorProto`` element type of ``fmt`` (ValueError for one ONNX has none of)."""
    t = _ELEMENT_TYPES.get((fmt.bits, fmt.signed))
    if t is None:
        raise ValueError(f"format {fmt.name}: no ONNX element type for {fmt.bits}-bit "
                         f"{'signed' if fmt.signed else 'unsigned'} integers")
    return t


def storage_dtype(fmt: QuantFormat) -> torch.dtype:
    """The torch dtype the deploy model stores ``fmt``'s weight grid values in."""
    if fmt.bits > 8:
        raise ValueError(f"format {fmt.name}: the deploy model stores weights of at most 8 bits")
    return torch.int8 if fmt.signed else torch.uint8


def numpy_dtype(fmt: QuantFormat) -> np.dtype:
    """The numpy dtype that holds ``fmt``'s values in a file written with numpy: the storage
    dtype for weights of at most 8 bits, int16/uint16 for 16-bit activations."""
    if fmt.bits > 8:
        return np.dtype(np.int16 if fmt.signed else np.uint16)
    return np.dtype(np.int8 if fmt.signed else np.uint8)
