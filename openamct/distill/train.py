"""The group-wise distillation loop behind ``distill``.

Each step: the teacher runs on the batch (or its outputs are read from the dump), then the
student runs once with every group's first block fed the teacher's input to it, and the loss is
the sum over groups of ``loss(student group output, teacher group output)``. Before training,
``batch_num`` eval forwards of the student initialise its activation quantizers (upstream's
calibration step), and one probe batch finds the groups whose end the student changed shape at
(filter pruning): such a group is merged with the next one, so it is compared at the nearest
boundary both models share.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from openamct.compressed.layer import CompressedLayer
from openamct.distill.distill_sample import DistillSampleBase, model_input
from openamct.distill.dump import TeacherDump
from openamct.distill.groups import Taps, normalised_mse, run_model, to_device
from openamct.progress import Progress

logger = logging.getLogger(__name__)

__all__ = ["move_folded_ends", "merge_pruned_boundaries", "calibrate", "reestimate_bn", "train_groups"]


def _device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _call_order(student: nn.Module, x: Any) -> list[str]:
    """The student's module names in the order their forwards finish, from one eval forward."""
    order: list[str] = []
    handles = [m.register_forward_hook(lambda mod, a, o, n=n: order.append(n)) for n, m in student.named_modules()]
    was = student.training
    student.eval()
    try:
        with torch.no_grad():
            run_model(student, x)
    finally:
        student.train(was)
        for h in handles:
            h.remove()
    return order


def move_folded_ends(teacher: nn.Module, student: nn.Module, groups: list[list[str]], x: Any) -> list[list[str]]:
    """A group ending at a layer whose BatchNorm the student folded in ends at that BatchNorm
    instead: the student's layer already outputs what the teacher's BN does, and the BN's place
    in the student (an Identity) passes it on."""
    folded = {n for n, m in student.named_modules() if isinstance(m, CompressedLayer) and m.bn is not None}
    if not any(g[-1] in folded for g in groups):
        return groups
    order = _call_order(student, x)
    t_mods, s_mods = dict(teacher.named_modules()), dict(student.named_modules())
    out = []
    for g in groups:
        end = g[-1]
        if end in folded and end in order:
            later = order[order.index(end) + 1:]
            bn = next((n for n in later if isinstance(s_mods[n], nn.Identity)
                       and isinstance(t_mods.get(n), nn.modules.batchnorm._BatchNorm)), None)
            if bn is not None:
                g = [*g[:-1], bn] if len(g) > 1 else [g[0], bn]
        out.append(g)
    return out


def merge_pruned_boundaries(teacher: nn.Module, student: nn.Module, groups: list[list[str]], x: Any) -> list[list[str]]:
    """``groups`` with each group whose output shape differs between the models merged into the
    next (a pruned boundary); the last such group merges into the one before."""
    t_taps, s_taps = Taps(teacher, groups), Taps(student, groups)
    try:
        with torch.no_grad():
            run_model(teacher, x)
            was = student.training
            student.eval()
            try:
                run_model(student, x)
            finally:
                student.train(was)
        same = [i in t_taps.outputs and i in s_taps.outputs and t_taps.outputs[i].shape == s_taps.outputs[i].shape
                for i in range(len(groups))]
    finally:
        t_taps.remove()
        s_taps.remove()
    merged: list[list[str]] = []
    pending: list[str] = []
    for g, ok in zip(groups, same):
        pending += g
        if ok:
            merged.append(pending)
            pending = []
    if pending:
        if not merged:
            raise ValueError("compress_model's output never has the teacher's shape at any group boundary (nor at "
                             "the last one): compress_model is not derived from model")
        merged[-1] += pending
    if len(merged) < len(groups):
        logger.info("distill: %d group(s) end where compress_model was pruned; compared at the next shared "
                    "boundary instead (%d groups)", len(groups) - len(merged), len(merged))
    return merged


def _batches(loader: Iterable, sample: DistillSampleBase) -> Iterable[Any]:
    for samples in loader:
        yield model_input(sample, samples)


def calibrate(student: nn.Module, loader: Iterable, sample: DistillSampleBase, batch_num: int) -> None:
    """``batch_num`` eval forwards (the loader restarts when shorter) to initialise the clips."""
    device = _device(student)
    was = student.training
    student.eval()
    done = 0
    with torch.no_grad():
        while done < batch_num:
            for x in _batches(loader, sample):
                run_model(student, to_device(x, device))
                done += 1
                if done >= batch_num:
                    break
    student.train(was)


def reestimate_bn(student: nn.Module, loader: Iterable, sample: DistillSampleBase) -> int:
    """Recompute the running statistics of the student's BatchNorms over one pass of
    ``loader``, every batch weighted alike (a cumulative average), with no other change: in
    training they follow the last batches (momentum 0.1), which describe the whole data only if
    every batch mixes it. Returns how many batches were read."""
    bns = [m for m in student.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    if not bns:
        return 0
    modes = {m: m.training for m in student.modules()}
    momenta = [m.momentum for m in bns]
    device, n = _device(student), 0
    student.eval()
    try:
        for m in bns:
            m.reset_running_stats()
            m.momentum = None
            m.train()
        with torch.no_grad():
            for x in _batches(loader, sample):
                run_model(student, to_device(x, device))
                n += 1
    finally:
        for m, momentum in zip(bns, momenta):
            m.momentum = momentum
        for m, mode in modes.items():
            m.training = mode
    return n


def train_groups(teacher: nn.Module, student: nn.Module, groups: Sequence[Sequence[str]], loader: Iterable,
                 epochs: int, optimizer: torch.optim.Optimizer, sample: DistillSampleBase,
                 loss: Callable[[Tensor, Tensor], Tensor] | None, data_dump: bool,
                 on_step: Callable[[int, float], None] | None = None,
                 after_epoch: Callable[[], None] | None = None) -> list[float]:
    """Train ``student`` for ``epochs`` passes (``after_epoch`` runs after each); the loss per step."""
    loss_fn = normalised_mse if loss is None else loss
    device = _device(student)
    t_taps, s_taps = Taps(teacher, groups), Taps(student, groups, feed=True)
    losses: list[float] = []
    folder = tempfile.TemporaryDirectory(prefix="openamct-distill-") if data_dump else contextlib.nullcontext()
    try:
        with folder as path:
            dump = TeacherDump(path) if data_dump else None
            for epoch in range(epochs):
                replay = dump is not None and epoch > 0
                total = dump.count if replay else (len(loader) if hasattr(loader, "__len__") else None)
                bar = Progress(f"distill epoch {epoch + 1}/{epochs}", total=total, logger=logger, unit="batch")
                source = range(dump.count) if replay else _batches(loader, sample)
                for item in source:
                    if replay:
                        x, t_in, t_out = dump.read(item)
                    else:
                        x = item
                        t_taps.clear()
                        with torch.no_grad():
                            run_model(teacher, to_device(x, _device(teacher)))
                        t_in, t_out = dict(t_taps.inputs), dict(t_taps.outputs)
                        if dump is not None:
                            dump.write(x, t_in, t_out)
                    s_taps.clear()
                    s_taps.feed.update({g: t.to(device) for g, t in t_in.items()})
                    run_model(student, to_device(x, device))
                    terms = [loss_fn(s_taps.outputs[g], t_out[g].to(device).reshape(s_taps.outputs[g].shape))
                             for g in range(len(groups)) if g in s_taps.outputs and g in t_out]
                    if not terms:
                        raise ValueError("distill: no group produced an output in the student's forward: check "
                                         "distill_group (its layers must run in the model's forward)")
                    value = torch.stack([t.reshape(()) for t in terms]).sum()
                    optimizer.zero_grad(set_to_none=True)
                    value.backward()
                    optimizer.step()
                    losses.append(float(value.detach()))
                    bar.update(what=f"loss {losses[-1]:.4g}")
                    if on_step is not None:
                        on_step(len(losses) - 1, losses[-1])
                bar.close()
                if after_epoch is not None:
                    s_taps.clear()  # nothing is fed to the student outside a step
                    after_epoch()
    finally:
        t_taps.remove()
        s_taps.remove()
        t_taps.clear()
        s_taps.clear()
    return losses
