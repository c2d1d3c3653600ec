"""The guest's trace clock computed on the host, and finding the TSC read it is calibrated at."""

from __future__ import annotations

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
