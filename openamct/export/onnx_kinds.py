"""What an ONNX file is, read from its content: a deploy model (weights stored as 4- or 8-bit
integers), the fake-quant model of the same save, or an FP32 export; and which kernels ONNX
Runtime runs for it.

``openamct verify`` takes its files in any order and tells them apart this way, so two files
given the wrong way round are compared the right way round (and said so), and
``verify_pair`` refuses them with the reason.
"""

from __future__ import annotations

import collections
import logging
import os
import tempfile
from dataclasses import dataclass

import onnx

from openamct.export.ids import SAVE_ID_KEY

logger = logging.getLogger(__name__)

__all__ = ["FP32_OF_KEY", "FileInfo", "file_info", "ort_kernels", "split_kernels"]

# metadata_props key of an FP32 export written by save_* (fp32_model=): the save id of its pair
FP32_OF_KEY = "openamct_fp32_of"

_INTEGER = frozenset({onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.INT4, onnx.TensorProto.UINT4})
# ORT's integer kernels (and MatMulNBits, 4-bit weights), as its optimised graph names them
_INTEGER_OPS = ("QLinear", "QGemm", "QAttention", "MatMulInteger", "ConvInteger", "DynamicQuantize",
                "MatMulNBits")
# float ops that multiply by weights or activations: where a deploy model's time goes
FLOAT_COMPUTE_OPS = ("Conv", "FusedConv", "ConvTranspose", "Gemm", "FusedGemm", "MatMul", "FusedMatMul",
                     "LSTM", "GRU", "RNN", "Attention", "MultiHeadAttention", "Einsum")


@dataclass(frozen=True)
class FileInfo:
    path: str
    integer_weights: int  # initializers of two or more dimensions stored as 4- or 8-bit integers
    save_id: str | None  # the id both files of one save carry (export/ids.py)
    fp32_of: str | None  # an FP32 export written by save_*: the save id of its pair

    @property
    def kind(self) -> str:
        """"deploy", "fake-quant" or "fp32"."""
        if self.integer_weights:
            return "deploy"
        if self.fp32_of is not None or self.save_id is None:
            return "fp32"
        return "fake-quant"


def file_info(path: str) -> FileInfo:
    """Read ``path``'s graph (not its external data); a file that is not ONNX is a ValueError."""
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError, OSError
        raise ValueError(f"{path!r} is not an ONNX model: {exc}") from None
    meta = {p.key: p.value for p in model.metadata_props}
    count = sum(1 for t in model.graph.initializer if t.data_type in _INTEGER and len(t.dims) >= 2)
    return FileInfo(path, count, meta.get(SAVE_ID_KEY), meta.get(FP32_OF_KEY))


def ort_kernels(path: str) -> collections.Counter | None:
    """Op counts of the graph ONNX Runtime runs for ``path`` after its optimisations (CPU,
    ``ORT_ENABLE_ALL``); None when ORT cannot write that graph (a model over 2 GB)."""
    import onnxruntime as ort

    with tempfile.TemporaryDirectory(prefix="openamct-kernels-") as tmp:
        out = os.path.join(tmp, "optimized.onnx")
        so = ort.SessionOptions()
        so.optimized_model_filepath = out
        so.log_severity_level = 3  # its note on hardware-specific optimisations in the saved graph
        try:
            ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
            graph = onnx.load(out, load_external_data=False).graph
        except Exception as exc:  # ORT's own exception types, or a graph too large to write
            logger.info("%s: ORT's optimised graph could not be read back (%s): kernels not listed", path, exc)
            return None
    return collections.Counter(n.op_type for n in graph.node)


def split_kernels(ops: collections.Counter) -> tuple[dict[str, int], dict[str, int]]:
    """(integer kernels, float compute ops) of an ORT op count, most frequent first."""
    integer = {k: v for k, v in ops.most_common() if k.startswith(_INTEGER_OPS)}
    floating = {k: v for k, v in ops.most_common() if k in FLOAT_COMPUTE_OPS}
    return integer, floating
