"""One hit of an event, as ftrace's trace prints it and as JSON."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from qprobe.fetch import terminal_safe


@dataclass(slots=True)  # thousands a second from the rings: no __dict__ each
class EventHit:
    """One hit of an event, with its arguments formatted as ftrace does."""

    event: str
    cpu: int
    pid: int
    comm: str
    ts: float  # seconds on the guest's trace clock, as its own trace prints them (HitClock.hit_time)
    addr: int
    symbol: str
    args: dict[str, str]
    body: str  # "(ksys_lseek+0x0/0x90) fd=3 ..."
    irqs_off: bool = False
    func: str | None = None  # a return probe's function (addr and symbol are then the return site)
    numbers: frozenset[str] = frozenset()  # the arguments that are integers (JSON gives them as numbers)
    strings: frozenset[str] = frozenset()  # the string arguments (JSON gives them without ftrace's quotes)
    order: float = 0.0  # where the hit goes among all others (HitClock.hit_time): push it so to the timeline

    def line(self) -> str:
        """The line ftrace's ``trace`` file would show."""
        flags = ("d" if self.irqs_off else ".") + "...."
        return f"{self.comm:>16}-{self.pid:<7} [{self.cpu:03d}] {flags} {self.ts:12.6f}: {self.event}: {self.body}"

    @property
    def function(self) -> str:
        """The probed function's name (bpftrace's ``func``): a return hit's ``addr`` is in its caller."""
        return (self.func or self.symbol).split("+", 1)[0]

    def escaped(self) -> EventHit:
        """The hit with the control characters of its guest text (the process name, the arguments' text)
        shown as ``\\xNN``: printed to a terminal, a name the guest chose must not act on it."""
        return dataclasses.replace(self, comm=terminal_safe(self.comm), body=terminal_safe(self.body),
                                   args={name: terminal_safe(text) for name, text in self.args.items()})  # fmt: skip

    def as_json(self) -> dict[str, object]:
        """The hit as JSON; a return probe's ``addr``/``symbol`` are its return site, ``func`` its function."""
        out: dict[str, object] = {"event": self.event, "cpu": self.cpu, "pid": self.pid, "comm": self.comm,
                                  "ts": round(self.ts, 6), "addr": f"{self.addr:#x}",
                                  "symbol": self.symbol}  # fmt: skip
        if self.func is not None:
            out["func"] = self.func
        out["args"] = {name: _json_number(text) if name in self.numbers else _json_string(text) if name in self.strings
                       else text for name, text in self.args.items()}  # fmt: skip
        return out


def _json_string(text: str) -> str:
    """A string argument as ftrace prints it (``"workload"``: no escaping inside) as the string; a fault stays text."""
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] == '"' else text


def _json_number(text: str) -> int | str:
    """An integer argument as ftrace formats it (``-5``, ``4096``, ``0x1000``) as a number; a fault stays text."""
    try:
        return int(text, 16) if text.lower().startswith("0x") else int(text, 10)
    except ValueError:
        return text


__all__ = ["EventHit"]
