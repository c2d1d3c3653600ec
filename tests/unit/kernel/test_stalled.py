"""What a stalled boot says of its vCPUs: a kernel function for those in the kernel, the address for the others."""

from __future__ import annotations

from qprobe.arch.x86_64.arch import X86_64
from qprobe.kernel.stalled import vcpu_places

CR0_PE_PG = 0x80000011


class _Stub:
    """A stopped VM: vCPU 1 in the kernel's idle loop, vCPU 2 still in the firmware, waiting for its SIPI."""

    regs = {"1": {"rip": 0xFFFFFFFF81A0_0010, "cr0": CR0_PE_PG}, "2": {"rip": 0xFD09A, "cs": 0x0, "cr0": 0x10}}

    def threads(self) -> list[str]:
        return list(self.regs)

    def read_registers(self, tid: str) -> dict[str, int]:
        return self.regs[tid]


class _Symbols:
    def symbolize(self, addr: int) -> str:
        assert addr == 0xFFFFFFFF81A0_0010
        return "default_idle+0x10"


def test_each_vcpu_by_the_function_it_is_in_or_where_it_waits_before_the_kernel() -> None:
    places = vcpu_places(_Stub(), X86_64(), _Symbols())  # type: ignore[arg-type]
    assert places == "vCPU 0 at default_idle+0x10, vCPU 1 at 0xfd09a, not in the kernel yet"
