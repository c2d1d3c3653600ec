"""perf probe's language: parsing, gdb's location words -> fetch arguments, and the translation's rules."""

from __future__ import annotations

from typing import Any

import pytest

from qprobe.arch.x86_64.arch import X86_64
from qprobe.kernel.perfdwarf import Location, line_address, location_at, parse_line_table, parse_location, parse_scope
from qprobe.kernel.perfprobe import fetch_text, fetch_type, translate
from qprobe.kernel.perfsyntax import PerfProbeError, is_perf_definition, parse_perf_probe

# `info scope *0xffffffff8134ccf8` on Debian's 6.1.0-56-cloud-amd64 vmlinux (vfs_read+0xa8), abridged.
SCOPE = """Scope for *0xffffffff8134ccf8:
Symbol file is multi-location:
  Base address 0xffffffff8134cc50  Range 0xffffffff8134cc50-0xffffffff8134ccba: a variable in $rdi
  Range 0xffffffff8134ccba-0xffffffff8134ccbe: a variable in $rsi
  Range 0xffffffff8134ccbe-0xffffffff8134cd10: a variable in $rbp
  Range 0xffffffff8134cd17-0xffffffff8134cd41: a complex DWARF expression:
     0: DW_OP_entry_value
       2: DW_OP_reg5 [$rdi]
     3: DW_OP_stack_value

, length 8.
Symbol ret is multi-location:
  Base address 0xffffffff8134ccc2  Range 0xffffffff8134ccc2-0xffffffff8134ccfd: a variable in $rbx
  Range 0xffffffff8134cd41-0xffffffff8134cdc5: a variable in $rbx
, length 8.
Symbol op is a variable at frame base reg $rbp offset 16+-20, length 4.
Symbol gone is optimized out.
"""

LINE_TABLE = """symtab: debian/build/build_amd64_none_cloud-amd64/fs/read_write.c ((struct symtab *) 0x7f)
linetable: ((struct linetable *) 0x56):
INDEX  LINE   ADDRESS            IS-STMT PROLOGUE-END
1101   451    0xffffffff8134cc50 Y
1102   451    0xffffffff8134cc55
1126   468    0xffffffff8134ccf5
1127   473    0xffffffff8134ccf8 Y
1128   473    0xffffffff8134ccf8
1129   END    0xffffffff8134ccfd Y
1135   469    0xffffffff8134cda6
1136   469    0xffffffff8134cdaf Y
"""

PT_NAME = X86_64.registers.pt_name  # gdb's register names -> pt_regs names


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        ("perf vfs_read", {"function": "vfs_read"}),
        ("perf vfs_read:23", {"function": "vfs_read", "line": 23}),
        ("perf vfs_read+8", {"function": "vfs_read", "offset": 8}),
        ("perf vfs_read%return", {"function": "vfs_read", "is_return": True}),
        ("perf vfs_read@fs/read_write.c:3", {"function": "vfs_read", "file": "fs/read_write.c", "line": 3}),
        ("perf fs/read_write.c:473", {"file": "fs/read_write.c", "line": 473, "function": None}),
        ("perf vfs_read;ret*", {"function": "vfs_read", "lazy": "ret*"}),
        ("perf grp:ev=vfs_read", {"function": "vfs_read", "group": "grp", "event": "ev"}),
        ("perf ev=fs/read_write.c:473", {"file": "fs/read_write.c", "line": 473, "event": "ev", "group": None}),
    ],
)
def test_probe_points(text: str, expect: dict[str, Any]) -> None:
    probe = parse_perf_probe(text)
    for key, value in expect.items():
        assert getattr(probe, key) == value, key


def test_arguments_named_as_perf_names_them() -> None:
    args = parse_perf_probe("perf vfs_read count file->f_pos n=file->f_path.dentry a[2] c:u32 $retval").args
    assert [a.event_name for a in args] == ["count", "f_pos", "n", "a", "c_u32", "$retval"]
    assert args[1].fields == (("->", "f_pos"),)
    assert args[2].fields == (("->", "f_path"), (".", "dentry"))
    assert args[3].fields == (("[]", "2"),)
    assert args[4].type == "u32"
    assert not args[5].is_c_var


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("perf", "give a probe point"),
        ("perf vfs_read:x", "must be a number"),
        ("perf vfs_read:3+4", "an offset is for FUNC+OFFS"),
        ("perf vfs_read%entry", "unknown %entry"),
        ("perf vfs_read%return count", "a return probe fetches $retval"),
        ("perf vfs_read file-f_pos", "cannot parse"),
        ("perf fs/read_write.c:", "the line must be a number"),
        ("perf a-b=vfs_read", "not a valid event name"),
    ],
)
def test_syntax_errors(text: str, words: str) -> None:
    with pytest.raises(PerfProbeError) as exc:
        parse_perf_probe(text)
    assert words in str(exc.value)


def test_perf_is_marked_by_its_word() -> None:
    assert is_perf_definition("perf vfs_read count")
    assert not is_perf_definition("p:perf vfs_read")
    assert not is_perf_definition("performance")


def test_scope_locations_at_an_address() -> None:
    scope = parse_scope(SCOPE)
    assert location_at(scope["file"], 0xFFFFFFFF8134CCF8) == "a variable in $rbp"
    assert location_at(scope["ret"], 0xFFFFFFFF8134CCF8) == "a variable in $rbx"
    assert location_at(scope["ret"], 0xFFFFFFFF8134CCAC) is None  # not yet assigned: optimized out there
    assert "DW_OP_entry_value" in str(location_at(scope["file"], 0xFFFFFFFF8134CD20))
    assert scope["op"] == "a variable at frame base reg $rbp offset 16+-20"
    assert scope["gone"] == "optimized out"


@pytest.mark.parametrize(
    ("desc", "loc"),
    [
        ("a variable in $rdx", Location("%dx")),
        ("a variable in $r12", Location("%r12")),
        ("a variable at offset 16 from base reg $rsp", Location("%sp", 16)),
        ("a variable at frame base reg $rbp offset 16+-20", Location("%bp", -4)),
        ("static storage at address 0xffffffff82000000", Location("@jiffies", 0)),
    ],
)
def test_locations(desc: str, loc: Location) -> None:
    assert parse_location(desc, "jiffies" if "static" in desc else "v", PT_NAME) == loc


@pytest.mark.parametrize(
    ("desc", "words"),
    [
        ("optimized out", "v is optimized out"),
        ("a complex DWARF expression: 0: DW_OP_entry_value 2: DW_OP_reg1 [$rdx]", "computed here"),
        ("constant", "a constant"),
    ],
)
def test_unfetchable_locations(desc: str, words: str) -> None:
    with pytest.raises(PerfProbeError, match=words):
        parse_location(desc, "v", PT_NAME)


def test_fetch_text_as_perf_synthesizes_it() -> None:
    assert fetch_text(Location("%di"), [("deref", 104)], "file->f_pos") == "+104(%di)"
    assert fetch_text(Location("%bp", -4), [], "op") == "-4(%bp)"
    # file->f_path.dentry->d_name.name with file in %di: f_path+dentry add, d_name.name deref
    assert fetch_text(Location("%di"), [("deref", 16), ("add", 8), ("deref", 32), ("add", 8)], "x") == "+40(+24(%di))"
    assert fetch_text(Location("@jiffies", 0), [], "jiffies") == "+0(@jiffies)"
    with pytest.raises(PerfProbeError, match="structure in a register"):
        fetch_text(Location("%di"), [("add", 8)], "s.a")


def test_types_as_perf_chooses_them() -> None:
    ssize = {"kind": "scalar", "size": 8, "signed": True, "target": None}
    size = {"kind": "scalar", "size": 8, "signed": False, "target": None}
    ptr = {"kind": "pointer", "size": 8, "signed": False, "target": "char"}
    big = {"kind": "struct", "size": 208, "signed": False, "target": None}
    assert fetch_type(ssize, None, True, "ret") == ("s64", False)
    assert fetch_type(size, None, True, "count") == ("x64", False)
    assert fetch_type(size, None, False, "count") == ("u64", False)  # a kernel without x types
    assert fetch_type(size, "s", True, "count") == ("s64", False)
    assert fetch_type(size, "u16", True, "count") == ("u16", False)
    assert fetch_type(ptr, "string", True, "name") == ("string", True)
    assert fetch_type(big, None, True, "s") == ("x64", False)  # cut down to 64 bits, as perf does
    with pytest.raises(PerfProbeError, match="not a pointer nor array"):
        fetch_type(size, "string", True, "count")


def test_line_table() -> None:
    ((name, rows),) = parse_line_table(LINE_TABLE)
    assert name.endswith("fs/read_write.c")
    assert line_address(rows, 473) == 0xFFFFFFFF8134CCF8
    assert line_address(rows, 469) == 0xFFFFFFFF8134CDAF  # the is_stmt row, not the first row
    assert line_address(rows, 468) is None  # no is_stmt row
    assert line_address(rows, 473, 0, 0xFFFFFFFF8134CCF8) is None  # outside the function


class FakeDwarf:
    """The answers gdb gave for vfs_read on Debian's 6.1.0-56-cloud-amd64 vmlinux."""

    def function(self, name: str) -> dict[str, Any] | None:
        return {"file": "fs/read_write.c", "line": 450, "addr": 0xFFFFFFFF8134CC50} if name == "vfs_read" else None

    def symtab_files(self, spec: str) -> list[str]:
        return ["fs/read_write.c"]

    def line_table(self, file: str) -> list[tuple[int, int, bool]]:
        return parse_line_table(LINE_TABLE)[0][1]

    def scope(self, addr: int) -> str:
        return SCOPE

    def access(self, var: str, addr: int, fields: Any) -> dict[str, Any]:
        if var not in ("ret", "file", "gone"):
            return {"error": "notfound"}
        if var == "file" and fields:
            t = {"kind": "scalar", "size": 8, "signed": True, "target": None, "bitfield": 0}
            return {"steps": [["deref", 104]], "type": t, "global": False, "argument": True}
        t = {"kind": "scalar", "size": 8, "signed": var == "ret", "target": None, "bitfield": 0}
        return {"steps": [], "type": t, "global": False, "argument": var == "file"}


class FakeFunctions:
    def function_range(self, name: str) -> tuple[int, int] | None:
        return (0xFFFFFFFF8134CC50, 780) if name == "vfs_read" else None

    def function_at(self, addr: int) -> tuple[str, int] | None:
        return ("vfs_read", 0xFFFFFFFF8134CC50)


def _tr(text: str) -> str:
    return translate(parse_perf_probe(text), FakeDwarf(), FakeFunctions(), True, PT_NAME).definition


def test_translation() -> None:
    expect = "p:probe/vfs_read_L23 vfs_read+168 ret=%bx:s64 f_pos=+104(%bp):s64"
    assert _tr("perf vfs_read:23 ret file->f_pos") == expect
    assert _tr("perf fs/read_write.c:473 ret") == "p:probe/vfs_read vfs_read+168 ret=%bx:s64"
    assert _tr("perf rd=vfs_read file") == "p:probe/rd vfs_read file=%di:x64"
    assert _tr("perf vfs_read%return r=$retval") == "r:probe/vfs_read__return vfs_read r=$retval"


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("perf vfs_read:1 ret", "vfs_read:1: ret is optimized out here"),
        ("perf vfs_read:23 nosuch", "vfs_read:23: no variable nosuch here"),
        ("perf vfs_read:18 ret", "no code for line 468"),
        ("perf vfs_raed", "no function vfs_raed"),
        ("perf vfs_read;ret*", "source text"),
        ("perf vfs_read+900", "past the end"),
        ("perf vfs_read:23 gone", "vfs_read:23: gone is optimized out"),
    ],
)
def test_translation_errors(text: str, words: str) -> None:
    with pytest.raises(PerfProbeError, match=words.replace("+", r"\+")) as exc:
        _tr(text)
    assert "\n" not in str(exc.value)
