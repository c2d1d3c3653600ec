"""The shell's map commands, as bpftrace's maps: ``count``, ``hist``, and the functions of a value
(``sum()``, ``avg()``, ``min()``, ``max()``, ``stats()``, ``hist()``, ``lhist()``), by keys, every few
seconds, for a while or since boot."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .collect import Aggregation, Collector, check_argument
from .event_cmds import select_events
from .parse import ShellUsageError, parse_collect, split_call
from .show_cmds import kept_hits

if TYPE_CHECKING:
    from qprobe.events import TraceEvent

    from .context import Handler, ShellContext
    from .guest_cmds import GuestCommands
    from .parse import Call, Collect


class MapCommands:
    """count, hist and the map functions of a value (``call``: a line such as ``sum(count) rd``)."""

    def __init__(self, shell: ShellContext, guest: GuestCommands) -> None:
        self.shell = shell
        self.guest = guest

    def handlers(self) -> dict[str, Handler]:
        return {"count": self.cmd_count, "hist": self.cmd_hist}

    def cmd_count(self, rest: str, label: str | None = None) -> None:
        spec = parse_collect(rest, verb="count")
        events = select_events(self.shell.target, spec.events)
        agg = Aggregation("count", spec.keys, by_event=not spec.keys and len(events) > 1, label=label)
        self._aggregate(spec, events, agg)

    def named(self, label: str | None, line: str) -> None:
        """A map in bpftrace's spelling (``@NAME[KEY, ...] = FUNC(...) ...``, ``count() ...``), given as the
        shell's own ``line`` and the map's name (None: the usual one)."""
        call = split_call(line)
        if call is not None:
            self.call(*call, label=label)
        else:
            self.cmd_count(line.removeprefix("count").strip(), label)

    def cmd_hist(self, rest: str) -> None:
        """``hist EVENT by VALUE``: a histogram of VALUE (the form before ``hist(VALUE)``)."""
        spec = parse_collect(rest, verb="hist", need_key=True)
        if len(spec.events) != 1 or len(spec.keys) != 1:
            raise ShellUsageError("usage: hist EVENT by VALUE, or hist(VALUE) [EVENT...] [by KEY, ...]")
        value = spec.keys[0]
        if value in ("$comm", "$stack"):
            raise ShellUsageError(f"hist needs a numeric value, not {value} (try: count EVENT by {value})")
        spec.keys = ()
        events = select_events(self.shell.target, spec.events)
        self._check_names(value, events)
        self._aggregate(spec, events, Aggregation("hist", value=value))

    def call(self, call: Call, rest: str, label: str | None = None) -> None:
        """``sum(VALUE) [EVENT...] [by KEY, ...]`` and the other map functions of a value."""
        spec = parse_collect(rest, verb=call.func)
        events = select_events(self.shell.target, spec.events)
        self._check_names(call.value, events)
        agg = Aggregation(call.func, spec.keys, call.value, bounds=call.bounds, label=label)
        self._aggregate(spec, events, agg)

    def _check_names(self, name: str, events: list[TraceEvent]) -> None:
        check_argument(name, [(te.name, te.definition) for te in events], "; `help count` lists the keys")

    def _aggregate(self, spec: Collect, events: list[TraceEvent], agg: Aggregation) -> None:
        for key in spec.keys:
            self._check_names(key, events)
        if spec.since_boot:
            if "$stack" in spec.keys:
                raise ShellUsageError("$stack is unwound while the vCPU is stopped at a hit: not for hits "
                                      "already made (since boot)")  # fmt: skip
            for te, hit in kept_hits(self.shell, events):
                agg.add(te, hit)
            if not agg.print_and_clear(self.shell.out.write):
                self.shell.note("no hits")
            if agg.skipped:
                self.shell.note(f"({agg.skipped} of {agg.total} values of {agg.value} were not numbers)")
            return
        every = spec.every
        due = [time.monotonic() + every] if every is not None else []

        def poll() -> None:  # every S: print the map and clear it, as an interval probe's print(@); clear(@)
            if due and time.monotonic() >= due[0]:
                due[0] += every or 0
                agg.print_and_clear(self._write_now)

        collector = Collector(events, agg, every=every)
        with collector:
            # Said (in GuestCommands.watch) once every hit is counted and a Ctrl-C ends the count, not its set-up.
            what = ", ".join(te.name for te in events) + (f" by {', '.join(spec.keys)}" if spec.keys else "")
            value = f"{agg.kind}({agg.value}) of " if agg.value is not None else "counting "
            ready = f"{value}{what}{f' every {every:g} s' if every else ''}; Ctrl-C to stop"
            result = self.guest.watch(spec, poll, ready)
        self.guest.report_run(result)
        if not agg.print_and_clear(self.shell.out.write) and every is None:
            self.shell.note("no hits")
        if agg.skipped:
            self.shell.note(f"({agg.skipped} of {agg.total} values of {agg.value} were not numbers)")
        if collector.missed:
            # Hits the guest made but nobody counted: records dropped on a full lossy ring, or hits missed
            # while the same vCPU was already in a probe.  The counts above are short by that many.
            self.shell.out.write(f"@lost: {collector.missed}\n")
            self.shell.note(f"{collector.missed} hits were lost (full record rings or missed probes): "
                            "the counts above miss them")  # fmt: skip

    def _write_now(self, text: str) -> None:
        self.shell.out.write(text)
        self.shell.out.flush()


__all__ = ["MapCommands"]
