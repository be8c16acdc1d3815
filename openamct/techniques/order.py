"""The order techniques are applied in, from what each declares (``Technique.after``).

A registry is sorted topologically: a technique runs after every technique it names. Among
techniques with no declared relation the registry's own order is kept (stable), so the record
lists entries in the same order from one run to the next. A name no technique of the registry
has, a technique listed twice, or a cycle is a ValueError naming them.
"""

from __future__ import annotations

from collections.abc import Sequence

from openamct.techniques.base import Technique


def ordered(techniques: Sequence[Technique]) -> tuple[Technique, ...]:
    """``techniques`` in an order that honours every ``after`` declaration."""
    names = [t.name for t in techniques]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"techniques: {', '.join(map(repr, twice))} given more than once")
    for t in techniques:
        unknown = [n for n in t.after if n not in names]
        if unknown:
            raise ValueError(f"techniques: {t.name!r} declares after={tuple(t.after)!r}, but "
                             f"{', '.join(map(repr, unknown))} is not among the techniques in use "
                             f"({', '.join(map(repr, names))})")
    done: list[Technique] = []
    waiting = list(techniques)
    while waiting:
        placed = {t.name for t in done}
        ready = next((t for t in waiting if all(n in placed for n in t.after)), None)
        if ready is None:
            raise ValueError("techniques: their after= declarations form a cycle: "
                             + "; ".join(f"{t.name!r} after {tuple(t.after)!r}" for t in waiting))
        done.append(ready)
        waiting.remove(ready)
    return tuple(done)


def train_losses(model) -> dict[str, object]:
    """The loss terms the techniques of a compressed model offer after its last training forward
    (``Technique.losses``), keyed ``"<technique>/<term>"``: the user adds what they want to
    their loss (e.g. ``loss = task_loss + sum(train_losses(model).values())``)."""
    keeper = getattr(model, "_openamct", None)
    if keeper is None:
        raise ValueError("model was not returned by an openamct create_*/restore_* function")
    return {f"{t.name}/{k}": v for t, state in keeper.applied for k, v in t.losses(state).items()}
