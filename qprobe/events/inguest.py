"""Which events an optimized probe can record, filter or count in the guest, and the detour's terms for it.

An event is recorded in the guest when every fetch argument comes from the
registers; its filter runs there when every predicate compares a register
integer with a constant; a map is folded there when its key and value are
such integers or the hit's task and CPU.  The terms (qprobe.arch.inguest) are
the architecture's to compile.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from qprobe.arch.inguest import GuestFilter, KeyPart, KeySpec
from qprobe.fetch.expr import Arg, Comm, Imm, ImmString, Node, Reg, RetVal, StackPointer, SymbolAddr
from qprobe.fetch.filter import EventFilter, GuestReg, Pred, bind

if TYPE_CHECKING:
    from qprobe.arch import RegisterLayout
    from qprobe.fetch import ProbeEvent, UprobeEvent
    from qprobe.fetch.args import FetchArg


def _register_only(node: Node, layout: RegisterLayout) -> bool:
    """Whether a fetch argument's value is in the registers at the hit (no memory read)."""
    match node:
        case Reg() | StackPointer() | Imm() | ImmString() | Comm() | RetVal():
            return True
        case Arg(n):
            return n <= len(layout.arg_regs)  # the later ones are on the stack
        case SymbolAddr(_, _, offset):
            return offset is not None
    return False


def in_guest(ev: ProbeEvent | UprobeEvent, layout: RegisterLayout, returns: bool = False) -> bool:
    """Can an optimized probe record this event in the guest (a register snapshot), waking nobody?

    Only when every fetch argument comes from the registers (or is $comm, which the
    record carries): a memory dereference must be read at the hit, which needs the host.
    A return event only with ``returns`` (a uprobe's ret_handler records the registers at
    the return, ``$retval`` among them; a kprobe's return has no record).
    """

    def ok(a: FetchArg) -> bool:
        if a.type.string:  # a string is read from memory, except these two
            return isinstance(a.expr, Comm | ImmString)
        return _register_only(a.expr, layout) and not a.type.array

    return (returns or not ev.is_return) and all(ok(a) for a in ev.args)


def _arg_register(a: FetchArg, layout: RegisterLayout) -> str | None:
    """The general-purpose register (a pt_regs name) an argument is taken from as it is, if it is one."""
    match a.expr:
        case Reg(name) if name in layout.general:
            return name
        case Arg(n) if n <= len(layout.arg_regs):
            return layout.arg_regs[n - 1]
    return None


GUEST_KEYS = {"$comm": KeyPart("comm"), "$pid": KeyPart("pid"), "$cpu": KeyPart("cpu")}
EVENT_KEYS = ("$func", "$event")  # the same for every hit of one probe: the host adds them


def guest_key(ev: ProbeEvent, keys: Sequence[str], value: str | None, hist: bool,
              layout: RegisterLayout) -> KeySpec | None:  # fmt: skip
    """A map by ``keys`` of ``value`` as a key the detour can compute, or None if only the host can.

    A key part is ``$comm``, ``$pid``, ``$cpu``, ``$func`` or ``$event`` (the last two the same for
    every hit: the host adds them) or an integer argument taken from a register as it is; the value
    such an argument of a numeric type (u/s/x), since the host folds the number its text shows.
    """
    if not in_guest(ev, layout) or (hist and value is None):
        return None
    args = {a.name: a for a in ev.args}

    def register(name: str, numeric: bool) -> KeyPart | None:
        a = args.get(name)
        if a is None:
            return None
        t, reg = a.type, _arg_register(a, layout)
        if reg is None or t.string or t.array or t.bitfield or t.size not in (1, 2, 4, 8):
            return None
        if numeric and not (t.name[:1] in ("u", "s", "x") and t.name[1:].isdigit()):
            return None
        return KeyPart("reg", reg, t.size * 8, t.signed)

    parts: list[KeyPart] = []
    for name in keys:
        if name in ("$func", "$event"):
            continue
        part = GUEST_KEYS.get(name) or register(name, False)
        if part is None:
            return None
        parts.append(part)
    folded = register(value, True) if value is not None else None
    if value is not None and folded is None:
        return None
    if hist and folded is not None:
        return KeySpec((*parts, dataclasses.replace(folded, kind="hist")))
    return KeySpec(tuple(parts), folded)


def guest_filter(ev: ProbeEvent, flt: EventFilter, layout: RegisterLayout) -> GuestFilter | None:
    """The filter bound to registers, for an optimized probe's detour to run, or None if it needs the host.

    Every predicate must compare a 64- or 32-bit integer argument taken from a
    register with a constant in that type's range; common fields (pid, comm,
    cpu) and strings are only known on the host.
    """
    args = {a.name: a for a in ev.args}

    def where(p: Pred) -> GuestReg | None:
        a = args.get(p.field)
        if a is None or not isinstance(p.const, int):
            return None
        t, reg = a.type, _arg_register(a, layout)
        if reg is None or t.string or t.array or t.bitfield or t.symbol or t.size not in (4, 8):
            return None
        bits = t.size * 8
        lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if t.signed else (0, (1 << bits) - 1)
        return GuestReg(reg, bits, t.signed) if lo <= p.const <= hi else None

    return bind(flt.tree, where) if in_guest(ev, layout) else None


__all__ = ["EVENT_KEYS", "GUEST_KEYS", "guest_filter", "guest_key", "in_guest"]
