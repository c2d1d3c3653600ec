"""Where x86_64's boot first runs at the kernel's virtual addresses: found in vmlinux's own code.

The kernel starts at ``startup_64`` at a physical address (the decompressor's,
or the boot loader's, identity mapping), loads its own page tables and jumps
to its high virtual mapping through a register or a pointer, both relocated by
the KASLR slide.  6.1's ``secondary_startup_64`` does ``mov $1f, %rax;
jmp *%rax``, which ``startup_64`` reaches by a ``jmp`` into it; 6.9 ("x86/boot:
Simplify virtual switch on primary boot") made ``startup_64`` end in ``jmp
*common_startup_64_ptr(%rip)``.  Either way the target is the first instruction
run at ``link address + slide``; the secondary CPUs pass there too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from iced_x86 import Decoder, FlowControl, Instruction, OpKind

from qprobe.arch import BootStage
from qprobe.errors import SymbolError

MAX_INSNS = 400  # startup_64 to the jump is some tens of instructions; the bound keeps a bad decode short
MAX_BYTES = 0x400
CR0_PG = 1 << 31
RESET_CS, RESET_IP = 0xF000, 0xFFF0  # where a CPU comes out of reset (Intel SDM vol. 3, 9.1.4)


def boot_virtual_entry(read: Callable[[int, int], bytes], address: Callable[[str], int]) -> int:
    """The link address of the first instruction the boot CPU runs at virtual addresses."""
    at = address("startup_64")
    last_imm: dict[int, int] = {}  # registers loaded with a constant since the last jump
    for _ in range(MAX_INSNS):
        decoder = Decoder(64, read(at, MAX_BYTES), ip=at)
        insn = Instruction()
        jumped = False
        while decoder.can_decode:
            decoder.decode_out(insn)
            if insn.flow_control == FlowControl.UNCONDITIONAL_BRANCH and insn.op0_kind == OpKind.NEAR_BRANCH64:
                at, jumped = insn.near_branch_target, True  # startup_64's jmp into secondary_startup_64
                last_imm.clear()
                break
            if insn.flow_control == FlowControl.INDIRECT_BRANCH:
                if insn.op0_kind == OpKind.REGISTER and insn.op0_register in last_imm:
                    return last_imm[insn.op0_register]
                if insn.op0_kind == OpKind.MEMORY and insn.is_ip_rel_memory_operand:
                    return int.from_bytes(read(insn.ip_rel_memory_address, 8), "little")
                break
            if (insn.op_count == 2 and insn.op0_kind == OpKind.REGISTER
                    and insn.op1_kind in (OpKind.IMMEDIATE32TO64, OpKind.IMMEDIATE64)):  # fmt: skip
                last_imm[insn.op0_register] = insn.immediate(1) & ((1 << 64) - 1)
            elif insn.op0_kind == OpKind.REGISTER:
                last_imm.pop(insn.op0_register, None)
        if not jumped:
            break
    raise SymbolError("startup_64 reaches its virtual addresses in no way qprobe knows (mov $label, %reg; "
                      "jmp *%reg, or jmp *ptr(%rip)): boot-time probes need its first virtual instruction")  # fmt: skip


class X86Boot:
    """The :class:`qprobe.arch.Boot` facet of x86_64."""

    def boot_stage(self, regs: Mapping[str, int]) -> BootStage:
        """CR0.PG is on from the kernel's startup code on (the decompressor's long mode, then the kernel's
        own tables); a CPU comes out of reset at CS:IP f000:fff0.  A stub that shows no CR0 cannot tell: the
        kernel is taken to run, as an attach expects."""
        if regs.get("cr0", CR0_PG) & CR0_PG:
            return BootStage.KERNEL
        if regs["rip"] == RESET_IP and regs["cs"] == RESET_CS:
            return BootStage.RESET
        return BootStage.EARLY

    def arch_boot_entry(self, read: Callable[[int, int], bytes], address: Callable[[str], int]) -> int:
        return boot_virtual_entry(read, address)

    def arch_boot_switch(self, read: Callable[[int, int], bytes], address: Callable[[str], int]) -> int | None:
        """None: the decompressor picks the slide, and the candidates are armed (qprobe.kernel.bootslide)."""
        return None


__all__ = ["X86Boot", "boot_virtual_entry"]
