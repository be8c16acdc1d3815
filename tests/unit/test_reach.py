"""Filter pruning on the transformer structures that used to stay whole: Hugging Face SDPA's
grouped-query attention (``enable_gqa``: whole KV groups with their query heads), GPT-Neo's
merge written as ``num_heads * head_dim``, PoolFormer's LayerScale read through unsqueezes, and
SqueezeBERT's grouped 1×1 Conv1d projections split into heads. Each on a small Hugging Face
config (random weights, benchmarks/reach_families.py): the groups are found, the pruned
forward follows them (consistency), and the whole lifecycle (create, train, restore, save)
runs, with the fake-quant ONNX reproducing the model in ONNX Runtime.
"""

import pytest

from benchmarks.reach_families import build
from openamct.sparsity.consistency import consistent_groups
from tests.pruning import select_filters
from tests.zoo.lifecycle import CONFIGS, run


def _groups(family: str):
    model, inputs = build(family)
    groups, blocked = select_filters(model, inputs, ratio=0.3, types=None)
    return model, inputs, groups, blocked


def _named(groups, producer: str):
    return next(g for g in groups if producer in g.producer_names)


def _lifecycle(tmp_path, family: str, share: float) -> dict:
    r = run(lambda: build(family), CONFIGS["filter0.3+int8"], str(tmp_path))
    assert r["removed_share"] >= share, r
    assert r["fake_vs_torch"] >= 0.999, r
    return r


def test_sdpa_gqa_prunes_whole_kv_groups_with_their_query_heads():
    model, inputs, groups, _ = _groups("Llama")
    attn = "model.layers.0.self_attn"
    g = _named(groups, f"{attn}.q_proj")
    assert set(g.producer_names) == {f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"}
    # 2 KV heads, 2 query heads each: a unit is one KV head (16 rows) and its 2 query heads (32 rows)
    rows = {p.name: p.repeat for p in g.producers}
    assert rows == {f"{attn}.q_proj": 32, f"{attn}.k_proj": 16, f"{attn}.v_proj": 16} and g.channels == 2
    assert g.removed and consistent_groups(model, groups, inputs) == groups


def test_sdpa_gqa_lifecycle_runs_in_onnx_runtime(tmp_path):
    _lifecycle(tmp_path, "Llama", 0.25)


def test_sdpa_gqa_groups_are_the_eager_repeat_kv_groups():
    # enable_gqa reads KV head i // n_rep for query head i, as eager's repeat_kv expands it: both
    # paths must find the same groups and remove the same heads
    found = {}
    for attention in (None, "eager"):
        model, inputs = build("Llama", attention)
        groups, _ = select_filters(model, inputs, ratio=0.3, types=None)
        found[attention] = sorted((tuple(g.producer_names), g.channels, tuple(g.removed)) for g in groups)
    assert found[None] == found["eager"]


def test_gpt_neo_merge_from_the_head_count_follows():
    model, inputs, groups, _ = _groups("GPT-Neo")
    attn = "transformer.h.0.attn.attention"
    g = _named(groups, f"{attn}.q_proj")
    assert f"{attn}.num_heads" in {m.name for m in g.passive}
    assert g.removed and consistent_groups(model, groups, inputs) == groups


def test_gpt_neo_lifecycle_runs_in_onnx_runtime(tmp_path):
    _lifecycle(tmp_path, "GPT-Neo", 0.25)


def test_poolformer_layer_scale_through_unsqueezes_follows():
    model, inputs, groups, _ = _groups("PoolFormer")
    g = _named(groups, "poolformer.encoder.patch_embeddings.0.projection")
    params = {m.name for m in g.passive if m.op_type == "Parameter"}
    assert "poolformer.encoder.block.0.0.layer_scale_1" in params
    assert consistent_groups(model, groups, inputs) == groups


def test_poolformer_lifecycle_runs_in_onnx_runtime(tmp_path):
    _lifecycle(tmp_path, "PoolFormer", 0.25)


def test_squeezebert_grouped_conv_heads_are_pruned_per_block():
    model, inputs, groups, _ = _groups("SqueezeBERT")
    attn = "transformer.encoder.layers.0.attention"
    g = _named(groups, f"{attn}.query")
    assert set(g.producer_names) == {f"{attn}.query", f"{attn}.key", f"{attn}.value"}
    # 12 heads of 8 in 4 conv groups: whole heads, the same number from each group of 3
    assert g.channels == 12 and g.prune_group == 4 and all(p.repeat == 8 for p in g.producers)
    assert len(g.removed) == 4 and sorted(h // 3 for h in g.removed) == [0, 1, 2, 3]
    assert {f"{attn}.num_attention_heads", f"{attn}.all_head_size"} <= {m.name for m in g.passive}
    assert consistent_groups(model, groups, inputs) == groups


def test_squeezebert_lifecycle_runs_in_onnx_runtime(tmp_path):
    r = _lifecycle(tmp_path, "SqueezeBERT", 0.25)
    assert r["pruned"] > 0


@pytest.mark.parametrize("family", ["GPT-2", "ViT", "BEiT", "DINOv2", "OPT", "Whisper-encoder"])
def test_families_already_reaching_keep_reaching(family):
    model, inputs, groups, _ = _groups(family)
    assert any(g.removed for g in groups)
    assert consistent_groups(model, groups, inputs) == groups


def test_a_softmax_module_along_the_channels_blocks_and_across_them_follows():
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.a, self.softmax, self.b = nn.Conv1d(4, 8, 1), nn.Softmax(dim=dim), nn.Conv1d(8, 2, 1)

        def forward(self, x):
            return self.b(self.softmax(self.a(x)))

    x = torch.randn(2, 4, 6)
    groups, _ = select_filters(Net(dim=-1).eval(), x, ratio=0.5, types=None)
    assert [g.producer_names for g in groups if g.removed] == [["a"]]
    groups, blocked = select_filters(Net(dim=1).eval(), x, ratio=0.5, types=None)
    assert not [g for g in groups if "a" in g.producer_names]
    assert any(b.producers == ["a"] and "works along the channel axis" in b.reason for b in blocked)
