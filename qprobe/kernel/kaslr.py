"""Find where the running kernel is, and prove it is the vmlinux we were given.

KASLR moves the kernel image by a multiple of CONFIG_PHYSICAL_ALIGN (2 MiB)
within the 1 GiB kernel-image window.  ``linux_banner`` and the build-id note
live in read-only data that boot never patches, so finding the file's bytes
at ``link address + slide`` both finds the slide and matches the file; text
itself cannot be compared byte for byte (alternatives, static keys and the
ftrace NOPs rewrite it at boot).
"""

from __future__ import annotations

import itertools
import re
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

from qprobe.errors import ImageError, MemoryFault, VmlinuxMismatch
from qprobe.images.image import kernel_kind
from qprobe.kernel.symbols import Symbols
from qprobe.vmm.memory import GuestMemory

ALIGN = 0x200000
HINT_ALIGN = 0x10000
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


def slides_near(symbols: Symbols, pcs: Iterable[int]) -> list[int]:
    """The slides that put each of ``pcs`` (a vCPU's kernel-mode pc) within the image's text, nearest first.

    arm64's KASLR moves the image anywhere in half of its vmalloc area (arch/arm64/kernel/pi/kaslr_early.c,
    BIT(VA_BITS_MIN - 3) + the seed's bits): no window to scan, but a vCPU in the kernel is in its text.
    The step is 64 KiB, arm64's smallest image alignment (SEGMENT_ALIGN), of which x86's 2 MiB is a multiple."""
    found: dict[int, None] = {}  # ordered, without repeats
    pcs = list(pcs)
    if not pcs:
        return []
    text = symbols.address("_text")
    etext = symbols.address("_etext" if "_etext" in symbols else "_end")
    for pc in pcs:
        high, low = pc - text, pc - etext
        for slide in range(high - high % HINT_ALIGN, max(low, 0) - 1, -HINT_ALIGN):
            found.setdefault(slide)
    return list(found)


def detect_slide(symbols: Symbols, mem: GuestMemory, console_text: str = "", pcs: Iterable[int] = ()) -> int:
    """The KASLR slide of the running kernel; raises VmlinuxMismatch if it is not this vmlinux.

    ``pcs``, the kernel-mode pcs of the vCPUs, are tried first; then every slide of x86's window."""
    symbols.slide = 0
    window = range(0, WINDOW - (symbols.address("_end") - symbols.address("_text")), ALIGN)
    for slide in itertools.chain(slides_near(symbols, pcs), window):
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
    if kernel_kind(head) == "arm64 Image":
        # Its slide has some 2**25 candidates, too many for a breakpoint each: Arch.boot.arch_boot_switch finds it.
        raise ImageError(f"{image.name} is an arm64 Image: it has no KASLR alignment (its slide is found at its "
                         "branch to virtual addresses)")  # fmt: skip
    if len(head) < 0x240 or head[HDR_MAGIC : HDR_MAGIC + 4] != b"HdrS":
        raise ImageError(f"{image.name} is not a bzImage (no boot protocol header): its KASLR alignment is unknown")
    version: int = struct.unpack_from("<H", head, HDR_VERSION)[0]
    align: int = struct.unpack_from("<I", head, HDR_KERNEL_ALIGNMENT)[0]
    if version < 0x205 or not align or align & (align - 1):
        raise ImageError(f"{image.name}'s boot protocol header ({version:#x}) gives no kernel alignment")
    return align


def candidate_slides(symbols: Symbols, align: int) -> range:
    """Every KASLR slide the kernel can boot at: multiples of ``align`` that keep it within its window."""
    room = KERNEL_IMAGE_BASE + WINDOW - (symbols.address("_end") - symbols.slide)
    return range(0, max(room, 0) + 1, align)


# -- where the decompressor puts the kernel (x86's bzImage: arch/x86/boot/compressed/misc.c) -------------------
# Its payload is vmlinux as an ELF file (``objcopy -R .comment -S``: sections and symbols go, the program
# headers stay); extract_kernel decompresses the whole file to the physical address it chose (``output``, a
# multiple of the image's kernel_alignment), then parse_elf moves each PT_LOAD segment from its p_offset
# to output + p_paddr - LOAD_PHYSICAL_ADDR, and handle_relocations applies the virtual slide.  The ELF
# header is the first thing decompressed and the text segment's move overwrites it: while it is at
# ``output``, the kernel has not been entered.
_EHDR, _PHDR = struct.Struct("<16sHHIQQQIHHHHHH"), struct.Struct("<IIQQQQQQ")
PT_LOAD = 1


class Decompressed:
    """What the decompressor writes of one vmlinux, from the file's first page: the ELF header's parts
    the stripped copy keeps, and where the kernel is entered relative to ``output``."""

    def __init__(self, head: bytes) -> None:
        """``head``: vmlinux's first bytes (its ELF and program headers); ImageError if they are not there."""
        if len(head) < _EHDR.size or head[:5] != b"\x7fELF\x02":
            raise ImageError("vmlinux is not a 64-bit ELF file")
        entry, phoff = _EHDR.unpack_from(head)[4:6]
        phentsize, phnum = _EHDR.unpack_from(head)[9:11]
        if phentsize != _PHDR.size or not phnum or phoff + phnum * phentsize > len(head):
            raise ImageError("vmlinux's program headers are not in its first page")
        loads = [p for p in (_PHDR.unpack_from(head, phoff + i * phentsize) for i in range(phnum)) if p[0] == PT_LOAD]
        if not loads:
            raise ImageError("vmlinux has no PT_LOAD segment")
        # LOAD_PHYSICAL_ADDR is where the lowest segment (the text) links physically.
        base = min(p[4] for p in loads)
        if not base <= entry < max(p[4] + p[6] for p in loads):
            raise ImageError(f"vmlinux's entry {entry:#x} is outside its segments")
        # The decompressor enters the kernel at output + e_entry - LOAD_PHYSICAL_ADDR (parse_elf's
        # entry_offset; decompressors older than it jump to output itself, and their vmlinux's e_entry
        # is that of startup_64 at _text: the same place).
        self.entry = entry - base
        # e_shoff, e_shnum and e_shstrndx are the stripped copy's own; the rest is vmlinux's.
        self.pieces = ((0, head[:0x28]), (0x30, head[0x30:0x3A]), (phoff, head[phoff : phoff + phnum * phentsize]))

    @property
    def magic(self) -> bytes:
        """The header's first bytes: a cheap first test at every candidate."""
        return self.pieces[0][1][:8]

    def header_at(self, read: Callable[[int, int], bytes], output: int) -> bool:
        """Whether the decompressed ELF header is at physical ``output`` (``read(paddr, size)``)."""
        try:
            return all(read(output + off, len(data)) == data for off, data in self.pieces)
        except MemoryFault:
            return False


def output_candidates(low: int, size: int, align: int, high_base: int = 1 << 32) -> list[int]:
    """Every physical address the decompressor can put the kernel at, in RAM of ``size`` bytes whose first
    ``low`` are at 0 and the rest at ``high_base``: the multiples of ``align`` (choose_random_location's
    slots, and the load address itself without KASLR)."""
    out = list(range(0, low, align))
    if size > low:
        out += range(high_base, high_base + size - low, align)
    return out
