"""ftrace's event filter language, for ``qprobe trace --filter`` and ``add_event(filter=...)``.

The grammar is the one ``/sys/kernel/tracing/events/.../filter`` accepts
(Documentation/trace/events.rst, "Event filtering")::

    expr := term { '||' term } ;  term := factor { '&&' factor }
    factor := '!' factor | '(' expr ')' | FIELD OP VALUE

Numeric fields compare with ``== != < <= > >=`` and ``&`` (bitwise test);
string fields with ``== !=`` and ``~`` (a glob: ``*``, ``?``, ``[...]``).
The fields are the event's own arguments plus ftrace's common ones:
``common_pid`` (alias ``pid``), ``comm`` and ``cpu``.  The error texts are the
kernel's (kernel/trace/trace_events_filter.c), with a caret under the column.

The parsed tree (:class:`Pred`, :class:`And`, :class:`Or`, :class:`Not`) is
compiled two ways.  The host tests a record with it (:func:`evaluator`); an
optimized probe's detour tests registers with it, once :func:`bind` has given
every leaf the register its field is in (:class:`GuestReg`), and the
architecture compiles that bound tree (x86_64: ``qprobe.arch.x86_64.guestfilter``).
The tree lives here, not in qprobe.arch, because fetch is the lower of the two
layers that read it (tests/unit/test_layering.py): arch may import fetch, never
the reverse.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from qprobe.errors import FetchArgError

COMMON_NUMERIC = ("common_pid", "pid", "cpu")
COMMON_STRING = ("comm",)
_TOKEN = re.compile(
    r"""\s*(?:(?P<op>&&|\|\||==|!=|<=|>=|[<>~&!()])|(?P<str>"[^"]*"?|'[^']*'?)|(?P<word>[^\s&|=!<>~()"']+))"""
)
_NUM_OPS = ("==", "!=", "<", "<=", ">", ">=", "&")
_STR_OPS = ("==", "!=", "~")

# kernel/trace/trace_events_filter.c, ERRORS
INVALID_OP = "Invalid operator"
UNBALANCED_PAREN = "Unbalanced parens"
TOO_MANY_CLOSE = "Too many ')'"
MISSING_FIELD = "Missing field name and/or value"
FIELD_NOT_FOUND = "Field not found"
ILLEGAL_INTVAL = "Illegal integer value"
ILLEGAL_FIELD_OP = "Illegal operation for field type"
MISSING_QUOTE = "Missing matching quote"
EXPECT_DIGIT = "Expecting numeric field"
EXPECT_STRING = "Expecting string field"
NO_FILTER = "Meaningless filter expression"
# Not the kernel's (its parser keeps an explicit stack): ours recurses, and so do the evaluator, bind and
# the in-guest compiler, so nesting is bounded well below Python's recursion limit.
MAX_DEPTH = 100
TOO_DEEP = f"Nested too deeply (more than {MAX_DEPTH} levels of '(' and '!')"

Record = Mapping[str, str | int]  # field name -> formatted argument value, or a common field's value


@dataclass(frozen=True)
class GuestReg:
    """Where an optimized probe's detour finds a numeric field: a register, as a 64- or 32-bit integer."""

    reg: str  # a pt_regs name from qprobe.arch.RegisterLayout.general
    bits: int  # 64 or 32: the low half for 32
    signed: bool


@dataclass(frozen=True)
class Pred:
    """``field op const``: const is an int for a numeric field, the text for a string field.

    ``at`` is None as parsed; :func:`bind` sets it where the guest can read the field, and then
    ``const`` is within the range of ``at``'s type.
    """

    field: str
    op: str
    const: int | str
    at: GuestReg | None = None


@dataclass(frozen=True)
class And:
    parts: tuple[Node, ...]


@dataclass(frozen=True)
class Or:
    parts: tuple[Node, ...]


@dataclass(frozen=True)
class Not:
    inner: Node


Node = Pred | And | Or | Not


@dataclass(frozen=True)
class _Tok:
    kind: str  # "op", "str" or "word"
    text: str
    col: int


def _tokenize(text: str) -> list[_Tok]:
    toks: list[_Tok] = []
    pos = 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:  # a lone '|' or '='
            col = len(text) - len(text[pos:].lstrip())
            raise FetchArgError(INVALID_OP, text, col)
        kind = m.lastgroup or "word"
        value = m.group(kind)
        col = m.start(kind)
        if kind == "str" and (len(value) < 2 or value[-1] != value[0]):
            raise FetchArgError(MISSING_QUOTE, text, col)
        toks.append(_Tok(kind, value, col))
        pos = m.end()
    return toks


def _int(text: str) -> int | None:
    """A filter constant or a formatted argument as an integer (ftrace prints hex as 0x..)."""
    try:
        return int(text, 0)
    except ValueError:
        return None


class EventFilter:
    """A parsed filter; ``filter(record)`` says whether a hit passes."""

    def __init__(self, text: str, numeric: set[str], strings: set[str]) -> None:
        """``numeric``/``strings`` are the event's argument names by kind (the common fields are added)."""
        self.text = text
        self._numeric = numeric | set(COMMON_NUMERIC)
        self._strings = strings | set(COMMON_STRING)
        self._toks = _tokenize(text)
        self._i = 0
        self._depth = 0
        if not self._toks:
            raise FetchArgError(NO_FILTER, text, 0)
        self.tree: Node = self._expr()
        if self._i < len(self._toks):
            tok = self._toks[self._i]
            raise FetchArgError(TOO_MANY_CLOSE if tok.text == ")" else INVALID_OP, text, tok.col)
        self._test = evaluator(self.tree)

    def __call__(self, record: Record) -> bool:
        return self._test(record)

    # -- recursive descent ----------------------------------------------------------
    def _peek(self) -> _Tok | None:
        return self._toks[self._i] if self._i < len(self._toks) else None

    def _next(self, what: str) -> _Tok:
        tok = self._peek()
        if tok is None:
            raise FetchArgError(what, self.text, len(self.text))
        self._i += 1
        return tok

    def _expr(self) -> Node:
        parts = self._chain("||", self._term)
        return parts[0] if len(parts) == 1 else Or(parts)

    def _term(self) -> Node:
        parts = self._chain("&&", self._factor)
        return parts[0] if len(parts) == 1 else And(parts)

    def _chain(self, op: str, operand: Callable[[], Node]) -> tuple[Node, ...]:
        """``operand { op operand }``."""
        parts = [operand()]
        while (tok := self._peek()) is not None and tok.text == op:
            self._i += 1
            parts.append(operand())
        return tuple(parts)

    def _factor(self) -> Node:
        tok = self._next(MISSING_FIELD)
        if tok.text in ("!", "("):
            self._depth += 1
            if self._depth > MAX_DEPTH:
                raise FetchArgError(TOO_DEEP, self.text, tok.col)
            try:
                return self._nested(tok)
            finally:
                self._depth -= 1
        if tok.kind != "word":
            raise FetchArgError(MISSING_FIELD, self.text, tok.col)
        return self._predicate(tok)

    def _nested(self, tok: _Tok) -> Node:
        """What follows a ``!`` or a ``(``."""
        if tok.text == "!":
            return Not(self._factor())
        inner = self._expr()
        close = self._peek()
        if close is None or close.text != ")":
            raise FetchArgError(UNBALANCED_PAREN, self.text, tok.col)
        self._i += 1
        return inner

    def _predicate(self, field: _Tok) -> Pred:
        name = field.text
        if name not in self._numeric and name not in self._strings:
            raise FetchArgError(FIELD_NOT_FOUND, self.text, field.col)
        op = self._next(INVALID_OP)
        if op.kind != "op" or op.text not in (*_NUM_OPS, *_STR_OPS):
            raise FetchArgError(INVALID_OP, self.text, op.col)
        value = self._next(MISSING_FIELD)
        if value.kind == "op":
            raise FetchArgError(MISSING_FIELD, self.text, value.col)
        if name in self._strings:
            if op.text not in _STR_OPS:
                raise FetchArgError(ILLEGAL_FIELD_OP, self.text, op.col)
            return Pred(name, op.text, value.text.strip("\"'"))
        if op.text not in _NUM_OPS:
            raise FetchArgError(ILLEGAL_FIELD_OP, self.text, op.col)
        const = _int(value.text) if value.kind == "word" else None
        if const is None:
            raise FetchArgError(ILLEGAL_INTVAL, self.text, value.col)
        return Pred(name, op.text, const)


def bind(node: Node, where: Callable[[Pred], GuestReg | None]) -> Node | None:
    """The tree with every leaf's ``at`` set to ``where(leaf)``, or None if ``where`` has no register for one.

    ``where`` answers None for a leaf the guest cannot test: a string or common field, a field not in
    a register, or a constant outside the register's type.
    """
    match node:
        case Pred():
            at = where(node)
            return None if at is None else dataclasses.replace(node, at=at)
        case And(parts) | Or(parts):
            bound = [bind(p, where) for p in parts]
            kept = tuple(b for b in bound if b is not None)
            if len(kept) < len(bound):
                return None
            return And(kept) if isinstance(node, And) else Or(kept)
        case Not(inner):
            sub = bind(inner, where)
            return None if sub is None else Not(sub)
    raise TypeError(f"not a filter node: {node!r}")


def evaluator(node: Node) -> Callable[[Record], bool]:
    """The tree as a test of a record, short-circuit left to right (a leaf's ``at`` plays no part)."""
    match node:
        case Pred(name, op, str() as const):
            return _string_test(name, op, const)
        case Pred(name, op, int() as const):
            return _numeric_test(name, op, const)
        case And(parts):
            tests = [evaluator(p) for p in parts]
            return lambda r: all(t(r) for t in tests)
        case Or(parts):
            tests = [evaluator(p) for p in parts]
            return lambda r: any(t(r) for t in tests)
        case Not(inner):
            test = evaluator(inner)
            return lambda r: not test(r)
    raise TypeError(f"not a filter node: {node!r}")


def _field_str(record: Record, name: str) -> str:
    value = record[name]
    text = str(value)
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] == '"' else text


def _string_test(name: str, op: str, const: str) -> Callable[[Record], bool]:
    if op == "~":
        return lambda r: fnmatch.fnmatchcase(_field_str(r, name), const)
    if op == "==":
        return lambda r: _field_str(r, name) == const
    return lambda r: _field_str(r, name) != const


_COMPARE: dict[str, Callable[[int, int], bool]] = {
    "==": lambda a, b: a == b, "!=": lambda a, b: a != b, "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b, ">": lambda a, b: a > b, ">=": lambda a, b: a >= b,
    "&": lambda a, b: bool(a & b),
}  # fmt: skip


def _numeric_test(name: str, op: str, const: int) -> Callable[[Record], bool]:
    compare = _COMPARE[op]

    def test(r: Record) -> bool:
        value = r[name]
        number = value if isinstance(value, int) else _int(value)
        # A value that is not a number (a fault's "(fault)") matches nothing, as in ftrace.
        return number is not None and compare(number, const)

    return test


__all__ = ["And", "EventFilter", "GuestReg", "Node", "Not", "Or", "Pred", "bind", "evaluator"]
