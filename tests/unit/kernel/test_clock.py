"""The guest's trace clock computed on the host, and finding the TSC read it is calibrated at."""

from __future__ import annotations

import threading

from qprobe.arch.x86_64.tsc import after_rdtsc
from qprobe.kernel.clock import TraceClock


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
        return self.words.get(addr, 0).to_bytes(8, "little")[:size]


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
