"""One fetch argument, ``[NAME=]FETCHARG[:TYPE]``: parsing, evaluation, printing.

Parsing follows ``traceprobe_parse_probe_arg`` and
``traceprobe_parse_probe_arg_body`` (Linux 6.1), including the order in which
mistakes are found, since that decides which error the user sees.  Values
are computed as ``process_fetch_insn`` stores them and printed as
``print_probe_args`` prints them, with one deliberate difference: when a
numeric memory read faults, the kernel leaves whatever was in the ring
buffer slot while qprobe prints ``(fault)``, as the kernel does for strings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from . import messages as M
from .btf import fetch_type_name, is_char_array, is_char_ptr
from .context import (
    FAULT,
    U64_MASK,
    Fault,
    FetchContext,
    MemoryFault,
    SymbolValue,
    UprobeContext,
    read_string,
    read_uint,
)
from .dialect import BASE, Dialect
from .expr import (
    FL_USER,
    Arg,
    ArgError,
    Code,
    Comm,
    Deref,
    Imm,
    ImmString,
    Node,
    Reg,
    RetVal,
    Stack,
    SymbolAddr,
    fetch,
    parse_probe_arg,
    symbol_refs,
)
from .ftypes import STRING, Bitfield, FetchType, find_fetch_type, parse_bitfield
from .kstrto import is_good_name, kstrtouint

RESERVED_FIELD_NAMES = frozenset(
    {
        "common_type",
        "common_flags",
        "common_preempt_count",
        "common_pid",
        "common_tgid",
        "__probe_ip",
        "__probe_ret_ip",
        "__probe_func",
    }
)

Scalar = int | str | Fault
Value = Scalar | list[Scalar]


@dataclass(frozen=True)
class FetchArg:
    """A parsed argument; ``body`` is the text after ``NAME=`` (the kernel's comm)."""

    name: str
    body: str
    type: FetchType
    expr: Node

    @property
    def definition(self) -> str:
        """``name=body``, as ``cat kprobe_events`` shows the argument."""
        return f"{self.name}={self.body}"

    # -- evaluation -------------------------------------------------------
    def evaluate(self, ctx: FetchContext) -> Value:
        """The value recorded at a hit: int, str, SymbolValue, FAULT or a list."""
        if self.type.string:
            return self._eval_string(ctx)
        expr = self.expr
        count = self.type.array
        if isinstance(expr, Deref):  # FETCH_OP_ST_MEM / ST_UMEM
            try:
                base = (fetch(expr.inner, ctx) + expr.offset) & U64_MASK
            except (MemoryFault, KeyError):
                return [FAULT] * count if count else FAULT
            size = self.type.size
            if not count:
                return self._load(ctx, base, expr.user)
            return [self._load(ctx, base + i * size, expr.user) for i in range(count)]
        try:  # FETCH_OP_ST_RAW
            raw = fetch(expr, ctx)
        except (MemoryFault, KeyError):
            return FAULT
        return self._finish(raw, ctx)

    def _load(self, ctx: FetchContext, addr: int, user: bool) -> Scalar:
        try:
            raw = read_uint(ctx, addr, self.type.size, user)
        except MemoryFault:
            return FAULT
        return self._finish(raw, ctx)

    def _finish(self, raw: int, ctx: FetchContext) -> Scalar:
        """Truncate to the type, apply a bitfield, sign or symbolize."""
        t = self.type
        value = raw & ((1 << t.bits) - 1)
        if t.bitfield is not None:
            value = t.bitfield.extract(value)
        if t.signed and value >> (t.bits - 1):
            value -= 1 << t.bits
        if t.symbol:
            return SymbolValue(value, ctx.symbolize(value))
        return value

    def _eval_string(self, ctx: FetchContext) -> Value:
        expr = self.expr
        user = self.type.user
        count = self.type.array
        if self.type.symbol:  # symstr: the value's %pS text
            try:
                return ctx.symbolize(fetch(expr, ctx) & U64_MASK)
            except (MemoryFault, KeyError):
                return FAULT
        if isinstance(expr, Comm):
            return ctx.comm()
        if isinstance(expr, ImmString):
            # trace_uprobe.c's fetch_store_string copies every string but $comm with strncpy_from_user,
            # which refuses the kernel address the constant is kept at: a uprobe records it as a fault.
            return FAULT if isinstance(ctx, UprobeContext) else expr.value
        if isinstance(expr, Imm):
            if count:  # the kernel stores nothing usable for an array here
                return [FAULT] * count
            return read_string(ctx, expr.value, user)
        assert isinstance(expr, Deref)
        try:
            base = (fetch(expr.inner, ctx) + expr.offset) & U64_MASK
        except (MemoryFault, KeyError):
            return [FAULT] * count if count else FAULT
        if not count:  # the last deref became the string store
            return read_string(ctx, base, user or expr.user)
        out: list[Scalar] = []
        for i in range(count):  # an array of char pointers
            try:
                ptr = read_uint(ctx, base + 8 * i, 8, expr.user)
            except MemoryFault:
                out.append(FAULT)
                continue
            out.append(read_string(ctx, ptr, user))
        return out

    # -- printing -----------------------------------------------------------
    def format(self, value: Value) -> str:
        """``name=value`` exactly as ftrace prints it in a trace line."""
        return f"{self.name}={self.format_value(value)}"

    def format_value(self, value: Value) -> str:
        """The value part: ``{a,b}`` for arrays, else one element."""
        if isinstance(value, list):
            return "{" + ",".join(self._format_one(v) for v in value) + "}"
        return self._format_one(value)

    def _format_one(self, value: Scalar) -> str:
        t = self.type
        if isinstance(value, Fault):
            return "(fault)"
        if isinstance(value, str):
            return f'"{value}"'
        if isinstance(value, SymbolValue):
            return value.text
        mask = (1 << t.bits) - 1
        if t.char:
            # ftrace prints the byte as it is (%c); a byte of 0x80 and above stays that one byte, as a
            # fetched string's bytes do (surrogateescape), not the code point U+0080...
            return "'" + bytes([value & mask & 0xFF]).decode("utf-8", "surrogateescape") + "'"
        if t.hex or t.symbol:
            return f"0x{value & mask:x}"
        if t.signed:
            value &= mask
            return str(value - (1 << t.bits) if value >> (t.bits - 1) else value)
        return str(value & mask)


def parse_fetch_arg(
    text: str, index: int, flags: int, previous: list[FetchArg], dialect: Dialect = BASE, func: str | None = None
) -> FetchArg:
    """``traceprobe_parse_probe_arg`` for the ``index``-th (0-based) argument.

    ``dialect`` is what the kernel accepts beyond 6.1.0 (``symstr``, BTF
    variables...); ``func`` the probed symbol, whose BTF prototype names the
    parameters.  Raises ArgError with an offset inside ``text``.
    """
    eq = text.find("=")
    if eq >= 0:
        if eq > M.MAX_ARG_NAME_LEN:
            raise ArgError(0, M.ARG_NAME_TOO_LONG)
        if eq == 0:
            raise ArgError(0, M.NO_ARG_NAME)
        name, body, offset = text[:eq], text[eq + 1 :], eq + 1
    else:
        name, body, offset = f"arg{index + 1}", text, 0
        if dialect.btf_args:  # generate_probe_arg_name: the argument itself, if it makes a name (a BTF variable)
            head = text.split(":", 1)[0]
            name = head if is_good_name(head) else name
    if not is_good_name(name):
        raise ArgError(0, M.BAD_ARG_NAME)
    if name in RESERVED_FIELD_NAMES or any(a.name == name for a in previous):
        raise ArgError(0, M.USED_ARG_NAME)
    ftype, expr = _parse_body(body, flags, offset, dialect, func)
    return FetchArg(name, body, ftype, expr)


def _parse_body(body: str, flags: int, offset: int, dialect: Dialect, func: str | None) -> tuple[FetchType, Node]:
    """``traceprobe_parse_probe_arg_body``: expression, type, store checks."""
    if len(body) > M.MAX_ARGSTR_LEN:
        raise ArgError(offset, M.ARG_TOO_LONG)
    if not body:
        raise ArgError(offset, M.NO_ARG_BODY)
    arg, spec, count, tpos = body, None, 0, 0
    colon = body.find(":")
    if colon >= 0:
        arg, spec, tpos = body[:colon], body[colon + 1 :], colon + 1
        bracket = spec.find("[")
        if bracket >= 0:
            num_pos = tpos + bracket + 1
            num = spec[bracket + 1 :]
            spec = spec[:bracket]
            close = num.find("]")
            if close < 0:
                raise ArgError(offset + num_pos + len(num), M.ARRAY_NO_CLOSE)
            if close + 1 < len(num):
                raise ArgError(offset + num_pos + close + 1, M.BAD_ARRAY_SUFFIX)
            parsed = kstrtouint(num[:close], 0)
            if not parsed:
                raise ArgError(offset + num_pos, M.BAD_ARRAY_NUM)
            if parsed > M.MAX_ARRAY_LEN:
                raise ArgError(offset + num_pos, M.ARRAY_TOO_BIG)
            count = parsed
    type_offs = offset + tpos
    base: FetchType | None
    if arg in ("$comm", "$COMM") or arg.startswith('\\"'):
        if count or (spec is not None and spec != "string"):
            if dialect.has(M.NEED_STRING_TYPE):
                raise ArgError(type_offs, M.NEED_STRING_TYPE)
            # 6.1.0 returns -EINVAL here without logging anything.
            raise ArgError(type_offs, M.BAD_TYPE, logged=False)
        base = STRING
    elif flags & FL_USER and spec in ("symbol", "symstr") and dialect.meta_args:
        # "tracing/probes: Reject symbol/symstr type for uprobe" (Linux 6.5, with the parser meta_args
        # stands for): a user address has no %pS.  Debian's 6.1 took symstr's backport without it.
        base = None
    else:
        base = find_fetch_type(spec, dialect.types)
    if base is None:
        raise ArgError(type_offs, M.BAD_TYPE)
    full_spec = body[colon + 1 :] if colon >= 0 else None

    code = Code(dialect, offset, func)
    expr = parse_probe_arg(arg, flags, offset, code)
    if dialect.meta_args:
        # The 6.5+ parser keeps the offset in its context, where a dereference left it: the errors
        # found after the expression are reported from there.
        offset = code.offset
        type_offs = offset + tpos
    if code.last_type is not None:  # a BTF variable: its type, unless one is given
        if spec is None:
            base = find_fetch_type(fetch_type_name(code.last_type), dialect.types)
            assert base is not None
        elif "string" in spec:  # check_prepare_btf_string_fetch
            if is_char_ptr(code.last_type):
                code.advance(offset)
                expr = Deref(expr, 0, user=spec.startswith("u"))
            elif not is_char_array(code.last_type):
                raise ArgError(offset, M.BAD_TYPE4STR)

    # Store stage: strings need memory, an immediate or $comm; others ST_*.
    if base.name == "symstr":
        # FETCH_OP_ST_SYMSTR keeps the fetched value (a register, stack slot, argument or kernel load).
        if not isinstance(expr, Reg | Stack | RetVal | Arg) and not (isinstance(expr, Deref) and not expr.user):
            raise ArgError(type_offs, M.BAD_SYMSTRING)
        _next_insn(code, offset)
        store_is_mem = True
    elif base.string:
        if not isinstance(expr, Deref | Imm | Comm | ImmString):
            raise ArgError(type_offs, M.BAD_STRING)
        if not isinstance(expr, Deref) or count:
            _next_insn(code, offset)
        store_is_mem = True
    elif isinstance(expr, Deref):
        store_is_mem = not expr.user  # ST_MEM; ST_UMEM cannot be an array
    else:
        _next_insn(code, offset)
        store_is_mem = False

    bitfield = None
    if spec is not None and spec.startswith("b"):
        bitfield = parse_bitfield(spec, base.size)
        if bitfield is None or code.idx + 1 == Code.END:
            raise ArgError(type_offs, M.BAD_BITFIELD)
        code.idx += 1
    elif spec is None and code.last_type is not None and code.btf_bitfield is not None:
        # parse_btf_bitfield: a BTF bitfield member, extracted in a 64-bit container over the stored value.
        if code.idx + 1 == Code.END:
            raise ArgError(offset, M.TOO_MANY_OPS)
        code.idx += 1
        bitfield = Bitfield(*code.btf_bitfield, 64)
    if count:
        if not store_is_mem:
            raise ArgError(type_offs, M.BAD_STRING)
        _next_insn(code, offset)
    ftype = base.with_array(count, full_spec)
    if bitfield is not None:
        ftype = replace(ftype, bitfield=bitfield)
    return ftype, expr


def _next_insn(code: Code, offset: int) -> None:
    """``code++; if (code->op != FETCH_OP_NOP)``: only the END slot is not NOP."""
    code.idx += 1
    if code.idx == Code.END:
        raise ArgError(offset, M.TOO_MANY_OPS)


def symbol_refs_of(args: list[FetchArg]) -> list[tuple[int, SymbolAddr]]:
    """(argument index, ``@SYM``) pairs, in registration (update_arg) order."""
    return [(i, ref) for i, a in enumerate(args) for ref in symbol_refs(a.expr)]


def integer_names(args: Sequence[FetchArg]) -> frozenset[str]:
    """The arguments whose values are integers (not strings, symbols, arrays or bitfields' text)."""
    return frozenset(a.name for a in args if not (a.type.string or a.type.symbol or a.type.array))


def string_names(args: Sequence[FetchArg]) -> frozenset[str]:
    """The arguments whose values are strings (``string``, ``ustring``, ``symstr``, ``$comm``)."""
    return frozenset(a.name for a in args if a.type.string and not a.type.array)
