"""PtRegs: pt_regs names over gdbstub registers, dirty tracking, ABI arguments, guest reads."""

from __future__ import annotations

import copy
import struct
from dataclasses import replace

import pytest

from qprobe.arch.x86_64.arch import X86_64
from qprobe.arch.x86_64.paging import kernel_pgd
from qprobe.arch.x86_64.ptregs import ARG_REGS
from qprobe.arch.x86_64.ptregs import GDB_NAME as PT_REGS
from qprobe.core.regs import PtRegs, regs_get_kernel_argument, regs_return_value
from qprobe.vmm.memory import MemoryFault

PAGE = 4096
SP = 0xFFFF_C900_0001_3F00
KPGD = 0x0123_4000


class FakeMem:
    """Kernel virtual memory in whole pages; reads record the PGD they were given."""

    def __init__(self, pgd: int = 0x0999_9000) -> None:
        self.pgd = pgd
        self.pages: dict[int, bytearray] = {}
        self.pgds: list[int | None] = []

    def pgd_of(self, cr3: int) -> int:
        return kernel_pgd(cr3)

    def write(self, addr: int, data: bytes) -> None:
        for i, b in enumerate(data):
            a = addr + i
            self.pages.setdefault(a & ~(PAGE - 1), bytearray(PAGE))[a & (PAGE - 1)] = b

    def read(self, addr: int, size: int, pgd: int | None = None) -> bytes:
        self.pgds.append(pgd)
        out = bytearray()
        for a in range(addr, addr + size):
            page = self.pages.get(a & ~(PAGE - 1))
            if page is None:
                raise MemoryFault(a)
            out.append(page[a & (PAGE - 1)])
        return bytes(out)


class FakeSymbols:
    def symbolize(self, addr: int) -> str:
        return f"vfs_read+{addr - 0xFFFF_FFFF_8130_0000:#x}"


GDB_VALUES = {
    "rax": 0xA, "rbx": 0xB, "rcx": 0x4C, "rdx": 0x3D, "rsi": 0x2E, "rdi": 0x1F,
    "rbp": 0xB0, "rsp": SP, "r8": 0x58, "r9": 0x69, "r10": 0x10, "r11": 0x11,
    "r12": 0x12, "r13": 0x13, "r14": 0x14, "r15": 0x15, "rip": 0xFFFF_FFFF_8130_0004,
    "eflags": 0x246, "cs": 0x10, "ss": 0x18,
    # Not pt_regs names: left out of the view.
    "fs_base": 0x7F00_0000_0000, "gs_base": 0xFFFF_8880_3FC0_0000, "cr3": KPGD | 0x1000 | 0x5, "ds": 0,
}  # fmt: skip


def make(values: dict[str, int] | None = None, mem: FakeMem | None = None, symbols: FakeSymbols | None = None
         ) -> tuple[PtRegs, FakeMem]:  # fmt: skip
    mem = mem or FakeMem()
    # Stack at function entry: return address, then arguments 7, 8, 9.
    mem.write(SP, struct.pack("<4Q", 0xFFFF_FFFF_8120_0000, 0x77, 0x88, 0x99))
    return PtRegs(
        dict(GDB_VALUES if values is None else values),
        "p1.2",
        1,
        mem,
        symbols,  # type: ignore[arg-type]
        layout=X86_64.registers,
    ), mem


@pytest.mark.parametrize(("pt", "gdb"), sorted(PT_REGS.items()))
def test_names(pt: str, gdb: str) -> None:
    regs, _ = make()
    assert getattr(regs, pt) == GDB_VALUES[gdb]


def test_view_has_only_pt_regs() -> None:
    regs, _ = make()
    assert regs.as_dict() == {pt: GDB_VALUES[g] for pt, g in PT_REGS.items()}
    assert (regs.tid, regs.vcpu) == ("p1.2", 1)
    for name in ("rax", "rip", "cr3", "fs_base", "orig_ax", "eflags", "nonsense"):
        with pytest.raises(AttributeError, match=f"pt_regs has no register '{name}'"):
            getattr(regs, name)
    assert not hasattr(regs, "cr3")


def test_the_per_cpu_base_is_kept_for_per_cpu_reads() -> None:
    regs, _ = make()
    assert regs.percpu_base == GDB_VALUES["gs_base"]
    assert "gs_base" not in regs.as_dict()
    without, _ = make({k: v for k, v in GDB_VALUES.items() if k != "gs_base"})
    assert without.percpu_base == 0
    # What the kernel layer finds current from: x86 keeps it per-CPU, so the per-CPU base alone.
    assert regs.task_regs == {"gs_base": GDB_VALUES["gs_base"]}


def test_the_register_that_holds_current_is_kept_with_the_mode_where_the_architecture_has_one() -> None:
    layout = replace(X86_64.registers, current="sp_el0")
    regs = PtRegs({**GDB_VALUES, "sp_el0": 0xFFFF_0000_0123_4000}, "p1.1", 0, FakeMem(), layout=layout)
    # The register holds current in kernel mode only: the stop's registers come too, to tell the mode.
    assert regs.task_regs == {**GDB_VALUES, "sp_el0": 0xFFFF_0000_0123_4000}


def test_the_return_value_is_the_layout_s_register() -> None:
    regs, _ = make()
    assert regs.return_value() == regs_return_value(regs) == GDB_VALUES["rax"]


def test_missing_register_is_attribute_error() -> None:
    regs, _ = make({"rip": 1, "rsp": SP})
    with pytest.raises(AttributeError):
        _ = regs.ax


def test_set_marks_dirty_in_gdbstub_names() -> None:
    regs, _ = make()
    assert regs.dirty() == {}
    regs.ax = 0x1234
    regs.ip = 0xFFFF_FFFF_8130_0010
    regs.flags = 0x202
    assert regs.ax == 0x1234
    assert regs.dirty() == {"rax": 0x1234, "rip": 0xFFFF_FFFF_8130_0010, "eflags": 0x202}
    regs.mark_clean()
    assert regs.dirty() == {}
    assert regs.ax == 0x1234


@pytest.mark.parametrize(("value", "stored"), [(-1, (1 << 64) - 1), (1 << 64, 0), ((1 << 65) + 7, 7), (True, 1)])
def test_set_masks_to_64_bits(value: int, stored: int) -> None:
    regs, _ = make()
    regs.di = value
    assert regs.di == stored and regs.dirty() == {"rdi": stored}


def test_set_quietly_is_not_dirty() -> None:
    regs, _ = make()
    regs.set_quietly("ip", -1)
    assert regs.ip == (1 << 64) - 1
    assert regs.dirty() == {}


@pytest.mark.parametrize("name", ["rax", "cr3", "orig_ax", "fs_base", "x"])
def test_set_unknown_register(name: str) -> None:
    regs, _ = make()
    with pytest.raises(AttributeError, match="pt_regs has no register"):
        setattr(regs, name, 1)
    assert regs.dirty() == {}


@pytest.mark.parametrize("value", ["0x10", 1.0, None, b"\x01", [1]])
def test_set_non_int(value: object) -> None:
    regs, _ = make()
    with pytest.raises(TypeError, match=f"regs.ax must be an int, not {type(value).__name__}"):
        regs.ax = value  # type: ignore[assignment]
    assert regs.ax == 0xA and regs.dirty() == {}


# -- ABI --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "value"),
    [(1, 0x1F), (2, 0x2E), (3, 0x3D), (4, 0x4C), (5, 0x58), (6, 0x69), (7, 0x77), (8, 0x88), (9, 0x99)],
)
def test_arg(n: int, value: int) -> None:
    regs, mem = make()
    assert regs.arg(n) == value
    if n > 6:
        # Stack arguments are read through the kernel half of the interrupted task's CR3.
        assert mem.pgds == [KPGD]
    assert regs_get_kernel_argument(regs, n - 1) == value


def test_arg_registers_are_the_abi_ones() -> None:
    assert ARG_REGS == ("di", "si", "dx", "cx", "r8", "r9")


@pytest.mark.parametrize("n", [0, -1])
def test_arg_numbering_starts_at_one(n: int) -> None:
    regs, _ = make()
    with pytest.raises(ValueError, match="numbered from 1"):
        regs.arg(n)


def test_arg_follows_a_changed_register() -> None:
    regs, _ = make()
    regs.si = 0x5555
    regs.sp = SP + 8
    assert regs.arg(2) == 0x5555
    assert regs.arg(7) == 0x88


def test_stack_argument_fault() -> None:
    regs, _ = make({**GDB_VALUES, "rsp": 0xFFFF_C900_0002_0000 - 8})
    with pytest.raises(MemoryFault):
        regs.arg(7)


def test_stack() -> None:
    regs, _ = make()
    assert [regs.stack(i) for i in range(4)] == [0xFFFF_FFFF_8120_0000, 0x77, 0x88, 0x99]


def test_without_cr3_reads_use_the_memory_pgd() -> None:
    values = {k: v for k, v in GDB_VALUES.items() if k != "cr3"}
    regs, mem = make(values)
    regs.arg(7)
    assert mem.pgds == [mem.pgd]


def test_return_value() -> None:
    regs, _ = make()
    assert regs_return_value(regs) == 0xA
    regs.ax = -22
    assert regs_return_value(regs) == (1 << 64) - 22


# -- guest reads ------------------------------------------------------------------------------


def test_read_helpers() -> None:
    regs, mem = make()
    mem.write(0xFFFF_8880_0000_1000, struct.pack("<QI", 0x1122_3344_5566_7788, 0xDEAD_BEEF))
    assert regs.read(0xFFFF_8880_0000_1000, 2) == b"\x88\x77"
    assert regs.read_u64(0xFFFF_8880_0000_1000) == 0x1122_3344_5566_7788
    assert regs.read_u32(0xFFFF_8880_0000_1008) == 0xDEAD_BEEF
    assert set(mem.pgds) == {KPGD}


def test_read_string() -> None:
    regs, mem = make()
    base = 0x7FFD_0000_0000
    mem.write(base, b"/etc/passwd\0junk")
    assert regs.read_string(base) == "/etc/passwd"
    assert regs.read_string(base, limit=4) == "/etc"
    mem.write(base + 0x100, b"\0")
    assert regs.read_string(base + 0x100) == ""
    mem.write(base + 0x200, b"caf\xc3\xa9 \xff\0")
    assert regs.read_string(base + 0x200) == "caf\u00e9 \ufffd"
    long = b"x" * 300
    mem.write(base + 0x400, long + b"\0")
    assert regs.read_string(base + 0x400) == long.decode()


def test_read_string_stops_before_an_unmapped_page() -> None:
    regs, mem = make()
    end = 0x7FFD_0000_1000  # the next page is not mapped
    mem.write(end - 5, b"tail\0")
    assert regs.read_string(end - 5) == "tail"
    mem.write(end - 70, b"y" * 65 + b"\0\0\0\0\0")  # longer than one 64-byte read
    assert regs.read_string(end - 70) == "y" * 65
    mem.write(end - 3, b"abc")  # no NUL before the hole
    with pytest.raises(MemoryFault):
        regs.read_string(end - 3)


def test_read_string_without_nul_is_cut_at_limit() -> None:
    regs, mem = make()
    mem.write(0x7FFD_0000_2000, b"z" * PAGE)
    assert regs.read_string(0x7FFD_0000_2000, limit=100) == "z" * 100


# -- printing ---------------------------------------------------------------------------------


def test_symbolize() -> None:
    regs, _ = make(symbols=FakeSymbols())
    assert regs.symbolize() == "vfs_read+0x4"
    assert regs.symbolize(0xFFFF_FFFF_8130_0020) == "vfs_read+0x20"
    bare, _ = make()
    assert bare.symbolize() == "0xffffffff81300004"


def test_repr() -> None:
    regs, _ = make()
    text = repr(regs)
    assert text.startswith("<pt_regs vcpu=1 ") and "ip=0xffffffff81300004" in text and "flags=0x246" in text
    assert "cr3" not in text


def test_copy_is_an_independent_snapshot() -> None:
    # copy.copy builds the object without __init__ and asks for __setstate__;
    # __getattr__ then reads self._values, which is unset, which calls
    # __getattr__('_values') again: RecursionError instead of a copy.
    regs, _ = make()
    saved = copy.copy(regs)
    regs.ax = 1
    assert saved.ax == 0xA
