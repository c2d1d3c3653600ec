"""Jump optimization and the stop-less handler channel (host side).

An optimized probe's first instructions are a ``jmp`` to a detour in the
scratch area, built by the architecture (``arch_prepare_optimized_kprobe``).
Its hits never stop the VM: a Python handler runs on the doorbell server's
thread (qprobe.core.doorbell), and probes that need no Python handler at the
hit do not wake the host at all (see ``detour_kind``): their detour counts in
guest RAM, or records the registers into a per-CPU ring that the collector
thread drains (qprobe.core.records, qprobe.core.optcounters).  A return
probe's instances live in guest RAM too (qprobe.core.pools).

The checks before optimizing are the kernel's (``can_optimize``: whole
function decoded from running memory, no jump into the region, nothing in
the exception table, every displaced instruction relocatable), plus: no
vCPU is inside the region, no other probe lies in it, the probe has no
post_handler, and the probe was armed with an int3 for a grace period first
(the kernel's optimizer delay), so that a context interrupted inside the
region has left it.  On a fully preemptible kernel a context can also sleep
inside the region: there the jump waits, as the kernel's waits for an
RCU-tasks grace period, until no sleeping task's stack points into it
(qprobe.kernel.preempted).  Those checks are qprobe.core.optcheck's; the
queue that retries them is qprobe.core.optqueue's.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

from qprobe.arch import DetourParams, PercpuLayout
from qprobe.arch.inguest import KeySpec, MapKey, MapSlot
from qprobe.core.doorbell import Doorbell
from qprobe.core.errorlog import ErrorLog
from qprobe.core.fence import GuestBlacklist
from qprobe.core.optcheck import JumpCheck, JumpTable
from qprobe.core.optcounters import MAX_OPTIMIZED, GuestCounters
from qprobe.core.optqueue import OptimizingQueue
from qprobe.core.point import Optimized, ProbePoint
from qprobe.core.pools import ReturnPools, page_round
from qprobe.core.records import RECORDING, RecordRings, Sink
from qprobe.core.table import ProbeTable
from qprobe.errors import QprobeError, SymbolError
from qprobe.vmm.memory import SharedRam
from qprobe.vmm.qemu import DOORBELL_PORT

if TYPE_CHECKING:
    from qprobe.core.handlers import Counted, Handlers
    from qprobe.core.kprobe import GuestRecord
    from qprobe.core.regs import RegsSource

log = logging.getLogger("qprobe.optimizer")


def detour_kind(point: ProbePoint) -> str:
    """What the detour does at a hit, from what its probes need.

    "count": no probe has a handler, so the detour only increments a counter in
    guest RAM; "record": the probes' actions can run in the guest (kprobe_events
    fetch arguments that are all registers), so the detour snapshots the
    registers into its CPU's ring and returns; "mailbox": a Python handler runs
    synchronously through the doorbell.  Neither of the first two wakes the host.
    "filtered" is "record" behind the probe's ftrace filter compiled to compares
    (one probe at the point, whose filter only reads registers).  "retentry" is
    a kretprobe's entry alone at its point, with no entry_handler and a pool of
    instances in guest RAM: the detour takes the instance and replaces the return
    address itself (qprobe.arch.x86_64.retdetour).  "keyed" folds the hit into a map
    in a per-CPU table, by a key computed at the hit (one probe with a ``guest_key``).
    """
    rp = point.probes[0].kretprobe if len(point.probes) == 1 else None
    if rp is not None and rp.entry_handler is None and rp.pool is not None:
        return "retentry"
    if len(point.probes) == 1 and point.probes[0].guest_key is not None and point.probes[0].post_handler is None:
        return "keyed"
    if any(kp.post_handler is not None for kp in point.probes):
        return "mailbox"
    if any(kp.pre_handler is not None and kp.recorder is None for kp in point.probes):
        return "mailbox"
    if not any(kp.recorder is not None for kp in point.probes):
        return "count"
    if len(point.probes) == 1 and point.probes[0].guest_filter is not None:
        return "filtered"  # "record", behind the probe's filter compiled into the detour
    return "record"


class KprobeParts(JumpTable, Protocol):
    """The parts of the kprobes core the optimizer works with (qprobe.core.kprobes.KprobeManager's): what the
    jump checks read, and the one place handlers run."""

    handlers: Handlers


class Optimizer:
    """Places and removes jumps; owns the stub, the probe ids, and the parts that work for them.

    ``check`` says why a jump must wait, ``queue`` retries it in rounds,
    ``counts`` folds the detours' counters, ``records`` and ``returns`` are
    the record rings and the kretprobe pools in guest RAM.

    ``available`` is False without a doorbell socket or writable shared RAM
    (e.g. attached to a QEMU qprobe did not start), or on an architecture
    without guest-RAM layouts; probes then stay int3s.  An architecture
    without jump optimization has the mailbox for its kretprobes' returns,
    and every probe stays an int3 (``why_not`` says so).
    """

    def __init__(self, kprobes: KprobeParts, table: ProbeTable, regs: RegsSource, ram: SharedRam | None,
                 doorbell: str | None) -> None:  # fmt: skip
        """``table``: the probe table whose points it queues; ``regs``: pt_regs for the mailbox's handlers."""
        self.arch = kprobes.arch
        self.machine = kprobes.machine
        self.kernel = kprobes.kernel
        self.scratch = kprobes.scratch
        self.text = kprobes.text
        self.slots = kprobes.slots
        self.ram = ram
        self.doorbell_path = doorbell
        layouts = self.arch.guest_ram
        self.available = bool(ram is not None and ram.writable and doorbell and layouts is not None)
        self.unavailable = (f"{self.arch.name} has no jump optimization nor detours in guest RAM: every hit stops "
                            "the VM" if layouts is None else
                            "jump optimization needs qprobe's own QEMU (a doorbell device and shared RAM)")  # fmt: skip
        self.enabled = self.available  # debug.kprobes_optimization
        self.by_id: dict[int, ProbePoint] = {}
        # The text under each jump, listed in the guest's own kprobe_blacklist (see qprobe.core.fence).
        self.guest_blacklist = GuestBlacklist(self.machine, kprobes.kernel, kprobes.symbols, kprobes.scratch)
        self.check = JumpCheck(kprobes, self.guest_blacklist)
        # What went wrong off the stop loop (doorbell, collector, optimizer thread): a guest can send requests
        # that fail as often as it likes, so the lines kept and the warnings printed are bounded.
        self.errors = ErrorLog(log)
        self.queue = OptimizingQueue(self.machine, table.points, self.scratch, self.check, self.optimize,
                                     lambda: self.enabled, self.errors)  # fmt: skip
        # Probe id 0 is the kretprobe trampoline's.
        self._free_ids = list(range(MAX_OPTIMIZED - 1, 0, -1))
        self.stub = 0
        self.mailboxes = 0
        self._mailbox_phys: list[int] = []  # each CPU's mailbox in guest RAM, once the stub exists
        self._retired: set[int] = set()  # ids of points unoptimized lately (their records may still arrive)
        # Without shared RAM, or guest-RAM layouts, nothing below runs: probes stay int3s.
        self.returns: ReturnPools | None = None  # kretprobe instances in guest RAM
        self.doorbell: Doorbell | None = None
        self.records: RecordRings | None = None  # the record rings, drained by the collector
        self.counts: GuestCounters | None = None  # the detours' counters in guest RAM, folded by the collector
        if ram is not None and layouts is not None:
            self.returns = ReturnPools(self.arch, self.machine, kprobes.scratch, ram,
                                       lambda: kprobes.kernel.current_task_offset, self._stub)  # fmt: skip
            self.records = RecordRings(self.arch, self.machine, kprobes.scratch, ram, kprobes.kernel, kprobes.symbols,
                                       kprobes.handlers, self.by_id, self._retired)  # fmt: skip
            self.counts = GuestCounters(layouts, len(self.machine.vcpus), kprobes.scratch, ram, self.by_id,
                                        self.records, self.returns, self.errors)  # fmt: skip
            drain_now = self.counts.drain_now.set
            self.doorbell = Doorbell(self.arch, self.machine.vcpus, ram, kprobes.handlers, regs.make_regs,
                                     self.by_id.get, kprobes.slots.trampolines, self.errors, drain_now)  # fmt: skip

    @property
    def served(self) -> int:
        """Mailbox requests answered so far."""
        return self.doorbell.served if self.doorbell is not None else 0

    def optimize_later(self, addrs: Iterable[int]) -> None:
        """Queue points for their jump (the kernel's optimize_kprobe()), placed in rounds by ``queue``."""
        self.queue.optimize_later(addrs)

    def enqueue(self, addrs: list[int]) -> bool:
        """Queue points for their jump in this VM stop (OptimizingQueue.enqueue); False if none is."""
        return self.queue.enqueue(addrs)

    def kprobe_optimizer(self, addrs: list[int]) -> None:
        """Place the jumps queued by ``enqueue`` (OptimizingQueue.kprobe_optimizer), off the stop loop."""
        self.queue.kprobe_optimizer(addrs)

    # -- set-up (stop loop) -------------------------------------------------------------
    def _ensure_stub(self) -> None:
        if self.stub and self.scratch.mapped:
            return
        scratch = self.scratch
        scratch.ensure_mapped()
        ncpus = len(self.machine.vcpus)
        # Data the host writes through the RAM file lives on pages of its own, apart from code.
        layouts = self.arch.guest_ram
        assert self.counts is not None and layouts is not None
        mailbox_size = layouts.mailbox_size
        size = ncpus * mailbox_size + self.counts.size
        data = scratch.alloc(page_round(size), align=4096)
        self.mailboxes = data
        self.counts.place(data + ncpus * mailbox_size)
        self._zero(data, size)
        percpu = self._percpu()
        missed = self.counts.missed

        def stub(at: int) -> bytes:
            return layouts.build_mailbox_stub(self.mailboxes, missed, percpu, DOORBELL_PORT, at)

        size = len(stub(scratch.base))
        self.stub = scratch.alloc(size, align=64)
        self.machine.journal.set_meta(stub=self.stub, stub_size=size, mailboxes=self.mailboxes,
                                      scratch=scratch.base, scratch_phys=scratch.phys)  # fmt: skip
        scratch.write(self.stub, stub(self.stub))
        self._mailbox_phys = [scratch.phys_of(self.mailboxes + cpu * mailbox_size) for cpu in range(ncpus)]
        self._start_threads()

    def _stub(self) -> int:
        self._ensure_stub()
        return self.stub

    def _percpu(self) -> PercpuLayout:
        kernel = self.kernel
        return PercpuLayout(kernel.percpu_offset("cpu_number"), kernel.percpu_offset("this_cpu_off"),
                            kernel.current_task_offset)  # fmt: skip

    def keyed_counts(self, point: ProbePoint, spec: KeySpec) -> dict[MapKey, MapSlot]:
        """A "keyed" point's map so far (see GuestCounters.keyed_counts); empty without shared RAM."""
        return self.counts.keyed_counts(point, spec) if self.counts is not None else {}

    def _zero(self, addr: int, size: int) -> None:
        assert self.ram is not None
        self.ram.write_phys(self.scratch.phys_of(addr), bytes(size))

    def _start_threads(self) -> None:
        assert self.doorbell is not None and self.doorbell_path is not None and self.counts is not None
        self.doorbell.start(self.doorbell_path, self._mailbox_phys)
        self.counts.start()

    def close(self) -> None:
        """Stop the threads (on the stop loop, from KprobeManager.remove_all, or on any thread)."""
        self.queue.close()
        if self.counts is not None:
            self.counts.stop()
        if self.doorbell is not None:
            self.doorbell.close()
        if self.counts is not None:
            self.counts.join()

    def stub_missing(self) -> str | None:
        """Why the shared stub cannot be built (the kernel's per-CPU layout is unknown), or None."""
        try:
            for name in ("cpu_number", "this_cpu_off", self.arch.registers.current_percpu):
                self.kernel.percpu_offset(name)
        except SymbolError as exc:
            return f"the detours need the kernel's per-CPU layout: {exc}"
        return None

    def trampoline_code(self, address: int) -> bytes:
        """The stop-less kretprobe trampoline at ``address``: ``push 0; call stub; int3``."""
        self._ensure_stub()
        assert self.arch.guest_ram is not None
        return self.arch.guest_ram.return_trampoline(address, self.stub)

    def why_not(self, point: ProbePoint) -> str | None:
        """None if ``point`` can be optimized now, else the reason."""
        if not self.enabled:
            return "optimization is off"
        if self.arch.optprobes is None:
            return f"{self.arch.name} has no jump optimization"
        missing = self.stub_missing()
        if missing is not None:
            return missing
        if not point.armed or point.opt is not None:
            return "not armed with an int3"
        if any(kp.post_handler is not None for kp in point.probes):
            return "a probe there has a post_handler"
        if not self._free_ids:
            return "too many optimized probes"
        return self.check.why_not(point)

    def why_not_kept(self, point: ProbePoint) -> str | None:
        """Why an optimized point must go back to an int3 (a post_handler arrived, the knob is off)."""
        if not self.enabled:
            return "optimization is off"
        if any(kp.post_handler is not None for kp in point.probes):
            return "a probe there has a post_handler"
        if point.opt is not None and point.opt.kind != detour_kind(point):
            return "its probes' handlers changed"
        return None

    def optimize(self, point: ProbePoint) -> bool:
        why = point.not_optimized = self.why_not(point)
        if why is not None:
            log.debug("not optimizing %s: %s", point.where, why)
            return False
        self._ensure_stub()
        size = point.opt_size
        region = self.text.original(point.addr, size)
        probe_id = self._free_ids.pop()
        self._retired.discard(probe_id)
        params = self._detour_params(point, probe_id, point.addr + size)
        scratch, opt = self.scratch, self.arch.optprobes
        assert opt is not None  # why_not refused the point otherwise
        detour, code, continue_addr = opt.arch_prepare_optimized_kprobe(params, region, point.addr, scratch.base,
                                                                        scratch.alloc)  # fmt: skip
        scratch.write(detour, code)
        assert self.counts is not None
        self.counts.baseline(probe_id)
        # Swap the int3 for the jump while every vCPU is stopped.
        assert point.int3 is not None
        jmp = self.text.repatch(point.int3, opt.arch_optimize_kprobes(point.addr, detour), "optjmp", detour)
        point.int3 = None
        fence = self.guest_blacklist.add(point.addr, point.addr + size)
        point.opt = Optimized(probe_id, detour, size, jmp, continue_addr, params.kind, params.tables, fence)
        self.slots.resume_targets[point.addr + size] = math.inf
        if self.check.round is not None:
            bisect.insort(self.check.round.resume_targets, point.addr + size)
        self.by_id[probe_id] = point
        return True

    def _detour_params(self, point: ProbePoint, probe_id: int, resume: int) -> DetourParams:
        """What ``point``'s detour needs: its kind, counters, stub, and a "keyed" detour's tables (allocated here)."""
        kind = detour_kind(point)
        counts = self.counts
        assert counts is not None
        counter, missed, lost = (array + probe_id * 8 for array in (counts.counters, counts.missed, counts.lost))
        stub = self.stub
        if kind in RECORDING:
            assert self.records is not None
            stub = self.records.ensure(counts.lost, self._percpu(), self._zero, DOORBELL_PORT)
        first = point.probes[0]
        params = DetourParams(kind, probe_id, resume, counter, missed, lost, stub=stub)
        if kind == "filtered":
            return dataclasses.replace(params, guest_filter=first.guest_filter)
        if kind == "keyed":
            spec, layouts = first.guest_key, self.arch.guest_ram
            assert spec is not None and layouts is not None
            table_bytes = layouts.guest_map_size(spec) * len(self.machine.vcpus)
            tables = self.scratch.alloc(table_bytes, align=4096)  # written by the guest: apart from code
            self._zero(tables, table_bytes)
            current, pid, _tgid, comm = self.kernel.offsets
            return dataclasses.replace(params, guest_key=spec, tables=tables, task=(current, pid, comm),
                                       cpu_number=self.kernel.percpu_offset("cpu_number"))  # fmt: skip
        if kind == "retentry":
            assert first.kretprobe is not None and first.kretprobe.pool is not None
            assert self.returns is not None
            return dataclasses.replace(params, returns=self.returns.ensure(), pool=first.kretprobe.pool)
        return params

    def unoptimize(self, point: ProbePoint) -> None:
        opt = point.opt
        if opt is None:
            return
        # Counters folded and records delivered while the point is still what they belong to.
        self.sync_missed(point, opt)
        self.text.unpatch(opt.jmp)
        if opt.fence is not None:
            self.guest_blacklist.remove(opt.fence)
            self.slots.quarantine(opt.fence)
        point.opt = None
        self.by_id.pop(opt.probe_id, None)
        # A vCPU stopped inside the record stub publishes after this: recognise its id a while longer.
        self._retired.add(opt.probe_id)
        self._free_ids.insert(0, opt.probe_id)
        # A vCPU or an interrupted context may still be in the detour: never reuse it (nor its tables).
        self.slots.quarantine(opt.detour)
        if opt.tables:
            self.slots.quarantine(opt.tables)

    # -- records the guest's own uprobes' handlers write (qprobe.core.uguest) --------------------------
    def open_recorder(self, owner: Counted, deliver: Callable[[list[GuestRecord]], None]) -> int:
        """A probe id whose ring records go to ``deliver`` as ``owner``'s, the rings laid out (stop loop)."""
        assert self.records is not None and self.counts is not None and self.available
        self._ensure_stub()
        self.records.ensure(self.counts.lost, self._percpu(), self._zero, DOORBELL_PORT)
        if not self._free_ids:
            raise QprobeError(f"every one of the {MAX_OPTIMIZED - 1} probe ids of detours and recorders is in use")
        probe_id = self._free_ids.pop()
        self._retired.discard(probe_id)
        self.counts.baseline(probe_id)
        self.records.sinks[probe_id] = Sink(owner, deliver)
        return probe_id

    def close_recorder(self, probe_id: int) -> int:
        """``probe_id``'s records delivered and the id given back, once the guest calls none of its handlers (stop
        loop); the records it lost on a full ring."""
        assert self.records is not None and self.counts is not None
        lost = self.counts.drain_lost(probe_id)
        del self.records.sinks[probe_id]
        self._retired.add(probe_id)
        self._free_ids.insert(0, probe_id)
        return lost

    def sync_missed(self, point: ProbePoint, opt: Optimized | None = None) -> None:
        """Fold the guest's counters of an optimized point into its probes (GuestCounters.sync_missed)."""
        if self.counts is not None:
            self.counts.sync_missed(point, opt)

    def sync_all(self) -> None:
        """Drain the rings once and fold every in-guest counter now (RAM reads, no VM stop)."""
        if self.counts is not None:
            self.counts.sync_all()


__all__ = ["Optimizer", "detour_kind"]
