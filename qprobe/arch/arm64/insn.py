"""A64 instruction classes and fields, as arch/arm64/include/asm/insn.h and arch/arm64/lib/insn.c define them.

Only what the kprobes decoder (:mod:`qprobe.arch.arm64.decode`) and the
simulator (:mod:`qprobe.arch.arm64.simulate`) need.  Each ``aarch64_insn_is_*``
test is the kernel's ``__AARCH64_INSN_FUNCS(abbr, mask, val)``:
``(insn & mask) == val``, with the masks of Linux 6.1 and 6.12 (which agree on
every one used here; ``mops`` is 6.13's and 6.12.2's, see decode.py).
Instructions are 32-bit words, little-endian in memory (``le32_to_cpu``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

AARCH64_INSN_SIZE = 4
_MASK64 = (1 << 64) - 1

# arch/arm64/include/asm/debug-monitors.h and brk-imm.h: BRK #imm is AARCH64_BREAK_MON | imm << 5.
AARCH64_BREAK_MON = 0xD4200000
KPROBES_BRK_IMM = 0x004
UPROBES_BRK_IMM = 0x005
KPROBES_BRK_SS_IMM = 0x006
BRK64_OPCODE_KPROBES = AARCH64_BREAK_MON | KPROBES_BRK_IMM << 5
BRK64_OPCODE_UPROBES = AARCH64_BREAK_MON | UPROBES_BRK_IMM << 5
BRK64_OPCODE_KPROBES_SS = AARCH64_BREAK_MON | KPROBES_BRK_SS_IMM << 5

# arch/arm64/include/uapi/asm/ptrace.h: PSTATE's condition flags and exception masks.
PSR_F_BIT = 0x00000040
PSR_I_BIT = 0x00000080
PSR_A_BIT = 0x00000100
PSR_D_BIT = 0x00000200
PSR_V_BIT = 0x10000000
PSR_C_BIT = 0x20000000
PSR_Z_BIT = 0x40000000
PSR_N_BIT = 0x80000000
DAIF_MASK = PSR_D_BIT | PSR_A_BIT | PSR_I_BIT | PSR_F_BIT  # asm/daifflags.h
DAIF_SHIFT = 6  # PSR_F_BIT's position: DAIF as a 4-bit number is (pstate & DAIF_MASK) >> DAIF_SHIFT

# enum aarch64_insn_special_register: MRS/MSR's op0:op1:CRn:CRm:op2 field (bits 20:5).
AARCH64_INSN_SPCLREG_DAIF = 0xDA11

# enum aarch64_insn_hint_cr_op: a HINT's CRm:op2 (bits 11:5), as the kernel shifts them.
AARCH64_INSN_HINT_NOP = 0x00 << 5
AARCH64_INSN_HINT_XPACLRI = 0x07 << 5
AARCH64_INSN_HINT_PACIA_1716 = 0x08 << 5
AARCH64_INSN_HINT_PACIB_1716 = 0x0A << 5
AARCH64_INSN_HINT_PACIAZ = 0x18 << 5
AARCH64_INSN_HINT_PACIASP = 0x19 << 5
AARCH64_INSN_HINT_PACIBZ = 0x1A << 5
AARCH64_INSN_HINT_PACIBSP = 0x1B << 5
AARCH64_INSN_HINT_BTI = 0x20 << 5
AARCH64_INSN_HINT_BTIC = 0x22 << 5
AARCH64_INSN_HINT_BTIJ = 0x24 << 5
AARCH64_INSN_HINT_BTIJC = 0x26 << 5

# aarch64_insn_is_steppable_hint()'s list (asm/insn.h), the same in 6.1 and 6.12: NOP, and the
# PAC and BTI hints that only sign a register or mark a landing pad.  The AUT* hints were taken
# off it in 2020, long before 6.1: a failed authentication faults.
STEPPABLE_HINTS = frozenset({
    AARCH64_INSN_HINT_XPACLRI, AARCH64_INSN_HINT_PACIA_1716, AARCH64_INSN_HINT_PACIB_1716,
    AARCH64_INSN_HINT_PACIAZ, AARCH64_INSN_HINT_PACIASP, AARCH64_INSN_HINT_PACIBZ,
    AARCH64_INSN_HINT_PACIBSP, AARCH64_INSN_HINT_BTI, AARCH64_INSN_HINT_BTIC, AARCH64_INSN_HINT_BTIJ,
    AARCH64_INSN_HINT_BTIJC, AARCH64_INSN_HINT_NOP,
})  # fmt: skip


def _funcs(mask: int, val: int) -> Callable[[int], bool]:
    """``__AARCH64_INSN_FUNCS``: the test ``(insn & mask) == val``."""
    assert not ~mask & val
    return lambda insn: insn & mask == val


aarch64_insn_is_adr = _funcs(0x9F000000, 0x10000000)
aarch64_insn_is_adrp = _funcs(0x9F000000, 0x90000000)
aarch64_insn_is_prfm_lit = _funcs(0xFF000000, 0xD8000000)
aarch64_insn_is_ldr_lit = _funcs(0xBF000000, 0x18000000)
aarch64_insn_is_ldrsw_lit = _funcs(0xFF000000, 0x98000000)
aarch64_insn_is_exclusive = _funcs(0x3F800000, 0x08000000)
# The 6.1/6.12 masks: bit 23 joined them only after 6.12 (with the BPF load-acquire/store-release
# work of 2025), so LDAR/STLR (and CAS) count as exclusive loads/stores in the atomic-sequence scan.
aarch64_insn_is_load_ex = _funcs(0x3F400000, 0x08400000)
aarch64_insn_is_store_ex = _funcs(0x3F400000, 0x08000000)
aarch64_insn_is_mops = _funcs(0x3B200C00, 0x19000400)  # FEAT_MOPS CPY*/SET* (6.13, 6.12.2)
aarch64_insn_is_b = _funcs(0xFC000000, 0x14000000)
aarch64_insn_is_bl = _funcs(0xFC000000, 0x94000000)
aarch64_insn_is_cbz = _funcs(0x7F000000, 0x34000000)
aarch64_insn_is_cbnz = _funcs(0x7F000000, 0x35000000)
aarch64_insn_is_tbz = _funcs(0x7F000000, 0x36000000)
aarch64_insn_is_tbnz = _funcs(0x7F000000, 0x37000000)
aarch64_insn_is_bcond = _funcs(0xFF000010, 0x54000000)
aarch64_insn_is_exception = _funcs(0xFF000000, 0xD4000000)
aarch64_insn_is_hint = _funcs(0xFFFFF01F, 0xD503201F)
aarch64_insn_is_br = _funcs(0xFFFFFC1F, 0xD61F0000)
aarch64_insn_is_br_auth = _funcs(0xFEFFF800, 0xD61F0800)
aarch64_insn_is_blr = _funcs(0xFFFFFC1F, 0xD63F0000)
aarch64_insn_is_blr_auth = _funcs(0xFEFFF800, 0xD63F0800)
aarch64_insn_is_ret = _funcs(0xFFFFFC1F, 0xD65F0000)
aarch64_insn_is_ret_auth = _funcs(0xFFFFFBFF, 0xD65F0BFF)
aarch64_insn_is_eret = _funcs(0xFFFFFFFF, 0xD69F03E0)
aarch64_insn_is_eret_auth = _funcs(0xFFFFFBFF, 0xD69F0BFF)
aarch64_insn_is_mrs = _funcs(0xFFF00000, 0xD5300000)
aarch64_insn_is_msr_imm = _funcs(0xFFF8F01F, 0xD500401F)
aarch64_insn_is_msr_reg = _funcs(0xFFF00000, 0xD5100000)
# Not one of the kernel's tests: LDR (literal, SIMD&FP), opc:011:V=1:00 (decode.py refuses it).
aarch64_insn_is_ldr_lit_simd = _funcs(0x3F000000, 0x1C000000)


def aarch64_insn_is_class_branch_sys(insn: int) -> bool:
    """AARCH64_INSN_CLS_BR_SYS: the encoding class (bits 28:25, aarch64_insn_encoding_class[]) 101x."""
    return insn & 0x1C000000 == 0x14000000


def aarch64_insn_is_adr_adrp(insn: int) -> bool:
    return aarch64_insn_is_adr(insn) or aarch64_insn_is_adrp(insn)


def aarch64_insn_uses_literal(insn: int) -> bool:
    """ldr/ldrsw (literal), adr/adrp, prfm (literal): lib/insn.c's list, which has no SIMD&FP literal load."""
    return (aarch64_insn_is_ldr_lit(insn) or aarch64_insn_is_ldrsw_lit(insn) or aarch64_insn_is_adr_adrp(insn)
            or aarch64_insn_is_prfm_lit(insn))  # fmt: skip


def aarch64_insn_is_branch(insn: int) -> bool:
    """b, bl, cb*, tb*, ret*, b.cond, br*, blr* (lib/insn.c): the pointer-authenticated forms too."""
    tests = (aarch64_insn_is_b, aarch64_insn_is_bl, aarch64_insn_is_cbz, aarch64_insn_is_cbnz, aarch64_insn_is_tbz,
             aarch64_insn_is_tbnz, aarch64_insn_is_ret, aarch64_insn_is_ret_auth, aarch64_insn_is_br,
             aarch64_insn_is_br_auth, aarch64_insn_is_blr, aarch64_insn_is_blr_auth, aarch64_insn_is_bcond)  # fmt: skip
    return any(test(insn) for test in tests)


def aarch64_insn_is_steppable_hint(insn: int) -> bool:
    return aarch64_insn_is_hint(insn) and insn & 0xFE0 in STEPPABLE_HINTS


def aarch64_insn_extract_system_reg(insn: int) -> int:
    """An MRS/MSR's system register, op0:op1:CRn:CRm:op2 (asm/insn.h)."""
    return (insn & 0x1FFFE0) >> 5


# -- immediates ------------------------------------------------------------------------------


def sign_extend64(value: int, index: int) -> int:
    """linux/bitops.h ``sign_extend64(value, index)``: bit ``index`` is the sign bit; a Python int back."""
    shift = index + 1
    value &= (1 << shift) - 1
    return value - (1 << shift) if value >> index & 1 else value


sign_extend32 = sign_extend64  # the same value: every field here is narrower than 32 bits


def bbl_displacement(insn: int) -> int:
    """B/BL's imm26 * 4 (simulate-insn.c)."""
    return sign_extend32((insn & 0x3FFFFFF) << 2, 27)


def bcond_displacement(insn: int) -> int:
    """B.cond's, CBZ/CBNZ's and LDR (literal)'s imm19 * 4: ``cbz_displacement`` and ``ldr_displacement`` too."""
    return sign_extend32((insn >> 5 & 0x7FFFF) << 2, 20)


cbz_displacement = bcond_displacement
ldr_displacement = bcond_displacement


def tbz_displacement(insn: int) -> int:
    """TBZ/TBNZ's imm14 * 4."""
    return sign_extend32((insn >> 5 & 0x3FFF) << 2, 15)


def adr_imm(insn: int) -> int:
    """ADR/ADRP's immhi:immlo, sign-extended (simulate_adr_adrp)."""
    return sign_extend64((insn >> 3 & 0x1FFFFC) | (insn >> 29 & 0x3), 20)


# -- conditions ------------------------------------------------------------------------------


def _hi(pstate: int) -> bool:
    return bool(pstate & ~(pstate >> 1) & PSR_C_BIT)  # C set and Z clear


def _ge(pstate: int) -> bool:
    return not (pstate ^ (pstate << 3)) & PSR_N_BIT  # N == V


def _gt(pstate: int) -> bool:
    return not ((pstate ^ (pstate << 3)) | (pstate << 1)) & PSR_N_BIT  # N == V and Z clear


# aarch32_opcode_cond_checks[16] (arch/arm64/lib/insn.c, __check_eq ... __check_al), indexed by a
# condition code; simulate_b_cond() hands it pstate's low 32 bits.  NV (15) is "always", as AArch64's is.
aarch32_opcode_cond_checks: tuple[Callable[[int], bool], ...] = (
    lambda p: bool(p & PSR_Z_BIT),  # EQ
    lambda p: not p & PSR_Z_BIT,  # NE
    lambda p: bool(p & PSR_C_BIT),  # CS
    lambda p: not p & PSR_C_BIT,  # CC
    lambda p: bool(p & PSR_N_BIT),  # MI
    lambda p: not p & PSR_N_BIT,  # PL
    lambda p: bool(p & PSR_V_BIT),  # VS
    lambda p: not p & PSR_V_BIT,  # VC
    _hi,  # HI
    lambda p: not _hi(p),  # LS
    _ge,  # GE
    lambda p: not _ge(p),  # LT
    _gt,  # GT
    lambda p: not _gt(p),  # LE
    lambda p: True,  # AL
    lambda p: True,  # NV
)


# -- memory ----------------------------------------------------------------------------------


def le32(code: bytes, off: int = 0) -> int:
    """``le32_to_cpu(*addr)``: the instruction word at byte ``off``."""
    return int.from_bytes(code[off : off + AARCH64_INSN_SIZE], "little")


def recover_bytes(code: bytes, start: int, patched: Mapping[int, int] | None) -> bytes:
    """``code`` (read at ``start``) with the original bytes put back under qprobe's own breakpoints.

    ``patched`` maps each byte address qprobe wrote to the byte that was there.
    """
    if not patched:
        return code
    buf = bytearray(code)
    for off in range(len(buf)):
        was = patched.get(start + off)
        if was is not None:
            buf[off] = was
    return bytes(buf)


def u64(value: int) -> int:
    """A register's 64 bits."""
    return value & _MASK64
