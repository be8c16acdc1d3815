"""Filter-prune groups <-> record: upstream's message shape, replay without re-scoring,
refusal of records from another model, and upstream's own record files."""

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from openamct.config.specs import LayerPlan, Plan
from openamct.graph.capture import capture_graph
from openamct.graph.layers import find_layers
from openamct.record import attrs
from openamct.record.file_io import read_record, write_record
from openamct.record.scale_offset_record_pb2 import ScaleOffsetRecord
from openamct.sparsity.dependency import analyse
from openamct.sparsity.filter import apply_removal, score_and_select
from openamct.sparsity.filter_record import groups_from_records, groups_to_records
from openamct.techniques.filter_prune import FilterSpec
from tests.conftest import COMPAT
from tests.models import INPUT_SHAPES, MobileNetV2Tiny, UNetTiny
from tests.record_models import EltwiseConv, NetTrainBranch, SingleConv, SplitConcatConv


def fixture(name):
    return read_record(os.path.join(COMPAT, "records", f"record_{name}.txt"))


# -- models (upstream's record models are in tests/record_models.py) -------------------------------

class ConcatFlattenNet(nn.Module):
    """Concat offsets, a depthwise conv and a non-global flatten in one record."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 3), nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16))
        self.dw, self.conv = nn.Conv2d(24, 24, 1, groups=24), nn.Conv2d(24, 12, 3)
        self.fc1, self.fc2 = nn.Linear(12 * 2 * 2, 20), nn.Linear(20, 3)

    def forward(self, x):
        y = self.dw(torch.cat([F.relu(self.a(x)), F.relu(self.b(x))], 1))
        return self.fc2(F.relu(self.fc1(F.relu(self.conv(y)).flatten(1))))


def pruned_groups(model, x, ratio=0.5):
    graph = capture_graph(model, x)
    layers = find_layers(model, graph)
    plan = Plan({n: LayerPlan(n, i.type, {"filter_prune": FilterSpec(ratio, False)})
                 for n, i in layers.items() if i.type in ("Conv2d", "Linear") and not i.depthwise})
    groups, _ = analyse(graph, layers, plan)
    score_and_select(model, groups)
    return groups


def node_view(node, modules):
    keys = ("type", "begin", "end", "prune_axis", "group", "prune_group")
    vals = {k: (attrs.get_str(node, k) if k == "type" else attrs.get_int(node, k)) for k in keys}
    name = node.name if node.name in modules else "<function>"
    return name, {k: v for k, v in vals.items() if v is not None}


# -- tests --------------------------------------------------------------------------------------

@pytest.mark.parametrize("cls,shape", [(ConcatFlattenNet, (2, 3, 6, 6)), (EltwiseConv, (1, 4, 6, 6)),
                                       (SplitConcatConv, (1, 3, 6, 6)), (UNetTiny, INPUT_SHAPES["UNetTiny"]),
                                       (MobileNetV2Tiny, INPUT_SHAPES["MobileNetV2Tiny"])],
                         ids=lambda v: getattr(v, "__name__", ""))
def test_round_trip_through_the_record_file_gives_identical_weights(cls, shape, tmp_path):
    torch.manual_seed(3)
    original, x = cls().eval(), torch.randn(*shape)
    model = copy.deepcopy(original)
    groups = pruned_groups(model, x)
    assert any(g.removed for g in groups)
    record = ScaleOffsetRecord()
    groups_to_records(groups, record)
    assert len(record.prune_record) == sum(1 for g in groups if g.removed)
    path = str(tmp_path / "record.txt")
    write_record(path, record)
    apply_removal(model, groups)

    fresh = copy.deepcopy(original)
    replayed = groups_from_records(read_record(path), fresh)
    assert [g.removed for g in replayed] == [g.removed for g in groups if g.removed]
    apply_removal(fresh, replayed)
    a, b = model.state_dict(), fresh.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), model(x))


def test_written_record_has_upstream_shape():
    model = ConcatFlattenNet()
    groups = pruned_groups(model, torch.randn(1, 3, 6, 6))
    record = ScaleOffsetRecord()
    groups_to_records(groups, record)
    by_producer = {pr.producer[0].name: pr for pr in record.prune_record}
    pr = by_producer["b.0"]
    prod = pr.producer[0]
    assert attrs.get_str(prod, "type") == "Conv" and attrs.get_int(prod, "prune_axis") == 1
    assert (attrs.get_int(prod, "begin"), attrs.get_int(prod, "end"), attrs.get_int(prod, "prune_group")) == (0, 16, 1)
    removed = attrs.get_ints(prod, "prune_index")
    assert len(removed) == 8 and removed == sorted(removed)
    cons = {c.name: c for c in pr.consumer}
    assert attrs.get_str(cons["b.1"], "type") == "BatchNormalization"
    assert attrs.get_str(cons["cat_0"], "type") == "Concat"
    assert (attrs.get_int(cons["conv"], "begin"), attrs.get_int(cons["conv"], "end")) == (8, 24)
    assert attrs.get_ints(cons["conv"], "prune_index") == [8 + c for c in removed]  # absolute in begin..end
    assert attrs.get_int(cons["dw"], "group") == 24
    fc = by_producer["conv"]
    assert attrs.get_ints(fc.producer[0], "prune_index") is not None
    fc1 = {c.name: c for c in fc.consumer}["fc1"]
    assert (attrs.get_int(fc1, "begin"), attrs.get_int(fc1, "end")) == (0, 48)
    assert len(attrs.get_ints(fc1, "prune_index")) == 4 * 6  # 6 channels x 2x2 features each
    assert attrs.get_int(by_producer["fc1"].producer[0], "prune_axis") == -1
    assert attrs.get_str(by_producer["fc1"].producer[0], "type") == "Gemm"


def test_record_from_another_model_is_refused():
    record = ScaleOffsetRecord()
    groups_to_records(pruned_groups(EltwiseConv(), torch.randn(1, 4, 6, 6)), record)
    with pytest.raises(ValueError, match=r"prune_record\[0\].*'layer1.0' has 128 output channels.*another model"):
        groups_from_records(record, EltwiseConv(channels=128))
    with pytest.raises(ValueError, match="'layer1.0' does not exist"):
        groups_from_records(record, SingleConv().layer2)
    renamed = copy.deepcopy(record)
    renamed.prune_record[0].producer[0].name = "layer5.0"
    with pytest.raises(ValueError, match="'layer5.0' has 8 output channels"):
        groups_from_records(renamed, EltwiseConv())


def test_record_with_wrong_type_or_tampered_index_is_refused():
    record = ScaleOffsetRecord()
    groups_to_records(pruned_groups(ConcatFlattenNet(), torch.randn(1, 3, 6, 6)), record)
    by_producer = {pr.producer[0].name: i for i, pr in enumerate(record.prune_record)}
    wrong = copy.deepcopy(record)
    attrs.find(wrong.prune_record[by_producer["fc1"]].producer[0], "type").s = b"Conv"
    with pytest.raises(ValueError, match="'fc1' is a Linear in the model, the record says type 'Conv'"):
        groups_from_records(wrong, ConcatFlattenNet())
    tampered = copy.deepcopy(record)
    consumer = [c for c in tampered.prune_record[by_producer["b.0"]].consumer if c.name == "conv"][0]
    attrs.find(consumer, "prune_index").ints[0] += 1
    with pytest.raises(ValueError, match="'conv' lists other removed positions"):
        groups_from_records(tampered, ConcatFlattenNet())


def test_upstream_single_conv_record():
    (g,) = groups_from_records(fixture("SingleConv"), SingleConv())
    assert g.producer_names == ["layer1.0"] and g.channels == 64 and g.removed == []
    assert [m.name for m in g.passive] == ["layer1.1"] and [m.name for m in g.consumers] == ["layer2.0"]
    # Our own analysis of the same model describes the same group.
    model = SingleConv()
    ours = ScaleOffsetRecord()
    groups_to_records(pruned_groups(model, torch.randn(1, 3, 8, 8)), ours)
    mods = dict(model.named_modules())
    theirs = fixture("SingleConv").prune_record[0]
    assert [node_view(c, mods) for c in ours.prune_record[0].consumer] == [node_view(c, mods) for c in theirs.consumer]


def test_upstream_eltwise_record_and_our_analysis_agree():
    model = EltwiseConv()
    (g,) = groups_from_records(fixture("EltwiseConv"), model)
    assert g.producer_names == ["layer1.0", "layer2.0", "layer3.0", "layer4.0"]
    assert (g.channels, g.prune_group, g.removed) == (160, 2, [])
    assert [m.name for m in g.consumers] == ["layer5.0", "layer6.0"]
    assert [m.name for m in g.passive if not m.is_function] == ["layer1.1", "layer2.1", "layer3.1", "layer4.1"]
    assert sum(m.is_function for m in g.passive) == 3  # Add_8/Add_13/Add_18: no weights
    ours = ScaleOffsetRecord()
    groups_to_records([gr for gr in pruned_groups(model, torch.randn(1, 4, 6, 6)) if len(gr.producers) == 4], ours)
    mods = dict(model.named_modules())
    theirs = fixture("EltwiseConv").prune_record[0]
    (mine,) = ours.prune_record
    assert [node_view(p, mods) for p in mine.producer] == [node_view(p, mods) for p in theirs.producer]
    assert [node_view(c, mods) for c in mine.consumer] == [node_view(c, mods) for c in theirs.consumer]


def test_upstream_train_branch_record_replays_its_prune_index():
    model = NetTrainBranch().eval()
    (g,) = groups_from_records(fixture("NetTrainBranch"), model)
    assert g.removed == [1, 6, 13, 14]
    before = copy.deepcopy(model)
    apply_removal(model, [g])
    kept = [c for c in range(16) if c not in g.removed]
    assert model.layer1[0].out_channels == 12 and model.layer3[0].in_channels == 12
    assert torch.equal(model.layer1[0].weight, before.layer1[0].weight[kept])
    assert torch.equal(model.layer3[0].weight, before.layer3[0].weight[:, kept])
    assert model(torch.randn(1, 3, 8, 8)).shape == (1, 8, 4, 4)


def test_upstream_split_concat_record():
    model = SplitConcatConv()
    g1, g2 = groups_from_records(fixture("SplitConcatConv"), model)
    assert (g1.producer_names, g1.channels, g2.producer_names, g2.channels) == (["layer2_1.0"], 160, ["layer2_2.0"], 80)
    assert [(m.name, m.begin, m.end) for m in g2.consumers] == [("layer3.0", 160, 240)]
    groups = [g for g in pruned_groups(model, torch.randn(1, 3, 6, 6)) if g.producer_names[0].startswith("layer2")]
    assert [(m.name, m.begin, m.end) for g in groups for m in g.consumers] == [("layer3.0", 0, 160), ("layer3.0", 160, 240)]


def test_record_that_would_split_a_grouped_conv_unevenly_is_refused():
    model = EltwiseConv()
    (g,) = [g for g in pruned_groups(model, torch.randn(1, 4, 6, 6)) if len(g.producers) == 4]
    g.prune_group, g.removed = 1, list(range(40))  # all 40 from the first of the convs' two groups
    record = ScaleOffsetRecord()
    groups_to_records([g], record)
    with pytest.raises(ValueError, match=r"prune_record\[0\].*layer1.0.*same number.*another model"):
        groups_from_records(record, EltwiseConv())
