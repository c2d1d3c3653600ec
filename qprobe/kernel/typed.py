"""Typed kernel data over live guest memory, from the kernel's own BTF.

``KObject`` is a value of a BTF type at an address: ``task.comm.string_()``,
``task.mm.start_brk.value_()``, ``task.pid.value_()``.  Member access
follows pointers to structs the way C's ``->`` does.  Method names end in
``_`` (as drgn's) so they never hide a member.

Why BTF and not drgn: the types come from the 4 MB ``.BTF`` section, parsed
in about 30 ms, where loading the 590 MB vmlinux's DWARF into drgn takes
seconds and hundreds of MB; and drgn would need a custom memory reader that
undoes KASLR for image addresses but not for pointers read from memory.
Linux 6.1's BTF describes per-CPU variables but not other globals, so
``Target.var(name, type)`` takes the type from the caller for those.
"""

from __future__ import annotations

from collections.abc import Callable

from qprobe.kernel.btf import KIND_ARRAY, KIND_ENUM, KIND_ENUM64, KIND_INT, KIND_PTR, KIND_STRUCT, KIND_UNION, Btf

Reader = Callable[[int, int], bytes]


class KObject:
    """A kernel object of BTF type ``type_id`` at ``address`` (read lazily from guest memory)."""

    __slots__ = ("_btf", "_read", "_tid", "address_")

    def __init__(self, btf: Btf, read: Reader, type_id: int, address: int) -> None:
        self._btf, self._read, self._tid, self.address_ = btf, read, type_id, address

    @classmethod
    def of(cls, btf: Btf, read: Reader, type_name: str, address: int) -> KObject:
        return cls(btf, read, btf._type_id(type_name), address)

    @property
    def type_(self) -> str:
        return self._btf.type_name(self._tid)

    def _kind(self) -> tuple[int, int, int, int]:
        tid = self._btf._strip(self._tid)
        kind, info, size_or_type = self._btf._head(tid)
        return tid, kind, info, size_or_type

    def __getattr__(self, name: str) -> KObject:
        if name.startswith("_"):
            raise AttributeError(name)
        tid, kind, _, ref = self._kind()
        obj = self
        if kind == KIND_PTR:  # C's ->: follow a pointer to a struct
            obj = KObject(self._btf, self._read, ref, self.value_())
            tid, kind, _, ref = obj._kind()
        if kind not in (KIND_STRUCT, KIND_UNION):
            raise AttributeError(f"{self.type_} has no members (asked for {name!r})")
        found = self._btf._find_member(tid, name, 0)
        if found is None:
            raise AttributeError(f"{self._btf.type_name(tid)} has no member {name!r}")
        bits, member = found
        if member.bitfield_size:
            raise AttributeError(f"{name} is a bitfield; read it with value_() on the containing word")
        return KObject(self._btf, self._read, member.type_id, obj.address_ + bits // 8)

    def __getitem__(self, index: int) -> KObject:
        tid, kind, _, ref = self._kind()
        if kind == KIND_ARRAY:
            elem, _n = self._btf._array(tid)
            return KObject(self._btf, self._read, elem, self.address_ + index * self._btf._size_or_zero(elem))
        if kind == KIND_PTR:
            return KObject(self._btf, self._read, ref, self.value_() + index * self._btf._size_or_zero(ref))
        raise TypeError(f"{self.type_} cannot be indexed")

    def value_(self) -> int:
        """The integer value of an int, enum or pointer."""
        tid, kind, info, size = self._kind()
        if kind == KIND_PTR:
            return int.from_bytes(self._read(self.address_, 8), "little")
        if kind in (KIND_INT, KIND_ENUM, KIND_ENUM64):
            signed = bool(self._btf._words[self._btf._starts[tid] + 3] >> 24 & 1) if kind == KIND_INT else \
                bool(info >> 31)  # fmt: skip
            return int.from_bytes(self._read(self.address_, size), "little", signed=signed)
        raise TypeError(f"{self.type_} is not a scalar; use a member or string_()")

    def string_(self, limit: int = 4096) -> str:
        """A char array or char pointer as a string (up to its NUL)."""
        tid, kind, _, _ = self._kind()
        if kind == KIND_ARRAY:
            _elem, n = self._btf._array(tid)
            data = self._read(self.address_, n)
        elif kind == KIND_PTR:
            addr, data = self.value_(), b""
            while b"\0" not in data and len(data) < limit:
                data += self._read(addr + len(data), 64)
        else:
            raise TypeError(f"{self.type_} is not a string")
        return data.split(b"\0")[0].decode("utf-8", "replace")

    def __int__(self) -> int:
        return self.value_()

    def __repr__(self) -> str:
        return f"({self.type_}) at {self.address_:#x}"
