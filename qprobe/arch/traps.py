"""The trap path's side of the seam: where the host hears of a breakpoint, and what a stop there is.

:class:`Traps` is ``Arch.traps``: the kernel's breakpoint entry, the functions
a trap runs through from it, which kprobes handler (:class:`BreakHook`) a stop
on the entry is for, and the decoding of a stop into a :class:`Trap`;
:class:`TrapWatch` is the optional facet that hears of a trap by a watchpoint
instead (``Arch.trap_watch``).

x86 gives each exception its own entry (``asm_exc_int3`` for int3 alone), so
a stop on its breakpoint entry is always a breakpoint trap.  arm64 takes
every synchronous exception from EL1 through one vector (``el1h_64_sync``,
at VBAR_EL1 + 0x200): a BRK, a data abort and an undefined instruction all
stop there, and ESR_EL1 says which, with a BRK's immediate, by which the
kernel's ``call_break_hook`` picks the handler registered for it
(``register_kernel_break_hook``).  ``kprobe_break_hook`` is that choice as
far as kprobes are concerned: the core asks for it before it takes a stop on
the entry as a trap.
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


class BreakHook(enum.Enum):
    """Which kprobes handler the kernel runs for an exception taken on the trap entry.

    arm64 registers two break hooks by BRK immediate; x86 has one handler for
    every int3, which tells a probe's from the one after a trap-stepped copy by
    its address, so it answers ``KPROBE`` for both.
    """

    KPROBE = "kprobe"  # kprobe_breakpoint_handler (KPROBES_BRK_IMM), x86's kprobe_int3_handler
    KPROBE_SS = "kprobe-ss"  # kprobe_breakpoint_ss_handler (KPROBES_BRK_SS_IMM): the trap after a trap-stepped copy


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
    The read must be on the breakpoint path alone (x86's poke_int3_handler, called by exc_int3 only;
    arm64's, inside kprobes' break hooks): the core does not ask ``kprobe_break_hook`` at a watch stop.
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

    def kprobe_break_hook(self, regs: Mapping[str, int]) -> BreakHook | None:
        """Which kprobes handler the kernel runs for the exception a vCPU stopped on the trap entry (``regs``)
        is in; None: no breakpoint of kprobes' (another exception on a shared vector, or a BRK of BUG's),
        which the kernel's own handler takes."""
        ...

    def decode_trap(self, hook: TrapHook, regs: Mapping[str, int], read: Callable[[int, int], bytes]) -> Trap:
        """The trapped context of a stop on the entry (``TrapHook.ENTRY``) or at trap_watch's read (``WATCH``)."""
        ...


__all__ = ["BreakHook", "Trap", "TrapHook", "TrapWatch", "Traps"]
