"""Connection: a socket carrying RSP, against a peer on a socketpair (no QEMU, no network)."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import cast

import pytest
from vmm_fakes import pkt

from qprobe.errors import GuestTimeout, ProtocolError, TargetError, TargetGone
from qprobe.vmm import connection
from qprobe.vmm.connection import _POLL, Connection


@pytest.fixture
def pair() -> Iterator[tuple[Connection, socket.socket]]:
    ours, peer = socket.socketpair()
    conn = Connection(ours, name="test")
    yield conn, peer
    conn.close()
    peer.close()


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert text and "\n" not in text, text
    return text


# Waits are checked by counting them on a virtual clock, not by timing them: a
# loaded machine stretches wall-clock time but not the number of reads or retries.

MAX_WAITS = 1000  # a loop that never reaches its deadline fails here instead of hanging


class Clock:
    """Stands in for the connection module's ``time``: virtual seconds that pass only when something waits."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []
        self.on_sleep: Callable[[int], None] = lambda n: None  # told how many sleeps there have been

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert len(self.sleeps) < MAX_WAITS, "still retrying long past any deadline"
        self.sleeps.append(seconds)
        self.now += seconds
        self.on_sleep(len(self.sleeps))


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(connection, "time", c)
    return c


class SilentSocket:
    """A peer that never sends: each recv waits out the socket timeout on the clock, then times out."""

    family = socket.AF_UNIX

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.timeout: float | None = None
        self.waits: list[float] = []  # the timeout of each recv, in order

    def settimeout(self, timeout: float | None) -> None:
        self.timeout = timeout

    def recv(self, size: int) -> bytes:
        assert self.timeout is not None and self.timeout > 0, f"a recv that never times out ({self.timeout})"
        assert len(self.waits) < MAX_WAITS, "still reading long past any deadline"
        self.waits.append(self.timeout)
        self.clock.now += self.timeout
        raise TimeoutError

    def close(self) -> None:
        pass


class Alive:
    """An ``alive`` callback that counts its calls and answers True for the first ``lives`` of them."""

    def __init__(self, lives: int) -> None:
        self.lives = lives
        self.calls = 0

    def __call__(self) -> bool:
        self.calls += 1
        return self.calls <= self.lives


def silent(clock: Clock, alive: Callable[[], bool]) -> tuple[Connection, SilentSocket]:
    sock = SilentSocket(clock)
    return Connection(cast(socket.socket, sock), alive=alive, name="silent"), sock


class CountingSocket:
    """A real socket that counts the calls made on it (a socket.socket's own methods cannot be replaced)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.family = sock.family
        self.calls = 0

    def settimeout(self, timeout: float | None) -> None:
        self.calls += 1
        self.sock.settimeout(timeout)

    def recv(self, size: int) -> bytes:
        self.calls += 1
        return self.sock.recv(size)

    def sendall(self, data: bytes) -> None:
        self.calls += 1
        self.sock.sendall(data)

    def close(self) -> None:
        self.sock.close()


# -- receiving ---------------------------------------------------------------------


def test_recv_skips_acks(pair: tuple[Connection, socket.socket]) -> None:
    conn, peer = pair
    peer.sendall(b"+" + pkt(b"OK"))
    assert conn.recv(1.0) == b"OK"


def test_two_packets_in_one_read_are_both_queued(pair: tuple[Connection, socket.socket]) -> None:
    conn, peer = pair
    peer.sendall(b"+" + pkt(b"T02thread:01;") + pkt(b"PacketSize=1000") + b"+" + pkt(b"E14"))
    assert [conn.recv(1.0) for _ in range(3)] == [b"T02thread:01;", b"PacketSize=1000", b"E14"]


def test_packet_split_across_reads(pair: tuple[Connection, socket.socket]) -> None:
    conn, peer = pair
    data = b"+" + pkt(b"T05thread:p01.02;swbreak:;")

    def dribble() -> None:
        for i in range(len(data)):
            peer.sendall(data[i : i + 1])
            time.sleep(0.002)

    t = threading.Thread(target=dribble)
    t.start()
    assert conn.recv(5.0) == b"T05thread:p01.02;swbreak:;"
    t.join()


def test_request_sends_a_framed_packet(pair: tuple[Connection, socket.socket]) -> None:
    conn, peer = pair
    peer.sendall(b"+" + pkt(b"OK"))
    assert conn.request(b"Z0,ffffffff81000000,1", timeout=1.0) == b"OK"
    peer.settimeout(1.0)
    assert peer.recv(100) == pkt(b"Z0,ffffffff81000000,1")


def test_send_escapes(pair: tuple[Connection, socket.socket]) -> None:
    conn, peer = pair
    conn.send(b"X0,1:#")
    peer.settimeout(1.0)
    assert peer.recv(100) == b"$X0,1:}\x03#" + b"%02x" % (sum(b"X0,1:}\x03") & 0xFF)


# -- timeouts and a dead peer ---------------------------------------------------------


def test_recv_timeout_is_guest_timeout(clock: Clock) -> None:
    alive = Alive(lives=MAX_WAITS)
    conn, sock = silent(clock, alive)
    with pytest.raises(GuestTimeout) as info:
        conn.recv(0.3)
    # It waits out the whole timeout, in reads of at most _POLL each, asking after QEMU between them.
    assert sum(sock.waits) == pytest.approx(0.3)
    assert len(sock.waits) == 3 and max(sock.waits) <= _POLL, sock.waits
    assert alive.calls == len(sock.waits)
    assert not isinstance(info.value, TargetGone)
    assert "0.3 s" in one_line(info.value)


def test_poll_returns_none_on_timeout(pair: tuple[Connection, socket.socket]) -> None:
    conn, peer = pair
    assert conn.poll(0.15) is None
    peer.sendall(pkt(b"T05thread:p01.01;"))
    assert conn.poll(1.0) == b"T05thread:p01.01;"


@pytest.mark.parametrize("timeout", [0, 0.0])
def test_poll_with_zero_timeout_returns_none(pair: tuple[Connection, socket.socket], timeout: float) -> None:
    # settimeout(0.0) makes the socket non-blocking: recv raises BlockingIOError
    # (EAGAIN), which is an OSError but not a TimeoutError, so _fill reports
    # the connection lost.  The same happens whenever a _fill starts at or past
    # its deadline, e.g. after a partial packet arrives just before it.
    conn, _peer = pair
    assert conn.poll(timeout) is None


def test_recv_with_zero_timeout_is_guest_timeout(pair: tuple[Connection, socket.socket]) -> None:
    conn, _peer = pair
    with pytest.raises(GuestTimeout):
        conn.recv(0)


def test_zero_timeout_still_returns_a_queued_packet(pair: tuple[Connection, socket.socket]) -> None:
    conn, peer = pair
    peer.sendall(pkt(b"OK") + pkt(b"OK"))
    assert conn.recv(1.0) == b"OK"
    assert conn.poll(0) == b"OK"  # already queued: no read at all


def test_silent_peer_and_dead_qemu_is_target_gone_quickly(clock: Clock) -> None:
    alive = Alive(lives=0)
    conn, sock = silent(clock, alive)
    with pytest.raises(TargetGone) as info:
        conn.recv(10.0)
    # One poll interval, not the 10 s timeout: QEMU is asked after the first read that times out.
    assert sock.waits == [_POLL] and alive.calls == 1
    assert "QEMU exited" in one_line(info.value)


def test_alive_is_polled_while_waiting_forever(clock: Clock) -> None:
    alive = Alive(lives=2)
    conn, sock = silent(clock, alive)
    with pytest.raises(TargetGone, match="QEMU exited"):
        conn.recv(None)
    # Without a timeout it still reads in _POLL steps (SilentSocket refuses a read that would block forever).
    assert sock.waits == [_POLL] * 3 and alive.calls == 3


def test_peer_that_closes_is_target_gone() -> None:
    ours, peer = socket.socketpair()
    sock = CountingSocket(ours)
    conn = Connection(cast(socket.socket, sock), name="test")
    peer.close()
    with pytest.raises(TargetGone, match="closed the connection") as info:
        conn.recv(5.0)
    one_line(info.value)
    # Once gone, it stays gone without touching the socket again, so without waiting for a timeout.
    calls = sock.calls
    with pytest.raises(TargetGone):
        conn.recv(5.0)
    with pytest.raises(TargetGone):
        conn.send(b"?")
    assert sock.calls == calls
    conn.close()


def test_peer_closes_after_a_partial_packet(pair: tuple[Connection, socket.socket]) -> None:
    conn, peer = pair
    peer.sendall(b"+$T05thre")
    peer.close()
    with pytest.raises(TargetGone):
        conn.recv(5.0)


def test_send_to_a_closed_peer_is_target_gone(pair: tuple[Connection, socket.socket]) -> None:
    conn, peer = pair
    peer.close()
    with pytest.raises(TargetGone) as info:
        for _ in range(100):  # the first send may still land in the socket buffer
            conn.send(b"m0,10")
    one_line(info.value)


def test_closed_connection_refuses_everything(pair: tuple[Connection, socket.socket]) -> None:
    conn, _peer = pair
    conn.close()
    conn.close()  # idempotent
    with pytest.raises(TargetGone, match="is closed"):
        conn.send(b"?")
    with pytest.raises(TargetGone, match="is closed"):
        conn.recv(1.0)


# -- protocol errors ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"-", "rejected a packet checksum"),
        (b"%" + pkt(b"Stop:T05thread:p01.01;")[1:], "non-stop notification"),
        (b"$OK#00", "checksum"),
        (b"garbage", "unexpected byte"),
    ],
)
def test_protocol_errors(pair: tuple[Connection, socket.socket], data: bytes, words: str) -> None:
    conn, peer = pair
    peer.sendall(data)
    with pytest.raises(ProtocolError, match=words) as info:
        conn.recv(1.0)
    one_line(info.value)


# -- opening --------------------------------------------------------------------------


@pytest.fixture
def short_dir() -> Iterator[str]:
    # AF_UNIX paths are limited to 108 bytes; pytest's tmp_path can be longer.
    d = tempfile.mkdtemp(prefix="qpc")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("prefix", ["unix:", ""])
def test_open_unix_socket(short_dir: str, prefix: str) -> None:
    path = os.path.join(short_dir, "gdb.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)

    def serve() -> None:
        s, _ = server.accept()
        s.recv(100)
        s.sendall(b"+" + pkt(b"OK"))
        time.sleep(0.2)
        s.close()

    t = threading.Thread(target=serve)
    t.start()
    conn = Connection.open(prefix + path, timeout=2.0)
    try:
        assert conn.name == prefix + path
        assert conn.request(b"?", timeout=2.0) == b"OK"
    finally:
        conn.close()
        t.join()
        server.close()


def test_open_waits_for_the_socket_to_appear(short_dir: str, clock: Clock) -> None:
    path = os.path.join(short_dir, "late.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

    def appear(sleeps: int) -> None:
        if sleeps == 3:  # QEMU creates its socket while we retry
            server.bind(path)
            server.listen(1)

    clock.on_sleep = appear
    conn = Connection.open("unix:" + path, timeout=3.0)
    conn.close()
    server.close()
    assert len(clock.sleeps) == 3  # connected on the first try after the socket appeared


def test_open_missing_socket_with_dead_qemu_is_target_gone(short_dir: str, clock: Clock) -> None:
    alive = Alive(lives=0)
    with pytest.raises(TargetGone, match="cannot connect") as info:
        Connection.open("unix:" + os.path.join(short_dir, "none.sock"), alive=alive, timeout=10.0)
    # One attempt, QEMU found dead, no pause to retry: not the 10 s timeout.
    assert clock.sleeps == [] and alive.calls == 1
    one_line(info.value)


def test_open_missing_socket_times_out(short_dir: str, clock: Clock) -> None:
    with pytest.raises(TargetGone, match="No such file"):
        Connection.open(os.path.join(short_dir, "none.sock"), timeout=0.2)
    # It retried, pausing between attempts, until just past the timeout: not giving up at once, not waiting longer.
    step = clock.sleeps[0]
    assert clock.sleeps == [step] * len(clock.sleeps) and 0 < step <= _POLL
    assert 0.2 < sum(clock.sleeps) <= 0.2 + step + 1e-9, clock.sleeps


@pytest.mark.parametrize("address", ["localhost", "localhost:", "host:port", ":1234"])
def test_open_bad_address(address: str) -> None:
    with pytest.raises(TargetError, match="bad gdbstub address") as info:
        Connection.open(address, timeout=0.5)
    assert not isinstance(info.value, TargetGone)
    one_line(info.value)
