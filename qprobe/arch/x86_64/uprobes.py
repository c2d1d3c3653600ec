"""x86's :class:`qprobe.arch.Uprobes`: the answers of arch/x86/kernel/uprobes.c qprobe's user-space probes need."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import cast

from iced_x86 import Code, Decoder

from qprobe.arch import Registers, UserMemory
from qprobe.arch.x86_64.decode import decode_one
from qprobe.arch.x86_64.emulate import Regs
from qprobe.arch.x86_64.insn import MAX_INSN_SIZE
from qprobe.arch.x86_64.paging import PAGE_SIZE
from qprobe.arch.x86_64.uemulate import uprobe_emulate
from qprobe.errors import CannotProbe, MemoryFault

# arch/x86/include/asm/segment.h: the 64-bit user code segment (GDT_ENTRY_DEFAULT_USER_CS * 8 + 3); an ia32
# task runs on __USER32_CS (0x23).
USER_CS = 0x33

# Instructions that enter the kernel on purpose: a step that ends there is no fault to restart.
_SYSTEM_CALLS = frozenset({Code.SYSCALL, Code.SYSENTER, Code.INT_IMM8, Code.INT3, Code.INTO, Code.INT1})

# Leaf page-table entry bits (arch/x86/include/asm/pgtable_types.h).  The upper levels of a user address
# are _PAGE_TABLE (present, RW, user, accessed, dirty) in Linux, so the leaf decides; the kernel's copy of
# a PTI pair's user entries has NX set, which the leaf's own NX answers for.
_PAGE_PRESENT, _PAGE_RW, _PAGE_USER, _PAGE_ACCESSED, _PAGE_DIRTY = 0x1, 0x2, 0x4, 0x20, 0x40
_PAGE_PKEY = 0xF << 59  # a protection key other than 0: PKRU, which the host does not check, may deny it
_PAGE_NX = 1 << 63
_NEEDS = {
    "read": _PAGE_PRESENT | _PAGE_USER | _PAGE_ACCESSED,
    "fetch": _PAGE_PRESENT | _PAGE_USER | _PAGE_ACCESSED,
    "write": _PAGE_PRESENT | _PAGE_USER | _PAGE_ACCESSED | _PAGE_RW | _PAGE_DIRTY,
}


class X86Uprobes:
    """Which user instructions may be probed, a step that faulted, a function's return at its entry, and the
    instructions the host performs instead of stepping them."""

    uprobe_swbp_insn_size = 1  # UPROBE_SWBP_INSN_SIZE (asm/uprobes.h): the int3's one byte

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
        if after["cs"] & 3:  # still in user mode: the instruction completed
            return False
        return Decoder(64, code[:16]).decode().code not in _SYSTEM_CALLS

    def arch_uretprobe_frame(self, regs: Mapping[str, int], read: Callable[[int, int], bytes]) -> tuple[int, int]:
        """At a function's first instruction ``call`` has pushed the return address at rsp; ``ret`` pops it."""
        sp = regs["rsp"]
        return int.from_bytes(read(sp, 8), "little"), sp + 8

    def arch_uprobe_emulate(self, regs: Registers, mem: UserMemory) -> bool:
        """qprobe.arch.x86_64.uemulate on the bytes at ip, fetched as the task would (an instruction that ends
        on a page the task cannot fetch from is stepped, to fault as the CPU would)."""
        if regs.cs != USER_CS:  # an ia32 task (__USER32_CS): its instructions decode otherwise, stepped
            return False
        pt = cast(Regs, regs)
        ip = pt.ip
        try:
            code = mem.fetch(ip, min(MAX_INSN_SIZE, PAGE_SIZE - ip % PAGE_SIZE))
            try:
                insn = decode_one(code, ip)
            except CannotProbe:
                if len(code) == MAX_INSN_SIZE:
                    return False
                insn = decode_one(mem.fetch(ip, MAX_INSN_SIZE), ip)
            return uprobe_emulate(insn, pt, mem)
        except (CannotProbe, MemoryFault):
            return False

    def user_page_allows(self, entry: int, access: str) -> bool:
        need = _NEEDS[access]
        if entry & need != need or entry & _PAGE_PKEY:
            return False
        return access != "fetch" or not entry & _PAGE_NX


__all__ = ["X86Uprobes"]
