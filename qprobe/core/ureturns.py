"""The return instances of uretprobes: the kernel's prepare_uretprobe() and handle_trampoline(), from the host.

A return probe's entry reads the return address and puts a breakpoint there; the return is the stop of the
same task, in the same address space, with the stack pointer the return leaves.  Frames a task left without
returning (``longjmp``) are dropped when it calls from an outer one (the kernel's
``cleanup_return_instances``) or returns from one (its ``handle_trampoline``); at most MAX_URETPROBE_DEPTH
live per task, as in the kernel.
"""

from __future__ import annotations

from collections.abc import Mapping as Regs
from dataclasses import dataclass

from qprobe.arch import Arch
from qprobe.core.handlers import Handlers
from qprobe.core.regs import PtRegs
from qprobe.core.upoints import UprobePoint, UprobePoints
from qprobe.core.uprobe import Uprobe
from qprobe.errors import QprobeError

__all__ = ["MAX_TASKS_WITH_RETURNS", "MAX_URETPROBE_DEPTH", "ReturnInstance", "UprobeReturns"]

# kernel/events/uprobes.c: return instances a task may hold; deeper calls go unprobed (counted in nmissed).
MAX_URETPROBE_DEPTH = 64
MAX_TASKS_WITH_RETURNS = 4096  # tasks whose return instances are kept (the oldest beyond it are dropped)


@dataclass
class ReturnInstance:
    """One call of a return-probed function in flight (the kernel's ``return_instance``)."""

    probes: list[Uprobe]
    func: int
    ret_addr: int
    sp_after: int


class UprobeReturns:
    """Every task's calls in flight, keyed by (page-table root, task); stop loop only."""

    def __init__(self, arch: Arch, handlers: Handlers, points: UprobePoints) -> None:
        self.arch = arch
        self.handlers = handlers
        self.points = points
        self.by_task: dict[tuple[int, int], list[ReturnInstance]] = {}  # (page-table root, task) -> its calls

    def prepare(self, probes: list[Uprobe], pt: PtRegs, values: Regs[str, int],
                       key: tuple[int, int]) -> None:  # fmt: skip
        """prepare_uretprobe(): remember the call and stop at its return address (values: before any handler)."""
        assert self.arch.uprobes is not None  # a uprobe was registered
        try:
            ret_addr, sp_after = self.arch.uprobes.arch_uretprobe_frame(values, pt.read)
        except QprobeError:
            for up in probes:
                up.nmissed += 1
            return
        stack = self.by_task.get(key)
        if stack is None:
            if len(self.by_task) >= MAX_TASKS_WITH_RETURNS:
                self.forget(next(iter(self.by_task)))
            stack = self.by_task[key] = []
        if len(stack) >= MAX_URETPROBE_DEPTH:
            for up in probes:
                up.nmissed += 1
            return
        # cleanup_return_instances() at a call: the calls of frames below this one's were left without
        # returning (longjmp).  One of this very frame stays, as the kernel keeps it for a tail call (it
        # tells that from a new call by its trampoline in the return slot; qprobe writes none there).
        while stack and stack[-1].sp_after < sp_after:
            self.points.release(stack.pop().ret_addr)
        stack.append(ReturnInstance(list(probes), self.arch.ip(values), ret_addr, sp_after))
        self.points.hold(ret_addr)

    def returning(self, point: UprobePoint, key: tuple[int, int], ip: int, sp: int) -> list[ReturnInstance]:
        """The calls of this task that return here now; calls it left without returning are dropped."""
        stack = self.by_task.get(key)
        out: list[ReturnInstance] = []
        while stack:
            top = stack[-1]
            if top.sp_after > sp:
                break
            stack.pop()
            self.points.release(top.ret_addr)
            if top.sp_after == sp and top.ret_addr == ip:
                out.append(top)
        if stack is not None and not stack:
            del self.by_task[key]
        return out

    def run(self, ri: ReturnInstance, pt: PtRegs) -> None:
        for up in ri.probes:
            up.nreturns += 1
            if up.ret_handler is not None:
                self.handlers.call(up, f"ret_handler of {up.where()}", up.ret_handler, up, ri.func, pt)

    def drop_probe(self, up: Uprobe) -> None:
        """An unregistered probe's handler runs at none of the returns in flight."""
        for stack in self.by_task.values():
            for ri in stack:
                if up in ri.probes:
                    ri.probes.remove(up)

    def forget(self, key: tuple[int, int]) -> None:
        for ri in self.by_task.pop(key, []):
            self.points.release(ri.ret_addr)
