"""The KASLR slide of a kernel that has not run yet, found as it boots.

With the VM halted before the kernel's first instruction, nothing in guest
memory says where the kernel will be: the decompressor picks the slide.  The
boot CPU, though, runs one known instruction at the kernel's virtual addresses
first (``Arch.arch_boot_entry``, before ``start_kernel``), at its link address
plus the slide, and the slide is a multiple of the image's KASLR alignment
within the kernel's window.  A stub breakpoint on that instruction for every
candidate slide (writing nothing into the guest) stops the VM there; the one
hit gives the slide, the others go, and the kernel can be probed from then on.

Each of those breakpoints costs every translated block QEMU runs a compare
(TCG's check_for_breakpoints walks the CPU's list), and the decompressor runs
while they are in: some hundreds of them make it several times slower.  With
the guest's RAM shared with the host they go in only for the short stretch
from the kernel's physical entry to that instruction: the host watches RAM,
without stopping the VM, for the decompressed vmlinux's ELF header at the
candidate physical addresses; the header found (and still there with the VM
stopped, so the kernel has not been entered), one breakpoint on the kernel's
physical entry there (``startup_64`` runs identity mapped) stops it before it
runs, and the candidates go in then.  Should the header be missed, the kernel
found only once it is in place, every candidate goes in at once if no vCPU has
run at a kernel virtual address yet, and the boot fails loudly if one has.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable

from qprobe.arch import Arch
from qprobe.errors import ImageError, MemoryFault, TargetError, TargetGone
from qprobe.kernel.kaslr import Decompressed, candidate_slides, output_candidates
from qprobe.kernel.symbols import Symbols
from qprobe.vmm.gdbremote import BREAK_HW
from qprobe.vmm.machine import Machine
from qprobe.vmm.memory import SharedRam

Found = Callable[[str, dict[str, int], int], None]
Failed = Callable[[BaseException], None]
log = logging.getLogger("qprobe")

# The decompressor and the kernel's physical entry run identity mapped, in the lower half; the kernel
# from its first virtual instruction on in the upper one.
UPPER_HALF = 1 << 63
WATCH_PERIOD = 0.002  # s between two looks at every candidate (some hundred reads of a few bytes)


class StubSearch:
    """The stub breakpoints a slide search puts in (stop loop), each with its stop handler, taken out together."""

    def __init__(self, machine: Machine) -> None:
        self.machine = machine
        self.armed: list[int] = []

    def disarm(self) -> None:
        for addr in self.armed:
            self.machine.stop_handlers.pop(addr, None)
            self.machine.gdb.remove_breakpoint(addr, BREAK_HW)
        self.armed.clear()

    def _insert(self, addr: int, handler: Callable[[str, dict[str, int]], None]) -> None:
        self.machine.gdb.insert_breakpoint(addr, BREAK_HW)
        self.armed.append(addr)
        self.machine.stop_handlers[addr] = handler


class BootSlide(StubSearch):
    """Stub breakpoints on the first virtual instruction at every candidate slide, put in at once or (shared
    RAM) once the kernel is entered (the stop loop's)."""

    def __init__(self, machine: Machine, symbols: Symbols, arch: Arch, align: int, cmdline: str,
                 ram: SharedRam | None = None) -> None:  # fmt: skip
        """``cmdline``: the kernel's; with ``nokaslr`` the decompressor leaves the kernel at its link address.
        ``ram``: the guest's RAM, if shared: the candidates then go in only once the kernel is entered."""
        super().__init__(machine)
        assert symbols.slide == 0, "candidates are link addresses plus a slide"
        self.entry = arch.boot.arch_boot_entry(symbols.file_bytes, symbols.address)
        nokaslr = "nokaslr" in cmdline.split()
        self.slides = range(0, 1) if nokaslr else candidate_slides(symbols, align)
        self.ram = None if nokaslr else ram  # one breakpoint is as cheap as the watch
        if self.ram is not None:
            try:
                with open(symbols.path, "rb") as f:
                    self.decompressed = Decompressed(f.read(4096))
            except (OSError, ImageError) as exc:
                log.warning("boot slide: every candidate slide's breakpoint from the start: %s", exc)
                self.ram = None
        if self.ram is not None:
            text = symbols.address("_text")
            banner = symbols.address("linux_banner")
            # Read-only characters up to the NUL: nothing handle_relocations changes.
            self.banner = (banner - text, symbols.file_bytes(banner, 160).split(b"\0")[0])
            self.outputs = output_candidates(self.ram.low, self.ram.size, align)
        self.on_found: Found | None = None
        self.on_failed: Failed | None = None
        self.armed_at = 0.0  # time.monotonic() when the search began
        self.found_after = 0.0  # seconds from then to the hit
        # How the slide was found: "candidates" (all in from the start), "entry" (the physical entry's
        # breakpoint, then the candidates) or "late" (the header missed: all in once the kernel was found).
        self.method = "candidates"
        self.output: int | None = None  # the kernel's physical address, when watched for
        self.output_after = 0.0  # seconds from the start to the watch finding it
        self.entered_after = 0.0  # and to the physical entry's hit
        self._watching = threading.Event()

    def arm(self, on_found: Found, on_failed: Failed) -> None:
        """Start the search (stop loop); ``on_found(tid, regs, slide)`` runs on the hit, with every breakpoint
        out, ``on_failed(exc)`` (on any thread) if the kernel got past its first virtual instruction unseen."""
        self.on_found, self.on_failed = on_found, on_failed
        self.armed_at = time.monotonic()
        if self.ram is None:
            self._arm_candidates()
            return
        self.method = "entry"
        self._watching.set()
        threading.Thread(target=self._watch, name="qprobe-boot-watch", daemon=True).start()

    def waiting_for(self) -> str:
        """What the search is waiting for, for a boot that timed out."""
        if self._watching.is_set():
            return f"the decompressed vmlinux at any of {len(self.outputs)} physical addresses"
        if self.method == "entry" and not self.entered_after:
            return f"the kernel's physical entry at {self.output or 0:#x}"
        return f"{len(self.slides)} candidate slides' first virtual instruction"

    def disarm(self) -> None:
        self._watching.clear()
        super().disarm()

    def _arm_candidates(self) -> None:
        for slide in self.slides:
            self._insert(self.entry + slide, self._hit)

    def _hit(self, tid: str, regs: dict[str, int]) -> None:
        self.found_after = time.monotonic() - self.armed_at
        slide = regs[self.machine.pc] - self.entry
        self.disarm()  # the vCPU goes on from here: no breakpoint left under it
        assert self.on_found is not None
        self.on_found(tid, regs, slide)

    # -- the watch on shared RAM ---------------------------------------------------------------
    def _watch(self) -> None:
        """The watch thread: look at every candidate until the kernel is found, or the search ends."""
        assert self.ram is not None
        read = self.ram.read_phys
        magic = self.decompressed.magic
        banner_at, banner = self.banner
        try:
            while self._watching.is_set() and self.machine.alive:
                for output in self.outputs:
                    try:
                        if read(output, len(magic)) == magic and self.decompressed.header_at(read, output):
                            self.machine.call(functools.partial(self._header_seen, output))
                            return
                        if read(output + banner_at, len(banner)) == banner:
                            self.machine.call(lambda: self._late("its banner seen before its decompressed header"))
                            return
                    except MemoryFault:
                        continue
                time.sleep(WATCH_PERIOD)
        except (TargetGone, ValueError) as exc:  # the VM went, or its RAM was unmapped, meanwhile
            log.debug("boot slide: the watch on guest RAM ended: %s", exc)
        except BaseException as exc:  # a breakpoint refused, a read failed: the boot is said to fail at once
            assert self.on_failed is not None
            self.on_failed(exc)

    def _header_seen(self, output: int) -> None:
        """The VM stopped (stop loop): the decompressed header at ``output``, unless parse_elf moved the text
        over it between the look and the stop."""
        if not self._watching.is_set():
            return
        assert self.ram is not None
        if not self.decompressed.header_at(self.ram.read_phys, output):
            self._late(f"its decompressed header seen at {output:#x}, and moved over by the stop")
            return
        self._watching.clear()
        self.output, self.output_after = output, time.monotonic() - self.armed_at
        self._insert(output + self.decompressed.entry, self._entered)
        log.debug("boot slide: vmlinux decompressed at %#x after %.2f s: a breakpoint on its entry %#x",
                  output, self.output_after, output + self.decompressed.entry)  # fmt: skip

    def _entered(self, tid: str, regs: dict[str, int]) -> None:
        """The kernel's first instruction, at its physical address (stop loop): now the candidates."""
        self.entered_after = time.monotonic() - self.armed_at
        self.disarm()
        self._arm_candidates()

    def _late(self, why: str) -> None:
        """The kernel found past the decompressor's header (stop loop): every candidate in, if no vCPU has
        run at its virtual addresses yet (its first one there is the one the candidates are on)."""
        if not self._watching.is_set():
            return
        self._watching.clear()
        self.method = "late"
        self.output_after = time.monotonic() - self.armed_at
        virtual = [tid for tid in self.machine.vcpus
                   if self.machine.gdb.read_registers(tid)[self.machine.pc] >= UPPER_HALF]  # fmt: skip
        if virtual:
            assert self.on_failed is not None
            self.on_failed(TargetError(f"the kernel ran past its first virtual instruction before qprobe found "
                                       f"it in guest RAM ({why}): boot-time probes missed it"))  # fmt: skip
            return
        log.warning("boot slide: FALLBACK to every candidate slide's breakpoint at once, the kernel not yet at "
                    "its virtual addresses (the watch on guest RAM: %s)", why)  # fmt: skip
        self._arm_candidates()


__all__ = ["UPPER_HALF", "BootSlide", "Failed", "Found", "StubSearch"]
