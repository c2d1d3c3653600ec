"""The kprobe blacklist: text sections plus _kprobe_blacklist entries, with the KASLR slide."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from qprobe.arch import ArchBlacklist
from qprobe.arch.x86_64.arch import X86_64
from qprobe.core.blacklist import Blacklist, BlacklistEntry
from qprobe.errors import SymbolError
from qprobe.kernel.symbols import Symbol, Symbols
from qprobe.kernel.vmlinux import Section

ARCH = X86_64().arch_populate_kprobe_blacklist()

SLIDE = 0x1E0_0000
T = 0xFFFF_FFFF_8100_0000  # link-time text base

# Link-time addresses, as vmlinux has them.
LINK_SYMBOLS = {
    "__entry_text_start": T + 0xC0_0000,
    "__entry_text_end": T + 0xC0_3000,
    "__noinstr_text_start": T + 0xB0_0000,
    "__noinstr_text_end": T + 0xB0_8000,
    "__kprobes_text_start": T + 0xA0_0000,
    "__kprobes_text_end": T + 0xA0_1000,
    "__softirqentry_text_start": T + 0xD0_0000,  # no end symbol: not a section entry
    "__start_kprobe_blacklist": 0xFFFF_FFFF_8300_0000,
    "__stop_kprobe_blacklist": 0xFFFF_FFFF_8300_0030,
}
# Link-time functions: name -> (start, size).
FUNCS = {
    "notify_die": (T + 0x10_0000, 0x80),
    "do_int3": (T + 0x02_0000, 0x140),
    "kprobe_handler": (T + 0x05_0000, 0x200),
    "exc_int3_helper": (T + 0xC0_1000, 0x40),  # inside .entry.text
}
BLACKLIST_LINK = [
    FUNCS["notify_die"][0],
    FUNCS["do_int3"][0],
    FUNCS["notify_die"][0],  # NOKPROBE_SYMBOL twice: one entry
    FUNCS["kprobe_handler"][0],
    FUNCS["exc_int3_helper"][0],
    T + 0x90_0000,  # no function there (an asm label): skipped
]


class FakeSymbols:
    """The parts of Symbols that Blacklist uses, in running addresses."""

    def __init__(self, slide: int = SLIDE, names: dict[str, int] | None = None) -> None:
        self.slide = slide
        self.names = dict(LINK_SYMBOLS if names is None else names)
        self.calls: list[int] = []

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def address(self, name: str) -> int:
        if name not in self.names:
            raise SymbolError(f"unknown symbol {name!r}")
        return self.names[name] + self.slide

    def file_bytes(self, addr: int, size: int) -> bytes:
        assert addr == self.address("__start_kprobe_blacklist")
        return struct.pack(f"<{len(BLACKLIST_LINK)}Q", *BLACKLIST_LINK)[:size]

    def function(self, addr: int) -> Symbol | None:
        self.calls.append(addr)
        for name, (start, size) in FUNCS.items():
            if start + self.slide <= addr < start + self.slide + size:
                return Symbol(name, start + self.slide, size, "func")
        return None

    def containing(self, addr: int) -> Symbol | None:
        return next(
            (Symbol(n, a + self.slide, sz, "func") for n, (a, sz) in FUNCS.items() if 0 <= addr - a - self.slide < sz),
            None,
        )


def running(name: str) -> tuple[int, int]:
    start, size = FUNCS[name]
    return start + SLIDE, start + SLIDE + size


@pytest.fixture
def blacklist() -> Blacklist:
    return Blacklist(FakeSymbols(), ARCH)  # type: ignore[arg-type]


def test_sections(blacklist: Blacklist) -> None:
    assert blacklist.sections == [
        BlacklistEntry(T + 0xC0_0000 + SLIDE, T + 0xC0_3000 + SLIDE, ".entry.text"),
        BlacklistEntry(T + 0xB0_0000 + SLIDE, T + 0xB0_8000 + SLIDE, ".noinstr.text"),
        BlacklistEntry(T + 0xA0_0000 + SLIDE, T + 0xA0_1000 + SLIDE, ".kprobes.text"),
    ]


def test_functions_are_deduplicated_sorted_and_slid() -> None:
    syms = FakeSymbols()
    bl = Blacklist(syms, ARCH)  # type: ignore[arg-type]
    assert [(e.name, e.start, e.end) for e in bl.functions] == [
        ("do_int3", *running("do_int3")),
        ("kprobe_handler", *running("kprobe_handler")),
        ("notify_die", *running("notify_die")),
        ("exc_int3_helper", *running("exc_int3_helper")),
    ]
    # Entries are link addresses: each is looked up at link + slide.
    assert syms.calls == [a + SLIDE for a in BLACKLIST_LINK]
    assert len(bl) == 4 + 3
    assert list(bl) == bl.functions + bl.sections


LOOKUPS = [
    ("do_int3 start", running("do_int3")[0], "do_int3"),
    ("do_int3 last byte", running("do_int3")[1] - 1, "do_int3"),
    ("do_int3 end", running("do_int3")[1], None),
    ("before everything", T + SLIDE, None),
    ("notify_die middle", running("notify_die")[0] + 0x40, "notify_die"),
    ("link address, not running", FUNCS["notify_die"][0], None),
    ("entry text", T + 0xC0_0000 + SLIDE, ".entry.text"),
    ("entry text end", T + 0xC0_3000 + SLIDE, None),
    ("function in entry text", running("exc_int3_helper")[0], ".entry.text"),  # sections first
    ("noinstr last byte", T + 0xB0_8000 + SLIDE - 1, ".noinstr.text"),
    ("kprobes text", T + 0xA0_0800 + SLIDE, ".kprobes.text"),
    ("softirq text (no end symbol)", T + 0xD0_0010 + SLIDE, None),
    ("unresolvable entry", T + 0x90_0000 + SLIDE, None),
    ("far above", 0xFFFF_FFFF_FFFF_F000, None),
]


@pytest.mark.parametrize(("addr", "name"), [c[1:] for c in LOOKUPS], ids=[c[0] for c in LOOKUPS])
def test_lookup(blacklist: Blacklist, addr: int, name: str | None) -> None:
    entry = blacklist.lookup(addr)
    assert (entry.name if entry else None) == name


def test_debugfs_format() -> None:
    e = BlacklistEntry(0xFFFF_FFFF_8102_0000, 0xFFFF_FFFF_8102_0140, "do_int3")
    assert str(e) == "0xffffffff81020000-0xffffffff81020140\tdo_int3"


def test_no_slide() -> None:
    bl = Blacklist(FakeSymbols(slide=0), ARCH)  # type: ignore[arg-type]
    assert bl.lookup(FUNCS["notify_die"][0]) is not None
    assert bl.lookup(FUNCS["notify_die"][0] + SLIDE) is None


def test_empty_blacklist_array() -> None:
    names = {**LINK_SYMBOLS, "__stop_kprobe_blacklist": LINK_SYMBOLS["__start_kprobe_blacklist"]}
    bl = Blacklist(FakeSymbols(names=names), ARCH)  # type: ignore[arg-type]
    assert bl.functions == [] and len(bl) == 3
    assert bl.lookup(running("do_int3")[0]) is None


def test_with_real_symbols(tmp_path: Path) -> None:
    # The same through Symbols, with _kprobe_blacklist read from a file section.
    data = struct.pack(f"<{len(BLACKLIST_LINK)}Q", *BLACKLIST_LINK)
    vmlinux = tmp_path / "vmlinux"
    vmlinux.write_bytes(b"\0" * 0x100 + data)
    rows = [(n, a, 0, "other") for n, a in LINK_SYMBOLS.items()]
    rows += [(n, a, s, "func") for n, (a, s) in FUNCS.items()]
    sections = [
        Section(".text", T, 0x100_0000, 0x1000, True),
        Section(".init.data", 0xFFFF_FFFF_8300_0000, len(data), 0x100, False),
    ]
    syms = Symbols(vmlinux, "00" * 20, rows, sections)
    syms.slide = SLIDE
    bl = Blacklist(syms, ARCH)
    assert [e.name for e in bl.functions] == ["do_int3", "kprobe_handler", "notify_die", "exc_int3_helper"]
    hit = bl.lookup(running("kprobe_handler")[0] + 1)
    assert hit is not None and hit.name == "kprobe_handler"
    assert [e.name for e in bl.sections] == [".entry.text", ".noinstr.text", ".kprobes.text"]


def test_without_config_kprobes_the_set_is_derived(tmp_path: Path) -> None:
    # No _kprobe_blacklist (NOKPROBE_SYMBOL is empty without CONFIG_KPROBES), an empty .kprobes.text:
    # the entry/noinstr sections and the thunks are refused, other functions are not.
    link = {k: v for k, v in LINK_SYMBOLS.items() if "kprobe_blacklist" not in k}
    link["__kprobes_text_end"] = link["__kprobes_text_start"]
    funcs = {
        "vfs_read": (T + 0x20_0000, 0x100),
        "__x86_return_thunk": (T + 0x30_0000, 0),  # an assembler label: up to the next symbol
        "__x86_indirect_thunk_rax": (T + 0x30_0020, 0x20),
        "srso_alias_untrain_ret": (T + 0x30_0040, 0x10),
        "preempt_schedule_thunk": (T + 0x30_0060, 0x20),
        "is_callthunk": (T + 0x30_0100, 0x40),  # a C helper, probeable
        "next": (T + 0x30_0200, 0x10),
    }
    rows = [(n, a, 0, "other") for n, a in link.items()] + [(n, a, sz, "func") for n, (a, sz) in funcs.items()]
    rows.append(("retbleed_strings", 0xFFFF_FFFF_8200_0000, 0x40, "object"))  # data: never a probe point
    sections = [
        Section(".text", T, 0x100_0000, 0x1000, True),
        Section(".rodata", 0xFFFF_FFFF_8200_0000, 0x1000, 0x2000, False),
    ]
    (tmp_path / "vmlinux").write_bytes(b"\0" * 0x3000)
    syms = Symbols(tmp_path / "vmlinux", "00" * 20, rows, sections)
    syms.slide = SLIDE
    bl = Blacklist(syms, ARCH)
    assert bl.derived
    assert [e.name for e in bl.sections] == [".entry.text", ".noinstr.text"]
    assert [(e.name, e.end - e.start) for e in bl.functions] == [
        ("__x86_return_thunk", 0x20),
        ("__x86_indirect_thunk_rax", 0x20),
        ("srso_alias_untrain_ret", 0x10),
        ("preempt_schedule_thunk", 0x20),
    ]
    assert bl.lookup(T + 0x30_0010 + SLIDE).name == "__x86_return_thunk"  # type: ignore[union-attr]
    assert bl.lookup(T + 0x30_0100 + SLIDE) is None and bl.lookup(T + 0x20_0000 + SLIDE) is None
    assert not Blacklist(FakeSymbols(), ARCH).derived  # type: ignore[arg-type]
    # The thunks are the architecture's to name: with none named, no function is refused by name.
    assert Blacklist(syms, ArchBlacklist(ARCH.sections)).functions == []


def test_cfi_preamble_and_padding_are_refused(tmp_path: Path) -> None:
    # __pfx_/__cfi_ symbols are the NOPs or the CFI hash before a function (is_cfi_preamble_symbol).
    rows = [(n, a, 0, "other") for n, a in LINK_SYMBOLS.items()]
    rows += [("__pfx_vfs_read", T + 0x1F_FFF0, 0x10, "func"), ("vfs_read", T + 0x20_0000, 0x100, "func")]
    rows += [("__cfi_vfs_write", T + 0x20_0100, 0x10, "func"), ("vfs_write", T + 0x20_0110, 0x100, "func")]
    data = struct.pack(f"<{len(BLACKLIST_LINK)}Q", *BLACKLIST_LINK)
    (tmp_path / "vmlinux").write_bytes(b"\0" * 0x100 + data)
    sections = [
        Section(".text", T, 0x100_0000, 0x1000, True),
        Section(".init.data", 0xFFFF_FFFF_8300_0000, len(data), 0x100, False),
    ]
    syms = Symbols(tmp_path / "vmlinux", "00" * 20, rows, sections)
    syms.slide = SLIDE
    bl = Blacklist(syms, ARCH)
    assert bl.lookup(T + 0x1F_FFF8 + SLIDE).name == "__pfx_vfs_read"  # type: ignore[union-attr]
    assert bl.lookup(T + 0x20_0100 + SLIDE).name == "__cfi_vfs_write"  # type: ignore[union-attr]
    assert bl.lookup(T + 0x20_0000 + SLIDE) is None and bl.lookup(T + 0x20_0110 + SLIDE) is None
    assert "__pfx_vfs_read" not in [e.name for e in bl]  # not listed, as debugfs does not list them
