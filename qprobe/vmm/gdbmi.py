"""The GdbRemote interface, carried by a real gdb driven through GDB/MI (pygdbmi).

Why a second transport: a real gdb sitting between qprobe and QEMU proves
that qprobe's use of the stub is something gdb itself can do (interoperability),
and it gives the shell's raw ``gdb CMD`` a full gdb to talk to, symbols and all.
``GdbMiRemote`` has the public methods and attributes of ``GdbRemote``; the
stop loop, kprobes and kretprobes cannot tell them apart.

Three layers, as in pygdbmi itself:

* pure functions (``parse_*``, ``mi_quote``) that turn the dicts pygdbmi parses
  from MI records into qprobe's types, strictly: anything unexpected is a
  ``ProtocolError``, because a mis-parsed register is a guest crash later;
* ``MiChannel``, the I/O: tokened commands in, records out.  A command's answer
  is recognised by its token (``17^done``), never by a quiet period (pygdbmi's
  own ``write`` waits for 0.2 s of silence; we do not use that);
* ``GdbMiRemote``, one method per ``GdbRemote`` method.

gdb settings that matter, and why:

* ``mi-async on``: ``-exec-interrupt`` only works while the target runs in the background;
* ``scheduler-locking step`` (set after connecting, gdb refuses it before):
  ``stepi`` resumes only the stepped vCPU (``vCont;s:TID``), ``continue`` resumes all;
* ``breakpoint always-inserted on``: gdb would otherwise remove every breakpoint
  at each stop and insert it again at each resume, two packets per stop;
* ``stack-cache``/``code-cache off``: we switch QEMU's physical-memory mode behind
  gdb's back, so gdb must not serve a read from a cache filled in the other mode;
* ``osabi none``: the guest is a kernel, not a Linux process.

gdb 8.3 and later connect to a Unix socket given as a plain path to ``target remote``.
"""

from __future__ import annotations

import collections
import os
import re
import select
import shlex
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from pygdbmi.gdbcontroller import GdbController
from pygdbmi.IoManager import IoManager

from qprobe.errors import GuestTimeout, ProtocolError, TargetError, TargetGone
from qprobe.vmm.gdbremote import BREAK_HW, BREAK_SW, WATCH_ACCESS, WATCH_READ, WATCH_WRITE, RegDesc
from qprobe.vmm.rsp import StopReply

MiRecord = dict[str, Any]
GDB_COMMAND = ("--nx", "--quiet", "--interpreter=mi3")
_POLL = 0.1

# gdb's own signal numbers (include/gdb/signals.def), which are also the
# numbers of the remote protocol's stop replies: a StopReply made here carries
# the number a raw ``T`` packet would.  They differ from Linux's above 15.
GDB_SIGNALS = {
    "0": 0, "SIGHUP": 1, "SIGINT": 2, "SIGQUIT": 3, "SIGILL": 4, "SIGTRAP": 5, "SIGABRT": 6, "SIGEMT": 7,
    "SIGFPE": 8, "SIGKILL": 9, "SIGBUS": 10, "SIGSEGV": 11, "SIGSYS": 12, "SIGPIPE": 13, "SIGALRM": 14,
    "SIGTERM": 15, "SIGURG": 16, "SIGSTOP": 17, "SIGTSTP": 18, "SIGCONT": 19, "SIGCHLD": 20, "SIGTTIN": 21,
    "SIGTTOU": 22, "SIGIO": 23, "SIGXCPU": 24, "SIGXFSZ": 25, "SIGVTALRM": 26, "SIGPROF": 27,
    "SIGWINCH": 28, "SIGLOST": 29, "SIGUSR1": 30, "SIGUSR2": 31, "SIGPWR": 32, "SIGPOLL": 33,
}  # fmt: skip
SIGTRAP = GDB_SIGNALS["SIGTRAP"]
# *stopped reasons that are a SIGTRAP on the wire (gdb explains the trap instead of naming it).
_TRAP_REASONS = frozenset(
    {"breakpoint-hit", "end-stepping-range", "watchpoint-trigger", "read-watchpoint-trigger",
     "access-watchpoint-trigger", "watchpoint-scope", "function-finished", "location-reached"}
)  # fmt: skip
# Watchpoint stops: gdb's reason and the record naming the watchpoint -> the field a raw ``T`` packet carries.
_WATCH_STOPS = {
    "watchpoint-trigger": ("wpt", "watch"),
    "read-watchpoint-trigger": ("hw-rwpt", "rwatch"),
    "access-watchpoint-trigger": ("hw-awpt", "awatch"),
}
_WATCH_FLAGS = {WATCH_WRITE: "", WATCH_READ: "-r ", WATCH_ACCESS: "-a "}
# ``-break-info`` types of watchpoints QEMU checks; a plain "watchpoint" is gdb single-stepping the VM.
_HW_WATCH_TYPES = frozenset({"hw watchpoint", "read watchpoint", "acc watchpoint"})
# Console commands that would end or replace the session under our feet.
_SESSION_COMMANDS = frozenset({"quit", "q", "kill", "k", "detach", "disconnect", "target", "tar"})

_TARGET_ID = re.compile(r"Thread (\d+)(?:\.(\d+))?")
_REMOTE_REG = re.compile(r"\s*(\S+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(.+?)\s+(\d+)\s+(\d+)\s*")
_PSEUDO_REG = re.compile(r"\s*(\S+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\S.*?)\s*")
_RECEIVED = re.compile(r'received: "((?:[^"\\]|\\.)*)"\n?')


# -- pure functions: MI text and records -> qprobe's types ---------------------------------
def mi_quote(text: str) -> str:
    """A C string for an MI command argument (MI unescapes it before use)."""
    if any((ord(c) < 0x20 and c not in "\t\n") or ord(c) > 0x7E for c in text):
        raise TargetError(f"cannot pass {text[:40]!r} to gdb: only printable ASCII, tabs and newlines")
    body = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
    return f'"{body}"'


def gdb_address(address: str) -> str:
    """qprobe's ``unix:PATH``/``PATH``/``HOST:PORT`` as ``target remote`` takes it."""
    target = address.removeprefix("unix:")
    if not target or any(c.isspace() for c in target):
        raise TargetError(f"bad gdbstub address {address!r} for gdb: expected unix:PATH or HOST:PORT, no spaces")
    return target


def one_line(text: str) -> str:
    """gdb's messages span lines; qprobe's errors are one line."""
    return "; ".join(part.strip() for part in text.strip().splitlines() if part.strip())


def _field(payload: Mapping[str, Any] | None, key: str, what: str) -> Any:
    if not isinstance(payload, Mapping) or key not in payload:
        raise ProtocolError(f"gdb's answer to {what} has no {key!r}: {str(payload)[:80]}")
    return payload[key]


def _string(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ProtocolError(f"gdb sent {what} as {type(value).__name__}, expected a string: {str(value)[:40]}")
    return value


def _int(value: Any, what: str) -> int:
    text = _string(value, what)
    try:
        return int(text, 0)
    except ValueError:
        raise ProtocolError(f"gdb sent {what} {text[:40]!r}, expected a number") from None


def result_payload(record: MiRecord, what: str) -> Mapping[str, Any]:
    """The payload of a ``^done``/``^running``/``^connected`` record; ``^error`` raises TargetError."""
    message = record.get("message")
    payload = record.get("payload")
    if message == "error":
        msg = payload.get("msg", "") if isinstance(payload, Mapping) else ""
        raise TargetError(f"gdb refused {what}: {one_line(str(msg)) or 'no message'}")
    if message not in ("done", "running", "connected", "exit"):
        raise ProtocolError(f"unexpected gdb result {message!r} for {what}")
    if payload is None:
        return {}
    if not isinstance(payload, Mapping):
        raise ProtocolError(f"gdb's answer to {what} is not a tuple: {str(payload)[:80]}")
    return payload


def parse_target_id(target_id: str) -> str:
    """``Thread 1.2`` (pid.lwp, decimal, multiprocess) or ``Thread 2`` -> ``p1.2`` as normalize_thread gives."""
    m = _TARGET_ID.fullmatch(target_id)
    if m is None:
        raise ProtocolError(f"gdb names a thread {target_id!r}, expected 'Thread PID.TID'")
    pid, tid = (int(m[1]), int(m[2])) if m[2] is not None else (1, int(m[1]))
    return f"p{pid:x}.{tid:x}"


def parse_thread_info(payload: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``-thread-info`` -> [(gdb thread id, stub thread id)] in gdb's order (vCPU order for QEMU)."""
    threads = _field(payload, "threads", "-thread-info")
    if not isinstance(threads, list):
        raise ProtocolError("gdb's thread list is not a list")
    out = []
    for t in threads:
        gid = _string(_field(t, "id", "-thread-info"), "a thread id")
        out.append((gid, parse_target_id(_string(_field(t, "target-id", "-thread-info"), "a target-id"))))
    if len({tid for _, tid in out}) != len(out):
        raise ProtocolError(f"gdb lists a thread twice: {out}")
    return out


def parse_architecture(text: str) -> str:
    """gdb's architecture from ``show architecture`` (``... set to "auto" (currently "i386:x86-64").``)."""
    m = re.search(r'currently "([\w:.+-]{1,64})"', text) or re.search(r'set to "([\w:.+-]{1,64})"', text)
    return m[1] if m is not None and m[1] != "auto" else ""


def parse_remote_registers(text: str) -> tuple[dict[str, RegDesc], dict[str, int]]:
    """``maint print remote-registers`` -> (the stub's register table, gdb's register numbers).

    The first is what ``GdbRemote.regs`` holds (remote number, ``g`` offset);
    the second is what MI commands take.  Pseudo registers (``eax``) and unnamed
    slots have no remote number and are left out of both.
    """
    lines = text.splitlines()
    if not lines or lines[0].split()[:2] != ["Name", "Nr"] or "g/G" not in lines[0]:
        raise ProtocolError(f"unexpected header from 'maint print remote-registers': {lines[:1]}")
    regs: dict[str, RegDesc] = {}
    numbers: dict[str, int] = {}
    for line in lines[1:]:
        m = _REMOTE_REG.fullmatch(line)
        if m is None:
            if _PSEUDO_REG.fullmatch(line) or line.startswith("*"):  # no remote number, or a type footnote
                continue
            raise ProtocolError(f"cannot parse 'maint print remote-registers' line {line!r}")
        name, nr, size, rnum, goff = m[1], int(m[2]), int(m[5]), int(m[7]), int(m[8])
        if name == "''":
            continue
        if name in regs:
            raise ProtocolError(f"gdb lists register {name} twice")
        regs[name] = RegDesc(name, rnum, size * 8, goff)
        numbers[name] = nr
    return regs, numbers


def parse_register_values(payload: Mapping[str, Any], names: Mapping[int, str]) -> dict[str, int]:
    """``-data-list-register-values x ...`` -> {name: value}; every requested register must be there."""
    values = _field(payload, "register-values", "-data-list-register-values")
    if not isinstance(values, list):
        raise ProtocolError("gdb's register values are not a list")
    out: dict[str, int] = {}
    for v in values:
        number = _int(_field(v, "number", "a register value"), "a register number")
        if number not in names:
            raise ProtocolError(f"gdb sent register number {number}, which was not asked for")
        out[names[number]] = _int(_field(v, "value", "a register value"), f"register {names[number]}")
    missing = set(names.values()) - set(out)
    if missing:
        raise ProtocolError(f"gdb did not send registers {sorted(missing)}")
    return out


def parse_memory(payload: Mapping[str, Any], addr: int, size: int) -> bytes:
    """``-data-read-memory-bytes`` -> bytes: one block exactly covering [addr, addr+size) or an error.

    gdb answers a partly readable range with the readable blocks only; the
    RSP transport fails such a read, and so do we.
    """
    blocks = _field(payload, "memory", "-data-read-memory-bytes")
    if not isinstance(blocks, list) or len(blocks) != 1:
        raise TargetError(f"cannot read guest memory at {addr:#x}: only part of {size} bytes is readable")
    block = blocks[0]
    begin = _int(_field(block, "begin", "a memory block"), "a block start")
    offset = _int(_field(block, "offset", "a memory block"), "a block offset")
    end = _int(_field(block, "end", "a memory block"), "a block end")
    contents = _string(_field(block, "contents", "a memory block"), "memory contents")
    if begin + offset != addr or end != addr + size:
        raise TargetError(f"cannot read guest memory at {addr:#x}: gdb read {begin + offset:#x}..{end:#x} only")
    try:
        data = bytes.fromhex(contents)
    except ValueError:
        raise ProtocolError(f"gdb sent memory contents that are not hex: {contents[:40]!r}") from None
    if len(data) != size:
        raise ProtocolError(f"gdb sent {len(data)} bytes for a {size}-byte block")
    return data


def parse_breakpoint_number(payload: Mapping[str, Any]) -> str:
    """``-break-insert``/``-break-watch`` -> the breakpoint's number, for ``-break-delete``."""
    keys = [k for k in ("bkpt", "wpt", "hw-rwpt", "hw-awpt") if isinstance(payload, Mapping) and k in payload]
    if len(keys) != 1:
        raise ProtocolError(f"gdb's answer to a breakpoint insertion names no single breakpoint: {str(payload)[:80]}")
    number = _string(_field(payload[keys[0]], "number", "-break-insert"), "a breakpoint number")
    if not number.isdigit():
        raise ProtocolError(f"gdb numbered a breakpoint {number!r}")
    return number


def parse_breakpoint_type(payload: Mapping[str, Any]) -> str:
    """``-break-info N`` -> gdb's type for it (``breakpoint``, ``hw watchpoint``, ``watchpoint``, ...)."""
    body = _field(_field(payload, "BreakpointTable", "-break-info"), "body", "-break-info")
    if not isinstance(body, list) or len(body) != 1:
        raise ProtocolError(f"gdb's -break-info lists {len(body) if isinstance(body, list) else 'no'} breakpoints")
    return _string(_field(body[0], "type", "-break-info"), "a breakpoint type")


def parse_stopped(
    payload: Mapping[str, Any], threads: Mapping[str, str], watches: Mapping[str, int] | None = None
) -> StopReply:
    """A ``*stopped`` record -> the StopReply the raw stub would have sent.

    A stop gdb explains (breakpoint hit, end of a stepi) is a SIGTRAP on the
    wire; a stop with no reason at all is the one ``target remote`` reports
    on connecting, which QEMU's ``?`` answers with SIGTRAP too.  A watchpoint
    stop gets the ``watch``/``rwatch``/``awatch`` field QEMU sends, with the
    watched address found through ``watches`` (gdb number -> address); one
    of gdb's own (made on the console) gets none.
    """
    if not isinstance(payload, Mapping):
        raise ProtocolError(f"malformed *stopped record: {str(payload)[:80]}")
    reason = payload.get("reason")
    fields: list[tuple[str, str]] = []
    if reason is None:
        kind, signal = "T", SIGTRAP
    else:
        reason = _string(reason, "a stop reason")
        fields.append(("reason", reason))
        if reason in _TRAP_REASONS:
            kind, signal = "T", SIGTRAP
        elif reason == "signal-received":
            kind, signal = "T", _signal(payload)
        elif reason == "exited-normally":
            kind, signal = "W", 0
        elif reason == "exited":
            # MI prints the exit code in octal (mi_interp::on_exited).
            code = _string(_field(payload, "exit-code", "*stopped"), "an exit code")
            try:
                kind, signal = "W", int(code, 8)
            except ValueError:
                raise ProtocolError(f"gdb sent exit code {code!r}") from None
        elif reason == "exited-signalled":
            kind, signal = "X", _signal(payload)
        else:
            raise ProtocolError(f"gdb stopped for a reason qprobe does not know: {reason!r}")
    for key in ("signal-name", "bkptno"):
        if key in payload:
            fields.append((key, _string(payload[key], key)))
    if reason in _WATCH_STOPS:
        record, field = _WATCH_STOPS[reason]
        number = _string(_field(_field(payload, record, "*stopped"), "number", "*stopped"), "a watchpoint number")
        if watches is not None and number in watches:
            fields.append((field, f"{watches[number]:x}"))
    thread = None
    if kind == "T" and "thread-id" in payload:
        gid = _string(payload["thread-id"], "a thread id")
        if gid not in threads:
            raise ProtocolError(f"gdb stopped in thread {gid}, which it never listed")
        thread = threads[gid]
        fields.append(("thread", thread))
    frame = payload.get("frame")
    if isinstance(frame, Mapping) and "addr" in frame:
        fields.append(("addr", _string(frame["addr"], "a frame address")))
    return StopReply(kind, signal, thread, tuple(fields))


def _signal(payload: Mapping[str, Any]) -> int:
    name = _string(_field(payload, "signal-name", "*stopped"), "a signal name")
    if name not in GDB_SIGNALS:
        raise ProtocolError(f"gdb reported signal {name!r}, which qprobe does not know")
    return GDB_SIGNALS[name]


def parse_maint_packet(text: str) -> bytes:
    """``maint packet`` console output (``sending: X`` then ``received: "OK"``) -> the reply payload.

    gdb prints bytes outside printable ASCII as ``\\xNN`` and escapes ``"`` and ``\\``.
    """
    lines = [line for line in text.splitlines(keepends=True) if line.startswith("received: ")]
    if len(lines) != 1:
        raise ProtocolError(f"no single 'received:' line in gdb's maint packet output: {text[:80]!r}")
    m = _RECEIVED.fullmatch(lines[0])
    if m is None:
        raise ProtocolError(f"malformed maint packet reply {lines[0][:80]!r}")
    out = bytearray()
    body = m[1]
    i = 0
    while i < len(body):
        c = body[i]
        if not c.isascii():
            raise ProtocolError(f"gdb printed a non-ASCII character in a maint packet reply: {c!r}")
        if c != "\\":
            out += c.encode()
            i += 1
        elif body[i + 1] == "x":
            try:
                out.append(int(body[i + 2 : i + 4], 16))
            except ValueError:
                raise ProtocolError(f"malformed escape in maint packet reply {body[i : i + 4]!r}") from None
            i += 4
        else:
            out += body[i + 1].encode()
            i += 2
    return bytes(out)


def stream_text(records: Iterable[MiRecord], kinds: tuple[str, ...] = ("console", "target", "output")) -> str:
    """Concatenated stream output (``~``, ``@`` and raw lines) of some records."""
    return "".join(r["payload"] for r in records if r.get("type") in kinds and isinstance(r.get("payload"), str))


# -- I/O: one gdb process ------------------------------------------------------------------
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

    def next_stop(self, timeout: float | None) -> MiRecord | None:
        """The next ``*stopped`` payload, or None after ``timeout`` s (None: wait forever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.stops:
            if self.gone is not None:
                raise TargetGone(f"lost the gdbstub connection {self.name}: {self.gone}")
            if not self.pump(deadline) and deadline is not None and time.monotonic() >= deadline:
                return None
        return self.stops.popleft()

    def pump(self, deadline: float | None) -> bool:
        """Wait up to 100 ms (or the deadline) for output and route it; False if none came."""
        if self._closed:
            raise TargetGone(f"the gdb process for {self.name} is closed")
        wait = _POLL if deadline is None else max(0.0, min(_POLL, deadline - time.monotonic()))
        ready, _, _ = select.select([self._stdout, self._stderr], [], [], wait)
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


# -- the GdbRemote interface -------------------------------------------------------------
class GdbMiRemote:
    """``GdbRemote``'s interface through a gdb process.  A single thread must own an instance.

    ``address`` is what ``Connection.open`` takes (``unix:PATH``, ``PATH`` or
    ``HOST:PORT``).  ``vmlinux``, when given, is loaded with ``load_symbols``
    before connecting (at its link address; call ``load_symbols`` again with
    the KASLR slide once known).  qprobe itself only uses raw addresses.
    """

    def __init__(self, address: str, *, alive: Callable[[], bool] | None = None, vmlinux: str | Path | None = None,
                 gdb: str = "gdb", connect_timeout: int = 5) -> None:  # fmt: skip
        self.address = address
        self.conn = MiChannel(gdb, alive, address)
        self.regs: dict[str, RegDesc] = {}
        self.architecture = ""  # gdb's name of the target's architecture, from the stub's target description
        self.packet_size = 0x1000  # gdb splits packets itself; kept for interface parity
        self.running = False
        self._target = gdb_address(address)
        self._connect_timeout = connect_timeout
        self._numbers: dict[str, int] = {}  # register name -> gdb's register number
        self._read_set: dict[int, str] = {}  # gdb number -> name, for read_registers
        self._read_args = ""
        self._tids: dict[str, str] = {}  # gdb thread id -> stub thread id (p1.N)
        self._gids: dict[str, str] = {}  # and back
        self._current: str | None = None  # gdb's selected thread, when we know it
        self._phys = False  # the mode QEMU is in
        self._want_phys = False  # the mode our next memory access needs
        self._breakpoints: dict[tuple[int, int, int], list[str]] = {}  # (kind, addr, length) -> gdb numbers
        self._watches: dict[str, int] = {}  # gdb watchpoint number -> watched address
        try:
            for setting in ("mi-async on", "pagination off", "width 0", "height 0", "confirm off", "non-stop off"):
                self.conn.command(f"-gdb-set {setting}")
            # The architecture is the one the stub's target description names (gdb reads it on connecting).
            for cli in ("set auto-load off", "set osabi none",
                        "set breakpoint always-inserted on", "set stack-cache off", "set code-cache off",
                        "set remotetimeout 20", "set print thread-events off",
                        f"set tcp connect-timeout {connect_timeout}"):  # fmt: skip
                self._cli(cli)
            if vmlinux is not None:
                self.load_symbols(vmlinux, 0)
        except BaseException:
            self.conn.close()
            raise

    # -- set-up ------------------------------------------------------------------------------
    def handshake(self) -> StopReply:
        """Connect gdb to the stub, learn registers and vCPUs, return the current stop state.

        gdb retries a refused TCP connection for ``connect_timeout`` seconds
        (``tcp connect-timeout``), as Connection.open does; failing that, the
        error is TargetGone like Connection.open's.
        """
        token = self.conn.send(f"-target-select remote {self._target}")
        record = self.conn.result(token, "connecting gdb to the gdbstub", self._connect_timeout + 30)
        if record.get("message") == "error":
            msg = one_line(str((record.get("payload") or {}).get("msg", ""))) or "no message"
            raise TargetGone(f"cannot connect to the gdbstub at {self.address}: {msg}")
        result_payload(record, "connecting gdb to the gdbstub")
        # Connecting stops a running VM; gdb reports that stop before ^connected.
        stopped = self.conn.next_stop(0)
        self._cli("set scheduler-locking step")  # refused before there is a target
        self.regs, self._numbers = parse_remote_registers(self._cli("maint print remote-registers"))
        self.architecture = parse_architecture(self._cli("show architecture"))
        # What GdbRemote.read_registers returns: everything up to 64 bits wide.
        self._read_set = {self._numbers[d.name]: d.name for d in self.regs.values() if d.bitsize <= 64}
        self._read_args = " ".join(str(n) for n in self._read_set)
        self.threads()
        self.running = False
        if stopped is None:
            raise ProtocolError("gdb connected without reporting where the VM stopped")
        return parse_stopped(stopped, self._tids)

    def load_symbols(self, vmlinux: str | Path, slide: int = 0, index_dir: str | Path | None = None) -> None:
        """Give gdb the kernel's symbols, moved by the KASLR slide (``symbol-file -o``).

        Only for people typing gdb commands (``console``): qprobe's own requests
        use raw addresses.  Without ``index_dir``, ELF symbols only (``-readnever``,
        0.2 s): ``info symbol``, ``x/i`` with names.  With it, the DWARF too, through
        gdb's index cache in that directory: ``info line``, ``ptype``, ``list``; about
        1 s once the cache holds this build, 20 s or more for the load that writes it.
        """
        path = shlex.quote(str(vmlinux))
        if index_dir is None:
            self._cli(f"symbol-file -readnever -o {slide:#x} {path}")
            return
        self._cli(f"set index-cache directory {shlex.quote(str(index_dir))}")
        self._cli("set index-cache enabled on")
        self._cli(f"symbol-file -o {slide:#x} {path}", timeout=600.0)

    def _cli(self, command: str, timeout: float = 30.0) -> str:
        """A gdb CLI command through MI; its console output."""
        result = self.conn.result(self.conn.send(f"-interpreter-exec console {mi_quote(command)}"), command, timeout)
        text = self.conn.console_text()
        result_payload(result, repr(command))
        if result.get("message") == "running":
            self.running = True
            self._current = None
        return text

    def console(self, command: str, timeout: float = 60.0) -> str:
        """Run one gdb CLI command (the shell's raw ``gdb CMD``) and return what it printed.

        Only while the VM is stopped (the stop loop's ``call``).  A command that
        resumes the VM (``stepi``, ``continue``) leaves ``running`` set, and the
        stop loop collects the stop as if ``cont``/``step`` had resumed it.
        Commands that end the session (quit, kill, detach, disconnect, target)
        are refused: they would pull the stub out from under qprobe.
        """
        words = command.split()
        if not words:
            return ""
        if words[0] in _SESSION_COMMANDS:
            raise TargetError(f"gdb command {words[0]!r} would end qprobe's session; use qprobe's detach/close")
        self._check_stopped(command)
        self._apply_physical(False)  # a person typing ``x/4gx ADDR`` means a virtual address
        self._current = None  # the command may select another thread or frame
        return self._cli(command, timeout)

    def _check_stopped(self, what: str) -> None:
        if self.running:
            raise TargetError(f"internal: request {what[:20]!r} sent while the VM runs")

    def request(self, payload: bytes) -> bytes:
        """One raw packet through gdb (``maint packet``) and its reply, like GdbRemote.request.

        gdb does not know what the packet did: fine for queries and QEMU's
        own ``Qqemu.*`` packets, wrong for anything that changes state gdb keeps.
        """
        self._check_stopped(repr(payload))
        try:
            text = payload.decode("ascii")
        except UnicodeDecodeError:
            raise TargetError(f"cannot send binary packet {payload[:20]!r} through gdb's maint packet") from None
        if not text.isprintable() or any(c in text for c in "$#}*"):
            # maint packet frames the text as it is: these would need the escaping putpkt does not do.
            raise TargetError(f"cannot send packet {payload[:20]!r} through gdb's maint packet")
        return parse_maint_packet(self._cli(f"maint packet {text}"))

    # -- threads = vCPUs ---------------------------------------------------------------------
    def threads(self) -> list[str]:
        self._check_stopped("-thread-info")
        payload = self.conn.command("-thread-info")
        pairs = parse_thread_info(payload)
        self._tids = dict(pairs)
        self._gids = {tid: gid for gid, tid in pairs}
        current = payload.get("current-thread-id")
        self._current = current if isinstance(current, str) else None
        return [tid for _, tid in pairs]

    def _gid(self, tid: str) -> str:
        if tid not in self._gids:
            self.threads()
            if tid not in self._gids:
                raise TargetError(f"gdb does not know vCPU thread {tid}")
        return self._gids[tid]

    def select(self, tid: str) -> None:
        """Make ``tid`` gdb's selected thread: gdb sends ``Hg`` for it before memory accesses."""
        gid = self._gid(tid)
        if self._current != gid:
            self._check_stopped("-thread-select")
            self.conn.command(f"-thread-select {gid}", f"selecting vCPU {tid}")
            self._current = gid

    # -- registers -------------------------------------------------------------------------
    def read_registers(self, tid: str) -> dict[str, int]:
        """Registers of frame 0 of ``tid`` (``--frame 0``: never an unwound frame a user selected)."""
        self._check_stopped("-data-list-register-values")
        gid = self._gid(tid)
        payload = self.conn.command(f"-data-list-register-values --thread {gid} --frame 0 x {self._read_args}",
                                    f"reading the registers of vCPU {tid}")  # fmt: skip
        return parse_register_values(payload, self._read_set)

    def write_register(self, tid: str, name: str, value: int) -> None:
        self.write_registers(tid, {name: value})

    def write_registers(self, tid: str, values: dict[str, int]) -> None:
        """One C comma expression (``$rip=..,$rsp=..``): one MI command per call, one ``P`` packet per register.

        Each MI command costs gdb a thread switch and a new frame 0, which is
        most of the time a separate command per register would take.
        """
        if not values:
            return
        self._check_stopped("register write")
        gid = self._gid(tid)
        parts = []
        for name, value in values.items():
            d = self.regs[name]  # KeyError for an unknown name, as GdbRemote
            parts.append(f"(${name}={value & ((1 << d.bitsize) - 1):#x})")
        expr = mi_quote(",".join(parts))
        what = f"writing registers {', '.join(values)} of vCPU {tid}"
        self.conn.command(f"-data-evaluate-expression --thread {gid} --frame 0 {expr}", what)

    # -- memory ----------------------------------------------------------------------------
    @property
    def chunk(self) -> int:
        return (self.packet_size - 32) // 2

    def set_physical(self, on: bool) -> None:
        """``Qqemu.PhyMemMode``: m/M take guest-physical addresses.

        Applied lazily, at the next memory access, and turned off again before
        each resume: gdb reads memory itself at every stop (to describe the
        frame), with the virtual addresses it finds in registers.
        """
        self._want_phys = on

    def _apply_physical(self, on: bool) -> None:
        if self._phys != on:
            reply = self.request(b"Qqemu.PhyMemMode:%d" % on)
            if reply != b"OK":
                raise TargetError(f"gdbstub refused physical memory mode: {reply[:40]!r}")
            self._phys = on

    def read_memory(self, addr: int, size: int) -> bytes:
        self._check_stopped("-data-read-memory-bytes")
        if size == 0:
            return b""
        self._apply_physical(self._want_phys)
        token = self.conn.send(f"-data-read-memory-bytes {addr:#x} {size}")
        record = self.conn.result(token, f"reading guest memory at {addr:#x}")
        if record.get("message") == "error":
            msg = one_line(str((record.get("payload") or {}).get("msg", "")))
            raise TargetError(f"cannot read guest memory at {addr:#x}: {msg}")
        return parse_memory(result_payload(record, "-data-read-memory-bytes"), addr, size)

    def write_memory(self, addr: int, data: bytes) -> None:
        self._check_stopped("-data-write-memory-bytes")
        if not data:
            return
        self._apply_physical(self._want_phys)
        self.conn.command(f"-data-write-memory-bytes {addr:#x} {data.hex()}", f"writing guest memory at {addr:#x}")

    # -- breakpoints -------------------------------------------------------------------------
    def insert_breakpoint(self, addr: int, kind: int = BREAK_SW, length: int = 1) -> None:
        """gdb breakpoints and watchpoints: ``Z0``..``Z4`` on the wire.

        A watchpoint watches ``*(unsigned char (*)[length]) addr``.  One
        difference from the raw stub: gdb compares a write watchpoint's value
        itself and resumes without reporting a write that left it unchanged.
        gdb reads that value in virtual mode, so physical mode is turned off first.
        """
        self._check_stopped("-break-insert")
        what = f"{'breakpoint' if kind in (BREAK_SW, BREAK_HW) else 'watchpoint'} at {addr:#x}"
        if kind in (BREAK_SW, BREAK_HW):
            payload = self.conn.command(f"-break-insert {'-h ' if kind == BREAK_HW else ''}*{addr:#x}", what)
            number = parse_breakpoint_number(payload)
        elif kind in _WATCH_FLAGS:
            self._apply_physical(False)
            expr = mi_quote(f"*(unsigned char (*)[{length}]) {addr:#x}")
            number = parse_breakpoint_number(self.conn.command(f"-break-watch {_WATCH_FLAGS[kind]}{expr}", what))
            kind_name = parse_breakpoint_type(self.conn.command(f"-break-info {number}", what))
            if kind_name not in _HW_WATCH_TYPES:
                self.conn.command(f"-break-delete {number}", what)
                raise TargetError(f"gdb would watch {addr:#x} by single-stepping the VM ({kind_name}), not via QEMU")
            self._watches[number] = addr
        else:
            raise TargetError(f"unknown breakpoint kind {kind} at {addr:#x}")
        self._breakpoints.setdefault((kind, addr, length), []).append(number)

    def remove_breakpoint(self, addr: int, kind: int = BREAK_SW, length: int = 1) -> None:
        self._check_stopped("-break-delete")
        numbers = self._breakpoints.get((kind, addr, length))
        if not numbers:
            raise TargetError(f"gdbstub refused removing breakpoint at {addr:#x}: no such breakpoint")
        self.conn.command(f"-break-delete {numbers[-1]}", f"removing breakpoint at {addr:#x}")
        self._watches.pop(numbers.pop(), None)
        if not numbers:
            del self._breakpoints[(kind, addr, length)]

    # -- execution ---------------------------------------------------------------------------
    def _before_resume(self) -> None:
        self._apply_physical(False)  # see set_physical

    def cont(self) -> None:
        """Resume every vCPU.  A no-op if a console command already resumed the VM."""
        if self.running:
            return
        self._before_resume()
        self.conn.command("-exec-continue", "continuing")
        self.running = True
        self._current = None

    def step(self, tid: str, timeout: float = 10.0) -> StopReply:
        """Single-step one vCPU; the others stay stopped (scheduler-locking step: ``vCont;s:TID``)."""
        self._check_stopped("-exec-step-instruction")
        gid = self._gid(tid)
        self._before_resume()
        self.conn.command(f"-exec-step-instruction --thread {gid}", f"stepping vCPU {tid}")
        self.running = True
        self._current = None
        return self.wait_stop(timeout)

    def interrupt(self) -> None:
        """Stop a running VM; the stop arrives through wait_stop/poll_stop."""
        try:
            self.conn.command("-exec-interrupt", "interrupting the VM")
        except TargetError:
            # The VM stopped on its own just before: that stop is what the caller will wait for.
            if not self.conn.stops:
                raise

    def _stopped(self, payload: Mapping[str, Any]) -> StopReply:
        self.running = False
        gid = payload.get("thread-id")
        if isinstance(gid, str) and gid not in self._tids:
            self.threads()  # a vCPU gdb learned of only now (hot-plug): refresh the map
        # gdb selects the thread that stopped (all-stop); select() asks again rather than rely on it.
        self._current = None
        return parse_stopped(payload, self._tids, self._watches)

    def wait_stop(self, timeout: float | None = 10.0) -> StopReply:
        payload = self.conn.next_stop(timeout)
        if payload is None:
            raise GuestTimeout(f"the VM did not stop within {timeout:g} s")
        return self._stopped(payload)

    def poll_stop(self, timeout: float) -> StopReply | None:
        payload = self.conn.next_stop(timeout)
        return None if payload is None else self._stopped(payload)

    def detach(self) -> None:
        """Detach (the VM runs on without us) and end gdb."""
        try:
            if not self.running and self.conn.gone is None:
                self._apply_physical(False)
                self.conn.expect_exit = True
                self.conn.command("-target-detach", "detaching", 5.0)
                try:
                    self.conn.command("-gdb-exit", "exiting gdb", 5.0)
                except TargetGone:
                    pass  # gdb may exit before we read its ^exit
        finally:
            self.conn.close()


__all__ = [
    "GDB_SIGNALS",
    "GdbMiRemote",
    "MiChannel",
    "gdb_address",
    "mi_quote",
    "parse_breakpoint_number",
    "parse_breakpoint_type",
    "parse_maint_packet",
    "parse_memory",
    "parse_register_values",
    "parse_remote_registers",
    "parse_stopped",
    "parse_target_id",
    "parse_thread_info",
    "result_payload",
    "stream_text",
]
