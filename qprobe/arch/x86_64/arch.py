"""x86_64 as the core sees it: the :class:`qprobe.arch.Arch` object, over the modules of this package.

Each method is the x86 half of a kernel hook (arch/x86/kernel/kprobes/
core.c and opt.c) or of qprobe's host-side additions; the work is done by
the modules it names.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable, Mapping
from typing import cast

from iced_x86 import Code, Decoder

from qprobe.arch import (
    ArchBlacklist,
    BootStage,
    CycleCounter,
    DetourParams,
    ExceptionTable,
    FtraceSite,
    MailboxRequest,
    Memory,
    PercpuLayout,
    Prepared,
    RegisterLayout,
    Registers,
    Resume,
    ResumeKind,
    ReturnHijack,
    ReturnLayout,
    RingEntry,
    Trap,
    TrapHook,
    TrapWatch,
)
from qprobe.arch.inguest import KeySpec, MapKey, MapSlot
from qprobe.arch.x86_64 import detour, guestagg, guestfilter, retdetour
from qprobe.arch.x86_64.boost import CALL_INSN_SIZE, INT3_INSN_OPCODE, JMP32_INSN_SIZE, call_target, synthesize_reljump
from qprobe.arch.x86_64.bootentry import boot_virtual_entry
from qprobe.arch.x86_64.decode import check_boundary, decode_all
from qprobe.arch.x86_64.emulate import Regs, emulate
from qprobe.arch.x86_64.insn import (
    SLOT_SIZE,
    TRAP_COPY,
    PreparedInsn,
    arch_adjust_kprobe_addr,
    copy_instruction,
    is_endbr,
    prepare_kprobe,
    resume_singlestep,
    resume_trap_step,
    trap_copy_start,
)
from qprobe.arch.x86_64.int3hook import watch_site
from qprobe.arch.x86_64.opt import can_optimize
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
    parse_stub_frame,
    stub_frame_offset,
)
from qprobe.arch.x86_64.tsc import after_rdtsc

# Instructions that enter the kernel on purpose: a step that ends there is no fault to restart.
_SYSTEM_CALLS = frozenset({Code.SYSCALL, Code.SYSENTER, Code.INT_IMM8, Code.INT3, Code.INTO, Code.INT1})
_MAILBOX = struct.Struct(f"<{(detour.MB_REGS + detour.FRAME_SIZE) // 8}Q")  # a mailbox up to the end of its frame
_ANSWER = struct.Struct("<2Q")  # MB_FINAL_IP, MB_FINAL_SP: written in one go
assert detour.MB_FINAL_SP == detour.MB_FINAL_IP + 8

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


CR0_PG = 1 << 31
RESET_CS, RESET_IP = 0xF000, 0xFFF0
# The #BP entry: asm_exc_int3 since Linux 5.8's IDTENTRY rework of the x86 entry code
# ("x86/entry: Convert INT3 exception to IDTENTRY_RAW"); plain int3 before.
TRAP_ENTRIES = ("asm_exc_int3", "int3")
# What a vCPU runs from the #BP entry up to the read poke_int3_handler makes of the text_poke_bp
# descriptor (the watchpoint hook's site); the names of 5.8 and later.
TRAP_PATH = ("asm_exc_int3", "error_entry", "exc_int3", "poke_int3_handler")
# ``bp_desc`` is text_poke_bp's descriptor with a ``refs`` count in the 6.1 and 6.12 kernels qprobe
# is tested on (arch/x86/kernel/alternative.c; older kernels reached it through a pointer).
TRAP_WATCH = TrapWatch("bp_desc", "struct bp_patching_desc", "refs", "poke_int3_handler")
# native_sched_clock() is cycles_2_ns(rdtsc()) on a usable TSC (arch/x86/kernel/tsc.c); after its
# rdtsc, edx:eax hold the counter just read.
TSC = CycleCounter("native_sched_clock", after_rdtsc,
                   lambda regs: (regs["rdx"] & 0xFFFFFFFF) << 32 | regs["rax"] & 0xFFFFFFFF)  # fmt: skip


def _insn(prep: Prepared) -> PreparedInsn:
    """The core hands back what arch_prepare_kprobe returned: a PreparedInsn."""
    assert isinstance(prep, PreparedInsn)
    return prep


def _regs(regs: Registers) -> Regs:
    """The core's registers answer every pt_regs field by name, as x86's emulator reads them."""
    return cast(Regs, regs)


class X86_64:
    """The x86_64 implementation of :class:`qprobe.arch.Arch`."""

    name = "x86_64"
    gdb_architecture = "i386:x86-64"
    breakpoint = bytes([INT3_INSN_OPCODE])
    # kprobe_int3_handler hands pre_handlers regs->ip past the int3 (arch/x86/kernel/kprobes/core.c).
    kprobe_ip_offset = 1
    ret_pops = 8  # at a function's entry the return address ``call`` pushed is at rsp; ``ret`` pops it
    slot_size = SLOT_SIZE  # the copy and a jmp back, then the two int3-terminated copies (insn.SLOT_SIZE)
    jump_size = JMP32_INSN_SIZE
    registers = RegisterLayout(GDB_NAME, ARG_REGS, {"cs": KERNEL_CS, "ss": KERNEL_DS}, general=guestfilter.GPRS,
                               irq_flag=X86_EFLAGS_IF, page_table="cr3", percpu_base="gs_base",
                               retval="ax", stack_args=8, pt_regs=PT_NAMES, unwound=(*PT_GPRS, "rip", "rsp"),
                               display=DISPLAY, flag_bits=FLAG_BITS, plain=PLAIN)  # fmt: skip
    # Annotated as Arch declares them: a protocol's attributes are settable, so their types must match.
    cycle_counter: CycleCounter | None = TSC
    ftrace_site: FtraceSite | None = FtraceSite("__fentry__", CALL_INSN_SIZE, call_target)
    drgn_architecture = "X86_64"
    trap_entries: tuple[str, ...] = TRAP_ENTRIES
    trap_path: tuple[str, ...] = TRAP_PATH
    trap_watch: TrapWatch | None = TRAP_WATCH

    mailbox_size = detour.MAILBOX_SIZE
    ring_header_size = detour.RING_HEADER
    ring_entries = detour.RING_ENTRIES
    ring_entry_size = detour.ENTRY_SIZE
    ring_head, ring_tail = detour.R_HEAD, detour.R_TAIL
    ring_waits, ring_lossy = detour.R_WAITS, detour.R_LOSSY
    drain_doorbell = detour.DRAIN_DOORBELL
    instance_size = retdetour.INSTANCE_SIZE
    trampoline_id = retdetour.TRAMPOLINE_ID

    def page_tables(self, regs: Mapping[str, int]) -> X86PageTables:
        return page_tables(regs)

    def vmcoreinfo(self, address: Callable[[str], int], virt_to_phys: Callable[[int], int], levels: int) -> list[str]:
        """arch/x86/kernel/machine_kexec_64.c's lines.

        swapper_pg_dir is init_top_pgt (#define in pgtable_64.h), and phys_base is where the image
        was loaded minus where it was linked to load: __pa_symbol(x) = x - __START_KERNEL_map + phys_base.
        """
        text = address("_text")
        phys_base = virt_to_phys(text) - (text - KERNEL_IMAGE_BASE)  # printed signed, as VMCOREINFO_NUMBER does
        return [f"SYMBOL(swapper_pg_dir)={address(X86PageTables.kernel_root_symbol):x}",
                f"NUMBER(phys_base)={phys_base}", f"NUMBER(pgtable_l5_enabled)={int(levels == 5)}"]  # fmt: skip

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

    def arch_fault_fixup(self, prep: Prepared, regs: Registers, mem: Memory) -> None:
        """As kprobe_fault_handler does for KPROBE_HIT_SS: the exception frame's ip moves from the slot
        back to the probe address, so the kernel's fixup (exception tables) and oops reports see the real text.
        """
        lo, hi, sp = prep.slot_addr, prep.slot_addr + len(prep.copy), regs.sp
        for off in (0, 8):  # with and without an error code
            frame_ip = int.from_bytes(mem.read(sp + off, 8), "little")
            if lo <= frame_ip <= hi:
                mem.write(sp + off, (prep.addr + frame_ip - lo).to_bytes(8, "little"))
                return

    # -- traps -------------------------------------------------------------------------------
    def trap_watch_site(self, code: bytes, address: int, watched: int) -> frozenset[int] | None:
        """Where a vCPU is when QEMU reports poke_int3_handler's read of ``watched`` (see int3hook)."""
        return watch_site(code, address, watched)

    def decode_trap(self, hook: TrapHook, regs: Mapping[str, int], read: Callable[[int, int], bytes]) -> Trap:
        """The trapped context of a stop on the #BP entry or in poke_int3_handler (see int3hook)."""
        if hook is TrapHook.ENTRY:
            frame = parse_hw_frame(read(regs["rsp"], HW_FRAME_SIZE))
            return Trap(frame["rip"] - 1, frame["rsp"], frame["eflags"], regs, user=bool(frame["cs"] & 3))
        pt = parse_pt_regs(read(regs["rdi"], PT_REGS_SIZE))
        gprs = {name: pt[name] for name in PT_GPRS}
        return Trap(pt["rip"] - 1, pt["rsp"], pt["eflags"], {**regs, **gprs}, gprs, user=bool(pt["cs"] & 3))

    def resume_registers(self, resume: Resume) -> dict[str, int]:
        out = dict(resume.changed)
        if resume.sp is not None:
            out["rsp"] = resume.sp
        if resume.flags is not None:
            out["eflags"] = resume.flags
        out["rip"] = resume.ip
        return out

    def ip(self, regs: Mapping[str, int]) -> int:
        return regs["rip"]

    def boot_stage(self, regs: Mapping[str, int]) -> BootStage:
        """CR0.PG is on from the kernel's startup code on (the decompressor's long mode, then the kernel's
        own tables); a CPU comes out of reset at CS:IP f000:fff0 (Intel SDM vol. 3, 9.1.4).  A stub that
        shows no CR0 cannot tell: the kernel is taken to run, as an attach expects."""
        if regs.get("cr0", CR0_PG) & CR0_PG:
            return BootStage.KERNEL
        if regs["rip"] == RESET_IP and regs["cs"] == RESET_CS:
            return BootStage.RESET
        return BootStage.EARLY

    def arch_boot_entry(self, read: Callable[[int, int], bytes], address: Callable[[str], int]) -> int:
        return boot_virtual_entry(read, address)

    def arch_prepare_kretprobe(self, regs: Registers, read_u64: Callable[[int], int]) -> ReturnHijack:
        return ReturnHijack(read_u64(regs.sp), slot=regs.sp)

    def sp(self, regs: Mapping[str, int]) -> int:
        return regs["rsp"]

    def flags(self, regs: Mapping[str, int]) -> int:
        return regs["eflags"]

    def user_mode(self, regs: Mapping[str, int]) -> bool:
        return bool(regs["cs"] & 3)

    def arch_uprobe_analyze_insn(self, code: bytes) -> str | None:
        """The kernel refuses an int3 as the probed instruction (``is_trap_insn``, -ENOTSUPP): it would be
        its own trap.  It also refuses what its decoder cannot read; an instruction qprobe steps in place
        needs no table of what can run out of line."""
        insn = Decoder(64, code[:16]).decode()
        if insn.code == Code.INVALID:
            return "an instruction the decoder cannot read (EINVAL)"
        if insn.code == Code.INT3:
            return "an int3 is there already (ENOTSUPP)"
        return None

    def arch_uprobe_xol_was_trapped(self, code: bytes, after: Mapping[str, int]) -> bool:
        if self.user_mode(after):
            return False
        return Decoder(64, code[:16]).decode().code not in _SYSTEM_CALLS

    def arch_uretprobe_frame(self, regs: Mapping[str, int], read: Callable[[int, int], bytes]) -> tuple[int, int]:
        """At a function's first instruction ``call`` has pushed the return address at rsp; ``ret`` pops it."""
        sp = regs["rsp"]
        return int.from_bytes(read(sp, 8), "little"), sp + 8

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

    # -- jump optimization (opt.c) ----------------------------------------------------------
    def arch_check_optimized_kprobe(self, func_code: bytes, func_start: int, addr: int,
                                    exception_table: ExceptionTable | None, patched: Mapping[int, int],
                                    name: str) -> tuple[str | None, int]:  # fmt: skip
        check = can_optimize(func_code, func_start, addr, exception_table, patched=patched, name=name)
        return (None if check.ok else check.reason), check.size

    def arch_prepare_optimized_kprobe(self, params: DetourParams, region: bytes, addr: int, near: int,
                                      alloc: Callable[[int], int]) -> tuple[int, bytes, int]:  # fmt: skip
        """(the detour's address, its code, where its continue label is) for the ``region`` at ``addr``.

        ``alloc(size)`` places the detour; ``near`` is any address in the same area (to size its head).
        """
        build = self._detour_builder(params)
        insns = decode_all(region, addr)
        head = build(near, b"")[1]  # the head's size does not depend on where it is placed
        total = head + sum(len(copy_instruction(i, addr)) for i in insns) + JMP32_INSN_SIZE
        at = alloc(total + 16)
        relocated = b""
        for insn in insns:
            relocated += copy_instruction(insn, at + head + len(relocated))
        code, got = build(at, relocated)
        assert got == head
        return at, code, at + head

    def _detour_builder(self, p: DetourParams) -> Callable[[int, bytes], tuple[bytes, int]]:
        if p.kind == "count":
            return lambda at, rel: (detour.build_count_detour(at, p.counter, rel, p.resume), detour.COUNT_HEAD)
        if p.kind == "filtered":
            tree = p.guest_filter
            assert tree is not None
            return lambda at, rel: guestfilter.build_filtered_detour(at, tree, p.probe_id, p.stub,
                                                                     p.counter, rel, p.resume)  # fmt: skip
        if p.kind == "keyed":
            spec = p.guest_key
            assert spec is not None
            return lambda at, rel: guestagg.build_keyed_detour(at, spec, p.tables, p.cpu_number, p.task, p.counter,
                                                               p.lost, rel, p.resume)  # fmt: skip
        if p.kind == "retentry":
            ret, pool = p.returns, p.pool
            assert isinstance(ret, retdetour.RetParams) and pool is not None
            return lambda at, rel: retdetour.build_entry_detour(at, ret, pool, p.counter, p.missed, rel, p.resume)
        return lambda at, rel: (detour.build_detour(at, p.probe_id, p.stub, rel, p.resume), detour.DETOUR_HEAD)

    def arch_optimize_kprobes(self, addr: int, detour_addr: int) -> bytes:
        """The jump that replaces the probed instructions."""
        return synthesize_reljump(addr, detour_addr)

    def arch_unoptimize_kprobes(self, jump: bytes, original: bytes) -> bytes:
        return original

    def arch_within_optimized_kprobe(self, addr: int, size: int, target: int) -> bool:
        """Whether ``target`` lies in the displaced instructions of a probe at ``addr`` (other than their start)."""
        return addr < target < addr + size

    # -- guest-RAM layouts of the optimized path -----------------------------------------------
    def build_mailbox_stub(self, mailboxes: int, missed: int, percpu: PercpuLayout, port: int, address: int) -> bytes:
        params = detour.StubParams(mailboxes, missed, percpu.cpu_number, percpu.this_cpu_off, percpu.current_task,
                                   port)  # fmt: skip
        return detour.build_stub(params, address)

    def build_record_stub(self, rings: int, ncpus: int, lost: int, percpu: PercpuLayout, pid_offset: int,
                          comm_offset: int, port: int, address: int) -> bytes:  # fmt: skip
        params = detour.RecordParams(rings, rings + detour.RING_HEADER * ncpus, lost, percpu.cpu_number,
                                     percpu.current_task, pid_offset, comm_offset, port)  # fmt: skip
        return detour.build_record_stub(params, address)

    def return_layout(self, instances: int, count: int, trampolines: int, returns: int, stub: int,
                      current_task: int) -> ReturnLayout:  # fmt: skip
        return retdetour.RetParams(instances, count, trampolines, returns, stub, current_task)

    def build_return_trampolines(self, layout: ReturnLayout) -> bytes:
        assert isinstance(layout, retdetour.RetParams)
        return retdetour.build_trampolines(layout)

    def return_int3s(self, layout: ReturnLayout) -> tuple[int, int]:
        """The shared return code's two int3s: after the mailbox call (busy mailbox), and on a bad instance."""
        assert isinstance(layout, retdetour.RetParams)
        common = layout.trampoline(layout.count)
        busy, bad = retdetour.common_offsets(layout)
        return common + busy, common + bad

    def return_trampoline(self, address: int, stub: int) -> bytes:
        """The stop-less kretprobe trampoline at ``address``: ``push 0; call stub; int3``."""
        return detour.build_detour(address, retdetour.TRAMPOLINE_ID, stub, b"", 0)[: detour.DETOUR_HEAD] + b"\xcc"

    def new_instance(self, owner: int, mailbox: bool) -> bytes:
        """A free instance of ``owner``'s pool, whose return counts in the guest or goes to the mailbox."""
        raw = bytearray(retdetour.INSTANCE_SIZE)
        mode = retdetour.MODE_MAILBOX if mailbox else retdetour.MODE_COUNT
        struct.pack_into("<II", raw, retdetour.I_OWNER, owner, mode)
        return bytes(raw)

    def parse_instances(self, raw: bytes) -> list[tuple[int, int, int, int]]:
        """(n, slot, return address, task) of every taken instance in ``raw`` (consecutive instances)."""
        out = []
        for n in range(len(raw) // retdetour.INSTANCE_SIZE):
            slot, ret, task = struct.unpack_from("<3Q", raw, n * retdetour.INSTANCE_SIZE + retdetour.I_SLOT)
            if slot:
                out.append((n, slot, ret, task))
        return out

    def instance_return_field(self, layout: ReturnLayout, i: int) -> int:
        return layout.instance(i) + retdetour.I_RET

    def trampoline_index(self, layout: ReturnLayout, value: int) -> int | None:
        """If ``value`` is instance i's trampoline, i."""
        if not layout.trampolines <= value < layout.trampoline(layout.count):
            return None
        return (value - layout.trampolines) // retdetour.TRAMP_STRIDE

    def read_mailbox(self, read: Callable[[int, int], bytes]) -> MailboxRequest | None:
        """The request in a CPU's mailbox (``read(offset, size)`` reads it), or None if there is none.

        The state is read first: the stub writes everything else before it publishes REQUEST.
        """
        if int.from_bytes(read(detour.MB_STATE, 8), "little") != detour.STATE_REQUEST:
            return None
        raw = read(0, _MAILBOX.size)  # the header words and the frame, in one read
        box = _MAILBOX.unpack(raw)
        values, continue_addr, probe_id = parse_stub_frame(raw, detour.MB_REGS)
        frame = box[detour.MB_FRAME // 8]
        values.update(rsp=frame + detour.FRAME_SIZE, cr3=box[detour.MB_CR3 // 8], gs_base=box[detour.MB_PERCPU // 8],
                      tsc=box[detour.MB_TSC // 8])  # fmt: skip
        return MailboxRequest(probe_id, values, continue_addr, frame, frame + detour.FRAME_SIZE)

    def mailbox_answer(self, changed: Mapping[str, int], final_ip: int, final_sp: int) -> list[tuple[int, bytes]]:
        """(offset, bytes) writes that answer a request, in order; the last publishes DONE in one store."""
        writes = []
        for name, value in changed.items():
            off = stub_frame_offset(name)
            if off is not None:
                writes.append((detour.MB_REGS + off, value.to_bytes(8, "little")))
        writes.append((detour.MB_FINAL_IP, _ANSWER.pack(final_ip, final_sp)))
        writes.append((detour.MB_STATE, detour.STATE_DONE.to_bytes(8, "little")))
        return writes

    def parse_ring_entry(self, raw: bytes) -> RingEntry:
        values, _ret, probe_id = parse_stub_frame(raw)
        cpu_pid, task, tsc = (int.from_bytes(raw[o : o + 8], "little")
                              for o in (detour.E_CPU_PID, detour.E_TASK, detour.E_TSC))  # fmt: skip
        comm = detour.task_comm(raw[detour.E_COMM : detour.E_COMM + 16])
        return RingEntry(probe_id, cpu_pid & 0xFFFFFFFF, detour.task_pid(cpu_pid >> 32), comm, task, tsc,
                         values["rsp"], values)  # fmt: skip

    ring_entry_read_size = detour.E_TASK + 8

    def guest_map_size(self, spec: KeySpec) -> int:
        return guestagg.table_size(spec)

    def parse_guest_map(self, spec: KeySpec, raw: bytes) -> dict[MapKey, MapSlot]:
        """Key -> slot over one or more CPUs' tables of a "keyed" detour, each key part decoded."""
        out: dict[MapKey, MapSlot] = {}
        for words, slot in guestagg.parse_tables(spec, raw).items():
            key = guestagg.decode_key(spec, words)
            old = out.get(key)  # two comm words that differ only after the NUL are one name
            out[key] = slot if old is None else old.merge(slot)
        return out


__all__ = ["KRETPROBE_BLACKLIST", "THUNKS", "X86_64"]
