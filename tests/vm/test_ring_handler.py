"""Ring handlers (``Target.ring_buffer``): a kprobe event's hits in batches off the record rings, checked against
what the guest's workload did (its pid, fd and the offsets it passed, printed by the workload itself)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

import qprobe
from qprobe.errors import InvalidProbe
from qprobe.events import Samples

from .conftest import wait_for_optimizer, workload_result

pytestmark = pytest.mark.vm

CALLS = 5000
DEFINITION = "p:ringtest/seek ksys_lseek fd=%di:u32 off=%si:s64 whence=%dx:u32 who=$comm"


def _until(done: threading.Event, check: Callable[[], bool], timeout: float = 60.0) -> None:
    """Wait, while the collector drains the rings, until ``check()`` holds (or the timeout: the asserts say why)."""
    end = time.monotonic() + timeout
    while not check() and time.monotonic() < end:
        done.wait(0.1)
        done.clear()


def test_a_ring_handler_gets_every_call_with_the_workload_s_arguments(target: qprobe.Target) -> None:
    batches: list[Samples] = []
    delivered = threading.Event()

    def sample_cb(samples: Samples) -> None:
        batches.append(samples)
        delivered.set()

    te = target.ring_buffer(DEFINITION, sample_cb)
    try:
        wait_for_optimizer(target)
        res = workload_result(target.run(f"workload lseek {CALLS}").check().output)
        pid = int(res["pid"])

        def mine() -> list[tuple[int, int, int, str]]:
            return [(s.args["fd"], s.args["off"], s.args["whence"], s.comm) for b in list(batches) for s in b
                    if s.pid == pid]  # fmt: skip

        _until(delivered, lambda: len(mine()) >= CALLS)
    finally:
        target.remove_event(te)
    got = mine()
    assert len(got) == CALLS  # every call once: none lost, none twice
    assert sorted(off for _, off, _, _ in got) == list(range(1, CALLS + 1))
    assert {(fd, whence, comm) for fd, _, whence, comm in got} == {(int(res["fd"]), 0, "workload")}
    assert te.lost == 0 and te.nhit == sum(len(b) for b in batches) and not te.hits
    assert max(len(b) for b in batches) > 1  # drained from the rings in runs, not taken a hit at a time
    ts = [t for b in batches for t in b.ts]
    assert all(b.event == "seek" for b in batches) and ts == sorted(ts)
    assert not target.events


def test_what_a_ring_handler_raises_is_counted_and_leaves_nothing_armed(target: qprobe.Target) -> None:
    before = dict(target.journal.patches)
    calls: list[int] = []
    delivered = threading.Event()

    def sample_cb(samples: Samples) -> None:
        calls.append(len(samples))
        delivered.set()
        raise ValueError("a handler's bug")

    te = target.ring_buffer(DEFINITION, sample_cb)
    try:
        wait_for_optimizer(target)
        res = workload_result(target.run("workload lseek 300").check().output)
        _until(delivered, lambda: sum(calls) >= 300)
    finally:
        target.remove_event(te)
    assert res["errors"] == "0" and sum(calls) >= 300  # later batches still came
    assert te.probe is not None and te.probe.nfaults == len(calls)
    assert "ValueError: a handler's bug" in te.probe.errors[0]
    assert target.journal.patches == before and not target.events


def test_a_ring_handler_refuses_what_the_guest_cannot_record(target: qprobe.Target) -> None:
    before = dict(target.journal.patches)
    for text in ("p:ringtest/mem ksys_lseek first=+0(%sp):u64", "r:ringtest/ret ksys_lseek ret=$retval"):
        with pytest.raises(InvalidProbe, match="a ring handler takes what an optimized probe records"):
            target.ring_buffer(text, lambda samples: None)
    assert target.journal.patches == before and not target.events
