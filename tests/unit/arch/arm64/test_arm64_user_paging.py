"""arm64's user half: TTBR0_EL1's tables shaped by T0SZ and TG0, walked beside TTBR1's for a task's reads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from qprobe.arch.arm64.paging import TCR_TBI0, Arm64PageTables
from qprobe.arch.arm64.ptregs import REGISTERS
from qprobe.core.regs import PtRegs
from qprobe.errors import MemoryFault
from qprobe.vmm.memory import GuestMemory

sys.path.insert(0, str(Path(__file__).parent))
from pagetables_arm64 import ATTRS, K4, M2, PAGE, TG1_4K, TG1_16K, Ram, Tables, kva, tcr

T1SZ_48, T0SZ_39 = (64 - 48) << 16 | TG1_4K, 64 - 39  # TG0 0: 4K, the kernel half's granule
USER = 0x40_1234_5000  # in a 39-bit user half: 3 levels, top index bits 38:30
TAGGED = 0x2A << 56 | USER  # an MTE/HWASan-tagged pointer to it


class PhysRam(Ram):
    """The fake RAM as GuestMemory's physical reader: whole words, little-endian."""

    def read_phys(self, paddr: int, size: int) -> bytes:
        first = paddr & ~7
        raw = b"".join(self.read_u64(a).to_bytes(8, "little") for a in range(first, paddr + size, 8))
        return raw[paddr - first : paddr - first + size]


def halves(tcr_el1: int = T1SZ_48 | T0SZ_39 | TCR_TBI0) -> tuple[PhysRam, Tables, Tables, Arm64PageTables]:
    """A 48-bit kernel half and a 39-bit user half, a page mapped in each."""
    pt = Arm64PageTables(tcr_el1)
    ram = PhysRam()
    kernel, user = Tables(pt, ram), Tables(pt, ram, pt.user)
    kernel.map(kva(48, 0x1234_5000), 0x4123_4000)
    user.map(USER, 0x4567_8000)
    return ram, kernel, user, pt


def test_t0sz_and_tg0_shape_the_user_half() -> None:
    pt = Arm64PageTables(T1SZ_48 | T0SZ_39)
    assert pt.user is not None and (pt.user.va_bits, pt.user.levels, pt.levels) == (39, 3, 4)
    assert pt.task_size_max() == 1 << 39


def test_a_user_half_with_another_granule_than_the_kernel_s_is_not_walked() -> None:
    pt = Arm64PageTables(tcr(48, TG1_16K))  # TG0 left at 4K
    assert pt.user is None and pt.task_size_max() == 1 << 48
    with pytest.raises(MemoryFault, match="neither half"):
        pt.translate(Ram().read_u64, 0x4010_0000, USER)


def test_a_user_address_walks_the_task_s_ttbr0_tables() -> None:
    ram, _, user, pt = halves()
    assert ram.read_u64(user.root + (USER >> 30 & 0x1FF) * 8) & 3 == 3  # a 3-level walk's top index
    assert pt.translate(ram.read_u64, user.root, USER + 0x10) == (0x4567_8010, K4, 0x4567_8000 | PAGE | ATTRS)


def test_a_user_block_is_a_2m_section() -> None:
    ram, _, user, pt = halves()
    user.map(0x20_0000, 0x4800_0000, level=2)
    assert pt.translate(ram.read_u64, user.root, 0x2F_1234)[:2] == (0x480F_1234, M2)


def test_tbi0_ignores_a_user_pointer_s_tag() -> None:
    ram, _, user, pt = halves()
    assert pt.translate(ram.read_u64, user.root, TAGGED)[0] == 0x4567_8000
    ram, _, user, pt = halves(T1SZ_48 | T0SZ_39)
    with pytest.raises(MemoryFault, match="neither half"):
        pt.translate(ram.read_u64, user.root, TAGGED)


def test_an_address_above_t0sz_s_size_is_in_neither_half() -> None:
    ram, _, user, pt = halves()
    with pytest.raises(MemoryFault, match="neither half"):
        pt.translate(ram.read_u64, user.root, 1 << 39)


def test_guest_memory_walks_each_half_from_its_own_root() -> None:
    ram, kernel, user, pt = halves()
    ram.words[0x4567_8000] = int.from_bytes(b"user\0\0\0\0", "little")
    ram.words[0x4123_4000] = int.from_bytes(b"kernel\0\0", "little")
    mem = GuestMemory(ram, kernel.root, pt)
    assert mem.read(USER, 4, user.root) == b"user"
    assert mem.read(kva(48, 0x1234_5000), 6, user.root) == b"kernel"
    assert mem.read(kva(48, 0x1234_5000), 6) == b"kernel"
    with pytest.raises(MemoryFault, match="TTBR0_EL1"):
        mem.read(USER, 4)


def test_a_hit_s_regs_read_user_memory_through_its_ttbr0() -> None:
    """PtRegs reads through TTBR0_EL1's table (its ASID and CnP bits dropped), kernel memory through TTBR1's."""
    ram, kernel, user, pt = halves()
    ram.words[0x4567_8000] = int.from_bytes(b"user\0\0\0\0", "little")
    ram.words[0x4123_4000] = int.from_bytes(b"kernel\0\0", "little")
    mem = GuestMemory(ram, kernel.root, pt)
    values = {"pc": 0, "TTBR1_EL1": kernel.root, "TTBR0_EL1": 0x0042 << 48 | user.root | 1}
    regs = PtRegs(values, "1", 0, mem, layout=REGISTERS)
    assert regs.read_string(USER) == "user"
    assert regs.read_string(kva(48, 0x1234_5000)) == "kernel"
