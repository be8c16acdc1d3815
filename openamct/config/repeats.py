"""Refuse a singular field or a oneof given twice in one block of a text-format config.

The parser uses ``text_format.Merge``, where the last of two ``prune_config`` blocks silently
wins. ``Parse`` would refuse it, but would also refuse upstream's own sample configs, which
write ``layer_name: "layer2.0"`` twice in one override block. So: the same scalar value written
twice is accepted (it changes nothing); a different value, a repeated message block, or two
members of one oneof are a ConfigError naming the field and both lines.

The walk runs after ``Merge`` succeeded, so the text is known to be well formed.
"""

from __future__ import annotations

from google.protobuf import text_format

from openamct.config.errors import ConfigError

_ENDS = {"{": "}", "<": ">"}


def _pos(tok: text_format.Tokenizer) -> tuple[int, int]:
    return tok._line + 1, tok._column + 1  # the tokenizer's own 0-based position of its token


def _scalar(tok: text_format.Tokenizer) -> str:
    parts = [tok.token]
    tok.NextToken()
    while parts[0][:1] in ("'", '"') and tok.token[:1] in ("'", '"'):  # adjacent strings concatenate
        parts.append(tok.token)
        tok.NextToken()
    return "".join(parts)


def _value(tok: text_format.Tokenizer, field, where: str) -> str | None:
    """Consume one value (or a [list]); the scalar's text, None for a message."""
    if tok.TryConsume("["):
        while not tok.TryConsume("]"):
            _value(tok, field, where)
            tok.TryConsume(",")
        return None
    if field.message_type is not None:
        for start, end in _ENDS.items():
            if tok.TryConsume(start):
                _block(tok, field.message_type, end, where)
                return None
    return _scalar(tok)


def _block(tok: text_format.Tokenizer, desc, end: str | None, where: str) -> None:
    seen: dict[str, tuple[int, str | None]] = {}
    oneofs: dict[str, tuple[str, int]] = {}
    while not (tok.AtEnd() if end is None else tok.TryConsume(end)):
        if tok.AtEnd():  # unbalanced: Merge would have refused it; never loop on it
            return
        line, col = _pos(tok)
        name = tok.token
        tok.NextToken()
        field = desc.fields_by_name.get(name)
        if field is None:  # an extension or Any expansion: not in our protos, Merge judged it
            return
        tok.TryConsume(":")
        value = _value(tok, field, where)
        tok.TryConsume(",") or tok.TryConsume(";")
        if field.is_repeated:
            continue
        if name in seen:
            first, before = seen[name]
            if value is None or before is None or value != before:
                raise ConfigError(f"{where}: line {line}:{col}: field {name!r} is given twice in {desc.name} "
                                  f"(first at line {first}); only one is allowed: merge the two into one")
        seen.setdefault(name, (line, value))
        oneof = field.containing_oneof
        if oneof is not None:
            other = oneofs.setdefault(oneof.name, (name, line))
            if other[0] != name:
                raise ConfigError(f"{where}: line {line}:{col}: field {name!r} and field {other[0]!r} (line "
                                  f"{other[1]}) are both given in {desc.name}, but only one of them may be "
                                  f"(they are alternatives of {oneof.name!r})")


def check_repeats(text: str, message_descriptor, where: str) -> None:
    """Raise ConfigError for a singular field or oneof given twice in one block of ``text``."""
    tok = text_format.Tokenizer(text.split("\n"))
    _block(tok, message_descriptor, None, where)
