"""The few facts qprobe reads from the guest's ELF programs on the host: their loader and the libraries they need.

Only 64-bit little-endian files, the kind of every guest qprobe builds
(x86_64, aarch64); read by offsets from the ELF header, program headers and
dynamic section (``include/uapi/linux/elf.h``), so a program of another
architecture is read as well as one of the host's.
"""

from __future__ import annotations

import struct
from pathlib import Path

from qprobe.errors import ImageError

__all__ = ["interpreter", "needed"]

_PT_LOAD = 1
_PT_DYNAMIC = 2
_PT_INTERP = 3
_DT_NEEDED = 1
_DT_STRTAB = 5


def _segments(data: bytes, path: Path, what: str) -> list[tuple[int, int, int, int]]:
    """(p_type, p_offset, p_vaddr, p_filesz) of each program header, from the file's first bytes ``data``."""
    if data[:4] != b"\x7fELF" or len(data) < 64 or data[4] != 2 or data[5] != 1:
        raise ImageError(f"{what} {path} is not a 64-bit little-endian ELF program")
    phoff, phentsize, phnum = int.from_bytes(data[32:40], "little"), data[54] | data[55] << 8, data[56] | data[57] << 8
    found = []
    for i in range(phnum):
        off = phoff + i * phentsize
        if off + 56 > len(data):
            raise ImageError(f"{what} {path}: its program headers are not in its first {len(data)} bytes")
        p_type, _flags, p_offset, p_vaddr, _paddr, p_filesz = struct.unpack_from("<IIQQQQ", data, off)
        found.append((p_type, p_offset, p_vaddr, p_filesz))
    return found


def interpreter(path: Path, what: str = "program") -> str | None:
    """The ELF program's PT_INTERP (its dynamic loader's path), None for a static program."""
    data = path.read_bytes()[:4096]
    for p_type, p_offset, _vaddr, p_filesz in _segments(data, path, what):
        if p_type == _PT_INTERP:
            with path.open("rb") as f:
                f.seek(p_offset)
                return f.read(min(p_filesz, 4096)).split(b"\0", 1)[0].decode("utf-8", "replace")
    return None


def needed(path: Path, what: str = "library") -> list[str]:
    """The DT_NEEDED names of an ELF program or shared library, in order ([] for a static one)."""
    data = path.read_bytes()
    segments = _segments(data[:4096], path, what)
    dynamic = [(offset, size) for p_type, offset, _vaddr, size in segments if p_type == _PT_DYNAMIC]
    if not dynamic:
        return []
    offset, size = dynamic[0]
    entries = [struct.unpack_from("<qQ", data, at) for at in range(offset, min(offset + size, len(data) - 15), 16)]
    strtab = next((value for tag, value in entries if tag == _DT_STRTAB), None)
    # DT_STRTAB is an address: the file offset is where the PT_LOAD segment holding it was read from.
    base = next(
        (offset - vaddr for p_type, offset, vaddr, size in segments
         if p_type == _PT_LOAD and strtab is not None and vaddr <= strtab < vaddr + size),
        None,
    )  # fmt: skip
    if strtab is None or base is None:
        raise ImageError(f"{what} {path} has a dynamic section without a string table")
    names = []
    for tag, value in entries:
        if tag == 0:  # DT_NULL ends the table
            break
        if tag == _DT_NEEDED:
            start = strtab + base + value
            names.append(data[start : data.index(b"\0", start)].decode("utf-8", "replace"))
    return names
