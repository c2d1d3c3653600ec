"""Watchpoint probes: a handler when the guest kernel writes (or reads) a location.

These are QEMU's gdbstub watchpoints (``Z2``/``Z3``/``Z4``), not the x86 debug
registers: there is no limit of four, and the guest cannot see or disturb
them; but one per address, as the stop reply names only the address.  Under
TCG QEMU reports the hit after the accessing instruction ran, so ``regs.ip``
is the instruction after the access, as with a hardware data breakpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from qprobe.core.handlers import Handlers
from qprobe.core.regs import PtRegs
from qprobe.errors import InvalidProbe, ProbeError
from qprobe.kernel.symbols import Symbols
from qprobe.vmm.gdbremote import WATCH_ACCESS, WATCH_READ, WATCH_WRITE
from qprobe.vmm.machine import Machine

KINDS = {"w": WATCH_WRITE, "r": WATCH_READ, "rw": WATCH_ACCESS}


class Watchpoint:
    """Watch ``length`` bytes at ``addr`` or ``symbol_name+offset``; ``kind`` is "w", "r" or "rw".

    ``handler(wp, regs)`` runs on the host with the vCPU that made the access
    stopped; during it ``wp.old_value`` and ``wp.new_value`` are the watched
    bytes before and after the access.  ``wp.nhit`` counts hits.
    """

    def __init__(self, symbol_name: str | None = None, offset: int = 0, addr: int | None = None, length: int = 8,
                 kind: str = "w", handler: Callable[[Watchpoint, Any], Any] | None = None) -> None:  # fmt: skip
        if (symbol_name is None) == (addr is None):
            raise InvalidProbe("a watchpoint needs exactly one of symbol_name and addr (EINVAL)")
        if kind not in KINDS:
            raise InvalidProbe(f"watchpoint kind {kind!r} is not one of w, r, rw (EINVAL)")
        if length not in (1, 2, 4, 8) and not 0 < length <= 4096:
            raise InvalidProbe(f"watchpoint length {length} is out of range (EINVAL)")
        self.symbol_name, self.offset, self.addr = symbol_name, offset, addr
        self.length, self.kind, self.handler = length, kind, handler
        self.nhit = 0
        self.nfaults = 0
        self.errors: list[str] = []
        self.resolved = 0
        self.registered = False
        self.old_value = b""
        self.new_value = b""

    def __repr__(self) -> str:
        where = f"{self.symbol_name}+{self.offset:#x}" if self.symbol_name else f"{self.addr:#x}"
        return f"<Watchpoint {self.kind} {where} len={self.length} nhit={self.nhit}>"


class Watchpoints:
    """Arms watchpoints through the stub and runs their handlers at each hit (stop-loop thread)."""

    def __init__(self, machine: Machine, symbols: Symbols, handlers: Handlers,
                 make_regs: Callable[[Mapping[str, int], str], PtRegs]) -> None:  # fmt: skip
        self.machine = machine
        self.symbols = symbols
        self.handlers = handlers
        self.make_regs = make_regs

    def register_watchpoint(self, wp: Watchpoint) -> None:
        if wp.registered:
            raise ProbeError(f"{wp!r} is already registered")
        mem = self.machine.mem
        addr = (self.symbols.address(wp.symbol_name) if wp.symbol_name else wp.addr or 0) + wp.offset
        mem.read(addr, wp.length)  # refuse an unmapped address before touching the stub
        wp.new_value = mem.read(addr, wp.length)

        def hit(tid: str, regs: dict[str, int]) -> None:
            wp.nhit += 1
            # QEMU reports the hit after the access: the value before it is our last copy.
            wp.old_value, wp.new_value = wp.new_value, mem.read(addr, wp.length)
            if wp.handler is None:
                return
            pt = self.make_regs(regs, tid)
            self.handlers.call(wp, f"handler of {wp!r}", wp.handler, wp, pt)
            if pt.dirty():
                self.machine.gdb.write_registers(tid, pt.dirty())

        def arm() -> None:
            # QEMU's stop reply names the watched address only, so one handler per address: a second
            # watchpoint there (or on the int3 hook's own) would silently take the first one's hits.
            if addr in self.machine.watch_handlers:
                raise ProbeError(f"{addr:#x} is already watched (EBUSY): one watchpoint per address")
            self.machine.gdb.insert_breakpoint(addr, KINDS[wp.kind], wp.length)
            self.machine.watch_handlers[addr] = hit

        self.machine.call(arm)
        wp.resolved, wp.registered = addr, True

    def unregister_watchpoint(self, wp: Watchpoint) -> None:
        if not wp.registered:
            raise InvalidProbe(f"{wp!r} is not registered")

        def disarm() -> None:
            self.machine.gdb.remove_breakpoint(wp.resolved, KINDS[wp.kind], wp.length)
            self.machine.watch_handlers.pop(wp.resolved, None)

        self.machine.call(disarm)
        wp.registered = False


__all__ = ["KINDS", "Watchpoint", "Watchpoints"]
