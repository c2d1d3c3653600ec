"""Where an aggregation over events is folded: the one choice the shell, ``qprobe trace --map`` and the
Python API make, and the in-guest maps it picks where it can.

Three paths, cheapest first:

- ``"guest map"``: every event's optimized probe (a uprobe event's: a consumer in the guest kernel's own
  uprobes) folds its hits into a map in guest RAM (``count_in_guest``), nobody woken and no record written.
  Each part of the key and the value must be computable at the hit (see qprobe.events.inguest); with
  ``owned`` (only some processes' hits count, as ``trace --run``'s) the map is keyed by the task's pid as
  well, and the pids that are not the owner's are dropped when the map is read.
- ``"probe counts"``: a count with no key, or by ``$func``/``$event`` alone, of entry kprobes
  without a filter, taken from each probe's own hit count (kept in guest RAM).
- ``"ring"``: every hit reaches the host (a record drained from the rings, or a stop), which folds it.

Printing and clearing a map every few seconds needs the hits as they come, and ``lhist``'s buckets
are the host's: those take the ring.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal

from qprobe.core.kprobe import Kretprobe
from qprobe.core.uprobe import Uprobe
from qprobe.events.inguest import EVENT_KEYS
from qprobe.events.kprobe import KprobeEvent
from qprobe.events.uprobe import UprobeTraceEvent

if TYPE_CHECKING:
    from qprobe.arch.inguest import MapSlot
    from qprobe.events.event import TraceEvent

FoldPath = Literal["guest map", "probe counts", "ring"]
PID = "$pid"
# Whether the owner takes the hits of ``pid`` on ``event`` (``hits`` of them, for its own accounting).
Owner = Callable[[str, int, int], bool]
Slots = dict[tuple[str | int, ...], "MapSlot"]


def fold_path(events: Sequence[TraceEvent], kind: str, keys: Sequence[str], value: str | None, *,
              every: float | None = None, owned: bool = False) -> FoldPath:  # fmt: skip
    """The cheapest exact path for a ``kind`` map (count, sum, avg, min, max, stats, hist, lhist) of
    ``value`` by ``keys`` over ``events``, printed every ``every`` seconds, of the owner's hits only
    with ``owned``."""
    if not events or every is not None:
        return "ring"
    hist = kind == "hist"
    mine = (*keys, PID) if owned else tuple(keys)
    # An optimized kprobe's detour folds a map (a kprobe event's, when its jump can be placed), and a uprobe
    # event's consumer in the guest kernel's own uprobes (qprobe.core.uguest), where it has them.
    foldable = (KprobeEvent, UprobeTraceEvent)
    if kind != "lhist" and all(isinstance(te, foldable) and te.can_count_in_guest(mine, value, hist)
                               for te in events):  # fmt: skip
        return "guest map"
    if not owned and probe_counts(events, kind, keys):
        return "probe counts"
    return "ring"


def probe_counts(events: Sequence[TraceEvent], kind: str, keys: Sequence[str]) -> bool:
    """A count with no key, or by ``$event``/``$func`` alone, of kprobe entry probes without a filter.

    A uprobe event's own probe keeps no count in the guest (its hits each stop the VM and are counted on the
    host, as they come): where the guest can count it, its count is a "guest map".
    """
    return (kind == "count" and set(keys) <= set(EVENT_KEYS) and len(keys) <= 1
            and all(te.filter is None and not isinstance(one.probe, (Kretprobe, Uprobe))
                    for te in events for one in te.probes()))  # fmt: skip


class GuestMaps:
    """Each event's hits folded into its own map in guest RAM, from ``start`` to ``stop``.

    ``owner`` (optional) keeps only the hits of the pids it takes: the maps are keyed by pid too,
    and told apart when they are read, so the owner may learn its pids while the maps fill.
    """

    def __init__(self, events: Sequence[TraceEvent], keys: Sequence[str], value: str | None = None,
                 hist: bool = False, owner: Owner | None = None) -> None:  # fmt: skip
        self.events = list(events)
        self.keys = tuple(keys)
        self.value = value
        self.hist = hist
        self.owner = owner
        self.started: list[TraceEvent] = []

    def start(self) -> bool:
        """Fold in guest RAM from now on; whether every event does (those that could not still see their hits
        through their callbacks, as before)."""
        keys = (*self.keys, PID) if self.owner is not None else self.keys
        for te in self.events:
            if te.count_in_guest(keys, self.value, self.hist):
                self.started.append(te)
        return len(self.started) == len(self.events)

    def stop(self) -> list[tuple[TraceEvent, Slots]]:
        """Stop folding; each started event's map, by the key's parts (a hist() bucket last), the owner's only."""
        out = []
        for te in self.started:
            slots = te.stop_counting_in_guest()
            out.append((te, slots if self.owner is None else self._owned(te.definition.event, slots)))
        self.started = []
        return out

    def _owned(self, event: str, slots: Slots) -> Slots:
        """The slots of the pids the owner takes, the pid part taken out (the slots left that share a key merged)."""
        assert self.owner is not None
        at = len(self.keys)
        by_pid: dict[int, list[tuple[tuple[str | int, ...], MapSlot]]] = {}
        for parts, slot in slots.items():
            pid = parts[at]
            assert isinstance(pid, int)
            by_pid.setdefault(pid, []).append(((*parts[:at], *parts[at + 1 :]), slot))
        out: Slots = {}
        for pid, rows in by_pid.items():
            if not self.owner(event, pid, sum(slot.count for _, slot in rows)):
                continue
            for key, slot in rows:
                old = out.get(key)
                out[key] = slot if old is None else old.merge(slot)
        return out


__all__ = ["EVENT_KEYS", "FoldPath", "GuestMaps", "Owner", "fold_path", "probe_counts"]
