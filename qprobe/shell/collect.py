"""Watching events for a while: taps on TraceEvents and the count/hist aggregations.

A :class:`Tap` chains a callback onto events for as long as a ``with`` block
lasts (the event's own callback still runs), and for ``$stack`` wraps the
probe's handler so the stack is unwound while the vCPU is stopped at the hit.
Everything it installs is put back on exit, also on Ctrl-C.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from qprobe.core.kprobe import Kretprobe

from .parse import NUMERIC_SPECIAL_KEYS, key_name
from .render import MapKey, hist_buckets, log2_bucket, parse_number, render_counts, render_hist_map, strip_quotes

if TYPE_CHECKING:
    from qprobe.core.regs import PtRegs
    from qprobe.events import EventHit, TraceEvent

Stack = tuple[str, ...]
HitSink = Callable[["TraceEvent", "EventHit", "Stack | None"], None]


class Tap:
    """Chain ``sink(te, hit, stack)`` onto ``events`` while the block runs.

    ``unwind(regs) -> Stack`` (optional) runs inside the probe handler, on the
    stop-loop thread, before the event records its hit; hits are delivered on
    that same thread right after, so the stack of the hit being recorded is
    the one just unwound.
    """

    def __init__(self, events: Sequence[TraceEvent], sink: HitSink,
                 unwind: Callable[[PtRegs], Stack] | None = None) -> None:  # fmt: skip
        self.events = list(events)
        self.sink = sink
        self.unwind = unwind
        self._pending: Stack | None = None
        self._saved: list[tuple[TraceEvent, Any, str | None, Any]] = []

    def __enter__(self) -> Tap:
        for te in self.events:
            old_cb = te.callback
            attr, old_handler = None, None
            if self.unwind is not None and te.probe is not None:
                attr = "handler" if isinstance(te.probe, Kretprobe) else "pre_handler"
                old_handler = getattr(te.probe, attr)
                setattr(te.probe, attr, self._wrap_handler(old_handler))
                te.use_host_handler(True)  # a stack is unwound at the hit, not from a record
            self._saved.append((te, old_cb, attr, old_handler))
            te.callback = self._chain(te, old_cb)
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        for te, old_cb, attr, old_handler in reversed(self._saved):
            te.callback = old_cb
            if attr is not None:
                setattr(te.probe, attr, old_handler)
                te.use_host_handler(False)
        self._saved.clear()

    def _chain(self, te: TraceEvent, old: Callable[[EventHit], None] | None) -> Callable[[EventHit], None]:
        def callback(hit: EventHit) -> None:
            stack, self._pending = self._pending, None
            self.sink(te, hit, stack)
            if old is not None:
                old(hit)

        return callback

    def _wrap_handler(self, handler: Callable[..., Any]) -> Callable[..., Any]:
        unwind = self.unwind
        assert unwind is not None

        def wrapped(probe_or_instance: Any, regs: PtRegs) -> Any:
            try:
                self._pending = unwind(regs)
            except Exception as exc:  # an unwinder failure is shown as the key, not a probe fault
                self._pending = (f"[unwind failed: {type(exc).__name__}: {exc}]",)
            return handler(probe_or_instance, regs)

        return wrapped


def hit_key(hit: EventHit, key: str, stack: Stack | None) -> MapKey:
    """The value of ``key`` (an argument name or ``$comm``/``$pid``/``$cpu``/``$stack``) at one hit."""
    if key == "$comm":
        return hit.comm
    if key == "$pid":
        return hit.pid
    if key == "$cpu":
        return hit.cpu
    if key == "$stack":
        return stack if stack is not None else ("[no stack]",)
    return strip_quotes(hit.args.get(key, "(none)"))


def numeric_value(hit: EventHit, key: str) -> int | None:
    """The integer a histogram buckets for ``key`` at one hit, or None when it is not a number."""
    if key in NUMERIC_SPECIAL_KEYS:
        value = hit_key(hit, key, None)
        return value if isinstance(value, int) else None
    return parse_number(hit.args.get(key, ""))


class Aggregation:
    """``count`` (by a key, or one total) or ``hist`` (log2 buckets of a numeric key)."""

    def __init__(self, kind: str, key: str | None, by_event: bool = False) -> None:
        if kind not in ("count", "hist"):
            raise ValueError(kind)
        if kind == "hist" and key is None:
            raise ValueError("a histogram needs a key")
        self.kind = kind
        self.key = key
        self.by_event = by_event  # count with no key over several events: one row per event
        self.counts: dict[MapKey, int] = {}
        self.buckets: dict[int, int] = {}
        self.skipped = 0
        self.total = 0

    def add(self, te: TraceEvent | None, hit: EventHit, stack: Stack | None = None) -> None:
        self.total += 1
        if self.kind == "hist":
            assert self.key is not None
            value = numeric_value(hit, self.key)
            if value is None:
                self.skipped += 1
                return
            i = log2_bucket(value)
            self.buckets[i] = self.buckets.get(i, 0) + 1
            return
        if self.key is not None:
            k: MapKey = hit_key(hit, self.key, stack)
        elif self.by_event:
            k = te.definition.event if te is not None else hit.event
        else:
            k = None
        self.counts[k] = self.counts.get(k, 0) + 1

    def add_counts(self, counts: dict[str | int, int]) -> None:
        """Hits counted in the guest: ``count`` by formatted key, ``hist`` by bucket index."""
        for k, n in counts.items():
            if self.kind == "hist":
                assert isinstance(k, int)
                self.buckets[k] = self.buckets.get(k, 0) + n
            else:
                key: MapKey = strip_quotes(k) if isinstance(k, str) else k
                self.counts[key] = self.counts.get(key, 0) + n
            self.total += n

    def add_values(self, values: Sequence[int]) -> None:
        """Bucket plain integers (tests and the Python API)."""
        for i, n in hist_buckets(values).items():
            self.buckets[i] = self.buckets.get(i, 0) + n
        self.total += len(values)

    def render(self) -> str:
        if self.kind == "hist":
            assert self.key is not None
            if not self.buckets:
                return ""
            return render_hist_map(key_name(self.key), {None: dict(self.buckets)})
        return render_counts("", dict(self.counts))  # a copy: a hit still in flight may add a key
