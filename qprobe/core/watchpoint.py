"""Watchpoint probes: a handler when the guest kernel writes (or reads) a location.

These are QEMU's gdbstub watchpoints (``Z2``/``Z3``/``Z4``), not the x86 debug
registers: there is no limit of four, and the guest cannot see or disturb
them.  Under TCG QEMU reports the hit after the accessing instruction ran,
so ``regs.ip`` is the instruction after the access, as with a hardware
data breakpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qprobe.errors import InvalidProbe
from qprobe.target.gdbremote import WATCH_ACCESS, WATCH_READ, WATCH_WRITE

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
