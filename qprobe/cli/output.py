"""``qprobe trace``'s output: each hit's line (ftrace's, --format's or --json's) or the map it folds into,
and the summary at the end."""

from __future__ import annotations

import argparse
import collections
import json
import sys
import threading
from typing import TYPE_CHECKING, TextIO

from qprobe.errors import QprobeError

from .definitions import _check_boot

if TYPE_CHECKING:
    from qprobe.api import Target
    from qprobe.events import EventHit, TraceEvent
    from qprobe.events.lines import LineRun
    from qprobe.fetch import ProbeEvent, UprobeEvent
    from qprobe.proctree import ProcessTree
    from qprobe.shell.collect import Aggregation
    from qprobe.shell.printf import HitFormat


class _Trace:
    """One ``qprobe trace``'s output: what the options ask for, checked before boot, and what was shown."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.lock = threading.Lock()  # one line (or map) at a time on stdout
        self.shown: collections.Counter[str] = collections.Counter()  # with --run, the command's hits
        self.tree: ProcessTree | None = None  # with --run, the command's processes once followed
        # Guest text (a process name, a fetched string) reaches a terminal with its control characters shown;
        # the user's own --format keeps its escapes (a colour, say).
        self.tty = sys.stdout.isatty()
        self.out: TextIO | None = None  # where lines go; None: sys.stdout, as it is when they go
        self.fmt: HitFormat | None = None
        if args.format is not None:
            from qprobe.shell.printf import parse_printf

            if args.json:
                raise QprobeError("--format and --json: choose one")
            self.fmt = parse_printf(args.format)
        self.agg: Aggregation | None = None
        self.every: float | None = None
        if args.map is not None:
            from qprobe.shell.collect import parse_map

            if args.json or args.format is not None:
                raise QprobeError("--map prints a map instead of lines: not with --json or --format")
            self.agg, self.every = parse_map(args.map)
        self.cpid_filter = args.filter is not None and "$cpid" in args.filter
        if self.cpid_filter and not args.run:
            raise QprobeError("$cpid is the pid of --run's command: give --run CMD")
        if getattr(args, "boot", False) and (args.map is not None or self.cpid_filter):
            raise QprobeError("--boot traces from the kernel's first instruction on: not with --map or $cpid")
        _check_boot(args)
        # The filter as it is checked before boot; one naming $cpid is set on the events once the command forks.
        self.filter: str | None = args.filter.replace("$cpid", "0") if self.cpid_filter else args.filter

    def check(self, ev: ProbeEvent | UprobeEvent) -> None:
        """A definition against the filter and --format, before booting."""
        from qprobe.events import event_filter

        if self.filter:
            event_filter(ev, self.filter)
        if self.fmt is not None:
            missing = [n for n in self.fmt.names() if n not in {a.name for a in ev.args}]
            if missing:
                raise QprobeError(f"--format names {missing[0]!r}, which {ev.text!r} does not fetch")
            self.fmt.check_types(ev.integer_args)

    @property
    def _stdout(self) -> TextIO:
        return sys.stdout if self.out is None else self.out

    @property
    def bulk(self) -> bool:
        """Whether a ring's runs of hits can be printed as blocks of ftrace lines (``show_run``): plain lines,
        not to a terminal (whose lines show the guest's control characters escaped, a hit at a time)."""
        return self.fmt is None and not self.args.json and not self.tty

    def show_run(self, run: LineRun, start: int, stop: int) -> None:
        """Lines ``start`` to ``stop`` of a run, in one write: with --run only the command's, as ``show``."""
        take = None
        if self.args.run and not getattr(self.args, "boot", False):
            tree = self.tree
            if tree is None:
                return
            owned: dict[int, bool] = {}  # a run's few pids, each asked once

            def take(pid: int) -> bool:
                mine = owned.get(pid)
                if mine is None:
                    mine = owned[pid] = tree.owns_pid(pid)
                return mine

        n, text = run.text(start, stop, take)
        with self.lock:
            self.shown[run.event] += n
            self._stdout.write(text)

    def show(self, hit: EventHit) -> None:
        """One hit's line: with --run only the command's (those before its process tree is followed, the
        guest shell reading the line that asks for its pid, are not); with --boot every hit, the boot's first."""
        if self.args.run and not getattr(self.args, "boot", False) and (self.tree is None or not self.tree.owns(hit)):
            return
        with self.lock:  # unflushed: the timeline flushes after each run of hits it hands on (``flush``)
            self.shown[hit.event] += 1
            out = self._stdout
            if self.fmt is not None:
                out.write(self.fmt(hit.escaped() if self.tty else hit))
            elif self.args.json:
                out.write(json.dumps(hit.as_json()) + "\n")
            else:
                out.write((hit.escaped() if self.tty else hit).line() + "\n")

    def flush(self) -> None:
        """The lines shown so far out to stdout, in one write where they fit a buffer."""
        with self.lock:
            self._stdout.flush()

    def owns(self, event: str, pid: int, hits: int) -> bool:
        """With --run, whether the map takes ``hits`` hits of ``event`` by task ``pid``: the command's only."""
        if self.tree is None or not self.tree.owns_pid(pid):
            return False
        with self.lock:
            self.shown[event] += hits
        return True

    def write(self, text: str) -> None:
        with self.lock:
            self._stdout.write(text)
            self._stdout.flush()


def _summarize(target: Target, events: list[TraceEvent], trace: _Trace) -> None:
    """One row an event (its trace shows one event name), the counts of probes appended to it added in."""
    args = trace.args
    totals: dict[str, collections.Counter[str]] = {}
    for te in events:
        totals.setdefault(te.definition.event, collections.Counter()).update(
            hits=te.nhit, nmissed=te.nmissed, lost=te.lost, filtered=te.filtered, oversized=te.oversized)  # fmt: skip
    summary: dict[str, dict[str, int]] = {}
    for name, t in totals.items():
        row = {"hits": t["hits"], "nmissed": t["nmissed"], "lost": t["lost"]}
        if trace.tree is not None:  # hits counts the command's; the other processes' are said apart
            row.update(hits=trace.shown[name], others=t["hits"] - trace.shown[name])
        if args.filter:
            row["filtered"] = t["filtered"]
        if t["oversized"]:  # records past the guest's ring buffer's bound: its own event drops them too
            row["oversized"] = t["oversized"]
        summary[name] = row
    # The rings are this process's, zeroed when it laid them out: their count is this run's.
    waited = target.record_waits() if target.machine.alive else 0
    with trace.lock:
        if args.json:
            rings = {"records": {"waited": waited}} if waited else {}
            print(json.dumps({"summary": summary, **rings}), flush=True)
        else:
            for name, row in summary.items():
                print(f"# {name}: " + " ".join(f"{k}={v}" for k, v in row.items()))
            if waited:
                # Nothing was lost for it: these hits' vCPUs waited for qprobe to drain a full ring.
                print(f"# records: waited={waited}")
