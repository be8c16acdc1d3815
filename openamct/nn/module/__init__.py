"""``openamct.nn.module``: the QAT module packages (``quantization``)."""
