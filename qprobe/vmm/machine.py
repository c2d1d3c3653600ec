"""One guest under our control: the stub, its memory, its console, and the stop loop.

Data flows one way: a stop event arrives on the stop-loop thread, goes to the
handler registered for that breakpoint address (the kprobes dispatcher),
and the handler decides how the vCPU resumes.  Every other use of the stub
(arming a probe, reading registers for a user) is a request the loop runs
while the VM is stopped, so the stub is only ever driven from one thread.
"""

from __future__ import annotations

import os
import queue
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from qprobe.errors import ProtocolError, QprobeError, TargetError, TargetGone
from qprobe.vmm.gdbremote import BREAK_HW
from qprobe.vmm.journal import Journal, Patch
from qprobe.vmm.memory import GuestMemory, SharedRam
from qprobe.vmm.rsp import StopReply
from qprobe.vmm.transport import GdbTransport

T = TypeVar("T")
StopHandler = Callable[[str, dict[str, int]], None]
SIGTRAP = 5


class Machine:
    """The stop loop and guarded writes.  ``call`` is the only way in from other threads."""

    def __init__(self, gdb: GdbTransport, mem: GuestMemory, journal: Journal, pc: str, paused: bool = False) -> None:
        """``paused``: the VM stays stopped, requests served, until ``resume()`` (a VM that must not start
        before its first breakpoints are in)."""
        self.gdb = gdb
        self.pc = pc  # the gdbstub's name of the program counter: stop_handlers are keyed by its value
        self.mem = mem
        self.journal = journal
        self.vcpus = gdb.threads()
        self.stop_handlers: dict[int, StopHandler] = {}
        # Why QEMU went away, if the guest's console says (a panic, a reboot).
        self.exit_hint: Callable[[], str | None] | None = None
        # Where data (not code) can be written without stopping the VM: the shared RAM file.
        self.data_writer: SharedRam | None = None
        # Watchpoint hits, keyed by the watched address the stop reply names.
        self.watch_handlers: dict[int, StopHandler] = {}
        # Runs after every stop, with the thread whose stop was just handled, if any (see KprobeManager._hook).
        self.after_stop: Callable[[str | None], None] | None = None
        # Told the kernel address of every patch just before it is written (the pytest plugin
        # snapshots the text around it); they must not raise.
        self.patch_watchers: list[Callable[[int], None]] = []
        self.handler_errors: list[str] = []
        # Told, on the stop-loop thread, when the loop ends for good because the VM went (never on close());
        # they must not raise.
        self.gone_watchers: list[Callable[[], None]] = []
        self._requests: queue.Queue[tuple[Callable[[], Any], Future[Any]]] = queue.Queue()
        self._error: BaseException | None = None
        self._closing = False
        self._paused = 1 if paused else 0
        # A byte here wakes the loop from its wait on a running VM, so a request is served at once rather
        # than at the wait's next timeout (a latency every register, patch and read would pay).
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._wake_lock = threading.Lock()  # the pipe is closed under it: no write may reach a reused fd
        self._wake_open = True
        self._thread = threading.Thread(target=self._loop, name="qprobe-stop-loop", daemon=True)
        self._thread.start()

    # -- requests from other threads -----------------------------------------
    def call(self, fn: Callable[[], T], timeout: float | None = 60.0) -> T:
        """Run ``fn`` on the stop-loop thread with every vCPU stopped."""
        if threading.current_thread() is self._thread:
            return fn()
        if self._error is not None:
            raise TargetGone(f"the VM is gone: {self._error}")
        fut: Future[T] = Future()
        self._requests.put((fn, fut))
        with self._wake_lock:
            if self._wake_open:
                try:
                    os.write(self._wake_w, b"\0")
                except BlockingIOError:  # the pipe is full of wake-ups already: the loop will wake
                    pass
        if not self._thread.is_alive():  # ended before or while this was queued: nothing will serve it
            self._fail_pending()
        return fut.result(timeout)

    def check_alive(self, wait: float = 0.0) -> None:
        """Raise the reason the VM is gone, if it is (waiting up to ``wait`` s for the loop to notice)."""
        if wait:
            self._thread.join(wait)
        if self._error is not None:
            raise TargetGone(f"the VM is gone: {self._error}")

    @property
    def alive(self) -> bool:
        return self._error is None and self._thread.is_alive()

    def pause(self) -> None:
        """Keep the VM stopped after the current request (until ``resume``)."""
        self.call(lambda: setattr(self, "_paused", self._paused + 1))

    def resume(self) -> None:
        self.call(lambda: setattr(self, "_paused", max(0, self._paused - 1)))

    # -- the loop ----------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                if self.gdb.running:
                    self._drain_wake()
                    stop = self.gdb.poll_stop(0.5, self._wake_r) if self._requests.empty() else None
                    if stop is None:
                        if self._requests.empty():
                            continue
                        self.gdb.interrupt()
                        stop = self.gdb.wait_stop(10.0)
                    self._dispatch(stop)
                self._serve_requests()
                while self._paused and not self._closing:
                    self._serve_requests(block=True)
                if self._closing:
                    return
                self.gdb.cont()
        except BaseException as exc:  # recorded, and re-raised in every caller
            hint = self.exit_hint() if isinstance(exc, TargetGone) and self.exit_hint else None
            self._error = TargetGone(f"{exc} ({hint})") if hint else exc
        finally:
            self._fail_pending()
            with self._wake_lock:
                self._wake_open = False
                os.close(self._wake_r)
                os.close(self._wake_w)
        if self._error is not None:  # (close() returns from the loop above)
            for watcher in list(self.gone_watchers):
                watcher()

    def _drain_wake(self) -> None:
        """Empty the wake-up pipe before looking at the queue: a request queued after this is seen there or
        wakes the next wait."""
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _dispatch(self, stop: StopReply) -> None:
        if stop.exited:
            raise TargetGone(f"the guest exited (stop reply {stop.kind}{stop.signal:02x})")
        handled = None
        if stop.signal == SIGTRAP and stop.thread is not None:
            self._dispatch_trap(stop.thread, stop)
            handled = stop.thread
        # Also after our own interrupt (SIGINT): a vCPU's debug stop can be lost to any other stop.
        if self.after_stop is not None:
            self.after_stop(handled)

    def _dispatch_trap(self, thread: str, stop: StopReply) -> None:
        regs = self.gdb.read_registers(thread)
        for key in ("watch", "rwatch", "awatch"):
            value = stop.field(key)
            if value is not None:
                if not re.fullmatch(r"[0-9a-fA-F]{1,16}", value):
                    raise ProtocolError(f"the gdbstub reported a watchpoint hit at {value[:40]!r}")
                watcher = self.watch_handlers.get(int(value, 16))
                if watcher is not None:
                    watcher(thread, regs)
                return
        handler = self.stop_handlers.get(regs[self.pc])
        if handler is not None:
            handler(thread, regs)

    def _serve_requests(self, block: bool = False) -> None:
        """Run queued requests: all of them, or (``block``) at most one within 50 ms."""
        while True:
            try:
                fn, fut = self._requests.get(timeout=0.05) if block else self._requests.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except TargetGone as exc:
                    fut.set_exception(exc)
                    raise
                except BaseException as exc:
                    fut.set_exception(exc)
            if block:
                return

    def _fail_pending(self) -> None:
        err = self._error or TargetError("the stop loop ended")
        while True:
            try:
                _fn, fut = self._requests.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                fut.set_exception(TargetGone(f"the VM is gone: {err}") if self._error else err)

    def close(self, detach: bool = True) -> None:
        """Stop the loop, leaving the VM running (detached) unless it is gone."""
        if not self._thread.is_alive():
            return
        try:
            self.call(lambda: setattr(self, "_closing", True), timeout=10.0)
        except (QprobeError, TimeoutError):  # a loop that does not answer is left behind (a daemon thread)
            pass
        self._thread.join(5.0)
        if detach and self._error is None:
            try:
                self.gdb.detach()
            except QprobeError:
                pass
        else:
            self.gdb.close()

    # -- guarded writes (stop-loop thread only) --------------------------------
    def patch(self, virt: int, data: bytes, what: str, slot: int = 0) -> Patch:
        """Journal, then write ``data`` at kernel address ``virt`` (physically, past write protection)."""
        for watcher in self.patch_watchers:
            watcher(virt)
        phys = self.mem.virt_to_phys(virt)
        if (phys & 0xFFF) + len(data) > 0x1000:
            raise TargetError(f"internal: patch at {virt:#x} crosses a page")
        old = self.mem.read(virt, len(data))
        p = Patch(phys, virt, old, data, what, slot)
        self.journal.record(p)
        self.write_phys(phys, data)
        return p

    def repatch(self, p: Patch, data: bytes, what: str, slot: int = 0) -> Patch:
        """Replace live patch ``p`` by ``data`` at the same address, at least as long, in one write.

        The new patch's old bytes are ``p``'s, then what lay after it (an int3 swapped for a jump).
        """
        if len(data) < len(p.old) or (p.phys & 0xFFF) + len(data) > 0x1000:
            raise TargetError(f"internal: repatch at {p.virt:#x} shorter than its patch or crossing a page")
        for watcher in self.patch_watchers:
            watcher(p.virt)
        old = p.old + self.mem.read(p.virt + len(p.old), len(data) - len(p.old))
        new = Patch(p.phys, p.virt, old, data, what, slot)
        self.journal.record(new)  # the same physical address: it takes p's place
        self.write_phys(p.phys, data)
        return new

    def patch_data(self, virt: int, data: bytes, what: str) -> Patch:
        """Journal, then write data (never code) from any thread: through the shared RAM file if we can."""
        if self.data_writer is None:
            if threading.current_thread() is not self._thread:
                raise TargetError("internal: data written off the stop loop without shared RAM")
            return self.patch(virt, data, what)
        phys = self.mem.virt_to_phys(virt)
        if (phys & 0xFFF) + len(data) > 0x1000:
            raise TargetError(f"internal: patch at {virt:#x} crosses a page")
        p = Patch(phys, virt, self.mem.read(virt, len(data)), data, what)
        self.journal.record_often(p)
        self.data_writer.write_phys(phys, data)
        return p

    def unpatch(self, p: Patch) -> None:
        self.write_phys(p.phys, p.old)
        self.journal.forget(p.phys)

    def insert_stub_breakpoint(self, addr: int) -> None:
        """A gdbstub breakpoint that is a probe (Z1: nothing written into the guest under TCG).  Not journaled:
        QEMU keeps it after a killed qprobe, and the next attach takes out all it finds
        (gdbremote.drop_stale_breakpoints)."""
        self.gdb.insert_breakpoint(addr, BREAK_HW)

    def remove_stub_breakpoint(self, addr: int) -> None:
        self.gdb.remove_breakpoint(addr, BREAK_HW)

    def write_phys(self, phys: int, data: bytes) -> None:
        self.gdb.set_physical(True)
        self.gdb.write_memory(phys, data)
