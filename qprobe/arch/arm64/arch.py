"""arm64 as the core sees it: the :class:`qprobe.arch.Arch` object, over the modules of this package.

Each method is the arm64 half of a kernel hook (arch/arm64/kernel/probes/
kprobes.c, decode-insn.c, simulate-insn.c, uprobes.c) or of qprobe's
host-side additions; the work is done by the modules it names.  A probe is
``brk #KPROBES_BRK_IMM`` in the text; the host hears of it on
``el1h_64_sync``, the vector every synchronous exception taken at EL1 enters
(``traps``), where ESR_EL1 says whether it is a BRK of kprobes'.  A copy runs
out of line in a slot of the scratch area, stepped by the host; PC-relative
instructions are simulated on the host.

User-space probes (``uprobes``) are the core's, stepped in place under a
gdbstub breakpoint, with ``Arm64Uprobes``'s answers (decode.py's and
returns.py's); a task's memory is read through its TTBR0_EL1 (paging).

What arm64 has not yet, each facet ``None`` (docs/porting.md): jump
optimization (upstream arm64 has none either), the guest-RAM layouts (the
mailbox, record rings and maps: their stubs are x86 code, and the doorbell is
an I/O port arm64 lacks), the trap-step (every copy is stepped by the host)
and the cycle counter (event times are the host's).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from qprobe.arch import (
    ArchBlacklist,
    Boot,
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
    ReturnHijack,
    Traps,
    TrapStep,
    TrapWatch,
    Uprobes,
)
from qprobe.arch.arm64 import blacklist, kprobes, returns
from qprobe.arch.arm64.bootentry import Arm64Boot, SCTLR_ELx_M
from qprobe.arch.arm64.insn import BRK64_OPCODE_KPROBES
from qprobe.arch.arm64.paging import Arm64PageTables, MmuOff, page_tables
from qprobe.arch.arm64.ptregs import REGISTERS, SCTLR_EL1, TPIDR_EL1, user_mode
from qprobe.arch.arm64.traps import Arm64Traps
from qprobe.arch.arm64.uprobes import Arm64Uprobes
from qprobe.arch.arm64.vmcoreinfo import arch_crash_save_vmcoreinfo
from qprobe.arch.shared import resume_registers


class Arm64:
    """The arm64 implementation of :class:`qprobe.arch.Arch`."""

    name = "aarch64"
    gdb_architecture = "aarch64"
    breakpoint = BRK64_OPCODE_KPROBES.to_bytes(4, "little")
    # kprobe_breakpoint_handler hands pre_handlers regs->pc at the BRK itself (ELR_EL1 of a BRK is its own
    # address, arch/arm64/kernel/probes/kprobes.c).
    kprobe_ip_offset = 0
    ret_pops = returns.RET_POPS
    slot_size = kprobes.SLOT_SIZE
    registers: RegisterLayout = REGISTERS
    # arm64's ftrace site is the NOPs -fpatchable-function-entry puts before the prologue: no call to
    # decode as linked.  ftrace patches the second (a BL when traced; the first is ``mov x9, x30`` from
    # boot on), and arm64 selects no HAVE_KPROBES_ON_FTRACE: a kprobe there is refused (core/sites.py).
    ftrace_site: FtraceSite | None = None
    drgn_architecture = "AARCH64"
    trap_step: TrapStep | None = None
    trap_watch: TrapWatch | None = None
    optprobes: OptProbes | None = None
    guest_ram: GuestRam | None = None
    uprobes: Uprobes | None = Arm64Uprobes()
    cycle_counter: CycleCounter | None = None
    guest_call: GuestCall | None = None
    jump_label_probe = blacklist.JUMP_LABEL_PROBE
    jump_label_max = blacklist.JUMP_LABEL_MAX
    static_call_size = blacklist.STATIC_CALL_SIZE

    def __init__(self) -> None:
        # One per Arch object: it keeps what it read of each trap entry (pt_regs' size, from its code).
        self.traps: Traps = Arm64Traps()
        self.boot: Boot = Arm64Boot()

    def page_tables(self, regs: Mapping[str, int]) -> Arm64PageTables | MmuOff:
        """The tables TCR_EL1 shapes; none while the MMU is off (SCTLR_EL1.M clear: at reset, or in the kernel's
        first instructions, before __enable_mmu), until boot-time probes find the boot CPU with it on."""
        if not regs.get(SCTLR_EL1, SCTLR_ELx_M) & SCTLR_ELx_M:
            return MmuOff()
        return page_tables(regs)

    def vmcoreinfo(self, address: Callable[[str], int], virt_to_phys: Callable[[int], int],
                   read_u64: Callable[[int], int], paging: PageTables) -> list[str]:  # fmt: skip
        """arch/arm64/kernel/crash_core.c's lines (vmcore_info.c from 6.10)."""
        assert isinstance(paging, Arm64PageTables)
        return arch_crash_save_vmcoreinfo(address, virt_to_phys, read_u64, paging)

    # -- instructions (kprobes.c) ------------------------------------------------------------
    def arch_adjust_kprobe_addr(self, func_code: bytes, func_start: int, offset: int) -> int:
        """arm64 keeps the generic one: the address is the function's plus the offset."""
        return func_start + offset

    def entry_skip(self, func_code: bytes) -> int:
        """Nothing at an arm64 function's start is skipped: ``bti c`` and ``paciasp`` run out of line."""
        return 0

    def check_boundary(self, code: bytes, func_start: int, addr: int, patched: Mapping[int, int], name: str) -> None:
        kprobes.check_boundary(code, func_start, addr, patched, name)

    def arch_prepare_kprobe(
        self, code: bytes, addr: int, slot: int, where: str, exception_table: ExceptionTable | None
    ) -> Prepared:
        return kprobes.prepare_kprobe(code, addr, slot, where=where, exception_table=exception_table)

    def arch_slot_code(self, prep: Prepared) -> bytes:
        return kprobes.slot_code(prep)

    def arch_setup_resume(self, prep: Prepared, regs: Registers, mem: Memory, may_boost: bool,
                          may_trap_step: bool) -> Resume:  # fmt: skip
        """setup_singlestep(): simulate on the host, or run the copy out of line (arm64 never boosts)."""
        return kprobes.arch_setup_resume(prep, regs, mem, may_trap_step)

    def arch_slot_resume(self, slot: int, addr: int, ip: int, flags: int) -> tuple[int, int] | None:
        return kprobes.arch_slot_resume(slot, addr, ip, flags)

    def step_left_slot(self, prep: Prepared, ip: int) -> bool:
        return kprobes.step_left_slot(prep, ip)

    def arch_resume_singlestep(self, prep: Prepared, regs: Registers, mem: Memory) -> None:
        kprobes.resume_singlestep(prep, regs)

    def arch_fault_fixup(self, prep: Prepared, regs: Registers, mem: Memory) -> bool:
        return kprobes.arch_fault_fixup(prep, regs)

    arch_emulate_in_place = staticmethod(kprobes.emulate_in_place)

    # -- traps -------------------------------------------------------------------------------
    def resume_registers(self, resume: Resume) -> dict[str, int]:
        return resume_registers(self.registers, resume)

    def ip(self, regs: Mapping[str, int]) -> int:
        return regs["pc"]

    def arch_prepare_kretprobe(self, regs: Registers, read_u64: Callable[[int], int]) -> ReturnHijack:
        return returns.arch_prepare_kretprobe(regs, read_u64)

    def sp(self, regs: Mapping[str, int]) -> int:
        return regs["sp"]

    def flags(self, regs: Mapping[str, int]) -> int:
        return regs["cpsr"]

    def user_mode(self, regs: Mapping[str, int]) -> bool:
        return user_mode(regs["cpsr"])

    def percpu_base(self, regs: Mapping[str, int]) -> int:
        """TPIDR_EL1 holds this CPU's __per_cpu_offset in kernel and user mode alike (set_my_cpu_offset)."""
        return regs[TPIDR_EL1]

    # -- the blacklist and the text the kernel rewrites --------------------------------------
    def jump_label_size(self, code: bytes) -> int:
        return blacklist.jump_label_size(code)

    def arch_populate_kprobe_blacklist(self) -> ArchBlacklist:
        return blacklist.arch_populate_kprobe_blacklist()

    def arch_kretprobe_blacklist(self) -> frozenset[str]:
        return blacklist.arch_kretprobe_blacklist()


__all__ = ["Arm64"]
