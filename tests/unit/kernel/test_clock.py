"""The guest's trace clock computed on the host, and finding the TSC read it is calibrated at."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from qprobe.arch import CycleCounter
from qprobe.arch.x86_64.tsc import after_rdtsc
from qprobe.kernel.clock import CALIBRATE_WAIT, ROUND, StopClock, TraceClock


def test_after_rdtsc_is_the_next_instruction() -> None:
    # native_sched_clock's shape: endbr64; rdtsc; shl $0x20,%rdx; or %rdx,%rax
    code = bytes.fromhex("f30f1efa0f3148c1e2204809d0c3")
    assert after_rdtsc(code, 0xFFFFFFFF81000000) == 0xFFFFFFFF81000006


def test_no_rdtsc_no_site() -> None:
    assert after_rdtsc(bytes.fromhex("0f01f9c3"), 0x1000) is None  # rdtscp is not taken


def test_cycles_2_ns_as_the_kernel_computes_it() -> None:
    clock = TraceClock.__new__(TraceClock)
    clock.name = "local"
    clock._scale = lambda cpu: (0x15555556, 30, 12345)  # type: ignore[method-assign]  # a 3 GHz TSC
    # arch/x86/kernel/tsc.c: ns = offset + mul_u64_u32_shr(cyc, mul, shift), a 128-bit product
    cyc = 3_000_000_000 * 1_000_000  # a million seconds of cycles: the product needs more than 64 bits
    assert clock.ns(cyc, 1) == 12345 + (cyc * 0x15555556 >> 30)
    assert abs(clock.ns(cyc, 1) - 12345 - 10**15) < 10**15 // 10**8


class _Ram:
    """Guest memory as a dict of little-endian u64s (and one u32) by address."""

    def __init__(self, words: dict[int, int]) -> None:
        self.words = words

    def read(self, addr: int, size: int) -> bytes:
        raw = b"".join(self.words.get(at, 0).to_bytes(8, "little") for at in range(addr, addr + size, 8))
        return raw[:size]


def _global_clock(words: dict[int, int]) -> TraceClock:
    clock = TraceClock.__new__(TraceClock)
    clock.name, clock._last = "global", {}
    clock._lock = threading.Lock()
    clock.kernel = type("K", (), {"mem": _Ram(words)})()  # type: ignore[assignment]
    clock._scale = lambda cpu: (1 << 30, 30, 0)  # type: ignore[method-assign]  # 1 ns per cycle
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


def test_global_never_goes_back_for_a_later_tsc() -> None:
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
    """ns_many: each TSC as ns converts it (the offsets, the never-back hold across the run), the guest's
    per-CPU clock state read once a CPU, not once a record."""
    words = {0x1000: 1_000, 0x1008: 2_000, 0x1100: 5_000, 0x1108: 9_000, 0x100: int(stable), 0x108: 42, 0x110: 7}
    points = [(1_500, 0), (5_100, 1), (1_499, 0), (1_600, 0), (5_050, 1), (1_700, 0)]
    one_at_a_time = _global_clock(dict(words))
    expected = [one_at_a_time.ns(tsc, cpu) for tsc, cpu in points]
    clock = _global_clock(dict(words))
    ram = _CountingRam(dict(words))
    clock.kernel = type("K", (), {"mem": ram})()  # type: ignore[assignment]
    assert clock.ns_many(points) == expected
    reads_a_cpu = ram.reads // 2
    assert reads_a_cpu == (2 if stable else 4)  # the flag and an offset; unstable, the tick pair read twice too
    assert clock.ns_many([]) == []


class _Guest:
    """A guest whose TSC runs at B ticks per ns of its virtual time, reading its clock every few ms, with
    a gdbstub that stops it LATENCY ns after a breakpoint's trap (the HPET is read at the stop)."""

    A, B, LATENCY, SITE, HPET = 7_000_000_000, 2.5, 40_000, 0x5000, 0xFED00000
    PERIOD_FS = 10_000_000  # a 100 MHz HPET

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
            "sched_clock_read", lambda code, addr: self.SITE, lambda regs: regs["tsc"]))  # fmt: skip
        self.runner = threading.Thread(target=self._run, daemon=True)
        self.runner.start()

    def _run(self) -> None:
        while self.alive:
            time.sleep(0.005)
            with self.lock:
                self.virt += 3_000_000
                if self.armed:
                    tsc = self.A + round(self.B * self.virt)
                    self.virt += self.LATENCY
                    self.pairs += 1
                    self.stop_handlers[self.armed]("1", {"tsc": tsc})

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
        assert self.physical
        counter = self.virt * 10**6 // self.PERIOD_FS
        regs = {self.HPET: self.PERIOD_FS << 32, self.HPET + 0x10: 1, self.HPET + 0xF0: counter}
        return regs[addr].to_bytes(size, "little")

    # the kernel's symbols and memory
    def __contains__(self, name: str) -> bool:
        return name in ("hpet_address", "sched_clock_read", "tsc_khz")

    def address(self, name: str) -> int:
        return {"hpet_address": 0x100, "tsc_khz": 0x108}[name]

    def lookup(self, name: str) -> SimpleNamespace:
        return SimpleNamespace(addr=0x4000, size=16)

    def read(self, addr: int, size: int) -> bytes:
        value = {0x100: self.HPET, 0x108: round(self.B * 1.01 * 10**6)}.get(addr, 0)
        return value.to_bytes(8, "little")[:size]


def test_the_stop_clock_is_usable_after_one_pair_and_calibrated_in_the_background() -> None:
    guest = _Guest()
    try:
        clock = StopClock(guest, guest)  # type: ignore[arg-type]
        assert clock.unavailable() is None
        assert guest.pairs == 1  # one read of the guest's clock; an idle guest makes one every few 100 ms
        assert clock.rate() == 2.5 * 1.01  # the guest's tsc_khz until the rounds end
        deadline = time.monotonic() + 30  # a bound on waiting, not on speed
        while clock.rate() == 2.5 * 1.01 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert guest.pairs == 1 + 2 * ROUND
        assert abs(clock.rate() - guest.B) < guest.B * 1e-4
        now = clock.machine.call(clock._tsc_stopped)
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
