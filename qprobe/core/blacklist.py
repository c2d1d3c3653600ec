"""Code qprobe must never probe, as the kernel's kprobe blacklist plus our own needs.

The architecture's entry code (added by ``arch_populate_kprobe_blacklist``:
the breakpoint entry and everything the CPU runs before the host sees the
trap) would recurse; .noinstr.text runs where instrumentation is unsafe;
.kprobes.text and the ``_kprobe_blacklist`` entries (NOKPROBE_SYMBOL) are
what the kernel itself refuses.  The entries are read from vmlinux:
``_kprobe_blacklist`` is init data, freed after boot.

A kernel built without CONFIG_KPROBES has no ``_kprobe_blacklist`` (the
NOKPROBE_SYMBOL macro expands to nothing) and an empty .kprobes.text.  The
refused set is then derived from what such a kernel still marks as not to be
instrumented: the entry, .noinstr.text and irq/softirq entry sections (the
breakpoint entry and its handlers live there), and the functions the
architecture names as ``thunks`` (return and indirect-branch thunks, which
every ``ret`` or indirect call of the trap path may run through).  Functions
that a CONFIG_KPROBES build of the same source would list by NOKPROBE_SYMBOL
cannot be known there and stay probeable.

On any kernel, ``__cfi_``/``__pfx_`` symbols are refused: the CFI preamble
or the padding NOPs before a function, never run as code (kernel commit
de02f2ac5d8c, v6.5: ``is_cfi_preamble_symbol`` in check_kprobe_address_safe).
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Iterator
from dataclasses import dataclass

from qprobe.arch import ArchBlacklist
from qprobe.kernel.symbols import Symbols

# What kernel/kprobes.c's populate_kprobe_blacklist() adds for every architecture.
_SECTIONS = (
    ("__noinstr_text_start", "__noinstr_text_end", ".noinstr.text"),
    ("__kprobes_text_start", "__kprobes_text_end", ".kprobes.text"),
    ("__irqentry_text_start", "__irqentry_text_end", ".irqentry.text"),
    ("__softirqentry_text_start", "__softirqentry_text_end", ".softirqentry.text"),
)

_PREAMBLE = ("__cfi_", "__pfx_")


@dataclass(frozen=True)
class BlacklistEntry:
    start: int
    end: int
    name: str

    def __str__(self) -> str:
        # The debugfs kprobes/blacklist format: 0xSTART-0xEND\tSYMBOL
        return f"0x{self.start:016x}-0x{self.end:016x}\t{self.name}"


def _listed(symbols: Symbols) -> list[BlacklistEntry]:
    """The functions of vmlinux's ``_kprobe_blacklist`` (NOKPROBE_SYMBOL), at their running addresses."""
    lo, hi = symbols.address("__start_kprobe_blacklist"), symbols.address("__stop_kprobe_blacklist")
    entries = []
    for (link,) in struct.iter_unpack("<Q", symbols.file_bytes(lo, hi - lo)):
        fn = symbols.function(link + symbols.slide)
        if fn is not None:
            entries.append(BlacklistEntry(fn.addr, fn.addr + fn.size, fn.name))
    return entries


def _derived(symbols: Symbols, arch: ArchBlacklist) -> list[BlacklistEntry]:
    """Without CONFIG_KPROBES: the functions the architecture names as thunks."""
    thunks = arch.thunks
    if thunks is None:
        return []
    entries = []
    for name in symbols.names():
        fn = symbols.lookup(name) if thunks.fullmatch(name) else None
        if fn is not None and symbols.is_text(fn.addr):
            # A size-0 label (assembler thunks often have one) covers up to the next symbol.
            size = fn.size or symbols.kallsyms_size(fn)
            entries.append(BlacklistEntry(fn.addr, fn.addr + size, fn.name))
    return entries


class Blacklist:
    def __init__(self, symbols: Symbols, arch: ArchBlacklist) -> None:
        """``arch``: the architecture's own additions (``arch_populate_kprobe_blacklist``)."""
        self._symbols = symbols
        self.sections = [
            BlacklistEntry(symbols.address(start), symbols.address(end), name)
            for start, end, name in (*arch.sections, *_SECTIONS)
            if start in symbols and end in symbols and symbols.address(end) > symbols.address(start)
        ]
        # CONFIG_KPROBES: the kernel's own list; without it, derived (see the module's docstring).
        self.derived = "__start_kprobe_blacklist" not in symbols
        entries = _derived(symbols, arch) if self.derived else _listed(symbols)
        # Function entries do not overlap one another, so a bisect finds the one.
        self.functions = sorted(set(entries), key=lambda e: e.start)
        self._starts = [e.start for e in self.functions]
        self.entries = self.functions + self.sections

    def lookup(self, addr: int) -> BlacklistEntry | None:
        for e in self.sections:
            if e.start <= addr < e.end:
                return e
        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0 and self.functions[i].start <= addr < self.functions[i].end:
            return self.functions[i]
        sym = self._symbols.containing(addr)
        if sym is not None and sym.name.startswith(_PREAMBLE):
            return BlacklistEntry(sym.addr, sym.addr + (sym.size or self._symbols.kallsyms_size(sym)), sym.name)
        return None

    def __iter__(self) -> Iterator[BlacklistEntry]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)
