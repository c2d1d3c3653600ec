"""Where the vCPUs of a kernel that went silent in its own boot were: the first thing to know of a stall."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qprobe.arch import Arch, BootStage

if TYPE_CHECKING:
    from qprobe.kernel.symbols import Symbols
    from qprobe.vmm.transport import GdbTransport


def vcpu_places(gdb: GdbTransport, arch: Arch, symbols: Symbols) -> str:
    """``vCPU 0 at FUNCTION+0xOFF, vCPU 1 at ...`` for a stopped VM whose kernel's slide is known."""
    places = []
    for n, tid in enumerate(gdb.threads()):
        regs = gdb.read_registers(tid)
        pc = regs[arch.registers.pc]
        if arch.boot.boot_stage(regs) is BootStage.KERNEL:
            places.append(f"vCPU {n} at {symbols.symbolize(pc)}")
        else:  # a secondary CPU the kernel has not brought up yet still waits in the firmware
            places.append(f"vCPU {n} at {pc:#x}, not in the kernel yet")
    return ", ".join(places)


__all__ = ["vcpu_places"]
