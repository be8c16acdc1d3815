"""Upstream's sensitivity= / search_alg= arguments: a registered name or an instance of the
base class users subclass."""

from __future__ import annotations

from typing import Any


def resolve(arg: str, value: Any, base: type, known: dict[str, type], method: str = "",
            upstream_hooks: tuple[str, ...] = ()) -> Any:
    """``method``: the one a subclass implements; ``upstream_hooks``: upstream's methods of the
    same base, which read AMCT's internal graph and records: a subclass implementing those and
    not ``method`` was written for upstream, and is refused saying so."""
    if isinstance(value, base):
        cls = type(value)
        if method and getattr(cls, method) is getattr(base, method) and any(hasattr(cls, h) for h in upstream_hooks):
            raise TypeError(f"{arg}: {cls.__name__} implements upstream's {'/'.join(upstream_hooks)}, which work on "
                            f"AMCT's internal graph and record objects; openamct calls {method} instead "
                            f"(docs/prune_search.md): implement {method}")
        return value
    if isinstance(value, str):
        if value not in known:
            raise ValueError(f"{arg} {value!r} is not known: use one of {', '.join(known)} "
                             f"or an instance of a {base.__name__} subclass")
        return known[value]()
    raise TypeError(f"{arg} must be a name (str) or a {base.__name__} instance, got {type(value).__name__}")
