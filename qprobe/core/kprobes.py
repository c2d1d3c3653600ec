"""The architecture-neutral kprobes core, host side: probe table, aggregation,
per-vCPU control blocks, arming, and the #BP dispatcher.

Mirrors kernel/kprobes.c: ``register_kprobe`` resolves and checks
everything before it writes a byte (``_kprobe_addr``,
``check_kprobe_address_safe``), probes at one address share one int3 and one
out-of-line copy (the aggregate probe, ``aggr_pre_handler``), and a hit while
the same vCPU is already handling a probe only counts ``nmissed``.
"""

from __future__ import annotations

import enum
import functools
import logging
import struct
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from qprobe.arch.x86_64.decode import check_boundary
from qprobe.arch.x86_64.insn import (
    PreparedInsn,
    arch_adjust_kprobe_addr,
    emulate,
    is_endbr,
    prepare_kprobe,
    resume_singlestep,
    singlestep_done,
)
from qprobe.arch.x86_64.int3hook import PT_GPRS, PT_REGS_SIZE, parse_pt_regs, watch_site
from qprobe.core.blacklist import Blacklist
from qprobe.core.kprobe import KPROBE_FLAG_DISABLED, Kprobe
from qprobe.core.optimizer import RESUME_GRACE, Optimized, Optimizer
from qprobe.core.regs import PtRegs
from qprobe.errors import (
    Blacklisted,
    InvalidProbe,
    NotKernelText,
    ProbeError,
    QprobeError,
    SymbolError,
)
from qprobe.kernel.program import KernelData
from qprobe.kernel.reserved import ReservedText
from qprobe.target.gdbremote import WATCH_READ
from qprobe.target.journal import Patch
from qprobe.target.machine import Machine
from qprobe.target.scratch import ScratchArea

if TYPE_CHECKING:
    from qprobe.core.kretprobe import KretprobeManager

log = logging.getLogger("qprobe.kprobes")

INT3 = b"\xcc"
SLOT_SIZE = 32  # MAX_INSN_SIZE (16) + a 5-byte jmp back, rounded up
TF, RF = 0x100, 0x10000
MAX_STEP_RETRIES = 1 << 16
OPTIMIZE_DELAY = 0.05  # seconds the VM runs between arming the int3 and placing the jump
OPTIMIZE_RETRIES = 5  # attempts for a probe a vCPU was passing through at the moment of optimizing


class KprobeStatus(enum.Enum):
    """kprobe_ctlblk.kprobe_status."""

    IDLE = 0
    HIT_ACTIVE = 1
    HIT_SS = 2


@dataclass
class KprobeCtlblk:
    """Per-vCPU state (the kernel's per-CPU kprobe_ctlblk)."""

    status: KprobeStatus = KprobeStatus.IDLE
    current: ProbePoint | None = None


@dataclass
class ProbePoint:
    """All probes at one address: one int3, one slot (the kernel's aggregate kprobe)."""

    addr: int
    where: str
    prep: PreparedInsn
    probes: list[Kprobe] = field(default_factory=list)
    int3: Patch | None = None
    boosted: int = 0  # hits that ran the copy freely with a jmp back instead of a single-step
    opt: Optimized | None = None  # set while jump-optimized
    opt_size: int = 0
    not_optimized: str | None = None  # why the last attempt to optimize it failed
    optimizing: bool = False  # queued for the optimizer: hits are single-stepped, not boosted

    @property
    def armed(self) -> bool:
        return self.int3 is not None or self.opt is not None

    def wants_arming(self) -> bool:
        return any(not kp.disabled for kp in self.probes)


def find_watch_site(kernel: KernelData) -> tuple[int, frozenset[int]] | None:
    """(address of bp_desc.refs, where a vCPU is when QEMU reports poke_int3_handler's read of it), or None.

    None (the breakpoint hook is used) if this kernel has no such read in the
    shape qprobe.arch.x86_64.int3hook expects.
    """
    symbols = kernel.symbols
    if "bp_desc" not in symbols or "poke_int3_handler" not in symbols:
        return None
    try:
        refs = symbols.address("bp_desc") + kernel.type_offset("struct bp_patching_desc", "refs")
        fn = symbols.lookup("poke_int3_handler")
        code = kernel.mem.read(fn.addr, min(fn.size, 128))
    except QprobeError:
        return None
    safe = watch_site(code, fn.addr, refs)
    return None if safe is None else (refs, safe)


class KprobeManager:
    """Owns the probe table; every method that touches the guest runs on the stop loop."""

    def __init__(
        self,
        machine: Machine,
        kernel: KernelData,
        scratch: ScratchArea,
        int3_entry: str = "asm_exc_int3",
        fully_preemptible: bool = False,
    ) -> None:
        self.machine = machine
        self.symbols = symbols = kernel.symbols
        self.scratch = scratch
        self.blacklist = Blacklist(symbols)
        self.points: dict[int, ProbePoint] = {}
        self.ctlblk: dict[str, KprobeCtlblk] = {tid: KprobeCtlblk() for tid in machine.vcpus}
        self.vcpu_index = {tid: i for i, tid in enumerate(machine.vcpus)}
        self.enabled = True  # debugfs kprobes/enabled
        self.int3_entry = symbols.address(int3_entry)
        self._hooked = False
        # The int3 hook (see _hook): a watchpoint in poke_int3_handler when found (watch_refs set), else a
        # breakpoint on the #BP entry.
        self.watch_int3 = True
        self.watch_refs, self.watch_safe = 0, frozenset[int]()
        self._touched: set[int] = set()  # every address we ever put an int3 at
        self.passed_through = 0
        self.ntraps = 0  # int3 traps dispatched (each one a VM stop)
        self.handler_errors: list[str] = []
        # int3s in the scratch area that are not probes: the kretprobe trampoline.
        self.trampolines: dict[int, Callable[[str, dict[str, int], int, int], None]] = {}
        self.kernel = kernel  # the kernel's data through drgn
        self.extable = symbols.exception_table()
        self._fentry = symbols.address("__fentry__") if "__fentry__" in symbols else None  # CONFIG_FUNCTION_TRACER
        # Boosting lets a vCPU run the slot copy freely; an interrupt there leaves an
        # interrupted context inside the slot.  Without forced preemption that context
        # resumes as soon as the interrupt returns, which the grace period in
        # remove_all() covers; a fully preemptible kernel could sleep there, so it is
        # not boosted (the kernel waits for an RCU-tasks grace period instead).
        self.boost = not fully_preemptible
        self._quarantine: list[int] = []  # boosted slots and detours, never reused while the area is mapped
        # Where code in the scratch area jumps back into kernel text (boosted slots, detours), for as
        # long as the area is mapped: a vCPU or an interrupted context may still be on its way there.
        # address -> when it was last resumed to: time.monotonic() of a boosted hit, inf for a detour.
        self.resume_targets: dict[int, float] = {}
        # User handlers never run concurrently (the stop loop and the doorbell thread both call them).
        self.handler_lock = threading.RLock()
        self.optimizer: Optimizer | None = None
        self.kretprobes: KretprobeManager | None = None  # set by KretprobeManager

    # -- resolving and checking (no guest writes) -----------------------------
    def kprobe_addr(self, kp: Kprobe) -> int:
        """``_kprobe_addr``: the address the kernel's kprobe would have (its ``kp->addr``).

        ``sym+offset`` or ``addr+offset``, moved past an ``endbr64`` at a function's
        entry as ``arch_adjust_kprobe_addr`` does on IBT kernels (an indirect call
        must land on the ENDBR, so it stays in place).
        """
        if kp.symbol_name is not None:
            try:
                addr = self.symbols.address(kp.symbol_name) + kp.offset
            except SymbolError:
                raise SymbolError(f"unknown symbol {kp.symbol_name!r}: not in the kernel's symbol table") from None
        else:
            assert kp.addr is not None
            addr = kp.addr + kp.offset
        fn = self.symbols.function(addr)
        if fn is not None:
            addr, _ = arch_adjust_kprobe_addr(self.original(fn.addr, 4), fn.addr, addr - fn.addr)
        return addr

    def entry_skip(self, fn_addr: int) -> int:
        """Bytes at a function's start that are not its entry for probes: 4 for an ENDBR, else 0."""
        return 4 if is_endbr(self.original(fn_addr, 4)) else 0

    def ftrace_site(self, addr: int) -> bool:
        """Whether ``addr`` is a ``call __fentry__`` site of vmlinux.

        Those 5 bytes belong to the guest's ftrace: boot turns each into a NOP,
        and its function tracer or its own kprobe_events on a function entry
        (ftrace-based on x86) turn it back into a call, after checking that the
        bytes are what ftrace left there (``ftrace_verify_code``; anything else
        is an ``ftrace_bug`` that disables the guest's ftrace).  So qprobe never
        writes there: a probe on such a site is armed on the next instruction,
        where the registers are the same (a NOP ran in between), as the
        kernel's own probes there run from ftrace with ``[FTRACE]`` in its list.
        """
        if self._fentry is None:
            return False
        try:
            linked = self.symbols.file_bytes(addr, 5)
        except QprobeError:
            return False
        return linked[0] == 0xE8 and addr + 5 + int.from_bytes(linked[1:], "little", signed=True) == self._fentry

    def check_kprobe_address_safe(self, addr: int) -> tuple[str, int, bytes]:
        """(sym+off text, function start, function bytes) or a ProbeError saying why not."""
        where = self.symbols.symbolize(addr)
        if not self.symbols.is_text(addr):
            raise NotKernelText(f"{where} ({addr:#x}) is not in kernel text")
        bad = self.blacklist.lookup(addr)
        if bad is not None:
            raise Blacklisted(f"{where} is blacklisted ({bad.name}): probing it would break the trap path")
        reserved = self.reserved.conflict(addr, addr)
        if reserved is not None:
            raise InvalidProbe(f"{where} is reserved ({reserved}): the kernel rewrites it at run time (EINVAL)")
        fn = self.symbols.function(addr)
        if fn is None:
            raise NotKernelText(f"{addr:#x} is not inside a known kernel function")
        code = self.machine.mem.read(fn.addr, fn.size)
        return where, fn.addr, code

    @functools.cached_property
    def reserved(self) -> ReservedText:
        """Jump-label, static-call and BUG sites (check_kprobe_address_safe refuses them)."""
        try:
            bug_entry = self.kernel.prog.type("struct bug_entry").size
        except (QprobeError, LookupError):
            bug_entry = None  # no debug info: BUG sites are not known
        return ReservedText(self.symbols, lambda a, n: self.machine.mem.read(a, n), bug_entry)

    def patched(self) -> dict[int, int]:
        """address -> original byte of everything we changed in kernel text."""
        out = {a: p.int3.old[0] for a, p in self.points.items() if p.int3 is not None}
        for p in self.points.values():
            if p.opt is not None:
                out.update({p.addr + i: b for i, b in enumerate(p.opt.jmp.old)})
        return out

    def original(self, addr: int, size: int) -> bytes:
        """Kernel text as it was before qprobe touched it."""
        patched = self.patched()
        return bytes(patched.get(addr + i, b) for i, b in enumerate(self.machine.mem.read(addr, size)))

    def quarantine(self, addr: int) -> None:
        self._quarantine.append(addr)

    def _regions(self, addr: int) -> list[ProbePoint]:
        """Optimized points whose displaced instructions cover ``addr`` (other than at their start)."""
        return [p for p in self.points.values() if p.opt is not None and p.addr < addr < p.addr + p.opt.size]

    # -- registration ------------------------------------------------------------
    def register_kprobe(self, kp: Kprobe, optimize: bool = True) -> None:
        if kp.registered:
            raise InvalidProbe(f"{kp.where()} is already registered (EINVAL)")
        kp.at = self.kprobe_addr(kp)
        addr = kp.at + 5 if self.ftrace_site(kp.at) else kp.at
        self.machine.call(lambda: self._register(kp, addr))
        if optimize:
            self.optimize_later([addr])

    def optimize_later(self, addrs: Iterable[int]) -> None:
        """The kernel's delayed optimizer: int3 first, a grace period, then the jump.

        While queued a point's hits are not boosted, so that after the grace period
        no context can be inside its copy on the way back into the region.
        """
        opt = self.optimizer
        if opt is None or not opt.enabled:
            return
        queued = todo = list(addrs)

        def queue(on: bool) -> None:
            for a in queued:
                point = self.points.get(a)
                if point is not None:
                    point.optimizing = on

        def work() -> list[int]:
            retry = []
            for a in todo:
                point = self.points.get(a)
                if point is None or point.opt is not None or not point.armed or opt.optimize(point):
                    continue
                if point.not_optimized is not None and opt.transient(point.not_optimized):
                    retry.append(a)
            return retry

        self.machine.call(lambda: queue(True))
        try:
            time.sleep(max(OPTIMIZE_DELAY, RESUME_GRACE))
            # A vCPU inside a region (or a context interrupted there) only delays its jump: try again.
            for _ in range(OPTIMIZE_RETRIES):
                todo = self.machine.call(work)
                if not todo:
                    return
                time.sleep(OPTIMIZE_DELAY)
        finally:
            self.machine.call(lambda: queue(False))

    def _register(self, kp: Kprobe, addr: int) -> None:
        point = self.points.get(addr)
        for other in self._regions(addr):
            self.optimizer.unoptimize(other)  # type: ignore[union-attr]
            self._sync(other)
        if point is None:
            where, fn_start, code = self.check_kprobe_address_safe(addr)
            patched = self.patched()
            check_boundary(code, fn_start, addr, patched=patched, name=where.split("+")[0])
            if not self.scratch.mapped:
                self.scratch.map()
            slot = self.scratch.alloc(SLOT_SIZE)
            try:
                prep = prepare_kprobe(self.original(addr, 16), addr, slot, where=where,
                                      exception_table=self.extable)  # fmt: skip
                if prep.copy:
                    self.scratch.write(slot, prep.boosted_copy() if prep.boostable else prep.copy)
            except BaseException:
                self.scratch.free(slot)
                raise
            point = ProbePoint(addr, where, prep)
            self.points[addr] = point
        point.probes.append(kp)
        kp.registered = True
        kp.addr = addr if kp.symbol_name is None else kp.addr
        kp.resolved = addr
        self._sync(point)

    def resync(self, kp: Kprobe, change: Callable[[], None] | None = None) -> None:
        """Re-arm a registered probe's point as its handlers, recorder or guest key now need.

        ``change``, if given, runs first in the same VM stop (so that no hit falls between it and the re-arm).
        """
        addr = kp.resolved

        def work() -> None:
            if change is not None:
                change()
            if kp.registered and addr in self.points:
                self._sync(self.points[addr])

        self.machine.call(work)
        if kp.registered and addr in self.points:
            self.optimize_later([addr])

    def register_kprobes(self, kps: Iterable[Kprobe]) -> None:
        """All or nothing: on an error, the ones already registered are unregistered."""
        done: list[Kprobe] = []
        try:
            for kp in kps:
                self.register_kprobe(kp, optimize=False)
                done.append(kp)
        except BaseException:
            for kp in reversed(done):
                self.unregister_kprobe(kp)
            raise
        # One grace period and one VM stop place every jump (the kernel's batched optimizer).
        self.optimize_later([kp.resolved for kp in done])

    def unregister_kprobe(self, kp: Kprobe) -> None:
        if not kp.registered:
            raise InvalidProbe(f"{kp.where()} is not registered")
        addr = kp.resolved
        self.machine.call(lambda: self._unregister(kp))
        if addr in self.points:  # the others there may be optimizable now
            self.optimize_later([addr])

    def unregister_kprobes(self, kps: Iterable[Kprobe]) -> None:
        for kp in list(kps):
            if kp.registered:
                self.unregister_kprobe(kp)

    def _unregister(self, kp: Kprobe) -> None:
        addr = kp.resolved
        point = self.points[addr]
        if self.optimizer is not None:
            self.optimizer.sync_missed(point)
        point.probes.remove(kp)
        kp.registered = False
        self._sync(point)
        if not point.probes:
            if point.opt is not None:
                self.optimizer.unoptimize(point)  # type: ignore[union-attr]
            del self.points[addr]
            if point.boosted:
                self._quarantine.append(point.prep.slot_addr)
            else:
                self.scratch.free(point.prep.slot_addr)
        if not self.points:
            self._unhook()

    def enable_kprobe(self, kp: Kprobe) -> None:
        self._set_disabled(kp, False)

    def disable_kprobe(self, kp: Kprobe) -> None:
        self._set_disabled(kp, True)

    def _set_disabled(self, kp: Kprobe, disabled: bool) -> None:
        if not kp.registered:
            kp.flags = (kp.flags | KPROBE_FLAG_DISABLED) if disabled else (kp.flags & ~KPROBE_FLAG_DISABLED)
            return

        def change() -> None:
            kp.flags = (kp.flags | KPROBE_FLAG_DISABLED) if disabled else (kp.flags & ~KPROBE_FLAG_DISABLED)
            self._sync(self.points[kp.resolved])

        self.machine.call(change)
        if not disabled:
            self.optimize_later([kp.resolved])  # as the kernel's arm_kprobe: int3 first, then the jump

    def set_enabled(self, on: bool) -> None:
        """debugfs kprobes/enabled: arm or disarm everything, keeping each probe's own state."""

        def change() -> None:
            self.enabled = on
            for point in self.points.values():
                self._sync(point)

        self.machine.call(change)
        if on:
            self.optimize_later(list(self.points))

    # -- arming (stop-loop thread) -----------------------------------------------
    def _sync(self, point: ProbePoint) -> None:
        if point.opt is not None and self.optimizer is not None:
            self.optimizer.sync_missed(point)  # count the hits so far for the probes as they were
        want = self.enabled and point.wants_arming()
        if point.opt is not None and (not want or self.optimizer is None or self.optimizer.why_not_kept(point)):
            self.optimizer.unoptimize(point)  # type: ignore[union-attr]
        if want and not point.armed:
            self._hook()
            self._touched.add(point.addr)
            point.int3 = self.machine.patch(point.addr, INT3, "int3", point.prep.slot_addr)
        elif not want and point.int3 is not None:
            self.machine.unpatch(point.int3)
            point.int3 = None

    def _hook(self) -> None:
        """Hear of every guest int3: a read watchpoint in the #BP handler if it can be found, else a breakpoint.

        See qprobe.arch.x86_64.int3hook: a watchpoint stop costs the guest no
        re-translation, a breakpoint stop does.
        """
        if self._hooked:
            return
        site = self.watch_site()
        if site is not None:
            self.watch_refs, self.watch_safe = site
            self.machine.gdb.insert_breakpoint(self.watch_refs, WATCH_READ, 4)
            self.machine.watch_handlers[self.watch_refs] = self._on_int3_watch
            self.machine.after_stop = self._lost_traps
        else:
            self.machine.gdb.insert_breakpoint(self.int3_entry)
            self.machine.stop_handlers[self.int3_entry] = self._on_int3
        self._hooked = True

    def watch_site(self) -> tuple[int, frozenset[int]] | None:
        return find_watch_site(self.kernel) if self.watch_int3 else None

    def drain(self) -> None:
        """Finish every hit a vCPU is part way into, so the hook and the scratch area can go.

        A vCPU can be stopped on the #BP entry with one of our traps pending, or
        about to execute a trampoline's int3; left alone after the hook is
        gone, the guest's own #BP handler would see an int3 it does not know.
        """
        for tid in self.machine.vcpus:
            regs = self.machine.gdb.read_registers(tid)
            if regs["rip"] == self.int3_entry and not self.watch_refs:
                self._on_int3(tid, regs)
            elif self.watch_refs and regs["rip"] in self.watch_safe:
                self._on_int3_watch(tid, regs)
            elif regs["rip"] in self.trampolines:
                self.trampolines[regs["rip"]](tid, regs, regs["rsp"], regs["eflags"])

    def _unhook(self, final: bool = False) -> None:
        """Remove the hook once nothing of ours can trap.

        The watchpoint hook hears of a trap some thirty instructions after the
        int3 ran, so it stays until ``remove_all`` (``final``), after its grace
        period: a vCPU between an int3 we have just removed and the watched
        read must still be sent back to the original instruction.
        """
        if not self._hooked or self.trampolines or (self.watch_refs and not final):
            return
        self.drain()
        if self.watch_refs:
            self.machine.gdb.remove_breakpoint(self.watch_refs, WATCH_READ, 4)
            del self.machine.watch_handlers[self.watch_refs]
            self.machine.after_stop = None
            self.watch_refs, self.watch_safe = 0, frozenset()
        else:
            self.machine.gdb.remove_breakpoint(self.int3_entry)
            del self.machine.stop_handlers[self.int3_entry]
        self._hooked = False

    def remove_all(self, grace: float = 0.1) -> None:
        """Unregister every probe, then unmap the scratch area (exit path).

        Between the two the VM runs for ``grace`` seconds with no probe armed,
        so that a context interrupted inside a boosted copy has returned to it
        and left it; vCPUs still inside the area are then stepped out.
        """

        def disarm() -> None:
            for point in list(self.points.values()):
                for kp in list(point.probes):
                    self._unregister(kp)
            if self._hooked:
                self.drain()

        def unmap() -> None:
            self.evacuate()
            if self.optimizer is not None:
                self.optimizer.close()
            self.trampolines.clear()
            self._unhook(final=True)
            self.scratch.unmap()
            self._quarantine.clear()
            self.resume_targets.clear()

        self.machine.call(disarm)
        if self._quarantine and self.scratch.mapped:
            time.sleep(grace)
        self.machine.call(unmap)

    def evacuate(self) -> None:
        """Step every vCPU whose ip is inside the scratch area until it is out (stop loop)."""
        gdb = self.machine.gdb
        for tid in self.machine.vcpus:
            for _ in range(100_000):  # a vCPU in the optimized stub spins until served
                rip = gdb.read_registers(tid)["rip"]
                if not self.scratch.contains(rip) or rip in self.trampolines:
                    break
                gdb.step(tid)
            else:
                raise ProbeError(f"vCPU {tid} did not leave the scratch area")

    # -- the dispatcher (stop-loop thread) ---------------------------------------------
    def _write_regs(self, tid: str, values: dict[str, int]) -> None:
        self.machine.gdb.write_registers(tid, values)

    def _on_int3(self, tid: str, regs: dict[str, int]) -> None:
        """The breakpoint hook: the vCPU stopped on the #BP entry, the hardware frame at rsp."""
        ret_ip, cs, rflags, rsp, _ss = struct.unpack("<5Q", self.machine.mem.read(regs["rsp"], 40))
        if not self._ours(ret_ip - 1, cs):
            self._pass_through(tid)
            return
        self._trap(tid, regs, ret_ip - 1, rflags, rsp)

    def _on_int3_watch(self, tid: str, regs: dict[str, int]) -> None:
        """The watchpoint hook: the vCPU is inside poke_int3_handler, the trap's pt_regs at rdi.

        Any other read of the watched word (text_poke_bp's own) and any int3
        not ours just continue, untouched.  For ours, every register goes back
        to the trapped context's and the trap is handled as at the int3.
        """
        if regs["rip"] not in self.watch_safe:
            return
        pt = parse_pt_regs(self.machine.mem.read(regs["rdi"], PT_REGS_SIZE))
        if not self._ours(pt["rip"] - 1, pt["cs"]):
            return
        gprs = {name: pt[name] for name in PT_GPRS}
        self._write_regs(tid, gprs)
        self._trap(tid, {**regs, **gprs}, pt["rip"] - 1, pt["eflags"], pt["rsp"])

    def _lost_traps(self, handled: str | None) -> None:
        """Handle the traps of vCPUs that wait right after the watched read without a stop of their own.

        QEMU 7.2 reports one stop at a time: when a vCPU's debug stop comes
        together with another (a second vCPU's, or our own interrupt), it is
        dropped, and a watchpoint (unlike a breakpoint) does not fire again when
        that vCPU goes on.  So after every stop, any vCPU sitting right after
        the read is handled here (``handled``, whose stop was just dispatched,
        is not looked at again; if a dropped stop does come later, its ip has
        moved and it is ignored).
        """
        for tid in self.machine.vcpus:
            if tid == handled:
                continue
            regs = self.machine.gdb.read_registers(tid)
            if regs["rip"] in self.watch_safe:
                self._on_int3_watch(tid, regs)

    def _ours(self, addr: int, cs: int) -> bool:
        """Whether an int3 at ``addr`` (from code segment ``cs``) is one of our traps."""
        if cs & 3:
            return False
        point = self.points.get(addr)
        return addr in self.trampolines or (point is not None and point.armed) or (
            addr in self._touched and self.machine.mem.read(addr, 1) != INT3)  # fmt: skip

    def _trap(self, tid: str, regs: dict[str, int], addr: int, rflags: int, rsp: int) -> None:
        """One of our int3s at ``addr`` trapped; ``regs`` are the context's (ip and sp aside)."""
        self.ntraps += 1
        tramp = self.trampolines.get(addr)
        if tramp is not None:
            tramp(tid, regs, rsp, rflags)
            return
        point = self.points.get(addr)
        if point is None or not point.armed:
            # Our int3 was removed after this vCPU executed it but before we saw
            # the trap: back up and run the original instruction (as the kernel does).
            self._write_regs(tid, {"rip": addr, "rsp": rsp, "eflags": rflags})
            return
        pt = self.make_regs(regs, tid)
        # Undo the trap: the state is exactly the one before the int3.
        pt.set_quietly("ip", addr)
        pt.set_quietly("sp", rsp)
        pt.set_quietly("flags", rflags)
        ctl = self.ctlblk[tid]
        if ctl.status is not KprobeStatus.IDLE:
            for kp in point.probes:
                kp.nmissed += 1
            self._execute(point, pt, None)
            return
        ctl.status, ctl.current = KprobeStatus.HIT_ACTIVE, point
        try:
            self._execute(point, pt, ctl)
        finally:
            ctl.status, ctl.current = KprobeStatus.IDLE, None

    def make_regs(self, values: dict[str, int], tid: str) -> PtRegs:
        """pt_regs for a handler; its stack traces see through kretprobe trampolines."""
        return PtRegs(values, tid, self.vcpu_index[tid], self.machine.mem, self.symbols, self.kernel,
                      fix_return=self.kretprobes.fix_return if self.kretprobes else None)  # fmt: skip

    def _pass_through(self, tid: str) -> None:
        """Somebody else's int3: let the guest's own #BP handler have it."""
        self.passed_through += 1
        # A gdb breakpoint sits on the entry; stepping executes its first instruction.
        self.machine.gdb.step(tid)

    def _execute(self, point: ProbePoint, pt: PtRegs, ctl: KprobeCtlblk | None) -> None:
        active = [kp for kp in point.probes if not kp.disabled] if ctl is not None else []
        if self.run_pre_handlers(active, pt):
            # A pre_handler changed ip and asked to skip the instruction.
            self._write_regs(pt.tid, {"rsp": pt.sp, "eflags": pt.flags, **pt.dirty(), "rip": pt.ip})
            return
        prep = point.prep
        if prep.emulate is not None:
            emulate(prep, pt, _StackWriter(self.machine, pt))
            self._post_handlers(active, pt)
            self._write_regs(pt.tid, {"rsp": pt.sp, "eflags": pt.flags, **pt.dirty(), "rip": pt.ip})
            return
        if self.boost and prep.boostable and not point.optimizing and not any(kp.post_handler for kp in active):
            # The kprobe-booster: the copy in the slot is followed by a jmp back,
            # so the vCPU just runs it: one VM stop per hit instead of two.  Not while the
            # point waits to be optimized: the jump back would land inside the jump.
            point.boosted += 1
            self.resume_targets[point.addr + prep.insn.length] = time.monotonic()
            self._write_regs(pt.tid, {**pt.dirty(), "rip": prep.slot_addr, "rsp": pt.sp, "eflags": pt.flags})
            return
        if ctl is not None:
            ctl.status = KprobeStatus.HIT_SS
        self._single_step(point, pt, active)

    def _single_step(self, point: ProbePoint, pt: PtRegs, active: list[Kprobe]) -> None:
        prep, gdb, tid = point.prep, self.machine.gdb, pt.tid
        self._write_regs(tid, {**pt.dirty(), "rip": prep.slot_addr, "rsp": pt.sp, "eflags": pt.flags & ~(TF | RF)})
        for _ in range(MAX_STEP_RETRIES):
            gdb.step(tid)
            after = gdb.read_registers(tid)
            # QEMU with MTTCG sometimes reports a step that executed nothing, and a
            # rep-prefixed instruction stops after each iteration: step again.
            if singlestep_done(prep, after["rip"]):
                break
        else:
            raise ProbeError(f"single-step of {point.where} never left the slot")
        post = self.make_regs(after, tid)
        ip = after["rip"]
        if prep.resume_fixes_ip and not prep.slot_addr <= ip <= prep.slot_addr + len(prep.copy):
            self._step_faulted(point, post, active)
            return
        resume_singlestep(prep, post)
        post.mark_clean()
        self._post_handlers(active, post)
        self._write_regs(tid, {**post.dirty(), "rip": post.ip})

    def _step_faulted(self, point: ProbePoint, post: PtRegs, active: list[Kprobe]) -> None:
        """The copy raised an exception: make the guest see it at the original address.

        As kprobe_fault_handler does for KPROBE_HIT_SS: the exception frame's
        ip is moved from the slot back to the probe address, so the kernel's
        fixup (exception tables) and oops reports see the real text.
        """
        prep = point.prep
        lo, hi = prep.slot_addr, prep.slot_addr + len(prep.copy)
        for off in (0, 8):  # with and without an error code
            frame_ip = int.from_bytes(self.machine.mem.read(post.sp + off, 8), "little")
            if lo <= frame_ip <= hi:
                phys = self.machine.mem.virt_to_phys(post.sp + off)
                self.machine.write_phys(phys, (point.addr + frame_ip - lo).to_bytes(8, "little"))
                break
        exc = ProbeError(f"the out-of-line copy of {point.where} faulted (guest exception at {post.symbolize()})")
        for kp in active:
            kp.nfaults += 1
            self._call_fault_handler(kp, post, exc)

    # -- handlers (user code) --------------------------------------------------------
    def run_pre_handlers(self, active: list[Kprobe], pt: PtRegs) -> bool:
        with self.handler_lock:
            return self._pre_handlers(active, pt)

    def _pre_handlers(self, active: list[Kprobe], pt: PtRegs) -> bool:
        """aggr_pre_handler: every enabled probe's pre_handler; True to skip the step."""
        skip = False
        for kp in active:
            kp.nhit += 1
            if kp.pre_handler is None:
                continue
            ip = pt.ip
            try:
                ret = kp.pre_handler(kp, pt)
            except Exception as exc:
                self._handler_failed(kp, pt, exc, "pre_handler")
                continue
            if ret and pt.ip != ip:
                skip = True
        return skip

    def _post_handlers(self, active: list[Kprobe], pt: PtRegs) -> None:
        with self.handler_lock:
            self._post_handlers_locked(active, pt)

    def _post_handlers_locked(self, active: list[Kprobe], pt: PtRegs) -> None:
        for kp in active:
            if kp.post_handler is None:
                continue
            try:
                kp.post_handler(kp, pt)
            except Exception as exc:
                self._handler_failed(kp, pt, exc, "post_handler")

    def _handler_failed(self, kp: Kprobe, pt: PtRegs, exc: Exception, which: str) -> None:
        kp.nfaults += 1
        line = f"{which} of {kp.where()} raised {type(exc).__name__}: {exc}"
        if len(kp.errors) < 100:
            kp.errors.append(line)
        if len(self.handler_errors) < 1000:
            self.handler_errors.append(line)
        log.warning("%s\n%s", line, "".join(traceback.format_exception(exc)[-3:]))
        self._call_fault_handler(kp, pt, exc)

    def _call_fault_handler(self, kp: Kprobe, pt: PtRegs, exc: BaseException) -> None:
        if kp.fault_handler is None:
            return
        try:
            kp.fault_handler(kp, pt, exc)
        except Exception as inner:
            log.warning("fault_handler of %s raised %s: %s", kp.where(), type(inner).__name__, inner)

    # -- listing -------------------------------------------------------------------
    def list_probes(self, sync: bool = True) -> str:
        """The debugfs kprobes/list format."""
        if sync and self.optimizer is not None:
            for point in self.points.values():
                self.optimizer.sync_missed(point)
        lines = []
        for addr in sorted(self.points):
            point = self.points[addr]
            for kp in point.probes:
                flags = ("[GONE]" if kp.gone else "") + ("[DISABLED]" if kp.disabled and not kp.gone else "")
                if not self.enabled and not kp.disabled:
                    flags += "[DISABLED]"
                if point.opt is not None:
                    flags += "[OPTIMIZED]"
                elif point.not_optimized is not None and point.armed:
                    flags += f"  (not optimized: {point.not_optimized})"
                kind = "r" if kp.kretprobe is not None else "k"
                at, where = addr, point.where
                if kp.at != addr:  # moved off an __fentry__ site: listed where asked, as the kernel's [FTRACE]
                    at, where, flags = kp.at, self.symbols.symbolize(kp.at), "[FTRACE]" + flags
                lines.append(f"{at:016x}  {kind}  {where}    {flags}".rstrip())
        return "\n".join(lines) + ("\n" if lines else "")


class _StackWriter:
    """Memory for the emulator: reads through the task's tables, writes through the stub."""

    def __init__(self, machine: Machine, pt: PtRegs) -> None:
        self.machine = machine
        self.pt = pt

    def read(self, addr: int, size: int) -> bytes:
        return self.pt.read(addr, size)

    def write(self, addr: int, data: bytes) -> None:
        phys = self.machine.mem.virt_to_phys(addr, self.pt._pgd)
        if (phys & 0xFFF) + len(data) > 0x1000:
            head = 0x1000 - (phys & 0xFFF)
            self.write(addr, data[:head])
            self.write(addr + head, data[head:])
            return
        self.machine.write_phys(phys, data)
