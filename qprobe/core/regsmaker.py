"""pt_regs for handlers, one maker for every kind of probe: kprobes, kretprobes, uprobes, watchpoints, events.

A handler's stack trace must see through the kretprobe trampolines a frame returns to, so the maker
keeps the fixers the kretprobes add (``add_return_fixer``) and gives every pt_regs it makes their answer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from qprobe.arch import Arch
from qprobe.core.regs import PtRegs
from qprobe.kernel.program import KernelData
from qprobe.vmm.machine import Machine


class RegsMaker:
    """Makes a hit's pt_regs from a vCPU's register values."""

    def __init__(self, machine: Machine, kernel: KernelData, arch: Arch) -> None:
        self.machine = machine
        self.kernel = kernel
        self.arch = arch
        self.vcpu_index = {tid: i for i, tid in enumerate(machine.vcpus)}
        # A trampoline a frame returns to -> its real return address (kretprobes'): stack traces see through.
        self._fixers: list[Callable[[int, int], int]] = []

    def make_regs(self, values: Mapping[str, int], tid: str) -> PtRegs:
        """pt_regs for a handler on vCPU ``tid``; its stack traces see through kretprobe trampolines."""
        return PtRegs(dict(values), tid, self.vcpu_index[tid], self.machine.mem, self.kernel.symbols, self.kernel,
                      fix_return=self.fix_return,
                      layout=self.arch.registers)  # fmt: skip

    def make_regs_on(self, values: Mapping[str, int], cpu: int) -> PtRegs:
        """pt_regs for a handler on the ``cpu``-th vCPU."""
        return self.make_regs(values, self.machine.vcpus[cpu])

    def add_return_fixer(self, fix: Callable[[int, int], int]) -> None:
        """``fix(sp, value)``: the real return address behind a trampoline's ``value``, else ``value``."""
        self._fixers.append(fix)

    def fix_return(self, sp: int, value: int) -> int:
        """The real return address behind ``value``, a frame's return with stack pointer ``sp`` (else itself)."""
        for fix in self._fixers:
            real = fix(sp, value)
            if real != value:
                return real
        return value


__all__ = ["RegsMaker"]
