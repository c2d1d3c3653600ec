"""x86's cycle counter facet: the rdtsc the host calibrates at, cycles_2_ns, tsc_khz and the HPET stop timer."""

from __future__ import annotations

from types import SimpleNamespace

from qprobe.arch.x86_64.arch import TSC
from qprobe.arch.x86_64.hpet import hpet_timer
from qprobe.arch.x86_64.tsc import Cyc2ns, after_rdtsc, tsc_hz


def test_after_rdtsc_is_the_next_instruction() -> None:
    # native_sched_clock's shape: endbr64; rdtsc; shl $0x20,%rdx; or %rdx,%rax
    code = bytes.fromhex("f30f1efa0f3148c1e2204809d0c3")
    assert after_rdtsc(code, 0xFFFFFFFF81000000) == 0xFFFFFFFF81000006


def test_no_rdtsc_no_site() -> None:
    assert after_rdtsc(bytes.fromhex("0f01f9c3"), 0x1000) is None  # rdtscp is not taken


def test_the_counter_read_is_edx_eax() -> None:
    assert TSC.value({"rdx": 0xFFFF_FFFF_0000_0012, "rax": 0xAAAA_AAAA_3456_789A}) == 0x12_3456_789A


def test_cycles_2_ns_as_the_kernel_computes_it() -> None:
    clock = Cyc2ns.__new__(Cyc2ns)
    clock.scale = lambda cpu: (0x15555556, 30, 12345)  # type: ignore[method-assign]  # a 3 GHz TSC
    # arch/x86/kernel/tsc.c: ns = offset + mul_u64_u32_shr(cyc, mul, shift), a 128-bit product
    cyc = 3_000_000_000 * 1_000_000  # a million seconds of cycles: the product needs more than 64 bits
    assert clock.ns(cyc, 1) == 12345 + (cyc * 0x15555556 >> 30)
    assert abs(clock.ns(cyc, 1) - 12345 - 10**15) < 10**15 // 10**8


def test_a_run_of_counter_values_reads_each_cpus_scale_once() -> None:
    """ns_many: each value as ns converts it, the scale (its latch's sequence, a read of guest memory) read
    once a CPU for the run, not once a value."""
    scales = {0: (0x15555556, 30, 12345), 1: (1 << 30, 30, 7)}
    asked: list[int] = []

    def scale(cpu: int) -> tuple[int, int, int]:
        asked.append(cpu)
        return scales[cpu]

    clock = Cyc2ns.__new__(Cyc2ns)
    clock.scale = scale  # type: ignore[method-assign]
    points = [(3_000, 0), (5_000, 1), (2**64 - 1, 0), (9_000, 1), (0, 0)]
    expected = [clock.ns(cycles, cpu) for cycles, cpu in points]
    asked.clear()
    assert clock.ns_many(points) == expected
    assert sorted(asked) == [0, 1]
    assert clock.ns_many([]) == []


class _Kernel:
    """The guest kernel as the facet reads it: symbols at fixed addresses, little-endian u64s."""

    def __init__(self, symbols: dict[str, int], words: dict[int, int]) -> None:
        self.symbols, self.words = symbols, words

    def address(self, name: str) -> int | None:
        return self.symbols.get(name)

    def read(self, addr: int, size: int) -> bytes:
        return self.words.get(addr, 0).to_bytes(8, "little")[:size]


def test_the_tsc_rate_is_the_kernels_tsc_khz() -> None:
    assert tsc_hz(_Kernel({"tsc_khz": 0x100}, {0x100: 2_500_000})) == 2_500_000_000  # type: ignore[arg-type]
    assert tsc_hz(_Kernel({}, {})) == 0  # type: ignore[arg-type]


HPET = 0xFED00000


def _hpet(period_fs: int, enabled: int, counter: int) -> dict[int, int]:
    return {HPET: period_fs << 32, HPET + 0x10: enabled, HPET + 0xF0: counter}


def test_the_hpet_counts_ns_by_its_period() -> None:
    regs = _hpet(10_000_000, 1, 0)  # a 100 MHz HPET
    kernel = _Kernel({"hpet_address": 0x100}, {0x100: HPET})
    timer = hpet_timer(kernel, lambda addr, size: regs[addr].to_bytes(size, "little"))  # type: ignore[arg-type]
    assert not isinstance(timer, str)
    regs[HPET + 0xF0] = 1234
    assert timer.ns() == 12340


def test_no_running_hpet_no_stop_timer() -> None:
    def read(regs: dict[int, int]) -> SimpleNamespace:
        return SimpleNamespace(fn=lambda addr, size: regs[addr].to_bytes(size, "little"))

    kernel = _Kernel({"hpet_address": 0x100}, {0x100: HPET})
    assert hpet_timer(kernel, read(_hpet(10_000_000, 0, 0)).fn) == "the guest's HPET counter is not running"  # type: ignore[arg-type]
    assert hpet_timer(_Kernel({"hpet_address": 0x100}, {}), read({}).fn) == "the guest has no HPET to time stops with"  # type: ignore[arg-type]
    assert "no hpet_address" in str(hpet_timer(_Kernel({}, {}), read({}).fn))  # type: ignore[arg-type]
