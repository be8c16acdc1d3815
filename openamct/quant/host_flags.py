"""Host copies of a module's 0-dim flag buffers (a quantizer's ``initialized``, ``fixed_min``):
a forward must not wait for the device once per quantizer to learn a flag that rarely changes."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["host_flag", "set_host_flag", "forget_host_flags"]


def host_flag(module: nn.Module, name: str) -> bool:
    """The value of the 0-dim bool buffer ``name`` of ``module``, read from its device only when
    it may have changed: a forward must not wait for the device once per quantizer. The copy is
    re-read when the buffer was written in place (its ``_version`` moved: a fill, a
    ``load_state_dict``, a rollback) or replaced on the same device; a buffer that ``.to()``
    moved to another device keeps the value it had (a move does not change it)."""
    t = module._buffers[name]
    seen = module.__dict__.get("_host_" + name)
    if seen is not None and torch.compiler.is_compiling():
        # The compiler guards on the host copy (a Python bool) instead of reading the tensor:
        # every writer of the buffer updates or drops the copy (``set_host_flag``,
        # ``forget_host_flags``),
        # and a changed copy fails the guard and recompiles.
        return seen[2]
    if seen is not None:
        if seen[0] is t and seen[1] == t._version:
            return seen[2]
        if seen[0] is not t and (t.is_meta or t.device != seen[0].device):
            module.__dict__["_host_" + name] = (t, t._version, seen[2])
            return seen[2]
    return set_host_flag(module, name, bool(t))


def set_host_flag(module: nn.Module, name: str, value: bool) -> bool:
    """Record that buffer ``name`` now holds ``value`` (its writer knows it: no read)."""
    t = module._buffers[name]
    module.__dict__["_host_" + name] = (t, t._version, value)
    return value


def forget_host_flags(module: nn.Module) -> None:
    """Drop the host copies of ``module``'s flags, for writers that copy into the buffers
    wholesale (a state-dict load, a rollback): the next ``host_flag`` reads the buffer."""
    for key in [k for k in module.__dict__ if k.startswith("_host_")]:
        del module.__dict__[key]
