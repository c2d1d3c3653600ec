"""Jump optimization and the stop-less handler channel (host side).

An optimized probe's first instructions are a ``jmp`` to a detour in the
scratch area, built by the architecture (``arch_prepare_optimized_kprobe``).
Its hits never stop the VM: a Python handler runs on the doorbell server's
thread (qprobe.core.doorbell), and probes that need no Python handler at the
hit do not wake the host at all (see ``detour_kind``): their detour counts in
guest RAM, or records the registers into a per-CPU ring that this module's
collector thread drains (qprobe.core.records).  A return probe's instances live in guest RAM too
(qprobe.core.pools).

The checks before optimizing are the kernel's (``can_optimize``: whole
function decoded from running memory, no jump into the region, nothing in
the exception table, every displaced instruction relocatable), plus: no
vCPU is inside the region, no other probe lies in it, the probe has no
post_handler, and the probe was armed with an int3 for a grace period first
(the kernel's optimizer delay), so that a context interrupted inside the
region has left it.  On a fully preemptible kernel a context can also sleep
inside the region: there the jump waits, as the kernel's waits for an
RCU-tasks grace period, until no sleeping task's stack points into it
(qprobe.kernel.preempted).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import math
import struct
import threading
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Protocol

import drgn

from qprobe.arch import Arch, DetourParams, PercpuLayout
from qprobe.arch.inguest import KeySpec, MapSlot
from qprobe.core.doorbell import Doorbell
from qprobe.core.errorlog import ErrorLog
from qprobe.core.fence import GuestBlacklist
from qprobe.core.point import Optimized, ProbePoint
from qprobe.core.pools import ReturnPools, page_round
from qprobe.core.records import RECORDING, RecordRings
from qprobe.errors import MemoryFault, QprobeError, SymbolError, TargetGone
from qprobe.kernel.features import thread_size
from qprobe.kernel.preempted import first_inside, preempted_words
from qprobe.vmm.memory import SharedRam
from qprobe.vmm.qemu import DOORBELL_PORT

if TYPE_CHECKING:
    from qprobe.core.dispatch import Trampoline
    from qprobe.core.handlers import Handlers
    from qprobe.core.regs import PtRegs
    from qprobe.kernel.program import KernelData
    from qprobe.kernel.reserved import ReservedText
    from qprobe.kernel.symbols import Symbols
    from qprobe.vmm.journal import Patch
    from qprobe.vmm.machine import Machine
    from qprobe.vmm.scratch import ScratchArea

log = logging.getLogger("qprobe.optimizer")

MAX_OPTIMIZED = 4096  # probe ids: one nmissed counter each
COLLECT_INTERVAL = 0.02  # seconds between drains of the rings and folds of the in-guest counters
# Reasons that hold only at the moment of the attempt (their texts start with these).
TRANSIENT = ("vCPU", "a context interrupted on vCPU", "a boosted copy", "a preempted task")
# Seconds after its last entry that a boosted copy may still hold a context interrupted inside it
# (the same grace KprobeManager.remove_all gives before unmapping).
RESUME_GRACE = 0.1
OPTIMIZE_DELAY = 0.05  # seconds the VM runs between arming the int3 and placing the jump
OPTIMIZE_RETRIES = 5  # attempts before register returns, for a probe a vCPU was passing through
OPTIMIZE_MAX_DELAY = 1.0  # seconds between the optimizer thread's later attempts, at most


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


class ProbeTable(Protocol):
    """What the optimizer works with: the probe table (qprobe.core.kprobes.KprobeManager) and its resources."""

    arch: Arch
    machine: Machine
    kernel: KernelData
    symbols: Symbols
    scratch: ScratchArea
    handlers: Handlers
    points: dict[int, ProbePoint]
    trampolines: dict[int, Trampoline]
    resume_targets: dict[int, float]
    fully_preemptible: bool

    @property
    def reserved(self) -> ReservedText: ...
    def original(self, addr: int, size: int) -> bytes: ...
    def patched(self) -> Mapping[int, int]: ...
    def patch_text(self, addr: int, data: bytes, what: str, slot: int = 0) -> Patch: ...
    def repatch_text(self, p: Patch, data: bytes, what: str, slot: int = 0) -> Patch: ...
    def unpatch_text(self, p: Patch) -> None: ...
    def quarantine(self, addr: int) -> None: ...
    def make_regs(self, values: Mapping[str, int], tid: str) -> PtRegs: ...
    def addresses(self) -> list[int]: ...
    def arriving(self, regs: Mapping[str, int]) -> int | None: ...
    def trap_step_returns(self) -> dict[str, int]: ...


@dataclasses.dataclass
class VcpuView:
    """One vCPU as the jump checks see it during one VM stop (nothing moves until the VM runs again)."""

    tid: str
    ip: int
    trapped: int | None  # a trap still to be dispatched: the int3's address (KprobeManager.arriving)
    # Every word of its running stack and its task's stack, sorted (an interrupted context's return
    # address is among them); None when they cannot be read, empty in user mode.
    words: list[int] | None


@dataclasses.dataclass
class RoundView:
    """What every point's jump check reads in one optimizer round, read once for the round.

    A round checks every queued point in one VM stop; reading the vCPUs'
    registers and stacks (two gdbstub round trips and 32 KiB of RAM per vCPU)
    for each point made a round over 1,000 points take seconds.
    """

    vcpus: list[VcpuView] | None  # None until first needed
    points: list[int]  # the probe table's addresses, sorted
    resume_targets: list[int]  # KprobeManager.resume_targets' addresses, sorted (kept so as jumps are placed)


class Optimizer:
    """Decides and places jumps (a queue worked in steps), owns the guest-RAM counters and record rings.

    ``available`` is False without a doorbell socket or writable shared RAM
    (e.g. attached to a QEMU qprobe did not start); probes then stay int3s.
    """

    def __init__(self, kprobes: ProbeTable, ram: SharedRam | None, doorbell: str | None) -> None:
        self.kp = kprobes
        self.arch: Arch = kprobes.arch
        self.machine = kprobes.machine
        self.ram = ram
        self.doorbell_path = doorbell
        self.available = bool(ram is not None and ram.writable and doorbell)
        self.enabled = self.available  # debug.kprobes_optimization
        self.by_id: dict[int, ProbePoint] = {}
        # The text under each jump, listed in the guest's own kprobe_blacklist (see qprobe.core.fence).
        self.guest_blacklist = GuestBlacklist(self.machine, kprobes.kernel, kprobes.symbols, kprobes.scratch)
        # Addresses waiting for their jump, with when they were queued (the kernel's optimizing_list);
        # changed on the stop loop only.
        self.optimizing_list: dict[int, float] = {}
        # Probe id 0 is the kretprobe trampoline's.
        self._free_ids = list(range(MAX_OPTIMIZED - 1, 0, -1))
        self.stub = 0
        self.mailboxes = 0
        self._mailbox_phys: list[int] = []  # each CPU's mailbox in guest RAM, once the stub exists
        self.missed = 0
        self.counters = 0  # per probe id: hits of in-guest counting detours
        self._missed_seen: dict[int, int] = {}
        self._counted_seen: dict[int, int] = {}
        self._lost_seen: dict[int, int] = {}
        self.lost = 0  # per probe id: records dropped on a full ring
        self._retired: set[int] = set()  # ids of points unoptimized lately (their records may still arrive)
        self._fold_lock = threading.Lock()
        self._collector: threading.Thread | None = None
        self._optimizer: threading.Thread | None = None  # later rounds of the optimizing list
        self._kick = threading.Event()
        self._thread_size = 0  # the kernel's THREAD_SIZE, once looked up (stack_size)
        # Fully preemptible kernels: the sleeping tasks' live stack words, read once per VM stop that needs them.
        self._preempted: list[int] | None = None
        self._round: RoundView | None = None  # while a round runs (_optimize_queued)
        # What went wrong off the stop loop (doorbell, collector): a guest can send requests that fail as
        # often as it likes, so the lines kept and the warnings printed are bounded.
        self.errors = ErrorLog(log)
        self._stop = False
        self._drain_now = threading.Event()  # a record waits on a full ring: drain before the interval is up
        # Without shared RAM nothing below runs: probes stay int3s.
        self.returns: ReturnPools | None = None  # kretprobe instances in guest RAM
        self.doorbell: Doorbell | None = None
        self.records: RecordRings | None = None  # the record rings, drained by the collector
        if ram is not None:
            self.returns = ReturnPools(self.arch, self.machine, kprobes.scratch, ram,
                                       lambda: kprobes.kernel.current_task_offset, self._stub)  # fmt: skip
            self.doorbell = Doorbell(self.arch, self.machine.vcpus, ram, kprobes.handlers, kprobes.make_regs,
                                     self.by_id.get, kprobes.trampolines, self.errors, self._drain_now.set)  # fmt: skip
            self.records = RecordRings(self.arch, self.machine, kprobes.scratch, ram, kprobes.kernel, kprobes.symbols,
                                       kprobes.handlers, self.by_id, self._retired)  # fmt: skip

    @property
    def served(self) -> int:
        """Mailbox requests answered so far."""
        return self.doorbell.served if self.doorbell is not None else 0

    # -- set-up (stop loop) -------------------------------------------------------------
    def _ensure_stub(self) -> None:
        if self.stub and self.kp.scratch.mapped:
            return
        scratch = self.kp.scratch
        if not scratch.mapped:
            scratch.map()
        ncpus = len(self.machine.vcpus)
        # Data the host writes through the RAM file lives on pages of its own, apart from code.
        mailbox_size = self.arch.mailbox_size
        size = ncpus * mailbox_size + 3 * MAX_OPTIMIZED * 8
        data = scratch.alloc(page_round(size), align=4096)
        self.mailboxes, self.missed = data, data + ncpus * mailbox_size
        self.counters = self.missed + MAX_OPTIMIZED * 8
        self.lost = self.counters + MAX_OPTIMIZED * 8
        self._zero(data, size)
        percpu = self._percpu()

        def stub(at: int) -> bytes:
            return self.arch.build_mailbox_stub(self.mailboxes, self.missed, percpu, DOORBELL_PORT, at)

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
        kernel = self.kp.kernel
        return PercpuLayout(kernel.percpu_offset("cpu_number"), kernel.percpu_offset("this_cpu_off"),
                            kernel.current_task_offset)  # fmt: skip

    def keyed_counts(self, point: ProbePoint, spec: KeySpec) -> dict[tuple[int, ...], MapSlot]:
        """A "keyed" point's map so far (its probe's ``spec``), summed over the CPUs' tables (RAM reads, no stop)."""
        opt = point.opt
        if opt is None or opt.kind != "keyed" or self.ram is None:
            return {}
        size = self.arch.guest_map_size(spec) * len(self.machine.vcpus)
        return self.arch.parse_guest_map(spec, self.ram.read_phys(self.kp.scratch.phys_of(opt.tables), size))

    def _zero(self, addr: int, size: int) -> None:
        assert self.ram is not None
        self.ram.write_phys(self.kp.scratch.phys_of(addr), bytes(size))

    def _start_threads(self) -> None:
        assert self.doorbell is not None and self.doorbell_path is not None
        self.doorbell.start(self.doorbell_path, self._mailbox_phys)
        if self._collector is None:
            self._collector = threading.Thread(target=self._collect_loop, name="qprobe-collector", daemon=True)
            self._collector.start()

    def close(self) -> None:
        """Stop the threads (on the stop loop, from KprobeManager.remove_all, or on any thread)."""
        self._stop = True
        self.optimizing_list.clear()
        self._kick.set()  # the optimizer thread is not joined: it may be waiting for this very stop loop
        self._drain_now.set()
        if self.doorbell is not None:
            self.doorbell.close()
        if self._collector is not None:
            self._collector.join(2.0)

    def stub_missing(self) -> str | None:
        """Why the shared stub cannot be built (the kernel's per-CPU layout is unknown), or None."""
        try:
            for name in ("cpu_number", "this_cpu_off", "current_task"):
                self.kp.kernel.percpu_offset(name)
        except SymbolError as exc:
            return f"the detours need the kernel's per-CPU layout: {exc}"
        return None

    def trampoline_code(self, address: int) -> bytes:
        """The stop-less kretprobe trampoline at ``address``: ``push 0; call stub; int3``."""
        self._ensure_stub()
        return self.arch.return_trampoline(address, self.stub)

    # -- the delayed optimizer (any thread but the stop loop) -----------------------------
    def optimize_later(self, addrs: Iterable[int]) -> None:
        """Queue points for the jump and work the queue: optimize_kprobe() and kprobe_optimizer().

        Unoptimizing needs no queue here: the stop loop swaps a jump back for
        the int3 while every vCPU is stopped (``unoptimize``), and the detour
        is quarantined instead of freed after a quiescent period.
        """
        queued = list(addrs)
        if self.enabled and queued and self.machine.call(lambda: self.enqueue(queued)):
            self.kprobe_optimizer(queued)

    def kprobe_optimizer(self, mine: list[int]) -> None:
        """Work the optimizing list in steps, as kernel/kprobes.c's kprobe_optimizer() does, until ``mine`` is done."""
        # Step 1: the queued points are int3s whose hits are single-stepped, not boosted (enqueue).
        # Step 2: a grace period, so that no context is left inside one of their boosted copies on
        # its way back into a region (the kernel's synchronize_rcu_tasks()).
        time.sleep(max(OPTIMIZE_DELAY, RESUME_GRACE))
        for _ in range(OPTIMIZE_RETRIES):
            # Step 3: in one VM stop, place the jump of every queued point that can take it now.
            left = self.machine.call(self._optimize_queued)
            if not any(a in left for a in mine):
                return
            # Step 4: a vCPU inside a region (or a context interrupted there) only delays its
            # jump: the optimizer runs again after a short delay (the kernel's kick_kprobe_optimizer).
            time.sleep(OPTIMIZE_DELAY)
        # Step 5: what is still held up stays queued, a plain int3 meanwhile, and the optimizer
        # thread works the list later, less often each round, until it is empty: kprobe_optimizer()
        # kicks itself again while its optimizing_list is not empty (kernel/kprobes.c).
        self._kick_optimizer()

    def _kick_optimizer(self) -> None:
        if self._optimizer is None:
            self._optimizer = threading.Thread(target=self._optimizer_loop, name="qprobe-optimizer", daemon=True)
            self._optimizer.start()
        self._kick.set()

    def _optimizer_loop(self) -> None:
        """The optimizer thread: a round every ``delay`` s while the list holds points, else asleep until kicked."""
        delay = OPTIMIZE_DELAY
        while not self._stop:
            # Read off the stop loop: a stale answer costs one round or one kick's wait.
            if self._kick.wait(delay if self.optimizing_list else None):
                self._kick.clear()
                delay = OPTIMIZE_DELAY  # newly queued: their own grace period first
                continue
            if self._stop:
                return
            try:
                left = self.machine.call(self._optimize_queued)
            except TargetGone:
                return
            except QprobeError as exc:
                self.errors.add(f"optimizer: {exc}")
                left = list(self.optimizing_list)
            delay = min(max(delay, OPTIMIZE_DELAY) * 2, OPTIMIZE_MAX_DELAY) if left else OPTIMIZE_DELAY

    def enqueue(self, addrs: list[int]) -> bool:
        """optimize_kprobe(): queue points for the jump (stop loop); False if nothing is (the knob is off)."""
        if not self.enabled or not addrs:
            return False
        for a in addrs:
            point = self.kp.points.get(a)
            if point is not None:
                point.optimizing = True
                self.optimizing_list.setdefault(a, time.monotonic())
        return True

    def _optimize_queued(self) -> list[int]:
        """Optimize what has been queued a grace period; the list keeps what a later attempt may still optimize."""
        now, grace = time.monotonic(), max(OPTIMIZE_DELAY, RESUME_GRACE)
        self._preempted = None  # the tasks have run since the last round
        self._round = RoundView(None, self.kp.addresses(), sorted(self.kp.resume_targets))
        # Every jump of the round journaled in one write, the detours written in as few as can be.
        with self.machine.journal.batch(), self.kp.scratch.combined():
            try:
                self._optimize_round(now, grace)
            finally:
                self._round = None
        return list(self.optimizing_list)

    def _optimize_round(self, now: float, grace: float) -> None:
        """One round's attempts, in the VM stop of ``_optimize_queued``."""
        for a, since in list(self.optimizing_list.items()):
            if now - since < grace:
                continue  # queued by another caller since: its own grace period is not over
            point = self.kp.points.get(a)
            if (
                point is None
                or point.opt is not None
                or not point.armed
                or self.optimize(point)
                or point.not_optimized is None
                or not self.transient(point.not_optimized)
            ):
                del self.optimizing_list[a]
                if point is not None:
                    point.optimizing = False  # boosted again, if it stays an int3

    # -- optimizing (stop loop) -------------------------------------------------------
    @property
    def stack_size(self) -> int:
        """The kernel's THREAD_SIZE, looked up once (SymbolError where the kernel does not tell)."""
        if not self._thread_size:
            self._thread_size = thread_size(self.kp.kernel)
        return self._thread_size

    def why_not(self, point: ProbePoint) -> str | None:
        """None if ``point`` can be optimized now, else the reason."""
        if not self.enabled:
            return "optimization is off"
        missing = self.stub_missing()
        if missing is not None:
            return missing
        if not point.armed or point.opt is not None:
            return "not armed with an int3"
        if any(kp.post_handler is not None for kp in point.probes):
            return "a probe there has a post_handler"
        if not self._free_ids:
            return "too many optimized probes"
        fn = self.kp.symbols.function(point.addr)
        if fn is None:
            return "not in a known function"
        code = self.machine.mem.read(fn.addr, fn.size)
        why, size = self.arch.arch_check_optimized_kprobe(code, fn.addr, point.addr, self.kp.symbols.exception_table(),
                                                          self.kp.patched(), fn.name)  # fmt: skip
        if why is not None:
            return why
        end = point.addr + size
        reserved = self.kp.reserved.conflict(point.addr + 1, end - 1)
        if reserved is not None:  # copy_optimized_instructions' *_text_reserved checks
            return f"the displaced instructions hold {reserved}"
        view = self._round or RoundView(None, self.kp.addresses(), sorted(self.kp.resume_targets))
        if first_inside(view.points, point.addr + 1, end) is not None:
            return "another probe lies in the region"
        theirs = self.guest_blacklist.kprobes_in(point.addr + 1, end)
        if theirs:
            return f"the guest kernel's own kprobe at {self.kp.symbols.symbolize(theirs[0])} lies in the region"
        now = time.monotonic()
        targets = view.resume_targets
        i, j = bisect.bisect_right(targets, point.addr), bisect.bisect_left(targets, end)
        returned = [self.kp.resume_targets[a] for a in targets[i:j]]  # when something last jumped back there
        if any(t == math.inf for t in returned):
            # A detour (perhaps already removed) jumps back there.
            return "out-of-line code returns into the region"
        if any(now - t < RESUME_GRACE for t in returned):
            return f"{TRANSIENT[2]} returning into the region ran {RESUME_GRACE} s ago or less"
        if (point.addr & 0xFFF) + self.arch.jump_size > 0x1000:
            return "the jump would cross a page"
        for tid, back in self.kp.trap_step_returns().items():
            if point.addr < back < end:
                return f"{TRANSIENT[0]} {tid} is running a copy out of line that returns inside the region"
        try:
            stack_size = self.stack_size
        except SymbolError as exc:  # a missing fact, not a moment's obstacle
            return f"interrupted contexts cannot be found: {exc}"
        if view.vcpus is None:
            view.vcpus = self._vcpu_views(stack_size)
        held = self._held_on_vcpus(view.vcpus, point.addr + 1, end, "inside the region", trapping=True)
        if held is not None:
            return held
        if self.kp.fully_preemptible:
            try:
                if self._preempted is None:
                    self._preempted = preempted_words(self.kp.kernel, stack_size)
            except QprobeError as exc:
                return f"{TRANSIENT[3]} cannot be ruled out inside the region: {exc}"
            hit = first_inside(self._preempted, point.addr + 1, end)
            if hit is not None:
                return f"{TRANSIENT[3]}'s stack holds {hit:#x}, inside the region"
            # A task preempted in a boosted copy jumps back into the region when it runs again.
            scratch = self.kp.scratch
            if any(point.addr < a < end for a in self.kp.resume_targets) and scratch.mapped:
                hit = first_inside(self._preempted, scratch.base, scratch.base + scratch.mapped_size)
                if hit is not None:
                    return f"{TRANSIENT[3]}'s stack holds {hit:#x}, in out-of-line code that returns into the region"
        point.opt_size = size
        return None

    def preempted_in(self, lo: int, hi: int) -> str | None:
        """On a fully preemptible kernel, what could still resume in [lo, hi) (stop loop), or None.

        Before code there is given up: a vCPU, a context interrupted on one,
        or a sleeping task whose stack holds an address there.
        """
        try:
            stack_size = self.stack_size
            words = preempted_words(self.kp.kernel, stack_size)
        except QprobeError as exc:
            return f"the tasks' stacks cannot be read: {exc}"
        hit = first_inside(words, lo, hi)
        if hit is not None:
            return f"{TRANSIENT[3]}'s stack holds {hit:#x}"
        return self._held_on_vcpus(self._vcpu_views(stack_size), lo, hi, f"inside [{lo:#x}, {hi:#x})")

    def _held_on_vcpus(self, vcpus: list[VcpuView], lo: int, hi: int, where: str,
                       trapping: bool = False) -> str | None:  # fmt: skip
        """What on a vCPU could still run code in [lo, hi) (stop loop), or None.

        Its ip; with ``trapping``, a trap still to be dispatched (if its probe
        is gone it resumes at the int3's address); a context interrupted on it.
        """
        for vcpu in vcpus:
            if lo <= vcpu.ip < hi:
                return f"{TRANSIENT[0]} {vcpu.tid} is {where}"
            if trapping and vcpu.trapped is not None and lo <= vcpu.trapped < hi:
                return f"{TRANSIENT[0]} {vcpu.tid} is trapping on an int3 {where}"
            if vcpu.words is None or first_inside(vcpu.words, lo, hi) is not None:
                return f"{TRANSIENT[1]} {vcpu.tid} would return {where}"
        return None

    def _vcpu_views(self, stack_size: int) -> list[VcpuView]:
        """Every vCPU as the checks see it in this VM stop: registers and stacks read once."""
        out = []
        for tid in self.machine.vcpus:
            regs = self.machine.gdb.read_registers(tid)
            out.append(VcpuView(tid, self.arch.ip(regs), self.kp.arriving(regs), self._stack_words(regs, stack_size)))
        return out

    def _stack_words(self, regs: dict[str, int], stack_size: int) -> list[int] | None:
        """Where an interrupted context on this vCPU could return to: its stacks' words, sorted.

        An interrupt taken inside the region leaves its return address in a
        pt_regs frame: on the task's stack, or on the IRQ stack the vCPU runs on
        now.  The kernel waits for an RCU-tasks grace period instead; we look:
        every qword of the running stack and of the current task's stack that
        points strictly inside the region counts (a false match only delays).
        None: the stacks cannot be read (do not optimize now).
        """
        if self.arch.user_mode(regs):
            return []  # user mode: no kernel context is interrupted on this vCPU
        mem, sp = self.machine.mem, self.arch.sp(regs)
        # The running stack up to its first unmapped page, at most a stack's size above sp: a task's
        # stack is THREAD_SIZE-aligned, but an IRQ stack is vmapped only page-aligned (6.1's
        # map_irq_stack in arch/x86/kernel/irq_64.c), so its top can lie past sp's THREAD_SIZE boundary.
        # Both are vmapped with a guard page after them; without VMAP_STACK the words read past a
        # task stack's top are extra matches, which only delay.
        stacks = [(sp & ~7, (sp & ~7) + stack_size)]
        try:
            base = self.kp.kernel.current(self.arch.percpu_base(regs)).stack.value_()
            stacks.append((base, base + stack_size))
        except (QprobeError, drgn.FaultError):
            return None
        words: list[int] = []
        for i, (lo, hi) in enumerate(stacks):  # the running stack first
            try:
                data = mem.read(lo, hi - lo)
            except MemoryFault as exc:
                # The running stack ends at its guard page: its live part is all below it.
                if not (i == 0 and lo < exc.addr < hi):
                    return None
                try:
                    data = mem.read(lo, exc.addr - lo)
                except QprobeError:
                    return None
            except QprobeError:
                return None
            words += struct.unpack(f"<{len(data) // 8}Q", data)
        return sorted(words)

    def why_not_kept(self, point: ProbePoint) -> str | None:
        """Why an optimized point must go back to an int3 (a post_handler arrived, the knob is off)."""
        if not self.enabled:
            return "optimization is off"
        if any(kp.post_handler is not None for kp in point.probes):
            return "a probe there has a post_handler"
        if point.opt is not None and point.opt.kind != detour_kind(point):
            return "its probes' handlers changed"
        return None

    @staticmethod
    def transient(reason: str) -> bool:
        """Whether ``reason`` (from why_not) only holds for this moment: another attempt may succeed."""
        return reason.startswith(TRANSIENT)

    def optimize(self, point: ProbePoint) -> bool:
        why = point.not_optimized = self.why_not(point)
        if why is not None:
            log.debug("not optimizing %s: %s", point.where, why)
            return False
        self._ensure_stub()
        size = point.opt_size
        region = self.kp.original(point.addr, size)
        probe_id = self._free_ids.pop()
        self._retired.discard(probe_id)
        params = self._detour_params(point, probe_id, point.addr + size)
        scratch = self.kp.scratch
        detour, code, continue_addr = self.arch.arch_prepare_optimized_kprobe(params, region, point.addr,
                                                                              scratch.base, scratch.alloc)  # fmt: skip
        scratch.write(detour, code)
        for array, seen in self._counter_arrays():
            seen[probe_id] = self._read_counter(array, probe_id)
        # Swap the int3 for the jump while every vCPU is stopped.
        assert point.int3 is not None
        jmp = self.kp.repatch_text(point.int3, self.arch.arch_optimize_kprobes(point.addr, detour), "optjmp", detour)
        point.int3 = None
        fence = self.guest_blacklist.add(point.addr, point.addr + size)
        point.opt = Optimized(probe_id, detour, size, jmp, continue_addr, params.kind, params.tables, fence)
        self.kp.resume_targets[point.addr + size] = math.inf
        if self._round is not None:
            bisect.insort(self._round.resume_targets, point.addr + size)
        self.by_id[probe_id] = point
        return True

    def _detour_params(self, point: ProbePoint, probe_id: int, resume: int) -> DetourParams:
        """What ``point``'s detour needs: its kind, counters, stub, and a "keyed" detour's tables (allocated here)."""
        kind = detour_kind(point)
        counter, missed, lost = (array + probe_id * 8 for array in (self.counters, self.missed, self.lost))
        stub = self.stub
        if kind in RECORDING:
            assert self.records is not None
            stub = self.records.ensure(self.lost, self._percpu(), self._zero, DOORBELL_PORT)
        first = point.probes[0]
        params = DetourParams(kind, probe_id, resume, counter, missed, lost, stub=stub)
        if kind == "filtered":
            return dataclasses.replace(params, guest_filter=first.guest_filter)
        if kind == "keyed":
            spec = first.guest_key
            assert spec is not None
            table_bytes = self.arch.guest_map_size(spec) * len(self.machine.vcpus)
            tables = self.kp.scratch.alloc(table_bytes, align=4096)  # written by the guest: apart from code
            self._zero(tables, table_bytes)
            current, pid, _tgid, comm = self.kp.kernel.offsets
            return dataclasses.replace(params, guest_key=spec, tables=tables, task=(current, pid, comm),
                                       cpu_number=self.kp.kernel.percpu_offset("cpu_number"))  # fmt: skip
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
        self.kp.unpatch_text(opt.jmp)
        if opt.fence is not None:
            self.guest_blacklist.remove(opt.fence)
            self.kp.quarantine(opt.fence)
        point.opt = None
        self.by_id.pop(opt.probe_id, None)
        # A vCPU stopped inside the record stub publishes after this: recognise its id a while longer.
        self._retired.add(opt.probe_id)
        self._free_ids.insert(0, opt.probe_id)
        # A vCPU or an interrupted context may still be in the detour: never reuse it (nor its tables).
        self.kp.quarantine(opt.detour)
        if opt.tables:
            self.kp.quarantine(opt.tables)

    def _counter_arrays(self) -> tuple[tuple[int, dict[int, int]], ...]:
        """The guest's u64 arrays indexed by probe id, each with the values the host has folded so far."""
        return ((self.missed, self._missed_seen), (self.counters, self._counted_seen), (self.lost, self._lost_seen))

    def _read_counter(self, array: int, probe_id: int) -> int:
        assert self.ram is not None
        return self.ram.read_u64_phys(self.kp.scratch.phys_of(array + probe_id * 8))

    def _delta(self, array: int, seen: dict[int, int], probe_id: int) -> int:
        """How much the guest's counter ``array[probe_id]`` went up since it was last folded."""
        now = self._read_counter(array, probe_id)
        delta = now - seen.get(probe_id, now)
        seen[probe_id] = now
        return delta

    def sync_missed(self, point: ProbePoint, opt: Optimized | None = None) -> None:
        """Fold the guest's counters of an optimized probe (nmissed; in-guest hits, records) into its probes."""
        opt = opt or point.opt
        if opt is None or self.records is None:
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

    def sync_all(self) -> None:
        """Drain the rings once and fold every in-guest counter now (RAM reads, no VM stop)."""
        if self.records is None:
            return
        with self._fold_lock:
            self.records.drain()
            for point in list(self.by_id.values()):
                opt = point.opt
                if opt is not None and opt.kind != "mailbox":
                    self._fold(point, opt)
            if self.returns is not None:
                self.returns.fold_all()

    def _collect_loop(self) -> None:
        """While the VM runs (RAM reads, no stop): fold in-guest counters, drain the record rings."""
        while not self._stop:
            try:
                self.sync_all()
            except QprobeError as exc:
                self.errors.add(f"collector: {exc}")
            self._drain_now.wait(COLLECT_INTERVAL)
            self._drain_now.clear()


__all__ = ["Optimizer", "detour_kind"]
