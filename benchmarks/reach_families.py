"""Small Hugging Face models of the transformer families whose filter-pruning reach
``python -m benchmarks.prune_reach_zoo hf`` measures (random weights, built offline from
config objects), and the ones tests/unit/test_reach*.py prune, export and run.

Why these sizes: the share prune_ratio 0.3 removes is decided by proportions, not size. So
each model keeps its shipped proportions (FFN 4 × hidden, 2 key/value heads per 4 query heads
for the GQA decoders, SqueezeBERT's 12 heads over 4 grouped-conv blocks) at hidden 64 and two
layers; the tests' zoo (tests/zoo/families.py: FFN 2 × hidden) understates the FFN's share.
"""

from __future__ import annotations

import torch

HIDDEN = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256)
DECODER = dict(vocab_size=100, num_key_value_heads=2, max_position_embeddings=64, **HIDDEN)
VISION = dict(image_size=32, patch_size=8, num_labels=10, **HIDDEN)


def _vision(cls_name: str, config_name: str, **cfg):
    def build():
        import transformers as T
        model = getattr(T, cls_name)(getattr(T, config_name)(**cfg))
        return model, {"pixel_values": torch.randn(1, 3, 32, 32)}
    return build


def _text(cls_name: str, config_name: str, **cfg):
    def build():
        import transformers as T
        ids = torch.randint(3, cfg.get("vocab_size", 100), (1, 12))
        model = getattr(T, cls_name)(getattr(T, config_name)(**cfg))
        return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return build


def _whisper():
    import transformers as T
    config = T.WhisperConfig(d_model=64, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=256,
                             decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=256, num_mel_bins=16,
                             max_source_positions=16, vocab_size=100, pad_token_id=0, bos_token_id=1,
                             eos_token_id=2, decoder_start_token_id=1)
    return T.WhisperModel(config).get_encoder(), {"input_features": torch.randn(1, 16, 32)}


FAMILIES = {
    "ViT": _vision("ViTForImageClassification", "ViTConfig", **VISION),
    "DeiT": _vision("DeiTForImageClassification", "DeiTConfig", **VISION),
    "BEiT": _vision("BeitForImageClassification", "BeitConfig", **VISION),
    "DINOv2": _vision("Dinov2Model", "Dinov2Config", image_size=32, patch_size=8, hidden_size=64,
                      num_hidden_layers=2, num_attention_heads=4, mlp_ratio=4),
    "GPT-2": _text("GPT2LMHeadModel", "GPT2Config", vocab_size=100, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                   bos_token_id=1, eos_token_id=2),
    "Llama": _text("LlamaForCausalLM", "LlamaConfig", **DECODER),
    "Qwen2": _text("Qwen2ForCausalLM", "Qwen2Config", **DECODER),
    "Mistral": _text("MistralForCausalLM", "MistralConfig", **DECODER),
    "OPT": _text("OPTForCausalLM", "OPTConfig", vocab_size=100, hidden_size=64, num_hidden_layers=2,
                 num_attention_heads=4, ffn_dim=256, max_position_embeddings=64, word_embed_proj_dim=64),
    "GPT-Neo": _text("GPTNeoForCausalLM", "GPTNeoConfig", vocab_size=100, hidden_size=64, num_layers=2, num_heads=4,
                     attention_types=[[["global", "local"], 1]], max_position_embeddings=64, intermediate_size=256,
                     bos_token_id=1, eos_token_id=2),
    "Whisper-encoder": _whisper,
    "PoolFormer": _vision("PoolFormerForImageClassification", "PoolFormerConfig", hidden_sizes=[16, 32, 64, 128],
                          depths=[1, 1, 1, 1], num_labels=10),
    "SqueezeBERT": _text("SqueezeBertForSequenceClassification", "SqueezeBertConfig", vocab_size=100,
                         hidden_size=96, embedding_size=96, num_hidden_layers=2, num_attention_heads=12,
                         intermediate_size=384, max_position_embeddings=64, num_labels=4, pad_token_id=0),
}


def build(family: str, attention: str | None = None, seed: int = 0):
    """(model in eval mode, example inputs) of one family; ``attention``: a Hugging Face
    attention implementation ("eager"), or None for the model's default (SDPA where it has it)."""
    from tests.zoo.families import reinitialise

    torch.manual_seed(seed)
    model, inputs = FAMILIES[family]()
    if attention is not None:
        model.config._attn_implementation = attention
    reinitialise(model, inputs, seed)
    return model, inputs
