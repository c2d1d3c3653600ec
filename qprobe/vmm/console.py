"""The guest's serial ports: the kernel's console, watched for oopses, and the shell qprobe drives.

QEMU gives the guest two serial ports when qprobe boots it: ttyS0, the
kernel's console (``console=ttyS0``), carries the kernel's log and nothing
else; ttyS1 (``qprobe.shell=ttyS1`` on the command line, read by the guest's
/init) carries the shell (on arm64's ``virt`` board, the PL011 ttyAMA0 and a PCI
16550 the guest names ttyS0: ``qprobe.vmm.boards``).  A command's output therefore holds exactly what
the command wrote, whatever the kernel logs meanwhile, and the oops scan sees
the kernel's lines only.  A guest whose /init ignores ``qprobe.shell=`` (a
root filesystem of the user's own, or a QEMU started by hand with one serial
port) has its shell on the console, and the two are read from one port as
before: the markers still frame each command, but kernel messages can land
inside its output.

The shell runs with echo off and no prompt; a command is wrapped between two
marker lines carrying a fresh token, so its output and exit status are found
by the protocol, not by timing.
"""

from __future__ import annotations

import codecs
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from qprobe.errors import GuestPanicked, GuestTimeout, TargetError, TargetGone
from qprobe.vmm.bootfail import BootSetup, BootWatch

READY = "QPROBE-READY"
# What is kept in memory of a port that may print forever (a guest in a WARNING loop): the last
# MAX_TEXT characters, and the first MAX_OOPS oops lines.  QEMU's log files have everything.
MAX_TEXT = 4 << 20
MAX_OOPS = 10_000
INTERRUPT_RETRY = 0.5  # seconds between the ^Cs sent while an interrupted guest command has not ended
INTERRUPT_SETTLE = 5.0  # seconds of them at most: a command that ignores SIGINT is left to run
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


class SerialPort:
    """One of QEMU's socket character devices, read on a thread: what the guest printed there.

    ``crlf``: the port is the kernel's console, whose driver ends each line with "\r\n"; the "\r" is
    dropped.  The shell's port keeps every byte (its tty has -onlcr).
    """

    def __init__(self, path: Path, alive: Callable[[], bool] | None = None, *, crlf: bool = False) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(str(path))
        self._alive = alive or (lambda: True)
        self._crlf = crlf
        # A character's bytes may be split between two reads.
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text = ""
        self._base = 0  # how many characters were dropped from the front of _text
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._reader, name="qprobe-serial", daemon=True)
        self._thread.start()

    def _reader(self) -> None:
        while True:
            try:
                data = self._sock.recv(65536)
            except OSError:
                data = b""
            with self._cond:
                if not data:
                    self._text += self._decoder.decode(b"", final=True)
                    self._closed = True
                    self._cond.notify_all()
                    return
                text = self._decoder.decode(data)
                self._text += text.replace("\r", "") if self._crlf else text
                self._received()
                if len(self._text) > MAX_TEXT:
                    drop = len(self._text) - MAX_TEXT // 2
                    self._text = self._text[drop:]
                    self._base += drop
                    self._dropped(drop)
                self._cond.notify_all()

    def _received(self) -> None:
        """Called under the condition after text arrived (a subclass scans it)."""

    def _dropped(self, count: int) -> None:
        """Called under the condition after ``count`` characters were dropped from the front."""

    @property
    def text(self) -> str:
        """What the guest printed here (its last MAX_TEXT characters at most)."""
        with self._cond:
            return self._text

    @property
    def end(self) -> int:
        """The offset just past everything printed so far, counting what is no longer kept (for ``wait_for``)."""
        with self._cond:
            return self._base + len(self._text)

    @property
    def closed(self) -> bool:
        with self._cond:
            return self._closed

    def wait_closed(self, timeout: float) -> bool:
        """Wait until QEMU closes the port (everything it printed has been read)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._closed, timeout)

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.text.splitlines()[-lines:])

    def slice(self, start: int, stop: int) -> str:
        """The text between two offsets (as ``end`` and ``wait_for`` count them), as far as it is kept."""
        with self._cond:
            return self._text[max(0, start - self._base) : max(0, stop - self._base)]

    def _gone(self, pattern: str) -> TargetGone:
        """The error for a port that closed while ``pattern`` was awaited (caller holds the condition)."""
        return TargetGone(f"the guest's serial port closed while waiting for {pattern!r}")

    def find(self, pattern: str, start: int = 0) -> int | None:
        """Where ``pattern`` (a regex) ends after offset ``start``, if it has been printed."""
        with self._cond:
            m = re.search(pattern, self._text[max(0, start - self._base) :])
            return None if m is None else max(start, self._base) + m.end()

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
                    raise self._gone(pattern)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise GuestTimeout(f"the guest did not print {pattern!r} within {timeout:g} s")
                self._cond.wait(min(left, 0.2))

    def write(self, data: str) -> None:
        try:
            self._sock.sendall(data.encode())
        except OSError as exc:
            raise TargetGone(f"cannot write to the guest's serial port: {exc}") from None

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


class Console(SerialPort):
    """The kernel's console: its log, with the oops, BUG, WARNING and panic lines kept apart."""

    def __init__(self, path: Path, alive: Callable[[], bool] | None = None) -> None:
        self._scanned = 0  # where in _text the oops scan goes on (the start of a line not yet complete)
        self._oopses: list[str] = []
        super().__init__(path, alive, crlf=True)

    def _received(self) -> None:
        """Keep the oops lines among the lines completed since the last scan."""
        last = self._text.rfind("\n") + 1
        if last <= self._scanned:
            return
        for line in self._text[self._scanned : last].splitlines():
            if _OOPS.search(line) and len(self._oopses) < MAX_OOPS:
                self._oopses.append(line)
        self._scanned = last

    def _dropped(self, count: int) -> None:
        self._scanned = max(0, self._scanned - count)

    def oopses(self) -> list[str]:
        """Console lines that report a kernel oops, BUG, WARNING or panic (complete lines, the first MAX_OOPS)."""
        with self._cond:
            return list(self._oopses)

    def panic_line(self) -> str | None:
        """The kernel's "Kernel panic" line, if it printed one."""
        with self._cond:
            m = re.search(r"Kernel panic[^\r\n]*", self._text)
            if m:
                return m.group(0).strip()[:120]
            return next((line.strip()[:120] for line in self._oopses if "Kernel panic" in line), None)

    def _gone(self, pattern: str) -> TargetGone:
        panic = self.panic_line()
        if panic is not None:
            return GuestPanicked(f"the guest kernel panicked while qprobe waited for {pattern!r}: {panic}")
        return TargetGone(f"the guest console closed while waiting for {pattern!r}")


class GuestShell:
    """The shell the guest's /init runs on a serial port: one command at a time, its output and exit status.

    ``console`` is the kernel's console, asked why when the shell's port closes (a panic); it may be the
    same port as the shell's.
    """

    def __init__(self, port: SerialPort, console: Console | None = None) -> None:
        self.port = port
        self.console = console
        self._lock = threading.Lock()  # one command at a time
        # The end marker (a pattern) and start offset of a command whose wait was interrupted: still running.
        self._in_flight: tuple[str, int] | None = None

    def _wait(self, pattern: str, timeout: float, start: int) -> int:
        try:
            return self.port.wait_for(pattern, timeout, start)
        except TargetGone as exc:
            if isinstance(exc, GuestPanicked) or self.console is None or self.console is self.port:
                raise
            self.console.wait_closed(1.0)
            panic = self.console.panic_line()
            if panic is None:
                raise
            raise GuestPanicked(f"the guest kernel panicked while qprobe waited for {pattern!r}: {panic}") from None

    def wait_ready(self, timeout: float) -> None:
        """Wait for the shell's first QPROBE-READY."""
        self._wait(READY, timeout, 0)

    def write(self, data: str) -> None:
        """Bytes to the shell's tty, as typed."""
        self.port.write(data)

    def interrupt(self, settle: float = INTERRUPT_SETTLE) -> None:
        """Ctrl-C the shell's foreground command (the port is its controlling tty).

        Where the ^C lands depends on when: before the shell forks the command it aborts the rest of the
        command line (no end marker comes), once the command's process group is the terminal's foreground
        it ends the command, and in between it reaches the shell, which waits on, while the command runs.
        So while a command ``run`` left (its wait interrupted) has printed neither its end marker nor the
        answer to a line asking whether the shell reads again, ^C again every INTERRUPT_RETRY s, for up to
        ``settle`` s (a ^C flushes the tty's input, that line included: it is sent again each time).
        """
        self.port.write("\x03")
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return
        ended, start = flight
        token = secrets.token_hex(6)
        either = f"{ended}|@@qp-idle-{token}@@\n"
        deadline = time.monotonic() + settle
        while (left := deadline - time.monotonic()) > 0:
            self.port.write(f"printf '\\n@@qp-idle-%s@@\\n' {token}\n")
            try:
                self.port.wait_for(either, min(INTERRUPT_RETRY, left), start)
                return
            except GuestTimeout:
                self.port.write("\x03")

    def run(self, command: str, timeout: float = 60.0) -> RunResult:
        """Run a shell command in the guest; returns its combined output and exit status."""
        if "\n" in command:
            raise TargetError("guest commands must be one line")
        token = secrets.token_hex(6)
        begin, end = f"@@qp-begin-{token}@@", f"@@qp-end-{token}@@"
        with self._lock:
            start = self.port.end
            # The markers are printed by printf so that the command line itself
            # (should echo be on) never contains them verbatim.  The command runs
            # in a subshell so that ``exit`` ends it, not the guest's shell, and
            # that subshell is forked by another, which does the redirections and
            # the job control, so the command's process does nothing before the
            # command (what ``--run`` counts from its fork: qprobe.proctree); the
            # ``exit`` after it keeps the shell from running the inner one unforked.
            self.port.write(
                f"printf '\\n@@qp-begin-%s@@\\n' {token}; ( ( {command} ); exit ) </dev/null 2>&1; "
                f"printf '\\n@@qp-end-%s@@%d\\n' {token} $?\n"
            )
            ended = re.escape(end) + r"(\d+)\n"
            self._in_flight = (ended, start)  # until it ends: an interrupt() then knows what to wait for
            try:
                stop = self._wait(ended, timeout, start)
                self._in_flight = None
            except GuestTimeout:
                self._in_flight = None
                # Ctrl-C the command so the shell is usable for the next one.
                self.port.write("\x03\n")
                raise GuestTimeout(f"guest command {command!r} did not finish within {timeout:g} s") from None
            text = self.port.slice(start, stop)
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
        self.port.close()


def open_shell(
    console: Console,
    shell: Path | None,
    alive: Callable[[], bool] | None,
    timeout: float | None,
    setup: BootSetup | None = None,
) -> GuestShell:
    """The guest's shell on its own port ``shell``, or on the console when there is none.

    With a ``timeout`` (a VM booting), once it says QPROBE-READY: a guest whose /init ignores
    ``qprobe.shell=`` says it on the console, and then the shell is read there.  With ``setup`` (what
    booted), a console that shows the shell will never come (a login prompt, a panic, no root device,
    nothing at all) ends the wait at once with that cause (``bootfail.diagnose``).
    """
    port = SerialPort(shell, alive) if shell is not None else console
    guest = GuestShell(port, console)
    if timeout is None:
        return guest
    watch = BootWatch(setup) if setup is not None else None
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                guest.wait_ready(min(0.2, max(0.0, deadline - time.monotonic())))
                return guest
            except GuestTimeout:
                if port is not console and console.find(f"(?m)^{READY}$") is not None:
                    port.close()
                    return GuestShell(console, console)
                failure = watch.check(console.text) if watch is not None else None
                if failure is not None:
                    raise failure.error() from None
                if time.monotonic() >= deadline:
                    raise GuestTimeout(f"the guest did not print {READY!r} within {timeout:g} s") from None
            except TargetGone:
                console.wait_closed(1.0)  # the kernel's last lines may still be in flight
                failure = watch.check(console.text, ended=True) if watch is not None else None
                if failure is None:
                    raise
                raise failure.error() from None
    except BaseException:
        if port is not console:
            port.close()
        raise
