"""What else an upstream script meets on its first run: an empty save_path, type entries naming
no layer of the model, the search's base classes at upstream's module paths."""

import logging

import pytest
import torch

import openamct as amct
from openamct.common.auto_channel_prune.search_channel_base import GreedySearch, SearchChannelBase
from openamct.common.auto_channel_prune.sensitivity_base import (
    SensitivityBase,
    TaylorLossSensitivity,
)
from tests.upstream.pages import INPUT_SHAPE, INT8_CFG, build_model, train, write


def test_an_empty_save_path_writes_bare_names_in_the_working_folder(monkeypatch, tmp_path):
    """Upstream's split_save_path: '' is the working folder with no prefix."""
    monkeypatch.chdir(tmp_path)
    model = amct.create_compressed_retrain_model(build_model(), torch.randn(INPUT_SHAPE), write("q.cfg", INT8_CFG),
                                                 "r.txt")
    train(model)
    amct.save_compressed_retrain_model(model, "r.txt", "", torch.randn(INPUT_SHAPE))
    assert (tmp_path / "fake_quant_model.onnx").is_file() and (tmp_path / "deploy_model.onnx").is_file()


def test_a_type_entry_naming_no_layer_of_the_model_warns_once(monkeypatch, tmp_path, caplog):
    """A layer name that names no layer is refused; a type entry was dropped without a word."""
    monkeypatch.chdir(tmp_path)
    write("t.cfg", INT8_CFG + 'quant_skip_types: "Conv3d"\nskip_layer_types: "ConvTranspose2d"\n')
    with caplog.at_level(logging.WARNING, logger="openamct"):
        amct.create_compressed_retrain_model(build_model(), torch.randn(INPUT_SHAPE), "t.cfg", "r.txt")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "skip_layer_types 'ConvTranspose2d'" in warnings[0] and "quant_skip_types 'Conv3d'" in warnings[0]
    write("n.cfg", INT8_CFG + 'quant_skip_layers: "conv9"\n')
    with pytest.raises(ValueError, match="layer 'conv9' does not exist"):
        amct.create_compressed_retrain_model(build_model(), torch.randn(INPUT_SHAPE), "n.cfg", "r2.txt")


class UpstreamSensitivity(SensitivityBase):
    """The README's custom sensitivity: upstream's hooks only."""

    def setup_initialization(self, graph_tuple, input_data, test_iteration):
        pass

    def get_sensitivity(self, search_records):
        pass


class UpstreamSearch(SearchChannelBase):
    def channel_prune_search(self, graph_info, search_records, prune_config):
        return {}


SEARCH_CFG = "compress_ratio: 1.5\nascend_optimized: false\n"


def _search(sensitivity, search_alg, labels=None):
    model = build_model()
    x = torch.randn(4, 3, 8, 8)
    y = torch.randn(model(x).shape) if labels is None else labels
    return amct.auto_channel_prune_search(model, "s.cfg", [x, y], "out.cfg", sensitivity, search_alg)


def test_search_base_classes_at_upstreams_paths(monkeypatch, tmp_path):
    """A subclass written for upstream's hooks (which read AMCT's internal graph and records)
    is refused naming the method openamct calls; upstream's instances and set_loss_func work."""
    monkeypatch.chdir(tmp_path)
    write("s.cfg", SEARCH_CFG)
    with pytest.raises(TypeError, match="implements upstream's get_sensitivity/setup_initialization.*channel_scores"):
        _search(UpstreamSensitivity(), "GreedySearch")
    with pytest.raises(TypeError, match="implements upstream's channel_prune_search.*implement search"):
        _search("TaylorLossSensitivity", UpstreamSearch())
    sens = TaylorLossSensitivity()
    sens.set_loss_func(torch.nn.MSELoss())
    report = _search(sens, GreedySearch())
    assert report.macs_after < report.macs_before


def test_search_pair_needs_a_sample_per_iteration(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    write("s.cfg", SEARCH_CFG + "test_iteration: 5\n")
    with pytest.raises(ValueError, match="test_iteration 5 reads one sample per iteration.*holds 4"):
        _search("TaylorLossSensitivity", "GreedySearch")
