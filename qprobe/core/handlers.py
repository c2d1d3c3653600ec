"""The one place user handlers run: the kernel's ``aggr_pre_handler``/``aggr_post_handler``.

Whatever path reached a hit (the int3 trap on the stop loop, the doorbell
thread's mailbox, a record drained from a ring, a kretprobe's trampoline, a
data watchpoint), its handlers are called here: under one lock, so that user
code never runs concurrently, and with every exception caught, counted on the
probe (``nfaults``, ``errors``), logged and passed to the probe's
``fault_handler``, never raised into the engine.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Callable
from typing import Any, Protocol

from qprobe.core.errorlog import ErrorLog
from qprobe.core.kprobe import Kprobe
from qprobe.core.regs import PtRegs

log = logging.getLogger("qprobe.kprobes")
MAX_ERRORS = 100  # kept per probe
MAX_HANDLER_ERRORS = 1000  # kept for the whole session


class Counted(Protocol):
    """Something whose handler failures are counted: a kprobe, a kretprobe, a watchpoint."""

    nfaults: int
    errors: list[str]


class Handlers:
    """Runs handlers and accounts for their failures."""

    def __init__(self) -> None:
        # User handlers never run concurrently (the stop loop and the doorbell thread both call them).
        self.lock = threading.RLock()
        # The session's report: the first MAX_HANDLER_ERRORS failures, all counted, warnings rate-limited
        # (a handler that raises on every hit of a hot probe must not flood stderr).
        self.errors = ErrorLog(log, keep=MAX_HANDLER_ERRORS)

    def pre(self, active: list[Kprobe], pt: PtRegs) -> bool:
        """aggr_pre_handler: every enabled probe's pre_handler; True to skip the probed instruction."""
        with self.lock:
            skip = False
            for kp in active:
                kp.nhit += 1
                if kp.pre_handler is None:
                    continue
                ip = pt.ip
                try:
                    ret = kp.pre_handler(kp, pt)
                except Exception as exc:
                    self.failed(kp, exc, f"pre_handler of {kp.where()}", pt)
                    continue
                if ret and pt.ip != ip:
                    skip = True
            return skip

    def post(self, active: list[Kprobe], pt: PtRegs) -> None:
        """aggr_post_handler: every post_handler, after the probed instruction ran."""
        with self.lock:
            for kp in active:
                if kp.post_handler is None:
                    continue
                try:
                    kp.post_handler(kp, pt)
                except Exception as exc:
                    self.failed(kp, exc, f"post_handler of {kp.where()}", pt)

    def call(self, owner: Counted, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run one handler of ``owner`` (a kretprobe's, a watchpoint's, a recorder); None if it raised."""
        with self.lock:
            try:
                return fn(*args)
            except Exception as exc:  # user code: counted and reported, never fatal
                self.failed(owner, exc, what, None)
                return None

    def failed(self, owner: Counted, exc: Exception, what: str, pt: PtRegs | None) -> None:
        """Count a handler's exception on ``owner``, report it, and tell a kprobe's fault_handler."""
        owner.nfaults += 1
        line = f"{what} raised {type(exc).__name__}: {exc}"
        if len(owner.errors) < MAX_ERRORS:
            owner.errors.append(line)
        self.errors.add(line, "".join(traceback.format_exception(exc)[-3:]).rstrip("\n"))
        if isinstance(owner, Kprobe) and pt is not None:
            self.fault(owner, pt, exc)

    def fault(self, kp: Kprobe, pt: PtRegs, exc: BaseException) -> None:
        """The probe's fault_handler, if it has one (its own exceptions are only logged)."""
        if kp.fault_handler is None:
            return
        try:
            kp.fault_handler(kp, pt, exc)
        except Exception as inner:
            log.warning("fault_handler of %s raised %s: %s", kp.where(), type(inner).__name__, inner)


__all__ = ["Counted", "Handlers"]
