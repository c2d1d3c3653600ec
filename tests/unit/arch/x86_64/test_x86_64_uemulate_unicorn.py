"""The user-instruction emulation against a CPU model (unicorn: QEMU's own x86 translator, which runs the guest).

Random registers; the instruction runs once in unicorn and once on the host emulation, and the registers,
flags and the stack must come out the same.  Skipped when unicorn (an optional test dependency) is absent.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

unicorn = pytest.importorskip(
    "unicorn", reason="unicorn is not installed (pip install unicorn); it only cross-checks the arch layer"
)
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from unicorn import x86_const as X  # noqa: E402

from qprobe.arch.x86_64.uprobes import X86Uprobes  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from fakes_x86_64 import REG_NAMES, FakeRegs  # noqa: E402

IP = 0x0000_5555_5555_4000
STACK = 0x0000_7FFF_FFFF_0000  # the stack page; rsp is put in its middle
DATA = 0x0000_5555_5556_0000  # what rip-relative and register-based operands point at
UC = {name: getattr(X, f"UC_X86_REG_{name.upper() if name[0] == 'r' else 'R' + name.upper()}")
      for name in REG_NAMES if name not in ("ip", "flags")}  # fmt: skip
# Encodings (GNU as) of what function prologues, call sites and libc's entries run.
# fmt: off
FORMS = [
    "4154", "55", "53", "6a05", "5b", "415c",  # push r12; push rbp; push rbx; push 5; pop rbx; pop r12
    "4889fb", "89f8", "88d8", "4c89e7", "b86e000000", "48c7c0f6ffffff",  # movs
    "488d0437", "8d4701", "488d442408", "488d0500100000",  # leas (the last rip-relative)
    "4883ec10", "4883c418", "4881ec08010000", "4801d8", "29c8", "83c001", "4883e801",  # add, sub
    "4885ff", "85c0", "84c0", "a801", "4883fa10", "4839c8", "83f8ff", "80fb2f",  # test, cmp
    "31c0", "4831d2", "81e1f0000000", "4809d2", "0c01", "483d00100000", "2580000000",  # xor, and, or; accumulator
    "488b0424", "8b442404", "48894424f8", "4c8b0501000100",  # loads and stores (the last rip-relative)
    "803d0900010000", "f30f1efa", "0f1f4000",  # cmp byte [rip],0; endbr64; nop
]
# fmt: on
WORD = st.integers(0, (1 << 64) - 1)


def unicorn_step(code: bytes, regs: FakeRegs, data: bytes) -> tuple[FakeRegs, bytes, bytes]:
    uc = unicorn.Uc(unicorn.UC_ARCH_X86, unicorn.UC_MODE_64)
    for base in (IP & ~0xFFF, STACK, DATA, (IP + 0x10000) & ~0xFFF):
        uc.mem_map(base, 0x2000)
    uc.mem_write(IP, code)
    uc.mem_write(STACK, data)
    uc.mem_write(DATA, data[:0x1000])
    uc.mem_write((IP + 0x10000) & ~0xFFF, data[:0x1000])
    for name, reg in UC.items():
        uc.reg_write(reg, getattr(regs, name))
    uc.reg_write(X.UC_X86_REG_EFLAGS, regs.flags)
    uc.emu_start(IP, 0, count=1)
    out = FakeRegs(**{name: uc.reg_read(reg) for name, reg in UC.items()})
    out.ip, out.flags = uc.reg_read(X.UC_X86_REG_RIP), uc.reg_read(X.UC_X86_REG_EFLAGS)
    return out, bytes(uc.mem_read(STACK, 0x2000)), bytes(uc.mem_read(DATA, 0x1000))


class Pages:
    """The same pages for the host's emulation."""

    def __init__(self, code: bytes, data: bytes) -> None:
        self.mem = {IP & ~0xFFF: bytearray(0x2000), STACK: bytearray(data),
                    DATA: bytearray(data[:0x1000]) + bytearray(0x1000),
                    (IP + 0x10000) & ~0xFFF: bytearray(data[:0x1000]) + bytearray(0x1000)}  # fmt: skip
        self.mem[IP & ~0xFFF][IP & 0xFFF : (IP & 0xFFF) + len(code)] = code

    def _at(self, addr: int, size: int) -> tuple[bytearray, int]:
        for base, buf in self.mem.items():
            if base <= addr and addr + size <= base + len(buf):
                return buf, addr - base
        raise AssertionError(f"{addr:#x} is outside the test's pages")

    def read(self, addr: int, size: int) -> bytes:
        buf, off = self._at(addr, size)
        return bytes(buf[off : off + size])

    fetch = read

    def write(self, addr: int, data: bytes) -> None:
        buf, off = self._at(addr, len(data))
        buf[off : off + len(data)] = data


@pytest.mark.parametrize("form", FORMS)
@settings(max_examples=25, deadline=None, database=None)
@given(values=st.lists(WORD, min_size=15, max_size=15), flags=st.integers(0, 0xFFF), seed=st.integers(0, 1 << 32))
def test_the_host_emulation_is_what_the_cpu_does(form: str, values: list[int], flags: int, seed: int) -> None:
    code = bytes.fromhex(form)
    data = random.Random(seed).randbytes(0x2000)  # the stack and the data page
    names = [n for n in REG_NAMES if n not in ("ip", "flags", "sp")]
    regs = FakeRegs(**dict(zip(names, values, strict=True)))
    # Registers used as addresses point into the data page (a low byte or index keeps them inside it).
    regs.di, regs.si, regs.cx = DATA + (regs.di & 0xFF), regs.si & 0xFF, regs.cx & 0x3F
    regs.sp = STACK + 0x1000 + (regs.sp & 0x7F8)
    regs.flags = 0x2 | (flags & 0xCD5)  # the arithmetic flags and DF, never TF
    regs.ip = IP
    want, stack, page = unicorn_step(code, regs, data)
    mem = Pages(code, data)
    got = FakeRegs(**{n: getattr(regs, n) for n in REG_NAMES})
    assert X86Uprobes().arch_uprobe_emulate(got, mem), form  # type: ignore[arg-type]
    assert got == want
    assert mem.read(STACK, 0x2000) == stack and mem.read(DATA, 0x1000) == page
