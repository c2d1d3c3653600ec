"""arch/arm64/kernel/probes/simulate-insn.c on the host: the instructions a probe runs without a slot.

Each ``simulate_*`` takes the instruction word, its address and the trapped
context's registers (the pt_regs names ``x0`` ... ``x30``, ``sp``, ``pc``,
``pstate``), and sets them as the instruction would, the pc included.  As
the kernel's ``get_x_reg``/``set_x_reg`` do, register number 31 reads as
zero and is never written: none of these instructions names sp.  A W
register's write clears its upper half (``set_w_reg``).  The literal loads
read guest memory through ``read(addr, size)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from qprobe.arch.arm64.decode import NEWEST, KernelVersion, ldr_literal_fixed
from qprobe.arch.arm64.insn import (
    AARCH64_INSN_SIZE,
    aarch32_opcode_cond_checks,
    adr_imm,
    bbl_displacement,
    bcond_displacement,
    cbz_displacement,
    ldr_displacement,
    sign_extend64,
    tbz_displacement,
    u64,
)

Read = Callable[[int, int], bytes]


class SimRegs(Protocol):
    """The registers a simulation reads and writes, by pt_regs name (``qprobe.arch.Registers`` is one)."""

    def __getattr__(self, name: str) -> int: ...
    def __setattr__(self, name: str, value: int) -> None: ...


def get_x_reg(regs: SimRegs, reg: int) -> int:
    return u64(getattr(regs, f"x{reg}")) if reg < 31 else 0


def get_w_reg(regs: SimRegs, reg: int) -> int:
    return get_x_reg(regs, reg) & 0xFFFFFFFF


def set_x_reg(regs: SimRegs, reg: int, val: int) -> None:
    if reg < 31:
        setattr(regs, f"x{reg}", u64(val))


def set_w_reg(regs: SimRegs, reg: int, val: int) -> None:
    if reg < 31:
        setattr(regs, f"x{reg}", val & 0xFFFFFFFF)


def _advance(regs: SimRegs) -> None:
    """``instruction_pointer_set(regs, instruction_pointer(regs) + 4)``."""
    regs.pc = u64(regs.pc + AARCH64_INSN_SIZE)


def _check_cbz(opcode: int, regs: SimRegs) -> bool:
    xn = opcode & 0x1F
    return (get_x_reg(regs, xn) if opcode & 1 << 31 else get_w_reg(regs, xn)) == 0


def _tbz_bit(opcode: int, regs: SimRegs) -> int:
    bit_pos = (opcode & 1 << 31) >> 26 | (opcode >> 19 & 0x1F)  # b5:b40
    return get_x_reg(regs, opcode & 0x1F) >> bit_pos & 1


def simulate_adr_adrp(opcode: int, addr: int, regs: SimRegs) -> None:
    imm = adr_imm(opcode)
    # ADRP (bit 31) counts 4 KiB pages from the instruction's page.
    val = (imm << 12) + (addr & ~0xFFF) if opcode & 0x80000000 else imm + addr
    set_x_reg(regs, opcode & 0x1F, val)
    _advance(regs)


def simulate_b_bl(opcode: int, addr: int, regs: SimRegs) -> None:
    if opcode & 1 << 31:  # BL: the link register is x30
        set_x_reg(regs, 30, addr + AARCH64_INSN_SIZE)
    regs.pc = u64(addr + bbl_displacement(opcode))


def simulate_b_cond(opcode: int, addr: int, regs: SimRegs) -> None:
    disp = AARCH64_INSN_SIZE
    if aarch32_opcode_cond_checks[opcode & 0xF](regs.pstate & 0xFFFFFFFF):
        disp = bcond_displacement(opcode)
    regs.pc = u64(addr + disp)


def simulate_br_blr_ret(opcode: int, addr: int, regs: SimRegs) -> None:
    # The pc first, in case of a "blr lr" (the kernel's comment).
    regs.pc = get_x_reg(regs, opcode >> 5 & 0x1F)
    if opcode >> 21 & 0x3 == 1:  # BLR
        set_x_reg(regs, 30, addr + AARCH64_INSN_SIZE)


def simulate_cbz_cbnz(opcode: int, addr: int, regs: SimRegs) -> None:
    zero = _check_cbz(opcode, regs)
    taken = not zero if opcode & 1 << 24 else zero  # bit 24: CBNZ
    regs.pc = u64(addr + (cbz_displacement(opcode) if taken else AARCH64_INSN_SIZE))


def simulate_tbz_tbnz(opcode: int, addr: int, regs: SimRegs) -> None:
    bit = _tbz_bit(opcode, regs)
    taken = bit != 0 if opcode & 1 << 24 else bit == 0  # bit 24: TBNZ
    regs.pc = u64(addr + (tbz_displacement(opcode) if taken else AARCH64_INSN_SIZE))


def simulate_ldr_literal(opcode: int, addr: int, regs: SimRegs, read: Read, version: KernelVersion = NEWEST) -> None:
    """LDR Xt/Wt, label.  Before the 6.12 fix (6.1.113 in 6.1's stable series) the kernel loaded 64 bits
    for a W register too and kept the low half: the same value, from a read twice as wide."""
    load_addr = u64(addr + ldr_displacement(opcode))
    xn = opcode & 0x1F
    if opcode & 1 << 30:
        set_x_reg(regs, xn, int.from_bytes(read(load_addr, 8), "little"))
    else:
        size = 4 if ldr_literal_fixed(version) else 8
        set_w_reg(regs, xn, int.from_bytes(read(load_addr, size), "little"))
    _advance(regs)


def simulate_ldrsw_literal(opcode: int, addr: int, regs: SimRegs, read: Read) -> None:
    load_addr = u64(addr + ldr_displacement(opcode))
    word = int.from_bytes(read(load_addr, 4), "little")
    set_x_reg(regs, opcode & 0x1F, sign_extend64(word, 31))
    _advance(regs)


_PLAIN: dict[str, Callable[[int, int, SimRegs], None]] = {
    "simulate_adr_adrp": simulate_adr_adrp,
    "simulate_b_bl": simulate_b_bl,
    "simulate_b_cond": simulate_b_cond,
    "simulate_br_blr_ret": simulate_br_blr_ret,
    "simulate_cbz_cbnz": simulate_cbz_cbnz,
    "simulate_tbz_tbnz": simulate_tbz_tbnz,
}


def simulate(handler: str, opcode: int, addr: int, regs: SimRegs, read: Read,
             version: KernelVersion = NEWEST) -> None:  # fmt: skip
    """``arch_simulate_insn()``: run the handler the decoder named (``Decoded.handler``)."""
    if handler == "simulate_ldr_literal":
        simulate_ldr_literal(opcode, addr, regs, read, version)
    elif handler == "simulate_ldrsw_literal":
        simulate_ldrsw_literal(opcode, addr, regs, read)
    else:
        _PLAIN[handler](opcode, addr, regs)
