"""Return probes (kretprobes), host side.

Once its entry is jump-optimized, a return probe's instances live in guest
RAM and the guest takes them itself (qprobe.arch.x86_64.retdetour): the
entry wakes nobody, and the return either counts in the guest (no handler) or
hands its registers to ``returned`` through the mailbox.  Until then, and for
probes with an entry_handler (which runs on the host at entry), the host does
it: at function entry an internal kprobe takes a free ``KretprobeInstance``,
saves the return address and replaces it with the address of a trampoline in
the scratch area (one breakpoint), where ``arch_prepare_kretprobe`` says it
is: a stack slot (x86) or a link register (arm64).  When the function returns
there, the dispatcher hands the hit to ``KretprobeManager.returned``, which
matches the instance by its frame (the stack pointer at the call's entry),
runs the handler and resumes at the real return address.  Matching by the
frame makes recursion, preemption and sleeping functions right: every live
call has its own.  A stack write is journaled like any patch, so an exit or
crash puts every real return address back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterable

from qprobe.core.kprobe import KPROBE_FLAG_DISABLED, Kretprobe, KretprobeInstance
from qprobe.core.kprobes import KprobeManager
from qprobe.core.regs import PtRegs
from qprobe.core.stubreturns import StubReturn, StubReturnInstance, StubReturns
from qprobe.errors import InvalidProbe, ProbeError, QprobeError
from qprobe.vmm.journal import Patch

log = logging.getLogger("qprobe.kretprobes")


class KretprobeManager:
    """Instances, the trampoline and its dispatch, on top of the kprobe table."""

    def __init__(self, kprobes: KprobeManager) -> None:
        self.kprobes = kprobes
        self.machine = kprobes.machine
        self.symbols = kprobes.symbols
        self.arch = kprobes.arch
        self.kernel = kprobes.kernel
        self.sites = kprobes.sites
        self.handlers = kprobes.handlers  # the one place handlers run
        self.dispatcher = kprobes.dispatcher
        self.trampoline = 0
        self.by_frame: dict[int, KretprobeInstance] = {}
        self.registered: set[Kretprobe] = set()
        # Anywhere: returns caught on stub breakpoints at the return address, the stack left alone.
        self.stub_returns = StubReturns(kprobes.stubs, kprobes.arch)
        self.stub_of: dict[Kretprobe, StubReturn] = {}  # anywhere kretprobes: their calls in flight
        kprobes.regs.add_return_fixer(self.fix_return)

    def fix_return(self, sp: int, value: int) -> int:
        """For the unwinder: the real return address behind a trampoline address ``value`` a frame returned to
        with stack pointer ``sp``."""
        if value and value == self.trampoline:  # an instance the host holds, keyed by its frame
            ri = self.by_frame.get(sp - self.arch.ret_pops)
            if ri is not None:
                return ri.ret_addr
        pools = self.kprobes.optimizer.returns
        real = pools.return_address(value) if pools is not None else None
        return value if real is None else real

    def live_instances(self, rp: Kretprobe) -> list[KretprobeInstance]:
        """The calls of ``rp`` in flight: instances the host holds and those taken in guest RAM."""
        out = list(rp.live.values())
        if rp in self.stub_of:
            out += [inst.data for inst in self.stub_of[rp].live]
        pools = self.kprobes.optimizer.returns
        if rp.pool is not None and pools is not None:
            for _i, slot, ret_addr, task in pools.instances(rp.pool):
                out.append(KretprobeInstance(rp, ret_addr, slot, self.kernel.snapshot(task), frame=slot))
        return out

    def default_maxactive(self) -> int:
        """The kernel's default: max(10, 2 * possible CPUs), whatever the preemption model (register_kretprobe
        in kernel/kprobes.c of 6.1 and 6.12; the CONFIG_PREEMPTION-only branch of older kernels is gone)."""
        return max(10, 2 * len(self.machine.vcpus))

    # -- registration ------------------------------------------------------------
    def register_kretprobe(self, rp: Kretprobe) -> None:
        kp = rp.kp
        if kp.registered:  # before anything below resets its instances
            raise InvalidProbe(f"{kp.where()} is already registered (EINVAL)")
        if self.kprobes.booting:
            # Entry and return stay on stub breakpoints after boot too: calls in flight then (kernel_init's,
            # a kthread's loop) return through the stub's return sites, matched by task and stack pointer,
            # where the trampoline path would find no instance of theirs.
            kp.anywhere = True
        addr = self.sites.kprobe_addr(kp)
        fn = self.symbols.function(addr)
        name = fn.name if fn else ""
        if name in self.arch.arch_kretprobe_blacklist():
            raise ProbeError(f"cannot return-probe {name}: it does not return to its caller")
        # kprobe_on_func_entry: the address itself must be a function's entry (sym+SIZE is the next one's).
        if fn is None or addr not in (fn.addr, fn.addr + self.sites.entry_skip(fn.addr)):
            raise InvalidProbe(f"{kp.where()} is not a function entry (EINVAL)")
        n = rp.maxactive or self.default_maxactive()
        if kp.anywhere:
            self._register_anywhere(rp, n)
            return
        rp.free = [KretprobeInstance(rp, data=bytearray(rp.data_size)) for _ in range(n)]
        kp.pre_handler = lambda _kp, regs: self._entry(rp, regs)

        def prepare() -> None:
            self._ensure_trampoline()
            opt = self.kprobes.optimizer
            # Instances in guest RAM serve a "retentry" detour alone: only where the entry can take a jump.
            jumps = opt.available and self.arch.optprobes is not None
            if jumps and opt.returns is not None and opt.stub_missing() is None and rp.entry_handler is None:
                rp.pool = opt.returns.alloc(rp, n)
                self._ensure_return_int3s()

        self.machine.call(prepare)
        try:
            self.kprobes.register_kprobe(kp)
        except BaseException:
            self.machine.call(lambda: self._retire(rp))  # the instance pool goes back
            raise
        self.registered.add(rp)

    def _register_anywhere(self, rp: Kretprobe, maxactive: int) -> None:
        """Entry and return on stub breakpoints (qprobe.core.stubreturns), keyed by the current task."""
        stub = StubReturn(self._task_key, lambda inst, pt: self._returned_anywhere(rp, inst, pt), maxactive)
        self.stub_of[rp] = stub
        rp.kp.pre_handler = lambda _kp, regs: self._entry_anywhere(rp, regs)
        self.stub_returns.register(stub)
        try:
            self.kprobes.register_kprobe(rp.kp)
        except BaseException:
            self.machine.call(lambda: self.stub_returns.unregister(stub))
            del self.stub_of[rp]
            raise
        self.registered.add(rp)

    def unregister_kretprobe(self, rp: Kretprobe) -> None:
        self.kprobes.unregister_kprobe(rp.kp)
        self._forget(rp)

    def kill_kretprobe(self, rp: Kretprobe) -> None:
        """``kill_kprobe`` of its entry probe (KprobeManager.kill_kprobe), its calls in flight put back."""
        self.kprobes.kill_kprobe(rp.kp)
        self._forget(rp)

    def _forget(self, rp: Kretprobe) -> None:
        stub = self.stub_of.pop(rp, None)
        if stub is not None:
            self.machine.call(lambda: self.stub_returns.unregister(stub))
        else:
            self.machine.call(lambda: self._retire(rp))
        self.registered.discard(rp)
        if not self.registered:
            self.machine.call(self._drop_trampoline)

    def _drop_trampoline(self) -> None:
        """No kretprobe left, and no call in flight that returns through the trampoline (the host holds every
        one, with no return pools in guest RAM): it goes, so that the trap hook need not stay for it alone.
        A hook kept only for it stops the VM at every kernel trap, and arm64's is its EL1 synchronous vector,
        which every kernel-mode fault and BRK (the guest's own kprobes') also enters."""
        if not self.trampoline or self.by_frame or self.kprobes.optimizer.returns is not None:
            return
        if self.kprobes.slots.trampolines.pop(self.trampoline, None) is not None:
            self.kprobes.scratch.free(self.trampoline)
            self.trampoline = 0
            if not self.kprobes.points:
                self.dispatcher.remove()

    def register_kretprobes(self, rps: Iterable[Kretprobe]) -> None:
        """All or nothing, as register_kprobes."""
        done: list[Kretprobe] = []
        try:
            for rp in rps:
                self.register_kretprobe(rp)
                done.append(rp)
        except BaseException:
            for rp in reversed(done):
                self.unregister_kretprobe(rp)
            raise

    def remove_all(self) -> None:
        for rp in list(self.registered):
            self.unregister_kretprobe(rp)

    def _ensure_trampoline(self) -> None:
        """An int3, or with the doorbell channel ``push 0; call stub; int3`` so returns need no stop.

        The int3 after the call is only reached when the CPU's mailbox was busy
        (an NMI inside a probe): that return then takes the stop-based path.
        """
        if self.trampoline and self.kprobes.scratch.mapped:
            return
        scratch, opt = self.kprobes.scratch, self.kprobes.optimizer
        scratch.ensure_mapped()
        self.trampoline = scratch.alloc(32)
        if opt.available and opt.stub_missing() is None:
            code = opt.trampoline_code(self.trampoline)
            scratch.write(self.trampoline, code)
            self.kprobes.slots.trampolines[self.trampoline + len(code) - 1] = self.returned
        else:
            scratch.write(self.trampoline, self.arch.breakpoint)
            self.kprobes.slots.trampolines[self.trampoline] = self.returned

    def _ensure_return_int3s(self) -> None:
        """The shared return code's int3s (a busy mailbox, a bad instance) finish the return on the stop path."""
        pools = self.kprobes.optimizer.returns
        assert pools is not None
        busy, bad = pools.int3s()
        self.kprobes.slots.trampolines[busy] = self.returned
        self.kprobes.slots.trampolines[bad] = self._returned_bad

    def _returned_bad(self, pt: PtRegs) -> tuple[int, Callable[[], None] | None]:
        """A return whose instance was not its own: the pushed index is still on the stack, the slot a word further."""
        pt.set_quietly("sp", pt.sp + 8)
        return self.returned(pt)

    def _retire(self, rp: Kretprobe) -> None:
        """Put back the real return address of every call still in flight.

        One in a register cannot be put back (the function may have saved it anywhere): its return
        still comes to the trampoline, where its instance, kept by its frame, sends it on unreported.
        """
        # A vCPU may already have returned into the trampoline: finish that first.
        self.dispatcher.drain()
        for frame, ri in list(rp.live.items()):
            del rp.live[frame]
            if ri.patch is not None:
                self._release(ri, restore=True)
        pools = self.kprobes.optimizer.returns
        if rp.pool is not None and pools is not None:
            pools.retire(rp)
            rp.pool = None

    def _release(self, ri: KretprobeInstance, restore: bool) -> None:
        if ri.patch is not None:
            current = self.machine.mem.read(ri.patch.virt, 8, None)
            if restore and current == ri.patch.new:
                self.machine.unpatch(ri.patch)
            else:
                self.machine.journal.forget_often(ri.patch.phys)
        if self.by_frame.get(ri.frame) is ri:  # (one whose entry failed was never there)
            del self.by_frame[ri.frame]
        ri.patch = None
        ri.task = None
        ri.data[:] = bytes(len(ri.data))
        ri.rp.free.append(ri)

    def _reclaim(self, rp: Kretprobe) -> None:
        """Recycle instances whose call can no longer return here (the task exited, the stack was reused)."""
        for frame, ri in list(rp.live.items()):
            if ri.patch is None:
                continue  # a return address in a register, saved where the function chose: nothing to read
            try:
                still = self.machine.mem.read(ri.stack_slot, len(ri.patch.new)) == ri.patch.new
            except QprobeError:
                still = False
            if not still:
                del rp.live[frame]
                self._release(ri, restore=False)

    # -- entry (a kprobe pre_handler, on the stop loop) ------------------------------
    def _entry(self, rp: Kretprobe, regs: PtRegs) -> int:
        if not rp.free:
            self._reclaim(rp)
        if not rp.free:
            rp.nmissed += 1
            return 0
        ri = rp.free.pop()
        try:
            ri.frame = regs.sp
            hijack = self.arch.arch_prepare_kretprobe(regs, regs.read_u64)
            ri.ret_addr, ri.stack_slot = hijack.ret_addr, hijack.slot or 0
            ri.task = self.kernel.snapshot(regs=regs.task_regs)
            if rp.entry_handler is not None:
                what = f"entry_handler of kretprobe {rp.kp.where()}"
                if self.handlers.call(rp, what, rp.entry_handler, ri, regs):
                    self._release(ri, restore=False)
                    return 0
            if hijack.slot is not None:
                ri.patch = self.machine.patch_data(hijack.slot, self.trampoline.to_bytes(8, "little"), "retaddr")
            else:
                assert hijack.register is not None
                setattr(regs, hijack.register, self.trampoline)  # written back with the resume
        except BaseException:  # a stack that cannot be read or written: the call goes unprobed, the instance back
            self._release(ri, restore=False)
            raise
        rp.live[ri.frame] = ri
        self.by_frame[ri.frame] = ri
        return 0

    # -- anywhere: entry and return on stub breakpoints --------------------------------------
    def _task_key(self, regs: PtRegs) -> Hashable:
        """Whose call it is: the current task (the per-CPU base where it cannot be read, early in boot)."""
        try:
            return self.kernel.current_address(regs.task_regs, regs.read_u64)
        except QprobeError:
            return ("percpu", regs.percpu_base)

    def _entry_anywhere(self, rp: Kretprobe, regs: PtRegs) -> int:
        stub = self.stub_of[rp]
        ri = KretprobeInstance(rp, data=bytearray(rp.data_size))
        inst = self.stub_returns.entered(stub, regs, ri)
        if inst is None:
            rp.nmissed += 1
            return 0
        ri.ret_addr, ri.frame = inst.ret_addr, regs.sp
        ri.task = self.kernel.snapshot(regs=regs.task_regs)
        if rp.entry_handler is not None:
            what = f"entry_handler of kretprobe {rp.kp.where()}"
            if self.handlers.call(rp, what, rp.entry_handler, ri, regs):
                self.stub_returns.discard(inst)
        return 0

    def _returned_anywhere(self, rp: Kretprobe, inst: StubReturnInstance, pt: PtRegs) -> None:
        rp.nreturns += 1
        if rp.handler is not None and not rp.kp.flags & KPROBE_FLAG_DISABLED:
            self.handlers.call(rp, f"handler of kretprobe {rp.kp.where()}", rp.handler, inst.data, pt)

    # -- return (the trampoline's int3, or its mailbox) ---------------------------------------------
    def returned(self, pt: PtRegs) -> tuple[int, Callable[[], None] | None]:
        """Run the handler of the instance whose call just returned; the real return address, and what to run
        once the vCPU's registers send it there (a qprobe.core.slots.Trampoline).

        Called from the dispatcher (a breakpoint trampoline: a qprobe.core.slots.Trampoline)
        or the doorbell thread; ``pt.sp`` is the stack pointer after the return, ``ret_pops``
        bytes above the call's frame.
        """
        frame = pt.sp - self.arch.ret_pops
        ri = self.by_frame.get(frame)
        pools = self.kprobes.optimizer.returns
        guest = None
        if ri is None and pools is not None:
            guest = pools.find(frame)
        if ri is None and guest is None:
            raise ProbeError(f"a return into the kretprobe trampoline with no instance for the frame {frame:#x}")
        if ri is None:
            assert guest is not None
            owner, index, ret_addr, task = guest
            if owner is None:  # unregistered while this call was in flight: no handler (as the kernel)
                assert pools is not None
                pools.free(index)
                return ret_addr, None
            ri = KretprobeInstance(
                owner, ret_addr, frame, self.kernel.snapshot(task), bytearray(owner.data_size), frame=frame
            )
        rp = ri.rp
        if guest is None and frame not in rp.live:  # retired in flight (_retire), unregistered: no handler
            self.by_frame.pop(frame, None)
            return ri.ret_addr, None
        rp.nreturns += 1
        # Where the ret went (the unwinder maps it back to the real return address while the instance is taken).
        layout = pools.ret if pools is not None else None
        pt.set_quietly("ip", self.trampoline if guest is None or layout is None else layout.trampoline(guest[1]))
        if rp.handler is not None and not rp.kp.flags & KPROBE_FLAG_DISABLED:
            self.handlers.call(rp, f"handler of kretprobe {rp.kp.where()}", rp.handler, ri, pt)
        ret_addr = ri.ret_addr
        if guest is not None:
            assert pools is not None
            pools.free(guest[1])
            return ret_addr, None
        rp.live.pop(frame, None)
        # The return address was consumed by the return: only forget the patch, and only once the vCPU's
        # registers send it to the real one: until then the journal's record is what sends a vCPU still on
        # the trampoline there, should qprobe be killed in between (qprobe.core.recovery).
        patch, ri.patch = ri.patch, None
        self._release(ri, restore=False)
        return ret_addr, None if patch is None else lambda: self._forget_patch(patch)

    def _forget_patch(self, patch: Patch) -> None:
        journal = self.machine.journal
        if journal.patches.get(patch.phys) is patch:  # not a later call's, at the same stack slot
            journal.forget_often(patch.phys)
