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

from qprobe.errors import GuestPanicked, GuestTimeout, TargetError, TargetGone

READY = "QPROBE-READY"
# What is kept in memory of a console that may print forever (a guest in a WARNING loop): the last
# MAX_TEXT characters, and the first MAX_OOPS oops lines.  QEMU's console log file has everything.
MAX_TEXT = 4 << 20
MAX_OOPS = 10_000
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
        self._base = 0  # how many characters were dropped from the front of _text
        self._scanned = 0  # where in _text the oops scan goes on (the start of a line not yet complete)
        self._oopses: list[str] = []
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
                self._scan()
                if len(self._text) > MAX_TEXT:
                    drop = len(self._text) - MAX_TEXT // 2
                    self._text = self._text[drop:]
                    self._base += drop
                    self._scanned = max(0, self._scanned - drop)
                self._cond.notify_all()

    def _scan(self) -> None:
        """Keep the oops lines among the lines completed since the last scan (under ``_cond``)."""
        last = self._text.rfind("\n") + 1
        if last <= self._scanned:
            return
        for line in self._text[self._scanned : last].splitlines():
            if _OOPS.search(line) and len(self._oopses) < MAX_OOPS:
                self._oopses.append(line)
        self._scanned = last

    @property
    def text(self) -> str:
        """What the guest printed (its last MAX_TEXT characters at most)."""
        with self._cond:
            return self._text

    @property
    def end(self) -> int:
        """The offset just past everything printed so far, counting what is no longer kept (for ``wait_for``)."""
        with self._cond:
            return self._base + len(self._text)

    def wait_closed(self, timeout: float) -> bool:
        """Wait until QEMU closes the console (everything it printed has been read)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._closed, timeout)

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.text.splitlines()[-lines:])

    def oopses(self) -> list[str]:
        """Console lines that report a kernel oops, BUG, WARNING or panic (complete lines, the first MAX_OOPS)."""
        with self._cond:
            return list(self._oopses)

    def _panic_line(self) -> str | None:
        """The kernel's "Kernel panic" line, if it printed one (caller holds the condition)."""
        m = re.search(r"Kernel panic[^\r\n]*", self._text)
        if m:
            return m.group(0).strip()[:120]
        return next((line.strip()[:120] for line in self._oopses if "Kernel panic" in line), None)

    def wait_for(self, pattern: str, timeout: float, start: int = 0) -> int:
        """Wait until ``pattern`` (a regex) appears after offset ``start``; returns the match end.

        Offsets count everything printed (see ``end``), kept in memory or not.
        """
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                m = rx.search(self._text, max(0, start - self._base))
                if m:
                    return m.end() + self._base
                if self._closed or not self._alive():
                    self._cond.wait_for(lambda: self._closed, 1.0)  # QEMU's last words may still be in flight
                    panic = self._panic_line()
                    if panic is not None:
                        raise GuestPanicked(f"the guest kernel panicked while qprobe waited for {pattern!r}: {panic}")
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
            start = self.end
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
            with self._cond:
                text = self._text[max(0, start - self._base) : stop - self._base]
        if begin not in text:
            raise TargetError(
                f"the output of guest command {command!r} is longer than qprobe keeps ({MAX_TEXT} characters)"
            )
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
