"""One small member of each of 30-odd timm families (random weights, 10 classes, small images),
picked for the layer kinds openamct meets there: depthwise and squeeze-excite nets, split
attention, reparameterised nets, weight-standardised convs, TF "same" padding, attention
hybrids, MetaFormers and plain transformers."""

from __future__ import annotations

from functools import partial

import torch

from tests.zoo.families import reinitialise
from tests.zoo.torchvision_ops import vision_modules

_, timm = vision_modules()


def _bit(num_classes: int):
    """resnetv2_50x1_bit's block (StdConv2d, GroupNorm, pre-activation), one block a stage."""
    from timm.layers import StdConv2d
    from timm.models.resnetv2 import ResNetV2

    return ResNetV2(layers=[1, 1, 1, 1], num_classes=num_classes, stem_type="fixed",
                    conv_layer=partial(StdConv2d, eps=1e-8))


def _metaformer(mixers: str):
    """timm's MetaFormer with one block a stage (the named models have 12-18 blocks)."""
    from timm.models import metaformer as mf

    def build(num_classes: int):
        kinds = {
            "pool": dict(norm_layers=mf.GroupNorm1NoBias, use_mlp_head=False),  # poolformerv2_s12's
            "conv": dict(token_mixers=mf.SepConv, norm_layers=mf.LayerNorm2dNoBias),  # convformer_s18's
            "conv+attention": dict(token_mixers=[mf.SepConv, mf.SepConv, mf.Attention, mf.Attention],
                                   norm_layers=[mf.LayerNorm2dNoBias] * 2 + [mf.LayerNormNoBias] * 2),
        }
        return mf.MetaFormer(depths=[1, 1, 1, 1], dims=[32, 64, 96, 128], num_classes=num_classes, **kinds[mixers])
    return build


# family -> (timm model name or a builder, image size, extra create_model arguments)
MODELS = {
    "ResNet-T": ("resnet10t", 32, {}),
    "SE-ResNet": ("legacy_seresnet18", 32, {}),
    "SKNet": ("skresnet18", 32, {}),
    "ResNeSt": ("resnest14d", 32, {}),
    "Res2Net": ("res2net50_14w_8s", 32, {}),
    "RegNetX": ("regnetx_002", 32, {}),
    "DLA": ("dla46_c", 32, {}),
    "DPN": ("dpn48b", 32, {}),
    "CSPDarkNet": ("cs3darknet_focus_s", 32, {}),
    # 64 px: at 32 its last ceil-mode MaxPool(3) sees 2x2, which OpenVINO refuses
    "VoVNet-ESE": ("ese_vovnet19b_slim_dw", 64, {}),
    "HRNet": ("hrnet_w18_small", 64, {}),
    "MobileNetV3": ("mobilenetv3_small_050", 32, {}),
    "LCNet": ("lcnet_050", 32, {}),
    "TinyNet": ("tinynet_e", 32, {}),
    "TF-EfficientNet-Lite": ("tf_efficientnet_lite0", 32, {}),
    "GhostNet": ("ghostnet_050", 32, {}),
    "ReXNet": ("rexnet_100", 32, {}),
    "FasterNet": ("fasternet_t0", 32, {}),
    "RepVGG": ("repvgg_a0", 32, {}),
    "MobileOne": ("mobileone_s0", 32, {}),
    "RepGhost": ("repghostnet_050", 32, {}),
    "RepViT": ("repvit_m0_9", 32, {}),
    "FastViT": ("fastvit_t8", 64, {}),
    "HGNetV2": ("hgnetv2_b0", 32, {}),
    "NF-RegNet": ("nf_regnet_b0", 32, {}),
    "ResNetV2-BiT": (_bit, 32, {}),
    "ConvNeXt": ("convnext_atto", 32, {}),
    "InceptionNeXt": ("inception_next_atto", 32, {}),
    "PoolFormerV2": (_metaformer("pool"), 32, {}),
    "ConvFormer": (_metaformer("conv"), 32, {}),
    "CAFormer": (_metaformer("conv+attention"), 32, {}),
    "MambaOut": ("mambaout_femto", 32, {}),
    "StarNet": ("starnet_s050", 32, {}),
    "EdgeNeXt": ("edgenext_xx_small", 64, {}),
    "EfficientViT-MIT": ("efficientvit_b0", 64, {}),
    "CoaT-Lite": ("coat_lite_tiny", 64, {"img_size": 64}),
    "LeViT": ("levit_128s", 64, {"img_size": 64}),
    "MobileViT": ("mobilevit_xxs", 64, {}),
    "EfficientFormerV2": ("efficientformerv2_s0", 64, {"img_size": 64}),
    "PVTv2": ("pvt_v2_b0", 64, {}),
    "PiT": ("pit_ti_224", 64, {"img_size": 64}),
    "ViT": ("vit_tiny_patch16_224", 32, {"img_size": 32}),
    "DeiT-distilled": ("deit_tiny_distilled_patch16_224", 32, {"img_size": 32}),
    "XCiT": ("xcit_nano_12_p16_224", 32, {"img_size": 32}),
    "MLP-Mixer": ("mixer_s16_224", 32, {"img_size": 32}),
    "MaxViT": ("maxvit_nano_rw_256", 64, {"img_size": 64}),
    "GCViT": ("gcvit_xxtiny", 64, {"img_size": 64}),
    "BoTNet": ("botnet26t_256", 64, {"img_size": 64}),
}
BUILDERS = MODELS
# The test's share (test_timm_zoo.py): the families that run in a few seconds. The others
# (a second member of a kind, or 10-17 s a run) are in the table (python -m tests.zoo.table timm).
# The test's share of the families (the table runs them all): the slowest few of a kind that
# others already cover (MobileOne: RepVGG; SE-ResNet: ResNeSt, SKNet; CoaT-Lite and
# EfficientFormerV2: MobileViT, LeViT, FastViT) are left to the table to keep the suite short.
TESTED = ("ResNet-T", "SKNet", "ResNeSt", "RegNetX", "DLA", "DPN", "CSPDarkNet", "VoVNet-ESE",
          "MobileNetV3", "LCNet", "TinyNet", "TF-EfficientNet-Lite", "FasterNet", "RepVGG",
          "RepGhost", "FastViT", "HGNetV2", "NF-RegNet", "ResNetV2-BiT", "ConvNeXt", "InceptionNeXt",
          "PoolFormerV2", "ConvFormer", "CAFormer", "MambaOut", "StarNet", "EdgeNeXt", "EfficientViT-MIT",
          "LeViT", "MobileViT", "PVTv2", "ViT")


def build(family: str, seed: int = 0):
    """(model in eval mode, {"x": a batch of 2 images}) for one family."""
    torch.manual_seed(seed)
    name, size, extra = MODELS[family]
    if callable(name):
        model = name(num_classes=10)
    else:
        model = timm.create_model(name, pretrained=False, num_classes=10, **extra)
    inputs = {"x": torch.randn(2, 3, size, size)}
    reinitialise(model, inputs, seed)
    return model, inputs
