"""Whether a vmlinux carries the debug information a feature needs, told before anything boots.

A kernel built without CONFIG_DEBUG_INFO (buildroot's default) has symbols but no DWARF, and then no BTF
either (CONFIG_DEBUG_INFO_BTF is made from the DWARF).  Probes, kprobe_events definitions with registers
and ``qprobe funcs`` work from the symbols; perf probe definitions, the kernel's types (drgn: ``t.prog``,
stack traces, ``regs.arg(name)``, ``qprobe drgn``) need the DWARF, and kprobe_events' named arguments need
the BTF.  The check reads the section headers of the file itself (two small reads, even of a 600 MB
vmlinux), since the symbol table qprobe caches by build-id is the same for a stripped copy.
"""

from __future__ import annotations

import struct
from pathlib import Path

from qprobe.errors import SymbolError

__all__ = ["BTF_FRAGMENT", "DWARF_FRAGMENT", "has_btf_section", "has_dwarf", "need_dwarf", "section_names"]

DWARF_FRAGMENT = "CONFIG_DEBUG_INFO_DWARF_TOOLCHAIN_DEFAULT=y"
BTF_FRAGMENT = (
    f"{DWARF_FRAGMENT} and CONFIG_DEBUG_INFO_BTF=y (and pahole: BR2_LINUX_KERNEL_NEEDS_HOST_PAHOLE in buildroot)"
)
# Where a buildroot user puts such lines: a config fragment file (make linux-menuconfig also works).
_HOW = "BR2_LINUX_KERNEL_CONFIG_FRAGMENT_FILES in buildroot"


def section_names(path: Path) -> frozenset[str]:
    """The section names of a 64-bit little-endian ELF file (empty for anything else)."""
    try:
        with path.open("rb") as f:
            head = f.read(64)
            if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
                return frozenset()
            (shoff,) = struct.unpack_from("<Q", head, 0x28)
            shentsize, shnum, shstrndx = struct.unpack_from("<HHH", head, 0x3A)
            if not shoff or shentsize < 64 or shstrndx >= shnum:
                return frozenset()
            f.seek(shoff)
            table = f.read(shentsize * shnum)
            if len(table) < shentsize * shnum:
                return frozenset()
            str_off, str_size = struct.unpack_from("<QQ", table, shstrndx * shentsize + 0x18)
            f.seek(str_off)
            strings = f.read(min(str_size, 1 << 20))
    except OSError:
        return frozenset()
    names = set()
    for i in range(shnum):
        (name,) = struct.unpack_from("<I", table, i * shentsize)
        names.add(strings[name : strings.find(b"\0", name)].decode(errors="replace") if name < len(strings) else "")
    return frozenset(names)


def has_dwarf(path: Path) -> bool:
    """Whether the file has DWARF (compressed or not)."""
    names = section_names(path)
    return ".debug_info" in names or ".zdebug_info" in names


def has_btf_section(path: Path) -> bool:
    return ".BTF" in section_names(path)


def need_dwarf(path: str | Path, what: str) -> None:
    """One line, before a feature that reads the kernel's DWARF is tried on a vmlinux without it."""
    path = Path(path)
    if not has_dwarf(path):
        raise SymbolError(f"{what} needs the kernel's debug info, and {path.name} has none (no DWARF): build the "
                          f"kernel with {DWARF_FRAGMENT} (a config fragment: {_HOW}) and use that "
                          f"vmlinux")  # fmt: skip
