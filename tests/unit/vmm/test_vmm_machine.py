"""The stop loop serves a request from another thread as soon as it is queued: ``call`` wakes the loop's wait
on the running VM through a pipe, and a request to a loop that has ended fails at once."""

from __future__ import annotations

import os
import select
import signal
import threading
from types import SimpleNamespace
from typing import Any, cast

import pytest

from qprobe.errors import TargetError
from qprobe.vmm.machine import Machine


class _WakeOnlyStub:
    """A running VM that never stops by itself: its wait for a stop ends only when the loop is woken, so a
    request that did not wake it would never be served."""

    def __init__(self) -> None:
        self.running = True
        self.woken = 0
        self.interrupts = 0
        self.waiting = threading.Event()  # set while the loop waits on the running VM

    def threads(self) -> list[str]:
        return ["1"]

    def poll_stop(self, timeout: float, wake: int | None = None) -> None:
        assert wake is not None, "the loop waits without a way to be woken"
        self.waiting.set()
        select.select([wake], [], [])  # no timeout: only a wake-up ends this wait
        self.waiting.clear()
        self.woken += 1

    def interrupt(self) -> None:
        self.interrupts += 1
        self.running = False

    def wait_stop(self, timeout: float) -> SimpleNamespace:
        return SimpleNamespace(exited=False, signal=signal.SIGINT, thread=None)  # our own interrupt

    def cont(self) -> None:
        self.running = True

    def detach(self) -> None:
        pass


def test_a_request_wakes_the_loop_that_waits_on_a_running_vm() -> None:
    stub = _WakeOnlyStub()
    machine = Machine(cast(Any, stub), cast(Any, None), cast(Any, None), "rip")
    try:
        for n in range(3):
            assert stub.waiting.wait(30)  # the loop is in its wait, which nothing but a wake-up ends
            assert machine.call(lambda n=n: n * 7, timeout=30) == n * 7  # a bound on a hang, not a speed
            assert stub.woken == n + 1
        assert stub.interrupts == 3
    finally:
        machine.close()
    assert not machine.alive


def test_a_request_to_a_loop_that_has_ended_fails_at_once() -> None:
    stub = _WakeOnlyStub()
    machine = Machine(cast(Any, stub), cast(Any, None), cast(Any, None), "rip")
    machine.close()
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(TargetError, match="the stop loop ended"):
        machine.call(lambda: None, timeout=30)  # not a TimeoutError: nothing is waited for
    assert len(os.listdir("/proc/self/fd")) == before  # no write reached a descriptor the loop gave back


def test_the_wake_up_pipe_is_given_back_when_the_loop_ends() -> None:
    before = len(os.listdir("/proc/self/fd"))
    machines = [Machine(cast(Any, _WakeOnlyStub()), cast(Any, None), cast(Any, None), "rip") for _ in range(5)]
    for machine in machines:
        machine.close()
    assert all(not m._thread.is_alive() for m in machines)
    assert len(os.listdir("/proc/self/fd")) == before


def test_many_threads_calling_at_once_are_all_served() -> None:
    stub = _WakeOnlyStub()
    machine = Machine(cast(Any, stub), cast(Any, None), cast(Any, None), "rip")
    results: list[int] = []
    lock = threading.Lock()

    def caller(k: int) -> None:
        for i in range(20):
            value = machine.call(lambda i=i: k * 100 + i, timeout=30)
            with lock:
                results.append(value)

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        machine.close()
    assert sorted(results) == sorted(k * 100 + i for k in range(4) for i in range(20))
