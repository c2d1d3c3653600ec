"""What qprobe asks of a gdbstub client: the interface both transports implement.

``GdbRemote`` (qprobe.vmm.gdbremote) speaks the remote protocol to QEMU's
gdbstub itself; ``GdbMiRemote`` (qprobe.vmm.gdbmi) drives a real gdb through
GDB/MI.  The stop loop, the recovery of a crashed session and the target's
set-up hold a :class:`GdbTransport` and cannot tell them apart.  These are
exactly the methods they (and the tests comparing the two) call; a transport
may offer more (gdb's console), for a caller that asks for it by type.  A single thread must own a transport.
"""

from __future__ import annotations

from typing import Protocol

from qprobe.vmm.gdbremote import BREAK_SW
from qprobe.vmm.rsp import StopReply


class GdbTransport(Protocol):
    """One connection to a gdbstub: vCPUs as threads, their registers, guest memory, breakpoints, execution."""

    @property
    def running(self) -> bool:
        """Whether the VM was resumed and its stop not collected yet."""
        ...

    def handshake(self) -> StopReply:
        """Connect, learn the registers and vCPUs; the stop the VM is in."""
        ...

    def threads(self) -> list[str]:
        """The vCPUs' thread ids, in vCPU order."""
        ...

    def request(self, payload: bytes) -> bytes:
        """One raw packet and the stub's reply (the VM stopped)."""
        ...

    def select(self, tid: str) -> None:
        """Make ``tid`` the vCPU whose page tables the following virtual memory accesses go through."""
        ...

    def read_registers(self, tid: str) -> dict[str, int]: ...
    def write_registers(self, tid: str, values: dict[str, int]) -> None: ...

    def set_physical(self, on: bool) -> None:
        """Whether the following memory accesses take guest-physical addresses (QEMU's PhyMemMode)."""
        ...

    def read_memory(self, addr: int, size: int) -> bytes: ...
    def write_memory(self, addr: int, data: bytes) -> None: ...

    def insert_breakpoint(self, addr: int, kind: int = BREAK_SW, length: int = 1) -> None:
        """A breakpoint or watchpoint of ``kind`` (gdbremote's BREAK_* and WATCH_*, the ``Z`` packet's types)."""
        ...

    def remove_breakpoint(self, addr: int, kind: int = BREAK_SW, length: int = 1) -> None: ...
    def cont(self) -> None: ...

    def step(self, tid: str, timeout: float = 10.0) -> StopReply:
        """Single-step one vCPU, the others staying stopped; its stop."""
        ...

    def interrupt(self) -> None: ...
    def wait_stop(self, timeout: float | None = 10.0) -> StopReply: ...
    def poll_stop(self, timeout: float, wake: int | None = None) -> StopReply | None:
        """A stop if one comes within ``timeout`` s, else None; None at once when the file descriptor
        ``wake`` is readable."""
        ...

    def detach(self) -> None:
        """Leave the VM running without us, and close."""
        ...

    def close(self) -> None:
        """Drop the connection without a word (a VM gone, or one to leave stopped)."""
        ...


__all__ = ["GdbTransport"]
