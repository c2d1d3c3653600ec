"""The boards qprobe boots guests on: the scratch area's reservation each one writes and reads back."""

from __future__ import annotations

import pytest

from qprobe.errors import TargetError
from qprobe.vmm.boards import SCRATCH_SIZE, board_for


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
@pytest.mark.parametrize("ram", [128 << 20, 512 << 20, 1 << 30, 4 << 30])
def test_the_reservation_a_board_writes_is_the_one_it_reads(arch: str, ram: int) -> None:
    board = board_for(arch)
    phys = board.scratch_phys(ram)
    assert not phys % (2 << 20) and board.ram_base <= phys and phys + SCRATCH_SIZE <= board.ram_base + ram
    assert board.reserved(f"root=/dev/vda {board.reserve(phys)} quiet") == (phys, SCRATCH_SIZE)


@pytest.mark.parametrize(
    ("cmdline", "found"),
    [
        ("console=ttyAMA0 mem=480M panic=-1", (0x4000_0000 + (480 << 20), SCRATCH_SIZE)),
        ("mem=0x1e000000", (0x4000_0000 + 0x1E00_0000, SCRATCH_SIZE)),
        ("mem=1G mem=480M", (0x4000_0000 + (480 << 20), SCRATCH_SIZE)),  # the last one, as the kernel's
        ("mem=481M", None),  # not a whole number of 2 MiB pages: not one qprobe wrote
        ("memmap=2M$0x1e000000", None),  # arm64 Linux has no memmap=
        ("kmem=480M", None),
        ("", None),
    ],
)
def test_the_virt_boards_reservation_is_the_ram_above_mem(cmdline: str, found: tuple[int, int] | None) -> None:
    assert board_for("aarch64").reserved(cmdline) == found


def test_a_guest_of_no_known_board_is_refused_in_one_line() -> None:
    with pytest.raises(TargetError, match=r"^qprobe boots no riscv64 guest: it knows aarch64, x86_64$"):
        board_for("riscv64")


def test_too_little_ram_for_the_scratch_area_is_refused() -> None:
    with pytest.raises(TargetError, match="too small"):
        board_for("aarch64").scratch_phys(64 << 20)
