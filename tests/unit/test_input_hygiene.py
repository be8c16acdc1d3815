"""Input hygiene of the public API: unusual but legitimate models and inputs work,
wrong ones get a clear error before any work starts.

meta-device models, frozen parameters, models in eval (or mixed) mode, inputs of the wrong
dtype, ``input_data`` as a tensor / tuple / list / dict of keyword tensors, and models already
wrapped in DistributedDataParallel / DataParallel.
"""

from __future__ import annotations

import copy
import gc
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

import openamct as amct
from tests.training import sgd_steps

QUANT = "retrain_data_quant_config { ulq_quantize { } }\nretrain_weight_quant_config { arq_retrain { } }\n"
NM = "prune_config { n_out_of_m_pruner { l1_selective_prune { } } }\n"
CONFIGS = {"prune": NM, "compressed": QUANT + NM, "quant": QUANT}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 8)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.relu(self.bn(self.conv(x)))), 1))


class TwoInputNet(nn.Module):
    """forward(x, bias=None): positional and keyword tensors (Hugging Face style)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16, 8)

    def forward(self, x, bias=None):
        h = torch.relu(self.conv(x)).mean(dim=(2, 3))
        if bias is not None:
            h = h + bias
        return self.fc(h)


X = torch.randn(4, 8, 6, 6)
B = torch.randn(4, 16)


@pytest.fixture
def files(tmp_path):
    paths = {}
    for api, text in CONFIGS.items():
        p = tmp_path / f"{api}.cfg"
        p.write_text(text)
        paths[api] = str(p)
    paths["rec"] = str(tmp_path / "rec.txt")
    paths["dir"] = tmp_path
    return paths


def create(api, model, files, input_data=X):
    cfg, rec = files[api], files["rec"]
    if api == "prune":
        return amct.create_prune_retrain_model(model, input_data, cfg, rec)
    if api == "compressed":
        return amct.create_compressed_retrain_model(model, input_data, cfg, rec)
    return amct.create_quant_retrain_model(cfg, model, rec, input_data)


def restore(api, model, files, pth, input_data=X):
    cfg, rec = files[api], files["rec"]
    if api == "prune":
        return amct.restore_prune_retrain_model(model, input_data, rec, cfg, pth, "sd")
    if api == "compressed":
        return amct.restore_compressed_retrain_model(model, input_data, cfg, rec, pth, "sd")
    return amct.restore_quant_retrain_model(cfg, model, rec, input_data, pth, "sd")


def train_steps(model, inputs, steps=3):
    sgd_steps(model, inputs, steps, lr=0.05)


APIS = sorted(CONFIGS)


# -- meta device ----------------------------------------------------------------------------------

@pytest.mark.parametrize("api", APIS)
def test_meta_device_model_is_a_clear_error(api, files):
    with torch.device("meta"):
        model = Net()
    with pytest.raises(ValueError, match=r"model has parameters on the meta device \('conv.weight'"):
        create(api, model, files)
    pth = str(files["dir"] / "ck.pth")
    torch.save({"sd": {}}, pth)
    with pytest.raises(ValueError, match="meta device"):
        restore(api, model, files, pth)
    with pytest.raises(ValueError, match="meta device"):
        amct.create_quant_retrain_config(str(files["dir"] / "q.json"), model, X)
    assert not os.path.exists(files["rec"])  # refused before any work


def test_meta_model_materialised_with_to_empty_works(files):
    with torch.device("meta"):
        model = Net()
    model = model.to_empty(device="cpu")
    model.load_state_dict(Net().state_dict())
    assert create("compressed", model, files)(X).shape == (4, 8)


# -- frozen parameters -------------------------------------------------------------------------

@pytest.mark.parametrize("api", APIS)
def test_frozen_parameters_stay_frozen_through_create_training_and_restore(api, files):
    model = Net()
    model.conv.weight.requires_grad_(False)
    model.bn.requires_grad_(False)
    frozen = {"conv.weight", "bn.weight", "bn.bias"}
    original = copy.deepcopy(model.state_dict())
    c = create(api, model, files)
    grads = {n: p.requires_grad for n, p in c.named_parameters()}
    assert {n for n, g in grads.items() if not g} in (frozen, {"conv.weight", "conv.bn.weight", "conv.bn.bias"})
    assert grads["fc.weight"] and grads["conv.bias"]  # (the second set: BN folded into the conv)
    w0 = c.conv.weight.detach().clone()
    train_steps(c, (X,))
    assert torch.equal(c.conv.weight, w0)  # frozen: never updated
    assert not torch.equal(c.fc.weight, model.fc.weight)  # the rest trained
    assert {n for n, p in model.named_parameters() if not p.requires_grad} == frozen  # caller's model untouched
    assert all(torch.equal(v, original[k]) for k, v in model.state_dict().items())
    c.eval()
    y = c(X)
    pth = str(files["dir"] / "ck.pth")
    torch.save({"sd": c.state_dict()}, pth)
    r = restore(api, model, files, pth)
    assert {n: p.requires_grad for n, p in r.named_parameters()} == grads
    r.eval()
    assert torch.equal(r(X), y)


# -- eval / mixed mode ---------------------------------------------------------------------------

def modes(model):
    return {n: m.training for n, m in model.named_modules()}


@pytest.mark.parametrize("api", APIS)
def test_model_in_eval_mode_works_and_stays_in_eval_mode(api, files):
    model = Net().eval()
    c = create(api, model, files)
    assert c.training is False
    assert not any(m.training for n, m in c.named_modules() if not isinstance(m, nn.Identity))
    assert not any(m.training for m in model.modules())  # the caller's model too
    y = c(X)  # eval forward works (it also initialises the activation clips)
    assert y.shape == (4, 8) and torch.isfinite(y).all()
    train_steps(c, (X,), steps=1)
    assert c.training is True


def test_eval_mode_is_preserved_for_every_module(files):
    c = create("quant", Net().eval(), files)
    assert not any(modes(c).values()), {n for n, t in modes(c).items() if t}


def test_frozen_batchnorm_in_a_training_model_keeps_its_mode(files):
    model = Net().train()
    model.bn.eval()  # the usual fine-tuning pattern: BN statistics frozen
    c = create("quant", model, files)
    assert c.conv.bn.training is False
    before = c.conv.bn.running_mean.clone()
    c(X)
    assert torch.equal(c.conv.bn.running_mean, before)


# -- dtype -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("api", APIS)
def test_input_of_the_wrong_dtype_is_a_clear_error_naming_the_layer(api, dtype, files):
    with pytest.raises(ValueError, match=r"(?s)input_data.*module 'conv' \(Conv2d\).*Input type"):
        create(api, Net(), files, X.to(dtype))
    assert not os.path.exists(files["rec"])


def test_double_model_is_refused_at_create(files):
    # fp64 would train but fail only at save, so it is refused at create (docs/limits.md)
    with pytest.raises(ValueError, match=r"model has torch.float64 tensors \('conv.weight'\)"):
        create("compressed", Net().double(), files, X.double())


# -- input_data forms ------------------------------------------------------------------------

@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("form", ["tensor", "tuple", "list", "dict", "tuple_none"])
def test_input_data_forms(api, form, files):
    inputs = {"tensor": X, "tuple": (X, B), "list": [X, B], "dict": {"x": X, "bias": B},
              "tuple_none": (X, None)}[form]
    c = create(api, TwoInputNet(), files, inputs)
    call = (inputs,) if form == "tensor" else inputs
    train_steps(c, call)
    c.eval()
    y = c(*call) if not isinstance(call, dict) else c(**call)
    assert y.shape == (4, 8)
    pth = str(files["dir"] / "ck.pth")
    torch.save({"sd": c.state_dict()}, pth)
    r = restore(api, TwoInputNet(), files, pth, inputs).eval()
    assert torch.equal(r(*call) if not isinstance(call, dict) else r(**call), y)


@pytest.mark.parametrize("bad", [X.numpy(), [], (), {}, [X, "text"], {"x": X, 3: B}, 1.5, None])
def test_bad_input_data_is_a_type_error_naming_it(bad, files):
    with pytest.raises(TypeError, match="input_data"):
        create("compressed", Net(), files, bad)


# -- wrapped models ------------------------------------------------------------------------------

@pytest.fixture
def process_group(tmp_path):
    """A one-rank gloo group, so DistributedDataParallel can be built in-process."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        gc.collect()  # DDP objects first, then the group (see docs/ddp.md)
        dist.destroy_process_group()


@pytest.mark.parametrize("api", APIS)
def test_create_and_restore_refuse_a_ddp_wrapped_model(api, files, process_group):
    ddp = DistributedDataParallel(Net())
    try:
        with pytest.raises(ValueError, match=r"model is wrapped in DistributedDataParallel.*create_\*/restore_\*"):
            create(api, ddp, files)
        pth = str(files["dir"] / "ck.pth")
        torch.save({"sd": {}}, pth)
        with pytest.raises(ValueError, match="wrapped in DistributedDataParallel"):
            restore(api, ddp, files, pth)
        # The documented order works: create on the plain model, then wrap.
        c = DistributedDataParallel(create(api, Net(), files))
        train_steps(c, (X,), steps=1)
        assert c.module._openamct is not None
    finally:
        del ddp
        c = None


@pytest.mark.parametrize("api", APIS)
def test_create_refuses_a_dataparallel_wrapped_model(api, files):
    with pytest.raises(ValueError, match="wrapped in DataParallel"):
        create(api, DataParallel(Net()), files)
