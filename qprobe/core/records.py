"""The record rings: hits that "record" and "filtered" detours write in the guest, drained by the host.

A recording detour calls the architecture's record stub, which snapshots
the registers, the task and the TSC into its CPU's ring and returns: the hit
wakes nobody.  The optimizer's collector thread drains the rings (RAM reads,
no VM stop): each ring's new entries in one read and one bulk decode, all of
them oldest first across CPUs, handed to their probes' recorders as runs of
:class:`GuestRecord` (one call a run, not a record) through the one handler
runner (qprobe.core.handlers).  The ring layout is the architecture's; its
size per CPU (a power of two of entries) the host's choice, made when the
rings are laid out (``buffer_size_kb``, as ftrace's file of that name).

The same rings take the records of uprobes the guest kernel's own uprobes
call a handler of qprobe's for (qprobe.core.uguest): each such probe id is a
:class:`Sink`, whose records carry the user ip they were taken at.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qprobe.arch import Arch, PercpuLayout, RingEntry
from qprobe.core.kprobe import GuestRecord
from qprobe.core.point import ProbePoint
from qprobe.core.pools import page_round
from qprobe.errors import QprobeError
from qprobe.kernel.clock import cycles_hz
from qprobe.vmm.memory import SharedRam

if TYPE_CHECKING:
    from qprobe.core.handlers import Counted, Handlers
    from qprobe.kernel.program import KernelData
    from qprobe.kernel.symbols import Symbols
    from qprobe.vmm.machine import Machine
    from qprobe.vmm.scratch import ScratchArea

log = logging.getLogger("qprobe")

RECORDING = ("record", "filtered")  # detour kinds that write the rings
_CYCLES = operator.attrgetter("cycles")
RINGS_SHARE = 2  # the rings take at most 1/RINGS_SHARE of the scratch area: code, counters and maps need the rest


@dataclass(frozen=True)
class Sink:
    """Where the records of a probe id that is no optimized point go: ``deliver`` runs of them, as ``owner``'s
    handler (its exceptions counted on it)."""

    owner: Counted
    deliver: Callable[[list[GuestRecord]], None]


class RecordRings:
    """The per-CPU rings and their stub (built on first use) and the host's reading of them.

    ``by_id`` maps a probe id to its optimized point; ``retired`` holds the
    ids of points unoptimized lately, whose records may still arrive from a
    vCPU that was inside the record stub (counted in ``late_records``).
    """

    def __init__(self, arch: Arch, machine: Machine, scratch: ScratchArea, ram: SharedRam, kernel: KernelData,
                 symbols: Symbols, handlers: Handlers, by_id: Mapping[int, ProbePoint],
                 retired: Container[int]) -> None:  # fmt: skip
        assert arch.guest_ram is not None  # built only for an architecture with guest-RAM layouts
        self.arch = arch
        self.layouts = arch.guest_ram
        self.machine = machine
        self.scratch = scratch
        self.ram = ram
        self.kernel = kernel
        self.symbols = symbols
        self.handlers = handlers
        self.by_id = by_id
        self.retired = retired
        self.sinks: dict[int, Sink] = {}  # probe ids recorded by handlers of the guest's own uprobes
        self._stub_args: tuple[int, PercpuLayout, int, int, int, int] | None = None  # ensure()'s, for the handlers
        self.stub = 0
        self.rings = 0  # ring headers (ring_header_size per CPU), then the entries
        self.buffer_size_kb: int | None = None  # asked for, per CPU (None: the architecture's ring_entries)
        self.entries = 0  # per CPU, once laid out: a power of two
        self._tails: list[int] = []
        self.ring_errors = 0  # ring entries or heads that failed validation (a guest scribbling)
        self.late_records = 0  # records of a probe unoptimized while a vCPU was inside its record stub
        self._cycles_hz = 0.0
        self._host_offset: float | None = None
        self.lossy = False  # a full ring drops its records (counted as lost) instead of making them wait

    def _header(self, cpu: int) -> int:
        return self.scratch.phys_of(self.rings + cpu * self.layouts.ring_header_size)

    def set_lossy(self, on: bool) -> None:
        """Drop records on a full ring (perf's and bpftrace's way) instead of making the hitting vCPU wait."""
        self.lossy = on
        for cpu in range(len(self._tails)):
            self.ram.write_u64_phys(self._header(cpu) + self.layouts.ring_lossy, int(on))

    def waits(self) -> int:
        """Records that found their ring full and waited for the host to drain it (every CPU's)."""
        return sum(
            self.ram.read_u64_phys(self._header(cpu) + self.layouts.ring_waits) for cpu in range(len(self._tails))
        )

    def set_buffer_size_kb(self, kb: int) -> None:
        """Each CPU's ring about ``kb`` KiB (the largest power of two of entries that fits; ftrace's buffer_size_kb).

        Only before the rings are laid out (the first recording probe): the record stub is built for their size.
        """
        if kb < 1:
            raise QprobeError(f"a record ring of {kb} KiB: give at least 1")
        if self.stub and self._entries_for(kb) != self.entries:
            raise QprobeError(f"the record rings are laid out already ({self.size_kb} KiB per CPU): "
                              "set their size before the first recorded probe")  # fmt: skip
        self.buffer_size_kb = kb

    @property
    def size_kb(self) -> int:
        """Each CPU's ring, in KiB: as laid out, else as it would be."""
        entries = self.entries or self._entries_for(self.buffer_size_kb)
        return entries * self.layouts.ring_entry_size // 1024

    def _entries_for(self, kb: int | None) -> int:
        """Entries per CPU for ``kb`` KiB asked (None: the default), within the scratch area's share for rings."""
        layouts = self.layouts
        wanted = layouts.ring_entries if kb is None else max(1, kb * 1024 // layouts.ring_entry_size)
        entries = 1 << (wanted.bit_length() - 1)
        ncpus = len(self.machine.vcpus)
        while entries > 1 and ncpus * (layouts.ring_header_size + entries * layouts.ring_entry_size) > (
            self.scratch.size // RINGS_SHARE
        ):
            entries //= 2
        return entries

    def ensure(self, lost: int, percpu: PercpuLayout, zero: Callable[[int, int], None], port: int) -> int:
        """The record stub's address; the rings (``buffer_size_kb`` per CPU) and the stub on first use.

        ``lost`` is the u64 array, by probe id, of records dropped on a full ring; ``port`` the doorbell's.
        """
        if self.stub:
            return self.stub
        scratch, layouts = self.scratch, self.layouts
        ncpus = len(self.machine.vcpus)
        entries = self._entries_for(self.buffer_size_kb)
        if self.buffer_size_kb is not None and entries * layouts.ring_entry_size < self.buffer_size_kb * 1024 // 2:
            log.warning("record rings: %d KiB per CPU asked, %d KiB laid out (the scratch area holds %d MiB)",
                        self.buffer_size_kb, entries * layouts.ring_entry_size // 1024, scratch.size >> 20)  # fmt: skip
        size = layouts.ring_header_size * ncpus + entries * layouts.ring_entry_size * ncpus
        self.rings = scratch.alloc(page_round(size), align=4096)  # written by the guest: apart from code
        self.entries = entries
        zero(self.rings, size)
        self._tails = [0] * ncpus
        if self.lossy:
            self.set_lossy(True)
        _cur, pid_off, _tgid, comm_off = self.kernel.offsets
        self._stub_args = (lost, percpu, pid_off, comm_off, port, ncpus)

        def code(at: int) -> bytes:
            return layouts.build_record_stub(self.rings, ncpus, entries, lost, percpu, pid_off, comm_off, port, at)

        stub = scratch.alloc(len(code(scratch.base)), align=64)
        scratch.write(stub, code(stub))
        self.stub = stub
        self._cycles_hz = float(cycles_hz(self.kernel))
        return stub

    def handler_code(self, probe_id: int, counter: int, returns: bool, at: int) -> bytes:
        """A uprobe_consumer handler at ``at`` recording ``probe_id``'s hits (``returns``: a ret_handler) into the
        rings, counting each at ``counter`` (the rings laid out first: ``ensure``)."""
        assert self._stub_args is not None
        lost, percpu, pid_off, comm_off, port, ncpus = self._stub_args
        return self.layouts.build_record_handler(self.rings, ncpus, self.entries, lost, percpu, pid_off, comm_off,
                                                 port, probe_id, counter, returns, at)  # fmt: skip

    def drain(self) -> None:
        """Deliver every record in the rings, oldest first across CPUs (the caller serializes drains).

        Everything read from a ring is validated before use: a head that went
        backwards or past a full ring, an entry whose CPU is not its ring's or
        whose probe id is not a recording probe; each failure is counted in
        ``ring_errors`` and skipped.
        """
        if not self.stub:
            return
        batch: list[RingEntry] = []
        points: dict[int, ProbePoint | Sink] = {}  # the recording points (or sinks) the batch's probe ids name
        for cpu in range(len(self._tails)):
            batch += self._read_ring(cpu, points)
        if batch:
            self._deliver(batch, points)

    def _read_ring(self, cpu: int, points: dict[int, ProbePoint | Sink]) -> list[RingEntry]:
        """The valid entries of ``cpu``'s ring since the last drain, their points added to ``points``; the
        ring's tail moves past them all (once they are read, before they are decoded).

        The new entries are read in one go (two where they wrap) and decoded together.
        """
        ram, layouts, entries = self.ram, self.layouts, self.entries
        hdr = self._header(cpu)
        head, tail = ram.read_u64_phys(hdr + layouts.ring_head), self._tails[cpu]
        if head == tail:
            return []
        if not 0 < head - tail <= entries:
            self.ring_errors += 1
            self._free(cpu, head)
            return []
        size, count, first = layouts.ring_entry_size, head - tail, tail % entries
        base = self.scratch.phys_of(self.rings + layouts.ring_header_size * len(self._tails) + cpu * entries * size)
        upto_end = min(count, entries - first)
        raw = ram.read_phys(base + first * size, upto_end * size)
        if upto_end < count:
            raw += ram.read_phys(base, (count - upto_end) * size)
        # The entries are copied: the ring is free again before they are decoded, so a vCPU waiting on
        # it goes on now, not once this drain's records have been decoded and handled.
        self._free(cpu, head)
        out = []
        by_id, retired, sinks = self.by_id, self.retired, self.sinks
        for entry in layouts.parse_ring_entries(raw):
            probe_id = entry.probe_id
            if probe_id not in points:  # each id checked once a drain
                point = by_id.get(probe_id)
                sink = sinks.get(probe_id)
                if point is None and sink is None and probe_id in retired:
                    self.late_records += 1
                    continue
                if sink is not None:
                    points[probe_id] = sink
                elif point is None or point.opt is None or point.opt.kind not in RECORDING:
                    self.ring_errors += 1
                    continue
                else:
                    points[probe_id] = point
            if entry.cpu != cpu:
                self.ring_errors += 1
                continue
            out.append(entry)
        return out

    def _free(self, cpu: int, head: int) -> None:
        """``cpu``'s ring read up to ``head``: the guest may write over what lies before it."""
        self._tails[cpu] = head
        self.ram.write_u64_phys(self._header(cpu) + self.layouts.ring_tail, head)

    def _deliver(self, batch: list[RingEntry], points: Mapping[int, ProbePoint | Sink]) -> None:
        """Every record, in cycle-counter order, to the recorders of its point's enabled probes (or its sink):
        each run of records of one point in one call.  A point's records take its address as their ip; a
        sink's keep the one they were taken at."""
        batch.sort(key=_CYCLES)
        now = time.monotonic()
        hz = self._cycles_hz
        if self._host_offset is None or not hz:
            self._host_offset = now - batch[-1].cycles / hz if hz else 0.0
        offset = self._host_offset
        layout = self.arch.registers
        ip = layout.gdb_name[layout.ip]
        run: list[GuestRecord] = []
        run_point = points[batch[0].probe_id]
        for entry in batch:
            point = points[entry.probe_id]
            values = entry.values  # the entry's own dict, made for it by the decode
            if isinstance(point, ProbePoint):
                values[ip] = point.addr
            cycles = values["cycles"] = entry.cycles
            when = min(now, cycles / hz + offset) if hz else now
            if point is not run_point:
                self._hand(run_point, run)
                run_point, run = point, []
            run.append(GuestRecord(values, entry.cpu, entry.pid, entry.comm, entry.task, when, entry.func))
        self._hand(run_point, run)

    def _hand(self, point: ProbePoint | Sink, records: list[GuestRecord]) -> None:
        """A run of ``point``'s records to its enabled probes' recorders (or to the sink)."""
        if isinstance(point, Sink):
            self.handlers.call(point.owner, "recorder", point.deliver, records)
            return
        for kp in point.probes:
            if kp.disabled:
                continue
            kp.nhit += len(records)
            if kp.recorder is not None:
                self.handlers.call(kp, "recorder", kp.recorder, records)


__all__ = ["RECORDING", "RecordRings", "Sink"]
