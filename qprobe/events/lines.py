"""Trace lines made in bulk: a run of ring records as ftrace's lines, column by column, no object a hit.

A hot loop's hits reach the host as runs of thousands of ring records.  Made
one :class:`qprobe.events.hit.EventHit` at a time, each costs a hit object,
its dicts, a timeline entry and a line formatted field by field.  A
:class:`LineRun` holds the run as columns instead: each hit's line is its
head (``comm-pid [cpu] flags``, the same few texts again and again, made
once each), its time and its tail (``: event: (symbol) args``, from a format
made once a run), joined when the timeline hands the run on (a guest's
"global" trace clock may move a time forward then).  The timeline takes the
run as one entry and merges it with every other hit by time
(``Timeline.push_run``); a printer (:class:`InOrderLines`) takes slices of
it as one block of text each.  The lines are byte for byte ``EventHit.line``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qprobe.events.event import InOrder

if TYPE_CHECKING:
    from qprobe.core.kprobe import GuestRecord


def line_head(comm: str, pid: int, cpu: int, irqs_off: bool) -> str:
    """A line up to its time, as ``EventHit.line`` starts it."""
    return f"{comm:>16}-{pid:<7} [{cpu:03d}] {'d' if irqs_off else '.'}.... "


class LineRun:
    """One event's hits of one run, oldest first, as the columns of their lines.

    ``order`` places each hit among all others (ascending: the timeline merges
    by it), ``ts`` is each hit's printed time, ``pid`` its task's pid; ``heads``
    and ``tails`` are the text before and after the time.
    """

    __slots__ = ("event", "heads", "order", "pid", "tails", "ts")

    def __init__(self, event: str, order: list[float], ts: list[float], pid: list[int], heads: list[str],
                 tails: list[str]) -> None:  # fmt: skip
        self.event, self.order, self.ts, self.pid, self.heads, self.tails = event, order, ts, pid, heads, tails

    def __len__(self) -> int:
        return len(self.order)

    def text(self, start: int, stop: int, take: Callable[[int], bool] | None = None) -> tuple[int, str]:
        """(lines, text) of hits ``start`` to ``stop``, each line ending in a newline; ``take``: only the hits
        whose pid it takes."""
        heads, ts, tails = self.heads[start:stop], self.ts[start:stop], self.tails[start:stop]
        if take is not None:
            kept = [i for i, pid in enumerate(self.pid[start:stop]) if take(pid)]
            heads, ts, tails = [heads[i] for i in kept], [ts[i] for i in kept], [tails[i] for i in kept]
        return len(heads), "".join(["%s%12.6f%s" % line for line in zip(heads, ts, tails, strict=True)])  # noqa: UP031


class LineFormat:
    """An event's line after the time, for a run whose hits share their probe's place: ``: event: (head)``
    and each argument's ``NAME=text``, one %-format made once."""

    def __init__(self, event: str, head: str, names: Sequence[str]) -> None:
        fixed = f": {event}: {head}".replace("%", "%%")
        self._format = fixed + "".join(f" {n.replace('%', '%%')}=%s" for n in names) + "\n"

    def tails(self, hits: int, texts: Sequence[Sequence[str]]) -> list[str]:
        """Each of ``hits`` hits' tail, from its arguments' text columns (one list an argument, in the
        definition's order)."""
        fmt = self._format
        if not texts:
            return [fmt % ()] * hits
        return [fmt % row for row in zip(*texts, strict=True)]


def line_run(event: str, head: str, names: Sequence[str], records: list[GuestRecord], texts: Sequence[list[str]],
             times: list[tuple[float, float]], flags: str, irqs_off: Callable[[int], bool]) -> LineRun:  # fmt: skip
    """The lines of a run of one probe's records: ``head`` is the probe's ``(symbol+off/size)``, ``texts``
    each argument's column of text, ``times`` each record's (printed time, place), ``flags`` the name of
    the register whose word ``irqs_off`` reads."""
    heads: list[str] = []
    made: dict[tuple[str, int, int, int], str] = {}  # a few tasks on a few CPUs make most records
    for rec in records:
        key = (rec.comm, rec.pid, rec.cpu, rec.values[flags])
        text = made.get(key)
        if text is None:
            text = made[key] = line_head(rec.comm, rec.pid, rec.cpu, irqs_off(key[3]))
        heads.append(text)
    tails = LineFormat(event, head, names).tails(len(records), texts)
    ts, order = [t for t, _ in times], [o for _, o in times]
    pids = [rec.pid for rec in records]
    if order != sorted(order):  # the rings hand records on in cycle order; a clock that places them otherwise
        at = sorted(range(len(order)), key=order.__getitem__)
        ts, order, pids = [ts[i] for i in at], [order[i] for i in at], [pids[i] for i in at]
        heads, tails = [heads[i] for i in at], [tails[i] for i in at]
    return LineRun(event, order, ts, pids, heads, tails)


@dataclass(frozen=True)
class InOrderLines(InOrder):
    """A printer that takes a ring's runs of trace lines in bulk, in the guest's order of hits across every
    event: ``lines(run, start, stop)`` for each slice the timeline hands on, ``fn(hit)`` for a hit that took
    another path (a VM stop, a mailbox), as InOrder.

    The hits of the runs are counted in the event's ``nhit`` but not kept in its ``hits``: a printer's lines
    are what they are for.  An event with a host filter still makes its hits one at a time.
    """

    lines: Callable[[LineRun, int, int], None]


__all__ = ["InOrderLines", "LineFormat", "LineRun", "line_head", "line_run"]
