"""Whether a point may take its jump now: the kernel's can_optimize and what else a jump must wait for.

The checks read the probe table and the vCPUs in one VM stop; a round of the
optimizer (qprobe.core.optqueue) reads the vCPUs once for every point it checks
(``RoundView``).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import struct
import time
from typing import TYPE_CHECKING, Protocol

import drgn

from qprobe.arch import Arch
from qprobe.core.fence import GuestBlacklist
from qprobe.core.point import ProbePoint
from qprobe.core.text import KernelText
from qprobe.errors import MemoryFault, QprobeError, SymbolError
from qprobe.kernel.features import thread_size
from qprobe.kernel.preempted import first_inside, preempted_words

if TYPE_CHECKING:
    from qprobe.core.dispatch import Dispatcher
    from qprobe.core.sites import ProbeSites
    from qprobe.core.slots import InsnSlots
    from qprobe.kernel.program import KernelData
    from qprobe.kernel.symbols import Symbols
    from qprobe.vmm.machine import Machine
    from qprobe.vmm.scratch import ScratchArea

# Reasons that hold only at the moment of the attempt (their texts start with these).
TRANSIENT = ("vCPU", "a context interrupted on vCPU", "a boosted copy", "a preempted task")
# Seconds after its last entry that a boosted copy may still hold a context interrupted inside it
# (the same grace KprobeManager.remove_all gives before unmapping).
RESUME_GRACE = 0.1


def transient(reason: str) -> bool:
    """Whether ``reason`` (from a jump check) only holds for this moment: another attempt may succeed."""
    return reason.startswith(TRANSIENT)


class JumpTable(Protocol):
    """What the checks read of the kprobes core (qprobe.core.kprobes.KprobeManager): its parts, and every
    probed address."""

    arch: Arch
    machine: Machine
    kernel: KernelData
    symbols: Symbols
    scratch: ScratchArea
    text: KernelText
    sites: ProbeSites
    dispatcher: Dispatcher
    slots: InsnSlots

    def addresses(self) -> list[int]: ...


@dataclasses.dataclass
class VcpuView:
    """One vCPU as the jump checks see it during one VM stop (nothing moves until the VM runs again)."""

    tid: str
    ip: int
    trapped: int | None  # a trap still to be dispatched: the int3's address (Dispatcher.arriving)
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
    resume_targets: list[int]  # InsnSlots.resume_targets' addresses, sorted (kept so as jumps are placed)


class JumpCheck:
    """The region checks of a jump (stop loop): its code, the probes and text around it, the vCPUs, the tasks."""

    def __init__(self, table: JumpTable, guest_blacklist: GuestBlacklist) -> None:
        self.kp = table
        self.arch = table.arch
        self.machine = table.machine
        self.kernel = table.kernel
        self.symbols = table.symbols
        self.text = table.text
        self.sites = table.sites
        self.dispatcher = table.dispatcher
        self.slots = table.slots
        self.guest_blacklist = guest_blacklist
        self._thread_size = 0  # the kernel's THREAD_SIZE, once looked up (stack_size)
        # Fully preemptible kernels: the sleeping tasks' live stack words, read once per VM stop that needs them.
        self.preempted: list[int] | None = None
        self.round: RoundView | None = None  # while a round runs (begin_round)

    def begin_round(self) -> None:
        """A round of checks in one VM stop starts: what they read is read once for all of them."""
        self.preempted = None  # the tasks have run since the last round
        self.round = self._view()

    def _view(self) -> RoundView:
        return RoundView(None, self.kp.addresses(), sorted(self.slots.resume_targets))

    @property
    def stack_size(self) -> int:
        """The kernel's THREAD_SIZE, looked up once (SymbolError where the kernel does not tell)."""
        if not self._thread_size:
            self._thread_size = thread_size(self.kernel)
        return self._thread_size

    def why_not(self, point: ProbePoint) -> str | None:
        """None if the jump at the armed ``point`` can displace its instructions now, else the reason.

        On success ``point.opt_size`` is the number of bytes the jump displaces.
        """
        opt = self.arch.optprobes
        assert opt is not None  # Optimizer.why_not refused the point otherwise
        fn = self.symbols.function(point.addr)
        if fn is None:
            return "not in a known function"
        code = self.machine.mem.read(fn.addr, fn.size)
        why, size = opt.arch_check_optimized_kprobe(code, fn.addr, point.addr, self.symbols.exception_table(),
                                                    self.text.patched(), fn.name)  # fmt: skip
        if why is not None:
            return why
        end = point.addr + size
        reserved = self.sites.reserved.conflict(point.addr + 1, end - 1)
        if reserved is not None:  # copy_optimized_instructions' *_text_reserved checks
            return f"the displaced instructions hold {reserved}"
        view = self.round or self._view()
        if first_inside(view.points, point.addr + 1, end) is not None:
            return "another probe lies in the region"
        theirs = self.guest_blacklist.kprobes_in(point.addr + 1, end)
        if theirs:
            return f"the guest kernel's own kprobe at {self.symbols.symbolize(theirs[0])} lies in the region"
        now = time.monotonic()
        targets = view.resume_targets
        i, j = bisect.bisect_right(targets, point.addr), bisect.bisect_left(targets, end)
        returned = [self.slots.resume_targets[a] for a in targets[i:j]]  # when something last jumped back there
        if any(t == math.inf for t in returned):
            # A detour (perhaps already removed) jumps back there.
            return "out-of-line code returns into the region"
        if any(now - t < RESUME_GRACE for t in returned):
            return f"{TRANSIENT[2]} returning into the region ran {RESUME_GRACE} s ago or less"
        if (point.addr & 0xFFF) + opt.jump_size > 0x1000:
            return "the jump would cross a page"
        for tid, back in self.dispatcher.trap_step_returns().items():
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
        if self.slots.fully_preemptible:
            try:
                if self.preempted is None:
                    self.preempted = preempted_words(self.kernel, stack_size)
            except QprobeError as exc:
                return f"{TRANSIENT[3]} cannot be ruled out inside the region: {exc}"
            hit = first_inside(self.preempted, point.addr + 1, end)
            if hit is not None:
                return f"{TRANSIENT[3]}'s stack holds {hit:#x}, inside the region"
            # A task preempted in a boosted copy jumps back into the region when it runs again.
            scratch = self.kp.scratch
            if any(point.addr < a < end for a in self.slots.resume_targets) and scratch.mapped:
                hit = first_inside(self.preempted, scratch.base, scratch.base + scratch.mapped_size)
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
            words = preempted_words(self.kernel, stack_size)
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
            trapped = self.dispatcher.arriving(regs)
            out.append(VcpuView(tid, self.arch.ip(regs), trapped, self._stack_words(regs, stack_size)))
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
            base = self.kernel.current(regs).stack.value_()
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
