"""Boosting and synthesized jumps: Linux's can_boost() and synthesize_rel*().

A boosted probe runs the slot copy freely, followed by a ``jmp`` back to the
next original instruction, instead of single-stepping it. Whether that is
safe depends only on the instruction's opcode (Linux's twobyte_is_boostable
bitmap and the one-byte opcode switch), reproduced here as in Linux 6.1.
The same rules decide which instructions an optimized (jump) probe may copy.
"""

from __future__ import annotations

from iced_x86 import EncodingKind

from qprobe.arch import ExceptionTable
from qprobe.arch.shared import search_exception_tables
from qprobe.arch.x86_64.decode import Insn, skip_prefixes
from qprobe.errors import DisplacementOverflow

__all__ = [
    "CALL_INSN_OPCODE",
    "INT3_INSN_OPCODE",
    "JMP32_INSN_OPCODE",
    "JMP32_INSN_SIZE",
    "MAX_INSN_SIZE",
    "ExceptionTable",
    "can_boost",
    "search_exception_tables",
    "synthesize_relcall",
    "synthesize_reljump",
    "twobyte_is_boostable",
]

INT3_INSN_OPCODE = 0xCC
INT3_INSN_SIZE = 1
JMP32_INSN_OPCODE = 0xE9
JMP32_INSN_SIZE = 5
CALL_INSN_OPCODE = 0xE8
CALL_INSN_SIZE = 5
MAX_INSN_SIZE = 16
_MASK64 = (1 << 64) - 1


# --- synthesized jumps ----------------------------------------------------


def signed64(value: int) -> int:
    """``value`` as a signed 64-bit integer (addresses wrap like the CPU's)."""
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


def rel32(src_next: int, dst: int, what: str) -> int:
    """Displacement from ``src_next`` to ``dst``; DisplacementOverflow beyond ±2 GiB."""
    rel = signed64(dst - src_next)
    if not -(1 << 31) <= rel < (1 << 31):
        raise DisplacementOverflow(
            f"a {what} from {src_next:#x} to {dst:#x} spans {rel:+#x}, beyond the ±2 GiB of a rel32"
        )
    return rel


def __synthesize_relative_insn(src: int, dst: int, op: int, what: str) -> bytes:
    return bytes([op]) + rel32(src + 5, dst, what).to_bytes(4, "little", signed=True)


def synthesize_reljump(src: int, dst: int) -> bytes:
    """5-byte ``jmp rel32`` placed at ``src`` that lands on ``dst``."""
    return __synthesize_relative_insn(src, dst, JMP32_INSN_OPCODE, "jump")


def call_target(code: bytes, addr: int) -> int | None:
    """Where the ``call rel32`` ``code`` at ``addr`` goes (None: it is not one)."""
    if len(code) < CALL_INSN_SIZE or code[0] != CALL_INSN_OPCODE:
        return None
    return addr + CALL_INSN_SIZE + int.from_bytes(code[1:CALL_INSN_SIZE], "little", signed=True)


def synthesize_relcall(src: int, dst: int) -> bytes:
    """5-byte ``call rel32`` placed at ``src`` that calls ``dst``."""
    return __synthesize_relative_insn(src, dst, CALL_INSN_OPCODE, "call")


# --- can_boost -----------------------------------------------------------

# Linux's twobyte_is_boostable bitmap, one row of 16 second-opcode bytes per line:
# undefined/reserved opcodes, jcc, group opcodes and a few special ones can't boost.
_TWOBYTE_ROWS = (
    "0011001011000000",  # 00
    "0000000000000001",  # 10
    "1111000000000000",  # 20
    "0100000000000000",  # 30
    "1111111111111111",  # 40
    "0000000000000000",  # 50
    "1111111111110011",  # 60
    "0000111100000011",  # 70
    "0000000000000000",  # 80
    "1111111111111111",  # 90
    "1101110011011101",  # a0
    "1111111100011111",  # b0
    "1100000011111111",  # c0
    "0111010011011101",  # d0
    "0110010011011101",  # e0
    "0111010011101110",  # f0
)
twobyte_is_boostable = tuple(bit == "1" for row in _TWOBYTE_ROWS for bit in row)


_VEX_PREFIX_LEN = {0xC5: 2, 0xC4: 3, 0x8F: 3, 0x62: 4}  # VEX2, VEX3, XOP, EVEX


def opcode_bytes(insn: Insn) -> tuple[int, bytes, int]:
    """(nbytes, opcode bytes, offset of the byte after them) as Linux's insn decoder sees them.

    VEX/EVEX instructions count as one opcode byte, as in insn_get_opcode().
    """
    raw = insn.raw
    i = skip_prefixes(raw)
    if insn.instr.encoding != EncodingKind.LEGACY:
        pos = i + _VEX_PREFIX_LEN.get(raw[i], 1)
        return 1, raw[pos : pos + 1], pos + 1
    if raw[i] == 0x0F:
        if raw[i + 1] in (0x38, 0x3A):
            return 3, raw[i : i + 3], i + 3
        return 2, raw[i : i + 2], i + 2
    return 1, raw[i : i + 1], i + 1


def can_boost(insn: Insn, exception_table: ExceptionTable | None = None) -> bool:
    """Linux 6.1 ``can_boost()``: may the copy run freely, followed by a jmp back?

    Boosting skips the single-step: the slot holds the copy plus a jump to the
    next original instruction. Only instructions whose effect does not depend
    on where they run, and that cannot fault into a fixup, qualify.
    """
    if search_exception_tables(exception_table, insn.addr):
        return False  # a page fault may occur here; the fixup is keyed by the original address
    nbytes, opcode, after = opcode_bytes(insn)
    if nbytes == 2:
        return twobyte_is_boostable[opcode[1]]
    if nbytes != 1:
        return False
    for prefix in insn.raw[: skip_prefixes(insn.raw)]:
        # Can't boost address-size override prefix and CS override prefix
        if prefix in (0x2E, 0x67):
            return False
    op = opcode[0]
    if (
        op == 0x62  # bound
        or 0x70 <= op <= 0x7F  # conditional jumps
        or op == 0x9A  # call far
        or 0xC0 <= op <= 0xC1  # grp2
        or 0xCC <= op <= 0xCE  # software exceptions
        or 0xD0 <= op <= 0xD3  # grp2
        or op == 0xD6  # (UD)
        or 0xD8 <= op <= 0xDF  # ESC
        or 0xE0 <= op <= 0xE3  # LOOP*, JCXZ
        or 0xE8 <= op <= 0xE9  # near call, jmp
        or op == 0xEB  # short jmp
        or 0xF0 <= op <= 0xF4  # LOCK/REP, HLT
        or 0xF6 <= op <= 0xF7  # grp3
        or op == 0xFE  # grp4
    ):
        return False
    if op == 0xFF:  # grp5: only indirect jmp is boostable
        return after < len(insn.raw) and (insn.raw[after] >> 3) & 7 == 4
    return True
