"""A fast protobuf text parser for the record: the mirror of ``text_writer``.

Why it exists: ``text_format.Merge`` is pure Python at about 7 us per field, and a record has a
``scale_w`` and an ``offset_w`` line per output channel, so restore spent seconds per billion
parameters parsing. ``fast_merge`` builds the same message from the text a record
writer prints: one regular expression splits the text into tokens, and a loop over them fills
the message; repeated scalars are collected per field and added with one ``extend``.

It accepts only the plain subset that writers print: ``name: value`` and ``name { ... }``, `#`
comments, decimal numbers, ``inf``/``nan``, double-quoted strings (C escapes as text_format
reads them), enum values by name or number. Anything else (an unknown field, ``<...>``,
``[...]`` lists, separators, hex or octal integers, ``1.5f``, single quotes, a value out of its
field's range) raises ``Unsupported`` before anything is trusted, and the caller then parses the
text with ``text_format.Merge``, whose error messages name the line and column. So the fast path
never decides what a text means where the two parsers could differ: its tests compare it with
``text_format`` on the fixtures, edge cases and a fuzz.
"""

from __future__ import annotations

import re

from google.protobuf import text_encoding
from google.protobuf.descriptor import FieldDescriptor as FD

__all__ = ["Unsupported", "fast_merge"]


class Unsupported(Exception):
    """The text uses something the fast path leaves to ``text_format``."""


# One token per match: comments and whitespace are matched and dropped (empty group).
_TOKENS = re.compile(r'\s+|#[^\n]*|("(?:[^"\\\n]|\\.)*"|[A-Za-z_][A-Za-z0-9_]*|[-+.0-9][-+.0-9A-Za-z_]*|[{}:]|.)')
_INT = re.compile(r"-?(?:0|[1-9][0-9]*)\Z")
_FLOAT = re.compile(r"-?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?\Z")
_FLOAT_WORDS = {"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan"), "-nan": float("nan")}
_BOOLS = {"true": True, "false": False}

_INTS = {FD.TYPE_INT32, FD.TYPE_INT64, FD.TYPE_UINT32, FD.TYPE_UINT64, FD.TYPE_SINT32, FD.TYPE_SINT64,
         FD.TYPE_FIXED32, FD.TYPE_FIXED64, FD.TYPE_SFIXED32, FD.TYPE_SFIXED64}
_FLOATS = {FD.TYPE_FLOAT, FD.TYPE_DOUBLE}


def _float(tok: str) -> float:
    if _FLOAT.match(tok):
        return float(tok)
    if tok in _FLOAT_WORDS:
        return _FLOAT_WORDS[tok]
    raise Unsupported(tok)


def _int(tok: str) -> int:
    if _INT.match(tok):
        return int(tok)
    raise Unsupported(tok)


def _value(field, tokens: list, i: int):
    """The value of scalar ``field`` starting at ``tokens[i]``; (value, next index)."""
    t, tok = field.type, tokens[i]
    if t in _FLOATS:
        return _float(tok), i + 1
    if t in _INTS:
        return _int(tok), i + 1
    if t == FD.TYPE_STRING or t == FD.TYPE_BYTES:
        parts = []
        while i < len(tokens) and tokens[i][:1] == '"':  # adjacent strings concatenate
            parts.append(text_encoding.CUnescape(tokens[i][1:-1]))
            i += 1
        if not parts:
            raise Unsupported(tok)
        data = b"".join(parts)
        return (data.decode("utf-8") if t == FD.TYPE_STRING else data), i
    if t == FD.TYPE_BOOL:
        if tok in _BOOLS:
            return _BOOLS[tok], i + 1
        raise Unsupported(tok)
    if t == FD.TYPE_ENUM:
        values = field.enum_type.values_by_name
        if tok in values:
            return values[tok].number, i + 1
        return _int(tok), i + 1
    raise Unsupported(field.full_name)


def fast_merge(text: str, message) -> None:
    """Merge ``text`` into ``message`` as ``text_format.Merge`` would; ``Unsupported`` (with
    ``message`` in an unspecified state) when the text leaves the plain subset."""
    tokens = [t for t in _TOKENS.findall(text) if t]
    n = len(tokens)
    stack = []  # (message, its pending repeated scalars) of the enclosing messages
    pending: dict = {}
    msg, fields = message, message.DESCRIPTOR.fields_by_name
    i = 0
    try:
        while i < n:
            tok = tokens[i]
            if tok == "}":
                if not stack:
                    raise Unsupported("}")
                _flush(msg, pending)
                msg, pending = stack.pop()
                fields = msg.DESCRIPTOR.fields_by_name
                i += 1
                continue
            field = fields.get(tok)
            if field is None or i + 1 >= n:
                raise Unsupported(tok)
            i += 1
            if field.type == FD.TYPE_MESSAGE:
                if tokens[i] == ":":
                    i += 1
                if i >= n or tokens[i] != "{" or field.message_type.GetOptions().map_entry:
                    raise Unsupported(tok)
                i += 1
                child = getattr(msg, tok).add() if field.is_repeated else getattr(msg, tok)
                child.SetInParent()
                stack.append((msg, pending))
                msg, pending, fields = child, {}, child.DESCRIPTOR.fields_by_name
                continue
            if tokens[i] != ":" or i + 1 >= n:
                raise Unsupported(tok)
            value, i = _value(field, tokens, i + 1)
            if field.is_repeated:
                pending.setdefault(tok, []).append(value)
            else:
                setattr(msg, tok, value)
        if stack:
            raise Unsupported("unclosed message")
        _flush(msg, pending)
    except (ValueError, TypeError, OverflowError, UnicodeDecodeError) as exc:  # out of range, bad escape
        raise Unsupported(str(exc)) from None


def _flush(msg, pending: dict) -> None:
    for name, values in pending.items():
        getattr(msg, name).extend(values)


def merge_or_decline(text: str, message) -> bool:
    """``record.file_io.FastText.merge``: ``fast_merge``, False where the text leaves the plain
    subset (``text_format`` then reads it)."""
    try:
        fast_merge(text, message)
    except Unsupported:
        return False
    return True
