"""The uprobes' stub breakpoints, by virtual address, and why each one is there.

A uprobe is keyed by (file, offset), but the gdbstub stops at a virtual address: every address where some
process maps a probed offset gets one breakpoint, which a return instance waiting there may share.  The
breakpoint goes in with its first reason and out with its last.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from qprobe.vmm.machine import Machine, StopHandler

__all__ = ["UprobePoint", "UprobePoints"]


@dataclass
class UprobePoint:
    """A virtual address with a stub breakpoint: the probed offsets some mapping puts there, and returns."""

    keys: set[tuple[int, int]] = field(default_factory=set)  # (address_space, offset)
    returns: int = 0  # live return instances waiting here


class UprobePoints(Mapping[int, UprobePoint]):
    """Virtual address -> its point; changed only through the methods below, on the stop loop."""

    def __init__(self, machine: Machine, on_stop: StopHandler) -> None:
        """``on_stop(tid, registers)`` is called for a stop on any of the breakpoints."""
        self.machine = machine
        self.on_stop = on_stop
        self._at: dict[int, UprobePoint] = {}

    def __getitem__(self, va: int) -> UprobePoint:
        return self._at[va]

    def __iter__(self) -> Iterator[int]:
        return iter(self._at)

    def __len__(self) -> int:
        return len(self._at)

    def add(self, va: int, key: tuple[int, int] | None) -> UprobePoint:
        """The point at ``va``, its breakpoint put in if it had none; ``key`` a probed offset mapped there."""
        point = self._at.get(va)
        if point is None:
            point = self._at[va] = UprobePoint()
            self.machine.insert_stub_breakpoint(va)
            self.machine.stop_handlers[va] = self.on_stop
        if key is not None:
            point.keys.add(key)
        return point

    def hold(self, va: int) -> None:
        """A return instance waits at ``va``."""
        self.add(va, None).returns += 1

    def release(self, va: int) -> None:
        """A return instance no longer waits at ``va``."""
        point = self._at.get(va)
        if point is not None:
            point.returns -= 1
            self.prune(va, point)

    def prune(self, va: int, point: UprobePoint) -> None:
        """Take the breakpoint out if nothing is left for it to stop."""
        if not point.keys and not point.returns:
            self.remove(va)

    def remove(self, va: int) -> None:
        self._at.pop(va, None)
        self.machine.stop_handlers.pop(va, None)
        self.machine.remove_stub_breakpoint(va)
