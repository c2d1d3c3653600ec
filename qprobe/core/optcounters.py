"""The optimized probes' counters in guest RAM, folded into their probes by the host.

A detour counts in u64 arrays indexed by probe id (nmissed, in-guest hits,
records lost on a full ring) and appends records to per-CPU rings; the
collector thread here drains the rings and folds the counters while the VM
runs (RAM reads, no VM stop).
"""

from __future__ import annotations

import threading

from qprobe.arch import GuestRam
from qprobe.arch.inguest import KeySpec, MapKey, MapSlot
from qprobe.core.errorlog import ErrorLog
from qprobe.core.point import Optimized, ProbePoint
from qprobe.core.pools import ReturnPools
from qprobe.core.records import RECORDING, RecordRings
from qprobe.errors import QprobeError
from qprobe.vmm.memory import SharedRam
from qprobe.vmm.scratch import ScratchArea

MAX_OPTIMIZED = 4096  # probe ids: one nmissed counter each
COLLECT_INTERVAL = 0.02  # seconds between drains of the rings and folds of the in-guest counters


class GuestCounters:
    """The per-probe-id arrays in guest RAM, what the host has folded of them, and the collector thread."""

    def __init__(self, layouts: GuestRam, ncpus: int, scratch: ScratchArea, ram: SharedRam,
                 by_id: dict[int, ProbePoint], records: RecordRings, returns: ReturnPools,
                 errors: ErrorLog) -> None:  # fmt: skip
        self.layouts = layouts
        self.ncpus = ncpus
        self.scratch = scratch
        self.ram = ram
        self.by_id = by_id
        self.records = records
        self.returns = returns
        self.errors = errors
        self.missed = 0
        self.counters = 0  # per probe id: hits of in-guest counting detours
        self.lost = 0  # per probe id: records dropped on a full ring
        self._missed_seen: dict[int, int] = {}
        self._counted_seen: dict[int, int] = {}
        self._lost_seen: dict[int, int] = {}
        self._fold_lock = threading.Lock()
        self._collector: threading.Thread | None = None
        self._stop = False
        self.drain_now = threading.Event()  # a record waits on a full ring: drain before the interval is up

    size = 3 * MAX_OPTIMIZED * 8  # bytes of the three arrays

    def place(self, at: int) -> None:
        """The arrays are at ``at`` in the scratch area (zeroed), ``size`` bytes."""
        self.missed = at
        self.counters = self.missed + MAX_OPTIMIZED * 8
        self.lost = self.counters + MAX_OPTIMIZED * 8

    def start(self) -> None:
        if self._collector is None:
            self._collector = threading.Thread(target=self._collect_loop, name="qprobe-collector", daemon=True)
            self._collector.start()

    def stop(self) -> None:
        """Tell the collector to end after its current pass (any thread)."""
        self._stop = True
        self.drain_now.set()

    def join(self) -> None:
        if self._collector is not None:
            self._collector.join(2.0)

    def keyed_counts(self, point: ProbePoint, spec: KeySpec) -> dict[MapKey, MapSlot]:
        """A "keyed" point's map so far (its probe's ``spec``), summed over the CPUs' tables (RAM reads, no stop)."""
        opt = point.opt
        if opt is None or opt.kind != "keyed":
            return {}
        size = self.layouts.guest_map_size(spec) * self.ncpus
        return self.layouts.parse_guest_map(spec, self.ram.read_phys(self.scratch.phys_of(opt.tables), size))

    def baseline(self, probe_id: int) -> None:
        """A new detour's counters start from what the guest's arrays hold for its id now."""
        for array, seen in self._counter_arrays():
            seen[probe_id] = self._read_counter(array, probe_id)

    def _counter_arrays(self) -> tuple[tuple[int, dict[int, int]], ...]:
        """The guest's u64 arrays indexed by probe id, each with the values the host has folded so far."""
        return ((self.missed, self._missed_seen), (self.counters, self._counted_seen), (self.lost, self._lost_seen))

    def _read_counter(self, array: int, probe_id: int) -> int:
        return self.ram.read_u64_phys(self.scratch.phys_of(array + probe_id * 8))

    def _delta(self, array: int, seen: dict[int, int], probe_id: int) -> int:
        """How much the guest's counter ``array[probe_id]`` went up since it was last folded."""
        now = self._read_counter(array, probe_id)
        delta = now - seen.get(probe_id, now)
        seen[probe_id] = now
        return delta

    def sync_missed(self, point: ProbePoint, opt: Optimized | None = None) -> None:
        """Fold the guest's counters of an optimized probe (nmissed; in-guest hits, records) into its probes."""
        opt = opt or point.opt
        if opt is None:
            return
        with self._fold_lock:
            if opt.kind in RECORDING:
                self.records.drain()  # the records before the counts that follow them
            self._fold(point, opt)

    def _fold(self, point: ProbePoint, opt: Optimized) -> None:
        """sync_missed's work, with _fold_lock held and the rings already drained."""
        delta = self._delta(self.missed, self._missed_seen, opt.probe_id)
        rp = point.probes[0].kretprobe if point.probes else None
        if opt.kind == "retentry" and rp is not None:
            rp.nmissed += delta  # calls that found no free instance: the kretprobe's nmissed
            delta = 0
        if opt.kind in (*RECORDING, "keyed"):
            # A record dropped on a full ring (a key with no free slot) is a hit whose action did not run.
            lost = self._delta(self.lost, self._lost_seen, opt.probe_id)
            for kp in point.probes:
                kp.nlost += lost
            delta += lost
        for kp in point.probes:
            kp.nmissed += delta
        if opt.kind in ("count", "filtered", "retentry", "keyed"):  # hits counted in the guest ("filtered": rejected)
            counted = self._delta(self.counters, self._counted_seen, opt.probe_id)
            for kp in point.probes:
                if not kp.disabled:
                    kp.nhit += counted
                    if opt.kind == "filtered":
                        kp.nfiltered += counted

    def drain_lost(self, probe_id: int) -> int:
        """The rings drained, and the records ``probe_id`` lost on a full ring since its baseline (a recorder's)."""
        with self._fold_lock:
            self.records.drain()
            return self._read_counter(self.lost, probe_id) - self._lost_seen.get(probe_id, 0)

    def sync_all(self) -> None:
        """Drain the rings once and fold every in-guest counter now (RAM reads, no VM stop)."""
        with self._fold_lock:
            self.records.drain()
            for point in list(self.by_id.values()):
                opt = point.opt
                if opt is not None and opt.kind != "mailbox":
                    self._fold(point, opt)
            self.returns.fold_all()

    def _collect_loop(self) -> None:
        """While the VM runs (RAM reads, no stop): fold in-guest counters, drain the record rings."""
        while not self._stop:
            try:
                self.sync_all()
            except QprobeError as exc:
                self.errors.add(f"collector: {exc}")
            self.drain_now.wait(COLLECT_INTERVAL)
            self.drain_now.clear()
