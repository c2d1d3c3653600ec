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
import struct
from pathlib import Path

from qprobe.errors import ImageError, VmlinuxMismatch
from qprobe.kernel.symbols import Symbols
from qprobe.vmm.memory import GuestMemory, MemoryFault

ALIGN = 0x200000
WINDOW = 1 << 30
KERNEL_IMAGE_BASE = 0xFFFF_FFFF_8000_0000  # __START_KERNEL_map: where the window starts


def _anchors(symbols: Symbols) -> list[tuple[int, bytes]]:
    """(link address, bytes) that boot never patches: the banner and the build-id notes."""
    banner_addr = symbols.address("linux_banner")
    notes = symbols.address("__start_notes")
    return [(banner_addr, symbols.file_bytes(banner_addr, 160).split(b"\0")[0]),
            (notes, symbols.file_bytes(notes, symbols.address("__stop_notes") - notes))]  # fmt: skip


def check_slide(symbols: Symbols, mem: GuestMemory, slide: int) -> bool:
    """Whether this vmlinux's banner and build-id are in guest memory at ``slide`` (``symbols.slide`` 0)."""
    try:
        return all(mem.read(addr + slide, len(data)) == data for addr, data in _anchors(symbols))
    except MemoryFault:
        return False


def detect_slide(symbols: Symbols, mem: GuestMemory, console_text: str = "") -> int:
    """The KASLR slide of the running kernel; raises VmlinuxMismatch if it is not this vmlinux."""
    symbols.slide = 0
    for slide in range(0, WINDOW - (symbols.address("_end") - symbols.address("_text")), ALIGN):
        if check_slide(symbols, mem, slide):
            symbols.slide = slide
            return slide
    banner = _anchors(symbols)[0][1]
    running = re.search(r"Linux version [^\n]*", console_text)
    mine = banner.decode(errors="replace").strip()
    raise VmlinuxMismatch(
        f"{symbols.path.name} is not the running kernel: its banner '{mine[:60]}' and build-id "
        f"{symbols.build_id[:12]} are not in guest memory"
        + (f" (the guest booted '{running.group(0)[:60]}')" if running else "")
    )


# The boot protocol's setup header in a bzImage (Documentation/arch/x86/boot.rst): its magic, the
# protocol version, and kernel_alignment (protocol 2.05 and later), which holds CONFIG_PHYSICAL_ALIGN.
HDR_MAGIC, HDR_VERSION, HDR_KERNEL_ALIGNMENT = 0x202, 0x206, 0x230


def image_alignment(image: Path) -> int:
    """CONFIG_PHYSICAL_ALIGN of a bzImage: the step of its KASLR slides (the decompressor's
    find_random_virt_addr picks a multiple of it)."""
    try:
        with open(image, "rb") as f:
            head = f.read(0x240)
    except OSError as exc:
        raise ImageError(f"cannot read {image}: {exc.strerror}") from None
    if len(head) < 0x240 or head[HDR_MAGIC : HDR_MAGIC + 4] != b"HdrS":
        raise ImageError(f"{image.name} is not a bzImage (no boot protocol header): its KASLR alignment is unknown")
    version, align = (
        struct.unpack_from("<H", head, HDR_VERSION)[0],
        struct.unpack_from("<I", head, HDR_KERNEL_ALIGNMENT)[0],
    )
    if version < 0x205 or not align or align & (align - 1):
        raise ImageError(f"{image.name}'s boot protocol header ({version:#x}) gives no kernel alignment")
    return align


def candidate_slides(symbols: Symbols, align: int) -> range:
    """Every KASLR slide the kernel can boot at: multiples of ``align`` that keep it within its window."""
    room = KERNEL_IMAGE_BASE + WINDOW - (symbols.address("_end") - symbols.slide)
    return range(0, max(room, 0) + 1, align)
