"""The trap path's side of the seam: where the host hears of a breakpoint, and what a stop there decodes to.

:class:`Traps` is ``Arch.traps``: the kernel's breakpoint entry, the functions
a trap runs through from it, and the decoding of a stop into a :class:`Trap`;
:class:`TrapWatch` is the optional facet that hears of a trap by a watchpoint
instead (``Arch.trap_watch``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol


class TrapHook(enum.Enum):
    """Where the host hears of a guest breakpoint: a breakpoint on the entry, or a watchpoint in its handler."""

    ENTRY = "entry"
    WATCH = "watch"


@dataclass(frozen=True)
class Trap:
    """A stop decoded as a breakpoint trap: the trapped context as it was before the breakpoint ran.

    ``regs`` are the context's registers (gdbstub names); ``restore`` are the
    ones the vCPU no longer holds (the stop came after the kernel's handler
    began) and must get back with the resume.
    """

    addr: int
    sp: int
    flags: int
    regs: Mapping[str, int]
    restore: Mapping[str, int] = field(default_factory=dict)
    user: bool = False


@dataclass(frozen=True)
class TrapWatch:
    """A data read the kernel's breakpoint handler makes for every kernel-mode trap, to watch instead of its entry.

    The watched word is ``variable``'s ``member`` (of type ``type_name``), read
    by ``handler``; ``site(code, address, watched)``, given the handler's first
    bytes ``code`` at ``address``, says where a vCPU is when QEMU reports its
    read of the word at ``watched``, or None if the read is not in the expected shape.
    """

    variable: str
    type_name: str
    member: str
    handler: str
    site: Callable[[bytes, int, int], frozenset[int] | None]


class Traps(Protocol):
    """Where the host hears of a kernel-mode breakpoint, and what a stop there is (``Arch.traps``)."""

    # Where a kernel-mode breakpoint trap enters the kernel (the first name the kernel has), and the
    # functions it runs through before trap_watch's read.
    trap_entries: tuple[str, ...]
    trap_path: tuple[str, ...]

    def decode_trap(self, hook: TrapHook, regs: Mapping[str, int], read: Callable[[int, int], bytes]) -> Trap:
        """The trapped context of a stop on the entry (``TrapHook.ENTRY``) or at trap_watch's read (``WATCH``)."""
        ...


__all__ = ["Trap", "TrapHook", "TrapWatch", "Traps"]
