"""The seam between the kprobes core and one CPU architecture, declared in one place.

As include/linux/kprobes.h declares the ``arch_*`` hooks kernel/kprobes.c
calls, :class:`Arch` lists everything ``qprobe.core`` asks of an
architecture; the core imports nothing from an architecture's package and is
handed its :class:`Arch` object by ``qprobe.wiring``.  The neutral types both
sides use (:class:`Resume`, :class:`Trap`, :class:`RegisterLayout`, ...) are
defined here too.

The members, grouped in the order a second architecture needs them (drgn's
"to support a new architecture" list in libdrgn/platform.h plays the same
part); docs/porting.md is the step-by-step guide, with the test that proves
each step.  ``Arch`` itself is the core every architecture implements (1-6);
the optional facets (7-11) are attributes that hold the facet's object, or
None where the architecture lacks it, as Linux keeps CONFIG_OPTPROBES apart
from the base kprobes hooks; the core checks for None before it uses one.

1. Identity: ``name``, ``gdb_architecture`` (how the gdbstub's target
   description names it: qprobe.arch.select chooses by it), ``drgn_architecture``,
   ``vmcoreinfo``.
2. Registers: ``registers`` (a :class:`RegisterLayout`: pt_regs once, the
   gdbstub's names, argument and return registers, where ``current`` is,
   the registers every stop must bring, what the shell prints) and the
   ``ip``/``sp``/``flags``/``user_mode``/``percpu_base`` readers.
3. Page tables: ``page_tables`` gives the :class:`PageTables` the host walks
   guest memory with and maps the scratch area through.
4. Instructions: ``arch_prepare_kprobe`` decodes the probed instruction and
   decides whether it runs out of line, is emulated on the host or is
   boosted (runs out of line followed by a jump back: ``Prepared.boostable``,
   no facet of its own); ``arch_setup_resume`` turns that decision into one
   :class:`Resume`.  A copy that runs out of line is single-stepped by the
   host (``arch_resume_singlestep`` maps the ip back after the step; after a
   fault, ``arch_fault_fixup`` moves the exception's return address, in
   memory or a register, back to the probe's), or run to a trap after it with
   the trap-step facet (7).  ``breakpoint`` is the trap instruction
   ``arch_arm_kprobe`` writes (int3; ``brk`` on arm64); ``arch_slot_resume``
   maps a vCPU left in a slot back to the text (recovery);
   ``arch_emulate_in_place`` runs a stub breakpoint's instruction on the host
   where it can (qprobe.core.anywhere).
5. Traps: ``traps`` (:class:`Traps`, qprobe.arch.traps): its
   ``trap_entries`` say where the host hears of a breakpoint, by a
   breakpoint on the entry (or the trap-watch facet, 8); its
   ``kprobe_break_hook`` says whether a stop on the entry is a trap of
   kprobes' (and which, :class:`BreakHook`) or another exception on a shared
   vector (arm64's); its ``decode_trap`` reads where a stop came from.
   ``resume_registers`` writes a :class:`Resume` back as gdbstub registers.
   Boot: the ``boot`` facet (:class:`Boot`: ``boot_stage``, ``arch_boot_entry``, ``arch_boot_switch``).
6. The blacklist: ``arch_populate_kprobe_blacklist``,
   ``arch_kretprobe_blacklist``, and the sites the kernel rewrites
   (``jump_label_size``, ``static_call_size``, ``ftrace_site``).
   Return probes: ``arch_prepare_kretprobe`` says where the return address
   is at a function's entry (a stack slot or a register), ``ret_pops`` how
   far the return moves the stack pointer.
7. ``trap_step`` (:class:`TrapStep`): the copy runs to the trap instruction
   after it (Linux's int3 single-step, since 5.14) and
   ``arch_resume_trap_step`` maps the ip back at that second trap.  None: the
   host single-steps every copy that runs out of line.
8. ``trap_watch`` (:class:`TrapWatch`): a read the kernel's breakpoint handler
   makes, watched instead of its entry (``traps.trap_path`` leads there).  None: a
   breakpoint on the entry.
9. ``optprobes`` (:class:`OptProbes`): jump optimization,
   ``arch_check_optimized_kprobe``, ``arch_prepare_optimized_kprobe``,
   ``arch_optimize_kprobes`` / ``arch_unoptimize_kprobes``,
   ``arch_within_optimized_kprobe``.  None: every probe stays a breakpoint.
10. ``guest_ram`` (:class:`GuestRam`, qprobe.arch.guestram): the guest-RAM
    layouts the core reads without stopping the VM: the mailbox stub and its
    answer, the record rings, the per-CPU keyed tables, kretprobe instances
    and their trampolines.  None: every hit stops the VM (jump optimization
    needs it too).
11. ``uprobes`` (:class:`Uprobes`): user-space probes.  None: refused.
    ``cycle_counter`` (:class:`CycleCounter`, qprobe.arch.cycles): the counter
    the kernel's sched_clock reads, sched_clock computed from it, and what the
    host times stops against.  None: trace timestamps are the host's, not the
    guest's clock.
12. ``guest_call`` (:class:`GuestCall`, qprobe.arch.guestcall): the code that
    makes the guest kernel call its own functions from a kworker (the queue
    stub run at an interrupt's exit, the work function), and a counting
    uprobe_consumer handler.  None: user-space probes always stop the VM.

``make lint`` type-checks every implementation against this protocol
(qprobe/arch/select.py), and tests/unit/test_layering.py keeps every other
package from importing an architecture's.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from qprobe.arch.boot import Boot, BootStage
from qprobe.arch.cycles import CycleCounter, GuestKernel, SchedClock, StopTimer
from qprobe.arch.guestcall import GuestCall
from qprobe.arch.guestram import (
    DetourParams,
    GuestRam,
    MailboxRequest,
    PercpuLayout,
    Pool,
    ReturnLayout,
    RingEntry,
)
from qprobe.arch.traps import BreakHook, Trap, TrapHook, Traps, TrapWatch


class ResumeKind(enum.Enum):
    """How a trapped vCPU goes on (``setup_singlestep``'s three cases, plus "done")."""

    CONTINUE = "continue"  # at ``ip``, with nothing left for the host to do
    STEP = "step"  # the host single-steps the out-of-line copy at ``ip`` through the gdbstub, then goes on
    # Run the copy at ``ip`` with interrupts off: the trap instruction after it brings the vCPU back
    # through the same hook, and the host finishes the hit then (the kernel's int3 single-step).
    TRAP_STEP = "trap-step"
    BOOST = "boost"  # run the copy at ``ip`` freely: it jumps back to ``jump_back`` on its own


@dataclass(frozen=True)
class Resume:
    """The one decision of how a vCPU resumes after a trap, applied in one place.

    ``ip``, ``sp`` and ``flags`` are the neutral names of the instruction
    pointer, stack pointer and flags (the arch maps them to its registers);
    ``changed`` holds every other register to write, by gdbstub name.
    """

    kind: ResumeKind
    ip: int
    sp: int | None = None
    flags: int | None = None
    changed: Mapping[str, int] = field(default_factory=dict)
    jump_back: int = 0  # BOOST: where the copy's jump lands in the original text


@dataclass(frozen=True)
class ReturnHijack:
    """Where a function's return address is at its first instruction (what arch_prepare_kretprobe replaces).

    Exactly one of ``slot`` and ``register`` is set: the stack address that holds it (x86's ``call``
    pushed it there), which the core overwrites with a journaled write; or the pt_regs name of the
    register that holds it (arm64's link register, x30), which the core sets in the trapped context.
    """

    ret_addr: int
    slot: int | None = None
    register: str | None = None


# Addresses of instructions with an exception-table fixup: a set, or a test of one address.
ExceptionTable = Container[int] | Callable[[int], bool]


class Registers(Protocol):
    """A trapped context's registers as the core hands them to the architecture (``qprobe.core.regs.PtRegs``).

    Every pt_regs field of the architecture's :class:`RegisterLayout` reads and writes as an attribute, its
    ``system`` registers only read; ``dirty`` gives the changed ones by gdbstub name.
    """

    def __getattr__(self, name: str) -> int: ...
    def __setattr__(self, name: str, value: int) -> None: ...
    def dirty(self) -> dict[str, int]: ...


@dataclass(frozen=True)
class RegisterLayout:
    """The architecture's pt_regs as a handler's ``regs`` object sees it."""

    gdb_name: Mapping[str, str]  # pt_regs name -> gdbstub register name
    arg_regs: tuple[str, ...]  # pt_regs names of the integer argument registers, in order
    defaults: Mapping[str, int]  # fields a detour's frame lacks, with their kernel-mode values
    general: tuple[str, ...]  # pt_regs names of the general registers (a detour's filter or key may read them)
    # The flags register's interrupt bit: x86's IF, set while interrupts are enabled; arm64's PSTATE.I, set
    # while they are masked (``irq_masked_when_set``).  irqs_disabled_flags() reads it either way.
    irq_flag: int
    page_table: str  # gdbstub name of the register holding the running task's page-table root (the kernel half's)
    percpu_base: str  # gdbstub name of the register holding the CPU's per-CPU base in kernel mode
    retval: str  # pt_regs name of the register a function returns its value in
    stack_args: int  # at a function's entry, sp + this is its first argument on the stack (x86_64: 8)
    # The per-CPU variable holding ``current`` wherever no register holds it: always on x86
    # (``current_task``, set by __switch_to), at a user-mode stop on arm64 (``__entry_task``: SP_EL0 is
    # then the user's stack pointer).
    current_percpu: str
    # pt_regs names of every field of struct pt_regs in memory order (what drgn's stack walk is given,
    # and the %REG names kprobe_events takes, with ``reg_aliases``').
    pt_regs: tuple[str, ...] = ()
    # kprobe_events' other %REG names for a pt_regs field, each with that field's name: the kernel's
    # regoffset_table (regs_query_register_offset) names arm64's x30 "lr" too.
    reg_aliases: Mapping[str, str] = field(default_factory=dict)
    unwound: tuple[str, ...] = ()  # gdbstub (and drgn) names of the registers a stack walk carries on from
    # (gdbstub name, how it is shown: "int", "code" or "data" pointer, "flags", "hex") in the order the
    # shell prints a vCPU's registers; the flags register's (mask, name) pairs.
    display: tuple[tuple[str, str], ...] = ()
    flag_bits: tuple[tuple[int, str], ...] = ()
    plain: frozenset[str] = frozenset()  # gdbstub registers whose write has no effect beyond the value
    # gdbstub name of the register that holds ``current`` (the running task_struct's address) in kernel
    # mode, as arm64's SP_EL0 does; None where it is always ``current_percpu``, read at the per-CPU base
    # (x86).  qprobe.kernel.program.KernelData.current_address reads either, by the stop's mode.
    current: str | None = None
    # pt_regs name of the field that holds a system call's number, which is no register (x86's orig_ax;
    # arm64's syscallno): a kernel-mode exception entry stores -1 there, so kprobe_events' %REG of it
    # reads -1 in a kprobe's handler.  None: pt_regs has no such field.
    syscall_nr: str | None = None
    # gdbstub names of the other registers the architecture's readers take from a stop (x86: CR4 for
    # page_tables, KERNEL_GS_BASE for percpu_base, CR0 for boot_stage).
    system: tuple[str, ...] = ()
    # gdbstub name of the register holding the root of the running task's user half where that is not
    # ``page_table``'s (arm64's TTBR0_EL1); None: ``page_table``'s root maps both halves (x86's CR3).
    user_page_table: str | None = None
    ip: str = "ip"  # pt_regs names of the instruction pointer, stack pointer and flags
    sp: str = "sp"
    flags: str = "flags"
    irq_masked_when_set: bool = False  # irq_flag set means interrupts are off (arm64's PSTATE.I), not on (x86's IF)

    def irqs_disabled_flags(self, flags: int) -> bool:
        """The kernel's irqs_disabled_flags() (arch_irqs_disabled_flags): whether a flags register's value
        (pt_regs' ``flags`` field, x86's EFLAGS or arm64's PSTATE) has interrupts off."""
        return bool(flags & self.irq_flag) == self.irq_masked_when_set

    @property
    def stop_registers(self) -> frozenset[str]:
        """gdbstub names of every register a stop's read must bring: pt_regs', the page-table roots, the
        per-CPU base, ``current``'s and ``system``.  A transport reads those its ``g`` packet lacks with ``p``
        (QEMU's aarch64 stub has its system registers in a target-description feature of their own)."""
        named = (self.task_page_table, self.page_table, self.percpu_base, *self.system,
                 *([self.current] if self.current else []))  # fmt: skip
        return frozenset((*self.gdb_name.values(), *named))

    @property
    def task_page_table(self) -> str:
        """gdbstub name of the register whose root (``GuestMemory.pgd_of``) the task's memory is read through."""
        return self.user_page_table or self.page_table

    @property
    def regoffset_table(self) -> dict[str, str]:
        """kprobe_events' %REG names, each with the pt_regs name of the field it reads (the kernel's table)."""
        return {**{name: name for name in self.pt_regs}, **self.reg_aliases}

    @property
    def pc(self) -> str:
        """The gdbstub's name of the program counter."""
        return self.gdb_name[self.ip]

    @property
    def pt_name(self) -> dict[str, str]:
        """gdbstub name -> pt_regs name."""
        return {g: pt for pt, g in self.gdb_name.items()}


@dataclass(frozen=True)
class ArchBlacklist:
    """What the architecture adds to the kernel's kprobe blacklist (``arch_populate_kprobe_blacklist``)."""

    sections: tuple[tuple[str, str, str], ...]  # (start symbol, end symbol, name), e.g. the entry code
    # Functions by name that a kernel without CONFIG_KPROBES cannot list (it has no _kprobe_blacklist)
    # but that the trap path runs through: return and indirect-branch thunks and the like.
    thunks: re.Pattern[str] | None = None


@dataclass(frozen=True)
class FtraceSite:
    """A function's ftrace call site as vmlinux links it (x86's ``call __fentry__``), which the guest's ftrace owns.

    ``entry`` is the function it calls, ``size`` its bytes; ``callee(code, addr)`` is what the ``size``
    bytes ``code`` linked at ``addr`` call (None: they are no call).
    """

    entry: str
    size: int
    callee: Callable[[bytes, int], int | None]


class PageTables(Protocol):
    """The guest's page tables as the host walks them (``qprobe.vmm.memory``, the scratch area's mapping).

    ``root`` turns a value of a page-table register (``RegisterLayout.page_table``, or
    ``user_page_table``) into the physical table it points at; ``root_for`` says which root walks an
    address of a task (the kernel's, ``mem.pgd``, or the task's: the same tables on x86; TTBR1's or
    TTBR0's on arm64); ``learn`` is told the kernel's symbols (a build option may shape the roots).
    The scratch area is mapped as ``large_page``-sized pages of kernel text in the table
    ``large_page_table`` finds, within branch reach of ``image_base``, in the first free run of
    ``scratch_slots`` (the slots the kernel itself maps last, given those ``image`` spans).
    """

    levels: int
    kernel_root_symbol: str  # the kernel's own page-table root (swapper_pg_dir or its name on this arch)
    kernel_root_from: str  # the boot function from whose entry on they map the kernel (boot-time reads switch there)
    image_base: int  # the kernel image's virtual base
    large_page: int

    def learn(self, has_symbol: Callable[[str], bool]) -> None: ...
    def root(self, value: int) -> int: ...
    def root_for(self, vaddr: int, kernel: int, task: int | None) -> int: ...
    def translate(self, read_u64: Callable[[int], int], root: int, vaddr: int) -> tuple[int, int, int]: ...
    def large_page_table(self, read_u64: Callable[[int], int], root: int) -> int: ...
    def large_page_entry(self, phys: int) -> int: ...
    def scratch_slots(self, image: range) -> Sequence[int]: ...
    def task_size_max(self) -> int: ...


class Memory(Protocol):
    """Guest memory for the emulator and for fault fix-ups."""

    def read(self, addr: int, size: int) -> bytes: ...
    def write(self, addr: int, data: bytes) -> None: ...


class UserMemory(Memory, Protocol):
    """A stopped task's user memory, faulting (MemoryFault) where the task's own access would."""

    def fetch(self, addr: int, size: int) -> bytes: ...


class Prepared(Protocol):
    """arch_prepare_kprobe's result (the kernel's ``struct arch_specific_insn``)."""

    addr: int
    slot_addr: int
    copy: bytes
    emulate: str | None
    boostable: bool
    # Why the copy is single-stepped by the host rather than run to a trap after it (None: it is not).
    step_reason: str | None

    @property
    def length(self) -> int: ...

    def boosted_copy(self) -> bytes: ...


class TrapStep(Protocol):
    """The int3 single-step (Linux's on x86 since 5.14; arm64's ``brk`` after the slot): the copy runs to a trap.

    Optional: without it every copy that runs out of line is single-stepped
    by the host through the gdbstub (correct; a step stop costs QEMU 7.2 a
    flush of its translated code, a trap heard by a watchpoint does not).
    """

    def is_trap_step_start(self, prep: Prepared, ip: int) -> bool: ...
    def is_trap_step_end(self, prep: Prepared, addr: int) -> bool: ...
    def arch_resume_trap_step(self, prep: Prepared, regs: Registers) -> None: ...


class OptProbes(Protocol):
    """Jump optimization (arch/x86/kernel/kprobes/opt.c's hooks): a jump to a detour in place of the breakpoint."""

    jump_size: int  # bytes an optimized probe's jump displaces at least

    def arch_check_optimized_kprobe(self, func_code: bytes, func_start: int, addr: int,
                                    exception_table: ExceptionTable | None,
                                    patched: Mapping[int, int], name: str) -> tuple[str | None, int]: ...  # fmt: skip
    def arch_prepare_optimized_kprobe(self, params: DetourParams, region: bytes, addr: int, near: int,
                                      alloc: Callable[[int], int]) -> tuple[int, bytes, int]: ...  # fmt: skip
    def arch_optimize_kprobes(self, addr: int, detour: int) -> bytes: ...
    def arch_unoptimize_kprobes(self, jump: bytes, original: bytes) -> bytes: ...
    def arch_within_optimized_kprobe(self, addr: int, size: int, target: int) -> bool: ...


class Uprobes(Protocol):
    """User-space probes (qprobe.core.uprobes): the kernel's arch/*/kernel/uprobes.c hooks qprobe needs."""

    # UPROBE_SWBP_INSN_SIZE: uprobe_register() refuses a file offset not aligned to it (EINVAL).
    uprobe_swbp_insn_size: int

    # Why the kernel's uprobes refuse an instruction as the probed one (None: they take it).
    def arch_uprobe_analyze_insn(self, code: bytes) -> str | None: ...
    # After the probed user instruction was stepped in place with registers ``after``: whether it trapped
    # into the kernel on an exception that returns to it (a fault), rather than completing or entering
    # the kernel on purpose (a system call); the instruction then runs again, and is no second hit.
    def arch_uprobe_xol_was_trapped(self, code: bytes, after: Mapping[str, int]) -> bool: ...
    # At a function's first instruction: its return address (``read`` reads the task's memory) and the
    # stack pointer once it has returned (arch_uretprobe_hijack_return_addr's two facts).
    def arch_uretprobe_frame(self, regs: Mapping[str, int], read: Callable[[int, int], bytes]) -> tuple[int, int]: ...
    # The user instruction at the registers' ip performed on the host, if the architecture emulates it (the
    # kernel's own user emulations, and the moves and arithmetic of prologues and call sites): a hit then
    # needs no single-step, whose stop costs QEMU 7.2 a flush of its translated code.  ``mem`` faults
    # (MemoryFault) wherever the task itself would.  False: the host steps it (``regs`` may be changed: give
    # a copy).
    def arch_uprobe_emulate(self, regs: Registers, mem: UserMemory) -> bool: ...
    # Whether a user-mode access of kind ``access`` ("read", "write" or "fetch") to a page whose leaf page-table
    # entry is ``entry`` completes without a fault and without the CPU having to set any bit in the entry
    # (a store needs the dirty bit set already: the host's write sets none).
    def user_page_allows(self, entry: int, access: str) -> bool: ...


class Arch(Protocol):
    """Everything the core asks of an architecture (see the checklist above); each optional facet is None if absent."""

    name: str
    gdb_architecture: str  # what the gdbstub's target description names it (<architecture>)
    breakpoint: bytes  # the trap instruction arch_arm_kprobe writes
    kprobe_ip_offset: int  # a kprobe handler's regs->ip minus the probe's address (x86: 1, the int3 has run)
    slot_size: int  # bytes of scratch per out-of-line copy
    registers: RegisterLayout
    ftrace_site: FtraceSite | None  # None: no call of ftrace's in a function's linked bytes
    drgn_architecture: str  # the name of drgn.Architecture's member for it

    # -- the optional facets -----------------------------------------------------------------
    trap_step: TrapStep | None  # None: the host single-steps every copy that runs out of line
    trap_watch: TrapWatch | None  # None: the host hears of a trap by a breakpoint on its entry
    optprobes: OptProbes | None  # None: every probe stays a breakpoint
    guest_ram: GuestRam | None  # None: every hit stops the VM (no mailbox, rings, maps or guest-RAM kretprobes)
    uprobes: Uprobes | None  # None: user-space probes are refused
    cycle_counter: CycleCounter | None  # None: hits are timed by the host, not by the guest's trace clock
    guest_call: GuestCall | None  # None: nothing runs as a guest call (every user-space probe hit stops the VM)

    def page_tables(self, regs: Mapping[str, int]) -> PageTables: ...
    def vmcoreinfo(self, address: Callable[[str], int], virt_to_phys: Callable[[int], int],
                   read_u64: Callable[[int], int], paging: PageTables) -> list[str]:  # fmt: skip
        """The arch's VMCOREINFO lines drgn reads (its machine_kexec's), for a kernel that exports none."""
        ...

    # -- instructions ------------------------------------------------------------------
    def arch_adjust_kprobe_addr(self, func_code: bytes, func_start: int, offset: int) -> int: ...
    def entry_skip(self, func_code: bytes) -> int: ...
    def check_boundary(
        self, code: bytes, func_start: int, addr: int, patched: Mapping[int, int], name: str
    ) -> None: ...
    def arch_prepare_kprobe(
        self, code: bytes, addr: int, slot: int, where: str, exception_table: ExceptionTable | None
    ) -> Prepared: ...
    def arch_slot_code(self, prep: Prepared) -> bytes: ...
    def arch_setup_resume(
        self, prep: Prepared, regs: Registers, mem: Memory, may_boost: bool, may_trap_step: bool
    ) -> Resume: ...
    def arch_slot_resume(self, slot: int, addr: int, ip: int, flags: int) -> tuple[int, int] | None: ...
    def step_left_slot(self, prep: Prepared, ip: int) -> bool: ...
    def arch_resume_singlestep(self, prep: Prepared, regs: Registers, mem: Memory) -> None: ...
    # False: the return address is not writable (arm64's ELR_EL1), ``regs`` put back at the probe instead.
    def arch_fault_fixup(self, prep: Prepared, regs: Registers, mem: Memory) -> bool: ...
    # The instruction at the registers' ip performed on the host, if the architecture emulates it for its
    # kprobes (branches, calls, returns) or a no-op: a stub breakpoint's hit then needs no single-step (a
    # translation flush in QEMU 7.2).  False: the host steps it (``regs`` may be changed: give a copy).
    def arch_emulate_in_place(self, regs: Registers, mem: Memory) -> bool: ...

    # -- traps -------------------------------------------------------------------------
    traps: Traps  # the trap entry, and what a stop on it is

    def resume_registers(self, resume: Resume) -> dict[str, int]: ...
    def ip(self, regs: Mapping[str, int]) -> int: ...

    boot: Boot  # how far a vCPU has come since reset, and where the kernel first runs at virtual addresses

    # -- return probes: a call is known by its entry's sp (ri->fp); its return leaves sp ret_pops bytes higher
    ret_pops: int

    def arch_prepare_kretprobe(self, regs: Registers, read_u64: Callable[[int], int]) -> ReturnHijack: ...
    def sp(self, regs: Mapping[str, int]) -> int: ...
    def flags(self, regs: Mapping[str, int]) -> int: ...
    def user_mode(self, regs: Mapping[str, int]) -> bool: ...
    def percpu_base(self, regs: Mapping[str, int]) -> int: ...

    # -- the blacklist and the text the kernel rewrites --------------------------------------
    jump_label_probe: int  # bytes of a jump-label site jump_label_size needs
    jump_label_max: int  # the most bytes a jump-label site occupies
    static_call_size: int  # bytes a static-call site occupies

    def jump_label_size(self, code: bytes) -> int: ...
    def arch_populate_kprobe_blacklist(self) -> ArchBlacklist: ...
    def arch_kretprobe_blacklist(self) -> frozenset[str]: ...


__all__ = [
    "Arch",
    "ArchBlacklist",
    "Boot",
    "BootStage",
    "BreakHook",
    "CycleCounter",
    "DetourParams",
    "ExceptionTable",
    "FtraceSite",
    "GuestCall",
    "GuestKernel",
    "GuestRam",
    "MailboxRequest",
    "Memory",
    "OptProbes",
    "PageTables",
    "PercpuLayout",
    "Pool",
    "Prepared",
    "RegisterLayout",
    "Registers",
    "Resume",
    "ResumeKind",
    "ReturnHijack",
    "ReturnLayout",
    "RingEntry",
    "SchedClock",
    "StopTimer",
    "Trap",
    "TrapHook",
    "TrapStep",
    "TrapWatch",
    "Traps",
    "Uprobes",
    "UserMemory",
]
