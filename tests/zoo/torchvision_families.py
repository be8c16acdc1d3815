"""Every classification family of ``torchvision.models`` as a small random-weight instance, built
through the model classes' constructors (the named builders' stock widths run to 100M+
parameters), with an example image batch as ``{"x": ...}`` (torchvision's forward argument)."""

from __future__ import annotations

import torch
from torch import nn

from tests.zoo.families import reinitialise
from tests.zoo.torchvision_ops import vision_modules

tv, _ = vision_modules()
M = tv.models
NUM_CLASSES = 10


def _small_head(model: nn.Module, features: int) -> nn.Module:
    """AlexNet's and VGG's 4096-wide classifier, 64 wide (the same layers, 50M weights fewer)."""
    model.classifier = nn.Sequential(nn.Dropout(0.5), nn.Linear(features, 64), nn.ReLU(True), nn.Dropout(0.5),
                                     nn.Linear(64, 64), nn.ReLU(True), nn.Linear(64, NUM_CLASSES))
    return model


def _alexnet():
    # 1x1 features at 64 px: torch's ONNX export refuses AdaptiveAvgPool2d(6) from 1x1
    model = M.AlexNet(num_classes=NUM_CLASSES)
    model.avgpool = nn.AdaptiveAvgPool2d((1, 1))
    return _small_head(model, 256), 64


def _vgg():
    cfg = [16, "M", 32, "M", 64, 64, "M", 64, "M"]
    model = M.VGG(M.vgg.make_layers(cfg, batch_norm=True), num_classes=NUM_CLASSES)
    model.avgpool = nn.AdaptiveAvgPool2d((2, 2))
    return _small_head(model, 64 * 2 * 2), 32


def _efficientnet_v2():
    E = M.efficientnet
    setting = [E.FusedMBConvConfig(1, 3, 1, 16, 16, 1), E.FusedMBConvConfig(4, 3, 2, 16, 24, 1),
               E.MBConvConfig(4, 3, 2, 24, 32, 1), E.MBConvConfig(6, 3, 1, 32, 48, 1)]
    return M.EfficientNet(setting, dropout=0.2, last_channel=128, num_classes=NUM_CLASSES), 32


def _regnet(se_ratio: float | None):
    params = M.regnet.BlockParams.from_init_params(depth=4, w_0=16, w_a=8.0, w_m=2.0, group_width=8,
                                                   se_ratio=se_ratio)
    return M.RegNet(params, num_classes=NUM_CLASSES), 32


def _swin(v2: bool):
    S = M.swin_transformer
    extra = dict(block=S.SwinTransformerBlockV2, downsample_layer=S.PatchMergingV2) if v2 else {}
    return M.SwinTransformer(patch_size=[2, 2], embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=[4, 4],
                             stochastic_depth_prob=0.0, num_classes=NUM_CLASSES, **extra), 32


# family -> () -> (model, image size)
BUILDERS = {
    "AlexNet": _alexnet,
    "VGG-BN": _vgg,
    "ResNet": lambda: (M.ResNet(M.resnet.BasicBlock, [1, 1, 1, 1], num_classes=NUM_CLASSES), 32),
    "ResNeXt": lambda: (M.ResNet(M.resnet.Bottleneck, [1, 1, 1, 1], groups=4, width_per_group=4,
                                 num_classes=NUM_CLASSES), 32),
    "Wide-ResNet": lambda: (M.ResNet(M.resnet.Bottleneck, [1, 1, 1, 1], width_per_group=32,
                                     num_classes=NUM_CLASSES), 32),
    "DenseNet": lambda: (M.DenseNet(growth_rate=8, block_config=(2, 2, 2), num_init_features=16, bn_size=2,
                                    num_classes=NUM_CLASSES), 32),
    "SqueezeNet": lambda: (M.SqueezeNet("1_1", num_classes=NUM_CLASSES), 64),
    "GoogLeNet": lambda: (M.GoogLeNet(num_classes=NUM_CLASSES, aux_logits=False, init_weights=True), 32),
    "InceptionV3": lambda: (M.Inception3(num_classes=NUM_CLASSES, aux_logits=False, init_weights=False), 75),
    "MNASNet": lambda: (M.MNASNet(0.25, num_classes=NUM_CLASSES), 32),
    "MobileNetV2": lambda: (M.MobileNetV2(num_classes=NUM_CLASSES, width_mult=0.25), 32),
    "MobileNetV3": lambda: (M.mobilenet_v3_small(num_classes=NUM_CLASSES, width_mult=0.5), 32),
    "EfficientNet": lambda: (M.EfficientNet(M.efficientnet._efficientnet_conf("efficientnet_b0", width_mult=0.25,
                                                                               depth_mult=0.25)[0],
                                            dropout=0.2, num_classes=NUM_CLASSES), 32),
    "EfficientNetV2": _efficientnet_v2,
    "RegNetX": lambda: _regnet(None),
    "RegNetY": lambda: _regnet(0.25),
    "ShuffleNetV2": lambda: (M.ShuffleNetV2([2, 2, 2], [16, 24, 48, 96, 128], num_classes=NUM_CLASSES), 32),
    "ConvNeXt": lambda: (M.ConvNeXt([M.convnext.CNBlockConfig(16, 32, 1), M.convnext.CNBlockConfig(32, None, 1)],
                                    stochastic_depth_prob=0.0, num_classes=NUM_CLASSES), 32),
    "ViT": lambda: (M.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=32,
                                        mlp_dim=64, num_classes=NUM_CLASSES), 32),
    "Swin": lambda: _swin(False),
    "SwinV2": lambda: _swin(True),
    "MaxViT": lambda: (M.MaxVit(input_size=(32, 32), stem_channels=16, partition_size=2, block_channels=[16, 32],
                                block_layers=[1, 1], head_dim=8, stochastic_depth_prob=0.0,
                                num_classes=NUM_CLASSES), 32),
}


def build(family: str, seed: int = 0):
    """(model in eval mode, {"x": a batch of 2 images}) for one family."""
    torch.manual_seed(seed)
    model, size = BUILDERS[family]()
    inputs = {"x": torch.randn(2, 3, size, size)}
    reinitialise(model, inputs, seed)
    return model, inputs
