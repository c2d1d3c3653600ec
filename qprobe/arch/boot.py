"""The boot facet of an architecture: how far a stopped vCPU has come since reset, and how the host finds the
KASLR slide of a kernel that has not run yet."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Protocol


class BootStage(enum.Enum):
    """How far a vCPU a debugger stopped has come (what an attach may do with it)."""

    RESET = "reset"  # at its reset vector: it has run no instruction (QEMU started with -S)
    EARLY = "early"  # running, without the kernel's page tables yet (firmware, boot loader, the kernel's setup)
    KERNEL = "kernel"  # paging on: the kernel runs


class Boot(Protocol):
    """The boot: how far a stopped vCPU has come, and how the host finds the KASLR slide of a kernel that has not
    run yet (qprobe.kernel.bootslide for x86's decompressor, qprobe.kernel.bootswitch for arm64)."""

    def boot_stage(self, regs: Mapping[str, int]) -> BootStage:
        """How far the vCPU with registers ``regs`` has come since reset."""
        ...

    def arch_boot_entry(self, read: Callable[[int, int], bytes], address: Callable[[str], int]) -> int:
        """The link address of the first instruction the boot CPU runs at the kernel's virtual addresses
        (plus the KASLR slide), from vmlinux's bytes (``read``) and symbols (``address``); SymbolError if unknown."""
        ...

    def arch_boot_switch(self, read: Callable[[int, int], bytes], address: Callable[[str], int]) -> int | None:
        """Where a kernel that relocates itself (arm64) leaves its physical addresses for ``arch_boot_entry``'s
        instruction: the link address of that branch, whose target the boot CPU computed with the slide; the
        host stops it there and steps it.  None where a loader of the kernel's own picks the slide from a window
        of candidates (x86's decompressor: ``qprobe.kernel.bootslide``)."""
        ...


__all__ = ["Boot", "BootStage"]
