"""Symbols built from (name, addr, size, kind) rows: lookups, resolve, containing/symbolize, the slide, the cache."""

from __future__ import annotations

import base64
import json
import os
import pickle
import stat
import struct
from pathlib import Path

import pytest

from qprobe.errors import SymbolError
from qprobe.kernel import symbols as symbols_mod
from qprobe.kernel.symbols import Symbol, Symbols
from qprobe.kernel.vmlinux import Section, elf_machine, read_build_id
from qprobe.paths import UnsafeCache

S = 0xFFFF_FFFF_8100_0000  # _text
D = 0xFFFF_FFFF_8200_0000  # _sdata
R = 0xFFFF_FFFF_8220_0000  # .rodata
SLIDE = 0x2E0_0000

ROWS: list[tuple[str, int, int, str]] = [
    ("_text", S, 0, "other"),
    ("_stext", S, 0, "other"),
    ("startup_64", S, 0x40, "func"),
    ("foo", S + 0x1000, 0x20, "func"),
    ("bar", S + 0x1040, 0x30, "func"),
    ("bar_alias", S + 0x1040, 0, "other"),  # a label at the same address
    ("__pfx_baz", S + 0x1080, 0, "func"),  # a sizeless function symbol
    ("baz", S + 0x1090, 0x10, "func"),
    ("cleanup", S + 0x3000, 0x10, "func"),  # the same static name twice
    ("cleanup", S + 0x2000, 0x18, "func"),
    ("cleanup_module.isra.0", S + 0x4000, 0x20, "func"),
    ("_etext", S + 0x10_0000, 0, "other"),
    ("jiffies", D, 8, "object"),
    ("_sdata", D, 0, "other"),
    ("init_task", D + 0x1000, 0x1000, "object"),
    ("linux_banner", R + 0x10, 0x60, "object"),
    ("absolute_zero", 0, 0, "other"),  # undefined/absolute: dropped
    ("_end", 0xFFFF_FFFF_8300_0000, 0, "other"),
]
SECTIONS = [
    Section(".text", S, 0x10_0000, 0x20_0000, True),
    Section(".init.text", 0xFFFF_FFFF_8280_0000, 0x1000, 0x30_0000, True),
    Section(".rodata", R, 0x100, 0x200, False),
    Section(".comment", 0, 0x40, 0x300, False),  # not allocated: no address
]


@pytest.fixture
def vmlinux(tmp_path: Path) -> Path:
    path = tmp_path / "vmlinux-test"
    data = bytearray(0x400)
    data[0x200:0x300] = bytes(range(256))
    path.write_bytes(bytes(data))
    return path


@pytest.fixture
def syms(vmlinux: Path) -> Symbols:
    return Symbols(vmlinux, "ab" * 20, list(ROWS), list(SECTIONS))


# -- lookup ------------------------------------------------------------------------------


def test_lookup(syms: Symbols) -> None:
    assert syms.lookup("foo") == Symbol("foo", S + 0x1000, 0x20, "func")
    assert syms.lookup("jiffies") == Symbol("jiffies", D, 8, "object")
    assert syms.address("_text") == S
    assert "foo" in syms and "nope" not in syms
    assert "absolute_zero" not in syms
    assert len(syms) == len(ROWS) - 1
    assert set(syms.names()) == {r[0] for r in ROWS} - {"absolute_zero"}


def test_duplicate_names_resolve_to_the_lowest_address(syms: Symbols) -> None:
    assert syms.address("cleanup") == S + 0x2000


def test_unknown_symbol(syms: Symbols) -> None:
    with pytest.raises(SymbolError, match="unknown symbol 'nope' in vmlinux-test") as info:
        syms.lookup("nope")
    assert "\n" not in str(info.value)


def test_slide_applies_everywhere(syms: Symbols) -> None:
    syms.slide = SLIDE
    assert syms.address("foo") == S + 0x1000 + SLIDE
    assert syms.lookup("foo").addr == S + 0x1000 + SLIDE
    assert syms.resolve("foo+0x4") == S + 0x1004 + SLIDE
    assert syms.containing(S + 0x1004 + SLIDE) == Symbol("foo", S + 0x1000 + SLIDE, 0x20, "func")
    assert syms.containing(S + 0x1004) is None or syms.containing(S + 0x1004).name != "foo"  # type: ignore[union-attr]
    assert syms.symbolize(S + 0x1044 + SLIDE) == "bar+0x4"
    assert [f.name for f in syms.functions_in(S + SLIDE, S + 0x1080 + SLIDE)] == ["startup_64", "foo", "bar"]
    assert syms.section_at(R + SLIDE) == SECTIONS[2]
    assert syms.section_at(R) is None or syms.section_at(R).name != ".rodata"  # type: ignore[union-attr]
    assert syms.is_text(S + 0x10 + SLIDE)


# -- resolve -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "addr"),
    [
        ("foo", S + 0x1000),
        ("foo+0x10", S + 0x1010),
        ("foo+16", S + 0x1010),
        ("foo + 0x10", S + 0x1010),
        ("  foo+0x10  ", S + 0x1010),
        ("foo-0x8", S + 0xFF8),
        ("foo+0", S + 0x1000),
        ("cleanup_module.isra.0+4", S + 0x4004),
        ("_text", S),
        ("0xffffffff81001234", 0xFFFF_FFFF_8100_1234),
        ("0XFFFFFFFF81001234", 0xFFFF_FFFF_8100_1234),
        ("4096", 4096),
    ],
)
def test_resolve(syms: Symbols, expr: str, addr: int) -> None:
    assert syms.resolve(expr) == addr


@pytest.mark.parametrize(
    ("expr", "words"),
    [
        ("nope+0x10", "unknown symbol 'nope'"),
        ("foo+", "cannot parse 'foo\\+'"),
        ("foo+0xzz", "cannot parse"),
        ("foo+bar", "cannot parse"),
        ("", "cannot parse"),
        ("0x", "cannot parse"),
    ],
)
def test_resolve_errors(syms: Symbols, expr: str, words: str) -> None:
    with pytest.raises(SymbolError, match=words) as info:
        syms.resolve(expr)
    assert "\n" not in str(info.value)


# -- containing / function / symbolize --------------------------------------------------------

CONTAINING = [
    # (address, symbol name or None, symbolize text)
    (S, "startup_64", "startup_64+0x0"),  # a sized function beats the size-0 aliases at its address
    (S + 0x3F, "startup_64", "startup_64+0x3f"),
    (S + 0x1000, "foo", "foo+0x0"),
    (S + 0x101F, "foo", "foo+0x1f"),
    (S + 0x1040, "bar", "bar+0x0"),  # not the label at the same address
    (S + 0x106F, "bar", "bar+0x2f"),
    (S + 0x1084, "__pfx_baz", "__pfx_baz+0x4"),  # size 0: the nearest below
    (S + 0x1090, "baz", "baz+0x0"),
    (S + 0x2010, "cleanup", "cleanup+0x10"),
    (S + 0x3000, "cleanup", "cleanup+0x0"),
    (D, "jiffies", "jiffies+0x0"),
    (D + 7, "jiffies", "jiffies+0x7"),
    (D + 0x1FFF, "init_task", "init_task+0xfff"),
    (S - 1, None, "0xffffffff80ffffff"),  # below every symbol
]


@pytest.mark.parametrize(("addr", "name", "text"), CONTAINING)
def test_containing_and_symbolize(syms: Symbols, addr: int, name: str | None, text: str) -> None:
    sym = syms.containing(addr)
    assert (sym.name if sym else None) == name
    if sym is not None and sym.size:
        assert sym.addr <= addr < sym.addr + sym.size
    assert syms.symbolize(addr) == text


@pytest.mark.parametrize(
    ("addr", "name"),
    [
        (S + 0x10, "startup_64"),
        (S + 0x1045, "bar"),
        (S + 0x1084, None),  # a sizeless function is not a function we can decode
        (D, None),  # an object
        (S - 1, None),
    ],
)
def test_function(syms: Symbols, addr: int, name: str | None) -> None:
    fn = syms.function(addr)
    assert (fn.name if fn else None) == name
    if fn is not None:
        assert fn.kind == "func" and fn.size


@pytest.mark.parametrize("addr", [S + 0x1030, S + 0x1028, S + 0x103F], ids=["foo+0x30", "foo+0x28", "foo+0x3f"])
def test_gap_after_a_function_is_not_a_far_away_symbol(syms: Symbols, addr: int) -> None:
    # S+0x1030 is padding after foo (ends S+0x1020) and before bar (S+0x1040).
    # While nothing is found, the backwards walk keeps going past every sized
    # symbol until it meets one of size 0, so this prints "_text+0x1030":
    # neither "not in a symbol" nor kallsyms' "foo+0x30".
    sym = syms.containing(addr)
    assert sym is None or sym.name == "foo"
    assert not syms.symbolize(addr).startswith(("_text", "_stext"))


def test_functions_in(syms: Symbols) -> None:
    names = [f.name for f in syms.functions_in(S, S + 0x2000)]
    assert names == ["startup_64", "foo", "bar", "__pfx_baz", "baz"]
    assert [f.name for f in syms.functions_in(S + 0x1000, S + 0x1041)] == ["foo", "bar"]
    assert syms.functions_in(D, D + 0x2000) == []  # objects only


# -- sections and file bytes --------------------------------------------------------------------


def test_sections(syms: Symbols) -> None:
    assert syms.section(".rodata") == SECTIONS[2]
    assert syms.section(".nope") is None
    assert syms.section_at(R + 0xFF) == SECTIONS[2]
    assert syms.section_at(R + 0x100) is None
    assert syms.section_at(0x10) is None  # .comment has no address


@pytest.mark.parametrize(
    ("addr", "text"),
    [(S, True), (S + 0xF_FFFF, True), (S + 0x10_0000, False), (0xFFFF_FFFF_8280_0000, False), (R, False), (D, False)],
)
def test_is_text(syms: Symbols, addr: int, text: bool) -> None:
    assert syms.is_text(addr) is text


def test_file_bytes(syms: Symbols) -> None:
    assert syms.file_bytes(R, 4) == b"\x00\x01\x02\x03"
    assert syms.file_bytes(syms.address("linux_banner"), 2) == b"\x10\x11"
    assert syms.file_bytes(R + 0xFC, 4) == b"\xfc\xfd\xfe\xff"
    syms.slide = SLIDE
    assert syms.file_bytes(R + 0x20 + SLIDE, 2) == b"\x20\x21"


@pytest.mark.parametrize("addr_size", [(R + 0xFE, 4), (R - 1, 1), (D, 1)])
def test_file_bytes_outside_a_section(syms: Symbols, addr_size: tuple[int, int]) -> None:
    with pytest.raises(SymbolError, match="is not in a section of vmlinux-test"):
        syms.file_bytes(*addr_size)


def test_percpu_offsets_do_not_slide(vmlinux: Path) -> None:
    syms = Symbols(vmlinux, "ab" * 20, list(ROWS), list(SECTIONS), {"runqueues": 0x2E000})
    syms.slide = SLIDE
    assert syms.percpu == {"runqueues": 0x2E000}
    assert Symbols(vmlinux, "ab" * 20, list(ROWS), list(SECTIONS)).percpu == {}


def test_exception_table(tmp_path: Path) -> None:
    # struct exception_table_entry { s32 insn, fixup, data; }, each relative to its own field.
    x = 0xFFFF_FFFF_8260_0000
    targets = [S + 0x1010, S + 0x4008]
    raw = b"".join(struct.pack("<iii", t - (x + 12 * i), 0x100, 0) for i, t in enumerate(targets)) + b"\xff" * 5
    path = tmp_path / "vmlinux"
    path.write_bytes(bytes(0x100) + raw)
    table = Section("__ex_table", x, len(raw), 0x100, False)
    syms = Symbols(path, "ab" * 20, list(ROWS), [*SECTIONS, table])
    assert syms.exception_table() == frozenset(targets)
    syms.slide = SLIDE
    assert syms.exception_table() == frozenset(t + SLIDE for t in targets)
    assert Symbols(path, "ab" * 20, list(ROWS), list(SECTIONS)).exception_table() == frozenset()


# -- build-id and the cache ------------------------------------------------------------------------


def note(name: bytes, ntype: int, desc: bytes) -> bytes:
    n = name + b"\0"
    pad = lambda b: b + bytes(-len(b) % 4)  # noqa: E731
    return struct.pack("<III", len(n), len(desc), ntype) + pad(n) + pad(desc)


def elf(note_sections: list[bytes], machine: int = 62, elf_class: int = 2) -> bytes:
    """A minimal ELF64 with a NULL section, a PROGBITS section and the given SHT_NOTE sections."""
    body = bytearray(b"\x90" * 16)  # .text at 64
    shdrs = [struct.pack("<IIQQQQIIQQ", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
             struct.pack("<IIQQQQIIQQ", 0, 1, 6, S, 64, 16, 0, 0, 16, 0)]  # fmt: skip
    for data in note_sections:
        shdrs.append(struct.pack("<IIQQQQIIQQ", 0, 7, 2, 0, 64 + len(body), len(data), 0, 0, 4, 0))
        body += data
    shoff = 64 + len(body)
    ident = b"\x7fELF" + bytes((elf_class, 1, 1)) + bytes(9)
    ehdr = struct.pack("<16sHHIQQQIHHHHHH", ident, 2, machine, 1, S, 0, shoff, 0, 64, 0, 0, 64, len(shdrs), 0)
    return ehdr + bytes(body) + b"".join(shdrs)


BUILD_ID = bytes.fromhex("0123456789abcdef0123456789abcdef01234567")


@pytest.mark.parametrize(
    "sections",
    [
        [note(b"GNU", 3, BUILD_ID)],
        [note(b"Xen", 3, b"\x01\x02\x03\x04\x05") + note(b"GNU", 1, bytes(16)) + note(b"GNU", 3, BUILD_ID)],
        [note(b"Linux", 6, b"6.1"), note(b"GNU", 3, BUILD_ID)],
    ],
    ids=["one", "after-others", "second-section"],
)
def test_read_build_id(tmp_path: Path, sections: list[bytes]) -> None:
    path = tmp_path / "vmlinux"
    path.write_bytes(elf(sections))
    assert read_build_id(path) == BUILD_ID.hex()


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"not an elf file at all, but long enough to have a header" + bytes(16), "not a 64-bit little-endian ELF"),
        (elf([note(b"GNU", 3, BUILD_ID)], elf_class=1), "not a 64-bit little-endian ELF"),
        (elf([]), "no build-id note"),
        (elf([note(b"GNU", 1, bytes(16))]), "no build-id note"),
    ],
    ids=["not-elf", "elf32", "no-notes", "no-build-id"],
)
def test_read_build_id_errors(tmp_path: Path, data: bytes, words: str) -> None:
    path = tmp_path / "vmlinux"
    path.write_bytes(data)
    with pytest.raises(SymbolError, match=words):
        read_build_id(path)


@pytest.mark.parametrize("cut", [5, 40, -40])
def test_truncated_vmlinux_is_a_symbol_error(tmp_path: Path, cut: int) -> None:
    # An interrupted download: the ELF header, or the note's section header (the last bytes), is cut short.
    path = tmp_path / "vmlinux"
    path.write_bytes(elf([note(b"GNU", 3, BUILD_ID)])[:cut])
    with pytest.raises(SymbolError):
        read_build_id(path)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("QPROBE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_load_missing_file(cache: Path, tmp_path: Path) -> None:
    with pytest.raises(SymbolError, match="does not exist"):
        Symbols.load(tmp_path / "nope")


def test_load_parses_once_then_uses_the_cache(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "vmlinux"
    path.write_bytes(elf([note(b"GNU", 3, BUILD_ID)]))
    parses: list[Path] = []

    def parse(p: Path, system_map: object = None) -> tuple[list[tuple[str, int, int, str]], list[Section], dict]:
        parses.append(p)
        return list(ROWS), list(SECTIONS), {"runqueues": 0x2E000}

    monkeypatch.setattr(symbols_mod, "parse_with_lief", parse)
    first = Symbols.load(path)
    assert first.build_id == BUILD_ID.hex() and first.address("foo") == S + 0x1000
    assert first.percpu == {"runqueues": 0x2E000}
    cached = cache / "symbols" / f"{BUILD_ID.hex()}.json"
    assert stat.S_IMODE(cached.stat().st_mode) == 0o600
    assert sorted(os.listdir(cached.parent)) == [cached.name]  # no .tmp left
    moved = tmp_path / "vmlinux-copy"
    moved.write_bytes(path.read_bytes())
    second = Symbols.load(str(moved))
    assert parses == [path]
    assert second.path == moved and second.address("bar") == S + 0x1040 and second.slide == 0
    assert second.percpu == {"runqueues": 0x2E000}


class RunsCode:
    """Unpickling this runs code: what a planted pickle cache would have done."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("touch ran-code",))


def _good_cache() -> dict[str, object]:
    syms = Symbols(Path("v"), BUILD_ID.hex(), list(ROWS), list(SECTIONS), {})
    return json.loads(syms._cache_bytes())


def _bad_caches() -> dict[str, bytes]:
    def changed(**values: object) -> bytes:
        return json.dumps({**_good_cache(), **values}).encode()

    return {
        "garbage": b"garbage",
        "pickle": pickle.dumps(RunsCode()),
        "old version": changed(version=3),
        "other build": changed(build_id="00" * 20),
        "not an object": b"[1, 2]",
        "Infinity": _good_cache_text().replace('"percpu":{}', '"percpu":{"x":Infinity}').encode(),
        "short column": changed(addrs=base64.b64encode(b"\0" * 8).decode()),
        "name not a string": changed(names=[1] * len(_good_cache()["names"])),  # type: ignore[arg-type]
        "unknown kind": changed(kinds="?" * len(_good_cache()["kinds"])),  # type: ignore[arg-type]
        "section shape": changed(sections=[["x", "0x10", 1, 2, True]]),
        "deep nesting": b"[" * 100_000,
    }


def _good_cache_text() -> str:
    return json.dumps(_good_cache(), separators=(",", ":"))


@pytest.mark.parametrize("name", list(_bad_caches()))
def test_load_rebuilds_a_bad_cache_and_never_runs_it(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     name: str) -> None:  # fmt: skip
    path = tmp_path / "vmlinux"
    path.write_bytes(elf([note(b"GNU", 3, BUILD_ID)]))
    (cache / "symbols").mkdir(parents=True)
    cached = cache / "symbols" / f"{BUILD_ID.hex()}.json"
    cached.write_bytes(_bad_caches()[name])
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(symbols_mod, "parse_with_lief", lambda p, system_map=None: (list(ROWS), list(SECTIONS), {}))
    assert Symbols.load(path).address("foo") == S + 0x1000
    assert not (tmp_path / "ran-code").exists()
    assert json.loads(cached.read_bytes()) == _good_cache()


def test_a_cached_table_is_the_parsed_one(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "vmlinux"
    path.write_bytes(elf([note(b"GNU", 3, BUILD_ID)]))
    percpu = {"runqueues": 0x2E000}
    monkeypatch.setattr(symbols_mod, "parse_with_lief", lambda p, system_map=None: (list(ROWS), list(SECTIONS), percpu))
    parsed = Symbols.load(path)
    cached = Symbols.load(path)
    assert cached._rows == parsed._rows and cached.sections == parsed.sections and cached.percpu == parsed.percpu


def test_a_symlink_planted_as_the_cache_file_is_refused(cache: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    path = tmp_path / "vmlinux"
    path.write_bytes(elf([note(b"GNU", 3, BUILD_ID)]))
    victim = tmp_path / "victim"
    victim.write_text("the user's file")
    (cache / "symbols").mkdir(parents=True)
    (cache / "symbols" / f"{BUILD_ID.hex()}.json").symlink_to(victim)
    monkeypatch.setattr(symbols_mod, "parse_with_lief", lambda p, system_map=None: (list(ROWS), list(SECTIONS), {}))
    with pytest.raises(UnsafeCache, match="symbolic link"):
        Symbols.load(path)
    assert victim.read_text() == "the user's file"


@pytest.mark.parametrize("machine", [62, 183])
def test_elf_machine(tmp_path: Path, machine: int) -> None:
    path = tmp_path / "vmlinux"
    path.write_bytes(elf([note(b"GNU", 3, BUILD_ID)], machine=machine))
    assert elf_machine(path) == machine


def test_elf_machine_of_no_elf_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "vmlinux"
    path.write_bytes(b"MZ")
    with pytest.raises(SymbolError, match="not a 64-bit little-endian ELF"):
        elf_machine(path)
