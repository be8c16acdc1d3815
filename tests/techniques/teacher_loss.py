"""A toy technique that needs a teacher model at train time: the hook a distillation technique
will use, not distillation itself.

The technique is given a frozen teacher through its constructor (a copy: the caller's module is
not touched). ``apply`` puts a forward hook on the compressed model's root that, in a training
forward with gradients on, runs the teacher on the same input under ``no_grad`` and keeps the
mean square between the student's and the teacher's outputs; the user reads it through
``openamct.techniques.train_losses(model)`` (``Technique.losses``) and adds it to their loss.

The teacher is no submodule of the student: it is not in ``state_dict``, not in the record (it
has no entries: restore is given the teacher again) and not in the ONNX files (the hook does
nothing in eval mode, which export traces in). The export's working copies share the one frozen
teacher instead of copying it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from openamct.techniques.base import Technique

NAME = "teacher_loss"


@dataclass
class TeacherState:
    loss: Tensor | None = None  # of the last training forward; None after any other forward

    def __deepcopy__(self, memo: dict) -> TeacherState:
        # A copy of the model (the export's working copy) has run no forward yet; the loss is
        # part of an autograd graph, which cannot be copied.
        return TeacherState()


class TeacherHook:
    """Forward hook of the student's root module (see the module docstring)."""

    def __init__(self, teacher: nn.Module, state: TeacherState) -> None:
        self.teacher, self.state = teacher, state

    def __call__(self, module: nn.Module, args: tuple, output: Tensor) -> None:
        self.state.loss = None
        if not module.training or not torch.is_grad_enabled():
            return
        with torch.no_grad():
            target = self.teacher(*args)
        self.state.loss = (output - target).square().mean()

    def __deepcopy__(self, memo: dict) -> TeacherHook:
        # the frozen teacher is shared, never copied; the state is the copied keeper's (memo)
        return TeacherHook(self.teacher, copy.deepcopy(self.state, memo))


class TeacherLoss(Technique):
    name = NAME
    # No config slice and no layer of its own: it acts on the whole model's output.

    def __init__(self, teacher: nn.Module) -> None:
        if not isinstance(teacher, nn.Module):
            raise TypeError(f"teacher must be a torch.nn.Module, got {type(teacher).__name__}")
        self.teacher = copy.deepcopy(teacher).eval().requires_grad_(False)

    def wanted(self, ctx) -> bool:
        return True  # whenever it is in the registry: the teacher was given

    def plan(self, ctx) -> TeacherState:
        return TeacherState()

    def from_record(self, ctx) -> TeacherState:
        return TeacherState()  # nothing recorded: the teacher is given again at restore

    def apply(self, ctx, state: TeacherState) -> None:
        ctx.model.register_forward_hook(TeacherHook(self.teacher, state))

    def losses(self, state: TeacherState) -> dict[str, Tensor]:
        return {} if state.loss is None else {"mse": state.loss}
