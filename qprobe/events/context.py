"""The FetchContext of one hit: what a definition's fetch arguments read at a stopped vCPU."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from qprobe.errors import QprobeError
from qprobe.fetch import MemoryFault, SymbolInfo
from qprobe.fetch.context import U64_MASK

if TYPE_CHECKING:
    from qprobe.arch import RegisterLayout
    from qprobe.core.kprobe import GuestRecord
    from qprobe.core.regs import PtRegs
    from qprobe.events.registry import EventHost


class HostContext:
    """The FetchContext of one hit: a stopped vCPU's registers and memory."""

    def __init__(self, host: EventHost, regs: PtRegs, retval: int | None, comm: str | None = None,
                 ip: int | None = None, entry: dict[int, int] | None = None) -> None:  # fmt: skip
        self.host = host
        self.regs = regs
        self._entry = entry  # a return probe's arguments, as its entry saw them
        self._retval = retval
        self._comm = comm
        self._ip = ip
        self.syscall_nr = U64_MASK  # RegisterLayout.syscall_nr's field, as the kind's handler's pt_regs hold it
        self.task_size_max = host.mem.paging.task_size_max()

    def reg(self, name: str) -> int:
        if name == self.host.arch.registers.syscall_nr:
            return self.syscall_nr
        if name == self.host.arch.registers.ip and self._ip is not None:
            return self._ip
        value: int = getattr(self.regs, name)  # a register property, or PtRegs.__getattr__
        return value

    def read(self, addr: int, size: int) -> bytes:
        try:
            return self.regs.read(addr, size)
        except QprobeError:
            raise MemoryFault(addr, size) from None

    read_user = read  # the interrupted task's page tables map its user memory too

    def stack(self, n: int) -> int:
        try:
            return self.regs.stack(n)
        except QprobeError:
            return 0

    def stack_pointer(self) -> int:
        sp: int = self.regs.sp
        return sp

    def retval(self) -> int:
        return self.regs.return_value() if self._retval is None else self._retval

    def comm(self) -> str:
        return self._comm if self._comm is not None else self.host.kernel.read_task(regs=self.regs.task_regs).comm

    def arg(self, n: int) -> int:
        if self._entry is not None:
            return self._entry[n]
        return self.regs.arg(n)

    def symbol_address(self, name: str) -> int:
        return self.host.symbols.address(name)

    def symbolize(self, addr: int) -> str:
        info = symbol_lookup(self.host)(addr)
        return f"{info.name}+{info.offset:#x}/{info.size:#x}" if info else f"{addr:#x}"


class RecordContext:
    """The FetchContext of a ring record: its registers as the detour saved them, read without a pt_regs.

    A definition recorded in the guest reads registers only; anything else (memory, the stack) goes
    through the HostContext of the record's pt_regs, made the first time it is asked for.
    """

    def __init__(self, host: EventHost, rec: GuestRecord, layout: RegisterLayout, ip: int, syscall_nr: int,
                 task_size_max: int, make_regs: Callable[[Mapping[str, int], int], PtRegs]) -> None:  # fmt: skip
        self.host = host
        self.rec = rec
        self._layout = layout
        self._ip = ip
        self.syscall_nr = syscall_nr  # RegisterLayout.syscall_nr's field, as the kind's handler's pt_regs hold it
        self.task_size_max = task_size_max
        self._make_regs = make_regs
        self._full: HostContext | None = None

    def _host(self) -> HostContext:
        if self._full is None:
            regs = self._make_regs(self.rec.values, self.rec.cpu)
            self._full = HostContext(self.host, regs, None, self.rec.comm, ip=self._ip)
            self._full.syscall_nr = self.syscall_nr
        return self._full

    def reg(self, name: str) -> int:
        if name == self._layout.syscall_nr:
            return self.syscall_nr
        if name == self._layout.ip:
            return self._ip
        value = self.rec.values.get(self._layout.gdb_name.get(name, ""))
        if value is None:
            value = self._layout.defaults.get(name)
        return self._host().reg(name) if value is None else value

    def read(self, addr: int, size: int) -> bytes:
        return self._host().read(addr, size)

    def read_user(self, addr: int, size: int) -> bytes:
        return self._host().read_user(addr, size)

    def stack(self, n: int) -> int:
        return self._host().stack(n)

    def stack_pointer(self) -> int:
        return self.reg(self._layout.sp)

    def retval(self) -> int:
        return self._host().retval()

    def comm(self) -> str:
        return self.rec.comm

    def arg(self, n: int) -> int:
        args = self._layout.arg_regs
        return self.reg(args[n - 1]) if 0 < n <= len(args) else self._host().arg(n)

    def symbol_address(self, name: str) -> int:
        return self.host.symbols.address(name)

    def symbolize(self, addr: int) -> str:
        return self._host().symbolize(addr)


def symbol_lookup(host: EventHost) -> Callable[[int], SymbolInfo | None]:
    def lookup(addr: int) -> SymbolInfo | None:
        sym = host.symbols.containing(addr)
        return None if sym is None else SymbolInfo(sym.name, addr - sym.addr, host.symbols.kallsyms_size(sym))

    return lookup


__all__ = ["HostContext", "RecordContext", "symbol_lookup"]
