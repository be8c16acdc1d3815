"""The runtimes as the tests and benchmarks use them: OpenVINO's CPU plugin, ONNX Runtime on a
file with input ``x``, and the graph ONNX Runtime optimises a file into (what its kernels run)."""


def openvino_compile(path: str, threads: int, **config):
    """``path`` compiled for OpenVINO's CPU plugin. f32: on CPUs with AMX or AVX512-BF16 it
    would otherwise run the float ops in bf16, another function than the file defines."""
    import openvino as ov

    return ov.Core().compile_model(path, "CPU", {"INFERENCE_NUM_THREADS": threads,
                                                 "INFERENCE_PRECISION_HINT": "f32", **config})


def ort_optimized_ops(path: str, folder) -> list[str]:
    """The op types of the graph ONNX Runtime's CPU provider optimises ``path`` into (written to
    ``folder``/opt.onnx and read back): which kernels it runs, int8 or float."""
    import os

    import onnx
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.optimized_model_filepath = os.path.join(str(folder), "opt.onnx")
    so.log_severity_level = 3  # the "hardware specific optimizations" warning: we only read the graph
    ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return [n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node]


def ort_run(path: str, x, *, optimised: bool = False):
    """ONNX Runtime's CPU output for the input ``x`` (a tensor): by default with graph
    optimisations off, so the file's own arithmetic runs, not ORT's fused kernels."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    if not optimised:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]
