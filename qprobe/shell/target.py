"""What the shell uses of a target: qprobe.api.Target's public API, as a Protocol.

The shell's commands work on a :class:`ShellTarget`; qprobe.api.Target is
one, and so is the unit tests' fake (tests/unit/shell/shell_fakes.py, checked
by tests/unit/shell/test_shell_target.py), so the shell needs no fallbacks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from qprobe.events.funcs import ProbeTables, RunningTarget

if TYPE_CHECKING:
    import drgn

    from qprobe.arch import Arch
    from qprobe.core.kprobe import Kprobe, Kretprobe
    from qprobe.core.point import ProbePoint
    from qprobe.events import EventHit, TraceEvent, Wildcard
    from qprobe.events.timeline import Timeline
    from qprobe.fetch import Definition, ProbeEvent
    from qprobe.kernel.program import KernelData, Stack
    from qprobe.vmm.console import RunResult


class ShellProbes(ProbeTables, Protocol):
    """The probe table, as ``list``/``stats``/``enabled`` read it."""

    enabled: bool

    @property
    def points(self) -> dict[int, ProbePoint]: ...


@runtime_checkable
class ShellTarget(RunningTarget, Protocol):
    """Everything the shell's commands ask of a target."""

    arch: Arch
    kernel: KernelData
    events: dict[str, TraceEvent]
    slide: int
    timeline: Timeline

    @property
    def kprobes(self) -> ShellProbes: ...
    @property
    def vcpus(self) -> int: ...
    @property
    def prog(self) -> drgn.Program: ...
    def add_event(self, definition: str | Definition | ProbeEvent, callback: Callable[[EventHit], None] | None = None,
                  filter: str | None = None) -> TraceEvent: ...  # fmt: skip
    def add_events(self, definition: str | Definition, callback: Callable[[EventHit], None] | None = None,
                   filter: str | None = None) -> Wildcard: ...  # fmt: skip
    def remove_events(self, events: Iterable[TraceEvent | str]) -> None: ...
    def resolve_user_symbol(self, path: str, spec: str) -> int: ...
    def interrupt_guest(self) -> None: ...
    def record_waits(self) -> int: ...
    def wait(self, seconds: float | None = None) -> None: ...
    def interrupt_when_gone(self) -> AbstractContextManager[None]: ...
    def enable_kprobe(self, kp: Kprobe) -> None: ...
    def disable_kprobe(self, kp: Kprobe) -> None: ...
    def enable_kretprobe(self, rp: Kretprobe) -> None: ...
    def disable_kretprobe(self, rp: Kretprobe) -> None: ...
    def list_probes(self) -> str: ...
    def set_kprobes_enabled(self, on: bool) -> None: ...
    def set_kprobes_optimization(self, on: bool) -> None: ...
    def blacklist(self) -> list[str]: ...
    def read(self, addr: int | str, size: int) -> bytes: ...
    def registers(self, vcpu: int = 0) -> dict[str, int]: ...
    def stack_trace(self, vcpu: int = 0) -> tuple[dict[str, int], Stack | None]: ...
    def gdb_command(self, command: str) -> str | None: ...
    def run(self, command: str, timeout: float = 60.0) -> RunResult: ...
    def sync(self) -> None: ...


__all__ = ["ShellProbes", "ShellTarget"]
