"""GDB/MI records, as pygdbmi parses them, turned into qprobe's types (pygdbmi's ``gdbmiparser`` layer).

Pure functions, strict: anything unexpected is a ``ProtocolError``, because a
mis-parsed register is a guest crash later.  The I/O is
qprobe.vmm.gdbmi_channel's; the transport on top, qprobe.vmm.gdbmi's.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from qprobe.errors import ProtocolError, TargetError
from qprobe.vmm.rsp import StopReply
from qprobe.vmm.tdesc import RegDesc

MiRecord = dict[str, Any]

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

_TARGET_ID = re.compile(r"Thread (\d+)(?:\.(\d+))?")
_REMOTE_REG = re.compile(r"\s*(\S+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(.+?)\s+(\d+)\s+(\d+)\s*")
_PSEUDO_REG = re.compile(r"\s*(\S+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\S.*?)\s*")
_RECEIVED = re.compile(r'received: "((?:[^"\\]|\\.)*)"\n?')


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


__all__ = [
    "GDB_SIGNALS",
    "MiRecord",
    "gdb_address",
    "mi_quote",
    "one_line",
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
