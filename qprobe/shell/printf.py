"""bpftrace's ``printf`` for event hits: ``"%-16s %6d\\n", $comm, count``.

The text is bpftrace's argument list of printf: a C string literal (``\\n``, ``\\t``,
``\\"``, ``\\\\`` escapes), then the values, comma-separated: an event's argument
names and ``$comm``, ``$pid``, ``$cpu``, ``$event``, ``$func`` (the probed
function, as bpftrace's ``func``), ``$ts`` (seconds) and ``$addr``.  The
conversions are C's (``%d %i %u %x %X %o %s %c %p %%`` with flags, width and
precision; length modifiers such as ``l``/``ll``/``h``/``z`` are accepted and
ignored, as Python's integers have no width).  Errors are one line, at parse time.
"""

from __future__ import annotations

import re
from collections.abc import Container
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qprobe.errors import QprobeError

from .render import parse_number, strip_quotes

if TYPE_CHECKING:
    from qprobe.events import EventHit

__all__ = ["HitFormat", "PrintfError", "parse_printf"]

_CONVERSION = re.compile(r"%(?P<spec>[-+ #0]*\d*(?:\.\d+)?)(?:hh|h|ll|l|z|j|t)?(?P<conv>[diouxXcsp%])")
_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\", '"': '"', "r": "\r", "0": "\0", "e": "\x1b"}
SPECIALS = ("$comm", "$pid", "$cpu", "$event", "$func", "$ts", "$addr")
NUMERIC_SPECIALS = ("$pid", "$cpu", "$addr")


class PrintfError(QprobeError):
    """A bad format or value list; the message is one line."""


@dataclass(frozen=True)
class HitFormat:
    """A parsed printf: the format's pieces and the value each conversion takes."""

    text: str
    pieces: tuple[tuple[str, str, str], ...]  # (literal before, spec, conversion); conversion "" for the tail
    values: tuple[str, ...]

    def names(self) -> tuple[str, ...]:
        """The event arguments the values name (the ``$`` ones are every hit's)."""
        return tuple(v for v in self.values if not v.startswith("$"))

    def check_types(self, numeric: Container[str]) -> None:
        """Refuse a number's conversion (``%d %u %x %c %p``...) of a string: ``numeric`` are the event's
        integer arguments; ``$pid $cpu $addr`` are numbers, ``$comm $event $func $ts`` text.  ``%s`` takes both."""
        convs = (c for _l, _s, c in self.pieces if c and c != "%")
        for conv, value in zip(convs, self.values, strict=True):
            if conv != "s" and value not in NUMERIC_SPECIALS and value not in numeric:
                what = "text" if value.startswith("$") else "not an integer argument"
                raise PrintfError(f"printf: %{conv} takes a number, and {value} is {what} (use %s)")

    def __call__(self, hit: EventHit) -> str:
        out = []
        values = iter(self.values)
        for literal, spec, conv in self.pieces:
            out.append(literal)
            if conv == "%":
                out.append("%")
            elif conv:
                out.append(_convert(spec, conv, _value(hit, next(values))))
        return "".join(out)


def parse_printf(text: str) -> HitFormat:
    """``"FORMAT", VALUE, ...`` -> HitFormat; a PrintfError names what is wrong."""
    fmt, rest = _string_literal(text.strip())
    values = tuple(v.strip() for v in rest.split(",")[1:]) if rest.strip() else ()
    if rest.strip() and not rest.strip().startswith(","):
        raise PrintfError(f"printf: expected ', VALUE' after the format, not {rest.strip()!r}")
    pieces: list[tuple[str, str, str]] = []
    pos = 0
    for m in _CONVERSION.finditer(fmt):
        pieces.append((fmt[pos : m.start()], m["spec"], m["conv"]))
        pos = m.end()
    if "%" in fmt[pos:]:
        raise PrintfError(f"printf: bad conversion at {fmt[pos:][:10]!r} (%d %u %x %s %c %p %%...)")
    pieces.append((fmt[pos:], "", ""))
    wanted = sum(1 for _l, _s, c in pieces if c and c != "%")
    if wanted != len(values):
        raise PrintfError(f"printf: the format has {wanted} conversions and {len(values)} values follow it")
    for v in values:
        if not v or (v.startswith("$") and v not in SPECIALS) or not re.fullmatch(r"\$?[A-Za-z_]\w*", v):
            raise PrintfError(f"printf: bad value {v!r}: an argument name or {', '.join(SPECIALS)}")
    return HitFormat(text, tuple(pieces), values)


def _string_literal(text: str) -> tuple[str, str]:
    """The C string literal at the start of ``text`` (unescaped) and what follows it."""
    if not text.startswith('"'):
        raise PrintfError('printf: the format is a string in double quotes: "%s %d\\n", $comm, count')
    out: list[str] = []
    i = 1
    while i < len(text):
        c = text[i]
        if c == '"':
            return "".join(out), text[i + 1 :]
        if c == "\\" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt not in _ESCAPES:
                raise PrintfError(f"printf: unknown escape \\{nxt}")
            out.append(_ESCAPES[nxt])
            i += 2
            continue
        out.append(c)
        i += 1
    raise PrintfError("printf: the format string has no closing quote")


def _value(hit: EventHit, name: str) -> str | int:
    match name:
        case "$comm":
            return hit.comm
        case "$pid":
            return hit.pid
        case "$cpu":
            return hit.cpu
        case "$event":
            return hit.event
        case "$func":
            return hit.function
        case "$ts":
            return f"{hit.ts:.6f}"
        case "$addr":
            return hit.addr
    return strip_quotes(hit.args.get(name, "(none)"))


def _convert(spec: str, conv: str, value: str | int) -> str:
    if conv == "s":
        return f"%{spec}s" % (value,)
    number = value if isinstance(value, int) else parse_number(value)
    if number is None:  # a string or a fault where a number was asked for: shown as it is
        return f"%{spec.split('.')[0].lstrip('0+ #')}s" % (value,)
    if conv in "di":
        return f"%{spec}d" % (number,)
    if conv == "u":
        return f"%{spec}d" % (number & (1 << 64) - 1 if number < 0 else number,)
    if conv == "c":
        return f"%{spec}c" % (number & 0xFF,)
    if conv == "p":
        return f"%{spec}s" % (f"{number & (1 << 64) - 1:#x}",)
    return f"%{spec}{conv}" % (number & (1 << 64) - 1 if number < 0 else number,)
