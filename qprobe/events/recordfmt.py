"""A definition's arguments as a ring record's text: compiled once for a run of records, not per record.

A definition recorded in the guest reads registers only.  The argument that
does no more than print an integer register (``%di:s32``, ``$arg2``, ``%dx``)
or ``$comm`` reads the record directly and formats it as ftrace does; any
other goes through the generic evaluation in the record's context, the same
text either way (qprobe.fetch.args.FetchArg.evaluate and format_value).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from qprobe.fetch.expr import Arg, Comm, Reg

if TYPE_CHECKING:
    from qprobe.arch import RegisterLayout
    from qprobe.core.kprobe import GuestRecord
    from qprobe.fetch import FetchArg, FetchContext

ArgText = Callable[["GuestRecord"], str]


def arg_text(arg: FetchArg, layout: RegisterLayout, context: Callable[[GuestRecord], FetchContext]) -> ArgText:
    """How ``arg``'s text (what follows ``NAME=``) is made from a record; ``context`` is the record's FetchContext."""

    def evaluated(rec: GuestRecord) -> str:
        return arg.format_value(arg.evaluate(context(rec)))

    expr, t = arg.expr, arg.type
    if t.array or t.symbol or t.char or t.bitfield is not None:
        return evaluated
    if t.string:
        return (lambda rec: f'"{rec.comm}"') if isinstance(expr, Comm) else evaluated
    args = layout.arg_regs
    if isinstance(expr, Reg):
        name = expr.name
    elif isinstance(expr, Arg) and 0 < expr.n <= len(args):
        name = args[expr.n - 1]
    else:
        return evaluated
    if name in (layout.ip, layout.syscall_nr) or name not in layout.gdb_name:
        return evaluated  # the handler's view of these is not the record's word
    gdb, bits = layout.gdb_name[name], t.bits
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


__all__ = ["ArgText", "arg_text"]
