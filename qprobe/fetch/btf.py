"""Function prototypes as a kernel's BTF gives them, for BTF fetch arguments.

With CONFIG_PROBE_EVENTS_BTF_ARGS (Linux 6.5 on) a kprobe event at a
function's entry or exit can name the function's parameters (``file``),
``$argN`` is listed under the Nth parameter's name, and an argument without
a type takes it from the parameter's BTF type.  The kernel looks the
function up by name in its BTF (``btf_find_func_proto``); this module holds
what the parser needs of the answer, and the rules of kernel/trace/trace_probe.c
(6.12) that map a BTF type to a fetch type.  ``qprobe.kernel.btf`` reads the
prototypes from vmlinux.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class CType:
    """A BTF type with typedefs and qualifiers skipped (``btf_type_skip_modifiers``).

    ``kind`` is ``int``, ``enum``, ``enum64``, ``ptr``, ``array``, ``struct``,
    ``union``, ``void`` or ``other``; ``bits`` and ``signed`` describe an ``int``
    (``BTF_INT_BITS``, ``BTF_INT_SIGNED``); ``target`` is what a pointer points
    to or an array holds, itself without a target (the parser looks one level
    down only); ``tid`` is a struct's or union's BTF id, to look up its members
    in ``btf``, the BTF that made the type (vmlinux's or a module's: their ids overlap).
    ``overlay`` is the type whose id is this type's ``size``/``type`` word (one
    union in ``struct btf_type``): a pointer's target, and for other kinds the
    type ``btf_type_is_char_ptr`` reads anyway, since 6.12 does not check that
    the type is a pointer (so an 8-byte integer is a char pointer where BTF id 8
    is ``const unsigned char``, as in Debian's 6.12).
    """

    kind: str
    bits: int = 0
    signed: bool = False
    target: CType | None = None
    tid: int = 0
    overlay: CType | None = field(default=None, compare=False)
    btf: Btf | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Member:
    """A struct or union member: its bit offset (anonymous members' included), bitfield width (0: none), type."""

    bit_offset: int
    bitfield: int
    type: CType


@dataclass(frozen=True)
class FuncProto:
    """A function's parameters (name, type) in order, and its return type (None: void)."""

    params: tuple[tuple[str, CType], ...]
    ret: CType | None


class Btf(Protocol):
    """What the parser asks of a kernel's BTF."""

    def proto(self, func: str) -> FuncProto | None:
        """The function's prototype (``btf_find_func_proto``), or None where BTF has no such function."""
        ...

    def offsetof(self, struct: str, path: str) -> int | None:
        """offsetof(struct ``struct``, ``path``) in bytes (``f_path.dentry``), or None."""
        ...

    def member(self, parent: CType, name: str) -> Member | None:
        """``btf_find_struct_member``: the member ``name`` of the struct or union ``parent``, or None."""
        ...


def fetch_type_name(t: CType) -> str | None:
    """``fetch_type_from_btf_type``: the fetch type of an untyped BTF argument (None: the default).

    Enums are s32/s64, pointers x64, integers by their width and sign; an
    unsigned integer of another width would be a bitfield, which a parameter
    is not, so it takes the default like every other kind.
    """
    if t.kind == "enum":
        return "s32"
    if t.kind == "enum64":
        return "s64"
    if t.kind == "ptr":
        return "x64"
    if t.kind == "int" and t.bits in (8, 16, 32, 64):
        return f"{'s' if t.signed else 'u'}{t.bits}"
    return None


def _is_uchar(t: CType | None) -> bool:
    return t is not None and t.kind == "int" and not t.signed and t.bits == 8


def is_char_ptr(t: CType) -> bool:
    """``btf_type_is_char_ptr``: ``type->type`` names an unsigned 8-bit integer (x86 builds with -funsigned-char)."""
    return _is_uchar(t.overlay if t.kind != "ptr" else t.target)


def is_char_array(t: CType) -> bool:
    """``btf_type_is_char_array``: an array of unsigned 8-bit integers."""
    return t.kind == "array" and _is_uchar(t.target)
