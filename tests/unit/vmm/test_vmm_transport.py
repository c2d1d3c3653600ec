"""Both gdbstub clients implement GdbTransport: every method it declares, with the same parameters and defaults.

No type checker runs in ``make test``, so this is what notices a transport
drifting from the interface the stop loop, recovery and set-up are written against.
"""

from __future__ import annotations

import inspect

import pytest
from vmm_fakes import QemuStub

from qprobe.vmm.connection import Connection
from qprobe.vmm.gdbmi import GdbMiRemote
from qprobe.vmm.gdbremote import GdbRemote
from qprobe.vmm.transport import GdbTransport

MEMBERS = sorted(
    name for name, value in vars(GdbTransport).items()
    if not name.startswith("_") and (callable(value) or isinstance(value, property))
)  # fmt: skip


def test_the_interface_is_what_callers_use() -> None:
    assert MEMBERS == [
        "close", "cont", "detach", "handshake", "insert_breakpoint", "interrupt", "poll_stop", "read_memory",
        "read_registers", "remove_breakpoint", "request", "running", "select", "set_physical", "step", "threads",
        "wait_stop", "write_memory", "write_registers",
    ]  # fmt: skip


def _params(fn: object) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]  # type: ignore[arg-type]


@pytest.mark.parametrize("cls", [GdbRemote, GdbMiRemote])
@pytest.mark.parametrize("name", [m for m in MEMBERS if m != "running"])
def test_transport_implements_method(cls: type, name: str) -> None:
    assert _params(getattr(cls, name)) == _params(getattr(GdbTransport, name))


def test_rsp_client_is_a_transport_running_or_not() -> None:
    stub = QemuStub()
    try:
        gdb: GdbTransport = GdbRemote(Connection(stub.client, name="fake"))
        gdb.handshake()
        assert gdb.running is False
        gdb.cont()
        assert gdb.running is True
        gdb.interrupt()
        assert gdb.wait_stop().signal == 2
        assert gdb.running is False
        gdb.close()
        assert not stub.errors, stub.errors
    finally:
        stub.close()
