"""One gdb process speaking GDB/MI: tokened commands in, records out (pygdbmi's IO manager layer).

A command's answer is recognised by its token (``17^done``), never by a
quiet period (pygdbmi's own ``write`` waits for 0.2 s of silence; qprobe
does not use that).  The records are turned into qprobe's types by
qprobe.vmm.gdbmi_parse.
"""

from __future__ import annotations

import collections
import os
import select
import subprocess
import time
from collections.abc import Callable, Mapping
from typing import Any

from pygdbmi.gdbcontroller import GdbController
from pygdbmi.IoManager import IoManager

from qprobe.errors import GuestTimeout, ProtocolError, TargetError, TargetGone
from qprobe.vmm.gdbmi_parse import MiRecord, one_line, result_payload, stream_text

GDB_COMMAND = ("--nx", "--quiet", "--interpreter=mi3")
_POLL = 0.1


class _GdbController(GdbController):
    """pygdbmi's GdbController, with gdb in a session of its own.

    A Ctrl-C typed at qprobe goes to the terminal's whole process group: gdb
    would take it as "interrupt the VM", or abort the command it is running
    (a register write half done).  Only qprobe may interrupt gdb.  The rest is
    pygdbmi 0.11's spawn_new_gdb_subprocess.
    """

    def spawn_new_gdb_subprocess(self) -> int:
        if self.gdb_process:
            self.exit()
        self.gdb_process = subprocess.Popen(
            self.command, shell=False, stdout=subprocess.PIPE, stdin=subprocess.PIPE, stderr=subprocess.PIPE,
            bufsize=0, start_new_session=True,
        )  # fmt: skip
        assert self.gdb_process.stdin is not None and self.gdb_process.stdout is not None
        self.io_manager = IoManager(self.gdb_process.stdin, self.gdb_process.stdout, self.gdb_process.stderr,
                                    self.time_to_check_for_additional_output_sec)  # fmt: skip
        return self.gdb_process.pid


class MiChannel:
    """gdb's MI stream: tokened commands in, records out.  A single thread must own it.

    Results are matched to commands by token.  ``*stopped`` records can arrive
    at any time (even while we wait for another command's result) and are
    queued for ``next_stop``.  ``alive`` (the QEMU process) is polled every
    100 ms so a dead QEMU is reported promptly, as Connection does.
    """

    def __init__(self, gdb: str = "gdb", alive: Callable[[], bool] | None = None, name: str = "") -> None:
        try:
            self.controller = _GdbController([gdb, *GDB_COMMAND])
        except ValueError as exc:
            raise TargetError(f"cannot start gdb ({gdb}): {exc}; install Debian's gdb") from None
        proc = self.controller.gdb_process
        assert proc is not None and proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        self.proc: subprocess.Popen[bytes] = proc
        self.name = name
        self._alive = alive or (lambda: True)
        self._stdin = proc.stdin.fileno()
        self._stdout = proc.stdout.fileno()
        self._stderr = proc.stderr.fileno()  # pygdbmi never reads it; we drain it so gdb cannot block on it
        self._stderr_tail = b""
        self._token = 0
        self._results: dict[int, MiRecord] = {}
        self._streams: list[MiRecord] = []  # stream records since the last command was sent
        self.stops: collections.deque[MiRecord] = collections.deque()
        self.gone: str | None = None  # why the stub connection ended, once it has
        self.expect_exit = False  # detaching: the end of the connection is ours
        self._closed = False

    # -- writing ---------------------------------------------------------------------------
    def send(self, command: str) -> int:
        """Write one tokened command; returns the token its result will carry."""
        if self._closed:
            raise TargetGone(f"the gdb process for {self.name} is closed")
        if self.gone is not None and not self.expect_exit:
            raise TargetGone(f"lost the gdbstub connection {self.name}: {self.gone}")
        if "\n" in command:
            raise TargetError(f"internal: MI command with a newline: {command[:40]!r}")
        self._token += 1
        data = f"{self._token}{command}\n".encode()
        self._streams = []
        try:
            while data:
                data = data[os.write(self._stdin, data) :]
        except OSError as exc:
            raise self._dead(f"cannot write to gdb: {exc}") from None
        return self._token

    # -- reading ---------------------------------------------------------------------------
    def result(self, token: int, what: str, timeout: float = 10.0) -> MiRecord:
        """The result record for ``token``; GuestTimeout after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while token not in self._results:
            if not self.pump(deadline) and time.monotonic() >= deadline:
                raise GuestTimeout(f"gdb did not answer {what} within {timeout:g} s")
        record = self._results.pop(token)
        if record.get("message") == "error" and self.gone is not None and not self.expect_exit:
            # gdb's own words would be "Remote connection closed": say what the caller can act on.
            raise TargetGone(f"lost the gdbstub connection {self.name}: {self.gone}")
        return record

    def command(self, command: str, what: str = "", timeout: float = 10.0) -> Mapping[str, Any]:
        """Send, wait for the result, return its payload; ``^error`` raises TargetError."""
        what = what or command.split()[0]
        return result_payload(self.result(self.send(command), what, timeout), what)

    def console_text(self) -> str:
        """Stream output gdb printed since the last command was sent."""
        return stream_text(self._streams)

    def next_stop(self, timeout: float | None, wake: int | None = None) -> MiRecord | None:
        """The next ``*stopped`` payload, or None after ``timeout`` s (None: wait forever) or as soon as the
        file descriptor ``wake`` becomes readable."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.stops:
            if self.gone is not None:
                raise TargetGone(f"lost the gdbstub connection {self.name}: {self.gone}")
            if wake is not None and wake in select.select([wake], [], [], 0)[0]:
                return None
            if not self.pump(deadline, wake) and deadline is not None and time.monotonic() >= deadline:
                return None
        return self.stops.popleft()

    def pump(self, deadline: float | None, wake: int | None = None) -> bool:
        """Wait up to 100 ms (or the deadline, or till ``wake`` is readable) for output and route it; False
        if none came."""
        if self._closed:
            raise TargetGone(f"the gdb process for {self.name} is closed")
        wait = _POLL if deadline is None else max(0.0, min(_POLL, deadline - time.monotonic()))
        fds = [self._stdout, self._stderr] if wake is None else [self._stdout, self._stderr, wake]
        ready, _, _ = select.select(fds, [], [], wait)
        if self._stderr in ready:
            try:
                self._stderr_tail = (self._stderr_tail + os.read(self._stderr, 65536))[-2000:]
            except BlockingIOError:
                pass
        if self._stdout not in ready:
            if self.proc.poll() is not None:
                raise self._dead("gdb exited")
            if not self._alive():
                raise self._dead("QEMU exited")
            return False
        records = self.controller.get_gdb_response(timeout_sec=0, raise_error_on_timeout=False)
        if not records and self.proc.poll() is not None:
            raise self._dead("gdb exited")
        for record in records:
            self._route(record)
        return True

    def _route(self, record: MiRecord) -> None:
        kind = record.get("type")
        if kind == "result":
            token = record.get("token")
            if token is None:
                raise ProtocolError(f"gdb sent a result for no command: {str(record)[:80]}")
            self._results[token] = record
        elif kind == "notify":
            message = record.get("message")
            if message == "stopped":
                self.stops.append(record.get("payload") or {})
            elif message == "thread-group-exited" and not self.expect_exit:
                self.gone = "QEMU closed the connection"
        elif kind == "log":
            text = str(record.get("payload"))
            self._streams.append(record)
            if text.startswith("Remote connection closed") and not self.expect_exit:
                self.gone = "QEMU closed the connection"
        elif kind in ("console", "target", "output"):
            self._streams.append(record)
        # Anything else pygdbmi yields ("done" for the prompt) carries nothing.

    def _dead(self, why: str) -> TargetGone:
        err = self._stderr_tail.decode(errors="replace").strip()
        self.gone = self.gone or why
        return TargetGone(f"lost the gdbstub connection {self.name}: {why}" + (f" ({one_line(err)})" if err else ""))

    def close(self) -> None:
        """End gdb at once (SIGKILL), sending nothing: like closing the RSP socket.

        A gdb that quits normally would detach or kill the target first; QEMU
        7.2 keeps a VM stopped when its gdb client just goes away, which is
        what a caller closing without ``detach`` wants.
        """
        if self._closed:
            return
        self._closed = True
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            pass
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()
        self.controller.gdb_process = None


__all__ = ["GDB_COMMAND", "MiChannel"]
