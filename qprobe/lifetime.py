"""A Target's lifetime: how it ends, and how its user hears that the VM did.

:class:`Lifetime` ends a target (``close``: every probe removed, detached, qprobe's own QEMU stopped;
``teardown``: the same without the probes, whatever state an attach failed in), keeps a failed VM's
console log, says what the console shows of a VM that ended, and turns the VM's death into an
exception in the main thread.  Every live target is closed at exit, and SIGTERM and SIGHUP unwind
the process as Ctrl-C does (``UNWIND_SIGNALS``).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Protocol

from qprobe.errors import QprobeError, TargetGone
from qprobe.paths import cache_dir, write_private

if TYPE_CHECKING:
    from qprobe.core.kprobes import KprobeManager
    from qprobe.core.kretprobe import KretprobeManager
    from qprobe.core.uprobes import UprobeManager
    from qprobe.events import TraceEvent
    from qprobe.events.timeline import Timeline
    from qprobe.kernel.program import KernelData
    from qprobe.vmm.console import Console, GuestShell
    from qprobe.vmm.gdbmi import GdbMiRemote
    from qprobe.vmm.gdbremote import GdbRemote
    from qprobe.vmm.journal import Journal
    from qprobe.vmm.machine import Machine
    from qprobe.vmm.qemu import QemuProcess

log = logging.getLogger("qprobe")
# How often a wait on the VM (Target.wait, a boot) looks whether it is still there.
LIVENESS_POLL = 0.2
UNWIND_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Ending(Protocol):
    """What ending a target releases, of its parts (qprobe.parts.Parts).  From ``gdb`` on, each is read only
    where the wiring (qprobe.wiring) got as far as making it: an attach may fail before."""

    @property
    def qemu(self) -> QemuProcess | None: ...
    @property
    def console(self) -> Console | None: ...
    @property
    def guest_shell(self) -> GuestShell | None: ...
    @property
    def events(self) -> dict[str, TraceEvent]: ...
    @property
    def timeline(self) -> Timeline: ...
    @property
    def gdb(self) -> GdbRemote | GdbMiRemote: ...
    @property
    def machine(self) -> Machine: ...
    @property
    def kernel(self) -> KernelData: ...
    @property
    def journal(self) -> Journal: ...
    @property
    def kprobes(self) -> KprobeManager: ...
    @property
    def kretprobes(self) -> KretprobeManager: ...
    @property
    def uprobes(self) -> UprobeManager: ...


class Lifetime:
    """The end of one target; ``leave_halted`` ends its connection without a detach, which would start the VM."""

    def __init__(self, target: Ending) -> None:
        self.target = target
        self.closed = False
        self.leave_halted = False

    def close(self) -> None:
        """Remove every probe, detach, and stop our own QEMU."""
        if self.closed:
            return
        self.closed = True
        _live.discard(self)
        t = self.target
        try:
            if hasattr(t, "kprobes") and t.machine.alive:
                t.events.clear()
                t.uprobes.remove_all()
                t.kretprobes.remove_all()
                t.kprobes.remove_all()
                t.journal.clear()
        except QprobeError as exc:
            log.warning("could not remove every probe: %s", exc)
        finally:
            t.timeline.close()
            # Whatever happened above, QEMU (if ours) is stopped and nothing is leaked.
            self.teardown()

    def teardown(self) -> None:
        """Detach (or leave the VM halted), close the kernel's drgn Program and the serial ports, stop our QEMU."""
        t = self.target
        machine = getattr(t, "machine", None)
        try:
            if machine is not None:
                machine.close(detach=not self.leave_halted)
            elif hasattr(t, "gdb"):
                try:
                    if self.leave_halted:
                        t.gdb.close()
                    else:
                        t.gdb.detach()
                except QprobeError:
                    pass
        finally:  # whatever the gdbstub did, our QEMU is stopped
            kernel = getattr(t, "kernel", None)
            if kernel is not None:
                kernel.close()
            try:
                self.release_serial_ports()
            finally:
                if t.qemu is not None:
                    t.qemu.terminate()
                    journal = getattr(t, "journal", None)
                    if journal is not None:
                        journal.clear()  # of no use once its VM is gone

    def attach_failed(self, why: BaseException) -> None:
        """An attach that raised ``why``: the console log kept (and said where), everything torn down."""
        kept = self.keep_console_log(why)
        self.teardown()
        if kept:
            why.add_note(f"guest console kept in {kept}")

    def keep_console_log(self, why: BaseException) -> Path | None:
        """Copy a failed VM's console log before its run directory goes, qprobe's reason and notes last."""
        qemu = self.target.qemu
        if qemu is None or not qemu.console_log.exists():
            return None
        dest = cache_dir("logs") / f"console-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
        said = "; ".join([str(why), *getattr(why, "__notes__", [])])
        write_private(dest, qemu.console_log.read_bytes() + f"\n[qprobe: {said}]\n".encode())
        return dest

    def exit_hint(self) -> str | None:
        """What the console says about the end of the VM."""
        console = self.target.console
        if console is None:
            return None
        console.wait_closed(1.0)  # QEMU's last words may still be in flight
        text = console.text
        panic = next((line for line in text.splitlines() if "Kernel panic" in line), None)
        if panic:
            return f"the guest kernel panicked: {panic.strip()[:120]}"
        if "reboot: Restarting system" in text or "reboot: Power down" in text:
            return "the guest rebooted or powered off; QEMU runs with -no-reboot, so the VM and its probes ended"
        return None

    def release_serial_ports(self) -> None:
        """Close the console and the guest shell's port (each of QEMU's takes one client at a time)."""
        t = self.target
        if t.guest_shell is not None and t.guest_shell.port is not t.console:
            t.guest_shell.close()
        if t.console is not None:
            t.console.close()

    @contextlib.contextmanager
    def interrupt_when_gone(self) -> Iterator[None]:
        """Within the block, the VM's death raises GoneInterrupt in the main thread at once, wherever it waits.

        For callers that wait on something other than the VM (a REPL's prompt, a test's sleep): the stop
        loop sees QEMU go within a fraction of a second and sends this process's main thread a SIGINT,
        which the handler set here turns into GoneInterrupt; any other SIGINT goes to the handler it
        replaced.  Outside the main thread (where signals cannot be handled) the block runs as it is.
        """
        from qprobe.errors import GoneInterrupt

        if threading.current_thread() is not threading.main_thread():
            yield
            return
        machine = self.target.machine
        main = threading.main_thread().ident
        assert main is not None
        lock = threading.Lock()
        state = {"active": True, "sent": False}

        def on_gone() -> None:
            with lock:
                if state["active"]:
                    state["sent"] = True
                    signal.pthread_kill(main, signal.SIGINT)

        def on_sigint(signum: int, frame: FrameType | None) -> None:
            if state["sent"]:
                state["sent"] = False  # raised once; the unwinding that follows is left alone
                try:
                    machine.check_alive()
                except TargetGone as exc:
                    raise GoneInterrupt(exc) from None
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:
                raise KeyboardInterrupt

        previous = signal.signal(signal.SIGINT, on_sigint)
        machine.gone_watchers.append(on_gone)
        try:
            machine.check_alive()  # gone before the block: the watcher will not be called
            yield
        finally:
            with lock:
                state["active"] = False
            machine.gone_watchers.remove(on_gone)
            signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)

    def register(self) -> None:
        """Close the target at exit and unwind on SIGTERM and SIGHUP, should its user not close it first."""
        global _handlers_installed
        _live.add(self)
        if not _handlers_installed and threading.current_thread() is threading.main_thread():
            _handlers_installed = True
            atexit.register(_close_all)
            # SIGTERM and SIGHUP (a closed terminal, an ended tmux session) unwind like Ctrl-C
            # does, so every ``with`` block and finally clause removes its probes before the end.
            for signum in UNWIND_SIGNALS:
                if signal.getsignal(signum) in (signal.SIG_DFL, None):
                    signal.signal(signum, unwind_on_signal)


# -- cleanup on exit and on SIGTERM ------------------------------------------------------
_live: set[Lifetime] = set()
_handlers_installed = False


def unwind_on_signal(signum: int, frame: object) -> None:
    """A signal handler that ends the process the way ``sys.exit`` does (status 128 + signal)."""
    raise SystemExit(128 + signum)


def _close_all() -> None:
    for lifetime in list(_live):
        lifetime.close()


__all__ = ["LIVENESS_POLL", "UNWIND_SIGNALS", "Ending", "Lifetime", "unwind_on_signal"]
