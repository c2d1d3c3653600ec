"""The user-facing uprobe objects, named as in <linux/uprobes.h>'s ``struct uprobe_consumer``.

Plain data at the bottom of the core, as qprobe.core.kprobe is for kprobes: qprobe.core.uprobes registers
them, qprobe.core.ureturns keeps their calls in flight.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qprobe.arch.inguest import KeySpec
from qprobe.core.kprobe import GuestRecord, check_handlers
from qprobe.core.regs import PtRegs
from qprobe.errors import InvalidProbe
from qprobe.kernel.ufile import GuestFile

__all__ = ["Uprobe", "Uretprobe"]

UprobeHandler = Callable[["Uprobe", PtRegs], Any]
RetHandler = Callable[["Uprobe", int, PtRegs], Any]
UprobeFilter = Callable[["Uprobe", PtRegs], bool]


class Uprobe:
    """A probe on one instruction of a file, in every process that maps it: ``struct uprobe_consumer``'s words.

    Give ``offset`` (bytes into the file) or ``symbol`` (``NAME`` or ``NAME+OFFS``, from the file's ELF
    symbols).  ``handler(up, regs)`` runs at the instruction with the process's user registers
    (``regs.read`` reads its memory); ``ret_handler(up, func, regs)`` when the function the probe is at
    returns (``func`` the probed address, ``regs_return_value(regs)`` its value).  ``filter(up, regs)``
    decides per hit whether the handlers run (the kernel asks it per mm); a hit it refuses is counted in
    ``nfiltered`` only.

    A probe with none of the three (a Uretprobe without its handler: counting returns) is counted in the
    guest where the guest's kernel can register it with its own uprobes (qprobe.core.uguest): no VM stop at
    its hits.  ``in_guest=False`` keeps it on the gdbstub's breakpoints, with nothing written into any
    process; ``in_guest=True`` refuses it where it cannot be counted in the guest.  After registration,
    ``in_guest`` says which it is.
    """

    def __init__(self, path: str, offset: int | None = None, symbol: str | None = None,
                 handler: UprobeHandler | None = None, ret_handler: RetHandler | None = None,
                 filter: UprobeFilter | None = None, in_guest: bool | None = None) -> None:  # fmt: skip
        if not isinstance(path, str) or not path.startswith("/"):
            raise InvalidProbe(f"a uprobe's path must be absolute, not {path!r} (EINVAL)")
        if (offset is None) == (symbol is None):
            raise InvalidProbe("give a uprobe an offset or a symbol, one of them (EINVAL)")
        if offset is not None and (not isinstance(offset, int) or offset < 0):
            raise InvalidProbe(f"a uprobe's offset must be a non-negative int, not {offset!r} (EINVAL)")
        check_handlers(handler=handler, ret_handler=ret_handler, filter=filter)
        self.path = path
        self.offset = offset
        self.symbol = symbol
        self.handler = handler
        self.ret_handler = ret_handler
        self.filter = filter
        self.in_guest = in_guest
        if in_guest and not self.runs_nothing:
            raise InvalidProbe("a uprobe counted in the guest runs nothing on the host: no handler, ret_handler "
                               "or filter (EINVAL)")  # fmt: skip
        self._nhit = self._nreturns = 0
        # While counted in the guest: the guest's counts (hits, returns), read from its RAM.
        self.guest_counts: Callable[[], tuple[int, int]] | None = None
        # Counted in the guest by this key (qprobe.events' maps), not only in nhit.
        self.guest_key: KeySpec | None = None
        # Recorded in the guest (qprobe.events' trace lines): each hit's user registers, task and time go into
        # the record rings, and runs of them to ``recorder`` off the ring, as an optimized kprobe's do.
        self.recorder: Callable[[list[GuestRecord]], None] | None = None
        self.nlost = 0  # recorded hits whose record a full ring dropped
        self.nfiltered = 0
        self.nmissed = 0  # returns not probed: the task already held MAX_URETPROBE_DEPTH instances
        self.nfaults = 0
        self.errors: list[str] = []
        self.registered = False
        self.file: GuestFile | None = None

    @property
    def runs_nothing(self) -> bool:
        """No handler, filter or ret_handler of the user's: the hits (and returns) are only counted."""
        return self.handler is None and self.filter is None and self.ret_handler in (None, _no_return_handler)

    @property
    def nhit(self) -> int:
        """Hits that ran the handlers (the filter let them)."""
        return self._nhit if self.guest_counts is None else self.guest_counts()[0]

    @nhit.setter
    def nhit(self, value: int) -> None:
        self._nhit = value

    @property
    def nreturns(self) -> int:
        """Returns of the probed function that ran ``ret_handler``."""
        return self._nreturns if self.guest_counts is None else self.guest_counts()[1]

    @nreturns.setter
    def nreturns(self, value: int) -> None:
        self._nreturns = value

    def where(self) -> str:
        at = f"{self.offset:#x}" if self.offset is not None else str(self.symbol)
        return f"{self.path}:{at}"

    def __repr__(self) -> str:
        kind = "Uretprobe" if self.handler is None and self.ret_handler is not None else "Uprobe"
        return f"<{kind} {self.where()} nhit={self.nhit} nmissed={self.nmissed}>"


class Uretprobe(Uprobe):
    """A return probe on a function of a file: a Uprobe with only ``ret_handler`` (``uretprobe`` events)."""

    def __init__(self, path: str, offset: int | None = None, symbol: str | None = None,
                 ret_handler: RetHandler | None = None, filter: UprobeFilter | None = None,
                 in_guest: bool | None = None) -> None:  # fmt: skip
        super().__init__(path, offset, symbol, ret_handler=ret_handler or _no_return_handler, filter=filter,
                         in_guest=in_guest)  # fmt: skip


def _no_return_handler(up: Uprobe, func: int, regs: PtRegs) -> None:
    """A Uretprobe without a handler still counts its returns."""
