"""BTF parsing: synthetic blobs for every kind and every malformation, then a real vmlinux.

The synthetic blobs come from a tiny encoder below, so each record size and
flag is stated here independently of the parser's own tables: if the parser
mis-sized any kind, every later type id would shift and the marker checks
would fail.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from qprobe.errors import SymbolError
from qprobe.kernel.btf import Btf

# BTF_KIND_* from include/uapi/linux/btf.h, spelled out again on purpose.
INT, PTR, ARRAY, STRUCT, UNION, ENUM, FWD, TYPEDEF = 1, 2, 3, 4, 5, 6, 7, 8
VOLATILE, CONST, RESTRICT, FUNC, FUNC_PROTO, VAR, DATASEC = 9, 10, 11, 12, 13, 14, 15
FLOAT, DECL_TAG, TYPE_TAG, ENUM64 = 16, 17, 18, 19
INT_SIGNED = 1 << 24


class BtfBuilder:
    """Encodes BTF records the way pahole does; type ids start at 1 in call order."""

    def __init__(self) -> None:
        self.strings = bytearray(b"\0")
        self.records: list[list[int]] = []

    def name(self, text: str) -> int:
        if not text:
            return 0
        off = len(self.strings)
        self.strings += text.encode() + b"\0"
        return off

    def add(self, kind: int, name: str = "", ref: int = 0, extra: tuple[int, ...] = (), *,
            vlen: int = 0, kflag: bool = False) -> int:  # fmt: skip
        info = (int(kflag) << 31) | (kind << 24) | vlen
        self.records.append([self.name(name), info, ref, *extra])
        return len(self.records)

    def int_(self, name: str, size: int, bits: int | None = None, offset: int = 0, enc: int = 0) -> int:
        return self.add(INT, name, size, (enc | (offset << 16) | (size * 8 if bits is None else bits),))

    def array(self, elem: int, nelems: int, index: int = 1) -> int:
        return self.add(ARRAY, "", 0, (elem, index, nelems))

    def struct(self, name: str, size: int, members: list[tuple[str, int, int, int]], *,
               union: bool = False, kflag: bool = True) -> int:  # fmt: skip
        """``members`` are (name, type, bit offset, bitfield size)."""
        words: list[int] = []
        for mname, mtype, bit, bits in members:
            words += [self.name(mname), mtype, (bits << 24) | bit if kflag else bit]
        return self.add(UNION if union else STRUCT, name, size, tuple(words), vlen=len(members), kflag=kflag)

    def blob(self, order: str = "<") -> bytes:
        types = b"".join(struct.pack(f"{order}{len(r)}I", *r) for r in self.records)
        header = struct.pack(order + "HBBIIIII", 0xEB9F, 1, 0, 24, 0, len(types), len(types), len(self.strings))
        return header + types + bytes(self.strings)

    def btf(self, order: str = "<") -> Btf:
        return Btf.from_bytes(self.blob(order))


def header(type_off: int = 0, type_len: int = 0, str_off: int = 0, str_len: int = 1, *,
           magic: int = 0xEB9F, version: int = 1, hdr_len: int = 24) -> bytes:  # fmt: skip
    return struct.pack("<HBBIIIII", magic, version, 0, hdr_len, type_off, type_len, str_off, str_len)


def raises(call: object, *args: object, match: str) -> SymbolError:
    """Assert a one-line SymbolError, since the CLI prints str(exc) as the whole diagnostic."""
    assert callable(call)
    with pytest.raises(SymbolError, match=match) as info:
        call(*args)
    assert "\n" not in str(info.value)
    return info.value


# -- every kind's record size ------------------------------------------------------

# (kind, kind_flag, vlen, record size in bytes per btf.rst, payload after the 12-byte head, spelling).
# Type 1 is "int"; the record under test is type 2.
KIND_RECORDS = [
    ("INT", INT, 0, 0, 16, lambda b: (2, (16,)), "short"),
    ("PTR", PTR, 0, 0, 12, lambda b: (1, ()), "int *"),
    ("ARRAY", ARRAY, 0, 0, 24, lambda b: (0, (1, 1, 3)), "int[3]"),
    ("STRUCT", STRUCT, 0, 2, 36, lambda b: (8, (b.name("a"), 1, 0, b.name("b"), 1, 32)), "struct s"),
    ("UNION", UNION, 0, 2, 36, lambda b: (4, (b.name("a"), 1, 0, b.name("b"), 1, 0)), "union s"),
    ("ENUM", ENUM, 0, 2, 28, lambda b: (4, (b.name("A"), 0, b.name("B"), 1)), "enum s"),
    ("FWD struct", FWD, 0, 0, 12, lambda b: (0, ()), "struct s"),
    ("FWD union", FWD, 1, 0, 12, lambda b: (0, ()), "union s"),
    ("TYPEDEF", TYPEDEF, 0, 0, 12, lambda b: (1, ()), "s"),
    ("VOLATILE", VOLATILE, 0, 0, 12, lambda b: (1, ()), "volatile int"),
    ("CONST", CONST, 0, 0, 12, lambda b: (1, ()), "const int"),
    ("RESTRICT", RESTRICT, 0, 0, 12, lambda b: (1, ()), "restrict int"),
    ("FUNC", FUNC, 0, 0, 12, lambda b: (1, ()), "int s"),
    ("FUNC_PROTO", FUNC_PROTO, 0, 2, 28, lambda b: (1, (b.name("x"), 1, 0, 0)), "int (int, ...)"),
    ("VAR", VAR, 0, 0, 16, lambda b: (1, (1,)), "int s"),
    ("DATASEC", DATASEC, 0, 2, 36, lambda b: (16, (1, 0, 4, 1, 8, 4)), "SEC(s)"),
    ("FLOAT", FLOAT, 0, 0, 12, lambda b: (8, ()), "s"),
    ("DECL_TAG", DECL_TAG, 0, 0, 16, lambda b: (1, (0xFFFFFFFF,)), "int"),
    ("TYPE_TAG", TYPE_TAG, 0, 0, 12, lambda b: (1, ()), "int"),
    ("ENUM64", ENUM64, 0, 2, 36, lambda b: (8, (b.name("A"), 0, 1, b.name("B"), 2, 0)), "enum s"),
]


@pytest.mark.parametrize(
    ("kind", "kflag", "vlen", "record_size", "payload", "spelled"),
    [pytest.param(*row[1:], id=row[0]) for row in KIND_RECORDS],
)
def test_every_kind_has_its_record_size(
    kind: int,
    kflag: int,
    vlen: int,
    record_size: int,
    payload: Callable[[BtfBuilder], tuple[int, tuple[int, ...]]],
    spelled: str,
) -> None:
    b = BtfBuilder()
    b.int_("int", 4, enc=INT_SIGNED)
    ref, extra = payload(b)
    assert 12 + 4 * len(extra) == record_size  # the table above agrees with btf.rst
    name = "short" if kind == INT else "s"
    assert b.add(kind, name, ref, extra, vlen=vlen, kflag=bool(kflag)) == 2
    marker = b.int_("marker", 2)
    b.struct("after", 2, [("x", marker, 0, 0)])
    btf = b.btf()
    assert len(btf) == 4
    assert btf.type_name(2) == spelled
    after = btf.struct("after")
    assert [(m.name, m.type_name, m.size) for m in after.members] == [("x", "marker", 2)]
    assert btf.sizeof("marker") == 2


# -- a kernel-like struct ------------------------------------------------------------


def task_btf(order: str = "<") -> Btf:
    """``struct task`` with the shapes handlers meet: bitfields, anonymous unions, nesting, arrays."""
    b = BtfBuilder()
    i_int = b.int_("int", 4, enc=INT_SIGNED)  # 1
    i_uint = b.int_("unsigned int", 4)
    i_char = b.int_("char", 1, enc=INT_SIGNED)
    i_ulong = b.int_("long unsigned int", 8)
    comm = b.array(i_char, 16)
    pid_t = b.add(TYPEDEF, "pid_t", i_int)
    lh_ptr = b.add(PTR, "", len(b.records) + 2)  # forward reference to list_head, as pahole emits
    list_head = b.struct("list_head", 16, [("next", lh_ptr, 0, 0), ("prev", lh_ptr, 64, 0)], kflag=False)
    cchar_ptr = b.add(PTR, "", b.add(CONST, "", i_char))
    proto = b.add(FUNC_PROTO, "", i_int, (b.name("fmt"), cchar_ptr, 0, 0), vlen=2)
    fn_ptr = b.add(PTR, "", proto)
    sched = b.struct("sched", 16, [("weight", i_uint, 0, 0), ("vruntime", i_ulong, 64, 0)])
    inner = b.struct("", 8, [("c", i_int, 0, 0), ("d", i_int, 32, 0)])
    anon = b.struct("", 8, [("a", i_ulong, 0, 0), ("", inner, 0, 0)], union=True)
    name_ptr = b.add(CONST, "", b.add(PTR, "", i_char))  # char *const
    ptr_arr = b.array(b.add(PTR, "", i_char), 2)  # char *[2]
    arr_ptr = b.add(PTR, "", comm)  # char (*)[16]
    state = b.add(VOLATILE, "", i_uint)
    task_ptr = b.add(PTR, "", len(b.records) + 2)
    task = b.struct(
        "task",
        120,
        [
            ("state", state, 0, 0),
            ("flags", i_uint, 32, 3),
            ("more", i_uint, 35, 5),
            ("pid", pid_t, 64, 0),
            ("tgid", pid_t, 96, 0),
            ("comm", comm, 128, 0),
            ("tasks", list_head, 256, 0),
            ("se", sched, 384, 0),
            ("", anon, 512, 0),
            ("fn", fn_ptr, 576, 0),
            ("parent", task_ptr, 640, 0),
            ("name", name_ptr, 704, 0),
            ("argv", ptr_arr, 768, 0),
            ("buf", arr_ptr, 896, 0),
        ],
    )
    assert task == task_ptr + 1
    b.add(TYPEDEF, "task_t", task)
    b.add(FWD, "never_defined")
    return b.btf(order)


@pytest.fixture(scope="module")
def task() -> Btf:
    return task_btf()


def test_members_are_decoded_with_c_spellings(task: Btf) -> None:
    st = task.struct("task")
    assert (st.name, st.size, st.kind) == ("task", 120, "struct")
    got = [(m.name, m.offset_bits, m.bitfield_size, m.type_name, m.size) for m in st.members]
    assert got == [
        ("state", 0, 0, "volatile unsigned int", 4),
        ("flags", 32, 3, "unsigned int", 4),
        ("more", 35, 5, "unsigned int", 4),
        ("pid", 64, 0, "pid_t", 4),
        ("tgid", 96, 0, "pid_t", 4),
        ("comm", 128, 0, "char[16]", 16),
        ("tasks", 256, 0, "struct list_head", 16),
        ("se", 384, 0, "struct sched", 16),
        ("", 512, 0, "union {...}", 8),
        ("fn", 576, 0, "int (*)(const char *, ...)", 8),
        ("parent", 640, 0, "struct task *", 8),
        ("name", 704, 0, "char *const", 8),
        ("argv", 768, 0, "char *[2]", 16),
        ("buf", 896, 0, "char (*)[16]", 8),
    ]
    assert st.member("comm").offset == 16


def test_struct_lookup_spellings(task: Btf) -> None:
    assert task.struct("struct task") is task.struct("task")  # decoded once, then cached
    assert task.struct("task_t").name == "task"  # a typedef of a struct resolves to it
    lh = task.struct("list_head")
    assert [(m.name, m.offset_bits // 8) for m in lh.members] == [("next", 0), ("prev", 8)]
    raises(task.struct, "nope", match="^no struct nope in BTF$")
    raises(task.struct, "pid_t", match="no struct pid_t")  # a typedef of an int is not a struct
    raises(task.struct, "never_defined", match="no struct never_defined")  # only a forward declaration


def test_offsetof_plain_nested_anonymous_and_indexed(task: Btf) -> None:
    assert task.offsetof("task", "comm") == 16
    assert task.offsetof("task", "pid") == 8
    assert task.offsetof("task", "tgid") == 12
    assert task.offsetof("task", "tasks.prev") == 40
    assert task.offsetof("task", "se.vruntime") == 56
    assert task.offsetof("struct task", " se . weight ") == 48
    assert task.offsetof("task", "a") == 64  # inside an anonymous union
    assert task.offsetof("task", "d") == 68  # inside an anonymous struct inside that union
    assert task.offsetof("task", "comm[3]") == 19
    assert task.offsetof("task", "argv[1]") == 104


def test_bitfields_need_locate(task: Btf) -> None:
    raises(task.offsetof, "task", "more", match="5-bit bitfield at bit 35.*locate")
    bits, member = task.locate("task", "flags")
    assert (bits, member.bitfield_size) == (32, 3)
    assert task.locate("task", "more")[0] == 35


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("nope", "struct task has no member 'nope'"),
        ("se.nope", "task.se has no member 'nope'"),
        ("pid.x", "task.pid is pid_t, not a struct or union"),
        ("parent.pid", r"task.parent is struct task \*, not a struct or union"),
        ("pid[0]", "task.pid is pid_t, not an array"),
        ("comm[16]", r"index 16 is past the end of task.comm \(16 elements\)"),
        ("", "bad member path"),
        ("se..weight", "bad member path"),
        ("9lives", "bad member path"),
    ],
)
def test_offsetof_errors_say_what_is_wrong(task: Btf, path: str, message: str) -> None:
    raises(task.offsetof, "task", path, match=message)


@pytest.mark.parametrize(
    ("name", "size"),
    [
        ("struct task", 120),
        ("task_t", 120),
        ("task", 120),  # bare struct name, as pahole accepts
        ("struct list_head", 16),
        ("pid_t", 4),
        ("char", 1),
        ("unsigned long", 8),
        ("long unsigned int", 8),
        ("unsigned", 4),
        ("signed int", 4),
        ("struct task *", 8),
        ("void *", 8),
        ("char[16]", 16),
        ("pid_t [3]", 12),
        ("struct sched[2][2]", 64),
    ],
)
def test_sizeof(task: Btf, name: str, size: int) -> None:
    assert task.sizeof(name) == size


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("struct nope", "no type struct nope"),
        ("nope *", "no type nope"),
        ("u128", "no type u128"),
        ("struct never_defined", "no type struct never_defined"),
    ],
)
def test_sizeof_errors(task: Btf, name: str, message: str) -> None:
    raises(task.sizeof, name, match=message)


def test_big_endian_blob_reads_the_same() -> None:
    be, le = task_btf(">"), task_btf("<")
    assert be.struct("task") == le.struct("task")
    assert be.offsetof("task", "se.vruntime") == 56


def test_old_style_bitfield_without_kind_flag() -> None:
    b = BtfBuilder()
    b.int_("unsigned int", 4)
    bf = b.int_("unsigned int", 4, bits=3, offset=2)  # pre-kind_flag encoding: bits live in the INT
    b.struct("s", 4, [("x", 1, 0, 0), ("y", bf, 8, 0)], kflag=False)
    x, y = b.btf().struct("s").members
    assert (x.offset_bits, x.bitfield_size) == (0, 0)
    assert (y.offset_bits, y.bitfield_size) == (10, 3)


def test_later_full_definition_wins_over_an_empty_one() -> None:
    b = BtfBuilder()
    b.int_("int", 4)
    b.struct("s", 0, [])
    b.struct("s", 4, [("x", 1, 0, 0)])
    assert b.btf().sizeof("struct s") == 4


def test_pointer_size_comes_from_long() -> None:
    b = BtfBuilder()
    b.int_("long int", 4)
    b.add(TYPEDEF, "p", b.add(PTR, "", 1))
    assert b.btf().sizeof("p") == 4


def test_reference_loops_and_bad_ids_are_errors_not_hangs() -> None:
    b = BtfBuilder()
    b.add(TYPEDEF, "loop", 1)  # typedef loop loop;
    b.struct("s", 4, [("x", 999, 0, 0)])
    btf = b.btf()
    raises(btf.sizeof, "loop", match="malformed BTF:.*loop")
    raises(btf.struct, "s", match="malformed BTF: reference to type id 999")


# -- malformed input ------------------------------------------------------------------


def _one_int(name_off: int = 1) -> bytes:
    return struct.pack("<IIII", name_off, INT << 24, 4, 32)


MALFORMED = [
    ("empty", b"", "shorter than the 24-byte header"),
    ("bad magic", b"\x7fELF" + bytes(40), "bad magic 7f45"),
    ("version", header(version=2), "version 2"),
    ("header length", header(hdr_len=500), "header length 500"),
    ("past end", header(type_len=64) + b"\0", "runs past the end of the data"),
    ("odd type length", header(type_len=2, str_off=2) + b"\0\0" + b"\0", "not a multiple of 4"),
    ("no strings", header(str_len=0), "string section must start and end with a NUL"),
    ("unterminated", header(str_len=2) + b"\0x", "string section must start and end with a NUL"),
    ("unknown kind", header(1, 12, 0, 1) + b"\0" + struct.pack("<III", 0, 25 << 24, 0), "unknown kind 25"),
    ("kind 0", header(0, 12, 12, 1) + struct.pack("<III", 0, 0, 0) + b"\0", "unknown kind 0"),
    ("truncated head", header(0, 8, 8, 1) + bytes(8) + b"\0", "truncated"),
    (
        "vlen past end",
        header(0, 24, 24, 1) + struct.pack("<IIIIII", 0, (STRUCT << 24) | 2, 4, 0, 1, 0) + b"\0",
        "runs past the end of the type section",
    ),
    ("name offset", header(0, 16, 16, 3) + _one_int(name_off=9) + b"\0x\0", "name offset 9 past"),
]


@pytest.mark.parametrize(("blob", "message"), [pytest.param(b, m, id=i) for i, b, m in MALFORMED])
def test_malformed_blobs_are_one_line_symbol_errors(blob: bytes, message: str) -> None:
    err = raises(Btf.from_bytes, blob, match=message)
    assert str(err).startswith("malformed BTF: ")


def test_well_formed_minimal_blob() -> None:
    btf = Btf.from_bytes(header(0, 16, 16, 5) + _one_int() + b"\0int\0")
    assert len(btf) == 1
    assert btf.sizeof("int") == 4


# -- ELF container ------------------------------------------------------------------


def make_elf(sections: list[tuple[str, bytes, int]], elf_class: int = 64, order: str = "<") -> bytes:
    """An ELF with the given (name, contents, sh_type) sections plus .shstrtab, headers at the end."""
    names = bytearray(b"\0")
    entries = [(0, 0, b"")]  # the null section
    for name, data, sh_type in [*sections, (".shstrtab", b"", 3)]:
        entries.append((len(names), sh_type, data))
        names += name.encode() + b"\0"
    entries[-1] = (entries[-1][0], 3, bytes(names))
    ehsize, shentsize = (64, 64) if elf_class == 64 else (52, 40)
    body = bytearray(ehsize)
    offsets = []
    for _, _, data in entries:
        offsets.append(len(body))
        body += data
    shoff = len(body)
    for (name_off, sh_type, data), off in zip(entries, offsets, strict=True):
        fmt = "IIQQQQIIQQ" if elf_class == 64 else "IIIIIIIIII"
        body += struct.pack(order + fmt, name_off, sh_type, 0, 0, off if data else 0, len(data), 0, 0, 1, 0)
    ident = b"\x7fELF" + bytes([1 if elf_class == 32 else 2, 1 if order == "<" else 2, 1]) + bytes(9)
    if elf_class == 64:
        rest = struct.pack(order + "HHIQQQIHHHHHH", 2, 62, 1, 0, 0, shoff, 0, ehsize, 0, 0, shentsize,
                           len(entries), len(entries) - 1)  # fmt: skip
    else:
        rest = struct.pack(order + "HHIIIIIHHHHHH", 2, 3, 1, 0, 0, shoff, 0, ehsize, 0, 0, shentsize,
                           len(entries), len(entries) - 1)  # fmt: skip
    body[:ehsize] = ident + rest
    return bytes(body)


@pytest.mark.parametrize(("elf_class", "order"), [(64, "<"), (64, ">"), (32, "<")])
def test_from_vmlinux_finds_btf_in_elf(tmp_path: Path, elf_class: int, order: str) -> None:
    path = tmp_path / "vmlinux"
    text = (".text", b"\x90" * 32, 1)
    path.write_bytes(make_elf([text, (".BTF", small_blob(), 1), (".BTF.ext", b"junk", 1)], elf_class, order))
    assert Btf.from_vmlinux(path).offsetof("task", "comm") == 8


def small_blob() -> bytes:
    """A few types, for embedding in files."""
    b = BtfBuilder()
    b.int_("int", 4, enc=INT_SIGNED)
    b.int_("char", 1, enc=INT_SIGNED)
    comm = b.array(2, 16)
    b.struct("task", 24, [("pid", 1, 0, 0), ("comm", comm, 64, 0)])
    return b.blob()


def test_from_vmlinux_accepts_raw_btf(tmp_path: Path) -> None:
    path = tmp_path / "btf_vmlinux"  # the shape of /sys/kernel/btf/vmlinux
    path.write_bytes(small_blob())
    assert Btf.from_vmlinux(str(path)).offsetof("task", "comm") == 8


@pytest.mark.parametrize(
    ("contents", "message"),
    [
        (make_elf([(".text", b"\x90", 1)]), r"no \.BTF section .*CONFIG_DEBUG_INFO_BTF"),
        (make_elf([(".BTF", b"", 8)]), r"\.BTF section has no contents"),
        (make_elf([(".BTF", b"\x9f\xeb\x01", 1)]), "malformed BTF: 3 bytes"),
        (b"#!/bin/sh\n" * 10, "not an ELF file or raw BTF"),
        (b"", "not an ELF file or raw BTF"),
        (make_elf([(".text", b"\x90", 1)])[:80], "no section headers|past the end"),
    ],
)
def test_from_vmlinux_errors_name_the_file(tmp_path: Path, contents: bytes, message: str) -> None:
    path = tmp_path / "vmlinux"
    path.write_bytes(contents)
    err = raises(Btf.from_vmlinux, path, match=message)
    assert str(err).startswith(f"{path}: ")


def test_from_vmlinux_missing_file(tmp_path: Path) -> None:
    raises(Btf.from_vmlinux, tmp_path / "absent", match="absent: cannot read: No such file")


# -- the real kernel --------------------------------------------------------------------


def _real_vmlinuxes() -> list[Path]:
    base = Path(os.environ.get("QPROBE_CACHE") or Path.home() / ".cache" / "qprobe")
    return sorted(p for p in base.glob("kernels/*/vmlinux-*") if p.stat().st_size > 100 << 20)


# Offsets read from the DWARF of the same files with gdb (p &((struct task_struct *)0)->comm, ...).
KNOWN = {
    "vmlinux-6.1.0-56-cloud-amd64": {"comm": 2976, "pid": 2416, "tgid": 2420, "size": 9728, "se.vruntime": 208},
    "vmlinux-6.1.0-56-rt-amd64": {"comm": 3040, "pid": 2480, "tgid": 2484, "size": 9792, "se.vruntime": 272},
}


@pytest.fixture(
    scope="module",
    params=_real_vmlinuxes() or [None],
    ids=lambda p: p.name if p else "no-vmlinux",
)
def real(request: pytest.FixtureRequest) -> tuple[Btf, dict[str, int]]:
    path = request.param
    if path is None:
        pytest.skip("no debug vmlinux in ~/.cache/qprobe/kernels/*/ (fetch a kernel image first)")
    # Parse speed is reported by `qprobe bench`, not asserted here.
    btf = Btf.from_vmlinux(path)
    return btf, KNOWN.get(path.name, {})


def test_real_task_struct_offsets(real: tuple[Btf, dict[str, int]]) -> None:
    btf, known = real
    comm, pid, tgid = (btf.offsetof("task_struct", m) for m in ("comm", "pid", "tgid"))
    size = btf.sizeof("struct task_struct")
    assert tgid == pid + 4  # pid_t pid; pid_t tgid; are adjacent in every 6.x kernel
    assert 0 < pid < comm < size
    assert btf.struct("task_struct").member("comm").type_name == "char[16]"
    assert btf.struct("task_struct").member("pid").type_name == "pid_t"
    assert btf.sizeof("pid_t") == 4
    assert size == btf.struct("task_struct").size
    if known:
        found = {"comm": comm, "pid": pid, "tgid": tgid, "size": size}
        found["se.vruntime"] = btf.offsetof("task_struct", "se.vruntime")
        assert found == known


def test_real_list_head_and_pointers(real: tuple[Btf, dict[str, int]]) -> None:
    btf, _ = real
    lh = btf.struct("list_head")
    assert lh.size == 16
    assert [(m.name, m.offset_bits, m.type_name) for m in lh.members] == [
        ("next", 0, "struct list_head *"),
        ("prev", 64, "struct list_head *"),
    ]
    assert btf.sizeof("unsigned long") == btf.sizeof("struct task_struct *") == 8


def test_real_bitfield(real: tuple[Btf, dict[str, int]]) -> None:
    btf, _ = real
    bitfields = [m for m in btf.struct("task_struct").members if m.bitfield_size]
    assert bitfields, "task_struct has sched_reset_on_fork:1 and friends"
    first = next(m for m in bitfields if m.name == "sched_reset_on_fork")
    assert first.bitfield_size == 1
    raises(btf.offsetof, "task_struct", "sched_reset_on_fork", match="1-bit bitfield")
    assert btf.locate("task_struct", "sched_reset_on_fork")[0] == first.offset_bits


def test_real_nested_and_anonymous_paths(real: tuple[Btf, dict[str, int]]) -> None:
    btf, _ = real
    se = btf.offsetof("task_struct", "se")
    assert btf.offsetof("task_struct", "se.vruntime") == se + btf.offsetof("sched_entity", "vruntime")
    assert btf.offsetof("page", "lru") == 8  # inside struct page's anonymous union of structs
    assert not btf.struct("page").member("flags").offset_bits
    raises(btf.struct("page").member, "lru", match="no direct member 'lru'")  # only via anonymous members
    assert btf.offsetof("task_struct", "comm[1]") == btf.offsetof("task_struct", "comm") + 1
