"""Put a guest back after a qprobe that died with probes armed (crash, SIGKILL).

Everything qprobe wrote is in the journal; what the journal cannot say is
where the vCPUs were when it died.  A vCPU may be trapped on one of our
int3s (stopped on the #BP entry), returning through the kretprobe
trampoline, inside a slot (boosted, or between a trap-step's two int3s),
or spinning in the optimized-probe stub
for an answer that will never come.  Each is moved to where it would have
been without qprobe (or answered and stepped out), the text and return
addresses are restored, the VM runs for a grace period with nothing of ours
left to enter, and only then is the scratch area unmapped (on a fully
preemptible kernel, once no sleeping task's stack points into it either:
qprobe.kernel.preempted).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from qprobe.arch import Arch, Resume, ResumeKind, TrapHook
from qprobe.core.uguest import finish_left
from qprobe.errors import QprobeError
from qprobe.kernel.features import find_watch_site, thread_size, trap_entry, trap_path
from qprobe.kernel.preempted import PREEMPTED_WAIT, first_inside, preempted_words, wait_preempted_out
from qprobe.kernel.program import KernelData
from qprobe.vmm.journal import Journal, JournalError, Patch
from qprobe.vmm.scratch import SIZE as SCRATCH_SIZE
from qprobe.vmm.transport import GdbTransport

log = logging.getLogger("qprobe.recovery")
GRACE = 0.1
LATER = ("uconsumer", "guestcall")  # the scratch area's own records: put back after the guest calls


class _Recovery:
    def __init__(self, gdb: GdbTransport, kernel: KernelData, arch: Arch, patches: list[Patch],
                 meta: dict[str, int]) -> None:  # fmt: skip
        symbols = kernel.symbols
        self.gdb, self.mem, self.arch, self.meta = gdb, kernel.mem, arch, meta
        self.kernel = kernel
        self.entry = trap_entry(symbols, arch)
        # With the watchpoint hook a trap is taken back from poke_int3_handler (see Dispatcher.install);
        # a vCPU on its way there from the #BP entry is stepped up to it.
        site = find_watch_site(kernel, arch)
        self.watch_safe = site[1] if site else frozenset()
        self.on_the_way = trap_path(symbols, arch)
        self.int3s = {p.virt: p for p in patches if p.what == "int3"}
        self.retaddrs = {p.virt: int.from_bytes(p.old, "little") for p in patches if p.what == "retaddr"}
        tramp = next((int.from_bytes(p.new, "little") for p in patches if p.what == "retaddr"), None)
        # Where a vCPU stands on the trampoline's int3: its first byte, or with the doorbell channel the one
        # after the mailbox call (KretprobeManager._ensure_trampoline); either way with the return's sp.
        self.trampolines: frozenset[int] = frozenset()
        if tramp is not None:
            size = len(arch.guest_ram.return_trampoline(tramp, tramp)) if arch.guest_ram is not None else 1
            self.trampolines = frozenset({tramp, tramp + size - 1})
        pmds = sorted(p.virt for p in patches if p.what == "pmd")  # 2 MiB each, contiguous
        self.scratch = pmds[0] if pmds else None
        self.scratch_size = len(pmds) * SCRATCH_SIZE
        self.guest = self.guest_instances()

    def from_slot(self, ip: int, flags: int) -> tuple[int, int] | None:
        """(ip, flags) in the text for a vCPU at ``ip`` in one of our slots (see ``arch_slot_resume``)."""
        for p in self.int3s.values():
            if p.slot:
                back = self.arch.arch_slot_resume(p.slot, p.virt, ip, flags)
                if back is not None:
                    return back
        return None

    def in_scratch(self, ip: int) -> bool:
        return self.scratch is not None and self.scratch <= ip < self.scratch + self.scratch_size

    def guest_instances(self) -> dict[int, tuple[int, int]]:
        """Kretprobe instances taken in guest RAM: stack slot -> (trampoline, real return address)."""
        meta, layouts = self.meta, self.arch.guest_ram
        if "instances" not in meta or layouts is None:
            return {}
        self.gdb.set_physical(True)
        phys = meta["scratch_phys"] + meta["instances"] - meta["scratch"]
        raw = self.gdb.read_memory(phys, meta["ninstances"] * layouts.instance_size)
        layout = layouts.return_layout(meta["instances"], meta["ninstances"], meta["ret_trampolines"], 0, 0, 0)
        return {slot: (layout.trampoline(i), ret) for i, slot, ret, _task in layouts.parse_instances(raw)}

    def real_return(self, slot: int) -> int | None:
        """The return address a trampoline stands for in the call whose return address stack ``slot`` held
        (instances of the host's or the guest's)."""
        if slot in self.retaddrs:
            return self.retaddrs[slot]
        return self.guest[slot][1] if slot in self.guest else None

    def restore_guest_stacks(self) -> int:
        """Put back every return address the guest replaced with an instance's trampoline."""
        restored = 0
        for slot, (tramp, ret) in self.guest.items():
            try:
                if self.mem.read_u64(slot) != tramp:
                    continue  # already returned, or the stack is gone
                phys = self.mem.virt_to_phys(slot)
            except QprobeError:
                continue
            self.gdb.set_physical(True)
            self.gdb.write_memory(phys, ret.to_bytes(8, "little"))
            restored += 1
        return restored

    def take_back(self, tid: str, regs: dict[str, int]) -> dict[str, int]:
        """A vCPU trapped on one of our int3s, inside the #BP handler: put it back on the int3's address."""
        arch = self.arch
        for _ in range(64):
            ip = arch.ip(regs)
            if ip in self.watch_safe or not any(lo <= ip < hi for lo, hi in self.on_the_way):
                break
            self.gdb.step(tid)
            regs = self.gdb.read_registers(tid)
        if arch.ip(regs) in self.watch_safe:
            trap = arch.traps.decode_trap(TrapHook.WATCH, regs, self.mem.read)
            slot = None if trap.user else self.from_slot(trap.addr, trap.flags)
            if not trap.user and (trap.addr in self.int3s or slot is not None):
                # On the int3 itself, or on the one after a trap-step's copy: the copy ran, so on past it.
                ip, flags = slot or (trap.addr, trap.flags)
                self.resume_at(tid, ip, trap.sp, flags, trap.restore)
                return self.gdb.read_registers(tid)
            ret = self.retaddrs.get(trap.sp - arch.ret_pops)
            if not trap.user and trap.addr in self.trampolines and ret is not None:
                self.resume_at(tid, ret, trap.sp, trap.flags, trap.restore)
                return self.gdb.read_registers(tid)
        return regs

    def rewind(self, tid: str) -> None:
        arch = self.arch
        regs = self.gdb.read_registers(tid)
        if self.watch_safe and (self.int3s or self.trampolines):
            regs = self.take_back(tid, regs)
        pc, sp = arch.ip(regs), arch.sp(regs)
        frame = sp - arch.ret_pops  # a return's, had it just returned into a trampoline
        if pc == self.entry:
            trap = arch.traps.decode_trap(TrapHook.ENTRY, regs, self.mem.read)
            slot = self.from_slot(trap.addr, trap.flags)
            if trap.addr in self.int3s or slot is not None:
                ip, flags = slot or (trap.addr, trap.flags)
                self.resume_at(tid, ip, trap.sp, flags)
            elif trap.addr in self.trampolines and trap.sp - arch.ret_pops in self.retaddrs:
                self.resume_at(tid, self.retaddrs[trap.sp - arch.ret_pops], trap.sp, trap.flags)
        elif pc in self.trampolines and frame in self.retaddrs:
            self.resume_at(tid, self.retaddrs[frame])
        elif self.guest.get(frame, (None,))[0] == pc:  # about to enter its instance's trampoline
            self.resume_at(tid, self.guest[frame][1])
        else:
            slot = self.from_slot(pc, arch.flags(regs))
            if slot is not None:
                ip, flags = slot
                self.resume_at(tid, ip, flags=flags)

    def resume_at(self, tid: str, ip: int, sp: int | None = None, flags: int | None = None,
                  restore: Mapping[str, int] | None = None) -> None:  # fmt: skip
        """Send a vCPU on at ``ip``: the one place recovery writes a vCPU's registers."""
        self.gdb.write_registers(
            tid, self.arch.resume_registers(Resume(ResumeKind.CONTINUE, ip, sp, flags, restore or {}))
        )

    def answer_mailbox(self, cpu: int) -> None:
        """Release a vCPU waiting in the stub: resume at its detour's continue label."""
        layouts = self.arch.guest_ram
        if "mailboxes" not in self.meta or layouts is None:
            return
        mb = self.meta["scratch_phys"] + self.meta["mailboxes"] - self.meta["scratch"] + cpu * layouts.mailbox_size
        self.gdb.set_physical(True)
        req = layouts.read_mailbox(lambda off, size: self.gdb.read_memory(mb + off, size))
        if req is None:
            return
        cont = req.continue_addr
        if req.probe_id == layouts.trampoline_id:
            # A return waiting for its handler: resume at the real return address, not the int3 after the call.
            cont = self.real_return(req.final_sp - self.arch.ret_pops) or cont
        for off, data in layouts.mailbox_answer({}, cont, req.final_sp):
            self.gdb.write_memory(mb + off, data)

    def preempted_inside(self) -> str | None:
        """What could still resume in the area: a sleeping task whose stack points into it; or None."""
        if self.scratch is None:
            return None
        try:
            words = preempted_words(self.kernel, thread_size(self.kernel))
        except QprobeError as exc:
            return f"the tasks' stacks cannot be read: {exc}"  # cannot tell yet
        hit = first_inside(words, self.scratch, self.scratch + self.scratch_size)
        return None if hit is None else f"a preempted task's stack holds {hit:#x}"

    def let_run(self, vcpus: list[str]) -> None:
        """Run the guest a moment: contexts interrupted (or preempted) inside the area return to the kernel
        text; then step out the vCPUs still in it."""
        self.gdb.cont()
        time.sleep(GRACE)
        self.gdb.interrupt()
        self.gdb.wait_stop()
        for cpu, tid in enumerate(vcpus):
            self.evacuate(tid, cpu)

    def evacuate(self, tid: str, cpu: int) -> None:
        for _ in range(100_000):
            ip = self.arch.ip(self.gdb.read_registers(tid))
            if not self.in_scratch(ip):
                return
            if ip in self.trampolines or self.from_slot(ip, 0) is not None:
                # Stepped, a copy in a slot would run on into the int3 after it, which no one handles now.
                self.rewind(tid)
                continue
            self.answer_mailbox(cpu)
            self.gdb.step(tid)
        raise RuntimeError(f"vCPU {tid} did not leave the scratch area")


def check_journal_matches(gdb: GdbTransport, journal: Journal, patches: list[Patch]) -> None:
    """Refuse, before anything is written, a journal whose bytes the guest does not hold.

    Every place the journal lists must hold qprobe's bytes or the original
    ones (already put back); anything else means the journal is not about
    this guest as it is now, and restoring from it would corrupt it.  Return
    addresses on stacks are not checked: the call may have returned since.
    """
    gdb.set_physical(True)
    for p in patches:
        if p.what == "retaddr":
            continue
        now = gdb.read_memory(p.phys, len(p.new))
        if now not in (p.new, p.old):
            raise JournalError(
                f"the undo journal {journal.path} does not match this guest: {p.what} at {p.virt:#x} holds "
                f"{now.hex()}, neither qprobe's {p.new.hex()} nor the original {p.old.hex()}; nothing was restored "
                "(if the guest was rebooted since, delete the file)"
            )


def _restore(gdb: GdbTransport, patches: list[Patch]) -> int:
    """The old bytes back wherever qprobe's are still there, the latest patch first; how many."""
    restored = 0
    gdb.set_physical(True)
    for p in reversed(patches):
        if gdb.read_memory(p.phys, len(p.new)) == p.new:
            gdb.write_memory(p.phys, p.old)
            restored += 1
    return restored


def recover(gdb: GdbTransport, kernel: KernelData, arch: Arch, journal: Journal,
            fully_preemptible: bool = False) -> int:  # fmt: skip
    """Undo an earlier qprobe's patches in this guest; returns how many were undone.

    Its gdbstub breakpoints and watchpoints are gone already: the connect took out every one it found
    (gdbremote.drop_stale_breakpoints).
    """
    patches = journal.load()
    if not patches:
        journal.clear()
        return 0
    check_journal_matches(gdb, journal, patches)
    r = _Recovery(gdb, kernel, arch, patches, journal.left_meta)
    vcpus = gdb.threads()
    for tid in vcpus:
        r.rewind(tid)
    restored = 0
    # The guest's own uprobes hold consumers in the scratch area: taken out by guest calls once the text is
    # the kernel's again (the VM runs for them), before the area goes.
    later = [p for p in patches if p.what in LATER]
    restored += _restore(gdb, [p for p in patches if p.what != "pmd" and p.what not in LATER])
    restored += r.restore_guest_stacks()
    pmd = [p for p in patches if p.what == "pmd"]
    if pmd:
        for cpu, tid in enumerate(vcpus):
            r.evacuate(tid, cpu)
        restored += finish_left(gdb, kernel, arch, patches)
        restored += _restore(gdb, later)
        r.let_run(vcpus)
        held = wait_preempted_out(r.preempted_inside, lambda: r.let_run(vcpus)) if fully_preemptible else None
        if held is not None:
            raise QprobeError(f"qprobe's scratch area stays mapped: after {PREEMPTED_WAIT:g} s {held}")
        restored += _restore(gdb, pmd)
    log.warning("restored %d patch(es) an earlier qprobe left in this guest", restored)
    journal.clear()
    return restored
