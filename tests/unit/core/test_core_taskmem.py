"""A uprobe hit's user memory (qprobe.core.taskmem.UserMemory): the task's own accesses, checked as the CPU checks
them, on the toy architecture."""

from __future__ import annotations

import pytest
from fakearch import PAGE, TOY_USER_PAGE, USER_END, USER_PHYS, Rig

from qprobe.core.taskmem import UserMemory
from qprobe.errors import MemoryFault

ROOT = 0x10_0000
LOW, HIGH = USER_END - 2 * PAGE, USER_END - PAGE  # two user pages, the last one below the end of user space


@pytest.fixture
def rig() -> Rig:
    rig = Rig()
    rig.t.mem.map_user(ROOT, LOW, USER_PHYS + 3 * PAGE)  # not contiguous in RAM: each page is translated
    rig.t.mem.map_user(ROOT, HIGH, USER_PHYS)
    return rig


def test_an_access_across_two_pages_reads_and_writes_each_page_s_frame(rig: Rig) -> None:
    mem = UserMemory(rig.t.machine, ROOT, lambda entry, access: entry == TOY_USER_PAGE)
    mem.write(HIGH - 4, bytes(range(8)))
    assert rig.t.mem.read_phys(USER_PHYS + 4 * PAGE - 4, 4) == bytes(range(4))
    assert rig.t.mem.read_phys(USER_PHYS, 4) == bytes(range(4, 8))
    assert mem.read(HIGH - 4, 8) == mem.fetch(HIGH - 4, 8) == bytes(range(8))


def test_an_access_the_page_refuses_faults_before_any_byte_is_written(rig: Rig) -> None:
    asked: list[str] = []

    def allows(entry: int, access: str) -> bool:
        asked.append(access)
        return access != "write" or len(asked) < 2  # the second page refuses the store

    mem = UserMemory(rig.t.machine, ROOT, allows)
    with pytest.raises(MemoryFault):
        mem.write(HIGH - 4, b"\xff" * 8)
    assert rig.t.mem.read_phys(USER_PHYS + 4 * PAGE - 4, 4) == bytes(4)  # the first page untouched too


def test_past_the_end_of_user_space_or_not_mapped_is_a_fault(rig: Rig) -> None:
    mem = UserMemory(rig.t.machine, ROOT, lambda entry, access: True)
    with pytest.raises(MemoryFault):
        mem.read(USER_END - 4, 8)  # its last bytes would be the kernel's
    with pytest.raises(MemoryFault):
        mem.fetch(LOW - PAGE, 4)
