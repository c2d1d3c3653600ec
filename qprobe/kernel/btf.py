"""Kernel type layouts from BTF, the compact type table every modern vmlinux carries.

Handlers need a few typed facts about the running kernel (where ``comm`` and
``pid`` sit in ``task_struct``, how big a ``list_head`` is).  DWARF has them
too, but reading DWARF out of the 590 MB debug vmlinux takes tens of seconds;
the ``.BTF`` section holds the same layouts in ~4 MB of fixed-size records.

So this module is a small pure-Python reader:

* the ELF section headers are parsed by hand from an mmap (no LIEF: finding
  one section must not cost a full ELF parse);
* the type section is loaded as one ``array('I')`` of 32-bit words and walked
  once to record where each type id starts and to index the names of
  structs, unions, enums, typedefs and base types (every record's size must
  be known exactly, or every later type id would be off);
* struct members are decoded only when a struct is first asked for, then
  cached, so keeping a :class:`Btf` around costs ~10 MB and no further work.

Format reference: Linux ``Documentation/bpf/btf.rst`` and
``include/uapi/linux/btf.h``.
"""

from __future__ import annotations

import mmap
import re
import struct
import sys
from array import array
from dataclasses import dataclass
from pathlib import Path

from qprobe.errors import SymbolError

BTF_MAGIC = 0xEB9F
BTF_VERSION = 1
_HEADER_SIZE = 24  # struct btf_header up to and including str_len

# BTF_KIND_* values (include/uapi/linux/btf.h).
KIND_INT = 1
KIND_PTR = 2
KIND_ARRAY = 3
KIND_STRUCT = 4
KIND_UNION = 5
KIND_ENUM = 6
KIND_FWD = 7
KIND_TYPEDEF = 8
KIND_VOLATILE = 9
KIND_CONST = 10
KIND_RESTRICT = 11
KIND_FUNC = 12
KIND_FUNC_PROTO = 13
KIND_VAR = 14
KIND_DATASEC = 15
KIND_FLOAT = 16
KIND_DECL_TAG = 17
KIND_TYPE_TAG = 18
KIND_ENUM64 = 19
_MAX_KIND = KIND_ENUM64

KIND_NAMES = {
    KIND_INT: "int", KIND_PTR: "ptr", KIND_ARRAY: "array", KIND_STRUCT: "struct",
    KIND_UNION: "union", KIND_ENUM: "enum", KIND_FWD: "fwd", KIND_TYPEDEF: "typedef",
    KIND_VOLATILE: "volatile", KIND_CONST: "const", KIND_RESTRICT: "restrict",
    KIND_FUNC: "func", KIND_FUNC_PROTO: "func_proto", KIND_VAR: "var",
    KIND_DATASEC: "datasec", KIND_FLOAT: "float", KIND_DECL_TAG: "decl_tag",
    KIND_TYPE_TAG: "type_tag", KIND_ENUM64: "enum64",
}  # fmt: skip

# Words (u32) that follow the 12-byte struct btf_type, per kind: a fixed part
# plus a part per vlen entry.  Index = kind; -1 marks kinds that do not exist.
_FIXED_WORDS = array("i", [-1] * 32)
_VLEN_WORDS = array("i", [0] * 32)
for _kind in range(1, _MAX_KIND + 1):
    _FIXED_WORDS[_kind] = 0
_FIXED_WORDS[KIND_INT] = 1  # u32 encoding/offset/bits
_FIXED_WORDS[KIND_ARRAY] = 3  # struct btf_array {type, index_type, nelems}
_FIXED_WORDS[KIND_VAR] = 1  # struct btf_var {linkage}
_FIXED_WORDS[KIND_DECL_TAG] = 1  # struct btf_decl_tag {component_idx}
_VLEN_WORDS[KIND_STRUCT] = 3  # struct btf_member {name_off, type, offset}
_VLEN_WORDS[KIND_UNION] = 3
_VLEN_WORDS[KIND_ENUM] = 2  # struct btf_enum {name_off, val}
_VLEN_WORDS[KIND_FUNC_PROTO] = 2  # struct btf_param {name_off, type}
_VLEN_WORDS[KIND_DATASEC] = 3  # struct btf_var_secinfo {type, offset, size}
_VLEN_WORDS[KIND_ENUM64] = 3  # struct btf_enum64 {name_off, val_lo32, val_hi32}

_QUALIFIERS = {KIND_CONST: "const", KIND_VOLATILE: "volatile", KIND_RESTRICT: "restrict"}
_TRANSPARENT = frozenset({KIND_TYPEDEF, KIND_CONST, KIND_VOLATILE, KIND_RESTRICT, KIND_TYPE_TAG})
_MAX_DEPTH = 64  # longest typedef/qualifier/pointer chain followed before calling it a loop
_PATH_PART = re.compile(r"([A-Za-z_]\w*)((?:\[\d+\])*)")
_SUFFIX = re.compile(r"^(.*?)\s*((?:\[\s*\d+\s*\])*)$")


@dataclass(frozen=True)
class Member:
    """One member of a struct or union, as C would spell and lay it out.

    ``offset_bits`` is from the start of the enclosing struct (not of any
    anonymous member it sits in).  ``bitfield_size`` is 0 for ordinary
    members.  ``size`` is the member type's size in bytes after typedefs and
    qualifiers (for a bitfield: the size of its underlying integer type).
    """

    name: str
    offset_bits: int
    bitfield_size: int
    type_name: str
    size: int
    type_id: int

    @property
    def offset(self) -> int:
        """Byte offset (rounded down for bitfields)."""
        return self.offset_bits // 8


@dataclass(frozen=True)
class StructType:
    """A struct or union with its members in declaration order."""

    name: str
    size: int
    members: list[Member]
    kind: str  # "struct" or "union"
    type_id: int

    def member(self, name: str) -> Member:
        """The direct member ``name`` (anonymous members are not searched; use Btf.locate)."""
        for m in self.members:
            if m.name == name:
                return m
        raise SymbolError(f"{self.kind} {self.name or '{...}'} has no direct member {name!r}")


def _malformed(why: str) -> SymbolError:
    return SymbolError(f"malformed BTF: {why}")


def _join(base: str, inner: str) -> str:
    """``base`` followed by a declarator: ``char[16]``, ``char *``, ``void (*)(int)``."""
    if not inner:
        return base
    return base + inner if inner[0] == "[" else f"{base} {inner}"


def _int_key(name: str) -> str:
    """A spelling-independent key for C integer types: ``unsigned long`` == ``long unsigned int``."""
    words = name.split()
    has_char = "char" in words
    words = [w for w in words if w != "int" and not (w == "signed" and not has_char)]
    return " ".join(sorted(words)) if words else "int"


class Btf:
    """The types of one kernel, decoded from its ``.BTF`` section.

    Construct with :meth:`from_vmlinux` or :meth:`from_bytes`.  Lookups raise
    :class:`SymbolError` with a message a user can act on.
    """

    def __init__(self, words: array, starts: array, strings: bytes, names: dict[str, int]) -> None:
        self._words = words  # the type section as u32s, in host order
        self._starts = starts  # type id -> index of its record in _words (id 0 = void)
        self._strings = strings
        self._names = names  # "struct x" / "union x" / "enum x" / "x" (ordinary namespace) -> type id
        self._structs: dict[int, StructType] = {}
        self._int_names: dict[str, int] | None = None
        self._ptr_size: int | None = None

    # -- loading -------------------------------------------------------------
    @classmethod
    def from_vmlinux(cls, path: str | Path) -> Btf:
        """Read the ``.BTF`` section of an ELF vmlinux (or a raw BTF file such as /sys/kernel/btf/vmlinux)."""
        path = Path(path)
        try:
            data = _read_btf_section(path)
            return cls.from_bytes(data)
        except SymbolError as exc:
            raise SymbolError(f"{path}: {exc}") from None

    @classmethod
    def from_bytes(cls, data: bytes) -> Btf:
        """Parse the contents of a ``.BTF`` section (header, type section, string section)."""
        data = bytes(data)
        if len(data) < _HEADER_SIZE:
            raise _malformed(f"{len(data)} bytes is shorter than the {_HEADER_SIZE}-byte header")
        if data[:2] == b"\x9f\xeb":
            order = "<"
        elif data[:2] == b"\xeb\x9f":
            order = ">"
        else:
            raise _malformed(f"bad magic {data[:2].hex()} (expected 0xeb9f)")
        _magic, version, _flags, hdr_len, type_off, type_len, str_off, str_len = struct.unpack_from(
            order + "HBBIIIII", data
        )
        if version != BTF_VERSION:
            raise _malformed(f"version {version} (only version {BTF_VERSION} is known)")
        if not _HEADER_SIZE <= hdr_len <= len(data):
            raise _malformed(f"header length {hdr_len} out of range")
        t_start, s_start = hdr_len + type_off, hdr_len + str_off
        if t_start + type_len > len(data) or s_start + str_len > len(data):
            raise _malformed("type or string section runs past the end of the data")
        if type_len % 4:
            raise _malformed(f"type section length {type_len} is not a multiple of 4")
        strings = data[s_start : s_start + str_len]
        if not strings or strings[0] != 0 or strings[-1] != 0:
            raise _malformed("string section must start and end with a NUL byte")
        words = array("I")
        if words.itemsize != 4:  # pragma: no cover - every CPython platform has a 32-bit unsigned int
            words = array("L")
        words.frombytes(data[t_start : t_start + type_len])
        if (order == "<") != (sys.byteorder == "little"):
            words.byteswap()
        starts, names = _walk(words, strings)
        return cls(words, starts, strings, names)

    # -- public lookups --------------------------------------------------------
    def __len__(self) -> int:
        """Number of types, not counting void (type id 0)."""
        return len(self._starts) - 1

    def __repr__(self) -> str:
        return f"<Btf {len(self)} types>"

    def struct(self, name: str) -> StructType:
        """The struct or union ``name`` (``task_struct``, ``struct task_struct``, or a typedef of one)."""
        tid = self._aggregate_id(name)
        if tid is None:
            raise SymbolError(f"no struct {name} in BTF")
        return self._struct_at(tid)

    def func_params(self, name: str) -> list[tuple[str, str]]:
        """(name, C type) of each parameter of function ``name``, in order (BTF FUNC -> FUNC_PROTO)."""
        tid = self._names.get(f"func {name}")
        if tid is None:
            raise SymbolError(f"no function {name} in BTF")
        proto = self._head(tid)[2]
        kind, info, _ = self._head(proto)
        if kind != KIND_FUNC_PROTO:
            raise _malformed(f"function {name} does not point at a prototype")
        words, i = self._words, self._starts[proto] + 3
        out = []
        for _ in range(info & 0xFFFF):
            name_off, ptype = words[i], words[i + 1]
            i += 2
            if ptype:  # a trailing (name 0, type 0) entry is the "..." of a variadic function
                out.append((self._str(name_off), self._spell(ptype, "", 0)))
        return out

    def locate(self, struct_name: str, member_path: str) -> tuple[int, Member]:
        """Bit offset of ``member_path`` in ``struct_name``, and the member found last.

        ``member_path`` is dotted (``se.vruntime``) and may index arrays
        (``pids[1].pid``).  Members of anonymous structs and unions are found
        as C finds them.  Unlike :meth:`offsetof` this works for bitfields.
        """
        st = self.struct(struct_name)
        tid, bits, member = st.type_id, 0, None
        label = f"{st.kind} {st.name}"  # what the error messages call the current location
        for i, part in enumerate(member_path.split(".")):
            m = _PATH_PART.fullmatch(part.strip())
            if m is None:
                raise SymbolError(f"bad member path {member_path!r}: {part!r} is not a member name")
            name, indices = m.group(1), m.group(2)
            if i:
                agg = self._aggregate_of(tid)
                if agg is None:
                    what = self.type_name(tid)
                    raise SymbolError(f"{label} is {what}, not a struct or union; no {name!r} in it")
                tid = agg
            found = self._find_member(tid, name, 0)
            if found is None:
                raise SymbolError(f"{label} has no member {name!r}")
            delta, member = found
            bits += delta
            tid = member.type_id
            label = f"{st.name}.{name}" if i == 0 else f"{label}.{name}"
            for idx_text in re.findall(r"\d+", indices):
                idx = int(idx_text)
                arr = self._strip(tid)
                if not arr or self._head(arr)[0] != KIND_ARRAY:
                    raise SymbolError(f"{label} is {self.type_name(tid)}, not an array; cannot index it")
                elem, nelems = self._array(arr)
                if nelems and idx >= nelems:
                    raise SymbolError(f"index {idx} is past the end of {label} ({nelems} elements)")
                bits += idx * 8 * self._size_or_zero(elem)
                tid = elem
                label = f"{label}[{idx}]"
        assert member is not None  # split() yields at least one part
        return bits, member

    def offsetof(self, struct_name: str, member_path: str) -> int:
        """Byte offset of ``member_path`` (``comm``, ``se.vruntime``) in a struct, as C's offsetof."""
        bits, member = self.locate(struct_name, member_path)
        if member.bitfield_size:
            raise SymbolError(
                f"{struct_name}.{member_path} is a {member.bitfield_size}-bit bitfield at bit {bits}; "
                "offsetof cannot take it (use Btf.locate for the bit offset)"
            )
        return bits // 8

    def sizeof(self, type_name: str) -> int:
        """Bytes in ``struct X``, ``union X``, ``enum X``, a typedef, a base type, ``T *`` or ``T[N]``.

        A bare name that is not a typedef or base type falls back to the
        struct or union of that name, as pahole does.
        """
        text = " ".join(type_name.split())
        m = _SUFFIX.match(text)
        assert m is not None  # the pattern matches any string
        base, dims = m.group(1), [int(d) for d in re.findall(r"\d+", m.group(2))]
        count = 1
        for d in dims:
            count *= d
        if base.endswith("*"):
            inner = base.rstrip("* ").strip()
            if inner != "void":
                self._type_id(inner)  # a typo in the pointee should not pass silently
            return count * self.pointer_size
        tid = self._type_id(base)
        size = self._size(tid)
        if size is None:
            raise SymbolError(f"{type_name} has no size (incomplete or function type)")
        return count * size

    def type_name(self, type_id: int) -> str:
        """The C spelling of a type id: ``char[16]``, ``struct task_struct *``, ``void (*)(int)``."""
        return self._spell(type_id, "", 0)

    @property
    def pointer_size(self) -> int:
        """Bytes in a pointer; BTF does not record it, so it is taken from ``long``."""
        if self._ptr_size is None:
            tid = self._lookup_int("long unsigned int") or self._lookup_int("long int")
            self._ptr_size = self._head(tid)[2] if tid else 8
        return self._ptr_size

    # -- records -------------------------------------------------------------
    def _head(self, tid: int) -> tuple[int, int, int]:
        """(kind, info, size_or_type) of type ``tid``."""
        if not 0 < tid < len(self._starts):
            raise _malformed(f"reference to type id {tid}, but there are only {len(self)} types")
        i = self._starts[tid]
        info = self._words[i + 1]
        return (info >> 24) & 0x1F, info, self._words[i + 2]

    def _name(self, tid: int) -> str:
        return self._str(self._words[self._starts[tid]])

    def _str(self, off: int) -> str:
        if off >= len(self._strings):
            raise _malformed(f"string offset {off} past the end of the string section")
        end = self._strings.index(b"\0", off)
        return self._strings[off:end].decode("utf-8", "replace")

    def _array(self, tid: int) -> tuple[int, int]:
        """(element type, element count) of an ARRAY type."""
        i = self._starts[tid] + 3
        return self._words[i], self._words[i + 2]

    def _strip(self, tid: int) -> int:
        """Follow typedefs, qualifiers and type tags to the underlying type."""
        for _ in range(_MAX_DEPTH):
            if tid == 0:
                return 0
            kind, _, ref = self._head(tid)
            if kind not in _TRANSPARENT:
                return tid
            tid = ref
        raise _malformed(f"type chain through id {tid} does not end (a reference loop?)")

    def _size(self, tid: int) -> int | None:
        """Bytes taken by type ``tid``, or None for void, functions and forward declarations."""
        for _ in range(_MAX_DEPTH):
            tid = self._strip(tid)
            if tid == 0:
                return None
            kind, _, size = self._head(tid)
            if kind in (KIND_INT, KIND_FLOAT, KIND_STRUCT, KIND_UNION, KIND_ENUM, KIND_ENUM64, KIND_DATASEC):
                return size
            if kind == KIND_PTR:
                return self.pointer_size
            if kind == KIND_VAR:
                tid = size
                continue
            if kind != KIND_ARRAY:
                return None
            elem, nelems = self._array(tid)
            elem_size = self._size(elem)
            return None if elem_size is None else elem_size * nelems
        raise _malformed("type chain does not end (a reference loop?)")

    def _size_or_zero(self, tid: int) -> int:
        size = self._size(tid)
        return 0 if size is None else size

    # -- names -----------------------------------------------------------------
    def _aggregate_id(self, name: str) -> int | None:
        text = " ".join(name.split())
        for key in (text,) if text.startswith(("struct ", "union ")) else (f"struct {text}", f"union {text}"):
            tid = self._names.get(key)
            if tid is not None:
                return tid
        tid = self._names.get(text)  # a typedef of a struct, e.g. spinlock_t
        return None if tid is None else self._aggregate_of(tid)

    def _aggregate_of(self, tid: int) -> int | None:
        """The struct/union type behind ``tid`` (through typedefs/qualifiers), or None."""
        tid = self._strip(tid)
        return tid if tid and self._head(tid)[0] in (KIND_STRUCT, KIND_UNION) else None

    def _lookup_int(self, name: str) -> int | None:
        if self._int_names is None:
            ints: dict[str, int] = {}
            for key, tid in self._names.items():
                if " " in key and key.split(" ", 1)[0] in ("struct", "union", "enum"):
                    continue
                if self._head(tid)[0] == KIND_INT:
                    ints.setdefault(_int_key(key), tid)
            self._int_names = ints
        return self._int_names.get(_int_key(name))

    def _type_id(self, name: str) -> int:
        """Type id for a C type name without declarators (``struct x``, ``u64``, ``unsigned long``)."""
        if name.startswith(("struct ", "union ", "enum ")):
            tid = self._names.get(name)
        else:
            tid = self._names.get(name) or self._lookup_int(name) or self._aggregate_id(name)
        if tid is None:
            raise SymbolError(f"no type {name} in BTF")
        return tid

    # -- struct members --------------------------------------------------------
    def _struct_at(self, tid: int) -> StructType:
        cached = self._structs.get(tid)
        if cached is not None:
            return cached
        kind, info, size = self._head(tid)
        kind_flag = info >> 31
        words, i = self._words, self._starts[tid] + 3
        members: list[Member] = []
        for _ in range(info & 0xFFFF):
            name_off, mtype, moff = words[i], words[i + 1], words[i + 2]
            i += 3
            if kind_flag:
                offset, bits = moff & 0xFFFFFF, moff >> 24
            else:
                offset, bits = moff, 0
                base = self._strip(mtype)
                if base and self._head(base)[0] == KIND_INT:
                    # Old-style bitfield: the INT itself says how many bits and where.
                    _, _, int_size = self._head(base)
                    enc = words[self._starts[base] + 3]
                    if enc & 0xFF != int_size * 8 or (enc >> 16) & 0xFF:
                        offset, bits = offset + ((enc >> 16) & 0xFF), enc & 0xFF
            members.append(
                Member(
                    self._str(name_off),
                    offset,
                    bits,
                    self._spell(mtype, "", 0),
                    self._size_or_zero(mtype),
                    mtype,
                )
            )
        st = StructType(self._name(tid), size, members, "union" if kind == KIND_UNION else "struct", tid)
        self._structs[tid] = st
        return st

    def _find_member(self, tid: int, name: str, depth: int) -> tuple[int, Member] | None:
        """Search ``tid``'s members, descending into anonymous structs/unions in order, as C does."""
        if depth > _MAX_DEPTH:
            raise _malformed("anonymous members nest too deeply (a reference loop?)")
        for m in self._struct_at(tid).members:
            if m.name == name:
                return m.offset_bits, m
            if not m.name:
                sub = self._aggregate_of(m.type_id)
                if sub is not None:
                    found = self._find_member(sub, name, depth + 1)
                    if found is not None:
                        return m.offset_bits + found[0], found[1]
        return None

    # -- spelling --------------------------------------------------------------
    def _spell(self, tid: int, inner: str, depth: int) -> str:
        """C spelling of ``tid`` around the declarator ``inner`` (built inside-out, like cdecl)."""
        if depth > _MAX_DEPTH:
            raise _malformed("type chain does not end (a reference loop?)")
        if tid == 0:
            return _join("void", inner)
        kind, info, ref = self._head(tid)
        if kind in (KIND_INT, KIND_FLOAT, KIND_TYPEDEF):
            return _join(self._name(tid), inner)
        if kind in (KIND_STRUCT, KIND_UNION, KIND_ENUM, KIND_ENUM64, KIND_FWD):
            if kind == KIND_FWD:
                tag = "union" if info >> 31 else "struct"
            else:
                tag = {KIND_STRUCT: "struct", KIND_UNION: "union"}.get(kind, "enum")
            return _join(f"{tag} {self._name(tid) or '{...}'}", inner)
        if kind == KIND_PTR:
            target = ref
            while target and self._head(target)[0] == KIND_TYPE_TAG:
                target = self._head(target)[2]
            if target and self._head(target)[0] in (KIND_ARRAY, KIND_FUNC_PROTO):
                return self._spell(target, f"(*{inner})", depth + 1)
            return self._spell(target, "*" + inner, depth + 1)
        if kind in _QUALIFIERS:
            qual = _QUALIFIERS[kind]
            if ref and self._head(ref)[0] == KIND_PTR:  # char *const: the qualifier binds to the pointer
                return self._spell(ref, f"{qual} {inner}".rstrip(), depth + 1)
            return f"{qual} {self._spell(ref, inner, depth + 1)}"
        if kind == KIND_ARRAY:
            elem, nelems = self._array(tid)
            return self._spell(elem, f"{inner}[{nelems}]", depth + 1)
        if kind == KIND_FUNC_PROTO:
            words, i = self._words, self._starts[tid] + 3
            params = []
            for _ in range(info & 0xFFFF):
                name_off, ptype = words[i], words[i + 1]
                i += 2
                params.append("..." if ptype == 0 and name_off == 0 else self._spell(ptype, "", depth + 1))
            return self._spell(ref, f"{inner}({', '.join(params) or 'void'})", depth + 1)
        if kind in (KIND_FUNC, KIND_VAR):
            return self._spell(ref, _join(self._name(tid), inner), depth + 1)
        if kind in (KIND_TYPE_TAG, KIND_DECL_TAG):
            return self._spell(ref, inner, depth + 1)
        return _join(f"SEC({self._name(tid)})", inner)  # DATASEC


def _walk(words: array, strings: bytes) -> tuple[array, dict[str, int]]:
    """Record where each type starts and index the names C code would use.

    Every kind's record length must be right, or all later type ids shift;
    hence the per-kind tables and the final length check.
    """
    starts = array("I", [0])
    names: dict[str, int] = {}
    fixed, per_vlen = _FIXED_WORDS, _VLEN_WORDS
    n, i = len(words), 0
    add = starts.append
    pending: list[tuple[int, int, int]] = []  # (kind, name_off, type id) to name after the walk
    while i < n:
        if i + 3 > n:
            raise _malformed(f"type record at byte {i * 4} is truncated")
        name_off, info = words[i], words[i + 1]
        kind = (info >> 24) & 0x1F
        extra = fixed[kind]
        if extra < 0:
            raise _malformed(f"unknown kind {kind} for type id {len(starts)}")
        add(i)
        if name_off and kind in _NAMED_KINDS:
            pending.append((kind, name_off, len(starts) - 1))
        i += 3 + extra + per_vlen[kind] * (info & 0xFFFF)
    if i != n:
        raise _malformed(f"last type record (id {len(starts) - 1}) runs past the end of the type section")
    str_len = len(strings)
    find = strings.find
    for kind, off, tid in pending:
        if off >= str_len:
            raise _malformed(f"type id {tid} has name offset {off} past the string section ({str_len} bytes)")
        name = strings[off : find(b"\0", off)].decode("utf-8", "replace")
        key = name if kind in (KIND_TYPEDEF, KIND_INT, KIND_FLOAT) else f"{_NAMED_KINDS[kind]} {name}"
        if kind == KIND_FUNC:
            key = f"func {name}"  # functions share C's ordinary namespace, but not our typedef lookups
        old = names.get(key)
        if old is None:
            names[key] = tid
        elif kind in (KIND_STRUCT, KIND_UNION) and words[starts[old] + 1] & 0xFFFF == 0:
            names[key] = tid  # a later non-empty definition beats an empty one of the same name
    return starts, names


# Kinds whose names go in the index, and the C tag each lives under.
_NAMED_KINDS = {
    KIND_STRUCT: "struct", KIND_UNION: "union", KIND_ENUM: "enum", KIND_ENUM64: "enum",
    KIND_TYPEDEF: "", KIND_INT: "", KIND_FLOAT: "", KIND_FUNC: "func",
}  # fmt: skip


# -- ELF -------------------------------------------------------------------------
def _read_btf_section(path: Path) -> bytes:
    """Contents of ``.BTF``, found through the section headers only (mmap, no full ELF parse)."""
    try:
        with open(path, "rb") as f:
            try:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except (ValueError, OSError):  # empty file, or sysfs which cannot be mapped
                return _btf_from_buffer(f.read())
    except OSError as exc:
        raise SymbolError(f"cannot read: {exc.strerror or exc}") from None
    with mm:
        return _btf_from_buffer(mm)


def _btf_from_buffer(buf: bytes | mmap.mmap) -> bytes:
    if buf[:2] in (b"\x9f\xeb", b"\xeb\x9f"):
        return bytes(buf)  # already raw BTF (e.g. /sys/kernel/btf/vmlinux)
    if len(buf) < 64 or buf[:4] != b"\x7fELF":
        raise SymbolError("not an ELF file or raw BTF")
    ei_class, ei_data = buf[4], buf[5]
    if ei_class not in (1, 2) or ei_data not in (1, 2):
        raise SymbolError(f"unsupported ELF class {ei_class} / data encoding {ei_data}")
    e = "<" if ei_data == 1 else ">"
    if ei_class == 2:
        (shoff,) = struct.unpack_from(e + "Q", buf, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from(e + "HHH", buf, 0x3A)
        shdr = struct.Struct(e + "IIQQQQIIQQ")  # name type flags addr offset size link info align entsize
    else:
        (shoff,) = struct.unpack_from(e + "I", buf, 0x20)
        shentsize, shnum, shstrndx = struct.unpack_from(e + "HHH", buf, 0x2E)
        shdr = struct.Struct(e + "IIIIIIIIII")
    size = len(buf)
    if shoff == 0 or shentsize < shdr.size or shoff + shdr.size > size:
        raise SymbolError("ELF file has no section headers")

    def header(idx: int) -> tuple[int, int, int, int]:
        """(name offset, type, file offset, size) of section ``idx``."""
        at = shoff + idx * shentsize
        if at + shdr.size > size:
            raise SymbolError(f"ELF section header {idx} lies past the end of the file")
        h = shdr.unpack_from(buf, at)
        return h[0], h[1], h[4], h[5]

    if shnum == 0 or shstrndx == 0xFFFF:  # more than 0xff00 sections: real values live in section 0
        first = shdr.unpack_from(buf, shoff)
        shnum = shnum or first[5]
        shstrndx = first[6] if shstrndx == 0xFFFF else shstrndx
    if shstrndx >= shnum:
        raise SymbolError("ELF section name table index out of range")
    _, _, str_off, str_size = header(shstrndx)
    if str_off + str_size > size:
        raise SymbolError("ELF section name table lies past the end of the file")
    for idx in range(shnum):
        name_off, sh_type, off, sec_size = header(idx)
        if name_off + 5 <= str_size and buf[str_off + name_off : str_off + name_off + 5] == b".BTF\0":
            if sh_type == 8:  # SHT_NOBITS
                raise SymbolError(".BTF section has no contents in the file")
            if off + sec_size > size:
                raise SymbolError(".BTF section lies past the end of the file (truncated download?)")
            return bytes(buf[off : off + sec_size])
    raise SymbolError("no .BTF section (kernel built without CONFIG_DEBUG_INFO_BTF?)")
