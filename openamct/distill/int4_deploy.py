"""4-bit weights in the deploy ONNX: what the export writes as an int8 initializer holding INT4
grid values (-8..7) -> DequantizeLinear (one scale per output row) -> Gemm/MatMul becomes a
weight ONNX Runtime stores and runs as 4 bits.

* ``"matmulnbits"`` (the default; measured the faster, docs/distill.md): each such Linear becomes
  ``com.microsoft.MatMulNBits(A, B, scales)``, B the weights as unsigned 4-bit (q + 8, the
  operator's default zero point) packed two to a byte in blocks of ``block_size`` along the
  input features, the row's scale repeated per block; a bias becomes an ``Add`` after it.
* ``"dq_int4"``: the initializer becomes an ONNX INT4 tensor (opset 21 DequantizeLinear reads
  it); the model is converted to opset 21 (``onnx.version_converter``), the graph otherwise unchanged.

Only weights whose DequantizeLinear feeds a Linear (``Gemm`` with transB, or
``Transpose``+``MatMul``) are rewritten; any other INT4 weight keeps its 8-bit storage.

The rewrite lives in ``openamct.export.int4_onnx``, which the retrain family's save uses too.
"""

from __future__ import annotations

from openamct.export.int4_onnx import FORMATS, pack_int4_weights

__all__ = ["pack_int4_weights", "FORMATS"]
