"""Which model a record describes: a structural fingerprint in comment lines at its top.

    # openamct-fingerprint: <sha256[:16]> (<n> layers)
    # openamct-layer: <name> <Type> <original weight shape>

Protobuf's text parser (upstream's too) skips ``#`` comments, so the record stays an upstream
ScaleOffsetRecord. Restore recomputes the lines from the model it is given and refuses a record
of another model, naming the first difference; a record without them (upstream's) is accepted.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping

from openamct.layer_types import RECURRENT_TYPES

logger = logging.getLogger(__name__)

_HEAD, _LAYER = "# openamct-fingerprint: ", "# openamct-layer: "


def layer_lines(layers: Mapping) -> list[str]:
    """One 'name Type shape' line per supported layer (``LayerInfo``s of the original model)."""
    out = []
    for name, info in layers.items():
        w = getattr(info.module, "weight", getattr(info.module, "weight_ih_l0", None))  # (an LSTM/GRU: its first)
        shape = "x".join(str(d) for d in w.shape) if w is not None else "-"
        out.append(f"{name} {info.type} {shape}")
    return out


def fingerprint_header(layers: Mapping) -> str:
    lines = layer_lines(layers)
    digest = hashlib.sha256("\n".join(lines).encode("utf-8")).hexdigest()[:16]
    return "".join([f"{_HEAD}{digest} ({len(lines)} layers)\n", *(f"{_LAYER}{ln}\n" for ln in lines)])


def read_fingerprint(text: str) -> list[str] | None:
    """The layer lines of a record's fingerprint, or None when it has none."""
    if _HEAD not in text:
        return None
    return [ln[len(_LAYER):].rstrip() for ln in text.splitlines() if ln.startswith(_LAYER)]


def check_fingerprint(text: str, layers: Mapping, where: str) -> None:
    recorded = read_fingerprint(text)
    if recorded is None:
        logger.debug("%s has no openamct fingerprint (an upstream record?): not checked", where)
        return
    now = layer_lines(layers)
    if not any(ln.split(" ")[1] in RECURRENT_TYPES for ln in recorded if " " in ln):
        # Written before openamct handled LSTM/GRU (they were left float and not listed): the
        # model's recurrent layers are not compared. A record that lists any is compared on all.
        now = [ln for ln in now if ln.split(" ")[1] not in RECURRENT_TYPES]
    if sorted(recorded) == sorted(now):
        return
    rec_by, now_by = {ln.split(" ")[0]: ln for ln in recorded}, {ln.split(" ")[0]: ln for ln in now}
    for name, line in now_by.items():
        if name not in rec_by:
            raise ValueError(f"{where} describes another model: the model's layer {name!r} ({line.split(' ', 1)[1]}) "
                             "is not in the record")
        if rec_by[name] != line:
            raise ValueError(f"{where} describes another model: layer {name!r} is {rec_by[name].split(' ', 1)[1]} in "
                             f"the record but {line.split(' ', 1)[1]} in the model")
    extra = next(n for n in rec_by if n not in now_by)
    raise ValueError(f"{where} describes another model: the record's layer {extra!r} "
                     f"({rec_by[extra].split(' ', 1)[1]}) is not in the model")
