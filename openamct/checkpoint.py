"""Load a checkpoint of a compressed model safely (weights only, never arbitrary pickles)."""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Mapping

import torch
from torch import nn

from openamct._checks import all_finite
from openamct.log_summary import warn_grouped
from openamct.training.decisions import KEY as DECISIONS_KEY

logger = logging.getLogger(__name__)


def _keys_preview(keys, n: int = 8) -> str:
    keys = list(keys)
    more = f", ... ({len(keys)} in all)" if len(keys) > n else ""
    return ", ".join(map(repr, keys[:n])) + more


def read_state_dict(pth_file: str, state_dict_name: str | None) -> Mapping[str, torch.Tensor]:
    """The state dict in ``pth_file`` (``ckpt[state_dict_name]`` when a name is given)."""
    return _read(pth_file, state_dict_name)[0]


def _read(pth_file: str, state_dict_name: str | None) -> tuple[Mapping[str, torch.Tensor], bool]:
    """(the state dict, whether its tensors are mapped from the file)."""
    if not os.path.isfile(pth_file):
        raise ValueError(f"pth_file {pth_file!r} does not exist or is not a file")
    try:
        try:
            # Memory-mapped: a billion-parameter checkpoint is read into the model's own tensors
            # a part at a time, never held whole beside them (``load_into``).
            ckpt, mapped = torch.load(pth_file, map_location="cpu", weights_only=True, mmap=True), True
        except Exception:  # a legacy (non-zip) file cannot be mapped; any other fault repeats below
            ckpt, mapped = torch.load(pth_file, map_location="cpu", weights_only=True), False
    except Exception as exc:  # whatever the weights-only unpickler raises on a bad file (also IndexError, KeyError, struct.error)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"pth_file {pth_file!r} was refused: it is not a plain tensor checkpoint that loads with "
            f"torch.load(weights_only=True) ({first}). openamct never unpickles arbitrary objects; "
            "save checkpoints with torch.save({'state_dict': model.state_dict()}, path).") from None
    if state_dict_name is not None:
        if not isinstance(ckpt, Mapping) or state_dict_name not in ckpt:
            held = _keys_preview(ckpt.keys()) if isinstance(ckpt, Mapping) else type(ckpt).__name__
            raise ValueError(f"state_dict_name {state_dict_name!r} is not in pth_file {pth_file!r}; the file holds: {held}")
        ckpt = ckpt[state_dict_name]
    if not isinstance(ckpt, Mapping) or not all(isinstance(v, torch.Tensor) for v in ckpt.values()):
        hint = ""
        if isinstance(ckpt, Mapping):
            nested = [k for k, v in ckpt.items() if isinstance(v, Mapping)]
            if nested:
                hint = f"; it holds nested dicts under {_keys_preview(nested)}: pass state_dict_name"
        raise ValueError(f"pth_file {pth_file!r} does not hold a state dict (name -> tensor){hint}")
    return ckpt, mapped


def with_metadata(part: Mapping, sd: Mapping) -> Mapping:
    """``part`` carrying ``sd``'s ``_metadata`` (each module's ``version``, which a module's
    ``_load_from_state_dict`` may read: torchvision's MNASNet refuses a load without it), as
    ``load_state_dict`` needs on every dict it is given; a plain dict carries none."""
    meta = getattr(sd, "_metadata", None)
    if meta is None:
        return part
    out = OrderedDict(part)
    out._metadata = meta
    return out


def _check_values(sd: Mapping[str, torch.Tensor], own: Mapping[str, torch.Tensor], where: str,
                  sliced: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """Each value of ``own``'s keys as it enters: dtype kind, finiteness (of ``sliced`` keys: as
    their slices are copied), 0/1 masks, clip order; the collapsed quantizers found,
    for one warning."""
    collapsed: list[tuple[str, str]] = []
    for key, mine in own.items():
        value = sd[key]
        if (value.is_floating_point() != mine.is_floating_point() or (
                not mine.is_floating_point() and value.dtype != mine.dtype and value.numel())):
            raise ValueError(f"{where}: {key!r} has dtype {value.dtype} but the model's is {mine.dtype}: save "
                             "the checkpoint from the model that create_*/restore_* returned, without casting it")
        if value.is_floating_point() and value.dtype != mine.dtype and not _holds_exactly(value.dtype, mine.dtype):
            # A float16/bfloat16 copy of a float32 model has lost its low bits: the restored model
            # would no longer compute what was trained, and upcasting cannot bring them back.
            raise ValueError(f"{where}: {key!r} has dtype {value.dtype}, which cannot hold the model's {mine.dtype} "
                             "values exactly (the checkpoint was cast down): save the state_dict of the model "
                             "create_*/restore_* returned, as trained, without casting it")
        if key not in sliced and value.is_floating_point() and not all_finite(value):  # (isfinite: 2.8x the tensor)
            _not_finite(key, value, where)
        if key.endswith(".mask"):
            _check_01(value, key, where)
        if key.endswith("act_quant.clip_max"):
            # The quantizer uses max(clip_max, 0) and min(clip_min, 0) (or 0 with fixed_min). Training
            # itself can drive the raw values across each other, even to an empty range (a collapsed
            # quantizer; seen in the zoo's MobileNetV2): a resume must take what training made, so
            # an empty range is reported, not refused.
            prefix = key[:-len("clip_max")]
            cmin_key = prefix + "clip_min"
            cmax, cmin = float(value), float(sd.get(cmin_key, torch.tensor(0.0)))
            fixed = bool(sd.get(prefix + "fixed_min", torch.tensor(False)))
            lo, hi = (0.0 if fixed else min(cmin, 0.0)), max(cmax, 0.0)
            if not hi > lo:
                collapsed.append((key[:-len(".act_quant.clip_max")],
                                  f"inverted clips ({key!r} = {cmax:g}, {cmin_key!r} = {cmin:g}) leave the "
                                  "quantizer an empty range: its input quantizes to one value"))
    return collapsed


def _holds_exactly(have: torch.dtype, want: torch.dtype) -> bool:
    """Every ``want`` value converts to ``have`` and back unchanged (float64 holds float32)."""
    a, b = torch.finfo(have), torch.finfo(want)
    return a.bits >= b.bits and a.eps <= b.eps and a.max >= b.max


def _not_finite(key: str, value: torch.Tensor, where: str) -> None:
    bad = int((~torch.isfinite(value)).sum())
    raise ValueError(f"{where}: {key!r} holds {bad} NaN/inf value(s) (training diverged?): "
                     "resume from an earlier checkpoint")


def _check_01(value: torch.Tensor, key: str, where: str) -> None:
    if value.dtype != torch.bool and value.numel() and not bool(((value == 0) | (value == 1)).all()):
        odd = value[(value != 0) & (value != 1)].reshape(-1)[0].item()
        raise ValueError(f"{where}: {key!r} is a mask but holds {odd!r}; masks hold only 0 and 1")


def _pack_legacy_masks(sd: Mapping[str, torch.Tensor], own: Mapping[str, torch.Tensor], model: nn.Module,
                       pth_file: str) -> Mapping[str, torch.Tensor]:
    """A checkpoint from before 2:4 masks were packed holds ``<layer>.sparsity.mask`` (float
    0/1, later bool, of the weight's shape) where the model now has ``mask_bits``: packed here,
    after the same checks, so such checkpoints still load."""
    legacy = [k for k in sd if k.endswith(".mask") and k not in own and k + "_bits" in own and k + "_bits" not in sd]
    if not legacy:
        return sd
    from openamct.record.mask_codec import pack_bits

    where = f"pth_file {pth_file!r}"
    sd = with_metadata(dict(sd), sd)
    for key in legacy:
        value = sd.pop(key)
        shape = tuple(model.get_submodule(key[:-len(".mask")]).weight_shape)
        if tuple(value.shape) != shape:
            raise ValueError(f"{where} does not match the compressed model: shape mismatch {key}: checkpoint "
                             f"{tuple(value.shape)} vs model {shape}")
        _check_01(value, key, where)  # NaN and inf included
        sd[key + "_bits"] = pack_bits(value)
    return sd


def load_into(model: nn.Module, pth_file: str, state_dict_name: str | None, load_parts=None) -> None:
    """Load strictly; a checkpoint of another model is a ValueError listing what differs, before
    anything is copied. Values are checked as they enter: a bad one fails the restore, which then
    returns no model, and its working copy is dropped.

    ``load_parts`` is the load's branch point: the pipeline passes
    ``openamct.large.chunked_load.load_in_parts`` for a CPU model, and a memory-mapped
    checkpoint is then copied a part at a time, each part's file pages given back once copied;
    ``load_parts(model, sd, own, from_file, where)`` returns the collapsed quantizers' names."""
    sd, mapped = _read(pth_file, state_dict_name)
    own = model.state_dict()
    if DECISIONS_KEY in own and DECISIONS_KEY not in sd:
        # A checkpoint from before models carried their decisions: nothing to compare with.
        own.pop(DECISIONS_KEY)
    from_file = set(sd) if mapped else set()  # not the masks packed below: those are new memory
    sd = _pack_legacy_masks(sd, own, model, pth_file)
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    shapes = [f"{k}: checkpoint {tuple(sd[k].shape)} vs model {tuple(own[k].shape)}"
              for k in own if k in sd and tuple(sd[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing keys {_keys_preview(missing)}")
        if unexpected:
            parts.append(f"unexpected keys {_keys_preview(unexpected)}")
        if shapes:
            parts.append("shape mismatches " + "; ".join(shapes[:5]))
        raise ValueError(f"pth_file {pth_file!r} does not match the compressed model (was it saved from the "
                         f"model that create_*/restore_* returned, with this config and record?): {'; '.join(parts)}")
    where = f"pth_file {pth_file!r}"
    if load_parts is not None and mapped and all(t.device.type == "cpu" for t in own.values()):
        collapsed = load_parts(model, sd, own, from_file, where)  # branch point: see the docstring
    else:
        collapsed = _check_values(sd, own, where)
        model.load_state_dict(with_metadata(sd, sd), strict=False)  # keys and shapes matched above
    warn_grouped(logger, f"{where}: collapsed activation quantizer(s)", collapsed)
    logger.info("loaded %d tensors from %s", len(sd), pth_file)
