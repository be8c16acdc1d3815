"""What a technique declares (order, eligibility, config slice) and what the core derives from
it: the registry's order comes from ``after`` declarations, not from the tuple; the config path
runs parse -> validate -> plan without importing techniques or the 2:4 kernels."""

import ast
import os

import pytest
import torch

import openamct
from openamct import pipeline
from openamct.compressed.layer import CompressedLayer
from openamct.demo.models import MnistNet
from openamct.layer_types import LAYER_TYPES, NM_TYPES
from openamct.record.file_io import read_record
from openamct.techniques import TECHNIQUES, Technique, ordered
from openamct.techniques.filter_prune import FilterPruning
from openamct.techniques.sparsity24 import Sparsity24

DEMO_CFG = os.path.join(os.path.dirname(pipeline.__file__), "demo", "demo.cfg")
ROOT = os.path.dirname(openamct.__file__)


def _named(name, after=()):
    return type(f"T_{name}", (Technique,), {"name": name, "after": tuple(after)})()


def test_registry_order_comes_from_declarations():
    names = [t.name for t in TECHNIQUES]
    assert names.index("filter_prune") < names.index("2:4")
    assert names.index("filter_prune") < names.index("quant") < names.index("activation_quant")
    for shuffled in (TECHNIQUES[::-1], TECHNIQUES[2:] + TECHNIQUES[:2]):
        got = [t.name for t in ordered(shuffled)]
        for t in shuffled:
            assert all(got.index(n) < got.index(t.name) for n in t.after), got


def test_order_is_stable_and_refuses_cycles_unknown_names_and_repeats():
    a, b, c = _named("a"), _named("b", ["c"]), _named("c")
    assert [t.name for t in ordered((a, b, c))] == ["a", "c", "b"]
    assert [t.name for t in ordered((c, a, b))] == ["c", "a", "b"]  # no relation: as given
    with pytest.raises(ValueError, match=r"cycle: 'x' after \('y',\); 'y' after \('x',\)"):
        ordered((_named("x", ["y"]), _named("y", ["x"])))
    with pytest.raises(ValueError, match=r"'b' declares after=\('c',\), but 'c' is not among"):
        ordered((a, b))
    with pytest.raises(ValueError, match=r"'a' given more than once"):
        ordered((a, _named("a")))


def test_create_refuses_a_cycle_before_any_work(tmp_path):
    x = torch.randn(2, 1, 28, 28)
    bad = (*TECHNIQUES, _named("x", ["y"]), _named("y", ["x"]))
    with pytest.raises(ValueError, match="cycle"):
        pipeline.create(MnistNet(), x, DEMO_CFG, str(tmp_path / "r.txt"), "compressed", techniques=bad)
    assert not os.path.exists(tmp_path / "r.txt")


def test_shuffled_registry_builds_the_same_model(tmp_path):
    """Correctness does not rest on the tuple's order: a reversed registry gives the same
    layers, outputs and record entries (their order in the file may differ: only ties follow
    the tuple)."""
    x = torch.randn(4, 1, 28, 28)
    outs, entries = [], []
    for i, techniques in enumerate((TECHNIQUES, TECHNIQUES[::-1])):
        torch.manual_seed(0)
        rec = str(tmp_path / f"r{i}.txt")
        model = pipeline.create(MnistNet(), x, DEMO_CFG, rec, "compressed", techniques=techniques)
        assert [t.name for t in model._openamct.techniques] == [t.name for t in ordered(techniques)]
        model.eval()
        with torch.no_grad():
            outs.append(model(x))
        model._openamct.flush()
        entries.append(sorted(str(pr) for pr in read_record(rec).prune_record))
        assert any(isinstance(m, CompressedLayer) for m in model.modules())
    assert torch.equal(outs[0], outs[1])
    assert entries[0] == entries[1] and entries[0]


def test_eligibility_is_the_techniques_and_agrees_with_the_kernels_table():
    assert FilterPruning.layer_types == tuple(n for n, t in LAYER_TYPES.items() if t.filter == "active")
    assert Sparsity24.layer_types == NM_TYPES
    assert not hasattr(next(iter(LAYER_TYPES.values())), "quant")


def _imports(rel: str) -> set[str]:
    tree = ast.parse(open(os.path.join(ROOT, rel), encoding="utf-8").read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("openamct"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("openamct")}
    return found


def test_config_path_is_linear_and_imports_nothing_above_it():
    steps = ["errors", "repeats", "parse", "rules", "validate", "plan", "source"]
    for i, step in enumerate(steps):
        own = {m.removeprefix("openamct.config.") for m in _imports(f"config/{step}.py")
               if m.startswith("openamct.config.")}
        later = own & set(steps[i:])
        assert not later, f"config/{step}.py imports {later}: the config path must not call back"
    for rel in os.listdir(os.path.join(ROOT, "config")):
        if rel.endswith(".py"):
            above = {m for m in _imports(f"config/{rel}")
                     if m.startswith(("openamct.techniques", "openamct.sparsity", "openamct.export"))}
            assert not above, (rel, above)
    assert not {m for m in _imports("techniques/activation_quant.py") if m.startswith("openamct.export")}
