"""What the core and an architecture's in-guest code share in guest RAM: the optional facet of jump
optimization, detours and their mailboxes, record rings and kretprobe instances.

An architecture that leaves every probe a breakpoint never builds these; the core reads them
through :class:`qprobe.arch.Arch`'s layout methods when it does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from qprobe.arch.inguest import GuestFilter, KeySpec


@dataclass(frozen=True)
class PercpuLayout:
    """Per-CPU offsets the in-guest code reads (found by ``qprobe.kernel``)."""

    cpu_number: int
    this_cpu_off: int
    current_task: int


@dataclass(frozen=True)
class Pool:
    """One kretprobe's slice of the guest's instance array."""

    first: int  # index of its first instance
    count: int
    owner: int


class ReturnLayout(Protocol):
    """Where a kretprobe's instances and their trampolines live in the scratch area."""

    # Read-only, so that a frozen dataclass implements them.
    @property
    def instances(self) -> int: ...
    @property
    def count(self) -> int: ...
    @property
    def trampolines(self) -> int: ...
    @property
    def returns(self) -> int: ...  # u64 per pool owner: returns counted in the guest

    def trampoline(self, i: int) -> int: ...
    def instance(self, i: int) -> int: ...


@dataclass(frozen=True)
class DetourParams:
    """What a detour of one kind needs to know (see ``qprobe.core.optimizer.detour_kind``)."""

    kind: str
    probe_id: int
    resume: int  # where the relocated instructions jump back to
    counter: int  # the probe's u64 hit counter
    missed: int  # its nmissed counter
    lost: int  # its lost-record counter
    stub: int = 0  # the mailbox or record stub it calls
    tables: int = 0  # "keyed": CPU 0's table
    cpu_number: int = 0  # "keyed": per-CPU offset of cpu_number
    task: tuple[int, int, int] = (0, 0, 0)  # "keyed": per-CPU offset of current_task, offsetof task_struct pid, comm
    guest_filter: GuestFilter | None = None
    guest_key: KeySpec | None = None
    returns: ReturnLayout | None = None  # "retentry"
    pool: Pool | None = None


@dataclass(frozen=True)
class MailboxRequest:
    """A CPU waiting in the mailbox stub: its probe's registers and where it would go on."""

    probe_id: int
    values: dict[str, int]  # gdbstub names; rsp the probed context's, cr3 and gs_base included
    continue_addr: int  # the detour's continue label (the displaced instructions)
    frame: int  # the stub's frame address
    final_sp: int  # the context's sp


@dataclass(frozen=True)
class RingEntry:
    """One record a detour wrote into its CPU's ring."""

    probe_id: int
    cpu: int
    pid: int
    comm: str
    task: int
    tsc: int
    sp: int
    values: dict[str, int]  # gdbstub names, the ip not set (the host knows the probe's address)
