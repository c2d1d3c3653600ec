"""The uprobe kind of event: a uprobe_events definition on a file of the guest, armed as a Uprobe.

:class:`UprobeBackend` is all the events see of the core's uprobes (the target holds one as
``uprobe_backend``); :class:`UprobeTraceEvent` makes its probe from its definition
(:class:`qprobe.fetch.UprobeEvent`) and records each hit as trace_uprobe.c would print it:
``name: (0x401136) a=1``, a return ``name: (0x4011a0 <- 0x401136) ret=2``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from qprobe.core.uprobe import Uprobe, Uretprobe
from qprobe.core.uprobes import UprobeManager
from qprobe.events.context import HostContext
from qprobe.events.event import TraceEvent
from qprobe.events.registry import EventHost
from qprobe.fetch import UprobeContext, format_uprobe_event, format_uprobe_hit

if TYPE_CHECKING:
    from qprobe.core.regs import PtRegs
    from qprobe.fetch import UprobeEvent
    from qprobe.fetch.args import Value


class UprobeBackend:
    """The uprobes of uprobe events, on the target's uprobe table."""

    def __init__(self, uprobes: UprobeManager) -> None:
        self._uprobes = uprobes

    def register(self, events: Sequence[TraceEvent]) -> None:
        """All or nothing."""
        done: list[Uprobe] = []
        try:
            for te in events:
                if isinstance(te, UprobeTraceEvent) and te.probe is not None:
                    self._uprobes.register_uprobe(te.probe)
                    done.append(te.probe)
        except BaseException:
            for up in done:
                self._uprobes.unregister_uprobe(up)
            raise

    def unregister(self, events: Sequence[TraceEvent]) -> None:
        for te in events:
            if isinstance(te, UprobeTraceEvent) and te.probe is not None and te.probe.registered:
                self._uprobes.unregister_uprobe(te.probe)

    def function_name(self, path: str, offset: int) -> str:
        """The name of the function of ``path`` that holds file byte ``offset`` (``path:0xOFFS`` if none does)."""
        try:
            elf = self._uprobes.elf(path)
        except Exception:  # a file whose ELF cannot be read names no function
            return f"{path}:{offset:#x}"
        return elf.function_at(offset) or f"{path}:{offset:#x}"


class UprobeHost(EventHost, Protocol):
    """What a uprobe event uses of its target: the host's view and the uprobe backend."""

    uprobe_backend: UprobeBackend


class _UserContext(HostContext):
    """A uprobe hit's FetchContext: the user-mode registers, and where the probed file is mapped."""

    def __init__(self, host: EventHost, regs: PtRegs, retval: int | None, base: int) -> None:
        super().__init__(host, regs, retval)
        self._base = base

    def file_address(self, offset: int) -> int:
        """translate_user_vaddr: the probed address, less the probe's file offset, plus ``offset``."""
        return self._base + offset


@dataclass
class UprobeTraceEvent(TraceEvent):
    """A uprobe_events definition on a file of the guest, armed as a Uprobe (``r``: a Uretprobe)."""

    host: UprobeHost
    probe: Uprobe | None = None

    @property
    def udef(self) -> UprobeEvent:
        return self.definition  # type: ignore[return-value]

    @property
    def backend(self) -> UprobeBackend:
        return self.host.uprobe_backend

    def make_probe(self) -> None:
        ev = self.udef
        if ev.is_return:
            self.probe = Uretprobe(ev.path, ev.offset, ret_handler=self._returned)
        else:
            self.probe = Uprobe(ev.path, ev.offset, handler=self._hit)

    @property
    def registered(self) -> bool:
        return self.probe is not None and self.probe.registered

    @property
    def nmissed(self) -> int:
        return self.probe.nmissed if self.probe is not None else 0

    @property
    def lost(self) -> int:
        return 0  # every hit is a VM stop: none goes through a ring

    @property
    def maxactive(self) -> int:
        return 0

    @property
    def function_name(self) -> str:
        ev = self.udef
        return self.backend.function_name(ev.path, ev.offset)

    def listing(self) -> str:
        """The lines ``cat uprobe_events`` shows for the event, one per probe."""
        return "\n".join(format_uprobe_event(te.udef) for te in self.probes() if isinstance(te, UprobeTraceEvent))

    def _hit(self, up: Uprobe, regs: PtRegs) -> None:
        self._record(regs, regs.ip, None, None)

    def _returned(self, up: Uprobe, func: int, regs: PtRegs) -> None:
        self._record(regs, regs.ip, func, regs.return_value())

    def _context(self, regs: PtRegs, retval: int | None, comm: str | None, ip: int, func: int | None,
                 entry: dict[int, int] | None) -> UprobeContext:  # fmt: skip
        probed = ip if func is None else func
        return UprobeContext(_UserContext(self.host, regs, retval, probed - self.udef.offset))

    def _body(self, values: list[Value], ip: int, func: int | None) -> str:
        return format_uprobe_hit(self.udef, values, ip, func)

    def _symbolize(self, addr: int) -> str:
        return f"{addr:#x}"


__all__ = ["UprobeBackend", "UprobeHost", "UprobeTraceEvent"]
