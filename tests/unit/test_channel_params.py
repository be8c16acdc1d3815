"""Per-channel parameter owners follow a filter-prune decision: norms over the
channels (LayerNorm, RMSNorm, GroupNorm, ConvNeXt's channels-first LayerNorm), ConvNeXtV2's
GRN and LayerScale vectors are sliced with the channels; what cannot follow says why once."""

import copy
import logging

import pytest
import torch
from torch import nn
from transformers.models.convnext.modeling_convnext import ConvNextLayerNorm
from transformers.models.convnextv2.modeling_convnextv2 import ConvNextV2GRN
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from openamct.record import attrs
from openamct.record.scale_offset_record_pb2 import ScaleOffsetRecord
from openamct.sparsity.filter import apply_removal
from openamct.sparsity.filter_record import groups_from_records, groups_to_records
from tests.pruning import select_filters

# -- models -------------------------------------------------------------------------------------


class GroupNormNet(nn.Module):
    def __init__(self, groups=4):
        super().__init__()
        self.conv1, self.gn, self.conv2 = nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(groups, 16), nn.Conv2d(16, 8, 1)

    def forward(self, x):
        return self.conv2(torch.relu(self.gn(self.conv1(x)))).mean((2, 3))


class TokenNet(nn.Module):
    """Linear -> a norm over the features -> LayerScale (a bare parameter) -> Linear."""

    def __init__(self, norm):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(16, 32), norm, nn.Linear(32, 8)
        self.gamma = nn.Parameter(torch.rand(32) + 0.5)

    def forward(self, x):
        return self.fc2(self.gamma * torch.nn.functional.gelu(self.norm(self.fc1(x)))).mean(1)


class ConvNextLike(nn.Module):
    """HF's channels-first LayerNorm, a permute to channels-last, HF's GRN on (N, H, W, C)."""

    def __init__(self):
        super().__init__()
        self.stem, self.ln = nn.Conv2d(3, 16, 2, stride=2), ConvNextLayerNorm(16, data_format="channels_first")
        self.fc1, self.grn, self.fc2 = nn.Linear(16, 32), ConvNextV2GRN(32), nn.Linear(32, 8)
        with torch.no_grad():
            self.grn.weight.uniform_(0.5, 1.5)
            self.grn.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        h = self.ln(self.stem(x)).permute(0, 2, 3, 1)
        return self.fc2(self.grn(torch.relu(self.fc1(h)))).mean((1, 2))


class Mix(nn.Module):
    """A leaf module whose parameter is a matrix over the channels: it cannot follow."""

    def __init__(self, c):
        super().__init__()
        self.w = nn.Parameter(torch.randn(c, c))

    def forward(self, x):
        return x @ self.w


class BlockedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(8, 16)
        self.mix1, self.mix2, self.wide = Mix(16), Mix(16), nn.LayerNorm((4, 16))
        self.g = nn.Parameter(torch.ones(16))
        self.out = nn.Linear(16, 2)

    def forward(self, x):
        shared = self.fc3(x) * self.g + self.g  # one parameter read twice
        return self.out(self.mix1(self.fc1(x)) + self.mix2(self.fc2(x)) + self.wide(shared)).sum(1)


def prune(model, x, ratio=0.5):
    return select_filters(model, x, ratio)


def owners(group):
    return {m.name: m.op_type for m in group.passive if not m.is_function}


TOKENS = torch.randn(2, 5, 16)
NORMS = [lambda: nn.LayerNorm(32), lambda: nn.RMSNorm(32), lambda: LlamaRMSNorm(32)]

# -- tests --------------------------------------------------------------------------------------


@pytest.mark.parametrize("make_norm", NORMS, ids=["LayerNorm", "RMSNorm", "LlamaRMSNorm"])
def test_norm_and_layer_scale_are_sliced_with_the_channels(make_norm):
    torch.manual_seed(0)
    model = TokenNet(make_norm()).eval()
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
    original = copy.deepcopy(model)
    groups, _ = prune(model, TOKENS)
    (g,) = [g for g in groups if g.producer_names == ["fc1"]]
    kind = {"LayerNorm": "LayerNormalization", "RMSNorm": "RMSNormalization"}.get(type(model.norm).__name__,
                                                                                 "ChannelParams")
    assert owners(g) == {"norm": kind, "gamma": "Parameter"}
    apply_removal(model, groups)
    keep = [c for c in range(32) if c not in g.removed]
    assert len(keep) == 16
    assert torch.equal(model.norm.weight, original.norm.weight[keep])
    assert torch.equal(model.gamma, original.gamma[keep]) and isinstance(model.gamma, nn.Parameter)
    if hasattr(model.norm, "normalized_shape"):
        assert tuple(model.norm.normalized_shape) == (16,)
    assert model(TOKENS).shape == original(TOKENS).shape


def test_group_norm_keeps_every_group_with_equal_removal():
    torch.manual_seed(0)
    model = GroupNormNet().eval()
    groups, _ = prune(model, torch.randn(2, 3, 8, 8))
    (g,) = groups
    assert g.prune_group == 4 and owners(g) == {"gn": "GroupNormalization"}
    assert [sum(1 for c in g.removed if c // 4 == b) for b in range(4)] == [2, 2, 2, 2]
    apply_removal(model, groups)
    assert (model.gn.num_groups, model.gn.num_channels, model.gn.weight.shape) == (4, 8, (8,))
    assert model(torch.randn(2, 3, 8, 8)).shape == (2, 8)


def test_group_norm_of_one_channel_per_group_loses_groups():
    torch.manual_seed(0)
    model = GroupNormNet(groups=16).eval()
    groups, _ = prune(model, torch.randn(2, 3, 8, 8))
    assert groups[0].prune_group == 1
    apply_removal(model, groups)
    assert (model.gn.num_groups, model.gn.num_channels) == (8, 8)
    assert model(torch.randn(2, 3, 8, 8)).shape == (2, 8)


def test_convnext_layer_norm_and_grn_follow_through_the_permute():
    torch.manual_seed(0)
    model, x = ConvNextLike().eval(), torch.randn(2, 3, 8, 8)
    original = copy.deepcopy(model)
    groups, blocked = prune(model, x)
    by = {tuple(g.producer_names): g for g in groups}
    assert owners(by[("stem",)]) == {"ln": "LayerNormalization"}
    assert owners(by[("fc1",)]) == {"grn": "ChannelParams"}
    assert [b.producers for b in blocked] == [["fc2"]]  # the graph output, nothing else
    apply_removal(model, groups)
    keep = [c for c in range(32) if c not in by[("fc1",)].removed]
    assert model.grn.weight.shape == (1, 1, 1, 16) and torch.equal(model.grn.bias, original.grn.bias[..., keep])
    assert tuple(model.ln.normalized_shape) == (8,) and model(x).shape == (2, 8)


def test_what_cannot_follow_blocks_and_warns_once_per_reason(caplog):
    model = BlockedNet().eval()
    with caplog.at_level(logging.WARNING, logger="openamct.sparsity.dependency"):
        groups, blocked = prune(model, torch.randn(2, 4, 8))
    at = {b.producers[0]: (b.at, b.reason) for b in blocked}
    assert at["fc1"][0] == "mix1" and "'w' (16, 16) is not one value per channel" in at["fc1"][1]
    assert at["fc3"] == ("mul_0", "parameter 'g' holds one value per channel but is read by 2 ops (slicing it "
                                  "would change the others)")
    assert groups == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # mix1 and mix2 stop their groups for the same reason: one WARNING naming both
    (mixes,) = [w for w in warnings if "is not one value per channel" in w]
    assert mixes.startswith("filter prune: group(s) not pruned: 2:") and "fc1" in mixes and "fc2" in mixes


def test_layer_norm_over_more_than_the_channels_blocks():
    class Wide(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.ln, self.out = nn.Linear(8, 16), nn.LayerNorm((4, 16)), nn.Linear(16, 2)

        def forward(self, x):
            return self.out(self.ln(self.fc(x))).sum(1)

    _, blocked = prune(Wide().eval(), torch.randn(2, 4, 8))
    (b,) = [b for b in blocked if b.producers == ["fc"]]
    assert b.at == "ln" and "normalises over (4, 16)" in b.reason


@pytest.mark.parametrize("make", [lambda: TokenNet(nn.LayerNorm(32)), lambda: TokenNet(LlamaRMSNorm(32)),
                                  ConvNextLike, GroupNormNet], ids=["LayerNorm", "LlamaRMSNorm", "ConvNeXt", "GN"])
def test_record_replays_the_owners_exactly(make):
    torch.manual_seed(1)
    original = make().eval()
    x = TOKENS if isinstance(original, TokenNet) else torch.randn(2, 3, 8, 8)
    model = copy.deepcopy(original)
    groups, _ = prune(model, x)
    record = ScaleOffsetRecord()
    groups_to_records(groups, record)
    apply_removal(model, groups)
    fresh = copy.deepcopy(original)
    apply_removal(fresh, groups_from_records(record, fresh))
    a, b = model.state_dict(), fresh.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))


def _consumer(record, name):
    return next(n for pr in record.prune_record for n in pr.consumer if n.name == name)


def test_record_with_a_wrong_owner_is_refused():
    torch.manual_seed(1)
    original = TokenNet(nn.LayerNorm(32)).eval()
    groups, _ = prune(copy.deepcopy(original), TOKENS)
    record = ScaleOffsetRecord()
    groups_to_records(groups, record)

    wrong_type = copy.deepcopy(record)
    node = _consumer(wrong_type, "norm")
    del node.attr[:]
    attrs.add_str(node, "type", "GroupNormalization")
    attrs.add_int(node, "begin", 0)
    attrs.add_int(node, "end", 32)
    with pytest.raises(ValueError, match=r"prune_record\[0\].*'norm' is a LayerNorm in the model, not a per-channel"):
        groups_from_records(wrong_type, copy.deepcopy(original))

    missing = copy.deepcopy(record)
    _consumer(missing, "gamma").name = "beta"
    with pytest.raises(ValueError, match=r"'beta' does not exist in the model \(type 'Parameter'\)"):
        groups_from_records(missing, copy.deepcopy(original))

    smaller = TokenNet(nn.LayerNorm(32)).eval()
    smaller.gamma = nn.Parameter(torch.ones(24))
    with pytest.raises(ValueError, match=r"'gamma' has 24 channels, the record says begin=0 end=32"):
        groups_from_records(record, smaller)


def test_group_norm_record_with_unequal_removal_per_group_is_refused():
    torch.manual_seed(1)
    original = GroupNormNet().eval()
    groups, _ = prune(copy.deepcopy(original), torch.randn(2, 3, 8, 8))
    groups[0].removed, groups[0].prune_group = list(range(8)), 1  # groups 0 and 1 of the GroupNorm emptied
    record = ScaleOffsetRecord()
    groups_to_records(groups, record)
    with pytest.raises(ValueError, match=r"gn.num_channels: groups=4 needs the same number of channels removed"):
        groups_from_records(record, copy.deepcopy(original))
