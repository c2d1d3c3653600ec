"""Connection: a socket carrying RSP, against a peer on a socketpair (no QEMU, no network)."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest
from vmm_fakes import pkt

from qprobe.errors import GuestTimeout, ProtocolError, TargetError, TargetGone
from qprobe.vmm.connection import Connection


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


def test_recv_timeout_is_guest_timeout(pair: tuple[Connection, socket.socket]) -> None:
    conn, _peer = pair
    t0 = time.monotonic()
    with pytest.raises(GuestTimeout) as info:
        conn.recv(0.3)
    elapsed = time.monotonic() - t0
    assert 0.25 <= elapsed < 1.5
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


def test_silent_peer_and_dead_qemu_is_target_gone_quickly() -> None:
    ours, _peer = socket.socketpair()
    conn = Connection(ours, alive=lambda: False, name="dead")
    t0 = time.monotonic()
    with pytest.raises(TargetGone) as info:
        conn.recv(10.0)
    assert time.monotonic() - t0 < 1.0
    assert "QEMU exited" in one_line(info.value)


def test_alive_is_polled_while_waiting_forever() -> None:
    ours, _peer = socket.socketpair()
    dies_at = time.monotonic() + 0.3
    conn = Connection(ours, alive=lambda: time.monotonic() < dies_at)
    t0 = time.monotonic()
    with pytest.raises(TargetGone):
        conn.recv(None)
    assert 0.25 <= time.monotonic() - t0 < 1.3


def test_peer_that_closes_is_target_gone(pair: tuple[Connection, socket.socket]) -> None:
    conn, peer = pair
    peer.close()
    with pytest.raises(TargetGone, match="closed the connection") as info:
        conn.recv(5.0)
    one_line(info.value)
    # Once gone, it stays gone, without waiting for a timeout.
    t0 = time.monotonic()
    with pytest.raises(TargetGone):
        conn.recv(5.0)
    with pytest.raises(TargetGone):
        conn.send(b"?")
    assert time.monotonic() - t0 < 0.5


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


def test_open_waits_for_the_socket_to_appear(short_dir: str) -> None:
    path = os.path.join(short_dir, "late.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

    def late() -> None:
        time.sleep(0.2)
        server.bind(path)
        server.listen(1)

    t = threading.Thread(target=late)
    t.start()
    conn = Connection.open("unix:" + path, timeout=3.0)
    conn.close()
    t.join()
    server.close()


def test_open_missing_socket_with_dead_qemu_is_target_gone(short_dir: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(TargetGone, match="cannot connect") as info:
        Connection.open("unix:" + os.path.join(short_dir, "none.sock"), alive=lambda: False, timeout=10.0)
    assert time.monotonic() - t0 < 1.0
    one_line(info.value)


def test_open_missing_socket_times_out(short_dir: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(TargetGone):
        Connection.open(os.path.join(short_dir, "none.sock"), timeout=0.2)
    assert 0.15 <= time.monotonic() - t0 < 1.5


@pytest.mark.parametrize("address", ["localhost", "localhost:", "host:port", ":1234"])
def test_open_bad_address(address: str) -> None:
    with pytest.raises(TargetError, match="bad gdbstub address") as info:
        Connection.open(address, timeout=0.5)
    assert not isinstance(info.value, TargetGone)
    one_line(info.value)
