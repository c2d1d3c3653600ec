"""The guest as a Target's user meets it: commands in its shell, its console's oopses, waiting while it
runs, and what its probes recorded (folded on ``sync``, through record rings whose knobs are here)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

from qprobe.errors import TargetError, TargetGone
from qprobe.lifetime import LIVENESS_POLL

if TYPE_CHECKING:
    from qprobe.core.optimizer import Optimizer
    from qprobe.core.records import RecordRings
    from qprobe.events.timeline import Timeline
    from qprobe.vmm.console import Console, GuestShell, RunResult
    from qprobe.vmm.machine import Machine


class Hosting(Protocol):
    """What the guest's side uses of a target's parts (qprobe.parts.Parts)."""

    @property
    def console(self) -> Console | None: ...
    @property
    def guest_shell(self) -> GuestShell | None: ...
    @property
    def machine(self) -> Machine: ...
    @property
    def optimizer(self) -> Optimizer: ...
    @property
    def timeline(self) -> Timeline: ...


class Guest:
    """A target's guest: its shell, its console, its life, its probes' records."""

    def __init__(self, target: Hosting) -> None:
        self.target = target

    def run(self, command: str, timeout: float = 60.0) -> RunResult:
        """A shell command in the guest, its output exactly what it wrote; the counts synced when it is done."""
        t = self.target
        if t.guest_shell is None:
            raise TargetError("this target has no guest shell (attach with console=PATH)")
        t.machine.check_alive()
        try:
            result = t.guest_shell.run(command, timeout)
        except TargetGone:
            t.machine.check_alive(wait=2.0)  # the stop loop knows why QEMU went
            raise
        self.sync()
        return result

    def interrupt(self) -> None:
        """Ctrl-C the guest shell's foreground command (as ``run`` started it)."""
        if self.target.guest_shell is not None:
            self.target.guest_shell.interrupt()

    def oopses(self) -> list[str]:
        """The kernel's oops, BUG, WARNING and panic lines on its console since qprobe connected."""
        console = self.target.console
        return console.oopses() if console else []

    def wait(self, seconds: float | None) -> None:
        """Sleep while the VM runs: ``seconds`` (None: until interrupted), or until it is gone (TargetGone),
        which is noticed within LIVENESS_POLL."""
        deadline = None if seconds is None else time.monotonic() + seconds
        while True:
            self.target.machine.check_alive()
            left = LIVENESS_POLL if deadline is None else min(LIVENESS_POLL, deadline - time.monotonic())
            if left <= 0:
                return
            time.sleep(left)

    def sync(self) -> None:
        """Fold the in-guest counters and record rings now, not at the next 20 ms tick."""
        self.target.optimizer.sync_all()
        self.target.timeline.flush()

    @property
    def records(self) -> RecordRings | None:
        """The guest's record rings (only on qprobe's own QEMU, with shared RAM)."""
        return self.target.optimizer.records

    @property
    def records_lossy(self) -> bool:
        """Whether a full record ring drops a hit's record (True) or makes its vCPU wait (False)."""
        records = self.records
        return records is not None and records.lossy

    @records_lossy.setter
    def records_lossy(self, on: bool) -> None:
        records = self.records
        if records is None:
            if on:
                raise TargetError("records go through guest rings only on qprobe's own QEMU (shared RAM)")
            return
        records.set_lossy(on)

    @property
    def records_buffer_size_kb(self) -> int:
        """Each CPU's record ring in KiB: as laid out, or as it will be (0 without rings)."""
        records = self.records
        return records.size_kb if records is not None else 0

    @records_buffer_size_kb.setter
    def records_buffer_size_kb(self, kb: int) -> None:
        records = self.records
        if records is None:
            raise TargetError("records go through guest rings only on qprobe's own QEMU (shared RAM)")
        records.set_buffer_size_kb(kb)

    def record_waits(self) -> int:
        """Hits that found their CPU's record ring full and waited for the host to drain it."""
        records = self.records
        return records.waits() if records is not None else 0


__all__ = ["Guest", "Hosting"]
