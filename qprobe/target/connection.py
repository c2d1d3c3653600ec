"""A socket carrying the GDB remote protocol: bytes in, events out.

Timeouts are upper bounds, never the way a reply is recognised.  While
waiting we poll ``alive`` (the QEMU process) every 100 ms, so a dead QEMU is
reported within a fraction of a second instead of at the timeout.
"""

from __future__ import annotations

import collections
import socket
import time
from collections.abc import Callable

from qprobe.errors import GuestTimeout, ProtocolError, TargetError, TargetGone
from qprobe.target.rsp import Nak, Notification, Packet, PacketParser, frame

_POLL = 0.1


class Connection:
    """One stub connection.  Not thread-safe: a single thread owns it."""

    def __init__(self, sock: socket.socket, alive: Callable[[], bool] | None = None, name: str = "") -> None:
        self.sock = sock
        self.name = name
        self._alive = alive or (lambda: True)
        self._parser = PacketParser()
        self._packets: collections.deque[bytes] = collections.deque()
        self._closed = False
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    @classmethod
    def open(cls, address: str, alive: Callable[[], bool] | None = None, timeout: float = 5.0) -> Connection:
        """Connect to ``unix:/path``, ``/path`` or ``host:port``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if address.startswith("unix:") or address.startswith("/"):
                    path = address.removeprefix("unix:")
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    sock.connect(path)
                else:
                    host, _, port = address.rpartition(":")
                    if not host or not port.isdigit():
                        raise TargetError(f"bad gdbstub address {address!r}: expected HOST:PORT or unix:PATH")
                    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
                return cls(sock, alive, address)
            except (ConnectionRefusedError, FileNotFoundError) as exc:
                if time.monotonic() > deadline or (alive is not None and not alive()):
                    raise TargetGone(f"cannot connect to the gdbstub at {address}: {exc.strerror}") from None
                time.sleep(0.05)
            except OSError as exc:
                raise TargetGone(f"cannot connect to the gdbstub at {address}: {exc}") from None

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self.sock.close()
            except OSError:
                pass

    def _gone(self, why: str) -> TargetGone:
        self._closed = True
        return TargetGone(f"lost the gdbstub connection {self.name}: {why}")

    def send_raw(self, data: bytes) -> None:
        if self._closed:
            raise TargetGone(f"the gdbstub connection {self.name} is closed")
        try:
            self.sock.sendall(data)
        except OSError as exc:
            raise self._gone(str(exc)) from None

    def send(self, payload: bytes) -> None:
        self.send_raw(frame(payload))

    def _fill(self, deadline: float | None) -> bool:
        """Read once; False on timeout.  Queues complete packets."""
        wait = _POLL if deadline is None else min(_POLL, deadline - time.monotonic())
        if wait <= 0:
            return False  # settimeout(0) would make the socket non-blocking, not time out
        self.sock.settimeout(wait)
        try:
            data = self.sock.recv(65536)
        except TimeoutError:
            if not self._alive():
                raise self._gone("QEMU exited") from None
            return False
        except OSError as exc:
            raise self._gone(str(exc)) from None
        if not data:
            raise self._gone("QEMU closed the connection")
        for event in self._parser.feed(data):
            if isinstance(event, Packet):
                self._packets.append(event.payload)
            elif isinstance(event, Nak):
                raise ProtocolError("the gdbstub rejected a packet checksum")
            elif isinstance(event, Notification):
                raise ProtocolError("unexpected non-stop notification from the gdbstub")
            # Acks carry no information: QEMU 7.2 acks every packet and never waits for ours.
        return True

    def recv(self, timeout: float | None = 10.0) -> bytes:
        """Next packet payload; raises GuestTimeout after ``timeout`` s (None: forever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._packets:
            if self._closed:
                raise TargetGone(f"the gdbstub connection {self.name} is closed")
            if not self._fill(deadline) and deadline is not None and time.monotonic() >= deadline:
                raise GuestTimeout(f"the gdbstub did not answer within {timeout:g} s")
        return self._packets.popleft()

    def poll(self, timeout: float) -> bytes | None:
        """A packet if one arrives within ``timeout`` s, else None."""
        try:
            return self.recv(timeout)
        except GuestTimeout:
            return None

    def request(self, payload: bytes, timeout: float = 10.0) -> bytes:
        self.send(payload)
        return self.recv(timeout)
