"""The guest's trace clock computed on the host from the architecture's cycle counter, and the stop clock."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

from qprobe.arch import CycleCounter
from qprobe.kernel.clock import CALIBRATE_WAIT, ROUND, StopClock, TraceClock


def test_an_architecture_without_a_cycle_counter_leaves_hits_to_the_host_clock() -> None:
    kernel = SimpleNamespace(prog=object(), arch=SimpleNamespace(name="toy", cycle_counter=None))
    assert TraceClock(kernel).unavailable() == "qprobe cannot compute toy's sched_clock from a cycle counter"  # type: ignore[arg-type]
    assert StopClock(kernel, kernel).unavailable() == "qprobe cannot read toy's cycle counter at a stop"  # type: ignore[arg-type]


def test_the_architectures_reason_its_sched_clock_cannot_be_computed_is_the_clocks() -> None:
    why = "this kernel's sched_clock is kvm_sched_clock_read, not the TSC's native_sched_clock"
    counter = CycleCounter("f", lambda code, addr: None, lambda regs: 0, lambda kernel: why, lambda kernel: 0,
                           lambda kernel, read: "none")  # fmt: skip
    kernel = SimpleNamespace(prog=object(), arch=SimpleNamespace(name="toy", cycle_counter=counter))
    assert TraceClock(kernel).unavailable() == why  # type: ignore[arg-type]


class _Ram:
    """Guest memory as a dict of little-endian u64s (and one u32) by address."""

    def __init__(self, words: dict[int, int]) -> None:
        self.words = words

    def read(self, addr: int, size: int) -> bytes:
        raw = b"".join(self.words.get(at, 0).to_bytes(8, "little") for at in range(addr, addr + size, 8))
        return raw[:size]


class _OnePerCycle:
    """A sched_clock of 1 ns per cycle on every CPU."""

    def ns(self, cycles: int, cpu: int) -> int:
        return cycles

    def ns_many(self, points: list[tuple[int, int]]) -> list[int]:
        return [cycles for cycles, _cpu in points]


def _global_clock(words: dict[int, int]) -> TraceClock:
    clock = TraceClock.__new__(TraceClock)
    clock.name, clock._last = "global", {}
    clock._lock = threading.Lock()
    clock.kernel = type("K", (), {"mem": _Ram(words)})()  # type: ignore[assignment]
    clock._sched = _OnePerCycle()
    clock._addrs = (0x100, 0x108, 0x110)  # __sched_clock_stable, __sched_clock_offset, __gtod_offset
    clock._scd, clock._percpu = (0x1000, 0, 8), [0, 0x100]  # sched_clock_data: tick_raw, tick_gtod
    return clock


def test_global_is_the_time_of_day_at_the_tick_plus_sched_clocks_advance() -> None:
    # kernel/sched/clock.c sched_clock_local(): tick_gtod + __gtod_offset + (sched_clock() - tick_raw)
    clock = _global_clock({0x1100: 5_000_000, 0x1108: 7_000_000, 0x110: 30})  # CPU 1's tick, the offset
    assert clock.ns(5_000_100, 1) == 7_000_000 + 30 + 100


def test_a_stable_sched_clock_only_adds_its_offset() -> None:
    clock = _global_clock({0x100: 1, 0x108: 42})
    assert clock.ns(1_000, 0) == 1_042


def test_global_never_goes_back_for_a_later_counter_value() -> None:
    words = {0x1000: 1_000, 0x1008: 2_000}
    clock = _global_clock(words)
    first = clock.ns(1_500, 0)
    words[0x1000], words[0x1008] = 1_600, 2_050  # a later tick whose time of day is behind sched_clock's
    assert clock.ns(1_501, 0) == first  # held, as trace_clock_global's prev_time holds it
    assert clock.ns(1_400, 0) == 2_050 - 200  # an older TSC is converted as it is, not held


class _CountingRam(_Ram):
    def __init__(self, words: dict[int, int]) -> None:
        super().__init__(words)
        self.reads = 0

    def read(self, addr: int, size: int) -> bytes:
        self.reads += 1
        return super().read(addr, size)


@pytest.mark.parametrize("stable", [False, True])
def test_a_run_of_records_reads_the_clock_s_state_once_a_cpu_and_converts_as_one_at_a_time(stable: bool) -> None:
    """ns_many: each counter value as ns converts it (the offsets, the never-back hold across the run), the guest's
    per-CPU clock state read once a CPU, not once a record."""
    words = {0x1000: 1_000, 0x1008: 2_000, 0x1100: 5_000, 0x1108: 9_000, 0x100: int(stable), 0x108: 42, 0x110: 7}
    points = [(1_500, 0), (5_100, 1), (1_499, 0), (1_600, 0), (5_050, 1), (1_700, 0)]
    one_at_a_time = _global_clock(dict(words))
    expected = [one_at_a_time.ns(cycles, cpu) for cycles, cpu in points]
    clock = _global_clock(dict(words))
    ram = _CountingRam(dict(words))
    clock.kernel = type("K", (), {"mem": ram})()  # type: ignore[assignment]
    assert clock.ns_many(points) == expected
    reads_a_cpu = ram.reads // 2
    assert reads_a_cpu == (2 if stable else 4)  # the flag and an offset; unstable, the tick pair read twice too
    assert clock.ns_many([]) == []


class _Guest:
    """A guest whose cycle counter runs at B ticks per ns of its virtual time, reading its clock every few ms,
    with a gdbstub that stops it LATENCY ns after a breakpoint's trap (the stop timer is read at the stop:
    the toy's counts ns of virtual time at physical address TIMER)."""

    A, B, LATENCY, SITE, TIMER = 7_000_000_000, 2.5, 40_000, 0x5000, 0xFED00000

    def __init__(self) -> None:
        self.lock = threading.Lock()  # the stop loop: one request or stop at a time
        self.virt = 1_000_000_000
        self.armed = 0
        self.pairs = 0
        self.alive = True
        self.stop_handlers: dict[int, Any] = {}
        self.gdb = self
        self.physical = False
        self.symbols, self.mem = self, self
        # The guest's own calibration of its TSC, 1% off: what the model uses until its own rounds end.
        self.arch = SimpleNamespace(name="toy", cycle_counter=CycleCounter(
            "sched_clock_read", lambda code, addr: self.SITE, lambda regs: regs["cycles"], lambda kernel: "unused",
            lambda kernel: round(self.B * 1.01 * 10**6) * 1000, self._timer))  # fmt: skip
        self.runner = threading.Thread(target=self._run, daemon=True)
        self.runner.start()

    def _run(self) -> None:
        while self.alive:
            time.sleep(0.005)
            with self.lock:
                self.virt += 3_000_000
                if self.armed:
                    cycles = self.A + round(self.B * self.virt)
                    self.virt += self.LATENCY
                    self.pairs += 1
                    self.stop_handlers[self.armed]("1", {"cycles": cycles})

    def _timer(self, kernel: object, read_phys: Callable[[int, int], bytes]) -> SimpleNamespace:
        assert self.lock.locked()  # made on the stop loop's thread
        return SimpleNamespace(ns=lambda: int.from_bytes(read_phys(self.TIMER, 8), "little"))

    # the Machine
    def call(self, fn: Callable[[], Any], timeout: float = 60.0) -> Any:
        with self.lock:
            return fn()

    # the gdbstub
    def insert_breakpoint(self, addr: int, kind: int) -> None:
        self.armed = addr

    def remove_breakpoint(self, addr: int, kind: int) -> None:
        self.armed = 0

    def set_physical(self, on: bool) -> None:
        self.physical = on

    def read_memory(self, addr: int, size: int) -> bytes:
        assert self.physical and addr == self.TIMER
        return self.virt.to_bytes(size, "little")

    # the kernel's symbols and memory
    def __contains__(self, name: str) -> bool:
        return name == "sched_clock_read"

    def lookup(self, name: str) -> SimpleNamespace:
        return SimpleNamespace(addr=0x4000, size=16)

    def read(self, addr: int, size: int) -> bytes:
        return bytes(size)


def test_the_stop_clock_is_usable_after_one_pair_and_calibrated_in_the_background() -> None:
    guest = _Guest()
    try:
        clock = StopClock(guest, guest)  # type: ignore[arg-type]
        assert clock.unavailable() is None
        # One read of the guest's clock made it usable: the calibration thread may have taken a pair or two
        # since (the toy guest reads its clock every 5 ms), never its rounds (RATE_BASELINE apart).
        assert 1 <= guest.pairs < 1 + 2 * ROUND
        assert clock.rate() == 2.5 * 1.01  # the guest's own calibration until the rounds end
        deadline = time.monotonic() + 30  # a bound on waiting, not on speed
        while clock.rate() == 2.5 * 1.01 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert guest.pairs == 1 + 2 * ROUND
        assert abs(clock.rate() - guest.B) < guest.B * 1e-4
        now = clock.machine.call(clock._cycles_stopped)
        assert abs(now - (guest.A + guest.B * guest.virt)) < guest.B * 2 * guest.LATENCY
    finally:
        guest.alive = False


def test_the_calibration_thread_ends_with_its_target() -> None:
    guest = _Guest()
    clock = StopClock(guest, guest)  # type: ignore[arg-type]
    assert clock.unavailable() is None
    guest.alive = False  # closed before the rounds: the thread stops asking the stop loop
    threads = [t for t in threading.enumerate() if t.name == "qprobe-stop-clock"]
    for t in threads:
        t.join(CALIBRATE_WAIT + 5)
    assert not any(t.is_alive() for t in threads)


class _TickingRam(_Ram):
    """A CPU's tick stores its pair (tick_raw, tick_gtod at 0x1000) while the host reads: right after the
    host's first read there."""

    def __init__(self, old: tuple[int, int], new: tuple[int, int]) -> None:
        super().__init__({0x1000: old[0], 0x1008: old[1]})
        self.new: tuple[int, int] | None = new

    def read(self, addr: int, size: int) -> bytes:
        raw = super().read(addr, size)
        if self.new is not None and 0x1000 <= addr < 0x1010:
            self.words[0x1000], self.words[0x1008] = self.new
            self.new = None
        return raw


def test_a_tick_pair_read_while_the_tick_stores_it_is_read_again() -> None:
    # A 4 ms tick: a pair from two ticks (the old sched_clock, the new time of day) puts the hit a tick late.
    clock = _global_clock({})
    clock.kernel = type("K", (), {"mem": _TickingRam((5_000_000, 7_000_000), (9_000_000, 11_000_000))})()  # type: ignore[assignment]
    assert clock.ns(8_999_000, 0) == 11_000_000 - 1_000


def test_a_kernel_without_a_calibrated_counter_rate_leaves_stops_to_the_host_clock() -> None:
    guest = _Guest()
    try:
        guest.arch.cycle_counter = replace(guest.arch.cycle_counter, hz=lambda kernel: 0)
        clock = StopClock(guest, guest)  # type: ignore[arg-type]
        assert clock.unavailable() == "the guest kernel has no rate of its cycle counter to time stops with"
        assert guest.pairs == 0 and clock.cycles() is None
    finally:
        guest.alive = False
