"""The reorder buffer that hands event hits on in the guest's order."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

from qprobe.events import timeline
from qprobe.events.timeline import WINDOW, CycleOrder, Timeline


def test_a_late_earlier_hit_still_goes_out_first() -> None:
    out: list[str] = []
    tl = Timeline()
    tl.push(10.0, lambda: out.append("b"))
    tl.push(9.99, lambda: out.append("a"))  # drained from a ring after b was seen
    assert out == []
    tl.push(10.0 + WINDOW + 0.01, lambda: out.append("c"))  # a hit a window later: a and b are due
    assert out == ["a", "b"]
    tl.flush()
    assert out == ["a", "b", "c"]
    tl.close()


def test_equal_times_keep_their_arrival_order() -> None:
    out: list[int] = []
    tl = Timeline()
    for i in range(5):
        tl.push(1.0, lambda i=i: out.append(i))
    tl.flush()
    assert out == [0, 1, 2, 3, 4]
    tl.close()


def test_a_held_hit_goes_out_after_its_hold_with_nothing_newer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timeline, "HOLD", 0.05)
    monkeypatch.setattr(timeline, "TICK", 0.01)
    out: list[str] = []
    tl = Timeline()
    tl.push(5.0, lambda: out.append("x"))
    deadline = time.monotonic() + 5.0
    while not out and time.monotonic() < deadline:
        time.sleep(0.01)
    assert out == ["x"]
    tl.close()


def test_a_failing_callback_is_reported_and_the_rest_still_go_out() -> None:
    out: list[str] = []
    tl = Timeline()

    def bad() -> None:
        raise ValueError("user code")

    tl.push(1.0, bad)
    tl.push(2.0, lambda: out.append("after"))
    tl.flush()
    assert out == ["after"]
    assert tl.errors.lines == ["event callback failed: ValueError: user code"]
    tl.close()


def test_a_mailbox_hit_after_a_stop_on_its_vcpu_goes_after_it_when_the_stops_estimate_ran_ahead() -> None:
    # vfs_read's entry is a VM stop whose HPET-based estimate is later than the TSC the
    # guest then reads at vfs_read's return, which reaches the host through the mailbox.
    order = CycleOrder()
    entry = order.stop(1_000_500, vcpu=0)
    ret = order.exact(1_000_200, vcpu=0, at_once=True)
    assert entry == 1_000_500 and ret == 1_000_501


def test_a_mailbox_hit_on_another_vcpu_keeps_its_own_tsc() -> None:
    order = CycleOrder()
    order.stop(1_000_500, vcpu=0)
    assert order.exact(1_000_200, vcpu=1, at_once=True) == 1_000_200


def test_a_ring_record_keeps_its_own_tsc_it_may_be_older_than_the_stop() -> None:
    order = CycleOrder()
    order.stop(1_000_500, vcpu=0)
    assert order.exact(1_000_200, vcpu=0, at_once=False) == 1_000_200


def test_a_stop_goes_after_every_hit_already_seen_and_after_the_last_stop() -> None:
    order = CycleOrder()
    assert order.exact(2_000, vcpu=1, at_once=False) == 2_000
    assert order.stop(1_500, vcpu=0) == 2_001  # the ring record was taken before the stop reached the host
    assert order.stop(1_800, vcpu=1) == 2_002  # stops reach the host in their order
    assert order.stop(9_000, vcpu=0) == 9_000


@dataclass
class _Hit:
    ts: float


def test_printed_times_never_go_back_in_order_under_a_global_clock() -> None:
    # A ring record drained late (order 1.0) was converted on a CPU whose clock ran ahead of the
    # other's: the guest's trace_clock_global() would have stamped the hit after it no earlier.
    tl = Timeline()
    tl.monotone = True
    early, late = _Hit(5.0750), _Hit(5.0740)
    out: list[float] = []
    tl.push(2.0, lambda: out.append(late.ts), late)
    tl.push(1.0, lambda: out.append(early.ts), early)
    tl.flush()
    assert out == [5.0750, 5.0750] and late.ts == 5.0750
    tl.close()


def test_printed_times_are_left_alone_under_a_per_cpu_clock() -> None:
    tl = Timeline()
    early, late = _Hit(5.0750), _Hit(5.0740)
    tl.push(2.0, lambda: None, late)
    tl.push(1.0, lambda: None, early)
    tl.flush()
    assert late.ts == 5.0740
    tl.close()


def test_a_batch_holds_its_pushes_and_hands_them_on_in_order_at_its_end() -> None:
    """Inside batch() nothing goes out (not even a hit a window old), pushes nested in it included; at its end
    they go out in guest-time order, as single pushes would, and the flushers run once after them."""
    out: list[str] = []
    flushes: list[int] = []
    tl = Timeline()
    tl.flushers.append(lambda: flushes.append(len(out)))
    with tl.batch():
        tl.push(2.0, lambda: out.append("b"))
        with tl.batch():
            tl.push(1.0, lambda: out.append("a"))
        tl.push(2.0 + WINDOW + 1.0, lambda: out.append("c"))
        assert out == [] and flushes == []
    assert out == ["a", "b"] and flushes == [2]
    with tl.batch():
        pass
    assert flushes == [2]  # nothing handed on: no flush
    tl.flush()
    assert out == ["a", "b", "c"] and flushes == [2, 3]
    tl.close()


@dataclass
class Run:
    order: list[float]
    ts: list[float]


def test_a_run_goes_out_in_slices_merged_by_time_with_the_other_hits() -> None:
    """A run held as one entry comes out in the same order as its hits pushed one by one would: cut where
    another hit's time falls between two of its own, and whole where nothing does."""
    out: list[object] = []
    tl = Timeline()
    tl.push_run(Run([0.01, 0.03, 0.035, 0.05], [0.0] * 4), lambda a, b: out.append((a, b)))
    tl.push(0.02, lambda: out.append("two"))
    tl.push(0.04, lambda: out.append("four"))
    assert out == []  # all within a window of the newest
    tl.flush()
    assert out == [(0, 1), "two", (1, 3), "four", (3, 4)]
    tl.push_run(Run([0.06, 0.07], [0.0] * 2), lambda a, b: out.append((a, b)))
    tl.flush()
    assert out[-1] == (0, 2)
    tl.close()


def test_a_run_s_hits_are_due_as_single_hits_are() -> None:
    """Hits a window older than the newest go out without a flush; the run's newer ones stay held."""
    out: list[object] = []
    tl = Timeline()
    tl.push_run(Run([1.0, 1.05, 1.25, 1.3], [0.0] * 4), lambda a, b: out.append((a, b)))
    assert out == [(0, 2)]  # 1.0 and 1.05 are a window older than 1.3
    tl.flush()
    assert out == [(0, 2), (2, 4)]
    tl.close()


def test_a_run_s_printed_times_never_go_back_under_a_monotone_clock() -> None:
    @dataclass
    class Hit:
        ts: float

    tl = Timeline()
    tl.monotone = True
    run = Run([0.01, 0.02, 0.04], [0.5, 0.2, 0.6])
    before = Hit(0.7)
    tl.push(0.005, lambda: None, before)
    tl.push_run(run, lambda a, b: None)
    tl.push(0.03, lambda: None, after := Hit(0.1))
    tl.flush()
    assert run.ts == [0.7, 0.7, 0.7] and after.ts == 0.7
    tl.close()


def test_a_run_s_hit_at_the_time_of_one_held_before_it_goes_after_it() -> None:
    """Among equal times the hit pushed first goes first, as single hits do: the run pushed after a hit of
    0.02 hands on its own 0.02 after that one."""
    out: list[object] = []
    tl = Timeline()
    tl.push(0.02, lambda: out.append("held"))
    tl.push_run(Run([0.01, 0.02, 0.03], [0.0] * 3), lambda a, b: out.append((a, b)))
    tl.flush()
    assert out == [(0, 1), "held", (1, 3)]
    tl.close()
