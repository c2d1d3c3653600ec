"""KernelBtf on a BTF blob laid out by hand as include/uapi/linux/btf.h describes it.

The blob describes, in C::

    typedef unsigned char u8;
    struct qstr { union { struct { unsigned int hash; unsigned int len; }; unsigned long hash_len; };
                  const u8 *name; };
    struct dentry { int d_flags; int d_seq; struct qstr d_name; };
    long f(const u8 *name, struct dentry *d, enum e how);
    void g(void);

so the expected prototypes and offsets are C's (x86_64 sizes), not qprobe's.
"""

from __future__ import annotations

import struct

import pytest

from qprobe.errors import QprobeError
from qprobe.fetch.btf import CType, FuncProto, Member, is_char_ptr
from qprobe.kernel.btf import (
    CONST,
    ENUM,
    FUNC,
    FUNC_PROTO,
    INT,
    PTR,
    STRUCT,
    TYPEDEF,
    UNION,
    KernelBtf,
)
from qprobe.kernel.symbols import Symbols
from qprobe.kernel.tracefs import _LazyBtf


class Blob:
    def __init__(self, str_base: int = 0) -> None:
        self.strings = b"\0"
        self.types = b""
        self.str_base = str_base  # a split BTF's names are offsets past its base's strings

    def name(self, text: str) -> int:
        if not text:
            return 0
        off = self.str_base + len(self.strings)
        self.strings += text.encode() + b"\0"
        return off

    def add(self, name: str, kind: int, vlen: int, size_type: int, extra: bytes = b"", kflag: bool = False) -> None:
        info = (kind << 24) | vlen | (1 << 31 if kflag else 0)
        self.types += struct.pack("<III", self.name(name), info, size_type) + extra

    def build(self) -> bytes:
        hdr = struct.pack("<HBBIIIII", 0xEB9F, 1, 0, 24, 0, len(self.types), len(self.types), len(self.strings))
        return hdr + self.types + self.strings


def blob() -> bytes:
    b = Blob()
    b.add("unsigned char", INT, 0, 1, struct.pack("<I", 8))  # 1: bits 8, unsigned
    b.add("u8", TYPEDEF, 0, 1)  # 2
    b.add("", CONST, 0, 2)  # 3: const u8
    b.add("", PTR, 0, 3)  # 4: const u8 *
    b.add("unsigned int", INT, 0, 4, struct.pack("<I", 32))  # 5
    b.add("unsigned long", INT, 0, 8, struct.pack("<I", 64))  # 6
    b.add("", STRUCT, 2, 8, struct.pack("<III", b.name("hash"), 5, 0) + struct.pack("<III", b.name("len"), 5, 32))
    b.add("", UNION, 2, 8, struct.pack("<III", 0, 7, 0) + struct.pack("<III", b.name("hash_len"), 6, 0))  # 8
    b.add("qstr", STRUCT, 2, 16, struct.pack("<III", 0, 8, 0) + struct.pack("<III", b.name("name"), 4, 64))  # 9
    b.add("int", INT, 0, 4, struct.pack("<I", (1 << 24) | 32))  # 10: signed
    b.add("dentry", STRUCT, 3, 24, struct.pack("<III", b.name("d_flags"), 10, 0)
          + struct.pack("<III", b.name("d_seq"), 10, 32) + struct.pack("<III", b.name("d_name"), 9, 64))  # fmt: skip
    b.add("", PTR, 0, 11)  # 12: struct dentry *
    b.add("e", ENUM, 1, 4, struct.pack("<Ii", b.name("E0"), 0))  # 13
    b.add("long", INT, 0, 8, struct.pack("<I", (1 << 24) | 64))  # 14
    b.add("", FUNC_PROTO, 3, 14, struct.pack("<II", b.name("name"), 4) + struct.pack("<II", b.name("d"), 12)
          + struct.pack("<II", b.name("how"), 13))  # fmt: skip
    b.add("f", FUNC, 0, 15)  # 16
    b.add("", FUNC_PROTO, 0, 0)  # 17: void (void)
    b.add("g", FUNC, 0, 17)  # 18
    return b.build()


def test_function_prototypes() -> None:
    btf = KernelBtf(blob())
    u8 = CType("int", 8, False)
    assert btf.proto("f") == FuncProto(
        (
            ("name", CType("ptr", target=u8)),
            ("d", CType("ptr", target=CType("struct", tid=11))),
            ("how", CType("enum")),
        ),
        CType("int", 64, True),
    )
    assert btf.proto("g") == FuncProto((), None)
    assert btf.proto("dentry") is None and btf.proto("nosuch") is None


def test_offsets_through_anonymous_members() -> None:
    btf = KernelBtf(blob())
    assert btf.offsetof("dentry", "d_name.name") == 16  # 8 (d_name) + 8 (name after the 8-byte union)
    assert btf.offsetof("dentry", "d_name.len") == 12  # in the anonymous struct of the anonymous union
    assert btf.offsetof("qstr", "hash_len") == 0
    assert btf.offsetof("dentry", "d_name.nosuch") is None
    assert btf.offsetof("file", "f_path") is None


def test_members_as_the_parser_walks_them() -> None:
    btf = KernelBtf(blob())
    dentry = CType("struct", tid=11)
    d_name = btf.member(dentry, "d_name")
    assert d_name == Member(64, 0, CType("struct", tid=9))
    assert btf.member(d_name.type, "name") == Member(64, 0, CType("ptr", target=CType("int", 8, False)))
    assert btf.member(d_name.type, "len") == Member(32, 0, CType("int", 32, False))
    assert btf.member(dentry, "name") is None  # only through d_name
    assert btf.member(CType("int", 32), "x") is None


def test_char_pointers_as_btf_type_is_char_ptr_finds_them() -> None:
    """It reads ``type->type`` of any kind: the pointer's target, or an integer's size taken as an id."""
    btf = KernelBtf(blob())
    name_type = btf.proto("f").params[0][1]  # type: ignore[union-attr]
    assert is_char_ptr(name_type)
    assert is_char_ptr(btf.ctype(1))  # unsigned char: size 1, and id 1 is unsigned char
    assert not is_char_ptr(btf.ctype(5))  # unsigned int: size 4, and id 4 is a pointer
    assert not is_char_ptr(btf.ctype(12))  # struct dentry *


def test_not_btf() -> None:
    with pytest.raises(QprobeError):
        KernelBtf(b"\0" * 32)


def module_blob(base: bytes, func: str = "h") -> bytes:
    """A module's split BTF over ``blob()``: ``struct m { struct dentry *d; int n; }; int h(struct m *mp, u8 c);``.

    Its ids start after the base's last (18) and its string offsets after the base's strings.
    """
    b = Blob(str_base=struct.unpack_from("<I", base, 20)[0])
    b.add("m", STRUCT, 2, 16, struct.pack("<III", b.name("d"), 12, 0) + struct.pack("<III", b.name("n"), 10, 64))  # 19
    b.add("", PTR, 0, 19)  # 20: struct m *
    b.add("", FUNC_PROTO, 2, 10, struct.pack("<II", b.name("mp"), 20) + struct.pack("<II", b.name("c"), 2))  # 21
    b.add(func, FUNC, 0, 21)  # 22
    return b.build()


def test_a_modules_split_btf_over_vmlinux() -> None:
    base = KernelBtf(blob())
    mod = KernelBtf(module_blob(blob()), base=base)
    proto = mod.proto("h")
    assert proto == FuncProto(
        (("mp", CType("ptr", target=CType("struct", tid=19))), ("c", CType("int", 8, False))), CType("int", 32, True)
    )
    assert mod.proto("f") is None and base.proto("h") is None  # each finds its own functions only
    m = mod.ctype(19)
    assert m.btf is mod and base.ctype(11).btf is base
    d = mod.member(m, "d")
    assert d == Member(0, 0, CType("ptr", target=CType("struct", tid=11)))
    assert mod.member(CType("struct", tid=11), "d_seq") == Member(32, 0, CType("int", 32, True))  # a base type
    assert mod.offsetof("m", "n") == 8 and mod.offsetof("dentry", "d_name.name") == 16


def test_a_modules_btf_is_looked_up_by_its_address_and_its_bytes() -> None:
    # A module unloads and the next one's struct btf gets the same address: its functions, not the old ones.
    loaded = [(0xFFFF888001000000, module_blob(blob(), "mod_open"))]
    lazy = _LazyBtf(Symbols.__new__(Symbols), lambda: loaded)
    lazy.__dict__["_btf"] = KernelBtf(blob())  # vmlinux's, as _LazyBtf reads it from the file
    assert lazy.proto("mod_open") is not None and lazy.proto("mod_read") is None
    loaded = [(0xFFFF888001000000, module_blob(blob(), "mod_read"))]
    assert lazy.proto("mod_open") is None and lazy.proto("mod_read") is not None
