"""Function prototypes from the kernel's own BTF, as its kprobe_events parser finds them.

A kernel built with CONFIG_DEBUG_INFO_BTF carries its BTF in vmlinux's
``.BTF`` section (``__start_BTF``..``__stop_BTF`` at run time).  The probe
parser's ``btf_find_func_proto`` (kernel/trace/trace_btf.c) takes the first
``BTF_KIND_FUNC`` of the name and its ``FUNC_PROTO``: the parameters' names
and types.  This reads the same section from the vmlinux file on the host;
the format is include/uapi/linux/btf.h's.  A function that vmlinux's BTF
lacks is looked up in the loaded modules' BTF, as ``bpf_find_btf_id`` does
after vmlinux; that BTF is read from the guest (``module_btfs``), since the
kernel keeps its own parsed copy of each module's ``.BTF``.
"""

from __future__ import annotations

import struct

import drgn
from drgn.helpers.linux.list import list_for_each_entry

from qprobe.errors import QprobeError
from qprobe.fetch.btf import CType, FuncProto, Member
from qprobe.kernel.symbols import Symbols

BTF_MAGIC = 0xEB9F
# BTF_KIND_* (include/uapi/linux/btf.h)
INT, PTR, ARRAY, STRUCT, UNION, ENUM, FWD, TYPEDEF, VOLATILE, CONST, RESTRICT = range(1, 12)
FUNC, FUNC_PROTO, VAR, DATASEC, FLOAT, DECL_TAG, TYPE_TAG, ENUM64 = range(12, 20)
MODIFIERS = frozenset({TYPEDEF, VOLATILE, CONST, RESTRICT, TYPE_TAG})
BTF_INT_SIGNED = 1


def _extra(kind: int, vlen: int) -> int:
    """Bytes that follow a type's 12-byte ``struct btf_type``."""
    if kind in (INT, VAR, DECL_TAG):
        return 4
    if kind == ARRAY:
        return 12
    if kind in (STRUCT, UNION, DATASEC, ENUM64):
        return 12 * vlen
    if kind in (ENUM, FUNC_PROTO):
        return 8 * vlen
    return 0


class KernelBtf:
    """The types of one BTF blob, by id, and its functions by name.

    A module's BTF is split BTF on top of vmlinux's (``base``): its type ids
    continue after the base's last one and its string offsets after the base's
    string section, so both sections are read as the base's followed by the
    module's.  ``proto`` finds only the blob's own functions.
    """

    def __init__(self, data: bytes, base: KernelBtf | None = None) -> None:
        magic, _version, _flags, hdr_len, type_off, type_len, str_off, str_len = struct.unpack_from("<HBBIIIII", data)
        if magic != BTF_MAGIC:
            raise QprobeError(f"not BTF (magic {magic:#x})")
        types = data[hdr_len + type_off : hdr_len + type_off + type_len]
        strings = data[hdr_len + str_off : hdr_len + str_off + str_len]
        self._types: list[tuple[int, int, int, int]] = [(0, 0, 0, 0)]  # id 0 is void
        self._extra_at: list[int] = [0]
        self._kflag: list[bool] = [False]
        self._funcs: dict[str, int] = {}
        self._structs: dict[str, int] = {}
        shift = 0
        if base is not None:
            self._types, self._extra_at, self._kflag = list(base._types), list(base._extra_at), list(base._kflag)
            self._structs = dict(base._structs)
            shift = len(base._data)
            types, strings = base._data + types, base._strings + strings
        self._data: bytes = types
        self._strings: bytes = strings
        pos = shift
        while pos + 12 <= len(types):
            name_off, info, size_type = struct.unpack_from("<III", types, pos)
            kind, vlen = (info >> 24) & 0x1F, info & 0xFFFF
            self._types.append((kind, name_off, size_type, vlen))
            self._extra_at.append(pos + 12)
            self._kflag.append(bool(info >> 31))
            if kind == FUNC:
                self._funcs.setdefault(self._name(name_off), len(self._types) - 1)
            elif kind == STRUCT and name_off:
                self._structs.setdefault(self._name(name_off), len(self._types) - 1)
            pos += 12 + _extra(kind, vlen)

    @classmethod
    def of(cls, symbols: Symbols) -> KernelBtf | None:
        """The BTF of the vmlinux ``symbols`` describes, or None if it has none."""
        if "__start_BTF" not in symbols or "__stop_BTF" not in symbols:
            return None
        start = symbols.address("__start_BTF")
        try:
            return cls(symbols.file_bytes(start, symbols.address("__stop_BTF") - start))
        except (QprobeError, struct.error):
            return None

    def _name(self, off: int) -> str:
        end = self._strings.find(b"\0", off)
        return self._strings[off : end if end >= 0 else len(self._strings)].decode("utf-8", "replace")

    def _skip(self, tid: int) -> int:
        """``btf_type_skip_modifiers``: the id behind typedefs and qualifiers."""
        for _ in range(64):  # a loop would be a broken BTF
            if tid >= len(self._types) or self._types[tid][0] not in MODIFIERS:
                break
            tid = self._types[tid][2]
        return tid

    def ctype(self, tid: int, depth: int = 1) -> CType:
        """The type ``tid`` with modifiers skipped; a pointer's or array's target to ``depth`` levels.

        Every kind but a pointer also gets its ``overlay``: the type its size word names as an id.
        """
        tid = self._skip(tid)
        if tid == 0 or tid >= len(self._types):
            return CType("void")
        kind, _name, size_type, _vlen = self._types[tid]
        overlay = self.ctype(size_type, 0) if depth and kind != PTR else None
        if kind == INT:
            (enc,) = struct.unpack_from("<I", self._data, self._extra_at[tid])
            return CType("int", bits=enc & 0xFF, signed=bool((enc >> 24) & BTF_INT_SIGNED), overlay=overlay)
        if kind == ENUM:
            return CType("enum", overlay=overlay)
        if kind == ENUM64:
            return CType("enum64", overlay=overlay)
        if kind in (STRUCT, UNION):
            return CType("struct" if kind == STRUCT else "union", tid=tid, overlay=overlay, btf=self)
        if kind in (PTR, ARRAY):
            target = size_type if kind == PTR else struct.unpack_from("<I", self._data, self._extra_at[tid])[0]
            return CType("ptr" if kind == PTR else "array", target=self.ctype(target, depth - 1) if depth else None,
                          overlay=overlay)  # fmt: skip
        return CType("other", overlay=overlay)

    def proto(self, func: str) -> FuncProto | None:
        """``btf_find_func_proto`` + ``btf_get_func_param``: the function's parameters and return type."""
        fid = self._funcs.get(func)
        if fid is None:
            return None
        pid = self._types[fid][2]
        if pid >= len(self._types) or self._types[pid][0] != FUNC_PROTO:
            return None
        _kind, _name, ret, vlen = self._types[pid]
        at = self._extra_at[pid]
        params = []
        for i in range(vlen):
            name_off, tid = struct.unpack_from("<II", self._data, at + 8 * i)
            params.append((self._name(name_off), self.ctype(tid)))
        return FuncProto(tuple(params), None if ret == 0 else self.ctype(ret))

    def _members(self, tid: int) -> list[tuple[str, int, int, int]]:
        """(name, type id, bit offset, bitfield width) of a struct's or union's members.

        With the type's kflag the offset word holds both (``BTF_MEMBER_BIT_OFFSET``,
        ``BTF_MEMBER_BITFIELD_SIZE``); without it, the bit offset alone.
        """
        vlen = self._types[tid][3]
        at = self._extra_at[tid]
        kflag = self._kflag[tid]
        out = []
        for i in range(vlen):
            name_off, mtype, offset = struct.unpack_from("<III", self._data, at + 12 * i)
            bits = (offset & 0xFFFFFF, offset >> 24) if kflag else (offset, 0)
            out.append((self._name(name_off) if name_off else "", mtype, *bits))
        return out

    def _find(self, tid: int, name: str) -> tuple[int, int, int] | None:
        """``btf_find_struct_member``: (bit offset, bitfield width, type id) of ``name`` in struct/union ``tid``.

        Named members first, then those of anonymous members, the last one met first (its stack).
        """
        tid = self._skip(tid)
        if tid >= len(self._types) or self._types[tid][0] not in (STRUCT, UNION):
            return None
        stack: list[tuple[int, int]] = []
        base = 0
        while True:
            for mname, mtype, offset, width in self._members(tid):
                if not mname:
                    inner = self._skip(mtype)
                    if self._types[inner][0] in (STRUCT, UNION) and len(stack) < 16:  # BTF_ANON_STACK_MAX
                        stack.append((inner, base + offset))
                elif mname == name:
                    return base + offset, width, mtype
            if not stack:
                return None
            tid, base = stack.pop()

    def member(self, parent: CType, name: str) -> Member | None:
        """The member ``name`` of the struct or union ``parent`` (a CType this BTF made)."""
        found = self._find(parent.tid, name) if parent.kind in ("struct", "union") else None
        return None if found is None else Member(found[0], found[1], self.ctype(found[2]))

    def offsetof(self, struct_name: str, path: str) -> int | None:
        """offsetof(struct ``struct_name``, ``path``) in bytes (``d_name.name``), or None if BTF lacks it."""
        tid = self._structs.get(struct_name)
        bits = 0
        for name in path.split("."):
            found = None if tid is None else self._find(tid, name)
            if found is None:
                return None
            bits += found[0]
            tid = found[2]
        return bits // 8


def module_btfs(prog: drgn.Program) -> list[tuple[int, bytes]]:
    """(address of its ``struct btf``, raw BTF) of every loaded module that has BTF, in load order.

    Since Linux 5.11 (36e68442d1af, "bpf: Load and verify kernel module BTFs") the kernel
    parses a module's ``.BTF`` section as it loads it and keeps a copy in a ``struct btf`` on
    the ``btf_modules`` list (newest first); the section itself is freed with the load image.
    A kernel without CONFIG_DEBUG_INFO_BTF_MODULES, or a vmlinux whose debug info lacks the
    list, gives none.
    """
    try:
        head = prog.object("btf_modules")
        entries = list(list_for_each_entry("struct btf_module", head.address_of_(), "list"))
        blobs = [(e.btf.value_(), prog.read(e.btf.data.value_(), e.btf.data_size.value_())) for e in entries]
    except (LookupError, drgn.FaultError):
        return []
    return blobs[::-1]
