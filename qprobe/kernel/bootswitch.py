"""The KASLR slide of a kernel that relocates itself, found as it boots (arm64).

Such a kernel is placed in physical memory by its boot loader and picks its
own virtual slide (arm64's ``__pi_kaslr_early_init``/``__pi_early_map_kernel``
from the seed in the device tree), so there is no window of candidates the host
could cover with breakpoints beforehand.  It does, though, leave its physical
addresses through one branch (``Arch.arch_boot_switch``: head.S's ``br x8``)
whose target it computed with the slide, while it still runs identity mapped.
So: vCPU 0 is stepped from reset through the boot loader's stub until it
enters the image (its first bytes are vmlinux's), which gives the physical
address the image was loaded at; one stub breakpoint on the branch's physical
address stops it there, one step takes the branch, and the vCPU's pc is the
first virtual instruction (``Arch.arch_boot_entry``) plus the slide.
Nothing is written into the guest.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from qprobe.arch import Arch
from qprobe.errors import MemoryFault, TargetError
from qprobe.kernel.bootslide import UPPER_HALF, Failed, Found, StubSearch
from qprobe.kernel.symbols import Symbols
from qprobe.vmm.machine import Machine

log = logging.getLogger("qprobe")

# A boot loader's stub (QEMU's -kernel loader writes six instructions: hw/arm/boot.c's bootloader_aarch64)
# enters the image within this many instructions; a firmware would take millions.
MAX_LOADER_STEPS = 64
HEAD = 64  # bytes of the image's start compared with vmlinux's (arm64's Image header: no relocated field)


class SwitchSlide(StubSearch):
    """A stub breakpoint on the branch to the kernel's virtual addresses, at its physical address (put in by
    the stop loop, once vCPU 0 has been stepped into the image)."""

    method = "switch"

    def __init__(self, machine: Machine, symbols: Symbols, arch: Arch, switch: int,
                 read_phys: Callable[[int, int], bytes]) -> None:  # fmt: skip
        """``switch``: the branch's link address (``Arch.arch_boot_switch``); ``read_phys``: guest RAM."""
        assert symbols.slide == 0, "link addresses"
        super().__init__(machine)
        self.read_phys = read_phys
        self.entry = arch.boot.arch_boot_entry(symbols.file_bytes, symbols.address)
        self.text = symbols.address("_text")
        self.switch_offset = switch - self.text
        self.head = symbols.file_bytes(self.text, HEAD)
        self.on_found: Found | None = None
        self.on_failed: Failed | None = None
        self.armed_at = 0.0  # time.monotonic() when the search began
        self.found_after = 0.0  # seconds from then to the vCPU's first virtual instruction
        self.loaded_at: int | None = None  # the image's physical address, once vCPU 0 entered it

    def arm(self, on_found: Found, on_failed: Failed) -> None:
        """Step vCPU 0 into the image and put the breakpoint in (stop loop, the VM paused); ``on_found(tid,
        regs, slide)`` runs at the vCPU's first virtual instruction, ``on_failed(exc)`` if it cannot be found."""
        self.on_found, self.on_failed = on_found, on_failed
        self.armed_at = time.monotonic()
        tid = self.machine.vcpus[0]
        try:
            self.loaded_at = self._enter_image(tid)
        except TargetError as exc:
            on_failed(exc)
            return
        at = self.loaded_at + self.switch_offset
        self._insert(at, self._switching)
        log.debug("boot switch: image at %#x, a breakpoint on its branch to virtual addresses at %#x",
                  self.loaded_at, at)  # fmt: skip

    def _enter_image(self, tid: str) -> int:
        """Step ``tid`` until its pc is at the image's first instruction: that pc, a physical address."""
        gdb, pc = self.machine.gdb, self.machine.pc
        for _ in range(MAX_LOADER_STEPS + 1):
            at = gdb.read_registers(tid)[pc]
            try:
                if self.read_phys(at, HEAD) == self.head:
                    return int(at)
            except MemoryFault:
                pass
            gdb.step(tid)
        raise TargetError(f"vCPU 0 did not enter the kernel image within {MAX_LOADER_STEPS} instructions of its "
                          "reset (a firmware boot?): boot-time probes on this architecture need a boot loader "
                          "that enters the image at once, as QEMU's -kernel does")  # fmt: skip

    def waiting_for(self) -> str:
        """What the search is waiting for, for a boot that timed out."""
        if self.loaded_at is None:
            return "vCPU 0 to enter the kernel image"
        return f"the branch to the kernel's virtual addresses at physical {self.loaded_at + self.switch_offset:#x}"

    def _switching(self, tid: str, regs: dict[str, int]) -> None:
        """The boot CPU on the branch (stop loop): one step takes it to the first virtual instruction."""
        self.disarm()
        self.machine.gdb.step(tid)
        regs = self.machine.gdb.read_registers(tid)
        pc = regs[self.machine.pc]
        assert self.on_found is not None and self.on_failed is not None
        if not pc & UPPER_HALF:
            self.on_failed(TargetError(f"the kernel's branch to its virtual addresses went to {pc:#x}"))
            return
        self.found_after = time.monotonic() - self.armed_at
        self.on_found(tid, regs, pc - self.entry)


__all__ = ["SwitchSlide"]
