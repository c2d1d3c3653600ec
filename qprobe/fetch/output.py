"""Text the kernel prints about kprobe and uprobe events: listings, trace lines, formats.

``format_event`` is ``trace_kprobe_show`` (one line of ``cat kprobe_events``),
``format_hit`` is ``print_kprobe_event``/``print_kretprobe_event`` after the
``name: `` prefix, ``print_fmt`` is ``__set_print_fmt`` (the ``print fmt:``
line of the event's ``format`` file), and ``sprint_symbol``/``print_ip_sym``
are the kernel's ``%pS`` and ``seq_print_ip_sym``, given a symbol lookup.
``format_uprobe_event``, ``format_uprobe_hit`` and ``format_uprobe_profile``
are trace_uprobe.c's ``trace_uprobe_show``, ``print_uprobe_event`` and
``probes_profile_seq_show``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .args import Value
from .event import ProbeEvent
from .uevent import UprobeEvent


@dataclass(frozen=True)
class SymbolInfo:
    """What kallsyms knows about an address: the symbol containing it."""

    name: str
    offset: int  # from the symbol's start
    size: int
    module: str | None = None


SymbolLookup = Callable[[int], SymbolInfo | None]
KRETPROBE_UNKNOWN = "[unknown/kretprobe'd]"


def sprint_symbol(addr: int, lookup: SymbolLookup) -> str:
    """``%pS``: ``name+0xoff/0xsize [module]``, or ``0x...`` when unknown."""
    info = lookup(addr)
    if info is None:
        return f"0x{addr:x}"
    text = f"{info.name}+0x{info.offset:x}/0x{info.size:x}"
    return f"{text} [{info.module}]" if info.module else text


def print_ip_sym(addr: int, lookup: SymbolLookup, offset: bool = True, trampoline: int | None = None) -> str:
    """``seq_print_ip_sym``: ``0`` for 0; the name with or without ``+off/size``.

    ``trampoline`` is the address of ``__kretprobe_trampoline``: a return
    address equal to it prints as the kernel's ``[unknown/kretprobe'd]``.
    """
    if addr == 0:
        return "0"
    if trampoline is not None and addr == trampoline:
        return KRETPROBE_UNKNOWN
    if offset:
        return sprint_symbol(addr, lookup)
    info = lookup(addr)
    return info.name if info is not None and info.name else f"0x{addr:08x}"


def format_event(ev: ProbeEvent, maxactive: int = 0) -> str:
    """``trace_kprobe_show``: e.g. ``r10:kprobes/myret vfs_read arg1=$retval``.

    Offsets are decimal (``vfs_read+16``), offset 0 is omitted, addresses
    are printed in full (the kernel hashes them unless no_hash_pointers).
    ``maxactive`` is a registered return probe's instance count: once the
    kernel has registered it, the default (0 in the definition) is shown resolved.
    """
    active = maxactive or ev.maxactive
    head = ev.kind + (str(active) if ev.is_return and active else "")
    parts = [f"{head}:{ev.group}/{ev.event}", ev.probe_point]
    parts += [a.definition for a in ev.args]
    return " ".join(parts)


def format_hit(
    ev: ProbeEvent,
    values: Sequence[Value],
    ip: int | str,
    func: int | str | None = None,
    *,
    lookup: SymbolLookup | None = None,
    trampoline: int | None = None,
) -> str:
    """A trace line after ``EVENT: ``, e.g. ``(vfs_read+0x0/0x1a0) count=0x11``.

    For a kprobe ``ip`` is the probed address; for a kretprobe ``ip`` is the
    return address and ``func`` the probed function, printed as
    ``(caller+0x1b/0x1d <- vfs_read)``.  Addresses given as ints are printed
    with ``lookup``; strings are used as they are.
    """

    def place(where: int | str, with_offset: bool) -> str:
        if isinstance(where, str):
            return where
        if lookup is None:
            raise ValueError("format_hit needs lookup= to print an address")
        return print_ip_sym(where, lookup, with_offset, trampoline)

    where = place(ip, True)
    if ev.is_return:
        where += " <- " + place(func if func is not None else 0, False)
    return f"({where})" + "".join(f" {a.format(v)}" for a, v in zip(ev.args, values, strict=True))


_PRINT_FORMATS = {
    "u8": "%u",
    "u16": "%u",
    "u32": "%u",
    "u64": "%Lu",
    "s8": "%d",
    "s16": "%d",
    "s32": "%d",
    "s64": "%Ld",
    "x8": "0x%x",
    "x16": "0x%x",
    "x32": "0x%x",
    "x64": "0x%Lx",
    "symbol": "%pS",
    "string": '\\"%s\\"',
    "ustring": '\\"%s\\"',
    "symstr": '\\"%s\\"',
    "char": "'%c'",
}


def print_fmt(ev: ProbeEvent | UprobeEvent) -> str:
    """``__set_print_fmt``: the ``print fmt:`` value of the event's format file (a kprobe's or a uprobe's)."""
    if ev.is_return:
        fmt, rec = "(%lx <- %lx)", ", REC->__probe_func, REC->__probe_ret_ip"
    else:
        fmt, rec = "(%lx)", ", REC->__probe_ip"
    out = [f'"{fmt}']
    for a in ev.args:
        one = _PRINT_FORMATS[a.type.name]
        count = a.type.array
        out.append(f" {a.name}=" + ("{" + ",".join([one] * count) + "}" if count else one))
    out.append(f'"{rec}')
    for a in ev.args:
        names = [f"{a.name}[{j}]" for j in range(a.type.array)] if a.type.array else [a.name]
        out += [f", __get_str({n})" if a.type.string else f", REC->{n}" for n in names]
    return "".join(out)


def format_uprobe_event(ev: UprobeEvent) -> str:
    """``trace_uprobe_show``: e.g. ``p:uprobes/p_bash_0x4245c0 /bin/bash:0x00000000004245c0 arg1=%ax``.

    The offset is printed as ``0x%0*lx`` with 16 digits, the reference counter
    offset after it as ``(0x%lx)`` when it is not 0.
    """
    return " ".join([f"{ev.kind}:{ev.group}/{ev.event}", ev.probe_point, *(a.definition for a in ev.args)])


def format_uprobe_hit(ev: UprobeEvent, values: Sequence[Value], ip: int, func: int | None = None) -> str:
    """``print_uprobe_event`` after the ``name: `` prefix: ``(0x401136) x=1`` or ``(0x4011a0 <- 0x401136)``.

    For an entry probe ``ip`` is the probed address; for a return probe ``ip``
    is the address returned to and ``func`` the probed function's address.
    """
    where = f"0x{ip:x}" if not ev.is_return else f"0x{ip:x} <- 0x{func or 0:x}"
    return f"({where})" + "".join(f" {a.format(v)}" for a, v in zip(ev.args, values, strict=True))


def format_uprobe_profile(ev: UprobeEvent, nhit: int) -> str:
    """One line of ``uprobe_profile`` (``probes_profile_seq_show``): ``  PATH EVENT NHIT``."""
    return f"  {ev.path} {ev.event:<44} {nhit:>15}"


# Control characters a terminal would act on (C0 but tab and newline, DEL, C1), as \xNN: a process name
# or a string the guest fetched must not retitle, clear or move the user's terminal (ps does the same).
_TERMINAL_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0)) if c not in (0x09, 0x0A)}


def terminal_safe(text: str) -> str:
    """``text`` with the control characters a terminal would act on shown as ``\\xNN``."""
    return text.translate(_TERMINAL_ESCAPES)
