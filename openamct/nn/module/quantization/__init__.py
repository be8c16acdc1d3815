"""Single-op QAT modules, one module per layer kind as upstream's
``amct_pytorch.nn.module.quantization`` (``conv2d.Conv2dQAT``, ``linear.LinearQAT``...), and
the parser of their ``config`` dict (``config.parse_qat_config``)."""
