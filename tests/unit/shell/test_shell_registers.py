"""``regs``: gdb's ``info registers`` columns, each register shown as the arch's layout says."""

from __future__ import annotations

from qprobe.arch.x86_64.arch import X86_64
from qprobe.shell.render import flags_text, render_registers


def test_x86_64_registers_print_as_gdb_prints_them() -> None:
    regs = {"rax": (1 << 64) - 2, "rbp": 0xFFFF_C900_0001_3E00, "rsp": 0xFFFF_C900_0001_3DF0,
            "rip": 0xFFFF_FFFF_8134_CC50, "eflags": 0x246, "cs": 0x10, "cr3": 0x1_0A2E_8000}  # fmt: skip
    text = render_registers(regs, X86_64.registers, lambda v: "vfs_read" if v == regs["rip"] else None)
    assert text.splitlines() == [
        "rax            0xfffffffffffffffe -2",
        "rbp            0xffffc90000013e00 0xffffc90000013e00",
        "rsp            0xffffc90000013df0 0xffffc90000013df0",
        "rip            0xffffffff8134cc50 0xffffffff8134cc50 <vfs_read>",
        "eflags         0x246              [ PF ZF IF ]",
        "cs             0x10               16",
        "cr3            0x10a2e8000        0x10a2e8000",
    ]


def test_flags_text_names_the_bits_set() -> None:
    assert flags_text(0, X86_64.registers.flag_bits) == "[ ]"
    assert flags_text(0x10_0001, ((1, "C"), (0x10_0000, "X"))) == "[ C X ]"
