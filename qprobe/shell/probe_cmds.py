"""The shell's commands on the probe table, as debugfs's kprobes/ files show it: list, enabled,
optimization, blacklist, the functions that can be probed, and hit statistics."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from qprobe.core.kprobe import Kretprobe
from qprobe.events.funcs import Probeability, render_funcs

from .parse import ShellUsageError
from .render import render_table

if TYPE_CHECKING:
    from .context import Handler, ShellContext


class ProbeCommands:
    """list, enabled, optimization, blacklist, funcs and stats."""

    def __init__(self, shell: ShellContext) -> None:
        self.shell = shell

    def handlers(self) -> dict[str, Handler]:
        return {"list": self.cmd_list, "enabled": self.cmd_enabled, "optimization": self.cmd_optimization,
                "blacklist": self.cmd_blacklist, "funcs": self.cmd_funcs, "stats": self.cmd_stats}  # fmt: skip

    def cmd_list(self, rest: str) -> None:
        self.shell.out.write(self.shell.target.list_probes())

    def cmd_enabled(self, rest: str) -> None:
        if not rest:
            self.shell.out.line("1" if self.shell.target.kprobes.enabled else "0")
            return
        if rest not in ("0", "1"):
            raise ShellUsageError("usage: enabled [0|1]")
        self.shell.target.set_kprobes_enabled(rest == "1")

    def cmd_optimization(self, rest: str) -> None:
        if rest not in ("0", "1"):
            raise ShellUsageError("usage: optimization 0|1")
        self.shell.target.set_kprobes_optimization(rest == "1")

    def cmd_blacklist(self, rest: str) -> None:
        for line in self.shell.target.blacklist():
            self.shell.out.line(line)

    def cmd_funcs(self, rest: str) -> None:
        if self.shell.probeability is None:
            self.shell.probeability = Probeability.of_target(self.shell.target)
        text, summary, _ = render_funcs(self.shell.probeability, rest.split())
        self.shell.out.write(text)
        self.shell.note(summary)

    def cmd_stats(self, rest: str) -> None:
        now = time.monotonic()
        rows: list[tuple[object, ...]] = []
        mine: set[int] = set()
        for name, te in list(self.shell.target.events.items()):
            probe = te.probe
            if probe is not None:
                mine.add(id(probe.kp if isinstance(probe, Kretprobe) else probe))
            since = self.shell.armed.setdefault(name, now)
            rows.append((name, te.nhit, te.nmissed, te.lost, _rate(te.nhit, now - since)))
        for point in list(self.shell.target.kprobes.points.values()):
            for kp in list(point.probes):
                if id(kp) in mine:
                    continue
                kind = "kretprobe" if kp.kretprobe is not None else "kprobe"
                since = self.shell.armed.setdefault(f"{kind}@{id(kp)}", now)
                rows.append((f"{kind} {point.where}", kp.nhit, kp.nmissed, "-", _rate(kp.nhit, now - since)))
        if not rows:
            self.shell.note("no events or probes")
            return
        self.shell.out.write(render_table(("EVENT", "HITS", "NMISSED", "LOST", "HITS/S"), rows))
        waited = self.shell.target.record_waits()
        if waited:
            self.shell.note(f"{waited} hits found their CPU's record ring full and waited for qprobe to drain it "
                            "(none was lost for it)")  # fmt: skip


def _rate(hits: int, seconds: float) -> str:
    return f"{hits / seconds:.2f}" if seconds > 0 else "0.00"


__all__ = ["ProbeCommands"]
