"""Watching events for a while: taps on TraceEvents and the count/hist aggregations.

A :class:`Tap` chains a callback onto events for as long as a ``with`` block
lasts (the event's own callback still runs), and for ``$stack`` wraps the
probe's handler so the stack is unwound while the vCPU is stopped at the hit.
Everything it installs is put back on exit, also on Ctrl-C.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from qprobe.core.kprobe import Kretprobe

from .parse import NUMERIC_SPECIAL_KEYS, VALUE_FUNCS, key_name
from .render import (
    KeyParts,
    MapKey,
    c_div,
    lhist_bucket,
    log2_bucket,
    parse_number,
    render_counts,
    render_hist_map,
    render_lhist_map,
    render_stats,
    strip_quotes,
)

if TYPE_CHECKING:
    from qprobe.arch.inguest import MapSlot
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
    """The value of ``key`` (an argument name or ``$comm``/``$pid``/``$cpu``/``$func``/``$event``/``$stack``)
    at one hit."""
    if key == "$comm":
        return hit.comm
    if key == "$event":
        return hit.event
    if key == "$func":
        return hit.function
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
    """One bpftrace map: ``count`` (by a key, or one total) or a function of a numeric value.

    ``kind`` is count, sum, avg, min, max, stats, hist or lhist (``bounds`` its min, max,
    step); ``keys`` the parts of the map key; ``value`` what the function takes.  Hits
    may arrive on other threads while ``take`` renders and clears (``every S``).
    """

    def __init__(self, kind: str, keys: Sequence[str] = (), value: str | None = None, by_event: bool = False,
                 bounds: tuple[int, int, int] | None = None) -> None:  # fmt: skip
        if kind not in ("count", *VALUE_FUNCS):
            raise ValueError(kind)
        if (kind == "count") != (value is None) or (kind == "lhist") != (bounds is not None):
            raise ValueError(f"{kind} with value {value!r} and bounds {bounds!r}")
        self.kind = kind
        self.keys = tuple(keys)
        self.value = value
        self.bounds = bounds
        self.by_event = by_event  # count with no key over several events: one row per event
        self.counts: dict[MapKey, int] = {}  # count, sum, min, max
        self.pairs: dict[MapKey, tuple[int, int]] = {}  # avg and stats: (count, total)
        self.hists: dict[MapKey, dict[int, int]] = {}  # hist and lhist: bucket -> count
        self.skipped = 0
        self.total = 0
        self._lock = threading.Lock()

    @property
    def buckets(self) -> dict[int, int]:
        """The buckets of a histogram without a key."""
        return self.hists.get(None, {})

    def _key(self, te: TraceEvent | None, hit: EventHit, stack: Stack | None) -> MapKey:
        if len(self.keys) > 1:
            return KeyParts(hit_key(hit, k, stack) for k in self.keys)
        if self.keys:
            return hit_key(hit, self.keys[0], stack)
        if self.by_event:
            return te.definition.event if te is not None else hit.event
        return None

    def add(self, te: TraceEvent | None, hit: EventHit, stack: Stack | None = None) -> None:
        key = self._key(te, hit, stack)
        value = None if self.value is None else numeric_value(hit, self.value)
        with self._lock:
            self.total += 1
            if self.kind == "count":
                self.counts[key] = self.counts.get(key, 0) + 1
            elif value is None:
                self.skipped += 1
            else:
                self._fold(key, value)

    def _fold(self, key: MapKey, value: int) -> None:
        kind = self.kind
        if kind == "sum":
            self.counts[key] = self.counts.get(key, 0) + value
        elif kind in ("min", "max"):
            old = self.counts.get(key)
            self.counts[key] = value if old is None else (min if kind == "min" else max)(old, value)
        elif kind in ("avg", "stats"):
            n, total = self.pairs.get(key, (0, 0))
            self.pairs[key] = (n + 1, total + value)
        else:
            hist = self.hists.setdefault(key, {})
            i = log2_bucket(value) if self.bounds is None else lhist_bucket(value, *self.bounds)
            hist[i] = hist.get(i, 0) + 1

    def add_counts(self, counts: dict[MapKey, int]) -> None:
        """Hits counted without the host seeing them, by key (a ``count``'s)."""
        with self._lock:
            for key, n in counts.items():
                self.counts[key] = self.counts.get(key, 0) + n
                self.total += n

    def add_slots(self, slots: Mapping[tuple[str | int, ...], MapSlot]) -> None:
        """Hits folded into a map in the guest (``TraceEvent.stop_counting_in_guest``): by the parts of
        their key, a histogram's bucket last; each slot's count, and its value's sum, min and max."""
        with self._lock:
            for parts, slot in slots.items():
                bucket = None
                if self.kind == "hist":
                    *rest, last = parts
                    parts, bucket = tuple(rest), int(last)
                clean = tuple(strip_quotes(p) if isinstance(p, str) else p for p in parts)
                key: MapKey = None if not clean else clean[0] if len(clean) == 1 else KeyParts(clean)
                self.total += slot.count
                if bucket is not None:
                    hist = self.hists.setdefault(key, {})
                    hist[bucket] = hist.get(bucket, 0) + slot.count
                elif self.kind == "count":
                    self.counts[key] = self.counts.get(key, 0) + slot.count
                elif self.kind == "sum":
                    self.counts[key] = self.counts.get(key, 0) + slot.total
                elif self.kind in ("min", "max"):
                    pick = min if self.kind == "min" else max
                    old = self.counts.get(key)
                    mine = slot.min if self.kind == "min" else slot.max
                    self.counts[key] = mine if old is None else pick(old, mine)
                elif self.kind in ("avg", "stats"):
                    n, total = self.pairs.get(key, (0, 0))
                    self.pairs[key] = (n + slot.count, total + slot.total)
                else:
                    raise ValueError(f"{self.kind} is not folded in the guest")

    def add_values(self, values: Sequence[int]) -> None:
        """Fold plain integers in, without a key (tests and the Python API)."""
        with self._lock:
            for v in values:
                self._fold(None, v)
            self.total += len(values)

    @property
    def name(self) -> str:
        """The map's name: ``@`` for a count, ``@VALUE`` for a function of a value (``@count = hist(count)``)."""
        return "" if self.value is None else key_name(self.value)

    def render(self) -> str:
        """The map as bpftrace prints it; "" when it is empty."""
        with self._lock:
            return self._render()

    def take(self) -> str:
        """Render and clear, in one step (bpftrace's ``print(@); clear(@)`` of an interval probe)."""
        with self._lock:
            text = self._render()
            self.counts, self.pairs, self.hists = {}, {}, {}
            return text

    def _render(self) -> str:
        if self.kind in ("hist", "lhist"):
            hists = {k: dict(v) for k, v in self.hists.items() if v}
            if not hists:
                return ""
            if self.bounds is not None:
                return render_lhist_map(self.name, hists, *self.bounds)
            return render_hist_map(self.name, hists)
        if self.kind == "stats":
            return render_stats(self.name, dict(self.pairs))
        if self.kind == "avg":
            return render_counts(self.name, {k: c_div(total, n) for k, (n, total) in self.pairs.items()})
        return render_counts(self.name, dict(self.counts))  # a copy: a hit still in flight may add a key
