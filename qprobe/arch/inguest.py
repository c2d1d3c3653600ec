"""What an optimized probe's detour computes in the guest, said without an architecture.

qprobe.events binds an event's ftrace filter to registers (the tree
qprobe.fetch.filter parses, each leaf given its :class:`~qprobe.fetch.filter.GuestReg`:
a :data:`GuestFilter`), and turns a map the shell aggregates into (its key's parts
and value) into a :class:`KeySpec`; the core hands them to the architecture in
:class:`qprobe.arch.DetourParams`, and the architecture compiles them into the
detour (x86_64: ``guestfilter.py``, ``guestagg.py``).  Registers are named as in
pt_regs, from the layout's ``general`` registers (:class:`qprobe.arch.RegisterLayout`).
"""

from __future__ import annotations

from dataclasses import dataclass

from qprobe.fetch.filter import Node

# A filter tree every leaf of which has its register (qprobe.fetch.filter.bind): the host's tree, bound.
GuestFilter = Node


KEY_KINDS = ("reg", "hist", "cpu", "pid", "comm")


@dataclass(frozen=True)
class KeyPart:
    """One part of an in-guest map's key, computed by the detour at the hit.

    ``reg``: register ``reg`` (a pt_regs name) read as a ``bits``-wide integer; ``hist``: bpftrace's
    hist() bucket of that integer (0 negative, 1 zero, 2 + floor(log2 v)); ``cpu``: the CPU's
    number; ``pid``: the running task's pid (task_struct.pid, ftrace's common_pid); ``comm``: its
    16-byte name, which takes two words of the key.
    """

    kind: str
    reg: str = ""
    bits: int = 64  # 8, 16, 32 or 64
    signed: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KEY_KINDS:
            raise ValueError(f"key part {self.kind!r}")

    @property
    def words(self) -> int:
        return 2 if self.kind == "comm" else 1


# A map's key as the architecture decodes it, one item per KeyPart: ``comm`` as text, ``pid`` signed,
# ``reg`` the register's 64-bit word (the host formats it as the argument's type), ``cpu`` and ``hist`` ints.
MapKey = tuple[int | str, ...]


@dataclass(frozen=True)
class KeySpec:
    """An in-guest map: its key's parts, and the integer whose sum, min and max each slot keeps.

    Every slot counts its hits; with a ``value`` (a ``reg`` part) it also keeps that value's
    64-bit wrapping sum and its min and max, compared signed or not as the value's type is.
    """

    parts: tuple[KeyPart, ...]
    value: KeyPart | None = None

    @property
    def words(self) -> int:
        return sum(p.words for p in self.parts)


@dataclass(frozen=True)
class MapSlot:
    """One key's entry of an in-guest map, summed over the CPUs; ``total``, ``min`` and ``max`` are the
    value's, as its type reads them."""

    count: int
    total: int = 0
    min: int = 0
    max: int = 0

    def merge(self, other: MapSlot) -> MapSlot:
        """The same key's slot on two CPUs, as one."""
        return MapSlot(self.count + other.count, self.total + other.total, min(self.min, other.min),
                       max(self.max, other.max))  # fmt: skip


__all__ = ["KEY_KINDS", "GuestFilter", "KeyPart", "KeySpec", "MapSlot"]
