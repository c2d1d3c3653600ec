"""The running kernel as a Target shows it: its memory, its vCPUs' registers and stacks, its data through
drgn, the task a handler interrupted, and gdb's own commands on the live gdbstub."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from qprobe.errors import SymbolError
from qprobe.vmm.gdbmi import GdbMiRemote

if TYPE_CHECKING:
    import drgn

    from qprobe.arch import Arch
    from qprobe.core.regs import PtRegs
    from qprobe.core.regsmaker import RegsMaker
    from qprobe.kernel.program import KernelData, Stack, Task
    from qprobe.kernel.symbols import Symbols
    from qprobe.vmm.gdbremote import GdbRemote
    from qprobe.vmm.machine import Machine
    from qprobe.vmm.memory import GuestMemory


class Viewed(Protocol):
    """What the views read of a target's parts (qprobe.parts.Parts)."""

    @property
    def arch(self) -> Arch: ...
    @property
    def gdb(self) -> GdbRemote | GdbMiRemote: ...
    @property
    def mem(self) -> GuestMemory: ...
    @property
    def symbols(self) -> Symbols: ...
    @property
    def kernel(self) -> KernelData: ...
    @property
    def machine(self) -> Machine: ...
    @property
    def regs_maker(self) -> RegsMaker: ...


class KernelViews:
    """A target's running kernel, read: memory without stopping the VM, vCPUs with every vCPU stopped."""

    def __init__(self, target: Viewed) -> None:
        self.target = target

    def read(self, addr: int | str, size: int) -> bytes:
        """Kernel virtual memory at an address or a symbol, read from shared RAM without stopping the VM."""
        t = self.target
        return t.mem.read(t.symbols.resolve(addr) if isinstance(addr, str) else addr, size)

    def registers(self, vcpu: int) -> dict[str, int]:
        t = self.target
        tid = t.machine.vcpus[vcpu]
        return t.machine.call(lambda: t.gdb.read_registers(tid))

    @property
    def vcpus(self) -> int:
        return len(self.target.machine.vcpus)

    def stack_trace(self, vcpu: int) -> tuple[dict[str, int], Stack | None]:
        """A vCPU's registers and, in the kernel, its stack, read with every vCPU stopped so that the stack
        does not change under the unwinder."""
        t = self.target
        tid = t.machine.vcpus[vcpu]

        def unwind() -> tuple[dict[str, int], Stack | None]:
            values = t.gdb.read_registers(tid)
            if t.arch.user_mode(values):
                return values, None
            return values, t.regs_maker.make_regs(values, tid).stack_trace()

        return t.machine.call(unwind)

    def gdb_command(self, command: str) -> str | None:
        """gdb's CLI on the stub, on the stop loop (gdb may only talk to it while the VM is stopped)."""
        gdb = self.target.gdb
        if not isinstance(gdb, GdbMiRemote):
            return None
        return self.target.machine.call(lambda: gdb.console(command))

    @property
    def prog(self) -> drgn.Program:
        return self.target.kernel.prog

    def var(self, name: str) -> drgn.Object:
        try:
            return self.prog[name]
        except KeyError:
            raise SymbolError(f"no kernel variable {name!r} in {self.target.symbols.path.name}'s debug info") from None

    def current(self, regs: PtRegs) -> drgn.Object:
        return self.target.kernel.current(regs.task_regs)

    def current_task(self, regs: PtRegs) -> Task:
        return self.target.kernel.read_task(regs=regs.task_regs)


__all__ = ["KernelViews", "Viewed"]
