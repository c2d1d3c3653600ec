"""A loaded module's text and symbols beside vmlinux's: lookups, MOD:SYM, ftrace and reserved sites."""

from __future__ import annotations

from pathlib import Path

import pytest

from qprobe.arch.x86_64.arch import X86_64
from qprobe.errors import SymbolError
from qprobe.fetch import parse_event
from qprobe.kernel.modules import ModuleText
from qprobe.kernel.reserved import ReservedText
from qprobe.kernel.symbols import Symbol, Symbols
from qprobe.kernel.vmlinux import Section

S = 0xFFFF_FFFF_8100_0000
M = 0xFFFF_FFFF_C03B_B000  # where the module area starts on x86_64, as a loaded module sits

MOD = ModuleText(
    name="binfmt_misc",
    struct_addr=0xFFFF_FFFF_C03C_0000,
    text=((M, M + 0x2000),),
    symbols=(
        Symbol("bm_entry_read", M, 0x40, "func"),
        Symbol("bm_status_read", M + 0xD0, 0x60, "func"),
        Symbol("cleanup", M + 0x200, 0x10, "func"),
        Symbol("bm_status_read.cold", M + 0x1247, 0x10, "func"),
        Symbol("bm_fs_type", M + 0x3000, 0x40, "object"),
    ),
    ftrace_sites=(M, M + 0xD0),
    extable=frozenset({M + 0x110}),
    jump_labels=(M + 0x120,),
    static_calls=(M + 0x140,),
    bugs=frozenset({M + 0x150}),
)


@pytest.fixture
def syms(tmp_path: Path) -> Symbols:
    path = tmp_path / "vmlinux-test"
    path.write_bytes(bytes(0x400))
    rows = [("_text", S, 0, "other"), ("foo", S + 0x10, 0x20, "func"), ("cleanup", S + 0x40, 0x10, "func"),
            ("_etext", S + 0x1000, 0, "other"), ("_end", S + 0x20_0000, 0, "other")]  # fmt: skip
    table = Symbols(path, "ab" * 20, rows, [Section(".text", S, 0x1000, 0x0, True)])
    table.add_module(MOD)
    return table


def test_module_symbols_by_name(syms: Symbols) -> None:
    assert syms.address("binfmt_misc:bm_status_read") == M + 0xD0
    assert syms.address("bm_status_read") == M + 0xD0  # kallsyms_lookup_name searches modules after vmlinux
    assert syms.address("cleanup") == S + 0x40  # ... vmlinux first
    assert "binfmt_misc:nosuch" not in syms and "binfmt_misc:bm_entry_read" in syms
    with pytest.raises(SymbolError, match="module ext4 is not loaded"):
        syms.lookup("ext4:ext4_file_open")


def test_counting_names_as_validate_probe_symbol(syms: Symbols) -> None:
    assert syms.count("binfmt_misc:bm_status_read") == 1
    assert syms.count("binfmt_misc:nosuch") == 0
    assert syms.count("ext4:ext4_file_open") == 1  # not loaded yet: deferred
    assert syms.count("cleanup") == 2  # one in vmlinux, one in the module


def test_module_addresses(syms: Symbols) -> None:
    assert syms.containing(M + 0xD5) == Symbol("bm_status_read", M + 0xD0, 0x60, "func")
    assert syms.function(M + 0xD5) is not None
    assert syms.symbolize(M + 0xD5) == "bm_status_read+0x5"
    assert syms.is_text(M + 0xD5) and not syms.is_text(M + 0x3000)
    assert syms.module_of(M + 0xD5) is MOD and syms.module_of(S + 0x10) is None
    assert syms.kallsyms_size(syms.lookup("bm_status_read")) == 0x200 - 0xD0  # up to the next symbol
    assert M + 0x110 in syms.exception_table()


def test_fentry_sites_of_a_module_come_from_its_table(syms: Symbols) -> None:
    site = X86_64.ftrace_site
    assert site is not None
    assert syms.ftrace_site(M + 0xD0, site, S + 0x10)
    assert not syms.ftrace_site(M + 0xD5, site, S + 0x10)


def test_unloading_forgets_the_module(syms: Symbols) -> None:
    assert syms.remove_module("binfmt_misc") is MOD
    assert "bm_status_read" not in syms and syms.containing(M + 0xD5) is None
    assert not syms.is_text(M + 0xD5)


def test_reserved_sites_of_a_module(syms: Symbols) -> None:
    reserved = ReservedText(syms, lambda a, n: b"\x0f\x1f\x44\x00\x00"[:n], None, X86_64())
    assert reserved.conflict(M + 0x122, M + 0x122) == f"a jump label at {M + 0x120:#x}"
    assert reserved.conflict(M + 0x141, M + 0x141) == f"a static call at {M + 0x140:#x}"
    assert reserved.conflict(M + 0x150, M + 0x150) == "a BUG()/WARN() instruction"
    assert reserved.conflict(M + 0xD0, M + 0xD4) is None


def test_a_module_symbol_is_checked_at_registration() -> None:
    # validate_probe_symbol defers MOD:SYM while the module is not loaded: the definition parses.
    ev = parse_event("p:m binfmt_misc:bm_status_read", symbol_exists=lambda name: False, symbol_count=lambda n: 1)
    assert ev.symbol == "binfmt_misc:bm_status_read"


def test_init_text_is_the_module_s_while_it_is_coming(syms: Symbols) -> None:
    init = M + 0x8000
    coming = ModuleText("binfmt_misc", MOD.struct_addr, MOD.text, (*MOD.symbols, Symbol("init_fn", init, 0x20, "func")),
                        (*MOD.ftrace_sites, init), init_text=((init, init + 0x1000),))  # fmt: skip
    syms.add_module(coming)
    assert syms.is_text(init + 4) and syms.module_of(init) is coming and coming.is_init_text(init)
    assert syms.address("binfmt_misc:init_fn") == init and syms.symbolize(init + 4) == "init_fn+0x4"
    assert not coming.is_init_text(M + 0xD0) and coming.is_text(M + 0xD0)
    syms.add_module(MOD)  # LIVE: read again, without its init text and symbols
    assert not syms.is_text(init) and "binfmt_misc:init_fn" not in syms
