"""The HPET's main counter: the clock of the VM's virtual time the host reads at a stop.

QEMU stops the guest's clocks with the VM (``vm_stop`` calls ``cpu_disable_ticks``):
the TSC and the virtual clock the HPET counts both stand still during a stop and
run on together, so the TSC is a linear function of the HPET's time.  The gdbstub
reads the HPET as device memory, where the ACPI HPET table puts it (the kernel
keeps the address in ``hpet_address``, arch/x86/kernel/hpet.c).
"""

from __future__ import annotations

from collections.abc import Callable

from qprobe.arch.cycles import GuestKernel

# HPET registers (IA-PC HPET specification 1.0a, 2.3): capabilities (the period in fs in
# the high half), configuration (bit 0 enables the counter) and the main counter.
HPET_CAP, HPET_CFG, HPET_COUNTER, HPET_ENABLE = 0x000, 0x010, 0x0F0, 1
FS_PER_NS = 1_000_000


class Hpet:
    """The HPET at physical ``base`` counting every ``period`` fs, read through ``read_phys``."""

    def __init__(self, base: int, period: int, read_phys: Callable[[int, int], bytes]) -> None:
        self.base, self.period, self._read_phys = base, period, read_phys

    def ns(self) -> int:
        """The main counter's time in ns."""
        return int.from_bytes(self._read_phys(self.base + HPET_COUNTER, 8), "little") * self.period // FS_PER_NS


def hpet_timer(kernel: GuestKernel, read_phys: Callable[[int, int], bytes]) -> Hpet | str:
    """The guest's running HPET, or why there is none to time stops with."""
    at = kernel.address("hpet_address")
    if at is None:
        return "this kernel has no hpet_address to time stops with"
    base = int.from_bytes(kernel.read(at, 8), "little")
    if not base:
        return "the guest has no HPET to time stops with"
    cap = int.from_bytes(read_phys(base + HPET_CAP, 8), "little")
    cfg = int.from_bytes(read_phys(base + HPET_CFG, 8), "little")
    period = cap >> 32
    if not period or period == 0xFFFFFFFF or not cfg & HPET_ENABLE:
        return "the guest's HPET counter is not running"
    return Hpet(base, period, read_phys)


__all__ = ["Hpet", "hpet_timer"]
