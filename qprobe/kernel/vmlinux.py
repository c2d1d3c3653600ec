"""vmlinux the file: its ELF headers, its sections and the bytes linked in them, its symbol table as parsed.

What :class:`qprobe.kernel.symbols.Symbols` is made from and reads through:
the build-id and the machine straight from the ELF headers, the symbol table
and the section headers through LIEF (or a System.map for a stripped vmlinux),
and the bytes a section holds at a running address (link-time address +
``slide``), as linked, before boot-time patching.
"""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from qprobe.errors import SymbolError

# x86_64's __START_KERNEL with CONFIG_PHYSICAL_START=0x1000000: where ``_text`` is when a symbol table lacks it.
LINK_BASE = 0xFFFF_FFFF_8100_0000


def image_floor(text: int | None) -> int:
    """The lowest address a symbol of the kernel image has, given ``_text``'s link address (None: unknown).

    Below it are what is no address in the image: x86's per-CPU variables (linked from 0) and absolute
    symbols.  The image starts at ``_text``, within 256 MiB of its region's base (x86_64: 0xffffffff80000000;
    arm64: KIMAGE_VADDR, 0xffff800008000000 on 6.1 and 0xffff800080000000 on 6.12)."""
    return (LINK_BASE if text is None else text) & ~0xFFFFFFF


@dataclass(frozen=True)
class Section:
    name: str
    addr: int
    size: int
    offset: int  # in the file
    executable: bool


class VmlinuxImage:
    """vmlinux's sections at running addresses: which one holds an address, and the bytes linked there.

    ``slide`` (KASLR's) is set once the running kernel is known.
    """

    def __init__(self, path: Path, sections: list[Section]) -> None:
        self.path = path
        self.slide = 0
        self.sections = sections
        self._file: mmap.mmap | None = None

    def section(self, name: str) -> Section | None:
        return next((s for s in self.sections if s.name == name), None)

    def is_init_text(self, addr: int) -> bool:
        """Whether ``addr`` is in vmlinux's __init text (freed once the kernel has booted)."""
        sec = self.section_at(addr)
        return sec is not None and sec.executable and sec.name.startswith(".init")

    def section_at(self, addr: int) -> Section | None:
        link = addr - self.slide
        return next((s for s in self.sections if s.addr and s.addr <= link < s.addr + s.size), None)

    def file_bytes(self, addr: int, size: int) -> bytes:
        """Bytes vmlinux holds at running address ``addr`` (before boot-time patching)."""
        sec = self.section_at(addr)
        link = addr - self.slide
        if sec is None or link + size > sec.addr + sec.size:
            raise SymbolError(f"{addr:#x} is not in a section of {self.path.name}")
        if self._file is None:
            with open(self.path, "rb") as f:
                self._file = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        off = sec.offset + link - sec.addr
        return self._file[off : off + size]


def read_build_id(path: Path) -> str:
    """The GNU build-id note, read from the section headers directly.

    LIEF would take about a second for this on the debug vmlinux; the cache
    lookup must not cost more than the cache saves.
    """
    try:
        return _read_build_id(path)
    except struct.error:
        raise SymbolError(f"{path} is truncated: its ELF headers are cut short") from None


def elf_machine(path: Path) -> int:
    """The ELF header's e_machine of a 64-bit little-endian ELF file (which architecture it is for)."""
    try:
        with open(path, "rb") as f:
            ident = f.read(20)
    except OSError as exc:
        raise SymbolError(f"cannot read {path}: {exc.strerror}") from None
    if len(ident) < 20 or ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] != 1:
        raise SymbolError(f"{path} is not a 64-bit little-endian ELF vmlinux")
    return int(struct.unpack_from("<H", ident, 18)[0])


def _read_build_id(path: Path) -> str:
    with open(path, "rb") as f:
        ident = f.read(64)
        if len(ident) < 64 or ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] != 1:
            raise SymbolError(f"{path} is not a 64-bit little-endian ELF vmlinux")
        (shoff,) = struct.unpack_from("<Q", ident, 40)
        shentsize, shnum = struct.unpack_from("<HH", ident, 58)
        f.seek(shoff)
        headers = f.read(shentsize * shnum)
        for i in range(shnum):
            (sh_type,) = struct.unpack_from("<I", headers, i * shentsize + 4)
            if sh_type != 7:  # SHT_NOTE
                continue
            offset, size = struct.unpack_from("<QQ", headers, i * shentsize + 24)
            f.seek(offset)
            notes = f.read(size)
            pos = 0
            while pos + 12 <= len(notes):
                namesz, descsz, ntype = struct.unpack_from("<III", notes, pos)
                name_end = pos + 12 + ((namesz + 3) & ~3)
                desc = notes[name_end : name_end + descsz]
                if ntype == 3 and notes[pos + 12 : pos + 12 + namesz].rstrip(b"\0") == b"GNU":
                    return desc.hex()
                pos = name_end + ((descsz + 3) & ~3)
    raise SymbolError(f"{path} has no build-id note; cannot match it to a running kernel")


def parse_system_map(text: str) -> tuple[list[tuple[str, int, int, str]], dict[str, int]]:
    """System.map lines (``ffffffff81000000 T _stext``): symbols with sizes up to the next one.

    System.map carries no sizes, so a symbol's size is the distance to the next
    address, as kallsyms assumes; per-CPU variables are the small absolute ones.
    """
    rows = []
    percpu: dict[str, int] = {}
    found = re.search(r"^([0-9a-fA-F]+) [Tt] _text$", text, re.M)
    floor = image_floor(int(found.group(1), 16) if found else None)
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        try:
            addr = int(parts[0], 16)
        except ValueError:
            continue
        kind, name = parts[1], parts[2]
        if addr < floor:
            if kind in "Dd":
                percpu[name] = addr
            continue
        rows.append((addr, name, "func" if kind in "Tt" else "object" if kind in "DdBbRr" else "other"))
    rows.sort()
    syms = []
    for i, (addr, name, kind) in enumerate(rows):
        nxt = next((a for a, _n, _k in rows[i + 1 :] if a > addr), addr)
        syms.append((name, addr, nxt - addr, kind))
    return syms, percpu


def parse_with_lief(
    path: Path, system_map: str | Path | None = None
) -> tuple[list[tuple[str, int, int, str]], list[Section], dict[str, int]]:
    import lief

    config = lief.ELF.ParserConfig()
    config.parse_relocations = False
    config.parse_dyn_symbols = False
    config.parse_symbol_versions = False
    config.parse_overlay = False
    binary = lief.ELF.parse(str(path), config)
    if binary is None:
        raise SymbolError(f"LIEF could not parse {path}")
    kinds = {lief.ELF.Symbol.TYPE.FUNC: "func", lief.ELF.Symbol.TYPE.OBJECT: "object"}
    syms = []
    percpu: dict[str, int] = {}
    percpu_index = next((i for i, sec in enumerate(binary.sections) if sec.name == ".data..percpu"), -1)
    text = next((s.value for s in binary.symtab_symbols if s.name == "_text"), None)
    floor = image_floor(text)
    for s in binary.symtab_symbols:
        if not s.name or isinstance(s.name, bytes) or s.type == lief.ELF.Symbol.TYPE.FILE:  # bytes: not UTF-8
            continue
        if s.value >= floor:
            syms.append((s.name, s.value, s.size, kinds.get(s.type, "other")))
        elif s.shndx == percpu_index and s.type == lief.ELF.Symbol.TYPE.OBJECT:
            percpu[s.name] = s.value
    if not syms and system_map is not None:
        try:
            syms, percpu = parse_system_map(Path(system_map).read_text())
        except OSError as exc:
            raise SymbolError(f"cannot read {system_map}: {exc.strerror}") from None
    if not syms:
        raise SymbolError(f"{path} has no symbol table (stripped vmlinux?): use the -dbg package's file "
                          "or give its System.map")  # fmt: skip
    exec_flag = lief.ELF.Section.FLAGS.EXECINSTR
    sections = [
        Section(s.name, s.virtual_address, s.size, s.file_offset, s.has(exec_flag))
        for s in binary.sections
        if s.virtual_address and isinstance(s.name, str)  # LIEF gives bytes for a name not UTF-8
    ]
    return syms, sections, percpu
