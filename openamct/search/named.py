"""Upstream's sensitivity= / search_alg= arguments: a registered name or an instance of the
base class users subclass."""

from __future__ import annotations

from typing import Any


def resolve(arg: str, value: Any, base: type, known: dict[str, type]) -> Any:
    if isinstance(value, base):
        return value
    if isinstance(value, str):
        if value not in known:
            raise ValueError(f"{arg} {value!r} is not known: use one of {', '.join(known)} "
                             f"or an instance of a {base.__name__} subclass")
        return known[value]()
    raise TypeError(f"{arg} must be a name (str) or a {base.__name__} instance, got {type(value).__name__}")
