"""OpenVINO's CPU plugin as the tests and benchmarks compile it."""


def openvino_compile(path: str, threads: int, **config):
    """``path`` compiled for OpenVINO's CPU plugin. f32: on CPUs with AMX or AVX512-BF16 it
    would otherwise run the float ops in bf16, another function than the file defines."""
    import openvino as ov

    return ov.Core().compile_model(path, "CPU", {"INFERENCE_NUM_THREADS": threads,
                                                 "INFERENCE_PRECISION_HINT": "f32", **config})
