"""The record rings: hits that "record" and "filtered" detours write in the guest, drained by the host.

A recording detour calls the architecture's record stub, which snapshots
the registers, the task and the TSC into its CPU's ring and returns: the hit
wakes nobody.  The optimizer's collector thread drains the rings (RAM reads,
no VM stop), oldest first across CPUs, and hands each record to its probes'
recorders as a :class:`GuestRecord` through the one handler runner
(qprobe.core.handlers).  The ring layout is the architecture's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Mapping
from typing import TYPE_CHECKING

from qprobe.arch import Arch, PercpuLayout, RingEntry
from qprobe.core.kprobe import GuestRecord
from qprobe.core.point import ProbePoint
from qprobe.core.pools import page_round
from qprobe.kernel.clock import cycles_hz
from qprobe.vmm.memory import SharedRam

if TYPE_CHECKING:
    from qprobe.core.handlers import Handlers
    from qprobe.kernel.program import KernelData
    from qprobe.kernel.symbols import Symbols
    from qprobe.vmm.machine import Machine
    from qprobe.vmm.scratch import ScratchArea

RECORDING = ("record", "filtered")  # detour kinds that write the rings


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
        self.stub = 0
        self.rings = 0  # ring headers (ring_header_size per CPU), then the entries
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

    def ensure(self, lost: int, percpu: PercpuLayout, zero: Callable[[int, int], None], port: int) -> int:
        """The record stub's address; the rings and the stub on first use (64 KiB of scratch per CPU).

        ``lost`` is the u64 array, by probe id, of records dropped on a full ring; ``port`` the doorbell's.
        """
        if self.stub:
            return self.stub
        scratch, layouts = self.scratch, self.layouts
        ncpus = len(self.machine.vcpus)
        size = layouts.ring_header_size * ncpus + layouts.ring_entries * layouts.ring_entry_size * ncpus
        self.rings = scratch.alloc(page_round(size), align=4096)  # written by the guest: apart from code
        zero(self.rings, size)
        self._tails = [0] * ncpus
        if self.lossy:
            self.set_lossy(True)
        _cur, pid_off, _tgid, comm_off = self.kernel.offsets

        def code(at: int) -> bytes:
            return layouts.build_record_stub(self.rings, ncpus, lost, percpu, pid_off, comm_off, port, at)

        stub = scratch.alloc(len(code(scratch.base)), align=64)
        scratch.write(stub, code(stub))
        self.stub = stub
        self._cycles_hz = float(cycles_hz(self.kernel))
        return stub

    def drain(self) -> None:
        """Deliver every record in the rings, oldest first across CPUs (the caller serializes drains).

        Everything read from a ring is validated before use: a head that went
        backwards or past a full ring, an entry whose CPU is not its ring's or
        whose probe id is not a recording probe; each failure is counted in
        ``ring_errors`` and skipped.
        """
        if not self.stub:
            return
        batch: list[tuple[ProbePoint, RingEntry]] = []
        for cpu in range(len(self._tails)):
            batch += self._read_ring(cpu)
        if batch:
            self._deliver(batch)

    def _read_ring(self, cpu: int) -> list[tuple[ProbePoint, RingEntry]]:
        """The valid entries of ``cpu``'s ring since the last drain; the ring's tail moves past them all."""
        ram, scratch, layouts = self.ram, self.scratch, self.layouts
        ncpus = len(self._tails)
        hdr = self._header(cpu)
        head, tail = ram.read_u64_phys(hdr + layouts.ring_head), self._tails[cpu]
        if head == tail:
            return []
        out = []
        if not 0 < head - tail <= layouts.ring_entries:
            self.ring_errors += 1
        else:
            base = scratch.phys_of(self.rings + layouts.ring_header_size * ncpus
                                   + cpu * layouts.ring_entries * layouts.ring_entry_size)  # fmt: skip
            for seq in range(tail, head):
                raw = ram.read_phys(base + (seq % layouts.ring_entries) * layouts.ring_entry_size,
                                    layouts.ring_entry_read_size)  # fmt: skip
                entry = layouts.parse_ring_entry(raw)
                point = self.by_id.get(entry.probe_id)
                if point is None and entry.probe_id in self.retired:
                    self.late_records += 1
                    continue
                if point is None or point.opt is None or point.opt.kind not in RECORDING or entry.cpu != cpu:
                    self.ring_errors += 1
                    continue
                out.append((point, entry))
        self._tails[cpu] = head
        ram.write_u64_phys(hdr + layouts.ring_tail, head)
        return out

    def _deliver(self, batch: list[tuple[ProbePoint, RingEntry]]) -> None:
        """Each record, in cycle-counter order, to the recorders of its point's enabled probes."""
        batch.sort(key=lambda b: b[1].cycles)
        now = time.monotonic()
        if self._host_offset is None or not self._cycles_hz:
            self._host_offset = now - batch[-1][1].cycles / self._cycles_hz if self._cycles_hz else 0.0
        layout = self.arch.registers
        ip = layout.gdb_name[layout.ip]
        for point, entry in batch:
            values = {**entry.values, ip: point.addr, "cycles": entry.cycles}
            when = min(now, entry.cycles / self._cycles_hz + self._host_offset) if self._cycles_hz else now
            rec = GuestRecord(values, entry.cpu, entry.pid, entry.comm, entry.task, when)
            for kp in point.probes:
                if kp.disabled:
                    continue
                kp.nhit += 1
                if kp.recorder is not None:
                    self.handlers.call(kp, "recorder", kp.recorder, rec)


__all__ = ["RECORDING", "RecordRings"]
