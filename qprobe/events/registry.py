"""What events receive of the target they are armed on, narrowed to what they use.

Two views, each a Protocol that a target's registry (``qprobe.eventapi.EventAPI``) satisfies:

- :class:`EventHost` (here): what an armed event uses at a hit, whatever its
  probe kind: the architecture, the symbols, the task and clock of a hit, the
  timeline hits go through;
- a probe kind's host adds the backend that holds that kind's probes
  (:class:`qprobe.events.kprobe.KprobeHost`: ``kprobe_backend``);
- :class:`qprobe.events.define.EventRegistry` adds what defining an event checks
  against and records it in (the events table, the kernel's kprobe_events
  language, its trace events and ftrace sites, the modules followed).

A probe kind (kprobes today) is a backend the host holds and a TraceEvent
subclass that uses it; nothing in the events reaches into the core's probe
tables but through its backend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from qprobe.arch import Arch, PageTables
    from qprobe.core.regs import PtRegs
    from qprobe.events.timeline import Timeline
    from qprobe.kernel.program import Task
    from qprobe.kernel.symbols import ModuleText, Symbols


class Tasks(Protocol):
    """The task a hit interrupted, and the record its event may take (qprobe.kernel.program.KernelData)."""

    def read_task(self, addr: int | None = None, *, regs: Mapping[str, int] | None = None) -> Task: ...
    def snapshot(self, addr: int | None = None, *, regs: Mapping[str, int] | None = None) -> Task | None: ...
    def event_length_limit(self) -> int | None: ...


class Paged(Protocol):
    """The guest's page tables, for the user/kernel split fetches check (qprobe.vmm.memory.GuestMemory)."""

    paging: PageTables


class EventHost(Protocol):
    """What an armed event uses of its target at a hit."""

    arch: Arch
    symbols: Symbols
    timeline: Timeline

    # Read-only, so that the target's KernelData, GuestMemory and HitClock implement them.
    @property
    def kernel(self) -> Tasks: ...
    @property
    def mem(self) -> Paged: ...
    @property
    def clock(self) -> HitTimes: ...


class HitTimes(Protocol):
    """When a hit happened (qprobe.events.clock.HitClock)."""

    def hit_time(self, regs: PtRegs, recorded: bool = False) -> tuple[float, float]: ...
    def record_times(self, records: Sequence[tuple[int, int]]) -> list[tuple[float, float]]: ...  # (cycles, vCPU) each


class ModuleWatch(Protocol):
    """The target's following of module loads (qprobe.events.modules.ModuleNotifier), as events start it."""

    @property
    def started(self) -> bool: ...
    def start(self) -> None: ...
    def loaded(self) -> list[ModuleText]: ...


__all__ = ["EventHost", "HitTimes", "ModuleWatch", "Paged", "Tasks"]
