"""The detours' counters in guest RAM folded into their probes (qprobe.core.optcounters.GuestCounters).

The arrays live in a fake RAM the test writes as a detour would; the folds are
checked against those writes.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from qprobe.core.errorlog import ErrorLog
from qprobe.core.kprobe import KPROBE_FLAG_DISABLED, Kprobe, Kretprobe
from qprobe.core.optcounters import MAX_OPTIMIZED, GuestCounters
from qprobe.core.point import Optimized, ProbePoint

BASE = 0x10_0000  # where the arrays are placed in the scratch area
PROBE_ID = 7


class Ram:
    """u64s by physical address, zero until written."""

    def __init__(self) -> None:
        self.words: dict[int, int] = {}

    def read_u64_phys(self, paddr: int) -> int:
        return self.words.get(paddr, 0)


class Rig:
    def __init__(self) -> None:
        self.ram = Ram()
        self.calls: list[str] = []
        records = SimpleNamespace(drain=lambda: self.calls.append("drain"))
        returns = SimpleNamespace(fold_all=lambda: self.calls.append("fold_all"))
        scratch = SimpleNamespace(phys_of=lambda addr: addr)  # identity: the test writes by scratch address
        self.by_id: dict[int, ProbePoint] = {}
        self.counts = GuestCounters(None, 1, scratch, self.ram, self.by_id, records, returns,  # type: ignore[arg-type]
                                    ErrorLog(logging.getLogger("test")))  # fmt: skip
        self.counts.place(BASE)

    def set(self, array: int, value: int, probe_id: int = PROBE_ID) -> None:
        """The detour's counter ``array[probe_id]`` now holds ``value``."""
        self.ram.words[array + probe_id * 8] = value

    def point(self, kind: str, *probes: Kprobe, probe_id: int = PROBE_ID) -> ProbePoint:
        point = ProbePoint(0x1000, "f", None, list(probes))  # type: ignore[arg-type]
        point.opt = Optimized(probe_id, 0, 8, None, 0, kind)  # type: ignore[arg-type]
        self.by_id[probe_id] = point
        return point


@pytest.fixture
def rig() -> Rig:
    return Rig()


def test_the_arrays_follow_each_other_from_where_they_are_placed(rig: Rig) -> None:
    c = rig.counts
    assert (c.missed, c.counters, c.lost) == (BASE, BASE + MAX_OPTIMIZED * 8, BASE + 2 * MAX_OPTIMIZED * 8)
    assert GuestCounters.size == 3 * MAX_OPTIMIZED * 8


def test_a_counting_detour_folds_what_the_guest_counted_since_its_baseline(rig: Rig) -> None:
    c = rig.counts
    rig.set(c.counters, 5)  # left by the id's previous detour
    rig.set(c.missed, 2)
    c.baseline(PROBE_ID)
    on, off = Kprobe(addr=0x1000), Kprobe(addr=0x1000)
    off.flags |= KPROBE_FLAG_DISABLED
    point = rig.point("count", on, off)
    rig.set(c.counters, 12)
    rig.set(c.missed, 3)
    c.sync_missed(point)
    assert (on.nhit, on.nmissed) == (7, 1)
    assert (off.nhit, off.nmissed) == (0, 1)  # a disabled probe's hits do not count; its misses do
    c.sync_missed(point)  # nothing new in the guest: nothing twice
    assert (on.nhit, on.nmissed) == (7, 1)
    assert rig.calls == []  # a counting detour has no records to drain


def test_a_filtered_detour_counts_its_rejected_hits_as_hits_and_filtered(rig: Rig) -> None:
    c = rig.counts
    c.baseline(PROBE_ID)
    kp = Kprobe(addr=0x1000)
    point = rig.point("filtered", kp)
    rig.set(c.counters, 4)
    rig.set(c.lost, 1)
    c.sync_missed(point)
    assert (kp.nhit, kp.nfiltered, kp.nlost, kp.nmissed) == (4, 4, 1, 1)
    assert rig.calls == ["drain"]  # the records first, then the counts that follow them


def test_a_recording_detour_drains_and_counts_a_lost_record_as_missed(rig: Rig) -> None:
    c = rig.counts
    c.baseline(PROBE_ID)
    kp = Kprobe(addr=0x1000)
    point = rig.point("record", kp)
    rig.set(c.counters, 9)  # a recording detour does not count its hits in the guest: not folded
    rig.set(c.lost, 2)
    rig.set(c.missed, 1)
    c.sync_missed(point)
    assert (kp.nhit, kp.nlost, kp.nmissed) == (0, 2, 3)
    assert rig.calls == ["drain"]


def test_a_return_entry_detour_misses_go_to_its_kretprobe(rig: Rig) -> None:
    c = rig.counts
    c.baseline(PROBE_ID)
    rp = Kretprobe(addr=0x1000)
    point = rig.point("retentry", rp.kp)
    rig.set(c.missed, 3)  # calls that found no free instance
    rig.set(c.counters, 6)
    c.sync_missed(point)
    assert (rp.nmissed, rp.kp.nmissed, rp.kp.nhit) == (3, 0, 6)


def test_sync_all_folds_every_in_guest_counter_but_the_mailboxes_and_the_pools(rig: Rig) -> None:
    c = rig.counts
    counting, mailbox = Kprobe(addr=0x1000), Kprobe(addr=0x2000)
    for probe_id in (1, 2):
        c.baseline(probe_id)
    rig.point("count", counting, probe_id=1)
    rig.point("mailbox", mailbox, probe_id=2)
    rig.set(c.counters, 3, probe_id=1)
    rig.set(c.missed, 4, probe_id=2)  # a mailbox probe's misses are folded when its point is synced
    c.sync_all()
    assert (counting.nhit, mailbox.nmissed) == (3, 0)
    assert rig.calls == ["drain", "fold_all"]


def test_keyed_counts_are_empty_for_a_point_that_is_not_keyed(rig: Rig) -> None:
    point = rig.point("count", Kprobe(addr=0x1000))
    assert rig.counts.keyed_counts(point, None) == {}  # type: ignore[arg-type]
