import numpy as np
import onnx
import onnxruntime as ort
import pytest


def ort_run(path, x):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: np.ascontiguousarray(x.numpy())})[0]


def int8_initializers(path):
    model = onnx.load(path)
    return [t for t in model.graph.initializer if t.data_type == onnx.TensorProto.INT8]


@pytest.fixture
def run_ort():
    return ort_run
