"""x86_64 as the core sees it: the :class:`qprobe.arch.Arch` object, over the modules of this package.

Each method is the x86 half of a kernel hook (arch/x86/kernel/kprobes/
core.c) or of qprobe's host-side additions; the work is done by the modules
it names.  The optional facets are classes of their own, wired here: the
int3 single-step (:class:`X86TrapStep`), jump optimization
(``opt.X86OptProbes``), the guest-RAM layouts (``guestram.X86GuestRam``)
and user-space probes (``uprobes.X86Uprobes``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import cast

from iced_x86 import Mnemonic

from qprobe.arch import (
    ArchBlacklist,
    Boot,
    BreakHook,
    CycleCounter,
    ExceptionTable,
    FtraceSite,
    GuestCall,
    GuestRam,
    Memory,
    OptProbes,
    PageTables,
    Prepared,
    RegisterLayout,
    Registers,
    Resume,
    ResumeKind,
    ReturnHijack,
    Trap,
    TrapHook,
    Traps,
    TrapStep,
    TrapWatch,
    Uprobes,
)
from qprobe.arch.shared import resume_registers
from qprobe.arch.x86_64 import guestfilter
from qprobe.arch.x86_64.boost import CALL_INSN_SIZE, INT3_INSN_OPCODE, JMP32_INSN_SIZE, call_target
from qprobe.arch.x86_64.bootentry import X86Boot
from qprobe.arch.x86_64.decode import check_boundary, decode_one
from qprobe.arch.x86_64.emulate import Regs, emulate
from qprobe.arch.x86_64.guestcall import X86GuestCall
from qprobe.arch.x86_64.guestram import X86GuestRam
from qprobe.arch.x86_64.hpet import hpet_timer
from qprobe.arch.x86_64.insn import (
    MAX_INSN_SIZE,
    SLOT_SIZE,
    TRAP_COPY,
    PreparedInsn,
    arch_adjust_kprobe_addr,
    is_endbr,
    prepare_emulation,
    prepare_kprobe,
    resume_singlestep,
    resume_trap_step,
    trap_copy_start,
)
from qprobe.arch.x86_64.int3hook import watch_site
from qprobe.arch.x86_64.opt import X86OptProbes
from qprobe.arch.x86_64.paging import KERNEL_IMAGE_BASE, X86PageTables, page_tables
from qprobe.arch.x86_64.ptregs import (
    ARG_REGS,
    DISPLAY,
    FLAG_BITS,
    GDB_NAME,
    HW_FRAME_SIZE,
    KERNEL_CS,
    KERNEL_DS,
    PLAIN,
    PT_GPRS,
    PT_NAMES,
    PT_REGS_SIZE,
    X86_EFLAGS_IF,
    X86_EFLAGS_RF,
    X86_EFLAGS_TF,
    parse_hw_frame,
    parse_pt_regs,
)
from qprobe.arch.x86_64.tsc import after_rdtsc, native_sched_clock, tsc_hz
from qprobe.arch.x86_64.uprobes import X86Uprobes
from qprobe.errors import CannotProbe, MemoryFault

# Functions whose return address must not be replaced: __switch_to returns on another task's
# stack (the kernel's kretprobe_blacklist, arch/x86/kernel/kprobes/core.c before 5.18 and
# kernel/kprobes.c's arch-independent list since), and these never return.
KRETPROBE_BLACKLIST = frozenset({
    "__switch_to", "do_exit", "do_group_exit", "make_task_dead", "panic", "kthread_exit",
    "rewind_stack_and_make_dead", "__x64_sys_exit", "__x64_sys_exit_group", "machine_restart",
    "emergency_restart", "__stack_chk_fail", "__ubsan_handle_builtin_unreachable", "start_kernel",
    "cpu_startup_entry", "do_task_dead", "__do_sys_exit", "__do_sys_exit_group", "usercopy_abort",
})  # fmt: skip

# Thunks by the names arch/x86/lib/retpoline.S and arch/x86/entry/thunk_64.S give them (the thunk
# sections have no start/end symbols on every config): the return thunks (__x86_return_thunk,
# call_depth_/its_/srso_/retbleed_return_thunk), the retpolines (__x86_indirect_{,call_,jump_,its_}
# thunk_*), the untraining sequences and the THUNK-macro wrappers the kernel marks NOKPROBE
# (preempt_schedule{,_notrace}_thunk, warn_thunk_thunk).
THUNKS = re.compile(r"__x86_return_thunk|\w+_return_thunk|__x86_indirect_\w*thunk_\w+|\w*untrain_ret"
                    r"|srso_\w*safe_ret\w*|preempt_schedule\w*_thunk|warn_thunk_thunk")  # fmt: skip


# The #BP entry: asm_exc_int3 since Linux 5.8's IDTENTRY rework of the x86 entry code
# ("x86/entry: Convert INT3 exception to IDTENTRY_RAW"); plain int3 before.
TRAP_ENTRIES = ("asm_exc_int3", "int3")
# What a vCPU runs from the #BP entry up to the read poke_int3_handler makes of the text_poke_bp
# descriptor (the watchpoint hook's site); the names of 5.8 and later.
TRAP_PATH = ("asm_exc_int3", "error_entry", "exc_int3", "poke_int3_handler")
# ``bp_desc`` is text_poke_bp's descriptor with a ``refs`` count in the 6.1 and 6.12 kernels qprobe
# is tested on (arch/x86/kernel/alternative.c; older kernels reached it through a pointer).
# Where a vCPU is when QEMU reports that read: int3hook.watch_site.
TRAP_WATCH = TrapWatch("bp_desc", "struct bp_patching_desc", "refs", "poke_int3_handler", watch_site)
# native_sched_clock() is cycles_2_ns(rdtsc()) on a usable TSC (arch/x86/kernel/tsc.c); after its
# rdtsc, edx:eax hold the counter just read.  The host times a VM stop by the HPET.
TSC = CycleCounter("native_sched_clock", after_rdtsc,
                   lambda regs: (regs["rdx"] & 0xFFFFFFFF) << 32 | regs["rax"] & 0xFFFFFFFF,
                   native_sched_clock, tsc_hz, hpet_timer)  # fmt: skip


def _insn(prep: Prepared) -> PreparedInsn:
    """The core hands back what arch_prepare_kprobe returned: a PreparedInsn."""
    assert isinstance(prep, PreparedInsn)
    return prep


def _regs(regs: Registers) -> Regs:
    """The core's registers answer every pt_regs field by name, as x86's emulator reads them."""
    return cast(Regs, regs)


class X86TrapStep:
    """The int3 single-step (Linux 5.14+): a slot's int3-terminated copies (insn.TRAP_COPY), run with IF off."""

    def is_trap_step_start(self, prep: Prepared, ip: int) -> bool:
        """Whether ``ip`` is where a trap-step's copy starts (the vCPU has not run it yet)."""
        return trap_copy_start(_insn(prep), ip) == ip

    def is_trap_step_end(self, prep: Prepared, addr: int) -> bool:
        """Whether ``addr`` is the int3 after one of the copies a trap-step runs."""
        insn = _insn(prep)
        start = trap_copy_start(insn, addr)
        return start is not None and addr == start + insn.insn.length

    def arch_resume_trap_step(self, prep: Prepared, regs: Registers) -> None:
        resume_trap_step(_insn(prep), _regs(regs))


class X86Traps:
    """The #BP entry, which only int3 enters, and the trapped context a stop there or in poke_int3_handler has."""

    trap_entries: tuple[str, ...] = TRAP_ENTRIES
    trap_path: tuple[str, ...] = TRAP_PATH

    def kprobe_break_hook(self, regs: Mapping[str, int]) -> BreakHook | None:
        """Every stop on the #BP entry is an int3, as exc_int3 is the #BP vector's alone (a fault enters at its
        own vector); kprobe_int3_handler tells a probe's from the one after a trap-stepped copy by address."""
        return BreakHook.KPROBE

    def decode_trap(self, hook: TrapHook, regs: Mapping[str, int], read: Callable[[int, int], bytes]) -> Trap:
        """The trapped context of a stop on the #BP entry or in poke_int3_handler (see int3hook)."""
        if hook is TrapHook.ENTRY:
            frame = parse_hw_frame(read(regs["rsp"], HW_FRAME_SIZE))
            return Trap(frame["rip"] - 1, frame["rsp"], frame["eflags"], regs, user=bool(frame["cs"] & 3))
        pt = parse_pt_regs(read(regs["rdi"], PT_REGS_SIZE))
        gprs = {name: pt[name] for name in PT_GPRS}
        return Trap(pt["rip"] - 1, pt["rsp"], pt["eflags"], {**regs, **gprs}, gprs, user=bool(pt["cs"] & 3))


class X86_64:
    """The x86_64 implementation of :class:`qprobe.arch.Arch`."""

    name = "x86_64"
    gdb_architecture = "i386:x86-64"
    breakpoint = bytes([INT3_INSN_OPCODE])
    # kprobe_int3_handler hands pre_handlers regs->ip past the int3 (arch/x86/kernel/kprobes/core.c).
    kprobe_ip_offset = 1
    ret_pops = 8  # at a function's entry the return address ``call`` pushed is at rsp; ``ret`` pops it
    slot_size = SLOT_SIZE  # the copy and a jmp back, then the two int3-terminated copies (insn.SLOT_SIZE)
    registers = RegisterLayout(GDB_NAME, ARG_REGS, {"cs": KERNEL_CS, "ss": KERNEL_DS}, general=guestfilter.GPRS,
                               irq_flag=X86_EFLAGS_IF, page_table="cr3", percpu_base="gs_base",
                               system=("cr4", "k_gs_base", "cr0"),
                               retval="ax", stack_args=8, current_percpu="current_task", syscall_nr="orig_ax",
                               pt_regs=PT_NAMES, unwound=(*PT_GPRS, "rip", "rsp"),
                               display=DISPLAY, flag_bits=FLAG_BITS, plain=PLAIN)  # fmt: skip
    # Annotated as Arch declares them: a protocol's attributes are settable, so their types must match.
    ftrace_site: FtraceSite | None = FtraceSite("__fentry__", CALL_INSN_SIZE, call_target)
    drgn_architecture = "X86_64"
    traps: Traps = X86Traps()
    boot: Boot = X86Boot()
    # Every optional facet: x86 has them all.
    trap_step: TrapStep | None = X86TrapStep()
    trap_watch: TrapWatch | None = TRAP_WATCH
    optprobes: OptProbes | None = X86OptProbes()
    guest_ram: GuestRam | None = X86GuestRam()
    uprobes: Uprobes | None = X86Uprobes()
    cycle_counter: CycleCounter | None = TSC
    guest_call: GuestCall | None = X86GuestCall()

    def page_tables(self, regs: Mapping[str, int]) -> X86PageTables:
        return page_tables(regs)

    def vmcoreinfo(self, address: Callable[[str], int], virt_to_phys: Callable[[int], int],
                   read_u64: Callable[[int], int], paging: PageTables) -> list[str]:  # fmt: skip
        """arch/x86/kernel/machine_kexec_64.c's lines.

        swapper_pg_dir is init_top_pgt (#define in pgtable_64.h), and phys_base is where the image
        was loaded minus where it was linked to load: __pa_symbol(x) = x - __START_KERNEL_map + phys_base.
        """
        text = address("_text")
        phys_base = virt_to_phys(text) - (text - KERNEL_IMAGE_BASE)  # printed signed, as VMCOREINFO_NUMBER does
        return [f"SYMBOL(swapper_pg_dir)={address(X86PageTables.kernel_root_symbol):x}",
                f"NUMBER(phys_base)={phys_base}", f"NUMBER(pgtable_l5_enabled)={int(paging.levels == 5)}"]  # fmt: skip

    # -- instructions (core.c) -------------------------------------------------------------
    def arch_adjust_kprobe_addr(self, func_code: bytes, func_start: int, offset: int) -> int:
        return arch_adjust_kprobe_addr(func_code, func_start, offset)[0]

    def entry_skip(self, func_code: bytes) -> int:
        """Bytes at a function's start that are not its entry for probes: an ENDBR's 4, else 0."""
        return 4 if is_endbr(func_code) else 0

    def check_boundary(self, code: bytes, func_start: int, addr: int, patched: Mapping[int, int], name: str) -> None:
        check_boundary(code, func_start, addr, patched=patched, name=name)

    def arch_prepare_kprobe(
        self, code: bytes, addr: int, slot: int, where: str, exception_table: ExceptionTable | None
    ) -> PreparedInsn:
        return prepare_kprobe(code, addr, slot, where=where, exception_table=exception_table)

    def arch_slot_code(self, prep: Prepared) -> bytes:
        """The slot: the copy (with a jump back if it may be boosted), then the int3-terminated copies."""
        return _insn(prep).slot_code()

    def arch_setup_resume(self, prep: Prepared, regs: Registers, mem: Memory, may_boost: bool,
                          may_trap_step: bool) -> Resume:  # fmt: skip
        """setup_singlestep(): emulate on the host, boost, or run the copy out of line (to an int3, or stepped)."""
        insn, pt = _insn(prep), _regs(regs)
        if insn.emulate is not None:
            emulate(insn, pt, mem)
            return Resume(ResumeKind.CONTINUE, pt.ip, pt.sp, pt.flags, regs.dirty())
        if may_boost and insn.boostable:
            # The kprobe-booster: the copy in the slot is followed by a jmp back, so the vCPU
            # just runs it: one VM stop per hit instead of two.
            return Resume(ResumeKind.BOOST, insn.slot_addr, pt.sp, pt.flags, regs.dirty(),
                          jump_back=insn.addr + insn.insn.length)  # fmt: skip
        if insn.if_modifier:
            emulate(insn, pt, mem, "ifmodifier")
            return Resume(ResumeKind.CONTINUE, pt.ip, pt.sp, pt.flags, regs.dirty())
        flags = pt.flags & ~(X86_EFLAGS_TF | X86_EFLAGS_RF)
        if may_trap_step and insn.trap_copies:
            # The int3 single-step (Linux 5.14+): the copy runs with interrupts off, as the kernel's
            # does, so that nothing can preempt or migrate the task before its int3 traps back; the
            # copy chosen says whether IF goes back on then.
            start = insn.slot_addr + TRAP_COPY[bool(flags & X86_EFLAGS_IF)]
            return Resume(ResumeKind.TRAP_STEP, start, pt.sp, flags & ~X86_EFLAGS_IF, regs.dirty())
        # The gdbstub steps the copy; TF and RF stay clear so that the guest sees neither.
        return Resume(ResumeKind.STEP, insn.slot_addr, pt.sp, flags, regs.dirty())

    def arch_slot_resume(self, slot: int, addr: int, ip: int, flags: int) -> tuple[int, int] | None:
        """(ip, flags) in the text for a vCPU at ``ip`` in the slot at ``slot`` of the probe at ``addr``.

        For recovery, which knows the slot but not the instruction: every copy
        in the slot is at the same offset from its start as ``ip`` from the
        probed address, and the second int3-terminated copy runs for a
        context whose interrupts were on.
        """
        off = ip - slot
        if not 0 <= off < SLOT_SIZE:
            return None
        starts = (0, *TRAP_COPY)
        start = max(s for s in starts if s <= off)
        return addr + off - start, flags | (X86_EFLAGS_IF if start == TRAP_COPY[1] else 0)

    def step_left_slot(self, prep: Prepared, ip: int) -> bool:
        """Whether a step that should end in the slot ended elsewhere (the copy faulted)."""
        insn = _insn(prep)
        return insn.resume_fixes_ip and not insn.slot_addr <= ip <= insn.slot_addr + len(insn.copy)

    def arch_resume_singlestep(self, prep: Prepared, regs: Registers, mem: Memory) -> None:
        resume_singlestep(_insn(prep), _regs(regs), mem)

    def arch_fault_fixup(self, prep: Prepared, regs: Registers, mem: Memory) -> bool:
        """As kprobe_fault_handler does for KPROBE_HIT_SS: the exception frame's ip moves from the slot
        back to the probe address, so the kernel's fixup (exception tables) and oops reports see the real text.
        """
        lo, hi, sp = prep.slot_addr, prep.slot_addr + len(prep.copy), regs.sp
        for off in (0, 8):  # with and without an error code
            frame_ip = int.from_bytes(mem.read(sp + off, 8), "little")
            if lo <= frame_ip <= hi:
                mem.write(sp + off, (prep.addr + frame_ip - lo).to_bytes(8, "little"))
                break
        return True

    def arch_emulate_in_place(self, regs: Registers, mem: Memory) -> bool:
        """The kprobes' host emulations (calls, jumps, returns), and no-ops (a function's ``__fentry__`` site),
        on the bytes at ip now: the kernel may have rewritten them since the probe was placed.  ENDBR is stepped:
        under IBT the CPU waits for it after an indirect branch."""
        pt = _regs(regs)
        try:
            insn = decode_one(mem.read(pt.ip, MAX_INSN_SIZE), pt.ip)
            kind = "nop" if insn.instr.mnemonic == Mnemonic.NOP else prepare_emulation(insn)
            if kind == "nop":
                pt.ip = insn.addr + insn.length
            elif kind is not None:
                emulate(PreparedInsn(insn.addr, insn, b"", 0, kind, False), pt, mem)
        except (CannotProbe, MemoryFault):  # not an instruction qprobe emulates, or its memory faulted
            return False
        return kind is not None

    # -- traps -------------------------------------------------------------------------------
    def resume_registers(self, resume: Resume) -> dict[str, int]:
        return resume_registers(self.registers, resume)

    def ip(self, regs: Mapping[str, int]) -> int:
        return regs["rip"]

    def arch_prepare_kretprobe(self, regs: Registers, read_u64: Callable[[int], int]) -> ReturnHijack:
        return ReturnHijack(read_u64(regs.sp), slot=regs.sp)

    def sp(self, regs: Mapping[str, int]) -> int:
        return regs["rsp"]

    def flags(self, regs: Mapping[str, int]) -> int:
        return regs["eflags"]

    def user_mode(self, regs: Mapping[str, int]) -> bool:
        return bool(regs["cs"] & 3)

    def percpu_base(self, regs: Mapping[str, int]) -> int:
        """The kernel's per-CPU base: GS's, except between a kernel entry from user mode and its ``swapgs``
        (entry text, where only a stub breakpoint can stop), where GS is still the user's and the kernel's
        waits in KERNEL_GS_BASE.  The kernel's is a kernel address, the user's never is."""
        gs = regs["gs_base"]
        return gs if gs >> 63 else regs.get("k_gs_base", gs)

    # -- the blacklist and the text the kernel rewrites --------------------------------------
    # A jump-label site is a 2- or 5-byte jump or NOP (x86 picks the size at build time since
    # Linux 5.16, "x86/jump_label: Allow short NOPs"); a static-call site a 5-byte call or jump.
    jump_label_probe = 2
    jump_label_max = JMP32_INSN_SIZE
    static_call_size = CALL_INSN_SIZE

    def jump_label_size(self, code: bytes) -> int:
        """2 for a ``jmp rel8`` or the 2-byte NOP the kernel writes instead, else 5."""
        return 2 if code[:1] == b"\xeb" or code == b"\x66\x90" else JMP32_INSN_SIZE

    def arch_populate_kprobe_blacklist(self) -> ArchBlacklist:
        """.entry.text, which runs before the trap reaches a handler (x86's own addition), and the thunks."""
        return ArchBlacklist((("__entry_text_start", "__entry_text_end", ".entry.text"),), THUNKS)

    def arch_kretprobe_blacklist(self) -> frozenset[str]:
        return KRETPROBE_BLACKLIST


__all__ = ["KRETPROBE_BLACKLIST", "THUNKS", "X86_64", "X86TrapStep"]
