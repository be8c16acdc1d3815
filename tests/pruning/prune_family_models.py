"""Small Hugging Face models from configs (random weights), their calibration data, and the
checks every pruning test makes: reload after save_pretrained, and ONNX Runtime on the export."""

from __future__ import annotations

import os

import numpy as np
import torch

VOCAB = 96


def tiny(kind: str, **over):
    """A 2-layer model of ``kind`` (llama, qwen2, mistral, bert, mixtral, qwen2_moe, olmoe)."""
    import transformers as T

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  attn_implementation="eager")
    if kind == "bert":
        cfg = T.BertConfig(intermediate_size=64, **common, **over)
        return T.BertModel(cfg).eval()
    if kind in ("llama", "qwen2", "mistral"):
        cls = {"llama": (T.LlamaConfig, T.LlamaForCausalLM), "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM),
               "mistral": (T.MistralConfig, T.MistralForCausalLM)}[kind]
        return cls[1](cls[0](intermediate_size=64, num_key_value_heads=2, **common, **over)).eval()
    moe = {"mixtral": (T.MixtralConfig, T.MixtralForCausalLM, dict(num_local_experts=8, intermediate_size=48)),
           "qwen2_moe": (T.Qwen2MoeConfig, T.Qwen2MoeForCausalLM,
                         dict(num_experts=8, moe_intermediate_size=24, shared_expert_intermediate_size=48,
                              intermediate_size=64)),
           "olmoe": (T.OlmoeConfig, T.OlmoeForCausalLM, dict(num_experts=8, intermediate_size=24, eos_token_id=2,
                                                                pad_token_id=1))}[kind]
    cfg = moe[0](num_key_value_heads=2, num_experts_per_tok=2, experts_implementation="eager", **moe[2], **common,
                 **over)
    model = moe[1](cfg).eval()
    with torch.no_grad():  # some routers start at zero: give every expert a distinct share
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") and p.dim() == 2:
                p.normal_(0, 0.5)
    return model


def calib(n: int = 4, batch: int = 2, seq: int = 12, seed: int = 1, kind: str = "ids"):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, VOCAB, (batch, seq), generator=g) for _ in range(n)]
    if kind == "dict":
        return [{"input_ids": x, "attention_mask": torch.ones_like(x)} for x in ids]
    return ids


def logits(model, x):
    with torch.no_grad():
        out = model(x)
    return getattr(out, "logits", None) if hasattr(out, "logits") else out.last_hidden_state


def reload_same(model, tmp_path, x) -> float:
    """Largest output difference between ``model`` and its save_pretrained/from_pretrained copy."""
    path = os.path.join(str(tmp_path), "hf")
    model.save_pretrained(path)
    back = type(model).from_pretrained(path).eval()
    return float((logits(model, x) - logits(back, x)).abs().max())


class _Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        out = self.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False) \
            if hasattr(self.model.config, "use_cache") \
            else self.model(input_ids=input_ids)
        return out.logits if hasattr(out, "logits") else out.last_hidden_state


def ort_matches(model, tmp_path, x) -> float:
    """Largest difference between ONNX Runtime on the model's export and the model itself."""
    import onnxruntime as ort

    path = os.path.join(str(tmp_path), "pruned.onnx")
    wrapped = _Logits(model).eval()
    torch.onnx.export(wrapped, (x,), path, input_names=["input_ids"], output_names=["out"], opset_version=17,
                      dynamo=False)
    got = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"input_ids": x.numpy()})[0]
    return float(np.abs(got - logits(model, x).numpy()).max())
