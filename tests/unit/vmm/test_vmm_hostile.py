"""A hostile or broken gdbstub on TCP (hostile_stub.py) never hangs or crashes qprobe: every case ends,
after a bounded number of requests, in one line naming what the stub did wrong."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from hostile_stub import CASES, MAX_REQUESTS, serve

from qprobe import cli
from qprobe.errors import ProtocolError, QprobeError
from qprobe.vmm import gdbremote
from qprobe.vmm.connection import Connection
from qprobe.vmm.gdbremote import GdbRemote
from qprobe.vmm.machine import Machine
from qprobe.vmm.rsp import parse_stop_reply


@pytest.fixture(autouse=True)
def quick_first_reply(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gdbremote, "FIRST_REPLY_TIMEOUT", 2.0)  # not less: a stub thread may start late under load


@dataclass
class Stub:
    port: int
    requests: Callable[[], int]  # how many packets it has answered


@pytest.fixture
def stub(request: pytest.FixtureRequest) -> Iterator[Stub]:
    port, stop, requests = serve(request.param)
    yield Stub(port, requests)
    stop()


@pytest.mark.parametrize("stub", list(CASES), indirect=True)
def test_a_hostile_stub_gets_a_one_line_error_after_bounded_requests(
    stub: Stub, request: pytest.FixtureRequest
) -> None:
    message, stage = CASES[request.node.callspec.params["stub"]]
    gdb = GdbRemote(Connection.open(f"127.0.0.1:{stub.port}"))
    try:
        with pytest.raises(QprobeError, match=message) as e:
            gdb.handshake()
            if stage in ("threads", "read"):
                gdb.threads()
            if stage == "read":
                gdb.read_memory(0x1000, 16)
    finally:
        gdb.conn.close()
    # Bounded in requests rather than seconds: every flood is refused after a fixed number of round trips, and
    # a qprobe that kept asking would meet the stub hanging up at MAX_REQUESTS (the wrong message, above).
    assert 0 < stub.requests() < MAX_REQUESTS, stub.requests()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("stub", ["stop-flood", "xfer-self", "thread-garbage"], indirect=True)
def test_the_cli_says_one_line_for_a_hostile_stub(stub: Stub, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["attach", f"127.0.0.1:{stub.port}", "--vmlinux", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qprobe: error: ") and err.count("\n") == 1, err


def test_a_watchpoint_address_that_is_not_hex_is_a_protocol_error() -> None:
    machine = Machine.__new__(Machine)  # only the dispatch, without a VM
    machine.gdb = SimpleNamespace(read_registers=lambda tid: {"rip": 0})  # type: ignore[assignment]
    machine.watch_handlers = {}
    with pytest.raises(ProtocolError, match="watchpoint hit at 'zz'"):
        machine._dispatch_trap("p1.1", parse_stop_reply(b"T05thread:p01.01;watch:zz;"))
