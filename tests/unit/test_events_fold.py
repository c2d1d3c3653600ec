"""The one choice of where a map is folded (qprobe.events.fold), and the in-guest maps with an owner."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import pytest

from qprobe.arch.inguest import MapSlot
from qprobe.core.kprobe import Kprobe
from qprobe.events.fold import GuestMaps, fold_path
from qprobe.events.kprobe import KprobeEvent
from qprobe.shell.collect import Aggregation, Collector

FOLDABLE = {"$comm", "$pid", "$cpu", "$func", "$event", "fd", "count"}  # what the fake detour can compute


class FakeEvent(KprobeEvent):
    """A kprobe event whose in-guest map is whatever the test says it folded."""

    nmissed = lost = 0  # nothing missed, nothing dropped

    def __init__(self, name: str = "rd", foldable: bool = True, filter: object = None) -> None:
        self.definition = SimpleNamespace(event=name, group="kprobes")  # type: ignore[assignment]
        self.foldable = foldable
        self.filter = filter  # type: ignore[assignment]
        self.probe = Kprobe(symbol_name="ksys_read")
        self.folded: dict[tuple[str | int, ...], MapSlot] = {}
        self.asked: list[tuple[tuple[str, ...], str | None, bool]] = []
        self.callback = None
        self.appended = []

    def probes(self) -> list[FakeEvent]:
        return [self]

    def use_host_handler(self, on: bool) -> None:
        pass

    def can_count_in_guest(self, keys: Sequence[str], value: str | None = None, hist: bool = False) -> bool:
        return self.foldable and set(keys) <= FOLDABLE and (value is None or value in FOLDABLE)

    def count_in_guest(self, keys: Sequence[str], value: str | None = None, hist: bool = False) -> bool:
        self.asked.append((tuple(keys), value, hist))
        return self.can_count_in_guest(keys, value, hist)

    def stop_counting_in_guest(self) -> dict[tuple[str | int, ...], MapSlot]:
        return self.folded


@pytest.mark.parametrize(
    ("kind", "keys", "value", "every", "owned", "path"),
    [
        ("count", (), None, None, False, "guest map"),  # the keyless count: a map with an empty key
        ("count", ("$comm",), None, None, False, "guest map"),
        ("count", ("$comm",), None, None, True, "guest map"),  # trace --run's: keyed by pid as well
        ("count", (), None, None, True, "guest map"),
        ("sum", ("$comm",), "count", None, True, "guest map"),
        ("hist", (), "count", None, False, "guest map"),
        ("lhist", (), "count", None, False, "ring"),  # its buckets are the host's
        ("count", ("$comm",), None, 1.0, False, "ring"),  # printed as the hits come
        ("count", ("$stack",), None, None, False, "ring"),
    ],
)
def test_fold_path_takes_the_guest_map_wherever_the_map_allows(
    kind: str, keys: tuple[str, ...], value: str | None, every: float | None, owned: bool, path: str
) -> None:
    assert fold_path([FakeEvent()], kind, keys, value, every=every, owned=owned) == path


def test_fold_path_without_a_guest_map() -> None:
    """An event the detour cannot fold: a keyless count is each probe's own, unless an owner picks the hits."""
    cannot = FakeEvent(foldable=False)
    assert fold_path([cannot], "count", (), None) == "probe counts"
    assert fold_path([cannot], "count", ("$func",), None) == "probe counts"
    assert fold_path([cannot], "count", (), None, owned=True) == "ring"
    assert fold_path([cannot], "count", ("$comm",), None) == "ring"
    assert fold_path([FakeEvent(foldable=False, filter=object())], "count", (), None) == "ring"
    assert fold_path([FakeEvent(), FakeEvent("wr")], "count", (), None) == "guest map"  # every event its own map
    assert fold_path([SimpleNamespace(filter=None)], "count", ("$comm",), None) == "ring"  # type: ignore[list-item]
    assert fold_path([FakeEvent(), cannot], "count", (), None) == "probe counts"
    assert fold_path([], "count", (), None) == "ring"


def test_an_owner_keeps_its_pids_and_learns_their_hits() -> None:
    te = FakeEvent()
    told: list[tuple[str, int, int]] = []

    def owner(event: str, pid: int, hits: int) -> bool:
        told.append((event, pid, hits))
        return pid in (7, 8)

    maps = GuestMaps([te], ("$comm",), owner=owner)
    assert maps.start() and te.asked == [(("$comm", "$pid"), None, False)]
    te.folded = {("workload", 7): MapSlot(5), ("workload", 8): MapSlot(2), ("sh", 9): MapSlot(3)}
    assert maps.stop() == [(te, {("workload",): MapSlot(7)})]
    assert sorted(told) == [("rd", 7, 5), ("rd", 8, 2), ("rd", 9, 3)]


def test_collector_folds_a_keyless_count_of_several_events_in_the_guest_a_row_each() -> None:
    rd, wr = FakeEvent("rd"), FakeEvent("wr")
    agg = Aggregation("count", by_event=True)
    with Collector([rd, wr], agg) as c:
        assert c.path == "guest map" and c.in_guest
        rd.folded, wr.folded = {(): MapSlot(3)}, {(): MapSlot(4)}
    assert agg.render() == "@[rd]: 3\n@[wr]: 4\n"


def test_collector_with_an_owner_counts_the_owner_s_hits_only() -> None:
    """trace --run's map: folded in the guest by pid, the command's pids kept, as the tap keeps its hits."""
    te = FakeEvent()
    agg = Aggregation("count", ("$comm",))
    with Collector([te], agg, owns=lambda event, pid, hits: pid == 7) as c:
        assert c.path == "guest map"
        te.folded = {("workload", 7): MapSlot(50_000), ("sh", 3): MapSlot(1)}
    assert agg.render() == "@[workload]: 50000\n"
