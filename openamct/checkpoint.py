"""Load a checkpoint of a compressed model safely (weights only, never arbitrary pickles)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch
from torch import nn

logger = logging.getLogger(__name__)


def _keys_preview(keys, n: int = 8) -> str:
    keys = list(keys)
    more = f", ... ({len(keys)} in all)" if len(keys) > n else ""
    return ", ".join(map(repr, keys[:n])) + more


def read_state_dict(pth_file: str, state_dict_name: str | None) -> Mapping[str, torch.Tensor]:
    """The state dict in ``pth_file`` (``ckpt[state_dict_name]`` when a name is given)."""
    if not os.path.isfile(pth_file):
        raise ValueError(f"pth_file {pth_file!r} does not exist or is not a file")
    try:
        ckpt = torch.load(pth_file, map_location="cpu", weights_only=True)
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
    return ckpt


def load_into(model: nn.Module, pth_file: str, state_dict_name: str | None) -> None:
    """Load strictly; a checkpoint of another model is a ValueError listing what differs."""
    sd = read_state_dict(pth_file, state_dict_name)
    own = model.state_dict()
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
    model.load_state_dict(sd, strict=True)
    logger.info("loaded %d tensors from %s", len(sd), pth_file)
