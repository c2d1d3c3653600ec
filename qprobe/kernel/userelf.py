"""A user program's or shared library's ELF: its functions and the file offsets uprobes are placed at.

A uprobe is keyed by (file, offset in the file), so a function's symbol value
(a virtual address in the ELF's own layout) becomes a file offset through the
PT_LOAD segment that holds it: ``value - p_vaddr + p_offset``, as perf probe
``-x`` and bpftrace compute uprobe offsets.  Functions come from ``.symtab``
and ``.dynsym`` both (a stripped library keeps only the latter).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from qprobe.errors import QprobeError

if TYPE_CHECKING:
    import lief

ElfKind = Literal["exec", "pie", "shared"]
DF_1_PIE = 0x08000000  # elf.h: DT_FLAGS_1's "position-independent executable"
_SPEC = re.compile(r"([^+\s]+)(?:\+(\S*))?")


class UserElfError(QprobeError):
    """A file that is not a usable ELF, or a symbol that does not resolve; the message is one line."""


@dataclass(frozen=True)
class UserFunction:
    """One function symbol: ``name``, its ``vaddr`` in the ELF, ``offset`` in the file and ``size`` in bytes."""

    name: str
    vaddr: int
    offset: int
    size: int


class UserElf:
    """The functions of one ELF file, given as bytes (``path`` only names it in messages)."""

    def __init__(self, data: bytes, path: str = "the file") -> None:
        import lief  # here, not at the top: it takes 0.4 s to import, and most commands read no user ELF

        self.path = path
        if data[:4] != b"\x7fELF":
            raise UserElfError(f"{path} is not an ELF file")
        binary = lief.ELF.parse(list(data)) if data else None
        if not isinstance(binary, lief.ELF.Binary):
            raise UserElfError(f"{path}: LIEF could not parse it as ELF")
        self.kind = _kind(binary)
        self._loads = [
            (s.virtual_address, s.file_offset, s.physical_size)
            for s in binary.segments
            if s.type == lief.ELF.Segment.TYPE.LOAD
        ]
        seen: set[tuple[str, int]] = set()
        funcs: list[UserFunction] = []
        for sym in (*binary.symtab_symbols, *binary.dynamic_symbols):
            if sym.type != lief.ELF.Symbol.TYPE.FUNC or not sym.name or sym.shndx == 0 or not sym.value:
                continue  # undefined (imported) or absolute-zero functions have no code in this file
            offset = self.file_offset(sym.value)
            if offset is None or (sym.name, sym.value) in seen:
                continue
            seen.add((sym.name, sym.value))
            funcs.append(UserFunction(sym.name, sym.value, offset, sym.size))
        self._functions = sorted(funcs, key=lambda f: (f.offset, f.name))
        self._by_name: dict[str, list[UserFunction]] = {}
        for f in self._functions:
            for name in {f.name, f.name.split("@", 1)[0]}:  # memcpy@@GLIBC_2.14 answers to memcpy too
                self._by_name.setdefault(name, []).append(f)

    @property
    def is_pie(self) -> bool:
        """A position-independent executable (mapped at a random base), as opposed to a fixed-address one."""
        return self.kind == "pie"

    def file_offset(self, vaddr: int) -> int | None:
        """The file offset of a virtual address in the ELF's layout (None: in no loaded file bytes)."""
        for start, offset, size in self._loads:
            if start <= vaddr < start + size:
                return vaddr - start + offset
        return None

    def function_at(self, offset: int) -> str | None:
        """The name of the function whose bytes hold file ``offset`` (the first by name when several do)."""
        names = sorted(f.name for f in self._functions if f.offset <= offset < f.offset + max(f.size, 1))
        return names[0].split("@", 1)[0] if names else None

    def functions(self, pattern: str = "*") -> list[UserFunction]:
        """The functions whose names match the shell-style ``pattern``, by file offset."""
        return [f for f in self._functions if fnmatch.fnmatchcase(f.name, pattern)]

    def resolve(self, spec: str) -> int:
        """``SYMBOL[+OFFS]`` as a file offset; OFFS must fall inside the function."""
        m = _SPEC.fullmatch(spec.strip())
        if m is None:
            raise UserElfError(f"{spec!r}: expected SYMBOL or SYMBOL+OFFSET")
        name, offs_text = m.group(1), m.group(2)
        offs = 0
        if offs_text is not None:
            try:
                offs = int(offs_text, 0)
            except ValueError:
                raise UserElfError(f"{spec}: the offset {offs_text!r} is not a number") from None
        found = {(f.offset, f.size) for f in self._by_name.get(name, [])}
        if not found:
            raise UserElfError(f"{self.path} has no function {name!r} (qprobe funcs -x {self.path} lists them)")
        if len(found) > 1:
            places = ", ".join(f"0x{o:x}" for o, _ in sorted(found))
            raise UserElfError(f"{self.path} has {len(found)} functions named {name!r} (at {places}): give the offset")
        offset, size = found.pop()
        if offs and offs >= size:
            raise UserElfError(f"{spec}: {name} is {size} bytes long, the offset {offs:#x} is past its end")
        return offset + offs


def _kind(binary: lief.ELF.Binary) -> ElfKind:
    import lief

    if binary.header.file_type == lief.ELF.Header.FILE_TYPE.EXEC:
        return "exec"
    if binary.has_interpreter:
        return "pie"
    flags_1 = binary.get(lief.ELF.DynamicEntry.TAG.FLAGS_1) if binary.has(lief.ELF.DynamicEntry.TAG.FLAGS_1) else None
    if flags_1 is not None and flags_1.value & DF_1_PIE:
        return "pie"  # static-pie: no interpreter, relocated by its own start code
    return "shared"
