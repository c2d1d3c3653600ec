"""Calls of the guest kernel's own functions, made by the guest in a kworker (qprobe.arch.guestcall's code).

One block in the scratch area carries one call at a time: the host writes the function and its arguments,
puts a stub breakpoint on the architecture's interrupt exit, and at the first vCPU that stops there makes it
call the queue stub (one VM stop); the kworker makes the call, and the host reads the result in RAM.

Two drivers share the block: :class:`GuestCaller` through the stop loop of a live session, and
:class:`BareCalls` through the bare gdbstub, for the recovery of a killed qprobe's registrations.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from qprobe.arch import Arch
from qprobe.arch.guestcall import (
    BLOCK_ARGS,
    BLOCK_DONE,
    BLOCK_FN,
    BLOCK_QUEUE,
    BLOCK_QUEUED,
    BLOCK_RET,
    BLOCK_SIZE,
    BLOCK_TAG,
    BLOCK_WORK,
    MAX_ARGS,
    WORK_MAX,
    GuestCall,
)
from qprobe.errors import QprobeError, TargetError
from qprobe.kernel.program import KernelData
from qprobe.vmm.gdbremote import BREAK_HW
from qprobe.vmm.journal import Patch
from qprobe.vmm.machine import Machine
from qprobe.vmm.memory import SharedRam
from qprobe.vmm.scratch import ScratchArea
from qprobe.vmm.transport import GdbTransport

CALL_TIMEOUT = 30.0  # s for the guest to take the interrupt, run the kworker and return: TCG under load is slow
POLL = 0.005  # s between two looks at the done flag
# The kernel functions a guest call uses, each in Linux since before 5.9, the interrupt exit's first kernel.
QUEUE_WORK_ON, SYSTEM_WQ = "queue_work_on", "system_wq"


@dataclass(frozen=True)
class CallSite:
    """Where a block's guest calls go in: the queue stub's address and the interrupt exit it is called from."""

    block: int
    interrupt_exit: int

    @property
    def queue(self) -> int:
        return self.block + BLOCK_QUEUE


def unavailable(kernel: KernelData, arch: Arch) -> str | None:
    """Why this kernel cannot make guest calls (None: it can)."""
    gc = arch.guest_call
    if gc is None:
        return f"qprobe makes no guest calls on {arch.name}"
    missing = [n for n in (gc.interrupt_exit, QUEUE_WORK_ON, SYSTEM_WQ) if n not in kernel.symbols]
    if missing:
        return f"the kernel has no {', '.join(missing)}"
    try:
        size = kernel.prog.type("struct work_struct").size
    except (LookupError, QprobeError) as exc:
        return f"struct work_struct's size is not known: {exc}"
    if size is None or size > WORK_MAX:
        return f"struct work_struct is {size} bytes here (lockdep's map in it), more than a guest call's {WORK_MAX}"
    return None


def block_image(gc: GuestCall, kernel: KernelData, block: int) -> bytes:
    """A fresh block at ``block``: a zeroed work_struct whose func is the work function, and the code."""
    entry, func = kernel.type_offset("struct work_struct", "entry"), kernel.type_offset("struct work_struct", "func")
    image = bytearray(BLOCK_SIZE)
    # INIT_WORK's list: an empty list_head points at itself.
    image[entry : entry + 16] = ((block + entry).to_bytes(8, "little")) * 2
    image[func : func + 8] = (block + BLOCK_WORK).to_bytes(8, "little")
    symbols = kernel.symbols
    queue = gc.build_queue_stub(block + BLOCK_QUEUE, symbols.address(QUEUE_WORK_ON), symbols.address(SYSTEM_WQ),
                                block, kernel.percpu_offset("cpu_number"))  # fmt: skip
    code = gc.build_work_function(block + BLOCK_WORK)
    assert len(queue) <= BLOCK_WORK - BLOCK_QUEUE and len(code) <= BLOCK_SIZE - BLOCK_WORK
    image[BLOCK_QUEUE : BLOCK_QUEUE + len(queue)] = queue
    image[BLOCK_WORK : BLOCK_WORK + len(code)] = code
    return bytes(image)


def call_data(fn: int, args: tuple[int, ...], tag: int) -> bytes:
    """The block's call fields from BLOCK_FN on: the function, its arguments, no result, not done, the
    caller's tag, not queued."""
    if len(args) > MAX_ARGS:
        raise TargetError(f"internal: a guest call takes at most {MAX_ARGS} arguments")
    words = [fn, *args, *([0] * (MAX_ARGS - len(args))), 0, 0, tag, 0]
    return b"".join((w & ((1 << 64) - 1)).to_bytes(8, "little") for w in words)


assert BLOCK_ARGS == BLOCK_FN + 8 and BLOCK_RET == BLOCK_ARGS + 8 * MAX_ARGS and BLOCK_DONE == BLOCK_RET + 8
assert BLOCK_TAG == BLOCK_DONE + 8 and BLOCK_QUEUED == BLOCK_TAG + 8


@dataclass(frozen=True)
class LastCall:
    """The block's call as a killed qprobe left it."""

    fn: int
    tag: int
    ret: int
    done: bool
    queued: bool

    @classmethod
    def parse(cls, raw: bytes) -> LastCall:
        """From the block's bytes BLOCK_FN to BLOCK_QUEUE."""
        word = [int.from_bytes(raw[i : i + 8], "little") for i in range(0, len(raw), 8)]
        at = {off: word[(off - BLOCK_FN) // 8] for off in (BLOCK_FN, BLOCK_RET, BLOCK_DONE, BLOCK_TAG, BLOCK_QUEUED)}
        return cls(at[BLOCK_FN], at[BLOCK_TAG], at[BLOCK_RET], bool(at[BLOCK_DONE]), bool(at[BLOCK_QUEUED]))


def hijack(gc: GuestCall, site: CallSite, regs: Mapping[str, int],
           write_virt: Callable[[int, bytes], None], write_regs: Callable[[dict[str, int]], None]) -> None:  # fmt: skip
    """Make the vCPU stopped at the interrupt exit call the queue stub: the return address first, then the
    registers in one write (a kill between the two leaves a dead word below the stack pointer, nothing else)."""
    sp, data, new = gc.arch_call_from(regs, site.queue)
    write_virt(sp, data)
    write_regs(new)


def signed(value: int) -> int:
    return value - (1 << 64) if value >> 63 else value


class GuestCaller:
    """Guest calls of a live session, one at a time, from any thread but the stop loop's."""

    def __init__(self, machine: Machine, kernel: KernelData, scratch: ScratchArea, arch: Arch,
                 ram: SharedRam | None) -> None:  # fmt: skip
        self.machine, self.kernel, self.scratch, self.arch, self.ram = machine, kernel, scratch, arch, ram
        why = unavailable(kernel, arch) if ram is not None else "the guest's RAM is not shared with qprobe"
        self.unavailable = why
        self.site: CallSite | None = None
        self._lock = threading.Lock()
        self._armed = False
        self._patch: Patch | None = None
        self.stops = 0  # VM stops the calls took (one each)

    def _setup(self) -> CallSite:
        """The block (stop-loop thread): allocated, written and journaled once, on the first call."""
        if self.site is None:
            gc = self.arch.guest_call
            assert gc is not None
            self.scratch.ensure_mapped()
            block = self.scratch.alloc(BLOCK_SIZE, align=256)  # the journaled code within 256 bytes
            image = block_image(gc, self.kernel, block)
            self.scratch.write(block, image)
            # Its first code is journaled: a later qprobe finds the block by it, to undo what calls registered.
            self._patch = self.machine.patch(block + BLOCK_QUEUE, image[BLOCK_QUEUE : BLOCK_QUEUE + 64], "guestcall")
            exit_ = self.kernel.symbols.address(gc.interrupt_exit)
            if exit_ in self.machine.stop_handlers:
                raise TargetError(f"qprobe cannot make guest calls while {gc.interrupt_exit} is probed")
            self.site = CallSite(block, exit_)
        return self.site

    def call(self, name: str, *args: int, tag: int = 0) -> int:
        """``name(*args)`` called by the guest in a kworker; its return value (a u64, sign not applied).
        ``tag`` is left in the block with the call, for a later qprobe to tell whose call it was."""
        if self.unavailable is not None:
            raise TargetError(f"qprobe cannot call {name}() in this guest: {self.unavailable}")
        fn = self.kernel.symbols.address(name)
        with self._lock:
            site = self.machine.call(self._setup)
            assert self.ram is not None
            done_phys = self.scratch.phys_of(site.block + BLOCK_DONE)
            self.ram.write_phys(self.scratch.phys_of(site.block + BLOCK_FN), call_data(fn, args, tag))
            self.machine.call(lambda: self._arm(site))
            deadline = time.monotonic() + CALL_TIMEOUT
            while not self.ram.read_u64_phys(done_phys):
                self.machine.check_alive()
                if time.monotonic() > deadline:
                    self.machine.call(lambda: self._disarm(site))
                    # The call may still run later: the block is never reused, nor freed.
                    self.unavailable = f"the guest did not complete a call of {name}() within {CALL_TIMEOUT:g} s"
                    raise TargetError(f"qprobe's guest call: {self.unavailable}")
                time.sleep(POLL)
            return self.ram.read_u64_phys(self.scratch.phys_of(site.block + BLOCK_RET))

    def release(self) -> None:
        """The block taken out (its journal record too) while no call needs it; the next call makes another."""
        with self._lock:
            site = self.site
            if site is None or self.unavailable is not None:  # (a call that timed out may still use it)
                return
            self.site = None

            patch = self._patch
            assert patch is not None

            def drop() -> None:
                self.machine.unpatch(patch)
                self.scratch.free(site.block)

            self.machine.call(drop)

    def _arm(self, site: CallSite) -> None:
        self.machine.insert_stub_breakpoint(site.interrupt_exit)
        self.machine.stop_handlers[site.interrupt_exit] = self._on_exit
        self._armed = True

    def _disarm(self, site: CallSite) -> None:
        if self._armed:
            self.machine.stop_handlers.pop(site.interrupt_exit, None)
            self.machine.remove_stub_breakpoint(site.interrupt_exit)
            self._armed = False

    def _on_exit(self, tid: str, regs: dict[str, int]) -> None:
        site = self.site
        gc = self.arch.guest_call
        assert site is not None and gc is not None
        self._disarm(site)
        mem = self.machine.mem
        root = mem.pgd_of(regs[self.arch.registers.task_page_table])
        hijack(gc, site, regs, lambda va, data: self.machine.write_phys(mem.virt_to_phys(va, root), data),
               lambda new: self.machine.gdb.write_registers(tid, new))  # fmt: skip
        self.stops += 1


class BareCalls:
    """Guest calls through the bare gdbstub, the VM stopped before and after each: recovery's."""

    def __init__(self, gdb: GdbTransport, kernel: KernelData, arch: Arch, site: CallSite) -> None:
        self.gdb, self.kernel, self.arch, self.site = gdb, kernel, arch, site

    def read(self, addr: int, size: int) -> bytes:
        self.gdb.set_physical(True)
        return self.gdb.read_memory(self.kernel.mem.virt_to_phys(addr), size)

    def write(self, addr: int, data: bytes) -> None:
        self.gdb.set_physical(True)
        self.gdb.write_memory(self.kernel.mem.virt_to_phys(addr), data)

    def last(self) -> LastCall:
        return LastCall.parse(self.read(self.site.block + BLOCK_FN, BLOCK_QUEUE - BLOCK_FN))

    def wait_done(self, name: str | None = None, deadline: float | None = None) -> int:
        """The result of a call queued but not done yet (``name``'s, if known), once the guest has made it."""
        deadline = time.monotonic() + CALL_TIMEOUT if deadline is None else deadline
        while True:
            call = self.last()
            if call.done:
                return call.ret
            if time.monotonic() > deadline:
                what = f"{name}()" if name else f"{call.fn:#x}"
                raise TargetError(f"the guest did not complete qprobe's call of {what} within {CALL_TIMEOUT:g} s")
            self.gdb.cont()
            time.sleep(POLL * 4)
            self.gdb.interrupt()
            self.gdb.wait_stop()

    def __call__(self, name: str, *args: int, tag: int = 0) -> int:
        """``name(*args)`` called by the guest in a kworker; ``tag`` as GuestCaller.call's."""
        gc, gdb, site, mem = self.arch.guest_call, self.gdb, self.site, self.kernel.mem
        assert gc is not None
        self.write(site.block + BLOCK_FN, call_data(self.kernel.symbols.address(name), args, tag))
        deadline = time.monotonic() + CALL_TIMEOUT
        gdb.insert_breakpoint(site.interrupt_exit, BREAK_HW)
        try:
            while True:
                gdb.cont()
                stop = gdb.wait_stop(max(0.1, deadline - time.monotonic()))
                regs = gdb.read_registers(stop.thread) if stop.thread is not None else {}
                if regs and self.arch.ip(regs) == site.interrupt_exit:
                    break
                if time.monotonic() > deadline:
                    raise TargetError(f"no interrupt reached {gc.interrupt_exit} in {CALL_TIMEOUT:g} s")
        finally:
            gdb.remove_breakpoint(site.interrupt_exit, BREAK_HW)
        assert stop.thread is not None
        tid = stop.thread
        root = mem.pgd_of(regs[self.arch.registers.task_page_table])

        def write_virt(va: int, data: bytes) -> None:
            gdb.set_physical(True)
            gdb.write_memory(mem.virt_to_phys(va, root), data)

        hijack(gc, site, regs, write_virt, lambda new: gdb.write_registers(tid, new))
        return self.wait_done(name, deadline)


__all__ = ["BareCalls", "CallSite", "GuestCaller", "LastCall", "signed", "unavailable"]
