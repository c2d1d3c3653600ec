"""What the host and an architecture's in-guest code share in guest RAM: the optional facet :class:`GuestRam`.

The facet lays out what the host reads and writes without stopping the VM:
the mailbox stub and its answer, the record rings, the per-CPU keyed tables,
kretprobe instances and their trampolines.  An architecture without it stops
the VM at every hit.  The detours that fill them are jump optimization's
(:class:`qprobe.arch.OptProbes`, given :class:`DetourParams`); without that
facet every probe stays a breakpoint, and kretprobes may still return
through the mailbox.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from qprobe.arch.inguest import GuestFilter, KeySpec, MapKey, MapSlot


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
    values: dict[str, int]  # gdbstub names; rsp the probed context's, cr3 and gs_base included, and
    # ``cycles``, the cycle counter (x86's TSC) when the stub ran
    continue_addr: int  # the detour's continue label (the displaced instructions)
    frame: int  # the stub's frame address
    final_sp: int  # the context's sp


class RingEntry(NamedTuple):
    """One record a detour wrote into its CPU's ring (a tuple: a drain makes one per record, thousands at a time)."""

    probe_id: int
    cpu: int
    pid: int
    comm: str
    task: int
    cycles: int  # the cycle counter (x86's TSC) when the detour ran
    sp: int
    values: dict[str, int]  # gdbstub names; the ip a uprobe handler's (a detour's: the host knows the probe's)
    func: int = 0  # a return record's probed function, as a uprobe's ret_handler had it (a detour's: stale)


class GuestRam(Protocol):
    """The guest-RAM layouts the host reads and writes while the VM runs, and the stubs that fill them."""

    # -- the mailbox stub (qprobe.core.doorbell): a CPU's request, and the host's answer
    mailbox_size: int
    drain_doorbell: int  # the doorbell byte a waiting record rings (not a CPU number)
    trampoline_id: int  # the probe id a kretprobe return reports through the mailbox

    def build_mailbox_stub(
        self, mailboxes: int, missed: int, percpu: PercpuLayout, port: int, address: int
    ) -> bytes: ...
    def read_mailbox(self, read: Callable[[int, int], bytes]) -> MailboxRequest | None: ...
    def mailbox_answer(self, changed: Mapping[str, int], final_ip: int, final_sp: int) -> list[tuple[int, bytes]]: ...
    def return_trampoline(self, address: int, stub: int) -> bytes: ...

    # -- the record rings (qprobe.core.records): per CPU a header, then a power of two of entries
    ring_header_size: int
    ring_entries: int  # entries per CPU unless the host asks for another power of two
    ring_entry_size: int
    ring_head: int  # offsets in a ring header: the guest's head, the host's tail,
    ring_tail: int
    ring_waits: int  # the guest's count of records that waited for a full ring to drain,
    ring_lossy: int  # the host's switch that drops them instead

    def build_record_stub(self, rings: int, ncpus: int, entries: int, lost: int, percpu: PercpuLayout,
                          pid_offset: int, comm_offset: int, port: int, address: int) -> bytes: ...  # fmt: skip
    def build_record_handler(self, rings: int, ncpus: int, entries: int, lost: int, percpu: PercpuLayout,
                             pid_offset: int, comm_offset: int, port: int, probe_id: int, counter: int,
                             returns: bool, address: int) -> bytes: ...  # fmt: skip
    # ^ a uprobe_consumer handler (ret_handler if ``returns``) that counts at ``counter`` and records the user
    #   registers as ``probe_id``'s entry in the same rings
    def parse_ring_entries(self, raw: bytes) -> list[RingEntry]: ...  # consecutive entries, in order

    # -- a "keyed" detour's per-CPU tables (qprobe.core.optcounters)
    def guest_map_size(self, spec: KeySpec) -> int: ...  # one CPU's table, in bytes
    def parse_guest_map(self, spec: KeySpec, raw: bytes) -> dict[MapKey, MapSlot]: ...  # each key's parts decoded

    # -- kretprobe instances and their trampolines (qprobe.core.pools)
    instance_size: int

    def return_layout(self, instances: int, count: int, trampolines: int, returns: int, stub: int,
                      current_task: int) -> ReturnLayout: ...  # fmt: skip
    def build_return_trampolines(self, layout: ReturnLayout) -> bytes: ...
    def return_int3s(self, layout: ReturnLayout) -> tuple[int, int]: ...
    def new_instance(self, owner: int, mailbox: bool) -> bytes: ...
    def parse_instances(self, raw: bytes) -> list[tuple[int, int, int, int]]: ...
    def instance_return_field(self, layout: ReturnLayout, i: int) -> int: ...
    def trampoline_index(self, layout: ReturnLayout, value: int) -> int | None: ...


__all__ = ["DetourParams", "GuestRam", "MailboxRequest", "PercpuLayout", "Pool", "ReturnLayout", "RingEntry"]
