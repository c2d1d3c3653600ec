"""The cycle counter facet (:class:`CycleCounter`): the guest's sched_clock and the host's stop clock.

ftrace stamps events with ``sched_clock()`` (or a clock built on it), and
``sched_clock()`` is the architecture's: x86's ``native_sched_clock`` scales
the TSC by the per-CPU ``cyc2ns`` (arch/x86/kernel/tsc.c); arm64's is the
generic one over the architected timer's CNTVCT_EL0
(kernel/time/sched_clock.c).  The facet says how to read that counter at a
hit, how to compute ``sched_clock()`` from it, and what the host can read
at a VM stop to predict it; ``qprobe.kernel.clock`` builds the neutral
trace clock (``local``/``global``, the never-back clamp, recalibration)
on top.  An architecture without the facet has hits timed by the host.

The architecture layer sits below the kernel layer, so the facet's
factories are handed the running kernel as a :class:`GuestKernel`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import drgn


class GuestKernel(Protocol):
    """The running guest kernel as the facet's factories read it (``qprobe.kernel.clock`` hands one over)."""

    @property
    def prog(self) -> drgn.Program:
        """The kernel's drgn Program (the caller has checked that it has debug info)."""
        ...

    def address(self, name: str) -> int | None:
        """The running address of vmlinux's symbol ``name``, or None where it has none."""
        ...

    def symbolize(self, addr: int) -> str: ...
    def read(self, addr: int, size: int) -> bytes:
        """``size`` bytes of kernel virtual memory at ``addr``."""
        ...


class SchedClock(Protocol):
    """The guest's ``sched_clock()`` computed on the host from a counter value."""

    def ns(self, cycles: int, cpu: int) -> int:
        """What ``sched_clock()`` returns on ``cpu`` when its read of the counter gives ``cycles``."""
        ...

    def ns_many(self, points: Sequence[tuple[int, int]]) -> list[int]:
        """``ns`` of each (cycles, CPU), in order, the guest's state read once a CPU for them all (a run of
        ring records, converted together)."""
        ...


class StopTimer(Protocol):
    """A clock of the VM's virtual time that the host reads while the VM is stopped (x86: the HPET).

    QEMU stops the guest's counter with the VM and lets both run on together,
    so the counter is a linear function of this clock's time.
    """

    def ns(self) -> int:
        """The VM's virtual time now, in ns; called on the stop loop's thread."""
        ...


@dataclass(frozen=True)
class CycleCounter:
    """The cycle counter the kernel's sched_clock reads, as the host computes the guest's clocks from it.

    ``function`` reads it; ``after_read`` finds where the value just read is in
    registers, and ``value`` reads it there.  ``sched_clock`` gives the
    kernel's ``sched_clock()`` as a function of the counter, or says why the
    kernel's is not (a paravirtual clock, say).  ``hz`` is the counter's rate
    by the kernel's own calibration (0: unknown).  ``stop_timer``, given a
    reader of guest physical memory (``(address, size) -> bytes``, used on the
    stop loop's thread, where it is called), gives the clock the host times
    VM stops with, or says why there is none.
    """

    function: str
    after_read: Callable[[bytes, int], int | None]
    value: Callable[[Mapping[str, int]], int]
    sched_clock: Callable[[GuestKernel], SchedClock | str]
    hz: Callable[[GuestKernel], int]
    stop_timer: Callable[[GuestKernel, Callable[[int, int], bytes]], StopTimer | str]


__all__ = ["CycleCounter", "GuestKernel", "SchedClock", "StopTimer"]
