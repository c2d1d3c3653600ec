"""The doorbell server (qprobe.core.doorbell) on the toy architecture, through a real Unix socket.

Each test rings the doorbell with bytes (CPU numbers) and then hangs up, so
the server's thread has read and answered every byte before the test looks.
A mailbox is the toy's: u64 state, probe id, continue address, sp, r0, r1,
then the answer's final ip and sp.  What the guest writes there is not
trusted: a byte for a CPU with no mailbox, an empty mailbox, a probe nobody
registered, a probe id no detour can have written.
"""

from __future__ import annotations

import logging
import socket
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fakearch import IRQ, SCRATCH_PHYS, STATE_DONE, STATE_REQUEST, Toy, ToyGuestRam, ToyMemory

from qprobe.core.doorbell import Doorbell
from qprobe.core.errorlog import ErrorLog
from qprobe.core.handlers import Handlers
from qprobe.core.kprobe import Kprobe
from qprobe.core.point import Optimized, ProbePoint
from qprobe.core.regs import PtRegs
from qprobe.vmm.journal import Patch

PROBED = 0xFFFF_8000_0000_1010
DETOUR_CONTINUE = 0xFFFF_A000_0000_0400
TRAMPOLINE = 0xFFFF_A000_0000_0800
MAILBOXES = [SCRATCH_PHYS + 0x100, SCRATCH_PHYS + 0x140]
SP = 0xFFFF_C000_0000_8000


class Bell:
    def __init__(self, tmp_path: Path) -> None:
        self.mem = ToyMemory()
        self.drains = 0
        self.errors = ErrorLog(logging.getLogger("test.doorbell"), keep=10)
        self.points: dict[int, ProbePoint] = {}
        self.returns: list[int] = []
        self.resumed: list[int] = []  # the mailbox's state when a trampoline's after-resume ran
        trampolines = {TRAMPOLINE: self._returned}
        self.bell = Doorbell(Toy(), ["p1.1", "p1.2"], self.mem, Handlers(), self.make_regs,  # type: ignore[arg-type]
                             self.points.get, trampolines, self.errors, self._drain)  # fmt: skip
        self.path = str(tmp_path / "doorbell")
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(self.path)
        self.server.listen(1)

    def make_regs(self, values: dict[str, int], tid: str) -> PtRegs:
        return PtRegs(dict(values), tid, 0, self.mem, layout=Toy.registers)  # type: ignore[arg-type]

    def _drain(self) -> None:
        self.drains += 1

    def _returned(self, pt: PtRegs) -> tuple[int, Callable[[], None]]:
        self.returns.append(pt.sp)
        pt.r0 = 0x77  # a handler injecting a return value
        return 0xFFFF_8000_0000_9000, lambda: self.resumed.append(self.mailbox(0)[0])

    def probe(self, probe_id: int, *kps: Kprobe) -> None:
        jmp = Patch(0, PROBED, b"\x01\0\0\0", b"\x05\0\0\0", "jmp")
        point = ProbePoint(PROBED, "toy_fn+0x10", None, list(kps))  # type: ignore[arg-type]
        point.opt = Optimized(probe_id, 0xFFFF_A000_0000_0300, 8, jmp, DETOUR_CONTINUE)
        self.points[probe_id] = point

    def request(self, cpu: int, probe_id: int, cont: int = DETOUR_CONTINUE, r0: int = 0, r1: int = 0) -> None:
        self.mem.write_phys(MAILBOXES[cpu], struct.pack("<8Q", STATE_REQUEST, probe_id, cont, SP, r0, r1, 0, 0))

    def mailbox(self, cpu: int) -> tuple[int, ...]:
        return struct.unpack("<8Q", self.mem.read_phys(MAILBOXES[cpu], 64))

    def ring(self, data: bytes) -> None:
        """Ring with ``data`` and hang up; returns once the server has answered all of it."""
        self.bell.start(self.path, MAILBOXES)
        conn, _ = self.server.accept()
        conn.sendall(data)
        conn.close()
        assert self.bell._thread is not None
        self.bell._thread.join(10.0)
        assert not self.bell._thread.is_alive()

    def close(self) -> None:
        self.bell.close()
        self.server.close()


@pytest.fixture
def bell(tmp_path: Path) -> Iterator[Bell]:
    b = Bell(tmp_path)
    yield b
    b.close()


def test_a_request_runs_the_probes_pre_handlers_and_releases_the_vcpu_with_their_changes(bell: Bell) -> None:
    seen: list[tuple[int, int, int, str]] = []

    def pre(kp: Kprobe, regs: Any) -> None:
        seen.append((regs.ip, regs.sp, regs.r0, regs.tid))
        regs.r1 = 0x55

    kps = [Kprobe(addr=PROBED, pre_handler=pre), Kprobe(addr=PROBED)]
    bell.probe(3, *kps)
    bell.request(1, 3, r0=9)
    bell.ring(b"\x01")
    assert seen == [(PROBED, SP, 9, "p1.2")]
    assert [kp.nhit for kp in kps] == [1, 1]
    assert bell.mailbox(1) == (STATE_DONE, 3, DETOUR_CONTINUE, SP, 9, 0x55, DETOUR_CONTINUE, SP)
    assert bell.mailbox(0)[0] == 0  # the other CPU's mailbox is untouched
    assert (bell.bell.served, len(bell.errors)) == (1, 0)


def test_a_pre_handler_that_moves_ip_sends_the_vcpu_there(bell: Bell) -> None:
    def skip(kp: Kprobe, regs: Any) -> int:
        regs.ip = PROBED + 8
        return 1

    bell.probe(4, Kprobe(addr=PROBED, pre_handler=skip))
    bell.request(0, 4)
    bell.ring(b"\x00")
    assert bell.mailbox(0)[0] == STATE_DONE
    assert bell.mailbox(0)[6:] == (PROBED + 8, SP)


def test_a_kretprobe_return_through_the_mailbox_goes_to_the_real_return_address(bell: Bell) -> None:
    bell.request(0, ToyGuestRam.trampoline_id, cont=TRAMPOLINE)
    bell.ring(b"\x00")
    assert bell.returns == [SP] and bell.resumed == [STATE_DONE]  # only once the vCPU is released
    assert bell.mailbox(0) == (STATE_DONE, 0, TRAMPOLINE, SP, 0x77, 0, 0xFFFF_8000_0000_9000, SP)


def test_hostile_doorbells_are_bounded_and_every_waiting_vcpu_is_released(bell: Bell) -> None:
    bell.probe(3, Kprobe(addr=PROBED, pre_handler=lambda kp, regs: pytest.fail("ran for a bad request")))
    bell.request(0, 0x1_0000_0000)  # a probe id no detour writes: refused by the arch's parser
    bell.request(1, 999)  # a probe nobody registered (or unoptimized since): released as if unprobed
    flood = bytes(range(2, 255)) * 40 + b"\x00" * 5000 + b"\xff" * 3 + b"\x01"
    bell.ring(flood)
    assert bell.drains == 3  # the drain byte asks the collector to drain, nothing more
    assert bell.mailbox(0)[0] == STATE_REQUEST  # never answered: what it says cannot be trusted
    assert bell.mailbox(1) == (STATE_DONE, 999, DETOUR_CONTINUE, SP, 0, 0, DETOUR_CONTINUE, SP)
    assert bell.bell.served == 1
    # Every refusal counted, a bounded number kept, each one line.
    assert bell.errors.count == 5000
    assert len(bell.errors) == 10
    assert all("\n" not in line and line.startswith("doorbell for CPU 0: ProtocolError") for line in bell.errors)


def test_an_empty_mailbox_is_not_answered(bell: Bell) -> None:
    bell.probe(3, Kprobe(addr=PROBED, pre_handler=lambda kp, regs: pytest.fail("ran with no request")))
    bell.ring(b"\x00\x01" * 100)
    assert bell.mailbox(0) == bell.mailbox(1) == (0,) * 8
    assert (bell.bell.served, len(bell.errors)) == (0, 0)


def test_the_regs_a_handler_sees_are_the_mailboxes(bell: Bell) -> None:
    got: list[dict[str, int]] = []
    bell.probe(5, Kprobe(addr=PROBED, pre_handler=lambda kp, regs: got.append(regs.as_dict())))
    bell.request(0, 5, r0=1, r1=2)
    bell.ring(b"\x00")
    assert got == [{"ip": PROBED, "sp": SP, "flags": IRQ, "r0": 1, "r1": 2}]
