"""What an optimized probe's detour computes in the guest, said without an architecture.

qprobe.events turns an event's ftrace filter into a tree of register
compares (:class:`Pred`, :class:`And`, :class:`Or`, :class:`Not`) and a
``count``/``hist`` key into a :class:`KeySpec`; the core hands them to the
architecture in :class:`qprobe.arch.DetourParams`, and the architecture
compiles them into the detour (x86_64: ``guestfilter.py``, ``guestagg.py``).
Registers are named as in pt_regs, from the layout's ``general`` registers
(:class:`qprobe.arch.RegisterLayout`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Pred:
    """A register, as a 64- or 32-bit integer, compared with a constant."""

    reg: str  # a pt_regs name from RegisterLayout.general
    bits: int  # 64 or 32: the low half for 32
    signed: bool
    op: str  # == != < <= > >= &
    const: int  # within the field's range


@dataclass(frozen=True)
class And:
    parts: tuple[GuestFilter, ...]


@dataclass(frozen=True)
class Or:
    parts: tuple[GuestFilter, ...]


@dataclass(frozen=True)
class Not:
    inner: GuestFilter


GuestFilter = Pred | And | Or | Not


@dataclass(frozen=True)
class KeySpec:
    """The key: register ``reg`` (a pt_regs name) read as a ``bits``-wide integer, or its log2 bucket."""

    reg: str
    bits: int  # 8, 16, 32 or 64
    signed: bool
    hist: bool  # the key is bpftrace's hist() bucket of the value: 0 negative, 1 zero, 2 + floor(log2 v)


__all__ = ["And", "GuestFilter", "KeySpec", "Not", "Or", "Pred"]
