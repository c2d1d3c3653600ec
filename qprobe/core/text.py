"""Kernel text as qprobe changed it: every int3 and jump of a point, with the bytes it replaced."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from qprobe.vmm.journal import Patch
from qprobe.vmm.machine import Machine


class KernelText:
    """The writes of points into kernel text (stop loop), and the text as it was before them."""

    def __init__(self, machine: Machine) -> None:
        self.machine = machine
        # address -> original byte under every int3 and jump of a point (what ``patched`` returns), kept
        # as they are placed and removed: rebuilding it per call made a batch of N probes O(N**2).
        self._text: dict[int, int] = {}

    def patched(self) -> Mapping[int, int]:
        """address -> original byte of everything we changed in kernel text.

        A live read-only view, changed on the stop loop: another thread that iterates it while
        probes come and go takes a copy on the stop loop (``machine.call``).
        """
        return MappingProxyType(self._text)

    def patch(self, addr: int, data: bytes, what: str, slot: int = 0) -> Patch:
        """An int3 or a jump of a point written into kernel text (stop loop), its old bytes noted."""
        p = self.machine.patch(addr, data, what, slot)
        self._text.update(zip(range(addr, addr + len(p.old)), p.old, strict=True))
        return p

    def repatch(self, p: Patch, data: bytes, what: str, slot: int = 0) -> Patch:
        """An int3 of a point swapped for its jump in one write (stop loop)."""
        new = self.machine.repatch(p, data, what, slot)
        self._text.update(zip(range(new.virt, new.virt + len(new.old)), new.old, strict=True))
        return new

    def unpatch(self, p: Patch) -> None:
        """``patch`` undone."""
        self.machine.unpatch(p)
        for a in range(p.virt, p.virt + len(p.old)):
            del self._text[a]

    def original(self, addr: int, size: int) -> bytes:
        """Kernel text as it was before qprobe touched it."""
        text = self._text
        code = self.machine.mem.read(addr, size)
        if not any(a in text for a in range(addr, addr + size)):
            return code
        return bytes(text.get(addr + i, b) for i, b in enumerate(code))
