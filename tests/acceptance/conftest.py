import numpy as np
import onnx
import onnxruntime as ort
import pytest

from tests.runtimes import openvino_compile

# INT8 activations and weights with every default: the quantization half of the acceptance configs.
INT8_CFG = ("retrain_data_quant_config { ulq_quantize { } }\n"
            "retrain_weight_quant_config { arq_retrain { } }\n")


def write_cfg(tmp_path, text, name="c.cfg"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def ort_run(path, x):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: np.ascontiguousarray(x.numpy())})[0]


def openvino_run(path, x):
    """The file in OpenVINO's CPU plugin (tests/runtimes.py)."""
    compiled = openvino_compile(path, threads=2)
    return compiled(np.ascontiguousarray(x.numpy()))[compiled.outputs[0]]


def int8_initializers(path):
    model = onnx.load(path)
    return [t for t in model.graph.initializer if t.data_type == onnx.TensorProto.INT8]


@pytest.fixture
def run_ort():
    return ort_run
