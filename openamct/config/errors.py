"""The config error type and the helper that points a message at a line of the config text.

The lowest module of ``openamct.config``: parsing, the repeat check, validation, planning and
the techniques' config slices all raise ``ConfigError`` with a ``locate`` prefix.
"""

from __future__ import annotations

import re


class ConfigError(ValueError):
    """A config problem; the message names the file, line:column where known, and the field."""


def locate(text: str, field: str, value: str | None = None) -> str:
    """'line L:C' of the first occurrence of ``field`` (optionally followed by ``value``)."""
    pattern = r"\b" + re.escape(field) + r"\b"
    if value is not None:
        pattern += r"\s*:?\s*\"?" + re.escape(value)
    m = re.search(pattern, text)
    if m is None:
        return ""
    line = text.count("\n", 0, m.start()) + 1
    col = m.start() - (text.rfind("\n", 0, m.start()) + 1) + 1
    return f"line {line}:{col}: "
