"""Eager (single-op) quantization-aware training, upstream AMCT's ``amct_pytorch.nn`` layout:
QAT modules a model is built from (or converted to with ``from_float``)."""
