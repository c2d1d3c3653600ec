"""The KASLR slide of a kernel that has not run yet, found as it boots.

With the VM halted before the kernel's first instruction, nothing in guest
memory says where the kernel will be: the decompressor picks the slide.  The
boot CPU, though, runs one known instruction at the kernel's virtual addresses
first (``Arch.arch_boot_entry``, before ``start_kernel``), at its link address
plus the slide, and the slide is a multiple of the image's KASLR alignment
within the kernel's window.  A stub breakpoint on that instruction for every
candidate slide (writing nothing into the guest) stops the VM there; the one
hit gives the slide, the others go, and the kernel can be probed from then on.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from qprobe.arch import Arch
from qprobe.kernel.kaslr import candidate_slides
from qprobe.kernel.symbols import Symbols
from qprobe.vmm.gdbremote import BREAK_HW
from qprobe.vmm.machine import Machine

Found = Callable[[str, dict[str, int], int], None]


class BootSlide:
    """Stub breakpoints on the first virtual instruction at every candidate slide (the stop loop's)."""

    def __init__(self, machine: Machine, symbols: Symbols, arch: Arch, align: int, cmdline: str) -> None:
        """``cmdline``: the kernel's; with ``nokaslr`` the decompressor leaves the kernel at its link address."""
        self.machine = machine
        assert symbols.slide == 0, "candidates are link addresses plus a slide"
        self.entry = arch.arch_boot_entry(symbols.file_bytes, symbols.address)
        # Each breakpoint costs every translated-block lookup QEMU makes (returns and indirect jumps
        # included) a compare until the hit: the fewer the better.
        self.slides = range(0, 1) if "nokaslr" in cmdline.split() else candidate_slides(symbols, align)
        self.armed: list[int] = []
        self.on_found: Found | None = None
        self.armed_at = 0.0  # time.monotonic() when the breakpoints were in
        self.found_after = 0.0  # seconds from then to the hit

    def arm(self, on_found: Found) -> None:
        """Every candidate's breakpoint in; ``on_found(tid, regs, slide)`` runs on the hit, with them out."""
        self.on_found = on_found
        for slide in self.slides:
            addr = self.entry + slide
            self.machine.gdb.insert_breakpoint(addr, BREAK_HW)
            self.armed.append(addr)
            self.machine.stop_handlers[addr] = self._hit
        self.armed_at = time.monotonic()

    def disarm(self) -> None:
        for addr in self.armed:
            self.machine.stop_handlers.pop(addr, None)
            self.machine.gdb.remove_breakpoint(addr, BREAK_HW)
        self.armed.clear()

    def _hit(self, tid: str, regs: dict[str, int]) -> None:
        self.found_after = time.monotonic() - self.armed_at
        slide = regs[self.machine.pc] - self.entry
        self.disarm()  # the vCPU goes on from here: no breakpoint left under it
        assert self.on_found is not None
        self.on_found(tid, regs, slide)


__all__ = ["BootSlide"]
