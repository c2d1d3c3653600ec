"""A socket carrying the GDB remote protocol: bytes in, events out.

Timeouts are upper bounds, never the way a reply is recognised.  While
waiting we poll ``alive`` (the QEMU process) every 100 ms, so a dead QEMU is
reported within a fraction of a second instead of at the timeout.
"""

from __future__ import annotations

import collections
import fcntl
import os
import re
import select
import socket
import stat
import time
from collections.abc import Callable
from pathlib import Path

from qprobe.errors import GuestTimeout, ProtocolError, TargetError, TargetGone
from qprobe.vmm.rsp import Nak, Notification, Packet, PacketParser, frame

_POLL = 0.1


def parse_address(address: str) -> str | tuple[str, int]:
    """``unix:PATH`` or ``/PATH`` -> the socket path; ``HOST:PORT`` (``[V6]:PORT``) -> (host, port).

    TargetError for anything else: an empty address, a missing path, host or port, a port outside 1..65535.
    """
    if not address.strip():
        raise TargetError("empty gdbstub address: expected unix:PATH or HOST:PORT")
    if address.startswith(("unix:", "/")):
        path = address.removeprefix("unix:")
        if not path:
            raise TargetError(f"bad gdbstub address {address!r}: unix: needs the socket's path")
        return path
    host, _, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not host or not re.fullmatch(r"[0-9]{1,5}", port) or not 1 <= int(port) <= 65535:
        raise TargetError(f"bad gdbstub address {address!r}: expected unix:PATH or HOST:PORT with a port in 1..65535")
    return host, int(port)


def claim(path: str) -> int | None:
    """Take the lock that says a qprobe is attached through the socket ``path``; None where there is none to take.

    QEMU's gdbstub serves one client; a second one waits, unanswered, in its
    listen queue.  In a private run directory of ours (owned by us, 0700) a
    lock file beside the socket lets a second qprobe say so at once.
    """
    parent = Path(path).parent
    try:
        st = parent.stat()
    except OSError:
        return None
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o700:
        return None
    lock = parent / f"{Path(path).name}.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise TargetError(f"another qprobe is attached to {path}: QEMU's gdbstub serves one client at a time, "
                          "end that session first") from None  # fmt: skip
    return fd


class Connection:
    """One stub connection.  Not thread-safe: a single thread owns it."""

    def __init__(self, sock: socket.socket, alive: Callable[[], bool] | None = None, name: str = "") -> None:
        self.sock = sock
        self.name = name
        self._alive = alive or (lambda: True)
        self._parser = PacketParser()
        self._packets: collections.deque[bytes] = collections.deque()
        self._closed = False
        self.lock: int | None = None  # see claim(): released with the connection
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    @classmethod
    def open(cls, address: str, alive: Callable[[], bool] | None = None, timeout: float = 5.0) -> Connection:
        """Connect to ``unix:/path``, ``/path`` or ``host:port``."""
        where = parse_address(address)
        lock = claim(where) if isinstance(where, str) else None
        try:
            conn = cls(cls._connect(address, where, alive, timeout), alive, address)
        except BaseException:
            if lock is not None:
                os.close(lock)
            raise
        conn.lock = lock
        return conn

    @staticmethod
    def _connect(address: str, where: str | tuple[str, int], alive: Callable[[], bool] | None,
                 timeout: float) -> socket.socket:  # fmt: skip
        deadline = time.monotonic() + timeout
        while True:
            try:
                if isinstance(where, str):
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    try:
                        sock.connect(where)
                    except OSError:
                        sock.close()
                        raise
                    return sock
                return socket.create_connection(where, timeout=timeout)
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
        if self.lock is not None:
            os.close(self.lock)
            self.lock = None

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

    def poll(self, timeout: float, wake: int | None = None) -> bytes | None:
        """A packet if one arrives within ``timeout`` s, else None; None at once, too, when the file
        descriptor ``wake`` becomes readable (another thread has work for this one's)."""
        deadline = time.monotonic() + timeout
        while not self._packets:
            if self._closed:
                raise TargetGone(f"the gdbstub connection {self.name} is closed")
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            sock = self.sock.fileno()
            try:
                ready, _, _ = select.select([sock] if wake is None else [sock, wake], [], [], min(_POLL, left))
            except (OSError, ValueError) as exc:  # the socket closed under us
                raise self._gone(str(exc)) from None
            if sock in ready:
                self._fill(deadline)
            elif wake in ready:
                return None
            elif not self._alive():
                raise self._gone("QEMU exited")
        return self._packets.popleft()

    def request(self, payload: bytes, timeout: float = 10.0) -> bytes:
        self.send(payload)
        return self.recv(timeout)
