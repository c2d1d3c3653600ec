"""A hostile or broken gdbstub on TCP: QEMU 7.2's behaviour (vmm_fakes.QemuStub) with one thing wrong.

Each case is something a peer could send that must neither hang nor crash
qprobe: endless stop replies, endless thread lists, endless or looping
target descriptions, impossible register descriptions, a packet size too
small to carry a byte, replies of the wrong size, silence.  Run as a script
(``python hostile_stub.py CASE``) it prints its port and serves one client;
the tests use ``serve`` in-process.
"""

from __future__ import annotations

import socket
import sys
import threading
from collections.abc import Callable

from vmm_fakes import CLOSE, QemuStub, pkt

# Far more requests than any case takes to be refused (the thread flood, ~4,100): past it the stub hangs up,
# so a qprobe that keeps asking fails on the wrong message instead of asking forever.
MAX_REQUESTS = 10_000


def _counter() -> Callable[[], int]:
    n = [0]

    def next_value() -> int:
        n[0] += 1
        return n[0]

    return next_value


class HostileStub(QemuStub):
    """QemuStub with the misbehaviour named by ``case``."""

    def __init__(self, case: str, sock: socket.socket, answered: list[int]) -> None:
        self.case = case
        self.answered = answered  # [how many packets]: shared with serve(), which may not hold us yet
        self.tick = _counter()
        supported = {
            "packet-tiny": b"PacketSize=10;qXfer:features:read+;multiprocess+",
            "packet-garbage": b"PacketSize=zz;qXfer:features:read+;multiprocess+",
        }.get(case)
        xml = {
            "xfer-self": '<target><xi:include href="target.xml"/></target>',
            "xfer-cycle": '<target><xi:include href="a.xml"/></target>',
            "xfer-escape": '<target><xi:include href="../../etc/passwd"/></target>',
            "reg-bitsize": '<target><reg name="rip" bitsize="x"/></target>',
            "reg-odd": '<target><reg name="rip" bitsize="12"/></target>',
            "reg-name": '<target><reg name="" bitsize="64"/></target>',
            "reg-flood": "<target>" + "".join(f'<reg name="r{i}" bitsize="64"/>' for i in range(600)) + "</target>",
        }.get(case)
        annexes = {"a.xml": b'<feature><xi:include href="b.xml"/></feature>',
                   "b.xml": b'<feature><xi:include href="a.xml"/></feature>'}  # fmt: skip
        if xml is not None:
            annexes["target.xml"] = xml.encode()
        # The annexes go in before the stub's thread starts serving (it may be asked at once).
        super().__init__(supported=supported, sock=sock, annexes=annexes)

    def _answer(self, p: bytes) -> bytes | object:
        self.answered[0] += 1  # before the reply goes out: the client may count as soon as it has one
        if self.answered[0] > MAX_REQUESTS:
            return CLOSE
        case = self.case
        if case == "silent" and p.startswith(b"qSupported"):
            return b""
        if case == "stop-flood" and p.startswith(b"qSupported"):
            return pkt(b"T02thread:01;") * 1000 + pkt(self.supported)
        if case == "thread-flood" and p == b"qsThreadInfo":
            return pkt(b"mp01.%02x" % (self.tick() + 2))
        if case == "thread-garbage" and p == b"qfThreadInfo":
            return pkt(b"mzz,p1.-1")
        if case == "thread-none" and p == b"qfThreadInfo":
            return pkt(b"l")
        if case == "xfer-flood" and p.startswith(b"qXfer:features:read:"):
            return pkt(b"m" + b" " * 0xF00)
        if case == "xfer-empty" and p.startswith(b"qXfer:features:read:"):
            return pkt(b"m")
        if case == "read-long" and p.startswith(b"m"):
            return pkt(b"00" * 64)
        return super()._answer(p)


# case -> what qprobe must say (a regex), and what it must be doing to meet the case
CASES: dict[str, tuple[str, str]] = {
    "silent": ("did not answer within .* another debugger attached", "handshake"),
    "stop-flood": ("more than 16 stop replies", "handshake"),
    "packet-tiny": ("PacketSize 0x10 is too small", "handshake"),
    "packet-garbage": ("PacketSize b'zz' is not a hex number", "handshake"),
    "xfer-flood": ("target description is too long", "handshake"),
    "xfer-empty": ("empty chunk of target.xml", "handshake"),
    "xfer-self": ("includes target.xml twice", "handshake"),
    "xfer-cycle": ("includes a.xml twice", "handshake"),
    "xfer-escape": ("includes '../../etc/passwd': refused", "handshake"),
    "reg-bitsize": ("register with bitsize='x'", "handshake"),
    "reg-odd": ("register it cannot have", "handshake"),
    "reg-name": ("register it cannot have", "handshake"),
    "reg-flood": ("register it cannot have", "handshake"),
    "thread-flood": ("more than 4096 threads", "threads"),
    "thread-garbage": ("bad thread list entry", "threads"),
    "thread-none": ("lists no threads", "threads"),
    "read-long": ("answered a 16-byte read with 64 bytes", "read"),
}


def serve(case: str) -> tuple[int, Callable[[], None], Callable[[], int]]:
    """Listen on 127.0.0.1 for one client, answered as ``case`` says; returns (port, stop, packets answered)."""
    listener = socket.create_server(("127.0.0.1", 0))
    stubs: list[HostileStub] = []
    answered = [0]

    def accept() -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        stubs.append(HostileStub(case, conn, answered))

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()

    def stop() -> None:
        listener.close()
        thread.join(2.0)
        for stub in stubs:
            stub.close()

    return listener.getsockname()[1], stop, lambda: answered[0]


if __name__ == "__main__":
    port, stop, _ = serve(sys.argv[1])
    print(port, flush=True)
    sys.stdin.read()  # until the caller closes our stdin
    stop()
