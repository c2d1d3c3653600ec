"""A user program's or shared library's ELF: its functions and the file offsets uprobes are placed at.

A uprobe is keyed by (file, offset in the file), so a function's symbol value
(a virtual address in the ELF's own layout) becomes a file offset through the
PT_LOAD segment that holds it: ``value - p_vaddr + p_offset``, as perf probe
``-x`` and bpftrace compute uprobe offsets.  Functions come from ``.symtab``
and ``.dynsym`` both (a stripped library keeps only the latter).

An indirect function (STT_GNU_IFUNC: glibc's ``strlen``, ``memcpy`` and the
other string functions) is a function symbol whose value is its *resolver*,
which the dynamic loader calls once to pick the implementation for this CPU.
``NAME`` is the resolver's offset, as the kernel's uprobe_events at the
symbol's offset, ``perf probe -x`` and bpftrace place it (bcc's symbol lookup
takes the symbol's value whatever its type).  ``NAME@impl`` is the
implementation the loader picked: the file's own IRELATIVE relocations
(``.rela.dyn``/``.rela.plt``) name the resolver as their addend and the GOT
slot the loader wrote its choice into; reading that slot needs a process that
maps the file (``resolve``'s ``loaded``).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from qprobe.errors import QprobeError

if TYPE_CHECKING:
    import lief

ElfKind = Literal["exec", "pie", "shared"]
DF_1_PIE = 0x08000000  # elf.h: DT_FLAGS_1's "position-independent executable"
VERSYM_HIDDEN = 0x8000  # elf.h: a .gnu.version entry of a version no new link binds to
_SPEC = re.compile(r"([^+\s]+)(?:\+(\S*))?")
IMPL = "@impl"  # NAME@impl: an indirect function's implementation, as the loader picked it
# The relocations whose addend is a resolver and whose slot gets its choice (elf.h's R_*_IRELATIVE).
_IRELATIVE = ("X86_64_IRELATIVE", "AARCH64_IRELATIVE")

# What a GOT slot (its vaddr in the ELF's layout) holds in each process that maps the file, as vaddrs of the
# ELF's layout (the load base taken off); none when no process maps the file or the slot could not be read.
LoadedSlots = Callable[[int], list[int]]


class UserElfError(QprobeError):
    """A file that is not a usable ELF, or a symbol that does not resolve; the message is one line."""


@dataclass(frozen=True)
class UserFunction:
    """One function symbol: ``name``, its ``vaddr`` in the ELF, ``offset`` in the file and ``size`` in bytes."""

    name: str
    vaddr: int
    offset: int
    size: int
    ifunc: bool = False  # an indirect function: vaddr and offset are its resolver's


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
        kinds = {lief.ELF.Symbol.TYPE.FUNC: False, lief.ELF.Symbol.TYPE.GNU_IFUNC: True}
        for sym in (*binary.symtab_symbols, *binary.dynamic_symbols):
            if sym.type not in kinds or not sym.name or sym.shndx == 0 or not sym.value:
                continue  # undefined (imported) or absolute-zero functions have no code in this file
            offset = self.file_offset(sym.value)
            if offset is None or (sym.name, sym.value) in seen:
                continue
            seen.add((sym.name, sym.value))
            funcs.append(UserFunction(_versioned(sym), sym.value, offset, sym.size, kinds[sym.type]))
        irelative = {getattr(lief.ELF.Relocation.TYPE, t, None) for t in _IRELATIVE} - {None}
        self._slots: dict[int, list[int]] = {}  # resolver vaddr -> the vaddrs of the GOT slots it fills
        for rel in binary.relocations:
            if rel.type in irelative:
                self._slots.setdefault(rel.addend, []).append(rel.address)
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

    def vaddr_of(self, offset: int) -> int | None:
        """The virtual address, in the ELF's layout, of file byte ``offset`` (None: in no PT_LOAD segment)."""
        for start, file_start, size in self._loads:
            if file_start <= offset < file_start + size:
                return offset - file_start + start
        return None

    def irelative_slots(self, resolver: int) -> list[int]:
        """The vaddrs of the GOT slots the loader fills with the choice of the resolver at vaddr ``resolver``."""
        return sorted(self._slots.get(resolver, []))

    def function_at(self, offset: int) -> str | None:
        """The name of the function whose bytes hold file ``offset`` (the first by name when several do)."""
        names = sorted(f.name for f in self._functions if f.offset <= offset < f.offset + max(f.size, 1))
        return names[0].split("@", 1)[0] if names else None

    def functions(self, pattern: str = "*") -> list[UserFunction]:
        """The functions whose names match the shell-style ``pattern``, by file offset."""
        return [f for f in self._functions if fnmatch.fnmatchcase(f.name, pattern)]

    def resolve(self, spec: str, loaded: LoadedSlots | None = None) -> int:
        """``SYMBOL[+OFFS]`` or ``SYMBOL@impl[+OFFS]`` as a file offset; OFFS must fall inside the function.

        ``SYMBOL@impl`` reads the indirect function's GOT slots through ``loaded`` (None: no guest to read).
        """
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
        impl = name.endswith(IMPL) and name != IMPL
        if impl:
            name = name.removesuffix(IMPL)
        found: set[tuple[int, int | None, int, bool]] = {
            (f.offset, f.size, f.vaddr, f.ifunc) for f in self._by_name.get(name, [])
        }
        if not found:
            raise UserElfError(f"{self.path} has no function {name!r} (qprobe funcs -x {self.path} lists them)")
        if len(found) > 1:  # memcpy: the default version's symbol before an old one's (memcpy@GLIBC_2.2.5)
            found = {(f.offset, f.size, f.vaddr, f.ifunc) for f in self._by_name[name] if f.name == name} or found
        if len(found) > 1:
            places = ", ".join(f"0x{o:x}" for o, *_ in sorted(found))
            raise UserElfError(f"{self.path} has {len(found)} functions named {name!r} (at {places}): give the offset")
        offset, size, vaddr, ifunc = found.pop()
        if impl:
            offset, size = self._implementation(name, vaddr, ifunc, loaded)
        if offs and size is not None and offs >= size:
            raise UserElfError(f"{spec}: {name} is {size} bytes long, the offset {offs:#x} is past its end")
        return offset + offs

    def _implementation(
        self, name: str, resolver: int, ifunc: bool, loaded: LoadedSlots | None
    ) -> tuple[int, int | None]:
        """The file offset and size (None: no symbol tells it) of what the loader picked for indirect ``name``."""
        if not ifunc:
            raise UserElfError(f"{self.path}: {name} is no indirect function (STT_GNU_IFUNC): probe {name} itself")
        slots = self.irelative_slots(resolver)
        if not slots:
            raise UserElfError(f"{self.path} has no IRELATIVE slot of its own for {name} (only the programs that "
                               f"call it hold its choice): probe {name}, its resolver, or an offset")  # fmt: skip
        if loaded is None:
            raise UserElfError(f"{name}{IMPL}: the loader's choice is read from a running process of the guest")
        picked = {v for slot in slots for v in loaded(slot)}
        if not picked:
            raise UserElfError(f"{name}{IMPL}: no process of the guest maps {self.path} now (start one first)")
        offsets = {v: self.file_offset(v) for v in sorted(picked)}
        if len(offsets) > 1:
            places = ", ".join(f"0x{v:x}" if o is None else f"0x{o:x}" for v, o in offsets.items())
            raise UserElfError(f"{name}{IMPL}: the processes mapping {self.path} picked different implementations "
                               f"(at {places}): give the offset")  # fmt: skip
        ((vaddr, offset),) = offsets.items()
        if offset is None:
            raise UserElfError(f"{name}{IMPL}: the loader's choice 0x{vaddr:x} is in no loaded part of {self.path}")
        size = next((f.size for f in self._functions if f.offset == offset), None)
        return offset, size


def _versioned(sym: lief.ELF.Symbol) -> str:
    """A symbol's name, with ``@VERSION`` after it for a non-default (hidden) version's as ``nm -D`` shows it:
    the name alone is what a program linked now binds to, the default version (memcpy@@GLIBC_2.14)."""
    version = sym.symbol_version if sym.has_version else None
    aux = version.symbol_version_auxiliary if version is not None and version.value & VERSYM_HIDDEN else None
    tag = aux.name if aux is not None else None
    name = str(sym.name)
    return name + "@" + tag if isinstance(tag, str) and tag else name


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
