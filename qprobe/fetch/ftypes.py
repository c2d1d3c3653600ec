"""Fetch-argument types (``:u32``, ``:x8[4]``, ``:b4@2/32``, ``:string``...).

Mirrors ``probe_fetch_types`` and ``find_fetch_type`` in
kernel/trace/trace_probe.c of Linux 6.1 (x86_64): the default type is
``x64``, ``symbol`` is an alias of ``u64`` printed with ``%pS``, ``x*`` types
print as ``0x%x`` without zero padding, and a bitfield is stored in an
unsigned container of 8/16/32/64 bits.  6.1.0 has no ``symstr``, ``char`` or
BTF types; ``symstr`` and ``char`` are accepted where the kernel's Dialect says so.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .kstrto import kstrtoul, simple_strtoul

U64_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class Bitfield:
    """``b<bits>@<offset>/<container>``; the value is ``(v >> offset) & (2**bits - 1)``."""

    bits: int
    offset: int
    container: int  # container size in bits: 8, 16, 32 or 64

    @property
    def lshift(self) -> int:
        """The kernel's ``lshift`` (an unsigned char, hence the mask)."""
        return (self.container - self.bits - self.offset) & 0xFF

    @property
    def rshift(self) -> int:
        """The kernel's ``rshift`` (an unsigned char)."""
        return (self.container - self.bits) & 0xFF

    def extract(self, value: int) -> int:
        """``fetch_apply_bitfield``: shift left then right inside the container."""
        mask = (1 << self.container) - 1
        return ((value << self.lshift) & mask) >> self.rshift


@dataclass(frozen=True)
class FetchType:
    """How one argument is stored and printed.

    ``name`` is the kernel's fetch_type name (a bitfield's name is that of its
    unsigned container, as in the kernel, so ``b4@4/32`` and ``u32`` are the
    "same type" when probes are appended to an event).  ``size``, ``signed``
    and ``fmttype`` are what the event's ``format`` file shows; for strings
    that is the 32-bit ``__data_loc`` word.  ``array`` is the element count,
    0 for a scalar.
    """

    name: str
    size: int
    signed: bool
    hex: bool = False
    string: bool = False
    user: bool = False  # "ustring"
    symbol: bool = False
    char: bool = False  # printed as '%c'
    fmttype: str = ""
    bitfield: Bitfield | None = None
    array: int = 0
    spec: str | None = None  # the type text as written after ':' (None = default)

    @property
    def bits(self) -> int:
        """Width of the stored integer (the value size, not the __data_loc)."""
        return self.size * 8

    def with_array(self, count: int, spec: str | None) -> FetchType:
        """Same element type, as an array of ``count`` (0 = scalar)."""
        return replace(self, array=count, spec=spec)


def _int(name: str, size: int, signed: bool = False, hex_: bool = False) -> FetchType:
    fmttype = ("s" if signed else "u") + str(size * 8)
    return FetchType(name=name, size=size, signed=signed, hex=hex_, fmttype=fmttype)


BASIC_TYPES: dict[str, FetchType] = {
    "string": FetchType("string", 4, True, string=True, fmttype="__data_loc char[]"),
    "ustring": FetchType("ustring", 4, True, string=True, user=True, fmttype="__data_loc char[]"),
    "u8": _int("u8", 1),
    "u16": _int("u16", 2),
    "u32": _int("u32", 4),
    "u64": _int("u64", 8),
    "s8": _int("s8", 1, True),
    "s16": _int("s16", 2, True),
    "s32": _int("s32", 4, True),
    "s64": _int("s64", 8, True),
    "x8": _int("x8", 1, hex_=True),
    "x16": _int("x16", 2, hex_=True),
    "x32": _int("x32", 4, hex_=True),
    "x64": _int("x64", 8, hex_=True),
    "symbol": FetchType("symbol", 8, False, symbol=True, fmttype="u64"),
}
# Not in 6.1.0, accepted when the kernel's Dialect lists them: symstr (Linux 6.2, "tracing/probes: Add
# symstr type for dynamic events", and stable backports), the value printed as a string holding its %pS
# text; char (in 6.12's probe_fetch_types: ASSIGN_FETCH_TYPE_ALIAS(char, u8, u8, 0)), a u8 printed
# as '%c'.
OPTIONAL_FETCH_TYPES: dict[str, FetchType] = {
    "symstr": FetchType("symstr", 4, True, string=True, symbol=True, fmttype="__data_loc char[]"),
    "char": FetchType("char", 1, False, char=True, fmttype="u8"),
}
DEFAULT_FETCH_TYPE = "x64"  # x##BITS_PER_LONG
STRING = BASIC_TYPES["string"]


def find_fetch_type(spec: str | None, optional: frozenset[str] = frozenset()) -> FetchType | None:
    """``find_fetch_type``: the type named ``spec`` (None = default), or None.

    ``optional`` names the types of :data:`OPTIONAL_FETCH_TYPES` the kernel accepts.

    A spec starting with ``b`` is a bitfield: only the container after ``/`` is
    checked here (``parse_bitfield`` checks the rest later, as the kernel
    does, so that each mistake gets the kernel's own error).
    """
    if spec is None:
        return BASIC_TYPES[DEFAULT_FETCH_TYPE]
    if spec.startswith("b"):
        slash = spec.find("/")
        if slash < 0:
            return None
        container = kstrtoul(spec[slash + 1 :], 0)
        if container not in (8, 16, 32, 64):
            return None
        return BASIC_TYPES[f"u{container}"]
    if spec in optional:
        return OPTIONAL_FETCH_TYPES.get(spec)
    return BASIC_TYPES.get(spec)


def parse_bitfield(spec: str, container_size: int) -> Bitfield | None:
    """``__parse_bitfield_probe_arg`` minus the instruction bookkeeping.

    Returns None where the kernel logs "Invalid bitfield": zero width, a
    missing ``@`` or ``/``, no offset digits, or width + offset wider than
    the container.  Numbers wrap like ``simple_strtoul`` does.
    """
    width, end = simple_strtoul(spec[1:], 0)
    end += 1
    if width == 0 or spec[end : end + 1] != "@":
        return None
    start = end + 1
    offset, used = simple_strtoul(spec[start:], 0)
    if used == 0 or spec[start + used : start + used + 1] != "/":
        return None
    bits = container_size * 8
    if bits < ((width + offset) & U64_MASK):
        return None
    return Bitfield(width, offset, bits)
