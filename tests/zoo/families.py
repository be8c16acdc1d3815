"""Small Hugging Face models of 22 families, built offline from config objects (random weights,
re-initialised so the numbers mean something), with example inputs in the form each takes."""

from __future__ import annotations

import math

import torch
from torch import nn

IMAGE = (2, 3, 32, 32)
# Gain 1, not Kaiming's sqrt(2): BatchNorm re-normalises anyway, and the random networks stay
# far enough from chaos that one quantizer step flipped by float noise does not swamp the
# output (MobileViT: 3 of 5 batches flipped at gain sqrt(2), 1 of 5 at gain 1).
CONV_GAIN = 1.0


def _vision(cls_name: str, config_name: str, image=IMAGE, **cfg):
    import transformers as T

    def build():
        config = getattr(T, config_name)(**cfg)
        return getattr(T, cls_name)(config), {"pixel_values": torch.randn(*image)}
    return build


def _text(cls_name: str, config_name: str, **cfg):
    import transformers as T

    def build():
        config = getattr(T, config_name)(**cfg)
        ids = torch.randint(3, cfg.get("vocab_size", 100), (2, 12))
        return getattr(T, cls_name)(config), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return build


TEXT = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64)
DECODER = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=64, max_position_embeddings=64)


def _whisper():
    import transformers as T

    config = T.WhisperConfig(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
                             decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=64, num_mel_bins=16,
                             max_source_positions=16, vocab_size=100, pad_token_id=0,
                             bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    return T.WhisperModel(config).get_encoder(), {"input_features": torch.randn(2, 16, 32)}


def _wav2vec2():
    import transformers as T

    config = T.Wav2Vec2Config(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=64, conv_dim=(16, 16, 16), conv_stride=(5, 2, 2),
                              conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
                              do_stable_layer_norm=False, feat_extract_norm="group")
    return T.Wav2Vec2Model(config), {"input_values": torch.randn(2, 1600)}


def _t5():
    import transformers as T

    config = T.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    ids = torch.randint(3, 100, (2, 12))
    return T.T5EncoderModel(config), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


FAMILIES = {
    "ResNet": _vision("ResNetForImageClassification", "ResNetConfig", embedding_size=16, hidden_sizes=[16, 32],
                      depths=[1, 1], layer_type="basic", num_labels=10),
    "ConvNeXt": _vision("ConvNextForImageClassification", "ConvNextConfig", hidden_sizes=[16, 32], depths=[1, 1],
                        num_stages=2, num_labels=10),
    "ConvNeXtV2": _vision("ConvNextV2ForImageClassification", "ConvNextV2Config", hidden_sizes=[16, 32],
                          depths=[1, 1], num_stages=2, num_labels=10),
    "MobileNetV1": _vision("MobileNetV1ForImageClassification", "MobileNetV1Config", depth_multiplier=0.25,
                           image_size=32, num_labels=10),
    "MobileNetV2": _vision("MobileNetV2ForImageClassification", "MobileNetV2Config", depth_multiplier=0.25,
                           image_size=32, num_labels=10),
    "EfficientNet": _vision("EfficientNetForImageClassification", "EfficientNetConfig", width_coefficient=0.25,
                            depth_coefficient=0.25, image_size=32, hidden_dim=320, num_labels=10),
    "RegNet": _vision("RegNetForImageClassification", "RegNetConfig", embedding_size=16, hidden_sizes=[16, 32],
                      depths=[1, 1], groups_width=8, num_labels=10),
    "MobileViT": _vision("MobileViTForImageClassification", "MobileViTConfig", image_size=32,
                         hidden_sizes=[32, 48, 64], neck_hidden_sizes=[8, 16, 24, 32, 48, 64, 96], num_labels=10),
    "ViT": _vision("ViTForImageClassification", "ViTConfig", image_size=32, patch_size=8, hidden_size=32,
                   num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, num_labels=10),
    "DeiT": _vision("DeiTForImageClassification", "DeiTConfig", image_size=32, patch_size=8, hidden_size=32,
                    num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, num_labels=10),
    "Swin": _vision("SwinForImageClassification", "SwinConfig", image_size=32, patch_size=2, embed_dim=16,
                    depths=[1, 1], num_heads=[2, 4], window_size=4, num_labels=10),
    "SegFormer": _vision("SegformerForSemanticSegmentation", "SegformerConfig", num_encoder_blocks=2, depths=[1, 1],
                         sr_ratios=[2, 1], hidden_sizes=[16, 32], patch_sizes=[7, 3], strides=[4, 2],
                         num_attention_heads=[1, 2], mlp_ratios=[2, 2], decoder_hidden_size=32, num_labels=4),
    "BERT": _text("BertForSequenceClassification", "BertConfig", num_labels=4, **TEXT),
    "DistilBERT": _text("DistilBertForSequenceClassification", "DistilBertConfig", vocab_size=100, dim=32, n_layers=2,
                        n_heads=4, hidden_dim=64, max_position_embeddings=64, num_labels=4),
    "RoBERTa": _text("RobertaForSequenceClassification", "RobertaConfig", num_labels=4, **TEXT),
    "ALBERT": _text("AlbertForSequenceClassification", "AlbertConfig", embedding_size=16, num_labels=4, **TEXT),
    "GPT-2": _text("GPT2LMHeadModel", "GPT2Config", vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                   bos_token_id=1, eos_token_id=2),
    "Llama": _text("LlamaForCausalLM", "LlamaConfig", **DECODER),
    "Qwen2": _text("Qwen2ForCausalLM", "Qwen2Config", **DECODER),
    "T5-encoder": _t5,
    "Wav2Vec2": _wav2vec2,
    "Whisper-encoder": _whisper,
}


@torch.no_grad()
def reinitialise(model: nn.Module, inputs: dict, seed: int = 0) -> None:
    """Fan-in scaled weights, random norm affines, BatchNorm statistics from a few random
    batches: HF's default init (std 0.02) makes deep CNNs output ~1e-33."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        w = getattr(m, "weight", None)
        conv = isinstance(m, (nn.Conv1d, nn.Conv2d))
        if conv or isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D":
            fan_in = w.shape[0] if type(m).__name__ == "Conv1D" else w[0].numel()
            bound = (CONV_GAIN if conv else 1.0) * math.sqrt(3.0 / fan_in)
            if isinstance(w, nn.Parameter):
                w.copy_((torch.rand(w.shape, generator=g) * 2 - 1) * bound)
            if getattr(m, "bias", None) is not None:
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.05)
        elif isinstance(m, (nn.BatchNorm2d, nn.LayerNorm, nn.GroupNorm)) and getattr(m, "weight", None) is not None:
            m.weight.copy_(0.75 + 0.5 * torch.rand(m.weight.shape, generator=g))
            if m.bias is not None:  # timm's MetaFormers: norms without a bias
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if bns:
        for bn in bns:
            bn.reset_running_stats()
            bn.momentum = None  # cumulative average over the calibration batches
        model.train()
        for _ in range(3):
            model(**{k: _like(v, g) for k, v in inputs.items()})
        for bn in bns:
            bn.momentum = 0.1
    model.eval()


def _like(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    if t.is_floating_point():
        return torch.randn(t.shape, generator=g)
    return t


def build(family: str, seed: int = 0):
    """(model in eval mode, example inputs dict) for one family."""
    torch.manual_seed(seed)
    model, inputs = FAMILIES[family]()
    if hasattr(model, "config") and hasattr(model.config, "_attn_implementation"):
        model.config._attn_implementation = "eager"
    reinitialise(model, inputs, seed)
    return model, inputs
