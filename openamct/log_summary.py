"""One WARNING per reason, not one per layer: per-layer detail goes to INFO."""

from __future__ import annotations

import logging
import re


def reason_kind(reason: str) -> str:
    """The reason with names and numbers blanked, so 60 layers stopped alike share one line."""
    return re.sub(r"'[^']*'|\"[^\"]*\"|\S+\.\S+|\w*\d\w*", "...", reason)


def warn_grouped(logger: logging.Logger, what: str, items: list[tuple[str, str]], first: int = 3) -> None:
    """``items``: (layer or group, reason). Logs each at INFO, then one WARNING per kind of
    reason: '<what>: N: <first reason> (a, b, c ...)'."""
    kinds: dict[str, list[tuple[str, str]]] = {}
    for name, reason in items:
        logger.info("%s: %s: %s", what, name, reason)
        kinds.setdefault(reason_kind(reason), []).append((name, reason))
    for same in kinds.values():
        names = [n for n, _ in same]
        shown = ", ".join(names[:first]) + (f" and {len(names) - first} more" if len(names) > first else "")
        example = same[0][1] if len(same) == 1 else f"{same[0][1]} (and alike)"
        logger.warning("%s: %d: %s [%s]", what, len(same), example, shown)
