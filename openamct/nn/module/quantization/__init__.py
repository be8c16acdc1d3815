"""Single-op QAT modules, one module per layer kind as upstream's
``amct_pytorch.nn.module.quantization`` (``conv2d.Conv2dQAT``, ``linear.LinearQAT``...), and
the parser of their ``config`` dict (``config.parse_qat_config``)."""

from openamct.nn.module.quantization.conv1d import Conv1dQAT
from openamct.nn.module.quantization.conv2d import Conv2dQAT
from openamct.nn.module.quantization.conv3d import Conv3dQAT
from openamct.nn.module.quantization.conv_transpose_1d import ConvTranspose1dQAT
from openamct.nn.module.quantization.conv_transpose_2d import ConvTranspose2dQAT
from openamct.nn.module.quantization.gru import GRUQAT
from openamct.nn.module.quantization.linear import LinearQAT
from openamct.nn.module.quantization.lstm import LSTMQAT

__all__ = ["Conv1dQAT", "Conv2dQAT", "Conv3dQAT", "ConvTranspose1dQAT", "ConvTranspose2dQAT", "LinearQAT",
           "LSTMQAT", "GRUQAT"]
