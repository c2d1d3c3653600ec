"""Find where the running kernel is, and prove it is the vmlinux we were given.

KASLR moves the kernel image by a multiple of CONFIG_PHYSICAL_ALIGN (2 MiB)
within the 1 GiB kernel-image window.  ``linux_banner`` and the build-id note
live in read-only data that boot never patches, so finding the file's bytes
at ``link address + slide`` both finds the slide and matches the file; text
itself cannot be compared byte for byte (alternatives, static keys and the
ftrace NOPs rewrite it at boot).
"""

from __future__ import annotations

import re

from qprobe.errors import VmlinuxMismatch
from qprobe.kernel.symbols import Symbols
from qprobe.vmm.memory import GuestMemory, MemoryFault

ALIGN = 0x200000
WINDOW = 1 << 30


def detect_slide(symbols: Symbols, mem: GuestMemory, console_text: str = "") -> int:
    """The KASLR slide of the running kernel; raises VmlinuxMismatch if it is not this vmlinux."""
    symbols.slide = 0
    banner_addr = symbols.address("linux_banner")
    banner = symbols.file_bytes(banner_addr, 160).split(b"\0")[0]
    notes = symbols.address("__start_notes")
    notes_len = symbols.address("__stop_notes") - notes
    note_bytes = symbols.file_bytes(notes, notes_len)
    for slide in range(0, WINDOW - (symbols.address("_end") - symbols.address("_text")), ALIGN):
        try:
            if mem.read(banner_addr + slide, len(banner)) != banner:
                continue
            if mem.read(notes + slide, notes_len) != note_bytes:
                continue
        except MemoryFault:
            continue
        symbols.slide = slide
        return slide
    running = re.search(r"Linux version [^\n]*", console_text)
    mine = banner.decode(errors="replace").strip()
    raise VmlinuxMismatch(
        f"{symbols.path.name} is not the running kernel: its banner '{mine[:60]}' and build-id "
        f"{symbols.build_id[:12]} are not in guest memory"
        + (f" (the guest booted '{running.group(0)[:60]}')" if running else "")
    )
