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

from qprobe.core.kprobe import Kprobe, Kretprobe
from qprobe.core.uprobe import Uprobe
from qprobe.events.fold import GuestMaps, Owner, fold_path

from .mapsyntax import MAP_USAGE, map_line
from .parse import NUMERIC_SPECIAL_KEYS, VALUE_FUNCS, ShellUsageError, key_name, parse_collect, split_call
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
    stack_frames,
    strip_quotes,
)

if TYPE_CHECKING:
    from qprobe.arch.inguest import MapSlot
    from qprobe.core.regs import PtRegs
    from qprobe.events import EventHit, TraceEvent
    from qprobe.fetch import ProbeEvent, UprobeEvent

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
        if self.unwind is not None:
            user = [te.name for te in self.events if isinstance(te.probe, Uprobe)]
            if user:
                raise ShellUsageError(f"$stack is the kernel's stack; {user[0]} probes user space")
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
    step); ``keys`` the parts of the map key; ``value`` what the function takes; ``label``
    the map's name where one was given.  Hits
    may arrive on other threads while ``take`` renders and clears (``every S``).
    """

    def __init__(self, kind: str, keys: Sequence[str] = (), value: str | None = None, by_event: bool = False,
                 bounds: tuple[int, int, int] | None = None, label: str | None = None) -> None:  # fmt: skip
        if kind not in ("count", *VALUE_FUNCS):
            raise ValueError(kind)
        if (kind == "count") != (value is None) or (kind == "lhist") != (bounds is not None):
            raise ValueError(f"{kind} with value {value!r} and bounds {bounds!r}")
        self.kind = kind
        self.keys = tuple(keys)
        self.value = value
        self.bounds = bounds
        self.by_event = by_event  # count with no key over several events: one row per event
        self.label = label  # the name bpftrace's @NAME = ... gave the map
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
        """The map's name: the one it was given (``@bytes = sum(count)``), else ``@`` for a count and
        ``@VALUE`` for a function of a value (``@count = hist(count)``)."""
        if self.label is not None:
            return self.label
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

    def print_and_clear(self, write: Callable[[str], None]) -> bool:
        """bpftrace's ``print(@); clear(@)``: the map to ``write`` (not when empty); whether it had anything."""
        text = self.take()
        if text:
            write(text)
        return bool(text)

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


class Collector:
    """One aggregation over ``events`` for as long as a ``with`` block lasts (the shell's count, trace's maps).

    Folded on the path qprobe.events.fold_path picks, the one every front end takes: in guest RAM
    where the key and value can be computed at the hit (``GuestMaps``: the events' hits no longer
    recorded), else from each probe's own hit count for a count that needs no more, else through a
    :class:`Tap` (every hit the host sees).  ``owns(event, pid, hits)`` (``--run``'s process tree)
    says which tasks' hits count; ``every`` (seconds) means the map is printed and cleared as hits
    come, so they all come through the tap.
    """

    def __init__(self, events: Sequence[TraceEvent], agg: Aggregation, *, every: float | None = None,
                 owns: Owner | None = None) -> None:  # fmt: skip
        self.events = list(events)
        self.agg = agg
        self.owns = owns
        self.unwind = stack_unwinder() if "$stack" in agg.keys else None
        self.path = fold_path(self.events, agg.kind, agg.keys, agg.value, every=every, owned=owns is not None)
        self._before: list[int] = []
        self._tap: Tap | None = None
        self._maps: GuestMaps | None = None
        self._missed = 0

    @property
    def per_event(self) -> bool:
        return self.path == "probe counts"

    def _uncounted(self) -> int:
        # A per-probe count holds the records dropped on a full ring (nmissed counts those too).
        return sum(te.nmissed - (te.lost if self.per_event else 0) for te in self.events)

    def __enter__(self) -> Collector:
        self._missed = self._uncounted()
        if self.per_event:
            self._before = [_probe_hits(one) for te in self.events for one in te.probes()]
            return self
        agg, owns = self.agg, self.owns

        def sink(te: TraceEvent, hit: EventHit, stack: Stack | None) -> None:
            if owns is None or owns(hit.event, hit.pid, 1):
                agg.add(te, hit, stack)

        # The tap also in a guest map: hits the host still sees (before the jump is placed) come through it.
        self._tap = Tap(self.events, sink, self.unwind).__enter__()
        if self.path == "guest map":
            self._maps = GuestMaps(self.events, agg.keys, agg.value, agg.kind == "hist", owns)
            self._maps.start()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if self.per_event:
            key = self.agg.keys[0] if self.agg.keys else None
            probes = [one for te in self.events for one in te.probes()]
            counts: dict[MapKey, int] = {}
            for one, n in zip(probes, self._before, strict=True):
                k = _event_key(one, key, len(self.events) > 1)
                counts[k] = counts.get(k, 0) + _probe_hits(one) - n
            self.agg.add_counts({k: n for k, n in counts.items() if n})
        else:
            assert self._tap is not None
            try:
                self._tap.__exit__(et, ev, tb)
            finally:
                if self._maps is not None:
                    for te, slots in self._maps.stop():
                        if self.agg.by_event:  # a count with no key over several events: a row per event
                            slots = {(te.definition.event, *parts): slot for parts, slot in slots.items()}
                        self.agg.add_slots(slots)
        self._missed = self._uncounted() - self._missed

    @property
    def in_guest(self) -> bool:
        """Whether the map is folded in guest RAM (every event's, or some of them where a probe refused)."""
        return self._maps is not None

    @property
    def missed(self) -> int:
        """Hits the guest made but nobody counted while the block ran (read after it): records dropped on a
        full lossy ring, or hits missed while the same vCPU was already in a probe."""
        return self._missed


def stack_unwinder() -> Callable[[PtRegs], Stack]:
    """``$stack``: the kernel stack at a hit (drgn's), frames as bpftrace prints them."""

    def unwind(regs: PtRegs) -> Stack:
        return stack_frames(regs.stack_trace())

    return unwind


def _probe_hits(one: TraceEvent) -> int:
    """Delivered, and recorded in the guest but dropped on a full ring."""
    kp = one.probe
    return kp.nhit + kp.nlost if isinstance(kp, Kprobe) else 0


def _event_key(te: TraceEvent, key: str | None, several: bool) -> MapKey:
    """The map key of every hit of ``te`` (one of its probes) for a count by ``key`` (None: no key)."""
    if key == "$func":
        return te.function_name
    return te.definition.event if key == "$event" or several else None


def parse_map(text: str) -> tuple[Aggregation, float | None]:
    """``count [by KEY, ...]`` or ``FUNC(VALUE) [by KEY, ...]``, optionally ``every S``, or bpftrace's
    ``count()`` and ``@NAME[KEY, ...] = FUNC(...)``: one map over every event (``qprobe trace --map``), and
    its interval."""
    named = map_line(text)
    label, line = named if named is not None else (None, text.strip())
    call = split_call(line)
    words = line.split()
    if call is None and (not words or words[0] != "count"):
        raise ShellUsageError(f"--map: expected count [by KEY, ...] or FUNC(VALUE) [by KEY, ...] "
                              f"(FUNC: {' '.join(VALUE_FUNCS)}), or {MAP_USAGE}, not {text!r}")  # fmt: skip
    verb = call[0].func if call is not None else "count"
    spec = parse_collect(call[1] if call is not None else line.split(None, 1)[1] if len(words) > 1 else "", verb=verb)
    if spec.events or spec.command is not None or spec.seconds is not None:
        raise ShellUsageError(f"--map: {verb} [by KEY, ...] [every S] only: the events are trace's definitions, "
                              "and --run or --duration say for how long")  # fmt: skip
    if call is None:
        return Aggregation("count", spec.keys, label=label), spec.every
    return Aggregation(call[0].func, spec.keys, call[0].value, bounds=call[0].bounds, label=label), spec.every


def check_argument(name: str, events: Sequence[tuple[str, ProbeEvent | UprobeEvent]], hint: str = "") -> None:
    """A map's key or value ``name`` is ``$``-special or fetched by every event (a (name, definition) pair);
    ShellUsageError names an event that does not fetch it, with ``hint`` after."""
    if name.startswith("$"):
        return
    for label, ev in events:
        names = [a.name for a in ev.args]
        if name not in names:
            have = ", ".join(names) if names else "no arguments"
            raise ShellUsageError(f"{label} has no argument {name!r} ({have}){hint}")


def check_map_names(agg: Aggregation, definitions: Sequence[ProbeEvent | UprobeEvent]) -> None:
    """Every argument the map names is fetched by every definition; ShellUsageError names one that is not."""
    for name in (*agg.keys, *((agg.value,) if agg.value is not None else ())):
        check_argument(name, [(ev.event, ev) for ev in definitions])
