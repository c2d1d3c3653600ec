"""The guest's tasks as a handler sees them: ``current`` and its pid and comm.

``current`` is the per-CPU ``current_task`` (Linux 6.1; 6.2 moved it into
``pcpu_hot``), read at gs_base + its per-CPU offset, as the kernel's own
``this_cpu_read`` does in kernel mode.  Field offsets come from the kernel's
BTF, so they are right for whatever configuration the image was built with.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from qprobe.errors import SymbolError
from qprobe.kernel.btf import Btf
from qprobe.kernel.symbols import Symbols
from qprobe.target.memory import GuestMemory


@dataclass(frozen=True)
class Task:
    """A guest task_struct: its address, pid (thread id), tgid and comm."""

    addr: int
    pid: int
    tgid: int
    comm: str

    def __str__(self) -> str:
        return f"{self.comm}-{self.pid}"


class Tasks:
    def __init__(self, symbols: Symbols, mem: GuestMemory) -> None:
        self.symbols = symbols
        self.mem = mem

    @property
    def _btf(self) -> Btf:
        return self.symbols.btf

    @cached_property
    def offsets(self) -> tuple[int, int, int, int]:
        """(per-CPU offset of current_task, then offsetof task_struct pid, tgid, comm)."""
        if "current_task" in self.symbols.percpu:
            cur = self.symbols.percpu["current_task"]
        elif "pcpu_hot" in self.symbols.percpu:  # Linux >= 6.2
            cur = self.symbols.percpu["pcpu_hot"] + self._btf.offsetof("pcpu_hot", "current_task")
        else:
            raise SymbolError("this vmlinux has neither current_task nor pcpu_hot: cannot find current")
        btf = self._btf
        return cur, btf.offsetof("task_struct", "pid"), btf.offsetof("task_struct", "tgid"), \
            btf.offsetof("task_struct", "comm")  # fmt: skip

    def current_addr(self, gs_base: int) -> int:
        """The task_struct address running on a vCPU stopped in kernel mode."""
        return self.mem.read_u64(gs_base + self.offsets[0])

    def task(self, addr: int) -> Task:
        _cur, pid_off, tgid_off, comm_off = self.offsets
        pid = int.from_bytes(self.mem.read(addr + pid_off, 4), "little", signed=True)
        tgid = int.from_bytes(self.mem.read(addr + tgid_off, 4), "little", signed=True)
        comm = self.mem.read(addr + comm_off, 16).split(b"\0")[0].decode(errors="replace")
        return Task(addr, pid, tgid, comm)

    def current(self, gs_base: int) -> Task:
        return self.task(self.current_addr(gs_base))
