"""vmlinux symbols through LIEF, cached by build-id, with the KASLR slide applied.

Parsing the 590 MB debug vmlinux skips relocations and dynamic symbols (0.6-2 s
instead of 30 s); the result is cached as JSON keyed by the build-id, so
later loads take a fraction of that (JSON, not pickle: a cache file is data,
and loading it must never run code, whoever wrote it).  All addresses handed
out are *running* addresses: link-time address + ``slide``.  What is read
from the file itself, and how, is :mod:`qprobe.kernel.vmlinux`'s.
"""

from __future__ import annotations

import array
import base64
import bisect
import functools
import itertools
import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from qprobe.arch import FtraceSite
from qprobe.errors import QprobeError, SymbolError
from qprobe.kernel.vmlinux import Section, VmlinuxImage, image_floor, parse_with_lief, read_build_id
from qprobe.paths import cache_dir, read_private, write_private

_CACHE_VERSION = 4


@dataclass(frozen=True)
class Symbol:
    name: str
    addr: int
    size: int
    kind: str  # "func", "object", "other"


@dataclass(frozen=True)
class ModuleText:
    """One loaded module: its text ranges, symbols (running addresses, sorted) and special sites."""

    name: str
    struct_addr: int  # the struct module
    text: tuple[tuple[int, int], ...]  # (start, end) of its core text
    symbols: tuple[Symbol, ...]  # sorted by address
    ftrace_sites: tuple[int, ...] = ()  # sorted ``call __fentry__`` sites (NOPs until ftrace uses them)
    extable: frozenset[int] = frozenset()  # instructions with an exception-table fixup
    jump_labels: tuple[int, ...] = ()
    static_calls: tuple[int, ...] = ()
    bugs: frozenset[int] = frozenset()  # BUG()/WARN() instructions
    # Its init text while it is COMING (module_init runs there); empty once the kernel frees it.
    init_text: tuple[tuple[int, int], ...] = ()
    _addrs: list[int] = field(default_factory=list, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._addrs.extend(s.addr for s in self.symbols)

    def is_text(self, addr: int) -> bool:
        return self.is_init_text(addr) or any(lo <= addr < hi for lo, hi in self.text)

    def is_init_text(self, addr: int) -> bool:
        return any(lo <= addr < hi for lo, hi in self.init_text)

    def lookup(self, name: str) -> list[Symbol]:
        return [s for s in self.symbols if s.name == name]

    def containing(self, addr: int) -> Symbol | None:
        """The symbol covering ``addr`` (a sized function wins among those at one address).

        A size-0 symbol covers the text up to the next symbol, as in kallsyms.
        """
        i = bisect.bisect_right(self._addrs, addr) - 1
        if i < 0:
            return None
        at = self._addrs[i]
        rows = itertools.takewhile(lambda s: s.addr == at, self.symbols[i::-1])
        covering = [s for s in rows if addr < s.addr + s.size or (s.size == 0 and self.is_text(addr))]
        return max(covering, key=lambda s: (s.kind == "func", s.size > 0)) if covering else None

    def next_symbol(self, addr: int) -> int | None:
        """The address of the first symbol after ``addr`` (kallsyms' idea of where a symbol ends)."""
        i = bisect.bisect_right(self._addrs, addr)
        return self._addrs[i] if i < len(self._addrs) else None


class Symbols(VmlinuxImage):
    """Name <-> address for one vmlinux.  ``slide`` is set once the running kernel is known."""

    def __init__(self, path: Path, build_id: str, symbols: list[tuple[str, int, int, str]],
                 sections: list[Section], percpu: dict[str, int] | None = None) -> None:  # fmt: skip
        super().__init__(path, sections)
        # Per-CPU variables are offsets from each CPU's base (x86's GS base), not addresses: KASLR does not move them.
        self.percpu = percpu or {}
        self.build_id = build_id
        # Whether __init text is still the kernel's (during boot, until free_initmem): probes may go there.
        self.init_text = False
        rows = sorted((a, s, n, k) for n, a, s, k in symbols if a)
        self._addrs = [r[0] for r in rows]
        self._rows = rows
        self._by_name: dict[str, int] = {}
        for i, (_a, _s, n, _k) in enumerate(rows):
            self._by_name.setdefault(n, i)  # the first, as kallsyms_lookup_name does
        self._extable: tuple[int, frozenset[int]] | None = None  # (slide, running addresses)
        # Loaded modules whose symbols are known (``add_module``): kallsyms_lookup_name and
        # kallsyms_lookup search them after vmlinux, and ``MOD:SYM`` names one module's symbol.
        self.modules: dict[str, ModuleText] = {}

    # -- loading -------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path, system_map: str | Path | None = None) -> Symbols:
        """Symbols of ``path``; a stripped vmlinux takes its symbols from ``system_map``."""
        path = Path(path)
        if not path.is_file():
            raise SymbolError(f"vmlinux {path} does not exist")
        build_id = read_build_id(path)
        cached = cache_dir("symbols") / f"{build_id}.json"
        found = _from_cache(read_private(cached), build_id)
        if found is not None:
            return cls(path, build_id, *found)
        syms, sections, percpu = parse_with_lief(path, system_map)
        table = cls(path, build_id, syms, sections, percpu)
        write_private(cached, table._cache_bytes())
        cached.with_suffix(".pickle").unlink(missing_ok=True)  # the format of earlier versions
        return table

    def _cache_bytes(self) -> bytes:
        # Columns, not a list per symbol: JSON decodes a few long strings several times faster.
        data = {"version": _CACHE_VERSION, "build_id": self.build_id,
                "names": [n for _a, _s, n, _k in self._rows],
                "addrs": _pack([a for a, _s, _n, _k in self._rows]),
                "sizes": _pack([s for _a, s, _n, _k in self._rows]),
                "kinds": "".join(_KIND_CODES[k] for _a, _s, _n, k in self._rows),
                "sections": [[s.name, s.addr, s.size, s.offset, s.executable] for s in self.sections],
                "percpu": self.percpu}  # fmt: skip
        return json.dumps(data, separators=(",", ":")).encode()

    # -- lookups (running addresses) -----------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self._by_name or bool(self._module_lookup(name))

    def __len__(self) -> int:
        return len(self._rows)

    def lookup(self, name: str) -> Symbol:
        i = self._by_name.get(name)
        if i is None:
            found = self._module_lookup(name)
            if found:
                return found[0]
            mod = name.split(":", 1)[0] if ":" in name else None
            if mod is not None and mod not in self.modules:
                raise SymbolError(f"unknown symbol {name!r}: module {mod} is not loaded")
            raise SymbolError(f"unknown symbol {name!r} in {self.path.name}")
        a, s, n, k = self._rows[i]
        return Symbol(n, a + self.slide, s, k)

    # -- modules -------------------------------------------------------------------
    def add_module(self, mod: ModuleText) -> None:
        self.modules[mod.name] = mod

    def remove_module(self, name: str) -> ModuleText | None:
        return self.modules.pop(name, None)

    def module_of(self, addr: int) -> ModuleText | None:
        """The loaded module whose text holds ``addr``."""
        return next((m for m in self.modules.values() if m.is_text(addr)), None)

    def _module_lookup(self, name: str) -> list[Symbol]:
        """``MOD:SYM`` in that module, or a plain name in every loaded module (``module_kallsyms_lookup_name``)."""
        if ":" in name:
            mod, sym = name.split(":", 1)
            return self.modules[mod].lookup(sym) if mod in self.modules else []
        return [s for m in self.modules.values() for s in m.lookup(name)]

    def address(self, name: str) -> int:
        return self.lookup(name).addr

    def resolve(self, expr: str) -> int:
        """``sym``, ``sym+0x10``, ``sym+16`` or ``0xffff...`` -> running address."""
        text = expr.strip()
        m = re.fullmatch(r"([A-Za-z_.$][\w.$]*)\s*(?:([+-])\s*(0x[0-9a-fA-F]+|\d+))?", text)
        if m:
            off = int(m.group(3), 0) if m.group(3) else 0
            return self.address(m.group(1)) + (-off if m.group(2) == "-" else off)
        try:
            return int(text, 16) if text.lower().startswith("0x") else int(text, 0)
        except ValueError:
            raise SymbolError(f"cannot parse {expr!r}: expected SYMBOL[+OFFSET] or an address") from None

    def containing(self, addr: int) -> Symbol | None:
        """The symbol at the nearest address at or below ``addr`` that covers it.

        Among symbols sharing that address a sized function wins.  A size-0
        symbol (an assembler label) covers everything up to the next symbol, as
        in kallsyms; a sized one only its own bytes, so padding after a function
        is None rather than a far-away label's offset.
        """
        for mod in self.modules.values():
            sym = mod.containing(addr)
            if sym is not None:
                return sym
        link = addr - self.slide
        i = bisect.bisect_right(self._addrs, link) - 1
        if i < 0:
            return None
        at = self._addrs[i]
        rows = []
        while i >= 0 and self._addrs[i] == at:
            rows.append(self._rows[i])
            i -= 1
        # A label with no symbol after it (``_end``) ends there: what lies beyond is not vmlinux's.
        last = at == self._addrs[-1]
        covering = [r for r in rows if (r[1] == 0 and (link == at or not last)) or link < r[0] + r[1]]
        if not covering:
            return None
        a, size, name, kind = max(covering, key=lambda r: (r[3] == "func", r[1] > 0))
        return Symbol(name, a + self.slide, size, kind)

    def kallsyms_size(self, sym: Symbol) -> int:
        """The size kallsyms gives ``sym``: the distance to the next symbol's address (not the ELF size).

        ``kallsyms_lookup_size_offset`` has no sizes, so ``%pS`` prints ``func+off/SIZE``
        with the padding up to the next symbol included: the next of kallsyms' own symbols,
        which are not all of the ELF's (scripts/kallsyms.c leaves some out, so a data symbol's
        size can run far past its ELF neighbour).  They are read from vmlinux's kallsyms tables.
        """
        mod = self.module_of(sym.addr)
        if mod is not None:
            after = mod.next_symbol(sym.addr)
            return after - sym.addr if after is not None else sym.size
        link = sym.addr - self.slide
        table = self._kallsyms_addrs
        if table:
            i = bisect.bisect_right(table, link)
            if i < len(table) and table[i - 1] == link:
                return table[i] - link
        i = bisect.bisect_right(self._addrs, link)
        return self._addrs[i] - link if i < len(self._addrs) else sym.size

    @functools.cached_property
    def _kallsyms_addrs(self) -> list[int]:
        """The link-time addresses kallsyms holds, sorted (empty where vmlinux's tables cannot be read).

        ``kallsyms_offsets[]`` are relative to ``kallsyms_relative_base`` (CONFIG_KALLSYMS_BASE_RELATIVE, the
        only form from Linux 6.11); with CONFIG_KALLSYMS_ABSOLUTE_PERCPU (x86_64 SMP until Linux 6.15) a
        kernel address is stored negative, as ``base - 1 - offset``, and only per-CPU ones positive.
        Without the relative form they are ``kallsyms_addresses[]``.
        """
        try:
            count = struct.unpack("<I", self.file_bytes(self.address("kallsyms_num_syms"), 4))[0]
            if "kallsyms_addresses" in self._by_name:
                raw = self.file_bytes(self.address("kallsyms_addresses"), 8 * count)
                addrs = list(struct.unpack(f"<{count}Q", raw))
            else:
                offsets = struct.unpack(f"<{count}i", self.file_bytes(self.address("kallsyms_offsets"), 4 * count))
                base = struct.unpack("<Q", self.file_bytes(self.address("kallsyms_relative_base"), 8))[0]
                if not base:
                    base = self._relocated(self.address("kallsyms_relative_base") - self.slide)
                if any(o < 0 for o in offsets):
                    addrs = [o if o >= 0 else base - 1 - o for o in offsets]
                else:
                    addrs = [base + o for o in offsets]
        except (SymbolError, struct.error):
            return []
        floor = image_floor(self.address("_text") - self.slide if "_text" in self else None)
        return sorted(a for a in addrs if a >= floor)

    def _relocated(self, link: int) -> int:
        """The link-time value of the pointer at link address ``link`` that the kernel relocates itself: arm64
        links with ``--no-apply-dynamic-relocs``, so the file holds 0 there and a RELA entry in ``.rela.dyn``
        holds the value as its addend: ``__rela_start``..``__rela_end`` for head.S's __relocate_kernel, named
        ``__pi_rela_*`` since Linux 6.9 moved it into the position-independent pi/relocate.c.  SymbolError if
        none does."""
        names = next((n for n in (("__rela_start", "__rela_end"), ("__pi_rela_start", "__pi_rela_end"))
                      if n[0] in self._by_name), None)  # fmt: skip
        if names is None:
            raise SymbolError(f"{self.path.name} holds 0 at {link:#x} and has no relocations for it")
        start, end = self.address(names[0]), self.address(names[1])
        raw = self.file_bytes(start, end - start)
        for offset, _info, addend in struct.iter_unpack("<QQq", raw[: len(raw) - len(raw) % 24]):
            if offset == link:
                return int(addend) & (1 << 64) - 1
        raise SymbolError(f"{self.path.name} holds 0 at {link:#x} and no relocation of it")

    def function(self, addr: int) -> Symbol | None:
        sym = self.containing(addr)
        return sym if sym is not None and sym.kind == "func" and sym.size else None

    def symbolize(self, addr: int) -> str:
        """``sym+0xoff`` as kallsyms prints it, or the hex address."""
        sym = self.containing(addr)
        if sym is None:
            return f"{addr:#x}"
        return f"{sym.name}+{addr - sym.addr:#x}"

    def names(self) -> list[str]:
        return list(self._by_name)

    def count(self, name: str) -> int:
        """How many distinct functions or objects are called ``name`` (static ones may share a name).

        What kallsyms' ``number_of_same_symbols`` counts: the kernel refuses to probe a
        name that is not unique rather than pick one.
        """
        if ":" in name:
            mod, sym = name.split(":", 1)
            if mod not in self.modules:
                return 1  # validate_probe_symbol defers a module that is not loaded yet
            return len({s.addr for s in self.modules[mod].lookup(sym) if s.kind in ("func", "object")})
        in_modules = {s.addr for s in self._module_lookup(name) if s.kind in ("func", "object")}
        if name not in self._by_name:
            return len(in_modules)
        return self._shared.get(name, 1) + len(in_modules)

    @functools.cached_property
    def _shared(self) -> dict[str, int]:
        """Names several distinct functions or objects have, with how many (one pass, on first use)."""
        addrs: dict[str, set[int]] = {}
        for a, _s, n, k in self._rows:
            if k in ("func", "object"):
                addrs.setdefault(n, set()).add(a)
        return {n: len(found) for n, found in addrs.items() if len(found) > 1}

    def functions_in(self, start: int, end: int) -> list[Symbol]:
        lo = bisect.bisect_left(self._addrs, start - self.slide)
        hi = bisect.bisect_left(self._addrs, end - self.slide)
        return [Symbol(n, a + self.slide, s, k) for a, s, n, k in self._rows[lo:hi] if k == "func"]

    # -- text: vmlinux's sections and the loaded modules' --------------------------
    def exception_table(self) -> frozenset[int]:
        """Running addresses of instructions with an ``__ex_table`` fixup entry.

        Linux 6.1's ``struct exception_table_entry`` is three s32 offsets (insn,
        fixup, data), each relative to its own field's address.
        """
        if self._extable is None or self._extable[0] != self.slide:
            sec = self.section("__ex_table")
            sites: frozenset[int] = frozenset()
            if sec is not None:
                base = sec.addr + self.slide
                raw = self.file_bytes(base, sec.size - sec.size % 12)
                sites = frozenset(base + i + struct.unpack_from("<i", raw, i)[0] for i in range(0, len(raw), 12))
            self._extable = (self.slide, sites)
        if not self.modules:
            return self._extable[1]
        return self._extable[1].union(*(m.extable for m in self.modules.values()))

    def is_text(self, addr: int) -> bool:
        if self.module_of(addr) is not None:
            return True
        sec = self.section_at(addr)
        return sec is not None and sec.executable and (self.init_text or not sec.name.startswith(".init"))

    def ftrace_site(self, addr: int, site: FtraceSite, entry: int) -> bool:
        """Whether ``addr`` is an ftrace call site (``site``'s form, calling ``entry``): vmlinux's told by the bytes
        linked there (boot turns them into NOPs), a module's by its ``ftrace_callsites`` table (``__mcount_loc``)."""
        mod = self.module_of(addr)
        if mod is not None:
            i = bisect.bisect_left(mod.ftrace_sites, addr)
            return i < len(mod.ftrace_sites) and mod.ftrace_sites[i] == addr
        try:
            linked = self.file_bytes(addr, site.size)
        except QprobeError:
            return False
        return site.callee(linked, addr) == entry


_Cached = tuple[list[tuple[str, int, int, str]], list[Section], dict[str, int]]


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} in a symbol cache")


def _pack(values: list[int]) -> str:
    return base64.b64encode(array.array("Q", values).tobytes()).decode()


def _unpack(text: str, count: int) -> list[int]:
    values = array.array("Q")
    values.frombytes(base64.b64decode(text, validate=True))
    if len(values) != count:
        raise ValueError("a symbol cache column of the wrong length")
    return values.tolist()


_KIND_CODES = {"func": "f", "object": "o", "other": "x"}
_KINDS = {code: kind for kind, code in _KIND_CODES.items()}


def _from_cache(raw: bytes | None, build_id: str) -> _Cached | None:
    """The symbols, sections and per-CPU offsets of a cache file, or None for one that is missing,
    outdated or not exactly what ``_cache_bytes`` writes (it is then rebuilt)."""
    if raw is None:
        return None
    try:
        data = json.loads(raw, parse_constant=_refuse_constant)
        if data["version"] != _CACHE_VERSION or data["build_id"] != build_id:
            return None
        names, count = data["names"], len(data["names"])
        if not (isinstance(names, list) and all(type(x) is str for x in names) and len(data["kinds"]) == count):
            return None
        kinds = [_KINDS[c] for c in data["kinds"]]
        syms = list(zip(names, _unpack(data["addrs"], count), _unpack(data["sizes"], count), kinds, strict=True))
        sections = [Section(n, a, s, o, x) for n, a, s, o, x in data["sections"]]
        percpu = dict(data["percpu"])
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return None
    good = all(
        type(x.name) is str and type(x.addr) is int and type(x.size) is int and type(x.offset) is int
        and type(x.executable) is bool for x in sections
    ) and all(type(k) is str and type(v) is int for k, v in percpu.items())  # fmt: skip
    return (syms, sections, percpu) if good else None
