"""The reorder buffer that hands event hits on in the guest's order."""

from __future__ import annotations

import time

import pytest

from qprobe import timeline
from qprobe.timeline import WINDOW, Timeline


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
    assert tl.errors == ["ValueError: user code"]
    tl.close()
