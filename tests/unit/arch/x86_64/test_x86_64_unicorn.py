"""Cross-check relocation and emulation against a real x86 CPU model (unicorn).

The original instruction runs at its own address and the relocated copy at
the slot (or the emulation runs on the host); registers and memory must come
out the same. Skipped when unicorn (an optional test dependency) is absent.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest

unicorn = pytest.importorskip(
    "unicorn", reason="unicorn is not installed (pip install unicorn); it only cross-checks the arch layer"
)
from hypothesis import assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from unicorn import x86_const as X  # noqa: E402

from qprobe.arch.x86_64.emulate import emulate  # noqa: E402
from qprobe.arch.x86_64.insn import TRAP_COPY, prepare_kprobe, resume_singlestep, resume_trap_step  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from fakes_x86_64 import FakeMem, FakeRegs  # noqa: E402

PAGE = 0x1000
# unicorn cannot execute in the upper canonical half, so the "kernel" lives
# in the lower half here; the pure tests cover the wrap-around arithmetic.
ADDR = 0x00007F0081000100
STACK = 0x00007E0000008000
LOW_TEXT = (0x0000100000000000, 0x00007F0000000000)
DATA_VALUE = 0x1122334455667788
UC_REGS = {
    "ax": X.UC_X86_REG_RAX,
    "bx": X.UC_X86_REG_RBX,
    "cx": X.UC_X86_REG_RCX,
    "dx": X.UC_X86_REG_RDX,
    "si": X.UC_X86_REG_RSI,
    "di": X.UC_X86_REG_RDI,
    "bp": X.UC_X86_REG_RBP,
    "sp": X.UC_X86_REG_RSP,
    **{f"r{n}": getattr(X, f"UC_X86_REG_R{n}") for n in range(8, 16)},
    "ip": X.UC_X86_REG_RIP,
    "flags": X.UC_X86_REG_EFLAGS,
}


class Machine:
    """A unicorn x86_64 CPU with pages mapped on demand."""

    def __init__(self) -> None:
        self.uc = unicorn.Uc(unicorn.UC_ARCH_X86, unicorn.UC_MODE_64)
        self.pages: set[int] = set()
        # With count=1 unicorn still fetches at the branch target: map it on demand.
        self.uc.hook_add(unicorn.UC_HOOK_MEM_FETCH_UNMAPPED, self._map_on_fetch)

    def _map_on_fetch(self, uc: object, access: int, addr: int, size: int, value: int, data: object) -> bool:
        self.write(addr, b"\x90")
        return True

    def write(self, addr: int, data: bytes) -> None:
        for page in range(addr & ~(PAGE - 1), addr + len(data), PAGE):
            if page not in self.pages:
                self.uc.mem_map(page, PAGE)
                self.pages.add(page)
        self.uc.mem_write(addr, data)

    def read(self, addr: int, size: int) -> bytes:
        return bytes(self.uc.mem_read(addr, size))

    def step(self, code: bytes, at: int, regs: FakeRegs) -> FakeRegs:
        self.write(at, code)
        for name, uc_reg in UC_REGS.items():
            if name != "ip":
                self.uc.reg_write(uc_reg, getattr(regs, name))
        self.uc.emu_start(at, 0, count=1)
        out = FakeRegs()
        for name, uc_reg in UC_REGS.items():
            setattr(out, name, self.uc.reg_read(uc_reg))
        return out


# --- relocation --------------------------------------------------------------

RIP_FORMS = [
    "488d05{disp}",  # lea rax,[rip+disp]
    "488b05{disp}",  # mov rax,[rip+disp]
    "480305{disp}",  # add rax,[rip+disp]
    "4c8b3d{disp}",  # mov r15,[rip+disp]
    "0fb605{disp}",  # movzx eax,byte [rip+disp]
    "483b05{disp}",  # cmp rax,[rip+disp] (flags)
    "48c705{disp}efbeadde",  # mov qword [rip+disp],0xffffffffdeadbeef
]


def check_relocation(form: str, addr: int, disp: int, slot: int) -> None:
    raw = bytes.fromhex(form.format(disp=disp.to_bytes(4, "little", signed=True).hex()))
    prep = prepare_kprobe(raw + b"\x90" * 16, addr, slot)
    target = prep.insn.memory_target
    assert target is not None
    results = []
    for code, at in ((raw, addr), (prep.copy, slot)):
        m = Machine()
        m.write(target & ~7, DATA_VALUE.to_bytes(8, "little") * 2)
        regs = m.step(code, at, FakeRegs(ax=5, sp=STACK, flags=0x2))
        stored = m.read(target & ~7, 16)
        if at == slot:
            resume_singlestep(prep, regs)
        results.append((regs, stored))
    (orig, orig_mem), (moved, moved_mem) = results
    assert moved == orig
    assert moved_mem == orig_mem


@pytest.mark.parametrize("form", RIP_FORMS)
@pytest.mark.parametrize("disp", [0x1000, -0x2000, 0x4FFF0000, -0x7FFF0000])
def test_relocated_copy_computes_the_same(form: str, disp: int) -> None:
    check_relocation(form, ADDR, disp, ADDR - 0x3000_0000)


@settings(max_examples=60, deadline=None, database=None)
@given(
    form=st.sampled_from(RIP_FORMS),
    addr=st.integers(*LOW_TEXT),
    disp=st.integers(-(1 << 31), (1 << 31) - 1),
    slot_rel=st.integers(-(1 << 31), (1 << 31) - 1),
)
def test_relocated_copy_computes_the_same_randomly(form: str, addr: int, disp: int, slot_rel: int) -> None:
    slot = addr + slot_rel
    assume(PAGE <= slot < (1 << 47) - PAGE and abs(slot - addr) > 64)
    length = len(bytes.fromhex(form.format(disp="00000000")))
    target = addr + length + disp
    assume(PAGE <= target < (1 << 47) - 2 * PAGE and -(1 << 31) <= target - (slot + length) < (1 << 31))
    assume(abs(target - addr) > 2 * PAGE and abs(target - slot) > 2 * PAGE)
    check_relocation(form, addr, disp, slot)


IF = 0x200


@pytest.mark.parametrize("off", TRAP_COPY)
@pytest.mark.parametrize("form", [*RIP_FORMS, "55", "5b", "4801d8", "f3a4", "480fc1c3"])
def test_the_int3_terminated_copy_runs_to_its_int3_and_resumes_the_same(form: str, off: int) -> None:
    """The whole slot runs from the trap copy (interrupts off) and stops at its int3; the result is the original's."""
    raw = bytes.fromhex(form.format(disp=(0x1000).to_bytes(4, "little").hex()))
    slot = ADDR - 0x3000_0000
    prep = prepare_kprobe(raw + b"\x90" * 16, ADDR, slot)
    before = FakeRegs(ax=5, bx=0x10, cx=3, si=STACK - 0x80, di=STACK - 0x40, sp=STACK, flags=0x2 | IF * (off > 32))
    results = []
    for code, at in ((raw, ADDR), (prep.slot_code(), slot)):
        m = Machine()
        m.write(STACK - 0x100, bytes(range(256)) * 2)
        if prep.insn.memory_target is not None:
            m.write(prep.insn.memory_target & ~7, DATA_VALUE.to_bytes(8, "little") * 2)
        regs = FakeRegs(**vars(before))
        start = at if at == ADDR else at + off
        if at != ADDR:
            regs.flags &= ~IF
        m.write(at, code)
        for name, uc_reg in UC_REGS.items():
            if name != "ip":
                m.uc.reg_write(uc_reg, getattr(regs, name))
        end = start + len(raw)
        m.uc.emu_start(start, end)  # the copy may be a rep string: run until its int3
        out = FakeRegs(**{name: m.uc.reg_read(uc_reg) for name, uc_reg in UC_REGS.items()})
        if at != ADDR:
            assert m.read(end, 1) == b"\xcc"
            resume_trap_step(prep, out)
        results.append((out, m.read(STACK - 0x100, 0x200)))
    assert results[0] == results[1]


# --- emulation ----------------------------------------------------------------


def compare_emulation(
    hexcode: str, regs: FakeRegs, stack: bytes = b"", mem_extra: dict[int, bytes] | None = None
) -> None:
    raw = bytes.fromhex(hexcode)
    prep = prepare_kprobe(raw + b"\x90" * 16, ADDR, ADDR - 0x1000_0000)
    assert prep.emulate is not None

    m = Machine()
    fake = FakeMem()
    for where, data in [(regs.sp - 0x100, bytes(0x100) + stack), *(mem_extra or {}).items()]:
        m.write(where, data)
        fake.write(where, data)
    expected = m.step(raw, ADDR, regs)

    host = FakeRegs(**vars(regs))
    host.ip = ADDR
    emulate(prep, host, fake)
    assert (host.ip, host.sp, host.cx) == (expected.ip, expected.sp, expected.cx), hexcode
    assert fake.read(regs.sp - 0x100, 0x100 + len(stack)) == m.read(regs.sp - 0x100, 0x100 + len(stack))


CF, PF, ZF, SF, OF = 1 << 0, 1 << 2, 1 << 6, 1 << 7, 1 << 11


@pytest.mark.parametrize("cc", range(16))
def test_jcc_matches_the_cpu(cc: int) -> None:
    for bits in itertools.product([0, 1], repeat=5):
        flags = 0x2 | sum(f for f, b in zip((CF, PF, ZF, SF, OF), bits, strict=True) if b)
        compare_emulation(f"{0x70 + cc:02x}40", FakeRegs(sp=STACK, flags=flags))
        compare_emulation(f"0f{0x80 + cc:02x}00100000", FakeRegs(sp=STACK, flags=flags))


@pytest.mark.parametrize("hexcode", ["e2f0", "e1f0", "e0f0", "e3f0", "67e3f0", "67e2f0", "67e1f0"])
@pytest.mark.parametrize("rcx", [0, 1, 2, 0x1_0000_0000, 0x1_0000_0001, (1 << 64) - 1])
@pytest.mark.parametrize("zf", [0, ZF])
def test_loops_match_the_cpu(hexcode: str, rcx: int, zf: int) -> None:
    compare_emulation(hexcode, FakeRegs(sp=STACK, cx=rcx, flags=0x2 | zf))


def test_calls_and_returns_match_the_cpu() -> None:
    ret = (0x00007F0081ABCDEF).to_bytes(8, "little")
    compare_emulation("e8fb0f0000", FakeRegs(sp=STACK))
    compare_emulation("e9fb0f0000", FakeRegs(sp=STACK))
    compare_emulation("ebfe", FakeRegs(sp=STACK))
    compare_emulation("c3", FakeRegs(sp=STACK), stack=ret)
    compare_emulation("c21000", FakeRegs(sp=STACK), stack=ret + bytes(16))
    compare_emulation("ffd0", FakeRegs(sp=STACK, ax=0x00007F0081111110))
    compare_emulation("41ffd3", FakeRegs(sp=STACK, r11=0x00007F0081111110))
    compare_emulation("ffd4", FakeRegs(sp=STACK))
    compare_emulation("ffe0", FakeRegs(sp=STACK, ax=0x00007F0081111110))
    pointer = ADDR + 6 + 0x2000
    compare_emulation(
        "ff1500200000", FakeRegs(sp=STACK), mem_extra={pointer: (0x00007F0081C0FFEE).to_bytes(8, "little")}
    )
    compare_emulation("ff542408", FakeRegs(sp=STACK), stack=bytes(8) + (0x00007F0081D00D00).to_bytes(8, "little"))
