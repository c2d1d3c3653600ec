"""The machines qprobe boots a guest on: what QEMU emulates for each guest architecture.

These are facts of QEMU's boards, not of the kernel: the binary, the machine
and its RAM's physical base, the CPU under TCG, the serial ports, and how the
kernel is told to leave the scratch area alone.  The kernel side of each
architecture is ``qprobe.arch``'s.

- ``pc`` (x86_64): RAM from physical 0; two 16550 ports, so the kernel's
  console (ttyS0) and the guest's shell (ttyS1) never share a line; the
  scratch area is reserved with ``memmap=SIZE$ADDR``, which KASLR honours
  too; the optimized probes' doorbell is an ``isa-debugcon`` I/O port.
- ``virt`` (aarch64): RAM from physical 1 GiB (hw/arm/virt.c's
  ``VIRT_MEM``); one PL011 port (ttyAMA0), the kernel's console, and the
  guest's shell on QEMU's PCI 16550 (``pci-serial``), which the 8250 driver
  names ttyS0 (arm64 has no legacy ports before it); arm64 Linux has
  no ``memmap=``, so the kernel is given ``mem=`` and the scratch area lies
  in the RAM above it, which the kernel never maps; no I/O ports, so no
  doorbell.  The CPU is ``max`` with the implementation-defined pointer
  authentication algorithm: the architected one (QARMA) costs most of TCG's
  time in a kernel built with pointer authentication.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from qprobe.errors import TargetError

# The scratch area's size and alignment (qprobe.vmm.scratch maps it 2 MiB at a time).
SCRATCH_SIZE = 8 << 20
SCRATCH_ALIGN = 2 << 20
# How far below the top of RAM the scratch area starts (it ends 24 MiB below the top).
SCRATCH_GAP = 32 << 20
MIN_RAM = 128 << 20
# hw/arm/virt.c's memory map: RAM at 1 GiB (VIRT_MEM), where a -kernel boot's stub starts (hw/arm/boot.c's
# loader_start); the flash at 0 holds a firmware's reset vector (RVBAR_EL1, QEMU's rvbar property, 0).
VIRT_MEM = 0x4000_0000

_MEMMAP = re.compile(r"(?:^|\s)memmap=(0x[0-9a-fA-F]+|\d+)([KMG]?)\$(0x[0-9a-fA-F]+|\d+)([KMG]?)(?=\s|$)")
_MEM = re.compile(r"(?:^|\s)mem=(0x[0-9a-fA-F]+|\d+)([KMG]?)(?=\s|$)")


def memparse(number: str, suffix: str) -> int:
    """The kernel's memparse(): a number with an optional K/M/G suffix."""
    return int(number, 0) << {"": 0, "K": 10, "M": 20, "G": 30}[suffix]


@dataclass(frozen=True)
class Board:
    """One QEMU machine for one guest architecture (the vmlinux's, as ``qprobe.arch`` names it)."""

    arch: str  # the Arch's name: "x86_64", "aarch64"
    binary: str
    package: str  # the Debian package that has ``binary``
    machine: str
    ram_base: int  # physical address of the first byte of RAM
    tcg_cpu: str
    console: str  # the kernel's console device (console=)
    shell_tty: str | None  # the guest's name of the serial port for the guest's shell; None: it shares the console
    shell_device: tuple[str, ...]  # QEMU's arguments for that port, on chardev ``sh0``
    doorbell: bool  # the optimized probes' isa-debugcon doorbell
    reservation: str  # how the scratch area is kept from the kernel: "memmap" or "mem"
    extra: tuple[str, ...] = ()  # more arguments the machine needs
    # Where vCPU 0 of a VM that has run nothing is, where its architecture cannot tell by itself (a reset
    # vector of its own): a -kernel boot's stub, a firmware's reset vector.
    reset_pcs: tuple[int, ...] = ()

    def scratch_phys(self, ram: int) -> int:
        """Physical base of the scratch area in ``ram`` bytes of guest memory (2 MiB aligned, near the top).

        x86's is below 3 GiB, so that it is in the ``pc`` machine's first RAM block."""
        top = min(ram, 3 << 30) if self.machine == "pc" else ram
        if top < MIN_RAM:
            raise TargetError(f"guest memory {ram >> 20} MiB is too small: qprobe needs at least {MIN_RAM >> 20}M")
        return self.ram_base + ((top - SCRATCH_GAP) & ~(SCRATCH_ALIGN - 1))

    def reserve(self, phys: int, size: int = SCRATCH_SIZE) -> str:
        """The kernel parameter that keeps the kernel off [phys, phys + size)."""
        if self.reservation == "memmap":
            return f"memmap={size >> 20}M${phys:#x}"
        # mem= limits the RAM the kernel uses to that many bytes from the first: all of it below phys.
        return f"mem={(phys - self.ram_base) >> 20}M"

    def reserved(self, cmdline: str) -> tuple[int, int] | None:
        """(physical base, size) of the scratch area a kernel command line reserves, None if it reserves none.

        ``memmap=``: the last whole number of 2 MiB pages; ``mem=``: the scratch area's size above it
        (qprobe gives the guest that much more RAM than ``mem=``)."""
        found = None
        if self.reservation == "memmap":
            for m in _MEMMAP.finditer(cmdline):
                size = memparse(m.group(1), m.group(2))
                if size and not size % SCRATCH_ALIGN:
                    found = memparse(m.group(3), m.group(4)), size
            return found
        for m in _MEM.finditer(cmdline):
            limit = memparse(m.group(1), m.group(2))
            if limit and not limit % SCRATCH_ALIGN:
                found = self.ram_base + limit, SCRATCH_SIZE
        return found


BOARDS = {
    "x86_64": Board(
        arch="x86_64",
        binary="qemu-system-x86_64",
        package="qemu-system-x86",
        machine="pc",
        ram_base=0,
        # Everything QEMU can emulate but cmpxchg16b, whose flags QEMU 7.2's TCG takes from a stale
        # condition-code state (an earlier instruction's operand lands in EFLAGS, VM, AC, TF or DF set,
        # and the kernel's unlocked per-CPU cmpxchg16b in SLUB's fast path double-faults; the stops of a
        # probed boot make it likely).  Without CX16 the kernel takes its fallbacks
        # (arch/x86/lib/cmpxchg16b_emu.S for the per-CPU operation, a locked path for the slab's).
        tcg_cpu="max,cx16=off",
        console="ttyS0",
        shell_tty="ttyS1",
        shell_device=("-serial", "chardev:sh0"),
        doorbell=True,
        reservation="memmap",
        extra=("-vga", "none"),
    ),
    "aarch64": Board(
        arch="aarch64",
        binary="qemu-system-aarch64",
        package="qemu-system-arm",
        machine="virt",
        ram_base=VIRT_MEM,
        tcg_cpu="max,pauth-impdef=on",
        console="ttyAMA0",
        shell_tty="ttyS0",
        shell_device=("-device", "pci-serial,chardev=sh0"),
        doorbell=False,
        reservation="mem",
        reset_pcs=(0, VIRT_MEM),
    ),
}


def board_for(arch: str) -> Board:
    """The board qprobe boots a guest of ``arch`` on; one line naming those it knows otherwise."""
    board = BOARDS.get(arch)
    if board is None:
        raise TargetError(f"qprobe boots no {arch} guest: it knows {', '.join(sorted(BOARDS))}")
    return board


__all__ = ["BOARDS", "SCRATCH_ALIGN", "SCRATCH_SIZE", "Board", "board_for", "memparse"]
