"""A definition's arguments from ring records, as text or as values: compiled once for a run of records.

A definition recorded in the guest reads registers only.  The argument that
does no more than print an integer register (``%di:s32``, ``$arg2``, ``%dx``)
or ``$comm`` reads the record directly and formats it as ftrace does (its
text) or masks it as its type says (its value, for a ring handler's column);
any other goes through the generic evaluation in the record's context, the
same either way (qprobe.fetch.args.FetchArg.evaluate and format_value).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from qprobe.fetch.expr import Arg, Comm, Reg, RetVal

if TYPE_CHECKING:
    from qprobe.arch import RegisterLayout
    from qprobe.core.kprobe import GuestRecord
    from qprobe.fetch import FetchArg, FetchContext
    from qprobe.fetch.args import Value

ArgText = Callable[["GuestRecord"], str]
ArgColumn = Callable[[list["GuestRecord"]], list["Value"]]
ArgTexts = Callable[[list["GuestRecord"]], list[str]]


def _plain_register(arg: FetchArg, layout: RegisterLayout) -> str | None:
    """The gdbstub name of the register ``arg`` reads as a plain integer (``%di:s32``, ``$arg2``), if it does."""
    expr, t = arg.expr, arg.type
    if t.array or t.symbol or t.char or t.string or t.bitfield is not None:
        return None
    args = layout.arg_regs
    if isinstance(expr, Reg):
        name = expr.name
    elif isinstance(expr, Arg) and 0 < expr.n <= len(args):
        name = args[expr.n - 1]
    elif isinstance(expr, RetVal):  # a uprobe return's record: the user registers at the return
        name = layout.retval
    else:
        return None
    if name in (layout.ip, layout.syscall_nr) or name not in layout.gdb_name:
        return None  # the handler's view of these is not the record's word
    return layout.gdb_name[name]


def arg_column(arg: FetchArg, layout: RegisterLayout, context: Callable[[GuestRecord], FetchContext]) -> ArgColumn:
    """How ``arg``'s values for a run of records are made: a plain register masked (and signed) as its type says,
    ``$comm`` the record's, any other evaluated in each record's context."""

    def evaluated(recs: list[GuestRecord]) -> list[Value]:
        return [arg.evaluate(context(rec)) for rec in recs]

    gdb = _plain_register(arg, layout)
    if gdb is None:
        if arg.type.string and isinstance(arg.expr, Comm):
            return lambda recs: [rec.comm for rec in recs]
        return evaluated
    bits = arg.type.bits
    mask, top, span = (1 << bits) - 1, 1 << (bits - 1), 1 << bits

    def unsigned(recs: list[GuestRecord]) -> list[Value]:
        if recs and gdb not in recs[0].values:  # a register the records lack (a run's records hold the same ones)
            return evaluated(recs)
        return [rec.values[gdb] & mask for rec in recs]

    def signed(recs: list[GuestRecord]) -> list[Value]:
        if recs and gdb not in recs[0].values:
            return evaluated(recs)
        out: list[Value] = []
        for rec in recs:
            value = rec.values[gdb] & mask
            out.append(value - span if value & top else value)
        return out

    return unsigned if not arg.type.signed or arg.type.hex else signed


def arg_text(arg: FetchArg, layout: RegisterLayout, context: Callable[[GuestRecord], FetchContext]) -> ArgText:
    """How ``arg``'s text (what follows ``NAME=``) is made from a record; ``context`` is the record's FetchContext."""

    def evaluated(rec: GuestRecord) -> str:
        return arg.format_value(arg.evaluate(context(rec)))

    t = arg.type
    if t.string and not (t.array or t.symbol or t.char or t.bitfield is not None):
        return (lambda rec: f'"{rec.comm}"') if isinstance(arg.expr, Comm) else evaluated
    gdb = _plain_register(arg, layout)
    if gdb is None:
        return evaluated
    bits = t.bits
    mask, top, span = (1 << bits) - 1, 1 << (bits - 1), 1 << bits

    def hexadecimal(rec: GuestRecord) -> str:
        raw = rec.values.get(gdb)
        return evaluated(rec) if raw is None else f"0x{raw & mask:x}"  # None: a register the record lacks

    def signed(rec: GuestRecord) -> str:
        raw = rec.values.get(gdb)
        if raw is None:
            return evaluated(rec)
        value = raw & mask
        return str(value - span if value & top else value)

    def unsigned(rec: GuestRecord) -> str:
        raw = rec.values.get(gdb)
        return evaluated(rec) if raw is None else str(raw & mask)

    return hexadecimal if t.hex else signed if t.signed else unsigned


def arg_texts(arg: FetchArg, layout: RegisterLayout, context: Callable[[GuestRecord], FetchContext]) -> ArgTexts:
    """``arg_text`` for a run of records at once: a plain register's column formatted in one comprehension."""
    one = arg_text(arg, layout, context)
    gdb = _plain_register(arg, layout)
    if gdb is None:
        return lambda recs: [one(rec) for rec in recs]
    column = arg_column(arg, layout, context)

    def texts(recs: list[GuestRecord]) -> list[str]:
        if recs and gdb not in recs[0].values:  # a register the records lack (a run's records hold the same ones)
            return [one(rec) for rec in recs]
        values = column(recs)
        return [f"0x{v:x}" for v in values] if arg.type.hex else list(map(str, values))

    return texts


__all__ = ["ArgColumn", "ArgText", "ArgTexts", "arg_column", "arg_text", "arg_texts"]
