"""A unicorn x86-64 CPU that runs generated code at the kernel's addresses, for the unicorn tests.

Code that addresses its data as absolute disp32 (sign-extended: the top 2 GiB) or through GS must run where
the kernel runs it, at 0xffffffff8... addresses; unicorn's own addresses are physical ones, which stop far
below.  Its virtual TLB mode, filled from the test's own maps, puts those addresses on low physical memory.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import unicorn
from unicorn import x86_const as X

CALLER_SAVED = ("rax", "rcx", "rdx", "rsi", "rdi", "r8", "r9", "r10", "r11")
CALLEE_SAVED = ("rbx", "rbp", "r12", "r13", "r14", "r15")
IA32_GS_BASE = 0xC0000101  # the kernel's per-CPU base


class KernelCpu:
    """The CPU, with ``maps`` (virtual start, size) mapped; ``percpu``, if given, its GS base."""

    def __init__(self, maps: Iterable[tuple[int, int]], percpu: int | None = None) -> None:
        self.uc = unicorn.Uc(unicorn.UC_ARCH_X86, unicorn.UC_MODE_64)
        self.uc.ctl_set_tlb_mode(unicorn.UC_TLB_VIRTUAL)
        self.uc.hook_add(unicorn.UC_HOOK_TLB_FILL, self._fill)
        self.maps: list[tuple[int, int, int]] = []  # virtual start, size, physical start
        phys = 0x1000_0000
        for virt, size in maps:
            self.uc.mem_map(phys, size)
            self.maps.append((virt, size, phys))
            phys += size
        if percpu is not None:
            self.uc.msr_write(IA32_GS_BASE, percpu)

    def phys(self, virt: int) -> int:
        """Where ``virt`` is in unicorn's memory (its memory hooks' addresses are these)."""
        for start, size, phys in self.maps:
            if start <= virt < start + size:
                return phys + virt - start
        raise AssertionError(f"{virt:#x} is not mapped")

    def _fill(self, uc: Any, vaddr: int, access: int, entry: Any, data: Any) -> bool:
        entry.paddr, entry.perms = self.phys(vaddr & ~0xFFF), unicorn.UC_PROT_ALL
        return True

    def write(self, virt: int, data: bytes) -> None:
        self.uc.mem_write(self.phys(virt), data)

    def read(self, virt: int, size: int) -> bytes:
        return bytes(self.uc.mem_read(self.phys(virt), size))

    def word(self, virt: int) -> int:
        return int.from_bytes(self.read(virt, 8), "little")

    def reg(self, name: str, value: int | None = None) -> int:
        reg = getattr(X, f"UC_X86_REG_{name.upper()}")
        if value is not None:
            self.uc.reg_write(reg, value)
        return int(self.uc.reg_read(reg))

    def regs(self, names: Iterable[str] = CALLER_SAVED + CALLEE_SAVED) -> dict[str, int]:
        return {name: self.reg(name) for name in names}

    def call(self, fn: int, sp: int, resume: int) -> None:
        """``fn`` called with the stack pointer at ``sp`` (the return address already there), to ``resume``."""
        self.reg("rsp", sp)
        self.uc.emu_start(fn, resume, count=10_000)
        assert self.reg("rip") == resume
