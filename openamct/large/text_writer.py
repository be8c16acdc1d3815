"""A fast protobuf text printer for the record (ScaleOffsetRecord and the messages under it).

Why it exists: ``text_format.MessageToString`` is pure Python and formats each float with
``type_checkers.ToShortestFloat`` (a loop of ``'%.{p}g'`` and struct round trips); a record has a
``scale_w`` and an ``offset_w`` line per output channel, so printing cost ~20 s per billion
parameters, on every record write. ``message_to_text`` gives the same bytes >15x faster (its tests
compare it with ``MessageToString`` on the fixtures, hand-built edge cases and a fuzz): it walks
``ListFields()`` as text_format does and formats scalars with text_format's own code, but prints
repeated floats and ints with numpy.

Repeated floats: ``ToShortestFloat(x)`` is ``float('%.{p}g' % x)`` for the least p >= 6 that rounds
back to the float32 x, printed with ``repr``. For p = 6..9 we take N = rint(|x| * 10**s) in float64
only where it is provably '%.{p}g''s digits: y = |x| * 10**s is < 2.3e-7 off exact (two correctly
rounded operations on exact powers of ten, y < 1e9), and must be > 1e-6 from a .5 tie and in the
p-digit range. N * 10**-s (|s| <= 22: one IEEE operation on exact operands) is then exactly
``float('%.{p}g' % x)``, and the float32 cast is the one struct.pack does. repr of that double has
N's digits (a <= 9-digit decimal is the shortest repr of its nearest double), laid out by sign,
digit count and exponent as repr itself lays them out (``_layout``). The rest (nan, inf, |x| outside
about 1e-14..1e15, near-ties, doubles that are no float32) goes through text_format's own code.

Not handled (this proto has none; such messages go to ``text_format``): map fields, groups,
extensions, Any; big-endian hosts. Unknown fields are not printed (MessageToString's default).
"""

from __future__ import annotations

import functools
import math
import sys

import numpy as np
from google.protobuf import text_encoding, text_format
from google.protobuf.descriptor import FieldDescriptor as FD
from google.protobuf.internal.type_checkers import ToShortestFloat

_CHUNK = 1 << 14  # floats formatted together: numpy calls amortized, temporaries in cache


def message_to_text(message) -> str:
    """``text_format.MessageToString(message)``, byte for byte, faster on large repeated fields."""
    if not _supported(message.DESCRIPTOR) or sys.byteorder != "little":
        return text_format.MessageToString(message)
    out: list = []
    floats: dict = {}  # prefix -> [(index in out, values)]
    _print_message(message, "", out, floats)
    for prefix, fields in floats.items():  # all of a prefix together, in chunks
        values = np.concatenate([v for _, v in fields])
        ends = np.cumsum([len(v) for _, v in fields]).tolist()
        field, pieces = 0, []
        for start in range(0, len(values), _CHUNK):
            stop = min(start + _CHUNK, len(values))
            lines, row = _float_lines(values[start:stop]), start
            while row < stop:  # the pieces of fields in this chunk
                end = min(ends[field], stop)
                pieces.append(_join(lines[row - start:end - start], prefix))
                row = end
                if end == ends[field]:
                    out[fields[field][0]], pieces, field = "".join(pieces), [], field + 1
    return "".join(out)


@functools.cache
def _supported(desc, _seen=()) -> bool:
    if desc.full_name == "google.protobuf.Any" or desc.GetOptions().map_entry or desc.extensions \
            or desc.extension_ranges:
        return False
    for f in desc.fields:
        if f.type == FD.TYPE_GROUP:
            return False
        if f.type == FD.TYPE_MESSAGE and f.message_type not in _seen + (desc,) \
                and not _supported(f.message_type, _seen + (desc,)):
            return False
    return True


def _print_message(message, indent: str, out: list, floats: dict) -> None:
    for field, value in message.ListFields():  # text_format's order
        if field.is_repeated:  # (not empty: ListFields leaves those out)
            prefix = f"{indent}{field.name}: "
            if field.cpp_type == FD.CPPTYPE_FLOAT:
                floats.setdefault(prefix, []).append((len(out), np.asarray(value, np.float64)))
                out.append(None)
            elif field.cpp_type in _INT_TYPES:
                out.append(_int_lines(value, prefix))
            elif field.cpp_type == FD.CPPTYPE_MESSAGE:
                for element in value:
                    _print_submessage(field, element, indent, out, floats)
            else:
                out.append("".join(f"{prefix}{_scalar(field, v)}\n" for v in value))
        elif field.cpp_type == FD.CPPTYPE_MESSAGE:
            _print_submessage(field, value, indent, out, floats)
        else:
            out.append(f"{indent}{field.name}: {_scalar(field, value)}\n")


def _print_submessage(field, value, indent: str, out: list, floats: dict) -> None:
    out.append(f"{indent}{field.name} {{\n")
    _print_message(value, indent + "  ", out, floats)
    out.append(f"{indent}}}\n")


_INT_TYPES = (FD.CPPTYPE_INT32, FD.CPPTYPE_INT64, FD.CPPTYPE_UINT32, FD.CPPTYPE_UINT64)


def _scalar(field, value) -> str:
    """One value, as text_format's ``PrintFieldValue`` writes it (as_utf8=True)."""
    cpp = field.cpp_type
    if cpp == FD.CPPTYPE_FLOAT:
        return _float_str(value)
    if cpp == FD.CPPTYPE_ENUM:
        enum_value = field.enum_type.values_by_number.get(value, None)
        return enum_value.name if enum_value is not None else str(value)
    if cpp == FD.CPPTYPE_STRING:
        return '"' + text_encoding.CEscape(value, field.type != FD.TYPE_BYTES) + '"'
    if cpp == FD.CPPTYPE_BOOL:
        return "true" if value else "false"
    return str(value)  # ints, doubles


def _float_str(value: float) -> str:
    return str(value) if math.isnan(value) else str(ToShortestFloat(value))


def _join(rows: np.ndarray, prefix: str) -> str:
    """Rows of NUL-padded lines (each ends in a newline), NULs dropped, ``prefix`` before each."""
    text = rows.tobytes().translate(None, b"\0").decode("utf-8")
    return prefix + text[:-1].replace("\n", "\n" + prefix) + "\n"


def _int_lines(values, prefix: str) -> str:
    """``prefix + str(v) + "\\n"`` for each v; each distinct value formatted once when they span
    < 65536 (offsets: a few values, weights' all zero), else one by one."""
    a = np.asarray(values)
    lo, hi = int(a.min()), int(a.max())
    if lo == hi:  # one value (offset_w: all zeros): its line repeated
        return f"{prefix}{lo}\n" * a.size
    if hi - lo >= 1 << 16:
        return prefix + ("\n" + prefix).join(map(str, values)) + "\n"
    idx = (a - a.dtype.type(lo)).astype(np.intp)
    present = np.flatnonzero(np.bincount(idx))
    lines = [f"{lo + int(d)}\n".encode("ascii") for d in present]
    table = np.zeros((len(lines), max(map(len, lines))), dtype=np.uint8)
    for i, line in enumerate(lines):
        table[i, :len(line)] = np.frombuffer(line, dtype=np.uint8)
    row = np.zeros(hi - lo + 1, dtype=np.intp)
    row[present] = np.arange(len(present))
    return _join(table[row[idx]], prefix)


# -- repeated floats ------------------------------------------------------------------------------

_P10 = np.array([float(10 ** k) for k in range(23)])  # exact doubles
_PREC = np.array([6, 7, 8, 9])[:, None]
_POW = np.array([10 ** k for k in range(10)], np.uint64)
_EMIN, _EMAX = -24, 24  # decimal exponents in the layout tables (vectorized values: -15..15)
_NE = _EMAX - _EMIN + 1
# _KEEP[z]: clears bytes 0..z-2 of the digit word (z leading zeros, the first in the lead byte);
# _LOW[b]: keeps bytes 0..b-1
_KEEP = np.array([~((1 << 8 * max(z - 1, 0)) - 1) & (2 ** 64 - 1) for z in range(10)], np.uint64)
_LOW = np.array([(1 << 8 * b) - 1 for b in range(9)], np.uint64)


@functools.cache
def _layout():
    """For each combo (sign, digit count k, decimal exponent E): CPython's repr of such a float,
    taken from repr of one with the digits 1..k and cut around its digits. LEFT: the text before
    them (sign, "0.", zeros) in bytes 0..6 of a word; DOT: before which byte of the digit word
    (digits 2..9 of 9 right-aligned ones) the dot goes, 8: none; RIGHT: the text after them
    (zeros, ".0", exponent) and a newline, from byte 1 of 3 words (byte 0: a digit the dot pushed
    out of the digit word); RLEN: bytes used in RIGHT."""
    n = 2 * 9 * _NE
    left, dot, right, rlen = np.zeros(n, np.uint64), np.full(n, 8), np.zeros((n, 3), np.uint64), \
        np.zeros(n, np.intp)
    combo = 0
    for neg in (0, 1):
        for k in range(1, 10):
            digits = "123456789"[:k]
            for e in range(_EMIN, _EMAX + 1):
                text = repr(float(f"{'-' * neg}{digits}e{e - k + 1}"))
                i, j = text.index("1"), text.index(str(k)) + 1  # the first and last digit
                body, before, after = text[i:j], text[:i].encode(), (text[j:] + "\n").encode()
                assert body.replace(".", "", 1) == digits and len(before) <= 7 and len(after) < 24
                if "." in body:
                    dot[combo] = 9 - k + body.index(".") - 1
                left[combo] = int.from_bytes(before, "little")
                right[combo] = np.frombuffer((b"\0" + after).ljust(24, b"\0"), "<u8")
                rlen[combo] = 1 + len(after)
                combo += 1
    return left, dot, right, rlen


def _scaled(x: np.ndarray, s: np.ndarray) -> np.ndarray:
    """x * 10**s, for s in -22..22: one IEEE operation on exact operands (correctly rounded)."""
    if (s >= 0).all():
        return x * _P10[s]
    if (s <= 0).all():
        return x / _P10[-s]
    return np.where(s >= 0, x * _P10[np.maximum(s, 0)], x / _P10[np.maximum(-s, 0)])


def _digits8(x: np.ndarray) -> np.ndarray:
    """x < 10**8 (uint64) as 8 ASCII digits in a word, the first digit in its lowest byte."""
    hi = x // 10000
    v = hi | ((x - hi * 10000) << 32)  # two 4-digit lanes
    q = ((v * 5243) >> 19) & 0x0000007F0000007F  # lane // 100 (exact below 43699)
    v = q | ((v - q * 100) << 16)  # four 2-digit lanes
    q = ((v * 103) >> 10) & 0x000F000F000F000F  # lane // 10 (exact below 179)
    return (q | ((v - q * 10) << 8)) + 0x3030303030303030


def _float_lines(a: np.ndarray) -> np.ndarray:
    """``str(ToShortestFloat(v)) + "\\n"`` (nan: ``nan``) for each v of ``a``: rows of uint64
    words holding the text's bytes in order, with NULs among them; see ``_join``."""
    n = a.size
    zero = a == 0
    with np.errstate(all="ignore"):
        x32 = a.astype(np.float32)
        slow = ~zero & ~(np.isfinite(a) & (x32.astype(np.float64) == a))
        ax = np.where(slow | zero, 1.0, np.abs(a))
        e10 = np.clip(np.floor(np.log10(ax)).astype(np.intp), -14, 14)
        # |x| * 10**(8 - e10), in [1e8, 1e9) unless log10 was one off (right next to a power of
        # ten, if ever): the range check below sends such values the slow way
        y9 = _scaled(ax, 8 - e10)
        # rows p = 6..9: y = |x| * 10**(p - 1 - e10), < 2.3e-7 off exact (two roundings); its
        # rint is the p digits of '%.{p}g' if y is not near a .5 tie and y9 is in range (a y9 just
        # under 1e8 is < 0.05 under 10**(p-1) and rounds as '%.{p}g' rounds 10 * y: the same)
        slow |= ~zero & ((y9 < 1e8 - 0.04) | (y9 > 1e9 - 0.01))
        y = y9 / _P10[9 - _PREC]
        nr = np.rint(y)
        sure = np.abs(y - nr) < 0.5 - 1e-6
        s = 8 - e10 - (9 - _PREC)  # value = nr * 10**-s, s in -9..22
        hit = sure & (_scaled(nr, -s).astype(np.float32) == np.abs(x32))  # as '-%.{p}g' % -x
    # the least p that rounds back wins, unless a smaller p was not sure
    decided = hit | ~sure
    first = np.where(decided[0], 0, np.where(decided[1], 1, np.where(decided[2], 2, 3)))
    cols = np.arange(n)
    slow |= ~zero & ~hit[first, cols]
    fast = ~(slow | zero)
    digits = np.where(fast, nr[first, cols], 0).astype(np.uint64)
    exp10 = np.where(fast, -s[first, cols], 0)  # value = digits * 10**exp10
    while True:  # strip trailing zeros
        z = (digits % 10 == 0) & (digits != 0)
        if not z.any():
            break
        digits = np.where(z, digits // 10, digits)
        exp10 += z
    k = np.maximum(np.searchsorted(_POW, digits, side="right"), 1)  # digit count
    combo = (np.signbit(a) * 9 + k - 1) * _NE + np.clip(k - 1 + exp10, _EMIN, _EMAX) - _EMIN
    left, dot, right, rlen = _layout()
    # the 9 digits right-aligned, NUL for leading zeros: the first in a byte of its own, the
    # other 8 in a word; then the dot put in, the digit it pushes out goes to the next word
    top = digits // 100000000
    word = _digits8(digits - top * 100000000) & _KEEP[9 - k]
    lead = np.where(top > 0, (top + 48) << 56, 0).astype(np.uint64)
    b = dot[combo]
    if (b < 8).any():
        shift = (8 * np.minimum(b, 7)).astype(np.uint64)
        dotted = (word & _LOW[b]) | (np.uint64(46) << shift) | (((word >> shift) << 8) << shift)
        pushed = np.where(b < 8, word >> 56, 0).astype(np.uint64)
        word = np.where(b < 8, dotted, word)
    else:
        pushed = 0
    idx = np.flatnonzero(slow)  # these as text_format formats them, each distinct value once
    distinct, inverse = np.unique(a.view(np.uint64)[idx], return_inverse=True)  # -0.0, nans
    texts = [(_float_str(v) + "\n").encode("utf-8") for v in distinct.view(np.float64).tolist()]
    w = max([-(-int(rlen[combo].max()) // 8)] + [-(-len(t) // 8) - 2 for t in texts])
    lines = np.zeros((n, 2 + w), np.uint64)
    lines[:, 0] = left[combo] | lead
    lines[:, 1] = word
    lines[:, 2:5] = right[:, :min(w, 3)][combo]
    lines[:, 2] |= pushed
    if texts:
        rows = np.frombuffer(b"".join(t.ljust(16 + 8 * w, b"\0") for t in texts), np.uint64)
        lines[idx] = rows.reshape(len(texts), 2 + w)[inverse]
    return lines
