"""Event hits from every path, handed on in the order they happened in the guest.

A hit reaches the host by one of three paths: at a VM stop (at once), through an
optimized probe's mailbox (at once), or in a record ring the collector drains every
few milliseconds (late).  Each carries its time on the guest's trace clock, so a
hit is held back until nothing earlier can still arrive: until a hit ``WINDOW``
seconds of guest time newer has been seen, or for ``HOLD`` seconds of host time,
whichever comes first (perf's ordered events work the same way).  ``flush`` hands
on everything at once, when the caller knows all paths are drained.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol

from qprobe.core.errorlog import ErrorLog

log = logging.getLogger("qprobe.events.timeline")

WINDOW = 0.1  # seconds of guest time: longer than a record waits in its ring
HOLD = 0.15  # seconds of host time a hit is held at most
TICK = 0.05  # how often held hits are looked at while nothing new arrives


class CycleOrder:
    """The cycle counter value that places each hit among the others, consistent with the order the host
    handled them in.

    A hit the guest timed itself (a detour's mailbox, a ring record) carries its exact value.
    A VM stop's value is an estimate (qprobe.kernel.clock.StopClock), good to the stop's
    latency and the clock model's error, which can put it after hits that came later.  Two
    facts fix the order where it can be known: stops reach the host in the order they
    happened, after every hit already seen; and a hit handled at once (a stop or a mailbox)
    on a vCPU happened after every stop already handled on that vCPU (the host held the vCPU
    until it had handled the stop).  A ring record reaches the host late, so it keeps its own value.
    """

    def __init__(self) -> None:
        self._exact = 0  # the newest value a hit carried
        self._stop = 0  # the last value given to a VM stop
        self._stops: dict[int, int] = {}  # vCPU -> the value given to the last stop handled on it

    def exact(self, cycles: int, vcpu: int, at_once: bool) -> int:
        """The value to place a hit that carries ``cycles``; ``at_once``: it came through a mailbox, not a ring."""
        if at_once:
            cycles = max(cycles, self._stops.get(vcpu, -1) + 1)
        self._exact = max(self._exact, cycles)
        return cycles

    def stop(self, estimate: int, vcpu: int) -> int:
        """The value to place a VM stop's hit whose value is ``estimate``."""
        self._stop = self._stops[vcpu] = max(estimate, self._exact + 1, self._stop + 1)
        return self._stop


class Stamped(Protocol):
    """A hit with its printed time, which the timeline may move forward (``Timeline.monotone``)."""

    ts: float


class Run(Protocol):
    """Hits held as one: each one's place (ascending) and printed time, by index (qprobe.events.lines.LineRun)."""

    order: list[float]
    ts: list[float]


class _RunCursor:
    """A held run's hits not yet handed on: from ``at``; ``deliver(start, stop)`` hands on a slice."""

    __slots__ = ("at", "deliver", "run")

    def __init__(self, run: Run, deliver: Callable[[int, int], None]) -> None:
        self.run, self.deliver, self.at = run, deliver, 0


# A held hit (or run): (guest time, arrival number, host time held since, what hands it on (a run's cursor),
# the hit whose time it prints).
_Held = tuple[float, int, float, "Callable[[], None] | _RunCursor", Stamped | None]


class Timeline:
    """A reorder buffer keyed by guest time; ``deliver`` callables run in that order, one at a time."""

    def __init__(self) -> None:
        self._heap: list[_Held] = []
        self._seq = itertools.count()
        self._newest = float("-inf")
        self._lock = threading.Lock()  # the heap
        self._delivering = threading.RLock()  # one deliverer at a time, so the order holds
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._closed = False
        # What delivering raised (a user's callback): counted, never lost silently, kept and warned within bounds.
        self.errors = ErrorLog(log)
        # Printed times never go back in the order hits go out, as under the guest's "global" trace
        # clock: trace_clock_global() stamps no earlier than the last stamp any CPU took (its prev_time),
        # where the CPUs' own clocks (a tick apart at most) disagree.  Set by whoever knows the clock.
        self.monotone = False
        self._last_stamp = float("-inf")
        # Threads inside batch(): their pushes are only queued, and handed on once, when the batch ends.
        self._batching = threading.local()
        # Run after each run of hand-ons (a printer's flush: its lines go out in blocks, not a write each).
        self.flushers: list[Callable[[], None]] = []

    def push(self, ts: float, deliver: Callable[[], None], stamped: Stamped | None = None) -> None:
        """Hold ``deliver`` (a hit at guest time ``ts``) until its turn; ``stamped``: the hit, whose time it prints."""
        pending: list[_Held] | None = getattr(self._batching, "pending", None)
        if pending is not None:  # held since the batch began
            pending.append((ts, next(self._seq), self._batching.since, deliver, stamped))
            return
        with self._lock:
            heapq.heappush(self._heap, (ts, next(self._seq), time.monotonic(), deliver, stamped))
            self._newest = max(self._newest, ts)
            self._start_ticking()
        self._release(all_=False)

    def push_run(self, run: Run, deliver: Callable[[int, int], None]) -> None:
        """Hold a run of hits as one (``run.order`` ascending): ``deliver(start, stop)`` hands on a slice of it,
        the run merged by time with every other hit held, slices as long as the order allows."""
        if not run.order:
            return
        cursor = _RunCursor(run, deliver)
        pending: list[_Held] | None = getattr(self._batching, "pending", None)
        if pending is not None:
            pending.append((run.order[0], next(self._seq), self._batching.since, cursor, None))
            return
        with self._lock:
            heapq.heappush(self._heap, (run.order[0], next(self._seq), time.monotonic(), cursor, None))
            self._newest = max(self._newest, run.order[-1])
            self._start_ticking()
        self._release(all_=False)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """This thread's pushes meanwhile (a ring's records and their callbacks' own) are held together and
        taken in at the end under one lock, then handed on once: the order the same, microseconds a hit saved."""
        if getattr(self._batching, "pending", None) is not None:
            yield
            return
        pending: list[_Held] = []
        self._batching.pending, self._batching.since = pending, time.monotonic()
        try:
            yield
        finally:
            self._batching.pending = None
            if pending:
                with self._lock:
                    for held in pending:
                        heapq.heappush(self._heap, held)
                    self._newest = max(self._newest, max(_last(held) for held in pending))
                    self._start_ticking()
                self._release(all_=False)

    def _start_ticking(self) -> None:
        """With the lock held: the thread that releases held hits (started on the first push) looks again."""
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._tick, name="qprobe-timeline", daemon=True)
            self._thread.start()
        self._wake.notify()

    def flush(self) -> None:
        """Hand on every held hit now."""
        self._release(all_=True)

    def close(self) -> None:
        self.flush()
        with self._lock:
            self._closed = True
            self._wake.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(1.0)

    def _due(self, all_: bool) -> list[Callable[[], None]]:
        """Every held hit whose turn has come, in order, taken off the heap under one lock."""
        out: list[Callable[[], None]] = []
        with self._lock:
            heap, now = self._heap, time.monotonic()
            upto = self._newest - WINDOW
            while heap:
                ts, seq, held_since, deliver, stamped = heap[0]
                if not (all_ or ts <= upto or now - held_since >= HOLD):
                    break
                heapq.heappop(heap)
                if isinstance(deliver, _RunCursor):
                    out.append(self._run_slice(seq, held_since, deliver, all_ or now - held_since >= HOLD, upto))
                    continue
                if stamped is not None and self.monotone:
                    stamped.ts = self._last_stamp = max(stamped.ts, self._last_stamp)
                out.append(deliver)
        return out

    def _run_slice(self, seq: int, since: float, cursor: _RunCursor, every: bool,
                   upto: float) -> Callable[[], None]:  # fmt: skip
        """With the lock held, a run's cursor taken off the heap: its hits up to the next held hit's turn (and
        up to ``upto`` unless ``every`` is due), to hand on as one slice; the rest held again."""
        heap, run, start = self._heap, cursor.run, cursor.at
        order = run.order
        # Up to the next held hit's time: the run's hits at that very time too, unless that hit was pushed before
        # the run (among equal times the one pushed first goes first, as for single hits).
        limit, before = float("inf"), False
        if heap:
            limit, before = heap[0][0], heap[0][1] < seq
        if not every and upto < limit:
            limit, before = upto, False
        find = bisect.bisect_left if before else bisect.bisect_right
        stop = max(start + 1, find(order, limit, start + 1))
        if self.monotone:
            stamps, last = run.ts, self._last_stamp
            for i in range(start, stop):
                if stamps[i] < last:
                    stamps[i] = last
                else:
                    last = stamps[i]
            self._last_stamp = last
        if stop < len(order):
            cursor.at = stop
            heapq.heappush(heap, (order[stop], seq, since, cursor, None))
        return functools.partial(cursor.deliver, start, stop)

    def _release(self, all_: bool) -> None:
        with self._delivering:
            delivered = False
            while due := self._due(all_):
                delivered = True
                for deliver in due:
                    try:
                        deliver()
                    except Exception as exc:  # a user's callback: reported, and the hits after it still go out
                        self.errors.add(f"event callback failed: {type(exc).__name__}: {exc}")
            for flush in self.flushers if delivered else ():
                try:
                    flush()
                except Exception as exc:  # a printer's (a closed pipe): reported as a callback's is
                    self.errors.add(f"event output failed: {type(exc).__name__}: {exc}")

    def _tick(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                self._wake.wait(TICK if self._heap else None)
            self._release(all_=False)


def _last(held: _Held) -> float:
    """The newest guest time a held entry brings: a run's last hit's."""
    deliver = held[3]
    return deliver.run.order[-1] if isinstance(deliver, _RunCursor) else held[0]


__all__ = ["HOLD", "WINDOW", "CycleOrder", "Run", "Stamped", "Timeline"]
