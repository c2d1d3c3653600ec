"""GDB remote serial protocol framing: pure functions, no I/O.

The protocol frames by ``$payload#cs``; we never frame by timing.  QEMU 7.2
does not support ``QStartNoAckMode`` and acknowledges every packet with ``+``,
so the parser yields acks as events and the caller decides what to do with
them.  Binary payloads (``}`` escapes, ``*`` run-length encoding) are decoded
here so callers only ever see plain payload bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from qprobe.errors import ProtocolError

_ESCAPED = frozenset(b"$#}*")
_HEX2 = re.compile(rb"[0-9a-fA-F]{2}")
MAX_PACKET = 1 << 20  # a stop reply or register dump is far smaller; larger is garbage


def checksum(data: bytes) -> int:
    """The modulo-256 sum the protocol appends after ``#``."""
    return sum(data) & 0xFF


def escape(data: bytes) -> bytes:
    """Escape the bytes that cannot appear raw inside a packet."""
    out = bytearray()
    for b in data:
        if b in _ESCAPED:
            out += bytes((0x7D, b ^ 0x20))
        else:
            out.append(b)
    return bytes(out)


def frame(payload: bytes) -> bytes:
    """``$payload#xx`` with the payload escaped."""
    body = escape(payload)
    return b"$" + body + b"#" + b"%02x" % checksum(body)


def decode_body(body: bytes) -> bytes:
    """Undo ``}`` escapes and expand ``X*n`` run-length encoding."""
    out = bytearray()
    i = 0
    n = len(body)
    while i < n:
        b = body[i]
        if b == 0x7D:
            if i + 1 >= n:
                raise ProtocolError("malformed packet: escape character at end of packet")
            out.append(body[i + 1] ^ 0x20)
            i += 2
        elif b == 0x2A:
            if not out or i + 1 >= n:
                raise ProtocolError("malformed packet: run-length marker without a byte to repeat")
            count = body[i + 1] - 29
            if count < 3:
                raise ProtocolError(f"malformed packet: bad run-length count byte {body[i + 1]:#x}")
            out += bytes((out[-1],)) * count
            i += 2
        else:
            out.append(b)
            i += 1
    return bytes(out)


@dataclass(frozen=True)
class Ack:
    """``+``: the peer received our packet intact."""


@dataclass(frozen=True)
class Nak:
    """``-``: the peer saw a bad checksum and wants the packet again."""


@dataclass(frozen=True)
class Packet:
    payload: bytes


@dataclass(frozen=True)
class Notification:
    """``%name:data#cs``: asynchronous notification (non-stop mode)."""

    payload: bytes


Event = Ack | Nak | Packet | Notification


class PacketParser:
    """Incremental parser: feed bytes in any chunking, get whole events back.

    Strict on purpose: a bad checksum or a stray byte between packets is a
    protocol error, not something to skip over, because a desynchronised
    stream would otherwise be read as a wrong register value.
    """

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Event]:
        self._buf += data
        events: list[Event] = []
        while self._buf:
            head = self._buf[0]
            if head == 0x2B:  # '+'
                events.append(Ack())
                del self._buf[0]
            elif head == 0x2D:  # '-'
                events.append(Nak())
                del self._buf[0]
            elif head in (0x24, 0x25):  # '$' or '%'
                end = self._buf.find(b"#")
                if end < 0 or len(self._buf) < end + 3:
                    if len(self._buf) > MAX_PACKET:
                        raise ProtocolError("malformed packet: no end marker within 1 MiB")
                    break
                body = bytes(self._buf[1:end])
                cs_text = bytes(self._buf[end + 1 : end + 3])
                del self._buf[: end + 3]
                if not _HEX2.fullmatch(cs_text):  # int(x, 16) would take a sign or a space
                    raise ProtocolError(f"malformed packet: checksum {cs_text!r} is not hex")
                cs = int(cs_text, 16)
                if cs != checksum(body):
                    raise ProtocolError(f"malformed packet: checksum {cs:#04x} != computed {checksum(body):#04x}")
                payload = decode_body(body)
                events.append(Packet(payload) if head == 0x24 else Notification(payload))
            else:
                raise ProtocolError(f"malformed stream: unexpected byte {head:#04x} outside a packet")
        return events


@dataclass(frozen=True)
class StopReply:
    """A parsed stop reply (``S``, ``T``, ``W``, ``X``).

    ``thread`` is the stub's thread id string (``p1.2``), which QEMU maps one
    to one onto vCPUs.
    """

    kind: str
    signal: int
    thread: str | None = None
    fields: tuple[tuple[str, str], ...] = ()

    @property
    def exited(self) -> bool:
        return self.kind in ("W", "X")

    def field(self, name: str) -> str | None:
        for k, v in self.fields:
            if k == name:
                return v
        return None


def parse_stop_reply(payload: bytes) -> StopReply:
    """Parse ``T05thread:p01.02;swbreak:;`` and friends."""
    text = payload.decode("ascii", "replace")
    if not text or text[0] not in "STWX":
        raise ProtocolError(f"malformed stop reply {text[:40]!r}")
    kind = text[0]
    try:
        signal = int(text[1:3], 16)
    except ValueError:
        raise ProtocolError(f"malformed stop reply {text[:40]!r}: signal is not hex") from None
    fields: list[tuple[str, str]] = []
    thread = None
    if kind == "T":
        for part in text[3:].split(";"):
            if not part:
                continue
            key, _, value = part.partition(":")
            fields.append((key, value))
            if key == "thread":
                try:
                    thread = normalize_thread(value)
                except ValueError:
                    raise ProtocolError(f"malformed stop reply {text[:40]!r}: bad thread id") from None
    return StopReply(kind, signal, thread, tuple(fields))


_HEX_ID = re.compile(r"[0-9a-fA-F]{1,16}")


def normalize_thread(tid: str) -> str:
    """Canonical form ``p<pid>.<tid>`` in lowercase hex without leading zeros; ValueError for anything else."""
    pid, sep, t = tid[1:].partition(".") if tid.startswith("p") else ("1", ".", tid)
    if not (sep and _HEX_ID.fullmatch(pid) and _HEX_ID.fullmatch(t)):
        raise ValueError(f"bad thread id {tid[:40]!r}")
    return f"p{int(pid, 16):x}.{int(t, 16):x}"


def hex_to_bytes(text: bytes) -> bytes:
    try:
        return bytes.fromhex(text.decode("ascii"))
    except ValueError:
        raise ProtocolError(f"malformed hex data {text[:40]!r}") from None
