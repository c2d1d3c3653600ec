"""The guest's serial console: a shell we drive, and a log we watch for oopses.

The guest's /init runs a shell with echo off and no prompt; a command is
wrapped between two marker lines carrying a fresh token, so its output and
exit status are found by the protocol, not by timing, even with kernel
messages interleaved on the same console.
"""

from __future__ import annotations

import re
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from qprobe.errors import GuestTimeout, TargetError, TargetGone

READY = "QPROBE-READY"
_OOPS = re.compile(
    r"(BUG: |Oops: |Kernel panic|general protection fault|WARNING: CPU: |kernel BUG at|"
    r"RIP: 0010:|Call Trace:|watchdog: BUG: soft lockup|INFO: rcu_.* detected stalls)"
)


@dataclass(frozen=True)
class RunResult:
    command: str
    output: str
    status: int

    def check(self) -> RunResult:
        if self.status != 0:
            raise TargetError(f"guest command {self.command!r} exited {self.status}: {self.output.strip()[-200:]}")
        return self


class Console:
    """Reads the console socket on a thread; ``run`` talks to the guest shell."""

    def __init__(self, path: Path, log: Path | None = None, alive: Callable[[], bool] | None = None) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(str(path))
        self._alive = alive or (lambda: True)
        self._log = log
        self._text = ""
        self._cond = threading.Condition()
        self._closed = False
        self._lock = threading.Lock()  # one command at a time
        self._thread = threading.Thread(target=self._reader, name="qprobe-console", daemon=True)
        self._thread.start()

    def _reader(self) -> None:
        while True:
            try:
                data = self._sock.recv(65536)
            except OSError:
                data = b""
            with self._cond:
                if not data:
                    self._closed = True
                    self._cond.notify_all()
                    return
                self._text += data.decode("utf-8", "replace").replace("\r", "")
                self._cond.notify_all()

    @property
    def text(self) -> str:
        with self._cond:
            return self._text

    def wait_closed(self, timeout: float) -> bool:
        """Wait until QEMU closes the console (everything it printed has been read)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._closed, timeout)

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.text.splitlines()[-lines:])

    def oopses(self) -> list[str]:
        """Console lines that report a kernel oops, BUG, WARNING or panic."""
        return [line for line in self.text.splitlines() if _OOPS.search(line)]

    def wait_for(self, pattern: str, timeout: float, start: int = 0) -> int:
        """Wait until ``pattern`` (a regex) appears after offset ``start``; returns the match end."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                m = rx.search(self._text, start)
                if m:
                    return m.end()
                if self._closed or not self._alive():
                    raise TargetGone(f"the guest console closed while waiting for {pattern!r}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise GuestTimeout(f"the guest did not print {pattern!r} within {timeout:g} s")
                self._cond.wait(min(left, 0.2))

    def write(self, data: str) -> None:
        try:
            self._sock.sendall(data.encode())
        except OSError as exc:
            raise TargetGone(f"cannot write to the guest console: {exc}") from None

    def run(self, command: str, timeout: float = 60.0) -> RunResult:
        """Run a shell command in the guest; returns its combined output and exit status."""
        if "\n" in command:
            raise TargetError("guest commands must be one line")
        token = secrets.token_hex(6)
        begin, end = f"@@qp-begin-{token}@@", f"@@qp-end-{token}@@"
        with self._lock:
            start = len(self.text)
            # The markers are printed by printf so that the command line itself
            # (should echo be on) never contains them verbatim; the command runs
            # in a subshell so that ``exit`` ends it, not the guest's shell.
            self.write(
                f"printf '\\n@@qp-begin-%s@@\\n' {token}; ( {command} ) </dev/null 2>&1; "
                f"printf '\\n@@qp-end-%s@@%d\\n' {token} $?\n"
            )
            try:
                stop = self.wait_for(re.escape(end) + r"(\d+)\n", timeout, start)
            except GuestTimeout:
                # Ctrl-C the command so the shell is usable for the next one.
                self.write("\x03\n")
                raise GuestTimeout(f"guest command {command!r} did not finish within {timeout:g} s") from None
            text = self.text[start:stop]
        body = text[text.index(begin) + len(begin) + 1 :]
        out, _, status = body.rpartition(end)
        if out.endswith("\n"):
            out = out[:-1]
        return RunResult(command, out, int(status.strip()))

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
