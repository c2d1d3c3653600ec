"""The doorbell server: an optimized probe's Python handlers, run without stopping the VM (its own thread).

A probe whose detour calls the mailbox stub puts the registers in its CPU's
mailbox and rings the doorbell, an ``out`` to QEMU's isa-debugcon device
whose chardev is the Unix socket read here.  For each byte (a CPU number)
the server reads that mailbox through the shared RAM file, runs the probe's
pre_handlers (``Handlers.pre``, as the kernel's ``optimized_callback`` calls
``opt_pre_handler``), writes changed registers back and releases the vCPU;
other vCPUs keep running throughout.  A kretprobe's return comes the same way
from its trampoline, whose handler is the slots' ``Trampoline`` for the
int3 right after the call.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterable, Mapping

from qprobe.arch import Arch
from qprobe.core.errorlog import ErrorLog
from qprobe.core.handlers import Handlers
from qprobe.core.point import ProbePoint
from qprobe.core.regs import PtRegs
from qprobe.core.slots import Trampoline
from qprobe.vmm.memory import SharedRam

log = logging.getLogger("qprobe.optimizer")


class Doorbell:
    """Serves the mailboxes: ``start`` once the stub exists, ``close`` on the way out."""

    def __init__(self, arch: Arch, vcpus: list[str], ram: SharedRam, handlers: Handlers,
                 make_regs: Callable[[Mapping[str, int], str], PtRegs], point_of: Callable[[int], ProbePoint | None],
                 trampolines: dict[int, Trampoline], errors: ErrorLog,
                 drain: Callable[[], None]) -> None:  # fmt: skip
        assert arch.guest_ram is not None  # built only for an architecture with the mailbox (Optimizer.available)
        self.arch = arch
        self.layouts = arch.guest_ram
        self.vcpus = vcpus
        self.ram = ram
        self.handlers = handlers
        self.make_regs = make_regs
        self.point_of = point_of  # an optimized probe's point by its probe id
        self.trampolines = trampolines
        self.errors = errors  # shared with the optimizer: what went wrong off the stop loop
        self.drain = drain  # asks the collector to drain the record rings now
        self.served = 0
        self._mailbox_phys: list[int] = []  # each CPU's mailbox in guest RAM
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = False

    def start(self, path: str, mailbox_phys: list[int]) -> None:
        self._mailbox_phys = mailbox_phys
        if self._thread is not None:
            return
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        self._sock = sock
        self._thread = threading.Thread(target=self._serve_loop, name="qprobe-doorbell", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop = True
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
        if self._thread is not None:
            self._thread.join(2.0)

    def _serve_loop(self) -> None:
        sock = self._sock
        assert sock is not None
        while not self._stop:
            try:
                data = sock.recv(256)
            except OSError:
                return
            if not data:
                return
            self._answer_all(data)

    def _answer_all(self, cpus: Iterable[int]) -> None:
        for cpu in cpus:
            if cpu == self.layouts.drain_doorbell:  # a record waits on a full ring
                self.drain()
                continue
            try:
                self.serve(cpu)
            except Exception as exc:
                self.errors.add(f"doorbell for CPU {cpu}: {type(exc).__name__}: {exc}")

    def serve(self, cpu: int) -> None:
        """Answer one mailbox: run the handlers of its probe and release the vCPU."""
        ram = self.ram
        if cpu >= len(self._mailbox_phys):
            return  # a byte nobody sent as a doorbell (firmware debug output)
        mb = self._mailbox_phys[cpu]
        req = self.layouts.read_mailbox(lambda off, size: ram.read_phys(mb + off, size))
        if req is None:
            return
        final_ip, final_sp = req.continue_addr, req.final_sp
        point = self.point_of(req.probe_id)
        values = req.values
        dirty: dict[str, int] = {}
        resumed: Callable[[], None] | None = None
        tramp = self.trampolines.get(req.continue_addr) if req.probe_id == self.layouts.trampoline_id else None
        if tramp is not None:
            # A kretprobe's return, called from its trampoline's mailbox call (the int3 after the
            # call is the same trampoline's stop path).  No default here: without its instance
            # the real return address is unknown.
            pt = self.make_regs(values, self.vcpus[cpu])
            final_ip, resumed = tramp(pt)
            dirty = pt.dirty()
        elif point is not None and point.opt is not None:
            values[self.arch.registers.gdb_name[self.arch.registers.ip]] = point.addr
            try:
                pt = self.make_regs(values, self.vcpus[cpu])
                if self.handlers.pre(point.active(), pt):
                    final_ip = pt.ip
                final_sp = pt.sp
                dirty = pt.dirty()
            except Exception as exc:  # never leave the vCPU spinning: it resumes as if unprobed
                self.errors.add(f"{point.where}: {type(exc).__name__}: {exc}")
                final_ip, final_sp, dirty = req.continue_addr, req.final_sp, {}
        *answer, (state, done) = self.layouts.mailbox_answer(dirty, final_ip, final_sp)
        for off, data in answer:
            ram.write_phys(mb + off, data)
        self.served += 1
        # Published last, in one store: the stub reads the answer only after it sees DONE.
        ram.write_u64_phys(mb + state, int.from_bytes(done, "little"))
        if resumed is not None:
            resumed()


__all__ = ["Doorbell"]
