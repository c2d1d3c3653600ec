"""How far a stopped x86_64 vCPU has come: at reset (QEMU -S), early (no paging yet), or in the kernel."""

from __future__ import annotations

from qprobe.arch import BootStage
from qprobe.arch.x86_64.arch import X86_64


def test_reset_early_and_kernel() -> None:
    arch = X86_64()
    # The state QEMU's x86 reset gives a vCPU (CR0 0x60000010: caches off, ET; paging off).
    assert arch.boot.boot_stage({"cr0": 0x60000010, "rip": 0xFFF0, "cs": 0xF000}) is BootStage.RESET
    assert arch.boot.boot_stage({"cr0": 0x60000010, "rip": 0x7C00, "cs": 0}) is BootStage.EARLY  # a boot loader
    assert arch.boot.boot_stage({"cr0": 0x11, "rip": 0x100000, "cs": 0x10}) is BootStage.EARLY  # protected mode
    assert arch.boot.boot_stage({"cr0": 0x80050033, "rip": 0xFFFFFFFF81000000, "cs": 0x10}) is BootStage.KERNEL
    assert arch.boot.boot_stage({"rip": 0xFFF0, "cs": 0xF000}) is BootStage.KERNEL  # no CR0 shown: cannot tell
