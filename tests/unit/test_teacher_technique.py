"""A technique that needs a teacher at train time (tests/techniques/teacher_loss.py), added with
one registry line: its loss reaches the user through ``train_losses`` and trains the student, the
teacher stays frozen and out of the state dict, the record and the ONNX files, and restore works
with or without it."""

import os

import onnx
import pytest
import torch

from openamct import pipeline
from openamct.demo.models import MnistNet
from openamct.record.file_io import read_record
from openamct.techniques import TECHNIQUES, train_losses
from tests.techniques.teacher_loss import TeacherLoss

DEMO_CFG = os.path.join(os.path.dirname(pipeline.__file__), "demo", "demo.cfg")


def _model(seed):
    torch.manual_seed(seed)
    return MnistNet()


def _train(model, x, steps):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    model.train()
    seen = []
    for _ in range(steps):
        model(x)
        terms = train_losses(model)
        loss = sum(terms.values())  # the teacher's term only: what moves the student is that loss
        seen.append(float(loss.detach()))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return seen


def test_teacher_loss_trains_restores_and_is_never_saved(tmp_path):
    x = torch.randn(16, 1, 28, 28)
    teacher = _model(1)
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    with_teacher = (*TECHNIQUES, TeacherLoss(teacher))  # the registry line
    rec, ckpt = str(tmp_path / "record.txt"), str(tmp_path / "ckpt.pth")
    student = pipeline.create(_model(0), x, DEMO_CFG, rec, "compressed", techniques=with_teacher)

    assert train_losses(student) == {}  # no training forward yet
    seen = _train(student, x, steps=12)
    assert set(train_losses(student)) == {"teacher_loss/mse"}
    assert seen[-1] < 0.7 * seen[0], seen  # the loss the user added did the training
    for k, v in teacher.state_dict().items():  # the caller's teacher is untouched
        assert torch.equal(v, before[k]), k
    assert teacher.training and all(p.requires_grad for p in teacher.parameters())

    student.eval()
    with torch.no_grad():
        out = student(x)
    assert train_losses(student) == {}  # eval forwards run no teacher
    state = student.state_dict()
    assert len(state) == len(pipeline.create(_model(0), x, DEMO_CFG, str(tmp_path / "r2.txt"),
                                             "compressed").state_dict())
    assert not [k for k in state if "teacher" in k]
    torch.save({"state_dict": state}, ckpt)
    assert "teacher" not in open(rec, encoding="utf-8").read()
    assert len(read_record(rec).prune_record) > 0

    for techniques in (with_teacher, TECHNIQUES):  # the teacher is optional at restore
        restored = pipeline.restore(_model(0), x, DEMO_CFG, rec, ckpt, "state_dict", "compressed",
                                    techniques=techniques)
        restored.eval()
        with torch.no_grad():
            assert torch.equal(restored(x), out)
    restored = pipeline.restore(_model(0), x, DEMO_CFG, rec, ckpt, "state_dict", "compressed",
                                techniques=with_teacher)
    restored.train()
    restored(x)
    assert float(train_losses(restored)["teacher_loss/mse"].detach()) == pytest.approx(seen[-1], rel=0.5)

    sizes = {}
    for name, model in (("teacher", restored), ("plain", pipeline.restore(
            _model(0), x, DEMO_CFG, rec, ckpt, "state_dict", "compressed"))):
        model.eval()
        fake, deploy = pipeline.save(model, str(tmp_path / name), x, None, None, None, None)
        graphs = [onnx.load(p).graph for p in (fake, deploy)]
        sizes[name] = [(len(g.node), len(g.initializer), sum(t.ByteSize() for t in g.initializer)) for g in graphs]
    assert sizes["teacher"] == sizes["plain"]  # the teacher's weights and ops are in neither file


def test_teacher_must_be_a_module():
    with pytest.raises(TypeError, match="teacher must be a torch.nn.Module"):
        TeacherLoss("resnet18")
