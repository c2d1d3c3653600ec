"""A VM that dies is said to whoever waits: the stop loop tells its gone_watchers (never on close()), and
Target.interrupt_when_gone turns that into GoneInterrupt in the main thread, wherever it sleeps."""

from __future__ import annotations

import signal
import threading
import time
from types import SimpleNamespace
from typing import Any, cast

import pytest

from qprobe.api import Target
from qprobe.errors import GoneInterrupt, TargetGone
from qprobe.lifetime import Lifetime
from qprobe.parts import Parts
from qprobe.vmm.machine import Machine


class _DyingStub:
    """A gdbstub whose VM runs until ``die`` is set, then is gone (as a connection to a killed QEMU reports)."""

    def __init__(self) -> None:
        self.running = True
        self.die = threading.Event()

    def threads(self) -> list[str]:
        return ["1"]

    def poll_stop(self, timeout: float, wake: int | None = None) -> None:
        if self.die.wait(timeout):
            raise TargetGone("lost the gdbstub connection unix:/x/gdb.sock: QEMU exited")

    def interrupt(self) -> None:
        self.running = False

    def wait_stop(self, timeout: float) -> SimpleNamespace:
        return SimpleNamespace(exited=False, signal=signal.SIGINT, thread=None)  # our own interrupt

    def cont(self) -> None:
        self.running = True

    def detach(self) -> None:
        pass


def _machine() -> tuple[Machine, _DyingStub]:
    stub = _DyingStub()
    return Machine(cast(Any, stub), cast(Any, None), cast(Any, None), "rip"), stub


def _target(machine: Machine) -> Target:
    target = Target.__new__(Target)
    target.parts = Parts(None, "unix:/x/gdb.sock")
    target.machine = machine
    target.lifetime = Lifetime(target.parts)
    return target


def test_the_watchers_hear_of_a_death_once_and_never_of_a_close() -> None:
    machine, stub = _machine()
    told: list[bool] = []
    machine.gone_watchers.append(lambda: told.append(machine.alive))
    stub.die.set()
    machine._thread.join(10)  # a bound on waiting for the loop, not on its speed
    assert told == [False]
    closed, _ = _machine()
    closed.gone_watchers.append(lambda: told.append(True))
    closed.close(detach=True)
    assert told == [False]


def test_a_main_thread_that_sleeps_is_interrupted_with_why_and_the_sigint_handler_is_put_back() -> None:
    machine, stub = _machine()
    before = signal.getsignal(signal.SIGINT)
    threading.Timer(0.2, stub.die.set).start()
    with pytest.raises(GoneInterrupt) as caught, _target(machine).interrupt_when_gone():
        time.sleep(30)  # a bound: the VM's death ends it
    assert str(caught.value) == str(caught.value.gone)
    assert str(caught.value).startswith("the VM is gone: lost the gdbstub connection")
    assert isinstance(caught.value, SystemExit)  # so that a REPL's or a test's `except Exception` lets it by
    assert signal.getsignal(signal.SIGINT) is before and machine.gone_watchers == []


def test_a_sigint_of_someone_else_s_goes_to_the_handler_it_replaced() -> None:
    # A handler of the test's own: a process started in the background by a shell inherits SIGINT ignored,
    # and Python then installs none (the run this test is part of may be one).
    heard: list[int] = []

    def replaced(signum: int, frame: object) -> None:
        heard.append(signum)
        raise KeyboardInterrupt

    machine, _ = _machine()
    before = signal.signal(signal.SIGINT, replaced)
    try:
        with pytest.raises(KeyboardInterrupt), _target(machine).interrupt_when_gone():
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
            time.sleep(30)
        assert heard == [signal.SIGINT] and signal.getsignal(signal.SIGINT) is replaced
    finally:
        signal.signal(signal.SIGINT, before)
    assert machine.alive
    machine.close()


def test_a_vm_gone_before_the_block_is_said_at_once() -> None:
    machine, stub = _machine()
    stub.die.set()
    machine._thread.join(10)
    with pytest.raises(TargetGone, match="the VM is gone"), _target(machine).interrupt_when_gone():
        pytest.fail("the block ran with its VM gone")


def test_teardown_stops_our_qemu_whatever_the_stop_loop_does() -> None:
    """A stop loop that never answers close() (its QEMU's gdbstub stuck) must not keep QEMU running."""

    class _StuckMachine:
        def close(self, detach: bool) -> None:
            raise TimeoutError("the stop loop did not answer")

    stopped: list[str] = []
    parts = Parts(cast(Any, SimpleNamespace(terminate=lambda: stopped.append("qemu"))), "unix:/x/gdb.sock")
    parts.machine = cast(Any, _StuckMachine())
    with pytest.raises(TimeoutError):
        Lifetime(parts).teardown()
    assert stopped == ["qemu"]
