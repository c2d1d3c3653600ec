"""Code qprobe must never probe, as the kernel's kprobe blacklist plus our own needs.

The architecture's entry code (x86's .entry.text: the #BP entry and
everything the CPU runs before the host sees the trap, added by
``arch_populate_kprobe_blacklist``) would recurse; .noinstr.text runs where
instrumentation is unsafe; .kprobes.text and the ``_kprobe_blacklist``
entries (NOKPROBE_SYMBOL) are what the kernel itself refuses.  The entries
are read from vmlinux: ``_kprobe_blacklist`` is init data, freed after boot.
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from qprobe.kernel.symbols import Symbols

# What kernel/kprobes.c's populate_kprobe_blacklist() adds for every architecture.
_SECTIONS = (
    ("__noinstr_text_start", "__noinstr_text_end", ".noinstr.text"),
    ("__kprobes_text_start", "__kprobes_text_end", ".kprobes.text"),
    ("__irqentry_text_start", "__irqentry_text_end", ".irqentry.text"),
    ("__softirqentry_text_start", "__softirqentry_text_end", ".softirqentry.text"),
)


@dataclass(frozen=True)
class BlacklistEntry:
    start: int
    end: int
    name: str

    def __str__(self) -> str:
        # The debugfs kprobes/blacklist format: 0xSTART-0xEND\tSYMBOL
        return f"0x{self.start:016x}-0x{self.end:016x}\t{self.name}"


class Blacklist:
    def __init__(self, symbols: Symbols, arch_sections: Iterable[tuple[str, str, str]] = ()) -> None:
        """``arch_sections``: (start symbol, end symbol, name) of the architecture's own additions."""
        self.sections = [
            BlacklistEntry(symbols.address(start), symbols.address(end), name)
            for start, end, name in (*arch_sections, *_SECTIONS)
            if start in symbols and end in symbols
        ]
        entries: list[BlacklistEntry] = []
        lo, hi = symbols.address("__start_kprobe_blacklist"), symbols.address("__stop_kprobe_blacklist")
        raw = symbols.file_bytes(lo, hi - lo)
        for (link,) in struct.iter_unpack("<Q", raw):
            fn = symbols.function(link + symbols.slide)
            if fn is not None:
                entries.append(BlacklistEntry(fn.addr, fn.addr + fn.size, fn.name))
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
        return None

    def __iter__(self) -> Iterator[BlacklistEntry]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)
