"""openamct: AMCT-compatible retrain compression for PyTorch with standard ONNX output."""

__version__ = "0.1.0"
