"""The public API checks its arguments up front and never mutates the caller's model."""

import os

import pytest
import torch

import openamct as amct
from tests.conftest import compat_config
from tests.models import Net001

X = torch.randn(1, 2, 28, 28)
PRUNE_CFG = compat_config("configuration__net_001_prune_complete.cfg")
QUANT_CFG = compat_config("configuration__compressed_cfg__net_001_compressed_quant_only_data_weight_nochannelwise.cfg")


@pytest.mark.parametrize("call,pattern", [
    (lambda r: amct.create_prune_retrain_model("model", X, PRUNE_CFG, r), "model must be Module"),
    (lambda r: amct.create_prune_retrain_model(Net001(), 3, PRUNE_CFG, r), "input_data must be"),
    (lambda r: amct.create_prune_retrain_model(Net001(), X, 1, r), "config_defination must be str"),
    (lambda r: amct.create_prune_retrain_model(Net001(), X, PRUNE_CFG, None), "record_file must be str"),
    (lambda r: amct.create_compressed_retrain_model(Net001(), [], QUANT_CFG, r), "input_data must be"),
    (lambda r: amct.restore_compressed_retrain_model(Net001(), X, QUANT_CFG, r, 5), "pth_file must be str"),
    (lambda r: amct.restore_prune_retrain_model(Net001(), X, r, PRUNE_CFG, "x.pth", 7), "state_dict_name must be str or None"),
    (lambda r: amct.create_quant_retrain_model(None, Net001(), r, X), "config_file must be str"),
    (lambda r: amct.save_prune_retrain_model(Net001(), 3, X), "save_path must be str"),
    (lambda r: amct.save_compressed_retrain_model(Net001(), r, "out", X, input_names="x"), "input_names must be a list"),
])
def test_type_errors_name_the_argument(tmp_path, call, pattern):
    with pytest.raises(TypeError, match=pattern):
        call(str(tmp_path / "rec.txt"))


@pytest.fixture(scope="module")
def every_save(tmp_path_factory):
    """save_* API name -> save(path, **kw), on a prune model and an initialised INT8 model."""
    work = tmp_path_factory.mktemp("saves")
    rec = str(work / "rec.txt")
    pruned = amct.create_prune_retrain_model(Net001(), X, PRUNE_CFG, str(work / "prune_rec.txt"))
    quant = amct.create_compressed_retrain_model(Net001(), X, QUANT_CFG, rec)
    quant.eval()
    quant(X)  # clips initialised: only the bad argument can stop the save
    return {
        "save_prune_retrain_model": lambda path, **kw: amct.save_prune_retrain_model(pruned, path, X, **kw),
        "save_compressed_retrain_model": lambda path, **kw: amct.save_compressed_retrain_model(quant, rec, path, X, **kw),
        "save_quant_retrain_model": lambda path, **kw: amct.save_quant_retrain_model(QUANT_CFG, quant, rec, path, X, **kw),
    }


# Upstream AMCT raises TypeError for a dynamic_axes that is not a dict at all.
@pytest.mark.parametrize("axes", [["input"], [0], "input", ("input",), 0])
def test_dynamic_axes_of_the_wrong_type_is_a_type_error(tmp_path, every_save, axes):
    for name, save in every_save.items():
        with pytest.raises(TypeError, match=rf"^dynamic_axes must be a dict .* got {type(axes).__name__}$"):
            save(str(tmp_path / "m"), dynamic_axes=axes)
        assert not [f for f in os.listdir(tmp_path) if f.endswith(".onnx")], name


# A dict whose contents are wrong is a bad value, not a bad type.
@pytest.mark.parametrize("axes", [{"input": "0"}, {"input": [-1]}, {0: [0]}, {"input": {0: 1}}, {"input": [True]}])
def test_malformed_dynamic_axes(tmp_path, every_save, axes):
    for name, save in every_save.items():
        with pytest.raises(ValueError, match="dynamic_axes"):
            save(str(tmp_path / "m"), dynamic_axes=axes)
        assert not [f for f in os.listdir(tmp_path) if f.endswith(".onnx")], name


def test_create_does_not_mutate_and_refuses_compressed_models(tmp_path):
    model = Net001()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modules_before = [type(m) for m in model.modules()]
    out = amct.create_compressed_retrain_model(model, X, QUANT_CFG, str(tmp_path / "rec.txt"))
    assert out is not model
    assert [type(m) for m in model.modules()] == modules_before
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not hasattr(model, "_openamct") and not model._forward_hooks
    with pytest.raises(ValueError, match="already contains openamct modules"):
        amct.create_compressed_retrain_model(out, X, QUANT_CFG, str(tmp_path / "rec2.txt"))


def test_record_folder_is_made_and_a_failed_create_leaves_none(tmp_path):
    """As upstream, create_* makes the record's folders; only once the model is built."""
    bad = tmp_path / "bad.cfg"
    with open(PRUNE_CFG) as f:
        bad.write_text(f.read() + '\nskip_layers: "nope"\n')
    with pytest.raises(ValueError, match="layer 'nope' does not exist"):
        amct.create_prune_retrain_model(Net001(), X, str(bad), str(tmp_path / "no" / "rec.txt"))
    assert not (tmp_path / "no").exists()
    amct.create_prune_retrain_model(Net001(), X, PRUNE_CFG, str(tmp_path / "no" / "deeper" / "rec.txt"))
    assert (tmp_path / "no" / "deeper" / "rec.txt").stat().st_size > 0


def test_meta_device_model_is_refused(tmp_path):
    with torch.device("meta"):
        model = Net001()
    with pytest.raises(ValueError, match="meta device"):
        amct.create_prune_retrain_model(model, X, PRUNE_CFG, str(tmp_path / "rec.txt"))


def test_input_of_wrong_dtype_names_the_layer(tmp_path):
    with pytest.raises(ValueError, match="layer1.0"):
        amct.create_prune_retrain_model(Net001(), X.double(), PRUNE_CFG, str(tmp_path / "rec.txt"))


def test_save_requires_an_openamct_model_and_makes_a_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="not returned by an openamct create"):
        amct.save_prune_retrain_model(Net001(), str(tmp_path / "m"), X)
    assert not os.listdir(tmp_path)
    model = amct.create_prune_retrain_model(Net001(), X, PRUNE_CFG, str(tmp_path / "rec.txt"))
    amct.save_prune_retrain_model(model, str(tmp_path / "missing" / "m"), X)
    assert sorted(os.listdir(tmp_path / "missing")) == ["m_deploy_model.onnx", "m_fake_quant_model.onnx"]


def test_quant_and_compressed_save_check_axes_before_writing(tmp_path):
    rec = str(tmp_path / "rec.txt")
    model = amct.create_compressed_retrain_model(Net001(), X, QUANT_CFG, rec)
    model.eval()
    model(X)  # clips initialised: only the bad argument can stop the save
    saves = {
        "save_compressed_retrain_model": lambda path, **kw: amct.save_compressed_retrain_model(model, rec, path, X, **kw),
        "save_quant_retrain_model": lambda path, **kw: amct.save_quant_retrain_model(QUANT_CFG, model, rec, path, X, **kw),
    }
    for name, save in saves.items():
        with pytest.raises(ValueError, match="dynamic_axes"):
            save(str(tmp_path / "m"), dynamic_axes={"input": "0"})
        with pytest.raises(ValueError, match="dynamic_axes"):  # refused before the folder is made
            save(str(tmp_path / "missing" / "m"), dynamic_axes={"input": "0"})
        assert not os.path.exists(tmp_path / "missing"), name
        assert not [f for f in os.listdir(tmp_path) if f.endswith(".onnx")], name  # nothing half written


def test_restore_checkpoint_errors(tmp_path):
    rec = str(tmp_path / "rec.txt")
    model = amct.create_compressed_retrain_model(Net001(), X, QUANT_CFG, rec)
    ck = str(tmp_path / "ck.pth")
    torch.save({"state_dict": model.state_dict()}, ck)
    with pytest.raises(ValueError, match=r"state_dict_name 'weights' is not in pth_file .*holds: 'state_dict'"):
        amct.restore_compressed_retrain_model(Net001(), X, QUANT_CFG, rec, ck, "weights")
    with pytest.raises(ValueError, match="pass state_dict_name"):
        amct.restore_compressed_retrain_model(Net001(), X, QUANT_CFG, rec, ck)
    torch.save(Net001().state_dict(), str(tmp_path / "plain.pth"))
    with pytest.raises(ValueError, match="does not match the compressed model.*missing keys"):
        amct.restore_compressed_retrain_model(Net001(), X, QUANT_CFG, rec, str(tmp_path / "plain.pth"))
    with pytest.raises(ValueError, match="does not exist"):
        amct.restore_compressed_retrain_model(Net001(), X, QUANT_CFG, rec, str(tmp_path / "none.pth"))
